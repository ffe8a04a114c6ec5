//! The targets table: each target of issues 9, 17, 18, 33, 36 and 39 and its verdict, computed
//! from the results every time the document is generated.

use std::fmt::Write as _;

use super::dataplane_targets::{bare_path_target, dataplane_targets};
use super::exports::dns_targets;
use super::failover::failover_targets;
use super::format::num;
use super::inputs::Inputs;
use super::lab::lab_targets;
use super::mesh_targets::{mesh_target_size, not_converged_text, scale_targets};
use super::nat::nat_targets;
use super::parse::{Parsed, parse};
use super::tls::tls_targets;
use crate::results::{DataplaneResult, IpamResult, IpamScenario, MeshResult};

/// Whether a target is met.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Met,
    NotMet,
    NotMeasured,
}

impl Verdict {
    pub(super) fn text(&self) -> &'static str {
        match self {
            Verdict::Met => "**met**",
            Verdict::NotMet => "**not met**",
            Verdict::NotMeasured => "not measured",
        }
    }
}

/// One target (issues 9, 17 and 18) and what the results say about it.
#[derive(Debug, Clone)]
pub struct Target {
    pub target: &'static str,
    pub measured: String,
    pub verdict: Verdict,
}

/// Exponent k of `y ≈ c·x^k`, least squares in log-log; `None` with fewer than two points.
pub fn power_fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let logs: Vec<(f64, f64)> = points
        .iter()
        .filter(|(x, y)| *x > 0.0 && *y > 0.0)
        .map(|(x, y)| (x.ln(), y.ln()))
        .collect();
    if logs.len() < 2 {
        return None;
    }
    let n = logs.len() as f64;
    let mx = logs.iter().map(|p| p.0).sum::<f64>() / n;
    let my = logs.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = logs.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = logs.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let k = sxy / sxx;
    Some((k, (my - k * mx).exp()))
}

