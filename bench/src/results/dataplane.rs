//! `dataplane-bench`'s results: leaf to leaf (`bench/results/dataplane.json`: RTT induced and
//! through the hub, tunnel throughput, the side by side with wireguard-go) and the node path
//! (`bench/results/dataplane-nodes.json`).

use serde::{Deserialize, Serialize};

use super::{Machine, RunInfo, Store};

/// How link latency is emulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Emulation {
    /// `tc netem` on the gateways' uplinks, per destination.
    Netem,
    /// Userspace UDP delay relays (the kernel has no netem).
    UdpRelay,
}

impl Emulation {
    /// The name the result files use.
    pub fn as_str(self) -> &'static str {
        match self {
            Emulation::Netem => "netem",
            Emulation::UdpRelay => "udp_relay",
        }
    }
}

/// Round-trip times of one path.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Rtt {
    pub samples: usize,
    pub lost: u32,
    pub min_ms: f64,
    pub median_ms: f64,
    pub p90_ms: f64,
    pub max_ms: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Throughput {
    /// iperf3 TCP, one stream, receiver side.
    pub tunnel_mbit_s: f64,
    pub bare_veth_mbit_s: f64,
    pub tunnel_fraction_of_bare: f64,
    /// Issue 9's target: userspace tunnel throughput at least 30 % of the bare veth path.
    pub target_fraction: f64,
    pub target_met: bool,
    pub seconds: u32,
}

/// One iperf3 run: what arrived, and the CPU time the tunnel processes spent meanwhile.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Transfer {
    /// Received, Mbit/s (all streams).
    pub mbit_s: f64,
    /// iperf3 payload received, bytes.
    pub bytes: u64,
    /// utime + stime of the tunnel processes at both ends during the client's run.
    pub cpu_seconds: f64,
    /// `cpu_seconds` per 10^9 bytes of payload; none when nothing arrived.
    pub cpu_seconds_per_gb: Option<f64>,
}

/// One tunnel's iperf3 runs at one stream count; none for no runs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Side {
    pub runs: Vec<Transfer>,
    pub median_mbit_s: Option<f64>,
    pub min_mbit_s: Option<f64>,
    pub max_mbit_s: Option<f64>,
    pub median_cpu_seconds_per_gb: Option<f64>,
    pub min_cpu_seconds_per_gb: Option<f64>,
    pub max_cpu_seconds_per_gb: Option<f64>,
}

/// Trellis against wireguard-go at one stream count.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Comparison {
    pub streams: u32,
    pub trellis: Side,
    pub wireguard_go: Side,
    /// Absent where GotaTun was not measured.
    pub gotatun: Option<Side>,
    /// Trellis median / wireguard-go median (above 1: Trellis moves more).
    pub ratio_mbit_s: Option<f64>,
    /// Trellis median / wireguard-go median (below 1: Trellis spends less CPU per GB).
    pub ratio_cpu_seconds_per_gb: Option<f64>,
}

/// A tunnel's RTT against its underlay's, pod to pod through the tunnel and gateway to gateway
/// on the bridge, pinged alternately in the same run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RttOverhead {
    pub tunnel: Rtt,
    pub bare: Rtt,
    /// Median tunnel RTT minus median bare RTT.
    pub overhead_ms: f64,
}

/// Request/response over one path at one connection count (sockperf ping-pong, 64-byte
/// TCP messages), pooled over the rounds; none where nothing was measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RequestResponse {
    /// Transactions per second of each run, all connections together, in run order.
    pub runs_per_s: Vec<f64>,
    pub median_per_s: Option<f64>,
    /// Round trips measured, every transaction of every run.
    pub samples: usize,
    /// Round-trip time percentiles over every transaction, microseconds.
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
}

/// A tunnel's request/response, pod to pod through it, and its underlay's, gateway to gateway.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RrPath {
    pub tunnel: RequestResponse,
    pub underlay: RequestResponse,
}

/// Trellis against wireguard-go at one connection count, request/response.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RrComparison {
    pub connections: u32,
    pub trellis: RrPath,
    pub wireguard_go: RrPath,
    pub gotatun: Option<RrPath>,
}

/// Trellis's tunnel and wireguard-go's, measured in turns in one run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct SideBySide {
    /// `wireguard-go --version`'s first line.
    pub reference: String,
    /// Rounds of measurements; each round measures both tunnels (which one first alternates).
    pub rounds: u32,
    pub iperf_seconds: u32,
    pub throughput: Vec<Comparison>,
    /// Absent in results from before the RTT was part of the comparison.
    pub rtt_trellis: Option<RttOverhead>,
    pub rtt_wireguard_go: Option<RttOverhead>,
    /// `gotatun-cli --version`'s first line and its RTT; absent where GotaTun was not measured.
    pub gotatun_reference: Option<String>,
    pub rtt_gotatun: Option<RttOverhead>,
    /// Seconds per request/response run; 0 (and no comparisons) in results from before it.
    pub rr_seconds: u32,
    pub request_response: Vec<RrComparison>,
}

impl SideBySide {
    pub fn at(&self, streams: u32) -> Option<&Comparison> {
        self.throughput.iter().find(|c| c.streams == streams)
    }

    pub fn rr_at(&self, connections: u32) -> Option<&RrComparison> {
        self.request_response
            .iter()
            .find(|c| c.connections == connections)
    }
}

/// The kernel's CPU latency limit (`/dev/cpu_dma_latency`) a run had: how long an idle CPU
/// may take to wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuLatencyLimit {
    /// None (the kernel's default): an idle CPU takes the deepest idle state it likes; a vCPU
    /// halts.
    None,
    /// At most this many microseconds.
    Microseconds(u32),
}

