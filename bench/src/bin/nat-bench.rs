//! NAT traversal (issue 36, ADR 0025), as root in network namespaces with real packets: a hub
//! without NAT and `--leaves-per-kind` leaves behind each kind of NAT router of the lab
//! ([`trellis_netlab::nat`]: none, one-to-one, easy, hard), `--repeats` fresh fabrics.
//!
//! **Grid timing.** Every cluster has its own pod CIDR, so a pod's address is the same from
//! every cluster and known before any peering. Before the first `Peer` call, a prober in every
//! leaf's pod sends a UDP query to every other leaf's pod every 10 ms (answered by that pod's
//! prober), and a watch follows every leaf broker's TunnelEndpoints. Per unordered leaf pair:
//! t0 = the earlier of the two brokers writing the induced TunnelEndpoint for the other (as the
//! watch received it), t1 = the first query of either pod arriving at the other (the receiver's
//! clock). Per grid cell (an unordered pair of NAT kinds: 10) the p50/p95/max of t1 - t0 over
//! every pair of every repeat, and the path the cell ends on (the gateways' TunnelStatus, once
//! the probes stopped).
//!
//! **Paths.** In the same fabric, after the grid: ping RTT (`--pings` at `--ping-interval-ms`)
//! and iperf3 TCP throughput (one stream, `--iperf-seconds`) pod to pod over a direct pair
//! (easy × easy), a relayed pair (hard × hard) and from an easy and a hard leaf to the hub.
//!
//! Stores are `memory://`. Needs the service binaries of the same profile next to this one
//! (`make bench-nat` builds them in release mode).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use clap::Parser;
use trellis_bench::nat::{Settings, cells, path_summaries, repeat};
use trellis_bench::results::{NatParameters, NatResult};
use trellis_bench::{Machine, RunArgs, RunInfo, write_json};

/// Times induced peerings across NATs to their first pod-to-pod packet and measures relayed
/// against direct paths; writes the result as JSON.
#[derive(Debug, Parser)]
struct Args {
    /// Leaves behind each NAT kind (at least 2: the paths need two easy and two hard leaves).
    #[arg(long, default_value_t = 3)]
    leaves_per_kind: usize,
    /// Fresh fabrics, each timed once.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Seconds to wait for the induced mesh of TunnelEndpoints.
    #[arg(long, default_value_t = 120)]
    mesh_timeout: u64,
    /// Seconds after the first `Peer` call within which every pair's first reply must come.
    #[arg(long, default_value_t = 90)]
    probe_timeout: u64,
    /// Seconds the probes keep running (slowly) once every pair got its first reply.
    #[arg(long, default_value_t = 5)]
    settle: u64,
    /// Pings per path.
    #[arg(long, default_value_t = 200)]
    pings: u32,
    /// Interval between the pings, in milliseconds (below 200 needs root, which this has).
    #[arg(long, default_value_t = 20)]
    ping_interval_ms: u64,
    /// Duration of each iperf3 run, in seconds.
    #[arg(long, default_value_t = 5)]
    iperf_seconds: u32,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/nat.json")]
    out: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = RunInfo::start(&args.run);
    let missing =
        trellis_netlab::missing_prerequisites(&["ip", "nft", "ping", "python3", "iperf3"]);
    if !missing.is_empty() {
        bail!(
            "nat-bench builds network namespaces and NAT routers and needs {}; run it as root \
             (`sudo make bench-nat`) after `make setup`",
            missing.join(", ")
        );
    }
    ensure!(
        args.leaves_per_kind >= 2,
        "--leaves-per-kind must be at least 2"
    );
    ensure!(args.repeats > 0, "--repeats must be at least 1");
    let settings = Settings {
        leaves_per_kind: args.leaves_per_kind,
        mesh_timeout: Duration::from_secs(args.mesh_timeout),
        probe_timeout: Duration::from_secs(args.probe_timeout),
        settle: Duration::from_secs(args.settle),
        pings: args.pings,
        ping_interval: args.ping_interval_ms as f64 / 1000.0,
        iperf_seconds: args.iperf_seconds,
    };
    let started = Instant::now();
    let mut repeats = Vec::new();
    for r in 0..args.repeats {
        repeats.push(repeat(&settings, r).await?);
    }
    let report = NatResult {
        benchmark: "nat".into(),
        run: Some(run),
        machine: Some(Machine::describe()),
        parameters: NatParameters {
            leaves_per_kind: args.leaves_per_kind,
            repeats: args.repeats,
            // The prober's FAST interval (probe.py).
            probe_interval_ms: 10.0,
            probe_timeout_s: args.probe_timeout,
            pings: args.pings,
            ping_interval_ms: args.ping_interval_ms as f64,
            iperf_seconds: args.iperf_seconds,
            build: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
            .into(),
            store: "memory".into(),
        },
        cells: cells(&repeats),
        paths: path_summaries(&repeats),
        repeats,
    };
    write_json(&args.out, &report)?;
    let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
    eprintln!("| cell | pairs | unreached | p50 ms | p95 ms | max ms | path |");
    eprintln!("|---|---|---|---|---|---|---|");
    for c in &report.cells {
        let p = c.first_packet_ms.as_ref();
        eprintln!(
            "| {} x {} | {} | {} | {} | {} | {} | {} |",
            c.a_kind,
            c.c_kind,
            c.samples,
            c.unreached,
            ms(p.map(|p| p.p50)),
            ms(p.map(|p| p.p95)),
            ms(p.map(|p| p.max)),
            c.path
        );
    }
    for p in &report.paths {
        eprintln!(
            "nat-bench: {} ({} -> {}): RTT p50 {} ms, p99 {} ms, {} of {} answered; {} Mbit/s",
            p.name,
            p.from_kind,
            p.to_kind,
            p.rtt_p50_ms.map_or("-".into(), |v| format!("{v:.3}")),
            p.rtt_p99_ms.map_or("-".into(), |v| format!("{v:.3}")),
            p.pings_answered,
            p.pings_sent,
            ms(p.median_mbit_s)
        );
    }
    eprintln!(
        "nat-bench: {} repeats in {:.0} s; wrote {}",
        args.repeats,
        started.elapsed().as_secs_f64(),
        args.out.display()
    );
    Ok(())
}
