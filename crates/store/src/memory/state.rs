//! The data behind a [`MemoryStore`](super::MemoryStore) and etcd's rules for changing it:
//! keys, the revision counter, the bounded event history and leases.
//!
//! Everything here is synchronous and takes the current time as an argument, so the rules
//! are testable without a runtime; the handle in `mod.rs` adds locking, publishing and timers.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Bound;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::error::StoreError;
use crate::kv::{KeyValue, LeaseId, Listing, Revision, RevisionListing};
use crate::txn::{self, Compare, Op, Txn, TxnOutcome};
use crate::watch::WatchEvent;

/// The events of one revision, shared between the history and every live watcher.
#[derive(Debug)]
pub(super) struct Batch {
    pub(super) revision: Revision,
    pub(super) events: Vec<WatchEvent>,
}

#[derive(Debug)]
struct Entry {
    value: Bytes,
    create_revision: Revision,
    mod_revision: Revision,
    version: i64,
    lease: Option<LeaseId>,
}

#[derive(Debug)]
struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

#[derive(Debug)]
pub(super) struct State {
    revision: Revision,
    kvs: BTreeMap<String, Entry>,
    /// Whole revisions, oldest first, holding at most `history_limit` events and
    /// `history_bytes_limit` bytes of keys and values in total.
    history: VecDeque<Arc<Batch>>,
    history_events: usize,
    history_limit: usize,
    history_bytes: usize,
    history_bytes_limit: usize,
    /// The oldest watch start the history can still serve.
    oldest_replayable: Revision,
    leases: HashMap<LeaseId, Lease>,
    /// Lease deadlines in expiry order, so expiring due leases does not scan every lease.
    deadlines: BTreeSet<(Instant, i64)>,
    next_lease: i64,
    /// Batches committed since the handle last published them to live watchers.
    unpublished: Vec<Arc<Batch>>,
}

impl State {
    /// A store that keeps at most `history_limit` events for replay (and no byte limit).
    #[cfg(test)]
    pub(super) fn new(history_limit: usize) -> Self {
        Self::with_limits(history_limit, usize::MAX)
    }

    /// A store whose replay history holds at most `history_limit` events and
    /// `history_bytes_limit` bytes of keys and values.
    pub(super) fn with_limits(history_limit: usize, history_bytes_limit: usize) -> Self {
        Self {
            // etcd starts at revision 1; the first write is revision 2.
            revision: 1,
            kvs: BTreeMap::new(),
            history: VecDeque::new(),
            history_events: 0,
            history_limit,
            history_bytes: 0,
            history_bytes_limit,
            oldest_replayable: 1,
            leases: HashMap::new(),
            deadlines: BTreeSet::new(),
            next_lease: 1,
            unpublished: Vec::new(),
        }
    }

    pub(super) fn revision(&self) -> Revision {
        self.revision
    }

    pub(super) fn key_count(&self) -> usize {
        self.kvs.len()
    }

    pub(super) fn get(&self, key: &str) -> Option<KeyValue> {
        self.kvs.get(key).map(|entry| entry.to_kv(key))
    }

