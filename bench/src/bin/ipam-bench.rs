//! IPAM throughput and latency over gRPC on loopback, with the memory and the etcd store, and
//! with one or three IPAM replicas on the same etcd:
//!
//! - `MapEndpointIp` **local_nat** (a read and a translation) and **external_alloc** (a new
//!   external-CIDR allocation per request, i.e. a store transaction);
//! - `GetSubnetsPerCluster` **new_cluster_remap** (every request a new remote cluster whose
//!   pod and external CIDRs conflict with ours, so two ranges are allocated) and
//!   **known_cluster** (the same clusters asked again: the stored answer).
//!
//! The IPAM servers run in this process (each replica with its own store client, as separate
//! processes would be); clients are concurrent tonic clients over real TCP, spread round-robin
//! across the replicas. With replicas, a consistency check follows: every client maps the
//! *same* fresh endpoints and asks for the *same* new clusters at the same time, each through
//! its replica, and every answer must agree (one external address per endpoint, one remapped
//! range per cluster, no two endpoints or clusters sharing one). Disagreements are recorded,
//! not hidden. The memory store lives inside one server, so replicas do not apply to it.
//!
//! The **metrics overhead** variant (issue 19) measures `MapEndpointIp` local_nat on the memory
//! store twice in the same run, against an IPAM with its Prometheus metrics (the gRPC metrics
//! layer recording every request, `/metrics` served) and one with `--metrics-listen off` (no
//! layer), alternating which goes first; the ratio of their throughputs is the overhead.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use ipnet::IpNet;
use tonic::transport::Channel;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{
    FreeSubnetsPerClusterRequest, GetLocalSubnetsRequest, GetSubnetsPerClusterRequest,
    MapEndpointIpRequest, SetLocalNatRequest,
};
use trellis_bench::results::{
    Consistency, IpamParameters, IpamResult, IpamScenario, MetricsOverhead, Store,
};
use trellis_bench::{LatencySummary, Machine, Recorder, RunArgs, RunInfo, write_json};
use trellis_runtime::Shutdown;

/// Measures the IPAM's MapEndpointIp and GetSubnetsPerCluster over gRPC and writes a JSON
/// result (read by `bench-report`).
/// External-CIDR allocations across all repeats of one store: a quarter of the /16.
const EXTERNAL_BUDGET: usize = 16_000;

