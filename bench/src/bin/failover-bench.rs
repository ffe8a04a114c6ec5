//! Gateway failover (issue 33), as root in network namespaces with real packets: hub B and
//! leaves A and C, three nodes each, two gateway replicas per cluster (nodes 0 and 1), every
//! cluster's pods at 10.0.0.0/16. While flows run from the pod of A's node 2 to the pods of node
//! 2 of B (leaf to hub) and of C (leaf to leaf, induced), the active replica of A, B and C in
//! turn is killed with SIGKILL, `--kills` times in all. Per kill: the takeover time (until the
//! standby says it is active), the largest gap of a 10 ms UDP probe to both pods, and the TCP
//! connections broken (echoed ones, and ones on which only the server speaks, so that after the
//! switch the side that did not open them speaks first). Fresh flows for each kill; the killed
//! replica comes back as the standby before the next. p50/p99/max over all kills.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use clap::Parser;
use trellis_bench::results::{FailoverParameters, FailoverResult, Kill, Spread};
use trellis_bench::{Machine, RunArgs, RunInfo, write_json};
use trellis_integration::failover::{FLOWS, Flows, PORT, address, measured, python_in, the_active};
use trellis_netlab::{Fabric, FabricOptions};

const CLUSTERS: [&str; 3] = ["A (leaf)", "B (hub)", "C (leaf)"];
const A: usize = 0;
const B: usize = 1;
const C: usize = 2;