    pub(super) fn list(&self, prefix: &str) -> Listing {
        let kvs = self
            .kvs
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, entry)| entry.to_kv(key))
            .collect();
        Listing {
            kvs,
            revision: self.revision,
        }
    }

    pub(super) fn list_revisions(&self, prefix: &str) -> RevisionListing {
        let keys = self
            .kvs
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .take_while(|(key, _)| key.starts_with(prefix))
            .map(|(key, entry)| (key.clone(), entry.mod_revision))
            .collect();
        RevisionListing {
            keys,
            revision: self.revision,
        }
    }

    /// Applies `ops` as one revision (if any of them changes something).
    pub(super) fn apply(&mut self, ops: &[Op]) -> Result<(), StoreError> {
        if let Some(key) = txn::duplicate_key(ops) {
            return Err(duplicate(key));
        }
        for op in ops {
            if let Op::Put {
                lease: Some(lease), ..
            } = op
                && !self.leases.contains_key(lease)
            {
                return Err(StoreError::LeaseNotFound(*lease));
            }
        }
        let revision = self.revision + 1;
        let mut events = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                Op::Put { key, value, lease } => {
                    events.push(self.put_at(revision, key, value.clone(), *lease));
                }
                Op::Delete { key } => events.extend(self.delete_at(revision, key)),
            }
        }
        self.commit(revision, events);
        Ok(())
    }

    pub(super) fn txn(&mut self, txn: &Txn) -> Result<TxnOutcome, StoreError> {
        // etcd rejects a malformed branch even when the other one is taken.
        if let Some(why) = txn.oversize() {
            return Err(StoreError::Internal(why));
        }
        for branch in [&txn.success, &txn.failure] {
            if let Some(key) = txn::duplicate_key(branch) {
                return Err(duplicate(key));
            }
        }
        let succeeded = txn.compares.iter().all(|compare| self.holds(compare));
        self.apply(if succeeded {
            &txn.success
        } else {
            &txn.failure
        })?;
        Ok(TxnOutcome {
            succeeded,
            revision: self.revision,
        })
    }

    /// The batches with revision >= `start`, or the oldest replayable revision if the history
    /// no longer reaches back that far.
    pub(super) fn replay(&self, start: Revision) -> Result<Vec<Arc<Batch>>, Revision> {
        if start < self.oldest_replayable {
            return Err(self.oldest_replayable);
        }
        let first = self.history.partition_point(|batch| batch.revision < start);
        Ok(self.history.range(first..).cloned().collect())
    }

    pub(super) fn take_unpublished(&mut self) -> Vec<Arc<Batch>> {
        std::mem::take(&mut self.unpublished)
    }

    pub(super) fn grant(&mut self, ttl: Duration, now: Instant) -> LeaseId {
        let id = LeaseId(self.next_lease);
        self.next_lease += 1;
        let deadline = now + ttl;
        self.leases.insert(
            id,
            Lease {
                ttl,
                deadline,
                keys: BTreeSet::new(),
            },
        );
        self.deadlines.insert((deadline, id.0));
        id
    }

    pub(super) fn refresh(&mut self, id: LeaseId, now: Instant) -> Result<(), StoreError> {
        let lease = self
            .leases
            .get_mut(&id)
            .ok_or(StoreError::LeaseNotFound(id))?;
        self.deadlines.remove(&(lease.deadline, id.0));
        lease.deadline = now + lease.ttl;
        self.deadlines.insert((lease.deadline, id.0));
        Ok(())
    }

    pub(super) fn deadline(&self, id: LeaseId) -> Option<Instant> {
        self.leases.get(&id).map(|lease| lease.deadline)
    }

    /// Ends the lease, deleting its keys in one revision.
    pub(super) fn revoke(&mut self, id: LeaseId) -> Result<(), StoreError> {
        let lease = self
            .leases
            .remove(&id)
            .ok_or(StoreError::LeaseNotFound(id))?;
        self.deadlines.remove(&(lease.deadline, id.0));
        let revision = self.revision + 1;
        let events = lease
            .keys
            .iter()
            .filter_map(|key| self.delete_at(revision, key))
            .collect();
        self.commit(revision, events);
        Ok(())
    }

    /// Ends every lease whose deadline has passed, each in its own revision, like etcd.
    pub(super) fn expire_due(&mut self, now: Instant) {
        while let Some(&(deadline, raw_id)) = self.deadlines.first()
            && deadline <= now
        {
            let id = LeaseId(raw_id);
            let keys = self.leases.get(&id).map_or(0, |lease| lease.keys.len());
            // `revoke` also drops the deadline; dropping it here too guarantees the loop ends
            // even if `deadlines` and `leases` ever disagreed.
            let _ = self.revoke(id);
            self.deadlines.remove(&(deadline, raw_id));
            tracing::debug!(lease = %id, keys, "memory store lease expired");
        }
    }

    fn holds(&self, compare: &Compare) -> bool {
        match compare {
            Compare::ModRevision { key, revision } => {
                self.kvs.get(key).map_or(0, |entry| entry.mod_revision) == *revision
            }
            Compare::Value { key, value } => self.kvs.get(key).is_some_and(|e| e.value == *value),
        }
    }

    fn put_at(
        &mut self,
        revision: Revision,
        key: &str,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> WatchEvent {
        let (create_revision, version, old_lease) = match self.kvs.get(key) {
            Some(entry) => (entry.create_revision, entry.version + 1, entry.lease),
            None => (revision, 1, None),
        };
        if old_lease != lease {
            self.detach(key, old_lease);
            if let Some(lease) = lease.and_then(|id| self.leases.get_mut(&id)) {
                lease.keys.insert(key.to_owned());
            }
        }
        let entry = Entry {
            value: Bytes::from(value),
            create_revision,
            mod_revision: revision,
            version,
            lease,
        };
        let event = WatchEvent::Put(entry.to_kv(key));
        self.kvs.insert(key.to_owned(), entry);
        event
    }

    fn delete_at(&mut self, revision: Revision, key: &str) -> Option<WatchEvent> {
        let entry = self.kvs.remove(key)?;
        self.detach(key, entry.lease);
        Some(WatchEvent::Delete {
            key: key.to_owned(),
            mod_revision: revision,
        })
    }

    fn detach(&mut self, key: &str, lease: Option<LeaseId>) {
        if let Some(lease) = lease.and_then(|id| self.leases.get_mut(&id)) {
            lease.keys.remove(key);
        }
    }

    /// Makes `events` revision `revision`; nothing happens if nothing changed, as in etcd.
    fn commit(&mut self, revision: Revision, events: Vec<WatchEvent>) {
        if events.is_empty() {
            return;
        }
        self.revision = revision;
        self.history_events += events.len();
        let bytes = batch_bytes(&events);
        self.history_bytes += bytes;
        let batch = Arc::new(Batch { revision, events });
        self.history.push_back(Arc::clone(&batch));
        self.unpublished.push(batch);
        while self.history_events > self.history_limit
            || self.history_bytes > self.history_bytes_limit
        {
            let Some(oldest) = self.history.pop_front() else {
                break;
            };
            self.history_events -= oldest.events.len();
            self.history_bytes -= batch_bytes(&oldest.events);
            self.oldest_replayable = oldest.revision + 1;
        }
    }
}

