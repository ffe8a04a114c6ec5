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
//!   ([`trellis_bench::wireguard_go`]), alternating in rounds: iperf3 at 1 and 4 TCP streams,
//!   CPU seconds of the tunnel processes (both ends) per GB of payload, and RTT overhead
//!   (tunnel RTT minus the underlay's, pinged in the same round).
//! - **hub**: B's discovery with `--no-induced`: A and C only peer with B; B reflects C's pod to
//!   A through B's external CIDR (hub-path DNAT at B); A's pod pings that address.
//!
//! Stores are `memory://` by default (`--store etcd` for one etcd per service): the data plane
//! does not touch them, and 18 etcds would only add noise on 2 cores. Builds on the release
//! binaries: `make bench-dataplane` builds them first.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::{Parser, ValueEnum};
use serde::Serialize;
use trellis_api::pb::endpoints::TranslationPath;
use trellis_api::pb::types::PeeringKind;
use trellis_bench::wireguard_go::WireguardGoPair;
use trellis_bench::{Machine, RunArgs, RunInfo, write_json};
use trellis_netlab::netem::{self, LinkDelay, set_link_delays};
use trellis_netlab::netns::exec;
use trellis_netlab::relay::{RelayedLink, Relays, relay_links};
use trellis_netlab::topology::ping_rtts;
use trellis_netlab::{Fabric, FabricOptions, Service, StoreKind};

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const LIMIT: Duration = Duration::from_secs(90);

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Store {
    Memory,
    Etcd,
}

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
    /// Rounds of the side-by-side comparison with wireguard-go (each: RTT, then iperf3 at 1 and
    /// 4 streams, through both tunnels in turns); medians and spread over the rounds.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Duration of each iperf3 run, in seconds.
    #[arg(long, default_value_t = 10)]
    iperf_seconds: u32,
    /// Where the services keep their state.
    #[arg(long, value_enum, default_value_t = Store::Memory)]
    store: Store,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/dataplane.json")]
    out: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Clone, Serialize)]
struct Rtt {
    samples: usize,
    lost: u32,
    min_ms: f64,
    median_ms: f64,
    p90_ms: f64,
    max_ms: f64,
}

impl Rtt {
    fn of(mut rtts: Vec<f64>, sent: u32) -> anyhow::Result<Self> {
        if rtts.is_empty() {
            bail!("no ping was answered");
        }
        rtts.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let i = ((rtts.len() as f64 - 1.0) * q).round() as usize;
            rtts[i.min(rtts.len() - 1)]
        };
        Ok(Self {
            samples: rtts.len(),
            lost: sent.saturating_sub(u32::try_from(rtts.len()).unwrap_or(u32::MAX)),
            min_ms: rtts[0],
            median_ms: at(0.5),
            p90_ms: at(0.9),
            max_ms: rtts[rtts.len() - 1],
        })
    }
}

#[derive(Debug, Clone, Serialize)]
struct Throughput {
    /// iperf3 TCP, one stream, receiver side.
    tunnel_mbit_s: f64,
    bare_veth_mbit_s: f64,
    tunnel_fraction_of_bare: f64,
    /// Issue 9's target: userspace tunnel throughput at least 30 % of the bare veth path.
    target_fraction: f64,
    target_met: bool,
    seconds: u32,
}

#[derive(Debug, Serialize)]
struct Report {
    benchmark: &'static str,
    run: RunInfo,
    machine: Machine,
    /// Pings per RTT measurement and seconds per iperf3 run.
    samples: u32,
    iperf_seconds: u32,
    wireguard: &'static str,
    build: &'static str,
    store: Store,
    /// How the link delays were added.
    emulation: Emulation,
    /// With `udp_relay`: the induced path through relays adding 0 ms (the relays' own cost).
    rtt_through_zero_delay_relay: Option<Rtt>,
    hub_link_rtt_ms: u64,
    leaf_link_rtt_ms: u64,
    /// Without netem: pod to pod through the A–C tunnel, and gateway to gateway on the bridge.
    rtt_no_netem_tunnel: Rtt,
    rtt_no_netem_bare: Rtt,
    throughput: Throughput,
    /// With the link delays: A's pod to C's pod at the address B reflected to A.
    rtt_induced: Rtt,
    rtt_hub_path: Rtt,
    /// hub path median / induced median.
    ratio_hub_over_induced: f64,
    /// The published reference measurement of induced peering with the same link delays:
    /// 24 ms induced, 365 ms through the hub.
    thesis_induced_ms: f64,
    thesis_hub_ms: f64,
    /// How long the control plane took to make each path usable (services started to first
    /// answered ping), informative.
    induced_ready_seconds: f64,
    hub_ready_seconds: f64,
    /// Trellis's A–C tunnel against wireguard-go in the same run: throughput at 1 and 4
    /// streams, CPU per GB, RTT overhead over the underlay.
    side_by_side: SideBySide,
}

