//! One lab cluster: the six services started in this process from their libraries, each with
//! its own gRPC server on its own loopback port and its own store (an embedded memory store,
//! or a dedicated etcd process). Services talk to each other only through gRPC, exactly as
//! separate processes would; running them in one process is what lets a laptop hold 255
//! clusters (ADR 0013).

use anyhow::Context as _;
use clap::Parser as _;
use tokio::task::JoinHandle;
use trellis_runtime::Shutdown;
use trellis_testkit::Etcd;

use crate::config::StoreKind;
use crate::plan::ClusterPlan;

/// How a cluster starts.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub store: StoreKind,
    /// Discovery's induced peering (off: `--no-induced`).
    pub induced: bool,
}

/// A running lab cluster. Its services stop when the lab's shutdown token is cancelled; the
/// etcd processes (if any) are killed when this value is dropped.
#[derive(Debug)]
pub struct LabCluster {
    pub plan: ClusterPlan,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
    etcds: Vec<Etcd>,
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

impl LabCluster {
    /// Starts every service of `plan`. On failure the services already started are stopped
    /// again (through a child of `shutdown`).
    pub async fn start(
        plan: ClusterPlan,
        options: Options,
        shutdown: &Shutdown,
    ) -> anyhow::Result<Self> {
        let own = shutdown.child_token();
        let stop_on_failure = own.clone().drop_guard();
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
        let common = |service: &str, listen: std::net::SocketAddr, store: String| {
            let mut a = args(&[
                service,
                "--listen",
                &listen.to_string(),
                "--cluster-id",
                &plan.id,
                "--shutdown-grace",
                "1",
            ]);
            a.extend(["--store".to_owned(), store]);
            a
        };
        let mut tasks = Vec::new();

        let mut ipam = common("trellis-ipam", p.ipam, store("ipam")?);
        ipam.extend(args(&[
            "--pod-cidr",
            &plan.pod_cidr.to_string(),
            "--external-cidr",
            &plan.external_cidr.to_string(),
        ]));
        let ipam = trellis_ipam::start(trellis_ipam::Config::try_parse_from(ipam)?, own.clone())
            .await
            .context("ipam")?;
        tasks.push(ipam.task);

        let mut gateway = common("trellis-gateway", p.gateway, store("gateway")?);
        gateway.extend(args(&[
            "--dataplane",
            "none",
            "--endpoint-address",
            "127.0.0.1",
        ]));
        let gateway = trellis_gateway::start(
            trellis_gateway::Config::try_parse_from(gateway)?,
            own.clone(),
        )
        .await
        .context("gateway")?;
        tasks.push(gateway.task);

        let mut discovery = common("trellis-discovery", p.discovery, store("discovery")?);
        for (name, addr) in p.named() {
            discovery.extend([format!("--advertise-{name}"), addr.to_string()]);
        }
        discovery.extend(args(&[
            "--neighborhood-resync",
            "10",
            "--neighborhood-retry-max",
            "2",
        ]));
        if !options.induced {
            discovery.push("--no-induced".to_owned());
        }
        let discovery = trellis_discovery::start(
            trellis_discovery::Config::try_parse_from(discovery)?,
            own.clone(),
        )
        .await
        .context("discovery")?;
        tasks.push(discovery.task);

        let mut forwarder = common("trellis-forwarder", p.forwarder, store("forwarder")?);
        forwarder.extend(args(&[
            "--discovery",
            &p.discovery.to_string(),
            "--retry-max",
            "1",
        ]));
        let forwarder = trellis_forwarder::start(
            trellis_forwarder::Config::try_parse_from(forwarder)?,
            own.clone(),
        )
        .await
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
        let broker =
            trellis_broker::start(trellis_broker::Config::try_parse_from(broker)?, own.clone())
                .await
                .context("broker")?;
        tasks.push(broker.task);

        let mut endpoints = common("trellis-endpoints", p.endpoints, store("endpoints")?);
        endpoints.extend(args(&[
            "--ipam",
            &p.ipam.to_string(),
            "--discovery",
            &p.discovery.to_string(),
        ]));
        let endpoints = trellis_endpoints::start(
            trellis_endpoints::Config::try_parse_from(endpoints)?,
            own.clone(),
        )
        .await
        .context("endpoints")?;
        tasks.push(endpoints.task);

        stop_on_failure.disarm();
        Ok(Self { plan, tasks, etcds })
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
        first
    }
}
