//! [`NsCluster`]: the six services of one Trellis cluster as real processes inside the
//! cluster's gateway namespace, each listening on the site's bridge address at its default port
//! (discovery 7101 ... gateway 7106) and calling its local peers there too, so cluster-to-cluster
//! control traffic (peering, NetworkConfigs, Neighborhoods, remote IPAM calls) crosses the
//! internet bridge like the WireGuard packets do.
//!
//! Stores ([`StoreKind`]): one real etcd **per service** (the production shape) runs
//! on the host's loopback, reached from the namespace through a TCP forwarder on
//! `127.0.0.1:2379+k` inside it ([`crate::netns::forward_into`]); or `memory://` for every
//! service.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::gateway::{ListTunnelsRequest, TunnelStatus};
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_testkit::Etcd;
use trellis_testkit::PLAINTEXT_PEERING;
/// One of a cluster's services: the test kit's, which the process-cluster tests share.
pub use trellis_testkit::Service;
use trellis_testkit::peering::Peerable;

use crate::bins::bin_path;
use crate::netns::forward_into;
use crate::process::NsProcess;
use crate::topology::Site;

/// Where the services keep their state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// `memory://` everywhere: lost on restart.
    Memory,
    /// One etcd per service (the production shape).
    EtcdPerService,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Cluster ID (also its name).
    pub id: String,
    /// The cluster's external CIDR (its pod CIDR is the site's).
    pub external_cidr: String,
    /// Discovery's `--no-induced`: introduce nobody, accept no introductions.
    pub no_induced: bool,
    pub store: StoreKind,
    /// The gateway's `--dataplane` (`userspace`, `kernel`, `auto` or `none`).
    pub dataplane: String,
    /// Extra flags per service, appended to the defaults.
    pub extra_args: Vec<(Service, Vec<String>)>,
    /// The gateway's `--endpoint-address` (an IP or a DNS name); `None`: the site's bridge
    /// address.
    pub endpoint_address: Option<String>,
    /// With nodes: the IPAM is told the site's node network (`--reserved`), so it remaps a
    /// peer's range that overlaps it.
    pub reserve_node_network: bool,
    /// More gateway replicas (ADR 0023), each `(node index, its public address)`: the same
    /// binary and store as the gateway of node 0, on that node (which needs an uplink of its
    /// own, [`crate::Topology::add_node_uplink`]). Needs etcd: replicas share the store.
    pub standby_gateways: Vec<(usize, std::net::Ipv4Addr)>,
    /// Mutual TLS between clusters: each cluster-facing service also listens for other
    /// clusters on its port + 10, discovery advertises those, and the services make and renew
    /// their certificates in a directory of the cluster (`--tls-dir`). Off: plaintext
    /// (`--insecure-plaintext-peering`).
    pub tls: bool,
}

