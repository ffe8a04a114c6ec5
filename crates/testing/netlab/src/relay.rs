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
//! and the relay adds a userspace hop (measured by the benchmark with a 0 ms link). Each
//! direction of a link runs on two threads of its own, one receiving and one sending when a
//! datagram is due, which sleeps with the kernel's timers. The relay used to wait on tokio's
//! timer, which rounds every deadline up to its next millisecond tick: a capture on the bridge
//! showed a datagram through a 0 ms relay leaving 1.27 ms after it arrived, against 0.1–0.2 ms
//! now, and a ping through 0 ms relays took 3.1 ms against 0.8 ms now (0.56 ms without relays).
//! Dropping [`Relays`] stops the relays and removes the rewrites.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::netns::{exec, in_netns, ip, nft_apply};
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
    /// Set on drop: the receiving threads see it within [`STOP_CHECK`], and each sending
    /// thread ends when its receiving thread has.
    stop: Arc<AtomicBool>,
    namespaces: Vec<String>,
}

/// How long a receiving thread waits for a datagram before it checks whether to stop.
const STOP_CHECK: Duration = Duration::from_millis(100);

const TABLE: &str = "netlab";

/// A blocking UDP socket at `address` (port chosen by the kernel) in namespace `ns`, for the
/// relay's threads.
async fn socket_in(ns: &str, address: Ipv4Addr) -> anyhow::Result<UdpSocket> {
    let ns = ns.to_owned();
    let socket = tokio::task::spawn_blocking(move || {
        in_netns(&ns, move || {
            let s = UdpSocket::bind(SocketAddr::from((address, 0)))?;
            s.set_read_timeout(Some(STOP_CHECK))?;
            Ok(s)
        })
    })
    .await??;
    Ok(socket)
}

/// Forwards everything `from` receives through `to` to `dest`, `delay` later, in order, on
/// two threads (see the module doc) that end once `stop` is set.
fn pump(
    from: Arc<UdpSocket>,
    to: Arc<UdpSocket>,
    dest: SocketAddr,
    delay: Duration,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::Builder::new()
        .name("netlab-relay-rx".into())
        .spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while !stop.load(Ordering::Relaxed) {
                match from.recv_from(&mut buf) {
                    Ok((n, _)) => {
                        if tx
                            .send((Instant::now() + delay, buf[..n].to_vec()))
                            .is_err()
                        {
                            return;
                        }
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) => {}
                    Err(_) => return,
                }
            }
        })?;
    std::thread::Builder::new()
        .name("netlab-relay-tx".into())
        .spawn(move || {
            while let Ok((due, packet)) = rx.recv() {
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                let _ = to.send_to(&packet, dest);
            }
        })?;
    Ok(())
}

/// Starts one relay per link and redirects the gateways' WireGuard packets through them.
pub async fn relay_links(topology: &Topology, links: &[RelayedLink]) -> anyhow::Result<Relays> {
    let inet = &topology.inet_ns;
    let mut relays = Relays {
        stop: Arc::new(AtomicBool::new(false)),
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
        let rx = Arc::new(socket_in(inet, relay).await?);
        let ry = Arc::new(socket_in(inet, relay).await?);
        let (rx_port, ry_port) = (rx.local_addr()?.port(), ry.local_addr()?.port());
        let one_way = link.rtt / 2;
        let stop = &relays.stop;
        pump(
            rx.clone(),
            ry.clone(),
            link.y_endpoint,
            one_way,
            stop.clone(),
        )?;
        pump(ry, rx, link.x_endpoint, one_way, stop.clone())?;
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
        nft_apply(ns, &script)?;
        relays.namespaces.push(ns.clone());
    }
    Ok(relays)
}

impl Drop for Relays {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            let _ = exec(ns, "nft", &["delete", "table", "ip", TABLE]);
        }
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> UdpSocket {
        let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s
    }

    /// Every datagram arrives whole, in order, from the relay's sending socket, and none before
    /// its delay has passed; once stopped, the relay forwards nothing more.
    #[test]
    fn a_pump_forwards_in_order_after_the_delay_until_stopped() {
        let (client, server) = (local(), local());
        let (faces_client, faces_server) = (Arc::new(local()), Arc::new(local()));
        faces_client
            .set_read_timeout(Some(STOP_CHECK))
            .expect("timeout");
        let delay = Duration::from_millis(20);
        let stop = Arc::new(AtomicBool::new(false));
        let to = server.local_addr().expect("addr");
        pump(
            faces_client.clone(),
            faces_server.clone(),
            to,
            delay,
            stop.clone(),
        )
        .expect("pump");
        let relay = faces_client.local_addr().expect("addr");
        let mut sent = Vec::new();
        for i in 0..3u8 {
            sent.push(Instant::now());
            client.send_to(&[i; 100], relay).expect("send");
        }
        let mut buf = [0u8; 200];
        for (i, at) in sent.iter().enumerate() {
            let (n, from) = server.recv_from(&mut buf).expect("relayed");
            assert!(at.elapsed() >= delay, "datagram {i} came before its delay");
            assert_eq!(from, faces_server.local_addr().expect("addr"));
            assert_eq!(&buf[..n], &[u8::try_from(i).expect("small"); 100][..]);
        }
        stop.store(true, Ordering::Relaxed);
        std::thread::sleep(STOP_CHECK * 2);
        client.send_to(b"late", relay).expect("send");
        server.set_read_timeout(Some(delay * 5)).expect("timeout");
        assert!(
            server.recv_from(&mut buf).is_err(),
            "a stopped relay still forwarded"
        );
    }
}
