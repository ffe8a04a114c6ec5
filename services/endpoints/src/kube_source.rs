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
//! Deleting the `ServiceExport` or the Service withdraws the export. Each watcher event
//! triggers a pass over the watchers' caches; an export whose content did not change is not
//! written again ([`Endpoints::export`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt as _, stream};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::Api;
use kube::runtime::reflector::reflector as reflect;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use trellis_error::Result;
use trellis_runtime::Shutdown;

use crate::core::Endpoints;
use crate::mcs::ServiceExport;
use crate::model::{MANAGED_BY, MANAGED_BY_LABEL, Port, Protocol, SERVICE_NAME_LABEL};
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

/// The export of Service `service` with `slices` (those of the Service), keeping addresses in
/// `pod_cidr`. `None` when the Service has no port.
pub fn export_of(
    service: &Service,
    slices: &[&EndpointSlice],
    pod_cidr: ipnet::IpNet,
) -> Option<ExportRecord> {
    let namespace = service.metadata.namespace.clone()?;
    let name = service.metadata.name.clone()?;
    let slice_ports: BTreeMap<String, i32> = slices
        .iter()
        .flat_map(|s| s.ports.iter().flatten())
        .filter_map(|p| Some((p.name.clone().unwrap_or_default(), p.port?)))
        .collect();
    let ports: Vec<Port> = service
        .spec
        .as_ref()?
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
        return None;
    }
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
                });
            }
        }
    }
    endpoints.sort_by(|a, b| a.address.cmp(&b.address));
    Some(ExportRecord {
        namespace,
        name,
        ports,
        endpoints,
        update_time_nanos: 0,
        source: ExportSource::Kubernetes,
    })
}

impl Caches {
    /// Every export the caches describe, by (namespace, name).
    pub fn desired(&self, pod_cidr: ipnet::IpNet) -> BTreeMap<(String, String), ExportRecord> {
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
            if let Some(record) = export_of(&service, &own, pod_cidr) {
                out.insert((namespace, name), record);
            }
        }
        out
    }
}

impl Endpoints {
    /// One pass of the Kubernetes export source: every export the caches describe stored
    /// (unchanged ones are not rewritten), every Kubernetes export they no longer describe
    /// removed. Returns how many steps failed.
    pub async fn sync_kube_exports(&self, caches: &Caches) -> Result<usize> {
        let pod_cidr = self.pod_cidr().await?;
        let desired = caches.desired(pod_cidr);
        let mut failed = 0;
        for record in desired.values() {
            if let Err(err) = self.export(record.clone()).await {
                failed += 1;
                tracing::warn!(namespace = %record.namespace, name = %record.name, error = %err, "exporting from a serviceexport failed; retrying on the next pass");
            }
        }
        for held in self.stored_exports().await? {
            if held.source == ExportSource::Kubernetes
                && !desired.contains_key(&(held.namespace.clone(), held.name.clone()))
                && let Err(err) = self
                    .unexport(&held.namespace, &held.name, ExportSource::Kubernetes)
                    .await
            {
                failed += 1;
                tracing::warn!(namespace = %held.namespace, name = %held.name, error = %err, "withdrawing a serviceexport failed; retrying on the next pass");
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
        reflect(w3, watcher(Api::all(client), config()))
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
    loop {
        match core.sync_kube_exports(&caches).await {
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
            () = trellis_runtime::timer::period(resync) => {}
        }
    }
}
