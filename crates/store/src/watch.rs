//! Change events delivered by [`Store::watch`](crate::Store::watch).

use crate::error::StoreError;
use crate::kv::{KeyValue, Revision};

/// One change to one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// The key was created or updated; the new state, `mod_revision` being the change's.
    Put(KeyValue),
    /// The key was deleted (explicitly, by a transaction, or by its lease ending).
    Delete {
        /// The deleted key.
        key: String,
        /// The revision of the deletion.
        mod_revision: Revision,
    },
}

impl WatchEvent {
    /// The key that changed.
    pub fn key(&self) -> &str {
        match self {
            Self::Put(kv) => &kv.key,
            Self::Delete { key, .. } => key,
        }
    }

    /// The revision of the change.
    pub fn revision(&self) -> Revision {
        match self {
            Self::Put(kv) => kv.mod_revision,
            Self::Delete { mod_revision, .. } => *mod_revision,
        }
    }
}

/// The events of one watch, in revision order (changes made by one transaction share a
/// revision and arrive in the transaction's order).
pub type WatchStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<WatchEvent, StoreError>> + Send>>;
