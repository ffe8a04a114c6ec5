//! Moving relays stored under the old, ambiguous `relays/<origin>--<destination>` keys to
//! `relays/<origin>/<destination>` ([`crate::records`]). Runs on every start before the
//! forwarder serves; it is idempotent and safe to kill at any point:
//!
//! - each record moves in one transaction (put the new key, delete the old one, on condition
//!   that the old one is unchanged and the new one absent), so a crash leaves every record
//!   either moved or not, never both or neither, and the next start moves the rest;
//! - a store with nothing in the old layout is left untouched (no write at all);
//! - if a pair is held under both layouts, the new key wins: only a forwarder that already
//!   migrated writes it, so it is the later of the two. The old record is deleted.
//!
//! An old key held one of the colliding pairs' relays only (the other one had been
//! overwritten); the record's own origin and destination say which, and that is where it
//! goes. The overwritten relay is not recoverable here, but its origin re-sends it (ADR 0012:
//! origins drive).

use trellis_error::Result;
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{RELAYS_PREFIX, RelayRecord, decode, is_old_layout, relay_key};

/// Moves every old-layout relay; returns how many were moved (superseded ones are deleted
/// and not counted).
pub async fn relay_keys(store: &SharedStore) -> Result<usize> {
    let listing = store.list(RELAYS_PREFIX).await?;
    let mut moved = 0;
    for kv in listing.kvs.iter().filter(|kv| is_old_layout(&kv.key)) {
        if move_one(store, &kv.key).await? {
            moved += 1;
        }
    }
    Ok(moved)
}

/// Moves the record at `old`; true if it was moved, false if it was gone or superseded.
async fn move_one(store: &SharedStore, old: &str) -> Result<bool> {
    let mut contention = Contention::on(store, "moving a relay to the new key layout");
    loop {
        let Some(kv) = store.get(old).await? else {
            return Ok(false);
        };
        let record: RelayRecord = match decode(old, &kv.value) {
            Ok(record) => record,
            Err(err) => {
                // Left for an operator: deleting it would lose a relay, and nothing else
                // reads undecodable records either.
                tracing::warn!(key = %old, error = %err, "cannot move an undecodable relay");
                return Ok(false);
            }
        };
        let new = relay_key(&record.origin.id, &record.destination.id);
        let moved = store
            .txn(Txn {
                compares: vec![
                    Compare::ModRevision {
                        key: old.to_owned(),
                        revision: kv.mod_revision,
                    },
                    Compare::absent(new.clone()),
                ],
                success: vec![
                    Op::Put {
                        key: new.clone(),
                        value: kv.value.to_vec(),
                        lease: None,
                    },
                    Op::Delete {
                        key: old.to_owned(),
                    },
                ],
                failure: vec![],
            })
            .await?;
        if moved.succeeded {
            tracing::info!(from = %old, to = %new, "moved a relay to the new key layout");
            return Ok(true);
        }
        if store.get(&new).await?.is_some() {
            let dropped = store
                .txn(Txn {
                    compares: vec![Compare::ModRevision {
                        key: old.to_owned(),
                        revision: kv.mod_revision,
                    }],
                    success: vec![Op::Delete {
                        key: old.to_owned(),
                    }],
                    failure: vec![],
                })
                .await?;
            if dropped.succeeded {
                tracing::info!(from = %old, kept = %new, "dropped a relay superseded under the new key layout");
                return Ok(false);
            }
        }
        contention.lost().await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_single_segment_keys_are_old() {
        assert!(is_old_layout("relays/a--b--c"));
        assert!(!is_old_layout("relays/a--b/c"));
        assert!(!is_old_layout("other/a--b"));
    }
}
