//! The hub of one run, by mode: its five services started here from the flags
//! `InProcessCluster` gives them (stores kept reachable, so they can be sized), as child
//! processes of the release binaries, or as a `ProcessCluster` on etcd.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use anyhow::Context as _;
use trellis_integration::ServiceProcess;
use trellis_integration::processes::{ProcessCluster, Service};
use trellis_runtime::Shutdown;
use trellis_store::{SharedStore, StoreSize};

use super::lab::LabClusters;
use super::{EXTERNAL_CIDR, HUB_ID, POD_CIDR};
use crate::proc::pid_listening_on;
use crate::results::{HubStores, Mode, StoreUse};

fn flags(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// The hub's service addresses (picked before binding: discovery advertises them first).
#[derive(Debug, Clone)]
struct HubAddrs {
    discovery: SocketAddr,
    broker: SocketAddr,
    forwarder: SocketAddr,
    ipam: SocketAddr,
    gateway: SocketAddr,
    /// With mutual TLS: the cluster-facing services' peer listeners.
    tls: Option<HubTls>,
}

/// The hub's mutual TLS: where other clusters call its cluster-facing services, and the
/// directory its services make the cluster's CA and their certificates in.
#[derive(Debug, Clone)]
struct HubTls {
    discovery: SocketAddr,
    broker: SocketAddr,
    forwarder: SocketAddr,
    ipam: SocketAddr,
    dir: std::path::PathBuf,
}

impl HubAddrs {
    fn pick(tls_dir: Option<&std::path::Path>) -> Self {
        let free = trellis_integration::free_addr;
        Self {
            discovery: free(),
            broker: free(),
            forwarder: free(),
            ipam: free(),
            gateway: free(),
            tls: tls_dir.map(|dir| HubTls {
                discovery: free(),
                broker: free(),
                forwarder: free(),
                ipam: free(),
                dir: dir.to_owned(),
            }),
        }
    }

    /// Where other clusters reach `service`: its peer listener with TLS.
    fn facing(&self, service: &str) -> SocketAddr {
        match (&self.tls, service) {
            (Some(t), "discovery") => t.discovery,
            (Some(t), "broker") => t.broker,
            (Some(t), "forwarder") => t.forwarder,
            (Some(t), "ipam") => t.ipam,
            _ => listen_of(service, self),
        }
    }
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
    match &a.tls {
        _ if service == "gateway" => {}
        None => args.push(trellis_testkit::PLAINTEXT_PEERING.to_owned()),
        Some(tls) => {
            args.extend(flags(&[
                "--peer-listen",
                &a.facing(service).to_string(),
                "--tls-dir",
                &tls.dir.display().to_string(),
            ]));
            if service == "ipam" {
                // Discovery keeps the pinned CAs the IPAM's peer listener trusts.
                args.extend(flags(&["--discovery", &a.discovery.to_string()]));
            }
        }
    }
    args.extend(match service {
        "ipam" => flags(&["--pod-cidr", POD_CIDR, "--external-cidr", EXTERNAL_CIDR]),
        "gateway" => flags(&["--dataplane", "none", "--endpoint-address", "127.0.0.1"]),
        "discovery" => flags(&[
            "--advertise-discovery",
            &a.facing("discovery").to_string(),
            "--advertise-broker",
            &a.facing("broker").to_string(),
            "--advertise-forwarder",
            &a.facing("forwarder").to_string(),
            "--advertise-ipam",
            &a.facing("ipam").to_string(),
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

/// The hub in this process: the five services of `InProcessCluster`, started with the same
/// flags, whose stores stay reachable.
pub(super) struct InProcessHub {
    addrs: HubAddrs,
    /// With mutual TLS: the services' certificate directory, removed with the hub.
    _tls_dir: Option<tempfile::TempDir>,
    stores: [(&'static str, SharedStore); 5],
    shutdown: Shutdown,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl InProcessHub {
    async fn start_once(a: HubAddrs, tls_dir: Option<tempfile::TempDir>) -> anyhow::Result<Self> {
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
            _tls_dir: tls_dir,
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
    pub(super) async fn stores(&self) -> anyhow::Result<HubStores> {
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
pub(super) struct ProcessHub {
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
pub(super) enum Hub {
    InProcess(InProcessHub),
    Processes(ProcessHub),
    Etcd(Box<ProcessCluster>),
    Lab(LabClusters),
}

impl Hub {
    /// Ports are picked before binding: on a collision the whole hub starts again.
    pub(super) async fn start(mode: Mode) -> anyhow::Result<Option<Self>> {
        if mode.hub_on_etcd() {
            return Ok(ProcessCluster::start(HUB_ID, POD_CIDR, EXTERNAL_CIDR)
                .await?
                .map(|c| Hub::Etcd(Box::new(c))));
        }
        if mode == Mode::Lab {
            // The lab's cluster 0: its plan does not depend on the number of leaves.
            let hub = LabClusters::plan(1)?.into_iter().take(1).collect();
            return Ok(Some(Hub::Lab(Box::pin(LabClusters::start(hub)).await?)));
        }
        let mut attempt = 0;
        loop {
            let started = match mode {
                Mode::InProcess => InProcessHub::start_once(HubAddrs::pick(None), None)
                    .await
                    .map(Hub::InProcess),
                Mode::InProcessTls => {
                    let dir = tempfile::tempdir()?;
                    let a = HubAddrs::pick(Some(dir.path()));
                    InProcessHub::start_once(a, Some(dir))
                        .await
                        .map(Hub::InProcess)
                }
                _ => ProcessHub::start_once(HubAddrs::pick(None))
                    .await
                    .map(Hub::Processes),
            };
            match started {
                Err(err) if attempt < 5 && port_taken(&err) => attempt += 1,
                other => return other.map(Some),
            }
        }
    }

    pub(super) fn addr(&self, service: &str) -> SocketAddr {
        match self {
            Hub::InProcess(h) => listen_of(service, &h.addrs),
            Hub::Processes(h) => listen_of(service, &h.addrs),
            Hub::Lab(h) => h.addr(service),
            Hub::Etcd(c) => listen_of(
                service,
                &HubAddrs {
                    discovery: c.services.discovery,
                    broker: c.services.broker,
                    forwarder: c.services.forwarder,
                    ipam: c.services.ipam,
                    gateway: c.services.gateway,
                    tls: None,
                },
            ),
        }
    }

    /// The broker address the leaves peer with: its peer listener with mutual TLS.
    pub(super) fn peering_broker(&self) -> SocketAddr {
        match self {
            Hub::InProcess(h) => h.addrs.facing("broker"),
            Hub::Lab(h) => h.facing_broker(),
            _ => self.addr("broker"),
        }
    }

    /// The hub's processes by service name (none in process).
    pub(super) fn pids(&self) -> anyhow::Result<Vec<(&'static str, u32)>> {
        let services: Vec<&'static str> = match self {
            Hub::InProcess(_) | Hub::Lab(_) => return Ok(Vec::new()),
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
    pub(super) async fn etcd_revisions(
        &self,
    ) -> anyhow::Result<Option<BTreeMap<&'static str, i64>>> {
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

    /// The hub's counters (hub on etcd only), summed over its processes, from each one's
    /// `/metrics`: store transactions retried after a lost compare-and-swap, changes its store
    /// watches delivered, and relay deliveries the forwarder scheduled again.
    pub(super) fn counters(&self) -> Option<HubCounters> {
        let Hub::Etcd(c) = self else {
            return None;
        };
        let mut total = HubCounters::default();
        for service in Service::ALL {
            let addr = c.metrics_addr(service)?;
            let text = trellis_integration::prom::scrape(&addr.to_string());
            total.store_retries += counter(&text, "trellis_store_transaction_retries_total");
            total.watch_events += counter(&text, "trellis_store_watch_events_total");
            total.relay_retries += counter(&text, "trellis_forwarder_relay_retries_total");
        }
        Some(total)
    }

    pub(super) async fn stop(self) {
        match self {
            Hub::InProcess(mut h) => {
                h.shutdown.cancel();
                for task in h.tasks.drain(..) {
                    let _ = task.await;
                }
            }
            Hub::Lab(h) => h.stop().await,
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

impl From<StoreSize> for StoreUse {
    fn from(size: StoreSize) -> Self {
        Self {
            keys: size.keys,
            bytes: size.bytes,
        }
    }
}

/// Counters of the hub's processes, summed (see [`Hub::counters`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct HubCounters {
    pub(super) store_retries: f64,
    pub(super) watch_events: f64,
    pub(super) relay_retries: f64,
}

impl std::ops::Sub for HubCounters {
    type Output = Self;

    fn sub(self, before: Self) -> Self {
        Self {
            store_retries: self.store_retries - before.store_retries,
            watch_events: self.watch_events - before.watch_events,
            relay_retries: self.relay_retries - before.relay_retries,
        }
    }
}

/// The sum of every sample of counter `name` (each label set) in an exposition.
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let series_name = series.split('{').next()?;
            (series_name == name).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::counter;

    #[test]
    fn a_counter_sums_its_label_sets_and_nothing_else() {
        let text =
            "# TYPE a counter\na_total{x=\"1\"} 2\na_total{x=\"2\"} 3.5\na_total_b 7\nb_total 1\n";
        assert_eq!(counter(text, "a_total"), 5.5);
        assert_eq!(counter(text, "missing_total"), 0.0);
    }
}