#[derive(Debug, Parser)]
struct Args {
    /// Requests per scenario and repeat.
    #[arg(long, default_value_t = 20_000)]
    requests: usize,
    /// New remote clusters per run of the GetSubnetsPerCluster scenarios (each allocates two
    /// ranges; known_cluster then asks for them again; they are freed after the run). 250 is a
    /// hub with a full mesh of leaves.
    #[arg(long, default_value_t = 250)]
    new_clusters: usize,
    /// Concurrent client tasks (each with its own HTTP/2 connection).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Runs of each scenario; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Stores to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["memory", "etcd"])]
    stores: Vec<Store>,
    /// Numbers of IPAM replicas to measure with the etcd store (the memory store is always
    /// measured with one: it cannot be shared between servers).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 3])]
    replicas: Vec<usize>,
    /// Fresh endpoints (and, a tenth of it, new clusters) every client asks for at the same
    /// time in the consistency check with several replicas.
    #[arg(long, default_value_t = 300)]
    consistency_endpoints: usize,
    /// Repeats of the metrics-overhead variant (MapEndpointIp local_nat on the memory store,
    /// with and without the metrics layer, alternating); 0 skips it.
    #[arg(long, default_value_t = 5)]
    metrics_repeats: usize,
    /// Where to write the JSON result.
    #[arg(long, default_value = "bench/results/ipam.json")]
    out: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

const LEAF: &str = "leaf";
const OWNER: &str = "owner";

async fn client(addr: SocketAddr) -> anyhow::Result<IpamClient<Channel>> {
    IpamClient::connect(format!("http://{addr}"))
        .await
        .with_context(|| format!("connecting to the IPAM at {addr}"))
}

async fn prepare(addr: SocketAddr) -> anyhow::Result<IpNet> {
    let mut client = client(addr).await?;
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
    Ok(owner.pod_cidr_nat.parse()?)
}

/// One request of a scenario, number `n`.
#[derive(Debug, Clone)]
enum Request {
    Map(MapEndpointIpRequest),
    Subnets(GetSubnetsPerClusterRequest),
}

/// Sends `requests` requests from `concurrency` clients spread over `replicas`; returns the
/// latency summary and every answer (request number, answer) for checks.
async fn run_scenario(
    replicas: &[SocketAddr],
    requests: usize,
    concurrency: usize,
    request_of: Arc<dyn Fn(usize) -> Request + Send + Sync>,
) -> anyhow::Result<(LatencySummary, Vec<(usize, Result<String, String>)>)> {
    // Every client connects and sends one unrecorded request first, and the clock starts when
    // all of them are ready: connection set-up is not what is measured, and with a few thousand
    // requests it would otherwise own the p99.
    let ready = Arc::new(tokio::sync::Barrier::new(concurrency + 1));
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let request_of = request_of.clone();
        let addr = replicas[worker % replicas.len()];
        let ready = ready.clone();
        tasks.push(tokio::spawn(async move {
            let connected = async {
                let mut client = client(addr).await?;
                client.get_local_subnets(GetLocalSubnetsRequest {}).await?;
                anyhow::Ok(client)
            }
            .await;
            // Wait at the barrier even on failure, or the others would wait forever.
            ready.wait().await;
            let mut client = connected?;
            let mut recorder = Recorder::new();
            let mut answers = Vec::new();
            for n in (worker..requests).step_by(concurrency) {
                let t = Instant::now();
                let answer = match request_of(n) {
                    Request::Map(r) => client.map_endpoint_ip(r).await.map(|a| a.into_inner().ip),
                    Request::Subnets(r) => client.get_subnets_per_cluster(r).await.map(|a| {
                        let a = a.into_inner();
                        format!("{} {}", a.pod_cidr_nat, a.external_cidr_nat)
                    }),
                };
                recorder.record(t.elapsed());
                answers.push((n, answer.map_err(|s| s.message().to_owned())));
            }
            anyhow::Ok((recorder, answers))
        }));
    }
    ready.wait().await;
    let started = Instant::now();
    let mut all = Recorder::new();
    let mut answers = Vec::new();
    for task in tasks {
        let (recorder, mut some) = task.await??;
        all.merge(&recorder);
        answers.append(&mut some);
    }
    let failed: Vec<&String> = answers
        .iter()
        .filter_map(|(_, a)| a.as_ref().err())
        .collect();
    if let Some(first) = failed.first() {
        // A benchmark of failing requests measures nothing: say so instead of reporting it.
        anyhow::bail!(
            "{} of {requests} requests failed, e.g.: {first}",
            failed.len()
        );
    }
    Ok((all.summary(started.elapsed()), answers))
}

fn map_request(ip: IpAddr) -> Request {
    Request::Map(MapEndpointIpRequest {
        cluster_id: LEAF.into(),
        ip: ip.to_string(),
        induced: false,
    })
}

/// A new remote cluster `id` whose /24 pod CIDR and external CIDR conflict with ours.
fn subnets_request(id: usize) -> Request {
    Request::Subnets(GetSubnetsPerClusterRequest {
        cluster_id: format!("remote-{id:06}"),
        cluster_name: String::new(),
        pod_cidr: "10.0.0.0/24".into(),
        external_cidr: "10.201.0.0/24".into(),
    })
}

/// Started IPAM servers on one store.
struct Servers {
    addrs: Vec<SocketAddr>,
    shutdown: Shutdown,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
    _etcd: Option<trellis_testkit::Etcd>,
}

async fn start_servers(store: Store, replicas: usize) -> anyhow::Result<Servers> {
    start_servers_with(store, replicas, false).await
}

