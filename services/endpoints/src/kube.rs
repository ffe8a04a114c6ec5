//! Writes slices reflected to us into Kubernetes as `discovery.k8s.io/v1` EndpointSlices,
//! through kube (ADR 0011).
//!
//! Every object we write carries `endpointslice.kubernetes.io/managed-by: trellis.io` (so the
//! EndpointSlice controller leaves it alone), `kubernetes.io/service-name` (so kube-proxy and
//! DNS attach it to the reflected Service), and annotations naming the source cluster and the
//! source slice. An object is ours only when all of those match: anything else with the same
//! name is never modified or deleted. Writes are read-then-write with the read's
//! resourceVersion as precondition, retried when another writer got in between.

use std::collections::BTreeMap;

use k8s_openapi::api::discovery::v1 as k8s;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;

use crate::model::{MANAGED_BY, MANAGED_BY_LABEL, SERVICE_NAME_LABEL, Slice, is_label_value};

/// Label with the source cluster's ID (when the ID is a valid label value), for selection.
pub const SOURCE_CLUSTER_LABEL: &str = "trellis.io/source-cluster-id";
/// Annotation with the source cluster's ID (always set; the ownership check reads it).
pub const SOURCE_CLUSTER_ANNOTATION: &str = "trellis.io/source-cluster-id";
/// Annotation with the source cluster's name.
pub const SOURCE_CLUSTER_NAME_ANNOTATION: &str = "trellis.io/source-cluster-name";
/// Annotation with the source slice as `namespace/name`.
pub const SOURCE_SLICE_ANNOTATION: &str = "trellis.io/source-slice";

/// Longest Kubernetes object name.
const MAX_NAME: usize = 253;

/// Budget of one apply or delete (a few API calls): a hung API server fails the RPC with
/// UNAVAILABLE instead of holding it forever.
const OPERATION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

async fn bounded<T>(what: &str, work: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(OPERATION_TIMEOUT, work)
        .await
        .unwrap_or_else(|_| {
            Err(Error::Unavailable(format!(
                "{what}: kubernetes API did not answer within {} s",
                OPERATION_TIMEOUT.as_secs()
            )))
        })
}

/// Writes reflected EndpointSlices with one kube client.
#[derive(Clone)]
pub struct KubeWriter {
    client: kube::Client,
}

impl std::fmt::Debug for KubeWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeWriter").finish_non_exhaustive()
    }
}

/// FNV-1a: a stable short hash that keeps derived names unique after sanitising and truncation.
fn fnv1a(parts: &[&str]) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for part in parts {
        for byte in part.bytes().chain([0]) {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(0x0100_0193);
        }
    }
    hash
}

