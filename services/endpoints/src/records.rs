//! What the endpoints service keeps in its store, and where. Key layout (below the store's own
//! prefix):
//!
//! | key | value |
//! |---|---|
//! | `reflected/<source_cluster_id>/<namespace>/<name>` | [`ReflectedRecord`]: a slice a peer reflected to us (target side) |
//! | `outgoing/<target_cluster_id>/<namespace>/<name>` | [`OutgoingRecord`]: a slice we reflected to a peer (source side) |
//! | `export/<namespace>/<name>` | [`ExportRecord`]: a Service this cluster exports |
//!
//! Cluster IDs, namespaces (DNS labels) and names (DNS subdomains) never contain '/', so the
//! keys are unambiguous and a prefix listing selects one source or target. Both records are
//! written with compare-and-swap on their own revision.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use trellis_api::{ClusterId, ClusterIdentity};

use crate::model::Slice;

pub const REFLECTED_PREFIX: &str = "reflected/";
pub const OUTGOING_PREFIX: &str = "outgoing/";
pub const EXPORT_PREFIX: &str = "export/";

/// Store key of an exported Service.
pub fn export_key(namespace: &str, name: &str) -> String {
    format!("{EXPORT_PREFIX}{namespace}/{name}")
}

/// Store key of a slice reflected to us.
pub fn reflected_key(source: &ClusterId, namespace: &str, name: &str) -> String {
    format!("{REFLECTED_PREFIX}{source}/{namespace}/{name}")
}

/// Prefix of every slice one source reflected to us.
pub fn reflected_source_prefix(source: &ClusterId) -> String {
    format!("{REFLECTED_PREFIX}{source}/")
}

/// Store key of a slice we reflect to `target`.
pub fn outgoing_key(target: &ClusterId, namespace: &str, name: &str) -> String {
    format!("{OUTGOING_PREFIX}{target}/{namespace}/{name}")
}

/// Prefix of every slice we reflect to `target`.
pub fn outgoing_target_prefix(target: &ClusterId) -> String {
    format!("{OUTGOING_PREFIX}{target}/")
}

/// A slice a peer reflected to us, already translated for us.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReflectedRecord {
    pub source: ClusterIdentity,
    pub slice: Slice,
    pub generation: i64,
    /// The Kubernetes object written for it, when this service has Kubernetes access.
    #[serde(default)]
    pub object_name: Option<String>,
    /// Nanoseconds since the epoch of the last apply.
    pub update_time_nanos: i64,
}

/// A slice we reflect to a target: what must be released when it changes or goes away.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutgoingRecord {
    pub target: ClusterIdentity,
    /// Strictly increasing; sent as ApplyReflectedSlice.generation.
    pub generation: i64,
    /// Original addresses (as we address them) translated through our external CIDR for the
    /// target: each holds an allocation in our IPAM until released.
    pub hub_external: BTreeSet<String>,
    /// Set when the export reconciler made this reflection (the slice of an [`ExportRecord`]):
    /// only those are withdrawn by it when the export or the peer goes away.
    #[serde(default)]
    pub export: bool,
}

/// One endpoint of an exported Service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportedEndpoint {
    /// As this cluster addresses it (inside our pod CIDR).
    pub address: String,
    pub ready: bool,
    /// The pod's hostname (a StatefulSet's), which names it under the clusterset zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

/// Where an export comes from (ADR 0017: Kubernetes wins over gRPC for the same name).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExportSource {
    /// `ExportService` (trellisctl export).
    #[default]
    Grpc,
    /// A `ServiceExport` object and the Service's EndpointSlices ([`crate::kube_source`]).
    Kubernetes,
}

/// A Service this cluster exports to every peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportRecord {
    pub namespace: String,
    pub name: String,
    pub ports: Vec<crate::model::Port>,
    pub endpoints: Vec<ExportedEndpoint>,
    /// Nanoseconds since the epoch of the last export.
    pub update_time_nanos: i64,
    /// Who wrote it; records stored before the Kubernetes source existed are gRPC ones.
    #[serde(default)]
    pub source: ExportSource,
    /// What the Service says beyond its endpoints (type, Service ports, affinity, ...), from a
    /// ServiceExport; `None` for a gRPC export (a ClusterSetIP Service of [`Self::ports`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<crate::model::ExportedService>,
}

pub use trellis_store::record::{decode, encode};
