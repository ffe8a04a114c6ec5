//! Service exports across an induced mesh (issue 16): hub B and `--leaves` leaves, every
//! cluster in this process with memory stores and its own endpoints service, peered through
//! the brokers as in the integration tests. Leaf 0 exports; every other cluster (the hub and
//! the other leaves, reached through the hub's pass-on with the address of the induced path)
//! imports. Two measurements:
//!
//! - **change latency**: leaf 0 changes its export (one endpoint more each time) and the clock
//!   runs until an induced consumer (leaf 1) lists the changed slice; p50/p99 over `--samples`;
//! - **reflection throughput**: leaf 0 exports `--bulk-endpoints` endpoints at once (a new set
//!   each repeat) and the clock runs until every consumer lists all of them; endpoints
//!   reflected per second = consumers × endpoints / time.
//!
//! Consumers are polled (ListReflectedSlices) every `--poll-ms`, which bounds the resolution.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use ipnet::IpNet;
use trellis_api::pb::endpoints::{
    EndpointPort, ExportServiceRequest, ExportedEndpoint, ListReflectedSlicesRequest,
};
use trellis_bench::proc::raise_nofile_limit;
use trellis_bench::results::{ExportsParameters, ExportsResult};
use trellis_bench::{Machine, Recorder, RunArgs, RunInfo, median, write_json};
use trellis_integration::cluster::InProcessCluster;
use trellis_integration::peering::{host_at, peer, tunnel_to};

const POD_CIDR: &str = "10.0.0.0/16";
const EXTERNAL_CIDR: &str = "10.201.0.0/16";
const NAMESPACE: &str = "shop";

