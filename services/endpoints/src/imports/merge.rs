//! The MCS rules that make one import of a Service out of every exporting cluster's export
//! (KEP-1645 "conflict resolution"): the first exporter (earliest ServiceExport, then cluster ID)
//! gives the type, session affinity, traffic policies and exported metadata; the ports are the
//! union by name, the first exporter's number where two disagree; every disagreement is a
//! conflict each exporter's ServiceExport reports.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use super::origin_of;
use crate::model::{AddressType, ExportedService, Port, ServiceType, Slice};
use crate::records::ReflectedRecord;

/// Type of the ServiceImport condition reporting exporters that disagree on the ports.
pub const CONFLICT_CONDITION: &str = "Conflict";

/// What one exporting cluster says of the Service: its slices' [`ExportedService`], or for
/// slices without one (gRPC exports, slices reflected by hand) a ClusterSetIP Service of the
/// slice's ports, ordered after every exporter that says when it began.
fn exported_service(record: &ReflectedRecord) -> ExportedService {
    let mut service = record
        .slice
        .service
        .clone()
        .unwrap_or_else(|| ExportedService {
            ports: record.slice.ports.clone(),
            exported_at_nanos: i64::MAX,
            ..ExportedService::default()
        });
    service.ports = normalized(&service.ports);
    service
}

/// Why exporters of one Service disagree (the MCS `Conflict` condition's reasons), in the
/// order the condition names the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConflictKind {
    Port,
    Type,
    SessionAffinity,
    SessionAffinityConfig,
    InternalTrafficPolicy,
    TrafficDistribution,
    Labels,
    Annotations,
}

impl ConflictKind {
    /// The condition's reason.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Port => "PortConflict",
            Self::Type => "TypeConflict",
            Self::SessionAffinity => "SessionAffinityConflict",
            Self::SessionAffinityConfig => "SessionAffinityConfigConflict",
            Self::InternalTrafficPolicy => "InternalTrafficPolicyConflict",
            Self::TrafficDistribution => "TrafficDistributionConflict",
            Self::Labels => "LabelsConflict",
            Self::Annotations => "AnnotationsConflict",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::Port => "ports",
            Self::Type => "type",
            Self::SessionAffinity => "session affinity",
            Self::SessionAffinityConfig => "session affinity timeout",
            Self::InternalTrafficPolicy => "internal traffic policy",
            Self::TrafficDistribution => "traffic distribution",
            Self::Labels => "exported labels",
            Self::Annotations => "exported annotations",
        }
    }
}

/// Where `other` disagrees with `first` (unset and the Kubernetes default are the same).
fn disagreements(first: &ExportedService, other: &ExportedService) -> BTreeSet<ConflictKind> {
    let affinity =
        |s: &ExportedService| s.session_affinity.clone().unwrap_or_else(|| "None".into());
    let policy = |s: &ExportedService| {
        s.internal_traffic_policy
            .clone()
            .unwrap_or_else(|| "Cluster".into())
    };
    let mut out = BTreeSet::new();
    if first.ports != other.ports {
        out.insert(ConflictKind::Port);
    }
    if first.service_type != other.service_type {
        out.insert(ConflictKind::Type);
    }
    if affinity(first) != affinity(other) {
        out.insert(ConflictKind::SessionAffinity);
    } else if first.session_affinity_timeout_seconds != other.session_affinity_timeout_seconds {
        out.insert(ConflictKind::SessionAffinityConfig);
    }
    if policy(first) != policy(other) {
        out.insert(ConflictKind::InternalTrafficPolicy);
    }
    if first.traffic_distribution != other.traffic_distribution {
        out.insert(ConflictKind::TrafficDistribution);
    }
    if first.exported_labels != other.exported_labels {
        out.insert(ConflictKind::Labels);
    }
    if first.exported_annotations != other.exported_annotations {
        out.insert(ConflictKind::Annotations);
    }
    out
}

/// One imported Service, merged over every exporting cluster (the MCS rules): the first
/// exporter (earliest export, then cluster ID) gives the type, affinity, policies, labels and
/// annotations; the ports are the union by name, the first exporter's where a name is exported
/// at different numbers; any disagreement is a conflict every exporter's ServiceExport reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Import {
    pub namespace: String,
    pub name: String,
    /// The first exporter's view of the Service, with [`ExportedService::ports`] the union.
    pub service: ExportedService,
    /// The exporting clusters, sorted.
    pub clusters: Vec<String>,
    /// The first exporter.
    pub first: String,
    /// Exporters that disagree with the first, and on what; empty without conflict.
    pub conflicts: BTreeMap<String, BTreeSet<ConflictKind>>,
    /// Per exporter, the names of the ports it exports at another number or protocol than the
    /// import: its endpoints are left out of those ports, so a port reaches only the clusters
    /// that serve it as the import says.
    excluded_ports: BTreeMap<String, BTreeSet<Option<String>>>,
    /// The address families of the exporters' slices (`IPv4` first): a headless import's
    /// `ipFamilies` when the first exporter's Service does not say.
    pub(super) slice_families: Vec<&'static str>,
}

