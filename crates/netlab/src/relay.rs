//! Link latency without `sch_netem`: a userspace **UDP delay relay** per link, for kernels built
//! without netem (the build machines: `CONFIG_NET_SCH_NETEM` and `CONFIG_NET_SCH_PRIO` are not
//! set, `tc qdisc add ... netem` answers "Specified qdisc kind is unknown"). See [`crate::netem`]
//! for the qdisc variant where the kernel has it.
//!
//! A link between gateways X and Y carries WireGuard between X's port for Y (`x_endpoint`) and
//! Y's port for X (`y_endpoint`). The relay owns two UDP sockets on the bridge (the internet
//! namespace's address 192.0.2.254): `rx` faces X, `ry` faces Y. Each gateway namespace gets a
//! stateless nftables rewrite (table `ip netlab`, output route hook) sending its WireGuard
//! packets for the other end (recognised by the gateway's own port for that peer, whatever
//! address WireGuard currently sends them to) to the relay socket facing it; stateless, because the
//! tunnel's conntrack entries exist before the relay does and NAT is only decided on a
//! connection's first packet. The relay holds every datagram for half the link's delay and
//! sends it on from the socket facing the other end, to that end's real endpoint. WireGuard
//! then sees its peer at the relay's address and roams to it, which keeps the path through the
//! relay. So a round trip across a link adds the link's delay, as with netem on both ends.
//!
//! Only the tunnels' UDP packets are delayed (not the control plane's gRPC between gateways),
//! and the relay adds a userspace hop (sub-millisecond, measured by the benchmark with a 0 ms
//! link). Dropping [`Relays`] stops the relays and removes the rewrites.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::netns::{exec, in_netns, ip};
use crate::topology::{BRIDGE, Topology};

/// The internet namespace's own address on the bridge, where relays listen.
pub const RELAY_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 254);

/// One relayed link: the WireGuard endpoints of both ends (each as the other end addresses
/// it) and the round-trip delay the link adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayedLink {
    /// Site index of one end.
    pub x: usize,
    /// Where Y sends to reach X (X's WireGuard port for Y).
    pub x_endpoint: SocketAddr,
    /// Site index of the other end.
    pub y: usize,
    /// Where X sends to reach Y.
    pub y_endpoint: SocketAddr,
    pub rtt: Duration,
}

/// Running relays; stopped, and the gateways' rewrites removed, on drop.
#[derive(Debug)]
pub struct Relays {
    tasks: Vec<JoinHandle<()>>,
    namespaces: Vec<String>,
}

const TABLE: &str = "netlab";

fn nft(ns: &str, script: &str) -> anyhow::Result<()> {
    let path = std::env::temp_dir().join(format!("netlab-{ns}.nft"));
    std::fs::write(&path, script)?;
    let out = exec(ns, "nft", &["-f", &path.to_string_lossy()]);
    let _ = std::fs::remove_file(&path);
    let out = out?;
    if !out.status.success() {
        bail!(
            "nft -f in {ns} failed: {}\n{script}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

async fn socket_in(ns: &str) -> anyhow::Result<UdpSocket> {
    let ns = ns.to_owned();
    let socket = tokio::task::spawn_blocking(move || {
        in_netns(&ns, || {
            let s = std::net::UdpSocket::bind(SocketAddr::from((RELAY_IP, 0)))?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
    })
    .await??;
    Ok(UdpSocket::from_std(socket)?)
}

/// Forwards everything `from` receives through `to` to `dest`, `delay` later, in order.
fn pump(
    from: std::sync::Arc<UdpSocket>,
    to: std::sync::Arc<UdpSocket>,
    dest: SocketAddr,
    delay: Duration,
) -> Vec<JoinHandle<()>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let receive = tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok((n, _)) = from.recv_from(&mut buf).await {
            if tx
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                return;
            }
        }
    });
    let send = tokio::spawn(async move {
        while let Some((due, packet)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            let _ = to.send_to(&packet, dest).await;
        }
    });
    vec![receive, send]
}

/// Starts one relay per link and redirects the gateways' WireGuard packets through them.
pub async fn relay_links(topology: &Topology, links: &[RelayedLink]) -> anyhow::Result<Relays> {
    let inet = &topology.inet_ns;
    let has_addr =
        ip(&["-n", inet, "-4", "addr", "show", "dev", BRIDGE])?.contains(&RELAY_IP.to_string());
    if !has_addr {
        ip(&[
            "-n",
            inet,
            "addr",
            "add",
            &format!("{RELAY_IP}/24"),
            "dev",
            BRIDGE,
        ])?;
    }
    let mut relays = Relays {
        tasks: Vec::new(),
        namespaces: Vec::new(),
    };
    let mut rewrites: std::collections::BTreeMap<usize, Vec<String>> = Default::default();
    for link in links {
        let rx = std::sync::Arc::new(socket_in(inet).await?);
        let ry = std::sync::Arc::new(socket_in(inet).await?);
        let (rx_port, ry_port) = (rx.local_addr()?.port(), ry.local_addr()?.port());
        let one_way = link.rtt / 2;
        relays
            .tasks
            .extend(pump(rx.clone(), ry.clone(), link.y_endpoint, one_way));
        relays.tasks.extend(pump(ry, rx, link.x_endpoint, one_way));
        // Matched by the gateway's own port for the peer (unique per link), not by the
        // destination: WireGuard may have roamed to an earlier relay's address.
        let rule = |own_port: u16, relay_port: u16| {
            format!("    udp sport {own_port} ip daddr set {RELAY_IP} udp dport set {relay_port}")
        };
        rewrites
            .entry(link.x)
            .or_default()
            .push(rule(link.x_endpoint.port(), rx_port));
        rewrites
            .entry(link.y)
            .or_default()
            .push(rule(link.y_endpoint.port(), ry_port));
    }
    for (site, rules) in rewrites {
        let ns = &topology.sites.get(site).context("no such site")?.gw_ns;
        let script = format!(
            "table ip {TABLE} {{}}\ndelete table ip {TABLE}\ntable ip {TABLE} {{\n  chain out {{\n    \
             type route hook output priority mangle; policy accept;\n{}\n  }}\n}}\n",
            rules.join("\n")
        );
        nft(ns, &script)?;
        relays.namespaces.push(ns.clone());
    }
    Ok(relays)
}

impl Drop for Relays {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = exec(ns, "nft", &["delete", "table", "ip", TABLE]);
        }
        for t in &self.tasks {
            t.abort();
        }
    }
}
