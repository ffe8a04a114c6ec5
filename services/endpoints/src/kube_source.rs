//! The Kubernetes export source (ADR 0017, 0019): kube-runtime watchers of `ServiceExport`
//! objects, Services and EndpointSlices, in every namespace, turned into the same
//! [`ExportRecord`]s the `ExportService` RPC writes (with [`ExportSource::Kubernetes`]), so one
//! reconciler reflects both.
//!
//! A `ServiceExport` `ns/name` exports the Service `ns/name` when that Service exists:
//! - ports: the Service's ports (name, protocol, appProtocol), numbered as the endpoints listen
//!   (the EndpointSlice port of the same name, else a numeric targetPort, else the port), since
//!   a consumer's derived Service forwards to the endpoints' port;
//! - endpoints: every address of the Service's EndpointSlices (label
//!   `kubernetes.io/service-name`, not the ones Trellis writes for imports) that is in our pod
//!   CIDR, ready unless the slice says `ready: false`.
//!
//! The export also carries what the Service says beyond its endpoints ([`ExportedService`]:
//! ClusterSetIP or Headless, the Service's own port numbers, session affinity, traffic
//! policies, IP families, the labels and annotations the ServiceExport's `exportedLabels` and
//! `exportedAnnotations` ask for, and the ServiceExport's creation time, by which the first
//! exporter wins). An ExternalName Service, or a missing one, is not exported.
//!
//! Every ServiceExport gets a status: `Valid` (False with `NoService`, `InvalidServiceType` or
//! `InvalidServiceExport` when nothing is exported) and `Conflict` (whether the exporters of the
//! Service, as this cluster sees them, disagree; [`crate::imports::merge`]).
//!
//! Deleting the `ServiceExport` or the Service withdraws the export. Each watcher event, and
//! each change of what this cluster imports, triggers a pass over the watchers' caches; an
//! export whose content did not change is not written again ([`Endpoints::export`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt as _, stream};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::reflector as reflect;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use serde_json::{Value, json};
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;

use crate::core::Endpoints;
use crate::imports::{merge, with_transition_time};
use crate::mcs::{ServiceExport, VALID_CONDITION};
use crate::model::{
    ExportedService, MANAGED_BY, MANAGED_BY_LABEL, Port, Protocol, SERVICE_NAME_LABEL, ServiceType,
};
use crate::records::{ExportRecord, ExportSource, ExportedEndpoint};

/// Pause after an event before a pass, so a burst (a Deployment scaling) costs one pass.
const SETTLE: Duration = Duration::from_millis(100);

/// The watchers' caches.
#[derive(Debug, Clone)]
pub struct Caches {
    exports: Store<ServiceExport>,
    services: Store<Service>,
    slices: Store<EndpointSlice>,
}

fn protocol(value: Option<&str>) -> Protocol {
    match value {
        Some("UDP") => Protocol::Udp,
        Some("SCTP") => Protocol::Sctp,
        _ => Protocol::Tcp,
    }
}

fn label<'a>(slice: &'a EndpointSlice, key: &str) -> Option<&'a str> {
    slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str)
}

/// Why a ServiceExport exports nothing (its `Valid` condition is False with this reason).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub reason: &'static str,
    pub message: String,
}

fn invalid(reason: &'static str, message: String) -> Invalid {
    Invalid { reason, message }
}

