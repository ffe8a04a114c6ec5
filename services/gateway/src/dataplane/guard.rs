//! The tunnel guard, its own nftables table `ip trellis-guard` (kept apart from the NAT table
//! in [`super::nft`] so each is replaced whole and independently): what a peer may reach
//! through its tunnel once the gateway runs on a node, with the node's and the cluster's
//! addresses one routing decision away.
//!
//! Per tunnel interface, after the NAT table's DNAT (the forward and input hooks see the
//! translated destination):
//! - forward: replies and related packets (ICMP errors) of known connections pass; a new
//!   connection passes only to our real pod CIDR and to the hub-path targets mapped for that
//!   peer (where its hub-path DNAT leads); everything else (node addresses, the service CIDR,
//!   the control plane, other peers' ranges, and the addresses of our external CIDR that no
//!   mapping for the peer uses, which nothing holds and the node would route out of its
//!   default route) is dropped;
//! - input: the gateway node itself answers nothing that arrives through a tunnel except
//!   replies to what it sent (the handshake kick, probes).
//! - forward, first of all: a connection a peer opened (its conntrack mark says which peer)
//!   arrives only from a tunnel and is answered only into one. Normally the routing makes that
//!   so; this rule matters where it cannot: on the node of a replica killed a moment ago, whose
//!   tunnels are gone while its conntrack entries and NAT table stay. Until the route agents
//!   move to the new active, our pods' packets still reach that node; translated by the stale
//!   entries and with no tunnel to take, they were routed back to our own pods (the peer's real
//!   range is often ours) and reset the very connections the new active had been handed.
//!
//! A drop in any table is final, so this table needs no coordination with the NAT table.

use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;

use crate::names::MARK_MASK;

/// Name of the guard table (family `ip`).
pub const TABLE: &str = "trellis-guard";

/// What one tunnel may reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelGuard {
    pub interface: String,
    /// Destination ranges new connections from the tunnel may reach.
    pub allowed: Vec<IpNet>,
    /// Whether the peer's connections live in a conntrack zone of their own (every peer with
    /// a slot): then none of its packets may leave from the default zone.
    pub zoned: bool,
}

/// The script replacing the guard table with one for `tunnels` (just removing it when there
/// are none).
pub fn script(tunnels: &[TunnelGuard]) -> String {
    let mut s = format!("table ip {TABLE} {{}}\ndelete table ip {TABLE}\n");
    if tunnels.is_empty() {
        return s;
    }
    let _ = writeln!(s, "table ip {TABLE} {{");
    s.push_str("  chain forward {\n    type filter hook forward priority filter; policy accept;\n");
    let interfaces: Vec<String> = tunnels
        .iter()
        .map(|t| format!("\"{}\"", t.interface))
        .collect();
    let interfaces = interfaces.join(", ");
    let _ = writeln!(
        s,
        "    ct direction original ct mark and {MARK_MASK:#010x} != 0x00000000 iifname != {{ {interfaces} }} drop"
    );
    let _ = writeln!(
        s,
        "    ct direction reply ct mark and {MARK_MASK:#010x} != 0x00000000 oifname != {{ {interfaces} }} drop"
    );
    let zoned: Vec<String> = tunnels
        .iter()
        .filter(|t| t.zoned)
        .map(|t| format!("\"{}\"", t.interface))
        .collect();
    if !zoned.is_empty() {
        let _ = writeln!(s, "    oifname {{ {} }} ct zone 0 drop", zoned.join(", "));
    }
    // One set lookup for every tunnel's established traffic, one map lookup for where each
    // tunnel's new connections may go: per-tunnel rules were walked one by one by every packet,
    // a cost that grew with the hub's peers (ADR 0033).
    let _ = writeln!(
        s,
        "    iifname {{ {interfaces} }} ct state established,related accept"
    );
    let verdicts: Vec<String> = tunnels
        .iter()
        .enumerate()
        .map(|(i, t)| format!("\"{}\" : jump {}", t.interface, from_chain(i)))
        .collect();
    let _ = writeln!(s, "    iifname vmap {{ {} }}", verdicts.join(", "));
    s.push_str("  }\n");
    s.push_str("  chain input {\n    type filter hook input priority filter; policy accept;\n");
    let _ = writeln!(
        s,
        "    iifname {{ {interfaces} }} ct state established,related accept"
    );
    let _ = writeln!(s, "    iifname {{ {interfaces} }} drop");
    s.push_str("  }\n");
    for (i, t) in tunnels.iter().enumerate() {
        let _ = writeln!(s, "  chain {} {{", from_chain(i));
        // An interval set refuses overlapping elements: a hub-path target inside the pod CIDR
        // would otherwise fail the whole script.
        let v4: Vec<IpNet> = t
            .allowed
            .iter()
            .filter(|n| n.addr().is_ipv4())
            .copied()
            .collect();
        let allowed: Vec<String> = IpNet::aggregate(&v4)
            .iter()
            .map(ToString::to_string)
            .collect();
        if !allowed.is_empty() {
            let _ = writeln!(s, "    ip daddr {{ {} }} accept", allowed.join(", "));
        }
        s.push_str("    drop\n  }\n");
    }
    s.push_str("}\n");
    s
}

