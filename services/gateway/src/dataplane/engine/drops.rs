//! Why a datagram at the WireGuard port was dropped, and the counters by reason: every drop
//! is counted (`trellis_gateway_dropped_datagrams_total{reason}`), since a datagram that is
//! dropped is never answered, and the counters are what tells a flood, a replay or a peer
//! with the wrong key from a quiet link.

use std::sync::atomic::Ordering;

use defguard_boringtun::noise::errors::WireGuardError;

use super::{Engine, Shared};

/// Why a datagram at the WireGuard port was dropped (the `reason` label of
/// `trellis_gateway_dropped_datagrams_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Not a WireGuard message: wrong type, wrong length.
    Malformed,
    /// A handshake message whose MAC1 does not match our public key (or MAC2 under load).
    Mac,
    /// Authentic as far as it can be checked, but for no peer we have: an unknown receiver
    /// index, or a handshake initiation from a static key we have no peer for.
    UnknownPeer,
    /// A counter (data) or timestamp (handshake) already seen.
    Replay,
    /// Authentication failed: a bad AEAD tag, a handshake that does not decrypt.
    Decrypt,
    /// Decrypted, but the inner source is outside the peer's AllowedIPs.
    SourceNotAllowed,
    /// A handshake message refused under load: its source sent more than its share, or the
    /// handshake queue was full.
    RateLimited,
    /// Decrypted, but the TUN interface would not take it (its queue full). With offloads,
    /// one count is one write of gathered packets with a failure in it.
    TunWrite,
    /// Not a datagram: a super-packet read from a TUN interface that could not be split into
    /// segments, its virtio-net header not describing it (ADR 0030).
    TunRead,
    /// Any other refusal by the protocol (no session for the index, unexpected message).
    Other,
    /// Received while this replica is a standby: only the active replica answers for the
    /// cluster's key (a remote still pointing here after a failover, or a probe).
    Standby,
    /// A relay datagram this gateway does not relay or accept (ADR 0025): the relay is off,
    /// its sender is not where an authenticated peer of ours is, either end is not a full peer
    /// whose pair we introduced, or a relayed datagram comes from elsewhere than the hub that
    /// relays the peer.
    RelayRefused,
    /// A relay datagram over its pair's rate.
    RelayRateLimited,
    /// A relayed datagram whose counter was already seen or is out of the window: a copy
    /// resent through the hub after a switch to the relay of one that had arrived directly
    /// ([`super::resend`]), expected around every switch (a replay on the direct path counts as
    /// `replay`).
    RelayDuplicate,
}

impl DropReason {
    /// Every reason, in label order.
    pub const ALL: [DropReason; 14] = [
        Self::Malformed,
        Self::Mac,
        Self::UnknownPeer,
        Self::Replay,
        Self::Decrypt,
        Self::SourceNotAllowed,
        Self::RateLimited,
        Self::TunWrite,
        Self::TunRead,
        Self::Other,
        Self::Standby,
        Self::RelayRefused,
        Self::RelayRateLimited,
        Self::RelayDuplicate,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::Mac => "mac",
            Self::UnknownPeer => "unknown_peer",
            Self::Replay => "replay",
            Self::Decrypt => "decrypt",
            Self::SourceNotAllowed => "source_not_allowed",
            Self::RateLimited => "rate_limited",
            Self::TunWrite => "tun_write",
            Self::TunRead => "tun_read",
            Self::Other => "other",
            Self::Standby => "standby",
            Self::RelayRefused => "relay_refused",
            Self::RelayRateLimited => "relay_rate_limited",
            Self::RelayDuplicate => "relay_duplicate",
        }
    }

    pub(super) fn of(err: &WireGuardError) -> Self {
        match err {
            WireGuardError::InvalidMac => Self::Mac,
            WireGuardError::DuplicateCounter
            | WireGuardError::InvalidCounter
            | WireGuardError::WrongTai64nTimestamp => Self::Replay,
            WireGuardError::InvalidAeadTag => Self::Decrypt,
            WireGuardError::InvalidPacket | WireGuardError::IncorrectPacketLength => {
                Self::Malformed
            }
            WireGuardError::WrongIndex => Self::UnknownPeer,
            _ => Self::Other,
        }
    }
}

impl Engine {
    /// Datagrams resent through a hub so far, after switches to the relay.
    pub fn resent(&self) -> u64 {
        self.shared.resent.load(Ordering::Relaxed)
    }

    /// Datagrams dropped so far, by reason.
    pub fn dropped(&self) -> Vec<(DropReason, u64)> {
        DropReason::ALL
            .iter()
            .zip(&self.shared.dropped)
            .map(|(r, n)| (*r, n.load(Ordering::Relaxed)))
            .collect()
    }
}

impl Shared {
    pub(super) fn count(&self, reason: DropReason) {
        if let Some(n) = DropReason::ALL
            .iter()
            .position(|r| *r == reason)
            .and_then(|i| self.dropped.get(i))
        {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_reasons() {
        assert_eq!(
            DropReason::of(&WireGuardError::DuplicateCounter),
            DropReason::Replay
        );
        assert_eq!(
            DropReason::of(&WireGuardError::InvalidAeadTag),
            DropReason::Decrypt
        );
        let labels: std::collections::BTreeSet<&str> =
            DropReason::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), DropReason::ALL.len());
    }
}
