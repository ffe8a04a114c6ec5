//! Link latency without `sch_netem`: a userspace **UDP delay relay** per link, for kernels built
//! without netem (the build machines: `CONFIG_NET_SCH_NETEM` and `CONFIG_NET_SCH_PRIO` are not
//! set, `tc qdisc add ... netem` answers "Specified qdisc kind is unknown"). See [`crate::netem`]
//! for the qdisc variant where the kernel has it.
//!
//! A link between gateways X and Y carries WireGuard between X's port for Y (`x_endpoint`) and
//! Y's port for X (`y_endpoint`). The relay owns two UDP sockets on the bridge, at an address
//! of the internet namespace that belongs to this link alone ([`relay_ip`]): `rx` faces X, `ry`
//! faces Y. Each gateway namespace gets a stateless nftables rewrite (table `ip netlab`, output
//! route hook) sending its WireGuard packets for the other end to the relay socket facing it.
//! A packet is recognised by the gateway's WireGuard port and a destination that is the other
//! end's address or this link's relay address (where WireGuard may have roamed): the port alone
//! does not name the peer, since a gateway has one port for all of them (ADR 0022). Stateless,
//! because the tunnel's conntrack entries exist before the relay does and NAT is only decided
//! on a connection's first packet. The relay holds every datagram for half the link's delay and
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

/// The internet namespace's address on the bridge where the relay of the link between sites
/// `x` and `y` listens: 192.0.2.248 to .253 for the six links among sites 0 to 3. One address
/// per link, stable across relay runs, so a gateway that roamed to an earlier relay of the link
/// is still recognised as sending on this link.
pub fn relay_ip(x: usize, y: usize) -> anyhow::Result<Ipv4Addr> {
    let (a, b) = (x.min(y), x.max(y));
    let index = match (a, b) {
        (0, 1) => 0,
        (0, 2) => 1,
        (0, 3) => 2,
        (1, 2) => 3,
        (1, 3) => 4,
        (2, 3) => 5,
        _ => bail!("relayed links join two of sites 0 to 3, not {x} and {y}"),
    };
    Ok(Ipv4Addr::new(192, 0, 2, 248 + index))
}

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

async fn socket_in(ns: &str, address: Ipv4Addr) -> anyhow::Result<UdpSocket> {
    let ns = ns.to_owned();
    let socket = tokio::task::spawn_blocking(move || {
        in_netns(&ns, move || {
            let s = std::net::UdpSocket::bind(SocketAddr::from((address, 0)))?;
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
    let mut relays = Relays {
        tasks: Vec::new(),
        namespaces: Vec::new(),
    };
    let mut rewrites: std::collections::BTreeMap<usize, Vec<String>> = Default::default();
    for link in links {
        let relay = relay_ip(link.x, link.y)?;
        let has_addr =
            ip(&["-n", inet, "-4", "addr", "show", "dev", BRIDGE])?.contains(&relay.to_string());
        if !has_addr {
            ip(&[
                "-n",
                inet,
                "addr",
                "add",
                &format!("{relay}/24"),
                "dev",
                BRIDGE,
            ])?;
        }
        let rx = std::sync::Arc::new(socket_in(inet, relay).await?);
        let ry = std::sync::Arc::new(socket_in(inet, relay).await?);
        let (rx_port, ry_port) = (rx.local_addr()?.port(), ry.local_addr()?.port());
        let one_way = link.rtt / 2;
        relays
            .tasks
            .extend(pump(rx.clone(), ry.clone(), link.y_endpoint, one_way));
        relays.tasks.extend(pump(ry, rx, link.x_endpoint, one_way));
        // Matched by the gateway's own port and the destination: the other end's address, or
        // this link's relay address (WireGuard may have roamed to an earlier relay of it).
        let rule = move |own_port: u16, other: SocketAddr, relay_port: u16| {
            format!(
                "    udp sport {own_port} ip daddr {{ {}, {relay} }} ip daddr set {relay} udp dport set {relay_port}",
                other.ip()
            )
        };
        rewrites.entry(link.x).or_default().push(rule(
            link.x_endpoint.port(),
            link.y_endpoint,
            rx_port,
        ));
        rewrites.entry(link.y).or_default().push(rule(
            link.y_endpoint.port(),
            link.x_endpoint,
            ry_port,
        ));
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
