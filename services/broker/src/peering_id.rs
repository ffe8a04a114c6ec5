//! The ID of one full peering with a remote: chosen at random by the side that calls `Peer`,
//! sent in the handshake and kept by both sides (`peering/<remote>`). An unpeering notice names
//! the peering it ends, so a notice that was on the wire when a new peering began cannot end
//! the new one (issue 15, item 3; ADR 0010).

use std::fmt;

use rand::RngCore as _;
use serde::{Deserialize, Serialize};
use trellis_error::{Error, Result};

/// At most this many hex digits.
const MAX_LEN: usize = 64;

/// A validated peering ID: 1-64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PeeringId(String);

impl PeeringId {
    /// A fresh ID: 128 random bits.
    pub fn random() -> Self {
        let mut bytes = [0u8; 16];
        rand::rng().fill_bytes(&mut bytes);
        Self(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// `field` as given on the wire; empty means "none" (a peer that predates peering IDs).
    pub fn parse_optional(field: &str, text: &str) -> Result<Option<Self>> {
        if text.is_empty() {
            return Ok(None);
        }
        if text.len() > MAX_LEN
            || !text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(Error::invalid(
                field,
                format!("must be 1 to {MAX_LEN} lowercase hex digits"),
            ));
        }
        Ok(Some(Self(text.to_owned())))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PeeringId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_random_hex_and_parse_back() {
        let (a, b) = (PeeringId::random(), PeeringId::random());
        assert_ne!(a, b);
        assert_eq!(
            PeeringId::parse_optional("peering_id", a.as_str()).expect("valid"),
            Some(a)
        );
        assert_eq!(
            PeeringId::parse_optional("peering_id", "").expect("none"),
            None
        );
        for bad in ["XYZ", "0A", &"0".repeat(65), "a b"] {
            let err = PeeringId::parse_optional("peering_id", bad).expect_err(bad);
            assert!(err.to_string().contains("peering_id"), "{err}");
        }
    }
}