impl ClusterOptions {
    /// Userspace WireGuard, etcd per service, induced peering on.
    pub fn new(id: &str, external_cidr: &str) -> Self {
        Self {
            id: id.to_owned(),
            external_cidr: external_cidr.to_owned(),
            no_induced: false,
            store: StoreKind::EtcdPerService,
            dataplane: "userspace".to_owned(),
            extra_args: Vec::new(),
            endpoint_address: None,
            reserve_node_network: true,
            standby_gateways: Vec::new(),
            tls: false,
        }
    }
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// Replaces the value of each flag of `flags` in `args` (each must be there).
fn set_flags(args: &mut [String], flags: &[(&str, String)]) -> anyhow::Result<()> {
    for (flag, value) in flags {
        let at = args
            .iter()
            .position(|a| a == flag)
            .with_context(|| format!("the gateway has no {flag}"))?;
        let slot = args
            .get_mut(at + 1)
            .with_context(|| format!("{flag} has no value"))?;
        *slot = value.clone();
    }
    Ok(())
}

/// The route agents' gRPC port (`trellis_runtime::config::ports::ROUTE`).
const ROUTE_PORT: u16 = 7107;

/// A cluster's services running in its gateway namespace. Processes are killed, forwarders
/// stopped and etcds removed on drop (in that order).
#[derive(Debug)]
pub struct NsCluster {
    /// The cluster ID.
    pub id: String,
    /// The gateway namespace everything runs in.
    pub ns: String,
    /// The site's bridge address every service listens on.
    pub ip: IpAddr,
    // Drop order: processes, forwarders (aborted in Drop), etcds, logs.
    processes: BTreeMap<Service, NsProcess>,
    /// With nodes: the route agent of every node, by node index.
    agents: Vec<NsProcess>,
    /// The gateway replicas beyond node 0's, by node index.
    replicas: BTreeMap<usize, NsProcess>,
    forwarders: Vec<JoinHandle<()>>,
    etcds: BTreeMap<Service, Etcd>,
    logs: tempfile::TempDir,
    /// What the cluster was started with (a moved gateway keeps its flags).
    options: ClusterOptions,
}

/// A service's mutual-TLS port is its gRPC port + 10, as in the kustomize manifests.
const PEER_PORT_OFFSET: u16 = 10;

/// The clusterset DNS port of every cluster (the services run as root in their namespace).
pub const DNS_PORT: u16 = 53;

impl NsCluster {
    /// Starts the stores and the six services of `options.id` in `site`'s gateway namespace,
    /// each waited for until its health check says SERVING.
    pub async fn start(site: &Site, options: ClusterOptions) -> anyhow::Result<Self> {
        let logs = tempfile::Builder::new()
            .prefix(&format!("trellis-netlab-{}-", options.id))
            .tempdir()?;
        let mut this = Self {
            id: options.id.clone(),
            ns: site.gw_ns.clone(),
            ip: IpAddr::V4(site.uplink_ip),
            processes: BTreeMap::new(),
            agents: Vec::new(),
            replicas: BTreeMap::new(),
            forwarders: Vec::new(),
            etcds: BTreeMap::new(),
            logs,
            options: options.clone(),
        };
        if options.store == StoreKind::EtcdPerService {
            let starting: Vec<_> = Service::ALL
                .iter()
                .map(|&service| {
                    tokio::task::spawn_blocking(move || Etcd::start().map(|etcd| (service, etcd)))
                })
                .collect();
            for started in starting {
                let (service, etcd) = started.await.context("etcd start task")??;
                let target: SocketAddr = etcd.endpoint().parse()?;
                this.forwarders
                    .push(forward_into(&this.ns, Self::etcd_addr(service), target)?);
                this.etcds.insert(service, etcd);
            }
        }
        for service in Service::ALL {
            let args = this.args(service, site, &options);
            let process = NsProcess::start(
                &this.ns,
                bin_path(&service.binary())?,
                args,
                Vec::new(),
                this.addr(service),
                service.grpc_service(),
                this.logs.path().join(format!("{service}.log")),
            )
            .await
            .with_context(|| format!("{}: starting {service}", this.id))?;
            this.processes.insert(service, process);
        }
        if !options.standby_gateways.is_empty() && options.store != StoreKind::EtcdPerService {
            anyhow::bail!("gateway replicas share their store: they need etcd");
        }
        let mut gateways = vec![this.addr(Service::Gateway).to_string()];
        for &(index, endpoint) in &options.standby_gateways {
            let node = site
                .nodes
                .get(index)
                .context("no such node for a gateway replica")?;
            let listen = SocketAddr::new(IpAddr::V4(node.node_ip), Service::Gateway.port());
            if let Some(etcd) = this.etcds.get(&Service::Gateway) {
                let outside: SocketAddr = etcd.endpoint().parse()?;
                this.forwarders.push(forward_into(
                    &node.netns,
                    Self::etcd_addr(Service::Gateway),
                    outside,
                )?);
            }
            let mut args = this.args(Service::Gateway, site, &options);
            set_flags(
                &mut args,
                &[
                    ("--listen", listen.to_string()),
                    ("--node-name", node.name.clone()),
                    ("--node-ip", node.node_ip.to_string()),
                    ("--endpoint-address", endpoint.to_string()),
                ],
            )?;
            let process = NsProcess::start(
                &node.netns,
                bin_path(&Service::Gateway.binary())?,
                args,
                Vec::new(),
                listen,
                Service::Gateway.grpc_service(),
                this.logs.path().join(format!("gateway-{}.log", node.name)),
            )
            .await
            .with_context(|| {
                format!("{}: starting the gateway replica on {}", this.id, node.name)
            })?;
            this.replicas.insert(index, process);
            gateways.push(listen.to_string());
        }
        for node in &site.nodes {
            let addr = SocketAddr::new(IpAddr::V4(node.node_ip), ROUTE_PORT);
            let agent = NsProcess::start(
                &node.netns,
                bin_path("trellis-route")?,
                strings(&[
                    "--listen",
                    &addr.to_string(),
                    "--cluster-id",
                    &this.id,
                    "--gateway",
                    &gateways.join(","),
                    "--node-name",
                    &node.name,
                    "--node-ip",
                    &node.node_ip.to_string(),
                    "--resync-interval",
                    "5",
                    "--shutdown-grace",
                    "1",
                ]),
                Vec::new(),
                addr,
                "trellis.route.v1.Route",
                this.logs.path().join(format!("route-{}.log", node.name)),
            )
            .await
            .with_context(|| format!("{}: starting the route agent of {}", this.id, node.name))?;
            this.agents.push(agent);
        }
        Ok(this)
    }

