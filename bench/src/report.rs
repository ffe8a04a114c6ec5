//! The report generator behind `bench-report`: reads the benchmark results
//! (`bench/results/*.json`, and `bench/results/quick/*.json` from `make bench-quick`) and the
//! hand-written notes (`bench/notes/*.md`), and produces `docs/benchmarks.md` and the SVG plots
//! in `docs/bench/`. Every number in the output comes from the JSON: tables directly, and the
//! notes through `{{benchmark:/json/pointer}}` placeholders (`{{…|N}}` for N decimals).
//!
//! For each benchmark the newer of the full and the quick result is shown (by the run's
//! timestamp; results written before runs were timestamped count as oldest), and its section
//! says which run it is. Missing or unreadable results are reported as such, never invented.
//! Output depends on the inputs only (no clock), so a test can regenerate it and compare.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::Deserialize;
use serde_json::Value;

use crate::svg::{self, BarChart, LineChart, Scale, Series};

/// The benchmarks, by result file name (`<name>.json`).
pub const BENCHMARKS: [&str; 10] = [
    "ipam",
    "mesh",
    "mesh-hub-processes",
    "mesh-hub-etcd",
    "mesh-etcd",
    "endpoints",
    "exports",
    "dataplane",
    "dataplane-nodes",
    "failover",
];

/// Earlier measurements kept for the notes' "what changed" sections (full results only).
pub const HISTORY: &str = "history";

/// Mesh benchmarks also run, in the same `make bench` run, against the reference build (the
/// `main` branch, with this run's benchmark harness; see `scripts/bench.sh`): (result, the
/// reference's result, label). The document shows them side by side as ratios.
pub const REFERENCES: [(&str, &str, &str); 2] = [
    ("mesh", "mesh-main", "in process (memory)"),
    (
        "mesh-hub-processes",
        "mesh-hub-processes-main",
        "hub processes (memory)",
    ),
];

/// One result file as read.
#[derive(Debug, Clone)]
pub enum Loaded {
    Found { path: String, value: Value },
    Missing,
    Unreadable { path: String, error: String },
}

impl Loaded {
    fn value(&self) -> Option<&Value> {
        match self {
            Loaded::Found { value, .. } => Some(value),
            _ => None,
        }
    }
}

/// Everything the document is generated from.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// By benchmark name.
    pub results: BTreeMap<String, Loaded>,
    /// By note name (file stem in `bench/notes/`).
    pub notes: BTreeMap<String, String>,
}

/// The generated files, relative to the repository root.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub files: Vec<(PathBuf, String)>,
}

pub const DOC: &str = "docs/benchmarks.md";
pub const PLOT_DIR: &str = "docs/bench";

fn read_json(root: &Path, rel: &str) -> Loaded {
    let path = root.join(rel);
    match std::fs::read_to_string(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Loaded::Missing,
        Err(e) => Loaded::Unreadable {
            path: rel.into(),
            error: e.to_string(),
        },
        Ok(text) => match serde_json::from_str(&text) {
            Ok(value) => Loaded::Found {
                path: rel.into(),
                value,
            },
            Err(e) => Loaded::Unreadable {
                path: rel.into(),
                error: e.to_string(),
            },
        },
    }
}

fn timestamp(loaded: &Loaded) -> Option<&str> {
    loaded.value()?.pointer("/run/timestamp")?.as_str()
}

/// The newer of a full and a quick result (RFC 3339 UTC timestamps sort as text); a full
/// result wins ties and untimestamped pairs; a readable one wins over an unreadable one.
pub fn newest(full: Loaded, quick: Loaded) -> Loaded {
    match (&full, &quick) {
        (_, Loaded::Missing) => full,
        (Loaded::Missing | Loaded::Unreadable { .. }, Loaded::Found { .. }) => quick,
        (Loaded::Missing, _) => quick,
        (Loaded::Found { .. }, Loaded::Unreadable { .. }) => full,
        (Loaded::Unreadable { .. }, Loaded::Unreadable { .. }) => full,
        (Loaded::Found { .. }, Loaded::Found { .. }) => {
            if timestamp(&quick) > timestamp(&full) {
                quick
            } else {
                full
            }
        }
    }
}

impl Inputs {
    /// Reads the results and notes under the repository root `root`.
    pub fn read(root: &Path) -> anyhow::Result<Self> {
        let mut results = BTreeMap::new();
        for name in BENCHMARKS {
            let full = read_json(root, &format!("bench/results/{name}.json"));
            let quick = read_json(root, &format!("bench/results/quick/{name}.json"));
            results.insert(name.to_owned(), newest(full, quick));
        }
        results.insert(
            HISTORY.to_owned(),
            read_json(root, &format!("bench/results/{HISTORY}.json")),
        );
        for (_, name, _) in REFERENCES {
            let full = read_json(root, &format!("bench/results/{name}.json"));
            let quick = read_json(root, &format!("bench/results/quick/{name}.json"));
            results.insert(name.to_owned(), newest(full, quick));
        }
        let mut notes = BTreeMap::new();
        let dir = root.join("bench/notes");
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "md")
                && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
            {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                notes.insert(stem.to_owned(), text);
            }
        }
        Ok(Self { results, notes })
    }
}

