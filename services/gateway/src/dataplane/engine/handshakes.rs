//! Handshakes, off the data path: the handshake thread (the receiving thread hands it every
//! initiation and response through a bounded queue, so a flood of them cannot slow other
//! peers' data), the per-source token buckets that hold each source to its share under load,
//! starting a handshake with a peer, and the timer thread that drives every session's
//! handshake retries, keepalives and rekeys.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use defguard_boringtun::noise::TunnResult;

use super::buckets::TokenBuckets;
use super::peers::Peer;
use super::receive::Sink;
use super::{BUF, RECV_TIMEOUT, Shared, TICK};

/// Handshake messages per second (all peers together) before cookies are demanded, as
/// boringtun's own device sets it.
pub(super) const HANDSHAKE_RATE_LIMIT: u64 = 100;

/// Handshake messages waiting for the handshake thread; more are dropped (kernel WireGuard
/// queues 4096 per device; ours serves one gateway's peers, a few hundred at most).
pub(super) const HANDSHAKE_QUEUE: usize = 1024;

/// Under load, handshake messages per second one source address may send, and its burst: kernel
/// WireGuard's `ratelimiter.c` values (20 packets/s, burst 5).
const SOURCE_RATE: f64 = 20.0;
const SOURCE_BURST: f64 = 5.0;

/// Sources tracked at once under load; a new source beyond that is refused until old ones
/// expire (the table of a spoofing flood must not grow without bound).
const MAX_SOURCES: usize = 16_384;

