#!/usr/bin/env bash
# Runs the benchmark suite and regenerates docs/benchmarks.md and docs/bench/*.svg from the
# results: `scripts/bench.sh full` (make bench: bench/results/*.json) or `scripts/bench.sh quick`
# (make bench-quick: smaller sizes, fewer requests; bench/results/quick/*.json, so a quick run
# never overwrites the full results; the document shows the newer run of each benchmark and says
# which). A benchmark that fails does not stop the others; the document is regenerated from
# whatever results exist and the script then exits non-zero.
#
# Environment: TRELLIS_BENCH_NOTE (a note on the run's conditions, recorded in every result),
# TRELLIS_BENCH_ONLY (benchmark binaries to run, space-separated, e.g. "mesh-bench"; the others
# keep their previous results and the document says which run each comes from),
# CARGO_TARGET_DIR (where the release build lives; the Makefile sets it).
set -euo pipefail

kind=${1:-full}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
case "$kind" in
  full) out=bench/results ;;
  quick) out=bench/results/quick ;;
  *) echo "usage: $0 full|quick" >&2; exit 2 ;;
esac
mkdir -p "$out"

log() { printf 'bench: %s\n' "$*" >&2; }

# The service binaries are started as processes by mesh-bench (hub-processes and etcd modes) and
# dataplane-bench: build them together with the benchmarks, in release mode. lab-bench runs the
# trellis-lab binary.
log "building the benchmarks and the service binaries (release)"
cargo build --release --locked -p trellis-bench --bins \
  -p trellis-ipam -p trellis-discovery -p trellis-broker -p trellis-forwarder \
  -p trellis-gateway -p trellis-endpoints -p trellis-route -p trellis-lab
bin="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release"

failed=()
only=${TRELLIS_BENCH_ONLY:-}
selected() { [ -z "$only" ] || [[ " $only " == *" $1 "* ]]; }
run() {
  local name=$1; shift
  if ! selected "$name"; then
    log "$name: skipped (TRELLIS_BENCH_ONLY=$only); its previous result is kept"
    return 0
  fi
  log "$name: $*"
  local started=$SECONDS
  if "$bin/$name" --run-kind "$kind" "$@"; then
    log "$name: done in $((SECONDS - started)) s"
  else
    log "$name: FAILED (exit $?); its previous result, if any, is kept"
    failed+=("$name")
  fi
}

# The reference the mesh benchmarks are compared with in the same run (docs/benchmarks.md,
# "against main"): TRELLIS_BENCH_REFERENCE (default main; "none" skips it), checked out in a
# scratch worktree with this run's bench/ harness over it, so both builds record the same
# fields, and built in release into its own target directory.
reference=${TRELLIS_BENCH_REFERENCE:-main}
refbin=""
if [ "$reference" != none ] && selected mesh-bench; then
  target="$(dirname "$bin")"
  refsrc="$target/bench-reference/src"
  log "building the reference ($reference) with this run's benchmark harness (release)"
  if { git worktree remove --force "$refsrc" >/dev/null 2>&1 || rm -rf "$refsrc"; } &&
    git worktree prune &&
    git worktree add --force --detach "$refsrc" "$reference" >/dev/null &&
    rm -rf "$refsrc/bench" && cp -r bench "$refsrc/bench" &&
    (cd "$refsrc" && export CARGO_TARGET_DIR="$target/bench-reference/target" &&
      cargo build --release -p trellis-bench --bin mesh-bench &&
      # Separately: `--bin` would limit every package to that binary, and hub-processes and
      # hub-etcd need the reference's service binaries.
      cargo build --release --bins -p trellis-ipam -p trellis-discovery -p trellis-broker \
        -p trellis-forwarder -p trellis-gateway -p trellis-endpoints); then
    refbin="$target/bench-reference/target/release"
  else
    log "reference build FAILED: the mesh benchmarks are not compared with $reference"
    failed+=("reference-build")
  fi
