//! One lab cluster: the six services started in this process from their libraries, each with
//! its own gRPC server on its own loopback port and its own store (an embedded memory store,
//! or a dedicated etcd process). Services talk to each other only through gRPC, exactly as
//! separate processes would; running them in one process is what lets a laptop hold 255
//! clusters (ADR 0013). With mutual TLS (the default) each cluster's services share a
//! certificate directory where they make the cluster's CA and their own certificates, and
//! every cluster-facing service gets a mutual-TLS peer listener (ADR 0014, 0026). With
//! `OTEL_EXPORTER_OTLP_ENDPOINT` set each service also gets a tracer of its own, with its
//! binary's name and its cluster as the resource, so a lab's traces read like the processes'.

use std::future::Future;
use std::net::SocketAddr;

use anyhow::Context as _;
use clap::Parser as _;
use tokio::task::JoinHandle;
use tracing::instrument::WithSubscriber as _;
use trellis_runtime::Shutdown;
use trellis_runtime::telemetry::{self, ServiceIdentity, Telemetry};
use trellis_testkit::{Etcd, PLAINTEXT_PEERING};

use crate::config::StoreKind;
use crate::plan::ClusterPlan;

/// How a cluster starts.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub store: StoreKind,
    /// Discovery's induced peering (off: `--no-induced`).
    pub induced: bool,
}

/// With mutual TLS (the default): the directory the cluster's services share (`--tls-dir`),
/// where the first to start makes the cluster's CA and each issues and renews its own
/// certificate, as in a real deployment; removed with the cluster.
#[derive(Debug)]
struct Certificates {
    dir: tempfile::TempDir,
}

impl Certificates {
    fn new(cluster_id: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("trellis-lab-{cluster_id}-"))
            .tempdir()?;
        Ok(Self { dir })
    }

    /// The flags of a service serving other clusters on `listen`.
    fn flags(&self, listen: SocketAddr) -> Vec<String> {
        vec![
            "--peer-listen".into(),
            listen.to_string(),
            "--tls-dir".into(),
            self.dir.path().display().to_string(),
        ]
    }
}

/// A running lab cluster. Its services stop when the lab's shutdown token is cancelled; the
/// etcd processes (if any) are killed when this value is dropped.
#[derive(Debug)]
pub struct LabCluster {
    pub plan: ClusterPlan,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
    etcds: Vec<Etcd>,
    /// The services' own tracers (with an OTLP endpoint), flushed by [`LabCluster::finish`].
    tracers: Vec<Telemetry>,
    /// Kept until the cluster is dropped: the services re-read their certificate files.
    _certificates: Option<Certificates>,
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// Runs `start` (a service's start-up) under the service's own subscriber when there is an OTLP
/// endpoint, so the service's tasks and requests export through its own tracer.
async fn traced<F: Future>(
    service: &'static str,
    cluster: &str,
    tracers: &mut Vec<Telemetry>,
    start: F,
) -> anyhow::Result<F::Output> {
    let identity = ServiceIdentity {
        service,
        cluster_id: cluster.to_owned(),
        cluster_name: cluster.to_owned(),
    };
    match telemetry::service_dispatch(&identity, crate::LOG_FILTER)? {
        Some((dispatch, tracer)) => {
            tracers.push(tracer);
            Ok(start.with_subscriber(dispatch).await)
        }
        None => Ok(start.await),
    }
}

impl LabCluster {
    /// Starts every service of `plan`. On failure the services already started are stopped
    /// again (through a child of `shutdown`), and have let go of their ports when this returns:
    /// a start retried on the same fixed ports would otherwise find them still bound.
    pub async fn start(
        plan: ClusterPlan,
        options: Options,
        shutdown: &Shutdown,
    ) -> anyhow::Result<Self> {
        let own = shutdown.child_token();
        let mut started = Vec::new();
        match Self::start_services(plan, options, &own, &mut started).await {
            Ok(cluster) => Ok(cluster),
            Err(err) => {
                own.cancel();
                for task in started {
                    let _ = task.await;
                }
                Err(err)
            }
        }
    }