/// Computes every target's verdict from the results.
pub fn targets(inputs: &Inputs) -> Vec<Target> {
    let mut out = Vec::new();
    let mesh = parse::<MeshResult>(inputs, "mesh");
    let cores = mesh
        .as_ref()
        .ok()
        .and_then(|p| p.common.machine.as_ref())
        .map(|m| m.cores);

    // 1. 100 leaves under 10 s.
    let (why, size) = mesh_target_size(&mesh, 100);
    out.push(match size {
        None => Target {
            target: "100-cluster full mesh under 10 s in-process on 2 cores",
            measured: why,
            verdict: Verdict::NotMeasured,
        },
        Some(s) => match s.converged_median() {
            Some(m) => Target {
                target: "100-cluster full mesh under 10 s in-process on 2 cores",
                measured: format!(
                    "1 hub + 100 leaves: median {} s ({} cores)",
                    num(m, 3),
                    cores.map_or("?".into(), |c| c.to_string())
                ),
                verdict: if m < 10.0 {
                    Verdict::Met
                } else {
                    Verdict::NotMet
                },
            },
            None => Target {
                target: "100-cluster full mesh under 10 s in-process on 2 cores",
                measured: not_converged_text(s),
                // A run that failed (e.g. Peer requests timing out under load) did not converge
                // either; a skipped one was not tried.
                verdict: if matches!(s.status(), "timed_out" | "failed") {
                    Verdict::NotMet
                } else {
                    Verdict::NotMeasured
                },
            },
        },
    });

    // 2. Growth no worse than linear in total tunnels.
    let growth = "growth no worse than linear in total tunnels n·(n-1)";
    out.push(match &mesh {
        Err(why) => Target {
            target: growth,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(p) => {
            let points: Vec<(usize, f64)> = p
                .doc
                .sizes
                .iter()
                .filter_map(|s| Some((s.leaves, s.converged_median()?)))
                .collect();
            if points.len() < 3 {
                Target {
                    target: growth,
                    measured: format!(
                        "{} converged size(s) in `{}`; a trend needs at least 3",
                        points.len(),
                        p.path
                    ),
                    verdict: Verdict::NotMeasured,
                }
            } else {
                let xy: Vec<(f64, f64)> = points.iter().map(|(n, s)| (tunnels(*n) as f64, *s)).collect();
                let largest = &xy[xy.len() - 3..];
                let (k_large, _) = power_fit(largest).unwrap_or((f64::NAN, 0.0));
                let (k_all, _) = power_fit(&xy).unwrap_or((f64::NAN, 0.0));
                let per = |i: usize| 1000.0 * points[i].1 / tunnels(points[i].0) as f64;
                let first = points.len() - 3;
                Target {
                    target: growth,
                    measured: format!(
                        "seconds ∝ tunnels^k with k = {} over the three largest converged sizes ({}–{} leaves; k = {} over all {}); per induced tunnel {} ms at {} leaves, {} ms at {}",
                        num(k_large, 2),
                        points[first].0,
                        points[points.len() - 1].0,
                        num(k_all, 2),
                        points.len(),
                        num(per(first), 2),
                        points[first].0,
                        num(per(points.len() - 1), 2),
                        points[points.len() - 1].0
                    ),
                    verdict: if k_large <= 1.0 {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
        }
    });

    // 3. 254 leaves converge.
    let (why, size) = mesh_target_size(&mesh, 254);
    let t254 = "254 leaves (Cilium ClusterMesh's 255-cluster ceiling minus the hub) converge";
    out.push(match size {
        None => Target {
            target: t254,
            measured: why,
            verdict: Verdict::NotMeasured,
        },
        Some(s) => match s.converged_median() {
            Some(m) => Target {
                target: t254,
                measured: format!("converged, median {} s", num(m, 3)),
                verdict: Verdict::Met,
            },
            None => Target {
                target: t254,
                measured: not_converged_text(s),
                // A run that failed (e.g. Peer requests timing out under load) did not converge
                // either; a skipped one was not tried.
                verdict: if matches!(s.status(), "timed_out" | "failed") {
                    Verdict::NotMet
                } else {
                    Verdict::NotMeasured
                },
            },
        },
    });

    // 4 and 5. IPAM p99.
    let ipam = parse::<IpamResult>(inputs, "ipam");
    for (store, limit, target) in [
        ("memory", 2.0, "IPAM p99 under 2 ms with the memory store"),
        ("etcd", 10.0, "IPAM p99 under 10 ms with etcd"),
    ] {
        out.push(match &ipam {
            Err(why) => Target {
                target,
                measured: why.clone(),
                verdict: Verdict::NotMeasured,
            },
            Ok(p) => {
                let of_store: Vec<&IpamScenario> = p
                    .doc
                    .scenarios
                    .iter()
                    .filter(|s| s.store.as_str() == store)
                    .collect();
                let worst = of_store
                    .iter()
                    .max_by(|a, b| a.latency.p99_ms.total_cmp(&b.latency.p99_ms));
                match worst {
                    None => Target {
                        target,
                        measured: format!("no {store} scenario in `{}`", p.path),
                        verdict: Verdict::NotMeasured,
                    },
                    Some(w) => {
                        let over: Vec<String> = of_store
                            .iter()
                            .filter(|s| s.latency.p99_ms >= limit)
                            .map(|s| scenario_name(s))
                            .collect();
                        Target {
                            target,
                            measured: if over.is_empty() {
                                format!(
                                    "worst p99 {} ms ({}) over {} scenarios",
                                    num(w.latency.p99_ms, 3),
                                    scenario_name(w),
                                    of_store.len()
                                )
                            } else {
                                format!(
                                    "worst p99 {} ms ({}); at or over {} ms: {}",
                                    num(w.latency.p99_ms, 3),
                                    scenario_name(w),
                                    num(limit, 0),
                                    over.join("; ")
                                )
                            },
                            verdict: if over.is_empty() {
                                Verdict::Met
                            } else {
                                Verdict::NotMet
                            },
                        }
                    }
                }
            }
        });
    }

    // 6 and 7. Data plane.
    let dp = parse::<DataplaneResult>(inputs, "dataplane");
    let rtt_target = "induced leaf↔leaf RTT within 2 ms of the emulated link RTT";
    out.push(match &dp {
        Err(why) => Target {
            target: rtt_target,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(p) => match &p.doc.rtt_induced {
            None => Target {
                target: rtt_target,
                measured: format!("no induced RTT in `{}`", p.path),
                verdict: Verdict::NotMeasured,
            },
            Some(r) => {
                let over = r.median_ms - p.doc.leaf_link_rtt_ms as f64;
                let mut measured = format!(
                    "median {} ms for an emulated {} ms ({} ms above; link delays by {})",
                    num(r.median_ms, 1),
                    num(p.doc.leaf_link_rtt_ms as f64, 0),
                    num(over, 1),
                    p.doc.emulation.as_str().replace('_', " ")
                );
                if let (Some(relay), Some(bare)) = (
                    &p.doc.rtt_through_zero_delay_relay,
                    &p.doc.rtt_no_netem_tunnel,
                ) {
                    let own = relay.median_ms - bare.median_ms;
                    let _ = write!(
                        measured,
                        "; the relays' own measured cost is {} ms, without it {} ms above",
                        num(own, 2),
                        num(over - own, 1)
                    );
                }
                Target {
                    target: rtt_target,
                    measured,
                    verdict: if over <= 2.0 {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
        },
    });
    out.push(bare_path_target(
        "userspace tunnel throughput at least 30 % of the bare veth path",
        &dp,
        0.30,
    ));

    // 8 and 9 (issue 18). Against wireguard-go in the same run.
    let sbs = dp.as_ref().map_err(Clone::clone).and_then(|p| {
        p.doc.side_by_side.as_ref().ok_or_else(|| {
            format!(
                "no side-by-side comparison with wireguard-go in `{}`",
                p.path
            )
        })
    });
    let ratio_target =
        "Trellis at least 1.5× wireguard-go's throughput, one and four TCP streams, same run";
    out.push(match &sbs {
        Err(why) => Target {
            target: ratio_target,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(c) => {
            let at: Vec<Option<(u32, f64)>> = [1, 4]
                .iter()
                .map(|&n| {
                    let c = c.at(n)?;
                    Some((n, c.ratio_mbit_s?))
                })
                .collect();
            if at.iter().any(Option::is_none) {
                Target {
                    target: ratio_target,
                    measured: "the comparison lacks one or four streams".into(),
                    verdict: Verdict::NotMeasured,
                }
            } else {
                let at: Vec<(u32, f64)> = at.into_iter().flatten().collect();
                Target {
                    target: ratio_target,
                    measured: at
                        .iter()
                        .map(|(n, r)| {
                            format!(
                                "{} stream{}: ×{}",
                                n,
                                if *n == 1 { "" } else { "s" },
                                num(*r, 2)
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("; "),
                    verdict: if at.iter().all(|(_, r)| *r >= 1.5) {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
        }
    });
    let overhead_target =
        "tunnel RTT overhead (tunnel minus bare underlay, same run) at most 0.3 ms";
    out.push(match &sbs {
        Err(why) => Target {
            target: overhead_target,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(c) => match c.rtt_trellis.as_ref().map(|r| r.overhead_ms) {
            None => Target {
                target: overhead_target,
                measured: "no RTT overhead recorded".into(),
                verdict: Verdict::NotMeasured,
            },
            Some(ms) => {
                let mut measured = format!("{} ms", num(ms, 3));
                if let Some(wg) = c.rtt_wireguard_go.as_ref().map(|r| r.overhead_ms) {
                    let _ = write!(measured, " (wireguard-go: {} ms)", num(wg, 3));
                }
                Target {
                    target: overhead_target,
                    measured,
                    verdict: if ms <= 0.3 {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
        },
    });
    // Issue 17: the induced mesh at the hub's full scale, each figure beside main's in the same
    // run.
    out.extend(dataplane_targets(inputs));
    out.extend(scale_targets(inputs, &mesh));
    out.extend(failover_targets(inputs));
    out.extend(nat_targets(inputs));
    out.extend(tls_targets(inputs));
    out.extend(lab_targets(inputs));
    out.extend(dns_targets(inputs));
    out.push(ipam_relative_target(&parse::<IpamResult>(inputs, "ipam")));
    out
}

/// Induced tunnels in a mesh of `n` leaves, n·(n-1) (0 for a nonsensical 0 in a result file).
pub(super) fn tunnels(n: usize) -> usize {
    n * n.saturating_sub(1)
}

/// How many times a single point read's p99 an IPAM request may take on etcd (the proposed
/// target of issue 34: on a shared 2-core machine etcd's own latency dominates, so the target is
/// stated against a read measured in the same run).
const IPAM_RELATIVE_BOUND: f64 = 3.0;

/// Every etcd scenario's p99 within [`IPAM_RELATIVE_BOUND`] times the p99 of `known_cluster`
/// (one point read) with as many replicas, in the same run.
fn ipam_relative_target(ipam: &Result<Parsed<IpamResult>, String>) -> Target {
    const TARGET: &str = "IPAM p99 with etcd within 3× of a single point read's p99 (known_cluster) \
                          in the same run, per replica count: proposed (issue 34)";
    let p = match ipam {
        Err(why) => {
            return Target {
                target: TARGET,
                measured: why.clone(),
                verdict: Verdict::NotMeasured,
            };
        }
        Ok(p) => p,
    };
    let etcd: Vec<&IpamScenario> = p
        .doc
        .scenarios
        .iter()
        .filter(|s| s.store.as_str() == "etcd")
        .collect();
    let mut worst: Option<(f64, &IpamScenario, f64)> = None;
    for s in &etcd {
        let Some(base) = etcd
            .iter()
            .find(|b| b.replicas == s.replicas && b.path == "known_cluster")
            .map(|b| b.latency.p99_ms)
            .filter(|b| *b > 0.0)
        else {
            continue;
        };
        let ratio = s.latency.p99_ms / base;
        if worst.is_none_or(|(r, _, _)| ratio > r) {
            worst = Some((ratio, s, base));
        }
    }
    match worst {
        None => Target {
            target: TARGET,
            measured: format!("no etcd known_cluster scenario in `{}`", p.path),
            verdict: Verdict::NotMeasured,
        },
        Some((ratio, s, base)) => Target {
            target: TARGET,
            measured: format!(
                "worst {}× ({}: p99 {} ms against {} ms)",
                num(ratio, 1),
                scenario_name(s),
                num(s.latency.p99_ms, 3),
                num(base, 3)
            ),
            verdict: if ratio <= IPAM_RELATIVE_BOUND {
                Verdict::Met
            } else {
                Verdict::NotMet
            },
        },
    }
}

fn scenario_name(s: &IpamScenario) -> String {
    format!(
        "{}, {} replica{}, {} {}",
        s.store,
        s.replicas,
        if s.replicas == 1 { "" } else { "s" },
        s.rpc,
        s.path
    )
}
