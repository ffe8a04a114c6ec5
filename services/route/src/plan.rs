//! What a node should look like, from one routes update of its gateway ([`RoutesUpdate`]):
//! pure, so every rule of the node path is unit-tested without root.
//!
//! - Every node has the VXLAN device, with the overlay address 240.b.c.d/8 derived from its node
//!   IP a.b.c.d (unique per node on one node network, outside every range the IPAM hands out).
//! - A node that is not the gateway node points the VXLAN at the gateway node and routes every
//!   remote prefix via the gateway node's overlay address, with the route MTU of the tunnel:
//!   nested encapsulation (VXLAN, then WireGuard) must never need fragmentation.
//! - The gateway node's VXLAN has no fixed remote (it answers whichever node sent, so it learns
//!   their addresses), and it routes nothing into it: its tunnels already carry the remote
//!   prefixes. Every other node's VXLAN learns nothing: all it sends goes to the gateway node.
//! - A remote prefix that overlaps a network of the node itself is never routed, clamped or
//!   guarded ([`refuse`]): a route for it would take the node's own traffic (its node network,
//!   the overlay's underlay included) away from it.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use trellis_error::{Error, Result};

use crate::remote::{GatewayIp, RoutesUpdate};

/// VXLAN's overhead over IPv4: outer IP 20 + UDP 8 + VXLAN 8 + inner Ethernet 14.
pub const VXLAN_OVERHEAD: u32 = 50;

/// The node's own, fixed settings.
#[derive(Debug, Clone)]
pub struct NodeSettings {
    pub name: String,
    pub ip: Ipv4Addr,
    pub interface: String,
    pub vxlan_id: u32,
    pub vxlan_port: u16,
    pub underlay_mtu: u32,
    /// Where the node's `net` sysctls are (`--proc-sys-net`).
    pub proc_sys_net: std::path::PathBuf,
    /// The node network (`--node-cidrs`, else the network of the node IP's address): the only
    /// senders the gateway node's overlay accepts, and never routed as a remote prefix.
    pub node_cidrs: Vec<Ipv4Net>,
    /// Where the reconciliation reports the prefixes it refused.
    pub refused: crate::node::Refused,
}

/// The VXLAN device as it must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vxlan {
    pub id: u32,
    pub port: u16,
    pub local: Ipv4Addr,
    /// The gateway node, on every other node; `None` on the gateway node.
    pub remote: Option<Ipv4Addr>,
    pub mtu: u32,
    pub address: Ipv4Net,
    /// Its MAC address, derived from the node IP ([`overlay_mac`]): every node knows the
    /// gateway node's without asking (no ARP to wait for when the gateway moves).
    pub mac: String,
    /// Whether the device learns where inner addresses are from the frames it receives: on
    /// the gateway node only, which must answer every node; elsewhere the default entry
    /// towards the gateway node serves everything, and learning would only let a forged
    /// frame redirect replies.
    pub learning: bool,
}

/// The whole wanted state of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub gateway_node: String,
    pub is_gateway_node: bool,
    pub vxlan: Vxlan,
    /// Remote prefixes routed into the overlay (empty on the gateway node).
    pub routes: BTreeSet<Ipv4Net>,
    /// Next hop of those routes: the gateway node's overlay address.
    pub via: Option<Ipv4Addr>,
    /// The gateway node's overlay MAC, a permanent neighbour entry for `via`.
    pub via_mac: Option<String>,
    /// MTU of those routes (and the TCP MSS clamp's basis).
    pub route_mtu: u32,
    /// Every remote prefix, for the MSS clamp and the node guard (also on the gateway node).
    pub clamp: BTreeSet<Ipv4Net>,
}

/// The overlay address of the node with node IP `ip`: 240.b.c.d.
pub fn overlay_ip(ip: Ipv4Addr) -> Ipv4Addr {
    let [_, b, c, d] = ip.octets();
    Ipv4Addr::new(240, b, c, d)
}

/// The overlay MAC of the node with node IP `a.b.c.d`: 02:f0:a:b:c:d (locally administered,
/// unique per node IP).
pub fn overlay_mac(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("02:f0:{a:02x}:{b:02x}:{c:02x}:{d:02x}")
}

