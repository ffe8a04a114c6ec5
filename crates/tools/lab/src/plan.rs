//! The shape of a lab before anything starts: cluster identities, CIDRs and ports.
//!
//! Cluster 0 is `hub`, the others `leaf-1`, `leaf-2`, ... Pod CIDRs are 10.i.0.0/16, or all
//! 10.0.0.0/16 with `--same-pod-cidr`. External CIDRs are always distinct /24s in
//! 100.64.0.0/10: only the pod CIDRs are meant to collide, and 254 leaves remapping each
//! other's pod /16 already take nearly all of the IPAM's default 10.0.0.0/8 pool.

use std::net::{Ipv4Addr, SocketAddr};

use anyhow::bail;
use ipnet::Ipv4Net;

/// Whether a cluster is the hub or a leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Hub,
    Leaf,
}

/// Where one cluster's six services listen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    pub discovery: SocketAddr,
    pub broker: SocketAddr,
    pub forwarder: SocketAddr,
    pub ipam: SocketAddr,
    pub endpoints: SocketAddr,
    pub gateway: SocketAddr,
}

/// With mutual TLS (the default): where a cluster's cluster-facing services take calls from
/// other clusters (their mutual-TLS peer listeners, ADR 0014). Always free ports: the fixed
/// layout has no room for five more per cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerPorts {
    pub discovery: SocketAddr,
    pub broker: SocketAddr,
    pub forwarder: SocketAddr,
    pub ipam: SocketAddr,
    pub endpoints: SocketAddr,
}

impl PeerPorts {
    /// Ports the kernel reports free right now (see [`Ports::free`]).
    pub fn free() -> Self {
        let port = || loopback(trellis_testkit::free_port());
        Self {
            discovery: port(),
            broker: port(),
            forwarder: port(),
            ipam: port(),
            endpoints: port(),
        }
    }

    /// Every address with its service name, in port order.
    pub fn named(&self) -> [(&'static str, SocketAddr); 5] {
        [
            ("discovery", self.discovery),
            ("broker", self.broker),
            ("forwarder", self.forwarder),
            ("ipam", self.ipam),
            ("endpoints", self.endpoints),
        ]
    }
}

/// One cluster of the lab.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterPlan {
    pub index: u16,
    pub id: String,
    pub role: Role,
    pub pod_cidr: Ipv4Net,
    pub external_cidr: Ipv4Net,
    pub ports: Ports,
    /// The peer listeners, with mutual TLS (the default).
    pub peer: Option<PeerPorts>,
    /// The services' `/metrics` listeners (`--metrics-listen`): always free ports, the fixed
    /// layout has no room for six more per cluster.
    pub metrics: Ports,
    /// Where the endpoints service answers `clusterset.local` DNS (`--dns-listen`, UDP and
    /// TCP): BASE+10·index+7 with a fixed `--base-port`, else a free port.
    pub dns: SocketAddr,
}

