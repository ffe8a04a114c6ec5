//! The heartbeat between gateway replicas: one UDP datagram every `--heartbeat-interval`
//! from every replica to every other, saying who sends, whether it is the active and under
//! which epoch.
//!
//! Anyone on the node network can send UDP to a replica, and a forged heartbeat would be an
//! attack on the cluster: one that keeps "the active" alive stops a failover, one that claims
//! a higher epoch makes the active step down. So every heartbeat is authenticated with an
//! HMAC-SHA256 keyed from the gateway's WireGuard private key (every replica holds it, from
//! the store; nothing else does), and carries the sender's wall clock: a receiver takes a
//! heartbeat only if its time is later than the last one taken from that replica and within
//! [`MAX_SKEW_NANOS`] of its own clock, so a recorded heartbeat replayed later is refused.
//!
//! Layout (big-endian): `"TGHB"`, version (1), flags (bit 0: active, bit 1: warm), length of the
//! replica ID, the ID, epoch (u64), sent time in nanoseconds since the Unix epoch (i64), then
//! the 32-byte tag over everything before it.

use ring::hmac;

/// The first bytes of every heartbeat.
const MAGIC: &[u8; 4] = b"TGHB";
const VERSION: u8 = 1;
const TAG: usize = 32;

/// The longest replica ID (a DNS label).
pub const MAX_ID: usize = 63;

/// The largest heartbeat in bytes.
pub const MAX_LEN: usize = 4 + 1 + 1 + 1 + MAX_ID + 8 + 8 + TAG;

/// How far a heartbeat's sent time may be from the receiver's clock. Replicas need
/// synchronised clocks anyway: WireGuard refuses a takeover handshake whose timestamp is not
/// newer than the previous active's.
pub const MAX_SKEW_NANOS: i64 = 2_000_000_000;

/// The heartbeat key of a gateway with `private_key`: derived, so the WireGuard key itself
/// never keys anything else.
pub fn key(private_key: &[u8; 32]) -> hmac::Key {
    let root = hmac::Key::new(hmac::HMAC_SHA256, private_key);
    let derived = hmac::sign(&root, b"trellis gateway replica heartbeat v1");
    hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref())
}

/// What one heartbeat says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    pub replica: String,
    pub active: bool,
    /// Its data plane holds every desired tunnel (a standby that could take over at once).
    pub warm: bool,
    pub epoch: u64,
    pub sent_nanos: i64,
}

/// Why a datagram was not taken as a heartbeat (the `reason` label of
/// `trellis_gateway_heartbeats_refused_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not a heartbeat of this version: wrong magic, version, length or field.
    Malformed,
    /// The tag does not match: not sent by a holder of our key (another cluster's gateway, a
    /// replica with another key, or a forgery).
    Tag,
    /// Authentic but stale: not newer than the last one from that replica, or too far from our
    /// clock (a replay, or a replica whose clock is off).
    Stale,
}

impl Refusal {
    pub const ALL: [Refusal; 3] = [Self::Malformed, Self::Tag, Self::Stale];

    pub fn label(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::Tag => "tag",
            Self::Stale => "stale",
        }
    }
}

impl Heartbeat {
    /// The datagram, tagged with `key`. An ID longer than [`MAX_ID`] is cut (IDs are
    /// validated as DNS labels before they get here).
    pub fn encode(&self, key: &hmac::Key) -> Vec<u8> {
        let id = self.replica.as_bytes();
        let id = id.get(..MAX_ID).unwrap_or(id);
        let mut out = Vec::with_capacity(MAX_LEN);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(u8::from(self.active) | (u8::from(self.warm) << 1));
        out.push(u8::try_from(id.len()).unwrap_or(0));
        out.extend_from_slice(id);
        out.extend_from_slice(&self.epoch.to_be_bytes());
        out.extend_from_slice(&self.sent_nanos.to_be_bytes());
        let tag = hmac::sign(key, &out);
        out.extend_from_slice(tag.as_ref());
        out
    }

