//! The peers table: every peer by its 24-bit index (what data, handshake responses and
//! cookie replies name) and by its public key (what a handshake initiation names once
//! decrypted), with the TUN interface, the session and the endpoint of each. Adding a peer
//! creates its TUN and starts a handshake at once; updating one keeps its session where it
//! can.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Instant, SystemTime};

use defguard_boringtun::noise::Tunn;
use defguard_boringtun::x25519::PublicKey;
use ipnet::IpNet;
use mio::unix::SourceFd;
use mio::{Interest, Token};

use super::translate::Translation;
use super::tun::Tun;
use super::{Engine, Shared, io_err, relay, resend};

/// Peer indices are 24 bits: boringtun keeps the low 8 bits of a session index for itself.
const INDEX_MASK: u32 = 0x00ff_ffff;

/// What one peer is configured with (nothing secret: our private key is the engine's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    pub public_key: [u8; 32],
    pub endpoint: SocketAddr,
    pub allowed_ips: Vec<IpNet>,
    /// Persistent keepalive in seconds, 0 for none.
    pub keepalive: u16,
    /// Other places the peer may be reached (its reflexive endpoint behind a NAT, as a hub
    /// sees it): until an authenticated message arrives, every handshake initiation goes to
    /// the endpoint and to each of these, and whichever answers becomes the endpoint.
    pub candidates: Vec<SocketAddr>,
    /// The public key of the hub this peer is relayed through when it cannot be reached
    /// directly (an induced peer: the hub that introduced it, itself a peer of ours).
    pub relay_via: Option<[u8; 32]>,
    /// Whether we relay this peer's datagrams to our other relayable peers and theirs to it (a
    /// full peer of a hub, whose pairs the hub introduced).
    pub relayable: bool,
    /// The addresses of every IPv4 packet from its TUN rewritten before it is encrypted, the
    /// sending side of a stateless wire convention (ADR 0032); `None` sends packets as the
    /// kernel wrote them.
    pub translation: Option<Translation>,
}

/// A peer's counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub last_handshake: Option<SystemTime>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub endpoint: Option<SocketAddr>,
    /// Whether its datagrams go through a hub now.
    pub relayed: bool,
}

pub(super) struct Peer {
    pub(super) index: u32,
    pub(super) name: String,
    pub(super) public_key: [u8; 32],
    pub(super) tun: Tun,
    pub(super) tunn: Mutex<Tunn>,
    /// Where the peer is now: the configured endpoint until an authenticated message came from
    /// elsewhere (roaming).
    pub(super) endpoint: RwLock<SocketAddr>,
    /// The endpoint last configured: a reconfiguration with the same one keeps a roamed
    /// endpoint (a remote gateway that failed over to its standby is where its handshake came
    /// from, not where its NetworkConfig said).
    pub(super) configured: Mutex<SocketAddr>,
    pub(super) allowed_ips: RwLock<Vec<IpNet>>,
    pub(super) keepalive: Mutex<u16>,
    pub(super) candidates: RwLock<Vec<SocketAddr>>,
    pub(super) translation: RwLock<Option<Arc<Translation>>>,
    /// Whether an authenticated message came from the peer directly since it was added: until
    /// then the timer thread probes every candidate.
    pub(super) confirmed: AtomicBool,
    /// When the probing began and when the last probe went out ([`super::handshakes`]).
    pub(super) probing: Mutex<(Instant, Instant)>,
    /// Its key's tag in relay headers.
    pub(super) tag: u64,
    /// The hub it is relayed through, when it has one ([`PeerConfig::relay_via`]).
    pub(super) relay_via: RwLock<Option<[u8; 32]>>,
    pub(super) relayable: AtomicBool,
    /// When an authenticated message last came from it directly (not through a hub), in the
    /// engine's milliseconds ([`Shared::now_ms`]); 0 for never.
    pub(super) direct_rx_ms: AtomicU64,
    /// When an authenticated message last came from it through its hub: later than
    /// [`Self::direct_rx_ms`], the peer has moved to the relay, and we follow.
    pub(super) relayed_rx_ms: AtomicU64,
    /// Since when data sent to it directly has gone unanswered (0: everything answered), and
    /// when the last handshake that asks the direct path for an answer went out
    /// ([`super::relay`]).
    pub(super) unanswered_ms: AtomicU64,
    pub(super) asked_ms: AtomicU64,
    /// The route the timer thread last saw, to log when it changes.
    pub(super) was_relayed: AtomicBool,
    /// Set when a relayed peer is heard directly: the timer thread answers with a keepalive
    /// on the direct path.
    pub(super) greet: AtomicBool,
    /// When the peer was added: a peer never heard directly is relayed [`super::RELAY_AFTER`]
    /// after this, whatever candidates arrive later (those are probed from the relay).
    pub(super) added: Instant,
    /// Data datagrams lately sent directly, resent through the hub when the route moves there
    /// ([`super::resend`]).
    pub(super) sent: Mutex<resend::Sent>,
    /// The last handshake initiation we made for it, sent again while it may be in flight
    /// ([`super::handshakes`]).
    pub(super) initiation: Mutex<Option<Vec<u8>>>,
}

