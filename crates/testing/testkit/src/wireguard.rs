//! A hostile WireGuard initiator, for tests of what a gateway does with handshakes it must not
//! trust: [`Forger`] builds handshake initiations that **name a static key it does not hold**
//! (any peer's public key, which every member of a fabric learns from NetworkConfigs), with a
//! valid MAC1, and a valid MAC2 once it has read a cookie reply, exactly as an attacker who
//! knows the two public keys can (WireGuard paper §5.4; the timestamp, which needs the named
//! key's private half, is random bytes).
//!
//! Such an initiation passes every check that comes before the responder's Diffie-Hellman with
//! the named peer's static key: the MAC1, the cookie, and the anonymous decryption of the
//! initiator's static key. It can never complete a handshake.

use blake2::digest::{FixedOutput as _, KeyInit as _, Update as _};
use blake2::{Blake2s256, Blake2sMac, Digest as _};
use chacha20poly1305::aead::Aead as _;
use chacha20poly1305::aead::Payload;
use chacha20poly1305::aead::consts::U16;
use chacha20poly1305::{ChaCha20Poly1305, XChaCha20Poly1305};
use defguard_boringtun::x25519::{PublicKey, StaticSecret};

/// `HASH(CONSTRUCTION)`, the protocol's first chaining key.
const CONSTRUCTION: &[u8] = b"Noise_IKpsk2_25519_ChaChaPoly_BLAKE2s";
const IDENTIFIER: &[u8] = b"WireGuard v1 zx2c4 Jason@zx2c4.com";
const LABEL_MAC1: &[u8] = b"mac1----";
const LABEL_COOKIE: &[u8] = b"cookie--";

/// The length of a handshake initiation.
pub const INITIATION_LEN: usize = 148;
/// The message type of a cookie reply.
pub const COOKIE_REPLY: u8 = 3;

fn hash(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Blake2s256::new();
    for part in parts {
        blake2::Digest::update(&mut h, part);
    }
    h.finalize().into()
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    use ::hmac::Mac as _;
    let mut mac = ::hmac::SimpleHmac::<Blake2s256>::new_from_slice(key).expect("any key length");
    for part in parts {
        ::hmac::Mac::update(&mut mac, part);
    }
    mac.finalize().into_bytes().into()
}

fn mac16(key: &[u8], parts: &[&[u8]]) -> [u8; 16] {
    let mut mac = Blake2sMac::<U16>::new_from_slice(key).expect("key of at most 32 bytes");
    for part in parts {
        mac.update(part);
    }
    mac.finalize_fixed().into()
}

/// Forges handshake initiations to one responder.
#[derive(Debug)]
pub struct Forger {
    responder: [u8; 32],
    /// The cookie of the last cookie reply read, with the MAC1 it answered.
    cookie: Option<[u8; 16]>,
    /// MAC1 of the last initiation built (a cookie reply is sealed with it as associated data).
    last_mac1: [u8; 16],
    next_index: u32,
}

impl Forger {
    /// A forger of initiations to the responder whose static public key is `responder`.
    pub fn new(responder: [u8; 32]) -> Self {
        Self {
            responder,
            cookie: None,
            last_mac1: [0; 16],
            next_index: 0x00f0_0000,
        }
    }

