//! WireGuard public keys: 32 bytes, exchanged as standard base64 (44 characters).

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use trellis_error::{Error, Result};

/// A Curve25519 public key as WireGuard uses it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WgKey([u8; 32]);

impl WgKey {
    /// Parses the base64 text of request field `field`.
    pub fn parse(field: &str, text: &str) -> Result<Self> {
        if text.is_empty() {
            return Err(Error::invalid(field, "is required"));
        }
        if text.len() != 44 {
            return Err(Error::invalid(
                field,
                format!(
                    "is {} characters long; a WireGuard key is 44 characters of base64",
                    text.len()
                ),
            ));
        }
        let bytes = STANDARD
            .decode(text)
            .map_err(|e| Error::invalid(field, format!("is not base64: {e}")))?;
        let key: [u8; 32] = bytes
            .try_into()
            .map_err(|_| Error::invalid(field, "does not decode to 32 bytes"))?;
        Ok(Self(key))
    }

    /// From raw bytes (e.g. a freshly generated key).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&STANDARD.encode(self.0))
    }
}

impl serde::Serialize for WgKey {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for WgKey {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Self::parse("public_key", &text).map_err(serde::de::Error::custom)
    }
}

impl fmt::Debug for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WgKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_base64() {
        let key = WgKey::from_bytes([7; 32]);
        let text = key.to_string();
        assert_eq!(text.len(), 44);
        assert_eq!(WgKey::parse("public_key", &text).ok(), Some(key));
    }

    #[test]
    fn rejects_wrong_lengths_and_alphabets() {
        for bad in ["", "abc", &"!".repeat(44), &STANDARD.encode([1u8; 31])] {
            match WgKey::parse("spec.public_key", bad) {
                Err(Error::InvalidArgument { field, .. }) => assert_eq!(field, "spec.public_key"),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }
}