impl Entry {
    fn to_kv(&self, key: &str) -> KeyValue {
        KeyValue {
            key: key.to_owned(),
            value: self.value.clone(),
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            version: self.version,
            lease: self.lease,
        }
    }
}

fn duplicate(key: &str) -> StoreError {
    StoreError::Internal(format!("transaction branch writes key {key:?} twice"))
}

/// What the history's byte budget counts for `events`: each event's own size plus its key
/// and value. The fixed part matters: without it, a store of small records would keep the
/// whole event count whatever the budget.
fn batch_bytes(events: &[WatchEvent]) -> usize {
    events
        .iter()
        .map(|event| {
            std::mem::size_of::<WatchEvent>()
                + match event {
                    WatchEvent::Put(kv) => kv.key.len() + kv.value.len(),
                    WatchEvent::Delete { key, .. } => key.len(),
                }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::super::{DEFAULT_HISTORY_BYTES, DEFAULT_HISTORY_LIMIT, LIVE_BUFFER};
    use super::*;

    fn put(state: &mut State, key: &str, value: &str) {
        state.apply(&[Op::put(key, value)]).expect("put");
    }

    #[test]
    fn revisions_follow_etcd() {
        let mut state = State::new(100);
        assert_eq!(state.revision(), 1);
        put(&mut state, "a", "1");
        put(&mut state, "a", "2");
        let kv = state.get("a").expect("a exists");
        assert_eq!((kv.create_revision, kv.mod_revision, kv.version), (2, 3, 2));

        // A delete of nothing is not a change.
        state.apply(&[Op::delete("missing")]).expect("delete");
        assert_eq!(state.revision(), 3);

        state.apply(&[Op::delete("a")]).expect("delete");
        put(&mut state, "a", "3");
        let kv = state.get("a").expect("a exists again");
        assert_eq!((kv.create_revision, kv.mod_revision, kv.version), (5, 5, 1));
    }

    #[test]
    fn history_is_trimmed_by_whole_revisions() {
        let mut state = State::new(3);
        put(&mut state, "a", "1"); // rev 2
        state
            .apply(&[Op::put("b", "1"), Op::put("c", "1")])
            .expect("txn"); // rev 3
        put(&mut state, "d", "1"); // rev 4: 4 events > 3, so rev 2 goes
        assert_eq!(state.replay(2).err(), Some(3));
        let replayed: Vec<_> = state
            .replay(3)
            .expect("rev 3 retained")
            .iter()
            .map(|batch| batch.revision)
            .collect();
        assert_eq!(replayed, [3, 4]);
        assert!(state.replay(5).expect("future start").is_empty());
    }

    #[test]
    fn history_is_trimmed_by_bytes_too() {
        // Room for 100 events but for two puts of "kN" = "12345678" only (plus 5 bytes).
        let put_bytes = std::mem::size_of::<WatchEvent>() + 2 + 8;
        let mut state = State::with_limits(100, 2 * put_bytes + 5);
        let value = "12345678";
        put(&mut state, "k1", value); // rev 2
        put(&mut state, "k2", value); // rev 3
        assert_eq!(state.replay(2).expect("within the budget").len(), 2);
        put(&mut state, "k3", value); // rev 4: three puts are over the budget, rev 2 goes
        assert_eq!(state.replay(2).err(), Some(3));
        let replayed: Vec<_> = state
            .replay(3)
            .expect("rev 3 retained")
            .iter()
            .map(|batch| batch.revision)
            .collect();
        assert_eq!(replayed, [3, 4]);
        assert_eq!(state.history_bytes, 2 * put_bytes);

        // A revision bigger than the whole budget leaves nothing older replayable (and is
        // not kept itself), but a watch from the next revision still starts.
        let big = "x".repeat(3 * put_bytes);
        put(&mut state, "big", &big); // rev 5
        assert_eq!(state.replay(4).err(), Some(6));
        assert_eq!(state.replay(6).expect("from now on").len(), 0);
        assert_eq!(state.history_bytes, 0);
    }

    #[test]
    fn the_default_budget_bounds_the_history_of_large_records() {
        // Records of 300 bytes written over and over: the event count alone (10 000) would
        // keep about 4 MiB; the byte budget keeps what fits, which still covers the live
        // buffer.
        let mut state = State::with_limits(DEFAULT_HISTORY_LIMIT, DEFAULT_HISTORY_BYTES);
        let value = "v".repeat(300);
        for i in 0..10_000 {
            put(&mut state, &format!("records/{}", i % 300), &value);
        }
        assert!(
            state.history_bytes <= DEFAULT_HISTORY_BYTES,
            "history holds {} bytes, over the budget of {DEFAULT_HISTORY_BYTES}",
            state.history_bytes
        );
        assert_eq!(
            state.history_bytes,
            state
                .history
                .iter()
                .map(|b| batch_bytes(&b.events))
                .sum::<usize>(),
            "the running count matches what is held"
        );
        let Err(oldest) = state.replay(0) else {
            panic!("old starts are compacted");
        };
        let retained = state
            .replay(oldest)
            .expect("the oldest retained revision replays");
        assert!(
            retained.len() >= LIVE_BUFFER,
            "{} revisions retained, fewer than the live buffer ({LIVE_BUFFER})",
            retained.len()
        );
        assert_eq!(
            retained.last().map(|b| b.revision),
            Some(state.revision()),
            "the history reaches up to now"
        );
    }

    #[test]
    fn due_leases_expire_in_deadline_order() {
        let mut state = State::new(100);
        let t0 = Instant::now();
        let short = state.grant(Duration::from_secs(1), t0);
        let long = state.grant(Duration::from_secs(5), t0);
        state
            .apply(&[
                Op::put_with_lease("s", "", short),
                Op::put_with_lease("l", "", long),
            ])
            .expect("put");

        state.expire_due(t0 + Duration::from_millis(999));
        assert!(state.get("s").is_some());

        state.expire_due(t0 + Duration::from_secs(1));
        assert!(state.get("s").is_none());
        assert!(state.get("l").is_some());
        assert_eq!(
            state.refresh(short, t0),
            Err(StoreError::LeaseNotFound(short))
        );

        state
            .refresh(long, t0 + Duration::from_secs(4))
            .expect("refresh");
        state.expire_due(t0 + Duration::from_secs(8));
        assert!(state.get("l").is_some());
        state.expire_due(t0 + Duration::from_secs(9));
        assert!(state.get("l").is_none());
    }

    #[test]
    fn put_without_lease_detaches_the_key() {
        let mut state = State::new(100);
        let lease = state.grant(Duration::from_secs(1), Instant::now());
        state
            .apply(&[Op::put_with_lease("k", "1", lease)])
            .expect("put");
        put(&mut state, "k", "2");
        state.revoke(lease).expect("revoke");
        assert_eq!(state.get("k").map(|kv| kv.lease), Some(None));
    }

    #[test]
    fn duplicate_keys_in_a_branch_are_rejected() {
        let mut state = State::new(100);
        let txn = Txn::new()
            .when(Compare::absent("x"))
            .then(Op::put("a", "1"))
            .otherwise(Op::put("b", "1"))
            .otherwise(Op::delete("b"));
        assert!(matches!(state.txn(&txn), Err(StoreError::Internal(_))));
        assert_eq!(state.revision(), 1);
    }
}
