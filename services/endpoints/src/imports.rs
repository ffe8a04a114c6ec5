//! The import side with Kubernetes (ADR 0019): what peers reflected to us (stored under
//! `reflected/<source>/...`, the only source of truth) becomes, per imported Service
//! (`namespace`, Service name), one `ServiceImport` (type ClusterSetIP, the exported ports,
//! the exporting clusters, a `Conflict` condition), one selector-less derived Service
//! ([`derived_service_name`]) and the translated EndpointSlices attached to it, one per
//! reflected slice, so exports of the same Service by several clusters merge into one import.
//!
//! [`run_import_sync`] converges Kubernetes on the store after every import change, every
//! [`crate::exports::RESYNC`] and at start, idempotently (read, compare, write only what
//! differs, with the read resourceVersion as precondition): a restart re-derives everything
//! from the store and duplicates nothing, and whatever Trellis wrote for an import that is gone
//! (unpeered, withdrawn, or left behind by a crash) is deleted. Only objects carrying Trellis'
//! ownership marks are ever updated or deleted.
//!
//! Readiness: an endpoint whose address this cluster can no longer reach is written not ready
//! (see [`Reachability`]), instead of steering traffic to a wrong address.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1 as core_v1;
use k8s_openapi::api::discovery::v1 as discovery_v1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use serde_json::{Value, json};
use trellis_api::ClusterId;
use trellis_api::pb::types::ForeignCluster;
use trellis_api::peers::{is_introduced, is_networked_full_peer};
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;

use crate::core::Endpoints;
use crate::exports::ORIGIN_LABEL;
use crate::kube::{SOURCE_CLUSTER_ANNOTATION, SOURCE_SLICE_ANNOTATION, derived_service_name};
use crate::mcs::{
    DERIVED_SERVICE_ANNOTATION, IMPORT_ANNOTATION, IMPORTED_SERVICE_LABEL, ServiceImport,
};
use crate::model::{AddressType, ExportedService, MANAGED_BY, Port, ServiceType, Slice};
use crate::records::ReflectedRecord;

/// Type of the ServiceImport condition reporting exporters that disagree on the ports.
pub const CONFLICT_CONDITION: &str = "Conflict";

/// Which addresses this cluster can reach now, from its own IPAM (which cluster an address
/// belongs to, as we address it) and discovery (whether we still have a networked peering with
/// that cluster: a full peer with networking, or an induced peer its hub still introduces).
#[derive(Debug, Clone, Default)]
pub struct Reachability {
    /// How we address each known cluster's pod and external CIDRs.
    ranges: Vec<(IpNet, ClusterId)>,
    reachable: BTreeSet<ClusterId>,
}

/// Whether `fc` is a peering our traffic can use.
fn is_networked(fc: &ForeignCluster) -> bool {
    is_networked_full_peer(fc) || is_introduced(fc)
}

impl Reachability {
    /// `ranges` (how we address each cluster) of which the `reachable` clusters' count.
    pub fn new(ranges: Vec<(IpNet, ClusterId)>, reachable: BTreeSet<ClusterId>) -> Self {
        Self { ranges, reachable }
    }

    /// Whether `address` belongs to a cluster we have a networked peering with.
    pub fn reaches(&self, address: &str) -> bool {
        let Ok(ip) = address.parse::<IpAddr>() else {
            // Names (FQDN slices) are resolved by whoever uses them.
            return true;
        };
        self.ranges
            .iter()
            .any(|(net, id)| net.contains(&ip) && self.reachable.contains(id))
    }

    /// `slice` with every endpoint we cannot reach marked neither ready nor serving.
    pub fn mark(&self, slice: &Slice) -> Slice {
        let mut marked = slice.clone();
        for endpoint in &mut marked.endpoints {
            if !endpoint.addresses.iter().all(|a| self.reaches(a)) {
                endpoint.conditions.ready = Some(false);
                endpoint.conditions.serving = Some(false);
            }
        }
        marked
    }
}

