//! Shared pieces of the benchmark binaries: a latency recorder, the description of the
//! machine a run happened on, what identifies a run (date, git commit, quick or full, a
//! free-form note), the writing of a JSON result file, and the per-process measurements read
//! from /proc, and the reference tunnels of the data-plane benchmark, wireguard-go and GotaTun
//! ([`mod@reference`]). What the result files hold is [`results`], the one schema the
//! benchmarks write and the report generator (`bench-report`, [`report`]) reads. The larger
//! benchmarks' parts live in [`mesh`], [`dataplane`] and [`nat`]; their binaries keep `main` and
//! flags.

pub mod dataplane;
pub mod dns;
pub mod mesh;
pub mod nat;
pub mod proc;
pub mod reference;
pub mod report;
pub mod results;
pub mod svg;

pub use results::{LatencySummary, Machine, RunInfo, RunKind};

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
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

/// Flags every benchmark binary shares (flattened into each one's arguments).
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Which suite this run belongs to; recorded in the JSON and shown in
    /// docs/benchmarks.md next to the numbers (`make bench-quick` passes `quick`).
    #[arg(long, value_enum, default_value_t = RunKind::Full)]
    pub run_kind: RunKind,
    /// Free-form note on the conditions of this run (e.g. "other builds shared the machine"),
    /// recorded in the JSON and shown in the document's machine section.
    #[arg(long, env = "TRELLIS_BENCH_NOTE", default_value = "")]
    pub note: String,
}

impl RunInfo {
    /// Describes the run that is starting now.
    pub fn start(args: &RunArgs) -> Self {
        let command = std::env::args()
            .enumerate()
            .map(|(i, a)| {
                if i == 0 {
                    // The path of the binary depends on the target dir; its name does not.
                    Path::new(&a)
                        .file_name()
                        .map_or(a.clone(), |n| n.to_string_lossy().into_owned())
                } else {
                    a
                }
            })
            .collect();
        Self {
            kind: Some(args.run_kind),
            timestamp: Some(utc_now()),
            git_commit: Some(git_commit()),
            load_average_1m: std::fs::read_to_string("/proc/loadavg")
                .ok()
                .and_then(|l| l.split_whitespace().next()?.parse().ok()),
            note: args.note.clone(),
            command,
        }
    }
}

fn git_commit() -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "HEAD"]) {
        Some(head) if !head.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| changes_beyond_outputs(&s));
            if dirty { format!("{head}+dirty") } else { head }
        }
        _ => "unknown".into(),
    }
}

/// What the benchmarks write themselves: a suite run changes them before its later
/// benchmarks start, which is not a change of the tree they measure.
const OUTPUTS: &[&str] = &["bench/results/", "docs/bench/", "docs/benchmarks.md"];

/// Whether `git status --porcelain` output lists a change outside [`OUTPUTS`].
fn changes_beyond_outputs(porcelain: &str) -> bool {
    porcelain.lines().any(|line| {
        // "XY path", or "XY from -> to" for a rename: both ends count.
        let paths = line.get(3..).unwrap_or_default();
        paths.split(" -> ").any(|path| {
            !OUTPUTS
                .iter()
                .any(|o| path.trim_matches('"').starts_with(o))
        })
    })
}

/// The current time, UTC, as `YYYY-MM-DDTHH:MM:SSZ` (no date crate for one line).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs)
}

/// Seconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ` (Howard Hinnant's civil-from-days).
pub fn format_utc(secs: u64) -> String {
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The median of `values` (the upper one of the two middle values for an even count, so it
/// is always a measured value); `None` when empty.
pub fn median(values: &[f64]) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied()
}

/// `a / b`; none when either is missing or `b` is not positive.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Writes `value` as pretty JSON to `path`, creating its directory.
pub fn write_json(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, serde_json::to_string_pretty(value)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_dates() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(format_utc(1_795_320_000), "2026-11-22T04:00:00Z");
    }

    /// A suite run writes its results before its later benchmarks start: those files do not
    /// make the measured tree dirty; anything else does.
    #[test]
    fn only_changes_beyond_the_results_make_a_run_dirty() {
        assert!(!changes_beyond_outputs(""));
        assert!(!changes_beyond_outputs(
            " M bench/results/mesh.json\n M docs/bench/mesh-setup-vs-leaves.svg\n M docs/benchmarks.md\n"
        ));
        assert!(changes_beyond_outputs(
            " M bench/results/mesh.json\n M services/forwarder/src/core.rs\n"
        ));
        assert!(changes_beyond_outputs("M  bench/notes/mesh.md\n"));
        assert!(changes_beyond_outputs(
            "R  crates/a.rs -> bench/results/a.json\n"
        ));
    }

    #[test]
    fn median_is_a_measured_value() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0]), Some(4.0));
        assert_eq!(median(&[]), None);
    }
}
