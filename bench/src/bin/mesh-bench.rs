//! Full induced mesh setup time versus the number of leaves: one hub and n leaves, all with
//! the same pod CIDR (so every cluster remaps every other's) and each with an external /24 of
//! its own, as the lab does: remapping both /16s of 254 peers would take 508 /16s, and the
//! IPAM's default pools hold 273, so no leaf could map more than about 135 peers (until this
//! was found, a 254-leaf run stalled near 28 % of its induced tunnels for that reason alone:
//! each end had mapped about half of the others, in its own order). The clock starts
//! when the leaves send their Peer requests to the hub and stops when every leaf holds an
//! induced TunnelEndpoint for every other leaf (n·(n-1) in total). Three modes (`--mode`):
//!
//! - **in-process** (default): every cluster's five services in this process with memory
//!   stores (leaves are `trellis_integration::cluster::InProcessCluster`s; the hub is started
//!   here from the same flags, keeping each service's core so that its store can be sized after
//!   convergence: keys, and bytes of keys plus values);
//! - **hub-processes**: the same, but the hub's five services are the release service binaries
//!   as child processes (memory stores), so that the hub's CPU time (utime + stime) and peak
//!   memory (VmHWM) can be read from /proc at convergence;
//! - **hub-etcd**: the hub is a `trellis_integration::processes::ProcessCluster` (every service
//!   a process of the service binaries with its own etcd, as in production), the leaves run in
//!   this process as above: the hub's CPU, memory, etcd keys and etcd writes (each etcd's
//!   revision, which every write transaction raises by one) per induced tunnel at sizes up to
//!   254 leaves (issue 17);
//! - **etcd-processes**: hub and leaves as `ProcessCluster`s, every service a process with its
//!   own etcd; small n only. The hub's CPU, memory, etcd keys and writes are read as above.
//!
//! A run that does not converge within `--timeout` is recorded (with how many induced
//! TunnelEndpoints existed) and the larger sizes are skipped, unless `--keep-going`.
//! Every run is a process of its own (this binary with the hidden `--one-run`), so that the
//! memory and CPU it records are its own, not partly an earlier run's.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};
use tonic::transport::Channel;
use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{
    GetTokenRequest, ListNetworkConfigsRequest, ListRelaysRequest, ListTunnelEndpointsRequest,
    PeerRequest, WatchTunnelEndpointsRequest,
};
use trellis_api::pb::types::{PeeringKind, WatchEventType};
use trellis_bench::proc::{ProcUsage, pid_listening_on, raise_nofile_limit, reset_peak_rss, usage};
use trellis_bench::{Machine, RunArgs, RunInfo, median, write_json};
use trellis_integration::ServiceProcess;
use trellis_integration::cluster::InProcessCluster;
use trellis_integration::processes::{ProcessCluster, Service};
use trellis_runtime::Shutdown;
use trellis_store::{SharedStore, StoreSize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
enum Mode {
    /// Every service of every cluster in this process, memory stores.
    InProcess,
    /// The hub's services as child processes (release binaries, memory stores), leaves in
    /// this process: the hub's CPU time and peak memory are measured.
    HubProcesses,
    /// The hub's services as processes, each with its own etcd; leaves in this process.
    HubEtcd,
    /// Hub and leaves as processes, each service with its own etcd (small n).
    EtcdProcesses,
}

impl Mode {
    fn default_out(self) -> &'static str {
        match self {
            Mode::InProcess => "bench/results/mesh.json",
            Mode::HubProcesses => "bench/results/mesh-hub-processes.json",
            Mode::HubEtcd => "bench/results/mesh-hub-etcd.json",
            Mode::EtcdProcesses => "bench/results/mesh-etcd.json",
        }
    }

    /// Whether the hub is a `ProcessCluster` on etcd.
    fn hub_on_etcd(self) -> bool {
        matches!(self, Mode::HubEtcd | Mode::EtcdProcesses)
    }
}

/// Measures induced mesh setup time (and what the hub holds and spends) and writes a JSON
/// result (read by `bench-report`).
#[derive(Debug, Parser)]
struct Args {
    /// Where the clusters' services run and what they store in; see the module doc.
    #[arg(long, value_enum, default_value_t = Mode::InProcess)]
    mode: Mode,
    /// Numbers of leaves to measure (at least 2 each), in order.
    #[arg(long, value_delimiter = ',', default_values_t = [2usize, 5, 10, 20, 50, 100, 254])]
    leaves: Vec<usize>,
    /// Runs per size; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Give up on one run after this many seconds (recorded as not converged).
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// After a size does not converge, still try the larger ones (by default they are
    /// recorded as skipped: they would only time out too).
    #[arg(long)]
    keep_going: bool,
    /// Where to write the JSON result [default: bench/results/mesh.json,
    /// mesh-hub-processes.json, mesh-hub-etcd.json or mesh-etcd.json by mode].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Internal: measure one run of this many leaves and write its outcome to `--out` (the
    /// benchmark runs every repeat so, in a process of its own).
    #[arg(long, hide = true)]
    one_run: Option<usize>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Run {
    /// Setup time; the timeout when not converged.
    seconds: f64,
    converged: bool,
    /// Induced TunnelEndpoints held by the leaves when the run ended.
    induced_reached: usize,
    /// CPU seconds the hub's processes spent from the Peer requests to convergence.
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_cpu_seconds: Option<f64>,
    /// The same per induced TunnelEndpoint (n·(n-1)), in milliseconds: what one more induced
    /// tunnel costs the hub every leaf shares (issue 17).
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_cpu_ms_per_induced_tunnel: Option<f64>,
    /// Seconds from the Peer requests until every full tunnel was up: each leaf's to the hub
    /// and the hub's to each leaf (none when that did not happen before the run ended).
    full_tunnels_seconds: Option<f64>,
    /// Seconds until 90 % of the induced TunnelEndpoints existed.
    induced_90_seconds: Option<f64>,
    /// The last 10 % of induced TunnelEndpoints' share of the setup time:
    /// (seconds − induced_90_seconds) / seconds. A retry tail shows here.
    tail_share: Option<f64>,
    /// File descriptors this process held when the run ended (against `open_files_limit`:
    /// every in-process cluster's sockets count here).
    open_files: Option<usize>,
    /// Peer requests sent again after an UNAVAILABLE answer (at most `PEER_RETRIES` per leaf).
    peer_retries: usize,
    /// Write transactions on the hub's etcds from the Peer requests to convergence, per
    /// service (hub on etcd only).
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_etcd_writes: Option<BTreeMap<String, i64>>,
    /// All of them per induced TunnelEndpoint (n·(n-1)).
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_etcd_writes_per_induced_tunnel: Option<f64>,
    /// This benchmark process over the run, from before the hub started until it was stopped:
    /// its peak RSS (VmHWM, reset at the start), KiB, and its CPU seconds (user + system). In
    /// process that is every cluster; otherwise the leaves and the harness.
    #[serde(skip_serializing_if = "Option::is_none")]
    process_peak_rss_kib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    process_cpu_seconds: Option<f64>,
}

/// One hub service's store after convergence.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct StoreUse {
    keys: usize,
    /// Keys plus values, in bytes.
    bytes: usize,
}