/// The cluster whose export a reflected slice is: its origin label, else its source.
pub(crate) fn origin_of(record: &ReflectedRecord) -> String {
    record
        .slice
        .labels
        .get(ORIGIN_LABEL)
        .cloned()
        .unwrap_or_else(|| record.source.id.to_string())
}

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
    slice_families: Vec<&'static str>,
}

/// Ports compared as a set: order does not make two exports differ.
fn normalized(ports: &[Port]) -> Vec<Port> {
    let mut ports = ports.to_vec();
    ports.sort_by(|a, b| (&a.name, a.port).cmp(&(&b.name, b.port)));
    ports
}

/// Groups reflected slices into imports by (namespace, Service name).
pub fn merge(records: &[ReflectedRecord]) -> BTreeMap<(String, String), Import> {
    let mut by_service: BTreeMap<(String, String), BTreeMap<String, ExportedService>> =
        BTreeMap::new();
    let mut slice_families: BTreeMap<(String, String), BTreeSet<&'static str>> = BTreeMap::new();
    for record in records {
        if record.slice.address_type != AddressType::Fqdn {
            slice_families
                .entry((
                    record.slice.namespace.clone(),
                    record.slice.service_name.clone(),
                ))
                .or_default()
                .insert(record.slice.address_type.as_k8s());
        }
        by_service
            .entry((
                record.slice.namespace.clone(),
                record.slice.service_name.clone(),
            ))
            .or_default()
            .entry(origin_of(record))
            .or_insert_with(|| exported_service(record));
    }
    by_service
        .into_iter()
        .filter_map(|((namespace, name), exporters)| {
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
            let families = slice_families
                .remove(&(namespace.clone(), name.clone()))
                .unwrap_or_default();
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

fn managed_meta(namespace: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some(namespace.to_owned()),
        labels: Some(BTreeMap::from([(
            crate::mcs::MANAGED_BY_LABEL.to_owned(),
            MANAGED_BY.to_owned(),
        )])),
        ..ObjectMeta::default()
    }
}

fn is_managed(meta: &ObjectMeta) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(crate::mcs::MANAGED_BY_LABEL))
        .is_some_and(|v| v == MANAGED_BY)
}

fn annotation<'a>(meta: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

fn service_ports(ports: &[Port]) -> Vec<Value> {
    ports
        .iter()
        .map(|p| {
            let mut port = json!({"port": p.port.unwrap_or(0), "protocol": p.protocol.as_k8s()});
            if let Some(name) = &p.name {
                port["name"] = json!(name);
            }
            if let Some(app) = &p.app_protocol {
                port["appProtocol"] = json!(app);
            }
            port
        })
        .collect()
}

fn now_rfc3339() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// The address families of `ips`, in order (what a ServiceImport's `ipFamilies` says).
fn families(ips: &[String]) -> Vec<&'static str> {
    ips.iter()
        .filter_map(|ip| ip.parse::<IpAddr>().ok())
        .map(|ip| if ip.is_ipv4() { "IPv4" } else { "IPv6" })
        .collect()
}

impl Import {
    fn derived(&self) -> String {
        derived_service_name(&self.namespace, &self.name)
    }

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

