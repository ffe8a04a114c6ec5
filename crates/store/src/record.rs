//! Stored records are JSON: readable with `etcdctl get`, and new fields with `serde(default)`
//! keep old records readable (ADR 0002). These are the one encoder and decoder every service
//! uses, plus the wall clock that stamps records.

use serde::Serialize;
use serde::de::DeserializeOwned;
use trellis_error::{Error, Result};

/// Serialises a record; our own types always serialise.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| Error::Internal(format!("encoding a record: {e}")))
}

/// Deserialises the record read from `key`, naming it when the content is corrupt.
pub fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| Error::Internal(format!("corrupt store record {key:?}: {e}")))
}

/// Nanoseconds since the Unix epoch, for record timestamps.
pub fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_corrupt_keys() {
        let bytes = encode(&vec![1u8, 2]).expect("encodes");
        assert_eq!(decode::<Vec<u8>>("k", &bytes).expect("decodes"), vec![1, 2]);
        let err = decode::<Vec<u8>>("clusters/a", b"{").expect_err("corrupt");
        assert!(err.to_string().contains("clusters/a"), "{err}");
        assert!(now_nanos() > 0);
    }
}
