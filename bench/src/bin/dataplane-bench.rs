//! Data-plane benchmark (issue 6): leaf↔leaf round-trip time with induced peering and through
//! the hub, under link delays, and the throughput of one tunnel against the same veth path
//! without a tunnel; with `--scenario node-path` (issue 14), pod to pod between non-gateway
//! nodes against pod to pod on the gateway nodes. **Root only** (network namespaces, tc,
//! nftables).
//!
//! Topology ([`trellis_netlab::Fabric`]): hub B and leaves A and C, all with pod CIDR
//! 10.0.0.0/16, each a gateway namespace (the six real service binaries, userspace WireGuard)
//! plus a pod namespace, the gateways on one bridge. Latency per link is `tc netem` on each
//! gateway's uplink, selected by the peer gateway's address (see [`trellis_netlab::netem`]):
//! half of a link's delay in each direction, so a round trip across a link adds the link's
//! delay: 180 ms per hub link (A–B, C–B) and 20 ms on the leaf link (A–C) by default. The induced path A→C→A crosses the leaf link once each way (expected ≈ 20 ms); the
//! hub path A→B→C→B→A crosses both hub links (expected ≈ 360 ms).
//!
//! Scenarios:
//! - **induced**: induced peering on; B's endpoints service reflects C's pod to A (induced path),
//!   A's pod pings that address. Before netem is applied: the RTT and iperf3 TCP throughput
//!   through the A–C tunnel (pod to pod) and over the bare path the tunnel's UDP packets take
//!   (A's gateway to C's gateway: veth, bridge, veth). Side by side with the reference, Debian's
//!   `wireguard-go` between two more gateway namespaces of the same topology
//!   ([`trellis_bench::reference`]), alternating in rounds: iperf3 at 1 and 4 TCP streams,
//!   CPU seconds of the tunnel processes (both ends) per GB of payload, RTT overhead (tunnel
//!   RTT minus the underlay's, pinged in the same round), and request/response (sockperf
//!   ping-pong, 64-byte TCP messages, 1 and 4 connections: transactions per second and
//!   p50/p99/p99.9 round trips) through each tunnel and on its underlay.
//! - **hub**: B's discovery with `--no-induced`: A and C only peer with B; B reflects C's pod to
//!   A through B's external CIDR (hub-path DNAT at B); A's pod pings that address.
//!
//! Stores are `memory://` by default (`--store etcd` for one etcd per service): the data plane
//! does not touch them, and 18 etcds would only add noise on 2 cores. Builds on the release
//! binaries: `make bench-dataplane` builds them first.

use std::path::PathBuf;

use anyhow::bail;
use clap::{Parser, ValueEnum};
use trellis_bench::dataplane::{self, Settings, leaf_to_leaf, node_path};
use trellis_bench::results::{Emulation, Store};
use trellis_bench::{RunArgs, RunInfo, write_json};
use trellis_netlab::netem;

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// Leaf-to-leaf RTT, induced vs through the hub, and one tunnel's throughput.
    LeafToLeaf,
    /// The node path: pod to pod between non-gateway nodes (VXLAN to the gateway node, then the
    /// tunnel) against pod to pod on the gateway nodes, in the same clusters and run.
    NodePath,
}