fn options(args: &Args, hub_no_induced: bool) -> FabricOptions {
    let mut o = FabricOptions::three_clusters();
    o.hub_no_induced = hub_no_induced;
    o.store = match args.store {
        Store::Memory => StoreKind::Memory,
        Store::Etcd => StoreKind::EtcdPerService,
    };
    o.extra_args = vec![(
        Service::Gateway,
        vec!["--mappings-interval".into(), "1".into()],
    )];
    o
}

/// How link latency is emulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Emulation {
    /// `tc netem` on the gateways' uplinks, per destination.
    Netem,
    /// Userspace UDP delay relays (the kernel has no netem).
    UdpRelay,
}

/// Adds the link delays to every link that carries a tunnel; the relays (if any) must live
/// while measuring.
async fn emulate(
    fabric: &Fabric,
    emulation: Emulation,
    links: &[LinkDelay],
) -> anyhow::Result<Option<Relays>> {
    if emulation == Emulation::Netem {
        set_link_delays(&fabric.topology, links)?;
        return Ok(None);
    }
    let mut relayed = Vec::new();
    for l in links {
        let (Ok(y_endpoint), Ok(x_endpoint)) = (
            fabric.wireguard_endpoint(l.a, l.b).await,
            fabric.wireguard_endpoint(l.b, l.a).await,
        ) else {
            continue; // no tunnel on this link (hub path: A and C do not peer)
        };
        relayed.push(RelayedLink {
            x: l.a,
            x_endpoint,
            y: l.b,
            y_endpoint,
            rtt: l.rtt,
        });
    }
    Ok(Some(relay_links(&fabric.topology, &relayed).await?))
}

fn delays(args: &Args) -> [LinkDelay; 3] {
    let hub = Duration::from_millis(args.hub_link_ms);
    let leaf = Duration::from_millis(args.leaf_link_ms);
    [
        LinkDelay {
            a: A,
            b: B,
            rtt: hub,
        },
        LinkDelay {
            a: C,
            b: B,
            rtt: hub,
        },
        LinkDelay {
            a: A,
            b: C,
            rtt: leaf,
        },
    ]
}

fn rtt(ns: &str, target: Ipv4Addr, samples: u32) -> anyhow::Result<Rtt> {
    // One warm-up ping (ARP, conntrack, a handshake if one is due), then the samples.
    let _ = ping_rtts(ns, target, 1, 0.2)?;
    Rtt::of(ping_rtts(ns, target, samples, 0.2)?, samples)
}

/// One iperf3 run: what arrived, and the CPU time the tunnel processes spent meanwhile.
#[derive(Debug, Clone, Serialize)]
struct Transfer {
    /// Received, Mbit/s (all streams).
    mbit_s: f64,
    /// iperf3 payload received, bytes.
    bytes: u64,
    /// utime + stime of the tunnel processes at both ends during the client's run.
    cpu_seconds: f64,
    /// `cpu_seconds` per 10^9 bytes of payload.
    cpu_seconds_per_gb: f64,
}

/// The summed CPU seconds (utime + stime) of `pids`.
fn cpu_seconds(pids: &[u32]) -> anyhow::Result<f64> {
    pids.iter()
        .map(|p| trellis_bench::proc::usage(*p).map(|u| u.cpu_seconds))
        .sum()
}

