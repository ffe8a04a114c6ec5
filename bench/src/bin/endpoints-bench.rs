//! ReflectEndpointSlice throughput over gRPC on loopback: reflected endpoints per second, with
//! the memory and the etcd store. Hub B (IPAM, discovery, endpoints) and leaves A and C (IPAMs)
//! run in this process with pod CIDR 10.0.0.0/16 each; the peering state is set through the
//! services' RPCs. Two paths:
//!
//! - **local_nat**: every endpoint is a pod of B (one cluster lookup and one mapping in B's
//!   IPAM per address);
//! - **induced_remote_ipam**: every endpoint is a pod of A, reflected to C with an induced
//!   peering A-C, so each slice also asks A's IPAM over gRPC (one DoesClusterMappingExist per
//!   slice, one home-IP lookup in B's IPAM and one MapEndpointIp on A's IPAM per address).
//!
//! Each reflection also commits the reflection record (generation and hub-path addresses) in
//! the endpoints service's store.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use ipnet::IpNet;
use tonic::transport::Channel;
use trellis_api::pb::discovery::UpdatePeeringRequest;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::endpoints::{
    AddressType, Endpoint, EndpointSlice, ReflectEndpointSliceRequest, TranslationPath,
};
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{GetSubnetsPerClusterRequest, SetLocalNatRequest};
use trellis_api::pb::types::{ClusterIdentity, ServiceAddresses};
use trellis_bench::results::{EndpointsParameters, EndpointsResult, EndpointsScenario, Store};
use trellis_bench::{LatencySummary, Machine, Recorder, RunArgs, RunInfo, median, write_json};
use trellis_runtime::Shutdown;

/// Measures ReflectEndpointSlice over gRPC and writes a JSON result.
#[derive(Debug, Parser)]
struct Args {
    /// Reflections per scenario.
    #[arg(long, default_value_t = 400)]
    reflections: usize,
    /// Endpoints per slice.
    #[arg(long, default_value_t = 50)]
    slice_size: usize,
    /// Concurrent client tasks (each reflecting its own slice, on its own connection).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Runs of each scenario; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Stores to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["memory", "etcd"])]
    stores: Vec<Store>,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/endpoints.json")]
    out: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

const POD_CIDR: &str = "10.0.0.0/16";

struct Cluster {
    id: &'static str,
    external: &'static str,
    ipam: SocketAddr,
}

fn identity(id: &str) -> ClusterIdentity {
    ClusterIdentity {
        cluster_id: id.into(),
        cluster_name: String::new(),
    }
}

async fn ipam(addr: SocketAddr) -> anyhow::Result<IpamClient<Channel>> {
    Ok(IpamClient::connect(format!("http://{addr}")).await?)
}

/// `viewer` decides how it addresses `other`; `other` learns it.
async fn one_way(viewer: &Cluster, other: &Cluster) -> anyhow::Result<IpNet> {
    let view = ipam(viewer.ipam)
        .await?
        .get_subnets_per_cluster(GetSubnetsPerClusterRequest {
            cluster_id: other.id.into(),
            cluster_name: String::new(),
            pod_cidr: POD_CIDR.into(),
            external_cidr: other.external.into(),
        })
        .await?
        .into_inner();
    ipam(other.ipam)
        .await?
        .set_local_nat(SetLocalNatRequest {
            cluster_id: viewer.id.into(),
            cluster_name: String::new(),
            pod_cidr: view.pod_cidr_nat.clone(),
            external_cidr: view.external_cidr_nat,
        })
        .await?;
    Ok(view.pod_cidr_nat.parse()?)
}

fn address(net: IpNet, n: usize) -> String {
    match net {
        IpNet::V4(v4) => {
            std::net::Ipv4Addr::from(u32::from(v4.network()) + 1 + n as u32).to_string()
        }
        IpNet::V6(_) => String::new(),
    }
}

fn slice(worker: usize, addresses: Vec<String>) -> EndpointSlice {
    EndpointSlice {
        namespace: "bench".into(),
        name: format!("web-{worker}"),
        service_name: "web".into(),
        address_type: AddressType::Ipv4.into(),
        endpoints: addresses
            .into_iter()
            .map(|a| Endpoint {
                addresses: vec![a],
                ..Default::default()
            })
            .collect(),
        ports: vec![],
        labels: Default::default(),
        service: None,
    }
}

async fn run_scenario(
    addr: SocketAddr,
    args: &Args,
    base: IpNet,
    want: TranslationPath,
) -> anyhow::Result<(LatencySummary, f64)> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..args.concurrency {
        let reflections = (worker..args.reflections).step_by(args.concurrency).count();
        let addresses: Vec<String> = (0..args.slice_size)
            .map(|n| address(base, worker * args.slice_size + n))
            .collect();
        tasks.push(tokio::spawn(async move {
            let mut client = EndpointMapperClient::connect(format!("http://{addr}")).await?;
            let mut recorder = Recorder::new();
            for _ in 0..reflections {
                let request = ReflectEndpointSliceRequest {
                    target: Some(identity("c")),
                    slice: Some(slice(worker, addresses.clone())),
                    deliver: false,
                };
                let t = Instant::now();
                let answer = client.reflect_endpoint_slice(request).await?.into_inner();
                recorder.record(t.elapsed());
                anyhow::ensure!(
                    answer.translations.iter().all(|t| t.path == want as i32),
                    "unexpected path in {:?}",
                    answer.translations.first()
                );
            }
            anyhow::Ok(recorder)
        }));
    }
    let mut all = Recorder::new();
    for task in tasks {
        all.merge(&task.await??);
    }
    let wall = started.elapsed();
    let summary = all.summary(wall);
    let endpoints = summary.operations as f64 * args.slice_size as f64 / wall.as_secs_f64();
    Ok((summary, endpoints))
}

