//! The data plane: what one peer's tunnel needs ([`PeerPlan`]), and the Linux reconciler that
//! makes the network namespace match a set of plans ([`linux::Linux`]). Root only.
//!
//! - [`engine`]: the userspace WireGuard engine (one UDP port, one TUN interface per peer);
//! - [`wireguard`]: one WireGuard interface per peer (a peer of the engine, or kernel);
//! - [`nft`]: the `ip trellis` nftables table (double NAT, connection marks);
//! - [`guard`]: the `ip trellis-guard` table (what a peer may reach through its tunnel);
//! - `cmd` (from `trellis_runtime`): `ip`/`nft` invocations and sysctls;
//! - [`linux`]: the reconciler tying them together, with routes and policy-routing rules.

pub(crate) use trellis_runtime::cmd;
pub mod engine;
pub mod guard;
pub mod linux;
pub mod nft;
pub mod wireguard;

use std::net::IpAddr;
use std::path::Path;

use ipnet::IpNet;
use trellis_api::model::TunnelEndpoint;

use self::engine::translate::{Rewrite, Translation};
use crate::config::DataplaneFlag;
use crate::mappings::HubMapping;
use crate::names;

/// The data plane actually in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Control plane only.
    None,
    Userspace,
    Kernel,
}

impl Mode {
    /// Resolves `--dataplane`: `auto` is kernel when the wireguard module is loaded (the
    /// kernel does not autoload it for netlink in every setup), userspace otherwise.
    pub fn resolve(flag: DataplaneFlag) -> Self {
        match flag {
            DataplaneFlag::None => Self::None,
            DataplaneFlag::Userspace => Self::Userspace,
            DataplaneFlag::Kernel => Self::Kernel,
            DataplaneFlag::Auto if Path::new("/sys/module/wireguard").exists() => Self::Kernel,
            DataplaneFlag::Auto => Self::Userspace,
        }
    }
}

/// Everything needed to build the tunnel to one peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPlan {
    pub endpoint: std::sync::Arc<TunnelEndpoint>,
    /// The peer's slot: a number unique among our peers, persisted in the store, that is its
    /// connection mark and routing table (and, in kernel mode, its listen port).
    pub slot: u16,
    /// The UDP port the peer sends to: the engine's one port in userspace mode, the slot in
    /// kernel mode.
    pub listen_port: u16,
    pub interface: String,
    /// Whether the tunnel uses ADR 0032's stateless wire convention: we translate what we
    /// send into the peer's terms and the peer sends in ours, so nothing of the peer's needs
    /// a conntrack zone, NAT or a mark here (both sides offered it, ADR 0034).
    pub stateless: bool,
}

