//! [`MemoryStore`]: an in-process [`Store`] that models etcd's revisions, watches and leases.

mod state;
mod watcher;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::Instant;

use crate::Store;
use crate::error::StoreError;
use crate::kv::{KeyValue, LeaseId, Listing, Revision, RevisionListing};
use crate::txn::{Op, Txn, TxnOutcome};
use crate::watch::WatchStream;
use state::{Batch, State};

/// How many events the store keeps for watch replay unless told otherwise.
const DEFAULT_HISTORY_LIMIT: usize = 10_000;

/// How many bytes the history keeps at most, whatever the event count (each event counted as
/// its key, its value and the event's own size).
///
/// The history is what a watch started at an older revision (or a watcher that fell more than
/// [`LIVE_BUFFER`] revisions behind) replays. An event count alone let every store keep up to
/// 10 000 whole records, and an in-process lab has six stores per cluster (about 1 500 at 255
/// clusters; issue 17). 512 KiB still covers the live buffer for records of up to about 400
/// bytes (the services' are about that size or smaller) and any list-then-watch gap; older
/// starts get [`StoreError::Compacted`], as on a compacted etcd, and the watcher lists again.
const DEFAULT_HISTORY_BYTES: usize = 512 << 10;

/// How many revisions a live watcher may fall behind before it has to catch up from the
/// history (which is transparent as long as the history still reaches back far enough).
const LIVE_BUFFER: usize = 1024;

/// An in-memory store with etcd's semantics, for tests and single-process runs.
///
/// Clones are handles to the same data, so several "replicas" under test can share one store.
/// Revisions, versions, transactions and watch replay behave like etcd; the history kept for
/// replay is bounded (10 000 events and 512 KiB by default) and older starts get
/// [`StoreError::Compacted`]. Leases expire on their own, driven by tokio timers, so tests may
/// use tokio's paused clock. Leases therefore need a tokio runtime; everything else works
/// under any executor.
#[derive(Clone)]
pub struct MemoryStore {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Every committed revision, for live watchers; sent while `state` is locked so a watcher
    /// that subscribes under the same lock sees each revision exactly once.
    events: broadcast::Sender<Arc<Batch>>,
}

impl MemoryStore {
    /// A fresh, empty store at revision 1.
    pub fn new() -> Self {
        Self::with_history_limit(DEFAULT_HISTORY_LIMIT)
    }

    /// A fresh store that keeps about `events` events for watch replay (and at most the
    /// default byte budget).
    pub fn with_history_limit(events: usize) -> Self {
        Self::with_history_limits(events, DEFAULT_HISTORY_BYTES)
    }

    /// A fresh store that keeps about `events` events, and at most `bytes` bytes of keys and
    /// values, for watch replay.
    pub fn with_history_limits(events: usize, bytes: usize) -> Self {
        let (sender, _) = broadcast::channel(LIVE_BUFFER);
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State::with_limits(events, bytes)),
                events: sender,
            }),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = f.debug_struct("MemoryStore");
        // `try_lock`: formatting must not deadlock when the state is locked by this thread.
        match self.shared.state.try_lock() {
            Ok(state) => out
                .field("revision", &state.revision())
                .field("keys", &state.key_count()),
            Err(_) => out.field("state", &"<locked>"),
        };
        out.finish_non_exhaustive()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while the lock is held, and every mutation keeps the state
        // consistent, so a poisoned lock carries no half-done change.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `op` on the state after expiring due leases, then publishes what was committed.
    ///
    /// Expiring here, not only from the lease timers, means nobody observes a lease past its
    /// deadline, however late the timer task gets scheduled.
    fn with_state<T>(&self, op: impl FnOnce(&mut State, Instant) -> T) -> T {
        let now = Instant::now();
        let mut state = self.lock();
        state.expire_due(now);
        let out = op(&mut state, now);
        for batch in state.take_unpublished() {
            // An error only means nobody is watching right now; the history still has it.
            let _ = self.events.send(batch);
        }
        out
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        Ok(self.shared.with_state(|state, _| state.get(key)))
    }

    async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        Ok(self.shared.with_state(|state, _| state.list(prefix)))
    }

    async fn list_revisions(&self, prefix: &str) -> Result<RevisionListing, StoreError> {
        Ok(self
            .shared
            .with_state(|state, _| state.list_revisions(prefix)))
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision, StoreError> {
        self.shared.with_state(|state, _| {
            state.apply(&[Op::put(key, value)])?;
            Ok(state.revision())
        })
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.shared.with_state(|state, _| {
            let before = state.revision();
            state.apply(&[Op::delete(key)])?;
            Ok(state.revision() != before)
        })
    }

    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError> {
        self.shared.with_state(|state, _| state.txn(&txn))
    }

    async fn watch(
        &self,
        prefix: &str,
        start: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        watcher::watch(&self.shared, prefix, start)
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            StoreError::Internal("memory store leases need a tokio runtime".to_owned())
        })?;
        let id = self.shared.with_state(|state, now| state.grant(ttl, now));
        runtime.spawn(expire_when_due(Arc::downgrade(&self.shared), id));
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.shared
            .with_state(|state, now| state.refresh(lease, now))
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.shared.with_state(|state, _| state.revoke(lease))
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.shared.with_state(|state, _| {
            state.apply(&[Op::put_with_lease(key, value, lease)])?;
            Ok(state.revision())
        })
    }
}