async fn measure(store: Store, args: &Args) -> anyhow::Result<Vec<EndpointsScenario>> {
    let etcd = match store {
        Store::Etcd => Some(trellis_testkit::Etcd::start().context("starting etcd")?),
        Store::Memory => None,
    };
    let url = |prefix: &str| {
        etcd.as_ref()
            .map_or_else(|| "memory://".to_owned(), |e| e.url(prefix))
    };
    let shutdown = Shutdown::new();
    let common = |id: &str, store: String| {
        vec![
            "x".to_owned(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--store".into(),
            store,
            "--cluster-id".into(),
            id.into(),
            trellis_testkit::PLAINTEXT_PEERING.into(),
        ]
    };
    let mut clusters = Vec::new();
    for (id, external) in [
        ("a", "10.101.0.0/16"),
        ("b", "10.102.0.0/16"),
        ("c", "10.103.0.0/16"),
    ] {
        let mut argv = common(id, url(&format!("bench-ipam-{id}")));
        argv.extend([
            "--pod-cidr".into(),
            POD_CIDR.into(),
            "--external-cidr".into(),
            external.into(),
        ]);
        let started = trellis_ipam::start(
            trellis_ipam::Config::try_parse_from(argv)?,
            shutdown.clone(),
        )
        .await?;
        clusters.push(Cluster {
            id,
            external,
            ipam: started.addr,
        });
    }
    let (a, b, c) = (&clusters[0], &clusters[1], &clusters[2]);
    let discovery = trellis_discovery::start(
        trellis_discovery::Config::try_parse_from(common("b", url("bench-discovery-b")))?,
        shutdown.clone(),
    )
    .await?;
    let mut argv = common("b", url("bench-endpoints-b"));
    argv.extend([
        "--ipam".into(),
        b.ipam.to_string(),
        "--discovery".into(),
        discovery.addr.to_string(),
    ]);
    let endpoints = trellis_endpoints::start(
        trellis_endpoints::Config::try_parse_from(argv)?,
        shutdown.clone(),
    )
    .await?;

    let b_view_a = one_way(b, a).await?;
    one_way(a, b).await?;
    one_way(b, c).await?;
    one_way(c, b).await?;
    one_way(c, a).await?;
    one_way(a, c).await?;
    let mut disc = DiscoveryClient::connect(format!("http://{}", discovery.addr)).await?;
    for peer in [a, c] {
        disc.update_peering(UpdatePeeringRequest {
            identity: Some(identity(peer.id)),
            peered: true,
            addresses: Some(ServiceAddresses {
                ipam: peer.ipam.to_string(),
                ..Default::default()
            }),
            outgoing_peering_enabled: true,
            incoming_peering_enabled: true,
            networking_enabled: true,
            reason: "HandshakeCompleted".into(),
            message: String::new(),
            expected_revision: 0,
            ca_certificate: String::new(),
        })
        .await?;
    }

    let mut out = Vec::new();
    for (path, base, want) in [
        (
            "local_nat",
            POD_CIDR.parse::<IpNet>()?,
            TranslationPath::LocalNat,
        ),
        ("induced_remote_ipam", b_view_a, TranslationPath::Induced),
    ] {
        let mut runs = Vec::new();
        let mut rates = Vec::new();
        for _ in 0..args.repeats {
            let (latency, endpoints_per_second) =
                run_scenario(endpoints.addr, args, base, want).await?;
            runs.push(latency);
            rates.push(endpoints_per_second);
        }
        out.push(EndpointsScenario {
            store,
            path: path.into(),
            concurrency: args.concurrency,
            slice_size: args.slice_size,
            endpoints_per_second: median(&rates).context("--repeats must be at least 1")?,
            latency: LatencySummary::median_of(&runs).context("--repeats must be at least 1")?,
            runs,
        });
    }
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), endpoints.task).await???;
    Ok(out)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    anyhow::ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    let run = RunInfo::start(&args.run);
    let mut scenarios = Vec::new();
    for store in &args.stores {
        eprintln!(
            "endpoints-bench: measuring ReflectEndpointSlice with the {store:?} store ({} reflections of {} endpoints, {} clients)",
            args.reflections, args.slice_size, args.concurrency
        );
        scenarios.extend(measure(*store, &args).await?);
    }
    let report = EndpointsResult {
        benchmark: "endpoints_reflect_endpoint_slice".into(),
        run: Some(run),
        machine: Some(Machine::describe()),
        parameters: Some(EndpointsParameters {
            reflections: args.reflections,
            slice_size: args.slice_size,
            concurrency: args.concurrency,
            repeats: args.repeats,
        }),
        scenarios,
    };
    write_json(&args.out, &report)?;
    eprintln!(
        "| store | path | clients | endpoints/s | reflections/s | p50 ms | p99 ms | max ms |"
    );
    eprintln!("|---|---|---|---|---|---|---|---|");
    for s in &report.scenarios {
        eprintln!(
            "| {:?} | {} | {} | {:.0} | {:.1} | {:.3} | {:.3} | {:.3} |",
            s.store,
            s.path,
            s.concurrency,
            s.endpoints_per_second,
            s.latency.ops_per_second,
            s.latency.p50_ms,
            s.latency.p99_ms,
            s.latency.max_ms
        );
    }
    Ok(())
}
