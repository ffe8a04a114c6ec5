//! [`Fabric`]: a hub and its leaves, each a [`NsCluster`] in its own site of one [`Topology`],
//! every leaf peered with the hub through the brokers (the hub's token, `Broker.Peer`), plus
//! the probes tests and benchmarks share: TunnelEndpoints per cluster, IPAM views, endpoint
//! reflection through an endpoints service, pings from a pod.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use ipnet::Ipv4Net;
use trellis_api::pb::endpoints::{
    AddressType, Endpoint, EndpointSlice, ListReflectedSlicesRequest, ReflectEndpointSliceRequest,
    TranslationPath,
};
use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::ListTunnelEndpointsRequest;
use trellis_api::pb::types::{ClusterIdentity, PeeringKind};

use crate::cluster::{ClusterOptions, NsCluster, Service, StoreKind};
use crate::nat::{NatKind, NatRouter};
use crate::netns::exec;
use crate::topology::{Pod, Topology, host};

/// What to build.
#[derive(Debug, Clone)]
pub struct FabricOptions {
    /// Cluster IDs, also the site names (1-8 characters of a-z, 0-9).
    pub names: Vec<String>,
    /// Index of the hub in `names`.
    pub hub: usize,
    /// Every cluster's pod CIDR (identical on purpose: the NAT must cope).
    pub pod_cidr: String,
    /// Per-cluster pod CIDRs instead of `pod_cidr`, in `names` order (empty: `pod_cidr` for
    /// all).
    pub pod_cidrs: Vec<String>,
    /// Every cluster's external CIDR.
    pub external_cidr: String,
    /// Discovery's `--no-induced` on the hub: leaves only reach each other through it.
    pub hub_no_induced: bool,
    pub store: StoreKind,
    /// Extra flags per service, for every cluster.
    pub extra_args: Vec<(Service, Vec<String>)>,
    /// Extra flags per service for one cluster (its index in `names`), after `extra_args`.
    pub cluster_args: Vec<(usize, Service, Vec<String>)>,
    /// Nodes per cluster: 1 is the one-namespace topology; more build a node network with a
    /// route agent on every node ([`Topology::build_with_nodes`]).
    pub nodes: usize,
    /// With nodes: per-cluster node networks, in `names` order, instead of `100.64.<n>.0/24`
    /// (empty, or a shorter list: the default for the rest). Each IPAM is told its node
    /// network (`--reserved`), as the deployment does with `TRELLIS_RESERVED`.
    pub node_networks: Vec<String>,
    /// Indices of clusters whose IPAM is *not* told its node network: an operator who left
    /// `TRELLIS_RESERVED` unset.
    pub unreserved: Vec<usize>,
    /// Gateways advertise a DNS name ([`endpoint_name`]) instead of their bridge address; the
    /// names resolve inside every gateway namespace through `/etc/netns/<ns>/hosts` (which
    /// `ip netns exec` mounts over `/etc/hosts`), so each remote gateway resolves them itself.
    pub endpoint_names: bool,
    /// Gateway replicas per cluster (ADR 0023), on nodes 0..gateways: 1 or 2 (the topology
    /// gives each site one more uplink, on node 1). Needs nodes and etcd.
    pub gateways: usize,
    /// The NAT in front of each cluster's WireGuard port, in `names` order ([`crate::nat`];
    /// empty: none anywhere). A cluster behind one advertises its private address. The hub
    /// must be reachable: `none`.
    pub nat: Vec<NatKind>,
    /// Mutual TLS between the clusters ([`ClusterOptions::tls`]); off: plaintext.
    pub tls: bool,
}

/// The gateway's WireGuard port (its default), the one a NAT router translates.
pub const WIREGUARD_PORT: u16 = 51840;

/// The DNS name cluster `id`'s gateway advertises with [`FabricOptions::endpoint_names`]
/// (`.test`: reserved, never in real DNS, RFC 6761).
pub fn endpoint_name(id: &str) -> String {
    format!("gw-{id}.trellis.test")
}

/// `/etc/netns/<ns>/hosts` files, removed (with their directories) on drop.
#[derive(Debug)]
struct HostsFiles {
    dirs: Vec<std::path::PathBuf>,
}

