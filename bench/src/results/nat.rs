//! `nat-bench`'s result (`bench/results/nat.json`): per cell of the NAT grid (an unordered pair
//! of NAT kinds) the time from an induced peering reaching a leaf to the first pod-to-pod packet
//! between the two leaves, the path the cell ends on, and the RTT and throughput of a direct and
//! a relayed leaf pair next to the leaf-to-hub path, all measured in the same fabrics.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Machine, RunInfo, Transfer};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NatResult {
    #[serde(default)]
    pub benchmark: String,
    #[serde(default)]
    pub run: Option<RunInfo>,
    #[serde(default)]
    pub machine: Option<Machine>,
    pub parameters: NatParameters,
    /// One per grid cell, in the order of the NAT kinds (none, one-to-one, easy, hard).
    pub cells: Vec<NatCell>,
    /// RTT and throughput per measured path, over every repeat.
    pub paths: Vec<PathSummary>,
    /// Each fresh fabric, with every pair's timing.
    pub repeats: Vec<NatRepeat>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NatParameters {
    /// Leaves behind each NAT kind (the hub has none).
    pub leaves_per_kind: usize,
    /// Fresh fabrics.
    pub repeats: usize,
    /// The probes' interval until a pair's first reply, in milliseconds.
    pub probe_interval_ms: f64,
    /// How long a repeat waits for every pair's first reply after the peering starts, seconds.
    pub probe_timeout_s: u64,
    /// Pings per RTT measurement, and their interval in milliseconds.
    pub pings: u32,
    pub ping_interval_ms: f64,
    /// Seconds of each iperf3 run (TCP, one stream).
    pub iperf_seconds: u32,
    /// How the services were built (`debug` or `release`).
    pub build: String,
    /// Where the services keep their state.
    pub store: String,
}

/// One cell of the grid: every leaf pair whose NAT kinds are `a_kind` and `c_kind` (unordered).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NatCell {
    pub a_kind: String,
    pub c_kind: String,
    /// Pairs timed, over all repeats.
    pub samples: usize,
    /// Of those, pairs whose probes never got through within the timeout (not in the figures).
    pub unreached: usize,
    /// First pod-to-pod packet minus the peering reaching the first of the two leaves (t1 - t0),
    /// nearest-rank percentiles over the pairs that got through, in milliseconds; `None` when
    /// none did.
    pub first_packet_ms: Option<Percentiles>,
    /// The same up to the first echo answered (a round trip), in milliseconds.
    pub first_echo_ms: Option<Percentiles>,
    /// The path the cell ends on: `direct` or `relayed` when every pair ended on it, `mixed`
    /// otherwise; with the count of each pair path in `paths`.
    pub path: String,
    pub paths: BTreeMap<String, usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub max: f64,
}

/// One fresh fabric.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NatRepeat {
    pub repeat: usize,
    /// Building the namespaces and starting every cluster, before any peering.
    pub setup_seconds: f64,
    /// From the first `Peer` call until every broker holds the whole mesh of TunnelEndpoints.
    pub mesh_seconds: f64,
    /// From the first `Peer` call until the last pair's first packet (or the timeout).
    pub grid_seconds: f64,
    /// Each leaf's peering with the hub.
    #[serde(default)]
    pub leaves: Vec<LeafTimes>,
    /// Handshake initiations the hub's gateway dropped for coming from a key it had no peer
    /// for yet (a leaf that handshakes before the hub applied its TunnelEndpoint), read after
    /// the grid; `None` when its metrics could not be read.
    #[serde(default)]
    pub hub_unknown_peer_drops: Option<f64>,
    /// Every gateway's dropped datagrams at its WireGuard port by reason, read after the grid
    /// (before the path measurements), by cluster; only the reasons with any.
    #[serde(default)]
    pub gateway_drops: BTreeMap<String, BTreeMap<String, f64>>,
    /// Leaf pairs (unordered), each timed once.
    pub pairs: Vec<PairSample>,
    /// The RTT and throughput measurements of this fabric.
    pub paths: Vec<PathMeasure>,
}

