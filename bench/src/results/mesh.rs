//! `mesh-bench`'s result (`bench/results/mesh*.json`): induced mesh setup time per number of
//! leaves, and what the hub holds and spends.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Machine, RunInfo};

/// Where the clusters' services run and what they store in (see `mesh-bench`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Every service of every cluster in this process, memory stores.
    InProcess,
    /// The same with mutual TLS between the clusters, as by default: every cluster-facing
    /// service on a peer listener, the hub's certificates made by its services (`--tls-dir`),
    /// the leaves pinning the hub's CA at first contact.
    InProcessTls,
    /// The hub's services as child processes (release binaries, memory stores), leaves in
    /// this process: the hub's CPU time and peak memory are measured.
    HubProcesses,
    /// The hub's services as processes, each with its own etcd; leaves in this process.
    HubEtcd,
    /// Hub and leaves as processes, each service with its own etcd (small n).
    EtcdProcesses,
    /// The clusters `trellis-lab up --same-pod-cidr` runs, started by the lab's own code in this
    /// process: six services each with mutual TLS, gateways following their brokers, metrics
    /// served. The hub is the lab's cluster 0.
    Lab,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MeshResult {
    pub benchmark: String,
    /// Absent in results from before there were modes.
    pub mode: Option<Mode>,
    pub run: Option<RunInfo>,
    pub machine: Option<Machine>,
    pub parameters: Option<MeshParameters>,
    pub sizes: Vec<MeshSize>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MeshParameters {
    pub leaves: Vec<usize>,
    pub repeats: usize,
    pub timeout_seconds: u64,
    pub keep_going: bool,
    pub open_files_limit: Option<u64>,
}

/// How one size ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SizeStatus {
    /// Also what results from before timeouts were recorded mean: only converged sizes were
    /// written then.
    #[default]
    Converged,
    TimedOut,
    Failed,
    Skipped,
}

impl SizeStatus {
    /// The name the result files use.
    pub fn as_str(self) -> &'static str {
        match self {
            SizeStatus::Converged => "converged",
            SizeStatus::TimedOut => "timed_out",
            SizeStatus::Failed => "failed",
            SizeStatus::Skipped => "skipped",
        }
    }
}

fn yes() -> bool {
    true
}

/// One run of one size.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MeshRun {
    /// Setup time; the timeout when not converged.
    pub seconds: f64,
    /// Absent in results from before timeouts were recorded: those converged.
    #[serde(default = "yes")]
    pub converged: bool,
    /// Induced TunnelEndpoints held by the leaves when the run ended.
    #[serde(default)]
    pub induced_reached: usize,
    /// CPU seconds the hub's processes spent from the Peer requests to convergence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_cpu_seconds: Option<f64>,
    /// The same per induced TunnelEndpoint (n·(n-1)), in milliseconds: what one more induced
    /// tunnel costs the hub every leaf shares (issue 17).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_cpu_ms_per_induced_tunnel: Option<f64>,
    /// Seconds from the Peer requests until every full tunnel was up: each leaf's to the hub
    /// and the hub's to each leaf (none when that did not happen before the run ended).
    #[serde(default)]
    pub full_tunnels_seconds: Option<f64>,
    /// Seconds until 90 % of the induced TunnelEndpoints existed.
    #[serde(default)]
    pub induced_90_seconds: Option<f64>,
    /// The last 10 % of induced TunnelEndpoints' share of the setup time:
    /// (seconds − induced_90_seconds) / seconds. A retry tail shows here.
    #[serde(default)]
    pub tail_share: Option<f64>,
    /// File descriptors this process held when the run ended (against `open_files_limit`:
    /// every in-process cluster's sockets count here).
    #[serde(default)]
    pub open_files: Option<usize>,
    /// Peer requests sent again after an UNAVAILABLE answer (at most `PEER_RETRIES` per leaf);
    /// absent in results from before they were counted.
    #[serde(default)]
    pub peer_retries: Option<usize>,
    /// Write transactions on the hub's etcds from the Peer requests to convergence, per
    /// service (hub on etcd only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_etcd_writes: Option<BTreeMap<String, i64>>,
    /// All of them per induced TunnelEndpoint (n·(n-1)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_etcd_writes_per_induced_tunnel: Option<f64>,
    /// From the hub's processes' `/metrics` over the same span, per induced TunnelEndpoint
    /// (hub on etcd only): store transactions retried after a lost compare-and-swap, changes
    /// their store watches delivered, and relay deliveries the forwarder scheduled again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_store_retries_per_induced_tunnel: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_watch_events_per_induced_tunnel: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_relay_retries_per_induced_tunnel: Option<f64>,
    /// This benchmark process over the run, from before the hub started until it was stopped:
    /// its peak RSS (VmHWM, reset at the start), KiB, and its CPU seconds (user + system). In
    /// process that is every cluster; otherwise the leaves and the harness.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_peak_rss_kib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_cpu_seconds: Option<f64>,
}