    /// The ServiceImport's spec: `ips` is the derived Service's cluster IPs, what
    /// `clusterset.local` DNS answers for the import (none for a headless one, and left out
    /// while not known).
    fn spec(&self, ips: &[String]) -> Value {
        let service = &self.service;
        let mut spec = json!({
            "type": service.service_type.as_mcs(),
            "ports": service_ports(&service.ports),
        });
        if self.is_headless() {
            if !service.ip_families.is_empty() {
                spec["ipFamilies"] = json!(service.ip_families);
            } else if !self.slice_families.is_empty() {
                spec["ipFamilies"] = json!(self.slice_families);
            }
        } else if !ips.is_empty() {
            spec["ips"] = json!(ips);
            spec["ipFamilies"] = json!(families(ips));
        }
        if let Some(affinity) = &service.session_affinity {
            spec["sessionAffinity"] = json!(affinity);
        }
        if let Some(timeout) = service.session_affinity_timeout_seconds {
            spec["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": timeout}});
        }
        if let Some(policy) = &service.internal_traffic_policy {
            spec["internalTrafficPolicy"] = json!(policy);
        }
        if let Some(distribution) = &service.traffic_distribution {
            spec["trafficDistribution"] = json!(distribution);
        }
        spec
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

    /// The ServiceImport's status, keeping `held`'s transition time when the condition did
    /// not change.
    fn status(&self, held: &Value) -> Value {
        json!({
            "clusters": self.clusters.iter().map(|c| json!({"cluster": c})).collect::<Vec<_>>(),
            "conditions": [with_transition_time(self.condition(), held)],
        })
    }

    /// The derived Service: selector-less, the import's ports, headless for a headless import,
    /// with the import's affinity and policies (kube-proxy applies them to the clusterset IP).
    fn service(&self) -> core_v1::Service {
        let mut meta = managed_meta(&self.namespace, &self.derived());
        if let Some(labels) = meta.labels.as_mut() {
            labels.insert(IMPORTED_SERVICE_LABEL.to_owned(), self.name.clone());
        }
        meta.annotations = Some(BTreeMap::from([(
            IMPORT_ANNOTATION.to_owned(),
            format!("{}/{}", self.namespace, self.name),
        )]));
        let service = &self.service;
        core_v1::Service {
            metadata: meta,
            spec: Some(core_v1::ServiceSpec {
                type_: Some("ClusterIP".to_owned()),
                cluster_ip: self.is_headless().then(|| "None".to_owned()),
                ports: Some(
                    service
                        .ports
                        .iter()
                        .map(|p| core_v1::ServicePort {
                            name: p.name.clone(),
                            port: p.port.unwrap_or(0),
                            protocol: Some(p.protocol.as_k8s().to_owned()),
                            app_protocol: p.app_protocol.clone(),
                            target_port: p.port.map(IntOrString::Int),
                            ..core_v1::ServicePort::default()
                        })
                        .collect(),
                ),
                session_affinity: service.session_affinity.clone(),
                session_affinity_config: service.session_affinity_timeout_seconds.map(|t| {
                    core_v1::SessionAffinityConfig {
                        client_ip: Some(core_v1::ClientIPConfig {
                            timeout_seconds: Some(t),
                        }),
                    }
                }),
                internal_traffic_policy: service.internal_traffic_policy.clone(),
                traffic_distribution: service.traffic_distribution.clone(),
                ..core_v1::ServiceSpec::default()
            }),
            status: None,
        }
    }
}

/// `condition` with `held`'s transition time for a condition of its type with the same status,
/// reason and message, and now otherwise (`held` is a status with `conditions`).
pub(crate) fn with_transition_time(mut condition: Value, held: &Value) -> Value {
    let previous = held
        .get("conditions")
        .and_then(Value::as_array)
        .and_then(|c| c.iter().find(|c| c["type"] == condition["type"]));
    let time = match previous {
        Some(p)
            if p["status"] == condition["status"]
                && p["reason"] == condition["reason"]
                && p["message"] == condition["message"] =>
        {
            p["lastTransitionTime"].clone()
        }
        _ => json!(now_rfc3339()),
    };
    condition["lastTransitionTime"] = time;
    condition
}

/// The cluster IPs of a Service (none for a headless one, or before the API server assigned
/// them).
fn cluster_ips(service: &core_v1::Service) -> Vec<String> {
    let spec = service.spec.as_ref();
    let ips = spec
        .and_then(|s| s.cluster_ips.clone())
        .filter(|ips| !ips.is_empty())
        .or_else(|| spec.and_then(|s| s.cluster_ip.clone()).map(|ip| vec![ip]))
        .unwrap_or_default();
    ips.into_iter()
        .filter(|ip| !ip.is_empty() && ip != "None")
        .collect()
}

fn kube_error(what: &str, err: kube::Error) -> Error {
    Error::Unavailable(format!("{what}: {err}"))
}

fn exact(meta: &ObjectMeta) -> DeleteParams {
    DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: meta.resource_version.clone(),
            uid: meta.uid.clone(),
        }),
        ..DeleteParams::default()
    }
}

