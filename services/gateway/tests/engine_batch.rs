//! What batched I/O could break in the userspace engine (ADR 0022), with real packets in a
//! network namespace (root only; skipped loudly elsewhere, never in CI):
//!
//! - a burst of data datagrams for many peers, interleaved, some of them sent as UDP GSO
//!   batches (which reach the engine's GRO socket as one buffer of many datagrams), each
//!   lands in its own peer's TUN, and only there, although every peer's AllowedIPs are the
//!   same CIDR (the demultiplexer must go by the receiver index, not by address);
//! - traffic into many TUNs at once leaves in GSO batches that never mix destinations: each
//!   peer receives only datagrams its session decrypts, carrying only its own inner packets.
//!
//! The peers are boringtun `Tunn` sessions driven by the test over real UDP sockets: the same
//! protocol crate the engine uses, speaking to it across the kernel.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use defguard_boringtun::noise::errors::WireGuardError;
use defguard_boringtun::noise::{Tunn, TunnResult};
use defguard_boringtun::x25519::{PublicKey, StaticSecret};
use trellis_gateway::dataplane::engine::{DropReason, Engine, PeerConfig};
use trellis_gateway::keys::KeyPair;
use trellis_netlab::netns::{Namespaces, can_run, in_netns, ip};

const PEERS: usize = 12;
const ROUNDS: usize = 20;
/// Datagrams per peer per round sent as one GSO batch (after one sent singly).
const GSO_RUN: usize = 4;
const DEADLINE: Duration = Duration::from_secs(30);

/// A minimal IPv4/UDP packet from `src` to `dst` with `payload`, header checksum set.
fn ipv4_udp(src: Ipv4Addr, dst: Ipv4Addr, payload: &[u8]) -> Vec<u8> {
    let total = 20 + 8 + payload.len();
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[8] = 64;
    p[9] = 17;
    p[12..16].copy_from_slice(&src.octets());
    p[16..20].copy_from_slice(&dst.octets());
    let mut sum: u32 = p[..20]
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    p[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    p[20..22].copy_from_slice(&4000u16.to_be_bytes());
    p[22..24].copy_from_slice(&9u16.to_be_bytes());
    p[24..26].copy_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    p[28..].copy_from_slice(payload);
    p
}

/// One remote peer: its session and its socket.
struct Remote {
    tunn: Tunn,
    socket: UdpSocket,
}

impl Remote {
    /// Handles one datagram from the engine; returns the inner IPv4 packet it carried, if any.
    fn handle(&mut self, datagram: &[u8], engine: SocketAddr) -> Option<Vec<u8>> {
        let mut out = vec![0u8; 65536];
        match self.tunn.decapsulate(None, datagram, &mut out) {
            TunnResult::WriteToNetwork(reply) => {
                self.socket.send_to(reply, engine).expect("reply");
                let mut queued = vec![0u8; 65536];
                while let TunnResult::WriteToNetwork(p) =
                    self.tunn.decapsulate(None, &[], &mut queued)
                {
                    self.socket.send_to(p, engine).expect("queued");
                }
                None
            }
            TunnResult::WriteToTunnelV4(inner, _) => Some(inner.to_vec()),
            // Until a peer is heard from, the engine sends the initiation in flight again every
            // timer tick, the same bytes (a NAT may drop the first copies). The remotes are
            // established one after the other, so on a loaded machine several copies wait in a
            // remote's socket; once it has answered one, the next is a replay, which a responder
            // refuses and drops, as WireGuard's do.
            TunnResult::Err(WireGuardError::WrongTai64nTimestamp) => None,
            TunnResult::Err(err) => panic!("a datagram this peer cannot decapsulate: {err:?}"),
            _ => None,
        }
    }

    /// Answers the engine's handshake until its confirming keepalive arrives.
    fn establish(&mut self, engine: SocketAddr) {
        let deadline = Instant::now() + DEADLINE;
        let mut buf = vec![0u8; 65536];
        loop {
            assert!(Instant::now() < deadline, "no handshake with the engine");
            let Ok((n, from)) = self.socket.recv_from(&mut buf) else {
                continue;
            };
            assert_eq!(from, engine);
            let data = buf[0] == 4;
            self.handle(&buf[..n], engine);
            if data {
                return;
            }
        }
    }

    fn seal(&mut self, packet: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; packet.len() + 64];
        match self.tunn.encapsulate(packet, &mut out) {
            TunnResult::WriteToNetwork(d) if d[0] == 4 => d.to_vec(),
            other => panic!("no data message: {other:?}"),
        }
    }
}