fn dedup(nets: impl IntoIterator<Item = IpNet>) -> Vec<IpNet> {
    let mut out: Vec<IpNet> = Vec::new();
    for n in nets {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

impl PeerPlan {
    /// The CIDRs routed into the peer's interface: the peer's ranges as we address them.
    pub fn routed(&self) -> Vec<IpNet> {
        let te = &self.endpoint;
        dedup([te.remote_nat.pod_cidr_nat, te.remote_nat.external_cidr_nat])
    }

    /// WireGuard AllowedIPs: the routed CIDRs (our packets to the peer carry those
    /// destinations), plus the peer's *real* ranges: NAT happens on ingress at the receiver,
    /// so packets from the peer arrive with its real source addresses, and the replies we
    /// send back through the tunnel (after conntrack un-NATs them) go to those real addresses.
    /// With one interface per peer, overlapping real ranges of different peers never meet in
    /// one cryptokey routing table.
    ///
    /// Under the stateless convention the peer sends from its ranges as we address them, and
    /// our replies leave translated: the routed CIDRs are all it may use.
    pub fn allowed_ips(&self) -> Vec<IpNet> {
        let te = &self.endpoint;
        if self.stateless {
            return self.routed();
        }
        dedup(
            self.routed()
                .into_iter()
                .chain([te.remote_pod_cidr, te.remote_external_cidr]),
        )
    }

    /// The peer's connection mark.
    pub fn mark(&self) -> u32 {
        names::mark(self.slot)
    }

    /// The peer's policy-routing table.
    pub fn table(&self) -> u32 {
        names::table(self.slot)
    }

    /// Hub-path DNAT for traffic from this peer: for every external-CIDR mapping handed to
    /// the peer, `(the address the peer uses, the destination as we address it)`. The peer
    /// addresses our external CIDR through its own view of it (`local_nat.external_cidr_nat`),
    /// so the external address is rebased onto that view (same host bits).
    /// Under the stateless convention the peer translated it into our real address already.
    pub fn hub_dnat(&self, hub: &[HubMapping]) -> Vec<(IpAddr, IpAddr)> {
        let te = &self.endpoint;
        hub.iter()
            .filter(|m| m.clusters.contains(&te.remote.id))
            .filter_map(|m| {
                if self.stateless {
                    return Some((m.external_ip, m.destination));
                }
                let seen = rebase(
                    m.external_ip,
                    te.local_external_cidr,
                    te.local_nat.external_cidr_nat,
                )?;
                Some((seen, m.destination))
            })
            .collect()
    }

    /// The peer's part of the nftables table.
    pub fn nat(&self, hub: &[HubMapping]) -> nft::PeerNat {
        let te = &self.endpoint;
        nft::PeerNat {
            interface: self.interface.clone(),
            mark: self.mark(),
            hub_dnat: self.hub_dnat(hub),
            stateless: self.stateless,
            dnat: vec![
                (te.local_nat.pod_cidr_nat, te.local_pod_cidr),
                (te.local_nat.external_cidr_nat, te.local_external_cidr),
            ],
            snat: vec![
                (te.remote_pod_cidr, te.remote_nat.pod_cidr_nat),
                (te.remote_external_cidr, te.remote_nat.external_cidr_nat),
            ],
        }
    }

    /// What the engine rewrites in what it sends the peer under the stateless convention: our
    /// real ranges into how the peer addresses them, our views of the peer into its real ranges
    /// (IPv4, identities left out); `None` under the old one.
    pub fn translation(&self) -> Option<Translation> {
        if !self.stateless {
            return None;
        }
        let te = &self.endpoint;
        let rewrites = |pairs: [(IpNet, IpNet); 2]| {
            pairs
                .into_iter()
                .filter(|(from, to)| from != to)
                .filter_map(|pair| match pair {
                    (IpNet::V4(from), IpNet::V4(to)) => Rewrite::new(from, to),
                    _ => None,
                })
                .collect()
        };
        Some(Translation {
            source: rewrites([
                (te.local_pod_cidr, te.local_nat.pod_cidr_nat),
                (te.local_external_cidr, te.local_nat.external_cidr_nat),
            ]),
            destination: rewrites([
                (te.remote_nat.pod_cidr_nat, te.remote_pod_cidr),
                (te.remote_nat.external_cidr_nat, te.remote_external_cidr),
            ]),
        })
    }
}

impl PeerPlan {
    /// What new connections from this peer's tunnel may reach: where its DNAT maps lead to
    /// something of ours, i.e. our real pod CIDR and the hub-path targets mapped for it. Not
    /// our real external CIDR: the mapped addresses of it were already DNAT'ed to their
    /// targets, and any other address of it is held by nothing, so the node would route it
    /// out of its default route with the peer's source translated.
    pub fn guard(&self, hub: &[HubMapping]) -> guard::TunnelGuard {
        let te = &self.endpoint;
        let mut allowed = vec![te.local_pod_cidr];
        allowed.extend(guard::hosts(
            self.hub_dnat(hub).into_iter().map(|(_, target)| target),
        ));
        guard::TunnelGuard {
            interface: self.interface.clone(),
            allowed: dedup(allowed),
            zoned: !self.stateless && nft::zone(self.mark()) != 0,
        }
    }
}

/// The hub-path source NAT, `(destination, external address)` per mapping: a connection that
/// was DNAT'ed to a mapping's destination leaves with the mapping's external address as its
/// source. The destination's gateway only accepts sources in our real pod or external CIDR
/// from our tunnel (its AllowedIPs) and addresses our external CIDR through its own view, so
/// its replies come back to us, where conntrack undoes both translations (ADR 0008).
pub fn hub_snat(hub: &[HubMapping]) -> Vec<(IpAddr, IpAddr)> {
    hub.iter()
        .filter(|m| m.external_ip.is_ipv4() && m.destination.is_ipv4())
        .map(|m| (m.destination, m.external_ip))
        .collect()
}

/// `ip` moved from `from` into `to` with the same host bits; `None` when `ip` is not in `from`
/// or the prefix lengths or families differ.
pub fn rebase(ip: IpAddr, from: IpNet, to: IpNet) -> Option<IpAddr> {
    if !from.contains(&ip) || from.prefix_len() != to.prefix_len() {
        return None;
    }
    match (ip, from, to) {
        (IpAddr::V4(ip), IpNet::V4(from), IpNet::V4(to)) => {
            let host = u32::from(ip) & !u32::from(from.netmask());
            Some(IpAddr::V4((u32::from(to.network()) | host).into()))
        }
        (IpAddr::V6(ip), IpNet::V6(from), IpNet::V6(to)) => {
            let host = u128::from(ip) & !u128::from(from.netmask());
            Some(IpAddr::V6((u128::from(to.network()) | host).into()))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use trellis_api::model::{NatView, PeeringKind, WgKey};
    use trellis_api::{ClusterId, ClusterIdentity};

    fn net(s: &str) -> IpNet {
        s.parse().expect("net")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    fn plan(remote: &str) -> PeerPlan {
        PeerPlan {
            endpoint: std::sync::Arc::new(TunnelEndpoint {
                remote: ClusterIdentity::parse("id", remote, "name", remote).expect("id"),
                kind: PeeringKind::Full,
                via: None,
                local_pod_cidr: net("10.0.0.0/16"),
                local_external_cidr: net("10.201.0.0/16"),
                local_nat: NatView {
                    pod_cidr_nat: net("10.82.0.0/16"),
                    external_cidr_nat: net("10.92.0.0/16"),
                },
                remote_pod_cidr: net("10.0.0.0/16"),
                remote_external_cidr: net("10.201.0.0/16"),
                remote_nat: NatView {
                    pod_cidr_nat: net("10.81.0.0/16"),
                    external_cidr_nat: net("10.91.0.0/16"),
                },
                remote_endpoint: "192.0.2.1:51840".parse().expect("endpoint"),
                remote_public_key: WgKey::parse(
                    "k",
                    "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=",
                )
                .expect("key"),
                remote_candidates: Vec::new(),
                stateless_wire: false,
                generation: 1,
            }),
            slot: 51841,
            listen_port: 51840,
            interface: "tg01234567".into(),
            stateless: false,
        }
    }

    /// Under the stateless convention the peer's tunnel accepts our views of it only, its
    /// table has no NAT and no zone for it, the hub path is keyed by our real external
    /// addresses, and the engine translates our ranges into the peer's view of them and our
    /// views of the peer into its real ranges.
    #[test]
    fn a_stateless_peer_is_translated_by_the_engine_and_left_alone_by_the_kernel() {
        let stateless = PeerPlan {
            stateless: true,
            ..plan("a")
        };
        assert_eq!(
            stateless.allowed_ips(),
            vec![net("10.81.0.0/16"), net("10.91.0.0/16")]
        );
        let hub = [mapping("10.201.3.7", "10.100.0.9", &["a"])];
        assert_eq!(
            stateless.hub_dnat(&hub),
            vec![(ip("10.201.3.7"), ip("10.100.0.9"))]
        );
        assert!(stateless.nat(&hub).stateless);
        assert!(!stateless.guard(&hub).zoned);
        let translation = stateless.translation().expect("a translation");
        let rewrite = |from: &str, to: &str| {
            let v4 = |s: &str| s.parse::<ipnet::Ipv4Net>().expect("net");
            Rewrite::new(v4(from), v4(to)).expect("same length")
        };
        assert_eq!(
            translation.source,
            vec![
                rewrite("10.0.0.0/16", "10.82.0.0/16"),
                rewrite("10.201.0.0/16", "10.92.0.0/16")
            ]
        );
        assert_eq!(
            translation.destination,
            vec![
                rewrite("10.81.0.0/16", "10.0.0.0/16"),
                rewrite("10.91.0.0/16", "10.201.0.0/16")
            ]
        );
        assert_eq!(plan("a").translation(), None);
    }

    fn mapping(external: &str, destination: &str, clusters: &[&str]) -> HubMapping {
        HubMapping {
            external_ip: ip(external),
            destination: ip(destination),
            clusters: clusters
                .iter()
                .map(|c| ClusterId::parse("id", c).expect("id"))
                .collect::<BTreeSet<_>>(),
        }
    }

    #[test]
    fn hub_dnat_uses_the_peers_view_and_only_mappings_handed_to_it() {
        let hub = [
            mapping("10.201.3.7", "10.83.0.10", &["a"]),
            mapping("10.201.0.9", "10.83.0.11", &["c"]),
            // Outside our external CIDR: not ours to translate.
            mapping("10.99.0.1", "10.83.0.12", &["a"]),
        ];
        assert_eq!(
            plan("a").hub_dnat(&hub),
            vec![(ip("10.92.3.7"), ip("10.83.0.10"))]
        );
        assert_eq!(
            hub_snat(&hub[..1]),
            vec![(ip("10.83.0.10"), ip("10.201.3.7"))]
        );
    }

    #[test]
    fn the_guard_admits_our_pods_and_the_peers_mapped_targets_only() {
        let hub = [
            mapping("10.201.3.7", "10.83.0.10", &["a"]),
            // Mapped for another peer: not a's to reach.
            mapping("10.201.0.9", "10.83.0.11", &["c"]),
        ];
        let guard = plan("a").guard(&hub);
        assert_eq!(guard.interface, "tg01234567");
        // Our real external CIDR is absent: DNAT already sent the mapped addresses to their
        // targets, so anything else of it is an unmapped address the node would route out of
        // its default route.
        assert_eq!(
            guard.allowed,
            vec![net("10.0.0.0/16"), net("10.83.0.10/32")],
            "the guard of a peer holds our pod CIDR and its mapped hub targets, nothing else"
        );
    }

    #[test]
    fn rebase_keeps_host_bits_and_refuses_mismatches() {
        assert_eq!(
            rebase(ip("10.1.2.3"), net("10.1.0.0/16"), net("10.9.0.0/16")),
            Some(ip("10.9.2.3"))
        );
        assert_eq!(
            rebase(ip("10.2.2.3"), net("10.1.0.0/16"), net("10.9.0.0/16")),
            None
        );
        assert_eq!(
            rebase(ip("10.1.2.3"), net("10.1.0.0/16"), net("10.9.0.0/24")),
            None
        );
    }
}