/// iperf3 TCP with `streams` parallel streams from `client_ns` to a one-shot server in
/// `server_ns` bound to `server_ip`, reading the CPU time of the tunnel processes `pids` around
/// the client's run.
async fn iperf(
    client_ns: &str,
    server_ns: &str,
    server_ip: Ipv4Addr,
    connect_to: Ipv4Addr,
    seconds: u32,
    streams: u32,
    pids: &[u32],
) -> anyhow::Result<Transfer> {
    let mut server = std::process::Command::new("ip")
        .args(["netns", "exec", server_ns, "iperf3", "-s", "-1", "-B"])
        .arg(server_ip.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting the iperf3 server")?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (client_ns, target, secs, parallel) = (
        client_ns.to_owned(),
        connect_to.to_string(),
        seconds.to_string(),
        streams.to_string(),
    );
    let cpu_before = cpu_seconds(pids)?;
    let out = tokio::task::spawn_blocking(move || {
        exec(
            &client_ns,
            "iperf3",
            &["-c", &target, "-t", &secs, "-P", &parallel, "-J"],
        )
    })
    .await??;
    let cpu = cpu_seconds(pids)? - cpu_before;
    let _ = server.kill();
    let _ = server.wait();
    let json: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("iperf3 -J output")?;
    if let Some(err) = json["error"].as_str() {
        bail!("iperf3: {err}");
    }
    let received = &json["end"]["sum_received"];
    let bps = received["bits_per_second"]
        .as_f64()
        .context("no end.sum_received.bits_per_second in iperf3's output")?;
    let bytes = received["bytes"]
        .as_u64()
        .context("no end.sum_received.bytes in iperf3's output")?;
    Ok(Transfer {
        mbit_s: bps / 1e6,
        bytes,
        cpu_seconds: cpu,
        cpu_seconds_per_gb: if bytes > 0 {
            cpu / (bytes as f64 / 1e9)
        } else {
            f64::NAN
        },
    })
}

/// Median, smallest and largest of `v` (NaN for none).
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        f64::midpoint(v[n / 2 - 1], v[n / 2])
    };
    (median, v[0], v[n - 1])
}

/// One tunnel's iperf3 runs at one stream count.
#[derive(Debug, Clone, Serialize)]
struct Side {
    runs: Vec<Transfer>,
    median_mbit_s: f64,
    min_mbit_s: f64,
    max_mbit_s: f64,
    median_cpu_seconds_per_gb: f64,
    min_cpu_seconds_per_gb: f64,
    max_cpu_seconds_per_gb: f64,
}

impl Side {
    fn of(runs: Vec<Transfer>) -> Self {
        let (median_mbit_s, min_mbit_s, max_mbit_s) =
            spread(runs.iter().map(|r| r.mbit_s).collect());
        let (median_cpu_seconds_per_gb, min_cpu_seconds_per_gb, max_cpu_seconds_per_gb) =
            spread(runs.iter().map(|r| r.cpu_seconds_per_gb).collect());
        Self {
            runs,
            median_mbit_s,
            min_mbit_s,
            max_mbit_s,
            median_cpu_seconds_per_gb,
            min_cpu_seconds_per_gb,
            max_cpu_seconds_per_gb,
        }
    }
}

/// Trellis against wireguard-go at one stream count.
#[derive(Debug, Clone, Serialize)]
struct Comparison {
    streams: u32,
    trellis: Side,
    wireguard_go: Side,
    /// Trellis median / wireguard-go median (above 1: Trellis moves more).
    ratio_mbit_s: f64,
    /// Trellis median / wireguard-go median (below 1: Trellis spends less CPU per GB).
    ratio_cpu_seconds_per_gb: f64,
}

/// A tunnel's RTT against its underlay's, pod to pod through the tunnel and gateway to gateway
/// on the bridge, pinged alternately in the same run.
#[derive(Debug, Clone, Serialize)]
struct RttOverhead {
    tunnel: Rtt,
    bare: Rtt,
    /// Median tunnel RTT minus median bare RTT.
    overhead_ms: f64,
}

/// Trellis's tunnel and wireguard-go's, measured in turns in one run.
#[derive(Debug, Clone, Serialize)]
struct SideBySide {
    /// `wireguard-go --version`'s first line.
    reference: String,
    /// Rounds of measurements; each round measures both tunnels (which one first alternates).
    rounds: u32,
    iperf_seconds: u32,
    throughput: Vec<Comparison>,
    rtt_trellis: RttOverhead,
    rtt_wireguard_go: RttOverhead,
}

/// A tunnel to measure: pod to pod across it, the gateways' underlay, and its processes.
struct TunnelPath<'a> {
    name: &'static str,
    from_pod_ns: &'a str,
    to_pod_ns: &'a str,
    /// The server pod's own address and the address the client reaches it at.
    to_pod_ip: Ipv4Addr,
    to_pod_at: Ipv4Addr,
    from_gw_ns: &'a str,
    to_gw_ip: Ipv4Addr,
    pids: Vec<u32>,
}

