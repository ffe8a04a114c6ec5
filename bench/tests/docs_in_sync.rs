//! The committed docs/benchmarks.md and docs/bench/*.svg must be exactly what the generator
//! produces from the committed results and notes: the document can never be edited by hand
//! out of sync with the measurements.

use std::path::Path;

#[test]
fn committed_benchmark_docs_match_the_generator() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let output =
        trellis_bench::report::generate(&root).expect("the results and notes are readable");
    let differ = output.differences(&root);
    assert!(
        differ.is_empty(),
        "{} differ from what bench-report generates from bench/results and bench/notes; \
         regenerate them with `make bench-report` (never edit them by hand)",
        differ
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
}
