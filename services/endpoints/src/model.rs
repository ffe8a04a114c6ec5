//! Validated EndpointSlices: what reflection works on once a request passed the gRPC layer.
//! Parsing checks what Kubernetes would check (names, counts, one IP per endpoint of the slice's
//! family, label syntax) so a reflected slice is never refused later by the target's API server,
//! and names the offending field path (e.g. `slice.endpoints[3].addresses[0]`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use trellis_api::ident::{clip, is_label_like};
use trellis_api::pb::endpoints as pb;
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
}

fn optional_text(field: &str, value: &str, max: usize) -> Result<Option<String>> {
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

fn is_label_key(key: &str) -> bool {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    prefix.is_none_or(|p| is_label_like(p, 253, true)) && !name.is_empty() && is_label_value(name)
}

fn labels(
    field: &str,
    value: &std::collections::HashMap<String, String>,
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
        if key == MANAGED_BY_LABEL
            || key == SERVICE_NAME_LABEL
            || key.starts_with(TRELLIS_LABEL_PREFIX)
        {
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

fn address(field: &str, kind: AddressType, value: &str) -> Result<String> {
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

fn endpoint(field: &str, kind: AddressType, value: &pb::Endpoint) -> Result<Endpoint> {
    if value.addresses.is_empty() {
        return Err(Error::invalid(
            format!("{field}.addresses"),
            "needs at least one address",
        ));
    }
    if kind != AddressType::Fqdn && value.addresses.len() != 1 {
        return Err(Error::invalid(
            format!("{field}.addresses"),
            format!(
                "has {} addresses; an IP endpoint has exactly one",
                value.addresses.len()
            ),
        ));
    }
    if value.addresses.len() > 100 {
        return Err(Error::invalid(
            format!("{field}.addresses"),
            "has more than 100 addresses",
        ));
    }
    let addresses = value
        .addresses
        .iter()
        .enumerate()
        .map(|(i, a)| address(&format!("{field}.addresses[{i}]"), kind, a))
        .collect::<Result<Vec<_>>>()?;
    let conditions = value.conditions.map(|c| Conditions {
        ready: c.ready,
        serving: c.serving,
        terminating: c.terminating,
    });
    let hostname = if value.hostname.is_empty() {
        None
    } else {
        Some(dns_label(&format!("{field}.hostname"), &value.hostname)?)
    };
    Ok(Endpoint {
        addresses,
        conditions: conditions.unwrap_or_default(),
        hostname,
        node_name: optional_text(&format!("{field}.node_name"), &value.node_name, 253)?,
        zone: optional_text(&format!("{field}.zone"), &value.zone, 253)?,
    })
}

pub(crate) fn port(field: &str, value: &pb::EndpointPort) -> Result<Port> {
    let name = if value.name.is_empty() {
        None
    } else {
        Some(dns_label(&format!("{field}.name"), &value.name)?)
    };
    if let Some(p) = value.port
        && !(1..=65535).contains(&p)
    {
        return Err(Error::invalid(
            format!("{field}.port"),
            format!("{p} is not in 1-65535"),
        ));
    }
    let protocol = match pb::Protocol::try_from(value.protocol) {
        Ok(pb::Protocol::Unspecified | pb::Protocol::Tcp) => Protocol::Tcp,
        Ok(pb::Protocol::Udp) => Protocol::Udp,
        Ok(pb::Protocol::Sctp) => Protocol::Sctp,
        Err(_) => {
            return Err(Error::invalid(
                format!("{field}.protocol"),
                format!("{} is not a known protocol", value.protocol),
            ));
        }
    };
    Ok(Port {
        name,
        port: value.port,
        protocol,
        app_protocol: optional_text(&format!("{field}.app_protocol"), &value.app_protocol, 253)?,
    })
}

impl Slice {
    /// Validates a slice at `field` (e.g. `slice`); absent counts as empty.
    pub fn from_pb(field: &str, value: Option<&pb::EndpointSlice>) -> Result<Self> {
        let empty = pb::EndpointSlice::default();
        let value = value.unwrap_or(&empty);
        let namespace = dns_label(&format!("{field}.namespace"), &value.namespace)?;
        let name = dns_subdomain(&format!("{field}.name"), &value.name)?;
        let service_name = dns_label(&format!("{field}.service_name"), &value.service_name)?;
        let address_type = match pb::AddressType::try_from(value.address_type) {
            Ok(pb::AddressType::Ipv4) => AddressType::IPv4,
            Ok(pb::AddressType::Ipv6) => AddressType::IPv6,
            Ok(pb::AddressType::Fqdn) => AddressType::Fqdn,
            Ok(pb::AddressType::Unspecified) => {
                return Err(Error::invalid(
                    format!("{field}.address_type"),
                    "is required",
                ));
            }
            Err(_) => {
                return Err(Error::invalid(
                    format!("{field}.address_type"),
                    format!("{} is not a known address type", value.address_type),
                ));
            }
        };
        if value.endpoints.len() > MAX_ENDPOINTS {
            return Err(Error::invalid(
                format!("{field}.endpoints"),
                format!(
                    "has {} endpoints; at most {MAX_ENDPOINTS}",
                    value.endpoints.len()
                ),
            ));
        }
        if value.ports.len() > MAX_PORTS {
            return Err(Error::invalid(
                format!("{field}.ports"),
                format!("has {} ports; at most {MAX_PORTS}", value.ports.len()),
            ));
        }
        let endpoints = value
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| endpoint(&format!("{field}.endpoints[{i}]"), address_type, e))
            .collect::<Result<Vec<_>>>()?;
        let ports = value
            .ports
            .iter()
            .enumerate()
            .map(|(i, p)| port(&format!("{field}.ports[{i}]"), p))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            namespace,
            name,
            service_name,
            address_type,
            endpoints,
            ports,
            labels: labels(&format!("{field}.labels"), &value.labels)?,
        })
    }

    /// The proto form.
    pub fn to_pb(&self) -> pb::EndpointSlice {
        pb::EndpointSlice {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            service_name: self.service_name.clone(),
            address_type: match self.address_type {
                AddressType::IPv4 => pb::AddressType::Ipv4,
                AddressType::IPv6 => pb::AddressType::Ipv6,
                AddressType::Fqdn => pb::AddressType::Fqdn,
            }
            .into(),
            endpoints: self
                .endpoints
                .iter()
                .map(|e| pb::Endpoint {
                    addresses: e.addresses.clone(),
                    conditions: Some(pb::EndpointConditions {
                        ready: e.conditions.ready,
                        serving: e.conditions.serving,
                        terminating: e.conditions.terminating,
                    }),
                    hostname: e.hostname.clone().unwrap_or_default(),
                    node_name: e.node_name.clone().unwrap_or_default(),
                    zone: e.zone.clone().unwrap_or_default(),
                })
                .collect(),
            ports: self
                .ports
                .iter()
                .map(|p| pb::EndpointPort {
                    name: p.name.clone().unwrap_or_default(),
                    port: p.port,
                    protocol: match p.protocol {
                        Protocol::Tcp => pb::Protocol::Tcp,
                        Protocol::Udp => pb::Protocol::Udp,
                        Protocol::Sctp => pb::Protocol::Sctp,
                    }
                    .into(),
                    app_protocol: p.app_protocol.clone().unwrap_or_default(),
                })
                .collect(),
            labels: self.labels.clone().into_iter().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice() -> pb::EndpointSlice {
        pb::EndpointSlice {
            namespace: "default".into(),
            name: "web-abc12".into(),
            service_name: "web".into(),
            address_type: pb::AddressType::Ipv4.into(),
            endpoints: vec![pb::Endpoint {
                addresses: vec!["10.0.0.7".into()],
                ..Default::default()
            }],
            ports: vec![pb::EndpointPort {
                name: "http".into(),
                port: Some(80),
                ..Default::default()
            }],
            labels: Default::default(),
        }
    }

    fn field_of(r: Result<Slice>) -> String {
        match r {
            Err(Error::InvalidArgument { field, .. }) => field,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn round_trips() {
        let parsed = Slice::from_pb("slice", Some(&slice())).expect("valid");
        let again = Slice::from_pb("slice", Some(&parsed.to_pb())).expect("valid");
        assert_eq!(parsed, again);
    }

    #[test]
    fn errors_name_the_field_path() {
        let mut s = slice();
        s.endpoints[0].addresses[0] = "fd00::1".into();
        assert_eq!(
            field_of(Slice::from_pb("slice", Some(&s))),
            "slice.endpoints[0].addresses[0]"
        );
        let mut s = slice();
        s.namespace = "Default".into();
        assert_eq!(
            field_of(Slice::from_pb("slice", Some(&s))),
            "slice.namespace"
        );
        let mut s = slice();
        s.ports[0].port = Some(70_000);
        assert_eq!(
            field_of(Slice::from_pb("slice", Some(&s))),
            "slice.ports[0].port"
        );
        let mut s = slice();
        s.labels.insert(MANAGED_BY_LABEL.into(), "me".into());
        assert_eq!(field_of(Slice::from_pb("slice", Some(&s))), "slice.labels");
        let mut s = slice();
        s.address_type = 0;
        assert_eq!(
            field_of(Slice::from_pb("slice", Some(&s))),
            "slice.address_type"
        );
        let mut s = slice();
        s.endpoints[0].addresses.push("10.0.0.8".into());
        assert_eq!(
            field_of(Slice::from_pb("slice", Some(&s))),
            "slice.endpoints[0].addresses"
        );
        assert_eq!(field_of(Slice::from_pb("slice", None)), "slice.namespace");
    }

    #[test]
    fn label_syntax() {
        assert!(is_label_value("a-b.c_d"));
        assert!(!is_label_value("-a"));
        assert!(is_label_key("app.kubernetes.io/name"));
        assert!(!is_label_key("a/b/c"));
    }
}