/// The string map at `spec.<key>` of a ServiceExport.
fn spec_map(export: &ServiceExport, key: &str) -> std::collections::HashMap<String, String> {
    export
        .spec
        .get(key)
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// What `service` says beyond its endpoints, with what `export` asks to carry over, checked as
/// a peer will check it (so a peer never refuses what we send).
fn exported_service(export: &ServiceExport, service: &Service) -> Result<ExportedService, Invalid> {
    let spec = service.spec.clone().unwrap_or_default();
    let ports = spec
        .ports
        .iter()
        .flatten()
        .map(|p| Port {
            name: p.name.clone().filter(|n| !n.is_empty()),
            port: Some(p.port),
            protocol: protocol(p.protocol.as_deref()),
            app_protocol: p.app_protocol.clone(),
        })
        .collect();
    let exported_at_nanos = export
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| i64::try_from(t.0.as_nanosecond()).unwrap_or(0));
    let wanted = ExportedService {
        service_type: if spec.cluster_ip.as_deref() == Some("None") {
            ServiceType::Headless
        } else {
            ServiceType::ClusterSetIp
        },
        ports,
        session_affinity: spec.session_affinity.clone(),
        session_affinity_timeout_seconds: spec
            .session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds),
        internal_traffic_policy: spec.internal_traffic_policy.clone(),
        traffic_distribution: spec.traffic_distribution.clone(),
        ip_families: spec.ip_families.clone().unwrap_or_default(),
        exported_labels: spec_map(export, "exportedLabels").into_iter().collect(),
        exported_annotations: spec_map(export, "exportedAnnotations")
            .into_iter()
            .collect(),
        exported_at_nanos,
    };
    ExportedService::from_pb("service", &wanted.to_pb()).map_err(|err| {
        invalid(
            "InvalidServiceExport",
            format!("the ServiceExport or its Service cannot be exported: {err}"),
        )
    })
}

/// The export `export` (a ServiceExport) makes of Service `service` with `slices` (those of
/// the Service), keeping addresses in `pod_cidr`; or why it makes none.
pub fn export_of(
    export: &ServiceExport,
    service: &Service,
    slices: &[&EndpointSlice],
    pod_cidr: ipnet::IpNet,
) -> Result<ExportRecord, Invalid> {
    let (Some(namespace), Some(name)) = (
        service.metadata.namespace.clone(),
        service.metadata.name.clone(),
    ) else {
        return Err(invalid("NoService", "the Service has no name".into()));
    };
    let spec = service.spec.clone().unwrap_or_default();
    if spec.type_.as_deref() == Some("ExternalName") {
        return Err(invalid(
            "InvalidServiceType",
            format!(
                "{namespace}/{name} is an ExternalName Service, which cannot be exported (it has neither endpoints nor a cluster IP)"
            ),
        ));
    }
    let slice_ports: BTreeMap<String, i32> = slices
        .iter()
        .flat_map(|s| s.ports.iter().flatten())
        .filter_map(|p| Some((p.name.clone().unwrap_or_default(), p.port?)))
        .collect();
    let ports: Vec<Port> = spec
        .ports
        .iter()
        .flatten()
        .map(|p| {
            let key = p.name.clone().unwrap_or_default();
            let number = slice_ports
                .get(&key)
                .copied()
                .or(match &p.target_port {
                    Some(IntOrString::Int(n)) => Some(*n),
                    _ => None,
                })
                .unwrap_or(p.port);
            Port {
                name: p.name.clone().filter(|n| !n.is_empty()),
                port: Some(number),
                protocol: protocol(p.protocol.as_deref()),
                app_protocol: p.app_protocol.clone(),
            }
        })
        .collect();
    if ports.is_empty() {
        return Err(invalid(
            "InvalidServiceType",
            format!("{namespace}/{name} has no ports"),
        ));
    }
    let service_info = exported_service(export, service)?;
    let mut seen = BTreeSet::new();
    let mut endpoints = Vec::new();
    for slice in slices {
        if slice.address_type != "IPv4" && slice.address_type != "IPv6" {
            continue;
        }
        for endpoint in slice.endpoints.iter().flatten() {
            let ready = endpoint
                .conditions
                .as_ref()
                .and_then(|c| c.ready)
                .unwrap_or(true);
            for address in &endpoint.addresses {
                let Ok(ip) = address.parse::<IpAddr>() else {
                    continue;
                };
                // Host-network pods and external addresses are not ours to translate.
                if !pod_cidr.contains(&ip) || !seen.insert(ip) {
                    continue;
                }
                endpoints.push(ExportedEndpoint {
                    address: ip.to_string(),
                    ready,
                    hostname: endpoint
                        .hostname
                        .clone()
                        .filter(|h| crate::model::dns_label("hostname", h).is_ok()),
                });
            }
        }
    }
    endpoints.sort_by(|a, b| a.address.cmp(&b.address));
    Ok(ExportRecord {
        namespace,
        name,
        ports,
        endpoints,
        update_time_nanos: 0,
        source: ExportSource::Kubernetes,
        service: Some(service_info),
    })
}

