//! The service exports section (`ExportService` across an induced mesh).

use std::fmt::Write as _;

use super::document::opening;
use super::format::{compact, num};
use super::inputs::Inputs;
use super::parse::parse;
use super::targets::{Target, Verdict};
use crate::ratio;
use crate::results::ExportsResult;

pub(super) fn exports_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Service exports across an induced mesh (`ExportService`)\n\n");
    let Some(p) = opening::<ExportsResult>(md, inputs, "exports") else {
        return;
    };
    let d = &p.doc;
    if let Some(params) = &d.parameters {
        let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
    }
    let _ = writeln!(
        md,
        "Induced mesh complete {} s after the first Peer call.\n",
        num(d.mesh_seconds, 1)
    );
    md.push_str("| measurement | result |\n|---|---|\n");
    if let Some(l) = &d.change_latency {
        let _ = writeln!(
            md,
            "| export change → changed slice at an induced consumer ({} changes) | p50 {} ms, p99 {} ms, max {} ms |",
            l.operations,
            num(l.p50_ms, 1),
            num(l.p99_ms, 1),
            num(l.max_ms, 1)
        );
    }
    let runs = d
        .bulk_seconds
        .iter()
        .map(|s| num(*s, 2))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(
        md,
        "| bulk export at every consumer: seconds per run | {runs} |\n| reflected endpoints per second (consumers × endpoints / median) | {} |",
        num(d.reflected_endpoints_per_second, 0)
    );
    if let Some(l) = &d.dns_resolvable {
        let _ = writeln!(
            md,
            "| new export → its `clusterset.local` name answers at an induced consumer ({} exports) | p50 {} ms, p99 {} ms, max {} ms |",
            l.operations,
            num(l.p50_ms, 1),
            num(l.p99_ms, 1),
            num(l.max_ms, 1)
        );
    }
    for load in [&d.dns, &d.dns_peer].into_iter().flatten() {
        let _ = writeln!(
            md,
            "| DNS under load, {}: {} resolvers, {} s | {} answered queries/s, p50 {} ms, p99 {} ms, {} of {} unanswered |",
            load.server,
            load.clients,
            num(load.seconds, 0),
            num(load.latency.ops_per_second, 0),
            num(load.latency.p50_ms, 3),
            num(load.latency.p99_ms, 3),
            load.unanswered,
            load.sent
        );
    }
    if let (Some(ours), Some(peer)) = (&d.dns, &d.dns_peer) {
        let _ = writeln!(
            md,
            "| DNS queries/s, Trellis / {} (same load, same run) | {} |",
            peer.server,
            ratio(
                Some(ours.latency.ops_per_second),
                Some(peer.latency.ops_per_second)
            )
            .map_or_else(|| "–".to_owned(), |r| num(r, 2))
        );
    }
    md.push('\n');
}

/// The DNS target of issue 38: a new export's name answers at an induced consumer within 2 s
/// (p99), where the MCS conformance suite allows 20 s.
pub(super) fn dns_targets(inputs: &Inputs) -> Vec<Target> {
    const TARGET: &str = "export → name resolvable at an induced consumer, p99 under 2 s \
                          (issue 38)";
    let (measured, verdict) = match parse::<ExportsResult>(inputs, "exports") {
        Err(why) => (why, Verdict::NotMeasured),
        Ok(p) => match &p.doc.dns_resolvable {
            None => (
                "no DNS measurement in the result".to_owned(),
                Verdict::NotMeasured,
            ),
            Some(l) => (
                format!(
                    "p99 {} ms over {} exports (p50 {} ms)",
                    num(l.p99_ms, 1),
                    l.operations,
                    num(l.p50_ms, 1)
                ),
                if l.p99_ms < 2000.0 {
                    Verdict::Met
                } else {
                    Verdict::NotMet
                },
            ),
        },
    };
    vec![Target {
        target: TARGET,
        measured,
        verdict,
    }]
}
