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
use crate::model::{MANAGED_BY, Port, Slice};
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

/// One imported Service, merged over every slice reflected for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Import {
    pub namespace: String,
    pub name: String,
    /// The ports of the import (the first exporter's, by cluster ID, when they disagree).
    pub ports: Vec<Port>,
    /// The exporting clusters, sorted.
    pub clusters: Vec<String>,
    /// Exporters whose ports differ from [`Self::ports`]; empty without conflict.
    pub conflicting: Vec<String>,
}

/// Ports compared as a set: order does not make two exports differ.
fn normalized(ports: &[Port]) -> Vec<Port> {
    let mut ports = ports.to_vec();
    ports.sort_by(|a, b| (&a.name, a.port).cmp(&(&b.name, b.port)));
    ports
}

/// Groups reflected slices into imports by (namespace, Service name).
pub fn merge(records: &[ReflectedRecord]) -> BTreeMap<(String, String), Import> {
    let mut by_service: BTreeMap<(String, String), BTreeMap<String, Vec<Port>>> = BTreeMap::new();
    for record in records {
        by_service
            .entry((
                record.slice.namespace.clone(),
                record.slice.service_name.clone(),
            ))
            .or_default()
            .entry(origin_of(record))
            .or_insert_with(|| normalized(&record.slice.ports));
    }
    by_service
        .into_iter()
        .map(|((namespace, name), exporters)| {
            let ports = exporters.values().next().cloned().unwrap_or_default();
            let conflicting = exporters
                .iter()
                .filter(|(_, p)| **p != ports)
                .map(|(c, _)| c.clone())
                .collect();
            let import = Import {
                namespace: namespace.clone(),
                name: name.clone(),
                ports,
                clusters: exporters.keys().cloned().collect(),
                conflicting,
            };
            ((namespace, name), import)
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

impl Import {
    fn derived(&self) -> String {
        derived_service_name(&self.namespace, &self.name)
    }

    /// The ServiceImport's spec: `ips` is the derived Service's cluster IP, what
    /// `clusterset.local` DNS answers for the import (left out while it is not known).
    fn spec(&self, ips: &[String]) -> Value {
        let mut spec = json!({"type": "ClusterSetIP", "ports": service_ports(&self.ports)});
        if !ips.is_empty() {
            spec["ips"] = json!(ips);
        }
        spec
    }

    /// The Conflict condition (without its transition time).
    fn condition(&self) -> Value {
        if self.conflicting.is_empty() {
            json!({"type": CONFLICT_CONDITION, "status": "False", "reason": "NoConflict",
                   "message": "every exporting cluster exports the same ports"})
        } else {
            json!({"type": CONFLICT_CONDITION, "status": "True", "reason": "PortConflict",
                   "message": format!(
                       "clusters {} export {}/{} with other ports than cluster {}; the import uses cluster {}'s",
                       self.conflicting.join(", "), self.namespace, self.name,
                       self.clusters.first().map_or("", String::as_str),
                       self.clusters.first().map_or("", String::as_str))})
        }
    }

    /// The status, keeping `held`'s transition time when the condition did not change.
    fn status(&self, held: &Value) -> Value {
        let mut condition = self.condition();
        let previous = held
            .get("conditions")
            .and_then(Value::as_array)
            .and_then(|c| c.iter().find(|c| c["type"] == CONFLICT_CONDITION));
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
        json!({
            "clusters": self.clusters.iter().map(|c| json!({"cluster": c})).collect::<Vec<_>>(),
            "conditions": [condition],
        })
    }

    /// The derived Service: selector-less, ClusterIP, the import's ports.
    fn service(&self) -> core_v1::Service {
        let mut meta = managed_meta(&self.namespace, &self.derived());
        if let Some(labels) = meta.labels.as_mut() {
            labels.insert(IMPORTED_SERVICE_LABEL.to_owned(), self.name.clone());
        }
        meta.annotations = Some(BTreeMap::from([(
            IMPORT_ANNOTATION.to_owned(),
            format!("{}/{}", self.namespace, self.name),
        )]));
        core_v1::Service {
            metadata: meta,
            spec: Some(core_v1::ServiceSpec {
                type_: Some("ClusterIP".to_owned()),
                ports: Some(
                    self.ports
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
                ..core_v1::ServiceSpec::default()
            }),
            status: None,
        }
    }
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
                if held_spec.ports == want.ports && held.metadata.labels == desired.metadata.labels
                {
                    return Ok(cluster_ips(&held));
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
        meta.annotations = Some(BTreeMap::from([(
            DERIVED_SERVICE_ANNOTATION.to_owned(),
            import.derived(),
        )]));
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
                    || held.metadata.annotations != desired.metadata.annotations =>
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
            tracing::info!(namespace = %import.namespace, name = %import.name, clusters = ?import.clusters, conflicting = ?import.conflicting, "wrote serviceimport");
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
    /// What this cluster can reach now (see [`Reachability`]).
    pub async fn reachability(&self) -> Result<Reachability> {
        let clusters = self.clients.cluster_subnets().await?;
        let peers = self.clients.foreign_clusters().await?;
        let reachable = peers
            .iter()
            .filter(|fc| is_networked(fc))
            .filter_map(|fc| fc.identity.as_ref())
            .filter_map(|i| ClusterId::parse("cluster_id", &i.cluster_id).ok())
            .collect();
        let mut ranges = Vec::new();
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
        let records = self.list(None, None).await?;
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
            if let Err(err) = slices
                .apply(&record.source, &reach.mark(&record.slice))
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
            },
            generation: 1,
            object_name: None,
            update_time_nanos: 0,
        }
    }

    #[test]
    fn exports_of_one_service_merge_and_port_conflicts_are_named() {
        let agree = merge(&[record("b", "a", 80), record("b", "c", 80)]);
        let web = &agree[&("shop".to_owned(), "web".to_owned())];
        assert_eq!(web.clusters, vec!["a", "c"]);
        assert!(web.conflicting.is_empty());
        assert_eq!(web.condition()["status"], "False");
        let disagree = merge(&[record("b", "a", 80), record("b", "c", 8080)]);
        let web = &disagree[&("shop".to_owned(), "web".to_owned())];
        assert_eq!(web.ports[0].port, Some(80), "the first cluster's ports");
        assert_eq!(web.conflicting, vec!["c"]);
        assert_eq!(web.condition()["reason"], "PortConflict");
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
