//! `ipam-bench`'s result (`bench/results/ipam.json`): MapEndpointIp and GetSubnetsPerCluster
//! per store and number of replicas, the consistency check with several replicas, and the cost
//! of the metrics layer.

use serde::{Deserialize, Serialize};

use super::{LatencySummary, Machine, RunInfo, Store};

fn one() -> usize {
    1
}

fn map_endpoint_ip() -> String {
    "MapEndpointIp".into()
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct IpamResult {
    pub benchmark: String,
    pub run: Option<RunInfo>,
    pub machine: Option<Machine>,
    pub parameters: Option<IpamParameters>,
    pub scenarios: Vec<IpamScenario>,
    pub consistency: Vec<Consistency>,
    pub metrics_overhead: Option<MetricsOverhead>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct IpamParameters {
    pub requests: usize,
    pub new_clusters: usize,
    pub concurrency: usize,
    pub repeats: usize,
    pub replicas: Vec<usize>,
    pub consistency_endpoints: usize,
    /// Absent in results from before the metrics-overhead variant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_repeats: Option<usize>,
}

/// One scenario: one RPC on one path against one store with some number of replicas.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IpamScenario {
    pub store: Store,
    /// Absent in results from before replicas were measured: one.
    #[serde(default = "one")]
    pub replicas: usize,
    /// Absent in results from before GetSubnetsPerCluster was measured.
    #[serde(default = "map_endpoint_ip")]
    pub rpc: String,
    pub path: String,
    #[serde(default)]
    pub concurrency: usize,
    /// Medians over the runs, metric by metric.
    #[serde(flatten)]
    pub latency: LatencySummary,
    #[serde(default)]
    pub runs: Vec<LatencySummary>,
}

/// The outcome of the consistency check with several replicas.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Consistency {
    pub store: Store,
    pub replicas: usize,
    pub clients: usize,
    pub endpoints_checked: usize,
    pub clusters_checked: usize,
    /// Endpoints for which two clients got different addresses.
    pub endpoint_disagreements: usize,
    /// Addresses handed to more than one endpoint.
    pub shared_addresses: usize,
    /// Clusters for which two clients got different ranges.
    pub cluster_disagreements: usize,
    /// Ranges handed to more than one cluster (or overlapping).
    pub overlapping_ranges: usize,
    /// Failed requests (errors are answers too: they are counted, not retried).
    pub errors: usize,
    /// Up to five examples of what went wrong.
    pub examples: Vec<String>,
    pub consistent: bool,
}

/// The metrics-overhead variant: the same scenario against an IPAM with and without metrics.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MetricsOverhead {
    pub store: Store,
    pub rpc: String,
    pub path: String,
    #[serde(default)]
    pub concurrency: usize,
    /// Medians over the runs, with the gRPC metrics layer recording every request.
    pub with_metrics: LatencySummary,
    /// Medians over the runs, with `--metrics-listen off` (no layer).
    pub without_metrics: LatencySummary,
    /// Requests/s with metrics divided by requests/s without, per pair of runs.
    #[serde(default)]
    pub ratios: Vec<f64>,
    /// The median of `ratios` (1.0: no overhead; 0.95: 5% fewer requests per second).
    pub throughput_ratio: f64,
    /// Set by hand when the variant was taken from another invocation than the rest of the
    /// result: that invocation's run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunInfo>,
}
