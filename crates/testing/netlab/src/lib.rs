//! `trellis-netlab`: Trellis clusters in Linux network namespaces on one machine, for the
//! data-plane tests (`tests/integration/tests/gateway_dataplane.rs`), `trellis-lab --dataplane
//! netns` and the data-plane benchmark (docs/architecture.md). Root only.
//!
//! - [`netns`]: creating and removing namespaces, running commands and opening sockets inside
//!   them, forwarding a namespace's loopback port to the host (etcd);
//! - [`topology`]: the "internet" (a bridge in its own namespace) and, per cluster, a gateway
//!   namespace on that bridge plus a pod namespace behind the gateway;
//! - [`nat`]: NAT routers of four kinds between a site's gateway and the internet, for its
//!   WireGuard datagrams only;
//! - [`netem`]: `tc netem` delays per link between two gateways, where the kernel has netem;
//! - [`relay`]: the same per-link delays with userspace UDP relays, where it has not;
//! - [`partition`]: a silent partition (every frame dropped, nothing refused) between nodes;
//! - [`process`]: a binary running inside a namespace (`ip netns exec`), killed on drop;
//! - [`cluster`]: the six Trellis services of one cluster inside its gateway namespace, on the
//!   bridge address, each with its own etcd or a memory store;
//! - [`fabric`]: a hub and its leaves peered through the brokers, with the probes tests and
//!   benchmarks share (TunnelEndpoints, IPAM views, endpoint reflection, pings);
//! - [`bins`]: where the service binaries are;
//! - [`owner`]: each run's claim on its namespaces, and the leftovers of runs that died.
//!
//! Everything created is removed on drop: processes first, then etcds, then namespaces (with
//! every interface, route and qdisc in them). A run killed hard cannot drop anything: its
//! processes die with it (they are tied to it), and its namespaces are [`owner::leftovers`]. Hold a [`cluster::NsCluster`] shorter than the
//! [`topology::Topology`] it runs in (declare it after, or drop it first).

pub mod bins;
pub mod cluster;
pub mod fabric;
pub mod nat;
pub mod netem;
pub mod netns;
pub mod owner;
pub mod partition;
pub mod process;
pub mod relay;
pub mod topology;

pub use cluster::{ClusterOptions, NsCluster, Service, StoreKind};
pub use fabric::{Fabric, FabricOptions, Reach};
pub use nat::{NatKind, NatRouter};
pub use topology::{Pod, Site, Topology};

/// Whether this process may build topologies (root), and which tools it misses. Empty when
/// everything needed is there.
pub fn missing_prerequisites(tools: &[&str]) -> Vec<String> {
    let mut missing = Vec::new();
    if !netns::is_root() {
        missing.push("root (network namespaces)".to_owned());
    }
    for tool in tools {
        if trellis_testkit::tool_path(tool).is_none() {
            missing.push(format!("the `{tool}` tool"));
        }
    }
    missing
}

/// A short identifier unique to this process and moment, for namespace names: concurrent
/// runs and leftovers of killed runs never collide.
pub fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::from(d.subsec_nanos()) ^ d.as_secs())
        .unwrap_or_default();
    let id = format!(
        "{:06x}",
        (u64::from(std::process::id()) << 20 ^ nanos) & 0xff_ffff
    );
    id
}
