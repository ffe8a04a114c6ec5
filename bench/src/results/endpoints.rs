//! `endpoints-bench`'s result (`bench/results/endpoints.json`): ReflectEndpointSlice per store.

use serde::{Deserialize, Serialize};

use super::{LatencySummary, Machine, RunInfo, Store};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct EndpointsResult {
    pub benchmark: String,
    pub run: Option<RunInfo>,
    pub machine: Option<Machine>,
    pub parameters: Option<EndpointsParameters>,
    pub scenarios: Vec<EndpointsScenario>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct EndpointsParameters {
    pub reflections: usize,
    pub slice_size: usize,
    pub concurrency: usize,
    pub repeats: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EndpointsScenario {
    pub store: Store,
    #[serde(default)]
    pub path: String,
    #[serde(default)]
    pub concurrency: usize,
    #[serde(default)]
    pub slice_size: usize,
    /// Median over the runs.
    #[serde(default)]
    pub endpoints_per_second: f64,
    /// Latency of one whole reflection (a slice of `slice_size` endpoints), medians over the
    /// runs metric by metric.
    #[serde(flatten)]
    pub latency: LatencySummary,
    #[serde(default)]
    pub runs: Vec<LatencySummary>,
}
