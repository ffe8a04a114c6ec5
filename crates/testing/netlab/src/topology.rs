//! The namespaces and links of a multi-cluster topology (docs/architecture.md):
//!
//! ```text
//!   pod ns of A            gateway ns of A                 "internet" ns
//!  [eth0 10.0.0.10] --veth-- [pod 10.0.0.1 | wan 192.0.2.1] --veth-- [p0 ┐
//!                                                                        br0
//!  [eth0 10.0.0.10] --veth-- [pod 10.0.0.1 | wan 192.0.2.2] --veth-- [p1 ┘ ...
//! ```
//!
//! Each cluster ("site") gets a gateway namespace with an uplink `wan` on the bridge (192.0.2.N,
//! N = index + 1) and a pod namespace whose `eth0` holds host 10 of the cluster's pod CIDR, with
//! a default route via host 1 on the gateway's `pod` interface. Pod CIDRs may be identical
//! across sites (that is the point). Per-link latency is added by [`crate::netem`] on the `wan`
//! interfaces.

use std::net::Ipv4Addr;

use anyhow::{Context as _, bail};
use ipnet::Ipv4Net;

use crate::netns::{Namespaces, exec, ip};

/// Name of the uplink interface in every gateway namespace.
pub const UPLINK: &str = "wan";
/// Name of the gateway's interface towards its pod namespace.
pub const POD_LINK: &str = "pod";
/// Name of the bridge in the internet namespace.
pub const BRIDGE: &str = "br0";
/// Host number of the pod in its cluster's pod CIDR.
pub const POD_HOST: u32 = 10;
/// Host number of the gateway's pod-side address.
pub const GATEWAY_POD_HOST: u32 = 1;

/// One cluster's namespaces and addresses.
#[derive(Debug, Clone)]
pub struct Site {
    /// Short name (used in namespace names).
    pub name: String,
    /// Index in the topology.
    pub index: usize,
    /// Namespace of the gateway (and, with [`crate::cluster`], of every service of the cluster).
    pub gw_ns: String,
    /// Namespace of the cluster's one pod.
    pub pod_ns: String,
    /// The gateway's address on the bridge.
    pub uplink_ip: Ipv4Addr,
    /// The bridge port (in the internet namespace) of this site's uplink.
    pub bridge_port: String,
    /// The cluster's pod CIDR.
    pub pod_cidr: Ipv4Net,
    /// The pod's address.
    pub pod_ip: Ipv4Addr,
    /// The gateway's address in the pod CIDR (the pod's default route).
    pub gateway_pod_ip: Ipv4Addr,
    /// With [`Topology::build_with_nodes`]: the cluster's nodes, node 0 being the gateway
    /// namespace; empty in the one-namespace topology.
    pub nodes: Vec<Node>,
    /// With nodes: the cluster's node network (100.64.<index + 1>.0/24 unless
    /// [`Topology::build_with_node_networks`] chose another); `None` without nodes.
    pub node_network: Option<Ipv4Net>,
}

/// One node of a cluster built with [`Topology::build_with_nodes`]: a namespace on the
/// cluster's node network (a bridge in the site's own namespace), owning the `index`-th /24 of
/// the pod CIDR, with one pod namespace behind it.
#[derive(Debug, Clone)]
pub struct Node {
    /// `n0`, `n1`, ... (the node name the services and agents are given).
    pub name: String,
    pub index: usize,
    pub netns: String,
    /// The node's address on the node network: host `index + 1` of it (100.64.<site +
    /// 1>.<index + 1> by default).
    pub node_ip: Ipv4Addr,
    /// The node's slice of the pod CIDR.
    pub pod_slice: Ipv4Net,
    /// The node's pod.
    pub pod_ns: String,
    pub pod_ip: Ipv4Addr,
}

/// A pod namespace: the site's one pod, or a node's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    /// `pod-<node index>` (`pod-0` for the one-namespace topology).
    pub name: String,
    /// The node it runs on (`n0` is the gateway namespace).
    pub node: String,
    pub netns: String,
    pub ip: Ipv4Addr,
}

impl Site {
    /// The site's pods: one per node, or the one pod behind the gateway.
    pub fn pods(&self) -> Vec<Pod> {
        if self.nodes.is_empty() {
            return vec![Pod {
                name: "pod-0".to_owned(),
                node: "n0".to_owned(),
                netns: self.pod_ns.clone(),
                ip: self.pod_ip,
            }];
        }
        self.nodes
            .iter()
            .map(|n| Pod {
                name: format!("pod-{}", n.index),
                node: n.name.clone(),
                netns: n.pod_ns.clone(),
                ip: n.pod_ip,
            })
            .collect()
    }
}