impl From<StoreSize> for StoreUse {
    fn from(size: StoreSize) -> Self {
        Self {
            keys: size.keys,
            bytes: size.bytes,
        }
    }
}

/// The hub's stores after convergence, per service, and their sum.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct HubStores {
    discovery: StoreUse,
    broker: StoreUse,
    forwarder: StoreUse,
    ipam: StoreUse,
    gateway: StoreUse,
    total: StoreUse,
}

/// One hub process at convergence.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct HubProcess {
    service: String,
    /// utime + stime since the process started (including its start-up).
    cpu_seconds: f64,
    /// utime + stime from the Peer requests to convergence.
    cpu_seconds_during_setup: f64,
    /// VmHWM, KiB.
    peak_rss_kib: u64,
    /// VmRSS at convergence, KiB.
    rss_kib: u64,
}

/// What the hub holds after convergence.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Held {
    tunnels: usize,
    ncs: usize,
    relays: usize,
    ipam: usize,
    stores: Option<HubStores>,
    processes: Option<Vec<HubProcess>>,
    etcd_keys: Option<BTreeMap<String, usize>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Status {
    Converged,
    TimedOut,
    Failed,
    Skipped,
}

#[derive(Debug, Serialize)]
struct Size {
    leaves: usize,
    induced_tunnel_endpoints: usize,
    status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    runs: Vec<Run>,
    /// Median over the converged runs.
    median_seconds: Option<f64>,
    /// The rest from the last converged run.
    hub_tunnel_endpoints: Option<usize>,
    hub_network_configs: Option<usize>,
    hub_relays_in_flight: Option<usize>,
    hub_ipam_records: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_stores: Option<HubStores>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_processes: Option<Vec<HubProcess>>,
    /// Medians over the converged runs: the hub's CPU seconds during setup (all its
    /// processes), and the sum of its processes' peak RSS.
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_cpu_seconds_during_setup: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_peak_rss_kib_total: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hub_etcd_keys: Option<BTreeMap<String, usize>>,
    /// Medians over the converged runs of the per-run fields of the same names.
    median_full_tunnels_seconds: Option<f64>,
    median_tail_share: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    median_hub_cpu_ms_per_induced_tunnel: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    median_hub_etcd_writes_per_induced_tunnel: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    median_process_peak_rss_kib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    median_process_cpu_seconds: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Parameters {
    leaves: Vec<usize>,
    repeats: usize,
    timeout_seconds: u64,
    keep_going: bool,
    open_files_limit: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Report {
    benchmark: &'static str,
    mode: Mode,
    run: RunInfo,
    machine: Machine,
    parameters: Parameters,
    sizes: Vec<Size>,
}

fn flags(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// The hub's service addresses (picked before binding: discovery advertises them first).
#[derive(Debug, Clone, Copy)]
struct HubAddrs {
    discovery: SocketAddr,
    broker: SocketAddr,
    forwarder: SocketAddr,
    ipam: SocketAddr,
    gateway: SocketAddr,
}

impl HubAddrs {
    fn pick() -> Self {
        let free = trellis_integration::free_addr;
        Self {
            discovery: free(),
            broker: free(),
            forwarder: free(),
            ipam: free(),
            gateway: free(),
        }
    }
}

const HUB_ID: &str = "hub";
/// How many times one leaf's Peer request is sent again after UNAVAILABLE.
const PEER_RETRIES: usize = 5;
const POD_CIDR: &str = "10.0.0.0/16";
const EXTERNAL_CIDR: &str = "10.201.0.0/16";

/// Leaf `i`'s external CIDR: a /24 of its own in 100.64.0.0/10 (see the module doc).
/// Discovery's flags on every leaf, as the lab gives them: a leaf of an N-leaf hub is
/// introduced to N-1 others, above discovery's default cap (`--max-induced-per-hub`, 192) at
/// 254 leaves, where every Neighborhood would be refused.
fn leaf_discovery_flags() -> Vec<String> {
    vec!["--max-induced-per-hub".to_owned(), "4096".to_owned()]
}

fn leaf_external(i: usize) -> String {
    format!("100.{}.{}.0/24", 64 + i / 256, i % 256)
}
/// Hub services in start order (callees first), with their gRPC service for health checks.
const HUB_SERVICES: [(&str, &str); 5] = [
    ("ipam", "trellis.ipam.v1.Ipam"),
    ("gateway", "trellis.gateway.v1.Gateway"),
    ("discovery", "trellis.discovery.v1.Discovery"),
    ("forwarder", "trellis.peering.v1.Forwarder"),
    ("broker", "trellis.peering.v1.Broker"),
];

/// The flags of hub service `service` (those of `InProcessCluster`), without the program name.
fn hub_flags(service: &str, a: &HubAddrs) -> Vec<String> {
    let listen = listen_of(service, a);
    let mut args = flags(&[
        "--listen",
        &listen.to_string(),
        "--store",
        "memory://",
        "--cluster-id",
        HUB_ID,
        "--shutdown-grace",
        "1",
    ]);
    args.extend(match service {
        "ipam" => flags(&["--pod-cidr", POD_CIDR, "--external-cidr", EXTERNAL_CIDR]),
        "gateway" => flags(&["--dataplane", "none", "--endpoint-address", "127.0.0.1"]),
        "discovery" => flags(&[
            "--advertise-discovery",
            &a.discovery.to_string(),
            "--advertise-broker",
            &a.broker.to_string(),
            "--advertise-forwarder",
            &a.forwarder.to_string(),
            "--advertise-ipam",
            &a.ipam.to_string(),
            "--advertise-gateway",
            &a.gateway.to_string(),
            "--neighborhood-resync",
            "5",
            "--neighborhood-retry-max",
            "2",
        ]),
        "forwarder" => flags(&["--discovery", &a.discovery.to_string(), "--retry-max", "1"]),
        _ => flags(&[
            "--discovery",
            &a.discovery.to_string(),
            "--ipam",
            &a.ipam.to_string(),
            "--gateway",
            &a.gateway.to_string(),
            "--resync",
            "2",
        ]),
    });
    args
}

fn with_argv0(args: Vec<String>) -> Vec<String> {
    std::iter::once("x".to_owned()).chain(args).collect()
}

/// The hub in this process: the five services of [`InProcessCluster`], started with the same
/// flags, whose stores stay reachable.
struct InProcessHub {
    addrs: HubAddrs,
    stores: [(&'static str, SharedStore); 5],
    shutdown: Shutdown,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl InProcessHub {
    async fn start_once(a: HubAddrs) -> anyhow::Result<Self> {
        use clap::Parser as _;
        let shutdown = Shutdown::new();
        let stop_on_failure = shutdown.clone().drop_guard();
        let mut tasks = Vec::new();
        let f = |s: &str| with_argv0(hub_flags(s, &a));

        let started = trellis_ipam::start(
            trellis_ipam::Config::try_parse_from(f("ipam"))?,
            shutdown.clone(),
        )
        .await
        .context("ipam")?;
        let ipam_store = started.core.store().clone();
        tasks.push(started.task);
        let started = trellis_gateway::start(
            trellis_gateway::Config::try_parse_from(f("gateway"))?,
            shutdown.clone(),
        )
        .await
        .context("gateway")?;
        let gateway_store = started.core.store().clone();
        tasks.push(started.task);
        let started = trellis_discovery::start(
            trellis_discovery::Config::try_parse_from(f("discovery"))?,
            shutdown.clone(),
        )
        .await
        .context("discovery")?;
        let discovery_store = started.core.store().clone();
        tasks.push(started.task);
        let started = trellis_forwarder::start(
            trellis_forwarder::Config::try_parse_from(f("forwarder"))?,
            shutdown.clone(),
        )
        .await
        .context("forwarder")?;
        let forwarder_store = started.core.store().clone();
        tasks.push(started.task);
        let started = trellis_broker::start(
            trellis_broker::Config::try_parse_from(f("broker"))?,
            shutdown.clone(),
        )
        .await
        .context("broker")?;
        let broker_store = started.core.store().clone();
        tasks.push(started.task);

        stop_on_failure.disarm();
        Ok(Self {
            addrs: a,
            stores: [
                ("discovery", discovery_store),
                ("broker", broker_store),
                ("forwarder", forwarder_store),
                ("ipam", ipam_store),
                ("gateway", gateway_store),
            ],
            shutdown,
            tasks,
        })
    }

    /// Every key of every service's store, counted.
    async fn stores(&self) -> anyhow::Result<HubStores> {
        let mut out = HubStores::default();
        for (service, store) in &self.stores {
            let size = StoreUse::from(store.size("").await?);
            out.total.keys += size.keys;
            out.total.bytes += size.bytes;
            match *service {
                "discovery" => out.discovery = size,
                "broker" => out.broker = size,
                "forwarder" => out.forwarder = size,
                "ipam" => out.ipam = size,
                _ => out.gateway = size,
            }
        }
        Ok(out)
    }
}

/// The hub as five child processes of the release service binaries (memory stores).
struct ProcessHub {
    addrs: HubAddrs,
    processes: Vec<(&'static str, ServiceProcess)>,
}

impl ProcessHub {
    async fn start_once(a: HubAddrs) -> anyhow::Result<Self> {
        let mut processes = Vec::new();
        for (service, grpc) in HUB_SERVICES {
            // An absolute path: the binaries sit next to this one (target/<profile>/), not
            // next to a test binary, where `ServiceProcess` looks for bare names.
            let binary = trellis_netlab::bins::bin_path(&format!("trellis-{service}"))?;
            let listen = listen_of(service, &a);
            let process = ServiceProcess::start(
                &binary.to_string_lossy(),
                hub_flags(service, &a),
                listen,
                grpc,
            )
            .await
            .with_context(|| format!("starting the hub's {service} process"))?;
            processes.push((service, process));
        }
        Ok(Self {
            addrs: a,
            processes,
        })
    }
}

fn listen_of(service: &str, a: &HubAddrs) -> SocketAddr {
    match service {
        "ipam" => a.ipam,
        "gateway" => a.gateway,
        "discovery" => a.discovery,
        "forwarder" => a.forwarder,
        _ => a.broker,
    }
}

/// The hub of one run, by mode.
enum Hub {
    InProcess(InProcessHub),
    Processes(ProcessHub),
    Etcd(Box<ProcessCluster>),
}

impl Hub {
    /// Ports are picked before binding: on a collision the whole hub starts again.
    async fn start(mode: Mode) -> anyhow::Result<Option<Self>> {
        if mode.hub_on_etcd() {
            return Ok(ProcessCluster::start(HUB_ID, POD_CIDR, EXTERNAL_CIDR)
                .await?
                .map(|c| Hub::Etcd(Box::new(c))));
        }
        let mut attempt = 0;
        loop {
            let a = HubAddrs::pick();
            let started = match mode {
                Mode::InProcess => InProcessHub::start_once(a).await.map(Hub::InProcess),
                _ => ProcessHub::start_once(a).await.map(Hub::Processes),
            };
            match started {
                Err(err) if attempt < 5 && port_taken(&err) => attempt += 1,
                other => return other.map(Some),
            }
        }
    }

    fn addr(&self, service: &str) -> SocketAddr {
        match self {
            Hub::InProcess(h) => listen_of(service, &h.addrs),
            Hub::Processes(h) => listen_of(service, &h.addrs),
            Hub::Etcd(c) => listen_of(
                service,
                &HubAddrs {
                    discovery: c.services.discovery,
                    broker: c.services.broker,
                    forwarder: c.services.forwarder,
                    ipam: c.services.ipam,
                    gateway: c.services.gateway,
                },
            ),
        }
    }

    /// The hub's processes by service name (none in process).
    fn pids(&self) -> anyhow::Result<Vec<(&'static str, u32)>> {
        let services: Vec<&'static str> = match self {
            Hub::InProcess(_) => return Ok(Vec::new()),
            Hub::Processes(h) => h.processes.iter().map(|(s, _)| *s).collect(),
            Hub::Etcd(_) => Service::ALL.iter().map(|s| s.name()).collect(),
        };
        services
            .into_iter()
            .map(|s| {
                let addr = match self {
                    Hub::Etcd(c) => Service::ALL
                        .into_iter()
                        .find(|x| x.name() == s)
                        .map_or_else(|| self.addr(s), |x| c.addr(x)),
                    _ => self.addr(s),
                };
                Ok((s, pid_listening_on(addr)?))
            })
            .collect()
    }

    /// Each hub etcd's revision (hub on etcd only): the number of write transactions so far.
    async fn etcd_revisions(&self) -> anyhow::Result<Option<BTreeMap<&'static str, i64>>> {
        let Hub::Etcd(c) = self else {
            return Ok(None);
        };
        let mut revisions = BTreeMap::new();
        for service in Service::ALL {
            // A prefix nothing is stored under: the answer is only the revision.
            let listing = c.store(service).await?.list("mesh-bench-nothing/").await?;
            revisions.insert(service.name(), listing.revision);
        }
        Ok(Some(revisions))
    }

    async fn stop(self) {
        match self {
            Hub::InProcess(mut h) => {
                h.shutdown.cancel();
                for task in h.tasks.drain(..) {
                    let _ = task.await;
                }
            }
            // Dropping kills the processes (and etcds).
            Hub::Processes(h) => drop(h),
            Hub::Etcd(c) => drop(c),
        }
    }
}

fn port_taken(err: &anyhow::Error) -> bool {
    let text = format!("{err:#}");
    text.contains("cannot listen") || text.contains("Address already in use")
}

/// The leaves of one run, by mode; only their brokers are used after start.
enum Leaves {
    InProcess(Vec<InProcessCluster>),
    Etcd(Vec<ProcessCluster>),
}

impl Leaves {
    async fn start(mode: Mode, n: usize) -> anyhow::Result<Option<Self>> {
        let name = |i: usize| format!("leaf-{i:03}");
        Ok(Some(match mode {
            Mode::EtcdProcesses => {
                let mut out = Vec::new();
                for i in 0..n {
                    let options = trellis_integration::processes::Options {
                        discovery_flags: leaf_discovery_flags(),
                        ..Default::default()
                    };
                    let Some(c) =
                        ProcessCluster::start_with(&name(i), POD_CIDR, &leaf_external(i), options)
                            .await?
                    else {
                        return Ok(None);
                    };
                    out.push(c);
                }
                Leaves::Etcd(out)
            }
            _ => {
                let mut out = Vec::with_capacity(n);
                for i in 0..n {
                    let options = trellis_integration::cluster::Options {
                        discovery_flags: leaf_discovery_flags(),
                        ..Default::default()
                    };
                    out.push(
                        InProcessCluster::start_with(
                            &name(i),
                            POD_CIDR,
                            &leaf_external(i),
                            options,
                        )
                        .await?,
                    );
                }
                Leaves::InProcess(out)
            }
        }))
    }

    fn brokers(&self) -> Vec<SocketAddr> {
        match self {
            Leaves::InProcess(l) => l.iter().map(|c| c.services.broker).collect(),
            Leaves::Etcd(l) => l.iter().map(|c| c.services.broker).collect(),
        }
    }

    async fn stop(self) {
        match self {
            Leaves::InProcess(l) => {
                for leaf in l {
                    leaf.stop().await;
                }
            }
            Leaves::Etcd(l) => drop(l),
        }
    }
}

async fn channel(addr: SocketAddr) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?)
}

/// How many TunnelEndpoints of each kind every followed broker holds, kept current by their
/// WatchTunnelEndpoints streams ([`follow`]): each tunnel is seen when it is written, without
/// polling. (Polling a hundred brokers' listings one after the other took CPU from the mesh
/// being measured and saw the last full tunnel seconds after it was written.)
struct Tallies {
    /// Per broker: (full, induced) TunnelEndpoints, and whether its watch has sent its snapshot.
    counts: std::sync::Mutex<Vec<(usize, usize, bool)>>,
    changed: tokio::sync::Notify,
}

impl Tallies {
    fn new(brokers: usize) -> Self {
        Self {
            counts: std::sync::Mutex::new(vec![(0, 0, false); brokers]),
            changed: tokio::sync::Notify::new(),
        }
    }

    fn set(&self, i: usize, full: usize, induced: usize, watching: bool) {
        if let Ok(mut counts) = self.counts.lock() {
            counts[i] = (full, induced, watching);
        }
        self.changed.notify_one();
    }

    /// Returns once every broker's watch has delivered its snapshot.
    async fn wait_all_watching(&self) {
        loop {
            let all = self
                .counts
                .lock()
                .map(|c| c.iter().all(|(_, _, watching)| *watching))
                .unwrap_or(false);
            if all {
                return;
            }
            tokio::select! {
                () = self.changed.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    }

    /// Whether every full tunnel is up (each leaf's to the hub, the hub's to each of the
    /// `leaves`), and the induced TunnelEndpoints held over all leaves.
    fn progress(&self, leaves: usize) -> (bool, usize) {
        let Ok(counts) = self.counts.lock() else {
            return (false, 0);
        };
        let (hub, leaf_counts) = counts.split_last().expect("the hub is followed");
        let full_up = hub.0 >= leaves && leaf_counts.iter().all(|(full, _, _)| *full > 0);
        let induced = leaf_counts
            .iter()
            .map(|(_, induced, _)| (*induced).min(leaves - 1))
            .sum();
        (full_up, induced)
    }
}

/// Follows broker `i`'s TunnelEndpoints until `stop`, re-watching from a fresh snapshot after
/// an interrupted stream.
async fn follow(i: usize, addr: SocketAddr, tallies: Arc<Tallies>, stop: Shutdown) {
    loop {
        let watched = async {
            let mut stream = BrokerClient::new(channel(addr).await?)
                .watch_tunnel_endpoints(WatchTunnelEndpointsRequest { start_revision: 0 })
                .await?
                .into_inner();
            let mut held: BTreeMap<String, i32> = BTreeMap::new();
            let mut watching = false;
            while let Some(event) = stream.message().await? {
                let remote = event
                    .tunnel_endpoint
                    .as_ref()
                    .and_then(|t| t.remote.as_ref())
                    .map(|r| r.cluster_id.clone());
                match (WatchEventType::try_from(event.r#type), remote) {
                    (Ok(WatchEventType::Bookmark), _) => watching = true,
                    (Ok(WatchEventType::Deleted), Some(remote)) => {
                        held.remove(&remote);
                    }
                    (Ok(WatchEventType::Added | WatchEventType::Modified), Some(remote)) => {
                        let kind = event.tunnel_endpoint.as_ref().map_or(0, |t| t.kind);
                        held.insert(remote, kind);
                    }
                    _ => {}
                }
                let full = held
                    .values()
                    .filter(|k| **k == PeeringKind::Full as i32)
                    .count();
                let induced = held
                    .values()
                    .filter(|k| **k == PeeringKind::Induced as i32)
                    .count();
                tallies.set(i, full, induced, watching);
            }
            anyhow::Ok(())
        };
        tokio::select! {
            () = stop.cancelled() => return,
            _ = watched => {}
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

fn read_usage(pids: &[(&'static str, u32)]) -> anyhow::Result<Vec<(&'static str, ProcUsage)>> {
    pids.iter()
        .map(|(s, pid)| Ok((*s, usage(*pid).with_context(|| format!("hub {s}"))?)))
        .collect()
}

/// The outcome of one run.
#[derive(Debug, Serialize, Deserialize)]
struct Outcome {
    run: Run,
    held: Option<Held>,
}

/// One run: the setup time and, when it converged, the hub's holdings.
async fn run(mode: Mode, leaves: usize, timeout: Duration) -> anyhow::Result<Option<Outcome>> {
    // A failed reset only makes the peak include this process's start.
    if let Err(err) = reset_peak_rss() {
        eprintln!("mesh-bench: the peak RSS is not reset between runs: {err:#}");
    }
    let before = usage(std::process::id())?;
    let Some(hub) = Hub::start(mode).await? else {
        return Ok(None);
    };
    let Some(clusters) = Leaves::start(mode, leaves).await? else {
        return Ok(None);
    };
    let result = measure(&hub, &clusters, leaves, timeout).await;
    let after = usage(std::process::id())?;
    hub.stop().await;
    clusters.stop().await;
    let mut outcome = result?;
    outcome.run.process_peak_rss_kib = Some(after.peak_rss_kib);
    outcome.run.process_cpu_seconds = Some(after.cpu_seconds - before.cpu_seconds);
    Ok(Some(outcome))
}

/// One run in a process of its own: this binary with `--one-run`. In one process, a run's
/// peak RSS included what the allocator kept of the runs before it (the 254-leaf runs read
/// 2.6 GB where one run alone peaks at 1.4 GB), and a run's CPU what their tasks still did.
async fn run_alone(mode: Mode, leaves: usize, timeout: u64) -> anyhow::Result<Option<Outcome>> {
    let exe = std::env::current_exe().context("finding this binary")?;
    let out = std::env::temp_dir().join(format!(
        "mesh-bench-{}-{leaves}-{}.json",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let mode_flag = mode
        .to_possible_value()
        .context("every mode has a flag value")?;
    let status = tokio::process::Command::new(&exe)
        .arg("--mode")
        .arg(mode_flag.get_name())
        .arg("--timeout")
        .arg(timeout.to_string())
        .arg("--one-run")
        .arg(leaves.to_string())
        .arg("--out")
        .arg(&out)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .status()
        .await
        .with_context(|| format!("starting {}", exe.display()))?;
    let written = std::fs::read(&out);
    let _ = std::fs::remove_file(&out);
    anyhow::ensure!(status.success(), "the run's process ended with {status}");
    let written = written.with_context(|| format!("reading {}", out.display()))?;
    serde_json::from_slice(&written).context("reading the run's outcome")
}

async fn measure(
    hub: &Hub,
    clusters: &Leaves,
    leaves: usize,
    timeout: Duration,
) -> anyhow::Result<Outcome> {
    let token = BrokerClient::new(channel(hub.addr("broker")).await?)
        .get_token(GetTokenRequest {})
        .await?
        .into_inner()
        .token;
    let brokers = clusters.brokers();
    let expected = leaves * (leaves - 1);
    let pids = hub.pids()?;
    let before = read_usage(&pids)?;
    let revisions_before = hub.etcd_revisions().await?;

    // Every broker's tunnels are followed from before the first Peer request (index
    // `brokers.len()` is the hub).
    let tallies = Arc::new(Tallies::new(brokers.len() + 1));
    let stop = Shutdown::new();
    let followers: Vec<_> = brokers
        .iter()
        .chain(std::iter::once(&hub.addr("broker")))
        .enumerate()
        .map(|(i, addr)| tokio::spawn(follow(i, *addr, tallies.clone(), stop.clone())))
        .collect();
    let result = async {
        tallies.wait_all_watching().await;
        let started = Instant::now();
        let mut peerings = Vec::new();
        for broker in &brokers {
            let mut broker = BrokerClient::new(channel(*broker).await?);
            let request = PeerRequest {
                broker_address: hub.addr("broker").to_string(),
                token: token.clone(),
                expected_cluster_id: HUB_ID.into(),
                ca_cert_hash: String::new(),
            };
            // With hundreds of clusters on two cores a leaf's own services can be too slow to
            // answer its broker in time (UNAVAILABLE); an operator would run the command again,
            // and so does the benchmark, counting it.
            peerings.push(tokio::spawn(async move {
                let mut retries = 0;
                loop {
                    match broker.peer(request.clone()).await {
                        Err(status)
                            if status.code() == tonic::Code::Unavailable
                                && retries < PEER_RETRIES =>
                        {
                            retries += 1;
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                        other => return other.map(|_| retries),
                    }
                }
            }));
        }
        let mut peer_retries = 0;
        for peering in peerings {
            peer_retries += peering.await?.context("a leaf peers with the hub")?;
        }
        let mut full_tunnels_at = None;
        let mut induced_90_at = None;
        let mut induced_at = None;
        let (converged, reached) = loop {
            let (full_up, induced) = tallies.progress(leaves);
            if induced_90_at.is_none() && induced * 10 >= expected * 9 {
                induced_90_at = Some(started.elapsed());
            }
            if induced_at.is_none() && induced == expected {
                induced_at = Some(started.elapsed());
            }
            if full_tunnels_at.is_none() && full_up {
                full_tunnels_at = Some(started.elapsed());
            }
            if induced_at.is_some() && full_tunnels_at.is_some() {
                break (true, induced);
            }
            if started.elapsed() >= timeout {
                break (false, induced);
            }
            tokio::select! {
                () = tallies.changed.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        };
        anyhow::Ok((
            started,
            peer_retries,
            full_tunnels_at,
            induced_90_at,
            induced_at,
            converged,
            reached,
        ))
    }
    .await;
    stop.cancel();
    for follower in followers {
        let _ = follower.await;
    }
    let (started, peer_retries, full_tunnels_at, induced_90_at, induced_at, converged, reached) =
        result?;
    let elapsed = started.elapsed();
    let after = read_usage(&pids)?;
    let hub_etcd_writes = match (revisions_before, hub.etcd_revisions().await?) {
        (Some(before), Some(after)) => Some(
            after
                .iter()
                .map(|(service, rev)| {
                    let before = before.get(service).copied().unwrap_or(0);
                    ((*service).to_owned(), rev - before)
                })
                .collect::<BTreeMap<_, _>>(),
        ),
        _ => None,
    };
    let cpu_during: Vec<f64> = after
        .iter()
        .zip(&before)
        .map(|((_, a), (_, b))| a.cpu_seconds - b.cpu_seconds)
        .collect();
    let hub_cpu_seconds: Option<f64> = (!pids.is_empty()).then(|| cpu_during.iter().sum());
    // The setup ends with the last induced tunnel (full tunnels are normally up long before).
    let seconds = if converged {
        induced_at.unwrap_or(elapsed).as_secs_f64()
    } else {
        timeout.as_secs_f64()
    };
    let induced_90_seconds = induced_90_at.map(|d| d.as_secs_f64());
    let run = Run {
        seconds,
        converged,
        induced_reached: reached,
        hub_cpu_seconds,
        hub_cpu_ms_per_induced_tunnel: hub_cpu_seconds
            .filter(|_| converged)
            .map(|cpu| cpu * 1000.0 / expected as f64),
        full_tunnels_seconds: full_tunnels_at.map(|d| d.as_secs_f64()),
        induced_90_seconds,
        tail_share: induced_90_seconds
            .filter(|_| converged && seconds > 0.0)
            .map(|t90| (seconds - t90) / seconds),
        open_files: std::fs::read_dir("/proc/self/fd").ok().map(Iterator::count),
        peer_retries,
        hub_etcd_writes_per_induced_tunnel: hub_etcd_writes
            .as_ref()
            .filter(|_| converged)
            .map(|w| w.values().sum::<i64>() as f64 / expected as f64),
        hub_etcd_writes,
        process_peak_rss_kib: None,
        process_cpu_seconds: None,
    };
    if !converged {
        return Ok(Outcome { run, held: None });
    }
    debug_assert_eq!(reached, expected);

    let broker = || async { anyhow::Ok(BrokerClient::new(channel(hub.addr("broker")).await?)) };
    let tunnels = broker()
        .await?
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await?
        .into_inner()
        .tunnel_endpoints
        .len();
    let ncs = broker()
        .await?
        .list_network_configs(ListNetworkConfigsRequest::default())
        .await?
        .into_inner()
        .network_configs
        .len();
    let relays = ForwarderClient::new(channel(hub.addr("forwarder")).await?)
        .list_relays(ListRelaysRequest::default())
        .await?
        .into_inner()
        .relays
        .len();
    let ipam =
        trellis_api::pb::ipam::ipam_client::IpamClient::new(channel(hub.addr("ipam")).await?)
            .list_cluster_subnets(ListClusterSubnetsRequest {})
            .await?
            .into_inner()
            .clusters
            .len();
    let stores = match hub {
        Hub::InProcess(h) => Some(h.stores().await?),
        _ => None,
    };
    let processes = (!pids.is_empty()).then(|| {
        after
            .iter()
            .zip(&cpu_during)
            .map(|((service, u), during)| HubProcess {
                service: (*service).to_owned(),
                cpu_seconds: u.cpu_seconds,
                cpu_seconds_during_setup: *during,
                peak_rss_kib: u.peak_rss_kib,
                rss_kib: u.rss_kib,
            })
            .collect()
    });
    let etcd_keys = match hub {
        Hub::Etcd(c) => {
            let mut keys = BTreeMap::new();
            for service in Service::ALL {
                keys.insert(service.name().to_owned(), c.etcd_keys(service)?.len());
            }
            Some(keys)
        }
        _ => None,
    };
    Ok(Outcome {
        run,
        held: Some(Held {
            tunnels,
            ncs,
            relays,
            ipam,
            stores,
            processes,
            etcd_keys,
        }),
    })
}

/// `ProcessCluster` finds the service binaries next to a *test* binary
/// (`target/<profile>/deps/…`, one level below them). Cargo keeps this binary there too, as a
/// hard link of the same file: re-executing that link makes the lookup work without copying
/// the cluster launcher.
fn reexec_from_deps() -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    use std::os::unix::process::CommandExt as _;
    if trellis_integration::bin_path("trellis-ipam").is_ok() {
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let inode = std::fs::metadata(&exe)?.ino();
    let deps = exe
        .parent()
        .context("the executable has no directory")?
        .join("deps");
    let twin = std::fs::read_dir(&deps)
        .with_context(|| format!("listing {}", deps.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.ino() == inode && m.is_file()))
        .with_context(|| {
            format!(
                "--mode hub-etcd and etcd-processes need the service binaries next to {} (build them with \
                 `cargo build --release --bins`) and this binary's hard link in it",
                deps.display()
            )
        })?;
    let err = std::process::Command::new(twin)
        .args(std::env::args_os().skip(1))
        .exec();
    Err(err).context("re-executing from target/<profile>/deps")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Every service of the in-process clusters logs through this one subscriber: quiet unless
    // RUST_LOG asks (what a slow run waits on shows at debug).
    let _telemetry = trellis_runtime::telemetry::init_with_default(
        &trellis_runtime::telemetry::ServiceIdentity {
            service: "mesh-bench",
            cluster_id: String::new(),
            cluster_name: String::new(),
        },
        trellis_runtime::config::LogFormat::Text,
        "off",
    )?;
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    if let Some(bad) = args.leaves.iter().find(|n| **n < 2) {
        anyhow::bail!("--leaves: a mesh needs at least 2 leaves, got {bad}");
    }
    if args.mode.hub_on_etcd() {
        reexec_from_deps()?;
    }
    let open_files_limit = match raise_nofile_limit() {
        Ok(limit) => Some(limit),
        Err(err) => {
            eprintln!("mesh-bench: could not raise the open-file limit: {err:#}");
            None
        }
    };
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(args.mode.default_out()));
    let timeout = Duration::from_secs(args.timeout);
    if let Some(leaves) = args.one_run {
        let outcome = run(args.mode, leaves, timeout).await?;
        std::fs::write(&out, serde_json::to_vec(&outcome)?)
            .with_context(|| format!("writing {}", out.display()))?;
        return Ok(());
    }
    let run_info = RunInfo::start(&args.run);
    // Written again after every size, so a run stopped midway keeps the sizes it measured.
    let mut report = Report {
        benchmark: "induced_mesh_setup",
        mode: args.mode,
        run: run_info,
        machine: Machine::describe(),
        parameters: Parameters {
            leaves: args.leaves.clone(),
            repeats: args.repeats,
            timeout_seconds: args.timeout,
            keep_going: args.keep_going,
            open_files_limit,
        },
        sizes: Vec::new(),
    };
    let mut gave_up: Option<String> = None;
    for &leaves in &args.leaves {
        let expected = leaves * (leaves - 1);
        let mut size = Size {
            leaves,
            induced_tunnel_endpoints: expected,
            status: Status::Converged,
            reason: None,
            runs: Vec::new(),
            median_seconds: None,
            hub_tunnel_endpoints: None,
            hub_network_configs: None,
            hub_relays_in_flight: None,
            hub_ipam_records: None,
            hub_stores: None,
            hub_processes: None,
            hub_cpu_seconds_during_setup: None,
            hub_peak_rss_kib_total: None,
            hub_etcd_keys: None,
            median_full_tunnels_seconds: None,
            median_tail_share: None,
            median_process_peak_rss_kib: None,
            median_process_cpu_seconds: None,
            median_hub_cpu_ms_per_induced_tunnel: None,
            median_hub_etcd_writes_per_induced_tunnel: None,
        };
        if let Some(reason) = &gave_up {
            size.status = Status::Skipped;
            size.reason = Some(reason.clone());
            eprintln!("mesh-bench: 1 hub + {leaves} leaves skipped: {reason}");
            report.sizes.push(size);
            write_json(&out, &report)?;
            continue;
        }
        let mut peaks = Vec::new();
        for repeat in 0..args.repeats {
            match run_alone(args.mode, leaves, args.timeout).await {
                Ok(None) => {
                    size.status = Status::Skipped;
                    size.reason = Some("etcd is not installed (`make setup`)".into());
                    break;
                }
                Ok(Some(outcome)) => {
                    eprintln!(
                        "mesh-bench: {:?}, 1 hub + {leaves} leaves, run {}: {} after {:.3} s ({} of {expected} induced TunnelEndpoints)",
                        args.mode,
                        repeat + 1,
                        if outcome.run.converged {
                            "converged"
                        } else {
                            "NOT converged"
                        },
                        outcome.run.seconds,
                        outcome.run.induced_reached
                    );
                    let converged = outcome.run.converged;
                    size.runs.push(outcome.run);
                    if let Some(held) = outcome.held {
                        if let Some(p) = &held.processes {
                            peaks.push(p.iter().map(|p| p.peak_rss_kib).sum::<u64>() as f64);
                        }
                        size.hub_tunnel_endpoints = Some(held.tunnels);
                        size.hub_network_configs = Some(held.ncs);
                        size.hub_relays_in_flight = Some(held.relays);
                        size.hub_ipam_records = Some(held.ipam);
                        size.hub_stores = held.stores;
                        size.hub_processes = held.processes;
                        size.hub_etcd_keys = held.etcd_keys;
                    }
                    if !converged {
                        size.status = Status::TimedOut;
                        size.reason = Some(format!(
                            "not converged within {} s; later repeats not run",
                            args.timeout
                        ));
                        break;
                    }
                }
                Err(err) => {
                    eprintln!("mesh-bench: 1 hub + {leaves} leaves failed: {err:#}");
                    size.status = Status::Failed;
                    size.reason = Some(format!("{err:#}"));
                    break;
                }
            }
        }
        let converged: Vec<&Run> = size.runs.iter().filter(|r| r.converged).collect();
        size.median_seconds = median(&converged.iter().map(|r| r.seconds).collect::<Vec<_>>());
        size.hub_cpu_seconds_during_setup = median(
            &converged
                .iter()
                .filter_map(|r| r.hub_cpu_seconds)
                .collect::<Vec<_>>(),
        );
        size.hub_peak_rss_kib_total = median(&peaks).map(|p| p as u64);
        let of = |field: fn(&Run) -> Option<f64>| {
            median(
                &converged
                    .iter()
                    .filter_map(|r| field(r))
                    .collect::<Vec<_>>(),
            )
        };
        size.median_full_tunnels_seconds = of(|r| r.full_tunnels_seconds);
        size.median_tail_share = of(|r| r.tail_share);
        size.median_process_peak_rss_kib =
            of(|r| r.process_peak_rss_kib.map(|k| k as f64)).map(|k| k as u64);
        size.median_process_cpu_seconds = of(|r| r.process_cpu_seconds);
        size.median_hub_cpu_ms_per_induced_tunnel = of(|r| r.hub_cpu_ms_per_induced_tunnel);
        size.median_hub_etcd_writes_per_induced_tunnel =
            of(|r| r.hub_etcd_writes_per_induced_tunnel);
        if matches!(size.status, Status::TimedOut | Status::Failed) && !args.keep_going {
            gave_up = Some(format!(
                "1 hub + {leaves} leaves did not converge ({})",
                size.reason.as_deref().unwrap_or("")
            ));
        }
        report.sizes.push(size);
        write_json(&out, &report)?;
    }
    eprintln!(
        "| leaves | status | induced TEs | median s | full tunnels s | 90→100 % share | hub CPU s | hub CPU ms / induced TE | hub peak RSS MiB | hub etcd writes / induced TE |"
    );
    eprintln!("|---|---|---|---|---|---|---|---|---|---|");
    for s in &report.sizes {
        let opt = |v: Option<f64>, d: usize| v.map_or("-".into(), |v| format!("{v:.d$}"));
        eprintln!(
            "| {} | {:?} | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.leaves,
            s.status,
            s.induced_tunnel_endpoints,
            opt(s.median_seconds, 3),
            opt(s.median_full_tunnels_seconds, 3),
            opt(s.median_tail_share, 3),
            opt(s.hub_cpu_seconds_during_setup, 2),
            opt(s.median_hub_cpu_ms_per_induced_tunnel, 3),
            opt(s.hub_peak_rss_kib_total.map(|k| k as f64 / 1024.0), 1),
            opt(s.median_hub_etcd_writes_per_induced_tunnel, 2)
        );
    }
    eprintln!("mesh-bench: wrote {}", out.display());
    Ok(())
}
