//! Which of a peer's ranges are routed into its tunnel. A range overlapping a network of the
//! node itself is never routed (it would take the node's own traffic) but refused, logged once
//! and counted; and only the active replica routes at all, so turning active or standby adds
//! or removes the routes of every peer in one `ip -batch`.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use anyhow::Context as _;
use ipnet::IpNet;
use trellis_api::ClusterId;

use super::rules::is_ours;
use super::{Linux, peer_labels};
use crate::dataplane::cmd::{self, ip};

/// `routed` split into the ranges that may be routed and those overlapping one of the node's
/// own networks (`own`: `(interface, network)`), each refused one with the network it overlaps.
pub fn refuse(
    routed: &[IpNet],
    own: &[(String, IpNet)],
) -> (Vec<IpNet>, Vec<(IpNet, String, IpNet)>) {
    let mut kept = Vec::new();
    let mut refused = Vec::new();
    for net in routed {
        match own
            .iter()
            .find(|(_, mine)| trellis_api::net::overlaps(*net, *mine))
        {
            Some((interface, mine)) => refused.push((*net, interface.clone(), *mine)),
            None => kept.push(*net),
        }
    }
    (kept, refused)
}

impl Linux {
    /// The networks of the node's addresses, but our tunnel devices'.
    pub(super) async fn own_networks(&self) -> anyhow::Result<Vec<(String, IpNet)>> {
        let text = ip(&["-j", "addr", "show"]).await?;
        Ok(trellis_api::net::address_networks(&text)
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .filter(|(interface, _)| !is_ours(&self.prefix, interface))
            .collect())
    }

    /// Records the ranges of peer `id` refused in this configuration, warning once per change.
    pub(super) fn record_refused(
        &mut self,
        id: &ClusterId,
        interface: &str,
        refused: &[(IpNet, String, IpNet)],
    ) {
        let now: BTreeSet<IpNet> = refused.iter().map(|(net, _, _)| *net).collect();
        let before = self.refused.get(id).cloned().unwrap_or_default();
        for (net, own_interface, network) in refused {
            if !before.contains(net) {
                tracing::warn!(
                    peer = %id,
                    interface,
                    prefix = %net,
                    node_interface = %own_interface,
                    node_network = %network,
                    "refusing to route a peer's range that overlaps a network of this node; \
                     reserve the node network in the IPAM (--reserved) so the peer is remapped"
                );
            }
        }
        self.refused_metric
            .get_or_create(&peer_labels(id))
            .set(i64::try_from(now.len()).unwrap_or(i64::MAX));
        if now.is_empty() {
            self.refused.remove(id);
        } else {
            self.refused.insert(id.clone(), now);
        }
    }

    /// Whether this replica routes and sends ([`Linux::set_active`]).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// Makes this replica the cluster's active gateway, or a standby. Taking over changes only
    /// what a standby holds back, all prepared beforehand: the engine sends a handshake to
    /// every peer at once, and the peers' ranges are routed into their tunnels (one `ip -batch`
    /// for all). Stepping down removes those routes and silences the engine.
    pub async fn set_active(&mut self, active: bool) -> anyhow::Result<()> {
        self.active = active;
        if let Some(engine) = self.engine() {
            engine.set_standby(!active);
        }
        if active {
            // A connection that began on the previous active continues here from its middle:
            // conntrack picks it up from any packet (tcp_loose), and must not drop or leave
            // untranslated the packets whose window it has not seen yet.
            for (knob, value) in [
                ("nf_conntrack_tcp_loose", "1"),
                ("nf_conntrack_tcp_be_liberal", "1"),
            ] {
                let path = format!("/proc/sys/net/netfilter/{knob}");
                if let Err(err) = tokio::fs::write(&path, value).await {
                    tracing::warn!(knob, error = %err, "could not set a conntrack knob for taking over connections mid-flow");
                }
            }
        }
        let mut batch = String::new();
        for (id, (plan, _, _)) in &self.applied.peers {
            let refused = self.refused.get(id);
            for net in plan.routed() {
                if refused.is_some_and(|r| r.contains(&net)) {
                    continue;
                }
                let verb = if active { "replace" } else { "del" };
                let _ = writeln!(batch, "route {verb} {net} dev {}", plan.interface);
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        match cmd::run("ip", &["-force", "-batch", "-"], Some(&batch)).await {
            Ok(_) => Ok(()),
            Err(err) if active => Err(err).context("routing the peers' ranges into their tunnels"),
            // A route already gone is what stepping down wants.
            Err(err) => {
                tracing::debug!(
                    error = format!("{err:#}"),
                    "some tunnel routes were already gone"
                );
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_overlapping_a_network_of_the_node_are_refused() {
        let net = |s: &str| s.parse::<IpNet>().expect("net");
        let own = vec![
            ("node".to_owned(), net("10.9.0.0/16")),
            ("pod".to_owned(), net("10.0.0.0/24")),
        ];
        let (kept, refused) = refuse(
            &[
                net("10.9.0.0/16"),
                net("10.81.0.0/16"),
                net("10.9.128.0/20"),
                net("10.0.0.0/8"),
            ],
            &own,
        );
        assert_eq!(kept, [net("10.81.0.0/16")]);
        let refused: Vec<String> = refused
            .iter()
            .map(|(p, i, n)| format!("{p} {i} {n}"))
            .collect();
        assert_eq!(
            refused,
            [
                "10.9.0.0/16 node 10.9.0.0/16",
                "10.9.128.0/20 node 10.9.0.0/16",
                "10.0.0.0/8 node 10.9.0.0/16"
            ]
        );
    }
}