    /// `service`'s etcd (with [`StoreKind::EtcdPerService`]), to stop and restart it.
    pub fn etcd_mut(&mut self, service: Service) -> anyhow::Result<&mut Etcd> {
        let id = self.id.clone();
        self.etcds
            .get_mut(&service)
            .with_context(|| format!("{id}: {service} has no etcd of its own"))
    }

    /// The gateway replica on node `node`: node 0's is the cluster's gateway process.
    pub fn gateway_replica_mut(&mut self, node: usize) -> anyhow::Result<&mut NsProcess> {
        if node == 0 {
            return self.process_mut(Service::Gateway);
        }
        let id = self.id.clone();
        self.replicas
            .get_mut(&node)
            .with_context(|| format!("{id}: no gateway replica on node {node}"))
    }

    /// The process of the gateway replica on node `node`.
    pub fn gateway_replica_process(&self, node: usize) -> Option<&NsProcess> {
        if node == 0 {
            return self.processes.get(&Service::Gateway);
        }
        self.replicas.get(&node)
    }

    /// The nodes running a gateway replica, node 0 first.
    pub fn gateway_replica_nodes(&self) -> Vec<usize> {
        std::iter::once(0)
            .chain(self.replicas.keys().copied())
            .collect()
    }

    /// A client of the gateway replica on node `node`, from inside that node.
    pub fn gateway_replica(&self, node: usize) -> anyhow::Result<GatewayClient<Channel>> {
        if node == 0 {
            return self.gateway();
        }
        let process = self
            .replicas
            .get(&node)
            .with_context(|| format!("{}: no gateway replica on node {node}", self.id))?;
        Ok(GatewayClient::new(crate::netns::channel_in(
            process.netns(),
            process.addr(),
        )?))
    }

    /// The route agent of node `index` (with nodes).
    pub fn agent_mut(&mut self, index: usize) -> anyhow::Result<&mut NsProcess> {
        let id = self.id.clone();
        self.agents
            .get_mut(index)
            .with_context(|| format!("{id}: no route agent on node {index}"))
    }

    /// `service`'s store as reachable from the host (its etcd on the host's loopback, with the
    /// service's key prefix), for tests that read what a service persisted; `None` with a
    /// memory store.
    pub fn store_url(&self, service: Service) -> Option<String> {
        let etcd = self.etcds.get(&service)?;
        Some(etcd.url(&format!("trellis/{}/{service}", self.id)))
    }

