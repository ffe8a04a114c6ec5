//! What a pair loses when its direct path dies silently, given back through the relay
//! (ADR 0025): every data datagram sent directly to a peer that has a relay is kept for
//! [`RESEND_AGE`], and when the peer's route moves to the relay, the ones kept go again
//! through the hub.
//!
//! A direct path that dies is only noticed once data has gone unanswered and a handshake
//! asking for an answer got none ([`super::relay`]): everything sent in between is lost on
//! the dead path. Resending it costs the receiver nothing it does not already do: WireGuard's
//! counter window (1024 datagrams in boringtun) takes a resent datagram that never arrived and
//! drops one that did as a duplicate, so no datagram is delivered twice. What is kept is
//! already encrypted; nothing is re-encrypted or buffered in clear.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::peers::Peer;
use super::{Shared, relay};

/// How long a datagram sent directly is kept: enough to cover noticing a dead path at its
/// slowest, with a second to spare for timer passes and the round trip. Data goes unanswered
/// for [`relay::SUSPECT_AFTER`], then a handshake asks and gets no answer within
/// [`relay::ANSWER_WITHIN`]; a path that dies just after a question was answered (a one-way
/// stream is asked every [`relay::ASK_EVERY`]) is asked again only that long after it.
pub const RESEND_AGE: Duration = relay::ASK_EVERY
    .saturating_add(relay::SUSPECT_AFTER)
    .saturating_add(relay::ANSWER_WITHIN)
    .saturating_add(Duration::from_secs(1));
/// WireGuard's data message type.
pub(super) const DATA: u8 = 4;
/// The most datagrams kept per peer (WireGuard's counter window takes 1024 out of order).
const MAX_DATAGRAMS: usize = 512;
/// The most bytes kept per peer.
const MAX_BYTES: usize = 1 << 20;

/// The datagrams lately sent directly to one peer, oldest first, with when they went.
#[derive(Default)]
pub(super) struct Sent {
    kept: VecDeque<(u64, Vec<u8>)>,
    bytes: usize,
}

impl Sent {
    /// Keeps `datagram`, sent at `now_ms`, forgetting the oldest beyond the bounds.
    pub(super) fn keep(&mut self, now_ms: u64, datagram: &[u8]) {
        self.forget_before(now_ms.saturating_sub(RESEND_AGE.as_millis() as u64));
        let mut buf = Vec::new();
        while self.kept.len() >= MAX_DATAGRAMS
            || (!self.kept.is_empty() && self.bytes + datagram.len() > MAX_BYTES)
        {
            if let Some((_, old)) = self.kept.pop_front() {
                self.bytes -= old.len();
                buf = old;
            }
        }
        // The buffer of the datagram forgotten last is reused: no allocation per datagram once
        // the ring is full.
        buf.clear();
        buf.extend_from_slice(datagram);
        self.bytes += buf.len();
        self.kept.push_back((now_ms, buf));
    }

    /// Forgets what was sent before `ms`.
    pub(super) fn forget_before(&mut self, ms: u64) {
        while self.kept.front().is_some_and(|(at, _)| *at < ms) {
            if let Some((_, old)) = self.kept.pop_front() {
                self.bytes -= old.len();
            }
        }
    }

    /// Takes everything kept, oldest first.
    fn take(&mut self) -> VecDeque<(u64, Vec<u8>)> {
        self.bytes = 0;
        std::mem::take(&mut self.kept)
    }

    pub(super) fn len(&self) -> usize {
        self.kept.len()
    }
}

impl Peer {
    /// Whether the peer has a hub to resend through (what is sent directly is kept only then).
    pub(super) fn has_relay(&self) -> bool {
        self.relay_via
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Keeps `datagram`, sent directly at `now_ms`, if it is data (a handshake is never
    /// resent: a new one is made instead). Locked per datagram, so the timer thread never
    /// waits for a whole drain.
    pub(super) fn keep_sent(&self, now_ms: u64, datagram: &[u8]) {
        if datagram.first() == Some(&DATA) {
            self.sent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .keep(now_ms, datagram);
        }
    }
}

impl Shared {
    /// The peer's route just moved to the relay: what was sent directly in the last
    /// [`RESEND_AGE`] goes again through the hub. How many datagrams went.
    pub(super) fn resend_through_hub(&self, peer: &Peer) -> usize {
        let kept = {
            let mut sent = peer.sent.lock().unwrap_or_else(|e| e.into_inner());
            sent.forget_before(self.now_ms().saturating_sub(RESEND_AGE.as_millis() as u64));
            sent.take()
        };
        let mut resent = 0;
        for (_, datagram) in &kept {
            if !self.send_through_hub(peer, datagram) {
                break;
            }
            resent += 1;
        }
        self.resent.fetch_add(resent as u64, Ordering::Relaxed);
        resent
    }

    /// Forgets what is too old to resend (the timer thread, so an idle peer holds nothing).
    pub(super) fn forget_old_sends(&self, peer: &Peer) {
        let mut sent = peer.sent.lock().unwrap_or_else(|e| e.into_inner());
        if sent.len() > 0 {
            sent.forget_before(self.now_ms().saturating_sub(RESEND_AGE.as_millis() as u64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_newest_within_its_age_count_and_bytes() {
        let mut sent = Sent::default();
        for ms in 1..=10u64 {
            sent.keep(ms, &[ms as u8; 100]);
        }
        assert_eq!(sent.len(), 10);
        // Older than RESEND_AGE is forgotten as new ones come.
        let later = RESEND_AGE.as_millis() as u64 + 6;
        sent.keep(later, &[0; 100]);
        assert_eq!(sent.kept.front().map(|(at, _)| *at), Some(6));
        assert_eq!(sent.len(), 6);
        // The count bound keeps the newest.
        for i in 0..(MAX_DATAGRAMS as u64 + 10) {
            sent.keep(later + i, &[1; 10]);
        }
        assert_eq!(sent.len(), MAX_DATAGRAMS);
        assert_eq!(
            sent.kept.back().map(|(at, _)| *at),
            Some(later + MAX_DATAGRAMS as u64 + 9)
        );
        // The byte bound too.
        let mut big = Sent::default();
        for i in 0..20u64 {
            big.keep(i, &vec![0; MAX_BYTES / 8]);
        }
        assert!(big.bytes <= MAX_BYTES, "{} bytes kept", big.bytes);
        assert_eq!(big.len(), 8);
        assert_eq!(big.take().len(), 8);
        assert_eq!((big.len(), big.bytes), (0, 0));
    }
}