/// Like [`start_servers`]; `metrics` serves `/metrics` on a free port (the gRPC metrics layer
/// recording every request), otherwise `--metrics-listen off` (no layer).
async fn start_servers_with(
    store: Store,
    replicas: usize,
    metrics: bool,
) -> anyhow::Result<Servers> {
    let etcd = match store {
        Store::Etcd => Some(
            trellis_testkit::Etcd::start()
                .context("starting etcd (installed by `make setup`; `--stores memory` skips it)")?,
        ),
        Store::Memory => None,
    };
    let store_url = etcd
        .as_ref()
        .map_or_else(|| "memory://".to_owned(), |e| e.url("ipam-bench"));
    let shutdown = Shutdown::new();
    let mut addrs = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..replicas {
        let config = trellis_ipam::Config::try_parse_from([
            "trellis-ipam",
            "--listen",
            "127.0.0.1:0",
            "--store",
            &store_url,
            "--insecure-plaintext-peering",
            "--cluster-id",
            "hub",
            "--pod-cidr",
            "10.0.0.0/16",
            "--external-cidr",
            "10.201.0.0/16",
            "--metrics-listen",
            if metrics { "127.0.0.1:0" } else { "off" },
        ])?;
        let started = trellis_ipam::start(config, shutdown.clone()).await?;
        addrs.push(started.addr);
        tasks.push(started.task);
    }
    Ok(Servers {
        addrs,
        shutdown,
        tasks,
        _etcd: etcd,
    })
}

async fn measure(
    store: Store,
    replicas: usize,
    args: &Args,
) -> anyhow::Result<(Vec<IpamScenario>, Option<Consistency>)> {
    let servers = start_servers(store, replicas).await?;
    let owner_pods = prepare(servers.addrs[0]).await?;
    let base = trellis_api::net::ip_to_u128(owner_pods.network());
    let family = trellis_api::net::Family::of_net(owner_pods);
    let owner_ip = move |n: usize| {
        trellis_api::net::u128_to_ip(family, base + 1 + n as u128)
            .unwrap_or(IpAddr::from([0, 0, 0, 0]))
    };
    // Fresh endpoints and clusters in every repeat: numbers are offset per repeat. The
    // allocations of all repeats share the /16 external CIDR; past about a quarter full, hashed
    // probes start to collide and allocation falls back to listing every reservation, which
    // would measure a nearly full CIDR instead of the normal case.
    let external_per_repeat = args.requests.min(EXTERNAL_BUDGET / args.repeats.max(1));
    let mut runs: BTreeMap<(&str, &str), Vec<LatencySummary>> = BTreeMap::new();
    for repeat in 0..args.repeats {
        let local = run_scenario(
            &servers.addrs,
            args.requests,
            args.concurrency,
            Arc::new(local_request),
        )
        .await?
        .0;
        runs.entry(("MapEndpointIp", "local_nat"))
            .or_default()
            .push(local);

        let offset = repeat * external_per_repeat;
        let external = run_scenario(
            &servers.addrs,
            external_per_repeat,
            args.concurrency,
            Arc::new(move |n| map_request(owner_ip(offset + n))),
        )
        .await?
        .0;
        runs.entry(("MapEndpointIp", "external_alloc"))
            .or_default()
            .push(external);
    }
    // GetSubnetsPerCluster after every MapEndpointIp run: the clusters it adds would otherwise
    // be in the store during the later MapEndpointIp runs and make them differ from the first.
    for repeat in 0..args.repeats {
        let first_cluster = repeat * args.new_clusters;
        let new_clusters = args.new_clusters;
        let fresh = run_scenario(
            &servers.addrs,
            new_clusters,
            args.concurrency,
            Arc::new(move |n| subnets_request(first_cluster + n)),
        )
        .await?
        .0;
        runs.entry(("GetSubnetsPerCluster", "new_cluster_remap"))
            .or_default()
            .push(fresh);

        let known = run_scenario(
            &servers.addrs,
            args.requests,
            args.concurrency,
            Arc::new(move |n| subnets_request(first_cluster + n % new_clusters.max(1))),
        )
        .await?
        .0;
        runs.entry(("GetSubnetsPerCluster", "known_cluster"))
            .or_default()
            .push(known);
        // Free them again (not measured), so that every run starts from the same store: a hub
        // holds one record per peer, and each of these calls lists them all.
        let mut cleaner = client(servers.addrs[0]).await?;
        for n in 0..new_clusters {
            cleaner
                .free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
                    cluster_id: format!("remote-{:06}", first_cluster + n),
                })
                .await
                .context("freeing the clusters of a run")?;
        }
    }
    let order = [
        ("MapEndpointIp", "local_nat"),
        ("MapEndpointIp", "external_alloc"),
        ("GetSubnetsPerCluster", "new_cluster_remap"),
        ("GetSubnetsPerCluster", "known_cluster"),
    ];
    let scenarios = order
        .iter()
        .filter_map(|key| {
            let runs = runs.remove(key)?;
            Some(IpamScenario {
                store,
                replicas,
                rpc: key.0.into(),
                path: key.1.into(),
                concurrency: args.concurrency,
                latency: LatencySummary::median_of(&runs)?,
                runs,
            })
        })
        .collect();

    let consistency = if replicas > 1 {
        let offset = args.repeats * external_per_repeat;
        let first_cluster = args.repeats * args.new_clusters;
        Some(
            check_consistency(
                store,
                &servers.addrs,
                args,
                move |n| owner_ip(offset + n),
                first_cluster,
            )
            .await?,
        )
    } else {
        None
    };

    servers.shutdown.cancel();
    for task in servers.tasks {
        tokio::time::timeout(Duration::from_secs(15), task).await???;
    }
    Ok((scenarios, consistency))
}

