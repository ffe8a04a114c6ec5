//! The service exports section (`ExportService` across an induced mesh).

use std::fmt::Write as _;

use super::document::opening;
use super::format::{compact, num};
use super::inputs::Inputs;
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
        "| bulk export at every consumer: seconds per run | {runs} |\n| reflected endpoints per second (consumers × endpoints / median) | {} |\n",
        num(d.reflected_endpoints_per_second, 0)
    );
}
