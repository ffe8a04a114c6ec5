//! [`Partition`]: a **silent** partition between nodes of one site's node network, as when a
//! node loses power or a switch drops its traffic: every frame one side sends to the other is
//! dropped where it arrives, so nothing is refused, nothing is reset and no FIN gets through.
//! Open connections hang until an end's own liveness checks give up; new ones time out.
//!
//! Each node of either side gets an nftables table (`netdev netlab-partition`) with an ingress
//! chain on its node-network interface dropping frames whose source MAC is a node of the other
//! side: IP of any protocol, VXLAN, ARP. Frames between nodes of the same side, and every other
//! interface (uplinks, pods), are untouched. Dropping the [`Partition`] removes the tables.

use std::collections::BTreeSet;

use anyhow::{Context as _, bail};

use crate::netns::{exec, ip, nft_apply};
use crate::topology::{NODE_LINK, Site};

const TABLE: &str = "netlab-partition";

/// Nodes cut from each other until dropped.
#[derive(Debug)]
pub struct Partition {
    /// The namespaces holding a table.
    namespaces: Vec<String>,
}

impl Partition {
    /// Cuts nodes `a` of `site` (indices into [`Site::nodes`]) from nodes `b`, both ways.
    pub fn nodes(site: &Site, a: &[usize], b: &[usize]) -> anyhow::Result<Self> {
        let (a_set, b_set): (BTreeSet<_>, BTreeSet<_>) =
            (a.iter().copied().collect(), b.iter().copied().collect());
        if a_set.is_empty() || b_set.is_empty() {
            bail!("a partition needs a node on each side");
        }
        if let Some(both) = a_set.intersection(&b_set).next() {
            bail!("node {both} cannot be on both sides of a partition");
        }
        let node = |i: usize| {
            site.nodes
                .get(i)
                .with_context(|| format!("{} has no node {i}", site.name))
        };
        let macs = |side: &BTreeSet<usize>| -> anyhow::Result<Vec<String>> {
            side.iter().map(|&i| mac(&node(i)?.netns)).collect()
        };
        let (a_macs, b_macs) = (macs(&a_set)?, macs(&b_set)?);
        let mut this = Self {
            namespaces: Vec::new(),
        };
        for (side, others) in [(&a_set, &b_macs), (&b_set, &a_macs)] {
            for &i in side {
                let ns = &node(i)?.netns;
                drop_from(ns, others)?;
                this.namespaces.push(ns.clone());
            }
        }
        Ok(this)
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            match exec(ns, "nft", &["delete", "table", "netdev", TABLE]) {
                Ok(out) if out.status.success() => {}
                Ok(out) => eprintln!(
                    "could not heal the partition in {ns}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
                Err(err) => eprintln!("could not heal the partition in {ns}: {err:#}"),
            }
        }
    }
}

/// The MAC address of a node's node-network interface.
fn mac(ns: &str) -> anyhow::Result<String> {
    // `ip -br link`: name, state, address, flags.
    let line = ip(&["-n", ns, "-br", "link", "show", NODE_LINK])?;
    line.split_whitespace()
        .nth(2)
        .filter(|m| m.len() == 17 && m.bytes().filter(|b| *b == b':').count() == 5)
        .map(str::to_owned)
        .with_context(|| format!("no MAC address for {NODE_LINK} in {ns}: {line:?}"))
}

/// Drops, in `ns`, every frame arriving on the node link from one of `macs`.
fn drop_from(ns: &str, macs: &[String]) -> anyhow::Result<()> {
    let script = format!(
        "table netdev {TABLE} {{\n  chain ingress {{\n    type filter hook ingress device \
         \"{NODE_LINK}\" priority -500; policy accept;\n    ether saddr {{ {} }} drop\n  }}\n}}\n",
        macs.join(", ")
    );
    nft_apply(ns, &script)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Topology;

    /// How a TCP connection from `ns` to a closed port of `to` ends: `Some(true)` connected,
    /// `Some(false)` refused (an RST came back), `None` no answer within 2 s.
    fn connect(ns: &str, to: std::net::Ipv4Addr) -> Option<bool> {
        let out = exec(
            ns,
            "timeout",
            &["2", "bash", "-c", &format!("exec 3<>/dev/tcp/{to}/9")],
        )
        .expect("bash runs");
        match out.status.code() {
            Some(0) => Some(true),
            Some(124) => None,
            _ => Some(false),
        }
    }

    fn pings(ns: &str, to: std::net::Ipv4Addr) -> bool {
        exec(ns, "ping", &["-n", "-c", "1", "-W", "1", &to.to_string()])
            .expect("ping runs")
            .status
            .success()
    }

    #[test]
    fn a_partition_drops_everything_between_its_sides_silently_and_only_that() {
        if !crate::netns::can_run(
            "a_partition_drops_everything_between_its_sides_silently_and_only_that",
            &["ip", "nft", "ping", "bash", "timeout"],
        ) {
            return;
        }
        let topology = Topology::build_with_nodes(&[("a", "10.0.0.0/16")], 3).expect("topology");
        let site = &topology.sites[0];
        let (n0, n1, n2) = (&site.nodes[0], &site.nodes[1], &site.nodes[2]);
        // Positive controls: the probes see an answer, and an RST from a closed port.
        assert!(pings(&n2.netns, n0.node_ip), "n2 reaches n0 before");
        assert_eq!(
            connect(&n2.netns, n0.node_ip),
            Some(false),
            "refused before"
        );

        let partition = Partition::nodes(site, &[2], &[0]).expect("partition");
        assert!(!pings(&n2.netns, n0.node_ip), "n2 no longer reaches n0");
        assert!(!pings(&n0.netns, n2.node_ip), "nor n0 n2");
        assert_eq!(
            connect(&n2.netns, n0.node_ip),
            None,
            "no RST: the connection times out"
        );
        assert!(pings(&n2.netns, n1.node_ip), "n2 still reaches n1");
        assert!(pings(&n1.netns, n0.node_ip), "n1 still reaches n0");
        assert!(
            Partition::nodes(site, &[1], &[1]).is_err(),
            "one node, both sides"
        );

        drop(partition);
        // The neighbour entries went stale meanwhile: allow a few tries to resolve them.
        assert!((0..5).any(|_| pings(&n2.netns, n0.node_ip)), "healed");
    }
}
