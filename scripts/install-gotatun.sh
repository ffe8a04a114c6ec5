#!/usr/bin/env bash
# Installs `gotatun` (crate gotatun-cli), the userspace WireGuard device of GotaTun, into
# .tools/bin for the data-plane benchmark's side by side (ADR 0031). Idempotent; the release
# build takes a few minutes on 2 cores the first time (it compiles aws-lc), so only the
# benchmarks call it, never `make test`. Its build artifacts go to a target dir of their own,
# deleted afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.10.2
tools="$PWD/.tools"
log() { printf 'install-gotatun: %s\n' "$*" >&2; }
if "$tools/bin/gotatun" --version 2>/dev/null | grep -q "$version"; then
  exit 0
fi
log "building gotatun-cli $version from crates.io (a few minutes)"
target="${CARGO_TARGET_DIR:-$HOME/.cache/trellis/target}/gotatun-cli"
CARGO_TARGET_DIR="$target" cargo install gotatun-cli --version "$version" --locked \
  --root "$tools" --quiet
rm -rf "$target"
log "ok: $("$tools/bin/gotatun" --version | head -n1)"
