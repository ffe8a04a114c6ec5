//! The induced mesh against the reference build (main) measured in the same run.

use std::fmt::Write as _;

use super::format::{opt, run_line};
use super::inputs::{Inputs, REFERENCES};
use super::notes::note;
use super::parse::parse;
use crate::results::{MeshResult, MeshSize};

/// The mesh results next to the reference build's from the same run (ratio = this build /
/// the reference: below 1 is faster or cheaper).
pub(super) fn mesh_reference_section(md: &mut String, inputs: &Inputs) {
    md.push_str(
        "## Induced mesh against main, in the same run

",
    );
    md.push_str(&note(inputs, "mesh-reference"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    let pair = |a: Option<f64>, b: Option<f64>, d: usize| {
        format!("{} / {} ({})", opt(a, d), opt(b, d), ratio(a, b))
    };
    for (name, reference, label) in REFERENCES {
        let _ = writeln!(
            md,
            "### {label}
"
        );
        let (ours, theirs) = match (
            parse::<MeshResult>(inputs, name),
            parse::<MeshResult>(inputs, reference),
        ) {
            (Ok(ours), Ok(theirs)) => (ours, theirs),
            (Err(why), _) | (_, Err(why)) => {
                let _ = writeln!(
                    md,
                    "Not compared: {why}.
"
                );
                continue;
            }
        };
        let _ = writeln!(
            md,
            "{}
",
            run_line(&ours.path, &ours.common)
        );
        let _ = writeln!(
            md,
            "{}
",
            run_line(&theirs.path, &theirs.common)
        );
        md.push_str(
            "Each cell: this build / main (ratio).

",
        );
        md.push_str("| leaves | setup s | all full tunnels s | 90→100 % share of the setup | hub CPU ms per induced tunnel | hub peak RSS MiB | bench process peak RSS MiB | bench process CPU s |
");
        md.push_str(
            "|---|---|---|---|---|---|---|---|
",
        );
        for s in &ours.doc.sizes {
            let Some(r) = theirs.doc.sizes.iter().find(|r| r.leaves == s.leaves) else {
                continue;
            };
            let rss = |x: &MeshSize| x.hub_peak_rss_kib_total.map(|k| k as f64 / 1024.0);
            let own_rss = |x: &MeshSize| x.median_process_peak_rss_kib.map(|k| k as f64 / 1024.0);
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                s.leaves,
                pair(s.converged_median(), r.converged_median(), 2),
                pair(
                    s.median_full_tunnels_seconds,
                    r.median_full_tunnels_seconds,
                    2
                ),
                pair(s.median_tail_share, r.median_tail_share, 2),
                pair(
                    s.median_hub_cpu_ms_per_induced_tunnel,
                    r.median_hub_cpu_ms_per_induced_tunnel,
                    3
                ),
                pair(rss(s), rss(r), 1),
                pair(own_rss(s), own_rss(r), 0),
                pair(
                    s.median_process_cpu_seconds,
                    r.median_process_cpu_seconds,
                    1
                ),
            );
        }
        md.push('\n');
    }
}
