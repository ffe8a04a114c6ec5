//! What the IPAM keeps in its store, and where. Key layout (below the store's own prefix):
//!
//! | key | value |
//! |---|---|
//! | `local` | [`LocalRanges`](crate::subnets::LocalRanges): the ranges every replica must agree on |
//! | `subnets/epoch` | counter bumped by every change to the allocation table |
//! | `subnets/clusters/<cluster_id>` | [`ClusterRecord`] |
//! | `endpoints/<ip>` | [`EndpointRecord`]: a third-cluster endpoint behind our external CIDR |
//! | `external/<ip>` | the original IP an external address was allocated for (uniqueness) |
//! | `freed/<cluster_id>` | [`FreedRecord`]: the cluster was freed; only a new mapping revives it |
//! | `subnets/quarantine/<cluster_id>` | [`QuarantineRecord`]: the ranges we addressed a freed cluster by, and when |
//!
//! The epoch, the cluster records and the quarantined ranges share the `subnets/` prefix so a
//! single listing is a consistent snapshot of them; an allocation commits only if the epoch it saw is unchanged,
//! which serialises allocations across replicas without a lock.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use trellis_api::ClusterId;

pub const LOCAL_KEY: &str = "local";
pub const SUBNETS_PREFIX: &str = "subnets/";
pub const EPOCH_KEY: &str = "subnets/epoch";
pub const CLUSTERS_PREFIX: &str = "subnets/clusters/";
pub const ENDPOINTS_PREFIX: &str = "endpoints/";
pub const EXTERNAL_PREFIX: &str = "external/";
pub const FREED_PREFIX: &str = "freed/";
pub const QUARANTINE_PREFIX: &str = "subnets/quarantine/";

/// Store key of a cluster's record.
pub fn cluster_key(id: &ClusterId) -> String {
    format!("{CLUSTERS_PREFIX}{id}")
}

/// Store key of an endpoint mapping.
pub fn endpoint_key(ip: IpAddr) -> String {
    format!("{ENDPOINTS_PREFIX}{ip}")
}

/// Store key of an external address reservation.
pub fn external_key(ip: IpAddr) -> String {
    format!("{EXTERNAL_PREFIX}{ip}")
}

/// Store key of the ranges a freed cluster was addressed by.
pub fn quarantine_key(id: &ClusterId) -> String {
    format!("{QUARANTINE_PREFIX}{id}")
}

/// Store key of a freed cluster's tombstone.
pub fn freed_key(id: &ClusterId) -> String {
    format!("{FREED_PREFIX}{id}")
}

/// Left by `FreeSubnetsPerCluster`: a `SetLocalNat` arriving later (a decision of the
/// peering just torn down, racing the teardown) is refused instead of creating a record for
/// a cluster we no longer peer with. `GetSubnetsPerCluster` (a new peering mapping the cluster
/// again) removes it. One small key per cluster ever freed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreedRecord {
    pub freed_nanos: i64,
}

/// Left by `FreeSubnetsPerCluster` with the ranges we addressed the cluster by: no other
/// cluster is given them until the quarantine (`--range-quarantine`) has passed, unless
/// nothing else is free. A new mapping of the same cluster removes it. One small key per
/// cluster ever freed with a mapping.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuarantineRecord {
    pub freed_nanos: i64,
    pub ranges: Vec<IpNet>,
}

/// How we address a remote cluster: its real ranges and our (possibly remapped) view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteView {
    pub pod_cidr: IpNet,
    pub pod_cidr_nat: IpNet,
    pub external_cidr: IpNet,
    pub external_cidr_nat: IpNet,
}

/// How a remote cluster addresses us: its decision, learned from NetworkConfig status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalNat {
    pub pod_cidr: IpNet,
    pub external_cidr: IpNet,
}

/// Everything known about one remote cluster. Either half may be missing: the NetworkConfig
/// exchange completes the two directions in any order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRecord {
    pub id: ClusterId,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub remote: Option<RemoteView>,
    #[serde(default)]
    pub local_nat: Option<LocalNat>,
    /// Set while the record is being freed: no new mapping may reference it, and a restarted
    /// IPAM finishes the job.
    #[serde(default)]
    pub freeing: bool,
}

impl ClusterRecord {
    /// An empty record for a cluster seen for the first time.
    pub fn new(id: ClusterId, name: String) -> Self {
        Self {
            id,
            name,
            remote: None,
            local_nat: None,
            freeing: false,
        }
    }
}

/// A third-cluster endpoint reachable through our external CIDR.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointRecord {
    /// The endpoint as we address it (inside some remote's NAT'ed pod CIDR).
    pub ip: IpAddr,
    /// Its address in our external CIDR.
    pub external_ip: IpAddr,
    /// The clusters it was handed to; the address is released when this empties.
    pub clusters: BTreeSet<ClusterId>,
}

pub use trellis_store::record::{decode, encode, now_nanos};
