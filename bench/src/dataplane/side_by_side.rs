//! Trellis's A–C tunnel against the reference pairs (wireguard-go, and GotaTun where it is
//! installed), measured in turns in the same run: RTT over the underlay's, request/response at
//! 1 and 4 connections next to the underlay's, and iperf3 at 1 and 4 streams with CPU seconds
//! per GB.

use std::net::Ipv4Addr;

use trellis_netlab::topology::ping_rtts;

use super::Settings;
use super::probe::iperf;
use super::rr::{RrRun, tcp_rr};
use crate::ratio;
use crate::reference::Reference;
use crate::results::{
    Comparison, RequestResponse, RrComparison, RrPath, Rtt, RttOverhead, Side, SideBySide,
    Transfer, finite,
};

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

impl Side {
    fn of(runs: Vec<Transfer>) -> Self {
        let (median_mbit_s, min_mbit_s, max_mbit_s) =
            spread(runs.iter().map(|r| r.mbit_s).collect());
        let (median_cpu_seconds_per_gb, min_cpu_seconds_per_gb, max_cpu_seconds_per_gb) = spread(
            runs.iter()
                .map(|r| r.cpu_seconds_per_gb.unwrap_or(f64::NAN))
                .collect(),
        );
        Self {
            runs,
            median_mbit_s: finite(median_mbit_s),
            min_mbit_s: finite(min_mbit_s),
            max_mbit_s: finite(max_mbit_s),
            median_cpu_seconds_per_gb: finite(median_cpu_seconds_per_gb),
            min_cpu_seconds_per_gb: finite(min_cpu_seconds_per_gb),
            max_cpu_seconds_per_gb: finite(max_cpu_seconds_per_gb),
        }
    }
}

/// A tunnel to measure: pod to pod across it, the gateways' underlay, and its processes.
pub(super) struct TunnelPath<'a> {
    pub(super) name: &'static str,
    pub(super) from_pod_ns: &'a str,
    pub(super) to_pod_ns: &'a str,
    /// The server pod's own address and the address the client reaches it at.
    pub(super) to_pod_ip: Ipv4Addr,
    pub(super) to_pod_at: Ipv4Addr,
    pub(super) from_gw_ns: &'a str,
    pub(super) to_gw_ns: &'a str,
    pub(super) to_gw_ip: Ipv4Addr,
    pub(super) pids: Vec<u32>,
}

/// The pings of one path, pooled over rounds.
#[derive(Default)]
struct Pings {
    tunnel: Vec<f64>,
    bare: Vec<f64>,
    sent: u32,
}

/// One path's request/response runs at one connection count, through its tunnel and on its
/// underlay.
#[derive(Default)]
struct RrRuns {
    tunnel: Vec<RrRun>,
    underlay: Vec<RrRun>,
}

/// What one path measured over the rounds.
#[derive(Default)]
struct Measured {
    pings: Pings,
    rr: [RrRuns; 2],
    transfers: [Vec<Transfer>; 2],
}

const STREAMS: [u32; 2] = [1, 4];
const CONNECTIONS: [u16; 2] = [1, 4];