// ---------------------------------------------------------------------------------------------
// The results, as far as the document needs them. Every field is optional or defaulted, so that
// results written by earlier versions of the benchmarks stay readable.

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct RunMeta {
    kind: Option<String>,
    timestamp: Option<String>,
    git_commit: Option<String>,
    load_average_1m: Option<f64>,
    note: String,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
struct MachineMeta {
    cpu_model: String,
    cores: usize,
    memory_gib: f64,
    kernel: String,
    etcd_version: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct Common {
    run: Option<RunMeta>,
    machine: Option<MachineMeta>,
}

fn one() -> usize {
    1
}

fn map_rpc() -> String {
    "MapEndpointIp".into()
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct IpamDoc {
    scenarios: Vec<IpamScenario>,
    consistency: Vec<ConsistencyDoc>,
    parameters: Option<Value>,
    metrics_overhead: Option<MetricsOverheadDoc>,
}

/// ipam-bench's metrics-overhead variant.
#[derive(Debug, Clone, Deserialize)]
struct MetricsOverheadDoc {
    store: String,
    rpc: String,
    path: String,
    #[serde(default)]
    concurrency: usize,
    with_metrics: LatencyDoc,
    without_metrics: LatencyDoc,
    #[serde(default)]
    ratios: Vec<f64>,
    throughput_ratio: f64,
    /// Set when the variant ran in another invocation than the rest of the document (its
    /// `run` block: timestamp, commit, load).
    #[serde(default)]
    run: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
struct LatencyDoc {
    ops_per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
}

#[derive(Debug, Clone, Deserialize)]
struct IpamScenario {
    store: String,
    #[serde(default = "one")]
    replicas: usize,
    #[serde(default = "map_rpc")]
    rpc: String,
    path: String,
    #[serde(default)]
    concurrency: usize,
    #[serde(default)]
    operations: u64,
    ops_per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    #[serde(default)]
    runs: Vec<Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct ConsistencyDoc {
    store: String,
    replicas: usize,
    clients: usize,
    endpoints_checked: usize,
    clusters_checked: usize,
    endpoint_disagreements: usize,
    shared_addresses: usize,
    cluster_disagreements: usize,
    overlapping_ranges: usize,
    errors: usize,
    examples: Vec<String>,
    consistent: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct MeshDoc {
    mode: Option<String>,
    sizes: Vec<MeshSize>,
    parameters: Option<Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct MeshRun {
    seconds: f64,
    converged: Option<bool>,
    open_files: Option<usize>,
    peer_retries: Option<usize>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct StoreUse {
    keys: usize,
    bytes: usize,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct HubStores {
    discovery: StoreUse,
    broker: StoreUse,
    forwarder: StoreUse,
    ipam: StoreUse,
    gateway: StoreUse,
    total: StoreUse,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct HubProcess {
    service: String,
    cpu_seconds: f64,
    cpu_seconds_during_setup: f64,
    peak_rss_kib: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct MeshSize {
    leaves: usize,
    induced_tunnel_endpoints: usize,
    /// Absent in results from before timeouts were recorded: those converged.
    status: Option<String>,
    reason: Option<String>,
    runs: Vec<MeshRun>,
    median_seconds: Option<f64>,
    hub_tunnel_endpoints: Option<usize>,
    hub_network_configs: Option<usize>,
    hub_relays_in_flight: Option<usize>,
    hub_ipam_records: Option<usize>,
    hub_stores: Option<HubStores>,
    hub_processes: Option<Vec<HubProcess>>,
    hub_cpu_seconds_during_setup: Option<f64>,
    hub_peak_rss_kib_total: Option<u64>,
    hub_etcd_keys: Option<BTreeMap<String, usize>>,
    median_full_tunnels_seconds: Option<f64>,
    median_tail_share: Option<f64>,
    median_hub_cpu_ms_per_induced_tunnel: Option<f64>,
    median_hub_etcd_writes_per_induced_tunnel: Option<f64>,
    /// The benchmark process (in process: every cluster): peak RSS and CPU seconds per run.
    median_process_peak_rss_kib: Option<u64>,
    median_process_cpu_seconds: Option<f64>,
}

impl MeshSize {
    fn status(&self) -> &str {
        self.status.as_deref().unwrap_or("converged")
    }

    fn converged_median(&self) -> Option<f64> {
        (self.status() == "converged")
            .then_some(self.median_seconds)
            .flatten()
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct EndpointsDoc {
    scenarios: Vec<EndpointsScenario>,
    parameters: Option<Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct ExportsDoc {
    parameters: Option<Value>,
    mesh_seconds: f64,
    change_latency: Option<ExportsLatency>,
    bulk_seconds: Vec<f64>,
    reflected_endpoints_per_second: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct ExportsLatency {
    operations: u64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct EndpointsScenario {
    store: String,
    path: String,
    concurrency: usize,
    slice_size: usize,
    endpoints_per_second: f64,
    ops_per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct Rtt {
    samples: usize,
    lost: u32,
    min_ms: f64,
    median_ms: f64,
    p90_ms: f64,
    max_ms: f64,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct ThroughputDoc {
    tunnel_mbit_s: f64,
    bare_veth_mbit_s: f64,
    tunnel_fraction_of_bare: f64,
    seconds: u32,
}

/// One tunnel's iperf3 runs at one stream count (`dataplane-bench`'s side by side).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct SideDoc {
    runs: Vec<Value>,
    median_mbit_s: Option<f64>,
    min_mbit_s: Option<f64>,
    max_mbit_s: Option<f64>,
    median_cpu_seconds_per_gb: Option<f64>,
    min_cpu_seconds_per_gb: Option<f64>,
    max_cpu_seconds_per_gb: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct ComparisonDoc {
    streams: u32,
    trellis: SideDoc,
    wireguard_go: SideDoc,
    ratio_mbit_s: Option<f64>,
    ratio_cpu_seconds_per_gb: Option<f64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct RttOverheadDoc {
    tunnel: Option<Rtt>,
    bare: Option<Rtt>,
    overhead_ms: Option<f64>,
}

/// Trellis's tunnel against wireguard-go, in turns in one run.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct SideBySideDoc {
    reference: String,
    rounds: u32,
    iperf_seconds: u32,
    throughput: Vec<ComparisonDoc>,
    rtt_trellis: Option<RttOverheadDoc>,
    rtt_wireguard_go: Option<RttOverheadDoc>,
}

impl SideBySideDoc {
    fn at(&self, streams: u32) -> Option<&ComparisonDoc> {
        self.throughput.iter().find(|c| c.streams == streams)
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct DataplaneDoc {
    wireguard: String,
    build: String,
    emulation: String,
    store: String,
    rtt_through_zero_delay_relay: Option<Rtt>,
    hub_link_rtt_ms: f64,
    leaf_link_rtt_ms: f64,
    rtt_no_netem_tunnel: Option<Rtt>,
    rtt_no_netem_bare: Option<Rtt>,
    throughput: Option<ThroughputDoc>,
    rtt_induced: Option<Rtt>,
    rtt_hub_path: Option<Rtt>,
    ratio_hub_over_induced: Option<f64>,
    thesis_induced_ms: Option<f64>,
    thesis_hub_ms: Option<f64>,
    induced_ready_seconds: Option<f64>,
    hub_ready_seconds: Option<f64>,
    samples: Option<u32>,
    side_by_side: Option<SideBySideDoc>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct NodePathDoc {
    wireguard: String,
    build: String,
    store: String,
    samples: Option<u32>,
    iperf_seconds: Option<u32>,
    nodes_per_cluster: Option<u32>,
    rtt_gateway_nodes: Option<Rtt>,
    rtt_non_gateway_nodes: Option<Rtt>,
    mbit_s_gateway_nodes: Vec<f64>,
    mbit_s_non_gateway_nodes: Vec<f64>,
    rtt_ratio: Option<f64>,
    throughput_ratio: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct FailoverDoc {
    parameters: FailoverParameters,
    kills: Vec<FailoverKill>,
    takeover_ms: FailoverSpread,
    probe_gap_ms: FailoverSpread,
    tcp_connections: usize,
    tcp_broken: usize,
}

#[derive(Debug, Deserialize)]
struct FailoverParameters {
    kills: usize,
    connections_per_destination: usize,
    pushed_per_destination: usize,
}

#[derive(Debug, Deserialize)]
struct FailoverKill {
    cluster: String,
    probe_gap_ms: f64,
    tcp_broken: usize,
}

#[derive(Debug, Deserialize)]
struct FailoverSpread {
    p50: f64,
    p99: f64,
    max: f64,
}

/// A parsed result with where it came from.
struct Parsed<T> {
    path: String,
    common: Common,
    doc: T,
}

/// Parses benchmark `name`, or says why there is nothing to show.
fn parse<T: for<'de> Deserialize<'de>>(inputs: &Inputs, name: &str) -> Result<Parsed<T>, String> {
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

// ---------------------------------------------------------------------------------------------
// Formatting.

/// A number with `decimals` decimals and thin grouping of thousands (as in the earlier
/// hand-written tables: `49 788`).
pub fn num(v: f64, decimals: usize) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    let text = format!("{:.*}", decimals, v.abs());
    let (int, frac) = text
        .split_once('.')
        .map_or((text.as_str(), None), |(i, f)| (i, Some(f)));
    let mut grouped = String::new();
    let digits: Vec<char> = int.chars().collect();
    for (i, c) in digits.iter().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) && digits.len() > 4 {
            grouped.push(' ');
        }
        grouped.push(*c);
    }
    let sign = if v < 0.0 && text.chars().any(|c| c != '0' && c != '.') {
        "-"
    } else {
        ""
    };
    match frac {
        Some(f) => format!("{sign}{grouped}.{f}"),
        None => format!("{sign}{grouped}"),
    }
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "—".into(), |v| num(v, decimals))
}

fn opt_usize(v: Option<usize>) -> String {
    v.map_or_else(|| "—".into(), |v| num(v as f64, 0))
}

fn short_commit(c: &str) -> String {
    let (hash, dirty) = c.split_once('+').map_or((c, ""), |(h, d)| (h, d));
    let short: String = hash.chars().take(10).collect();
    if dirty.is_empty() {
        short
    } else {
        format!("{short}+{dirty}")
    }
}

/// "Run: quick, 2026-…, commit …, `path`." for a section.
fn run_line(path: &str, common: &Common) -> String {
    let run = common.run.clone().unwrap_or_default();
    let mut line = format!(
        "*Result: `{path}`; run: {}",
        run.kind
            .as_deref()
            .unwrap_or("full (written before runs were labelled)")
    );
    match &run.timestamp {
        Some(t) => {
            let _ = write!(line, ", started {t}");
        }
        None => line.push_str(", date not recorded"),
    }
    match &run.git_commit {
        Some(c) => {
            let _ = write!(line, ", commit `{}`", short_commit(c));
        }
        None => line.push_str(", commit not recorded"),
    }
    if let Some(l) = run.load_average_1m {
        let _ = write!(line, ", 1-minute load average {} at start", num(l, 2));
    }
    line.push_str(".*");
    if !run.note.is_empty() {
        let _ = write!(line, " Note: {}", run.note.trim());
    }
    line
}

/// Replaces `{{bench:/pointer}}` and `{{bench:/pointer|N}}` in a note with values from the
/// results; anything that cannot be resolved becomes a visible "(not measured: …)".
pub fn fill(note: &str, inputs: &Inputs) -> String {
    let mut out = String::new();
    let mut rest = note;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        out.push_str(&placeholder(after[..end].trim(), inputs));
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

fn placeholder(spec: &str, inputs: &Inputs) -> String {
    let (reference, decimals) = match spec.split_once('|') {
        Some((r, d)) => (r.trim(), d.trim().parse::<usize>().ok()),
        None => (spec, None),
    };
    let Some((name, pointer)) = reference.split_once(':') else {
        return format!("(bad placeholder `{spec}`)");
    };
    let value = inputs
        .results
        .get(name)
        .and_then(Loaded::value)
        .and_then(|v| v.pointer(pointer));
    match value {
        None => format!("(not measured: no `{reference}`)"),
        Some(Value::Number(n)) => match (n.as_f64(), decimals) {
            (Some(f), Some(d)) => num(f, d),
            (Some(f), None) if n.is_f64() => num(f, 3),
            _ => n.to_string(),
        },
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

fn note(inputs: &Inputs, name: &str) -> String {
    inputs
        .notes
        .get(name)
        .map(|n| fill(n.trim(), inputs) + "\n\n")
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Targets.

/// Whether a target is met.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Met,
    NotMet,
    NotMeasured,
}

impl Verdict {
    fn text(&self) -> &'static str {
        match self {
            Verdict::Met => "**met**",
            Verdict::NotMet => "**not met**",
            Verdict::NotMeasured => "not measured",
        }
    }
}

/// One target (issues 9, 17 and 18) and what the results say about it.
#[derive(Debug, Clone)]
pub struct Target {
    pub target: &'static str,
    pub measured: String,
    pub verdict: Verdict,
}

/// Exponent k of `y ≈ c·x^k`, least squares in log-log; `None` with fewer than two points.
pub fn power_fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let logs: Vec<(f64, f64)> = points
        .iter()
        .filter(|(x, y)| *x > 0.0 && *y > 0.0)
        .map(|(x, y)| (x.ln(), y.ln()))
        .collect();
    if logs.len() < 2 {
        return None;
    }
    let n = logs.len() as f64;
    let mx = logs.iter().map(|p| p.0).sum::<f64>() / n;
    let my = logs.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = logs.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx == 0.0 {
        return None;
    }
    let sxy: f64 = logs.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let k = sxy / sxx;
    Some((k, (my - k * mx).exp()))
}

fn mesh_target_size(
    mesh: &Result<Parsed<MeshDoc>, String>,
    leaves: usize,
) -> (String, Option<&MeshSize>) {
    match mesh {
        Err(why) => (why.clone(), None),
        Ok(p) => match p.doc.sizes.iter().find(|s| s.leaves == leaves) {
            None => (
                format!(
                    "1 hub + {leaves} leaves not in `{}` (sizes run: {})",
                    p.path,
                    p.doc
                        .sizes
                        .iter()
                        .map(|s| s.leaves.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                None,
            ),
            Some(s) => (String::new(), Some(s)),
        },
    }
}

fn not_converged_text(s: &MeshSize) -> String {
    format!(
        "1 hub + {} leaves: {}{}",
        s.leaves,
        s.status().replace('_', " "),
        s.reason
            .as_deref()
            .map(|r| format!(" ({r})"))
            .unwrap_or_default()
    )
}

/// One figure of issue 17: `value` of `leaves` in `doc` (and of its `-main` reference run),
/// met when `met` holds.
struct ScaleTarget {
    target: &'static str,
    doc: &'static str,
    leaves: usize,
    unit: &'static str,
    value: fn(&MeshSize) -> Option<f64>,
    met: fn(f64) -> bool,
}

/// Issue 17's targets, each with main's figure from the same run and the ratio.
fn scale_targets(inputs: &Inputs, mesh: &Result<Parsed<MeshDoc>, String>) -> Vec<Target> {
    let hub = parse::<MeshDoc>(inputs, "mesh-hub-processes");
    let figures = [
        ScaleTarget {
            target: "1 hub + 254 leaves in process converge in under 30 s (issue 17)",
            doc: "mesh",
            leaves: 254,
            unit: " s",
            value: MeshSize::converged_median,
            met: |v| v < 30.0,
        },
        ScaleTarget {
            target: "every full tunnel up within 10 s at 254 leaves (issue 17)",
            doc: "mesh",
            leaves: 254,
            unit: " s",
            value: |s| s.median_full_tunnels_seconds,
            met: |v| v <= 10.0,
        },
        ScaleTarget {
            target: "90 → 100 % of the induced tunnels under 20 % of the setup at 254 leaves (issue 17)",
            doc: "mesh",
            leaves: 254,
            unit: "",
            value: |s| s.median_tail_share,
            met: |v| v < 0.2,
        },
        ScaleTarget {
            target: "1 hub + 100 leaves in process under 4 s (issue 17)",
            doc: "mesh",
            leaves: 100,
            unit: " s",
            value: MeshSize::converged_median,
            met: |v| v < 4.0,
        },
        ScaleTarget {
            target: "hub CPU per induced tunnel at most 0.1 ms, hub as processes, 100 leaves (issue 17)",
            doc: "mesh-hub-processes",
            leaves: 100,
            unit: " ms",
            value: |s| s.median_hub_cpu_ms_per_induced_tunnel,
            met: |v| v <= 0.1,
        },
        ScaleTarget {
            target: "1 hub + 254 leaves in process peak under 1.5 GB of RSS, the bench's own reading (issue 17)",
            doc: "mesh",
            leaves: 254,
            unit: " GB",
            // Each run is a process of its own (mesh-bench's `--one-run`), so its peak is its own.
            value: |s| {
                s.median_process_peak_rss_kib
                    .map(|kib| kib as f64 * 1024.0 / 1e9)
            },
            met: |v| v < 1.5,
        },
    ];
    figures
        .into_iter()
        .map(|f| {
            let doc = if f.doc == "mesh" { mesh } else { &hub };
            let (why, size) = mesh_target_size(doc, f.leaves);
            let Some(value) = size.and_then(f.value) else {
                return Target {
                    target: f.target,
                    measured: size.map_or(why, not_converged_text),
                    verdict: Verdict::NotMeasured,
                };
            };
            let reference = parse::<MeshDoc>(inputs, &format!("{}-main", f.doc));
            let main = match mesh_target_size(&reference, f.leaves) {
                (_, Some(s)) => (f.value)(s),
                _ => None,
            };
            let measured = match main {
                Some(main) if main > 0.0 => format!(
                    "{}{unit}; main in the same run {}{unit} (ratio {})",
                    num(value, 3),
                    num(main, 3),
                    num(value / main, 2),
                    unit = f.unit
                ),
                _ => format!("{}{}; main not measured in this run", num(value, 3), f.unit),
            };
            Target {
                target: f.target,
                measured,
                verdict: if (f.met)(value) {
                    Verdict::Met
                } else {
                    Verdict::NotMet
                },
            }
        })
        .collect()
}

/// Computes every target's verdict from the results.
pub fn targets(inputs: &Inputs) -> Vec<Target> {
    let mut out = Vec::new();
    let mesh = parse::<MeshDoc>(inputs, "mesh");
    let cores = mesh
        .as_ref()
        .ok()
        .and_then(|p| p.common.machine.as_ref())
        .map(|m| m.cores);

    // 1. 100 leaves under 10 s.
    let (why, size) = mesh_target_size(&mesh, 100);
    out.push(match size {
        None => Target {
            target: "100-cluster full mesh under 10 s in-process on 2 cores",
            measured: why,
            verdict: Verdict::NotMeasured,
        },
        Some(s) => match s.converged_median() {
            Some(m) => Target {
                target: "100-cluster full mesh under 10 s in-process on 2 cores",
                measured: format!(
                    "1 hub + 100 leaves: median {} s ({} cores)",
                    num(m, 3),
                    cores.map_or("?".into(), |c| c.to_string())
                ),
                verdict: if m < 10.0 {
                    Verdict::Met
                } else {
                    Verdict::NotMet
                },
            },
            None => Target {
                target: "100-cluster full mesh under 10 s in-process on 2 cores",
                measured: not_converged_text(s),
                // A run that failed (e.g. Peer requests timing out under load) did not converge
                // either; a skipped one was not tried.
                verdict: if matches!(s.status(), "timed_out" | "failed") {
                    Verdict::NotMet
                } else {
                    Verdict::NotMeasured
                },
            },
        },
    });

    // 2. Growth no worse than linear in total tunnels.
    let growth = "growth no worse than linear in total tunnels n·(n-1)";
    out.push(match &mesh {
        Err(why) => Target {
            target: growth,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(p) => {
            let points: Vec<(usize, f64)> = p
                .doc
                .sizes
                .iter()
                .filter_map(|s| Some((s.leaves, s.converged_median()?)))
                .collect();
            if points.len() < 3 {
                Target {
                    target: growth,
                    measured: format!(
                        "{} converged size(s) in `{}`; a trend needs at least 3",
                        points.len(),
                        p.path
                    ),
                    verdict: Verdict::NotMeasured,
                }
            } else {
                let xy: Vec<(f64, f64)> = points.iter().map(|(n, s)| (tunnels(*n) as f64, *s)).collect();
                let largest = &xy[xy.len() - 3..];
                let (k_large, _) = power_fit(largest).unwrap_or((f64::NAN, 0.0));
                let (k_all, _) = power_fit(&xy).unwrap_or((f64::NAN, 0.0));
                let per = |i: usize| 1000.0 * points[i].1 / tunnels(points[i].0) as f64;
                let first = points.len() - 3;
                Target {
                    target: growth,
                    measured: format!(
                        "seconds ∝ tunnels^k with k = {} over the three largest converged sizes ({}–{} leaves; k = {} over all {}); per induced tunnel {} ms at {} leaves, {} ms at {}",
                        num(k_large, 2),
                        points[first].0,
                        points[points.len() - 1].0,
                        num(k_all, 2),
                        points.len(),
                        num(per(first), 2),
                        points[first].0,
                        num(per(points.len() - 1), 2),
                        points[points.len() - 1].0
                    ),
                    verdict: if k_large <= 1.0 {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
        }
    });

    // 3. 254 leaves converge.
    let (why, size) = mesh_target_size(&mesh, 254);
    let t254 = "254 leaves (Cilium ClusterMesh's 255-cluster ceiling minus the hub) converge";
    out.push(match size {
        None => Target {
            target: t254,
            measured: why,
            verdict: Verdict::NotMeasured,
        },
        Some(s) => match s.converged_median() {
            Some(m) => Target {
                target: t254,
                measured: format!("converged, median {} s", num(m, 3)),
                verdict: Verdict::Met,
            },
            None => Target {
                target: t254,
                measured: not_converged_text(s),
                // A run that failed (e.g. Peer requests timing out under load) did not converge
                // either; a skipped one was not tried.
                verdict: if matches!(s.status(), "timed_out" | "failed") {
                    Verdict::NotMet
                } else {
                    Verdict::NotMeasured
                },
            },
        },
    });

    // 4 and 5. IPAM p99.
    let ipam = parse::<IpamDoc>(inputs, "ipam");
    for (store, limit, target) in [
        ("memory", 2.0, "IPAM p99 under 2 ms with the memory store"),
        ("etcd", 10.0, "IPAM p99 under 10 ms with etcd"),
    ] {
        out.push(match &ipam {
            Err(why) => Target {
                target,
                measured: why.clone(),
                verdict: Verdict::NotMeasured,
            },
            Ok(p) => {
                let of_store: Vec<&IpamScenario> = p
                    .doc
                    .scenarios
                    .iter()
                    .filter(|s| s.store == store)
                    .collect();
                let worst = of_store.iter().max_by(|a, b| a.p99_ms.total_cmp(&b.p99_ms));
                match worst {
                    None => Target {
                        target,
                        measured: format!("no {store} scenario in `{}`", p.path),
                        verdict: Verdict::NotMeasured,
                    },
                    Some(w) => {
                        let over: Vec<String> = of_store
                            .iter()
                            .filter(|s| s.p99_ms >= limit)
                            .map(|s| scenario_name(s))
                            .collect();
                        Target {
                            target,
                            measured: if over.is_empty() {
                                format!(
                                    "worst p99 {} ms ({}) over {} scenarios",
                                    num(w.p99_ms, 3),
                                    scenario_name(w),
                                    of_store.len()
                                )
                            } else {
                                format!(
                                    "worst p99 {} ms ({}); at or over {} ms: {}",
                                    num(w.p99_ms, 3),
                                    scenario_name(w),
                                    num(limit, 0),
                                    over.join("; ")
                                )
                            },
                            verdict: if over.is_empty() {
                                Verdict::Met
                            } else {
                                Verdict::NotMet
                            },
                        }
                    }
                }
            }
        });
    }

    // 6 and 7. Data plane.
    let dp = parse::<DataplaneDoc>(inputs, "dataplane");
    let rtt_target = "induced leaf↔leaf RTT within 2 ms of the emulated link RTT";
    out.push(match &dp {
        Err(why) => Target {
            target: rtt_target,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(p) => match &p.doc.rtt_induced {
            None => Target {
                target: rtt_target,
                measured: format!("no induced RTT in `{}`", p.path),
                verdict: Verdict::NotMeasured,
            },
            Some(r) => {
                let over = r.median_ms - p.doc.leaf_link_rtt_ms;
                let mut measured = format!(
                    "median {} ms for an emulated {} ms ({} ms above; link delays by {})",
                    num(r.median_ms, 1),
                    num(p.doc.leaf_link_rtt_ms, 0),
                    num(over, 1),
                    p.doc.emulation.replace('_', " ")
                );
                if let (Some(relay), Some(bare)) = (
                    &p.doc.rtt_through_zero_delay_relay,
                    &p.doc.rtt_no_netem_tunnel,
                ) {
                    let own = relay.median_ms - bare.median_ms;
                    let _ = write!(
                        measured,
                        "; the relays' own measured cost is {} ms, without it {} ms above",
                        num(own, 2),
                        num(over - own, 1)
                    );
                }
                Target {
                    target: rtt_target,
                    measured,
                    verdict: if over <= 2.0 {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
        },
    });
    let tp_target = "userspace tunnel throughput at least 30 % of the bare veth path";
    out.push(match &dp {
        Err(why) => Target {
            target: tp_target,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(p) => match &p.doc.throughput {
            Some(t) if t.bare_veth_mbit_s > 0.0 => {
                let fraction = t.tunnel_mbit_s / t.bare_veth_mbit_s;
                Target {
                    target: tp_target,
                    measured: format!(
                        "{} of {} Mbit/s: {} %",
                        num(t.tunnel_mbit_s, 0),
                        num(t.bare_veth_mbit_s, 0),
                        num(100.0 * fraction, 1)
                    ),
                    verdict: if fraction >= 0.30 {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
            _ => Target {
                target: tp_target,
                measured: format!("no throughput in `{}`", p.path),
                verdict: Verdict::NotMeasured,
            },
        },
    });

    // 8 and 9 (issue 18). Against wireguard-go in the same run.
    let sbs = dp.as_ref().map_err(Clone::clone).and_then(|p| {
        p.doc.side_by_side.as_ref().ok_or_else(|| {
            format!(
                "no side-by-side comparison with wireguard-go in `{}`",
                p.path
            )
        })
    });
    let ratio_target =
        "Trellis at least 1.5× wireguard-go's throughput, one and four TCP streams, same run";
    out.push(match &sbs {
        Err(why) => Target {
            target: ratio_target,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(c) => {
            let at: Vec<Option<(u32, f64)>> = [1, 4]
                .iter()
                .map(|&n| {
                    let c = c.at(n)?;
                    Some((n, c.ratio_mbit_s?))
                })
                .collect();
            if at.iter().any(Option::is_none) {
                Target {
                    target: ratio_target,
                    measured: "the comparison lacks one or four streams".into(),
                    verdict: Verdict::NotMeasured,
                }
            } else {
                let at: Vec<(u32, f64)> = at.into_iter().flatten().collect();
                Target {
                    target: ratio_target,
                    measured: at
                        .iter()
                        .map(|(n, r)| {
                            format!(
                                "{} stream{}: ×{}",
                                n,
                                if *n == 1 { "" } else { "s" },
                                num(*r, 2)
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("; "),
                    verdict: if at.iter().all(|(_, r)| *r >= 1.5) {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
        }
    });
    let overhead_target =
        "tunnel RTT overhead (tunnel minus bare underlay, same run) at most 0.3 ms";
    out.push(match &sbs {
        Err(why) => Target {
            target: overhead_target,
            measured: why.clone(),
            verdict: Verdict::NotMeasured,
        },
        Ok(c) => match c.rtt_trellis.as_ref().and_then(|r| r.overhead_ms) {
            None => Target {
                target: overhead_target,
                measured: "no RTT overhead recorded".into(),
                verdict: Verdict::NotMeasured,
            },
            Some(ms) => {
                let mut measured = format!("{} ms", num(ms, 3));
                if let Some(wg) = c.rtt_wireguard_go.as_ref().and_then(|r| r.overhead_ms) {
                    let _ = write!(measured, " (wireguard-go: {} ms)", num(wg, 3));
                }
                Target {
                    target: overhead_target,
                    measured,
                    verdict: if ms <= 0.3 {
                        Verdict::Met
                    } else {
                        Verdict::NotMet
                    },
                }
            }
        },
    });
    // Issue 17: the induced mesh at the hub's full scale, each figure beside main's in the same
    // run.
    out.extend(scale_targets(inputs, &mesh));
    out.extend(failover_targets(inputs));
    out
}

/// Issue 33: the gateway failover's gap and the TCP connections it costs.
fn failover_targets(inputs: &Inputs) -> Vec<Target> {
    const GAP: &str = "gateway failover: largest 10 ms probe gap p50 under 0.5 s and p99 under \
                       2 s over at least 20 kills (issue 33)";
    const TCP: &str = "gateway failover: no established TCP connection lost (issue 33)";
    let p = match parse::<FailoverDoc>(inputs, "failover") {
        Ok(p) => p,
        Err(why) => {
            return [GAP, TCP]
                .map(|target| Target {
                    target,
                    measured: why.clone(),
                    verdict: Verdict::NotMeasured,
                })
                .into();
        }
    };
    let d = &p.doc;
    let gap = &d.probe_gap_ms;
    vec![
        Target {
            target: GAP,
            measured: format!(
                "p50 {} ms, p99 {} ms, max {} ms over {} kills",
                num(gap.p50, 0),
                num(gap.p99, 0),
                num(gap.max, 0),
                d.parameters.kills
            ),
            verdict: if d.parameters.kills < 20 {
                Verdict::NotMeasured
            } else if gap.p50 < 500.0 && gap.p99 < 2000.0 {
                Verdict::Met
            } else {
                Verdict::NotMet
            },
        },
        Target {
            target: TCP,
            measured: format!("{} of {} lost", d.tcp_broken, d.tcp_connections),
            verdict: if d.tcp_broken == 0 {
                Verdict::Met
            } else {
                Verdict::NotMet
            },
        },
    ]
}

/// Induced tunnels in a mesh of `n` leaves, n·(n-1) (0 for a nonsensical 0 in a result file).
fn tunnels(n: usize) -> usize {
    n * n.saturating_sub(1)
}

fn scenario_name(s: &IpamScenario) -> String {
    format!(
        "{}, {} replica{}, {} {}",
        s.store,
        s.replicas,
        if s.replicas == 1 { "" } else { "s" },
        s.rpc,
        s.path
    )
}

// ---------------------------------------------------------------------------------------------
// The document.

/// Generates the document and the plots from `inputs`.
pub fn render(inputs: &Inputs) -> Output {
    let mut md = String::new();
    md.push_str("# Benchmarks\n\n");
    md.push_str(
        "<!-- Generated by `make bench-report` (bench/src/report.rs) from bench/results/*.json and \
         bench/notes/*.md. Do not edit: a test compares this file with the generator's output. -->\n\n",
    );
    md.push_str(&note(inputs, "intro"));

    md.push_str("## Targets (issues 9, 17 and 18)\n\n");
    md.push_str("Computed from the results below each time the document is generated.\n\n");
    md.push_str("| target | measured | verdict |\n|---|---|---|\n");
    for t in targets(inputs) {
        let _ = writeln!(
            md,
            "| {} | {} | {} |",
            t.target,
            t.measured,
            t.verdict.text()
        );
    }
    md.push('\n');

    machine_section(&mut md, inputs);
    let mut files = Vec::new();
    ipam_section(&mut md, inputs, &mut files);
    mesh_section(&mut md, inputs, &mut files);
    mesh_reference_section(&mut md, inputs);
    endpoints_section(&mut md, inputs);
    exports_section(&mut md, inputs);
    dataplane_section(&mut md, inputs, &mut files);
    node_path_section(&mut md, inputs);
    failover_section(&mut md, inputs);
    md.push_str(&note(inputs, "outro"));
    while md.ends_with("\n\n") {
        md.pop();
    }
    files.insert(0, (PathBuf::from(DOC), md));
    Output { files }
}

fn machine_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Runs and machine\n\n");
    md.push_str(
        "| benchmark | result | run | started (UTC) | commit | load avg at start | note |\n",
    );
    md.push_str("|---|---|---|---|---|---|---|\n");
    let mut machines: Vec<(MachineMeta, Vec<&str>)> = Vec::new();
    for name in BENCHMARKS {
        match parse::<Value>(inputs, name) {
            Err(why) => {
                let _ = writeln!(md, "| {name} | {why} | — | — | — | — | — |");
            }
            Ok(p) => {
                let run = p.common.run.clone().unwrap_or_default();
                let _ = writeln!(
                    md,
                    "| {name} | `{}` | {} | {} | {} | {} | {} |",
                    p.path,
                    run.kind.as_deref().unwrap_or("not recorded"),
                    run.timestamp.as_deref().unwrap_or("not recorded"),
                    run.git_commit
                        .as_deref()
                        .map_or("not recorded".into(), |c| format!("`{}`", short_commit(c))),
                    opt(run.load_average_1m, 2),
                    run.note.trim()
                );
                if let Some(m) = p.common.machine {
                    match machines.iter_mut().find(|(x, _)| *x == m) {
                        Some((_, names)) => names.push(name),
                        None => machines.push((m, vec![name])),
                    }
                }
            }
        }
    }
    md.push('\n');
    for (m, names) in &machines {
        if machines.len() > 1 {
            let _ = writeln!(md, "Machine of {}:\n", names.join(", "));
        }
        let _ = writeln!(
            md,
            "| | |\n|---|---|\n| CPU | {}, {} cores |\n| memory | {} GiB |\n| kernel | {} |\n| etcd | {} |\n",
            m.cpu_model,
            m.cores,
            num(m.memory_gib, 1),
            m.kernel,
            m.etcd_version
        );
    }
    md.push_str(&note(inputs, "machine"));
}

fn ipam_section(md: &mut String, inputs: &Inputs, files: &mut Vec<(PathBuf, String)>) {
    md.push_str("## IPAM over gRPC\n\n");
    let parsed = parse::<IpamDoc>(inputs, "ipam");
    let mut chart = BarChart {
        title: "IPAM latency over gRPC (median of runs)".into(),
        y_label: "ms (log scale)".into(),
        y_scale: Scale::Log,
        categories: Vec::new(),
        series: vec![("p50".into(), Vec::new()), ("p99".into(), Vec::new())],
    };
    match &parsed {
        Err(why) => {
            let _ = writeln!(md, "Not measured: {why}.\n");
        }
        Ok(p) => {
            let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
            md.push_str(&note(inputs, "ipam"));
            if let Some(params) = &p.doc.parameters {
                let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
            }
            md.push_str("| store | replicas | RPC | path | clients | runs | requests/run | requests/s | p50 ms | p99 ms | max ms |\n");
            md.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
            for s in &p.doc.scenarios {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.store,
                    s.replicas,
                    s.rpc,
                    s.path,
                    s.concurrency,
                    s.runs.len().max(1),
                    num(s.operations as f64, 0),
                    num(s.ops_per_second, 0),
                    num(s.p50_ms, 3),
                    num(s.p99_ms, 3),
                    num(s.max_ms, 1)
                );
                chart.categories.push(format!(
                    "{}{} {}",
                    s.store,
                    if s.replicas > 1 {
                        format!("×{}", s.replicas)
                    } else {
                        String::new()
                    },
                    short_path(&s.path)
                ));
                chart.series[0].1.push(Some(s.p50_ms));
                chart.series[1].1.push(Some(s.p99_ms));
            }
            md.push('\n');
            if !p
                .doc
                .scenarios
                .iter()
                .any(|s| s.store == "memory" && s.replicas > 1)
            {
                md.push_str(
                    "Replicas apply to etcd only: the memory store lives inside one server \
                     process, so there is nothing for a second replica to share.\n\n",
                );
            }
            metrics_overhead(md, p.doc.metrics_overhead.as_ref());
            if p.doc.consistency.is_empty() {
                md.push_str("Consistency with several replicas: not measured in this run.\n\n");
            } else {
                md.push_str("**Consistency with several replicas**: every client asks for the same fresh endpoints and new clusters at the same time, each through its own replica.\n\n");
                md.push_str("| store | replicas | clients | endpoints | clusters | endpoint disagreements | shared addresses | cluster disagreements | overlapping ranges | errors | consistent |\n");
                md.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
                for c in &p.doc.consistency {
                    let _ = writeln!(
                        md,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                        c.store,
                        c.replicas,
                        c.clients,
                        c.endpoints_checked,
                        c.clusters_checked,
                        c.endpoint_disagreements,
                        c.shared_addresses,
                        c.cluster_disagreements,
                        c.overlapping_ranges,
                        c.errors,
                        if c.consistent { "yes" } else { "**no**" }
                    );
                }
                md.push('\n');
                for c in p.doc.consistency.iter().filter(|c| !c.consistent) {
                    let _ = writeln!(
                        md,
                        "**The replicas disagreed** ({} store, {} replicas). Examples:\n",
                        c.store, c.replicas
                    );
                    for e in &c.examples {
                        let _ = writeln!(md, "- `{e}`");
                    }
                    md.push('\n');
                }
            }
        }
    }
    md.push_str("![IPAM latency percentiles](bench/ipam-latency.svg)\n\n");
    files.push((
        PathBuf::from(PLOT_DIR).join("ipam-latency.svg"),
        svg::bar_chart(&chart),
    ));
    md.push_str(&note(inputs, "ipam-history"));
}

/// The overhead of the Prometheus metrics on the hot path: the same scenario against an IPAM
/// with and without the gRPC metrics layer, in the same run.
fn metrics_overhead(md: &mut String, m: Option<&MetricsOverheadDoc>) {
    let Some(m) = m else {
        md.push_str("Overhead of the metrics: not measured in this run.\n\n");
        return;
    };
    let _ = writeln!(
        md,
        "**Overhead of the Prometheus metrics** ({} {} on the {} store, {} clients, an IPAM with \
         its gRPC metrics layer against one with `--metrics-listen off`, alternating, in the same \
         run): throughput with metrics / without = **{}** (median of {} pairs: {}).\n",
        m.rpc,
        m.path,
        m.store,
        m.concurrency,
        num(m.throughput_ratio, 3),
        m.ratios.len(),
        m.ratios
            .iter()
            .map(|r| num(*r, 3))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(run) = &m.run {
        let _ = writeln!(
            md,
            "Measured in a separate invocation of ipam-bench (`--stores memory`): `{}`.\n",
            compact(run)
        );
    }
    md.push_str("| metrics | requests/s | p50 ms | p99 ms |\n|---|---|---|---|\n");
    for (label, l) in [("on", &m.with_metrics), ("off", &m.without_metrics)] {
        let _ = writeln!(
            md,
            "| {label} | {} | {} | {} |",
            num(l.ops_per_second, 0),
            num(l.p50_ms, 3),
            num(l.p99_ms, 3)
        );
    }
    md.push('\n');
}

fn short_path(path: &str) -> &str {
    match path {
        "local_nat" => "local",
        "external_alloc" => "ext alloc",
        "new_cluster_remap" => "new cl.",
        "known_cluster" => "known cl.",
        other => other,
    }
}

/// Parameters as one line of JSON.
fn compact(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

fn mesh_section(md: &mut String, inputs: &Inputs, files: &mut Vec<(PathBuf, String)>) {
    md.push_str("## Induced mesh setup time\n\n");
    md.push_str(&note(inputs, "mesh"));
    let modes = [
        ("mesh", "in process (memory)"),
        ("mesh-hub-processes", "hub processes (memory)"),
        ("mesh-hub-etcd", "hub processes + etcd"),
        ("mesh-etcd", "processes + etcd"),
    ];
    let mut by_leaves = Vec::new();
    let mut by_tunnels = Vec::new();
    for (name, label) in modes {
        if let Ok(p) = parse::<MeshDoc>(inputs, name) {
            let pts: Vec<(usize, f64)> = p
                .doc
                .sizes
                .iter()
                .filter_map(|s| Some((s.leaves, s.converged_median()?)))
                .collect();
            by_leaves.push(Series {
                name: label.into(),
                points: pts.iter().map(|(n, s)| (*n as f64, *s)).collect(),
                dashed: false,
            });
            by_tunnels.push(Series {
                name: label.into(),
                points: pts.iter().map(|(n, s)| (tunnels(*n) as f64, *s)).collect(),
                dashed: false,
            });
        }
    }

    let parsed = parse::<MeshDoc>(inputs, "mesh");
    md.push_str("### In process\n\n");
    match &parsed {
        Err(why) => {
            let _ = writeln!(md, "Not measured: {why}.\n");
        }
        Ok(p) => {
            let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
            if let Some(params) = &p.doc.parameters {
                let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
            }
            md.push_str("| leaves | status | induced TunnelEndpoints | median s | runs (s) | ms per induced tunnel | hub TunnelEndpoints | hub NetworkConfigs | relays held by the hub | hub IPAM records | open files at the end | peak RSS MiB (all clusters) | CPU s (all clusters) |\n");
            md.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
            for s in &p.doc.sizes {
                let med = s.converged_median();
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.leaves,
                    status_text(s),
                    num(s.induced_tunnel_endpoints as f64, 0),
                    opt(med, 3),
                    runs_text(s),
                    opt(
                        med.filter(|_| s.induced_tunnel_endpoints > 0)
                            .map(|m| 1000.0 * m / s.induced_tunnel_endpoints as f64),
                        2
                    ),
                    opt_usize(s.hub_tunnel_endpoints),
                    opt_usize(s.hub_network_configs),
                    opt_usize(s.hub_relays_in_flight),
                    opt_usize(s.hub_ipam_records),
                    opt_usize(s.runs.last().and_then(|r| r.open_files)),
                    opt(s.median_process_peak_rss_kib.map(|k| k as f64 / 1024.0), 0),
                    opt(s.median_process_cpu_seconds, 1)
                );
            }
            md.push('\n');
            let pts: Vec<(f64, f64)> = p
                .doc
                .sizes
                .iter()
                .filter_map(|s| Some((tunnels(s.leaves) as f64, s.converged_median()?)))
                .collect();
            if let Some((k, c)) = power_fit(&pts) {
                let _ = writeln!(
                    md,
                    "Least-squares fit over every converged size: seconds ≈ {} · tunnels^{} (k = 1 is linear in the number of induced tunnels n·(n-1); the targets table fits the three largest sizes).\n",
                    num(c, 4),
                    num(k, 2)
                );
                let (lo, hi) = pts.iter().fold((f64::INFINITY, 0f64), |(lo, hi), (x, _)| {
                    (lo.min(*x), hi.max(*x))
                });
                by_tunnels.push(Series {
                    name: format!("fit: k = {}", num(k, 2)),
                    points: vec![(lo, c * lo.powf(k)), (hi, c * hi.powf(k))],
                    dashed: true,
                });
                if let Some(&(x_max, y_max)) = pts.last() {
                    by_tunnels.push(Series {
                        name: "linear through largest".into(),
                        points: vec![(lo, y_max * lo / x_max), (x_max, y_max)],
                        dashed: true,
                    });
                }
            }
            md.push_str("![Setup time vs leaves](bench/mesh-setup-vs-leaves.svg)\n\n");
            md.push_str("![Setup time vs induced tunnels](bench/mesh-setup-vs-tunnels.svg)\n\n");
            md.push_str("### The hub's store after convergence\n\n");
            md.push_str("| leaves | discovery keys / bytes | broker keys / bytes | forwarder keys / bytes | IPAM keys / bytes | gateway keys / bytes | total keys | total bytes |\n");
            md.push_str("|---|---|---|---|---|---|---|---|\n");
            for s in &p.doc.sizes {
                let Some(h) = &s.hub_stores else { continue };
                let kb = |u: &StoreUse| {
                    format!("{} / {}", num(u.keys as f64, 0), num(u.bytes as f64, 0))
                };
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.leaves,
                    kb(&h.discovery),
                    kb(&h.broker),
                    kb(&h.forwarder),
                    kb(&h.ipam),
                    kb(&h.gateway),
                    num(h.total.keys as f64, 0),
                    num(h.total.bytes as f64, 0)
                );
            }
            md.push('\n');
            md.push_str(&note(inputs, "mesh-store"));
        }
    }
    files.push((
        PathBuf::from(PLOT_DIR).join("mesh-setup-vs-leaves.svg"),
        svg::line_chart(&LineChart {
            title: "Induced mesh setup time vs leaves (median)".into(),
            x_label: "leaves (log scale)".into(),
            y_label: "seconds (log scale)".into(),
            x_scale: Scale::Log,
            y_scale: Scale::Log,
            series: by_leaves,
        }),
    ));
    files.push((
        PathBuf::from(PLOT_DIR).join("mesh-setup-vs-tunnels.svg"),
        svg::line_chart(&LineChart {
            title: "Induced mesh setup time vs induced tunnels n·(n-1)".into(),
            x_label: "induced TunnelEndpoints (log scale)".into(),
            y_label: "seconds (log scale)".into(),
            x_scale: Scale::Log,
            y_scale: Scale::Log,
            series: by_tunnels,
        }),
    ));

    for (name, title) in [
        (
            "mesh-hub-processes",
            "### The hub as processes: CPU time and peak memory",
        ),
        (
            "mesh-hub-etcd",
            "### The hub as processes on etcd: CPU, memory and etcd writes per induced tunnel",
        ),
        ("mesh-etcd", "### Every service a process with its own etcd"),
    ] {
        let _ = writeln!(md, "{title}\n");
        match parse::<MeshDoc>(inputs, name) {
            Err(why) => {
                let _ = writeln!(md, "Not measured: {why}.\n");
            }
            Ok(p) => {
                let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
                md.push_str(&note(inputs, name));
                if let Some(params) = &p.doc.parameters {
                    let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
                }
                if p.doc.mode.is_none() {
                    md.push_str("(The result does not name its mode.)\n\n");
                }
                md.push_str("| leaves | status | median s | runs (s) | hub CPU s during setup | hub CPU ms per induced tunnel | hub CPU s per process during setup | hub peak RSS MiB (sum) | peak RSS MiB per process | hub etcd keys | hub etcd writes per induced tunnel |\n");
                md.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
                for s in &p.doc.sizes {
                    let per = |f: &dyn Fn(&HubProcess) -> String| {
                        s.hub_processes.as_ref().map_or("—".into(), |ps| {
                            ps.iter()
                                .map(|p| format!("{} {}", p.service, f(p)))
                                .collect::<Vec<_>>()
                                .join(", ")
                        })
                    };
                    let _ = writeln!(
                        md,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                        s.leaves,
                        status_text(s),
                        opt(s.converged_median(), 3),
                        runs_text(s),
                        opt(s.hub_cpu_seconds_during_setup, 2),
                        opt(s.median_hub_cpu_ms_per_induced_tunnel, 3),
                        per(&|p| num(p.cpu_seconds_during_setup, 2)),
                        opt(s.hub_peak_rss_kib_total.map(|k| k as f64 / 1024.0), 1),
                        per(&|p| num(p.peak_rss_kib as f64 / 1024.0, 1)),
                        s.hub_etcd_keys.as_ref().map_or("—".into(), |k| {
                            k.iter()
                                .map(|(s, n)| format!("{s} {n}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        }),
                        opt(s.median_hub_etcd_writes_per_induced_tunnel, 2)
                    );
                }
                md.push('\n');
            }
        }
    }
}

/// The mesh results next to the reference build's from the same run (ratio = this build /
/// the reference: below 1 is faster or cheaper).
fn mesh_reference_section(md: &mut String, inputs: &Inputs) {
    md.push_str(
        "## Induced mesh against main, in the same run

",
    );
    md.push_str(&note(inputs, "mesh-reference"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    let pair = |a: Option<f64>, b: Option<f64>, d: usize| {
        format!("{} / {} ({})", opt(a, d), opt(b, d), ratio(a, b))
    };
    for (name, reference, label) in REFERENCES {
        let _ = writeln!(
            md,
            "### {label}
"
        );
        let (ours, theirs) = match (
            parse::<MeshDoc>(inputs, name),
            parse::<MeshDoc>(inputs, reference),
        ) {
            (Ok(ours), Ok(theirs)) => (ours, theirs),
            (Err(why), _) | (_, Err(why)) => {
                let _ = writeln!(
                    md,
                    "Not compared: {why}.
"
                );
                continue;
            }
        };
        let _ = writeln!(
            md,
            "{}
",
            run_line(&ours.path, &ours.common)
        );
        let _ = writeln!(
            md,
            "{}
",
            run_line(&theirs.path, &theirs.common)
        );
        md.push_str(
            "Each cell: this build / main (ratio).

",
        );
        md.push_str("| leaves | setup s | all full tunnels s | 90→100 % share of the setup | hub CPU ms per induced tunnel | hub peak RSS MiB | bench process peak RSS MiB | bench process CPU s |
");
        md.push_str(
            "|---|---|---|---|---|---|---|---|
",
        );
        for s in &ours.doc.sizes {
            let Some(r) = theirs.doc.sizes.iter().find(|r| r.leaves == s.leaves) else {
                continue;
            };
            let rss = |x: &MeshSize| x.hub_peak_rss_kib_total.map(|k| k as f64 / 1024.0);
            let own_rss = |x: &MeshSize| x.median_process_peak_rss_kib.map(|k| k as f64 / 1024.0);
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                s.leaves,
                pair(s.converged_median(), r.converged_median(), 2),
                pair(
                    s.median_full_tunnels_seconds,
                    r.median_full_tunnels_seconds,
                    2
                ),
                pair(s.median_tail_share, r.median_tail_share, 2),
                pair(
                    s.median_hub_cpu_ms_per_induced_tunnel,
                    r.median_hub_cpu_ms_per_induced_tunnel,
                    3
                ),
                pair(rss(s), rss(r), 1),
                pair(own_rss(s), own_rss(r), 0),
                pair(
                    s.median_process_cpu_seconds,
                    r.median_process_cpu_seconds,
                    1
                ),
            );
        }
        md.push('\n');
    }
}

fn status_text(s: &MeshSize) -> String {
    match s.status() {
        "converged" => "converged".into(),
        other => format!(
            "**{}**{}",
            other.replace('_', " "),
            s.reason
                .as_deref()
                .map(|r| format!(": {}", r.replace('|', "/").replace('\n', " ")))
                .unwrap_or_default()
        ),
    }
}

fn runs_text(s: &MeshSize) -> String {
    if s.runs.is_empty() {
        return "—".into();
    }
    s.runs
        .iter()
        .map(|r| {
            let time = if r.converged == Some(false) {
                format!("> {}", num(r.seconds, 0))
            } else {
                num(r.seconds, 3)
            };
            match r.peer_retries {
                Some(n) if n > 0 => format!("{time} ({n} Peer retries)"),
                _ => time,
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn endpoints_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Endpoint reflection (`ReflectEndpointSlice` over gRPC)\n\n");
    match parse::<EndpointsDoc>(inputs, "endpoints") {
        Err(why) => {
            let _ = writeln!(md, "Not measured: {why}.\n");
        }
        Ok(p) => {
            let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
            md.push_str(&note(inputs, "endpoints"));
            if let Some(params) = &p.doc.parameters {
                let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
            }
            md.push_str("| store | path | clients | endpoints per slice | endpoints/s | reflections/s | p50 ms | p99 ms | max ms |\n");
            md.push_str("|---|---|---|---|---|---|---|---|---|\n");
            for s in &p.doc.scenarios {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.store,
                    s.path,
                    s.concurrency,
                    s.slice_size,
                    num(s.endpoints_per_second, 0),
                    num(s.ops_per_second, 1),
                    num(s.p50_ms, 1),
                    num(s.p99_ms, 1),
                    num(s.max_ms, 1)
                );
            }
            md.push('\n');
        }
    }
}

fn exports_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Service exports across an induced mesh (`ExportService`)\n\n");
    let Some(p) = opening::<ExportsDoc>(md, inputs, "exports") else {
        return;
    };
    let d = &p.doc;
    if let Some(params) = &d.parameters {
        let _ = writeln!(md, "Parameters: `{}`.\n", compact(params));
    }
    let _ = writeln!(
        md,
        "Induced mesh complete {} s after the first Peer call.\n",
        num(d.mesh_seconds, 1)
    );
    md.push_str("| measurement | result |\n|---|---|\n");
    if let Some(l) = &d.change_latency {
        let _ = writeln!(
            md,
            "| export change → changed slice at an induced consumer ({} changes) | p50 {} ms, p99 {} ms, max {} ms |",
            l.operations,
            num(l.p50_ms, 1),
            num(l.p99_ms, 1),
            num(l.max_ms, 1)
        );
    }
    let runs = d
        .bulk_seconds
        .iter()
        .map(|s| num(*s, 2))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = writeln!(
        md,
        "| bulk export at every consumer: seconds per run | {runs} |\n| reflected endpoints per second (consumers × endpoints / median) | {} |\n",
        num(d.reflected_endpoints_per_second, 0)
    );
}

/// The opening of a benchmark's section: its run line and its note, or why it was not
/// measured (then `None`: the section ends there).
fn opening<T: for<'de> Deserialize<'de>>(
    md: &mut String,
    inputs: &Inputs,
    name: &str,
) -> Option<Parsed<T>> {
    match parse::<T>(inputs, name) {
        Err(why) => {
            let _ = writeln!(md, "Not measured: {why}.\n");
            None
        }
        Ok(p) => {
            let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
            md.push_str(&note(inputs, name));
            Some(p)
        }
    }
}

fn node_path_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Data plane: pod to pod across non-gateway nodes (the node path)\n\n");
    let Some(p) = opening::<NodePathDoc>(md, inputs, "dataplane-nodes") else {
        return;
    };
    let d = &p.doc;
    let _ = writeln!(
        md,
        "WireGuard: {}; build: {}; store: {}; {} nodes per cluster; {} pings per RTT, {} s per iperf3 run.\n",
        d.wireguard,
        d.build,
        d.store,
        d.nodes_per_cluster.map_or("?".into(), |n| n.to_string()),
        d.samples.map_or("?".into(), |n| n.to_string()),
        d.iperf_seconds.map_or("?".into(), |n| n.to_string()),
    );
    md.push_str("| path (A's pod → C's pod, induced tunnel) | median RTT ms | p90 ms | lost | iperf3 TCP Mbit/s (each run) |\n|---|---|---|---|---|\n");
    let runs = |v: &[f64]| v.iter().map(|m| num(*m, 0)).collect::<Vec<_>>().join(", ");
    for (name, rtt, mbit) in [
        (
            "pods on the gateway nodes (tunnel only)",
            d.rtt_gateway_nodes.as_ref(),
            &d.mbit_s_gateway_nodes,
        ),
        (
            "pods on non-gateway nodes (node network, VXLAN to the gateway node, tunnel)",
            d.rtt_non_gateway_nodes.as_ref(),
            &d.mbit_s_non_gateway_nodes,
        ),
    ] {
        let Some(r) = rtt else { continue };
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {}/{} | {} |",
            num(r.median_ms, 3),
            num(r.p90_ms, 3),
            r.lost,
            r.samples as u32 + r.lost,
            runs(mbit)
        );
    }
    md.push('\n');
    if let (Some(rtt), Some(tput)) = (d.rtt_ratio, d.throughput_ratio) {
        let _ = writeln!(
            md,
            "Non-gateway nodes against gateway nodes, same clusters and run: RTT ×**{}**, throughput ×**{}**.\n",
            num(rtt, 2),
            num(tput, 2)
        );
    }
}

fn failover_section(md: &mut String, inputs: &Inputs) {
    md.push_str("## Gateway failover\n\n");
    let Some(p) = opening::<FailoverDoc>(md, inputs, "failover") else {
        return;
    };
    let d = &p.doc;
    let _ = writeln!(
        md,
        "{} kills; per destination {} echoed TCP connections and {} on which only the server \
         speaks, fresh for each kill.\n",
        d.parameters.kills,
        d.parameters.connections_per_destination,
        d.parameters.pushed_per_destination
    );
    md.push_str("| per kill | p50 ms | p99 ms | max ms |\n|---|---|---|---|\n");
    for (name, s) in [
        ("largest gap of the 10 ms UDP probes", &d.probe_gap_ms),
        (
            "takeover (until the standby says it is active)",
            &d.takeover_ms,
        ),
    ] {
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} |",
            num(s.p50, 0),
            num(s.p99, 0),
            num(s.max, 0)
        );
    }
    md.push_str(
        "| Submariner, Liqo: Lease duration before a standby may take over (not measured here) \
         | 15 000 | 15 000 | 15 000 |\n\n",
    );
    md.push_str("| cluster killed | kills | largest probe gap ms | TCP connections broken |\n|---|---|---|---|\n");
    let mut clusters: Vec<&str> = d.kills.iter().map(|k| k.cluster.as_str()).collect();
    clusters.sort_unstable();
    clusters.dedup();
    for c in clusters {
        let of: Vec<&FailoverKill> = d.kills.iter().filter(|k| k.cluster == c).collect();
        let gap = of.iter().map(|k| k.probe_gap_ms).fold(0.0, f64::max);
        let broken: usize = of.iter().map(|k| k.tcp_broken).sum();
        let _ = writeln!(md, "| {c} | {} | {} | {broken} |", of.len(), num(gap, 0));
    }
    let _ = writeln!(
        md,
        "\nTCP connections broken over all kills: **{} of {}**.\n",
        d.tcp_broken, d.tcp_connections
    );
}

fn dataplane_section(md: &mut String, inputs: &Inputs, files: &mut Vec<(PathBuf, String)>) {
    md.push_str(
        "## Data plane: leaf↔leaf RTT, induced vs through the hub, and tunnel throughput\n\n",
    );
    let mut chart = BarChart {
        title: "Leaf-to-leaf RTT: induced vs hub path".into(),
        y_label: "ms".into(),
        y_scale: Scale::Linear,
        categories: vec!["induced (A→C)".into(), "hub (A→B→C)".into()],
        series: vec![
            ("emulated link RTT".into(), vec![None, None]),
            ("measured median".into(), vec![None, None]),
            ("reference".into(), vec![None, None]),
        ],
    };
    let mut throughput_chart = BarChart {
        title: "Tunnel throughput: Trellis vs wireguard-go (iperf3 TCP, median)".into(),
        y_label: "Mbit/s".into(),
        y_scale: Scale::Linear,
        categories: vec!["1 stream".into(), "4 streams".into()],
        series: vec![
            ("Trellis".into(), vec![None, None]),
            ("wireguard-go".into(), vec![None, None]),
        ],
    };
    match parse::<DataplaneDoc>(inputs, "dataplane") {
        Err(why) => {
            let _ = writeln!(md, "Not measured: {why}.\n");
        }
        Ok(p) => {
            let d = &p.doc;
            let _ = writeln!(md, "{}\n", run_line(&p.path, &p.common));
            md.push_str(&note(inputs, "dataplane"));
            let _ = writeln!(
                md,
                "WireGuard: {}; build: {}; store: {}; link delays by: {}; {} pings per measurement.\n",
                d.wireguard,
                d.build,
                d.store,
                d.emulation.replace('_', " "),
                d.samples
                    .map_or("an unrecorded number of".into(), |s| s.to_string())
            );
            md.push_str(
                "| path | emulated link RTT ms | median ms | p90 ms | min ms | max ms | lost |\n",
            );
            md.push_str("|---|---|---|---|---|---|---|\n");
            let rows = [
                (
                    "induced (A→C direct)",
                    d.rtt_induced.as_ref(),
                    d.leaf_link_rtt_ms,
                ),
                (
                    "hub (A→B→C, DNAT at B)",
                    d.rtt_hub_path.as_ref(),
                    2.0 * d.hub_link_rtt_ms,
                ),
                (
                    "induced, no added delay",
                    d.rtt_no_netem_tunnel.as_ref(),
                    0.0,
                ),
                (
                    "induced through 0 ms relays",
                    d.rtt_through_zero_delay_relay.as_ref(),
                    0.0,
                ),
                (
                    "gateway to gateway, bare bridge path",
                    d.rtt_no_netem_bare.as_ref(),
                    0.0,
                ),
            ];
            for (name, rtt, emulated) in rows {
                let Some(r) = rtt else { continue };
                let _ = writeln!(
                    md,
                    "| {name} | {} | {} | {} | {} | {} | {}/{} |",
                    num(emulated, 0),
                    num(r.median_ms, 3),
                    num(r.p90_ms, 3),
                    num(r.min_ms, 3),
                    num(r.max_ms, 3),
                    r.lost,
                    r.samples as u32 + r.lost
                );
            }
            md.push('\n');
            if let Some(ratio) = d.ratio_hub_over_induced {
                let _ = write!(md, "Ratio hub / induced: **{}**", num(ratio, 1));
                if let (Some(ti), Some(th)) = (d.thesis_induced_ms, d.thesis_hub_ms) {
                    let _ = write!(
                        md,
                        " (the published reference measurement of induced peering with the same link delays: {} ms induced, {} ms through the hub, ratio {})",
                        num(ti, 0),
                        num(th, 0),
                        num(th / ti, 1)
                    );
                }
                md.push_str(".\n\n");
            }
            if let Some(t) = &d.throughput {
                md.push_str("| path (iperf3 TCP, one stream) | Mbit/s |\n|---|---|\n");
                let _ = writeln!(
                    md,
                    "| A's pod → C's pod through the A–C tunnel | {} |\n| A's gateway → C's gateway, same veth path, no tunnel | {} |\n",
                    num(t.tunnel_mbit_s, 0),
                    num(t.bare_veth_mbit_s, 0)
                );
                let _ = writeln!(
                    md,
                    "The tunnel carries {} % of the bare path ({} s per iperf3 run).\n",
                    num(100.0 * t.tunnel_fraction_of_bare, 1),
                    t.seconds
                );
            }
            if let Some(c) = &d.side_by_side {
                side_by_side_table(md, c);
                for (i, streams) in [1, 4].into_iter().enumerate() {
                    if let Some(x) = c.at(streams) {
                        throughput_chart.series[0].1[i] = x.trellis.median_mbit_s;
                        throughput_chart.series[1].1[i] = x.wireguard_go.median_mbit_s;
                    }
                }
            }
            if let (Some(i), Some(h)) = (d.induced_ready_seconds, d.hub_ready_seconds) {
                let _ = writeln!(
                    md,
                    "From starting the three clusters to the first answered ping: {} s (induced), {} s (hub path).\n",
                    num(i, 1),
                    num(h, 1)
                );
            }
            chart.series[0].1 = vec![Some(d.leaf_link_rtt_ms), Some(2.0 * d.hub_link_rtt_ms)];
            chart.series[1].1 = vec![
                d.rtt_induced.as_ref().map(|r| r.median_ms),
                d.rtt_hub_path.as_ref().map(|r| r.median_ms),
            ];
            chart.series[2].1 = vec![d.thesis_induced_ms, d.thesis_hub_ms];
        }
    }
    md.push_str("![Leaf-to-leaf RTT](bench/dataplane-rtt.svg)\n\n");
    md.push_str(
        "![Tunnel throughput, Trellis vs wireguard-go](bench/dataplane-throughput.svg)\n\n",
    );
    md.push_str(&note(inputs, "dataplane-analysis"));
    files.push((
        PathBuf::from(PLOT_DIR).join("dataplane-rtt.svg"),
        svg::bar_chart(&chart),
    ));
    files.push((
        PathBuf::from(PLOT_DIR).join("dataplane-throughput.svg"),
        svg::bar_chart(&throughput_chart),
    ));
}

/// "median (min–max)" of a side, with `decimals`.
fn median_spread(
    median: Option<f64>,
    min: Option<f64>,
    max: Option<f64>,
    decimals: usize,
) -> String {
    match (median, min, max) {
        (Some(m), Some(lo), Some(hi)) => format!(
            "{} ({}–{})",
            num(m, decimals),
            num(lo, decimals),
            num(hi, decimals)
        ),
        (m, _, _) => opt(m, decimals),
    }
}

/// The side-by-side comparison with wireguard-go: throughput and CPU per GB at 1 and 4
/// streams, and RTT overhead over the underlay.
fn side_by_side_table(md: &mut String, c: &SideBySideDoc) {
    let _ = writeln!(
        md,
        "Side by side with {} (two more gateway namespaces of the same topology, configured with \
         `wg set`; see the method above), {} round{} of {} s iperf3 runs, the tunnel measured \
         first alternating by round. Median (smallest–largest) over the rounds; ratios of \
         medians.\n",
        if c.reference.is_empty() {
            "wireguard-go"
        } else {
            c.reference.as_str()
        },
        c.rounds,
        if c.rounds == 1 { "" } else { "s" },
        c.iperf_seconds
    );
    md.push_str(
        "| measure | Trellis | wireguard-go | Trellis / wireguard-go |\n|---|---|---|---|\n",
    );
    for x in &c.throughput {
        let streams = format!(
            "{} TCP stream{}",
            x.streams,
            if x.streams == 1 { "" } else { "s" }
        );
        let _ = writeln!(
            md,
            "| {streams}, Mbit/s | {} | {} | **{}** |",
            median_spread(
                x.trellis.median_mbit_s,
                x.trellis.min_mbit_s,
                x.trellis.max_mbit_s,
                0
            ),
            median_spread(
                x.wireguard_go.median_mbit_s,
                x.wireguard_go.min_mbit_s,
                x.wireguard_go.max_mbit_s,
                0
            ),
            opt(x.ratio_mbit_s, 2)
        );
        let _ = writeln!(
            md,
            "| {streams}, tunnel CPU s per GB | {} | {} | {} |",
            median_spread(
                x.trellis.median_cpu_seconds_per_gb,
                x.trellis.min_cpu_seconds_per_gb,
                x.trellis.max_cpu_seconds_per_gb,
                1
            ),
            median_spread(
                x.wireguard_go.median_cpu_seconds_per_gb,
                x.wireguard_go.min_cpu_seconds_per_gb,
                x.wireguard_go.max_cpu_seconds_per_gb,
                1
            ),
            opt(x.ratio_cpu_seconds_per_gb, 2)
        );
    }
    if let (Some(t), Some(w)) = (&c.rtt_trellis, &c.rtt_wireguard_go) {
        let med = |r: &Option<Rtt>| opt(r.as_ref().map(|r| r.median_ms), 3);
        let _ = writeln!(
            md,
            "| RTT pod to pod through the tunnel, median ms | {} | {} | |",
            med(&t.tunnel),
            med(&w.tunnel)
        );
        let _ = writeln!(
            md,
            "| RTT gateway to gateway on the bridge (underlay), median ms | {} | {} | |",
            med(&t.bare),
            med(&w.bare)
        );
        let _ = writeln!(
            md,
            "| RTT overhead (tunnel − underlay), ms | **{}** | {} | |",
            opt(t.overhead_ms, 3),
            opt(w.overhead_ms, 3)
        );
    }
    md.push('\n');
}

// ---------------------------------------------------------------------------------------------
// Files.

impl Output {
    /// Writes every file under `root`.
    pub fn write(&self, root: &Path) -> anyhow::Result<()> {
        for (rel, content) in &self.files {
            let path = root.join(rel);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::write(&path, content)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// The files under `root` that differ from the generated ones (missing ones included).
    pub fn differences(&self, root: &Path) -> Vec<PathBuf> {
        self.files
            .iter()
            .filter(|(rel, content)| {
                std::fs::read_to_string(root.join(rel)).ok().as_deref() != Some(content.as_str())
            })
            .map(|(rel, _)| rel.clone())
            .collect()
    }
}

/// Reads everything under `root` and renders it.
pub fn generate(root: &Path) -> anyhow::Result<Output> {
    Ok(render(&Inputs::read(root)?))
}

#[cfg(test)]
mod tests;
