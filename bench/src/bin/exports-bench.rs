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
//! - **export → name** (issue 38): leaf 0 exports a new Service (one pod) and the clock runs
//!   until leaf 1's `clusterset.local` DNS answers its name with an address; p50/p99 over
//!   `--dns-samples`;
//! - **DNS under load**: `--dns-clients` resolvers ask leaf 1's DNS for one of those names back
//!   to back for `--dns-seconds`, alternating `--dns-rounds` times with the same load on
//!   dnsmasq (Debian's, answering the same name from its command line): answered queries per
//!   second and latency of each, medians over the rounds.
//!
//! Consumers are polled (ListReflectedSlices, or the DNS) every `--poll-ms`, which bounds the
//! resolution.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use ipnet::IpNet;
use trellis_api::pb::endpoints::{
    EndpointPort, ExportServiceRequest, ExportedEndpoint, ListReflectedSlicesRequest,
};
use trellis_bench::dns::{self, Dnsmasq};
use trellis_bench::proc::raise_nofile_limit;
use trellis_bench::results::{DnsLoad, LatencySummary};
use trellis_bench::results::{ExportsParameters, ExportsResult};
use trellis_bench::{Machine, Recorder, RunArgs, RunInfo, median, write_json};
use trellis_integration::cluster::{InProcessCluster, Options};
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
    /// New exports timed until their name resolves at the induced consumer.
    #[arg(long, default_value_t = 50)]
    dns_samples: usize,
    /// Concurrent resolvers of the DNS load.
    #[arg(long, default_value_t = 8)]
    dns_clients: usize,
    /// Seconds of each DNS load round.
    #[arg(long, default_value_t = 5.0)]
    dns_seconds: f64,
    /// DNS load rounds on each server, alternating; medians are reported.
    #[arg(long, default_value_t = 3)]
    dns_rounds: usize,
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

/// `dns-<k>.shop.svc.clusterset.local.`
fn dns_name(k: usize) -> String {
    format!("dns-{k}.{NAMESPACE}.svc.clusterset.local.")
}

/// Times `--dns-samples` new exports of leaf 0 until their names resolve at `dns`.
async fn resolvable(
    client: &mut trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient<
        tonic::transport::Channel,
    >,
    induced: &InProcessCluster,
    dns: SocketAddr,
    args: &Args,
) -> anyhow::Result<(LatencySummary, LatencySummary)> {
    let mut named = Recorder::new();
    let mut stored = Recorder::new();
    let timed = Instant::now();
    for k in 0..args.dns_samples {
        let service = format!("dns-{k}");
        let name = dns_name(k);
        let pod = 5000 + u32::try_from(k)?;
        let sent = Instant::now();
        client.export_service(export(&service, &[pod])).await?;
        let mut reflected = None;
        loop {
            if reflected.is_none() && listed(induced, &service).await? == Some(1) {
                reflected = Some(sent.elapsed());
            }
            if reflected.is_some() && !dns::resolve(dns, &name).await?.is_empty() {
                break;
            }
            anyhow::ensure!(
                sent.elapsed() < Duration::from_secs(args.timeout),
                "{name} never resolved at the induced consumer"
            );
            tokio::time::sleep(Duration::from_millis(args.poll_ms)).await;
        }
        named.record(sent.elapsed());
        stored.record(reflected.unwrap_or_default());
    }
    let (named, stored) = (
        named.summary(timed.elapsed()),
        stored.summary(timed.elapsed()),
    );
    eprintln!(
        "exports-bench: export -> name at the induced consumer p50 {:.1} ms, p99 {:.1} ms (slice stored there: p50 {:.1} ms, p99 {:.1} ms)",
        named.p50_ms, named.p99_ms, stored.p50_ms, stored.p99_ms
    );
    Ok((named, stored))
}

/// The rounds of one server as one load: latency metrics' medians, counts summed.
fn median_load(rounds: &[DnsLoad]) -> Option<DnsLoad> {
    let first = rounds.first()?;
    let latencies: Vec<LatencySummary> = rounds.iter().map(|r| r.latency.clone()).collect();
    Some(DnsLoad {
        server: first.server.clone(),
        clients: first.clients,
        seconds: rounds.iter().map(|r| r.seconds).sum(),
        sent: rounds.iter().map(|r| r.sent).sum(),
        unanswered: rounds.iter().map(|r| r.unanswered).sum(),
        latency: LatencySummary::median_of(&latencies)?,
    })
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
    // Leaf 1, the induced consumer, serves clusterset.local.
    let dns_addr = SocketAddr::from(([127, 0, 0, 1], trellis_testkit::free_port()));
    let mut leaves = Vec::with_capacity(args.leaves);
    for i in 0..args.leaves {
        let options = Options {
            endpoints: true,
            endpoints_flags: if i == 1 {
                vec!["--dns-listen".into(), dns_addr.to_string()]
            } else {
                Vec::new()
            },
            ..Options::default()
        };
        leaves.push(
            InProcessCluster::start_with(&format!("leaf-{i}"), POD_CIDR, EXTERNAL_CIDR, options)
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

    // Export -> name at the induced consumer, then its DNS under load next to dnsmasq's.
    let (dns_resolvable, dns_reflected, dns_load, dns_peer) = if args.dns_samples == 0 {
        (None, None, None, None)
    } else {
        let (resolvable, reflected) = resolvable(&mut client, induced, dns_addr, &args).await?;
        let name = dns_name(0);
        let answer = dns::resolve(dns_addr, &name).await?;
        let address = *answer.first().context("the first DNS export resolves")?;
        let peer = Dnsmasq::start(&name, address).await?;
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for _ in 0..args.dns_rounds {
            ours.push(
                dns::load(
                    "trellis",
                    dns_addr,
                    &name,
                    args.dns_clients,
                    args.dns_seconds,
                )
                .await?,
            );
            if let Some(peer) = &peer {
                theirs.push(
                    dns::load(
                        &peer.version,
                        peer.addr,
                        &name,
                        args.dns_clients,
                        args.dns_seconds,
                    )
                    .await?,
                );
            }
        }
        (
            Some(resolvable),
            Some(reflected),
            median_load(&ours),
            median_load(&theirs),
        )
    };
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
            dns_samples: args.dns_samples,
            dns_clients: args.dns_clients,
            dns_seconds: args.dns_seconds,
            dns_rounds: args.dns_rounds,
        }),
        mesh_seconds,
        change_latency: Some(change_latency),
        reflected_endpoints_per_second: (consumers.len() * args.bulk_endpoints) as f64 / med,
        bulk_seconds,
        dns_resolvable,
        dns_reflected,
        dns: dns_load,
        dns_peer,
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