/// The wanted state for `node` after `update`; an error names the message field that is
/// unusable here (the gateway sent something this agent cannot apply: nothing is changed).
pub fn plan(node: &NodeSettings, update: &RoutesUpdate) -> Result<Wanted> {
    let is_gateway_node = update.gateway_node == node.name;
    let gateway_ip = match &update.gateway_ip {
        GatewayIp::V4(ip) => *ip,
        GatewayIp::Unusable(_) if is_gateway_node => node.ip,
        GatewayIp::Unusable(text) => {
            return Err(Error::invalid(
                "gateway_node_ip",
                format!(
                    "{text:?} is not an IP address: the gateway runs without --node-ip, so no node \
                     can reach it"
                ),
            ));
        }
    };
    let prefixes = update.remote_prefixes.clone();
    let overlay_mtu = node.underlay_mtu.saturating_sub(VXLAN_OVERHEAD);
    let route_mtu = match update.tunnel_mtu {
        None => overlay_mtu,
        Some(tunnel) => tunnel.min(overlay_mtu),
    };
    let address = Ipv4Net::new(overlay_ip(node.ip), 8)
        .map_err(|e| Error::Internal(format!("overlay address: {e}")))?;
    Ok(Wanted {
        gateway_node: update.gateway_node.clone(),
        is_gateway_node,
        vxlan: Vxlan {
            id: node.vxlan_id,
            port: node.vxlan_port,
            local: node.ip,
            remote: (!is_gateway_node).then_some(gateway_ip),
            mtu: overlay_mtu,
            address,
            learning: is_gateway_node,
            mac: overlay_mac(node.ip),
        },
        routes: if is_gateway_node {
            BTreeSet::new()
        } else {
            prefixes.clone()
        },
        via: (!is_gateway_node).then(|| overlay_ip(gateway_ip)),
        via_mac: (!is_gateway_node).then(|| overlay_mac(gateway_ip)),
        route_mtu,
        clamp: prefixes,
    })
}