/// Leaf to leaf. Every option is set by the writer; they are options because results from
/// before a measurement existed lack it, and the report says so rather than showing zeros.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DataplaneResult {
    #[serde(default)]
    pub benchmark: String,
    #[serde(default)]
    pub run: Option<RunInfo>,
    #[serde(default)]
    pub machine: Option<Machine>,
    /// Pings per RTT measurement and seconds per iperf3 run.
    #[serde(default)]
    pub samples: Option<u32>,
    #[serde(default)]
    pub iperf_seconds: Option<u32>,
    #[serde(default)]
    pub wireguard: String,
    #[serde(default)]
    pub build: String,
    /// The gateways' busy-polling window in microseconds (0: none); `None` in results from
    /// before it was recorded (the run's note says what the gateways were given).
    #[serde(default)]
    pub busy_poll_us: Option<u64>,
    /// The share of the time, in percent, each polling thread could poll; `None` in results
    /// from before the budget existed (polling, where on, was not capped).
    #[serde(default)]
    pub busy_poll_budget_percent: Option<u8>,
    /// Whether the gateways offered the stateless wire convention (ADR 0032, 0034); false in
    /// results from before it existed, when every tunnel used the double NAT.
    #[serde(default)]
    pub stateless_wire: bool,
    /// The kernel's CPU latency limit during the run; `None` in results from before it was
    /// recorded.
    #[serde(default)]
    pub cpu_latency_limit: Option<CpuLatencyLimit>,
    pub store: Store,
    /// How the link delays were added.
    pub emulation: Emulation,
    /// With `udp_relay`: the induced path through relays adding 0 ms (the relays' own cost).
    #[serde(default)]
    pub rtt_through_zero_delay_relay: Option<Rtt>,
    #[serde(default)]
    pub hub_link_rtt_ms: u64,
    #[serde(default)]
    pub leaf_link_rtt_ms: u64,
    /// Without netem: pod to pod through the A–C tunnel, and gateway to gateway on the bridge.
    #[serde(default)]
    pub rtt_no_netem_tunnel: Option<Rtt>,
    #[serde(default)]
    pub rtt_no_netem_bare: Option<Rtt>,
    #[serde(default)]
    pub throughput: Option<Throughput>,
    /// With the link delays: A's pod to C's pod at the address B reflected to A.
    #[serde(default)]
    pub rtt_induced: Option<Rtt>,
    #[serde(default)]
    pub rtt_hub_path: Option<Rtt>,
    /// hub path median / induced median.
    #[serde(default)]
    pub ratio_hub_over_induced: Option<f64>,
    /// The published reference measurement of induced peering with the same link delays:
    /// 24 ms induced, 365 ms through the hub.
    #[serde(default)]
    pub thesis_induced_ms: Option<f64>,
    #[serde(default)]
    pub thesis_hub_ms: Option<f64>,
    /// How long the control plane took to make each path usable (services started to first
    /// answered ping), informative.
    #[serde(default)]
    pub induced_ready_seconds: Option<f64>,
    #[serde(default)]
    pub hub_ready_seconds: Option<f64>,
    /// Trellis's A–C tunnel against wireguard-go in the same run: throughput at 1 and 4
    /// streams, CPU per GB, RTT overhead over the underlay.
    #[serde(default)]
    pub side_by_side: Option<SideBySide>,
}

/// The node path: pods on non-gateway nodes against pods on the gateway nodes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodePathResult {
    #[serde(default)]
    pub benchmark: String,
    #[serde(default)]
    pub run: Option<RunInfo>,
    #[serde(default)]
    pub machine: Option<Machine>,
    #[serde(default)]
    pub samples: Option<u32>,
    #[serde(default)]
    pub iperf_seconds: Option<u32>,
    #[serde(default)]
    pub wireguard: String,
    #[serde(default)]
    pub build: String,
    /// The gateways' busy-polling window in microseconds (0: none); `None` in results from
    /// before it was recorded (the run's note says what the gateways were given).
    #[serde(default)]
    pub busy_poll_us: Option<u64>,
    /// The share of the time, in percent, each polling thread could poll; `None` in results
    /// from before the budget existed (polling, where on, was not capped).
    #[serde(default)]
    pub busy_poll_budget_percent: Option<u8>,
    /// Whether the gateways offered the stateless wire convention (ADR 0032, 0034); false in
    /// results from before it existed, when every tunnel used the double NAT.
    #[serde(default)]
    pub stateless_wire: bool,
    /// The kernel's CPU latency limit during the run; `None` in results from before it was
    /// recorded.
    #[serde(default)]
    pub cpu_latency_limit: Option<CpuLatencyLimit>,
    pub store: Store,
    #[serde(default)]
    pub nodes_per_cluster: Option<usize>,
    /// A's pod on its gateway node to C's pod on its gateway node (the tunnel only).
    #[serde(default)]
    pub rtt_gateway_nodes: Option<Rtt>,
    /// A's pod on node 1 to C's pod on node 2 (VXLAN, tunnel, node network).
    #[serde(default)]
    pub rtt_non_gateway_nodes: Option<Rtt>,
    /// iperf3 TCP, one stream, Mbit/s; runs alternate between the two paths.
    #[serde(default)]
    pub mbit_s_gateway_nodes: Vec<f64>,
    #[serde(default)]
    pub mbit_s_non_gateway_nodes: Vec<f64>,
    /// Non-gateway over gateway: median RTT, and mean throughput.
    #[serde(default)]
    pub rtt_ratio: Option<f64>,
    #[serde(default)]
    pub throughput_ratio: Option<f64>,
}
