//! The relay records in the store: every read and write of one goes through here, so the due
//! queue and the knowledge of which keys may be stored ([`MaybeStored`]) stay in step with
//! the store without reading it back.

use std::collections::HashMap;

use trellis_error::Result;
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, Txn};

use super::Forwarder;
use super::schedule::work_of;
use crate::records::{RelayRecord, decode, encode};

/// The keys of the relays that may be stored, kept by this process's writes (the forwarder is
/// the only writer of its store), each with the revision of its last write known to have
/// committed. A key is added before a put is sent ([`UNKNOWN`] until it commits) and
/// forgotten when a delete commits after every put of it known to have committed, so a write
/// whose outcome is unknown, or a put racing a delete, leaves it in: a key too many only
/// costs a read. Until the retry loop has listed the store at start (`complete`), absence
/// means nothing and every read goes to the store. On etcd a relay accepted and answered at
/// once read the store twice (its own key and the other direction's), at a hub n·(n-1) times.
#[derive(Debug, Default)]
pub(super) struct MaybeStored {
    complete: bool,
    keys: HashMap<String, i64>,
}

/// The revision of a put that has not committed (or whose outcome is unknown).
const UNKNOWN: i64 = 0;

impl MaybeStored {
    /// Whether `key` is known not to be stored.
    fn absent(&self, key: &str) -> bool {
        self.complete && !self.keys.contains_key(key)
    }

    /// A put of `key` is about to be sent.
    fn putting(&mut self, key: &str) {
        self.keys.entry(key.to_owned()).or_insert(UNKNOWN);
    }

    /// A put of `key` committed at `revision`.
    fn put(&mut self, key: &str, revision: i64) {
        let known = self.keys.entry(key.to_owned()).or_insert(UNKNOWN);
        *known = (*known).max(revision);
    }

    /// A delete of `key` committed at `revision`.
    fn deleted(&mut self, key: &str, revision: i64) {
        if self
            .keys
            .get(key)
            .is_some_and(|known| *known != UNKNOWN && *known < revision)
        {
            self.keys.remove(key);
        }
    }

    /// The store's listing at start: from now on absence is known.
    pub(super) fn listed(&mut self, kvs: &[trellis_store::KeyValue]) {
        for kv in kvs {
            self.keys
                .entry(kv.key.clone())
                .and_modify(|known| {
                    if *known != UNKNOWN {
                        *known = (*known).max(kv.mod_revision);
                    }
                })
                .or_insert(kv.mod_revision);
        }
        self.complete = true;
    }
}

impl Forwarder {
    pub(super) async fn load(&self, key: &str) -> Result<Option<(RelayRecord, i64)>> {
        let absent = self
            .maybe_stored
            .lock()
            .is_ok_and(|known| known.absent(key));
        if absent {
            return Ok(None);
        }
        Ok(match self.store.get(key).await? {
            Some(kv) => Some((decode(key, &kv.value)?, kv.mod_revision)),
            None => None,
        })
    }

    /// Replaces the record at `key` if it is still at `revision`; `None` deletes it. Every
    /// write of a relay goes through here, which keeps the due queue in step with the store.
    pub(super) async fn save(
        &self,
        key: &str,
        revision: i64,
        record: Option<&RelayRecord>,
    ) -> Result<bool> {
        Ok(self.save_at(key, revision, record).await?.is_some())
    }

    /// [`Self::save`], returning the record's new revision when it committed: the revision of
    /// the transaction, which is the key's mod revision, so the caller need not read it back.
    pub(super) async fn save_at(
        &self,
        key: &str,
        revision: i64,
        record: Option<&RelayRecord>,
    ) -> Result<Option<i64>> {
        let op = match record {
            Some(r) => Op::Put {
                key: key.to_owned(),
                value: encode(r)?,
                lease: None,
            },
            None => Op::Delete {
                key: key.to_owned(),
            },
        };
        if record.is_some()
            && let Ok(mut known) = self.maybe_stored.lock()
        {
            known.putting(key);
        }
        let done = self
            .store
            .txn(Txn {
                compares: vec![Compare::ModRevision {
                    key: key.to_owned(),
                    revision,
                }],
                success: vec![op],
                failure: vec![],
            })
            .await?;
        if done.succeeded {
            self.schedule(
                key,
                record.and_then(|r| work_of(r, self.delivery.retention)),
            );
        }
        if let Ok(mut known) = self.maybe_stored.lock() {
            match (done.succeeded, record) {
                (true, Some(_)) => known.put(key, done.revision),
                (true, None) => known.deleted(key, done.revision),
                // The key is not as this process believed: someone else wrote it (during a
                // rollout, the forwarder it replaces). Read it from now on.
                (false, _) => known.putting(key),
            }
        }
        if done.succeeded && record.is_none() {
            // A relay that is gone has no attempt left to expedite.
            self.take_expedited(key);
        }
        Ok(done.succeeded.then_some(done.revision))
    }

    /// Stores `record` at `key` unless `keep` says the record stored there wins.
    pub(super) async fn store_first(
        &self,
        key: &str,
        record: &RelayRecord,
        keep: impl Fn(&RelayRecord) -> bool,
    ) -> Result<()> {
        let mut contention = Contention::on(&self.store, "storing a relay");
        loop {
            let current = self.load(key).await?;
            if current.as_ref().is_some_and(|(held, _)| keep(held)) {
                return Ok(());
            }
            if self
                .save(key, current.map_or(0, |(_, r)| r), Some(record))
                .await?
            {
                return Ok(());
            }
            contention.lost().await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_known_absent_only_after_the_listing_and_a_delete_after_its_puts() {
        let mut known = MaybeStored::default();
        assert!(
            !known.absent("relays/a/b"),
            "nothing is known before the listing"
        );
        known.putting("relays/a/b");
        known.listed(&[]);
        assert!(!known.absent("relays/a/b"), "a put in flight may be stored");
        assert!(known.absent("relays/x/y"));
        // A delete committing while a put of the same key is unconfirmed leaves it in.
        known.deleted("relays/a/b", 5);
        assert!(!known.absent("relays/a/b"));
        known.put("relays/a/b", 7);
        // An older delete (its removal ran late) does not forget a newer put.
        known.deleted("relays/a/b", 6);
        assert!(!known.absent("relays/a/b"));
        known.deleted("relays/a/b", 8);
        assert!(known.absent("relays/a/b"));
    }
}
