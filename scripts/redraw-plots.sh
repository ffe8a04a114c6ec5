#!/usr/bin/env bash
# Regenerates docs/benchmarks.md and docs/bench/*.svg from the existing benchmark results
# (bench/results/*.json, bench/results/quick/*.json) and notes (bench/notes/*.md); measures
# nothing. `--check` only verifies that the committed files are up to date.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
exec cargo run --quiet --locked -p trellis-bench --bin bench-report -- --root "$root" "$@"
