//! A whole Trellis cluster in this process: IPAM, discovery, gateway (control plane only),
//! forwarder and broker (and, on request, endpoints without Kubernetes), each with its own
//! memory store, on loopback ports. For tests of the peering plane
//! that need many clusters at once; the multi-process tests cover real etcd and real binaries.

use std::net::SocketAddr;

use anyhow::Context as _;
use clap::Parser as _;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_runtime::Shutdown;
use trellis_runtime::tls::{ClusterCa, PeerTls, PinnedCa};

/// The addresses of one in-process cluster's services.
#[derive(Debug, Clone)]
pub struct Services {
    pub discovery: SocketAddr,
    pub broker: SocketAddr,
    pub forwarder: SocketAddr,
    pub ipam: SocketAddr,
    pub gateway: SocketAddr,
    /// Served only by clusters started with the endpoints service ([`InProcessCluster::start_tls`],
    /// [`InProcessCluster::start_with_endpoints`]).
    pub endpoints: SocketAddr,
}

/// One running in-process cluster; stopped when dropped.
#[derive(Debug)]
pub struct InProcessCluster {
    pub id: String,
    pub services: Services,
    /// Set by [`InProcessCluster::start_tls`].
    pub tls: Option<ClusterTls>,
    shutdown: Shutdown,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
    /// The endpoints service alone, so it can be restarted: its flags, stop signal and task.
    endpoints: Option<(Vec<String>, Shutdown, JoinHandle<anyhow::Result<()>>)>,
}

/// The mutual-TLS side of a cluster started with [`InProcessCluster::start_tls`] (ADR 0014):
/// its CA, and the peer listeners of its cluster-facing services (what its discovery
/// advertises).
#[derive(Debug)]
pub struct ClusterTls {
    pub ca: ClusterCa,
    pub broker: SocketAddr,
    pub forwarder: SocketAddr,
    pub discovery: SocketAddr,
    pub ipam: SocketAddr,
    pub endpoints: SocketAddr,
    dir: tempfile::TempDir,
}

impl ClusterTls {
    fn new(id: &str) -> anyhow::Result<Self> {
        Ok(Self {
            ca: ClusterCa::generate(id)?,
            broker: loopback(),
            forwarder: loopback(),
            discovery: loopback(),
            ipam: loopback(),
            endpoints: loopback(),
            dir: tempfile::tempdir()?,
        })
    }

    /// The TLS flags of `service` listening for peers on `listen`: a fresh certificate in
    /// files, or with `managed` seconds of lifetime, the CA in a `--tls-dir` where the service
    /// issues and renews its own.
    fn flags(
        &self,
        service: &str,
        listen: SocketAddr,
        managed: Option<u64>,
    ) -> anyhow::Result<Vec<String>> {
        if let Some(lifetime) = managed {
            let ca = self.dir.path().join("managed").join("ca");
            std::fs::create_dir_all(&ca)?;
            std::fs::write(ca.join("ca.pem"), self.ca.cert_pem())?;
            std::fs::write(ca.join("ca-key.pem"), self.ca.key_pem())?;
            return Ok(vec![
                "--peer-listen".into(),
                listen.to_string(),
                "--tls-dir".into(),
                self.dir.path().join("managed").display().to_string(),
                "--tls-cert-lifetime".into(),
                lifetime.to_string(),
                "--tls-reload".into(),
                "1".into(),
            ]);
        }
        let cert = self.ca.issue(service)?;
        let path = |name: String| self.dir.path().join(name);
        std::fs::write(path("ca.pem".into()), self.ca.cert_pem())?;
        std::fs::write(path(format!("{service}.pem")), &cert.cert_pem)?;
        std::fs::write(path(format!("{service}-key.pem")), cert.key_pem())?;
        let text = |name: String| path(name).display().to_string();
        Ok(vec![
            "--peer-listen".into(),
            listen.to_string(),
            "--tls-ca-cert".into(),
            text("ca.pem".into()),
            "--tls-cert".into(),
            text(format!("{service}.pem")),
            "--tls-key".into(),
            text(format!("{service}-key.pem")),
        ])
    }

    /// Where the services keep the certificates they issue themselves (`--tls-dir`, with
    /// [`Options::managed_cert_lifetime`]).
    pub fn managed_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("managed")
    }

    /// A client identity of this cluster (a fresh certificate for `service`) that trusts the
    /// CAs of `peers`: what a test uses to call other clusters as this one.
    pub fn client(&self, service: &str, peers: &[&InProcessCluster]) -> anyhow::Result<PeerTls> {
        let cert = self.ca.issue(service)?;
        let tls = PeerTls::new(
            self.ca.cluster_id(),
            self.ca.cert_pem(),
            &cert.cert_pem,
            cert.key_pem(),
        )?;
        for peer in peers {
            if let Some(theirs) = &peer.tls {
                tls.trust()
                    .pin(PinnedCa::from_pem(&peer.id, theirs.ca.cert_pem())?);
            }
        }
        Ok(tls)
    }
}

