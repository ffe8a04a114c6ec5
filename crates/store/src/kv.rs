//! Keys, values and the revisions that order them.

use std::fmt;

use bytes::Bytes;

/// A store-wide logical clock: every change bumps it by one. A fresh store is at revision 1.
pub type Revision = i64;

/// A lease handle; keys attached to it die with it.
///
/// Displayed in hex, like `etcdctl` prints lease ids, so log lines can be matched against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// One stored key with its metadata, as etcd reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key, without any store prefix.
    pub key: String,
    /// The value. Shared, not copied: the memory store hands out the buffer it keeps (and keeps
    /// in its watch history), so reads and events cost a reference count, not a copy.
    pub value: Bytes,
    /// The revision that created the key (since it last did not exist).
    pub create_revision: Revision,
    /// The revision that last changed the key.
    pub mod_revision: Revision,
    /// How many times the key was written since it was created (1 right after creation).
    pub version: i64,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// The keys under a prefix as of one revision.
#[derive(Debug, Clone)]
pub struct Listing {
    /// The keys, sorted by key.
    pub kvs: Vec<KeyValue>,
    /// The store revision the listing was taken at: watch from `revision + 1` to follow on
    /// from it without gaps.
    pub revision: Revision,
}

/// The keys under a prefix and the revision each was last changed at, without their values,
/// as of one revision (see [`Store::list_revisions`](crate::Store::list_revisions)).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevisionListing {
    /// (key, mod revision), sorted by key.
    pub keys: Vec<(String, Revision)>,
    /// The store revision the listing was taken at.
    pub revision: Revision,
}

impl From<Listing> for RevisionListing {
    fn from(listing: Listing) -> Self {
        Self {
            keys: listing
                .kvs
                .into_iter()
                .map(|kv| (kv.key, kv.mod_revision))
                .collect(),
            revision: listing.revision,
        }
    }
}

/// How much a store holds under a prefix (see [`Store::size`](crate::Store::size)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreSize {
    /// How many keys.
    pub keys: usize,
    /// Bytes of the keys (as the store names them, without an etcd URL's prefix) plus bytes
    /// of their values. Metadata (revisions, leases) and the backend's own overhead are not
    /// counted.
    pub bytes: usize,
}

impl StoreSize {
    /// The size of a listing.
    pub fn of(kvs: &[KeyValue]) -> Self {
        Self {
            keys: kvs.len(),
            bytes: kvs.iter().map(|kv| kv.key.len() + kv.value.len()).sum(),
        }
    }
}