/// The pings of one path, pooled over rounds.
#[derive(Default)]
struct Pings {
    tunnel: Vec<f64>,
    bare: Vec<f64>,
    sent: u32,
}

/// Alternates Trellis's A–C tunnel and the wireguard-go pair: per round, RTT (tunnel and
/// bare) and iperf3 at 1 and 4 streams for each, the first of the two alternating by round.
async fn side_by_side(
    args: &Args,
    trellis: &TunnelPath<'_>,
    wg: &TunnelPath<'_>,
) -> anyhow::Result<SideBySide> {
    const STREAMS: [u32; 2] = [1, 4];
    let paths = [trellis, wg];
    let mut pings: [Pings; 2] = Default::default();
    let mut transfers: [[Vec<Transfer>; 2]; 2] = Default::default();
    for round in 0..args.rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for &p in &order {
            let path = paths[p];
            let _ = ping_rtts(path.from_pod_ns, path.to_pod_at, 1, 0.2)?;
            pings[p].tunnel.extend(ping_rtts(
                path.from_pod_ns,
                path.to_pod_at,
                args.samples,
                0.2,
            )?);
            let _ = ping_rtts(path.from_gw_ns, path.to_gw_ip, 1, 0.2)?;
            pings[p].bare.extend(ping_rtts(
                path.from_gw_ns,
                path.to_gw_ip,
                args.samples,
                0.2,
            )?);
            pings[p].sent += args.samples;
        }
        for (s, &streams) in STREAMS.iter().enumerate() {
            for &p in &order {
                let path = paths[p];
                let t = iperf(
                    path.from_pod_ns,
                    path.to_pod_ns,
                    path.to_pod_ip,
                    path.to_pod_at,
                    args.iperf_seconds,
                    streams,
                    &path.pids,
                )
                .await?;
                eprintln!(
                    "dataplane-bench: round {}: {} {streams} stream(s): {:.0} Mbit/s, {:.1} CPU s/GB",
                    round + 1,
                    path.name,
                    t.mbit_s,
                    t.cpu_seconds_per_gb
                );
                transfers[p][s].push(t);
            }
        }
    }
    let [t_trellis, t_wg] = transfers;
    let throughput = STREAMS
        .iter()
        .zip(t_trellis.into_iter().zip(t_wg))
        .map(|(&streams, (ours, theirs))| {
            let (trellis, wireguard_go) = (Side::of(ours), Side::of(theirs));
            Comparison {
                streams,
                ratio_mbit_s: trellis.median_mbit_s / wireguard_go.median_mbit_s,
                ratio_cpu_seconds_per_gb: trellis.median_cpu_seconds_per_gb
                    / wireguard_go.median_cpu_seconds_per_gb,
                trellis,
                wireguard_go,
            }
        })
        .collect();
    let [p_trellis, p_wg] = pings;
    let overhead = |p: Pings| -> anyhow::Result<RttOverhead> {
        let tunnel = Rtt::of(p.tunnel, p.sent)?;
        let bare = Rtt::of(p.bare, p.sent)?;
        Ok(RttOverhead {
            overhead_ms: tunnel.median_ms - bare.median_ms,
            tunnel,
            bare,
        })
    };
    Ok(SideBySide {
        reference: trellis_bench::wireguard_go::version()?,
        rounds: args.rounds,
        iperf_seconds: args.iperf_seconds,
        throughput,
        rtt_trellis: overhead(p_trellis)?,
        rtt_wireguard_go: overhead(p_wg)?,
    })
}

/// What the induced scenario measured.
struct Induced {
    tunnel: Rtt,
    bare: Rtt,
    throughput: Throughput,
    relay_overhead: Option<Rtt>,
    delayed: Rtt,
    ready: f64,
    compared: SideBySide,
}