fn loopback() -> SocketAddr {
    crate::free_addr()
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// How an [`InProcessCluster`] starts beyond its CIDRs: the switches of the named constructors,
/// and extra flags per service for tests that need a non-default setting (a tiny IPAM pool, a
/// short WireGuard port range).
#[derive(Debug, Clone)]
pub struct Options {
    /// Induced peering on (the default); off is discovery's `--no-induced`.
    pub induced: bool,
    /// Mutual TLS between clusters ([`InProcessCluster::start_tls`]).
    pub tls: bool,
    /// With `tls`: the services' certificates are Trellis's own (`--tls-dir`, the CA made by
    /// the test so that peers can pin it), valid this many seconds and renewed by the services.
    pub managed_cert_lifetime: Option<u64>,
    /// The endpoints service too.
    pub endpoints: bool,
    /// Appended to the IPAM's flags.
    pub ipam_flags: Vec<String>,
    /// Appended to the gateway's flags.
    pub gateway_flags: Vec<String>,
    /// The endpoints service's store (e.g. a real etcd, to survive
    /// [`InProcessCluster::restart_endpoints`]); memory by default.
    pub endpoints_store: Option<String>,
    /// The endpoints service runs with `--kubernetes --kubeconfig FILE` (a fake API server's).
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The broker address discovery advertises to other clusters instead of the broker's own
    /// (a [`crate::gate::Hold`] in front of it, say).
    pub advertise_broker: Option<SocketAddr>,
    /// The same for the forwarder.
    pub advertise_forwarder: Option<SocketAddr>,
    /// Appended to the broker's flags.
    pub broker_flags: Vec<String>,
    /// Appended to discovery's flags.
    pub discovery_flags: Vec<String>,
    /// Appended to the endpoints service's flags (with `endpoints`).
    pub endpoints_flags: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            induced: true,
            tls: false,
            managed_cert_lifetime: None,
            endpoints: false,
            ipam_flags: Vec::new(),
            gateway_flags: Vec::new(),
            endpoints_store: None,
            kubeconfig: None,
            advertise_broker: None,
            advertise_forwarder: None,
            broker_flags: Vec::new(),
            discovery_flags: Vec::new(),
            endpoints_flags: Vec::new(),
        }
    }
}

impl InProcessCluster {
    /// Starts cluster `id` with the given pod and external CIDRs. Ports are picked before the
    /// services bind them (discovery must advertise them first), so another cluster may take
    /// one in between: then the whole cluster starts again on fresh ports.
    pub async fn start(id: &str, pod_cidr: &str, external_cidr: &str) -> anyhow::Result<Self> {
        Self::start_with(id, pod_cidr, external_cidr, Options::default()).await
    }

    /// Like [`Self::start`], with the endpoints service too (at `services.endpoints`).
    pub async fn start_with_endpoints(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
    ) -> anyhow::Result<Self> {
        let options = Options {
            endpoints: true,
            ..Options::default()
        };
        Self::start_with(id, pod_cidr, external_cidr, options).await
    }

    /// Like [`Self::start`], with mutual TLS between clusters (ADR 0014): a CA of its own, and
    /// every cluster-facing service (broker, forwarder, discovery, IPAM, endpoints) serving other
    /// clusters on a peer listener (`tls.broker`, ...), which discovery advertises. Peer with
    /// `tls.broker`.
    pub async fn start_tls(id: &str, pod_cidr: &str, external_cidr: &str) -> anyhow::Result<Self> {
        let options = Options {
            tls: true,
            endpoints: true,
            ..Options::default()
        };
        Self::start_with(id, pod_cidr, external_cidr, options).await
    }

    /// The broker address other clusters use: the peer listener with TLS.
    pub fn peering_broker(&self) -> SocketAddr {
        self.tls.as_ref().map_or(self.services.broker, |t| t.broker)
    }

    /// Like [`Self::start`], with discovery's `--no-induced`: the cluster neither introduces its
    /// peers to each other nor accepts introductions.
    pub async fn start_without_induced(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
    ) -> anyhow::Result<Self> {
        let options = Options {
            induced: false,
            ..Options::default()
        };
        Self::start_with(id, pod_cidr, external_cidr, options).await
    }

