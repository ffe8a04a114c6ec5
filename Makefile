# Trellis developer entry points. `make test` is what CI runs (.ci/run).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

ROOT := $(CURDIR)
export PATH := $(ROOT)/.tools/bin:$(HOME)/.cargo/bin:$(PATH)
# Reuse one target dir across clones and runs (builds are slow on 2 cores).
export CARGO_TARGET_DIR ?= $(HOME)/.cache/trellis/target
export CARGO_TERM_COLOR ?= never

.PHONY: demo setup test fmt-check clippy lint-proto validate-deploy build nextest fmt bench-ipam bench-mesh bench-endpoints clean

setup:
	bash scripts/setup.sh

fmt-check:
	cargo fmt --all -- --check

clippy:
	cargo clippy --workspace --all-targets --locked -- -D warnings

lint-proto:
	buf lint
	buf build -o /dev/null

# docker-compose.yml against the compose-spec schema, every kustomize overlay rendered and
# validated strictly against the Kubernetes schemas (offline). Flag consistency with the
# binaries is tests/integration/tests/deploy_flags.rs.
validate-deploy:
	bash scripts/validate-deploy.sh

# Binaries first: the multi-process tests in tests/integration start them.
build:
	cargo build --workspace --bins --locked

nextest: build
	cargo nextest run --workspace --locked --no-fail-fast

test: setup fmt-check lint-proto validate-deploy clippy nextest

fmt:
	cargo fmt --all

# The README's main command: a hub and two leaves with the same pod CIDR, until Ctrl-C.
demo: setup
	cargo run --locked -p trellis-lab --bin trellis-lab -- up --same-pod-cidr

# MapEndpointIp throughput and latency over gRPC, memory and etcd stores (docs/benchmarks.md).
bench-ipam: setup
	cargo run --release --locked -p trellis-bench --bin ipam-bench -- --out bench/results/ipam.json

# Induced mesh setup time, 1 hub + 2..50 leaves in process (docs/benchmarks.md).
bench-mesh: setup
	cargo run --release --locked -p trellis-bench --bin mesh-bench -- --out bench/results/mesh.json

# Reflected endpoints per second, local and remote-IPAM paths (docs/benchmarks.md).
bench-endpoints: setup
	cargo run --release --locked -p trellis-bench --bin endpoints-bench -- --out bench/results/endpoints.json

# Leaf-to-leaf RTT with induced peering vs through the hub under tc netem (180 ms hub links,
# 20 ms leaf link), and tunnel vs bare veth throughput, in network namespaces: root only
# (docs/benchmarks.md). The service binaries it starts are built in release mode first.
bench-dataplane: setup
	cargo build --release --locked --bins -p trellis-ipam -p trellis-discovery -p trellis-broker \
		-p trellis-forwarder -p trellis-gateway -p trellis-endpoints
	cargo run --release --locked -p trellis-bench --bin dataplane-bench -- --out bench/results/dataplane.json

clean:
	cargo clean