/// The local_nat request number `n` (addresses in our own pod CIDR, cycling).
fn local_request(n: usize) -> Request {
    map_request(IpAddr::from([
        10,
        0,
        (n / 250 % 250) as u8,
        (n % 250 + 1) as u8,
    ]))
}

/// The metrics-overhead variant: one IPAM with metrics and one without, both on the memory
/// store, the same local_nat scenario against each, alternating which runs first.
async fn measure_metrics_overhead(args: &Args) -> anyhow::Result<MetricsOverhead> {
    let with = start_servers_with(Store::Memory, 1, true).await?;
    let without = start_servers_with(Store::Memory, 1, false).await?;
    prepare(with.addrs[0]).await?;
    prepare(without.addrs[0]).await?;
    let mut with_runs = Vec::new();
    let mut without_runs = Vec::new();
    let mut ratios = Vec::new();
    for repeat in 0..args.metrics_repeats {
        let mut pair = [None, None];
        let order = if repeat % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let servers = if i == 0 { &with } else { &without };
            let summary = run_scenario(
                &servers.addrs,
                args.requests,
                args.concurrency,
                Arc::new(local_request),
            )
            .await?
            .0;
            pair[i] = Some(summary);
        }
        let [Some(w), Some(wo)] = pair else {
            anyhow::bail!("a run of the metrics-overhead pair is missing");
        };
        ratios.push(w.ops_per_second / wo.ops_per_second);
        with_runs.push(w);
        without_runs.push(wo);
    }
    for servers in [with, without] {
        servers.shutdown.cancel();
        for task in servers.tasks {
            tokio::time::timeout(Duration::from_secs(15), task).await???;
        }
    }
    Ok(MetricsOverhead {
        store: Store::Memory,
        rpc: "MapEndpointIp".into(),
        path: "local_nat".into(),
        concurrency: args.concurrency,
        with_metrics: LatencySummary::median_of(&with_runs).context("no runs")?,
        without_metrics: LatencySummary::median_of(&without_runs).context("no runs")?,
        throughput_ratio: trellis_bench::median(&ratios).context("no runs")?,
        ratios,
        run: None,
    })
}