/// Kills each cluster's active gateway replica in turn and writes the gaps as JSON.
#[derive(Debug, Parser)]
struct Args {
    /// Kills in all (A, B, C, A, ...).
    #[arg(long, default_value_t = 21)]
    kills: usize,
    /// Echoed TCP connections to each destination.
    #[arg(long, default_value_t = 10)]
    connections: usize,
    /// TCP connections to each destination on which only the server speaks.
    #[arg(long, default_value_t = 5)]
    pushed: usize,
    /// How long the flows run before each kill, in milliseconds (at least the gateway's
    /// `--handoff-interval`, so the standby holds the connections).
    #[arg(long, default_value_t = 2500)]
    before_ms: u64,
    /// How long the flows run after each takeover, in milliseconds.
    #[arg(long, default_value_t = 2500)]
    after_ms: u64,
    /// Seconds to wait for the mesh, and for each takeover.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/failover.json")]
    out: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

/// The nearest-rank percentile `p` (0–1) of `values`: always a measured value.
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn spread(values: &[f64]) -> Spread {
    Spread {
        p50: percentile(values, 0.5),
        p99: percentile(values, 0.99),
        max: percentile(values, 1.0),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = RunInfo::start(&args.run);
    let missing =
        trellis_netlab::missing_prerequisites(&["ip", "nft", "ping", "python3", "conntrack"]);
    if !missing.is_empty() {
        bail!(
            "failover-bench builds network namespaces and needs {}; run it as root \
             (`sudo make bench-failover`) after `make setup`",
            missing.join(", ")
        );
    }
    ensure!(args.kills > 0, "--kills must be at least 1");
    let timeout = Duration::from_secs(args.timeout);
    let mut options = FabricOptions::three_clusters();
    options.nodes = 3;
    options.gateways = 2;
    let started = Instant::now();
    let mut fabric = Fabric::up(options)
        .await
        .context("bringing the fabric up")?;
    fabric
        .wait_mesh(timeout)
        .await
        .context("waiting for the mesh")?;
    let mesh_seconds = started.elapsed().as_secs_f64();
    eprintln!("failover-bench: 3 clusters x 3 nodes x 2 replicas peered in {mesh_seconds:.1} s");

    let dir = tempfile::tempdir()?;
    let script = dir.path().join("flows.py");
    std::fs::write(&script, FLOWS)?;
    let (a2, b2, c2) = (
        fabric.topology.sites[A].nodes[2].clone(),
        fabric.topology.sites[B].nodes[2].clone(),
        fabric.topology.sites[C].nodes[2].clone(),
    );
    let _servers = [&b2, &c2]
        .map(|n| python_in(&n.pod_ns, &script, &["serve".into(), PORT.to_string()]))
        .into_iter()
        .collect::<anyhow::Result<Vec<_>>>()?;
    let to_b = address(&fabric, A, B, b2.pod_ip).await?;
    let to_c = address(&fabric, A, C, c2.pod_ip).await?;
    for to in [to_b, to_c] {
        fabric
            .wait_ping(A, to, timeout)
            .await
            .with_context(|| format!("A never reached {to}"))?;
    }
    let mut targets = Vec::new();
    for to in [to_b, to_c] {
        targets.push(format!("tcp:{to}:{PORT}:{}", args.connections));
        targets.push(format!("push:{to}:{PORT}:{}", args.pushed));
        targets.push(format!("udp:{to}:{PORT}"));
    }

    let mut kills = Vec::new();
    for k in 0..args.kills {
        let cluster = k % CLUSTERS.len();
        let flows = Flows::start(&a2.pod_ns, &script, dir.path(), &format!("k{k}"), &targets)?;
        tokio::time::sleep(Duration::from_millis(args.before_ms)).await;
        let (old, epoch) = the_active(&fabric, cluster, timeout).await?;
        let killed = Instant::now();
        fabric.clusters[cluster].gateway_replica_mut(old)?.kill9();
        let (new, new_epoch) = the_active(&fabric, cluster, timeout).await?;
        let takeover_ms = killed.elapsed().as_secs_f64() * 1000.0;
        ensure!(
            new != old && new_epoch > epoch,
            "kill {k}: no takeover in cluster {}",
            CLUSTERS[cluster]
        );
        tokio::time::sleep(Duration::from_millis(args.after_ms)).await;
        let m = measured(&flows.stop()?);
        ensure!(
            m.silent.is_empty(),
            "kill {k}: nothing came back from {:?}",
            m.silent
        );
        fabric.clusters[cluster]
            .gateway_replica_mut(old)?
            .restart()
            .await
            .with_context(|| format!("kill {k}: restarting the killed replica"))?;
        eprintln!(
            "failover-bench: kill {}/{} ({}): takeover {takeover_ms:.0} ms, probe gap {:.0} ms, \
             {} TCP connections broken",
            k + 1,
            args.kills,
            CLUSTERS[cluster],
            m.probe_gap_ms,
            m.broken.len()
        );
        kills.push(Kill {
            cluster: CLUSTERS[cluster].to_owned(),
            takeover_ms,
            probe_gap_ms: m.probe_gap_ms,
            tcp_broken: m.broken.len(),
            broken: m.broken,
        });
        // The returning replica gets warm and hears the active's connections.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let _ = fabric;

    let takeovers: Vec<f64> = kills.iter().map(|k| k.takeover_ms).collect();
    let gaps: Vec<f64> = kills.iter().map(|k| k.probe_gap_ms).collect();
    let mut by_cluster = std::collections::BTreeMap::new();
    for k in &kills {
        *by_cluster.entry(k.cluster.clone()).or_insert(0) += k.tcp_broken;
    }
    let report = FailoverResult {
        benchmark: "failover".into(),
        run: Some(run),
        machine: Some(Machine::describe()),
        parameters: FailoverParameters {
            kills: args.kills,
            clusters: 3,
            nodes_per_cluster: 3,
            replicas_per_cluster: 2,
            connections_per_destination: args.connections,
            pushed_per_destination: args.pushed,
            probe_interval_ms: 10,
            before_ms: args.before_ms,
            after_ms: args.after_ms,
        },
        mesh_seconds,
        tcp_connections: args.kills * 2 * (args.connections + args.pushed),
        tcp_broken: kills.iter().map(|k| k.tcp_broken).sum(),
        tcp_broken_by_cluster: by_cluster,
        takeover_ms: spread(&takeovers),
        probe_gap_ms: spread(&gaps),
        kills,
    };
    write_json(&args.out, &report)?;
    eprintln!(
        "failover-bench: probe gap p50 {:.0} / p99 {:.0} / max {:.0} ms; takeover p50 {:.0} ms; \
         {} of {} TCP connections broken; wrote {}",
        report.probe_gap_ms.p50,
        report.probe_gap_ms.p99,
        report.probe_gap_ms.max,
        report.takeover_ms.p50,
        report.tcp_broken,
        report.tcp_connections,
        args.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_and_always_a_measured_value() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 10.0);
        assert_eq!(percentile(&v, 0.99), 20.0);
        assert_eq!(percentile(&v, 1.0), 20.0);
        assert_eq!(percentile(&[7.0], 0.5), 7.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
