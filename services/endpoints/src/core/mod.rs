//! The endpoints service's domain logic.
//!
//! Source side ([`Endpoints::reflect`], [`Endpoints::unreflect`]): translate every address of a
//! slice for a target cluster as docs/architecture.md describes endpoint reflection,
//! remember which addresses hold an allocation in our external CIDR for that target, and
//! release those that disappear. Target side ([`Endpoints::apply`], [`Endpoints::delete`]):
//! store what a peer reflected to us (generation-checked) and, with Kubernetes access, write it.
//! Store writes are compare-and-swap on the record's own revision, retried on contention.
//!
//! This module keeps the [`Endpoints`] service itself, its construction and what both sides
//! ask of it (the local pod CIDR, whether a cluster is a full peer); the work is cut along
//! what it does:
//!
//! - [`outgoing`]: the source side, recording a reflection per target, delivering it and
//!   withdrawing it;
//! - [`translation`]: translating a slice's addresses for one target (local NAT, target home,
//!   induced through the home cluster's IPAM, hub path);
//! - `release`: giving hub-path allocations back to the local IPAM once no reflection to the
//!   target uses them;
//! - [`reflected`]: the target side, storing the slices peers reflected to us and writing
//!   them into Kubernetes.

use ipnet::IpNet;
use tokio::sync::OnceCell;
use trellis_api::pb::types::{self as tpb, ForeignCluster};
use trellis_api::peers::is_networked_full_peer;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::{Compare, SharedStore};

use crate::kube::KubeWriter;
use crate::remote::Clients;

pub mod outgoing;
pub mod reflected;
mod release;
pub mod translation;

/// Clusterset IPs by imported Service (namespace, name).
pub type ClustersetIps = std::collections::BTreeMap<(String, String), Vec<std::net::IpAddr>>;

/// The endpoints service of one cluster.
#[derive(Debug)]
pub struct Endpoints {
    pub(crate) store: SharedStore,
    local: ClusterIdentity,
    pub(crate) clients: Clients,
    writer: Option<KubeWriter>,
    pod_cidr: OnceCell<IpNet>,
    /// Wakes the export reconciler ([`crate::exports`]) when an export changes.
    pub(crate) exports_changed: tokio::sync::Notify,
    /// Wakes the import side ([`crate::imports`]) when an import changes.
    pub(crate) imports_changed: tokio::sync::Notify,
    /// Counts changes of what the clusterset zone is built from (imports, clusterset IPs):
    /// the DNS zone ([`crate::dns`]) is rebuilt after each.
    pub(crate) zone_changed: tokio::sync::watch::Sender<u64>,
    /// The clusterset IPs of the imports, by (namespace, name), as the Kubernetes import side
    /// last wrote them (the derived Services' cluster IPs); `None` until its first pass, and
    /// always without Kubernetes.
    pub(crate) clusterset_ips: std::sync::Mutex<Option<ClustersetIps>>,
    /// Whether imports are written with unreachable endpoints marked not ready (set when the
    /// whole Kubernetes import side runs, [`crate::imports`]).
    mark_readiness: bool,
}

fn unchanged(key: impl Into<String>, revision: i64) -> Compare {
    Compare::ModRevision {
        key: key.into(),
        revision,
    }
}

fn advertised(fc: &ForeignCluster) -> Option<&tpb::ServiceAddresses> {
    fc.full
        .as_ref()
        .and_then(|f| f.addresses.as_ref())
        .or_else(|| fc.induced.as_ref().and_then(|i| i.addresses.as_ref()))
}

impl Endpoints {
    pub fn new(
        store: SharedStore,
        local: ClusterIdentity,
        clients: Clients,
        writer: Option<KubeWriter>,
    ) -> Self {
        Self {
            store,
            local,
            clients,
            writer,
            pod_cidr: OnceCell::new(),
            exports_changed: tokio::sync::Notify::new(),
            imports_changed: tokio::sync::Notify::new(),
            zone_changed: tokio::sync::watch::Sender::new(0),
            clusterset_ips: std::sync::Mutex::new(None),
            mark_readiness: false,
        }
    }

    /// With the Kubernetes import side: imports are written with the endpoints this cluster
    /// cannot reach marked not ready ([`crate::imports::Reachability`]).
    pub fn with_readiness_marking(mut self) -> Self {
        self.mark_readiness = true;
        self
    }

    /// Wakes the import side and the DNS zone after an import changed.
    pub(crate) fn imports_changed(&self) {
        self.imports_changed.notify_one();
        self.zone_changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Records the clusterset IPs the import side wrote; the zone is rebuilt when they changed.
    pub(crate) fn set_clusterset_ips(&self, ips: ClustersetIps) {
        let changed = match self.clusterset_ips.lock() {
            Ok(mut held) => {
                let changed = held.as_ref() != Some(&ips);
                *held = Some(ips);
                changed
            }
            Err(_) => false,
        };
        if changed {
            self.zone_changed.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// The EndpointSlice writer, with Kubernetes access.
    pub(crate) fn writer(&self) -> Option<&KubeWriter> {
        self.writer.as_ref()
    }

    /// This cluster's identity.
    pub fn local(&self) -> &ClusterIdentity {
        &self.local
    }

    /// The local pod CIDR, asked once from the local IPAM (it cannot change under a store).
    pub(crate) async fn pod_cidr(&self) -> Result<IpNet> {
        self.pod_cidr
            .get_or_try_init(|| self.clients.local_pod_cidr())
            .await
            .copied()
    }

    /// The target's record, required to be a networked full peer.
    async fn full_peer(
        &self,
        id: &ClusterId,
        refusal: fn(String) -> Error,
    ) -> Result<ForeignCluster> {
        match self.clients.foreign_cluster(id).await? {
            Some(fc) if is_networked_full_peer(&fc) => Ok(fc),
            Some(_) => Err(refusal(format!(
                "cluster {id} is not a full peer with networking established"
            ))),
            None => Err(refusal(format!("cluster {id} is not a known peer"))),
        }
    }
}