    /// Like [`Self::start`], with `options`.
    pub async fn start_with(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
        options: Options,
    ) -> anyhow::Result<Self> {
        // The process now runs services: it gets their allocator options, as a service
        // binary does (the benchmarks measure what a deployment would run).
        trellis_runtime::allocator::tune();
        let mut attempt = 0;
        loop {
            match Box::pin(Self::start_once(id, pod_cidr, external_cidr, &options)).await {
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
        options: &Options,
    ) -> anyhow::Result<Self> {
        let (induced, with_endpoints) = (options.induced, options.endpoints);
        let tls = options.tls.then(|| ClusterTls::new(id)).transpose()?;
        let services = Services {
            discovery: loopback(),
            broker: loopback(),
            forwarder: loopback(),
            ipam: loopback(),
            gateway: loopback(),
            endpoints: loopback(),
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
        if let Some(tls) = &tls {
            ipam.extend(args(&["--discovery", &services.discovery.to_string()]));
            ipam.extend(tls.flags("ipam", tls.ipam, options.managed_cert_lifetime)?);
        } else {
            ipam.push(trellis_testkit::PLAINTEXT_PEERING.into());
        }
        ipam.extend(options.ipam_flags.iter().cloned());
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
        gateway.extend(options.gateway_flags.iter().cloned());
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
            &tls.as_ref()
                .map_or(services.discovery, |t| t.discovery)
                .to_string(),
            "--advertise-broker",
            &options
                .advertise_broker
                .unwrap_or(tls.as_ref().map_or(services.broker, |t| t.broker))
                .to_string(),
            "--advertise-forwarder",
            &options
                .advertise_forwarder
                .unwrap_or(tls.as_ref().map_or(services.forwarder, |t| t.forwarder))
                .to_string(),
            "--advertise-ipam",
            &tls.as_ref().map_or(services.ipam, |t| t.ipam).to_string(),
            "--advertise-endpoints",
            &tls.as_ref()
                .map_or(services.endpoints, |t| t.endpoints)
                .to_string(),
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
        discovery.extend(options.discovery_flags.iter().cloned());
        if let Some(tls) = &tls {
            discovery.extend(tls.flags(
                "discovery",
                tls.discovery,
                options.managed_cert_lifetime,
            )?);
        } else {
            discovery.push(trellis_testkit::PLAINTEXT_PEERING.into());
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
        if let Some(tls) = &tls {
            forwarder.extend(tls.flags(
                "forwarder",
                tls.forwarder,
                options.managed_cert_lifetime,
            )?);
        } else {
            forwarder.push(trellis_testkit::PLAINTEXT_PEERING.into());
        }
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
        if let Some(tls) = &tls {
            broker.extend(tls.flags("broker", tls.broker, options.managed_cert_lifetime)?);
        } else {
            broker.push(trellis_testkit::PLAINTEXT_PEERING.into());
        }
        broker.extend(options.broker_flags.iter().cloned());
        let broker = trellis_broker::start(
            trellis_broker::Config::try_parse_from(broker)?,
            shutdown.clone(),
        )
        .await
        .context("broker")?;
        tasks.push(broker.task);

        let mut endpoints_service = None;
        if with_endpoints {
            let mut endpoints = common(services.endpoints);
            endpoints.extend(args(&[
                "--ipam",
                &services.ipam.to_string(),
                "--discovery",
                &services.discovery.to_string(),
            ]));
            if let Some(store) = &options.endpoints_store
                && let Some(at) = endpoints.iter().position(|a| a == "--store")
            {
                endpoints[at + 1] = store.clone();
            }
            if let Some(kubeconfig) = &options.kubeconfig {
                endpoints.extend(args(&[
                    "--kubernetes",
                    "--kubeconfig",
                    &kubeconfig.display().to_string(),
                ]));
            }
            if let Some(tls) = &tls {
                endpoints.extend(tls.flags(
                    "endpoints",
                    tls.endpoints,
                    options.managed_cert_lifetime,
                )?);
            } else {
                endpoints.push(trellis_testkit::PLAINTEXT_PEERING.into());
            }
            endpoints.extend(options.endpoints_flags.iter().cloned());
            let stop = shutdown.child_token();
            let started = trellis_endpoints::start(
                trellis_endpoints::Config::try_parse_from(&endpoints)?,
                stop.clone(),
            )
            .await
            .context("endpoints")?;
            endpoints_service = Some((endpoints, stop, started.task));
        }

        stop_on_failure.disarm();
        Ok(Self {
            id: id.to_owned(),
            services,
            tls,
            shutdown,
            tasks,
            endpoints: endpoints_service,
        })
    }

    /// Stops the endpoints service (as a crash would: its in-memory state is gone) and starts
    /// it again with the same flags and store, on the same address.
    pub async fn restart_endpoints(&mut self) -> anyhow::Result<()> {
        let (flags, stop, task) = self
            .endpoints
            .take()
            .context("this cluster runs no endpoints service")?;
        stop.cancel();
        let _ = task.await;
        let mut attempt = 0;
        loop {
            let stop = self.shutdown.child_token();
            match trellis_endpoints::start(
                trellis_endpoints::Config::try_parse_from(&flags)?,
                stop.clone(),
            )
            .await
            {
                Ok(started) => {
                    self.endpoints = Some((flags, stop, started.task));
                    return Ok(());
                }
                // The old listener's port may linger for a moment.
                Err(err) if attempt < 50 && format!("{err:#}").contains("cannot listen") => {
                    attempt += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(err) => return Err(err.context("restarting endpoints")),
            }
        }
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

    pub async fn gateway(&self) -> anyhow::Result<GatewayClient<Channel>> {
        Ok(GatewayClient::new(
            Self::channel(self.services.gateway).await?,
        ))
    }

    pub async fn endpoints(&self) -> anyhow::Result<EndpointMapperClient<Channel>> {
        Ok(EndpointMapperClient::new(
            Self::channel(self.services.endpoints).await?,
        ))
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
        if let Some((_, _, task)) = self.endpoints.take() {
            let _ = task.await;
        }
    }
}

impl Drop for InProcessCluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
