//! `exports-bench`'s result (`bench/results/exports.json`): how fast an export change reaches
//! the induced consumers, and a bulk export's reflection rate.

use serde::{Deserialize, Serialize};

use super::{LatencySummary, Machine, RunInfo};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ExportsResult {
    pub benchmark: String,
    pub run: Option<RunInfo>,
    pub machine: Option<Machine>,
    pub parameters: Option<ExportsParameters>,
    /// Seconds from the first Peer call to the complete induced mesh.
    pub mesh_seconds: f64,
    /// Export change → changed slice at the induced consumer.
    pub change_latency: Option<LatencySummary>,
    /// Seconds until every consumer listed every endpoint of a bulk export, per repeat.
    pub bulk_seconds: Vec<f64>,
    /// Consumers × bulk endpoints / median bulk seconds.
    pub reflected_endpoints_per_second: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ExportsParameters {
    pub leaves: usize,
    pub consumers: usize,
    pub samples: usize,
    pub bulk_endpoints: usize,
    pub repeats: usize,
    pub poll_ms: u64,
}
