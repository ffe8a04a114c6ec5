//! The one key-value store API every Trellis service persists through.
//!
//! Each service owns one store (in production its own etcd, possibly shared with others under
//! a key prefix) and codes against the narrow [`Store`] trait: point reads, prefix listings,
//! compare-and-swap transactions, resumable prefix watches and leases. Two backends implement
//! it and pass the same behavioural suite (the `conformance` feature):
//!
//! - [`EtcdStore`], the production backend (etcd v3 API);
//! - [`MemoryStore`], a faithful in-process model of etcd's revision, watch and lease
//!   semantics, for unit tests and single-process demos.
//!
//! Services pick a backend from configuration with [`open`]:
//!
//! ```no_run
//! # async fn demo() -> Result<(), trellis_store::StoreError> {
//! let store = trellis_store::open("etcd://10.0.0.1:2379,10.0.0.2:2379/ipam").await?;
//! store.put("pools/p1", b"10.0.0.0/16".to_vec()).await?;
//! # Ok(()) }
//! ```

pub mod counted;
mod error;
mod etcd;
mod kv;
mod memory;
pub mod metered;
pub mod record;
pub mod retry;
mod txn;
mod url;
mod watch;

#[cfg(feature = "conformance")]
pub mod conformance;

use std::sync::Arc;
use std::time::Duration;

pub use error::StoreError;
pub use etcd::{EtcdAuth, EtcdStore, EtcdTls};
pub use kv::{KeyValue, LeaseId, Listing, Revision, RevisionListing, StoreSize};
pub use memory::MemoryStore;
pub use txn::{Compare, MAX_TXN_OPS, Op, Txn, TxnOutcome};
pub use url::StoreUrl;
pub use watch::{WatchEvent, WatchStream};

/// A store shared by every task of a service.
pub type SharedStore = Arc<dyn Store>;

/// A strictly ordered key-value store with etcd's revision model.
///
/// Every change bumps a store-wide [`Revision`] once (a transaction with several operations
/// is one change); keys carry the revision that created and last modified them, which is what
/// compare-and-swap ([`Compare::ModRevision`]) and watch resumption build on.
#[async_trait::async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    /// The key's current value, if it exists.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError>;

    /// Every key starting with `prefix` (`""` lists the whole store), sorted by key, as of one
    /// revision.
    async fn list(&self, prefix: &str) -> Result<Listing, StoreError>;

    /// Every key starting with `prefix` with the revision it last changed at, without values,
    /// sorted by key, as of one revision: for a caller that keeps decoded records and only
    /// needs to see which changed (a listing copies every value).
    async fn list_revisions(&self, prefix: &str) -> Result<RevisionListing, StoreError> {
        Ok(self.list(prefix).await?.into())
    }

    /// How many keys and bytes (keys plus values) are stored under `prefix` (`""`: the whole
    /// store), as of one revision. Lists every key under the prefix: meant for benchmarks and
    /// operators, not for hot paths.
    async fn size(&self, prefix: &str) -> Result<StoreSize, StoreError> {
        Ok(StoreSize::of(&self.list(prefix).await?.kvs))
    }

    /// Sets `key` to `value` (detaching any lease) and returns the revision of the change.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<Revision, StoreError>;

    /// Deletes `key`; `true` if it existed.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// Atomically: if every compare holds, applies the success ops, else the failure ops.
    ///
    /// A branch may not touch the same key twice (etcd rejects that, so the memory store does
    /// too, with [`StoreError::Internal`]).
    async fn txn(&self, txn: Txn) -> Result<TxnOutcome, StoreError>;

    /// Events for keys under `prefix`, in revision order.
    ///
    /// `start = Some(r)` first replays every change with `mod_revision >= r` (so a consumer
    /// that saw up to `R` resumes with `Some(R + 1)` and neither misses nor duplicates), then
    /// follows live; `None` follows from now: every change committed after this call returns
    /// is delivered. A start older than what the store retains yields
    /// [`StoreError::Compacted`], from this call or as the stream's first item; the consumer
    /// then relists and watches from the listing's revision + 1.
    ///
    /// The stream ends only after yielding an error (or when dropped, which cancels the watch).
    async fn watch(&self, prefix: &str, start: Option<Revision>)
    -> Result<WatchStream, StoreError>;

    /// Creates a lease that expires `ttl` after its last refresh.
    ///
    /// etcd counts whole seconds (rounded up) and enforces its own minimum (about 2 s with
    /// default timing); the memory store honours `ttl` exactly.
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError>;

    /// Refreshes the lease once; [`StoreError::LeaseNotFound`] if it expired or never existed.
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError>;

    /// Ends the lease now, deleting every key attached to it (one revision, with a delete
    /// event per key); [`StoreError::LeaseNotFound`] if it already ended.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError>;

    /// Like [`Store::put`], but the key is deleted when the lease expires or is revoked.
    async fn put_with_lease(
        &self,
        key: &str,
        value: Vec<u8>,
        lease: LeaseId,
    ) -> Result<Revision, StoreError>;

    /// Told by [`retry::Contention`] each time a caller lost a compare-and-swap race and
    /// retries: nothing for a backend; [`metered::MeteredStore`] counts it
    /// (`trellis_store_transaction_retries_total`), so retries are counted in the one place
    /// every retry loop goes through.
    fn retried(&self) {}
}

/// Opens a store from its URL.
///
/// - `memory://` is a fresh, empty in-memory store.
/// - `etcd://h1:2379,h2:2379/prefix` connects to etcd (endpoints comma-separated; the port
///   defaults to 2379); `etcds://` does the same over TLS (see [`open_with`]). Every key is stored under `/prefix/` so several services can share one
///   etcd; an empty path means no prefix. Fails with [`StoreError::Unavailable`] within about
///   five seconds when etcd cannot be reached.
///
/// A malformed URL is [`StoreError::InvalidUrl`], naming what is wrong with it.
pub async fn open(url: &str) -> Result<SharedStore, StoreError> {
    open_with(url, &EtcdAuth::default()).await
}

/// [`open`] with credentials for etcd: `etcds://` URLs connect over TLS with `auth.tls`
/// (required for them, refused for the others), and `auth.user` logs in to etcd's
/// authentication. A memory store takes no credentials.
pub async fn open_with(url: &str, auth: &EtcdAuth) -> Result<SharedStore, StoreError> {
    match StoreUrl::parse(url)? {
        StoreUrl::Memory if auth.is_empty() => Ok(Arc::new(MemoryStore::new())),
        StoreUrl::Memory => Err(StoreError::InvalidUrl(
            "memory:// takes no TLS settings or etcd credentials".into(),
        )),
        StoreUrl::Etcd {
            endpoints,
            prefix,
            tls,
        } => Ok(Arc::new(
            EtcdStore::connect_with(&endpoints, &prefix, tls, auth).await?,
        )),
    }
}
