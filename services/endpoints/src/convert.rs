//! The wire forms of the endpoints service's own values: EndpointSlices and their ports
//! parsed into the validated [`Slice`] (errors name the field path) and written back, and the
//! translation paths as the API reports them. Used by the gRPC handlers and by the port to
//! other clusters' endpoints services, so the core only sees [`Slice`].

use trellis_api::pb::endpoints as pb;
use trellis_error::{Error, Result};

use crate::core::translation::Path;
use crate::model::{
    AddressType, Conditions, Endpoint, MAX_ENDPOINTS, MAX_PORTS, Port, Protocol, Slice, address,
    dns_label, dns_subdomain, labels, optional_text,
};

impl Path {
    /// The API's TranslationPath.
    pub fn to_pb(self) -> pb::TranslationPath {
        match self {
            Self::LocalNat => pb::TranslationPath::LocalNat,
            Self::Induced => pb::TranslationPath::Induced,
            Self::HubExternal => pb::TranslationPath::HubExternal,
            Self::TargetHome => pb::TranslationPath::TargetHome,
            Self::Untranslated => pb::TranslationPath::Untranslated,
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
    use crate::model::MANAGED_BY_LABEL;

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
}