/// Handshake messages, one at a time, off the thread that carries every peer's data.
pub(super) fn handshake_loop(
    shared: &Shared,
    queue: &std::sync::mpsc::Receiver<(SocketAddr, Vec<u8>)>,
) {
    let mut sink = Sink::new(1);
    while !shared.stop.load(Ordering::Relaxed) {
        match queue.recv_timeout(RECV_TIMEOUT) {
            Ok((from, datagram)) => {
                shared.handle(from, &datagram, &mut sink);
                sink.flush(shared);
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// A token bucket per source address (IPv6 by /64, as kernel WireGuard groups them), consulted
/// only under load.
pub(super) struct SourceBuckets(TokenBuckets<IpAddr>);

impl Default for SourceBuckets {
    fn default() -> Self {
        Self(TokenBuckets::new(MAX_SOURCES))
    }
}

impl SourceBuckets {
    pub(super) fn allow(&mut self, source: IpAddr, now: Instant) -> bool {
        let source = match source {
            IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(Ipv6Addr::from(bits))
            }
            IpAddr::V6(v6) => IpAddr::V4(v6.to_ipv4_mapped().unwrap_or(Ipv4Addr::UNSPECIFIED)),
            v4 => v4,
        };
        self.0.allow(source, SOURCE_RATE, SOURCE_BURST, now)
    }
}

impl Shared {
    /// Starts a handshake with `peer` now, sent to its endpoint and, until the peer was heard
    /// from, to each of its candidates.
    pub(super) fn initiate(&self, peer: &Peer) {
        self.initiate_everywhere(peer, false);
    }

    /// A handshake initiation to the endpoint and, unless confirmed, every candidate, and
    /// through the hub when the peer is relayed; `force` makes a new one even while one is in
    /// flight (a probe). Without `force`, while one is in flight, that one goes again (new
    /// candidates must hear it now, not at the next probe).
    fn initiate_everywhere(&self, peer: &Peer, force: bool) {
        let mut buf = [0u8; 256];
        let fresh = match peer.tunn().format_handshake_initiation(&mut buf, force) {
            TunnResult::WriteToNetwork(packet) => {
                let packet = packet.to_vec();
                *peer.initiation.lock().unwrap_or_else(|e| e.into_inner()) = Some(packet.clone());
                Some(packet)
            }
            _ => None,
        };
        let Some(packet) = fresh.or_else(|| peer.pending_initiation()) else {
            return;
        };
        self.send_direct(peer, &packet);
        if self.relayed(peer) {
            self.send_through_hub(peer, &packet);
        }
    }

    /// `datagram` to the peer's endpoint and, unless confirmed, each of its candidates.
    fn send_direct(&self, peer: &Peer, datagram: &[u8]) {
        let endpoint = peer.endpoint();
        self.send(datagram, endpoint);
        if !peer.confirmed.load(Ordering::Relaxed) {
            for candidate in peer.candidates() {
                if candidate != endpoint {
                    self.send(datagram, candidate);
                }
            }
        }
    }

    /// Probes a peer that was not heard from yet: a new initiation to every place every
    /// [`PROBE_FAST`] for the first [`PROBE_FAST_FOR`], then, for a peer with candidates, every
    /// [`PROBE_SLOW`]. Both ends of an induced pair start within a second or two of each other,
    /// and each one's first datagram opens its own NAT for the other's. A leaf behind a NAT
    /// and its hub are the same race: the hub drops the leaf's first initiation when it has
    /// not added the leaf yet, and cannot reach the leaf's private address itself, so without
    /// this the leaf would wait for WireGuard's own retry (5 s) and every induced pair of that
    /// leaf with it (the hub learns the leaf's reflexive endpoint from that handshake).
    ///
    /// A peer relayed through its hub with a session is probed with keepalives on its direct
    /// path instead (a new handshake that only the direct path carries would never complete,
    /// and WireGuard ends a session whose rekey keeps failing): the first one that arrives
    /// makes the other end answer directly, which switches the pair back.
    fn probe(&self, peer: &Peer, relayed: bool, now: Instant) {
        let mut probing = peer.probing.lock().unwrap_or_else(|e| e.into_inner());
        let (began, last) = *probing;
        let fast = now.duration_since(began) < PROBE_FAST_FOR;
        // Past the fast phase, a peer without candidates is left to WireGuard's own retries:
        // it has one place only, and the peer there may simply be down.
        let unheard = !peer.confirmed.load(Ordering::Relaxed)
            && (fast
                || !peer
                    .candidates
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_empty());
        if !relayed && !unheard {
            return;
        }
        let every = if fast { PROBE_FAST } else { PROBE_SLOW };
        if now.duration_since(last) < every {
            // Between two new initiations, the one in flight goes again every tick while the
            // probing is new: a NAT in front of the peer drops our first copies until the peer
            // has sent towards us, and a hub drops them until it has added us. The same bytes
            // make no new handshake state, so an answer that takes longer than a tick still
            // completes the handshake (a new initiation every tick would not, over a long
            // round trip).
            if !relayed && unheard && now.duration_since(began) < RESEND_FOR {
                drop(probing);
                if let Some(packet) = peer.pending_initiation() {
                    self.send_direct(peer, &packet);
                }
            }
            return;
        }
        let session = peer.tunn().time_since_last_handshake().is_some();
        probing.1 = now;
        drop(probing);
        if relayed && session {
            let mut buf = [0u8; 64];
            if let TunnResult::WriteToNetwork(keepalive) = peer.tunn().encapsulate(&[], &mut buf) {
                self.send_direct(peer, keepalive);
            }
        } else {
            self.initiate_everywhere(peer, true);
        }
    }

    /// Starts a handshake with `peer` now, sent to its endpoint and to `also`.
    pub(super) fn initiate_to(&self, peer: &Peer, also: Option<SocketAddr>) {
        let mut buf = [0u8; 256];
        let result = peer.tunn().format_handshake_initiation(&mut buf, false);
        if let TunnResult::WriteToNetwork(packet) = result {
            self.send(packet, peer.endpoint());
            if let Some(to) = also {
                self.send(packet, to);
            }
        }
    }
}

/// How often a peer not heard from yet is probed at first, and for how long.
const PROBE_FAST: Duration = Duration::from_secs(1);
/// For how long after the probing began the initiation in flight is sent again every tick.
const RESEND_FOR: Duration = Duration::from_secs(5);
const PROBE_FAST_FOR: Duration = Duration::from_secs(20);
/// How often a peer with candidates is probed afterwards, until it answers.
const PROBE_SLOW: Duration = Duration::from_secs(5);

pub(super) fn timer_loop(shared: &Shared) {
    let mut dst = vec![0u8; BUF];
    let mut last_reset = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(TICK);
        #[cfg(test)]
        assert!(
            !shared.crash_timers.load(Ordering::Relaxed),
            "the timer thread crashes, as the test asked"
        );
        if last_reset.elapsed() >= Duration::from_secs(1) {
            shared.limiter.reset_count();
            shared.handshakes.store(0, Ordering::Relaxed);
            last_reset = Instant::now();
        }
        if shared.standby.load(Ordering::Relaxed) {
            continue;
        }
        let peers = shared.all_peers();
        let now = Instant::now();
        for peer in peers {
            let relayed = shared.relayed(&peer);
            if peer.was_relayed.swap(relayed, Ordering::Relaxed) != relayed {
                // What the dead path swallowed goes again, the way that works now.
                let resent = if relayed {
                    shared.resend_through_hub(&peer)
                } else {
                    0
                };
                tracing::info!(
                    interface = %peer.name,
                    path = if relayed { "relayed" } else { "direct" },
                    endpoint = %peer.endpoint(),
                    heard_directly_ms_ago = shared.now_ms().saturating_sub(peer.direct_rx_ms.load(Ordering::Relaxed)),
                    resent,
                    "tunnel path changed"
                );
            } else {
                shared.forget_old_sends(&peer);
            }
            if peer.greet.swap(false, Ordering::Relaxed) {
                let mut buf = [0u8; 64];
                if let TunnResult::WriteToNetwork(keepalive) =
                    peer.tunn().encapsulate(&[], &mut buf)
                {
                    shared.send(keepalive, peer.endpoint());
                }
            }
            shared.probe(&peer, relayed, now);
            if !relayed && shared.should_ask(&peer) {
                // The peer answers a handshake at once: silence means the direct path is gone.
                let mut buf = [0u8; 256];
                let asked = peer.tunn().format_handshake_initiation(&mut buf, true);
                if let TunnResult::WriteToNetwork(initiation) = asked {
                    shared.send(initiation, peer.endpoint());
                }
            }
            let result = peer.tunn().update_timers(&mut dst);
            if let TunnResult::WriteToNetwork(packet) = result {
                shared.send_to_peer(&peer, packet);
            }
        }
    }
}