impl HostsFiles {
    /// Writes, for every namespace of `namespaces`, a hosts file naming every `(name, ip)`.
    fn write(namespaces: &[&str], names: &[(String, Ipv4Addr)]) -> anyhow::Result<Self> {
        let mut text = String::from("127.0.0.1 localhost\n::1 localhost\n");
        for (name, ip) in names {
            text.push_str(&format!("{ip} {name}\n"));
        }
        let mut this = Self { dirs: Vec::new() };
        for ns in namespaces {
            let dir = std::path::Path::new("/etc/netns").join(ns);
            // Ours: the namespace of that name was just created by this topology (a
            // leftover file of a killed run is replaced).
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            this.dirs.push(dir.clone());
            std::fs::write(dir.join("hosts"), &text)
                .with_context(|| format!("writing {}/hosts", dir.display()))?;
        }
        Ok(this)
    }
}

impl Drop for HostsFiles {
    fn drop(&mut self) {
        for dir in &self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
        // /etc/netns itself when nothing else is in it (remove_dir refuses otherwise).
        let _ = std::fs::remove_dir("/etc/netns");
    }
}

impl FabricOptions {
    /// Hub `b` with leaves `a` and `c`, all with pod CIDR 10.0.0.0/16 and external CIDR
    /// 10.201.0.0/16, etcd per service, induced peering on.
    pub fn three_clusters() -> Self {
        Self {
            names: ["a", "b", "c"].map(str::to_owned).to_vec(),
            hub: 1,
            pod_cidr: "10.0.0.0/16".into(),
            pod_cidrs: Vec::new(),
            external_cidr: "10.201.0.0/16".into(),
            hub_no_induced: false,
            store: StoreKind::EtcdPerService,
            extra_args: Vec::new(),
            cluster_args: Vec::new(),
            nodes: 1,
            node_networks: Vec::new(),
            unreserved: Vec::new(),
            endpoint_names: false,
            gateways: 1,
            nat: Vec::new(),
            tls: false,
        }
    }
}

/// A pod of cluster `from` reaching a pod of cluster `to` at `address`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reach {
    pub from: usize,
    pub from_pod: Pod,
    pub to: usize,
    pub to_pod: Pod,
    pub address: Ipv4Addr,
}

/// The clusters and their topology. Clusters drop before the topology (field order).
#[derive(Debug)]
pub struct Fabric {
    pub clusters: Vec<NsCluster>,
    /// With [`FabricOptions::endpoint_names`]: the gateway namespaces' hosts files.
    _hosts: Option<HostsFiles>,
    pub topology: Topology,
    /// Index of the hub.
    pub hub: usize,
    /// With [`FabricOptions::nat`]: each cluster's router (or its own uplink), by index.
    pub routers: Vec<NatRouter>,
}

impl Fabric {
    /// Builds the topology, starts every cluster (concurrently) and peers each leaf with the
    /// hub. Returns once the `Peer` calls succeeded; tunnels come up asynchronously.
    pub async fn up(options: FabricOptions) -> anyhow::Result<Self> {
        let fabric = Self::start(options).await?;
        fabric.peer_leaves().await?;
        Ok(fabric)
    }

