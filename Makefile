# Trellis developer entry points. `make test` is what CI runs (.ci/run).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

ROOT := $(CURDIR)
export PATH := $(ROOT)/.tools/bin:$(HOME)/.cargo/bin:$(PATH)
# Reuse one target dir across clones and runs (builds are slow on 2 cores).
export CARGO_TARGET_DIR ?= $(HOME)/.cache/trellis/target
export CARGO_TERM_COLOR ?= never

.PHONY: demo setup test fmt-check clippy doc lint-proto validate-deploy build nextest fmt bench bench-quick bench-report bench-ipam bench-mesh bench-endpoints bench-exports bench-dataplane bench-gateway-rules bench-failover bench-nat bench-tls bench-lab clean

setup:
	bash scripts/setup.sh

fmt-check:
	cargo fmt --all -- --check

clippy:
	cargo clippy --workspace --all-targets --locked -- -D warnings

# The docs of every crate, private items included (they are the project's internals guide):
# a broken or ambiguous link, or text rustdoc reads as an HTML tag, fails. Links from public
# items to private ones are fine here, where both are documented.
doc:
	RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" cargo doc --workspace --no-deps --document-private-items --locked

lint-proto:
	buf lint
	buf build -o /dev/null

# docker-compose.yml against the compose-spec schema, every kustomize overlay rendered and
# validated strictly against the Kubernetes schemas (its cert-manager resources against
# scripts/cert-manager-v1-subset.schema.json), offline. Flag consistency with the binaries is
# tests/integration/tests/deploy_flags.rs.
validate-deploy:
	bash scripts/validate-deploy.sh

# Binaries first: the multi-process tests in tests/integration start them.
build:
	cargo build --workspace --bins --locked

nextest: build
	cargo nextest run --workspace --locked --no-fail-fast

test: setup fmt-check lint-proto validate-deploy clippy doc nextest

fmt:
	cargo fmt --all

# The README's main command: a hub and two leaves with the same pod CIDR, until Ctrl-C.
demo: setup
	cargo run --locked -p trellis-lab --bin trellis-lab -- up --same-pod-cidr

# The benchmark suite (docs/benchmarks.md): every benchmark at full size, results in
# bench/results/*.json, then the document and the plots in docs/bench/ regenerated from them.
# The data-plane benchmark needs root and iperf3 and is skipped loudly otherwise. Set
# TRELLIS_BENCH_NOTE to record the run's conditions (e.g. other work on the machine).
bench: setup
	bash scripts/bench.sh full

# The same at small sizes and fewer requests (under 5 minutes on 2 cores with a warm release
# build); results in bench/results/quick/*.json, never over the full ones. The document shows
# the newer run of each benchmark and says which.
bench-quick: setup
	bash scripts/bench.sh quick

# Regenerates docs/benchmarks.md and docs/bench/*.svg from the existing results; measures nothing.
bench-report:
	bash scripts/redraw-plots.sh

# Single benchmarks at full size (each writes its bench/results/*.json; `make bench-report` then
# updates the document).
bench-ipam: setup
	cargo run --release --locked -p trellis-bench --bin ipam-bench -- --out bench/results/ipam.json

bench-mesh: setup
	cargo run --release --locked -p trellis-bench --bin mesh-bench -- --out bench/results/mesh.json

bench-endpoints: setup
	cargo run --release --locked -p trellis-bench --bin endpoints-bench -- --out bench/results/endpoints.json

bench-exports: setup
	cargo run --release --locked -p trellis-bench --bin exports-bench -- --out bench/results/exports.json

# Root only; the service binaries it starts are built in release mode first, and GotaTun's
# device is installed for the side by side.
bench-dataplane: setup
	bash scripts/install-gotatun.sh
	cargo build --release --locked --bins -p trellis-ipam -p trellis-discovery -p trellis-broker \
		-p trellis-forwarder -p trellis-gateway -p trellis-endpoints -p trellis-route
	cargo run --release --locked -p trellis-bench --bin dataplane-bench -- --out bench/results/dataplane.json
	cargo run --release --locked -p trellis-bench --bin dataplane-bench -- --scenario node-path \
		--out bench/results/dataplane-nodes.json

# Root only: ping RTT through a router holding the gateway's rules for one peer and for a hub's
# 254, against plain routing (ADR 0033).
bench-gateway-rules: setup
	cargo run --release --locked -p trellis-bench --bin gateway-rules-bench -- \
		--out bench/results/gateway-rules.json

# Root only: kills each cluster's active gateway replica in turn (issue 33, ADR 0023).
bench-failover: setup
	cargo build --release --locked --bins -p trellis-ipam -p trellis-discovery -p trellis-broker \
		-p trellis-forwarder -p trellis-gateway -p trellis-endpoints -p trellis-route
	cargo run --release --locked -p trellis-bench --bin failover-bench -- --out bench/results/failover.json

# The induced mesh's setup at 100 leaves with mutual TLS against plaintext, alternately in one
# run: what secure by default costs (issue 37).
bench-tls: setup
	cargo run --release --locked -p trellis-bench --bin tls-bench -- --out bench/results/tls.json

# `trellis-lab up --clusters 255 --same-pod-cidr --until-converged` against mesh-bench at 254
# leaves, alternately in one run: whether the benchmark's numbers are what the lab's user sees
# (issue 34).
bench-lab: setup
	cargo build --release --locked -p trellis-lab --bin trellis-lab
	cargo run --release --locked -p trellis-bench --bin lab-bench -- --out bench/results/lab.json

# Root only: a hub and leaves behind every kind of NAT router, timed from induced peering to the
# first pod-to-pod packet, and relayed paths against direct ones (issue 36, ADR 0025).
bench-nat: setup
	cargo build --release --locked --bins -p trellis-ipam -p trellis-discovery -p trellis-broker \
		-p trellis-forwarder -p trellis-gateway -p trellis-endpoints -p trellis-route
	cargo run --release --locked -p trellis-bench --bin nat-bench -- --out bench/results/nat.json

clean:
	cargo clean