/// One leaf's full peering with the hub, in milliseconds since the first `Peer` call of the
/// repeat: a leaf behind a NAT is seen by the hub (and can be given to the other leaves as a
/// candidate) only once it completed a handshake with the hub.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LeafTimes {
    pub name: String,
    pub kind: String,
    /// When its `Peer` call with the hub returned (the leaves are peered one after another).
    pub peered_at_ms: Option<f64>,
    /// When the hub's gateway completed its handshake with it (the hub's TunnelStatus, read
    /// after the grid; the first handshake, since no rekey is due that soon).
    pub hub_handshake_at_ms: Option<f64>,
}

/// One unordered leaf pair in one fabric. Times are milliseconds since the first `Peer` call of
/// the repeat (`*_at_ms`) or differences (`*_ms`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PairSample {
    pub a: String,
    pub c: String,
    pub a_kind: String,
    pub c_kind: String,
    /// When `a`'s broker wrote its induced TunnelEndpoint for `c` (as the benchmark's watch saw
    /// it), and `c`'s for `a`.
    pub a_tunnel_at_ms: Option<f64>,
    pub c_tunnel_at_ms: Option<f64>,
    /// When each of those TunnelEndpoints first carried candidates (where the hub sees the
    /// remote; only a remote behind a NAT gets any), as the watch saw them.
    #[serde(default)]
    pub a_candidates_at_ms: Option<f64>,
    #[serde(default)]
    pub c_candidates_at_ms: Option<f64>,
    /// The first pod-to-pod probe to arrive, in either direction (the receiver's clock).
    pub first_packet_at_ms: Option<f64>,
    /// Which way it went: `a>c` or `c>a`.
    pub first_direction: Option<String>,
    /// The first reply back at a prober, in either direction.
    pub first_echo_at_ms: Option<f64>,
    /// t1 - t0: the first packet after the earlier of the two TunnelEndpoints.
    pub first_packet_ms: Option<f64>,
    pub first_echo_ms: Option<f64>,
    /// Probes sent after the pair's first reply, at the slow rate, and how many went unanswered
    /// (both directions; the last second before the probes stopped is not counted).
    pub sent_after_first: u64,
    pub lost_after_first: u64,
    /// The longest gap between replies after the first, in either direction, in milliseconds.
    pub max_gap_after_first_ms: f64,
    /// `direct`, `relayed`, `none` (no handshake) or `mixed (a's/c's)` when the two gateways
    /// disagree (either may also be `unanswered`: no answer within 2 s), as the gateways'
    /// GetTunnelStatus said once the probes had stopped.
    pub path: String,
}

/// RTT and throughput of one path in one fabric.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PathMeasure {
    /// `direct`, `relayed` or `hub` (a leaf to the hub, a full peering).
    pub name: String,
    pub from: String,
    pub to: String,
    pub from_kind: String,
    pub to_kind: String,
    /// What the two gateways said of the tunnel's path after the measurement.
    pub path_seen: String,
    /// Ping round-trip times in milliseconds, in the order they were answered.
    pub rtts_ms: Vec<f64>,
    pub pings_sent: u32,
    /// iperf3 TCP, one stream, pod to pod; the CPU is that of the two leaves' gateways and the
    /// hub's.
    pub transfer: Option<Transfer>,
    /// Why there is no transfer, when iperf3 failed.
    #[serde(default)]
    pub transfer_error: Option<String>,
    /// What the hub's gateway dropped during this path's pings and iperf3 run, by reason (e.g.
    /// `relay_rate_limited`: relayed datagrams over the pair's `--relay-rate`); only the reasons
    /// with any.
    #[serde(default)]
    pub hub_drops: BTreeMap<String, f64>,
}

/// One path over every repeat.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PathSummary {
    pub name: String,
    pub from_kind: String,
    pub to_kind: String,
    /// The paths the gateways reported, with how many repeats saw each.
    pub paths_seen: BTreeMap<String, usize>,
    pub pings_sent: u32,
    pub pings_answered: usize,
    /// Nearest-rank percentiles of every answered ping of every repeat; `None` when none was.
    pub rtt_p50_ms: Option<f64>,
    pub rtt_p99_ms: Option<f64>,
    /// Each repeat's iperf3 throughput, Mbit/s, and their median.
    pub mbit_s: Vec<f64>,
    pub median_mbit_s: Option<f64>,
    /// Median over the repeats of the CPU seconds per 10^9 bytes (three gateways).
    pub median_cpu_seconds_per_gb: Option<f64>,
    /// The hub's drops during this path's measurements, summed over the repeats, by reason.
    #[serde(default)]
    pub hub_drops: BTreeMap<String, f64>,
}
