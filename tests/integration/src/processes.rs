//! A whole Trellis cluster as real processes: the `trellis-ipam`, `trellis-gateway` (control
//! plane only, `--dataplane none`), `trellis-discovery`, `trellis-forwarder`, `trellis-broker`
//! and `trellis-endpoints` (without Kubernetes access) binaries, each with **its own** etcd
//! process (as in production), on loopback ports. Any service can be SIGKILLed and
//! restarted by name, and each etcd can be read directly (with `etcdctl`) to check what the
//! service stored.
//!
//! Everything (processes and etcds, with their data directories) is killed and removed on drop.
//! Flags mirror [`crate::cluster::InProcessCluster`] (which has no endpoints service).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;

use anyhow::{Context as _, bail};
use tonic::transport::Channel;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_testkit::Etcd;
/// The services a [`ProcessCluster`] runs: the lab's enum, one for every test.
pub use trellis_testkit::Service;

use crate::ServiceProcess;
use crate::cluster::Services;
use crate::cut::{Cut, Side};
use crate::gate::Gate;

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// How many times a cluster is started on fresh ports when one of them was taken.
const START_ATTEMPTS: usize = 5;

/// Whether a start failed because a port picked for a service was taken in the meantime.
fn port_taken(err: &anyhow::Error) -> bool {
    let text = format!("{err:#}");
    text.contains("cannot listen") || text.contains("Address already in use")
}

/// Settings of a [`ProcessCluster`] beyond its CIDRs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Induced peering on (the default); off is discovery's `--no-induced`: as a hub the
    /// cluster introduces nobody, so its leaves peer only with it.
    pub induced: bool,
    /// Where every service exports its spans (`OTEL_EXPORTER_OTLP_ENDPOINT`); none by default.
    pub otlp_endpoint: Option<String>,
    /// Other clusters reach this one's services only through [`Gate`]s (its discovery
    /// advertises the gates), so [`ProcessCluster::partition`] can cut it off from them.
    pub gated: bool,
    /// Every service authenticates its local callers with the token in this file, and sends
    /// it to the local services it calls (`TRELLIS_LOCAL_TOKEN_FILE`, ADR 0020).
    pub local_token_file: Option<std::path::PathBuf>,
    /// The gateway follows the broker's TunnelEndpoints (`--broker`), as in a real cluster;
    /// off by default, where tests only need the gateway's keys and ports.
    pub gateway_follows_broker: bool,
    /// Every service process runs with this group ID (the user stays the test's), so that
    /// [`ProcessCluster::cut_from`] can cut this cluster from one other cluster only. Each
    /// cluster of a test needs its own.
    pub gid: Option<u32>,
    /// Appended to discovery's flags.
    pub discovery_flags: Vec<String>,
    /// Appended to the endpoints service's flags.
    pub endpoints_flags: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            induced: true,
            otlp_endpoint: None,
            gated: false,
            local_token_file: None,
            gateway_follows_broker: false,
            gid: None,
            discovery_flags: Vec::new(),
            endpoints_flags: Vec::new(),
        }
    }
}

/// One cluster of real service processes, each on its own etcd.
#[derive(Debug)]
pub struct ProcessCluster {
    pub id: String,
    pub services: Services,
    options: Options,
    // Processes before etcds: fields drop in declaration order, so services die before the
    // stores they write to.
    processes: BTreeMap<Service, ServiceProcess>,
    etcds: BTreeMap<Service, Etcd>,
    /// With [`Options::gated`]: the addresses other clusters are given, by service.
    gates: BTreeMap<Service, Gate>,
    /// Where each service serves `/metrics` (its own port: the default ones are shared by
    /// every cluster on the host).
    metrics: BTreeMap<Service, SocketAddr>,
}

impl ProcessCluster {
    /// Starts six etcds and the six services of cluster `id`. `Ok(None)` when etcd is not
    /// installed (skipped loudly by [`Etcd::start_or_skip`], which fails in CI instead).
    ///
    /// Call from the test's own task (not a spawned one) so that a skip names the test.
    pub async fn start(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
    ) -> anyhow::Result<Option<Self>> {
        Self::start_with(id, pod_cidr, external_cidr, Options::default()).await
    }

    /// Like [`Self::start`], with discovery's `--no-induced`.
    pub async fn start_without_induced(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
    ) -> anyhow::Result<Option<Self>> {
        Self::start_with(
            id,
            pod_cidr,
            external_cidr,
            Options {
                induced: false,
                ..Options::default()
            },
        )
        .await
    }