/// `wanted` without the remote prefixes that overlap one of the node's own networks
/// (`(interface or flag, network)` each), and those refused prefixes, each with the first
/// network it overlaps. Refused prefixes are neither routed, nor clamped, nor in the node
/// guard (whose "no new connection from a remote prefix" would cut the node off its own
/// network).
pub fn refuse(
    wanted: &Wanted,
    own: &[(String, Ipv4Net)],
) -> (Wanted, BTreeMap<Ipv4Net, (String, Ipv4Net)>) {
    let refused: BTreeMap<Ipv4Net, (String, Ipv4Net)> = wanted
        .clamp
        .iter()
        .filter_map(|prefix| {
            own.iter()
                .find(|(_, net)| net.contains(prefix) || prefix.contains(net))
                .map(|hit| (*prefix, hit.clone()))
        })
        .collect();
    let mut kept = wanted.clone();
    kept.routes.retain(|p| !refused.contains_key(p));
    kept.clamp.retain(|p| !refused.contains_key(p));
    (kept, refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, ip: [u8; 4]) -> NodeSettings {
        NodeSettings {
            name: name.into(),
            ip: Ipv4Addr::from(ip),
            interface: "trellis-vx".into(),
            vxlan_id: 7107,
            vxlan_port: 4800,
            underlay_mtu: 1500,
            proc_sys_net: "/proc/sys/net".into(),
            node_cidrs: vec!["100.64.1.0/24".parse().expect("net")],
            refused: crate::node::Refused::default(),
        }
    }

    fn net(s: &str) -> Ipv4Net {
        s.parse().expect("net")
    }

    #[test]
    fn prefixes_overlapping_a_network_of_the_node_are_refused_whole() {
        let wanted = plan(
            &node("n1", [10, 9, 0, 2]),
            &message(&["10.9.0.0/16", "10.9.4.0/24", "10.8.0.0/15", "10.83.0.0/16"]),
        )
        .expect("plans");
        let own = vec![
            ("node".to_owned(), net("10.9.0.0/16")),
            ("trellis-vx".to_owned(), net("240.0.0.0/8")),
        ];
        let (kept, refused) = refuse(&wanted, &own);
        // Equal, inside and around the node network: all three would take its traffic.
        let refused: Vec<String> = refused
            .iter()
            .map(|(p, (i, n))| format!("{p} {i} {n}"))
            .collect();
        assert_eq!(
            refused,
            [
                "10.8.0.0/15 node 10.9.0.0/16",
                "10.9.0.0/16 node 10.9.0.0/16",
                "10.9.4.0/24 node 10.9.0.0/16"
            ]
        );
        let routes: Vec<String> = kept.routes.iter().map(ToString::to_string).collect();
        assert_eq!(routes, ["10.83.0.0/16"]);
        assert_eq!(
            kept.clamp, kept.routes,
            "nor clamped, nor in the node guard"
        );
        assert_eq!(kept.vxlan, wanted.vxlan);
        // Nothing of the node's overlaps: nothing changes.
        let (same, none) = refuse(&wanted, &own[1..]);
        assert_eq!((same, none.len()), (wanted, 0));
    }

    #[test]
    fn only_the_gateway_nodes_overlay_learns() {
        let n = node("n1", [100, 64, 1, 2]);
        assert!(!plan(&n, &message(&[])).expect("plans").vxlan.learning);
        let g = node("n0", [100, 64, 1, 1]);
        assert!(plan(&g, &message(&[])).expect("plans").vxlan.learning);
    }

    fn message(prefixes: &[&str]) -> RoutesUpdate {
        RoutesUpdate {
            epoch: 1,
            gateway_node: "n0".into(),
            gateway_ip: GatewayIp::V4(Ipv4Addr::new(100, 64, 1, 1)),
            remote_prefixes: prefixes.iter().map(|p| net(p).trunc()).collect(),
            tunnel_mtu: Some(1420),
        }
    }

    #[test]
    fn a_node_routes_every_remote_prefix_to_the_gateway_nodes_overlay_address() {
        let wanted = plan(
            &node("n1", [100, 64, 1, 2]),
            &message(&["10.83.0.0/16", "10.81.0.0/16"]),
        )
        .expect("plans");
        assert!(!wanted.is_gateway_node);
        assert_eq!(wanted.vxlan.remote, Some(Ipv4Addr::new(100, 64, 1, 1)));
        assert_eq!(wanted.vxlan.address.to_string(), "240.64.1.2/8");
        assert_eq!(wanted.via, Some(Ipv4Addr::new(240, 64, 1, 1)));
        assert_eq!(wanted.vxlan.mtu, 1450);
        assert_eq!(wanted.route_mtu, 1420, "the tunnel is the narrower hop");
        let routes: Vec<String> = wanted.routes.iter().map(ToString::to_string).collect();
        assert_eq!(routes, ["10.81.0.0/16", "10.83.0.0/16"]);
    }

    #[test]
    fn the_gateway_node_receives_but_routes_nothing_into_the_overlay() {
        let wanted =
            plan(&node("n0", [100, 64, 1, 1]), &message(&["10.83.0.0/16"])).expect("plans");
        assert!(wanted.is_gateway_node);
        assert_eq!(wanted.vxlan.remote, None);
        assert!(wanted.routes.is_empty());
        assert_eq!(wanted.clamp.len(), 1, "its own pods' SYNs are clamped too");
    }

    #[test]
    fn a_small_underlay_shrinks_the_route_mtu() {
        let mut n = node("n1", [100, 64, 1, 2]);
        n.underlay_mtu = 1400;
        let wanted = plan(&n, &message(&[])).expect("plans");
        assert_eq!((wanted.vxlan.mtu, wanted.route_mtu), (1350, 1350));
    }

    #[test]
    fn a_gateway_without_a_node_ip_is_unusable_except_on_its_own_node() {
        let mut m = message(&[]);
        m.gateway_ip = GatewayIp::Unusable(String::new());
        let err = plan(&node("n1", [100, 64, 1, 2]), &m).expect_err("no gateway ip");
        assert!(err.to_string().contains("gateway_node_ip"), "{err}");
        let wanted = plan(&node("n0", [100, 64, 1, 1]), &m).expect("the gateway node itself");
        assert!(wanted.is_gateway_node);
    }
}
