//! Cluster identities: the ID every record is keyed by and the human-readable name beside it;
//! and the DNS-1123 names (labels, subdomains) Kubernetes objects and nodes are named by.

use std::fmt;

use serde::{Deserialize, Serialize};
use trellis_error::{Error, Result};

/// Longest accepted cluster ID, in bytes. UUIDs (36) and DNS labels (63) fit with room to spare.
pub const MAX_CLUSTER_ID_LEN: usize = 128;
/// Longest accepted cluster name, in bytes (a DNS name).
pub const MAX_CLUSTER_NAME_LEN: usize = 253;

/// A validated cluster ID: 1 to [`MAX_CLUSTER_ID_LEN`] characters of `[A-Za-z0-9._-]`, so it is
/// safe inside store keys, log fields and file names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ClusterId(String);

impl ClusterId {
    /// Validates `value` as the content of request field `field`.
    pub fn parse(field: &str, value: &str) -> Result<Self> {
        if value.is_empty() {
            return Err(Error::invalid(field, "is required"));
        }
        if value.len() > MAX_CLUSTER_ID_LEN {
            return Err(Error::invalid(
                field,
                format!(
                    "is {} bytes long; at most {MAX_CLUSTER_ID_LEN} are allowed",
                    value.len()
                ),
            ));
        }
        if let Some(bad) = value
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(Error::invalid(
                field,
                format!("contains {bad:?}; only letters, digits, '.', '_' and '-' are allowed"),
            ));
        }
        Ok(Self(value.to_owned()))
    }

    /// The ID as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClusterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for ClusterId {
    type Error = Error;
    fn try_from(value: String) -> Result<Self> {
        Self::parse("cluster_id", &value)
    }
}

impl From<ClusterId> for String {
    fn from(id: ClusterId) -> Self {
        id.0
    }
}

/// Validates an optional cluster name: empty is allowed, otherwise at most
/// [`MAX_CLUSTER_NAME_LEN`] bytes and no control characters.
pub fn parse_cluster_name(field: &str, value: &str) -> Result<String> {
    if value.len() > MAX_CLUSTER_NAME_LEN {
        return Err(Error::invalid(
            field,
            format!(
                "is {} bytes long; at most {MAX_CLUSTER_NAME_LEN} are allowed",
                value.len()
            ),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(Error::invalid(field, "contains control characters"));
    }
    Ok(value.to_owned())
}

/// Whether `value` is dot-separated (when `allow_dots`) DNS-1123 labels of lowercase letters,
/// digits and '-', at most `max` bytes in all.
pub fn is_label_like(value: &str, max: usize, allow_dots: bool) -> bool {
    !value.is_empty()
        && value.len() <= max
        && value
            .split('.')
            .all(|part| !part.is_empty() && !part.starts_with('-') && !part.ends_with('-'))
        && value.chars().all(|c| {
            c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || (allow_dots && c == '.')
        })
}

/// A DNS-1123 label (namespaces, Service names, hostnames): lowercase letters, digits and '-',
/// at most 63.
pub fn dns_label(field: &str, value: &str) -> Result<String> {
    if is_label_like(value, 63, false) {
        Ok(value.to_owned())
    } else if value.is_empty() {
        Err(Error::invalid(field, "is required"))
    } else {
        Err(Error::invalid(
            field,
            format!(
                "{:?} is not a DNS label (lowercase letters, digits and '-', at most 63)",
                clip(value)
            ),
        ))
    }
}

/// A DNS-1123 subdomain (object names): dot-separated labels, at most 253.
pub fn dns_subdomain(field: &str, value: &str) -> Result<String> {
    if is_label_like(value, 253, true) {
        Ok(value.to_owned())
    } else if value.is_empty() {
        Err(Error::invalid(field, "is required"))
    } else {
        Err(Error::invalid(
            field,
            format!(
                "{:?} is not a DNS subdomain (lowercase letters, digits, '-' and '.', at most 253)",
                clip(value)
            ),
        ))
    }
}

/// Keeps error messages short when the input is huge.
pub fn clip(value: &str) -> String {
    value.chars().take(64).collect()
}

/// A cluster's identity: its ID and its (possibly empty) name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ClusterIdentity {
    pub id: ClusterId,
    pub name: String,
}

impl ClusterIdentity {
    /// Validates both parts, naming the request fields on error.
    pub fn parse(id_field: &str, id: &str, name_field: &str, name: &str) -> Result<Self> {
        Ok(Self {
            id: ClusterId::parse(id_field, id)?,
            name: parse_cluster_name(name_field, name)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_uuids_and_dns_labels() {
        for ok in [
            "c1",
            "6f1c9e3a-1d2b-4c5d-8e9f-0a1b2c3d4e5f",
            "leaf.eu-west_1",
        ] {
            assert_eq!(
                ClusterId::parse("cluster_id", ok).map(|c| c.0).ok(),
                Some(ok.into())
            );
        }
    }

    #[test]
    fn rejects_empty_long_and_odd_ids_naming_the_field() {
        let long = "a".repeat(MAX_CLUSTER_ID_LEN + 1);
        for bad in ["", long.as_str(), "a/b", "a b", "ä"] {
            match ClusterId::parse("cluster_id", bad) {
                Err(Error::InvalidArgument { field, .. }) => assert_eq!(field, "cluster_id"),
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn names_may_be_empty_but_not_hold_control_characters() {
        assert!(parse_cluster_name("cluster_name", "").is_ok());
        assert!(parse_cluster_name("cluster_name", "hub\n").is_err());
        assert!(parse_cluster_name("cluster_name", &"n".repeat(300)).is_err());
    }
}
