//! `MapEndpointIp` throughput and latency over gRPC on loopback, with the memory and the etcd
//! store: the local-NAT path (a read and a translation) and the external path (a new
//! external-CIDR allocation per request, i.e. a store transaction). The IPAM server runs in
//! this process; clients are concurrent tonic clients over real TCP.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use ipnet::IpNet;
use serde::Serialize;
use tonic::transport::Channel;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{
    GetSubnetsPerClusterRequest, MapEndpointIpRequest, SetLocalNatRequest,
};
use trellis_bench::{LatencySummary, Machine, Recorder};
use trellis_runtime::Shutdown;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum StoreKind {
    Memory,
    Etcd,
}

/// Measures MapEndpointIp over gRPC and writes a JSON result.
#[derive(Debug, Parser)]
struct Args {
    /// Requests per scenario.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// Concurrent client tasks (each with its own HTTP/2 connection).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Stores to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["memory", "etcd"])]
    stores: Vec<StoreKind>,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/ipam.json")]
    out: PathBuf,
}

#[derive(Debug, Serialize)]
struct Scenario {
    store: StoreKind,
    path: &'static str,
    concurrency: usize,
    #[serde(flatten)]
    latency: LatencySummary,
}

#[derive(Debug, Serialize)]
struct Report {
    benchmark: &'static str,
    machine: Machine,
    scenarios: Vec<Scenario>,
}

const LEAF: &str = "leaf";
const OWNER: &str = "owner";

async fn prepare(addr: std::net::SocketAddr) -> anyhow::Result<(IpamClient<Channel>, IpNet)> {
    let mut client = IpamClient::connect(format!("http://{addr}")).await?;
    // OWNER shares our pod CIDR (remapped); its pods are the third-cluster endpoints.
    let owner = client
        .get_subnets_per_cluster(GetSubnetsPerClusterRequest {
            cluster_id: OWNER.into(),
            cluster_name: String::new(),
            pod_cidr: "10.0.0.0/16".into(),
            external_cidr: "10.201.0.0/16".into(),
        })
        .await?
        .into_inner();
    client
        .get_subnets_per_cluster(GetSubnetsPerClusterRequest {
            cluster_id: LEAF.into(),
            cluster_name: String::new(),
            pod_cidr: "10.5.0.0/16".into(),
            external_cidr: "10.205.0.0/16".into(),
        })
        .await?;
    client
        .set_local_nat(SetLocalNatRequest {
            cluster_id: LEAF.into(),
            cluster_name: String::new(),
            pod_cidr: "10.80.0.0/16".into(),
            external_cidr: "10.81.0.0/16".into(),
        })
        .await?;
    Ok((client, owner.pod_cidr_nat.parse()?))
}

async fn run_scenario(
    addr: std::net::SocketAddr,
    requests: usize,
    concurrency: usize,
    ip_of: impl Fn(usize) -> IpAddr + Send + Sync + Clone + 'static,
) -> anyhow::Result<LatencySummary> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let ip_of = ip_of.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = IpamClient::connect(format!("http://{addr}")).await?;
            let mut recorder = Recorder::new();
            for n in (worker..requests).step_by(concurrency) {
                let request = MapEndpointIpRequest {
                    cluster_id: LEAF.into(),
                    ip: ip_of(n).to_string(),
                    induced: false,
                };
                let t = Instant::now();
                client.map_endpoint_ip(request).await?;
                recorder.record(t.elapsed());
            }
            anyhow::Ok(recorder)
        }));
    }
    let mut all = Recorder::new();
    for task in tasks {
        all.merge(&task.await??);
    }
    Ok(all.summary(started.elapsed()))
}

async fn measure(store: StoreKind, args: &Args) -> anyhow::Result<Vec<Scenario>> {
    let etcd = match store {
        StoreKind::Etcd => Some(trellis_testkit::Etcd::start().context("starting etcd")?),
        StoreKind::Memory => None,
    };
    let store_url = etcd
        .as_ref()
        .map_or_else(|| "memory://".to_owned(), |e| e.url("ipam-bench"));
    let config = trellis_ipam::Config::try_parse_from([
        "trellis-ipam",
        "--listen",
        "127.0.0.1:0",
        "--store",
        &store_url,
        "--cluster-id",
        "hub",
        "--pod-cidr",
        "10.0.0.0/16",
        "--external-cidr",
        "10.201.0.0/16",
    ])?;
    let shutdown = Shutdown::new();
    let started = trellis_ipam::start(config, shutdown.clone()).await?;
    let (_client, owner_pods) = prepare(started.addr).await?;

    let mut out = Vec::new();
    // Local path: pods of this cluster, translated through the leaf's view of us.
    let local = run_scenario(started.addr, args.requests, args.concurrency, |n| {
        IpAddr::from([10, 0, (n / 250 % 250) as u8, (n % 250 + 1) as u8])
    })
    .await?;
    out.push(Scenario {
        store,
        path: "local_nat",
        concurrency: args.concurrency,
        latency: local,
    });
    // External path: every request is a new third-cluster endpoint, i.e. an allocation.
    let base = trellis_api::net::ip_to_u128(owner_pods.network());
    let family = trellis_api::net::Family::of_net(owner_pods);
    let requests = args.requests.min(60_000);
    let external = run_scenario(started.addr, requests, args.concurrency, move |n| {
        trellis_api::net::u128_to_ip(family, base + 1 + n as u128)
            .unwrap_or(IpAddr::from([0, 0, 0, 0]))
    })
    .await?;
    out.push(Scenario {
        store,
        path: "external_alloc",
        concurrency: args.concurrency,
        latency: external,
    });

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), started.task).await???;
    Ok(out)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut scenarios = Vec::new();
    for store in &args.stores {
        eprintln!(
            "ipam-bench: measuring MapEndpointIp with the {store:?} store ({} requests, {} clients)",
            args.requests, args.concurrency
        );
        scenarios.extend(measure(*store, &args).await?);
    }
    let report = Report {
        benchmark: "ipam_map_endpoint_ip",
        machine: Machine::describe(),
        scenarios,
    };
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)? + "\n")?;
    eprintln!("| store | path | clients | ops/s | p50 ms | p99 ms | max ms |");
    eprintln!("|---|---|---|---|---|---|---|");
    for s in &report.scenarios {
        eprintln!(
            "| {:?} | {} | {} | {:.0} | {:.3} | {:.3} | {:.3} |",
            s.store,
            s.path,
            s.concurrency,
            s.latency.ops_per_second,
            s.latency.p50_ms,
            s.latency.p99_ms,
            s.latency.max_ms
        );
    }
    eprintln!("ipam-bench: wrote {}", args.out.display());
    Ok(())
}