/// Writes imports into Kubernetes with one client.
#[derive(Clone)]
pub struct ImportWriter {
    client: kube::Client,
}

impl std::fmt::Debug for ImportWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportWriter").finish_non_exhaustive()
    }
}

impl ImportWriter {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }

    /// Creates or updates the derived Service of `import`; refuses a Service of that name that
    /// Trellis did not derive for this import. Returns its cluster IPs (assigned by the API
    /// server), for the ServiceImport.
    async fn apply_service(&self, import: &Import) -> Result<Vec<String>> {
        let api: Api<core_v1::Service> = Api::namespaced(self.client.clone(), &import.namespace);
        let name = import.derived();
        let what = format!("service {}/{name}", import.namespace);
        let desired = import.service();
        let written = match api.get_opt(&name).await.map_err(|e| kube_error(&what, e))? {
            None => {
                let created = api
                    .create(&PostParams::default(), &desired)
                    .await
                    .map_err(|e| kube_error(&what, e))?;
                tracing::info!(namespace = %import.namespace, service = %name, "created derived service");
                created
            }
            Some(held) => {
                let own = format!("{}/{}", import.namespace, import.name);
                if !is_managed(&held.metadata)
                    || annotation(&held.metadata, IMPORT_ANNOTATION) != Some(&own)
                {
                    return Err(Error::AlreadyExists(format!(
                        "{what} exists and was not derived by Trellis for {own}; left untouched"
                    )));
                }
                let held_spec = held.spec.clone().unwrap_or_default();
                let want = desired.spec.clone().unwrap_or_default();
                let headless =
                    |spec: &core_v1::ServiceSpec| spec.cluster_ip.as_deref() == Some("None");
                if held.metadata.labels == desired.metadata.labels
                    && held_spec.ports == want.ports
                    && held_spec.session_affinity == want.session_affinity
                    && held_spec.session_affinity_config == want.session_affinity_config
                    && held_spec.internal_traffic_policy == want.internal_traffic_policy
                    && held_spec.traffic_distribution == want.traffic_distribution
                    && headless(&held_spec) == headless(&want)
                {
                    return Ok(cluster_ips(&held));
                }
                if headless(&held_spec) != headless(&want) {
                    // clusterIP is immutable: the Service is replaced (the first exporter
                    // changed from or to a headless one).
                    api.delete(&name, &exact(&held.metadata))
                        .await
                        .map_err(|e| kube_error(&what, e))?;
                    let created = api
                        .create(&PostParams::default(), &desired)
                        .await
                        .map_err(|e| kube_error(&what, e))?;
                    tracing::info!(namespace = %import.namespace, service = %name, headless = import.is_headless(), "replaced derived service");
                    return Ok(cluster_ips(&created));
                }
                let mut update = desired;
                update.metadata.resource_version = held.metadata.resource_version.clone();
                if let Some(spec) = update.spec.as_mut() {
                    // Assigned by the API server and immutable.
                    spec.cluster_ip = held_spec.cluster_ip;
                    spec.cluster_ips = held_spec.cluster_ips;
                }
                let replaced = api
                    .replace(&name, &PostParams::default(), &update)
                    .await
                    .map_err(|e| kube_error(&what, e))?;
                tracing::info!(namespace = %import.namespace, service = %name, "updated derived service");
                replaced
            }
        };
        Ok(cluster_ips(&written))
    }

    /// Creates or updates the ServiceImport of `import` with `ips` (spec, then status through
    /// `/status`).
    async fn apply_import(&self, import: &Import, ips: &[String]) -> Result<()> {
        let api: Api<ServiceImport> = Api::namespaced(self.client.clone(), &import.namespace);
        let what = format!("serviceimport {}/{}", import.namespace, import.name);
        let mut meta = managed_meta(&import.namespace, &import.name);
        // The labels and annotations the first exporter's ServiceExport asks for, and only
        // those (never the Service's own).
        if let Some(labels) = meta.labels.as_mut() {
            for (key, value) in &import.service.exported_labels {
                labels.entry(key.clone()).or_insert_with(|| value.clone());
            }
        }
        let mut annotations = import.service.exported_annotations.clone();
        annotations.insert(DERIVED_SERVICE_ANNOTATION.to_owned(), import.derived());
        meta.annotations = Some(annotations);
        let desired = ServiceImport::new(meta, import.spec(ips));
        let held = match api
            .get_opt(&import.name)
            .await
            .map_err(|e| kube_error(&what, e))?
        {
            None => api
                .create(&PostParams::default(), &desired)
                .await
                .map_err(|e| kube_error(&what, e))?,
            Some(held) if !is_managed(&held.metadata) => {
                return Err(Error::AlreadyExists(format!(
                    "{what} exists and is not managed by Trellis; left untouched"
                )));
            }
            Some(held)
                if held.spec != desired.spec
                    || held.metadata.annotations != desired.metadata.annotations
                    || held.metadata.labels != desired.metadata.labels =>
            {
                let mut update = desired.clone();
                update.metadata.resource_version = held.metadata.resource_version.clone();
                update.status = held.status.clone();
                api.replace(&import.name, &PostParams::default(), &update)
                    .await
                    .map_err(|e| kube_error(&what, e))?
            }
            Some(held) => held,
        };
        let status = import.status(&held.status);
        if held.status != status {
            let mut update = held.clone();
            update.status = status;
            api.replace_status(&import.name, &PostParams::default(), &update)
                .await
                .map_err(|e| kube_error(&what, e))?;
            tracing::info!(namespace = %import.namespace, name = %import.name, clusters = ?import.clusters, conflicting = ?import.conflicts.keys().collect::<Vec<_>>(), "wrote serviceimport");
        }
        Ok(())
    }

    /// Deletes every Trellis-managed ServiceImport, derived Service and imported EndpointSlice
    /// that no longer belongs to `imports` / `slices` ((source, `namespace/slice`)).
    async fn collect_garbage(
        &self,
        imports: &BTreeMap<(String, String), Import>,
        slices: &BTreeSet<(String, String)>,
    ) -> Result<usize> {
        let mut deleted = 0;
        let managed =
            ListParams::default().labels(&format!("{}={MANAGED_BY}", crate::mcs::MANAGED_BY_LABEL));
        let all: Api<ServiceImport> = Api::all(self.client.clone());
        for held in all
            .list(&managed)
            .await
            .map_err(|e| kube_error("listing serviceimports", e))?
        {
            let (Some(ns), Some(name)) = (&held.metadata.namespace, &held.metadata.name) else {
                continue;
            };
            if !imports.contains_key(&(ns.clone(), name.clone())) {
                let api: Api<ServiceImport> = Api::namespaced(self.client.clone(), ns);
                api.delete(name, &exact(&held.metadata))
                    .await
                    .map_err(|e| kube_error("deleting a serviceimport", e))?;
                tracing::info!(namespace = %ns, name = %name, "deleted serviceimport");
                deleted += 1;
            }
        }
        let all: Api<core_v1::Service> = Api::all(self.client.clone());
        for held in all
            .list(&managed)
            .await
            .map_err(|e| kube_error("listing services", e))?
        {
            let (Some(ns), Some(name)) = (&held.metadata.namespace, &held.metadata.name) else {
                continue;
            };
            let Some(own) = annotation(&held.metadata, IMPORT_ANNOTATION) else {
                continue;
            };
            let wanted = own.split_once('/').is_some_and(|(n, s)| {
                imports.contains_key(&(n.to_owned(), s.to_owned()))
                    && *name == derived_service_name(n, s)
            });
            if !wanted {
                let api: Api<core_v1::Service> = Api::namespaced(self.client.clone(), ns);
                api.delete(name, &exact(&held.metadata))
                    .await
                    .map_err(|e| kube_error("deleting a derived service", e))?;
                tracing::info!(namespace = %ns, service = %name, "deleted derived service");
                deleted += 1;
            }
        }
        let all: Api<discovery_v1::EndpointSlice> = Api::all(self.client.clone());
        let ours = ListParams::default()
            .labels(&format!("{}={MANAGED_BY}", crate::model::MANAGED_BY_LABEL));
        for held in all
            .list(&ours)
            .await
            .map_err(|e| kube_error("listing endpointslices", e))?
        {
            let (Some(ns), Some(name)) = (&held.metadata.namespace, &held.metadata.name) else {
                continue;
            };
            let (Some(source), Some(slice)) = (
                annotation(&held.metadata, SOURCE_CLUSTER_ANNOTATION),
                annotation(&held.metadata, SOURCE_SLICE_ANNOTATION),
            ) else {
                continue;
            };
            if !slices.contains(&(source.to_owned(), slice.to_owned())) {
                let api: Api<discovery_v1::EndpointSlice> =
                    Api::namespaced(self.client.clone(), ns);
                api.delete(name, &exact(&held.metadata))
                    .await
                    .map_err(|e| kube_error("deleting an imported endpointslice", e))?;
                tracing::info!(namespace = %ns, object = %name, "deleted imported endpointslice left behind");
                deleted += 1;
            }
        }
        Ok(deleted)
    }
}

