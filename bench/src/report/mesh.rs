//! The induced mesh section: setup time per size and mode, its plots and fit, the hub's store
//! and the hub's processes.

use std::fmt::Write as _;
use std::path::PathBuf;

use super::format::{compact, num, opt, opt_usize, run_line};
use super::inputs::Inputs;
use super::notes::note;
use super::output::PLOT_DIR;
use super::parse::parse;
use super::targets::{power_fit, tunnels};
use crate::results::{HubProcess, MeshResult, MeshSize, StoreUse};
use crate::svg::{self, LineChart, Scale, Series};

pub(super) fn mesh_section(md: &mut String, inputs: &Inputs, files: &mut Vec<(PathBuf, String)>) {
    md.push_str("## Induced mesh setup time\n\n");
    md.push_str(&note(inputs, "mesh"));
    let modes = [
        ("mesh", "in process (memory)"),
        ("mesh-hub-processes", "hub processes (memory)"),
        ("mesh-hub-etcd", "hub processes + etcd"),
        ("mesh-etcd", "processes + etcd"),
    ];
    let mut by_leaves = Vec::new();
    let mut by_tunnels = Vec::new();
    for (name, label) in modes {
        if let Ok(p) = parse::<MeshResult>(inputs, name) {
            let pts: Vec<(usize, f64)> = p
                .doc
                .sizes
                .iter()
                .filter_map(|s| Some((s.leaves, s.converged_median()?)))
                .collect();
            by_leaves.push(Series {
                name: label.into(),
                points: pts.iter().map(|(n, s)| (*n as f64, *s)).collect(),
                dashed: false,
            });
            by_tunnels.push(Series {
                name: label.into(),
                points: pts.iter().map(|(n, s)| (tunnels(*n) as f64, *s)).collect(),
                dashed: false,
            });
        }
    }

    let parsed = parse::<MeshResult>(inputs, "mesh");
    md.push_str("### In process\n\n");
    match &parsed {
        Err(why) => {
            let _ = writeln!(md, "Not measured: {why}.\n");
        }
        Ok(p) => {
            let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
            if let Some(params) = &p.doc.parameters {
                let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
            }
            md.push_str("| leaves | status | induced TunnelEndpoints | median s | runs (s) | ms per induced tunnel | hub TunnelEndpoints | hub NetworkConfigs | relays held by the hub | hub IPAM records | open files at the end | peak RSS MiB (all clusters) | CPU s (all clusters) |\n");
            md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
            for s in &p.doc.sizes {
                let med = s.converged_median();
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.leaves,
                    status_text(s),
                    num(s.induced_tunnel_endpoints as f64, 0),
                    opt(med, 3),
                    runs_text(s),
                    opt(
                        med.filter(|_| s.induced_tunnel_endpoints > 0)
                            .map(|m| 1000.0 * m / s.induced_tunnel_endpoints as f64),
                        2
                    ),
                    opt_usize(s.hub_tunnel_endpoints),
                    opt_usize(s.hub_network_configs),
                    opt_usize(s.hub_relays_in_flight),
                    opt_usize(s.hub_ipam_records),
                    opt_usize(s.runs.last().and_then(|r| r.open_files)),
                    opt(s.median_process_peak_rss_kib.map(|k| k as f64 / 1024.0), 0),
                    opt(s.median_process_cpu_seconds, 1)
                );
            }
            md.push('\n');
            let pts: Vec<(f64, f64)> = p
                .doc
                .sizes
                .iter()
                .filter_map(|s| Some((tunnels(s.leaves) as f64, s.converged_median()?)))
                .collect();
            if let Some((k, c)) = power_fit(&pts) {
                let _ = writeln!(
                    md,
                    "Least-squares fit over every converged size: seconds ≈ {} · tunnels^{} (k = 1 is linear in the number of induced tunnels n·(n-1); the targets table fits the three largest sizes).\n",
                    num(c, 4),
                    num(k, 2)
                );
                let (lo, hi) = pts.iter().fold((f64::INFINITY, 0f64), |(lo, hi), (x, _)| {
                    (lo.min(*x), hi.max(*x))
                });
                by_tunnels.push(Series {
                    name: format!("fit: k = {}", num(k, 2)),
                    points: vec![(lo, c * lo.powf(k)), (hi, c * hi.powf(k))],
                    dashed: true,
                });
                if let Some(&(x_max, y_max)) = pts.last() {
                    by_tunnels.push(Series {
                        name: "linear through largest".into(),
                        points: vec![(lo, y_max * lo / x_max), (x_max, y_max)],
                        dashed: true,
                    });
                }
            }
            md.push_str("![Setup time vs leaves](bench/mesh-setup-vs-leaves.svg)\n\n");
            md.push_str("![Setup time vs induced tunnels](bench/mesh-setup-vs-tunnels.svg)\n\n");
            md.push_str("### The hub's store after convergence\n\n");
            md.push_str("| leaves | discovery keys / bytes | broker keys / bytes | forwarder keys / bytes | IPAM keys / bytes | gateway keys / bytes | total keys | total bytes |\n");
            md.push_str("|---|---|---|---|---|---|---|---|\n");
            for s in &p.doc.sizes {
                let Some(h) = &s.hub_stores else { continue };
                let kb = |u: &StoreUse| {
                    format!("{} / {}", num(u.keys as f64, 0), num(u.bytes as f64, 0))
                };
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.leaves,
                    kb(&h.discovery),
                    kb(&h.broker),
                    kb(&h.forwarder),
                    kb(&h.ipam),
                    kb(&h.gateway),
                    num(h.total.keys as f64, 0),
                    num(h.total.bytes as f64, 0)
                );
            }
            md.push('\n');
            md.push_str(&note(inputs, "mesh-store"));
        }
    }
    files.push((
        PathBuf::from(PLOT_DIR).join("mesh-setup-vs-leaves.svg"),
        svg::line_chart(&LineChart {
            title: "Induced mesh setup time vs leaves (median)".into(),
            x_label: "leaves (log scale)".into(),
            y_label: "seconds (log scale)".into(),
            x_scale: Scale::Log,
            y_scale: Scale::Log,
            series: by_leaves,
        }),
    ));
    files.push((
        PathBuf::from(PLOT_DIR).join("mesh-setup-vs-tunnels.svg"),
        svg::line_chart(&LineChart {
            title: "Induced mesh setup time vs induced tunnels n·(n-1)".into(),
            x_label: "induced TunnelEndpoints (log scale)".into(),
            y_label: "seconds (log scale)".into(),
            x_scale: Scale::Log,
            y_scale: Scale::Log,
            series: by_tunnels,
        }),
    ));

    for (name, title) in [
        (
            "mesh-hub-processes",
            "### The hub as processes: CPU time and peak memory",
        ),
        (
            "mesh-hub-etcd",
            "### The hub as processes on etcd: CPU, memory and etcd writes per induced tunnel",
        ),
        ("mesh-etcd", "### Every service a process with its own etcd"),
    ] {
        let _ = writeln!(md, "{title}\n");
        match parse::<MeshResult>(inputs, name) {
            Err(why) => {
                let _ = writeln!(md, "Not measured: {why}.\n");
            }
            Ok(p) => {
                let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
                md.push_str(&note(inputs, name));
                if let Some(params) = &p.doc.parameters {
                    let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
                }
                if p.doc.mode.is_none() {
                    md.push_str("(The result does not name its mode.)\n\n");
                }
                md.push_str("| leaves | status | median s | runs (s) | hub CPU s during setup | hub CPU ms per induced tunnel | hub CPU s per process during setup | hub peak RSS MiB (sum) | peak RSS MiB per process | hub etcd keys | hub etcd writes per induced tunnel | hub store retries, watch events, relay retries per induced tunnel |\n");
                md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
                for s in &p.doc.sizes {
                    let per = |f: &dyn Fn(&HubProcess) -> String| {
                        s.hub_processes.as_ref().map_or("—".into(), |ps| {
                            ps.iter()
                                .map(|p| format!("{} {}", p.service, f(p)))
                                .collect::<Vec<_>>()
                                .join(", ")
                        })
                    };
                    let _ = writeln!(
                        md,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                        s.leaves,
                        status_text(s),
                        opt(s.converged_median(), 3),
                        runs_text(s),
                        opt(s.hub_cpu_seconds_during_setup, 2),
                        opt(s.median_hub_cpu_ms_per_induced_tunnel, 3),
                        per(&|p| num(p.cpu_seconds_during_setup, 2)),
                        opt(s.hub_peak_rss_kib_total.map(|k| k as f64 / 1024.0), 1),
                        per(&|p| num(p.peak_rss_kib as f64 / 1024.0, 1)),
                        s.hub_etcd_keys.as_ref().map_or("—".into(), |k| {
                            k.iter()
                                .map(|(s, n)| format!("{s} {n}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        }),
                        opt(s.median_hub_etcd_writes_per_induced_tunnel, 2),
                        match (
                            s.median_hub_store_retries_per_induced_tunnel,
                            s.median_hub_watch_events_per_induced_tunnel,
                            s.median_hub_relay_retries_per_induced_tunnel,
                        ) {
                            (Some(r), Some(w), Some(f)) => format!("{r:.3}, {w:.2}, {f:.3}"),
                            _ => "—".into(),
                        }
                    );
                }
                md.push('\n');
            }
        }
    }
}

fn status_text(s: &MeshSize) -> String {
    match s.status() {
        "converged" => "converged".into(),
        other => format!(
            "**{}**{}",
            other.replace('_', " "),
            s.reason
                .as_deref()
                .map(|r| format!(": {}", r.replace('|', "/").replace('\n', " ")))
                .unwrap_or_default()
        ),
    }
}

pub(super) fn runs_text(s: &MeshSize) -> String {
    if s.runs.is_empty() {
        return "—".into();
    }
    s.runs
        .iter()
        .map(|r| {
            let time = if !r.converged {
                format!("> {}", num(r.seconds, 0))
            } else {
                num(r.seconds, 3)
            };
            match r.peer_retries {
                Some(n) if n > 0 => format!("{time} ({n} Peer retries)"),
                _ => time,
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}
