//! The wire forms of the endpoints service's own values: EndpointSlices and their ports
//! parsed into the validated [`Slice`] (errors name the field path) and written back, and the
//! translation paths as the API reports them. Used by the gRPC handlers and by the port to
//! other clusters' endpoints services, so the core only sees [`Slice`].

use trellis_api::pb::endpoints as pb;
use trellis_error::{Error, Result};

use crate::core::translation::Path;
use crate::model::{
    AddressType, Conditions, Endpoint, ExportedService, MAX_ENDPOINTS, MAX_PORTS, Port, Protocol,
    ServiceType, Slice, address, checked_labels, dns_label, dns_subdomain, is_label_key, labels,
    optional_text,
};

/// Longest annotation value carried onto a ServiceImport, and the longest all of them together
/// (Kubernetes refuses an object whose annotations exceed 256 KiB).
const MAX_ANNOTATION_VALUE: usize = 64 * 1024;
const MAX_ANNOTATIONS_TOTAL: usize = 128 * 1024;

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

/// The ports at `field` (at most [`MAX_PORTS`]).
fn ports(field: &str, value: &[pb::EndpointPort]) -> Result<Vec<Port>> {
    if value.len() > MAX_PORTS {
        return Err(Error::invalid(
            field,
            format!("has {} ports; at most {MAX_PORTS}", value.len()),
        ));
    }
    value
        .iter()
        .enumerate()
        .map(|(i, p)| port(&format!("{field}[{i}]"), p))
        .collect()
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

/// One of `allowed` (empty is unset).
fn one_of(field: &str, value: &str, allowed: &[&str]) -> Result<Option<String>> {
    if value.is_empty() {
        return Ok(None);
    }
    if allowed.contains(&value) {
        return Ok(Some(value.to_owned()));
    }
    Err(Error::invalid(
        field,
        format!(
            "{:?} is not one of {}",
            trellis_api::ident::clip(value),
            allowed.join(", ")
        ),
    ))
}

/// Keys Trellis sets on a ServiceImport itself, which an exporter may not ask for.
fn reserved_import_key(key: &str) -> bool {
    key == crate::mcs::MANAGED_BY_LABEL
        || key == crate::mcs::DERIVED_SERVICE_ANNOTATION
        || key.starts_with(crate::model::TRELLIS_LABEL_PREFIX)
}

fn exported_annotations(
    field: &str,
    value: &std::collections::HashMap<String, String>,
) -> Result<std::collections::BTreeMap<String, String>> {
    if let Some(key) = value.keys().find(|k| reserved_import_key(k)) {
        return Err(Error::invalid(
            field,
            format!("{key:?} is set by Trellis itself and may not be exported"),
        ));
    }
    let mut total = 0;
    let mut out = std::collections::BTreeMap::new();
    for (key, val) in value {
        if !is_label_key(key) {
            return Err(Error::invalid(
                field,
                format!(
                    "{:?} is not a valid annotation key",
                    trellis_api::ident::clip(key)
                ),
            ));
        }
        if val.len() > MAX_ANNOTATION_VALUE {
            return Err(Error::invalid(
                format!("{field}[{key}]"),
                format!("is {} bytes; at most {MAX_ANNOTATION_VALUE}", val.len()),
            ));
        }
        total += key.len() + val.len();
        out.insert(key.clone(), val.clone());
    }
    if total > MAX_ANNOTATIONS_TOTAL {
        return Err(Error::invalid(
            field,
            format!("holds {total} bytes; at most {MAX_ANNOTATIONS_TOTAL} together"),
        ));
    }
    Ok(out)
}

impl ExportedService {
    /// Validates what an exporter says of its Service at `field` (e.g. `slice.service`).
    pub fn from_pb(field: &str, value: &pb::ExportedService) -> Result<Self> {
        let service_type = match pb::ServiceType::try_from(value.r#type) {
            Ok(pb::ServiceType::Unspecified | pb::ServiceType::ClusterSetIp) => {
                ServiceType::ClusterSetIp
            }
            Ok(pb::ServiceType::Headless) => ServiceType::Headless,
            Err(_) => {
                return Err(Error::invalid(
                    format!("{field}.type"),
                    format!("{} is not a known service type", value.r#type),
                ));
            }
        };
        let ports = ports(&format!("{field}.ports"), &value.ports)?;
        if let Some(t) = value.session_affinity_timeout_seconds
            && !(1..=86_400).contains(&t)
        {
            return Err(Error::invalid(
                format!("{field}.session_affinity_timeout_seconds"),
                format!("{t} is not in 1-86400"),
            ));
        }
        if value.ip_families.len() > 2 {
            return Err(Error::invalid(
                format!("{field}.ip_families"),
                "has more than two families",
            ));
        }
        let ip_families = value
            .ip_families
            .iter()
            .enumerate()
            .map(|(i, f)| {
                one_of(&format!("{field}.ip_families[{i}]"), f, &["IPv4", "IPv6"])?
                    .ok_or_else(|| Error::invalid(format!("{field}.ip_families[{i}]"), "is empty"))
            })
            .collect::<Result<Vec<_>>>()?;
        let traffic_distribution = optional_text(
            &format!("{field}.traffic_distribution"),
            &value.traffic_distribution,
            63,
        )?;
        if let Some(td) = &traffic_distribution
            && !is_label_key(td)
        {
            return Err(Error::invalid(
                format!("{field}.traffic_distribution"),
                format!("{:?} is not a valid value", trellis_api::ident::clip(td)),
            ));
        }
        Ok(Self {
            service_type,
            ports,
            session_affinity: one_of(
                &format!("{field}.session_affinity"),
                &value.session_affinity,
                &["None", "ClientIP"],
            )?,
            session_affinity_timeout_seconds: value.session_affinity_timeout_seconds,
            internal_traffic_policy: one_of(
                &format!("{field}.internal_traffic_policy"),
                &value.internal_traffic_policy,
                &["Cluster", "Local"],
            )?,
            traffic_distribution,
            ip_families,
            exported_labels: checked_labels(
                &format!("{field}.exported_labels"),
                &value.exported_labels,
                reserved_import_key,
            )?,
            exported_annotations: exported_annotations(
                &format!("{field}.exported_annotations"),
                &value.exported_annotations,
            )?,
            exported_at_nanos: value.exported_at.as_ref().map_or(0, |t| {
                t.seconds
                    .saturating_mul(1_000_000_000)
                    .saturating_add(i64::from(t.nanos))
            }),
        })
    }

    /// The proto form.
    pub fn to_pb(&self) -> pb::ExportedService {
        pb::ExportedService {
            r#type: match self.service_type {
                ServiceType::ClusterSetIp => pb::ServiceType::ClusterSetIp,
                ServiceType::Headless => pb::ServiceType::Headless,
            }
            .into(),
            ports: self.ports.iter().map(port_to_pb).collect(),
            session_affinity: self.session_affinity.clone().unwrap_or_default(),
            session_affinity_timeout_seconds: self.session_affinity_timeout_seconds,
            internal_traffic_policy: self.internal_traffic_policy.clone().unwrap_or_default(),
            traffic_distribution: self.traffic_distribution.clone().unwrap_or_default(),
            ip_families: self.ip_families.clone(),
            exported_labels: self.exported_labels.clone().into_iter().collect(),
            exported_annotations: self.exported_annotations.clone().into_iter().collect(),
            exported_at: Some(trellis_api::convert::timestamp(self.exported_at_nanos)),
        }
    }
}

fn port_to_pb(p: &Port) -> pb::EndpointPort {
    pb::EndpointPort {
        name: p.name.clone().unwrap_or_default(),
        port: p.port,
        protocol: match p.protocol {
            Protocol::Tcp => pb::Protocol::Tcp,
            Protocol::Udp => pb::Protocol::Udp,
            Protocol::Sctp => pb::Protocol::Sctp,
        }
        .into(),
        app_protocol: p.app_protocol.clone().unwrap_or_default(),
    }
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
        let endpoints = value
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| endpoint(&format!("{field}.endpoints[{i}]"), address_type, e))
            .collect::<Result<Vec<_>>>()?;
        let ports = ports(&format!("{field}.ports"), &value.ports)?;
        Ok(Self {
            namespace,
            name,
            service_name,
            address_type,
            endpoints,
            ports,
            labels: labels(&format!("{field}.labels"), &value.labels)?,
            service: value
                .service
                .as_ref()
                .map(|s| ExportedService::from_pb(&format!("{field}.service"), s))
                .transpose()?,
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
            ports: self.ports.iter().map(port_to_pb).collect(),
            labels: self.labels.clone().into_iter().collect(),
            service: self.service.as_ref().map(ExportedService::to_pb),
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
            service: None,
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

    fn service() -> pb::ExportedService {
        pb::ExportedService {
            r#type: pb::ServiceType::Headless.into(),
            ports: vec![pb::EndpointPort {
                name: "tcp".into(),
                port: Some(42),
                ..Default::default()
            }],
            session_affinity: "ClientIP".into(),
            session_affinity_timeout_seconds: Some(10),
            internal_traffic_policy: "Cluster".into(),
            traffic_distribution: "PreferClose".into(),
            ip_families: vec!["IPv4".into()],
            exported_labels: [("tier".to_owned(), "web".to_owned())].into(),
            exported_annotations: [("note".to_owned(), "any text at all".to_owned())].into(),
            exported_at: Some(trellis_api::convert::timestamp(1_700_000_000_123_456_789)),
        }
    }

    #[test]
    fn the_exported_service_round_trips_and_bad_fields_are_named() {
        let mut s = slice();
        s.service = Some(service());
        let parsed = Slice::from_pb("slice", Some(&s)).expect("valid");
        let info = parsed.service.clone().expect("carried");
        assert_eq!(info.service_type, ServiceType::Headless);
        assert_eq!(info.exported_at_nanos, 1_700_000_000_123_456_789);
        assert_eq!(
            Slice::from_pb("slice", Some(&parsed.to_pb())).expect("valid"),
            parsed
        );
        type Spoil = fn(&mut pb::ExportedService);
        let bad: Vec<(&str, Spoil)> = vec![
            ("slice.service.type", |e| e.r#type = 9),
            ("slice.service.ports[0].port", |e| e.ports[0].port = Some(0)),
            ("slice.service.session_affinity", |e| {
                e.session_affinity = "Sticky".into();
            }),
            ("slice.service.session_affinity_timeout_seconds", |e| {
                e.session_affinity_timeout_seconds = Some(86_401);
            }),
            ("slice.service.internal_traffic_policy", |e| {
                e.internal_traffic_policy = "Node".into();
            }),
            ("slice.service.traffic_distribution", |e| {
                e.traffic_distribution = "no spaces please".into();
            }),
            ("slice.service.ip_families[0]", |e| {
                e.ip_families = vec!["IPv5".into()];
            }),
            ("slice.service.ip_families", |e| {
                e.ip_families = vec!["IPv4".into(), "IPv6".into(), "IPv4".into()];
            }),
            ("slice.service.exported_labels", |e| {
                e.exported_labels =
                    [("app.kubernetes.io/managed-by".to_owned(), "me".to_owned())].into();
            }),
            ("slice.service.exported_labels[tier]", |e| {
                e.exported_labels = [("tier".to_owned(), "not a value!".to_owned())].into();
            }),
            ("slice.service.exported_annotations", |e| {
                e.exported_annotations = [("bad key!".to_owned(), String::new())].into();
            }),
            ("slice.service.exported_annotations[big]", |e| {
                e.exported_annotations = [("big".to_owned(), "x".repeat(70_000))].into();
            }),
        ];
        for (field, spoil) in bad {
            let mut e = service();
            spoil(&mut e);
            let mut s = slice();
            s.service = Some(e);
            assert_eq!(
                field_of(Slice::from_pb("slice", Some(&s))),
                field,
                "{field}"
            );
        }
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
