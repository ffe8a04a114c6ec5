//! `failover-bench`'s result (`bench/results/failover.json`): gateway takeovers after killing
//! the active replica, and the connections that survived them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Machine, RunInfo};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailoverResult {
    #[serde(default)]
    pub benchmark: String,
    #[serde(default)]
    pub run: Option<RunInfo>,
    #[serde(default)]
    pub machine: Option<Machine>,
    pub parameters: FailoverParameters,
    #[serde(default)]
    pub mesh_seconds: f64,
    pub kills: Vec<Kill>,
    pub takeover_ms: Spread,
    pub probe_gap_ms: Spread,
    /// TCP connections open across a kill, over all kills.
    pub tcp_connections: usize,
    /// Of those, broken (reset, closed, or silent), over all kills and per cluster killed.
    pub tcp_broken: usize,
    #[serde(default)]
    pub tcp_broken_by_cluster: BTreeMap<String, usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FailoverParameters {
    pub kills: usize,
    #[serde(default)]
    pub clusters: usize,
    #[serde(default)]
    pub nodes_per_cluster: usize,
    #[serde(default)]
    pub replicas_per_cluster: usize,
    pub connections_per_destination: usize,
    pub pushed_per_destination: usize,
    #[serde(default)]
    pub probe_interval_ms: u64,
    #[serde(default)]
    pub before_ms: u64,
    #[serde(default)]
    pub after_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Kill {
    /// The cluster whose active was killed.
    pub cluster: String,
    #[serde(default)]
    pub takeover_ms: f64,
    pub probe_gap_ms: f64,
    pub tcp_broken: usize,
    #[serde(default)]
    pub broken: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spread {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}