    /// [`Self::start`]'s services, each task in `tasks` as soon as it runs.
    async fn start_services(
        plan: ClusterPlan,
        options: Options,
        own: &Shutdown,
        tasks: &mut Vec<JoinHandle<anyhow::Result<()>>>,
    ) -> anyhow::Result<Self> {
        let mut etcds = Vec::new();
        let mut store = |service: &str| -> anyhow::Result<String> {
            match options.store {
                StoreKind::Memory => Ok("memory://".to_owned()),
                StoreKind::Etcd => {
                    let etcd = Etcd::start()
                        .with_context(|| format!("starting the etcd of {}'s {service}", plan.id))?;
                    let url = etcd.url(service);
                    etcds.push(etcd);
                    Ok(url)
                }
            }
        };
        let p = plan.ports;
        let metrics = plan.metrics;
        let common = |service: &str, listen: std::net::SocketAddr, store: String| {
            let short = service.trim_start_matches("trellis-");
            let metrics_listen = metrics
                .named()
                .into_iter()
                .find(|(name, _)| *name == short)
                .map_or_else(|| "off".to_owned(), |(_, addr)| addr.to_string());
            let mut a = args(&[
                service,
                "--listen",
                &listen.to_string(),
                "--metrics-listen",
                &metrics_listen,
                "--cluster-id",
                &plan.id,
                "--shutdown-grace",
                "1",
            ]);
            a.extend(["--store".to_owned(), store]);
            a
        };
        let mut tracers = Vec::new();
        let certificates = plan
            .peer
            .map(|_| Certificates::new(&plan.id))
            .transpose()
            .context("making the directory of the cluster's certificates")?;
        // Each cluster-facing service's TLS flags, or plaintext when asked for.
        let tls = |service: &str| -> anyhow::Result<Vec<String>> {
            let (Some(certs), Some(peer)) = (&certificates, &plan.peer) else {
                return Ok(vec![PLAINTEXT_PEERING.to_owned()]);
            };
            let listen = peer
                .named()
                .into_iter()
                .find(|(name, _)| *name == service)
                .map(|(_, addr)| addr)
                .with_context(|| format!("no peer port for {service}"))?;
            Ok(certs.flags(listen))
        };

        let mut ipam = common("trellis-ipam", p.ipam, store("ipam")?);
        ipam.extend(args(&[
            "--pod-cidr",
            &plan.pod_cidr.to_string(),
            "--external-cidr",
            &plan.external_cidr.to_string(),
        ]));
        if plan.peer.is_some() {
            // Discovery keeps the pinned CAs the IPAM's listener trusts.
            ipam.extend(args(&["--discovery", &p.discovery.to_string()]));
        }
        ipam.extend(tls("ipam")?);
        let ipam = traced(
            "trellis-ipam",
            &plan.id,
            &mut tracers,
            Box::pin(trellis_ipam::start(
                trellis_ipam::Config::try_parse_from(ipam)?,
                own.clone(),
            )),
        )
        .await?
        .context("ipam")?;
        tasks.push(ipam.task);

        let mut gateway = common("trellis-gateway", p.gateway, store("gateway")?);
        // The gateway follows the broker's TunnelEndpoints as in a real cluster: without a data
        // plane it only records them, so `status` and `diagnose` see tunnels applied.
        gateway.extend(args(&[
            "--dataplane",
            "none",
            "--endpoint-address",
            "127.0.0.1",
            "--broker",
            &p.broker.to_string(),
        ]));
        let gateway = traced(
            "trellis-gateway",
            &plan.id,
            &mut tracers,
            Box::pin(trellis_gateway::start(
                trellis_gateway::Config::try_parse_from(gateway)?,
                own.clone(),
            )),
        )
        .await?
        .context("gateway")?;
        tasks.push(gateway.task);

        let mut discovery = common("trellis-discovery", p.discovery, store("discovery")?);
        for (name, addr) in plan.advertised() {
            discovery.extend([format!("--advertise-{name}"), addr.to_string()]);
        }
        discovery.extend(tls("discovery")?);
        discovery.extend(args(&[
            "--neighborhood-resync",
            "10",
            "--neighborhood-retry-max",
            "2",
            // The lab's hub introduces up to 254 leaves, above the production default (192,
            // which keeps one hub from filling a leaf's 256 gateway slots).
            "--max-induced-per-hub",
            "4096",
        ]));
        if !options.induced {
            discovery.push("--no-induced".to_owned());
        }
        let discovery = traced(
            "trellis-discovery",
            &plan.id,
            &mut tracers,
            Box::pin(trellis_discovery::start(
                trellis_discovery::Config::try_parse_from(discovery)?,
                own.clone(),
            )),
        )
        .await?
        .context("discovery")?;
        tasks.push(discovery.task);

        let mut forwarder = common("trellis-forwarder", p.forwarder, store("forwarder")?);
        forwarder.extend(args(&[
            "--discovery",
            &p.discovery.to_string(),
            "--retry-max",
            "1",
        ]));
        forwarder.extend(tls("forwarder")?);
        let forwarder = traced(
            "trellis-forwarder",
            &plan.id,
            &mut tracers,
            Box::pin(trellis_forwarder::start(
                trellis_forwarder::Config::try_parse_from(forwarder)?,
                own.clone(),
            )),
        )
        .await?
        .context("forwarder")?;
        tasks.push(forwarder.task);

        let mut broker = common("trellis-broker", p.broker, store("broker")?);
        broker.extend(args(&[
            "--discovery",
            &p.discovery.to_string(),
            "--ipam",
            &p.ipam.to_string(),
            "--gateway",
            &p.gateway.to_string(),
            "--resync",
            "2",
        ]));
        broker.extend(tls("broker")?);
        let broker = traced(
            "trellis-broker",
            &plan.id,
            &mut tracers,
            Box::pin(trellis_broker::start(
                trellis_broker::Config::try_parse_from(broker)?,
                own.clone(),
            )),
        )
        .await?
        .context("broker")?;
        tasks.push(broker.task);

        let mut endpoints = common("trellis-endpoints", p.endpoints, store("endpoints")?);
        endpoints.extend(args(&[
            "--ipam",
            &p.ipam.to_string(),
            "--discovery",
            &p.discovery.to_string(),
            "--dns-listen",
            &plan.dns.to_string(),
        ]));
        endpoints.extend(tls("endpoints")?);
        let endpoints = traced(
            "trellis-endpoints",
            &plan.id,
            &mut tracers,
            Box::pin(trellis_endpoints::start(
                trellis_endpoints::Config::try_parse_from(endpoints)?,
                own.clone(),
            )),
        )
        .await?
        .context("endpoints")?;
        tasks.push(endpoints.task);

        Ok(Self {
            plan,
            tasks: std::mem::take(tasks),
            etcds,
            tracers,
            _certificates: certificates,
        })
    }

    /// Waits for every service to finish (after the shutdown token was cancelled), then stops
    /// the etcd processes. Returns the first service error.
    pub async fn finish(mut self) -> anyhow::Result<()> {
        let mut first = Ok(());
        for task in self.tasks.drain(..) {
            let result = task.await.context("service task panicked").and_then(|r| r);
            if first.is_ok() {
                first = result.with_context(|| format!("cluster {}", self.plan.id));
            }
        }
        for etcd in &mut self.etcds {
            etcd.kill();
        }
        for tracer in self.tracers.drain(..) {
            tracer.shutdown().await;
        }
        first
    }
}
