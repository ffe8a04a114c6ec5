//! The mapping between the caller's keys and etcd's, which live under the store prefix.

use std::sync::Arc;

use bytes::Bytes;

use crate::error::StoreError;
use crate::kv::{KeyValue, LeaseId};

/// Adds the store prefix to keys going to etcd and strips it from keys coming back.
#[derive(Debug, Clone)]
pub(super) struct Keys {
    /// `"/<prefix>/"`, or empty for no prefix.
    prefix: Arc<str>,
}

impl Keys {
    /// `prefix` is the path of the store URL, with or without surrounding slashes.
    pub(super) fn new(prefix: &str) -> Self {
        let trimmed = prefix.trim_matches('/');
        let prefix = if trimmed.is_empty() {
            String::new()
        } else {
            format!("/{trimmed}/")
        };
        Self {
            prefix: prefix.into(),
        }
    }

    pub(super) fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(super) fn full(&self, key: &str) -> Vec<u8> {
        let mut full = Vec::with_capacity(self.prefix.len() + key.len());
        full.extend_from_slice(self.prefix.as_bytes());
        full.extend_from_slice(key.as_bytes());
        full
    }

    /// The etcd key range `[start, end)` holding every key that starts with `prefix`.
    pub(super) fn range(&self, prefix: &str) -> (Vec<u8>, Vec<u8>) {
        let start = self.full(prefix);
        let end = range_end(&start);
        // etcd's encoding of "from the first key": an empty key is not allowed.
        let start = if start.is_empty() { vec![0] } else { start };
        (start, end)
    }

    pub(super) fn strip(&self, full: &[u8]) -> Result<String, StoreError> {
        let Some(key) = full.strip_prefix(self.prefix.as_bytes()) else {
            return Err(StoreError::Internal(format!(
                "etcd returned key {:?} outside the store prefix {:?}",
                String::from_utf8_lossy(full),
                self.prefix
            )));
        };
        String::from_utf8(key.to_vec()).map_err(|_| {
            StoreError::Internal(format!(
                "etcd returned a key that is not utf-8: {:?}",
                String::from_utf8_lossy(full)
            ))
        })
    }

    pub(super) fn kv(&self, kv: &etcd_client::KeyValue) -> Result<KeyValue, StoreError> {
        Ok(KeyValue {
            key: self.strip(kv.key())?,
            value: Bytes::copy_from_slice(kv.value()),
            create_revision: kv.create_revision(),
            mod_revision: kv.mod_revision(),
            version: kv.version(),
            lease: (kv.lease() != 0).then_some(LeaseId(kv.lease())),
        })
    }
}

/// The smallest key greater than every key starting with `prefix`; `[0]` (etcd's "to the
/// end") when there is none.
fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_is_normalised() {
        assert_eq!(Keys::new("ipam").prefix(), "/ipam/");
        assert_eq!(Keys::new("/a/b/").prefix(), "/a/b/");
        assert_eq!(Keys::new("").prefix(), "");
        assert_eq!(Keys::new("/").prefix(), "");
    }

    #[test]
    fn keys_round_trip_through_the_prefix() {
        let keys = Keys::new("svc");
        assert_eq!(keys.full("pools/a"), b"/svc/pools/a");
        assert_eq!(keys.strip(b"/svc/pools/a"), Ok("pools/a".to_owned()));
        assert!(matches!(
            keys.strip(b"/other/x"),
            Err(StoreError::Internal(_))
        ));
    }

    #[test]
    fn ranges_cover_exactly_the_prefix() {
        let keys = Keys::new("svc");
        assert_eq!(keys.range("a/"), (b"/svc/a/".to_vec(), b"/svc/a0".to_vec()));
        assert_eq!(keys.range(""), (b"/svc/".to_vec(), b"/svc0".to_vec()));
        let unprefixed = Keys::new("");
        assert_eq!(unprefixed.range(""), (vec![0], vec![0]));
        assert_eq!(unprefixed.range("a"), (b"a".to_vec(), b"b".to_vec()));
    }

    #[test]
    fn range_end_carries_over_0xff() {
        assert_eq!(range_end(&[b'a', 0xff]), b"b");
        assert_eq!(range_end(&[0xff, 0xff]), [0]);
    }
}