impl Endpoints {
    /// What this cluster imports: every slice peers reflected to us and, as the MCS API has
    /// it (an exporting cluster imports its own export too), the slice of each of our own
    /// exports, from us.
    pub async fn import_records(&self) -> Result<Vec<ReflectedRecord>> {
        let mut records = self.list(None, None).await?;
        for export in self.stored_exports().await? {
            let mut slice = crate::exports::slice_of(&export);
            slice
                .labels
                .insert(ORIGIN_LABEL.to_owned(), self.local().id.to_string());
            records.push(ReflectedRecord {
                source: self.local().clone(),
                slice,
                generation: 0,
                object_name: None,
                update_time_nanos: export.update_time_nanos,
            });
        }
        Ok(records)
    }

    /// What this cluster can reach now (see [`Reachability`]).
    pub async fn reachability(&self) -> Result<Reachability> {
        let clusters = self.clients.cluster_subnets().await?;
        let peers = self.clients.foreign_clusters().await?;
        let mut reachable: BTreeSet<ClusterId> = peers
            .iter()
            .filter(|fc| is_networked(fc))
            .filter_map(|fc| fc.identity.as_ref())
            .filter_map(|i| ClusterId::parse("cluster_id", &i.cluster_id).ok())
            .collect();
        // Our own exports' endpoints are our pods.
        reachable.insert(self.local().id.clone());
        let mut ranges = vec![(self.pod_cidr().await?, self.local().id.clone())];
        for c in clusters {
            let Ok(id) = ClusterId::parse("cluster_id", &c.cluster_id) else {
                continue;
            };
            for net in [&c.remote_pod_cidr_nat, &c.remote_external_cidr_nat] {
                if let Ok(net) = net.parse::<IpNet>() {
                    ranges.push((net, id.clone()));
                }
            }
        }
        Ok(Reachability { ranges, reachable })
    }