/// One hub service's store after convergence.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct StoreUse {
    pub keys: usize,
    /// Keys plus values, in bytes.
    pub bytes: usize,
}

/// The hub's stores after convergence, per service, and their sum.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct HubStores {
    pub discovery: StoreUse,
    pub broker: StoreUse,
    pub forwarder: StoreUse,
    pub ipam: StoreUse,
    pub gateway: StoreUse,
    pub total: StoreUse,
}

/// One hub process at convergence.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct HubProcess {
    pub service: String,
    /// utime + stime since the process started (including its start-up).
    pub cpu_seconds: f64,
    /// utime + stime from the Peer requests to convergence.
    pub cpu_seconds_during_setup: f64,
    /// VmHWM, KiB.
    pub peak_rss_kib: u64,
    /// VmRSS at convergence, KiB.
    pub rss_kib: u64,
}

/// One number of leaves: its runs and what the hub held.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MeshSize {
    pub leaves: usize,
    pub induced_tunnel_endpoints: usize,
    pub status: SizeStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub runs: Vec<MeshRun>,
    /// Median over the converged runs.
    pub median_seconds: Option<f64>,
    /// The rest from the last converged run.
    pub hub_tunnel_endpoints: Option<usize>,
    pub hub_network_configs: Option<usize>,
    pub hub_relays_in_flight: Option<usize>,
    pub hub_ipam_records: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hub_stores: Option<HubStores>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hub_processes: Option<Vec<HubProcess>>,
    /// Medians over the converged runs: the hub's CPU seconds during setup (all its
    /// processes), and the sum of its processes' peak RSS.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hub_cpu_seconds_during_setup: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hub_peak_rss_kib_total: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hub_etcd_keys: Option<BTreeMap<String, usize>>,
    /// Medians over the converged runs of the per-run fields of the same names.
    pub median_full_tunnels_seconds: Option<f64>,
    pub median_tail_share: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_hub_cpu_ms_per_induced_tunnel: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_hub_etcd_writes_per_induced_tunnel: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_hub_store_retries_per_induced_tunnel: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_hub_watch_events_per_induced_tunnel: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_hub_relay_retries_per_induced_tunnel: Option<f64>,
    /// The benchmark process (in process: every cluster): peak RSS and CPU seconds per run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_process_peak_rss_kib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_process_cpu_seconds: Option<f64>,
}

impl MeshSize {
    /// A size about to be measured: converged until a run says otherwise.
    pub fn new(leaves: usize) -> Self {
        Self {
            leaves,
            induced_tunnel_endpoints: leaves * (leaves - 1),
            ..Self::default()
        }
    }

    pub fn status(&self) -> &'static str {
        self.status.as_str()
    }

    pub fn converged_median(&self) -> Option<f64> {
        (self.status == SizeStatus::Converged)
            .then_some(self.median_seconds)
            .flatten()
    }
}