impl ClusterPlan {
    /// What discovery advertises to other clusters: each service's peer listener with mutual TLS (the default)
    /// (the gateway has none), else its only listener.
    pub fn advertised(&self) -> [(&'static str, SocketAddr); 6] {
        let mut named = self.ports.named();
        if let Some(peer) = &self.peer {
            for (name, addr) in &mut named {
                if let Some((_, facing)) = peer.named().into_iter().find(|(n, _)| n == name) {
                    *addr = facing;
                }
            }
        }
        named
    }

    /// The address other clusters peer with.
    pub fn facing_broker(&self) -> SocketAddr {
        self.peer.map_or(self.ports.broker, |p| p.broker)
    }

    /// New free ports after losing a port race (peer listeners and metrics too).
    pub fn with_free_ports(mut self) -> Self {
        self.ports = Ports::free();
        self.with_other_free_ports()
    }

    /// The same plan with other free ports for the listeners that take free ports even with a
    /// fixed `--base-port` (metrics and peer listeners), since another program may take one
    /// before it is bound.
    pub fn with_other_free_ports(mut self) -> Self {
        self.peer = self.peer.map(|_| PeerPorts::free());
        self.metrics = Ports::free();
        self.dns = loopback(trellis_testkit::free_port());
        self
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

impl Ports {
    /// Cluster `index`'s ports from `base`: BASE+10·index+1 .. +6, in port order.
    fn fixed(base: u16, index: u16) -> anyhow::Result<Self> {
        let first = u32::from(base) + 10 * u32::from(index);
        // The sixth service's port, and the DNS port after it (see `ClusterPlan::dns`).
        if first + 7 > u32::from(u16::MAX) {
            bail!(
                "--base-port {base} leaves no room for cluster {index}'s ports (they would pass \
                 65535); use a lower base port or 0 for free ports"
            );
        }
        let port = |k: u32| loopback((first + k) as u16);
        Ok(Self {
            discovery: port(1),
            broker: port(2),
            forwarder: port(3),
            ipam: port(4),
            endpoints: port(5),
            gateway: port(6),
        })
    }

    /// Ports the kernel reports free right now (another process may still take one before
    /// the service binds it; the caller retries).
    pub fn free() -> Self {
        let port = || loopback(trellis_testkit::free_port());
        Self {
            discovery: port(),
            broker: port(),
            forwarder: port(),
            ipam: port(),
            endpoints: port(),
            gateway: port(),
        }
    }

    /// Every address with its service name, in port order.
    pub fn named(&self) -> [(&'static str, SocketAddr); 6] {
        [
            ("discovery", self.discovery),
            ("broker", self.broker),
            ("forwarder", self.forwarder),
            ("ipam", self.ipam),
            ("endpoints", self.endpoints),
            ("gateway", self.gateway),
        ]
    }
}

/// The clusters of a lab of `clusters` clusters; with `tls`, each with peer listeners.
pub fn plan(
    clusters: u16,
    same_pod_cidr: bool,
    base_port: u16,
    tls: bool,
) -> anyhow::Result<Vec<ClusterPlan>> {
    if !(2..=255).contains(&clusters) {
        bail!("a lab has 2 to 255 clusters (a hub and 1 to 254 leaves), not {clusters}");
    }
    (0..clusters)
        .map(|index| {
            let octet = index as u8;
            let pod = if same_pod_cidr { 0 } else { octet };
            Ok(ClusterPlan {
                index,
                id: if index == 0 {
                    "hub".to_owned()
                } else {
                    format!("leaf-{index}")
                },
                role: if index == 0 { Role::Hub } else { Role::Leaf },
                pod_cidr: Ipv4Net::new(Ipv4Addr::new(10, pod, 0, 0), 16)?,
                external_cidr: Ipv4Net::new(Ipv4Addr::new(100, 64, octet, 0), 24)?,
                ports: if base_port == 0 {
                    Ports::free()
                } else {
                    Ports::fixed(base_port, index)?
                },
                peer: tls.then(PeerPorts::free),
                metrics: Ports::free(),
                // Next to the six services in the fixed layout (BASE+10·index+7), so that the
                // README's `dig` works as printed; free otherwise.
                dns: if base_port == 0 {
                    loopback(trellis_testkit::free_port())
                } else {
                    loopback(u16::try_from(
                        u32::from(base_port) + 10 * u32::from(index) + 7,
                    )?)
                },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hub_gets_the_default_ports_and_leaves_follow_in_steps_of_ten() {
        let p = plan(3, false, 7100, false).expect("plans");
        assert_eq!(p[0].id, "hub");
        assert_eq!(p[0].role, Role::Hub);
        assert_eq!(p[0].ports.discovery.port(), 7101);
        assert_eq!(p[0].ports.gateway.port(), 7106);
        assert_eq!(p[2].id, "leaf-2");
        assert_eq!(p[2].ports.ipam.port(), 7124);
        assert_eq!(p[1].pod_cidr.to_string(), "10.1.0.0/16");
        assert_eq!(p[2].external_cidr.to_string(), "100.64.2.0/24");
    }

    #[test]
    fn same_pod_cidr_collides_pods_but_never_external_cidrs() {
        let p = plan(255, true, 0, false).expect("plans");
        assert!(p.iter().all(|c| c.pod_cidr.to_string() == "10.0.0.0/16"));
        let externals: std::collections::BTreeSet<_> = p.iter().map(|c| c.external_cidr).collect();
        assert_eq!(externals.len(), 255);
    }

    #[test]
    fn refuses_ports_past_the_end_and_bad_sizes() {
        let err = plan(10, false, 65500, false).expect_err("no room");
        assert!(err.to_string().contains("--base-port 65500"), "{err}");
        assert!(plan(1, false, 0, false).is_err());
        assert!(plan(256, false, 0, false).is_err());
    }
}
