//! The parts of `dataplane-bench` (the binary's doc describes the topology and the
//! scenarios): the link delays ([`links`]), ping and iperf3 ([`probe`]), request/response with
//! sockperf ([`rr`]), the side by side with
//! wireguard-go ([`side_by_side`]), the leaf-to-leaf scenarios ([`mod@leaf_to_leaf`]) and the node
//! path ([`mod@node_path`]). What it writes is [`crate::results::DataplaneResult`] and
//! [`crate::results::NodePathResult`].

use std::time::Duration;

use trellis_netlab::{FabricOptions, Service, StoreKind};

use crate::results::{CpuLatencyLimit, Store};

pub mod cpu_latency;
mod leaf_to_leaf;
mod links;
mod node_path;
pub(crate) mod probe;
pub mod rr;
mod side_by_side;

pub use leaf_to_leaf::leaf_to_leaf;
pub use node_path::node_path;

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const LIMIT: Duration = Duration::from_secs(90);

/// What the binary's flags set for the scenarios.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Pings per RTT measurement.
    pub samples: u32,
    /// Round-trip delay added by each hub link (A–B, C–B), in milliseconds.
    pub hub_link_ms: u64,
    /// Round-trip delay added by the leaf link (A–C), in milliseconds.
    pub leaf_link_ms: u64,
    /// Rounds of the side-by-side comparison with wireguard-go.
    pub rounds: u32,
    /// Duration of each iperf3 run, in seconds.
    pub iperf_seconds: u32,
    /// Duration of each request/response run, in seconds.
    pub rr_seconds: u32,
    /// Where the services keep their state.
    pub store: Store,
    /// The gateways' busy-polling window, in microseconds (0: none).
    pub busy_poll_us: u64,
    /// The share of the time, in percent, each polling thread may poll.
    pub busy_poll_budget_percent: u8,
    /// Whether the gateways offer the stateless wire convention (ADR 0034): the default, off
    /// with `--no-stateless-wire`.
    pub stateless_wire: bool,
    /// The kernel's CPU latency limit as the run found it (`None`: unreadable).
    pub cpu_latency_limit: Option<CpuLatencyLimit>,
}

fn options(settings: &Settings, hub_no_induced: bool) -> FabricOptions {
    let mut o = FabricOptions::three_clusters();
    o.hub_no_induced = hub_no_induced;
    o.store = match settings.store {
        Store::Memory => StoreKind::Memory,
        Store::Etcd => StoreKind::EtcdPerService,
    };
    o.extra_args = vec![(
        Service::Gateway,
        vec![
            "--mappings-interval".into(),
            "1".into(),
            "--busy-poll-us".into(),
            settings.busy_poll_us.to_string(),
            "--busy-poll-budget-percent".into(),
            settings.busy_poll_budget_percent.to_string(),
        ],
    )];
    if !settings.stateless_wire {
        o.extra_args[0].1.push("--no-stateless-wire".into());
    }
    o
}

fn build() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

const WIREGUARD: &str = "userspace (boringtun via defguard_boringtun), MTU 1420";