    /// An initiation that claims to come from the static key `claimed`, with a fresh ephemeral
    /// key and sender index, MAC1 valid, MAC2 valid under the last cookie read (zero without).
    pub fn initiation(&mut self, claimed: &[u8; 32]) -> [u8; INITIATION_LEN] {
        let mut msg = [0u8; INITIATION_LEN];
        msg[0] = 1;
        self.next_index = self.next_index.wrapping_add(1);
        msg[4..8].copy_from_slice(&self.next_index.to_le_bytes());

        let responder = PublicKey::from(self.responder);
        let mut chaining = hash(&[CONSTRUCTION]);
        let mut h = hash(&[&hash(&[&chaining, IDENTIFIER]), &self.responder]);
        let ephemeral = StaticSecret::random();
        let ephemeral_public = PublicKey::from(&ephemeral);
        msg[8..40].copy_from_slice(ephemeral_public.as_bytes());
        h = hash(&[&h, ephemeral_public.as_bytes()]);
        chaining = hmac(&hmac(&chaining, &[ephemeral_public.as_bytes()]), &[&[1]]);
        let shared = ephemeral.diffie_hellman(&responder);
        let temp = hmac(&chaining, &[shared.as_bytes()]);
        chaining = hmac(&temp, &[&[1]]);
        let key = hmac(&temp, &[&chaining, &[2]]);
        let sealed = ChaCha20Poly1305::new_from_slice(&key)
            .expect("32-byte key")
            .encrypt(
                &Default::default(),
                Payload {
                    msg: claimed,
                    aad: &h,
                },
            )
            .expect("48 bytes sealed");
        msg[40..88].copy_from_slice(&sealed);
        // The timestamp is sealed under DH(claimed key, responder): unknowable, so random.
        let mut timestamp = [0u8; 28];
        timestamp
            .iter_mut()
            .zip(StaticSecret::random().to_bytes())
            .for_each(|(t, r)| *t = r);
        msg[88..116].copy_from_slice(&timestamp);
        self.seal(&mut msg);
        msg
    }

    /// Sets MAC1 and MAC2 of `msg` (any handshake message of ours).
    fn seal(&mut self, msg: &mut [u8; INITIATION_LEN]) {
        let mac1 = mac16(&hash(&[LABEL_MAC1, &self.responder]), &[&msg[..116]]);
        msg[116..132].copy_from_slice(&mac1);
        self.last_mac1 = mac1;
        let mac2 = match &self.cookie {
            Some(cookie) => mac16(cookie, &[&msg[..132]]),
            None => [0; 16],
        };
        msg[132..148].copy_from_slice(&mac2);
    }

    /// Reads a cookie reply to the last initiation; later initiations carry a valid MAC2.
    /// Whether `datagram` was such a reply.
    pub fn read_cookie_reply(&mut self, datagram: &[u8]) -> bool {
        if datagram.len() != 64 || datagram[0] != COOKIE_REPLY {
            return false;
        }
        let key = hash(&[LABEL_COOKIE, &self.responder]);
        let nonce = chacha20poly1305::XNonce::try_from(&datagram[8..32]).expect("24 bytes");
        let opened = XChaCha20Poly1305::new_from_slice(&key)
            .expect("32-byte key")
            .decrypt(
                &nonce,
                Payload {
                    msg: &datagram[32..64],
                    aad: &self.last_mac1,
                },
            );
        match opened.ok().and_then(|c| <[u8; 16]>::try_from(c).ok()) {
            Some(cookie) => {
                self.cookie = Some(cookie);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use defguard_boringtun::noise::handshake::parse_handshake_anon;
    use defguard_boringtun::noise::{HandshakeInit, Tunn};

    /// The forgery is what the responder's anonymous parse accepts as coming from `claimed`,
    /// while a real session refuses it: the test that the forger forges, not just sends noise.
    #[test]
    fn a_forged_initiation_names_the_claimed_key_and_never_completes() {
        let responder = StaticSecret::random();
        let responder_public = PublicKey::from(&responder);
        let victim = StaticSecret::random();
        let victim_public = PublicKey::from(&victim);
        let mut forger = Forger::new(*responder_public.as_bytes());
        let msg = forger.initiation(victim_public.as_bytes());
        let Ok(defguard_boringtun::noise::Packet::HandshakeInit(init)) =
            Tunn::parse_incoming_packet(&msg)
        else {
            panic!("not parsed as an initiation");
        };
        let init: HandshakeInit<'_> = init;
        let half = parse_handshake_anon(&responder, &responder_public, &init)
            .expect("anonymous parse accepts the forgery");
        assert_eq!(half.peer_static_public, *victim_public.as_bytes());

        let mut session = Tunn::new(responder, victim_public, None, None, 7, None);
        let mut out = [0u8; 256];
        assert!(
            matches!(
                session.decapsulate(None, &msg, &mut out),
                defguard_boringtun::noise::TunnResult::Err(_)
            ),
            "a session with the claimed key must refuse the forgery"
        );
    }
}
