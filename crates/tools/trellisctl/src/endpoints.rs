//! `trellisctl endpoints`: the EndpointSlices other clusters reflected to this one
//! (EndpointMapper.ListReflectedSlices); `endpoints reflect` translates a local slice for a target
//! (EndpointMapper.ReflectEndpointSlice) and shows each address's translation.

use serde::Serialize;
use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::endpoints::{
    self as pb, ExportServiceRequest, ListExportsRequest, ListReflectedSlicesRequest,
    ReflectEndpointSliceRequest, UnexportServiceRequest,
};
use trellis_api::pb::types;

use crate::cli::{EndpointsArgs, ExportArgs, Globals, ReflectArgs, UnexportArgs};
use crate::error::CtlError;
use crate::identity::{IdentityView, id_or_empty};
use crate::names;
use crate::output::Report;
use crate::service::Service;
use crate::slice_file;
use crate::table::Table;
use crate::units::rfc3339;

/// The answer of `endpoints`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReflectedSlicesView {
    /// What this cluster exports, ordered by (namespace, name).
    pub exports: Vec<ExportView>,
    /// Ordered by (source cluster ID, namespace, name).
    pub reflected_slices: Vec<ReflectedSliceView>,
}

/// A Service this cluster exports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExportView {
    pub namespace: String,
    pub name: String,
    pub ports: Vec<PortView>,
    pub endpoints: Vec<ExportedEndpointView>,
    /// Cluster IDs of the peers it is reflected to now.
    pub reflected_to: Vec<String>,
    pub update_time: Option<String>,
}

/// One endpoint of an export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExportedEndpointView {
    pub address: String,
    pub ready: bool,
}

impl ExportView {
    fn from_pb(e: &pb::Export) -> Self {
        Self {
            namespace: e.namespace.clone(),
            name: e.name.clone(),
            ports: SliceView::from_pb(&pb::EndpointSlice {
                ports: e.ports.clone(),
                ..Default::default()
            })
            .ports,
            endpoints: e
                .endpoints
                .iter()
                .map(|x| ExportedEndpointView {
                    address: x.address.clone(),
                    ready: x.ready.unwrap_or(true),
                })
                .collect(),
            reflected_to: e.reflected_to.clone(),
            update_time: rfc3339(e.update_time.as_ref()),
        }
    }

    fn table_row(&self) -> [String; 5] {
        [
            self.namespace.clone(),
            self.name.clone(),
            self.endpoints
                .iter()
                .map(|e| {
                    if e.ready {
                        e.address.clone()
                    } else {
                        format!("{} (not ready)", e.address)
                    }
                })
                .collect::<Vec<_>>()
                .join(","),
            self.ports
                .iter()
                .map(|p| p.port.map_or_else(String::new, |n| n.to_string()))
                .collect::<Vec<_>>()
                .join(","),
            self.reflected_to.join(","),
        ]
    }
}

impl Report for ExportView {
    fn table(&self) -> String {
        let mut t = Table::new(&["NAMESPACE", "NAME", "ENDPOINTS", "PORTS", "REFLECTED TO"]);
        t.row(self.table_row());
        format!("exported\n{}", t.render())
    }
}

/// The answer of `unexport`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnexportView {
    pub namespace: String,
    pub name: String,
    /// False when it was not exported.
    pub unexported: bool,
}

impl Report for UnexportView {
    fn table(&self) -> String {
        if self.unexported {
            format!("unexported {}/{}\n", self.namespace, self.name)
        } else {
            format!("{}/{} was not exported\n", self.namespace, self.name)
        }
    }
}

