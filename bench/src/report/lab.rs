//! The lab against the benchmark (issue 34): `trellis-lab up` beside `mesh-bench`, same run.

use std::fmt::Write as _;

use super::document::opening;
use super::format::num;
use super::inputs::Inputs;
use super::parse::parse;
use super::targets::{Target, Verdict};
use crate::results::LabResult;

/// The lab may take at most this much longer than mesh-bench, setup and full tunnels alike.
const BOUND: f64 = 1.2;

/// Issue 34: at 254 leaves, the lab within 1.2× of mesh-bench, setup and full tunnels.
pub(super) fn lab_targets(inputs: &Inputs) -> Vec<Target> {
    const SETUP: &str = "`trellis-lab up --clusters 255 --same-pod-cidr --until-converged` \
                         converges within 1.2× of mesh-bench at 254 leaves, same run (issue 34)";
    const FULL: &str = "the lab's full tunnels within 1.2× of mesh-bench's at 254 leaves, same \
                        run (issue 34)";
    let measured = match parse::<LabResult>(inputs, "lab") {
        Err(why) => {
            return [SETUP, FULL]
                .into_iter()
                .map(|target| Target {
                    target,
                    measured: why.clone(),
                    verdict: Verdict::NotMeasured,
                })
                .collect();
        }
        Ok(p) => p,
    };
    let d = &measured.doc;
    let row = |target: &'static str, lab: Option<f64>, bench: Option<f64>, ratio: Option<f64>| {
        let (verdict, text) = match ratio {
            None => (
                Verdict::NotMeasured,
                "no run of a kind converged".to_owned(),
            ),
            Some(_) if d.parameters.leaves < 254 => (
                Verdict::NotMeasured,
                format!("only {} leaves", d.parameters.leaves),
            ),
            Some(r) => (
                if r <= BOUND {
                    Verdict::Met
                } else {
                    Verdict::NotMet
                },
                format!(
                    "lab {} s, mesh-bench {} s (medians of {}): ratio {}",
                    num(lab.unwrap_or(f64::NAN), 2),
                    num(bench.unwrap_or(f64::NAN), 2),
                    d.parameters.repeats,
                    num(r, 2)
                ),
            ),
        };
        Target {
            target,
            measured: text,
            verdict,
        }
    };
    vec![
        row(SETUP, d.lab_median_seconds, d.bench_median_seconds, d.ratio),
        row(
            FULL,
            d.lab_full_median_seconds,
            d.bench_full_median_seconds,
            d.full_ratio,
        ),
    ]
}

pub(super) fn lab_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## The lab against the benchmark\n\n");
    let Some(p) = opening::<LabResult>(md, inputs, "lab") else {
        return;
    };
    let d = &p.doc;
    let _ = writeln!(
        md,
        "1 hub + {} leaves, {} runs of each, alternating; the lab's command: `{}`.\n",
        d.parameters.leaves,
        d.parameters.repeats,
        d.parameters.lab_command.join(" ")
    );
    md.push_str(
        "| run | mesh-bench s | lab s | mesh-bench full tunnels s | lab full tunnels s | \
         lab CPU s (whole command) |\n|---|---|---|---|---|---|\n",
    );
    let opt = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| num(v, 3));
    for (i, (bench, lab)) in d.bench.iter().zip(&d.lab).enumerate() {
        let setup = |converged: bool, seconds: f64| {
            if converged {
                num(seconds, 3)
            } else {
                format!("not converged ({} s)", num(seconds, 0))
            }
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            i + 1,
            setup(bench.converged, bench.seconds),
            setup(lab.converged, lab.seconds),
            opt(bench.full_tunnels_seconds),
            opt(lab.full_tunnels_seconds),
            lab.process_cpu_seconds
                .map_or_else(|| "n/a".to_owned(), |v| num(v, 1)),
        );
    }
    let _ = writeln!(
        md,
        "| **median** | **{}** | **{}** | **{}** | **{}** | |\n",
        opt(d.bench_median_seconds),
        opt(d.lab_median_seconds),
        opt(d.bench_full_median_seconds),
        opt(d.lab_full_median_seconds),
    );
    let _ = writeln!(
        md,
        "The lab over mesh-bench, medians: setup **{}**, full tunnels **{}**.\n",
        d.ratio.map_or_else(|| "n/a".into(), |r| num(r, 2)),
        d.full_ratio.map_or_else(|| "n/a".into(), |r| num(r, 2)),
    );
}