/// Sends `contents` from `socket` to `to`, as one GSO send of `segment`-byte datagrams where
/// given and the kernel can (datagram by datagram where it cannot).
fn send(
    state: &quinn_udp::UdpSocketState,
    socket: &UdpSocket,
    to: SocketAddr,
    contents: &[u8],
    segment: Option<usize>,
) {
    if segment.is_some() && state.max_gso_segments() <= 1 {
        for d in contents.chunks(segment.unwrap_or(contents.len())) {
            send(state, socket, to, d, None);
        }
        return;
    }
    let transmit = quinn_udp::Transmit {
        destination: to,
        ecn: None,
        contents,
        segment_size: segment,
        src_ip: None,
    };
    let deadline = Instant::now() + DEADLINE;
    // quinn-udp made the socket non-blocking.
    while let Err(err) = state.try_send(socket.into(), &transmit) {
        assert!(
            err.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline,
            "send: {err}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn rx_packets(ns: &str, dev: &str) -> u64 {
    let out = ip(&["-n", ns, "-s", "-j", "link", "show", dev]).expect("ip -s link");
    let json: serde_json::Value = serde_json::from_str(&out).expect("ip json");
    json[0]["stats64"]["rx"]["packets"]
        .as_u64()
        .expect("rx packets")
}

struct Setup {
    _namespaces: Namespaces,
    ns: String,
    engine: Arc<Engine>,
    engine_addr: SocketAddr,
    remotes: Vec<Remote>,
    devs: Vec<String>,
}

/// `PEERS` peers of one engine in a fresh namespace, all with AllowedIPs 10.200.0.0/24, each
/// TUN up with a route to 10.201.<i>.0/24 through it; every session established.
fn setup(tag: &str) -> Setup {
    let ns = format!("eb{tag}{}", std::process::id());
    let mut namespaces = Namespaces::default();
    namespaces.add(&ns).expect("namespace");
    let engine_key = KeyPair::generate();
    let engine_public: [u8; 32] = *engine_key.public().as_bytes();
    let private = engine_key.private_bytes();
    let engine = Arc::new(in_netns(&ns, move || Engine::start(0, private)).expect("engine"));
    let engine_addr: SocketAddr = ([127, 0, 0, 1], engine.port()).into();
    let mut remotes = Vec::new();
    let mut devs = Vec::new();
    for i in 0..PEERS {
        let key = KeyPair::generate();
        let socket = in_netns(&ns, || UdpSocket::bind("127.0.0.1:0")).expect("peer socket");
        socket
            .set_read_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let secret = StaticSecret::from(key.private_bytes());
        let config = PeerConfig {
            public_key: *key.public().as_bytes(),
            endpoint: socket.local_addr().expect("addr"),
            allowed_ips: vec!["10.200.0.0/24".parse().expect("net")],
            keepalive: 0,
            candidates: Vec::new(),
            relay_via: None,
            relayable: false,
            translation: None,
        };
        let dev = format!("ebt{tag}{i}");
        // The TUN is created in the namespace of the thread that adds the peer.
        let (e, d) = (engine.clone(), dev.clone());
        in_netns(&ns, move || e.add_peer(&d, &config)).expect("add peer");
        ip(&["-n", &ns, "link", "set", &dev, "up"]).expect("tun up");
        ip(&[
            "-n",
            &ns,
            "route",
            "add",
            &format!("10.201.{i}.0/24"),
            "dev",
            &dev,
        ])
        .expect("route");
        let tunn = Tunn::new(
            secret,
            PublicKey::from(engine_public),
            None,
            None,
            i as u32 + 1,
            None,
        );
        devs.push(dev);
        remotes.push(Remote { tunn, socket });
    }
    for remote in &mut remotes {
        remote.establish(engine_addr);
    }
    Setup {
        _namespaces: namespaces,
        ns,
        engine,
        engine_addr,
        remotes,
        devs,
    }
}

fn no_drops(engine: &Engine) {
    let dropped: Vec<(DropReason, u64)> = engine
        .dropped()
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    assert!(
        dropped.is_empty(),
        "the engine dropped datagrams: {dropped:?}"
    );
}

#[test]
fn an_interleaved_burst_for_many_peers_lands_each_datagram_in_its_own_tun() {
    let test = "an_interleaved_burst_for_many_peers_lands_each_datagram_in_its_own_tun";
    if !can_run(test, &[]) {
        return;
    }
    let mut s = setup("r");
    let before: Vec<u64> = s.devs.iter().map(|d| rx_packets(&s.ns, d)).collect();
    // The same inner addresses for every peer: only the receiver index can tell them apart.
    let (src, dst) = (Ipv4Addr::new(10, 200, 0, 2), Ipv4Addr::new(10, 200, 0, 1));
    let gso: Vec<quinn_udp::UdpSocketState> = s
        .remotes
        .iter()
        .map(|r| quinn_udp::UdpSocketState::new((&r.socket).into()).expect("gso state"))
        .collect();
    let mut sent = vec![0u64; PEERS];
    let mut landed = Vec::new();
    // Rounds, each a burst of every peer's datagrams back to back (more than one recvmmsg
    // batch), waited for before the next: a socket buffer overflowing would lose datagrams
    // for a reason that is not the engine's.
    for round in 0..ROUNDS {
        for (i, remote) in s.remotes.iter_mut().enumerate() {
            let payload = vec![i as u8; 200 + round];
            let single = remote.seal(&ipv4_udp(src, dst, &payload));
            send(&gso[i], &remote.socket, s.engine_addr, &single, None);
            sent[i] += 1;
            // Then GSO_RUN datagrams of one size in one send: the engine's socket gets them as
            // one GRO buffer (or singly where the kernel has no GSO).
            let run: Vec<Vec<u8>> = (0..GSO_RUN)
                .map(|_| remote.seal(&ipv4_udp(src, dst, &payload)))
                .collect();
            let segment = run[0].len();
            send(
                &gso[i],
                &remote.socket,
                s.engine_addr,
                &run.concat(),
                Some(segment),
            );
            sent[i] += GSO_RUN as u64;
        }
        let deadline = Instant::now() + DEADLINE;
        landed = loop {
            let landed: Vec<u64> = s
                .devs
                .iter()
                .zip(&before)
                .map(|(d, b)| rx_packets(&s.ns, d) - b)
                .collect();
            if landed == sent || Instant::now() > deadline {
                break landed;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(
            landed, sent,
            "round {round}: packets written into each peer's tun (index = peer) vs sent by that peer"
        );
    }
    assert_eq!(
        landed.iter().sum::<u64>(),
        (PEERS * ROUNDS * (1 + GSO_RUN)) as u64
    );
    no_drops(&s.engine);
}

#[test]
fn gso_batches_from_many_tuns_never_mix_destinations() {
    let test = "gso_batches_from_many_tuns_never_mix_destinations";
    if !can_run(test, &[]) {
        return;
    }
    let mut s = setup("s");
    // Packets into every TUN, interleaved, from a socket in the namespace: the kernel routes
    // 10.201.<i>.1 through TUN i, the engine encrypts for peer i.
    let ns = s.ns.clone();
    ip(&["-n", &ns, "addr", "add", "10.202.0.1/32", "dev", "lo"]).expect("source address");
    let sender = in_netns(&ns, || UdpSocket::bind("10.202.0.1:0")).expect("sender");
    let mut buf = vec![0u8; 65536];
    // Rounds of ten packets per peer, each round read before the next, so no socket buffer
    // or TUN queue overflows for a reason that is not the engine's.
    for round in 0..10 {
        for n in 0..10 {
            for i in 0..PEERS {
                let to: SocketAddr = (Ipv4Addr::new(10, 201, i as u8, 1), 9).into();
                // One size, but one in five shorter: a shorter datagram ends a GSO batch.
                let len = if n % 5 == 4 { 300 } else { 1200 };
                sender.send_to(&vec![i as u8; len], to).expect("send");
            }
        }
        let deadline = Instant::now() + DEADLINE;
        for (i, remote) in s.remotes.iter_mut().enumerate() {
            let mut received = 0usize;
            while received < 10 && Instant::now() < deadline {
                let Ok((n, _)) = remote.socket.recv_from(&mut buf) else {
                    continue;
                };
                // A datagram meant for another peer fails to decapsulate here (panic names it).
                if let Some(inner) = remote.handle(&buf[..n], s.engine_addr) {
                    assert_eq!(
                        inner[16..20],
                        [10, 201, i as u8, 1],
                        "peer {i} got another peer's packet"
                    );
                    assert!(
                        inner[28..].iter().all(|b| *b == i as u8),
                        "peer {i} got another peer's payload"
                    );
                    received += 1;
                }
            }
            assert_eq!(received, 10, "round {round}: packets peer {i} received");
        }
    }
    no_drops(&s.engine);
}