/// Runs `export`.
pub async fn export(globals: &Globals, args: &ExportArgs) -> Result<ExportView, CtlError> {
    let target = globals.target(Service::Endpoints);
    let mut client = EndpointMapperClient::new(globals.connect(&target).await?);
    let reply = client
        .export_service(ExportServiceRequest {
            namespace: args.namespace.clone(),
            name: args.name.clone(),
            ports: args
                .ports
                .iter()
                .map(|p| pb::EndpointPort {
                    // Beyond i32: sent as i32::MAX, which the service refuses as out of range.
                    port: Some(i32::try_from(*p).unwrap_or(i32::MAX)),
                    protocol: pb::Protocol::Tcp.into(),
                    ..Default::default()
                })
                .collect(),
            endpoints: args
                .addresses
                .iter()
                .map(|ip| pb::ExportedEndpoint {
                    address: ip.clone(),
                    ready: Some(true),
                })
                .collect(),
        })
        .await
        .map_err(|s| CtlError::rpc(&target, "ExportService", &s))?
        .into_inner();
    Ok(ExportView::from_pb(&reply.export.unwrap_or_default()))
}

/// Runs `unexport`.
pub async fn unexport(globals: &Globals, args: &UnexportArgs) -> Result<UnexportView, CtlError> {
    let target = globals.target(Service::Endpoints);
    let mut client = EndpointMapperClient::new(globals.connect(&target).await?);
    let reply = client
        .unexport_service(UnexportServiceRequest {
            namespace: args.namespace.clone(),
            name: args.name.clone(),
        })
        .await
        .map_err(|s| CtlError::rpc(&target, "UnexportService", &s))?
        .into_inner();
    Ok(UnexportView {
        namespace: args.namespace.clone(),
        name: args.name.clone(),
        unexported: reply.unexported,
    })
}

/// One received slice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReflectedSliceView {
    pub source: Option<IdentityView>,
    pub slice: SliceView,
    pub generation: i64,
    /// Name of the Kubernetes object written; empty without Kubernetes access.
    pub object_name: String,
    pub update_time: Option<String>,
}

/// An EndpointSlice, as the proto carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SliceView {
    pub namespace: String,
    pub name: String,
    pub service_name: String,
    /// `IPv4`, `IPv6` or `FQDN`.
    pub address_type: String,
    pub endpoints: Vec<EndpointView>,
    pub ports: Vec<PortView>,
}

/// One endpoint of a slice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointView {
    pub addresses: Vec<String>,
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
    pub hostname: String,
    pub node_name: String,
    pub zone: String,
}

/// One port of a slice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PortView {
    pub name: String,
    pub port: Option<i32>,
    /// `tcp`, `udp`, `sctp` (`unspecified` = TCP).
    pub protocol: String,
    pub app_protocol: String,
}

impl SliceView {
    pub fn from_pb(s: &pb::EndpointSlice) -> Self {
        Self {
            namespace: s.namespace.clone(),
            name: s.name.clone(),
            service_name: s.service_name.clone(),
            address_type: names::address_type(s.address_type),
            endpoints: s
                .endpoints
                .iter()
                .map(|e| {
                    let c = e.conditions.as_ref();
                    EndpointView {
                        addresses: e.addresses.clone(),
                        ready: c.and_then(|c| c.ready),
                        serving: c.and_then(|c| c.serving),
                        terminating: c.and_then(|c| c.terminating),
                        hostname: e.hostname.clone(),
                        node_name: e.node_name.clone(),
                        zone: e.zone.clone(),
                    }
                })
                .collect(),
            ports: s
                .ports
                .iter()
                .map(|p| PortView {
                    name: p.name.clone(),
                    port: p.port,
                    protocol: names::protocol(p.protocol),
                    app_protocol: p.app_protocol.clone(),
                })
                .collect(),
        }
    }