/// The selector-less Service Trellis derives for the import of `namespace/service` (ADR 0019):
/// `derived-<10 hex of FNV-1a 64 of "namespace/service">`, the convention of MCS
/// implementations that derive a Service per ServiceImport. It is never the exported
/// Service's own name (nor any name a user is likely to give, such as `trellis-ipam`), and the
/// writer only ever touches a Service of that name that carries Trellis' ownership annotation.
pub fn derived_service_name(namespace: &str, service: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in namespace.bytes().chain([b'/']).chain(service.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("derived-{:010x}", hash >> 24)
}

/// The name of the object written for `source`'s slice `name`:
/// `trellis-<source id, sanitised>-<name>-<hash>`, at most 253 characters, a valid DNS
/// subdomain. The hash covers the unsanitised source ID and name, so two sources never share
/// an object.
pub fn object_name(source: &ClusterId, name: &str) -> String {
    let src: String = source
        .as_str()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let src = src.trim_matches('-');
    let hash = format!("{:08x}", fnv1a(&[source.as_str(), name]));
    let mut base = format!("trellis-{src}-{name}");
    base.truncate(MAX_NAME - hash.len() - 1);
    let base = base.trim_end_matches(['-', '.']);
    format!("{base}-{hash}")
}

/// The object Trellis writes for `slice` from `source`.
pub fn desired_object(source: &ClusterIdentity, slice: &Slice) -> k8s::EndpointSlice {
    let mut labels: BTreeMap<String, String> = slice.labels.clone();
    labels.insert(MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned());
    // Attached to the Service Trellis derived for the import, never to a local Service of the
    // exported name: a peer can only add endpoints to what Trellis created for it.
    labels.insert(
        SERVICE_NAME_LABEL.to_owned(),
        derived_service_name(&slice.namespace, &slice.service_name),
    );
    labels.insert(
        crate::mcs::IMPORTED_SERVICE_LABEL.to_owned(),
        slice.service_name.clone(),
    );
    if is_label_value(source.id.as_str()) {
        labels.insert(SOURCE_CLUSTER_LABEL.to_owned(), source.id.to_string());
    }
    let mut annotations = BTreeMap::from([
        (SOURCE_CLUSTER_ANNOTATION.to_owned(), source.id.to_string()),
        (
            SOURCE_SLICE_ANNOTATION.to_owned(),
            format!("{}/{}", slice.namespace, slice.name),
        ),
    ]);
    if !source.name.is_empty() {
        annotations.insert(
            SOURCE_CLUSTER_NAME_ANNOTATION.to_owned(),
            source.name.clone(),
        );
    }
    k8s::EndpointSlice {
        metadata: ObjectMeta {
            name: Some(object_name(&source.id, &slice.name)),
            namespace: Some(slice.namespace.clone()),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        address_type: slice.address_type.as_k8s().to_owned(),
        endpoints: Some(
            slice
                .endpoints
                .iter()
                .map(|e| k8s::Endpoint {
                    addresses: e.addresses.clone(),
                    conditions: Some(k8s::EndpointConditions {
                        ready: e.conditions.ready,
                        serving: e.conditions.serving,
                        terminating: e.conditions.terminating,
                    }),
                    hostname: e.hostname.clone(),
                    // The node is one of the source cluster's: naming it here would point the
                    // target's topology logic at a node it does not have.
                    node_name: None,
                    zone: e.zone.clone(),
                    ..k8s::Endpoint::default()
                })
                .collect(),
        ),
        ports: if slice.ports.is_empty() {
            None
        } else {
            Some(
                slice
                    .ports
                    .iter()
                    .map(|p| k8s::EndpointPort {
                        name: p.name.clone(),
                        port: p.port,
                        protocol: Some(p.protocol.as_k8s().to_owned()),
                        app_protocol: p.app_protocol.clone(),
                    })
                    .collect(),
            )
        },
    }
}

/// Whether `object` is the one Trellis wrote for `source`'s slice `namespace/name`.
fn is_ours(object: &k8s::EndpointSlice, source: &ClusterId, namespace: &str, name: &str) -> bool {
    let label = |k: &str| {
        object
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(k))
            .map(String::as_str)
    };
    let annotation = |k: &str| {
        object
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(k))
            .map(String::as_str)
    };
    label(MANAGED_BY_LABEL) == Some(MANAGED_BY)
        && annotation(SOURCE_CLUSTER_ANNOTATION) == Some(source.as_str())
        && annotation(SOURCE_SLICE_ANNOTATION) == Some(&format!("{namespace}/{name}"))
}

/// Whether `existing` already says what `desired` says (then nothing is written).
fn up_to_date(existing: &k8s::EndpointSlice, desired: &k8s::EndpointSlice) -> bool {
    let annotations_held = desired.metadata.annotations.iter().flatten().all(|(k, v)| {
        existing
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(k))
            == Some(v)
    });
    existing.address_type == desired.address_type
        && existing.endpoints.as_deref().unwrap_or_default()
            == desired.endpoints.as_deref().unwrap_or_default()
        && existing.ports.as_deref().unwrap_or_default()
            == desired.ports.as_deref().unwrap_or_default()
        && existing.metadata.labels == desired.metadata.labels
        && annotations_held
}

fn kube_error(what: &str, err: kube::Error) -> Error {
    match err {
        kube::Error::Api(status) => match status.code {
            404 => Error::NotFound(format!("{what}: {}", status.message)),
            409 => Error::Aborted(format!("{what}: {}", status.message)),
            // We validated the slice; the API server refusing it is our bug.
            400 | 422 => Error::Internal(format!(
                "{what}: kubernetes refused the object: {}",
                status.message
            )),
            _ => Error::Unavailable(format!(
                "{what}: kubernetes API answered {} {}: {}",
                status.code, status.reason, status.message
            )),
        },
        other => Error::Unavailable(format!("{what}: kubernetes API unreachable: {other}")),
    }
}

fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 409)
}

fn is_not_found(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == 404)
}