/// Measures export reflection across an induced mesh and writes a JSON result.
#[derive(Debug, Parser)]
struct Args {
    /// Leaves of the hub (leaf 0 exports; the hub and the other leaves consume).
    #[arg(long, default_value_t = 21)]
    leaves: usize,
    /// Export changes timed at the induced consumer.
    #[arg(long, default_value_t = 50)]
    samples: usize,
    /// Endpoints of the bulk export.
    #[arg(long, default_value_t = 1000)]
    bulk_endpoints: usize,
    /// Bulk exports timed; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Polling period of the consumers, in milliseconds.
    #[arg(long, default_value_t = 5)]
    poll_ms: u64,
    /// Seconds to wait for the mesh, and for each change to arrive.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/exports.json")]
    out: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

fn export(name: &str, pods: &[u32]) -> ExportServiceRequest {
    let net: IpNet = POD_CIDR.parse().unwrap_or_else(|_| unreachable!());
    ExportServiceRequest {
        namespace: NAMESPACE.into(),
        name: name.into(),
        ports: vec![EndpointPort {
            name: "http".into(),
            port: Some(8080),
            ..Default::default()
        }],
        endpoints: pods
            .iter()
            .map(|h| ExportedEndpoint {
                address: host_at(net, *h),
                ready: Some(true),
            })
            .collect(),
    }
}

/// The endpoints `cluster` lists for Service `name` (every slice of it, whatever its source),
/// or `None` when it holds no slice of it.
async fn listed(cluster: &InProcessCluster, name: &str) -> anyhow::Result<Option<usize>> {
    let slices = cluster
        .endpoints()
        .await?
        .list_reflected_slices(ListReflectedSlicesRequest {
            source_cluster_id: String::new(),
            namespace: NAMESPACE.into(),
        })
        .await?
        .into_inner()
        .reflected_slices;
    let of: Vec<usize> = slices
        .iter()
        .filter_map(|r| r.slice.as_ref())
        .filter(|s| s.service_name == name)
        .map(|s| s.endpoints.len())
        .collect();
    Ok((!of.is_empty()).then(|| of.iter().sum()))
}

/// Waits until `cluster` lists `count` endpoints of `name`; the time since `since`.
async fn arrival(
    cluster: &InProcessCluster,
    name: &str,
    count: usize,
    since: Instant,
    args: &Args,
) -> anyhow::Result<Duration> {
    loop {
        if listed(cluster, name).await? == Some(count) {
            return Ok(since.elapsed());
        }
        anyhow::ensure!(
            since.elapsed() < Duration::from_secs(args.timeout),
            "{} never listed {count} endpoints of {name}",
            cluster.id
        );
        tokio::time::sleep(Duration::from_millis(args.poll_ms)).await;
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.leaves >= 2, "--leaves must be at least 2");
    anyhow::ensure!(args.repeats >= 1 && args.samples >= 1, "nothing to measure");
    raise_nofile_limit()?;
    let run = RunInfo::start(&args.run);
    eprintln!(
        "exports-bench: hub + {} leaves in process, {} change samples, {} x {} bulk endpoints",
        args.leaves, args.samples, args.repeats, args.bulk_endpoints
    );
    let hub = InProcessCluster::start_with_endpoints("hub", POD_CIDR, EXTERNAL_CIDR).await?;
    let mut leaves = Vec::with_capacity(args.leaves);
    for i in 0..args.leaves {
        leaves.push(
            InProcessCluster::start_with_endpoints(&format!("leaf-{i}"), POD_CIDR, EXTERNAL_CIDR)
                .await?,
        );
    }
    let started = Instant::now();
    for leaf in &leaves {
        peer(leaf, &hub).await;
    }
    // The induced mesh: every leaf has a tunnel to every other.
    for a in &leaves {
        for b in &leaves {
            while a.id != b.id && tunnel_to(a, &b.id).await.is_none() {
                anyhow::ensure!(
                    started.elapsed() < Duration::from_secs(args.timeout),
                    "{} has no tunnel to {}",
                    a.id,
                    b.id
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    let mesh_seconds = started.elapsed().as_secs_f64();
    eprintln!("exports-bench: mesh complete in {mesh_seconds:.1} s");
    let exporter = &leaves[0];
    let induced = &leaves[1];
    let consumers: Vec<&InProcessCluster> =
        std::iter::once(&hub).chain(leaves.iter().skip(1)).collect();
    let mut client = exporter.endpoints().await?;

    // Change latency at the induced consumer.
    let mut pods: Vec<u32> = (10..20).collect();
    client.export_service(export("web", &pods)).await?;
    arrival(induced, "web", pods.len(), Instant::now(), &args).await?;
    let mut recorder = Recorder::new();
    let timed = Instant::now();
    for _ in 0..args.samples {
        pods.push(pods.last().copied().unwrap_or(10) + 1);
        let sent = Instant::now();
        client.export_service(export("web", &pods)).await?;
        recorder.record(arrival(induced, "web", pods.len(), sent, &args).await?);
    }
    let change_latency = recorder.summary(timed.elapsed());
    eprintln!(
        "exports-bench: change -> induced consumer p50 {:.1} ms, p99 {:.1} ms",
        change_latency.p50_ms, change_latency.p99_ms
    );

    // Bulk reflection to every consumer.
    let mut bulk_seconds = Vec::with_capacity(args.repeats);
    for repeat in 0..args.repeats {
        let first = 1000 + u32::try_from(repeat * args.bulk_endpoints)?;
        let bulk: Vec<u32> = (first..first + u32::try_from(args.bulk_endpoints)?).collect();
        let sent = Instant::now();
        client.export_service(export("bulk", &bulk)).await?;
        let mut slowest = Duration::ZERO;
        for consumer in &consumers {
            slowest = slowest.max(arrival(consumer, "bulk", bulk.len(), sent, &args).await?);
        }
        eprintln!(
            "exports-bench: {} endpoints at {} consumers in {:.2} s",
            bulk.len(),
            consumers.len(),
            slowest.as_secs_f64()
        );
        bulk_seconds.push(slowest.as_secs_f64());
    }
    let med = median(&bulk_seconds).context("--repeats must be at least 1")?;
    let report = ExportsResult {
        benchmark: "endpoints_exports".into(),
        run: Some(run),
        machine: Some(Machine::describe()),
        parameters: Some(ExportsParameters {
            leaves: args.leaves,
            consumers: consumers.len(),
            samples: args.samples,
            bulk_endpoints: args.bulk_endpoints,
            repeats: args.repeats,
            poll_ms: args.poll_ms,
        }),
        mesh_seconds,
        change_latency: Some(change_latency),
        reflected_endpoints_per_second: (consumers.len() * args.bulk_endpoints) as f64 / med,
        bulk_seconds,
    };
    write_json(&args.out, &report)?;
    eprintln!(
        "exports-bench: {:.0} reflected endpoints/s ({} consumers x {} endpoints, median {med:.2} s)",
        report.reflected_endpoints_per_second,
        consumers.len(),
        args.bulk_endpoints
    );
    for cluster in std::iter::once(hub).chain(leaves) {
        cluster.stop().await;
    }
    Ok(())
}
