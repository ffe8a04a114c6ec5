//! A store that counts what is asked of it: reads (gets and listings, with listings also
//! counted apart), writes (puts, deletes and transactions) and retried transactions. For tests
//! and benchmarks that bound how much store work an operation does, so that a quadratic path
//! cannot come back unnoticed. Its reads can be made slow ([`Counted::with_read_latency`]), so
//! that a test can also bound how many of them an operation waits for one after another. And
//! it can let someone else write between an operation's read and its transaction
//! ([`Counted::interleave`]), so that a test can make an operation lose its compare.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::{
    KeyValue, LeaseId, Listing, Revision, RevisionListing, SharedStore, Store, StoreError,
    StoreSize, Txn, TxnOutcome, WatchStream,
};

/// Counts the calls made through it to `inner`; writes can be held back ([`Counted::hold`]).
#[derive(Debug)]
pub struct Counted {
    inner: SharedStore,
    reads: AtomicU64,
    listings: AtomicU64,
    writes: AtomicU64,
    retries: AtomicU64,
    gate: tokio::sync::RwLock<()>,
    read_latency: Duration,
    interleaved: std::sync::Mutex<Option<(String, Vec<u8>)>>,
}

impl Counted {
    pub fn new(inner: SharedStore) -> Self {
        Self {
            inner,
            reads: AtomicU64::new(0),
            listings: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            gate: tokio::sync::RwLock::new(()),
            read_latency: Duration::ZERO,
            interleaved: std::sync::Mutex::new(None),
        }
    }

    /// Makes every get and listing take `latency` first, as a store across a network does:
    /// with tokio's paused clock, a test reads from the time it took how many reads an
    /// operation made one after another.
    #[must_use]
    pub fn with_read_latency(mut self, latency: Duration) -> Self {
        self.read_latency = latency;
        self
    }

    /// Holds every write back (counted, then waiting) until the guard is dropped: lets a test
    /// line up concurrent operations behind one that is writing.
    pub async fn hold(&self) -> tokio::sync::RwLockWriteGuard<'_, ()> {
        self.gate.write().await
    }

    /// Puts `value` under `key` just before the next transaction, as another writer would
    /// between that transaction's reads and its commit (not counted among the writes).
    pub fn interleave(&self, key: &str, value: Vec<u8>) {
        *self.interleaved.lock().unwrap_or_else(|e| e.into_inner()) = Some((key.to_owned(), value));
    }

    /// Gets and listings so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }

    /// Listings so far (also counted among the reads): what a test bounds where an operation
    /// must not read a whole prefix.
    pub fn listings(&self) -> u64 {
        self.listings.load(Ordering::SeqCst)
    }

    /// Puts, deletes and transactions so far.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    /// Transactions retried after a lost race so far.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::SeqCst)
    }

    async fn read(&self) {
        self.reads.fetch_add(1, Ordering::SeqCst);
        if !self.read_latency.is_zero() {
            tokio::time::sleep(self.read_latency).await;
        }
    }

    fn write(&self) {
        self.writes.fetch_add(1, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl Store for Counted {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        self.read().await;
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        self.listings.fetch_add(1, Ordering::SeqCst);
        self.read().await;
        self.inner.list(prefix).await
    }

    async fn list_revisions(&self, prefix: &str) -> Result<RevisionListing, StoreError> {
        self.listings.fetch_add(1, Ordering::SeqCst);
        self.read().await;
        self.inner.list_revisions(prefix).await
    }

    async fn size(&self, prefix: &str) -> Result<StoreSize, StoreError> {
        self.inner.size(prefix).await
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision, StoreError> {
        self.write();
        let _open = self.gate.read().await;
        self.inner.put(key, value).await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.write();
        let _open = self.gate.read().await;
        self.inner.delete(key).await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError> {
        self.write();
        let _open = self.gate.read().await;
        let other = self
            .interleaved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((key, value)) = other {
            self.inner.put(&key, value).await?;
        }
        self.inner.txn(txn).await
    }

    async fn watch(
        &self,
        prefix: &str,
        start: Option<Revision>,
    ) -> Result<WatchStream, StoreError> {
        self.inner.watch(prefix, start).await
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        self.inner.grant_lease(ttl).await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.keep_alive(lease).await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.revoke_lease(lease).await
    }

    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Revision, StoreError> {
        self.write();
        let _open = self.gate.read().await;
        self.inner.put_with_lease(key, value, lease).await
    }

    fn retried(&self) {
        self.retries.fetch_add(1, Ordering::SeqCst);
        self.inner.retried();
    }
}