    /// Like [`Self::start`], with `options`. Ports are picked before the services bind them
    /// (discovery must advertise them first), so another process may take one in between: then
    /// the whole cluster (etcds included) starts again on fresh ports.
    pub async fn start_with(
        id: &str,
        pod_cidr: &str,
        external_cidr: &str,
        options: Options,
    ) -> anyhow::Result<Option<Self>> {
        let mut attempt = 1;
        loop {
            match Self::start_once(id, pod_cidr, external_cidr, options.clone()).await {
                Err(err) if attempt < START_ATTEMPTS && port_taken(&err) => {
                    eprintln!(
                        "{id}: a port was taken before its service bound it, starting again \
                         on fresh ports (attempt {attempt}): {err:#}"
                    );
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
        options: Options,
    ) -> anyhow::Result<Option<Self>> {
        // The first one decides whether to skip (and names the test's thread when it does).
        let Some(first) = Etcd::start_or_skip() else {
            return Ok(None);
        };
        let mut etcds = BTreeMap::new();
        etcds.insert(Service::ALL[0], first);
        let starting: Vec<_> = Service::ALL[1..]
            .iter()
            .map(|&service| {
                tokio::task::spawn_blocking(move || Etcd::start().map(|etcd| (service, etcd)))
            })
            .collect();
        for started in crate::join_all(starting).await {
            let (service, etcd) = started.context("starting an etcd")?;
            etcds.insert(service, etcd);
        }

        let services = Services {
            discovery: crate::free_addr(),
            broker: crate::free_addr(),
            forwarder: crate::free_addr(),
            ipam: crate::free_addr(),
            gateway: crate::free_addr(),
            endpoints: crate::free_addr(),
        };
        let mut gates = BTreeMap::new();
        if options.gated {
            for (service, target) in [
                (Service::Discovery, services.discovery),
                (Service::Broker, services.broker),
                (Service::Forwarder, services.forwarder),
                (Service::Ipam, services.ipam),
                (Service::Endpoints, services.endpoints),
            ] {
                gates.insert(service, Gate::start(target).await?);
            }
        }
        let mut this = Self {
            id: id.to_owned(),
            services,
            options,
            processes: BTreeMap::new(),
            etcds,
            gates,
            metrics: Service::ALL
                .iter()
                .map(|&service| (service, crate::free_addr()))
                .collect(),
        };
        for service in Service::ALL {
            let args = this.args(service, pod_cidr, external_cidr)?;
            let mut env = match &this.options.otlp_endpoint {
                // Short batches, so spans arrive while the test still waits for them.
                Some(endpoint) => vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), endpoint.clone()),
                    ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "100".to_owned()),
                ],
                None => Vec::new(),
            };
            if let Some(file) = &this.options.local_token_file {
                env.push((
                    "TRELLIS_LOCAL_TOKEN_FILE".to_owned(),
                    file.display().to_string(),
                ));
            }
            let process = ServiceProcess::start_as(
                &service.binary(),
                args,
                env,
                this.options.gid,
                this.addr(service),
                service.grpc_service(),
            )
            .await
            .with_context(|| format!("{id}: starting {service}"))?;
            this.processes.insert(service, process);
        }
        Ok(Some(this))
    }

    /// The gRPC address of `service`.
    pub fn addr(&self, service: Service) -> SocketAddr {
        let s = &self.services;
        match service {
            Service::Ipam => s.ipam,
            Service::Gateway => s.gateway,
            Service::Discovery => s.discovery,
            Service::Forwarder => s.forwarder,
            Service::Broker => s.broker,
            Service::Endpoints => self.services.endpoints,
        }
    }

    /// Where `service` serves `/metrics`.
    pub fn metrics_addr(&self, service: Service) -> Option<SocketAddr> {
        self.metrics.get(&service).copied()
    }

    /// Where other clusters reach `service`: its gate with [`Options::gated`], else the
    /// service itself.
    pub fn advertised(&self, service: Service) -> SocketAddr {
        self.gates
            .get(&service)
            .map_or_else(|| self.addr(service), |g| g.addr)
    }

    /// With [`Options::gated`]: cuts the cluster off from every other cluster (`true`), or
    /// heals the partition (`false`). The test still reaches every service directly.
    pub fn partition(&self, cut: bool) {
        assert!(!self.gates.is_empty(), "{}: started without gates", self.id);
        for gate in self.gates.values() {
            if cut {
                gate.close();
            } else {
                gate.open();
            }
        }
    }

    /// With [`Options::gated`]: other clusters' calls to this one's broker hang, unanswered,
    /// until [`ProcessCluster::partition`]`(false)` lets them through: a silent partition that
    /// heals while they are on their way ([`Gate::stall`]). Returns the broker's gate, to see
    /// what waits at it.
    pub fn stall_broker(&self) -> &Gate {
        let gate = self
            .gates
            .get(&Service::Broker)
            .unwrap_or_else(|| panic!("{}: started without gates", self.id));
        gate.stall();
        gate
    }

    /// Cuts this cluster and `other` from each other, and only from each other, until the
    /// returned [`Cut`] is dropped: no process of either reaches a service (or gate) of the
    /// other; both still reach every other cluster. Both must have started with
    /// [`Options::gid`] (distinct); needs root and `nft`.
    pub fn cut_from(&self, other: &ProcessCluster) -> anyhow::Result<Cut> {
        Cut::between(&self.side()?, &other.side()?)
    }

    fn side(&self) -> anyhow::Result<Side> {
        let gid = self
            .options
            .gid
            .with_context(|| format!("{}: started without a group ID", self.id))?;
        let ports = Service::ALL
            .iter()
            .map(|&service| self.addr(service).port())
            .chain(self.gates.values().map(|gate| gate.addr.port()))
            .collect();
        Ok(Side { gid, ports })
    }

    /// The options the cluster started with.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The store prefix of `service`: `trellis/<cluster id>/<service>`.
    pub fn store_prefix(&self, service: Service) -> String {
        format!("trellis/{}/{}", self.id, service.name())
    }

    fn args(
        &self,
        service: Service,
        pod_cidr: &str,
        external_cidr: &str,
    ) -> anyhow::Result<Vec<String>> {
        let s = &self.services;
        let mut args = strings(&[
            "--listen",
            &self.addr(service).to_string(),
            "--store",
            &self.etcd(service)?.url(&self.store_prefix(service)),
            "--cluster-id",
            &self.id,
            "--shutdown-grace",
            "1",
        ]);
        if let Some(metrics) = self.metrics_addr(service) {
            args.extend(strings(&["--metrics-listen", &metrics.to_string()]));
        }
        args.extend(match service {
            Service::Ipam => strings(&["--pod-cidr", pod_cidr, "--external-cidr", external_cidr]),
            Service::Gateway => {
                let mut args = strings(&["--dataplane", "none", "--endpoint-address", "127.0.0.1"]);
                if self.options.gateway_follows_broker {
                    args.extend(strings(&["--broker", &s.broker.to_string()]));
                }
                args
            }
            Service::Discovery => {
                let at = |service| self.advertised(service).to_string();
                let mut args = strings(&[
                    "--advertise-discovery",
                    &at(Service::Discovery),
                    "--advertise-broker",
                    &at(Service::Broker),
                    "--advertise-forwarder",
                    &at(Service::Forwarder),
                    "--advertise-ipam",
                    &at(Service::Ipam),
                    "--advertise-gateway",
                    &s.gateway.to_string(),
                    "--advertise-endpoints",
                    &at(Service::Endpoints),
                    "--neighborhood-resync",
                    "5",
                    "--neighborhood-retry-max",
                    "2",
                ]);
                if !self.options.induced {
                    args.push("--no-induced".to_owned());
                }
                args.extend(self.options.discovery_flags.iter().cloned());
                args
            }
            Service::Forwarder => {
                strings(&["--discovery", &s.discovery.to_string(), "--retry-max", "1"])
            }
            Service::Broker => strings(&[
                "--discovery",
                &s.discovery.to_string(),
                "--ipam",
                &s.ipam.to_string(),
                "--gateway",
                &s.gateway.to_string(),
                "--resync",
                "2",
            ]),
            Service::Endpoints => {
                let mut e = strings(&[
                    "--ipam",
                    &s.ipam.to_string(),
                    "--discovery",
                    &s.discovery.to_string(),
                ]);
                e.extend(self.options.endpoints_flags.iter().cloned());
                e
            }
        });
        if service.faces_other_clusters() {
            // These clusters peer on a closed loopback network, in plaintext.
            args.push(trellis_testkit::PLAINTEXT_PEERING.to_owned());
        }
        Ok(args)
    }

    /// `service`'s own store, opened from the test (to read it, or to play a crash or a lost
    /// store while the service is down).
    pub async fn store(&self, service: Service) -> anyhow::Result<trellis_store::SharedStore> {
        let url = self.etcd(service)?.url(&self.store_prefix(service));
        Ok(trellis_store::open(&url).await?)
    }

    /// Deletes every key of `service`'s store, as a rebuilt etcd would have lost them (the
    /// service is down meanwhile); returns the keys it held, so a test can check there was
    /// something to lose.
    pub async fn wipe_store(&self, service: Service) -> Vec<String> {
        let store = self.store(service).await.expect("opens the store");
        let keys: Vec<String> = store
            .list("")
            .await
            .expect("lists")
            .kvs
            .into_iter()
            .map(|kv| kv.key)
            .collect();
        for key in &keys {
            store.delete(key).await.expect("deletes");
        }
        keys
    }

    /// The etcd `service` keeps its state in.
    pub fn etcd(&self, service: Service) -> anyhow::Result<&Etcd> {
        self.etcds
            .get(&service)
            .with_context(|| format!("{}: no etcd for {service}", self.id))
    }

    /// The process of `service`.
    pub fn process(&self, service: Service) -> anyhow::Result<&ServiceProcess> {
        self.processes
            .get(&service)
            .with_context(|| format!("{}: {service} not started", self.id))
    }

    fn process_mut(&mut self, service: Service) -> anyhow::Result<&mut ServiceProcess> {
        let id = self.id.clone();
        self.processes
            .get_mut(&service)
            .with_context(|| format!("{id}: {service} not started"))
    }

    /// SIGKILLs the etcd behind `service` (its data directory stays).
    pub fn kill9_etcd(&mut self, service: Service) -> anyhow::Result<()> {
        let id = self.id.clone();
        self.etcds
            .get_mut(&service)
            .with_context(|| format!("{id}: no etcd for {service}"))?
            .kill();
        Ok(())
    }

    /// Starts the etcd behind `service` again, on its data directory and ports.
    pub fn restart_etcd(&mut self, service: Service) -> anyhow::Result<()> {
        let id = self.id.clone();
        self.etcds
            .get_mut(&service)
            .with_context(|| format!("{id}: no etcd for {service}"))?
            .restart()
            .with_context(|| format!("{id}: restarting the etcd of {service}"))
    }

    /// Whether the process of `service` has exited (it does not restart by itself).
    pub fn exited(&mut self, service: Service) -> bool {
        self.processes
            .get_mut(&service)
            .is_some_and(ServiceProcess::exited)
    }

    /// SIGKILLs `service` (no shutdown hook; whatever is not in its etcd is lost).
    pub fn kill9(&mut self, service: Service) -> anyhow::Result<()> {
        self.process_mut(service)?.kill9();
        Ok(())
    }

    /// Starts `service` again with the same flags (and etcd) and waits until it serves.
    pub async fn restart(&mut self, service: Service) -> anyhow::Result<()> {
        let id = self.id.clone();
        self.process_mut(service)?
            .restart()
            .await
            .with_context(|| format!("{id}: restarting {service}"))
    }

    /// The last `lines` lines of every service's log, for failure messages.
    pub fn logs(&self, lines: usize) -> String {
        self.processes
            .iter()
            .map(|(service, process)| {
                format!(
                    "----- {} {service} -----\n{}",
                    self.id,
                    process.log_tail(lines)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every key in `service`'s etcd (the whole keyspace, not only the service's prefix), read
    /// with `etcdctl`.
    pub fn etcd_keys(&self, service: Service) -> anyhow::Result<Vec<String>> {
        let etcdctl = trellis_testkit::tool_path("etcdctl")
            .context("etcdctl not found on PATH or in .tools/bin (scripts/setup.sh installs it)")?;
        let mut command = Command::new(etcdctl);
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("ETCDCTL") {
                command.env_remove(name);
            }
        }
        let output = command
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.etcd(service)?.endpoint()))
            .args(["get", "", "--from-key", "--keys-only"])
            .output()
            .context("running etcdctl")?;
        if !output.status.success() {
            bail!(
                "etcdctl get failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect())
    }

    async fn channel(&self, service: Service) -> anyhow::Result<Channel> {
        Ok(
            Channel::from_shared(format!("http://{}", self.addr(service)))?
                .connect()
                .await?,
        )
    }

    pub async fn broker(&self) -> anyhow::Result<BrokerClient<Channel>> {
        Ok(BrokerClient::new(self.channel(Service::Broker).await?))
    }

    /// The broker's TunnelEndpoints, or why it could not be asked: for checks that must not
    /// read an unreachable broker as "no tunnel".
    pub async fn try_tunnel_endpoints(
        &self,
    ) -> anyhow::Result<Vec<trellis_api::pb::types::TunnelEndpoint>> {
        crate::peering::tunnels(self).await
    }

    /// Every TunnelEndpoint the broker lists; none while the broker cannot be reached (a
    /// chaos test reads clusters whose broker may be down).
    pub async fn tunnel_endpoints(&self) -> Vec<trellis_api::pb::types::TunnelEndpoint> {
        self.try_tunnel_endpoints().await.unwrap_or_default()
    }

    pub async fn forwarder(&self) -> anyhow::Result<ForwarderClient<Channel>> {
        Ok(ForwarderClient::new(
            self.channel(Service::Forwarder).await?,
        ))
    }

    pub async fn ipam(&self) -> anyhow::Result<IpamClient<Channel>> {
        Ok(IpamClient::new(self.channel(Service::Ipam).await?))
    }

    pub async fn discovery(&self) -> anyhow::Result<DiscoveryClient<Channel>> {
        Ok(DiscoveryClient::new(
            self.channel(Service::Discovery).await?,
        ))
    }

    pub async fn endpoints(&self) -> anyhow::Result<EndpointMapperClient<Channel>> {
        Ok(EndpointMapperClient::new(
            self.channel(Service::Endpoints).await?,
        ))
    }
}