    /// Moves the gateway to node `node` of `site`, as relabelling a node does in Kubernetes:
    /// SIGTERM where it runs (it removes its data plane), then the same binary with the same
    /// store on that node, with the node's name and address and `endpoint` (that node's own
    /// uplink, [`crate::Topology::add_node_uplink`]) as its public address. The gateway's
    /// service address ([`NsCluster::addr`], which the broker, the route agents and the tests
    /// dial) is DNAT'ed to its new place on every node, as kube-proxy does for a Service.
    pub async fn move_gateway(
        &mut self,
        site: &Site,
        node: usize,
        endpoint: std::net::Ipv4Addr,
    ) -> anyhow::Result<()> {
        let target = site.nodes.get(node).context("no such node")?.clone();
        let old = self.process_mut(Service::Gateway)?;
        if old.is_running() {
            old.terminate().await.context("stopping the gateway")?;
        }
        if let Some(etcd) = self.etcds.get(&Service::Gateway) {
            let outside: SocketAddr = etcd.endpoint().parse()?;
            self.forwarders.push(forward_into(
                &target.netns,
                Self::etcd_addr(Service::Gateway),
                outside,
            )?);
        }
        let listen = SocketAddr::new(IpAddr::V4(target.node_ip), Service::Gateway.port());
        let service_ip = self.ip.to_string();
        let script = format!(
            "table ip netlab-svc {{}}\ndelete table ip netlab-svc\n\
             table ip netlab-svc {{\n  chain output {{\n    type nat hook output priority -100;\n    \
             ip daddr {service_ip} tcp dport {port} dnat to {listen}\n  }}\n}}\n",
            port = Service::Gateway.port(),
        );
        let path = self.logs.path().join("gateway-service.nft");
        std::fs::write(&path, script)?;
        let path = path.to_str().context("utf-8 path")?.to_owned();
        for n in &site.nodes {
            let out = crate::netns::exec(&n.netns, "nft", &["-f", &path])?;
            if !out.status.success() {
                anyhow::bail!(
                    "pointing the gateway's address at {} on {}: {}",
                    target.name,
                    n.name,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        let mut args = self.args(Service::Gateway, site, &self.options.clone());
        set_flags(
            &mut args,
            &[
                ("--listen", listen.to_string()),
                ("--node-name", target.name.clone()),
                ("--node-ip", target.node_ip.to_string()),
                ("--endpoint-address", endpoint.to_string()),
            ],
        )?;
        let process = NsProcess::start(
            &target.netns,
            bin_path(&Service::Gateway.binary())?,
            args,
            Vec::new(),
            listen,
            Service::Gateway.grpc_service(),
            self.logs
                .path()
                .join(format!("gateway-{}.log", target.name)),
        )
        .await
        .with_context(|| format!("{}: starting the gateway on {}", self.id, target.name))?;
        self.processes.insert(Service::Gateway, process);
        Ok(())
    }

    /// The address inside every namespace of the cluster where `service`'s etcd is forwarded
    /// (what a test drops to cut a node off its store).
    pub fn etcd_addr(service: Service) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 2379 + service.index()))
    }

    /// The gRPC address of `service`.
    pub fn addr(&self, service: Service) -> SocketAddr {
        SocketAddr::new(self.ip, service.port())
    }