async fn induced(args: &Args, emulation: Emulation) -> anyhow::Result<Induced> {
    let started = Instant::now();
    let fabric = Fabric::up(options(args, false)).await?;
    fabric
        .wait_tunnel_endpoints(
            A,
            &[("b", PeeringKind::Full), ("c", PeeringKind::Induced)],
            LIMIT,
        )
        .await?;
    let (path, address) = fabric.reflect_pod(B, C, A).await?;
    if path != TranslationPath::Induced {
        bail!("B reflected C's pod to A by the {path:?} path, expected INDUCED");
    }
    fabric.wait_ping(A, address, LIMIT).await?;
    let ready = started.elapsed().as_secs_f64();
    eprintln!("dataplane-bench: induced path up at {address} after {ready:.1} s");
    let sites = &fabric.topology.sites;
    let wg = WireguardGoPair::up(LIMIT).await?;
    eprintln!("dataplane-bench: wireguard-go reference tunnel up");
    let mut pids = Vec::new();
    for i in [A, C] {
        pids.push(
            fabric.clusters[i]
                .process(Service::Gateway)?
                .pid()
                .context("a gateway is not running")?,
        );
    }
    let ours = TunnelPath {
        name: "trellis",
        from_pod_ns: &sites[A].pod_ns,
        to_pod_ns: &sites[C].pod_ns,
        to_pod_ip: sites[C].pod_ip,
        to_pod_at: address,
        from_gw_ns: &sites[A].gw_ns,
        to_gw_ip: sites[C].uplink_ip,
        pids,
    };
    let wg_sites = &wg.topology.sites;
    let theirs = TunnelPath {
        name: "wireguard-go",
        from_pod_ns: &wg_sites[0].pod_ns,
        to_pod_ns: &wg_sites[1].pod_ns,
        to_pod_ip: wg_sites[1].pod_ip,
        to_pod_at: wg_sites[1].pod_ip,
        from_gw_ns: &wg_sites[0].gw_ns,
        to_gw_ip: wg_sites[1].uplink_ip,
        pids: wg.pids(),
    };
    let compared = side_by_side(args, &ours, &theirs).await?;
    drop(wg);
    for (name, r) in [
        ("trellis", &compared.rtt_trellis),
        ("wireguard-go", &compared.rtt_wireguard_go),
    ] {
        eprintln!(
            "dataplane-bench: {name}: tunnel RTT median {:.3} ms, bare {:.3} ms, overhead {:.3} ms",
            r.tunnel.median_ms, r.bare.median_ms, r.overhead_ms
        );
    }
    for c in &compared.throughput {
        eprintln!(
            "dataplane-bench: {} stream(s): trellis {:.0} Mbit/s, wireguard-go {:.0} Mbit/s (x{:.2}); CPU s/GB {:.1} vs {:.1}",
            c.streams,
            c.trellis.median_mbit_s,
            c.wireguard_go.median_mbit_s,
            c.ratio_mbit_s,
            c.trellis.median_cpu_seconds_per_gb,
            c.wireguard_go.median_cpu_seconds_per_gb
        );
    }
    let tunnel = compared.rtt_trellis.tunnel.clone();
    let bare = compared.rtt_trellis.bare.clone();
    let tunnel_mbit = compared.throughput[0].trellis.median_mbit_s;
    let bare_mbit = iperf(
        &sites[A].gw_ns,
        &sites[C].gw_ns,
        sites[C].uplink_ip,
        sites[C].uplink_ip,
        args.iperf_seconds,
        1,
        &[],
    )
    .await?
    .mbit_s;
    let fraction = tunnel_mbit / bare_mbit;
    eprintln!(
        "dataplane-bench: iperf3 tunnel {tunnel_mbit:.0} Mbit/s, bare veth {bare_mbit:.0} Mbit/s ({:.1} %)",
        fraction * 100.0
    );
    let throughput = Throughput {
        tunnel_mbit_s: tunnel_mbit,
        bare_veth_mbit_s: bare_mbit,
        tunnel_fraction_of_bare: fraction,
        target_fraction: 0.30,
        target_met: fraction >= 0.30,
        seconds: args.iperf_seconds,
    };
    // The relay's own cost: the same path through a relay that adds no delay.
    let relay_overhead = if emulation == Emulation::UdpRelay {
        let zero = delays(args).map(|l| LinkDelay {
            rtt: Duration::ZERO,
            ..l
        });
        let relays = emulate(&fabric, emulation, &zero).await?;
        let through_relay = rtt(&sites[A].pod_ns, address, args.samples)?;
        drop(relays);
        eprintln!(
            "dataplane-bench: through a 0 ms relay: median {:.3} ms",
            through_relay.median_ms
        );
        Some(through_relay)
    } else {
        None
    };
    let relays = emulate(&fabric, emulation, &delays(args)).await?;
    let delayed = rtt(&sites[A].pod_ns, address, args.samples)?;
    drop(relays);
    eprintln!(
        "dataplane-bench: induced path with link delays: median {:.1} ms, p90 {:.1} ms",
        delayed.median_ms, delayed.p90_ms
    );
    Ok(Induced {
        tunnel,
        bare,
        throughput,
        relay_overhead,
        delayed,
        ready,
        compared,
    })
}

