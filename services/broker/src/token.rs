//! The peering token: random, stored, rotated with an optional grace period for the previous
//! one, and compared in constant time. It only authenticates new handshakes; existing peerings
//! do not depend on it.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore as _;
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{TOKEN_KEY, TokenRecord, decode, encode, now_nanos};

/// A fresh token: 32 random bytes, URL-safe base64.
pub fn generate() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    URL_SAFE_NO_PAD.encode(bytes)
}

/// Equality that takes the same time wherever the first difference is.
pub(crate) fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Validates an operator-supplied token.
pub fn check_format(field: &str, token: &str) -> Result<()> {
    if token.len() < 16 || token.len() > 256 {
        return Err(Error::invalid(field, "must be 16 to 256 characters long"));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::invalid(
            field,
            "must be printable ASCII without spaces",
        ));
    }
    Ok(())
}

/// Reads the token, creating it (from `initial` or at random) on first use.
pub async fn current(store: &SharedStore, initial: Option<&str>) -> Result<TokenRecord> {
    loop {
        if let Some(kv) = store.get(TOKEN_KEY).await? {
            return decode(TOKEN_KEY, &kv.value);
        }
        let record = TokenRecord {
            current: initial.map_or_else(generate, str::to_owned),
            created_nanos: now_nanos(),
            previous: None,
            previous_expires_nanos: 0,
        };
        let created = store
            .txn(Txn {
                compares: vec![Compare::ModRevision {
                    key: TOKEN_KEY.into(),
                    revision: 0,
                }],
                success: vec![Op::Put {
                    key: TOKEN_KEY.into(),
                    value: encode(&record)?,
                    lease: None,
                }],
                failure: vec![],
            })
            .await?;
        if created.succeeded {
            return Ok(record);
        }
    }
}

/// Whether `presented` is the current token, or the previous one within its grace period.
pub fn accepts(record: &TokenRecord, presented: &str) -> bool {
    same(&record.current, presented)
        || record
            .previous
            .as_deref()
            .is_some_and(|p| now_nanos() < record.previous_expires_nanos && same(p, presented))
}

/// Replaces the token; the previous one stays valid for `grace`.
pub async fn rotate(store: &SharedStore, grace: Duration) -> Result<TokenRecord> {
    let mut contention = Contention::on(store, "rotating the token");
    loop {
        let existing = store.get(TOKEN_KEY).await?;
        let (previous, revision) = match &existing {
            Some(kv) => (
                Some(decode::<TokenRecord>(TOKEN_KEY, &kv.value)?),
                kv.mod_revision,
            ),
            None => (None, 0),
        };
        let now = now_nanos();
        let grace_nanos = i64::try_from(grace.as_nanos()).unwrap_or(i64::MAX);
        let record = TokenRecord {
            current: generate(),
            created_nanos: now,
            previous: previous.filter(|_| grace_nanos > 0).map(|p| p.current),
            previous_expires_nanos: now.saturating_add(grace_nanos),
        };
        let committed = store
            .txn(Txn {
                compares: vec![Compare::ModRevision {
                    key: TOKEN_KEY.into(),
                    revision,
                }],
                success: vec![Op::Put {
                    key: TOKEN_KEY.into(),
                    value: encode(&record)?,
                    lease: None,
                }],
                failure: vec![],
            })
            .await?;
        if committed.succeeded {
            tracing::info!(grace_secs = grace.as_secs(), "rotated the peering token");
            return Ok(record);
        }
        contention.lost().await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use trellis_store::MemoryStore;

    #[tokio::test]
    async fn the_token_is_created_once_and_rotation_honours_the_grace_period() {
        let store: SharedStore = Arc::new(MemoryStore::new());
        let first = current(&store, None).await.expect("created");
        assert_eq!(first.current.len(), 43);
        assert_eq!(
            current(&store, None).await.expect("read").current,
            first.current
        );
        assert!(accepts(&first, &first.current));
        assert!(!accepts(&first, "x"));

        let rotated = rotate(&store, Duration::from_secs(60))
            .await
            .expect("rotates");
        assert_ne!(rotated.current, first.current);
        assert!(accepts(&rotated, &rotated.current));
        assert!(
            accepts(&rotated, &first.current),
            "previous token within grace"
        );

        let strict = rotate(&store, Duration::ZERO).await.expect("rotates");
        assert!(
            !accepts(&strict, &rotated.current),
            "no grace: previous refused"
        );
    }

    #[test]
    fn operator_tokens_are_checked() {
        assert!(check_format("token", "short").is_err());
        assert!(check_format("token", "has a space in the middle").is_err());
        assert!(check_format("token", "0123456789abcdef").is_ok());
    }
}
