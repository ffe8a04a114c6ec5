//! Shared pieces of the benchmark binaries: a latency recorder, the description of the
//! machine a run happened on, and the JSON result file every benchmark writes.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Latencies of one scenario.
#[derive(Debug)]
pub struct Recorder {
    histogram: Histogram<u64>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self::new()
    }
}

impl Recorder {
    /// Microsecond resolution, up to one minute.
    pub fn new() -> Self {
        Self {
            histogram: Histogram::new_with_bounds(1, 60_000_000, 3)
                .unwrap_or_else(|_| Histogram::new(3).unwrap_or_else(|_| unreachable!())),
        }
    }

    /// Records one operation's latency.
    pub fn record(&mut self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        let _ = self.histogram.record(micros.min(self.histogram.high()));
    }

    /// Merges another recorder (one per client task).
    pub fn merge(&mut self, other: &Recorder) {
        let _ = self.histogram.add(&other.histogram);
    }

    /// The summary of a scenario that ran `wall` in total.
    pub fn summary(&self, wall: Duration) -> LatencySummary {
        let h = &self.histogram;
        let ms = |us: u64| us as f64 / 1000.0;
        LatencySummary {
            operations: h.len(),
            wall_seconds: wall.as_secs_f64(),
            ops_per_second: h.len() as f64 / wall.as_secs_f64(),
            p50_ms: ms(h.value_at_quantile(0.50)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
        }
    }
}

/// Throughput and latency of one scenario.
#[derive(Debug, Clone, Serialize)]
pub struct LatencySummary {
    pub operations: u64,
    pub wall_seconds: f64,
    pub ops_per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// The machine a result was measured on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu_model: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub kernel: String,
    pub etcd_version: String,
}

impl Machine {
    /// Reads /proc and asks etcd for its version.
    pub fn describe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
            })
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_kib: f64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|r| r.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned();
        let etcd_version = trellis_testkit::tool_path("etcd")
            .and_then(|etcd| {
                std::process::Command::new(etcd)
                    .arg("--version")
                    .output()
                    .ok()
            })
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| {
                s.lines()
                    .next()
                    .map(|l| l.trim_start_matches("etcd Version: ").to_owned())
            })
            .unwrap_or_else(|| "not installed".into());
        Self {
            cpu_model,
            cores: std::thread::available_parallelism().map_or(0, usize::from),
            memory_gib: (memory_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
            kernel,
            etcd_version,
        }
    }
}
