//! The Kubernetes objects of an import: the ServiceImport (spec, status), the selector-less
//! derived Service, and [`ImportWriter`], which creates, updates and deletes them (only ever
//! objects carrying Trellis' ownership marks).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::core::v1 as core_v1;
use k8s_openapi::api::discovery::v1 as discovery_v1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use serde_json::{Value, json};
use trellis_error::{Error, Result};

use super::merge::Import;
use crate::kube::{SOURCE_CLUSTER_ANNOTATION, SOURCE_SLICE_ANNOTATION, derived_service_name};
use crate::mcs::{
    DERIVED_SERVICE_ANNOTATION, IMPORT_ANNOTATION, IMPORTED_SERVICE_LABEL, ServiceImport,
};
use crate::model::{MANAGED_BY, Port};

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

    /// The ServiceImport's spec: `ips` is the derived Service's cluster IPs, what
    /// `clusterset.local` DNS answers for the import (none for a headless one, and left out
    /// while not known).
    pub(super) fn spec(&self, ips: &[String]) -> Value {
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
                // One clusterset IP per family the exported Service has: a dual-stack export
                // asks a dual-stack cluster for both (a single-stack cluster gives one).
                ip_families: (!self.is_headless() && service.ip_families.len() == 2)
                    .then(|| service.ip_families.clone()),
                ip_family_policy: (!self.is_headless() && service.ip_families.len() == 2)
                    .then(|| "PreferDualStack".to_owned()),
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
    pub(super) async fn apply_service(&self, import: &Import) -> Result<Vec<String>> {
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
                    && (want.ip_family_policy.is_none()
                        || held_spec.ip_family_policy == want.ip_family_policy)
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
    pub(super) async fn apply_import(&self, import: &Import, ips: &[String]) -> Result<()> {
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
    pub(super) async fn collect_garbage(
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