    /// One pass of the import side: every stored import written into Kubernetes (derived
    /// Service, translated slices with readiness marked, ServiceImport), then everything Trellis
    /// wrote that no import needs any more deleted. Failures are logged and counted; the next
    /// pass retries.
    pub async fn sync_imports(&self, writer: &ImportWriter) -> Result<usize> {
        let Some(slices) = self.writer() else {
            return Ok(0);
        };
        let records = self.import_records().await?;
        let reach = self.reachability().await?;
        let imports = merge(&records);
        let mut failed = 0;
        let mut ips: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for (key, import) in &imports {
            match writer.apply_service(import).await {
                Ok(service_ips) => {
                    ips.insert(key.clone(), service_ips);
                }
                Err(err) => {
                    failed += 1;
                    tracing::warn!(namespace = %import.namespace, name = %import.name, error = %err, "writing a derived service failed; retrying on the next pass");
                }
            }
        }
        for record in &records {
            let key = (
                record.slice.namespace.clone(),
                record.slice.service_name.clone(),
            );
            let Some(import) = imports.get(&key) else {
                continue;
            };
            if let Err(err) = slices
                .apply(&record.source, &reach.mark(&import.slice_for(record)))
                .await
            {
                failed += 1;
                tracing::warn!(source.id = %record.source.id, namespace = %record.slice.namespace, name = %record.slice.name, error = %err, "writing an imported endpointslice failed; retrying on the next pass");
            }
        }
        // What clusterset DNS answers: every import whose derived Service has IPs this pass
        // (one whose write failed keeps the IPs it had).
        let mut known = self
            .clusterset_ips
            .lock()
            .ok()
            .and_then(|held| held.clone())
            .unwrap_or_default();
        known.retain(|key, _| imports.contains_key(key));
        for (key, service_ips) in &ips {
            known.insert(
                key.clone(),
                service_ips
                    .iter()
                    .filter_map(|ip| ip.parse().ok())
                    .collect(),
            );
        }
        self.set_clusterset_ips(known);
        for (key, import) in &imports {
            // Without the derived Service's IPs this pass the ServiceImport waits for the next
            // one rather than losing the IPs it has.
            let Some(ips) = ips.get(key) else {
                continue;
            };
            if let Err(err) = writer.apply_import(import, ips).await {
                failed += 1;
                tracing::warn!(namespace = %import.namespace, name = %import.name, error = %err, "writing a serviceimport failed; retrying on the next pass");
            }
        }
        let held: BTreeSet<(String, String)> = records
            .iter()
            .map(|r| {
                (
                    r.source.id.to_string(),
                    format!("{}/{}", r.slice.namespace, r.slice.name),
                )
            })
            .collect();
        if let Err(err) = writer.collect_garbage(&imports, &held).await {
            failed += 1;
            tracing::warn!(error = %err, "removing stale imports from kubernetes failed; retrying on the next pass");
        }
        Ok(failed)
    }
}