    /// Where the cluster's endpoints service answers `clusterset.local` DNS (UDP and TCP): port
    /// 53 of its services' address, which every pod of the cluster reaches.
    pub fn dns_addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, DNS_PORT)
    }

    /// With [`ClusterOptions::tls`]: the directory the services make the cluster's CA and
    /// their certificates in (`--tls-dir`).
    pub fn tls_dir(&self) -> Option<PathBuf> {
        self.options.tls.then(|| self.logs.path().join("tls"))
    }

    /// Where `service` takes calls from other clusters: its mutual-TLS listener with
    /// [`ClusterOptions::tls`] (the gateway has none), else its only one.
    pub fn facing_addr(&self, service: Service) -> SocketAddr {
        if self.options.tls && service.faces_other_clusters() {
            SocketAddr::new(self.ip, service.port() + PEER_PORT_OFFSET)
        } else {
            self.addr(service)
        }
    }

    fn args(&self, service: Service, site: &Site, options: &ClusterOptions) -> Vec<String> {
        let at = |s: Service| self.addr(s).to_string();
        let facing = |s: Service| self.facing_addr(s).to_string();
        let store = match options.store {
            StoreKind::Memory => "memory://".to_owned(),
            StoreKind::EtcdPerService => format!(
                "etcd://{}/trellis/{}/{service}",
                Self::etcd_addr(service),
                self.id
            ),
        };
        let mut args = strings(&[
            "--listen",
            &at(service),
            "--store",
            &store,
            "--cluster-id",
            &self.id,
            "--shutdown-grace",
            "1",
        ]);
        args.extend(match service {
            Service::Ipam => {
                let mut i = strings(&[
                    "--pod-cidr",
                    &site.pod_cidr.to_string(),
                    "--external-cidr",
                    &options.external_cidr,
                ]);
                if let Some(net) = site.node_network.filter(|_| options.reserve_node_network) {
                    i.extend(strings(&["--reserved", &net.to_string()]));
                }
                i
            }
            Service::Gateway => {
                let mut g = Vec::new();
                if let Some(node) = site.nodes.first() {
                    g = strings(&[
                        "--node-name",
                        &node.name,
                        "--node-ip",
                        &node.node_ip.to_string(),
                    ]);
                }
                g.extend(strings(&[
                    "--dataplane",
                    &options.dataplane,
                    "--endpoint-address",
                    &options
                        .endpoint_address
                        .clone()
                        .unwrap_or_else(|| self.ip.to_string()),
                    "--broker",
                    &at(Service::Broker),
                    "--ipam",
                    &at(Service::Ipam),
                    "--resync-interval",
                    "5",
                ]));
                g
            }
            Service::Discovery => {
                let mut d = strings(&[
                    "--advertise-discovery",
                    &facing(Service::Discovery),
                    "--advertise-broker",
                    &facing(Service::Broker),
                    "--advertise-forwarder",
                    &facing(Service::Forwarder),
                    "--advertise-ipam",
                    &facing(Service::Ipam),
                    "--advertise-endpoints",
                    &facing(Service::Endpoints),
                    "--advertise-gateway",
                    &at(Service::Gateway),
                    "--neighborhood-resync",
                    "5",
                    "--neighborhood-retry-max",
                    "2",
                ]);
                if options.no_induced {
                    d.push("--no-induced".to_owned());
                }
                d
            }
            Service::Forwarder => {
                strings(&["--discovery", &at(Service::Discovery), "--retry-max", "1"])
            }
            Service::Broker => strings(&[
                "--discovery",
                &at(Service::Discovery),
                "--ipam",
                &at(Service::Ipam),
                "--gateway",
                &at(Service::Gateway),
                "--resync",
                "2",
            ]),
            Service::Endpoints => strings(&[
                "--ipam",
                &at(Service::Ipam),
                "--discovery",
                &at(Service::Discovery),
                "--dns-listen",
                &self.dns_addr().to_string(),
            ]),
        });
        if service.faces_other_clusters() && options.tls {
            args.extend(strings(&[
                "--peer-listen",
                &facing(service),
                "--tls-dir",
                &self.logs.path().join("tls").display().to_string(),
                // A new CA (`trellisctl certs rotate-ca`) is taken within a second.
                "--tls-reload",
                "1",
            ]));
            if service == Service::Ipam {
                // Discovery keeps the pinned CAs the IPAM's listener trusts.
                args.extend(strings(&["--discovery", &at(Service::Discovery)]));
            }
        } else if service.faces_other_clusters() {
            // The lab's clusters peer across its own namespaces, in plaintext.
            args.push(PLAINTEXT_PEERING.to_owned());
        }
        for (s, extra) in &options.extra_args {
            if *s == service {
                override_flags(&mut args, extra);
            }
        }
        args
    }

    /// The process of `service`.
    pub fn process(&self, service: Service) -> anyhow::Result<&NsProcess> {
        self.processes
            .get(&service)
            .with_context(|| format!("{}: {service} not started", self.id))
    }

    /// The process of `service`, mutably (to stop, kill or restart it).
    pub fn process_mut(&mut self, service: Service) -> anyhow::Result<&mut NsProcess> {
        let id = self.id.clone();
        self.processes
            .get_mut(&service)
            .with_context(|| format!("{id}: {service} not started"))
    }

    /// SIGKILLs `service`.
    pub fn kill9(&mut self, service: Service) -> anyhow::Result<()> {
        self.process_mut(service)?.kill9();
        Ok(())
    }

    /// Starts `service` again (SIGKILL first if it runs) and waits until it serves.
    pub async fn restart(&mut self, service: Service) -> anyhow::Result<()> {
        self.process_mut(service)?.restart().await
    }

    /// Stops every service with SIGTERM (gateway last, so nothing reconfigures it while the
    /// others go), then kills every etcd: nothing of this cluster runs afterwards. Returns how
    /// long the whole stop took.
    pub async fn stop_all(&mut self) -> anyhow::Result<Duration> {
        let started = std::time::Instant::now();
        for service in Service::ALL.iter().rev() {
            if let Some(p) = self.processes.get_mut(service)
                && p.is_running()
            {
                p.terminate()
                    .await
                    .with_context(|| format!("{}: stopping {service}", self.id))?;
            }
        }
        for f in &self.forwarders {
            f.abort();
        }
        for etcd in self.etcds.values_mut() {
            etcd.kill();
        }
        Ok(started.elapsed())
    }

    /// Whether any process of this cluster runs.
    pub fn any_running(&mut self) -> bool {
        self.processes.values_mut().any(NsProcess::is_running)
            || self.etcds.values().any(Etcd::is_healthy)
    }

    /// The last `lines` lines of every service's log.
    pub fn logs(&self, lines: usize) -> String {
        self.processes
            .iter()
            .map(|(service, p)| format!("----- {} {service} -----\n{}", self.id, p.log_tail(lines)))
            .chain(self.replicas.iter().map(|(node, p)| {
                format!(
                    "----- {} gateway replica on node {node} -----\n{}",
                    self.id,
                    p.log_tail(lines)
                )
            }))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The directory holding the services' logs (removed on drop).
    pub fn log_dir(&self) -> PathBuf {
        self.logs.path().to_owned()
    }

    /// A lazily connecting channel to `service`, from inside the namespace.
    pub fn channel(&self, service: Service) -> anyhow::Result<Channel> {
        crate::netns::channel_in(&self.ns, self.addr(service))
    }

    pub fn broker(&self) -> anyhow::Result<BrokerClient<Channel>> {
        Ok(BrokerClient::new(self.channel(Service::Broker)?))
    }

    pub fn ipam(&self) -> anyhow::Result<IpamClient<Channel>> {
        Ok(IpamClient::new(self.channel(Service::Ipam)?))
    }

    pub fn gateway(&self) -> anyhow::Result<GatewayClient<Channel>> {
        Ok(GatewayClient::new(self.channel(Service::Gateway)?))
    }

    /// The tunnels the cluster's gateway reports (`ListTunnels`), or why it could not be asked.
    pub async fn gateway_tunnels(&self) -> anyhow::Result<Vec<TunnelStatus>> {
        Ok(self
            .gateway()?
            .list_tunnels(ListTunnelsRequest {})
            .await?
            .into_inner()
            .tunnels)
    }

    pub fn endpoints(&self) -> anyhow::Result<EndpointMapperClient<Channel>> {
        Ok(EndpointMapperClient::new(self.channel(Service::Endpoints)?))
    }

    pub fn discovery(&self) -> anyhow::Result<DiscoveryClient<Channel>> {
        Ok(DiscoveryClient::new(self.channel(Service::Discovery)?))
    }
}