/// Ports compared as a set: order does not make two exports differ.
fn normalized(ports: &[Port]) -> Vec<Port> {
    let mut ports = ports.to_vec();
    ports.sort_by(|a, b| (&a.name, a.port).cmp(&(&b.name, b.port)));
    ports
}

/// Groups reflected slices into imports by (namespace, Service name).
pub fn merge(records: &[ReflectedRecord]) -> BTreeMap<(String, String), Import> {
    // Per Service: each exporter's view of it, and the address families of its slices.
    type Exporters = (BTreeMap<String, ExportedService>, BTreeSet<&'static str>);
    let mut by_service: BTreeMap<(String, String), Exporters> = BTreeMap::new();
    for record in records {
        let (exporters, families) = by_service
            .entry((
                record.slice.namespace.clone(),
                record.slice.service_name.clone(),
            ))
            .or_default();
        exporters
            .entry(origin_of(record))
            .or_insert_with(|| exported_service(record));
        if record.slice.address_type != AddressType::Fqdn {
            families.insert(record.slice.address_type.as_k8s());
        }
    }
    by_service
        .into_iter()
        .filter_map(|((namespace, name), (exporters, families))| {
            let mut order: Vec<(&String, &ExportedService)> = exporters.iter().collect();
            order.sort_by_key(|(cluster, s)| (s.exported_at_nanos, (*cluster).clone()));
            let (first, winner) = *order.first()?;
            let mut union: BTreeMap<Option<String>, Port> = BTreeMap::new();
            let mut excluded_ports: BTreeMap<String, BTreeSet<Option<String>>> = BTreeMap::new();
            let mut conflicts = BTreeMap::new();
            for (cluster, service) in &order {
                for port in &service.ports {
                    match union.get(&port.name) {
                        None => {
                            union.insert(port.name.clone(), port.clone());
                        }
                        Some(held) if held.port != port.port || held.protocol != port.protocol => {
                            excluded_ports
                                .entry((*cluster).clone())
                                .or_default()
                                .insert(port.name.clone());
                        }
                        Some(_) => {}
                    }
                }
                let disagree = disagreements(winner, service);
                if !disagree.is_empty() {
                    conflicts.insert((*cluster).clone(), disagree);
                }
            }
            let mut service = winner.clone();
            service.ports = union.into_values().collect();
            let import = Import {
                slice_families: families.into_iter().collect(),
                namespace: namespace.clone(),
                name: name.clone(),
                service,
                clusters: exporters.keys().cloned().collect(),
                first: first.clone(),
                conflicts,
                excluded_ports,
            };
            Some(((namespace, name), import))
        })
        .collect()
}

impl Import {
    /// Whether the import has no clusterset IP.
    pub fn is_headless(&self) -> bool {
        self.service.service_type == ServiceType::Headless
    }

    /// `record`'s slice as the import serves it: without the ports its exporter exports at
    /// another number than the import (a port reaches only the clusters serving it as named).
    pub fn slice_for(&self, record: &ReflectedRecord) -> Slice {
        let mut slice = record.slice.clone();
        if let Some(excluded) = self.excluded_ports.get(&origin_of(record)) {
            slice.ports.retain(|p| !excluded.contains(&p.name));
        }
        slice
    }

    /// The Conflict condition (without its transition time), on the ServiceImport and on the
    /// ServiceExport of every exporting cluster.
    pub fn condition(&self) -> Value {
        let kinds: BTreeSet<ConflictKind> = self.conflicts.values().flatten().copied().collect();
        let Some(first_kind) = kinds.first() else {
            return json!({"type": CONFLICT_CONDITION, "status": "False", "reason": "NoConflicts",
                          "message": "every exporting cluster exports the Service alike"});
        };
        let detail: Vec<String> = self
            .conflicts
            .iter()
            .map(|(cluster, kinds)| {
                let what: Vec<&str> = kinds.iter().map(|k| k.what()).collect();
                format!("{cluster} ({})", what.join(", "))
            })
            .collect();
        json!({"type": CONFLICT_CONDITION, "status": "True", "reason": first_kind.reason(),
               "message": format!(
                   "{}/{}: clusters {} export it unlike cluster {}, the first exporter, whose export the import follows",
                   self.namespace, self.name, detail.join("; "), self.first)})
    }
}
