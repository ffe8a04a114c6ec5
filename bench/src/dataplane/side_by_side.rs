//! Trellis's A–C tunnel against the wireguard-go reference pair, measured in turns in the same
//! run: RTT over the underlay's, and iperf3 at 1 and 4 streams with CPU seconds per GB.

use std::net::Ipv4Addr;

use trellis_netlab::topology::ping_rtts;

use super::Settings;
use super::probe::iperf;
use crate::ratio;
use crate::results::{Comparison, Rtt, RttOverhead, Side, SideBySide, Transfer, finite};

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

/// Alternates Trellis's A–C tunnel and the wireguard-go pair: per round, RTT (tunnel and
/// bare) and iperf3 at 1 and 4 streams for each, the first of the two alternating by round.
pub(super) async fn side_by_side(
    settings: &Settings,
    trellis: &TunnelPath<'_>,
    wg: &TunnelPath<'_>,
) -> anyhow::Result<SideBySide> {
    const STREAMS: [u32; 2] = [1, 4];
    let paths = [trellis, wg];
    let mut pings: [Pings; 2] = Default::default();
    let mut transfers: [[Vec<Transfer>; 2]; 2] = Default::default();
    for round in 0..settings.rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for &p in &order {
            let path = paths[p];
            let _ = ping_rtts(path.from_pod_ns, path.to_pod_at, 1, 0.2)?;
            pings[p].tunnel.extend(ping_rtts(
                path.from_pod_ns,
                path.to_pod_at,
                settings.samples,
                0.2,
            )?);
            let _ = ping_rtts(path.from_gw_ns, path.to_gw_ip, 1, 0.2)?;
            pings[p].bare.extend(ping_rtts(
                path.from_gw_ns,
                path.to_gw_ip,
                settings.samples,
                0.2,
            )?);
            pings[p].sent += settings.samples;
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
                ratio_mbit_s: ratio(trellis.median_mbit_s, wireguard_go.median_mbit_s),
                ratio_cpu_seconds_per_gb: ratio(
                    trellis.median_cpu_seconds_per_gb,
                    wireguard_go.median_cpu_seconds_per_gb,
                ),
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
        reference: crate::wireguard_go::version()?,
        rounds: settings.rounds,
        iperf_seconds: settings.iperf_seconds,
        throughput,
        rtt_trellis: Some(overhead(p_trellis)?),
        rtt_wireguard_go: Some(overhead(p_wg)?),
    })
}