/// Every client asks for the same fresh endpoints and the same new clusters at once, each
/// through its replica (a different order per client, so they race on every one).
async fn check_consistency(
    store: Store,
    replicas: &[SocketAddr],
    args: &Args,
    owner_ip: impl Fn(usize) -> IpAddr + Send + Sync + Clone + 'static,
    first_cluster: usize,
) -> anyhow::Result<Consistency> {
    let endpoints = args.consistency_endpoints.max(1);
    let clusters = (endpoints / 10).max(1);
    let clients = args.concurrency.max(replicas.len());
    let mut tasks = Vec::new();
    for worker in 0..clients {
        let addr = replicas[worker % replicas.len()];
        let owner_ip = owner_ip.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = client(addr).await?;
            let mut endpoint_answers = Vec::new();
            let mut cluster_answers = Vec::new();
            for k in 0..endpoints {
                // Rotated start: client w begins at a different endpoint.
                let n = (k + worker * endpoints / clients) % endpoints;
                let answer = client
                    .map_endpoint_ip(MapEndpointIpRequest {
                        cluster_id: LEAF.into(),
                        ip: owner_ip(n).to_string(),
                        induced: false,
                    })
                    .await
                    .map(|a| a.into_inner().ip)
                    .map_err(|s| s.message().to_owned());
                endpoint_answers.push((n, answer));
                if k < clusters {
                    let c = (k + worker) % clusters;
                    let Request::Subnets(request) = subnets_request(first_cluster + c) else {
                        unreachable!("subnets_request builds a GetSubnetsPerCluster request")
                    };
                    let answer = client
                        .get_subnets_per_cluster(request)
                        .await
                        .map(|a| a.into_inner().pod_cidr_nat)
                        .map_err(|s| s.message().to_owned());
                    cluster_answers.push((c, answer));
                }
            }
            anyhow::Ok((endpoint_answers, cluster_answers))
        }));
    }
    let mut by_endpoint: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    let mut by_cluster: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    let mut errors = 0;
    let mut examples = Vec::new();
    for task in tasks {
        let (endpoint_answers, cluster_answers) = task.await??;
        for (n, answer) in endpoint_answers {
            match answer {
                Ok(ip) => {
                    by_endpoint.entry(n).or_default().insert(ip);
                }
                Err(e) => {
                    errors += 1;
                    if examples.len() < 5 {
                        examples.push(format!("MapEndpointIp for endpoint {n}: {e}"));
                    }
                }
            }
        }
        for (c, answer) in cluster_answers {
            match answer {
                Ok(range) => {
                    by_cluster.entry(c).or_default().insert(range);
                }
                Err(e) => {
                    errors += 1;
                    if examples.len() < 5 {
                        examples.push(format!("GetSubnetsPerCluster for cluster {c}: {e}"));
                    }
                }
            }
        }
    }
    let mut endpoint_disagreements = 0;
    let mut owners: BTreeMap<&String, usize> = BTreeMap::new();
    for (n, answers) in &by_endpoint {
        if answers.len() > 1 {
            endpoint_disagreements += 1;
            if examples.len() < 5 {
                examples.push(format!("endpoint {} got {answers:?}", owner_ip(*n)));
            }
        }
        for a in answers {
            *owners.entry(a).or_default() += 1;
        }
    }
    let shared_addresses = owners.values().filter(|c| **c > 1).count();
    let mut cluster_disagreements = 0;
    let mut ranges: Vec<IpNet> = Vec::new();
    for (c, answers) in &by_cluster {
        if answers.len() > 1 {
            cluster_disagreements += 1;
            if examples.len() < 5 {
                examples.push(format!(
                    "cluster remote-{:06} got {answers:?}",
                    first_cluster + c
                ));
            }
        }
        ranges.extend(answers.iter().filter_map(|a| a.parse::<IpNet>().ok()));
    }
    let mut overlapping_ranges = 0;
    for (i, a) in ranges.iter().enumerate() {
        if ranges[i + 1..]
            .iter()
            .any(|b| a.contains(&b.network()) || b.contains(&a.network()))
        {
            overlapping_ranges += 1;
        }
    }
    let consistent = errors == 0
        && endpoint_disagreements == 0
        && shared_addresses == 0
        && cluster_disagreements == 0
        && overlapping_ranges == 0;
    Ok(Consistency {
        store,
        replicas: replicas.len(),
        clients,
        endpoints_checked: by_endpoint.len(),
        clusters_checked: by_cluster.len(),
        endpoint_disagreements,
        shared_addresses,
        cluster_disagreements,
        overlapping_ranges,
        errors,
        examples,
        consistent,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    anyhow::ensure!(args.concurrency >= 1, "--concurrency must be at least 1");
    anyhow::ensure!(
        args.replicas.iter().all(|r| *r >= 1),
        "--replicas: every count must be at least 1"
    );
    let run = RunInfo::start(&args.run);
    let mut scenarios = Vec::new();
    let mut consistency = Vec::new();
    for store in &args.stores {
        let replica_counts = match store {
            // One server owns a memory store; there is nothing to replicate.
            Store::Memory => vec![1],
            Store::Etcd => args.replicas.clone(),
        };
        for replicas in replica_counts {
            eprintln!(
                "ipam-bench: {store:?} store, {replicas} replica(s): {} requests x {} repeats, {} clients",
                args.requests, args.repeats, args.concurrency
            );
            let (s, c) = measure(*store, replicas, &args)
                .await
                .with_context(|| format!("{store:?} store with {replicas} replica(s)"))?;
            scenarios.extend(s);
            if let Some(c) = c {
                if !c.consistent {
                    eprintln!("ipam-bench: REPLICAS DISAGREE: {c:?}");
                }
                consistency.push(c);
            }
        }
    }
    let metrics_overhead = if args.metrics_repeats > 0 {
        eprintln!(
            "ipam-bench: metrics overhead: MapEndpointIp local_nat, memory store, with and \
             without metrics, {} requests x {} repeats",
            args.requests, args.metrics_repeats
        );
        Some(
            measure_metrics_overhead(&args)
                .await
                .context("the metrics-overhead variant")?,
        )
    } else {
        None
    };
    let report = IpamResult {
        benchmark: "ipam".into(),
        run: Some(run),
        machine: Some(Machine::describe()),
        parameters: Some(IpamParameters {
            requests: args.requests,
            new_clusters: args.new_clusters,
            concurrency: args.concurrency,
            repeats: args.repeats,
            replicas: args.replicas.clone(),
            consistency_endpoints: args.consistency_endpoints,
            metrics_repeats: Some(args.metrics_repeats),
        }),
        scenarios,
        consistency,
        metrics_overhead,
    };
    write_json(&args.out, &report)?;
    eprintln!("| store | replicas | rpc | path | ops/s | p50 ms | p99 ms | max ms |");
    eprintln!("|---|---|---|---|---|---|---|---|");
    for s in &report.scenarios {
        eprintln!(
            "| {:?} | {} | {} | {} | {:.0} | {:.3} | {:.3} | {:.3} |",
            s.store,
            s.replicas,
            s.rpc,
            s.path,
            s.latency.ops_per_second,
            s.latency.p50_ms,
            s.latency.p99_ms,
            s.latency.max_ms
        );
    }
    if let Some(m) = &report.metrics_overhead {
        eprintln!(
            "metrics overhead: {:.0} requests/s with metrics, {:.0} without; ratio {:.3} \
             (per pair: {:?})",
            m.with_metrics.ops_per_second,
            m.without_metrics.ops_per_second,
            m.throughput_ratio,
            m.ratios
        );
    }
    eprintln!("ipam-bench: wrote {}", args.out.display());
    Ok(())
}