    /// [`Fabric::up`] without the peering: the topology and every cluster, none peered yet.
    /// For what must be in place before the first peering exists (a benchmark's probes and
    /// watches); [`Fabric::peer_leaves`] then peers them.
    pub async fn start(options: FabricOptions) -> anyhow::Result<Self> {
        if !options.pod_cidrs.is_empty() && options.pod_cidrs.len() != options.names.len() {
            bail!(
                "{} pod CIDRs for {} clusters",
                options.pod_cidrs.len(),
                options.names.len()
            );
        }
        let sites: Vec<(&str, &str)> = options
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let cidr = options.pod_cidrs.get(i).unwrap_or(&options.pod_cidr);
                (n.as_str(), cidr.as_str())
            })
            .collect();
        if !options.nat.is_empty()
            && (options.nat.len() != options.names.len()
                || options.nat.get(options.hub) != Some(&NatKind::None))
        {
            bail!(
                "{} NAT kinds for {} clusters (one each, the hub's `none`)",
                options.nat.len(),
                options.names.len()
            );
        }
        let mut topology = if options.nodes > 1 {
            let networks = options
                .node_networks
                .iter()
                .map(|n| n.parse().with_context(|| format!("node network {n:?}")))
                .collect::<anyhow::Result<Vec<ipnet::Ipv4Net>>>()?;
            Topology::build_with_node_networks(&sites, options.nodes, &networks)?
        } else {
            Topology::build(&sites)?
        };
        let mut routers = Vec::new();
        for (i, kind) in options.nat.iter().enumerate() {
            routers.push(topology.add_nat(i, *kind, WIREGUARD_PORT)?);
        }
        let hosts = if options.endpoint_names {
            let namespaces: Vec<&str> = topology.sites.iter().map(|s| s.gw_ns.as_str()).collect();
            let names: Vec<(String, Ipv4Addr)> = topology
                .sites
                .iter()
                .enumerate()
                .map(|(i, s)| (endpoint_name(&options.names[i]), s.uplink_ip))
                .collect();
            Some(HostsFiles::write(&namespaces, &names)?)
        } else {
            None
        };
        if options.gateways > 2 || (options.gateways == 2 && options.nodes < 2) {
            bail!(
                "{} gateway replicas on {} nodes: netlab runs at most 2, on nodes 0 and 1",
                options.gateways,
                options.nodes
            );
        }
        let mut second_uplinks = Vec::new();
        for i in 0..topology.sites.len() {
            second_uplinks.push(if options.gateways == 2 {
                Some(topology.add_node_uplink(i, 1)?)
            } else {
                None
            });
        }
        let starting = topology.sites.iter().enumerate().map(|(i, site)| {
            let mut o = ClusterOptions::new(&options.names[i], &options.external_cidr);
            if options.endpoint_names {
                o.endpoint_address = Some(endpoint_name(&options.names[i]));
            }
            if let Some(router) = routers.get(i).filter(|r| r.kind != NatKind::None) {
                o.endpoint_address = Some(router.private_ip.to_string());
            }
            o.no_induced = i == options.hub && options.hub_no_induced;
            o.reserve_node_network = !options.unreserved.contains(&i);
            o.store = options.store;
            o.extra_args = options.extra_args.clone();
            o.extra_args.extend(
                options
                    .cluster_args
                    .iter()
                    .filter(|(cluster, ..)| *cluster == i)
                    .map(|(_, service, args)| (*service, args.clone())),
            );
            o.standby_gateways = second_uplinks[i].map(|ip| (1, ip)).into_iter().collect();
            o.tls = options.tls;
            NsCluster::start(site, o)
        });
        let mut clusters = Vec::with_capacity(options.names.len());
        for started in futures::future::join_all(starting).await {
            clusters.push(started?);
        }
        Ok(Self {
            clusters,
            _hosts: hosts,
            topology,
            hub: options.hub,
            routers,
        })
    }

    /// Peers each leaf with the hub, in index order; returns once the `Peer` calls succeeded.
    pub async fn peer_leaves(&self) -> anyhow::Result<()> {
        for leaf in 0..self.clusters.len() {
            if leaf != self.hub {
                self.peer(leaf, self.hub).await?;
            }
        }
        Ok(())
    }

    /// Cluster `from` peers with `to` using `to`'s token.
    pub async fn peer(&self, from: usize, to: usize) -> anyhow::Result<()> {
        trellis_testkit::peering::try_peer(&self.clusters[from], &self.clusters[to]).await?;
        Ok(())
    }

    /// The last lines of every service's log.
    pub fn logs(&self) -> String {
        self.clusters
            .iter()
            .map(|c| c.logs(25))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `(remote cluster ID, kind)` of every TunnelEndpoint `i`'s broker holds, sorted; empty
    /// when the broker does not answer.
    pub async fn tunnel_endpoints(&self, i: usize) -> Vec<(String, PeeringKind)> {
        let Ok(mut broker) = self.clusters[i].broker() else {
            return Vec::new();
        };
        let Ok(r) = broker
            .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
            .await
        else {
            return Vec::new();
        };
        let mut out: Vec<(String, PeeringKind)> = r
            .into_inner()
            .tunnel_endpoints
            .into_iter()
            .filter_map(|t| {
                let kind = PeeringKind::try_from(t.kind).unwrap_or(PeeringKind::Unspecified);
                Some((t.remote?.cluster_id, kind))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Waits until `i`'s broker holds exactly the TunnelEndpoints `expected` (in any order).
    pub async fn wait_tunnel_endpoints(
        &self,
        i: usize,
        expected: &[(&str, PeeringKind)],
        limit: Duration,
    ) -> anyhow::Result<Duration> {
        let mut want: Vec<(String, PeeringKind)> = expected
            .iter()
            .map(|(id, kind)| ((*id).to_owned(), *kind))
            .collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        let started = Instant::now();
        loop {
            let seen = self.tunnel_endpoints(i).await;
            if seen == want {
                return Ok(started.elapsed());
            }
            if started.elapsed() > limit {
                bail!(
                    "{}: tunnel endpoints {seen:?}, expected {want:?}\n{}",
                    self.clusters[i].id,
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until every cluster holds exactly the tunnels of a mesh around the hub: full
    /// between the hub and each leaf, induced between every two leaves.
    pub async fn wait_mesh(&self, limit: Duration) -> anyhow::Result<()> {
        for i in 0..self.clusters.len() {
            let expected: Vec<(&str, PeeringKind)> = (0..self.clusters.len())
                .filter(|&o| o != i)
                .map(|o| {
                    let kind = if i == self.hub || o == self.hub {
                        PeeringKind::Full
                    } else {
                        PeeringKind::Induced
                    };
                    (self.clusters[o].id.as_str(), kind)
                })
                .collect();
            self.wait_tunnel_endpoints(i, &expected, limit).await?;
        }
        Ok(())
    }

    /// The WireGuard endpoint cluster `i` sends to for cluster `j` (from `i`'s TunnelEndpoint
    /// for `j`): `j`'s bridge address and its port for `i`.
    pub async fn wireguard_endpoint(
        &self,
        i: usize,
        j: usize,
    ) -> anyhow::Result<std::net::SocketAddr> {
        let text = self.published_endpoint(i, j).await?;
        text.parse().with_context(|| format!("endpoint {text:?}"))
    }

    /// The WireGuard endpoint of `j` as `i`'s TunnelEndpoint carries it ("ip:port", or
    /// "name:port" with [`FabricOptions::endpoint_names`]).
    pub async fn published_endpoint(&self, i: usize, j: usize) -> anyhow::Result<String> {
        let id = &self.clusters[j].id;
        let tes = self.clusters[i]
            .broker()?
            .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
            .await
            .context("ListTunnelEndpoints")?
            .into_inner()
            .tunnel_endpoints;
        let te = tes
            .iter()
            .find(|t| t.remote.as_ref().is_some_and(|r| &r.cluster_id == id))
            .with_context(|| format!("{} has no tunnel endpoint for {id}", self.clusters[i].id))?;
        Ok(te.remote_endpoint.clone())
    }

    /// The address a pod of cluster `from` uses for `to`'s pod `pod_ip`: the same host bits in
    /// `from`'s view of `to`'s pod CIDR.
    pub async fn pod_address(
        &self,
        from: usize,
        to: usize,
        pod_ip: Ipv4Addr,
    ) -> anyhow::Result<Ipv4Addr> {
        let view = self.view(from, to, false).await?;
        let site = &self.topology.sites[to];
        let offset = u32::from(pod_ip) - u32::from(site.pod_cidr.network());
        Ok(Ipv4Addr::from(u32::from(view.network()) + offset))
    }

    /// How `viewer`'s IPAM addresses `remote`'s pod CIDR (or external CIDR).
    pub async fn view(
        &self,
        viewer: usize,
        remote: usize,
        external: bool,
    ) -> anyhow::Result<Ipv4Net> {
        let clusters = self.clusters[viewer]
            .ipam()?
            .list_cluster_subnets(ListClusterSubnetsRequest {})
            .await
            .context("ListClusterSubnets")?
            .into_inner()
            .clusters;
        let id = &self.clusters[remote].id;
        let c = clusters
            .iter()
            .find(|c| &c.cluster_id == id)
            .with_context(|| format!("{} has no mapping for {id}", self.clusters[viewer].id))?;
        let text = if external {
            &c.remote_external_cidr_nat
        } else {
            &c.remote_pod_cidr_nat
        };
        text.parse().with_context(|| format!("CIDR {text:?}"))
    }

    /// `via`'s endpoints service reflects the slice `shop/web`, holding `home`'s pod as `via`
    /// addresses it, to `target`, delivered to `target`'s endpoints service. Returns the path
    /// and the address `target` holds (what its pods would use).
    pub async fn reflect_pod(
        &self,
        via: usize,
        home: usize,
        target: usize,
    ) -> anyhow::Result<(TranslationPath, Ipv4Addr)> {
        let original = if via == home {
            self.topology.sites[home].pod_ip
        } else {
            host(
                self.view(via, home, false).await?,
                crate::topology::POD_HOST,
            )
        };
        let answer = self.clusters[via]
            .endpoints()?
            .reflect_endpoint_slice(ReflectEndpointSliceRequest {
                target: Some(ClusterIdentity {
                    cluster_id: self.clusters[target].id.clone(),
                    cluster_name: String::new(),
                }),
                slice: Some(EndpointSlice {
                    namespace: "shop".into(),
                    name: "web".into(),
                    service_name: "web".into(),
                    address_type: AddressType::Ipv4.into(),
                    endpoints: vec![Endpoint {
                        addresses: vec![original.to_string()],
                        ..Default::default()
                    }],
                    ports: vec![],
                    labels: Default::default(),
                    service: None,
                }),
                deliver: true,
            })
            .await
            .context("ReflectEndpointSlice")?
            .into_inner();
        if !answer.delivered {
            bail!("the reflection was not delivered: {answer:?}");
        }
        let t = answer.translations.first().context("no translation")?;
        let path = TranslationPath::try_from(t.path).context("path")?;
        let held = self.clusters[target]
            .endpoints()?
            .list_reflected_slices(ListReflectedSlicesRequest {
                source_cluster_id: self.clusters[via].id.clone(),
                namespace: "shop".into(),
            })
            .await
            .context("ListReflectedSlices")?
            .into_inner()
            .reflected_slices;
        let address = held
            .first()
            .and_then(|r| r.slice.as_ref())
            .and_then(|s| s.endpoints.first())
            .and_then(|e| e.addresses.first())
            .context("the target holds no reflected address")?;
        if address != &t.translated_address {
            bail!(
                "the target holds {address}, the source translated to {}",
                t.translated_address
            );
        }
        Ok((path, address.parse().context("reflected address")?))
    }

    /// Every ordered pair of pods in different clusters, with the address the first uses for
    /// the second: the second pod's host bits in the first cluster's view of the second's pod
    /// CIDR (what `Ipam.MapEndpointIp` answers).
    pub async fn reach(&self) -> anyhow::Result<Vec<Reach>> {
        let mut out = Vec::new();
        for (from, from_site) in self.topology.sites.iter().enumerate() {
            for (to, to_site) in self.topology.sites.iter().enumerate() {
                if from == to {
                    continue;
                }
                let view = self.view(from, to, false).await?;
                for from_pod in from_site.pods() {
                    for to_pod in to_site.pods() {
                        let offset = u32::from(to_pod.ip) - u32::from(to_site.pod_cidr.network());
                        out.push(Reach {
                            from,
                            from_pod: from_pod.clone(),
                            to,
                            to_pod: to_pod.clone(),
                            address: Ipv4Addr::from(u32::from(view.network()) + offset),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// `ping -n <args> <to>` from site `from`'s pod.
    pub fn ping(
        &self,
        from: usize,
        to: Ipv4Addr,
        args: &[&str],
    ) -> anyhow::Result<std::process::Output> {
        let target = to.to_string();
        let mut all: Vec<&str> = vec!["-n"];
        all.extend_from_slice(args);
        all.push(&target);
        exec(&self.topology.sites[from].pod_ns, "ping", &all)
    }

    /// Pings from `from`'s pod until one answer; how long that took.
    pub async fn wait_ping(
        &self,
        from: usize,
        to: Ipv4Addr,
        bound: Duration,
    ) -> anyhow::Result<Duration> {
        let started = Instant::now();
        loop {
            if self
                .ping(from, to, &["-c", "1", "-W", "1"])?
                .status
                .success()
            {
                return Ok(started.elapsed());
            }
            if started.elapsed() > bound {
                bail!(
                    "{} cannot reach {to} within {bound:?}:\n{}",
                    self.clusters[from].id,
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Pings `to` from the namespace `pod_ns` until one answer or `bound`; whether it answered. For
/// tests that expect a path to come back (or to stay gone) rather than measure how soon.
pub async fn reaches(pod_ns: &str, to: Ipv4Addr, bound: Duration) -> bool {
    let started = Instant::now();
    loop {
        let out = exec(
            pod_ns,
            "ping",
            &["-n", "-c", "1", "-W", "1", &to.to_string()],
        )
        .expect("ping runs");
        if out.status.success() {
            return true;
        }
        if started.elapsed() > bound {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