impl KubeWriter {
    /// A writer using `client` (a real cluster's, or a mock service in tests).
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }

    /// A writer with the in-cluster service account or `KUBECONFIG`.
    pub async fn infer() -> anyhow::Result<Self> {
        Ok(Self::new(kube::Client::try_default().await?))
    }

    fn api(&self, namespace: &str) -> Api<k8s::EndpointSlice> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// Creates or updates the object for `source`'s `slice`; returns its name. Refuses with
    /// `AlreadyExists` when an object of that name exists and is not ours.
    pub async fn apply(&self, source: &ClusterIdentity, slice: &Slice) -> Result<String> {
        bounded(
            "writing an endpointslice",
            self.apply_unbounded(source, slice),
        )
        .await
    }

    async fn apply_unbounded(&self, source: &ClusterIdentity, slice: &Slice) -> Result<String> {
        let desired = desired_object(source, slice);
        let name = object_name(&source.id, &slice.name);
        let api = self.api(&slice.namespace);
        let what = format!("endpointslice {}/{name}", slice.namespace);
        let mut contention = Contention::elsewhere("writing an endpointslice");
        loop {
            let existing = api.get_opt(&name).await.map_err(|e| kube_error(&what, e))?;
            let written = match existing {
                None => api
                    .create(&PostParams::default(), &desired)
                    .await
                    .map(|_| "created"),
                Some(existing) => {
                    if !is_ours(&existing, &source.id, &slice.namespace, &slice.name) {
                        return Err(Error::AlreadyExists(format!(
                            "{what} exists and is not managed by Trellis for cluster {}; left untouched",
                            source.id
                        )));
                    }
                    if up_to_date(&existing, &desired) {
                        return Ok(name);
                    }
                    if existing.address_type != desired.address_type {
                        // addressType is immutable: replace the object.
                        self.delete_exact(&api, &name, &existing)
                            .await
                            .map_err(|e| kube_error(&what, e))?;
                        api.create(&PostParams::default(), &desired)
                            .await
                            .map(|_| "recreated")
                    } else {
                        let mut update = desired.clone();
                        update.metadata.resource_version =
                            existing.metadata.resource_version.clone();
                        api.replace(&name, &PostParams::default(), &update)
                            .await
                            .map(|_| "updated")
                    }
                }
            };
            match written {
                Ok(how) => {
                    tracing::info!(namespace = %slice.namespace, object = %name, how, "wrote endpointslice");
                    return Ok(name);
                }
                // Someone changed or created it meanwhile: read again and decide again.
                Err(e) if is_conflict(&e) || is_not_found(&e) => contention.lost().await?,
                Err(e) => return Err(kube_error(&what, e)),
            }
        }
    }

    async fn delete_exact(
        &self,
        api: &Api<k8s::EndpointSlice>,
        name: &str,
        existing: &k8s::EndpointSlice,
    ) -> std::result::Result<(), kube::Error> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: existing.metadata.resource_version.clone(),
                uid: existing.metadata.uid.clone(),
            }),
            ..DeleteParams::default()
        };
        api.delete(name, &params).await.map(|_| ())
    }

    /// Deletes the object for `source`'s slice `namespace/name` if it exists and is ours.
    /// Returns whether an object was deleted.
    pub async fn delete(
        &self,
        source: &ClusterIdentity,
        namespace: &str,
        name: &str,
    ) -> Result<bool> {
        bounded(
            "deleting an endpointslice",
            self.delete_unbounded(source, namespace, name),
        )
        .await
    }

    async fn delete_unbounded(
        &self,
        source: &ClusterIdentity,
        namespace: &str,
        name: &str,
    ) -> Result<bool> {
        let object = object_name(&source.id, name);
        let api = self.api(namespace);
        let what = format!("endpointslice {namespace}/{object}");
        let mut contention = Contention::elsewhere("deleting an endpointslice");
        loop {
            let Some(existing) = api
                .get_opt(&object)
                .await
                .map_err(|e| kube_error(&what, e))?
            else {
                return Ok(false);
            };
            if !is_ours(&existing, &source.id, namespace, name) {
                tracing::warn!(namespace, object = %object, "endpointslice is not managed by trellis for this source; left untouched");
                return Ok(false);
            }
            match self.delete_exact(&api, &object, &existing).await {
                Ok(()) => {
                    tracing::info!(namespace, object = %object, "deleted endpointslice");
                    return Ok(true);
                }
                Err(e) if is_not_found(&e) => return Ok(false),
                Err(e) if is_conflict(&e) => contention.lost().await?,
                Err(e) => return Err(kube_error(&what, e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names_are_valid_unique_and_bounded() {
        let a = ClusterId::parse("c", "Leaf_A").expect("id");
        let a2 = ClusterId::parse("c", "leaf-a").expect("id");
        let n = object_name(&a, "web-abc12");
        assert!(n.starts_with("trellis-leaf-a-web-abc12-"), "{n}");
        assert_ne!(n, object_name(&a2, "web-abc12"));
        let long = "x".repeat(253);
        let n = object_name(&a, &long);
        assert!(n.len() <= 253, "{}", n.len());
        assert!(crate::model::dns_subdomain("n", &n).is_ok());
    }
}
