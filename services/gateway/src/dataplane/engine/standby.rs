//! What the replicas' election (`crate::replicas`) asks of the engine. A standby's engine
//! holds every peer but sends nothing and drops what it receives; turning active starts a
//! fresh handshake with every peer, which moves each remote's endpoint for us here. The
//! active shares where it hears roamed peers, so a standby's takeover reaches them there.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use defguard_boringtun::noise::TunnResult;

use super::Engine;
use super::peers::PeerConfig;

impl Engine {
    /// Whether the engine is a standby's.
    pub fn is_standby(&self) -> bool {
        self.shared.standby.load(Ordering::Relaxed)
    }

    /// Makes the engine a standby's (`true`: it sends nothing, not even keepalives, and drops
    /// every datagram, counted as [`DropReason::Standby`](super::DropReason::Standby)) or the active's. Becoming active
    /// starts a fresh session with every peer and sends each an initiation at once: its
    /// timestamp is this moment's, newer than any the previous active sent, so every remote
    /// accepts it and, the message being authenticated, moves its endpoint for us here
    /// (roaming): no control-plane message is needed.
    pub fn set_standby(&self, standby: bool) {
        let shared = &self.shared;
        if shared.standby.swap(standby, Ordering::SeqCst) == standby || standby {
            return;
        }
        let peers = shared.all_peers();
        for peer in &peers {
            let keepalive = *peer.keepalive.lock().unwrap_or_else(|e| e.into_inner());
            let config = PeerConfig {
                public_key: peer.public_key,
                endpoint: peer.endpoint(),
                allowed_ips: Vec::new(),
                keepalive,
                candidates: peer.candidates(),
                relay_via: *peer.relay_via.read().unwrap_or_else(|e| e.into_inner()),
                relayable: peer.relayable.load(Ordering::Relaxed),
                translation: peer.translation().map(|t| (*t).clone()),
            };
            *peer.tunn() = shared.tunn(&config, peer.index);
            // Where the previous active last heard the peer may be out of date (the peer's
            // cluster failed over too): its published endpoint gets the same initiation.
            let configured = *peer.configured.lock().unwrap_or_else(|e| e.into_inner());
            let also = (configured != peer.endpoint()).then_some(configured);
            shared.initiate_to(peer, also);
        }
    }

    /// Sends every peer a new handshake initiation now, keeping the current sessions until the
    /// new ones complete: an active that hears a deposed active come back (its links restored)
    /// re-points the peers the deposed one may have drawn to itself with its last packets.
    pub fn reassert(&self) {
        if self.shared.standby.load(Ordering::Relaxed) {
            return;
        }
        let peers = self.shared.all_peers();
        let mut buf = [0u8; 256];
        for peer in peers {
            let result = peer.tunn().format_handshake_initiation(&mut buf, true);
            if let TunnResult::WriteToNetwork(packet) = result {
                self.shared.send(packet, peer.endpoint());
            }
        }
    }

    /// Every peer whose endpoint moved away from its configured one (roaming), by public key:
    /// what the active tells its standbys, so that a takeover reaches peers where they are.
    pub fn roamed(&self) -> Vec<([u8; 32], SocketAddr)> {
        let peers = self.shared.peers.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<([u8; 32], SocketAddr)> = peers
            .by_index
            .values()
            .filter(|p| *p.configured.lock().unwrap_or_else(|e| e.into_inner()) != p.endpoint())
            .map(|p| (p.public_key, p.endpoint()))
            .collect();
        out.sort();
        out
    }

    /// Points every peer at the endpoint the active last heard it from (`roamed`, by public
    /// key), and every other peer back at its configured endpoint. For a standby: its
    /// takeover then starts where the peers are.
    pub fn follow_roamed(&self, roamed: &[([u8; 32], SocketAddr)]) {
        let peers = self.shared.peers.read().unwrap_or_else(|e| e.into_inner());
        for peer in peers.by_index.values() {
            let configured = *peer.configured.lock().unwrap_or_else(|e| e.into_inner());
            let to = roamed
                .iter()
                .find(|(key, _)| *key == peer.public_key)
                .map_or(configured, |(_, at)| *at);
            if peer.endpoint() != to {
                *peer.endpoint.write().unwrap_or_else(|e| e.into_inner()) = to;
            }
        }
    }
}
