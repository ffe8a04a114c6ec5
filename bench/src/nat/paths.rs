//! RTT and throughput in the fabric the grid was timed in, once its probes have stopped: pod to
//! pod over a direct leaf pair (easy × easy), a relayed one (hard × hard, through the hub), and
//! from a leaf of each of those kinds to the hub (a full peering, for reference: the relayed
//! path is two such legs and the hub's relay between them).

use anyhow::Context as _;
use trellis_netlab::topology::ping_rtts;
use trellis_netlab::{Fabric, NatKind, Service};

use super::Settings;
use super::grid::{gateway_drops, leaf, pair_path};
use crate::dataplane::probe::iperf;
use crate::results::PathMeasure;

/// The paths measured: (name, from, to), `to` `None` for the hub.
const PATHS: [(&str, NatKind, Option<NatKind>); 4] = [
    ("direct", NatKind::Easy, Some(NatKind::Easy)),
    ("relayed", NatKind::Hard, Some(NatKind::Hard)),
    ("hub", NatKind::Easy, None),
    ("hub", NatKind::Hard, None),
];

/// Measures every path of [`PATHS`] in `fabric`, one after the other.
pub(super) async fn measure(
    fabric: &Fabric,
    settings: &Settings,
    names: &[String],
    kinds: &[NatKind],
) -> anyhow::Result<Vec<PathMeasure>> {
    // The CPU of every gateway the paths cross: both leaves' and the hub's (which relays).
    let mut out = Vec::new();
    for (name, from_kind, to_kind) in PATHS {
        let from = leaf(kinds, from_kind, 1).context("no leaf of that kind")?;
        let to = match to_kind {
            Some(kind) => leaf(kinds, kind, 2).context("two leaves of a kind are needed")?,
            None => fabric.hub,
        };
        let mut pids = Vec::new();
        for i in [from, to, fabric.hub] {
            if let Some(pid) = fabric.clusters[i].process(Service::Gateway)?.pid()
                && !pids.contains(&pid)
            {
                pids.push(pid);
            }
        }
        let sites = &fabric.topology.sites;
        let (from_ns, to_ip) = (sites[from].pod_ns.clone(), sites[to].pod_ip);
        let hub_before = gateway_drops(fabric, fabric.hub);
        let (pings, interval) = (settings.pings, settings.ping_interval);
        let rtts_ms = tokio::task::spawn_blocking(move || {
            // One warm-up ping (ARP, a handshake if one is due), then the samples.
            let _ = ping_rtts(&from_ns, to_ip, 1, 0.2)?;
            ping_rtts(&from_ns, to_ip, pings, interval)
        })
        .await??;
        let transfer = iperf(
            &sites[from].pod_ns,
            &sites[to].pod_ns,
            to_ip,
            to_ip,
            settings.iperf_seconds,
            1,
            &pids,
        )
        .await;
        let path_seen = pair_path(fabric, from, to).await;
        // What the hub dropped meanwhile (relayed datagrams over the pair's rate, above all).
        let hub_drops = match (hub_before, gateway_drops(fabric, fabric.hub)) {
            (Some(before), Some(after)) => after
                .into_iter()
                .map(|(reason, n)| (n - before.get(&reason).copied().unwrap_or(0.0), reason))
                .filter(|(n, _)| *n > 0.0)
                .map(|(n, reason)| (reason, n))
                .collect(),
            _ => Default::default(),
        };
        let m = PathMeasure {
            name: name.to_owned(),
            from: names[from].clone(),
            to: names[to].clone(),
            from_kind: kinds[from].as_str().to_owned(),
            to_kind: kinds[to].as_str().to_owned(),
            path_seen,
            pings_sent: pings,
            transfer_error: transfer.as_ref().err().map(|e| format!("{e:#}")),
            transfer: transfer.ok(),
            rtts_ms,
            hub_drops,
        };
        eprintln!(
            "nat-bench: {} {} -> {} ({}): {} of {} pings answered, median {} ms; {}",
            m.name,
            m.from,
            m.to,
            m.path_seen,
            m.rtts_ms.len(),
            pings,
            super::percentile(&m.rtts_ms, 0.5).map_or("-".into(), |v| format!("{v:.3}")),
            m.transfer.as_ref().map_or_else(
                || format!(
                    "iperf3 failed: {}",
                    m.transfer_error.as_deref().unwrap_or("")
                ),
                |t| format!("{:.0} Mbit/s", t.mbit_s)
            )
        );
        out.push(m);
    }
    Ok(out)
}