/// Expires the lease at its deadline (following keep-alives) even when nobody touches the
/// store, so watchers see the deletes. Holds only a weak handle: a dropped store stops it.
async fn expire_when_due(shared: Weak<Shared>, id: LeaseId) {
    loop {
        let Some(strong) = shared.upgrade() else {
            return;
        };
        // `with_state` expires the lease if it is due, after which it has no deadline.
        let Some(deadline) = strong.with_state(|state, _| state.deadline(id)) else {
            return;
        };
        drop(strong);
        tokio::time::sleep_until(deadline).await;
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;
    use crate::watch::WatchEvent;

    #[tokio::test(start_paused = true)]
    async fn leases_expire_on_their_own_under_paused_time() {
        let store = MemoryStore::new();
        let lease = store
            .grant_lease(Duration::from_secs(30))
            .await
            .expect("grant");
        store
            .put_with_lease("k", b"v".to_vec(), lease)
            .await
            .expect("put");
        let mut events = store.watch("", None).await.expect("watch");

        // Nobody touches the store: only the timer can produce this event.
        let event = events.next().await.expect("an event").expect("no error");
        assert_eq!(
            event,
            WatchEvent::Delete {
                key: "k".into(),
                mod_revision: 3
            }
        );
        assert_eq!(
            store.keep_alive(lease).await,
            Err(StoreError::LeaseNotFound(lease))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn keep_alive_postpones_expiry() {
        let store = MemoryStore::new();
        let lease = store
            .grant_lease(Duration::from_secs(10))
            .await
            .expect("grant");
        store
            .put_with_lease("k", b"v".to_vec(), lease)
            .await
            .expect("put");
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(8)).await;
            store.keep_alive(lease).await.expect("lease alive");
        }
        assert!(store.get("k").await.expect("get").is_some());
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert!(store.get("k").await.expect("get").is_none());
    }

    #[tokio::test]
    async fn watch_start_older_than_history_is_compacted() {
        let store = MemoryStore::with_history_limit(5);
        for i in 0..10 {
            store.put("k", vec![i]).await.expect("put");
        }
        // Revisions 2..=11 were written; the last five (7..=11) are retained.
        match store.watch("", Some(6)).await {
            Err(StoreError::Compacted {
                requested,
                compacted,
            }) => assert_eq!((requested, compacted), (6, 7)),
            Err(err) => panic!("expected compacted, got {err}"),
            Ok(_) => panic!("expected compacted, got a stream"),
        }
        let mut events = store.watch("", Some(7)).await.expect("retained");
        let first = events.next().await.expect("event").expect("no error");
        assert_eq!(first.revision(), 7);
    }

    /// The store keeps one copy of a value: reads, live watchers and the history's replay get
    /// that buffer, not copies of it (at 255 clusters in one process the copies the history
    /// kept were about a tenth of the peak memory; ADR 0015).
    #[tokio::test]
    async fn reads_watchers_and_the_history_share_one_copy_of_a_value() {
        fn put_value(event: WatchEvent) -> bytes::Bytes {
            match event {
                WatchEvent::Put(kv) => kv.value,
                other => panic!("expected a put, got {other:?}"),
            }
        }
        let store = MemoryStore::new();
        let mut live = store.watch("", None).await.expect("watch");
        let revision = store.put("k", vec![7; 300]).await.expect("put");
        let read = store.get("k").await.expect("get").expect("exists").value;
        let listed = store.list("").await.expect("list").kvs.remove(0).value;
        let watched = put_value(live.next().await.expect("event").expect("no error"));
        let mut replay = store.watch("", Some(revision)).await.expect("replay");
        let replayed = put_value(replay.next().await.expect("event").expect("no error"));
        assert_eq!(read, vec![7; 300]);
        for (how, value) in [
            ("listed", &listed),
            ("watched", &watched),
            ("replayed", &replayed),
        ] {
            assert_eq!(
                value.as_ptr(),
                read.as_ptr(),
                "{how}: a copy, not the stored buffer"
            );
        }
    }

    #[tokio::test]
    async fn a_lagging_watcher_catches_up_from_history() {
        let store = MemoryStore::new();
        let mut events = store.watch("", None).await.expect("watch");
        let writes = LIVE_BUFFER * 2;
        for i in 0..writes {
            store.put(&format!("k{i}"), Vec::new()).await.expect("put");
        }
        for i in 0..writes {
            let event = events.next().await.expect("event").expect("no error");
            assert_eq!(event.revision(), i as Revision + 2);
        }
    }

    #[tokio::test]
    async fn a_watcher_too_far_behind_gets_compacted() {
        let store = MemoryStore::with_history_limit(LIVE_BUFFER);
        let mut events = store.watch("", None).await.expect("watch");
        for i in 0..LIVE_BUFFER * 3 {
            store.put(&format!("k{i}"), Vec::new()).await.expect("put");
        }
        match events.next().await {
            Some(Err(StoreError::Compacted { requested: 2, .. })) => {}
            other => panic!("expected compacted from revision 2, got {other:?}"),
        }
        assert!(
            events.next().await.is_none(),
            "the stream ends after an error"
        );
    }

    #[tokio::test]
    async fn dropping_the_store_ends_watches_with_an_error() {
        let store = MemoryStore::new();
        let mut events = store.watch("", None).await.expect("watch");
        drop(store);
        assert!(matches!(
            events.next().await,
            Some(Err(StoreError::Unavailable(_)))
        ));
        assert!(events.next().await.is_none());
    }

    #[test]
    fn works_without_a_runtime_except_for_leases() {
        let store = MemoryStore::new();
        let put = futures::executor::block_on(store.put("k", b"v".to_vec()));
        assert_eq!(put, Ok(2));
        let grant = futures::executor::block_on(store.grant_lease(Duration::from_secs(1)));
        assert!(matches!(grant, Err(StoreError::Internal(_))));
    }
}
