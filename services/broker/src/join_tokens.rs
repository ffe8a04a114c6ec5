//! Join tokens: peering tokens that expire and can be revoked, for handing out to joining
//! clusters (the cluster token in [`crate::token`] lives until it is rotated).
//!
//! A join token reads `<id>.<secret>`: six and sixteen characters of `[a-z0-9]`, the shape of
//! kubeadm's bootstrap tokens, so an operator recognises it and a log that shows the id shows
//! nothing secret. The store keeps the id, the SHA-256 of the secret, when the token was made
//! and when it expires: a copy of the store cannot join anyone. An expired token is kept for
//! [`KEEP_EXPIRED`] so that a handshake presenting it is told it expired (rather than that it
//! is wrong), then forgotten the next time tokens are created or listed.

use std::time::Duration;

use rand::Rng as _;
use serde::{Deserialize, Serialize};
use trellis_error::{Error, Result};
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{JOIN_TOKENS_PREFIX, decode, encode, now_nanos};
use crate::token::same;

/// How long a join token lives unless asked otherwise (kubeadm's default).
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// The shortest and the longest time to live a join token may be given.
pub const MIN_TTL: Duration = Duration::from_secs(1);
pub const MAX_TTL: Duration = Duration::from_secs(365 * 24 * 3600);
/// How long an expired token is kept to say so.
pub const KEEP_EXPIRED: Duration = Duration::from_secs(24 * 3600);
/// The longest description.
pub const MAX_DESCRIPTION: usize = 256;

const ID_LEN: usize = 6;
const SECRET_LEN: usize = 16;
const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

/// What the store keeps of a join token (below `join-tokens/<id>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinTokenRecord {
    /// Hex SHA-256 of the secret.
    pub secret_sha256: String,
    pub created_nanos: i64,
    pub expires_nanos: i64,
    #[serde(default)]
    pub description: String,
}

/// A join token as listed: its id and record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub id: String,
    pub record: JoinTokenRecord,
}

/// What a presented token is, as far as join tokens go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not shaped like a join token (it may be the cluster token).
    NotAJoinToken,
    /// A live join token: accepted.
    Accepted { id: String },
    /// Shaped like one, refused: why, in words the joining operator can act on.
    Refused(String),
}

fn random_text(len: usize) -> String {
    let mut rng = rand::rng();
    (0..len)
        .map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]))
        .collect()
}

fn sha256_hex(secret: &str) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, secret.as_bytes());
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

fn key(id: &str) -> String {
    format!("{JOIN_TOKENS_PREFIX}{id}")
}

fn well_formed(part: &str, len: usize) -> bool {
    part.len() == len && part.bytes().all(|b| ALPHABET.contains(&b))
}

/// `(id, secret)` of a token shaped like a join token.
fn split(token: &str) -> Option<(&str, &str)> {
    let (id, secret) = token.split_once('.')?;
    (well_formed(id, ID_LEN) && well_formed(secret, SECRET_LEN)).then_some((id, secret))
}

/// Validates a join token id (or a whole token, whose id is taken), naming `field`.
pub fn parse_id(field: &str, text: &str) -> Result<String> {
    let id = text.split_once('.').map_or(text, |(id, _)| id);
    if !well_formed(id, ID_LEN) {
        return Err(Error::invalid(
            field,
            "must be a join token id: six lowercase letters or digits (the part before the dot)",
        ));
    }
    Ok(id.to_owned())
}

/// Validates a requested time to live (`None`: the default), naming `field`.
pub fn ttl(field: &str, requested: Option<Duration>) -> Result<Duration> {
    let ttl = requested.unwrap_or(DEFAULT_TTL);
    if !(MIN_TTL..=MAX_TTL).contains(&ttl) {
        return Err(Error::invalid(
            field,
            format!(
                "must be from {} s to {} s (365 days); unset means 24 hours",
                MIN_TTL.as_secs(),
                MAX_TTL.as_secs()
            ),
        ));
    }
    Ok(ttl)
}

