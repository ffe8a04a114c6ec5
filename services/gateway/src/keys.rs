//! The gateway's WireGuard key pair: generated once, persisted in the store, shared by every
//! per-peer interface. The private key never appears in logs, traces or `Debug` output.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use defguard_wireguard_rs::key::Key;
use trellis_api::model::WgKey;
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{KEY_KEY, KeyRecord, decode, encode};

/// A private key and its public half.
#[derive(Clone)]
pub struct KeyPair {
    private: [u8; 32],
    public: WgKey,
}

impl fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyPair")
            .field("private", &"<redacted>")
            .field("public", &self.public)
            .finish()
    }
}

impl KeyPair {
    /// A fresh random key pair.
    pub fn generate() -> Self {
        Self::from_private(Key::generate().as_array())
    }

    fn from_private(private: [u8; 32]) -> Self {
        let public = WgKey::from_bytes(Key::new(private).public_key().as_array());
        Self { private, public }
    }

    /// The public key, as published in NetworkConfigs.
    pub fn public(&self) -> WgKey {
        self.public
    }

    /// The private key's bytes, for the userspace engine. Secret.
    pub fn private_bytes(&self) -> [u8; 32] {
        self.private
    }

    /// The private key in lowercase hex, as the WireGuard UAPI wants it. Secret.
    pub fn private_hex(&self) -> String {
        hex(&self.private)
    }

    /// The private key in base64, as the kernel API wants it. Secret.
    pub fn private_base64(&self) -> String {
        STANDARD.encode(self.private)
    }

    /// Loads the stored key pair, or generates and stores one. Racing replicas agree: the
    /// first write wins (created only if absent) and the others read it back.
    pub async fn load_or_create(store: &SharedStore) -> Result<Self> {
        let mut contention = Contention::on(store, "creating the gateway key");
        loop {
            if let Some(kv) = store.get(KEY_KEY).await? {
                let record: KeyRecord = decode(KEY_KEY, &kv.value)?;
                return Self::from_record(&record);
            }
            let fresh = Self::generate();
            let record = KeyRecord {
                private_key: fresh.private_base64(),
            };
            let outcome = store
                .txn(
                    Txn::new()
                        .when(Compare::absent(KEY_KEY))
                        .then(Op::put(KEY_KEY, encode(&record)?)),
                )
                .await?;
            if outcome.succeeded {
                tracing::info!(public_key = %fresh.public, "generated the gateway key pair");
                return Ok(fresh);
            }
            contention.skip()?;
        }
    }

    fn from_record(record: &KeyRecord) -> Result<Self> {
        // The error never quotes the value: it is a secret.
        let bytes = STANDARD
            .decode(&record.private_key)
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| {
                Error::Internal(format!(
                    "corrupt store record {KEY_KEY:?}: the private key is not 32 bytes of base64"
                ))
            })?;
        Ok(Self::from_private(bytes))
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_private_key() {
        let pair = KeyPair::generate();
        let shown = format!("{pair:?}");
        assert!(!shown.contains(&pair.private_hex()), "{shown}");
        assert!(!shown.contains(&pair.private_base64()), "{shown}");
        assert!(shown.contains(&pair.public().to_string()), "{shown}");
    }

    #[tokio::test]
    async fn generated_once_and_read_back() {
        let store: SharedStore = std::sync::Arc::new(trellis_store::MemoryStore::new());
        let first = KeyPair::load_or_create(&store).await.expect("created");
        let again = KeyPair::load_or_create(&store).await.expect("loaded");
        assert_eq!(first.public(), again.public());
        assert_eq!(first.private_hex(), again.private_hex());
        assert_eq!(hex(&[0, 0xab]), "00ab");
    }
}