    fn addresses(&self) -> String {
        self.endpoints
            .iter()
            .flat_map(|e| e.addresses.iter().cloned())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn ports_text(&self) -> String {
        self.ports
            .iter()
            .map(|p| {
                let number = p.port.map_or_else(|| "*".into(), |n| n.to_string());
                let proto = if p.protocol == "unspecified" {
                    "tcp"
                } else {
                    &p.protocol
                };
                if p.name.is_empty() {
                    format!("{number}/{proto}")
                } else {
                    format!("{}:{number}/{proto}", p.name)
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl Report for ReflectedSlicesView {
    fn table(&self) -> String {
        let exports = if self.exports.is_empty() {
            "no exports\n".to_owned()
        } else {
            let mut t = Table::new(&["NAMESPACE", "NAME", "ENDPOINTS", "PORTS", "REFLECTED TO"]);
            for e in &self.exports {
                t.row(e.table_row());
            }
            format!("exports\n{}", t.render())
        };
        format!("{exports}\n{}", self.reflected_table())
    }
}

impl ReflectedSlicesView {
    fn reflected_table(&self) -> String {
        if self.reflected_slices.is_empty() {
            return "no reflected EndpointSlices\n".into();
        }
        let mut t = Table::new(&[
            "SOURCE",
            "NAMESPACE",
            "NAME",
            "SERVICE",
            "ADDRESSES",
            "PORTS",
            "GEN",
            "OBJECT",
        ]);
        for r in &self.reflected_slices {
            t.row([
                id_or_empty(r.source.as_ref()),
                r.slice.namespace.clone(),
                r.slice.name.clone(),
                r.slice.service_name.clone(),
                r.slice.addresses(),
                r.slice.ports_text(),
                r.generation.to_string(),
                r.object_name.clone(),
            ]);
        }
        t.render()
    }
}

/// The answer of `endpoints reflect`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReflectView {
    pub target: String,
    /// The translated slice, as the target will see it.
    pub slice: SliceView,
    /// One entry per address, in slice order.
    pub translations: Vec<TranslationView>,
    /// Whether the target applied it (only with `--deliver`).
    pub delivered: bool,
}

/// How one address was translated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TranslationView {
    pub original_address: String,
    pub translated_address: String,
    /// `local_nat`, `induced`, `hub_external`, `target_home` or `untranslated`.
    pub path: String,
    pub home_cluster: Option<IdentityView>,
    pub detail: String,
}

impl Report for ReflectView {
    fn table(&self) -> String {
        let mut t = Table::new(&["ORIGINAL", "FOR TARGET", "PATH", "HOME", "DETAIL"]);
        for tr in &self.translations {
            t.row([
                tr.original_address.clone(),
                tr.translated_address.clone(),
                tr.path.clone(),
                id_or_empty(tr.home_cluster.as_ref()),
                tr.detail.clone(),
            ]);
        }
        format!(
            "{}/{} for {}: {}\n{}",
            self.slice.namespace,
            self.slice.name,
            self.target,
            if self.delivered {
                "delivered"
            } else {
                "translated, not delivered"
            },
            t.render()
        )
    }
}

/// Runs `endpoints` (the listing).
pub async fn list(
    globals: &Globals,
    args: &EndpointsArgs,
) -> Result<ReflectedSlicesView, CtlError> {
    let target = globals.target(Service::Endpoints);
    let mut client = EndpointMapperClient::new(globals.connect(&target).await?);
    let reply = client
        .list_reflected_slices(ListReflectedSlicesRequest {
            source_cluster_id: args.source.clone().unwrap_or_default(),
            namespace: args.namespace.clone().unwrap_or_default(),
        })
        .await
        .map_err(|s| CtlError::rpc(&target, "ListReflectedSlices", &s))?
        .into_inner();
    let exports = client
        .list_exports(ListExportsRequest {})
        .await
        .map_err(|s| CtlError::rpc(&target, "ListExports", &s))?
        .into_inner()
        .exports;
    Ok(ReflectedSlicesView {
        exports: exports.iter().map(ExportView::from_pb).collect(),
        reflected_slices: reply
            .reflected_slices
            .iter()
            .map(|r| ReflectedSliceView {
                source: IdentityView::from_pb(r.source.as_ref()),
                slice: r
                    .slice
                    .as_ref()
                    .map(SliceView::from_pb)
                    .unwrap_or_else(|| SliceView::from_pb(&pb::EndpointSlice::default())),
                generation: r.generation,
                object_name: r.object_name.clone(),
                update_time: rfc3339(r.update_time.as_ref()),
            })
            .collect(),
    })
}

/// Runs `endpoints reflect`. The file is read before any service is contacted.
pub async fn reflect(globals: &Globals, args: &ReflectArgs) -> Result<ReflectView, CtlError> {
    let slice = slice_file::read(&args.file)?;
    let target = globals.target(Service::Endpoints);
    let mut client = EndpointMapperClient::new(globals.connect(&target).await?);
    let reply = client
        .reflect_endpoint_slice(ReflectEndpointSliceRequest {
            target: Some(types::ClusterIdentity {
                cluster_id: args.target.clone(),
                cluster_name: String::new(),
            }),
            slice: Some(slice.clone()),
            deliver: args.deliver,
        })
        .await
        .map_err(|s| CtlError::rpc(&target, "ReflectEndpointSlice", &s))?
        .into_inner();
    Ok(ReflectView {
        target: args.target.clone(),
        slice: SliceView::from_pb(reply.slice.as_ref().unwrap_or(&slice)),
        translations: reply
            .translations
            .iter()
            .map(|t| TranslationView {
                original_address: t.original_address.clone(),
                translated_address: t.translated_address.clone(),
                path: names::translation_path(t.path),
                home_cluster: IdentityView::from_pb(t.home_cluster.as_ref()),
                detail: t.detail.clone(),
            })
            .collect(),
        delivered: reply.delivered,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice() -> pb::EndpointSlice {
        pb::EndpointSlice {
            namespace: "shop".into(),
            name: "web-1".into(),
            service_name: "web".into(),
            address_type: pb::AddressType::Ipv4.into(),
            endpoints: vec![pb::Endpoint {
                addresses: vec!["10.80.3.7".into()],
                conditions: Some(pb::EndpointConditions {
                    ready: Some(true),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ports: vec![pb::EndpointPort {
                name: "http".into(),
                port: Some(8080),
                protocol: pb::Protocol::Unspecified.into(),
                app_protocol: String::new(),
            }],
            labels: Default::default(),
            service: None,
        }
    }

    #[test]
    fn listing_table_and_json() {
        let view = ReflectedSlicesView {
            exports: vec![],
            reflected_slices: vec![ReflectedSliceView {
                source: Some(IdentityView {
                    cluster_id: "hub".into(),
                    cluster_name: "hub".into(),
                }),
                slice: SliceView::from_pb(&slice()),
                generation: 2,
                object_name: String::new(),
                update_time: None,
            }],
        };
        assert_eq!(
            view.table(),
            "no exports\n\n\
             SOURCE  NAMESPACE  NAME   SERVICE  ADDRESSES  PORTS          GEN  OBJECT\n\
             hub     shop       web-1  web      10.80.3.7  http:8080/tcp  2    -\n"
        );
        let json = serde_json::to_value(&view).expect("json");
        assert_eq!(json["reflected_slices"][0]["slice"]["address_type"], "IPv4");
        assert_eq!(
            json["reflected_slices"][0]["slice"]["endpoints"][0]["ready"],
            true
        );
        assert!(json["reflected_slices"][0]["slice"]["endpoints"][0]["serving"].is_null());
        let empty = ReflectedSlicesView {
            exports: vec![],
            reflected_slices: vec![],
        };
        assert_eq!(empty.table(), "no exports\n\nno reflected EndpointSlices\n");
    }

    #[test]
    fn reflect_table_shows_each_translation() {
        let view = ReflectView {
            target: "leaf-a".into(),
            slice: SliceView::from_pb(&slice()),
            translations: vec![TranslationView {
                original_address: "10.0.3.7".into(),
                translated_address: "10.80.3.7".into(),
                path: "local_nat".into(),
                home_cluster: None,
                detail: String::new(),
            }],
            delivered: false,
        };
        assert_eq!(
            view.table(),
            "shop/web-1 for leaf-a: translated, not delivered\n\
             ORIGINAL  FOR TARGET  PATH       HOME  DETAIL\n\
             10.0.3.7  10.80.3.7   local_nat  -     -\n"
        );
    }
}
