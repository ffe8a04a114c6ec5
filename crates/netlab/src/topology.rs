//! The namespaces and links of a multi-cluster topology (DESIGN.md "Local topology for tests"):
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
}

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
}

/// Host `n` of `net`.
pub fn host(net: Ipv4Net, n: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(net.network()) + n)
}

impl Topology {
    /// Builds the internet namespace and one site per `(name, pod CIDR)`. Names are short
    /// (at most 8 characters of `[a-z0-9]`); at most 250 sites.
    pub fn build(sites: &[(&str, &str)]) -> anyhow::Result<Self> {
        if sites.len() > 250 {
            bail!("at most 250 sites on one /24 bridge");
        }
        let run = crate::run_id();
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
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            {
                bail!("site name {name:?}: 1-8 characters of a-z and 0-9");
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
        })
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

    /// Every namespace of the topology (for callers that must know what to clean up).
    pub fn namespaces(&self) -> &Namespaces {
        &self.namespaces
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
