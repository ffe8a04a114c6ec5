# syntax=docker/dockerfile:1
# One image with every Trellis binary; docker-compose.yml and deploy/kustomize pick the binary
# with `command:`. Build: `docker build -t trellis:dev .` (BuildKit, for the cache mounts).

# --- build ---------------------------------------------------------------------------------------
FROM rust:1.95-bookworm AS builder
# etcd-client's build script runs protoc on etcd's protos, which import the well-known types.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The six services are required; trellisctl and trellis-lab are copied when the workspace has
# them. target/ lives in a cache mount, so the binaries are copied out in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    set -eu; \
    cargo build --release --locked --workspace --bins; \
    mkdir -p /out; \
    for bin in trellis-discovery trellis-broker trellis-forwarder trellis-ipam \
               trellis-endpoints trellis-gateway trellis-route; do \
      cp "target/release/$bin" /out/; \
    done; \
    for bin in trellisctl trellis-lab; do \
      if [ -x "target/release/$bin" ]; then cp "target/release/$bin" /out/; \
      else echo "note: $bin not in this workspace; not in the image"; fi; \
    done

# --- runtime -------------------------------------------------------------------------------------
FROM debian:bookworm-slim
# nftables and iproute2: the gateway drives `nft` and `ip`; conntrack: it flushes a removed
# peer's connections; ca-certificates for TLS clients.
# /var/lib/trellis/tls is where docker-compose.yml mounts each cluster's TLS volume (--tls-dir):
# a new named volume takes the owner and mode of the image's directory, so the services (not
# root) can create the cluster's CA in it, and only they can read it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends nftables iproute2 conntrack ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 65532 trellis \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin trellis \
 && install -d -o 65532 -g 65532 -m 0700 /var/lib/trellis/tls
COPY --from=builder /out/ /usr/local/bin/
# Non-root by default; only the gateway runs as root (with NET_ADMIN), see docker-compose.yml.
USER 65532:65532
# gRPC ports (discovery, broker, forwarder, ipam, endpoints, gateway) and WireGuard UDP.
EXPOSE 7101 7102 7103 7104 7105 7106 7107 51840-51847/udp 4800/udp