/// What one ServiceExport makes: an export, or why none.
pub type Verdict = Result<ExportRecord, Invalid>;

impl Caches {
    /// What every ServiceExport the caches hold makes, by (namespace, name).
    pub fn desired(&self, pod_cidr: ipnet::IpNet) -> BTreeMap<(String, String), Verdict> {
        let slices = self.slices.state();
        let mut out = BTreeMap::new();
        for export in self.exports.state() {
            let (Some(namespace), Some(name)) = (
                export.metadata.namespace.clone(),
                export.metadata.name.clone(),
            ) else {
                continue;
            };
            if export.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let Some(service) = self.services.state().into_iter().find(|s| {
                s.metadata.namespace.as_deref() == Some(namespace.as_str())
                    && s.metadata.name.as_deref() == Some(name.as_str())
            }) else {
                out.insert(
                    (namespace.clone(), name.clone()),
                    Err(invalid(
                        "NoService",
                        format!("there is no Service {namespace}/{name} to export"),
                    )),
                );
                continue;
            };
            let own: Vec<&EndpointSlice> = slices
                .iter()
                .map(|s| &**s)
                .filter(|s| {
                    s.metadata.namespace.as_deref() == Some(namespace.as_str())
                        && label(s, SERVICE_NAME_LABEL) == Some(name.as_str())
                        && label(s, MANAGED_BY_LABEL) != Some(MANAGED_BY)
                })
                .collect();
            out.insert(
                (namespace, name),
                export_of(&export, &service, &own, pod_cidr),
            );
        }
        out
    }

    /// The cached ServiceExport `namespace/name`.
    fn export(&self, namespace: &str, name: &str) -> Option<Arc<ServiceExport>> {
        self.exports.state().into_iter().find(|e| {
            e.metadata.namespace.as_deref() == Some(namespace)
                && e.metadata.name.as_deref() == Some(name)
        })
    }
}

/// The `Valid` condition of a ServiceExport with `verdict`.
fn valid_condition(verdict: &Verdict) -> Value {
    match verdict {
        Ok(_) => json!({"type": VALID_CONDITION, "status": "True", "reason": "Valid",
                        "message": "the Service is exported to every peer"}),
        Err(why) => json!({"type": VALID_CONDITION, "status": "False", "reason": why.reason,
                           "message": why.message}),
    }
}

/// Writes `conditions` into `export`'s status (other condition types kept; a condition's
/// transition time kept while it says the same); nothing when they already stand.
async fn write_export_status(
    client: &kube::Client,
    export: &ServiceExport,
    conditions: Vec<Value>,
) -> Result<bool> {
    let held = export.status.get("conditions").and_then(Value::as_array);
    let same = |wanted: &Value| {
        held.into_iter().flatten().any(|c| {
            c["type"] == wanted["type"]
                && c["status"] == wanted["status"]
                && c["reason"] == wanted["reason"]
                && c["message"] == wanted["message"]
        })
    };
    if conditions.iter().all(same) {
        return Ok(false);
    }
    let (Some(namespace), Some(name)) = (&export.metadata.namespace, &export.metadata.name) else {
        return Ok(false);
    };
    let mut written: Vec<Value> = held
        .into_iter()
        .flatten()
        .filter(|c| !conditions.iter().any(|w| w["type"] == c["type"]))
        .cloned()
        .collect();
    written.extend(
        conditions
            .into_iter()
            .map(|c| with_transition_time(c, &export.status)),
    );
    let mut update = export.clone();
    update.status = json!({"conditions": written});
    let api: Api<ServiceExport> = Api::namespaced(client.clone(), namespace);
    api.replace_status(name, &PostParams::default(), &update)
        .await
        .map_err(|e| {
            Error::Unavailable(format!(
                "writing the status of serviceexport {namespace}/{name}: {e}"
            ))
        })?;
    Ok(true)
}