/// Validates a description, naming `field`.
pub fn description(field: &str, text: &str) -> Result<String> {
    if text.chars().count() > MAX_DESCRIPTION || text.chars().any(char::is_control) {
        return Err(Error::invalid(
            field,
            format!("must be at most {MAX_DESCRIPTION} characters without control characters"),
        ));
    }
    Ok(text.to_owned())
}

fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// Creates a join token living `ttl`; returns the token (the only time its secret is known)
/// and what is kept of it.
pub async fn create(
    store: &SharedStore,
    ttl: Duration,
    description: String,
) -> Result<(String, JoinToken)> {
    forget_expired(store).await?;
    loop {
        let (id, secret) = (random_text(ID_LEN), random_text(SECRET_LEN));
        let now = now_nanos();
        let record = JoinTokenRecord {
            secret_sha256: sha256_hex(&secret),
            created_nanos: now,
            expires_nanos: now.saturating_add(nanos(ttl)),
            description: description.clone(),
        };
        // A new key only: an id already taken (one chance in two billion) draws again.
        let created = store
            .txn(Txn {
                compares: vec![Compare::ModRevision {
                    key: key(&id),
                    revision: 0,
                }],
                success: vec![Op::Put {
                    key: key(&id),
                    value: encode(&record)?,
                    lease: None,
                }],
                failure: vec![],
            })
            .await?;
        if created.succeeded {
            tracing::info!(join_token.id = %id, ttl_secs = ttl.as_secs(), "created a join token");
            return Ok((format!("{id}.{secret}"), JoinToken { id, record }));
        }
    }
}

/// Every join token kept, by id (expired ones past [`KEEP_EXPIRED`] are forgotten first).
pub async fn list(store: &SharedStore) -> Result<Vec<JoinToken>> {
    forget_expired(store).await?;
    read_all(store).await
}

async fn read_all(store: &SharedStore) -> Result<Vec<JoinToken>> {
    store
        .list(JOIN_TOKENS_PREFIX)
        .await?
        .kvs
        .iter()
        .map(|kv| {
            Ok(JoinToken {
                id: kv.key.trim_start_matches(JOIN_TOKENS_PREFIX).to_owned(),
                record: decode(&kv.key, &kv.value)?,
            })
        })
        .collect()
}

/// Forgets tokens that expired more than [`KEEP_EXPIRED`] ago.
async fn forget_expired(store: &SharedStore) -> Result<()> {
    let cutoff = now_nanos().saturating_sub(nanos(KEEP_EXPIRED));
    for token in read_all(store).await? {
        if token.record.expires_nanos < cutoff {
            store.delete(&key(&token.id)).await?;
        }
    }
    Ok(())
}

/// Revokes the join token `id`; whether there was one.
pub async fn revoke(store: &SharedStore, id: &str) -> Result<bool> {
    let revoked = store.delete(&key(id)).await?;
    if revoked {
        tracing::info!(join_token.id = %id, "revoked a join token");
    }
    Ok(revoked)
}

/// What `presented` is as a join token.
pub async fn check(store: &SharedStore, presented: &str) -> Result<Verdict> {
    let Some((id, secret)) = split(presented) else {
        return Ok(Verdict::NotAJoinToken);
    };
    let Some(kv) = store.get(&key(id)).await? else {
        return Ok(Verdict::Refused(format!(
            "the join token {id} is unknown or was revoked"
        )));
    };
    let record: JoinTokenRecord = decode(&kv.key, &kv.value)?;
    if !same(&record.secret_sha256, &sha256_hex(secret)) {
        return Ok(Verdict::Refused(format!(
            "the join token {id} is unknown or was revoked"
        )));
    }
    if now_nanos() >= record.expires_nanos {
        return Ok(Verdict::Refused(format!(
            "the join token {id} expired at {}; ask the cluster's operator for a new one \
             (trellisctl token --join --ttl ...)",
            rfc3339(record.expires_nanos)
        )));
    }
    Ok(Verdict::Accepted { id: id.to_owned() })
}