async fn hub(args: &Args, emulation: Emulation) -> anyhow::Result<(Rtt, f64)> {
    let started = Instant::now();
    let fabric = Fabric::up(options(args, true)).await?;
    fabric
        .wait_tunnel_endpoints(
            B,
            &[("a", PeeringKind::Full), ("c", PeeringKind::Full)],
            LIMIT,
        )
        .await?;
    fabric
        .wait_tunnel_endpoints(A, &[("b", PeeringKind::Full)], LIMIT)
        .await?;
    let (path, address) = fabric.reflect_pod(B, C, A).await?;
    if path != TranslationPath::HubExternal {
        bail!("B reflected C's pod to A by the {path:?} path, expected HUB_EXTERNAL");
    }
    fabric.wait_ping(A, address, LIMIT).await?;
    let ready = started.elapsed().as_secs_f64();
    eprintln!("dataplane-bench: hub path up at {address} after {ready:.1} s");
    let relays = emulate(&fabric, emulation, &delays(args)).await?;
    let delayed = rtt(&fabric.topology.sites[A].pod_ns, address, args.samples)?;
    drop(relays);
    eprintln!(
        "dataplane-bench: hub path with link delays: median {:.1} ms, p90 {:.1} ms",
        delayed.median_ms, delayed.p90_ms
    );
    Ok((delayed, ready))
}

/// The node path's result: pods on non-gateway nodes against pods on the gateway nodes.
#[derive(Debug, Serialize)]
struct NodePathReport {
    benchmark: &'static str,
    run: RunInfo,
    machine: Machine,
    samples: u32,
    iperf_seconds: u32,
    wireguard: &'static str,
    build: &'static str,
    store: Store,
    nodes_per_cluster: usize,
    /// A's pod on its gateway node to C's pod on its gateway node (the tunnel only).
    rtt_gateway_nodes: Rtt,
    /// A's pod on node 1 to C's pod on node 2 (VXLAN, tunnel, node network).
    rtt_non_gateway_nodes: Rtt,
    /// iperf3 TCP, one stream, Mbit/s; runs alternate between the two paths.
    mbit_s_gateway_nodes: Vec<f64>,
    mbit_s_non_gateway_nodes: Vec<f64>,
    /// Non-gateway over gateway: median RTT, and mean throughput.
    rtt_ratio: f64,
    throughput_ratio: f64,
}

fn build() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

const WIREGUARD: &str = "userspace (boringtun via defguard_boringtun), MTU 1420";