impl Endpoints {
    /// One pass of the Kubernetes export source: every export the caches describe stored
    /// (unchanged ones are not rewritten), every Kubernetes export they no longer describe
    /// removed. Returns how many steps failed.
    pub async fn sync_kube_exports(&self, client: &kube::Client, caches: &Caches) -> Result<usize> {
        let pod_cidr = self.pod_cidr().await?;
        let desired = caches.desired(pod_cidr);
        let mut failed = 0;
        for record in desired.values().flatten() {
            if let Err(err) = self.export(record.clone()).await {
                failed += 1;
                tracing::warn!(namespace = %record.namespace, name = %record.name, error = %err, "exporting from a serviceexport failed; retrying on the next pass");
            }
        }
        for held in self.stored_exports().await? {
            if held.source == ExportSource::Kubernetes
                && !matches!(
                    desired.get(&(held.namespace.clone(), held.name.clone())),
                    Some(Ok(_))
                )
                && let Err(err) = self
                    .unexport(&held.namespace, &held.name, ExportSource::Kubernetes)
                    .await
            {
                failed += 1;
                tracing::warn!(namespace = %held.namespace, name = %held.name, error = %err, "withdrawing a serviceexport failed; retrying on the next pass");
            }
        }
        // Each ServiceExport says whether it is valid and whether the exporters of its
        // Service agree (as this cluster sees them: its own export and the peers').
        if desired.is_empty() {
            // No ServiceExport: no status to write, no reason to read the imports (this pass
            // also runs after every import change).
            return Ok(failed);
        }
        let imports = merge(&self.import_records().await?);
        for (key, verdict) in &desired {
            let Some(export) = caches.export(&key.0, &key.1) else {
                continue;
            };
            let mut conditions = vec![valid_condition(verdict)];
            if verdict.is_ok()
                && let Some(import) = imports.get(key)
            {
                conditions.push(import.condition());
            }
            match write_export_status(client, &export, conditions).await {
                Ok(true) => {
                    tracing::info!(namespace = %key.0, name = %key.1, valid = verdict.is_ok(), "wrote serviceexport status");
                }
                Ok(false) => {}
                Err(err) => {
                    failed += 1;
                    tracing::warn!(namespace = %key.0, name = %key.1, error = %err, "writing a serviceexport status failed; retrying on the next pass");
                }
            }
        }
        Ok(failed)
    }
}