/// `nanos` since the epoch as RFC 3339, UTC, to the second (prost's timestamp display).
fn rfc3339(nanos: i64) -> String {
    prost_types::Timestamp {
        seconds: nanos.div_euclid(1_000_000_000),
        nanos: 0,
    }
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use trellis_store::MemoryStore;

    fn store() -> SharedStore {
        Arc::new(MemoryStore::new())
    }

    #[tokio::test]
    async fn a_join_token_is_accepted_until_it_expires_or_is_revoked() {
        let store = store();
        let (token, made) = create(&store, MIN_TTL, "for leaf-7".into())
            .await
            .expect("created");
        let (id, secret) = split(&token).expect("shaped like a join token");
        assert_eq!((id.len(), secret.len()), (6, 16));
        assert_eq!(made.id, id);
        // Only the hash is kept.
        let kept = store.get(&key(id)).await.expect("get").expect("kept");
        assert!(!String::from_utf8_lossy(&kept.value).contains(secret));
        assert_eq!(
            check(&store, &token).await.expect("checked"),
            Verdict::Accepted { id: id.into() }
        );
        // Another secret with the same id is refused, as is the cluster token's shape.
        let forged = format!("{id}.{}", "a".repeat(16));
        assert!(matches!(
            check(&store, &forged).await.expect("checked"),
            Verdict::Refused(m) if m.contains("unknown or was revoked")
        ));
        assert_eq!(
            check(&store, "not-a-join-token-at-all-but-long")
                .await
                .expect("checked"),
            Verdict::NotAJoinToken
        );

        // Expired: said so, with the time.
        let mut record = made.record.clone();
        record.expires_nanos = now_nanos() - 1;
        store
            .put(&key(id), encode(&record).expect("encode"))
            .await
            .expect("put");
        let Verdict::Refused(message) = check(&store, &token).await.expect("checked") else {
            panic!("an expired token was accepted");
        };
        assert!(
            message.contains("expired at") && message.contains(id),
            "{message}"
        );

        // Revoked: unknown from then on; revoking again is a no-op.
        assert!(revoke(&store, id).await.expect("revoked"));
        assert!(!revoke(&store, id).await.expect("idempotent"));
        assert!(matches!(
            check(&store, &token).await.expect("checked"),
            Verdict::Refused(m) if m.contains("unknown or was revoked")
        ));
    }

    #[tokio::test]
    async fn tokens_long_expired_are_forgotten_and_bad_requests_name_the_field() {
        let store = store();
        let (_, old) = create(&store, MIN_TTL, String::new()).await.expect("old");
        let (_, live) = create(&store, DEFAULT_TTL, String::new())
            .await
            .expect("live");
        let mut record = old.record.clone();
        record.expires_nanos = now_nanos() - nanos(KEEP_EXPIRED) - 1;
        store
            .put(&key(&old.id), encode(&record).expect("encode"))
            .await
            .expect("put");
        let ids: Vec<String> = list(&store)
            .await
            .expect("listed")
            .into_iter()
            .map(|t| t.id)
            .collect();
        assert_eq!(ids, vec![live.id]);

        for bad in [Some(Duration::ZERO), Some(MAX_TTL + Duration::from_secs(1))] {
            let err = ttl("ttl", bad).expect_err("out of range");
            assert!(err.to_string().contains("ttl"), "{err}");
        }
        assert_eq!(ttl("ttl", None).expect("default"), DEFAULT_TTL);
        assert!(description("description", &"x".repeat(257)).is_err());
        assert!(description("description", "line\nbreak").is_err());
        assert_eq!(
            parse_id("id", "abc123.0123456789abcdef").expect("id"),
            "abc123"
        );
        assert!(parse_id("id", "ABC123").is_err());
    }

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(1_795_822_528 * 1_000_000_000),
            "2026-11-27T23:35:28Z"
        );
    }
}
