//! Validated EndpointSlices: what reflection works on once a request passed the gRPC layer.
//! Parsing (from the wire form in [`crate::convert`], with the checks here) checks what
//! Kubernetes would check (names, counts, one IP per endpoint of the slice's family, label
//! syntax) so a reflected slice is never refused later by the target's API server, and names
//! the offending field path (e.g. `slice.endpoints[3].addresses[0]`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use trellis_api::ident::{clip, is_label_like};
use trellis_error::{Error, Result};

pub use trellis_api::ident::{dns_label, dns_subdomain};

/// At most this many endpoints per slice, as in Kubernetes.
pub const MAX_ENDPOINTS: usize = 1000;
/// At most this many ports per slice, as in Kubernetes.
pub const MAX_PORTS: usize = 100;
/// At most this many extra labels carried over.
pub const MAX_LABELS: usize = 64;

/// Label: the Trellis writer manages the slice (the EndpointSlice controller convention).
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// Value of [`MANAGED_BY_LABEL`] on every slice Trellis writes.
pub const MANAGED_BY: &str = "trellis.io";
/// Label linking a slice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Label prefix reserved for Trellis' own labels (source cluster, ...).
pub const TRELLIS_LABEL_PREFIX: &str = "trellis.io/";

/// The type of a slice's addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum AddressType {
    IPv4,
    IPv6,
    #[serde(rename = "FQDN")]
    Fqdn,
}

impl AddressType {
    /// The Kubernetes spelling.
    pub fn as_k8s(self) -> &'static str {
        match self {
            Self::IPv4 => "IPv4",
            Self::IPv6 => "IPv6",
            Self::Fqdn => "FQDN",
        }
    }
}

/// Transport protocol of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Protocol {
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
    #[serde(rename = "SCTP")]
    Sctp,
}

impl Protocol {
    /// The Kubernetes spelling.
    pub fn as_k8s(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        }
    }
}

/// Readiness of an endpoint; `None` is "unknown".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conditions {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

/// One endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub addresses: Vec<String>,
    pub conditions: Conditions,
    pub hostname: Option<String>,
    pub node_name: Option<String>,
    pub zone: Option<String>,
}

/// One port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Port {
    pub name: Option<String>,
    pub port: Option<i32>,
    pub protocol: Protocol,
    pub app_protocol: Option<String>,
}

/// A validated EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slice {
    pub namespace: String,
    pub name: String,
    pub service_name: String,
    pub address_type: AddressType,
    pub endpoints: Vec<Endpoint>,
    pub ports: Vec<Port>,
    pub labels: BTreeMap<String, String>,
    /// What the exporting cluster's Service says beyond its endpoints; set on the slices the
    /// export reconciler reflects (absent on slices reflected by hand, and in records stored
    /// before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<ExportedService>,
}

/// The MCS ServiceImport's type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ServiceType {
    /// Reached through a clusterset IP.
    #[default]
    ClusterSetIp,
    /// No clusterset IP: names answer the endpoints (a Service with `clusterIP: None`).
    Headless,
}

impl ServiceType {
    /// The ServiceImport's spelling.
    pub fn as_mcs(self) -> &'static str {
        match self {
            Self::ClusterSetIp => "ClusterSetIP",
            Self::Headless => "Headless",
        }
    }
}

/// What an exported Service says beyond its endpoints, as the MCS API carries it from every
/// exporting cluster into the ServiceImport: where exporters disagree the first exporter
/// (earliest [`Self::exported_at_nanos`], then cluster ID) wins and every ServiceExport
/// reports the conflict.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedService {
    pub service_type: ServiceType,
    /// The Service's ports, numbered as the Service exposes them (the slice's ports are the
    /// endpoints' own numbers).
    pub ports: Vec<Port>,
    /// `None` or `ClientIP`; `None` when unset.
    pub session_affinity: Option<String>,
    pub session_affinity_timeout_seconds: Option<i32>,
    /// `Cluster` or `Local`.
    pub internal_traffic_policy: Option<String>,
    pub traffic_distribution: Option<String>,
    /// `IPv4` and/or `IPv6`, in the Service's order.
    pub ip_families: Vec<String>,
    /// The labels and annotations the ServiceExport asks to carry onto the ServiceImport.
    pub exported_labels: BTreeMap<String, String>,
    pub exported_annotations: BTreeMap<String, String>,
    /// When the export began (the ServiceExport's creation): the first exporter wins.
    pub exported_at_nanos: i64,
}

