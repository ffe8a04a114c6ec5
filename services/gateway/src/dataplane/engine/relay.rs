//! Relaying through a hub (ADR 0025): when two leaves behind NAT cannot reach each other
//! directly, the hub that introduced them forwards their WireGuard datagrams, which it cannot
//! read, on its one UDP port.
//!
//! A relayed datagram is a WireGuard datagram behind a 20-byte header: a type byte no
//! WireGuard message uses ([`TYPE`]), three zero bytes, then the tags of the sender's and the
//! receiver's public keys (their first 8 bytes). The header fits the 80 bytes a tunnel's MTU
//! keeps free over an IPv4 underlay (WireGuard needs 60 there); over IPv6 a relayed full-size
//! packet is fragmented.
//!
//! - **The hub** forwards a datagram only when the relay is on, its sender is where an
//!   authenticated full peer of ours is (the source address our WireGuard session with that
//!   peer roams to, which a forger cannot take without the peer's key), and both ends are full
//!   peers we relay for (the pairs we introduce); each (sender, receiver) pair has a token
//!   bucket, so a flood through the relay is dropped without touching other pairs.
//! - **A leaf** takes a relayed datagram only from the hub it relays that peer through, and
//!   hands the WireGuard message inside to the peer's session as if it came directly; its
//!   answers go back through the hub. A peer is relayed once it has not been heard from
//!   directly for [`RELAY_AFTER`] since it was added, or for [`DIRECT_STALE`] since it
//!   last was, or when data sent to it directly went unanswered for [`SUSPECT_AFTER`] and a
//!   handshake sent directly to ask for an answer got none within [`ANSWER_WITHIN`], or
//!   when it was last heard through the hub (it found the direct path dead first: we follow,
//!   so our answers do not wait for our own timers to find the same). While relayed, its
//!   direct candidates are probed with keepalives, and the first one heard directly switches
//!   the pair back. What went directly while the path was dying is resent through the hub
//!   ([`super::resend`]), so neither switch loses a datagram.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::peers::Peer;
use super::{DropReason, Shared};

/// The first byte of a relayed datagram (WireGuard's messages are types 1 to 4).
pub(super) const TYPE: u8 = 0x80;
/// The header's length: type, three zero bytes, the sender's tag, the receiver's tag.
pub(super) const HEADER: usize = 20;

/// How long a peer that was never heard from directly is tried directly before the relay.
pub const RELAY_AFTER: Duration = Duration::from_secs(3);
/// How long a peer may stay silent on its direct path before the relay takes over (the
/// persistent keepalive, 25 s, keeps a working path fresher than this).
pub const DIRECT_STALE: Duration = Duration::from_secs(30);

/// How long data sent directly may go unanswered before a handshake asks the direct path for
/// an answer (a one-way stream is answered by WireGuard's passive keepalive only after 10 s,
/// so such a question comes every [`ASK_EVERY`] at most).
pub const SUSPECT_AFTER: Duration = Duration::from_millis(500);
/// How long that handshake's answer may take before the relay takes over.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(1);
/// The least time between two such questions to one peer, unless the peer's own data came
/// directly since the last one (a two-way stream, whose path then dies, is asked again as soon
/// as its data goes unanswered).
pub const ASK_EVERY: Duration = Duration::from_secs(5);

/// A public key's tag in relay headers: its first 8 bytes.
pub(super) fn tag(key: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&key[..8]);
    u64::from_be_bytes(first)
}

/// The header of a datagram from `from` to `to` (tags).
pub(super) fn header(from: u64, to: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = TYPE;
    h[4..12].copy_from_slice(&from.to_be_bytes());
    h[12..20].copy_from_slice(&to.to_be_bytes());
    h
}

/// `(sender tag, receiver tag, WireGuard datagram)` of a relayed datagram.
pub(super) fn parse(datagram: &[u8]) -> Option<(u64, u64, &[u8])> {
    if datagram.len() <= HEADER || datagram[0] != TYPE || datagram[1..4] != [0, 0, 0] {
        return None;
    }
    let from = u64::from_be_bytes(datagram[4..12].try_into().ok()?);
    let to = u64::from_be_bytes(datagram[12..20].try_into().ok()?);
    Some((from, to, &datagram[HEADER..]))
}

