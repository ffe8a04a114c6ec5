//! The mesh's targets: a mesh size's figure or why it is missing, and the figures of issues 17
//! and 40 each beside main's from the same run.

use super::format::num;
use super::inputs::Inputs;
use super::parse::{Parsed, parse};
use super::targets::{Target, Verdict};
use crate::results::{MeshResult, MeshSize};

pub(super) fn mesh_target_size(
    mesh: &Result<Parsed<MeshResult>, String>,
    leaves: usize,
) -> (String, Option<&MeshSize>) {
    match mesh {
        Err(why) => (why.clone(), None),
        Ok(p) => match p.doc.sizes.iter().find(|s| s.leaves == leaves) {
            None => (
                format!(
                    "1 hub + {leaves} leaves not in `{}` (sizes run: {})",
                    p.path,
                    p.doc
                        .sizes
                        .iter()
                        .map(|s| s.leaves.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                None,
            ),
            Some(s) => (String::new(), Some(s)),
        },
    }
}

pub(super) fn not_converged_text(s: &MeshSize) -> String {
    format!(
        "1 hub + {} leaves: {}{}",
        s.leaves,
        s.status().replace('_', " "),
        s.reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    )
}

/// One figure of issue 17: `value` of `leaves` in `doc` (and of its `-main` reference run),
/// met when `met` holds.
struct ScaleTarget {
    target: &'static str,
    doc: &'static str,
    leaves: usize,
    unit: &'static str,
    value: fn(&MeshSize) -> Option<f64>,
    met: fn(f64) -> bool,
}

/// The spread of a size's converged runs: the slowest over the fastest.
fn spread(s: &MeshSize) -> Option<f64> {
    let runs: Vec<f64> = s
        .runs
        .iter()
        .filter(|r| r.converged)
        .map(|r| r.seconds)
        .collect();
    let (min, max) = runs
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    (runs.len() >= 3 && min > 0.0).then(|| max / min)
}

/// The targets of issues 17 and 40, each with main's figure from the same run and the ratio.
pub(super) fn scale_targets(
    inputs: &Inputs,
    mesh: &Result<Parsed<MeshResult>, String>,
) -> Vec<Target> {
    let figures = [
        ScaleTarget {
            target: "1 hub + 254 leaves in process converge in under 30 s (issue 17)",
            doc: "mesh",
            leaves: 254,
            unit: " s",
            value: MeshSize::converged_median,
            met: |v| v < 30.0,
        },
        ScaleTarget {
            target: "every full tunnel up within 10 s at 254 leaves (issue 17)",
            doc: "mesh",
            leaves: 254,
            unit: " s",
            value: |s| s.median_full_tunnels_seconds,
            met: |v| v <= 10.0,
        },
        ScaleTarget {
            target: "90 → 100 % of the induced tunnels under 20 % of the setup at 254 leaves (issue 17)",
            doc: "mesh",
            leaves: 254,
            unit: "",
            value: |s| s.median_tail_share,
            met: |v| v < 0.2,
        },
        ScaleTarget {
            target: "1 hub + 100 leaves in process under 4 s (issue 17)",
            doc: "mesh",
            leaves: 100,
            unit: " s",
            value: MeshSize::converged_median,
            met: |v| v < 4.0,
        },
        ScaleTarget {
            target: "hub CPU per induced tunnel at most 0.1 ms, hub as processes, 100 leaves (issue 17)",
            doc: "mesh-hub-processes",
            leaves: 100,
            unit: " ms",
            value: |s| s.median_hub_cpu_ms_per_induced_tunnel,
            met: |v| v <= 0.1,
        },
        ScaleTarget {
            target: "1 hub + 254 leaves in process peak under 1.5 GB of RSS, the bench's own reading (issue 17)",
            doc: "mesh",
            leaves: 254,
            unit: " GB",
            // Each run is a process of its own (mesh-bench's `--one-run`), so its peak is its own.
            value: |s| {
                s.median_process_peak_rss_kib
                    .map(|kib| kib as f64 * 1024.0 / 1e9)
            },
            met: |v| v < 1.5,
        },
        ScaleTarget {
            target: "1 hub on etcd + 254 leaves converge in under 15 s, the median of three runs (issue 40)",
            doc: "mesh-hub-etcd",
            leaves: 254,
            unit: " s",
            value: MeshSize::converged_median,
            met: |v| v < 15.0,
        },
        ScaleTarget {
            target: "1 hub on etcd + 254 leaves: the slowest of three runs under 1.3× the fastest (issue 40)",
            doc: "mesh-hub-etcd",
            leaves: 254,
            unit: "×",
            value: spread,
            met: |v| v < 1.3,
        },
        ScaleTarget {
            target: "hub on etcd: hub CPU per induced tunnel under 0.2 ms at 254 leaves (issue 40)",
            doc: "mesh-hub-etcd",
            leaves: 254,
            unit: " ms",
            value: |s| s.median_hub_cpu_ms_per_induced_tunnel,
            met: |v| v < 0.2,
        },
        ScaleTarget {
            target: "hub on etcd: etcd writes per induced tunnel under 1.5 at 254 leaves (issue 40)",
            doc: "mesh-hub-etcd",
            leaves: 254,
            unit: "",
            value: |s| s.median_hub_etcd_writes_per_induced_tunnel,
            met: |v| v < 1.5,
        },
    ];
    figures
        .into_iter()
        .map(|f| {
            let other;
            let doc = if f.doc == "mesh" {
                mesh
            } else {
                other = parse::<MeshResult>(inputs, f.doc);
                &other
            };
            let (why, size) = mesh_target_size(doc, f.leaves);
            let Some(value) = size.and_then(f.value) else {
                return Target {
                    target: f.target,
                    measured: size.map_or(why, not_converged_text),
                    verdict: Verdict::NotMeasured,
                };
            };
            let reference = parse::<MeshResult>(inputs, &format!("{}-main", f.doc));
            let main = match mesh_target_size(&reference, f.leaves) {
                (_, Some(s)) => (f.value)(s),
                _ => None,
            };
            let measured = match main {
                Some(main) if main > 0.0 => format!(
                    "{}{unit}; main in the same run {}{unit} (ratio {})",
                    num(value, 3),
                    num(main, 3),
                    num(value / main, 2),
                    unit = f.unit
                ),
                _ => format!("{}{}; main not measured in this run", num(value, 3), f.unit),
            };
            Target {
                target: f.target,
                measured,
                verdict: if (f.met)(value) {
                    Verdict::Met
                } else {
                    Verdict::NotMet
                },
            }
        })
        .collect()
}
