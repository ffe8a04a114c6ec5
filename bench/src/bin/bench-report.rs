//! Generates `docs/benchmarks.md` and the SVG plots in `docs/bench/` from the benchmark
//! results (`bench/results/*.json`, `bench/results/quick/*.json`) and the notes
//! (`bench/notes/*.md`). Runs nothing: `make bench` / `make bench-quick` measure, this only
//! redraws (`make bench-report`, `scripts/redraw-plots.sh`).

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use trellis_bench::report;

/// Regenerates docs/benchmarks.md and docs/bench/*.svg from the measured JSON.
#[derive(Debug, Parser)]
struct Args {
    /// The repository root (holding bench/results, bench/notes and docs/).
    #[arg(long, default_value = ".")]
    root: PathBuf,
    /// Write nothing; exit with an error when the committed files differ from what would be
    /// generated.
    #[arg(long)]
    check: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let output = report::generate(&args.root)
        .with_context(|| format!("reading the results under {}", args.root.display()))?;
    if args.check {
        let differ = output.differences(&args.root);
        if !differ.is_empty() {
            anyhow::bail!(
                "out of date (regenerate with `make bench-report`): {}",
                differ
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        eprintln!("bench-report: {} files up to date", output.files.len());
        return Ok(());
    }
    output.write(&args.root)?;
    for (path, _) in &output.files {
        eprintln!("bench-report: wrote {}", path.display());
    }
    Ok(())
}