/// What the hub's relay allows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RelayPolicy {
    /// Whether this engine relays for its full peers at all.
    pub enabled: bool,
    /// Datagrams a second one (sender, receiver) pair may send through the relay.
    pub rate: f64,
    /// How many it may send at once.
    pub burst: f64,
}

impl Default for RelayPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            rate: 20_000.0,
            burst: 2_000.0,
        }
    }
}

/// Relayed pairs tracked at once: beyond that, a new pair is held back until idle ones are
/// forgotten (pairs are of authenticated full peers, so this bounds only churn).
pub(super) const MAX_PAIRS: usize = 65_536;

/// Where a peer's datagrams go.
pub(super) enum Route {
    Direct(SocketAddr),
    /// To the hub, behind this header.
    Relayed(SocketAddr, [u8; HEADER]),
}

impl Shared {
    /// Milliseconds since the engine started, plus one (0 stands for "never").
    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .saturating_add(1)
    }

    /// Whether `peer` is relayed now (see the module doc); false without a relay for it.
    pub(super) fn relayed(&self, peer: &Peer) -> bool {
        self.relay_route(peer).is_some()
    }

    /// The hub and header `peer`'s datagrams take when it is relayed now.
    fn relay_route(&self, peer: &Peer) -> Option<(SocketAddr, [u8; HEADER])> {
        let hub_key = (*peer.relay_via.read().unwrap_or_else(|e| e.into_inner()))?;
        let heard = peer.direct_rx_ms.load(Ordering::Relaxed);
        // Heard through the hub since it was last heard directly: it found the direct path
        // dead first, and we follow.
        let followed = peer.relayed_rx_ms.load(Ordering::Relaxed) > heard;
        let stale = followed
            || if heard == 0 {
                peer.added.elapsed() >= RELAY_AFTER
            } else {
                let now = self.now_ms();
                now.saturating_sub(heard) > DIRECT_STALE.as_millis() as u64
                    || self.direct_unanswered(peer, now)
            };
        if !stale {
            return None;
        }
        let hub = self.peer_by_key(&hub_key)?;
        Some((hub.endpoint(), header(self.tag, peer.tag)))
    }

    /// Whether the direct path to `peer` left a question unanswered: data went unanswered for
    /// [`SUSPECT_AFTER`], a handshake then asked the direct path for an answer, and none came
    /// within [`ANSWER_WITHIN`].
    fn direct_unanswered(&self, peer: &Peer, now: u64) -> bool {
        let since = peer.unanswered_ms.load(Ordering::Relaxed);
        let asked = peer.asked_ms.load(Ordering::Relaxed);
        since != 0 && asked > since && now.saturating_sub(asked) > ANSWER_WITHIN.as_millis() as u64
    }

    /// Data went directly to `peer`, which has a relay (the sender checks, once per drain):
    /// from now on its path owes an answer (a peer's own data, acknowledgement or keepalive).
    pub(super) fn sent_data(&self, peer: &Peer) {
        if peer.unanswered_ms.load(Ordering::Relaxed) == 0 {
            peer.unanswered_ms.store(self.now_ms(), Ordering::Relaxed);
        }
    }

    /// Whether the timer thread should ask `peer`'s direct path for an answer now: data has
    /// gone unanswered for [`SUSPECT_AFTER`], and no question was asked for [`ASK_EVERY`] (a
    /// question is forgotten when the peer's data comes directly). Marks the question asked.
    pub(super) fn should_ask(&self, peer: &Peer) -> bool {
        let since = peer.unanswered_ms.load(Ordering::Relaxed);
        let asked = peer.asked_ms.load(Ordering::Relaxed);
        let now = self.now_ms();
        let due = since != 0
            && asked <= since
            && now.saturating_sub(since) > SUSPECT_AFTER.as_millis() as u64
            && (asked == 0 || now.saturating_sub(asked) > ASK_EVERY.as_millis() as u64);
        if due {
            peer.asked_ms.store(now, Ordering::Relaxed);
        }
        due
    }

    /// Where `peer`'s datagrams go now.
    pub(super) fn route(&self, peer: &Peer) -> Route {
        match self.relay_route(peer) {
            Some((hub, header)) => Route::Relayed(hub, header),
            None => Route::Direct(peer.endpoint()),
        }
    }

    /// Sends `datagram` to `peer` the way it goes now.
    pub(super) fn send_to_peer(&self, peer: &Peer, datagram: &[u8]) {
        match self.route(peer) {
            Route::Direct(to) => self.send(datagram, to),
            Route::Relayed(hub, header) => self.send_wrapped(&header, datagram, hub),
        }
    }

    /// Sends `datagram` to `peer` through its hub, whatever the route (an answer to what came
    /// that way). False without a hub for it.
    pub(super) fn send_through_hub(&self, peer: &Peer, datagram: &[u8]) -> bool {
        let hub_key = *peer.relay_via.read().unwrap_or_else(|e| e.into_inner());
        let Some(hub) = hub_key.and_then(|k| self.peer_by_key(&k)) else {
            return false;
        };
        self.send_wrapped(&header(self.tag, peer.tag), datagram, hub.endpoint());
        true
    }

    pub(super) fn send_wrapped(&self, header: &[u8; HEADER], datagram: &[u8], to: SocketAddr) {
        let mut wrapped = Vec::with_capacity(HEADER + datagram.len());
        wrapped.extend_from_slice(header);
        wrapped.extend_from_slice(datagram);
        self.send(&wrapped, to);
    }

    /// A relayed datagram that is not for us: forwarded to its receiver if we relay this pair.
    pub(super) fn forward(&self, from: SocketAddr, sender: u64, receiver: u64, datagram: &[u8]) {
        let policy = *self.relay_policy.read().unwrap_or_else(|e| e.into_inner());
        let ends = (self.peer_by_tag(sender), self.peer_by_tag(receiver));
        let (Some(source), Some(target)) = ends else {
            return self.count(DropReason::RelayRefused);
        };
        let allowed = policy.enabled
            && source.relayable.load(Ordering::Relaxed)
            && target.relayable.load(Ordering::Relaxed)
            && source.direct_rx_ms.load(Ordering::Relaxed) != 0
            && source.endpoint() == from
            && target.direct_rx_ms.load(Ordering::Relaxed) != 0;
        if !allowed {
            return self.count(DropReason::RelayRefused);
        }
        let admitted = self
            .relay_buckets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .allow(
                (sender, receiver),
                policy.rate,
                policy.burst,
                Instant::now(),
            );
        if !admitted {
            return self.count(DropReason::RelayRateLimited);
        }
        self.send(datagram, target.endpoint());
    }

    /// Whether a relayed WireGuard message from `from` claiming to be `peer`'s may be taken:
    /// it came from the hub we relay that peer through.
    pub(super) fn came_through_its_hub(&self, peer: &Peer, sender: u64, from: SocketAddr) -> bool {
        if peer.tag != sender {
            return false;
        }
        let hub_key = *peer.relay_via.read().unwrap_or_else(|e| e.into_inner());
        hub_key
            .and_then(|k| self.peer_by_key(&k))
            .is_some_and(|hub| hub.endpoint() == from)
    }
}

impl super::Engine {
    /// What the relay allows from now on.
    pub fn set_relay_policy(&self, policy: RelayPolicy) {
        *self
            .shared
            .relay_policy
            .write()
            .unwrap_or_else(|e| e.into_inner()) = policy;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_wireguard_messages_are_not_relayed_ones() {
        let h = header(7, 9);
        let mut datagram = h.to_vec();
        datagram.extend_from_slice(&[4, 0, 0, 0, 1, 2]);
        let (from, to, inner) = parse(&datagram).expect("parses");
        assert_eq!((from, to, inner), (7, 9, &[4u8, 0, 0, 0, 1, 2][..]));
        for wireguard in [[1u8, 0, 0, 0], [4, 0, 0, 0]] {
            assert!(parse(&wireguard).is_none());
        }
        // A header with nothing behind it, or with non-zero reserved bytes, is no datagram.
        assert!(parse(&h).is_none());
        let mut spoiled = datagram.clone();
        spoiled[2] = 1;
        assert!(parse(&spoiled).is_none());
    }
}