/// Runs the import side until `shutdown`: a pass at start, after every import change and every
/// `resync`.
pub async fn run_import_sync(
    core: Arc<Endpoints>,
    writer: ImportWriter,
    resync: std::time::Duration,
    shutdown: Shutdown,
) {
    loop {
        match core.sync_imports(&writer).await {
            Ok(0) => {}
            Ok(failed) => tracing::debug!(failed, "import sync pass had failures"),
            Err(err) => tracing::warn!(error = %err, "import sync pass failed"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = core.imports_changed.notified() => {}
            () = trellis_runtime::timer::period(resync) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{AddressType, Conditions, Endpoint, Protocol};
    use trellis_api::ClusterIdentity;

    fn record(source: &str, origin: &str, port: i32) -> ReflectedRecord {
        ReflectedRecord {
            source: ClusterIdentity {
                id: ClusterId::parse("s", source).expect("id"),
                name: String::new(),
            },
            slice: Slice {
                namespace: "shop".into(),
                name: format!("web.{origin}"),
                service_name: "web".into(),
                address_type: AddressType::IPv4,
                endpoints: vec![Endpoint {
                    addresses: vec!["10.1.0.7".into()],
                    conditions: Conditions::default(),
                    hostname: None,
                    node_name: None,
                    zone: None,
                }],
                ports: vec![Port {
                    name: Some("http".into()),
                    port: Some(port),
                    protocol: Protocol::Tcp,
                    app_protocol: None,
                }],
                labels: BTreeMap::from([(ORIGIN_LABEL.to_owned(), origin.to_owned())]),
                service: None,
            },
            generation: 1,
            object_name: None,
            update_time_nanos: 0,
        }
    }

    fn port(name: &str, number: i32) -> Port {
        Port {
            name: Some(name.into()),
            port: Some(number),
            protocol: Protocol::Tcp,
            app_protocol: None,
        }
    }

    /// `origin`'s export of shop/web, begun at `at`, with Service ports `ports`.
    fn exported(origin: &str, at: i64, ports: Vec<Port>) -> ReflectedRecord {
        let mut r = record("b", origin, 80);
        r.slice.ports = ports.clone();
        r.slice.service = Some(ExportedService {
            ports,
            exported_at_nanos: at,
            ..ExportedService::default()
        });
        r
    }

    fn web(imports: &BTreeMap<(String, String), Import>) -> &Import {
        &imports[&("shop".to_owned(), "web".to_owned())]
    }

    #[test]
    fn exports_of_one_service_merge_and_port_conflicts_are_named() {
        let agree = merge(&[record("b", "a", 80), record("b", "c", 80)]);
        let import = web(&agree);
        assert_eq!(import.clusters, vec!["a", "c"]);
        assert!(import.conflicts.is_empty());
        assert_eq!(import.condition()["status"], "False");
        let disagree = merge(&[record("b", "a", 80), record("b", "c", 8080)]);
        let import = web(&disagree);
        assert_eq!(
            import.service.ports,
            vec![port("http", 80)],
            "without export times, the first cluster by ID wins"
        );
        assert_eq!(import.conflicts.keys().collect::<Vec<_>>(), vec!["c"]);
        assert_eq!(import.condition()["status"], "True");
        assert_eq!(import.condition()["reason"], "PortConflict");
    }

    #[test]
    fn ports_are_the_union_and_the_first_exporter_wins_a_name() {
        // z exported first although its ID sorts last.
        let imports = merge(&[
            exported("a", 20, vec![port("tcp", 43), port("stcp", 142)]),
            exported("z", 10, vec![port("tcp", 42), port("udp", 42)]),
        ]);
        let import = web(&imports);
        assert_eq!(import.first, "z");
        assert_eq!(
            import.service.ports,
            vec![port("stcp", 142), port("tcp", 42), port("udp", 42)]
        );
        assert_eq!(import.condition()["reason"], "PortConflict");
        // a's endpoints leave the port it serves at another number, keep the others.
        let a = exported("a", 20, vec![port("tcp", 43), port("stcp", 142)]);
        let served: Vec<_> = import
            .slice_for(&a)
            .ports
            .into_iter()
            .map(|p| p.name)
            .collect();
        assert_eq!(served, vec![Some("stcp".to_owned())]);
        let z = exported("z", 10, vec![port("tcp", 42), port("udp", 42)]);
        assert_eq!(import.slice_for(&z).ports.len(), 2);
    }

    #[test]
    fn type_affinity_and_labels_follow_the_first_exporter() {
        let mut first = exported("c", 10, vec![port("tcp", 42)]);
        let mut second = exported("a", 20, vec![port("tcp", 42)]);
        if let (Some(f), Some(s)) = (first.slice.service.as_mut(), second.slice.service.as_mut()) {
            f.session_affinity = Some("ClientIP".into());
            f.exported_labels.insert("tier".into(), "web".into());
            s.service_type = ServiceType::Headless;
            s.exported_labels.insert("tier".into(), "db".into());
        }
        let imports = merge(&[second, first]);
        let import = web(&imports);
        assert!(!import.is_headless());
        assert_eq!(import.service.session_affinity.as_deref(), Some("ClientIP"));
        assert_eq!(import.service.exported_labels["tier"], "web");
        let kinds: Vec<_> = import.conflicts["a"].iter().copied().collect();
        assert_eq!(
            kinds,
            vec![
                ConflictKind::Type,
                ConflictKind::SessionAffinity,
                ConflictKind::Labels
            ]
        );
        assert_eq!(import.condition()["reason"], "TypeConflict");
        let spec = import.spec(&["10.96.0.9".to_owned()]);
        assert_eq!(spec["type"], "ClusterSetIP");
        assert_eq!(spec["ipFamilies"], json!(["IPv4"]));
        assert_eq!(spec["sessionAffinity"], "ClientIP");
    }

    #[test]
    fn unreachable_addresses_are_marked_not_ready() {
        let a = ClusterId::parse("c", "a").expect("id");
        let reach = Reachability {
            ranges: vec![("10.1.0.0/16".parse().expect("net"), a.clone())],
            reachable: BTreeSet::new(),
        };
        let r = record("b", "a", 80);
        assert_eq!(
            reach.mark(&r.slice).endpoints[0].conditions.ready,
            Some(false)
        );
        let reach = Reachability {
            reachable: BTreeSet::from([a]),
            ..reach
        };
        assert_eq!(reach.mark(&r.slice).endpoints[0].conditions.ready, None);
    }
}
