//! What the engine tests share: an engine alone in a fresh namespace, and peers that are
//! boringtun sessions driven by the test over real UDP sockets in it.

#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use defguard_boringtun::noise::{Tunn, TunnResult};
use defguard_boringtun::x25519::{PublicKey, StaticSecret};
use trellis_gateway::dataplane::engine::{DropReason, Engine, PeerConfig};
use trellis_gateway::keys::KeyPair;
use trellis_netlab::netns::{Namespaces, in_netns, ip};

pub(crate) const DEADLINE: Duration = Duration::from_secs(20);

/// An engine alone in a fresh namespace.
pub(crate) struct Setup {
    _namespaces: Namespaces,
    pub(crate) ns: String,
    pub(crate) engine: Arc<Engine>,
    pub(crate) engine_addr: SocketAddr,
    pub(crate) engine_public: [u8; 32],
}

pub(crate) fn setup(tag: &str) -> Setup {
    let ns = format!("es{tag}{}", std::process::id());
    let mut namespaces = Namespaces::default();
    namespaces.add(&ns).expect("namespace");
    let key = KeyPair::generate();
    let engine_public: [u8; 32] = *key.public().as_bytes();
    let private = key.private_bytes();
    let engine = Arc::new(in_netns(&ns, move || Engine::start(0, private)).expect("engine"));
    let engine_addr: SocketAddr = ([127, 0, 0, 1], engine.port()).into();
    Setup {
        _namespaces: namespaces,
        ns,
        engine,
        engine_addr,
        engine_public,
    }
}

/// A socket in the namespace at `ip` (any 127/8 address: all of it is local on `lo`).
pub(crate) fn socket(ns: &str, ip: Ipv4Addr) -> UdpSocket {
    let socket = in_netns(ns, move || UdpSocket::bind((ip, 0))).expect("socket");
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    socket
}

/// A peer of the engine: its session, its socket, its key.
pub(crate) struct Peer {
    pub(crate) tunn: Tunn,
    pub(crate) socket: UdpSocket,
    pub(crate) public: [u8; 32],
    pub(crate) index: u32,
    pub(crate) dev: String,
}

impl Peer {
    /// Adds a peer at 127.0.0.1 to the engine (which starts a handshake with it at once).
    pub(crate) fn add(s: &Setup, dev: &str) -> Self {
        Self::add_at(s, dev, Ipv4Addr::LOCALHOST, false)
    }

    /// Adds a peer at `at`, one the engine relays for when `relayable`.
    pub(crate) fn add_at(s: &Setup, dev: &str, at: Ipv4Addr, relayable: bool) -> Self {
        Self::add_relayed(s, dev, at, relayable, None)
    }

    /// [`Peer::add_at`] for a peer the engine relays through the hub `relay_via` when its
    /// direct path fails.
    pub(crate) fn add_relayed(
        s: &Setup,
        dev: &str,
        at: Ipv4Addr,
        relayable: bool,
        relay_via: Option<[u8; 32]>,
    ) -> Self {
        let key = KeyPair::generate();
        let socket = socket(&s.ns, at);
        let config = PeerConfig {
            public_key: *key.public().as_bytes(),
            endpoint: socket.local_addr().expect("addr"),
            allowed_ips: vec!["10.200.0.0/24".parse().expect("net")],
            keepalive: 0,
            candidates: Vec::new(),
            relay_via,
            relayable,
            translation: None,
        };
        let (engine, d) = (s.engine.clone(), dev.to_owned());
        let index = in_netns(&s.ns, move || engine.add_peer(&d, &config)).expect("add peer");
        // As the gateway does before it brings a tunnel up: without it, the kernel's IPv6
        // link-local chatter (router solicitations, MLD reports) leaves through the TUN at
        // random moments, as data the engine sends the peer.
        let ipv6 = format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6");
        in_netns(&s.ns, move || std::fs::write(ipv6, "1")).expect("ipv6 off");
        ip(&["-n", &s.ns, "link", "set", dev, "up"]).expect("tun up");
        let tunn = Tunn::new(
            StaticSecret::from(key.private_bytes()),
            PublicKey::from(s.engine_public),
            None,
            None,
            index.wrapping_add(1),
            None,
        );
        Self {
            tunn,
            socket,
            public: *key.public().as_bytes(),
            index,
            dev: dev.to_owned(),
        }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.socket.local_addr().expect("addr")
    }

    /// Serves the engine until its confirming keepalive arrives (the handshake is complete),
    /// for at most `limit`; whether it did.
    pub(crate) fn handshake(&mut self, engine: SocketAddr, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if self.serve(engine, Duration::from_millis(100)) {
                return true;
            }
        }
        false
    }

    /// Receives and answers what the engine sends for up to `for_`; whether a data message
    /// (the engine's confirming keepalive) arrived.
    pub(crate) fn serve(&mut self, engine: SocketAddr, for_: Duration) -> bool {
        let until = Instant::now() + for_;
        let mut buf = vec![0u8; 65536];
        let mut out = vec![0u8; 65536];
        let mut got_data = false;
        while Instant::now() < until {
            if let TunnResult::WriteToNetwork(p) = self.tunn.update_timers(&mut out) {
                self.socket.send_to(p, engine).expect("send");
            }
            let Ok((n, _)) = self.socket.recv_from(&mut buf) else {
                continue;
            };
            got_data |= buf[0] == 4;
            if let TunnResult::WriteToNetwork(reply) =
                self.tunn.decapsulate(None, &buf[..n], &mut out)
            {
                self.socket.send_to(reply, engine).expect("reply");
                let mut queued = vec![0u8; 65536];
                while let TunnResult::WriteToNetwork(p) =
                    self.tunn.decapsulate(None, &[], &mut queued)
                {
                    self.socket.send_to(p, engine).expect("queued");
                }
            }
        }
        got_data
    }

    /// One data datagram of this session (an IPv4 header from an allowed source is enough for
    /// the engine to write it into the TUN), not sent.
    pub(crate) fn seal_data(&mut self) -> Vec<u8> {
        let mut packet = vec![0u8; 28];
        packet[0] = 0x45;
        packet[2..4].copy_from_slice(&28u16.to_be_bytes());
        packet[8] = 64;
        packet[9] = 17;
        packet[12..16].copy_from_slice(&[10, 200, 0, 2]);
        packet[16..20].copy_from_slice(&[10, 200, 0, 1]);
        let mut out = vec![0u8; 256];
        match self.tunn.encapsulate(&packet, &mut out) {
            TunnResult::WriteToNetwork(d) => d.to_vec(),
            other => panic!("no session to send data with: {other:?}"),
        }
    }

    /// Sends one data packet into the tunnel ([`Peer::seal_data`]).
    pub(crate) fn send_data(&mut self, engine: SocketAddr) {
        let datagram = self.seal_data();
        self.socket.send_to(&datagram, engine).expect("data");
    }
}

pub(crate) fn dropped(engine: &Engine, reason: DropReason) -> u64 {
    engine
        .dropped()
        .into_iter()
        .find(|(r, _)| *r == reason)
        .map_or(0, |(_, n)| n)
}
