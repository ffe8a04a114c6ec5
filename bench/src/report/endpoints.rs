//! The endpoint reflection section (`ReflectEndpointSlice` over gRPC).

use std::fmt::Write as _;

use super::format::{compact, num, run_line};
use super::inputs::Inputs;
use super::notes::note;
use super::parse::parse;
use crate::results::EndpointsResult;

pub(super) fn endpoints_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Endpoint reflection (`ReflectEndpointSlice` over gRPC)\n\n");
    match parse::<EndpointsResult>(inputs, "endpoints") {
        Err(why) => {
            let _ = writeln!(md, "Not measured: {why}.\n");
        }
        Ok(p) => {
            let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
            md.push_str(&note(inputs, "endpoints"));
            if let Some(params) = &p.doc.parameters {
                let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
            }
            md.push_str("| store | path | clients | endpoints per slice | endpoints/s | reflections/s | p50 ms | p99 ms | max ms |\n");
            md.push_str("|---|---|---|---|---|---|---|---|---|\n");
            for s in &p.doc.scenarios {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.store,
                    s.path,
                    s.concurrency,
                    s.slice_size,
                    num(s.endpoints_per_second, 0),
                    num(s.latency.ops_per_second, 1),
                    num(s.latency.p50_ms, 1),
                    num(s.latency.p99_ms, 1),
                    num(s.latency.max_ms, 1)
                );
            }
            md.push('\n');
        }
    }
}