pub(crate) fn optional_text(field: &str, value: &str, max: usize) -> Result<Option<String>> {
    if value.is_empty() {
        return Ok(None);
    }
    if value.len() > max || value.chars().any(char::is_control) {
        return Err(Error::invalid(
            field,
            format!("must be at most {max} bytes without control characters"),
        ));
    }
    Ok(Some(value.to_owned()))
}

/// A label value: empty, or at most 63 of `[A-Za-z0-9._-]` starting and ending alphanumeric.
pub fn is_label_value(value: &str) -> bool {
    value.is_empty()
        || (value.len() <= 63
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && value.starts_with(|c: char| c.is_ascii_alphanumeric())
            && value.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

pub(crate) fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    prefix.is_none_or(|p| is_label_like(p, 253, true)) && !name.is_empty() && is_label_value(name)
}

pub(crate) fn labels(
    field: &str,
    value: &std::collections::HashMap<String, String>,
) -> Result<BTreeMap<String, String>> {
    checked_labels(field, value, |key| {
        key == MANAGED_BY_LABEL
            || key == SERVICE_NAME_LABEL
            || key.starts_with(TRELLIS_LABEL_PREFIX)
    })
}

/// Labels at `field`: at most [`MAX_LABELS`], each key and value valid Kubernetes label syntax,
/// none of the keys `reserved` says Trellis sets itself.
pub(crate) fn checked_labels(
    field: &str,
    value: &std::collections::HashMap<String, String>,
    reserved: impl Fn(&str) -> bool,
) -> Result<BTreeMap<String, String>> {
    if value.len() > MAX_LABELS {
        return Err(Error::invalid(
            field,
            format!(
                "has {} labels; at most {MAX_LABELS} are carried over",
                value.len()
            ),
        ));
    }
    let mut out = BTreeMap::new();
    for (key, val) in value {
        if !is_label_key(key) {
            return Err(Error::invalid(
                field,
                format!("{:?} is not a valid label key", clip(key)),
            ));
        }
        if reserved(key) {
            return Err(Error::invalid(
                field,
                format!("{key:?} is set by Trellis itself and may not be given"),
            ));
        }
        if !is_label_value(val) {
            return Err(Error::invalid(
                format!("{field}[{key}]"),
                format!("{:?} is not a valid label value", clip(val)),
            ));
        }
        out.insert(key.clone(), val.clone());
    }
    Ok(out)
}

pub(crate) fn address(field: &str, kind: AddressType, value: &str) -> Result<String> {
    match kind {
        AddressType::Fqdn => {
            let host = value.strip_suffix('.').unwrap_or(value);
            if trellis_api::address::optional(field, &format!("{host}:1")).is_ok()
                && !host.is_empty()
            {
                Ok(value.to_owned())
            } else {
                Err(Error::invalid(
                    field,
                    format!("{:?} is not a domain name", clip(value)),
                ))
            }
        }
        AddressType::IPv4 | AddressType::IPv6 => {
            let ip = trellis_api::wire::ip(field, value)?;
            match (kind, ip) {
                (AddressType::IPv4, IpAddr::V4(_)) | (AddressType::IPv6, IpAddr::V6(_)) => {
                    // The canonical text: what IPAM answers are compared against.
                    Ok(ip.to_string())
                }
                _ => Err(Error::invalid(
                    field,
                    format!(
                        "{ip} does not match the slice's address_type {}",
                        kind.as_k8s()
                    ),
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_syntax() {
        assert!(is_label_value("a-b.c_d"));
        assert!(!is_label_value("-a"));
        assert!(is_label_key("app.kubernetes.io/name"));
        assert!(!is_label_key("a/b/c"));
    }
}