/// Measures leaf-to-leaf RTT (induced vs hub path, under netem) and tunnel throughput, or the
/// node path's cost, and writes a JSON result.
#[derive(Debug, Parser)]
struct Args {
    /// What to measure (`node-path` writes its own result file; set `--out`).
    #[arg(long, value_enum, default_value_t = Scenario::LeafToLeaf)]
    scenario: Scenario,
    /// Pings per RTT measurement.
    #[arg(long, default_value_t = 20)]
    samples: u32,
    /// Round-trip delay added by each hub link (A–B, C–B), in milliseconds.
    #[arg(long, default_value_t = 180)]
    hub_link_ms: u64,
    /// Round-trip delay added by the leaf link (A–C), in milliseconds.
    #[arg(long, default_value_t = 20)]
    leaf_link_ms: u64,
    /// Rounds of the side-by-side comparison with wireguard-go (each: RTT, request/response at 1
    /// and 4 connections, then iperf3 at 1 and 4 streams, through both tunnels in turns);
    /// medians and spread over the rounds.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Duration of each iperf3 run, in seconds.
    #[arg(long, default_value_t = 10)]
    iperf_seconds: u32,
    /// Duration of each request/response run (sockperf ping-pong), in seconds; sockperf leaves
    /// its first 400 ms (warm-up) out.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    rr_seconds: u32,
    /// Where the services keep their state.
    #[arg(long, value_enum, default_value_t = Store::Memory)]
    store: Store,
    /// The gateways' `--busy-poll-us` (500, the gateway's default; 0 polls not at all). Passed as
    /// a flag, so that a `TRELLIS_BUSY_POLL_US` left in the environment cannot change the
    /// numbers unrecorded; the result records it.
    #[arg(
        long,
        default_value_t = trellis_gateway::config::DEFAULT_BUSY_POLL_US,
        value_parser = clap::value_parser!(u64).range(0..=10_000)
    )]
    busy_poll_us: u64,
    /// The gateways' `--busy-poll-budget-percent` (1, the gateway's default; 100 polls without
    /// a cap). Passed and recorded like `--busy-poll-us`.
    #[arg(
        long,
        default_value_t = trellis_gateway::dataplane::engine::BUSY_POLL_BUDGET_PERCENT,
        value_parser = clap::value_parser!(u8).range(0..=100)
    )]
    busy_poll_budget_percent: u8,
    /// The gateways' `--no-stateless-wire`: every tunnel keeps the kernels' double NAT
    /// (ADR 0008) instead of the default stateless wire convention, where each engine
    /// translates what it sends and the kernels leave the tunnels' traffic untracked
    /// (ADR 0032, 0034). Recorded in the result.
    #[arg(long)]
    no_stateless_wire: bool,
    /// Holds the kernel's CPU latency limit (`/dev/cpu_dma_latency`) at this many microseconds
    /// for the run, as a low-latency node tuning does; 0 keeps idle CPUs polling instead of
    /// halting, which makes waking a thread on an idle vCPU cheap and keeps every core busy
    /// while idle. Without it the machine's own limit stands. The result records the limit in
    /// force either way (ADR 0032).
    #[arg(long, value_name = "MICROSECONDS")]
    cpu_latency_us: Option<u32>,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/dataplane.json")]
    out: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = RunInfo::start(&args.run);
    // Held until the process ends: the kernel drops the request when the file closes.
    let _cpu_latency = args
        .cpu_latency_us
        .map(dataplane::cpu_latency::hold)
        .transpose()?;
    let settings = Settings {
        samples: args.samples,
        hub_link_ms: args.hub_link_ms,
        leaf_link_ms: args.leaf_link_ms,
        rounds: args.rounds,
        iperf_seconds: args.iperf_seconds,
        rr_seconds: args.rr_seconds,
        store: args.store,
        busy_poll_us: args.busy_poll_us,
        busy_poll_budget_percent: args.busy_poll_budget_percent,
        stateless_wire: !args.no_stateless_wire,
        cpu_latency_limit: dataplane::cpu_latency::limit(),
    };
    if args.scenario == Scenario::NodePath {
        let missing = trellis_netlab::missing_prerequisites(&["ip", "nft", "ping", "iperf3"]);
        if !missing.is_empty() {
            bail!(
                "dataplane-bench --scenario node-path builds network namespaces and needs {}; \
                 run it as root after `make setup`",
                missing.join(", ")
            );
        }
        let report = node_path(&settings, run).await?;
        write_json(&args.out, &report)?;
        eprintln!(
            "node path: RTT x{:.2}, throughput x{:.2} against the gateway nodes; wrote {}",
            report.rtt_ratio.unwrap_or(f64::NAN),
            report.throughput_ratio.unwrap_or(f64::NAN),
            args.out.display()
        );
        return Ok(());
    }
    let mut tools = vec![
        "ip",
        "tc",
        "nft",
        "ping",
        "iperf3",
        "sockperf",
        "wireguard-go",
        "wg",
    ];
    if args.store == Store::Etcd {
        tools.push("etcd");
    }
    let missing = trellis_netlab::missing_prerequisites(&tools);
    if !missing.is_empty() {
        bail!(
            "dataplane-bench builds network namespaces and needs {}; run it as root \
             (`sudo make bench-dataplane`) after `make setup`",
            missing.join(", ")
        );
    }
    let emulation = if netem::available() {
        Emulation::Netem
    } else {
        eprintln!(
            "dataplane-bench: this kernel has no netem qdisc; link delays by userspace UDP relays"
        );
        Emulation::UdpRelay
    };
    let report = leaf_to_leaf(&settings, emulation, run).await?;
    write_json(&args.out, &report)?;
    eprintln!("| path | median ms | p90 ms | min ms | max ms |");
    eprintln!("|---|---|---|---|---|");
    for (name, r) in [
        ("induced (A-C direct)", &report.rtt_induced),
        ("hub (A-B-C)", &report.rtt_hub_path),
    ] {
        let Some(r) = r else { continue };
        eprintln!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.median_ms, r.p90_ms, r.min_ms, r.max_ms
        );
    }
    eprintln!(
        "ratio hub/induced: {:.1}; wrote {}",
        report.ratio_hub_over_induced.unwrap_or(f64::NAN),
        args.out.display()
    );
    Ok(())
}
