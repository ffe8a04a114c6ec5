//! The IPAM section: latency per scenario and its plot, the overhead of the metrics, and the
//! consistency of several replicas.

use std::fmt::Write as _;
use std::path::PathBuf;

use super::format::{compact, num, run_line};
use super::inputs::Inputs;
use super::notes::note;
use super::output::PLOT_DIR;
use super::parse::parse;
use crate::results::{IpamResult, MetricsOverhead, Store};
use crate::svg::{self, BarChart, Scale};

pub(super) fn ipam_section(md: &mut String, inputs: &Inputs, files: &mut Vec<(PathBuf, String)>) {
    md.push_str("## IPAM over gRPC\n\n");
    let parsed = parse::<IpamResult>(inputs, "ipam");
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
                    num(s.latency.operations as f64, 0),
                    num(s.latency.ops_per_second, 0),
                    num(s.latency.p50_ms, 3),
                    num(s.latency.p99_ms, 3),
                    num(s.latency.max_ms, 1)
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
                chart.series[0].1.push(Some(s.latency.p50_ms));
                chart.series[1].1.push(Some(s.latency.p99_ms));
            }
            md.push('\n');
            if !p
                .doc
                .scenarios
                .iter()
                .any(|s| s.store == Store::Memory && s.replicas > 1)
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
fn metrics_overhead(md: &mut String, m: Option<&MetricsOverhead>) {
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