/// Alternates Trellis's A–C tunnel, the wireguard-go pair and (where given) the GotaTun pair:
/// per round, RTT (tunnel and bare), request/response at 1 and 4 connections (tunnel and bare)
/// and iperf3 at 1 and 4 streams for each, which path goes first rotating by round.
pub(super) async fn side_by_side(
    settings: &Settings,
    trellis: &TunnelPath<'_>,
    wg: &TunnelPath<'_>,
    gotatun: Option<&TunnelPath<'_>>,
) -> anyhow::Result<SideBySide> {
    let mut paths = vec![trellis, wg];
    paths.extend(gotatun);
    let mut measured: Vec<Measured> = paths.iter().map(|_| Measured::default()).collect();
    for round in 0..settings.rounds as usize {
        let order: Vec<usize> = (0..paths.len())
            .map(|i| (i + round) % paths.len())
            .collect();
        for &p in &order {
            let path = paths[p];
            let m = &mut measured[p].pings;
            let _ = ping_rtts(path.from_pod_ns, path.to_pod_at, 1, 0.2)?;
            m.tunnel.extend(ping_rtts(
                path.from_pod_ns,
                path.to_pod_at,
                settings.samples,
                0.2,
            )?);
            let _ = ping_rtts(path.from_gw_ns, path.to_gw_ip, 1, 0.2)?;
            m.bare.extend(ping_rtts(
                path.from_gw_ns,
                path.to_gw_ip,
                settings.samples,
                0.2,
            )?);
            m.sent += settings.samples;
        }
        for (c, &connections) in CONNECTIONS.iter().enumerate() {
            for &p in &order {
                let path = paths[p];
                let tunnel = tcp_rr(
                    path.from_pod_ns,
                    path.to_pod_ns,
                    path.to_pod_ip,
                    path.to_pod_at,
                    settings.rr_seconds,
                    connections,
                )
                .await?;
                let underlay = tcp_rr(
                    path.from_gw_ns,
                    path.to_gw_ns,
                    path.to_gw_ip,
                    path.to_gw_ip,
                    settings.rr_seconds,
                    connections,
                )
                .await?;
                eprintln!(
                    "dataplane-bench: round {}: {} request/response, {connections} connection(s): \
                     {:.0}/s through the tunnel, {:.0}/s on the underlay",
                    round + 1,
                    path.name,
                    tunnel.per_s,
                    underlay.per_s
                );
                measured[p].rr[c].tunnel.push(tunnel);
                measured[p].rr[c].underlay.push(underlay);
            }
        }
        for (s, &streams) in STREAMS.iter().enumerate() {
            for &p in &order {
                let path = paths[p];
                let t = iperf(
                    path.from_pod_ns,
                    path.to_pod_ns,
                    path.to_pod_ip,
                    path.to_pod_at,
                    settings.iperf_seconds,
                    streams,
                    &path.pids,
                )
                .await?;
                eprintln!(
                    "dataplane-bench: round {}: {} {streams} stream(s): {:.0} Mbit/s, {:.1} CPU s/GB",
                    round + 1,
                    path.name,
                    t.mbit_s,
                    t.cpu_seconds_per_gb.unwrap_or(f64::NAN)
                );
                measured[p].transfers[s].push(t);
            }
        }
    }
    let mut measured = measured.into_iter();
    let (ours, theirs) = (
        measured.next().expect("trellis is measured"),
        measured.next().expect("wireguard-go is measured"),
    );
    let gota = measured.next();
    assemble(settings, ours, theirs, gota)
}

/// The comparison's results from what each path measured.
fn assemble(
    settings: &Settings,
    ours: Measured,
    theirs: Measured,
    gota: Option<Measured>,
) -> anyhow::Result<SideBySide> {
    let Measured {
        pings: p_ours,
        rr: rr_ours,
        transfers: t_ours,
    } = ours;
    let Measured {
        pings: p_theirs,
        rr: rr_theirs,
        transfers: t_theirs,
    } = theirs;
    let (p_gota, mut rr_gota, mut t_gota) = match gota {
        Some(g) => (Some(g.pings), g.rr.map(Some), g.transfers.map(Some)),
        None => (None, [None, None], [None, None]),
    };
    let throughput = STREAMS
        .iter()
        .zip(t_ours.into_iter().zip(t_theirs))
        .enumerate()
        .map(|(i, (&streams, (ours, theirs)))| {
            let (trellis, wireguard_go) = (Side::of(ours), Side::of(theirs));
            Comparison {
                streams,
                ratio_mbit_s: ratio(trellis.median_mbit_s, wireguard_go.median_mbit_s),
                ratio_cpu_seconds_per_gb: ratio(
                    trellis.median_cpu_seconds_per_gb,
                    wireguard_go.median_cpu_seconds_per_gb,
                ),
                trellis,
                wireguard_go,
                gotatun: t_gota[i].take().map(Side::of),
            }
        })
        .collect();
    let path = |r: RrRuns| RrPath {
        tunnel: RequestResponse::of(r.tunnel),
        underlay: RequestResponse::of(r.underlay),
    };
    let request_response = CONNECTIONS
        .iter()
        .zip(rr_ours.into_iter().zip(rr_theirs))
        .enumerate()
        .map(|(i, (&connections, (ours, theirs)))| RrComparison {
            connections: u32::from(connections),
            trellis: path(ours),
            wireguard_go: path(theirs),
            gotatun: rr_gota[i].take().map(path),
        })
        .collect();
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
        reference: Reference::WireguardGo.version()?,
        gotatun_reference: match p_gota {
            Some(_) => Some(Reference::GotaTun.version()?),
            None => None,
        },
        rounds: settings.rounds,
        iperf_seconds: settings.iperf_seconds,
        throughput,
        rtt_trellis: Some(overhead(p_ours)?),
        rtt_wireguard_go: Some(overhead(p_theirs)?),
        rtt_gotatun: p_gota.map(overhead).transpose()?,
        rr_seconds: settings.rr_seconds,
        request_response,
    })
}
