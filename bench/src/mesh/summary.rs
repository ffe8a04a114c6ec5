//! What one size reports from its runs: the hub's holdings of the last converged run, medians
//! over the converged runs, and the summary table printed at the end.

use super::run::Held;
use crate::median;
use crate::results::{MeshRun, MeshSize};

/// Takes what the hub held after a run into `size`, and the sum of its processes' peak RSS
/// into `peaks`.
pub fn hold(size: &mut MeshSize, held: Held, peaks: &mut Vec<f64>) {
    if let Some(p) = &held.processes {
        peaks.push(p.iter().map(|p| p.peak_rss_kib).sum::<u64>() as f64);
    }
    size.hub_tunnel_endpoints = Some(held.tunnels);
    size.hub_network_configs = Some(held.ncs);
    size.hub_relays_in_flight = Some(held.relays);
    size.hub_ipam_records = Some(held.ipam);
    size.hub_stores = held.stores;
    size.hub_processes = held.processes;
    size.hub_etcd_keys = held.etcd_keys;
}

/// Sets the medians of `size` over its converged runs; `peaks` as from [`hold`].
pub fn summarize(size: &mut MeshSize, peaks: &[f64]) {
    let converged: Vec<&MeshRun> = size.runs.iter().filter(|r| r.converged).collect();
    size.median_seconds = median(&converged.iter().map(|r| r.seconds).collect::<Vec<_>>());
    size.hub_cpu_seconds_during_setup = median(
        &converged
            .iter()
            .filter_map(|r| r.hub_cpu_seconds)
            .collect::<Vec<_>>(),
    );
    size.hub_peak_rss_kib_total = median(peaks).map(|p| p as u64);
    let of = |field: fn(&MeshRun) -> Option<f64>| {
        median(
            &converged
                .iter()
                .filter_map(|r| field(r))
                .collect::<Vec<_>>(),
        )
    };
    size.median_full_tunnels_seconds = of(|r| r.full_tunnels_seconds);
    size.median_tail_share = of(|r| r.tail_share);
    size.median_process_peak_rss_kib =
        of(|r| r.process_peak_rss_kib.map(|k| k as f64)).map(|k| k as u64);
    size.median_process_cpu_seconds = of(|r| r.process_cpu_seconds);
    size.median_hub_cpu_ms_per_induced_tunnel = of(|r| r.hub_cpu_ms_per_induced_tunnel);
    size.median_hub_etcd_writes_per_induced_tunnel = of(|r| r.hub_etcd_writes_per_induced_tunnel);
    size.median_hub_store_retries_per_induced_tunnel =
        of(|r| r.hub_store_retries_per_induced_tunnel);
    size.median_hub_watch_events_per_induced_tunnel = of(|r| r.hub_watch_events_per_induced_tunnel);
    size.median_hub_relay_retries_per_induced_tunnel =
        of(|r| r.hub_relay_retries_per_induced_tunnel);
}

/// The summary of every size on stderr, as a Markdown table.
pub fn print_table(sizes: &[MeshSize]) {
    eprintln!(
        "| leaves | status | induced TEs | median s | full tunnels s | 90→100 % share | hub CPU s | hub CPU ms / induced TE | hub peak RSS MiB | hub etcd writes / induced TE | store retries / TE | watch events / TE | relay retries / TE |"
    );
    eprintln!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for s in sizes {
        let opt = |v: Option<f64>, d: usize| v.map_or("-".into(), |v| format!("{v:.d$}"));
        eprintln!(
            "| {} | {:?} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.leaves,
            s.status,
            s.induced_tunnel_endpoints,
            opt(s.median_seconds, 3),
            opt(s.median_full_tunnels_seconds, 3),
            opt(s.median_tail_share, 3),
            opt(s.hub_cpu_seconds_during_setup, 2),
            opt(s.median_hub_cpu_ms_per_induced_tunnel, 3),
            opt(s.hub_peak_rss_kib_total.map(|k| k as f64 / 1024.0), 1),
            opt(s.median_hub_etcd_writes_per_induced_tunnel, 2),
            opt(s.median_hub_store_retries_per_induced_tunnel, 3),
            opt(s.median_hub_watch_events_per_induced_tunnel, 2),
            opt(s.median_hub_relay_retries_per_induced_tunnel, 3)
        );
    }
}
