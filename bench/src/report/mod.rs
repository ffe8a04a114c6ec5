//! The report generator behind `bench-report`: reads the benchmark results
//! (`bench/results/*.json`, and `bench/results/quick/*.json` from `make bench-quick`) and the
//! hand-written notes (`bench/notes/*.md`), and produces `docs/benchmarks.md` and the SVG plots
//! in `docs/bench/`. Every number in the output comes from the JSON: tables directly, and the
//! notes through `{{benchmark:/json/pointer}}` placeholders (`{{…|N}}` for N decimals).
//!
//! For each benchmark the newer of the full and the quick result is shown (by the run's
//! timestamp; results written before runs were timestamped count as oldest), and its section
//! says which run it is. Missing or unreadable results are reported as such, never invented.
//! Output depends on the inputs only (no clock), so a test can regenerate it and compare.

use std::path::Path;

mod dataplane;
mod dataplane_targets;
mod document;
mod endpoints;
mod exports;
mod failover;
mod format;
mod gateway_rules;
mod inputs;
mod ipam;
mod lab;
mod mesh;
mod mesh_reference;
mod mesh_targets;
mod nat;
mod node_path;
mod notes;
mod output;
mod parse;
mod targets;
mod tls;

pub use document::render;
pub use format::num;
pub use inputs::{BENCHMARKS, HISTORY, Inputs, Loaded, REFERENCES, newest};
pub use notes::fill;
pub use output::{DOC, Output, PLOT_DIR};
pub use targets::{Target, Verdict, power_fit, targets};

/// Reads everything under `root` and renders it.
pub fn generate(root: &Path) -> anyhow::Result<Output> {
    Ok(render(&Inputs::read(root)?))
}

#[cfg(test)]
mod tests;
