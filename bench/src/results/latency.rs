//! Throughput and latency of one request-driven scenario, as the IPAM, endpoints and exports
//! benchmarks record it.

use serde::{Deserialize, Serialize};

use crate::median;

/// Throughput and latency of one scenario.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencySummary {
    pub operations: u64,
    pub wall_seconds: f64,
    pub ops_per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl LatencySummary {
    /// The median of each metric over `runs`, metric by metric (so the p99 is the median of the
    /// runs' p99s); `None` for no runs.
    pub fn median_of(runs: &[LatencySummary]) -> Option<LatencySummary> {
        let m = |f: fn(&LatencySummary) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
        Some(LatencySummary {
            operations: runs.first()?.operations,
            wall_seconds: m(|r| r.wall_seconds)?,
            ops_per_second: m(|r| r.ops_per_second)?,
            p50_ms: m(|r| r.p50_ms)?,
            p99_ms: m(|r| r.p99_ms)?,
            max_ms: m(|r| r.max_ms)?,
        })
    }
}