fi
# Runs the reference's mesh-bench with the same arguments (the last two: --out FILE, given as
# <name>-main.json next to it).
run_reference() {
  [ -n "$refbin" ] || return 0
  local args=("$@") n=${#args[@]}
  local out_file=${args[$((n - 1))]}
  args[$((n - 1))]="$root/${out_file%.json}-main.json"
  log "mesh-bench (reference $reference): ${args[*]}"
  # From the reference's tree, so the result records its commit.
  if ! (cd "$refsrc" && "$refbin/mesh-bench" --run-kind "$kind" \
    --note "reference $reference, run right after this build's; ${TRELLIS_BENCH_NOTE:-}" \
    "${args[@]}"); then
    log "mesh-bench (reference): FAILED; its previous result, if any, is kept"
    failed+=("mesh-bench-reference")
  fi
}

if [ "$kind" = quick ]; then
  run ipam-bench --requests 2000 --new-clusters 100 --repeats 3 --consistency-endpoints 200 \
    --out "$out/ipam.json"
  mesh=(--mode in-process --leaves 2,5,10,20 --repeats 3 --timeout 60 --out "$out/mesh.json")
  run mesh-bench "${mesh[@]}"
  run_reference "${mesh[@]}"
  hubp=(--mode hub-processes --leaves 2,5,10 --repeats 3 --timeout 60
    --out "$out/mesh-hub-processes.json")
  run mesh-bench "${hubp[@]}"
  run_reference "${hubp[@]}"
  run mesh-bench --mode hub-etcd --leaves 2,5 --repeats 2 --timeout 60 \
    --out "$out/mesh-hub-etcd.json"
  run mesh-bench --mode etcd-processes --leaves 2 --repeats 2 --timeout 60 \
    --out "$out/mesh-etcd.json"
  run tls-bench --leaves 10 --repeats 2 --timeout 60 --out "$out/tls.json"
  run lab-bench --leaves 10 --repeats 2 --timeout 60 --out "$out/lab.json"
  run endpoints-bench --reflections 80 --repeats 3 --out "$out/endpoints.json"
  run exports-bench --leaves 5 --samples 20 --bulk-endpoints 200 --repeats 2 \
    --out "$out/exports.json"
  dataplane=(--samples 10 --iperf-seconds 3 --rounds 2 --out "$out/dataplane.json")
  nodes=(--scenario node-path --samples 10 --iperf-seconds 3 --out "$out/dataplane-nodes.json")
  rules=(--rounds 2 --pings-per-round 15 --out "$out/gateway-rules.json")
  failover=(--kills 6 --connections 5 --out "$out/failover.json")
  nat=(--leaves-per-kind 2 --repeats 1 --pings 100 --iperf-seconds 3 --out "$out/nat.json")
else
  run ipam-bench --out "$out/ipam.json"
  mesh=(--mode in-process --leaves 2,5,10,20,50,100,254 --repeats 3 --timeout 180
    --out "$out/mesh.json")
  run mesh-bench "${mesh[@]}"
  run_reference "${mesh[@]}"
  hubp=(--mode hub-processes --leaves 2,5,10,20,50,100 --repeats 3 --timeout 300
    --out "$out/mesh-hub-processes.json")
  run mesh-bench "${hubp[@]}"
  run_reference "${hubp[@]}"
  # Three runs a size: issue 40's targets are a median and the spread of three runs.
  hube=(--mode hub-etcd --leaves 10,50,100,254 --repeats 3 --timeout 600
    --out "$out/mesh-hub-etcd.json")
  run mesh-bench "${hube[@]}"
  run_reference "${hube[@]}"
  run mesh-bench --mode etcd-processes --leaves 2,5 --repeats 3 --timeout 300 \
    --out "$out/mesh-etcd.json"
  run tls-bench --out "$out/tls.json"
  run lab-bench --out "$out/lab.json"
  run endpoints-bench --out "$out/endpoints.json"
  run exports-bench --out "$out/exports.json"
  dataplane=(--out "$out/dataplane.json")
  nodes=(--scenario node-path --out "$out/dataplane-nodes.json")
  rules=(--out "$out/gateway-rules.json")
  failover=(--out "$out/failover.json")
  nat=(--out "$out/nat.json")
fi

# The data plane needs root (network namespaces, nftables, tc), iperf3, sockperf, and wireguard-go
# with wg (the reference tunnel it is compared with).
missing=()
[ "$(id -u)" -eq 0 ] || missing+=("root")
for tool in ip tc nft ping iperf3 sockperf wireguard-go wg; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  log "dataplane-bench SKIPPED: it needs ${missing[*]}. docs/benchmarks.md keeps showing the"
  log "previous data-plane result and says which run it is from. Run \`sudo make bench\` for it."
else
  bash scripts/install-gotatun.sh || log "gotatun-cli could not be installed; dataplane-bench says GotaTun was not measured"
  run dataplane-bench "${dataplane[@]}"
  run dataplane-bench "${nodes[@]}"
  run gateway-rules-bench "${rules[@]}"
fi

# Gateway failover: root (network namespaces), python3 for the flows, conntrack for the handoff.
missing=()
[ "$(id -u)" -eq 0 ] || missing+=("root")
for tool in ip nft ping python3 conntrack; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  log "failover-bench SKIPPED: it needs ${missing[*]}. docs/benchmarks.md keeps showing the"
  log "previous failover result and says which run it is from. Run \`sudo make bench\` for it."
else
  run failover-bench "${failover[@]}"
fi

# NAT traversal: root (network namespaces, the NAT routers' nftables), python3 for the probes,
# iperf3 for the relayed and direct throughput.
missing=()
[ "$(id -u)" -eq 0 ] || missing+=("root")
for tool in ip nft ping python3 iperf3; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
  log "nat-bench SKIPPED: it needs ${missing[*]}. docs/benchmarks.md keeps showing the"
  log "previous NAT result and says which run it is from. Run \`sudo make bench\` for it."
else
  run nat-bench "${nat[@]}"
fi

log "regenerating docs/benchmarks.md and docs/bench/*.svg"
"$bin/bench-report" --root "$root"

if ((${#failed[@]})); then
  log "FAILED: ${failed[*]} (see above); the document shows their previous results"
  exit 1
fi
log "done"