/// Name of every node's interface on its cluster's node network.
pub const NODE_LINK: &str = "node";
/// Name of the node-network bridge in each site's own namespace.
pub const NODE_BRIDGE: &str = "nodes";

/// Byte and packet counters of an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
}

/// A built topology; every namespace is deleted on drop.
#[derive(Debug)]
pub struct Topology {
    /// The run identifier in every namespace name.
    pub run: String,
    /// Namespace holding the bridge.
    pub inet_ns: String,
    /// The sites, by index.
    pub sites: Vec<Site>,
    namespaces: Namespaces,
    /// Held until the namespaces are gone (fields drop in order).
    _claim: crate::owner::Claim,
}

/// Host `n` of `net`.
pub fn host(net: Ipv4Net, n: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(net.network()) + n)
}

impl Topology {
    /// Builds the internet namespace and one site per `(name, pod CIDR)`. Names are short
    /// (at most 8 characters of `[a-z0-9-]`); at most 250 sites.
    pub fn build(sites: &[(&str, &str)]) -> anyhow::Result<Self> {
        if sites.len() > 250 {
            bail!("at most 250 sites on one /24 bridge");
        }
        let run = crate::run_id();
        // Claimed before any namespace exists, so none is ever taken for a leftover.
        let claim = crate::owner::claim(&run)?;
        let mut namespaces = Namespaces::default();
        let inet_ns = format!("tl{run}-inet");
        namespaces.add(&inet_ns)?;
        ip(&["-n", &inet_ns, "link", "add", BRIDGE, "type", "bridge"])?;
        ip(&["-n", &inet_ns, "link", "set", BRIDGE, "up"])?;
        let mut built = Vec::with_capacity(sites.len());
        for (index, (name, pod_cidr)) in sites.iter().enumerate() {
            if name.is_empty()
                || name.len() > 8
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                bail!("site name {name:?}: 1-8 characters of a-z, 0-9 and -");
            }
            let pod_cidr: Ipv4Net = pod_cidr
                .parse()
                .with_context(|| format!("pod CIDR {pod_cidr:?} of {name}"))?;
            let index_u8 = u8::try_from(index + 1).context("too many sites")?;
            let site = Site {
                name: (*name).to_owned(),
                index,
                gw_ns: format!("tl{run}-{name}-gw"),
                pod_ns: format!("tl{run}-{name}-pod"),
                uplink_ip: Ipv4Addr::new(192, 0, 2, index_u8),
                bridge_port: format!("p{index}"),
                pod_cidr,
                pod_ip: host(pod_cidr, POD_HOST),
                gateway_pod_ip: host(pod_cidr, GATEWAY_POD_HOST),
                nodes: Vec::new(),
                node_network: None,
            };
            namespaces.add(&site.gw_ns)?;
            namespaces.add(&site.pod_ns)?;
            wire(&inet_ns, &site)?;
            built.push(site);
        }
        Ok(Self {
            run,
            inet_ns,
            sites: built,
            namespaces,
            _claim: claim,
        })
    }

    /// Like [`Topology::build`], with `nodes` nodes per site (1 to 16; pod CIDRs of at least
    /// /20 so every node owns a /24): node 0 is the gateway namespace (with the uplink), every
    /// node has a pod, and the nodes route each other's pod slices over the node network (a
    /// plain host-routed pod network). Nothing routes remote clusters' ranges from a node other
    /// than node 0: that is the route agent's job.
    pub fn build_with_nodes(sites: &[(&str, &str)], nodes: usize) -> anyhow::Result<Self> {
        Self::build_with_node_networks(sites, nodes, &[])
    }

    /// Like [`Topology::build_with_nodes`], with site `i` on node network `node_networks[i]`
    /// instead of 100.64.<i + 1>.0/24 (a missing entry keeps the default). A node network may
    /// be any range with room for the nodes, one that overlaps another cluster's pod CIDR
    /// included: that is what such a topology is for (a peer's range on our nodes' network).
    pub fn build_with_node_networks(
        sites: &[(&str, &str)],
        nodes: usize,
        node_networks: &[Ipv4Net],
    ) -> anyhow::Result<Self> {
        if !(1..=16).contains(&nodes) {
            bail!("1 to 16 nodes per site, not {nodes}");
        }
        if node_networks.len() > sites.len() {
            bail!(
                "{} node networks for {} sites",
                node_networks.len(),
                sites.len()
            );
        }
        let mut topology = Self::build(sites)?;
        for site in &mut topology.sites {
            if site.pod_cidr.prefix_len() > 20 {
                bail!(
                    "{}: pod CIDR {} is smaller than a /20",
                    site.name,
                    site.pod_cidr
                );
            }
            let network = match node_networks.get(site.index) {
                Some(net) => net.trunc(),
                None => {
                    let octet = u8::try_from(site.index + 1).context("too many sites")?;
                    Ipv4Net::new(Ipv4Addr::new(100, 64, octet, 0), 24)?
                }
            };
            // Hosts 1..=nodes, and neither the network nor the broadcast address.
            let room = (1u64 << (32 - u32::from(network.prefix_len()))).saturating_sub(2);
            if room < nodes as u64 {
                bail!(
                    "{}: node network {network} has no room for {nodes} nodes",
                    site.name
                );
            }
            if network.contains(&site.uplink_ip)
                || network.contains(&site.pod_cidr)
                || site.pod_cidr.contains(&network)
            {
                bail!(
                    "{}: node network {network} overlaps the site's own uplink or pod CIDR",
                    site.name
                );
            }
            site.node_network = Some(network);
            add_nodes(&mut topology.namespaces, &topology.run, site, nodes)?;
        }
        Ok(topology)
    }

    /// The site called `name`.
    pub fn site(&self, name: &str) -> anyhow::Result<&Site> {
        self.sites
            .iter()
            .find(|s| s.name == name)
            .with_context(|| format!("no site {name}"))
    }

    /// Counters of site `index`'s uplink, read in its gateway namespace.
    pub fn uplink_counters(&self, index: usize) -> anyhow::Result<Counters> {
        let site = self.sites.get(index).context("no such site")?;
        link_counters(&site.gw_ns, UPLINK)
    }

    /// Brings site `index`'s bridge port up or down (cuts it off the internet).
    pub fn set_uplink(&self, index: usize, up: bool) -> anyhow::Result<()> {
        let site = self.sites.get(index).context("no such site")?;
        ip(&[
            "-n",
            &self.inet_ns,
            "link",
            "set",
            &site.bridge_port,
            if up { "up" } else { "down" },
        ])
        .map(drop)
    }

    /// Gives node `node` of site `site` an uplink `wan` of its own on the internet bridge, at
    /// 192.0.2.(128 + site index): a second public address of the cluster, where a gateway
    /// moved to that node is reached. Sites 0 to 119 only (the bridge is one /24).
    pub fn add_node_uplink(&self, site: usize, node: usize) -> anyhow::Result<Ipv4Addr> {
        let s = self.sites.get(site).context("no such site")?;
        let n = s.nodes.get(node).context("no such node")?;
        if node == 0 {
            bail!("node 0 holds the site's uplink already");
        }
        let octet = u8::try_from(128 + site)
            .ok()
            .filter(|o| *o < 248)
            .context("second uplinks exist for sites 0 to 119 only")?;
        let address = Ipv4Addr::new(192, 0, 2, octet);
        let port = format!("u{site}");
        let cidr = format!("{address}/24");
        let (ns, inet) = (n.netns.as_str(), self.inet_ns.as_str());
        for args in [
            vec![
                "-n", ns, "link", "add", UPLINK, "type", "veth", "peer", "name", &port, "netns",
                inet,
            ],
            vec!["-n", inet, "link", "set", &port, "master", BRIDGE, "up"],
            vec!["-n", ns, "addr", "add", &cidr, "dev", UPLINK],
            vec!["-n", ns, "link", "set", UPLINK, "up"],
        ] {
            ip(&args).with_context(|| format!("an uplink for {} of {}", n.name, s.name))?;
        }
        Ok(address)
    }

    /// Every namespace of the topology (for callers that must know what to clean up).
    pub fn namespaces(&self) -> &Namespaces {
        &self.namespaces
    }

    /// For what adds namespaces to a built topology (the NAT routers), so they go with it.
    pub(crate) fn namespaces_mut(&mut self) -> &mut Namespaces {
        &mut self.namespaces
    }
}