    /// Parses and authenticates `datagram`. Never panics on any input.
    pub fn decode(datagram: &[u8], key: &hmac::Key) -> Result<Self, Refusal> {
        if datagram.len() < TAG + 4 + 3 + 16 || datagram.len() > MAX_LEN {
            return Err(Refusal::Malformed);
        }
        let (body, tag) = datagram.split_at(datagram.len() - TAG);
        let (magic, rest) = body.split_at(4);
        if magic != MAGIC {
            return Err(Refusal::Malformed);
        }
        let [version, flags, id_len, rest @ ..] = rest else {
            return Err(Refusal::Malformed);
        };
        if *version != VERSION || *flags > 3 || rest.len() != usize::from(*id_len) + 16 {
            return Err(Refusal::Malformed);
        }
        hmac::verify(key, body, tag).map_err(|_| Refusal::Tag)?;
        let (id, numbers) = rest.split_at(usize::from(*id_len));
        let replica = std::str::from_utf8(id).map_err(|_| Refusal::Malformed)?;
        if trellis_api::ident::dns_label("replica", replica).is_err() {
            return Err(Refusal::Malformed);
        }
        let (epoch, sent) = numbers.split_at(8);
        let epoch = u64::from_be_bytes(epoch.try_into().map_err(|_| Refusal::Malformed)?);
        let sent_nanos = i64::from_be_bytes(sent.try_into().map_err(|_| Refusal::Malformed)?);
        Ok(Self {
            replica: replica.to_owned(),
            active: flags & 1 == 1,
            warm: flags & 2 == 2,
            epoch,
            sent_nanos,
        })
    }
}

/// Whether a heartbeat sent at `sent` may be taken at `now`, after the last one taken from the
/// same replica was sent at `last`.
pub fn fresh(sent: i64, last: Option<i64>, now: i64) -> bool {
    last.is_none_or(|last| sent > last) && (sent - now).abs() <= MAX_SKEW_NANOS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat() -> Heartbeat {
        Heartbeat {
            replica: "gw-node-1".into(),
            active: true,
            warm: true,
            epoch: 7,
            sent_nanos: 1_700_000_000_000_000_000,
        }
    }

    #[test]
    fn a_heartbeat_round_trips_under_the_same_key_only() {
        let key = key(&[1; 32]);
        let datagram = beat().encode(&key);
        assert_eq!(Heartbeat::decode(&datagram, &key), Ok(beat()));
        let other = super::key(&[2; 32]);
        assert_eq!(Heartbeat::decode(&datagram, &other), Err(Refusal::Tag));
    }

    #[test]
    fn every_changed_byte_is_refused() {
        let key = key(&[1; 32]);
        let datagram = beat().encode(&key);
        for i in 0..datagram.len() {
            let mut bad = datagram.clone();
            if let Some(b) = bad.get_mut(i) {
                *b ^= 0x01;
            }
            assert!(
                Heartbeat::decode(&bad, &key).is_err(),
                "byte {i} flipped was accepted"
            );
        }
    }

    #[test]
    fn truncated_and_oversized_datagrams_are_malformed_not_a_panic() {
        let key = key(&[1; 32]);
        let datagram = beat().encode(&key);
        for len in 0..datagram.len() {
            assert!(Heartbeat::decode(datagram.get(..len).unwrap_or_default(), &key).is_err());
        }
        let mut long = datagram.clone();
        long.extend_from_slice(&[0; MAX_LEN]);
        assert_eq!(Heartbeat::decode(&long, &key), Err(Refusal::Malformed));
    }

    #[test]
    fn only_newer_heartbeats_near_our_clock_are_fresh() {
        let now = 1_000_000_000_000;
        assert!(fresh(now, None, now));
        assert!(fresh(now, Some(now - 1), now));
        assert!(!fresh(now, Some(now), now), "a replay of the last one");
        assert!(!fresh(now - 3_000_000_000, None, now), "recorded long ago");
        assert!(
            !fresh(now + 3_000_000_000, None, now),
            "from a clock far ahead"
        );
    }
}
