//! The price of mutual TLS (issue 37): the induced mesh's setup with TLS against plaintext.

use std::fmt::Write as _;

use super::document::opening;
use super::format::num;
use super::inputs::Inputs;
use super::parse::parse;
use super::targets::{Target, Verdict};
use crate::results::TlsResult;

/// Issue 37: the ratio is measured, whatever it is (the issue asks for the price, not a bound).
pub(super) fn tls_targets(inputs: &Inputs) -> Vec<Target> {
    const TARGET: &str = "mutual TLS: mesh setup at 100 leaves with TLS against plaintext in \
                          the same run, as a ratio (issue 37)";
    let measured = match parse::<TlsResult>(inputs, "tls") {
        Err(why) => {
            return vec![Target {
                target: TARGET,
                measured: why,
                verdict: Verdict::NotMeasured,
            }];
        }
        Ok(p) => p,
    };
    let d = &measured.doc;
    let (verdict, text) = match (d.ratio, d.parameters.leaves) {
        (Some(ratio), leaves) if leaves >= 100 => (
            Verdict::Met,
            format!(
                "{} leaves: TLS {} s, plaintext {} s, ratio {}",
                leaves,
                num(d.tls_median_seconds.unwrap_or(f64::NAN), 2),
                num(d.plaintext_median_seconds.unwrap_or(f64::NAN), 2),
                num(ratio, 2)
            ),
        ),
        (Some(ratio), leaves) => (
            Verdict::NotMeasured,
            format!("only {leaves} leaves (ratio {})", num(ratio, 2)),
        ),
        (None, _) => (Verdict::NotMeasured, "no run of a kind converged".into()),
    };
    vec![Target {
        target: TARGET,
        measured: text,
        verdict,
    }]
}

pub(super) fn tls_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Mutual TLS against plaintext: the mesh's setup\n\n");
    let Some(p) = opening::<TlsResult>(md, inputs, "tls") else {
        return;
    };
    let d = &p.doc;
    let _ = writeln!(
        md,
        "1 hub + {} leaves in one process, {} runs of each kind, alternating.\n",
        d.parameters.leaves, d.parameters.repeats
    );
    md.push_str("| run | plaintext s | mutual TLS s |\n|---|---|---|\n");
    for (i, (plain, tls)) in d.plaintext.iter().zip(&d.tls).enumerate() {
        let shown = |r: &crate::results::MeshRun| {
            if r.converged {
                num(r.seconds, 3)
            } else {
                format!("not converged ({} s)", num(r.seconds, 0))
            }
        };
        let _ = writeln!(md, "| {} | {} | {} |", i + 1, shown(plain), shown(tls));
    }
    let _ = writeln!(
        md,
        "| **median** | **{}** | **{}** |\n",
        d.plaintext_median_seconds
            .map_or_else(|| "n/a".into(), |s| num(s, 3)),
        d.tls_median_seconds
            .map_or_else(|| "n/a".into(), |s| num(s, 3))
    );
    let _ = writeln!(
        md,
        "Mutual TLS over plaintext, medians: **{}**.\n",
        d.ratio.map_or_else(|| "n/a".into(), |r| num(r, 2))
    );
}
