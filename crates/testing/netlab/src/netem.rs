//! Latency per *link* between two gateways with `tc netem`.
//!
//! All gateways share one bridge, so "the hub link A-B" and "the leaf link A-C" are not
//! separate wires. They become separate paths by **destination** on each gateway's uplink:
//! every `wan` interface gets an `htb` root qdisc (used only to classify, never to shape) whose
//! default class has no delay, plus one class per delayed peer with a `netem` child, selected by
//! a `u32` filter on the peer's bridge address (`ip dst 192.0.2.N/32`). Both ends of a link do this, each with half
//! the link's delay, so a round trip across a link adds exactly the configured delay (the
//! default "180 ms per hub link, 20 ms on the leaf link": an A→B→C→B→A round trip adds
//! 2 × 180 ms, an A→C→A round trip 20 ms). WireGuard's UDP packets and the control plane's
//! gRPC between the two gateways see the same delay, as on a real WAN link; traffic inside a
//! namespace (pod to gateway) sees none.
//!
//! Needs a kernel with `sch_netem` (and `sch_htb`); the build machines have no netem
//! ([`available`] says so), and use the userspace delay relay of [`crate::relay`] instead. This
//! variant is therefore not exercised there.

use std::net::Ipv4Addr;
use std::time::Duration;

use anyhow::{Context as _, bail};

use crate::netns::exec;
use crate::topology::{Topology, UPLINK};

/// The delay of one link between sites `a` and `b` (indexes), as its contribution to a
/// round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkDelay {
    pub a: usize,
    pub b: usize,
    pub rtt: Duration,
}

/// At most this many delayed peers per site.
pub const MAX_DELAYED_PEERS: usize = 200;

fn tc(ns: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = exec(ns, "tc", args)?;
    if !out.status.success() {
        bail!(
            "tc {} in {ns} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Replaces the delays of every site's uplink with `links` (sites in no link get none).
pub fn set_link_delays(topology: &Topology, links: &[LinkDelay]) -> anyhow::Result<()> {
    for site in &topology.sites {
        let peers: Vec<(Ipv4Addr, Duration)> = links
            .iter()
            .filter_map(|l| {
                let other = if l.a == site.index {
                    l.b
                } else if l.b == site.index {
                    l.a
                } else {
                    return None;
                };
                Some((topology.sites.get(other)?.uplink_ip, l.rtt / 2))
            })
            .collect();
        set_delays(&site.gw_ns, &peers).with_context(|| format!("netem on site {}", site.name))?;
    }
    Ok(())
}

/// Removes every delay.
pub fn clear(topology: &Topology) -> anyhow::Result<()> {
    set_link_delays(topology, &[])
}

/// Sets one-way delays on the uplink of namespace `ns` for packets to each peer address.
pub fn set_delays(ns: &str, peers: &[(Ipv4Addr, Duration)]) -> anyhow::Result<()> {
    if peers.len() > MAX_DELAYED_PEERS {
        bail!("{} delayed peers; at most {MAX_DELAYED_PEERS}", peers.len());
    }
    // Deleting a missing root qdisc fails harmlessly.
    let _ = exec(ns, "tc", &["qdisc", "del", "dev", UPLINK, "root"]);
    if peers.is_empty() {
        return Ok(());
    }
    // HTB only classifies here (every class may use the whole link): unmatched packets go to
    // class 1:1 with no delay.
    tc(
        ns,
        &[
            "qdisc", "add", "dev", UPLINK, "root", "handle", "1:", "htb", "default", "1",
        ],
    )?;
    tc(
        ns,
        &[
            "class", "add", "dev", UPLINK, "parent", "1:", "classid", "1:1", "htb", "rate", RATE,
        ],
    )?;
    for (k, (peer, delay)) in peers.iter().enumerate() {
        let class = format!("1:{}", k + 2);
        let handle = format!("{}:", k + 10);
        let delay = format!("{}us", delay.as_micros());
        tc(
            ns,
            &[
                "class", "add", "dev", UPLINK, "parent", "1:", "classid", &class, "htb", "rate",
                RATE,
            ],
        )?;
        tc(
            ns,
            &[
                "qdisc", "add", "dev", UPLINK, "parent", &class, "handle", &handle, "netem",
                "delay", &delay, "limit", "100000",
            ],
        )?;
        let dst = format!("{peer}/32");
        tc(
            ns,
            &[
                "filter", "add", "dev", UPLINK, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", "dst", &dst, "flowid", &class,
            ],
        )?;
    }
    Ok(())
}

/// Whether this kernel has the `netem` qdisc (probed on a veth in a scratch namespace).
pub fn available() -> bool {
    let ns = format!("tl{}-probe", crate::run_id());
    let mut guard = crate::netns::Namespaces::default();
    if guard.add(&ns).is_err() {
        return false;
    }
    if crate::netns::ip(&[
        "-n", &ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1",
    ])
    .is_err()
    {
        return false;
    }
    exec(
        &ns,
        "tc",
        &["qdisc", "add", "dev", "v0", "root", "netem", "delay", "1ms"],
    )
    .is_ok_and(|o| o.status.success())
}

/// HTB rate of every class: far above what a veth carries, so HTB never shapes.
const RATE: &str = "100gbit";
