//! A whole Trellis cluster in this process: IPAM, discovery, gateway (control plane only),
//! forwarder and broker, each with its own memory store, on loopback ports. For tests of the peering plane
//! that need many clusters at once; the multi-process tests cover real etcd and real binaries.

use std::net::SocketAddr;

use anyhow::Context as _;
use clap::Parser as _;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_runtime::Shutdown;

/// The addresses of one in-process cluster's services.
#[derive(Debug, Clone)]
pub struct Services {
    pub discovery: SocketAddr,
    pub broker: SocketAddr,
    pub forwarder: SocketAddr,
    pub ipam: SocketAddr,
    pub gateway: SocketAddr,
}

/// One running in-process cluster; stopped when dropped.
#[derive(Debug)]
pub struct InProcessCluster {
    pub id: String,
    pub services: Services,
    shutdown: Shutdown,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
}

fn loopback() -> SocketAddr {
    crate::free_addr()
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

impl InProcessCluster {
    /// Starts cluster `id` with the given pod and external CIDRs. Ports are picked before the
    /// services bind them (discovery must advertise them first), so another cluster may take
    /// one in between: then the whole cluster starts again on fresh ports.
    pub async fn start(id: &str, pod_cidr: &str, external_cidr: &str) -> anyhow::Result<Self> {
        Self::start_with(id, pod_cidr, external_cidr, true).await
    }

    /// Like [`Self::start`], with discovery's `--no-induced`: the cluster neither introduces its
    /// peers to each other nor accepts introductions.
    pub async fn start_without_induced(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
    ) -> anyhow::Result<Self> {
        Self::start_with(id, pod_cidr, external_cidr, false).await
    }

    async fn start_with(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
        induced: bool,
    ) -> anyhow::Result<Self> {
        let mut attempt = 0;
        loop {
            match Self::start_once(id, pod_cidr, external_cidr, induced).await {
                Err(err) if attempt < 5 && format!("{err:#}").contains("cannot listen") => {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
        induced: bool,
    ) -> anyhow::Result<Self> {
        let services = Services {
            discovery: loopback(),
            broker: loopback(),
            forwarder: loopback(),
            ipam: loopback(),
            gateway: loopback(),
        };
        let shutdown = Shutdown::new();
        // Services already started are stopped again if a later one fails to start.
        let stop_on_failure = shutdown.clone().drop_guard();
        let common = |listen: SocketAddr| {
            args(&[
                "x",
                "--listen",
                &listen.to_string(),
                "--store",
                "memory://",
                "--cluster-id",
                id,
                "--shutdown-grace",
                "1",
            ])
        };
        let mut tasks = Vec::new();

        let mut ipam = common(services.ipam);
        ipam.extend(args(&[
            "--pod-cidr",
            pod_cidr,
            "--external-cidr",
            external_cidr,
        ]));
        let ipam = trellis_ipam::start(
            trellis_ipam::Config::try_parse_from(ipam)?,
            shutdown.clone(),
        )
        .await
        .context("ipam")?;
        tasks.push(ipam.task);

        let mut gateway = common(services.gateway);
        gateway.extend(args(&[
            "--dataplane",
            "none",
            "--endpoint-address",
            "127.0.0.1",
        ]));
        let gateway = trellis_gateway::start(
            trellis_gateway::Config::try_parse_from(gateway)?,
            shutdown.clone(),
        )
        .await
        .context("gateway")?;
        tasks.push(gateway.task);

        let mut discovery = common(services.discovery);
        discovery.extend(args(&[
            "--advertise-discovery",
            &services.discovery.to_string(),
            "--advertise-broker",
            &services.broker.to_string(),
            "--advertise-forwarder",
            &services.forwarder.to_string(),
            "--advertise-ipam",
            &services.ipam.to_string(),
            "--advertise-gateway",
            &services.gateway.to_string(),
            "--neighborhood-resync",
            "5",
            "--neighborhood-retry-max",
            "2",
        ]));
        if !induced {
            discovery.push("--no-induced".into());
        }
        let discovery = trellis_discovery::start(
            trellis_discovery::Config::try_parse_from(discovery)?,
            shutdown.clone(),
        )
        .await
        .context("discovery")?;
        tasks.push(discovery.task);

        let mut forwarder = common(services.forwarder);
        forwarder.extend(args(&[
            "--discovery",
            &services.discovery.to_string(),
            "--retry-max",
            "1",
        ]));
        let forwarder = trellis_forwarder::start(
            trellis_forwarder::Config::try_parse_from(forwarder)?,
            shutdown.clone(),
        )
        .await
        .context("forwarder")?;
        tasks.push(forwarder.task);

        let mut broker = common(services.broker);
        broker.extend(args(&[
            "--discovery",
            &services.discovery.to_string(),
            "--ipam",
            &services.ipam.to_string(),
            "--gateway",
            &services.gateway.to_string(),
            "--resync",
            "2",
        ]));
        let broker = trellis_broker::start(
            trellis_broker::Config::try_parse_from(broker)?,
            shutdown.clone(),
        )
        .await
        .context("broker")?;
        tasks.push(broker.task);

        stop_on_failure.disarm();
        Ok(Self {
            id: id.to_owned(),
            services,
            shutdown,
            tasks,
        })
    }

    async fn channel(addr: SocketAddr) -> anyhow::Result<Channel> {
        Ok(Channel::from_shared(format!("http://{addr}"))?
            .connect()
            .await?)
    }

    pub async fn broker(&self) -> anyhow::Result<BrokerClient<Channel>> {
        Ok(BrokerClient::new(
            Self::channel(self.services.broker).await?,
        ))
    }

    pub async fn ipam(&self) -> anyhow::Result<IpamClient<Channel>> {
        Ok(IpamClient::new(Self::channel(self.services.ipam).await?))
    }

    pub async fn discovery(&self) -> anyhow::Result<DiscoveryClient<Channel>> {
        Ok(DiscoveryClient::new(
            Self::channel(self.services.discovery).await?,
        ))
    }

    /// Stops every service and waits for them.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
    }
}

impl Drop for InProcessCluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