impl Peer {
    pub(super) fn tunn(&self) -> MutexGuard<'_, Tunn> {
        // A panic while holding the lock cannot leave the session half-updated in a way we
        // could repair; keep going with what it holds.
        self.tunn.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn endpoint(&self) -> SocketAddr {
        *self.endpoint.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The initiation of the handshake in flight, if any: none once the peer was heard from
    /// directly.
    pub(super) fn pending_initiation(&self) -> Option<Vec<u8>> {
        if self.confirmed.load(Ordering::Relaxed) {
            return None;
        }
        self.initiation
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The translation of what leaves its TUN, if any.
    pub(super) fn translation(&self) -> Option<Arc<Translation>> {
        self.translation
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) fn candidates(&self) -> Vec<SocketAddr> {
        self.candidates
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(super) fn allows(&self, source: IpAddr) -> bool {
        self.allowed_ips
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|net| net.contains(&source))
    }
}

#[derive(Default)]
pub(super) struct Peers {
    pub(super) by_index: HashMap<u32, Arc<Peer>>,
    pub(super) by_key: HashMap<[u8; 32], u32>,
    /// By key tag, what relay headers name ([`super::relay`]).
    pub(super) by_tag: HashMap<u64, u32>,
}

impl Engine {
    /// Creates the TUN interface `name` and the peer behind it; returns the peer's index.
    /// Sends a handshake initiation at once: a restarted gateway must not wait for the peer's
    /// rekey timers (15 s) before its tunnels carry traffic again.
    pub fn add_peer(&self, name: &str, config: &PeerConfig) -> io::Result<u32> {
        let shared = &self.shared;
        let tun = Tun::open(name, shared.tun_offload)
            .map_err(|e| io_err(format!("creating tun interface {name}: {e}")))?;
        let fd = tun.fd();
        let peer = {
            let mut peers = shared.write_peers();
            if let Some(other) = peers.by_key.get(&config.public_key) {
                let other = peers.by_index.get(other).map(|p| p.name.clone());
                return Err(io_err(format!(
                    "the public key of {name} is already the key of {}",
                    other.unwrap_or_default()
                )));
            }
            let index = loop {
                let candidate = shared.next_index.fetch_add(1, Ordering::Relaxed) & INDEX_MASK;
                if !peers.by_index.contains_key(&candidate) {
                    break candidate;
                }
            };
            let peer = Arc::new(Peer {
                index,
                name: name.to_owned(),
                public_key: config.public_key,
                tun,
                tunn: Mutex::new(shared.tunn(config, index)),
                endpoint: RwLock::new(config.endpoint),
                configured: Mutex::new(config.endpoint),
                allowed_ips: RwLock::new(config.allowed_ips.clone()),
                keepalive: Mutex::new(config.keepalive),
                candidates: RwLock::new(config.candidates.clone()),
                translation: RwLock::new(config.translation.clone().map(Arc::new)),
                confirmed: AtomicBool::new(false),
                probing: Mutex::new((Instant::now(), Instant::now())),
                tag: relay::tag(&config.public_key),
                relay_via: RwLock::new(config.relay_via),
                relayable: AtomicBool::new(config.relayable),
                direct_rx_ms: AtomicU64::new(0),
                relayed_rx_ms: AtomicU64::new(0),
                unanswered_ms: AtomicU64::new(0),
                asked_ms: AtomicU64::new(0),
                was_relayed: AtomicBool::new(false),
                greet: AtomicBool::new(false),
                added: Instant::now(),
                sent: Mutex::default(),
                initiation: Mutex::new(None),
            });
            peers.by_index.insert(index, peer.clone());
            peers.by_key.insert(config.public_key, index);
            peers.by_tag.insert(peer.tag, index);
            peer
        };
        // Registered after the peer is findable by index, so no readiness event finds nobody.
        if let Err(err) = shared.registry.register(
            &mut SourceFd(&fd),
            Token(peer.index as usize),
            Interest::READABLE,
        ) {
            self.remove_peer(peer.index);
            return Err(err);
        }
        if !shared.standby.load(Ordering::Relaxed) {
            shared.initiate(&peer);
        }
        Ok(peer.index)
    }

    /// Applies `config` to the peer `index`: endpoint and AllowedIPs change in place (the
    /// session survives), a new keepalive starts a new session. A new public key is refused:
    /// the key is the peer's identity in the demultiplexer, so such a peer is replaced.
    pub fn update_peer(&self, index: u32, config: &PeerConfig) -> io::Result<()> {
        let shared = &self.shared;
        let Some(peer) = shared.peer(index) else {
            return Err(io_err(format!("no peer with index {index}")));
        };
        if peer.public_key != config.public_key {
            return Err(io_err(format!(
                "the peer behind {} changed its public key",
                peer.name
            )));
        }
        let mut configured = peer.configured.lock().unwrap_or_else(|e| e.into_inner());
        if *configured != config.endpoint {
            *configured = config.endpoint;
            *peer.endpoint.write().unwrap_or_else(|e| e.into_inner()) = config.endpoint;
        }
        drop(configured);
        *peer.allowed_ips.write().unwrap_or_else(|e| e.into_inner()) = config.allowed_ips.clone();
        *peer.relay_via.write().unwrap_or_else(|e| e.into_inner()) = config.relay_via;
        *peer.translation.write().unwrap_or_else(|e| e.into_inner()) =
            config.translation.clone().map(Arc::new);
        peer.relayable.store(config.relayable, Ordering::Relaxed);
        let new_candidates = {
            let mut candidates = peer.candidates.write().unwrap_or_else(|e| e.into_inner());
            let new = *candidates != config.candidates;
            candidates.clone_from(&config.candidates);
            new
        };
        if new_candidates && !peer.confirmed.load(Ordering::Relaxed) {
            // A peer we have not heard from yet: try the new places at once.
            *peer.probing.lock().unwrap_or_else(|e| e.into_inner()) =
                (Instant::now(), Instant::now());
            if !shared.standby.load(Ordering::Relaxed) {
                shared.initiate(&peer);
            }
        }
        let mut keepalive = peer.keepalive.lock().unwrap_or_else(|e| e.into_inner());
        if *keepalive != config.keepalive {
            *keepalive = config.keepalive;
            *peer.tunn() = shared.tunn(config, index);
            drop(keepalive);
            if !shared.standby.load(Ordering::Relaxed) {
                shared.initiate(&peer);
            }
        }
        Ok(())
    }

    /// Removes the peer `index`; its TUN interface disappears once no thread holds it.
    pub fn remove_peer(&self, index: u32) {
        let removed = {
            let mut peers = self.shared.write_peers();
            let removed = peers.by_index.remove(&index);
            if let Some(peer) = &removed {
                peers.by_key.remove(&peer.public_key);
                if peers.by_tag.get(&peer.tag) == Some(&index) {
                    peers.by_tag.remove(&peer.tag);
                }
            }
            removed
        };
        if let Some(peer) = removed {
            let fd = peer.tun.fd();
            let _ = self.shared.registry.deregister(&mut SourceFd(&fd));
        }
    }

    /// The counters of the peer `index`.
    pub fn counters(&self, index: u32) -> Option<Counters> {
        let peer = self.shared.peer(index)?;
        let (since, tx, rx, _, _) = peer.tunn().stats();
        Some(Counters {
            last_handshake: since.and_then(|d| SystemTime::now().checked_sub(d)),
            rx_bytes: rx as u64,
            tx_bytes: tx as u64,
            endpoint: Some(peer.endpoint()),
            relayed: self.shared.relayed(&peer),
        })
    }
}

impl Shared {
    pub(super) fn write_peers(&self) -> std::sync::RwLockWriteGuard<'_, Peers> {
        self.peers.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn peer(&self, index: u32) -> Option<Arc<Peer>> {
        self.peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_index
            .get(&index)
            .cloned()
    }

    /// Every peer, taken out of the lock (a pass over all of them must not hold it).
    pub(super) fn all_peers(&self) -> Vec<Arc<Peer>> {
        self.peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_index
            .values()
            .cloned()
            .collect()
    }

    pub(super) fn peer_by_tag(&self, tag: u64) -> Option<Arc<Peer>> {
        let peers = self.peers.read().unwrap_or_else(|e| e.into_inner());
        let index = peers.by_tag.get(&tag)?;
        peers.by_index.get(index).cloned()
    }

    pub(super) fn peer_by_key(&self, key: &[u8; 32]) -> Option<Arc<Peer>> {
        let peers = self.peers.read().unwrap_or_else(|e| e.into_inner());
        let index = peers.by_key.get(key)?;
        peers.by_index.get(index).cloned()
    }

    pub(super) fn tunn(&self, config: &PeerConfig, index: u32) -> Tunn {
        Tunn::new(
            self.secret.clone(),
            PublicKey::from(config.public_key),
            None,
            (config.keepalive > 0).then_some(config.keepalive),
            index,
            Some(self.mac1_only.clone()),
        )
    }
}