fn wire(inet_ns: &str, site: &Site) -> anyhow::Result<()> {
    let (gw, pod, port) = (&site.gw_ns, &site.pod_ns, &site.bridge_port);
    let uplink = format!("{}/24", site.uplink_ip);
    let gw_pod = format!("{}/{}", site.gateway_pod_ip, site.pod_cidr.prefix_len());
    let pod_addr = format!("{}/{}", site.pod_ip, site.pod_cidr.prefix_len());
    let gw_pod_ip = site.gateway_pod_ip.to_string();
    for args in [
        vec![
            "-n", gw, "link", "add", UPLINK, "type", "veth", "peer", "name", port, "netns", inet_ns,
        ],
        vec!["-n", inet_ns, "link", "set", port, "master", BRIDGE, "up"],
        vec!["-n", gw, "addr", "add", &uplink, "dev", UPLINK],
        vec!["-n", gw, "link", "set", UPLINK, "up"],
        vec![
            "-n", gw, "link", "add", POD_LINK, "type", "veth", "peer", "name", "eth0", "netns", pod,
        ],
        vec!["-n", gw, "addr", "add", &gw_pod, "dev", POD_LINK],
        vec!["-n", gw, "link", "set", POD_LINK, "up"],
        vec!["-n", pod, "addr", "add", &pod_addr, "dev", "eth0"],
        vec!["-n", pod, "link", "set", "eth0", "up"],
        vec!["-n", pod, "route", "add", "default", "via", &gw_pod_ip],
    ] {
        ip(&args).with_context(|| format!("wiring site {}", site.name))?;
    }
    Ok(())
}

