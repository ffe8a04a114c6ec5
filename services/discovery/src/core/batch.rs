//! The write every operation ends in: records guarded by the revisions they were read at,
//! committed in one transaction when it fits and in ordered, idempotent chunks when it does not
//! (a Neighborhood may list more neighbours than etcd allows operations in one transaction).

use trellis_api::ClusterId;
use trellis_error::{Error, Result};
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{ForeignClusterRecord, cluster_key, encode, now_nanos, tombstone_key};

/// One record's write: the guard on the revision it was read at, and its ops.
type Group = (Vec<Compare>, Vec<Op>);

/// Writes to several records, each guarded by the revision it was read at, plus `guards` that
/// every write depends on (the sender's record, the inbox).
///
/// A batch that fits one transaction commits atomically. A larger one (a Neighborhood with
/// more neighbours than etcd's `--max-txn-ops` allows in one transaction) commits in chunks in
/// order, each chunk under the shared guards, and the `last` writes (the inbox, the peer's own
/// record) in the final chunk: every chunk is idempotent (a re-read skips records already
/// written), and the final one is the commit point that says the whole change is applied.
#[derive(Default)]
pub(super) struct Batch {
    guards: Vec<Compare>,
    groups: Vec<Group>,
    last: Vec<Group>,
    pub(super) written: Vec<ClusterId>,
}

impl Batch {
    /// Writes `after` over `before` (read at `revision`, 0 = absent) unless nothing but the
    /// bookkeeping would change.
    pub(super) fn put(
        &mut self,
        before: Option<&ForeignClusterRecord>,
        revision: i64,
        after: ForeignClusterRecord,
    ) -> Result<()> {
        if let Some(group) = self.put_group(before, revision, after)? {
            self.groups.push(group);
        }
        Ok(())
    }

    /// Like [`Batch::put`], committed in the final chunk.
    pub(super) fn put_last(
        &mut self,
        before: Option<&ForeignClusterRecord>,
        revision: i64,
        after: ForeignClusterRecord,
    ) -> Result<()> {
        if let Some(group) = self.put_group(before, revision, after)? {
            self.last.push(group);
        }
        Ok(())
    }

    fn put_group(
        &mut self,
        before: Option<&ForeignClusterRecord>,
        revision: i64,
        mut after: ForeignClusterRecord,
    ) -> Result<Option<Group>> {
        if let Some(old) = before
            && same_content(old, &after)
        {
            return Ok(None);
        }
        after.previous_kind = before.map(|b| b.kind);
        after.update_time = now_nanos();
        let key = cluster_key(&after.identity.id);
        self.written.push(after.identity.id.clone());
        Ok(Some((
            vec![Compare::mod_revision(key.clone(), revision)],
            vec![Op::put(key, encode(&after)?)],
        )))
    }

    /// Deletes a record, leaving its last content as a tombstone at the same revision.
    pub(super) fn delete(&mut self, before: &ForeignClusterRecord, revision: i64) -> Result<()> {
        let key = cluster_key(&before.identity.id);
        self.groups.push((
            vec![Compare::mod_revision(key.clone(), revision)],
            vec![
                Op::delete(key),
                Op::put(tombstone_key(before.identity.id.as_str()), encode(before)?),
            ],
        ));
        Ok(())
    }

    pub(super) fn guard(&mut self, key: String, revision: i64) {
        self.guards.push(Compare::mod_revision(key, revision));
    }

    /// A write committed in the final chunk (the inbox).
    pub(super) fn op(&mut self, op: Op) {
        self.last.push((Vec::new(), vec![op]));
    }

    pub(super) fn is_empty(&self) -> bool {
        self.groups.is_empty() && self.last.is_empty()
    }

    /// Commits; `None` when a guard failed (re-read and decide again: chunks already committed
    /// are then found written and skipped).
    pub(super) async fn commit(self, store: &SharedStore) -> Result<Option<i64>> {
        let last = |groups: Vec<Group>| {
            groups.into_iter().fold(
                Txn {
                    compares: self.guards.clone(),
                    ..Txn::default()
                },
                |mut txn, (compares, ops)| {
                    txn.compares.extend(compares);
                    txn.success.extend(ops);
                    txn
                },
            )
        };
        let whole = last(self.groups.iter().chain(&self.last).cloned().collect());
        let txns = if whole.oversize().is_none() {
            vec![whole]
        } else {
            let mut txns = Txn::chunks(&self.guards, self.groups).map_err(Error::Internal)?;
            let tail = last(self.last);
            if let Some(why) = tail.oversize() {
                return Err(Error::Internal(format!("final chunk: {why}")));
            }
            txns.push(tail);
            txns
        };
        let chunks = txns.len();
        let mut revision = None;
        for (i, txn) in txns.into_iter().enumerate() {
            let outcome = store.txn(txn).await?;
            if !outcome.succeeded {
                if i > 0 {
                    tracing::debug!(
                        committed = i,
                        chunks,
                        "a chunked write lost a guard midway; re-reading"
                    );
                }
                return Ok(None);
            }
            revision = Some(outcome.revision);
        }
        Ok(revision)
    }
}

/// Equal but for the bookkeeping fields a write refreshes.
pub(super) fn same_content(a: &ForeignClusterRecord, b: &ForeignClusterRecord) -> bool {
    let strip = |r: &ForeignClusterRecord| {
        let mut r = r.clone();
        r.update_time = 0;
        r.previous_kind = None;
        r
    };
    strip(a) == strip(b)
}
