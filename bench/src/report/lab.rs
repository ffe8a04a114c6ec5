//! The lab against the benchmark (issue 34): `trellis-lab up` beside `mesh-bench` on the lab's
//! own clusters (`--mode lab`) and on five-service ones (`--mode in-process-tls`), same run.

use std::fmt::Write as _;

use super::document::opening;
use super::format::num;
use super::inputs::Inputs;
use super::parse::parse;
use super::targets::{Target, Verdict};
use crate::results::{LabResult, Mode};

/// The lab may take at most this much longer than mesh-bench, setup and full tunnels alike.
const BOUND: f64 = 1.2;

/// Issue 34: at 254 leaves, the lab within 1.2× of mesh-bench, setup and full tunnels.
pub(super) fn lab_targets(inputs: &Inputs) -> Vec<Target> {
    const SETUP: &str = "`trellis-lab up --clusters 255 --same-pod-cidr --until-converged` \
                         converges within 1.2× of mesh-bench measuring the same clusters \
                         (`--mode lab`) at 254 leaves, same run (issue 34)";
    const FULL: &str = "the lab's full tunnels within 1.2× of mesh-bench's on the same clusters \
                        at 254 leaves, same run (issue 34)";
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
    let bench_mode = d.parameters.bench_mode.unwrap_or(Mode::InProcessTls);
    let _ = writeln!(
        md,
        "1 hub + {} leaves, {} runs of each kind, alternating; the lab's command: `{}`. \
         mesh-bench ran `--mode {}`{}.\n",
        d.parameters.leaves,
        d.parameters.repeats,
        d.parameters.lab_command.join(" "),
        mode_name(bench_mode),
        if d.bare.is_empty() {
            String::new()
        } else {
            format!(
                " (the lab's own clusters) and `--mode {}` (five services per cluster, \
                 gateways not following their brokers, no `/metrics` served)",
                mode_name(Mode::InProcessTls)
            )
        },
    );
    let bare = !d.bare.is_empty();
    md.push_str("| run |");
    if bare {
        md.push_str(" mesh-bench five-service s |");
    }
    md.push_str(
        " mesh-bench s | lab s | mesh-bench full tunnels s | lab full tunnels s | \
         lab CPU s (whole command) |\n|---|",
    );
    md.push_str(if bare { "---|" } else { "" });
    md.push_str("---|---|---|---|---|\n");
    let opt = |v: Option<f64>| v.map_or_else(|| "n/a".to_owned(), |v| num(v, 3));
    let setup = |converged: bool, seconds: f64| {
        if converged {
            num(seconds, 3)
        } else {
            format!("not converged ({} s)", num(seconds, 0))
        }
    };
    for (i, (bench, lab)) in d.bench.iter().zip(&d.lab).enumerate() {
        let _ = write!(md, "| {} |", i + 1);
        if let Some(b) = d.bare.get(i) {
            let _ = write!(md, " {} |", setup(b.converged, b.seconds));
        } else if bare {
            md.push_str(" n/a |");
        }
        let _ = writeln!(
            md,
            " {} | {} | {} | {} | {} |",
            setup(bench.converged, bench.seconds),
            setup(lab.converged, lab.seconds),
            opt(bench.full_tunnels_seconds),
            opt(lab.full_tunnels_seconds),
            lab.process_cpu_seconds
                .map_or_else(|| "n/a".to_owned(), |v| num(v, 1)),
        );
    }
    md.push_str("| **median** |");
    if bare {
        let _ = write!(md, " **{}** |", opt(d.bare_median_seconds));
    }
    let _ = writeln!(
        md,
        " **{}** | **{}** | **{}** | **{}** | |\n",
        opt(d.bench_median_seconds),
        opt(d.lab_median_seconds),
        opt(d.bench_full_median_seconds),
        opt(d.lab_full_median_seconds),
    );
    let ratio = |r: Option<f64>| r.map_or_else(|| "n/a".into(), |r| num(r, 2));
    let _ = writeln!(
        md,
        "The lab over mesh-bench, medians: setup **{}**, full tunnels **{}**.\n",
        ratio(d.ratio),
        ratio(d.full_ratio),
    );
    if bare {
        let _ = writeln!(
            md,
            "Complete clusters over five-service ones, mesh-bench's setup medians: **{}** \
             ({} s over {} s; full tunnels {} s over {} s). The lab over mesh-bench's \
             five-service clusters: setup **{}**, full tunnels **{}**.\n",
            ratio(d.complete_cost),
            opt(d.bench_median_seconds),
            opt(d.bare_median_seconds),
            opt(d.bench_full_median_seconds),
            opt(d.bare_full_median_seconds),
            ratio(crate::ratio(d.lab_median_seconds, d.bare_median_seconds)),
            ratio(crate::ratio(
                d.lab_full_median_seconds,
                d.bare_full_median_seconds,
            )),
        );
    }
}

/// The `--mode` value people type.
fn mode_name(mode: Mode) -> String {
    use clap::ValueEnum as _;
    mode.to_possible_value()
        .map_or_else(|| format!("{mode:?}"), |v| v.get_name().to_owned())
}