/// Runs the watchers and the export source until `shutdown`.
pub async fn run_export_source(
    core: Arc<Endpoints>,
    client: kube::Client,
    resync: Duration,
    shutdown: Shutdown,
) {
    let config = watcher::Config::default;
    let (exports, w1) = reflector::store::<ServiceExport>();
    let (services, w2) = reflector::store::<Service>();
    let (slices, w3) = reflector::store::<EndpointSlice>();
    let events = stream::select_all([
        reflect(w1, watcher(Api::all(client.clone()), config()))
            .default_backoff()
            .map(|e| e.err().map(|e| e.to_string()))
            .boxed(),
        reflect(w2, watcher(Api::all(client.clone()), config()))
            .default_backoff()
            .map(|e| e.err().map(|e| e.to_string()))
            .boxed(),
        reflect(w3, watcher(Api::all(client.clone()), config()))
            .default_backoff()
            .map(|e| e.err().map(|e| e.to_string()))
            .boxed(),
    ]);
    let mut events = events.ready_chunks(256);
    let caches = Caches {
        exports,
        services,
        slices,
    };
    let ready = async {
        let _ = caches.exports.wait_until_ready().await;
        let _ = caches.services.wait_until_ready().await;
        let _ = caches.slices.wait_until_ready().await;
    };
    // The caches fill only while the streams are polled.
    tokio::pin!(ready);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = &mut ready => break,
            batch = events.next() => {
                for error in batch.iter().flatten().flatten() {
                    tracing::warn!(error, "kubernetes watch failed; retrying with backoff");
                }
            }
        }
    }
    tracing::info!("kubernetes export source ready");
    // Imports changing (a peer's export of the same Service) change our ServiceExports'
    // Conflict condition.
    let mut imports = core.zone_changed.subscribe();
    loop {
        imports.mark_unchanged();
        match core.sync_kube_exports(&client, &caches).await {
            Ok(0) => {}
            Ok(failed) => tracing::debug!(failed, "kubernetes export pass had failures"),
            Err(err) => tracing::warn!(error = %err, "kubernetes export pass failed"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            batch = events.next() => {
                let Some(batch) = batch else { return };
                for error in batch.iter().flatten() {
                    tracing::warn!(error, "kubernetes watch failed; retrying with backoff");
                }
                trellis_runtime::timer::period(SETTLE).await;
            }
            _ = imports.changed() => {}
            () = trellis_runtime::timer::period(resync) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object<T: serde::de::DeserializeOwned>(value: Value) -> T {
        serde_json::from_value(value).expect("an object")
    }

    fn export(spec: Value) -> ServiceExport {
        object(json!({"metadata": {"name": "web", "namespace": "shop",
                                   "creationTimestamp": "2026-11-28T12:00:01Z"},
                      "spec": spec}))
    }

    fn service(spec: Value) -> Service {
        object(json!({"metadata": {"name": "web", "namespace": "shop"}, "spec": spec}))
    }

    fn slice() -> EndpointSlice {
        object(json!({"metadata": {"name": "web-1", "namespace": "shop"},
                      "addressType": "IPv4",
                      "ports": [{"name": "http", "port": 8080}],
                      "endpoints": [{"addresses": ["10.0.0.7"], "hostname": "web-0"}]}))
    }

    fn cidr() -> ipnet::IpNet {
        "10.0.0.0/16".parse().expect("cidr")
    }

    #[test]
    fn a_service_export_carries_what_the_service_says_beyond_its_endpoints() {
        let svc = service(json!({
            "clusterIP": "None",
            "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}},
            "ipFamilies": ["IPv4"],
        }));
        let slice = slice();
        let record = export_of(
            &export(json!({"exportedLabels": {"tier": "web"}})),
            &svc,
            &[&slice],
            cidr(),
        )
        .expect("exported");
        assert_eq!(record.ports[0].port, Some(8080), "the endpoints' port");
        assert_eq!(record.endpoints[0].hostname.as_deref(), Some("web-0"));
        let info = record.service.expect("carried");
        assert_eq!(info.service_type, ServiceType::Headless);
        assert_eq!(info.ports[0].port, Some(80), "the Service's own port");
        assert_eq!(info.session_affinity_timeout_seconds, Some(30));
        assert_eq!(info.exported_labels["tier"], "web");
        assert_eq!(info.exported_at_nanos, 1_795_867_201_000_000_000);
    }

    #[test]
    fn what_cannot_be_exported_says_why() {
        let slice = slice();
        let external = service(json!({"type": "ExternalName", "externalName": "example.com"}));
        let why = export_of(&export(json!({})), &external, &[&slice], cidr()).expect_err("no");
        assert_eq!(why.reason, "InvalidServiceType");
        let portless = service(json!({}));
        let why = export_of(&export(json!({})), &portless, &[&slice], cidr()).expect_err("no");
        assert_eq!(why.reason, "InvalidServiceType");
        let svc = service(json!({"ports": [{"name": "http", "port": 80}]}));
        let reserved = export(json!({"exportedLabels": {"app.kubernetes.io/managed-by": "me"}}));
        let why = export_of(&reserved, &svc, &[&slice], cidr()).expect_err("no");
        assert_eq!(why.reason, "InvalidServiceExport");
        assert!(why.message.contains("exported_labels"), "{}", why.message);
        assert_eq!(
            valid_condition(&Err(why))["status"],
            "False",
            "the ServiceExport says so"
        );
    }
}