/// Turns `site` into `count` nodes: node 0 is its gateway namespace, whose pod link shrinks to
/// the first /24 of the pod CIDR; every other node gets a namespace and a pod of its own.
fn add_nodes(
    namespaces: &mut Namespaces,
    run: &str,
    site: &mut Site,
    count: usize,
) -> anyhow::Result<()> {
    let net_ns = format!("tl{run}-{}-net", site.name);
    namespaces.add(&net_ns)?;
    ip(&["-n", &net_ns, "link", "add", NODE_BRIDGE, "type", "bridge"])?;
    ip(&["-n", &net_ns, "link", "set", NODE_BRIDGE, "up"])?;
    let network = site
        .node_network
        .context("a site with nodes has a node network")?;
    let mut nodes = Vec::with_capacity(count);
    for index in 0..count {
        let k = u8::try_from(index).context("too many nodes")?;
        let slice = Ipv4Net::new(
            Ipv4Addr::from(u32::from(site.pod_cidr.network()) + (u32::from(k) << 8)),
            24,
        )?;
        let (netns, pod_ns) = if index == 0 {
            (site.gw_ns.clone(), site.pod_ns.clone())
        } else {
            let netns = format!("tl{run}-{}-n{index}", site.name);
            let pod_ns = format!("tl{run}-{}-p{index}", site.name);
            namespaces.add(&netns)?;
            namespaces.add(&pod_ns)?;
            (netns, pod_ns)
        };
        let node = Node {
            name: format!("n{index}"),
            index,
            netns,
            node_ip: host(network, u32::from(k) + 1),
            pod_slice: slice,
            pod_ns,
            pod_ip: host(slice, POD_HOST),
        };
        wire_node(&net_ns, site, &node)?;
        nodes.push(node);
    }
    // The host-routed pod network: every node reaches every other node's slice through that
    // node's address, and the gateway's service addresses (the uplink) through node 0.
    for node in &nodes {
        for other in nodes.iter().filter(|o| o.index != node.index) {
            ip(&[
                "-n",
                &node.netns,
                "route",
                "add",
                &other.pod_slice.to_string(),
                "via",
                &other.node_ip.to_string(),
            ])?;
        }
        if node.index != 0 {
            ip(&[
                "-n",
                &node.netns,
                "route",
                "add",
                &format!("{}/32", site.uplink_ip),
                "via",
                &nodes[0].node_ip.to_string(),
            ])?;
        }
        crate::netns::exec(&node.netns, "sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
    }
    site.nodes = nodes;
    Ok(())
}

fn wire_node(net_ns: &str, site: &Site, node: &Node) -> anyhow::Result<()> {
    let ns = node.netns.as_str();
    let port = format!("n{}", node.index);
    let node_addr = format!(
        "{}/{}",
        node.node_ip,
        site.node_network.map_or(24, |n| n.prefix_len())
    );
    let gw = host(node.pod_slice, GATEWAY_POD_HOST);
    let gw_addr = format!("{gw}/24");
    let pod_addr = format!("{}/24", node.pod_ip);
    let gw_ip = gw.to_string();
    let mut steps: Vec<Vec<&str>> = vec![
        vec![
            "-n", ns, "link", "add", NODE_LINK, "type", "veth", "peer", "name", &port, "netns",
            net_ns,
        ],
        vec![
            "-n",
            net_ns,
            "link",
            "set",
            &port,
            "master",
            NODE_BRIDGE,
            "up",
        ],
        vec!["-n", ns, "addr", "add", &node_addr, "dev", NODE_LINK],
        vec!["-n", ns, "link", "set", NODE_LINK, "up"],
    ];
    let (pod, pod_ns) = (POD_LINK, node.pod_ns.as_str());
    let site_prefix = format!("{}/{}", site.gateway_pod_ip, site.pod_cidr.prefix_len());
    if node.index == 0 {
        // The one-namespace wiring gave the gateway the whole pod CIDR; node 0 owns one /24.
        steps.extend([
            vec!["-n", ns, "addr", "del", &site_prefix, "dev", pod],
            vec!["-n", ns, "addr", "add", &gw_addr, "dev", pod],
            vec!["-n", pod_ns, "route", "del", "default"],
            vec!["-n", pod_ns, "addr", "flush", "dev", "eth0"],
            vec!["-n", pod_ns, "addr", "add", &pod_addr, "dev", "eth0"],
            vec!["-n", pod_ns, "route", "add", "default", "via", &gw_ip],
        ]);
    } else {
        steps.extend([
            vec![
                "-n", ns, "link", "add", pod, "type", "veth", "peer", "name", "eth0", "netns",
                pod_ns,
            ],
            vec!["-n", ns, "addr", "add", &gw_addr, "dev", pod],
            vec!["-n", ns, "link", "set", pod, "up"],
            vec!["-n", pod_ns, "addr", "add", &pod_addr, "dev", "eth0"],
            vec!["-n", pod_ns, "link", "set", "eth0", "up"],
            vec!["-n", pod_ns, "route", "add", "default", "via", &gw_ip],
        ]);
    }
    for args in steps {
        ip(&args).with_context(|| format!("wiring node {} of {}", node.name, site.name))?;
    }
    Ok(())
}

/// Counters of `dev` in namespace `ns` (`ip -s -j link show`).
pub fn link_counters(ns: &str, dev: &str) -> anyhow::Result<Counters> {
    let json = ip(&["-n", ns, "-s", "-j", "link", "show", "dev", dev])?;
    let v: serde_json::Value = serde_json::from_str(&json).context("parsing ip -j output")?;
    let stats = &v[0]["stats64"];
    let get = |dir: &str, what: &str| {
        stats[dir][what]
            .as_u64()
            .with_context(|| format!("no {dir}.{what} for {dev} in {ns}"))
    };
    Ok(Counters {
        rx_bytes: get("rx", "bytes")?,
        tx_bytes: get("tx", "bytes")?,
        rx_packets: get("rx", "packets")?,
        tx_packets: get("tx", "packets")?,
    })
}

/// Round-trip times of `count` pings from `ns` to `target`, `interval` apart (seconds; below
/// 0.2 needs root), in milliseconds, in the order they were answered; lost pings are missing.
pub fn ping_rtts(
    ns: &str,
    target: Ipv4Addr,
    count: u32,
    interval: f64,
) -> anyhow::Result<Vec<f64>> {
    let out = exec(
        ns,
        "ping",
        &[
            "-n",
            "-c",
            &count.to_string(),
            "-i",
            &interval.to_string(),
            "-W",
            "2",
            &target.to_string(),
        ],
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|l| l.split("time=").nth(1))
        .filter_map(|t| t.split_whitespace().next()?.parse::<f64>().ok())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_offsets_in_the_cidr() {
        let net: Ipv4Net = "10.0.0.0/16".parse().expect("net");
        assert_eq!(host(net, POD_HOST), Ipv4Addr::new(10, 0, 0, 10));
        assert_eq!(host(net, GATEWAY_POD_HOST), Ipv4Addr::new(10, 0, 0, 1));
    }

    #[test]
    fn run_ids_fit_in_namespace_and_interface_names() {
        let id = crate::run_id();
        assert_eq!(id.len(), 6, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