async fn node_path(args: &Args, run: RunInfo) -> anyhow::Result<NodePathReport> {
    const NODES: usize = 3;
    let mut o = options(args, false);
    o.nodes = NODES;
    let fabric = Fabric::up(o).await?;
    for (i, remotes) in [
        (A, [("b", PeeringKind::Full), ("c", PeeringKind::Induced)]),
        (C, [("a", PeeringKind::Induced), ("b", PeeringKind::Full)]),
    ] {
        fabric.wait_tunnel_endpoints(i, &remotes, LIMIT).await?;
    }
    let (a, c) = (&fabric.topology.sites[A], &fabric.topology.sites[C]);
    let view = fabric.view(A, C, false).await?;
    let at = |pod: Ipv4Addr| {
        Ipv4Addr::from(u32::from(view.network()) + u32::from(pod) - u32::from(c.pod_cidr.network()))
    };
    let (gw_from, gw_to) = (&a.nodes[0], &c.nodes[0]);
    let (far_from, far_to) = (&a.nodes[1], &c.nodes[2]);
    for (from, to) in [(gw_from, gw_to), (far_from, far_to)] {
        let deadline = Instant::now() + LIMIT;
        while ping_rtts(&from.pod_ns, at(to.pod_ip), 1, 0.2)?.is_empty() {
            if Instant::now() > deadline {
                bail!(
                    "{} never reached {}:\n{}",
                    from.name,
                    to.name,
                    fabric.logs()
                );
            }
        }
    }
    let rtt_gateway_nodes = rtt(&gw_from.pod_ns, at(gw_to.pod_ip), args.samples)?;
    let rtt_non_gateway_nodes = rtt(&far_from.pod_ns, at(far_to.pod_ip), args.samples)?;
    eprintln!(
        "dataplane-bench: node path RTT median {:.3} ms (gateway nodes) vs {:.3} ms (non-gateway nodes)",
        rtt_gateway_nodes.median_ms, rtt_non_gateway_nodes.median_ms
    );
    let (mut gw_mbit, mut far_mbit) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        for (from, to, into) in [
            (gw_from, gw_to, &mut gw_mbit),
            (far_from, far_to, &mut far_mbit),
        ] {
            let mbit = iperf(
                &from.pod_ns,
                &to.pod_ns,
                to.pod_ip,
                at(to.pod_ip),
                args.iperf_seconds,
                1,
                &[],
            )
            .await?
            .mbit_s;
            eprintln!(
                "dataplane-bench: iperf3 {} -> {}: {mbit:.0} Mbit/s",
                from.pod_ns, to.pod_ns
            );
            into.push(mbit);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    Ok(NodePathReport {
        benchmark: "dataplane_node_path",
        run,
        machine: Machine::describe(),
        samples: args.samples,
        iperf_seconds: args.iperf_seconds,
        wireguard: WIREGUARD,
        build: build(),
        store: args.store,
        nodes_per_cluster: NODES,
        rtt_ratio: rtt_non_gateway_nodes.median_ms / rtt_gateway_nodes.median_ms,
        throughput_ratio: mean(&far_mbit) / mean(&gw_mbit),
        rtt_gateway_nodes,
        rtt_non_gateway_nodes,
        mbit_s_gateway_nodes: gw_mbit,
        mbit_s_non_gateway_nodes: far_mbit,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = RunInfo::start(&args.run);
    if args.scenario == Scenario::NodePath {
        let missing = trellis_netlab::missing_prerequisites(&["ip", "nft", "ping", "iperf3"]);
        if !missing.is_empty() {
            bail!(
                "dataplane-bench --scenario node-path builds network namespaces and needs {}; \
                 run it as root after `make setup`",
                missing.join(", ")
            );
        }
        let report = node_path(&args, run).await?;
        write_json(&args.out, &report)?;
        eprintln!(
            "node path: RTT x{:.2}, throughput x{:.2} against the gateway nodes; wrote {}",
            report.rtt_ratio,
            report.throughput_ratio,
            args.out.display()
        );
        return Ok(());
    }
    let mut tools = vec!["ip", "tc", "nft", "ping", "iperf3", "wireguard-go", "wg"];
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
    let Induced {
        tunnel,
        bare,
        throughput,
        relay_overhead,
        delayed: induced_rtt,
        ready: induced_ready,
        compared,
    } = induced(&args, emulation).await?;
    let (hub_rtt, hub_ready) = hub(&args, emulation).await?;
    let report = Report {
        benchmark: "dataplane_leaf_to_leaf",
        run,
        machine: Machine::describe(),
        samples: args.samples,
        iperf_seconds: args.iperf_seconds,
        wireguard: WIREGUARD,
        build: build(),
        store: args.store,
        emulation,
        rtt_through_zero_delay_relay: relay_overhead,
        hub_link_rtt_ms: args.hub_link_ms,
        leaf_link_rtt_ms: args.leaf_link_ms,
        rtt_no_netem_tunnel: tunnel,
        rtt_no_netem_bare: bare,
        throughput,
        ratio_hub_over_induced: hub_rtt.median_ms / induced_rtt.median_ms,
        rtt_induced: induced_rtt,
        rtt_hub_path: hub_rtt,
        thesis_induced_ms: 24.0,
        thesis_hub_ms: 365.0,
        induced_ready_seconds: induced_ready,
        hub_ready_seconds: hub_ready,
        side_by_side: compared,
    };
    write_json(&args.out, &report)?;
    eprintln!("| path | median ms | p90 ms | min ms | max ms |");
    eprintln!("|---|---|---|---|---|");
    for (name, r) in [
        ("induced (A-C direct)", &report.rtt_induced),
        ("hub (A-B-C)", &report.rtt_hub_path),
    ] {
        eprintln!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} |",
            r.median_ms, r.p90_ms, r.min_ms, r.max_ms
        );
    }
    eprintln!(
        "ratio hub/induced: {:.1}; wrote {}",
        report.ratio_hub_over_induced,
        args.out.display()
    );
    Ok(())
}
