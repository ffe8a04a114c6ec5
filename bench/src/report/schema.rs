//! The results, as far as the document needs them, and the parsing of one result file into
//! them. Every field is optional or defaulted, so that results written by earlier versions of
//! the benchmarks stay readable.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use super::inputs::{Inputs, Loaded};

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct RunMeta {
    pub(super) kind: Option<String>,
    pub(super) timestamp: Option<String>,
    pub(super) git_commit: Option<String>,
    pub(super) load_average_1m: Option<f64>,
    pub(super) note: String,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(super) struct MachineMeta {
    pub(super) cpu_model: String,
    pub(super) cores: usize,
    pub(super) memory_gib: f64,
    pub(super) kernel: String,
    pub(super) etcd_version: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct Common {
    pub(super) run: Option<RunMeta>,
    pub(super) machine: Option<MachineMeta>,
}

fn one() -> usize {
    1
}

fn map_rpc() -> String {
    "MapEndpointIp".into()
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct IpamDoc {
    pub(super) scenarios: Vec<IpamScenario>,
    pub(super) consistency: Vec<ConsistencyDoc>,
    pub(super) parameters: Option<Value>,
    pub(super) metrics_overhead: Option<MetricsOverheadDoc>,
}

/// ipam-bench's metrics-overhead variant.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct MetricsOverheadDoc {
    pub(super) store: String,
    pub(super) rpc: String,
    pub(super) path: String,
    #[serde(default)]
    pub(super) concurrency: usize,
    pub(super) with_metrics: LatencyDoc,
    pub(super) without_metrics: LatencyDoc,
    #[serde(default)]
    pub(super) ratios: Vec<f64>,
    pub(super) throughput_ratio: f64,
    /// Set when the variant ran in another invocation than the rest of the document (its
    /// `run` block: timestamp, commit, load).
    #[serde(default)]
    pub(super) run: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub(super) struct LatencyDoc {
    pub(super) ops_per_second: f64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
}

#[derive(Debug, Clone, Deserialize)]
pub(super) struct IpamScenario {
    pub(super) store: String,
    #[serde(default = "one")]
    pub(super) replicas: usize,
    #[serde(default = "map_rpc")]
    pub(super) rpc: String,
    pub(super) path: String,
    #[serde(default)]
    pub(super) concurrency: usize,
    #[serde(default)]
    pub(super) operations: u64,
    pub(super) ops_per_second: f64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
    #[serde(default)]
    pub(super) runs: Vec<Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct ConsistencyDoc {
    pub(super) store: String,
    pub(super) replicas: usize,
    pub(super) clients: usize,
    pub(super) endpoints_checked: usize,
    pub(super) clusters_checked: usize,
    pub(super) endpoint_disagreements: usize,
    pub(super) shared_addresses: usize,
    pub(super) cluster_disagreements: usize,
    pub(super) overlapping_ranges: usize,
    pub(super) errors: usize,
    pub(super) examples: Vec<String>,
    pub(super) consistent: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct MeshDoc {
    pub(super) mode: Option<String>,
    pub(super) sizes: Vec<MeshSize>,
    pub(super) parameters: Option<Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct MeshRun {
    pub(super) seconds: f64,
    pub(super) converged: Option<bool>,
    pub(super) open_files: Option<usize>,
    pub(super) peer_retries: Option<usize>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct StoreUse {
    pub(super) keys: usize,
    pub(super) bytes: usize,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct HubStores {
    pub(super) discovery: StoreUse,
    pub(super) broker: StoreUse,
    pub(super) forwarder: StoreUse,
    pub(super) ipam: StoreUse,
    pub(super) gateway: StoreUse,
    pub(super) total: StoreUse,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct HubProcess {
    pub(super) service: String,
    pub(super) cpu_seconds: f64,
    pub(super) cpu_seconds_during_setup: f64,
    pub(super) peak_rss_kib: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct MeshSize {
    pub(super) leaves: usize,
    pub(super) induced_tunnel_endpoints: usize,
    /// Absent in results from before timeouts were recorded: those converged.
    pub(super) status: Option<String>,
    pub(super) reason: Option<String>,
    pub(super) runs: Vec<MeshRun>,
    pub(super) median_seconds: Option<f64>,
    pub(super) hub_tunnel_endpoints: Option<usize>,
    pub(super) hub_network_configs: Option<usize>,
    pub(super) hub_relays_in_flight: Option<usize>,
    pub(super) hub_ipam_records: Option<usize>,
    pub(super) hub_stores: Option<HubStores>,
    pub(super) hub_processes: Option<Vec<HubProcess>>,
    pub(super) hub_cpu_seconds_during_setup: Option<f64>,
    pub(super) hub_peak_rss_kib_total: Option<u64>,
    pub(super) hub_etcd_keys: Option<BTreeMap<String, usize>>,
    pub(super) median_full_tunnels_seconds: Option<f64>,
    pub(super) median_tail_share: Option<f64>,
    pub(super) median_hub_cpu_ms_per_induced_tunnel: Option<f64>,
    pub(super) median_hub_etcd_writes_per_induced_tunnel: Option<f64>,
    /// The benchmark process (in process: every cluster): peak RSS and CPU seconds per run.
    pub(super) median_process_peak_rss_kib: Option<u64>,
    pub(super) median_process_cpu_seconds: Option<f64>,
}

impl MeshSize {
    pub(super) fn status(&self) -> &str {
        self.status.as_deref().unwrap_or("converged")
    }

    pub(super) fn converged_median(&self) -> Option<f64> {
        (self.status() == "converged")
            .then_some(self.median_seconds)
            .flatten()
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct EndpointsDoc {
    pub(super) scenarios: Vec<EndpointsScenario>,
    pub(super) parameters: Option<Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct ExportsDoc {
    pub(super) parameters: Option<Value>,
    pub(super) mesh_seconds: f64,
    pub(super) change_latency: Option<ExportsLatency>,
    pub(super) bulk_seconds: Vec<f64>,
    pub(super) reflected_endpoints_per_second: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct ExportsLatency {
    pub(super) operations: u64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct EndpointsScenario {
    pub(super) store: String,
    pub(super) path: String,
    pub(super) concurrency: usize,
    pub(super) slice_size: usize,
    pub(super) endpoints_per_second: f64,
    pub(super) ops_per_second: f64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct Rtt {
    pub(super) samples: usize,
    pub(super) lost: u32,
    pub(super) min_ms: f64,
    pub(super) median_ms: f64,
    pub(super) p90_ms: f64,
    pub(super) max_ms: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct ThroughputDoc {
    pub(super) tunnel_mbit_s: f64,
    pub(super) bare_veth_mbit_s: f64,
    pub(super) tunnel_fraction_of_bare: f64,
    pub(super) seconds: u32,
}

/// One tunnel's iperf3 runs at one stream count (`dataplane-bench`'s side by side).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct SideDoc {
    pub(super) runs: Vec<Value>,
    pub(super) median_mbit_s: Option<f64>,
    pub(super) min_mbit_s: Option<f64>,
    pub(super) max_mbit_s: Option<f64>,
    pub(super) median_cpu_seconds_per_gb: Option<f64>,
    pub(super) min_cpu_seconds_per_gb: Option<f64>,
    pub(super) max_cpu_seconds_per_gb: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct ComparisonDoc {
    pub(super) streams: u32,
    pub(super) trellis: SideDoc,
    pub(super) wireguard_go: SideDoc,
    pub(super) ratio_mbit_s: Option<f64>,
    pub(super) ratio_cpu_seconds_per_gb: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct RttOverheadDoc {
    pub(super) tunnel: Option<Rtt>,
    pub(super) bare: Option<Rtt>,
    pub(super) overhead_ms: Option<f64>,
}

/// Trellis's tunnel against wireguard-go, in turns in one run.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct SideBySideDoc {
    pub(super) reference: String,
    pub(super) rounds: u32,
    pub(super) iperf_seconds: u32,
    pub(super) throughput: Vec<ComparisonDoc>,
    pub(super) rtt_trellis: Option<RttOverheadDoc>,
    pub(super) rtt_wireguard_go: Option<RttOverheadDoc>,
}

impl SideBySideDoc {
    pub(super) fn at(&self, streams: u32) -> Option<&ComparisonDoc> {
        self.throughput.iter().find(|c| c.streams == streams)
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct DataplaneDoc {
    pub(super) wireguard: String,
    pub(super) build: String,
    pub(super) emulation: String,
    pub(super) store: String,
    pub(super) rtt_through_zero_delay_relay: Option<Rtt>,
    pub(super) hub_link_rtt_ms: f64,
    pub(super) leaf_link_rtt_ms: f64,
    pub(super) rtt_no_netem_tunnel: Option<Rtt>,
    pub(super) rtt_no_netem_bare: Option<Rtt>,
    pub(super) throughput: Option<ThroughputDoc>,
    pub(super) rtt_induced: Option<Rtt>,
    pub(super) rtt_hub_path: Option<Rtt>,
    pub(super) ratio_hub_over_induced: Option<f64>,
    pub(super) thesis_induced_ms: Option<f64>,
    pub(super) thesis_hub_ms: Option<f64>,
    pub(super) induced_ready_seconds: Option<f64>,
    pub(super) hub_ready_seconds: Option<f64>,
    pub(super) samples: Option<u32>,
    pub(super) side_by_side: Option<SideBySideDoc>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub(super) struct NodePathDoc {
    pub(super) wireguard: String,
    pub(super) build: String,
    pub(super) store: String,
    pub(super) samples: Option<u32>,
    pub(super) iperf_seconds: Option<u32>,
    pub(super) nodes_per_cluster: Option<u32>,
    pub(super) rtt_gateway_nodes: Option<Rtt>,
    pub(super) rtt_non_gateway_nodes: Option<Rtt>,
    pub(super) mbit_s_gateway_nodes: Vec<f64>,
    pub(super) mbit_s_non_gateway_nodes: Vec<f64>,
    pub(super) rtt_ratio: Option<f64>,
    pub(super) throughput_ratio: Option<f64>,
}

#[derive(Debug, Deserialize)]
pub(super) struct FailoverDoc {
    pub(super) parameters: FailoverParameters,
    pub(super) kills: Vec<FailoverKill>,
    pub(super) takeover_ms: FailoverSpread,
    pub(super) probe_gap_ms: FailoverSpread,
    pub(super) tcp_connections: usize,
    pub(super) tcp_broken: usize,
}

#[derive(Debug, Deserialize)]
pub(super) struct FailoverParameters {
    pub(super) kills: usize,
    pub(super) connections_per_destination: usize,
    pub(super) pushed_per_destination: usize,
}

#[derive(Debug, Deserialize)]
pub(super) struct FailoverKill {
    pub(super) cluster: String,
    pub(super) probe_gap_ms: f64,
    pub(super) tcp_broken: usize,
}

#[derive(Debug, Deserialize)]
pub(super) struct FailoverSpread {
    pub(super) p50: f64,
    pub(super) p99: f64,
    pub(super) max: f64,
}

/// A parsed result with where it came from.
pub(super) struct Parsed<T> {
    pub(super) path: String,
    pub(super) common: Common,
    pub(super) doc: T,
}

/// Parses benchmark `name`, or says why there is nothing to show.
pub(super) fn parse<T: for<'de> Deserialize<'de>>(
    inputs: &Inputs,
    name: &str,
) -> Result<Parsed<T>, String> {
    match inputs.results.get(name) {
        None | Some(Loaded::Missing) => Err(format!(
            "no result (`bench/results/{name}.json` does not exist: the benchmark has not been run)"
        )),
        Some(Loaded::Unreadable { path, error }) => Err(format!("`{path}` is unreadable: {error}")),
        Some(Loaded::Found { path, value }) => {
            let common = Common::deserialize(value).unwrap_or_default();
            match T::deserialize(value) {
                Ok(doc) => Ok(Parsed {
                    path: path.clone(),
                    common,
                    doc,
                }),
                Err(e) => Err(format!("`{path}` does not have the expected shape: {e}")),
            }
        }
    }
}