impl Drop for NsCluster {
    fn drop(&mut self) {
        self.processes.clear();
        for f in &self.forwarders {
            f.abort();
        }
    }
}

/// Appends `extra` to `args`, where a flag of `extra` replaces the same flag (and its value)
/// among the defaults in `args`: flags like `--resync-interval` may be given once only.
fn override_flags(args: &mut Vec<String>, extra: &[String]) {
    for flag in extra.iter().filter(|a| a.starts_with("--")) {
        if let Some(at) = args.iter().position(|a| a == flag) {
            let with_value = args.get(at + 1).is_some_and(|v| !v.starts_with("--"));
            args.drain(at..at + 1 + usize::from(with_value));
        }
    }
    args.extend(extra.iter().cloned());
}

impl Peerable for NsCluster {
    fn cluster_id(&self) -> &str {
        &self.id
    }

    fn peering_broker(&self) -> SocketAddr {
        self.facing_addr(Service::Broker)
    }

    fn broker_client(
        &self,
    ) -> impl std::future::Future<Output = anyhow::Result<BrokerClient<Channel>>> + Send {
        std::future::ready(self.broker())
    }
}

#[cfg(test)]
mod tests {
    use super::override_flags;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn an_extra_flag_replaces_the_default_with_its_value() {
        let mut args = strings(&["--broker", "b:1", "--resync-interval", "5", "--verbose"]);
        override_flags(
            &mut args,
            &strings(&["--resync-interval", "600", "--verbose", "--new", "x"]),
        );
        assert_eq!(
            args,
            strings(&[
                "--broker",
                "b:1",
                "--resync-interval",
                "600",
                "--verbose",
                "--new",
                "x"
            ])
        );
    }
}