/// The chain holding what new connections from the `index`th tunnel may reach (named by
/// position: interface names need not be valid chain names).
fn from_chain(index: usize) -> String {
    format!("from_tunnel_{index}")
}

/// The destinations of hub-path DNAT entries as single-address ranges.
pub fn hosts(targets: impl IntoIterator<Item = IpAddr>) -> Vec<IpNet> {
    let mut out: Vec<IpNet> = targets.into_iter().map(IpNet::from).collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tunnel that may open nothing (only its other rules are looked at).
    fn tunnel(interface: &str, zoned: bool) -> TunnelGuard {
        TunnelGuard {
            interface: interface.into(),
            allowed: vec![],
            zoned,
        }
    }

    #[test]
    fn each_tunnel_reaches_only_its_allowed_destinations_and_established_traffic() {
        let s = script(&[
            TunnelGuard {
                interface: "tga".into(),
                allowed: vec![
                    "10.0.0.0/16".parse().expect("net"),
                    "10.83.0.10/32".parse().expect("net"),
                    // Inside the pod CIDR: merged into it, as the interval set requires.
                    "10.0.3.7/32".parse().expect("net"),
                ],
                zoned: true,
            },
            tunnel("tgb", true),
        ]);
        assert!(s.starts_with("table ip trellis-guard {}\ndelete table ip trellis-guard\n"));
        let est = s
            .find("iifname { \"tga\", \"tgb\" } ct state established,related accept")
            .expect(&s);
        let dispatch = s
            .find("iifname vmap { \"tga\" : jump from_tunnel_0, \"tgb\" : jump from_tunnel_1 }")
            .expect(&s);
        assert!(est < dispatch, "{s}");
        let from_a = s.find("chain from_tunnel_0 {").expect(&s);
        let from_b = s.find("chain from_tunnel_1 {").expect(&s);
        assert!(
            s[from_a..from_b].contains("ip daddr { 10.0.0.0/16, 10.83.0.10/32 } accept\n    drop"),
            "{s}"
        );
        // A tunnel allowed nothing opens nothing.
        assert!(
            s[from_b..].starts_with("chain from_tunnel_1 {\n    drop\n  }"),
            "{s}"
        );
        let input = s.find("hook input").expect(&s);
        assert!(
            s[input..from_a].contains("iifname { \"tga\", \"tgb\" } drop"),
            "{s}"
        );
    }

    #[test]
    fn a_peers_connection_only_enters_from_and_leaves_into_a_tunnel() {
        let s = script(&[tunnel("tga", true), tunnel("tgb", true)]);
        let first = s.find("hook forward").expect(&s);
        let original = s
            .find(
                "ct direction original ct mark and 0xffff0000 != 0x00000000 \
                 iifname != { \"tga\", \"tgb\" } drop",
            )
            .expect(&s);
        let reply = s
            .find(
                "ct direction reply ct mark and 0xffff0000 != 0x00000000 \
                 oifname != { \"tga\", \"tgb\" } drop",
            )
            .expect(&s);
        let per_tunnel = s.find("ct state established,related accept").expect(&s);
        assert!(
            first < original && original < per_tunnel && reply < per_tunnel,
            "{s}"
        );
    }

    #[test]
    fn nothing_enters_a_zoned_peers_tunnel_from_the_default_zone() {
        let s = script(&[tunnel("tga", true), tunnel("tgz", false)]);
        let zone = s.find("oifname { \"tga\" } ct zone 0 drop").expect(&s);
        let per_tunnel = s.find("ct state established,related accept").expect(&s);
        assert!(
            s.find("hook forward").expect(&s) < zone && zone < per_tunnel,
            "{s}"
        );
        assert!(!s.contains("\"tgz\" } ct zone"), "{s}");
    }

    #[test]
    fn no_tunnels_only_removes_the_table() {
        assert_eq!(
            script(&[]),
            "table ip trellis-guard {}\ndelete table ip trellis-guard\n"
        );
    }
}
