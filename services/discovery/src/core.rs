//! The discovery service's domain logic over the store. Every write is a read, a decision and a
//! transaction guarded by the mod revisions of everything the decision depended on; on conflict
//! it re-reads and decides again. Several replicas on one etcd are therefore safe without a
//! process-local lock, and a process killed between two steps leaves the old or the new state.
//!
//! This file keeps the service's type, its construction and its reads; the writes are cut by
//! what they change, each an `impl Discovery` of its own:
//!
//! - `batch`: the guarded, possibly chunked, transaction every write commits through;
//! - `discovered`: records the mechanisms find and lose, and the deletions that end a record;
//! - `peering`: the outcome of a full peering, or its end (UpdatePeering);
//! - `induced`: received Neighborhoods and the induced records they create and withdraw;
//! - `outbox`: what the Neighborhood sender reads and writes (who to wake, what was
//!   acknowledged).

mod batch;
mod discovered;
mod induced;
mod outbox;
mod peering;

use std::collections::{BTreeMap, BTreeSet};

use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::tls::PeerTls;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{
    Addresses, CLUSTERS_PREFIX, ForeignClusterRecord, IDENTITY_KEY, Kind, LocalIdentity, Neighbor,
    RecordHead, cluster_key, decode, encode,
};

/// A record with the store revision of its last change.
pub type Versioned = (ForeignClusterRecord, i64);

/// What UpdatePeering asks for (validated).
#[derive(Debug, Clone)]
pub struct PeeringUpdate {
    pub identity: ClusterIdentity,
    pub peered: bool,
    pub addresses: Addresses,
    pub outgoing: bool,
    pub incoming: bool,
    pub networking: bool,
    pub reason: String,
    pub message: String,
    /// 0 = unconditional.
    pub expected_revision: i64,
    /// The peer's CA certificate to pin; empty keeps the pinned one (ADR 0014).
    pub ca_certificate: String,
}

/// A received Neighborhood (syntactically validated by the caller).
#[derive(Debug, Clone)]
pub struct ReceivedNeighborhood {
    pub sender: ClusterIdentity,
    pub recipient: ClusterIdentity,
    pub neighbors: Vec<Neighbor>,
    pub generation: i64,
}

/// The answer to a Neighborhood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub applied: bool,
    pub current_generation: i64,
}

/// Every ForeignCluster as of one store revision.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub records: BTreeMap<ClusterId, Versioned>,
    pub revision: i64,
}

/// The discovery service of one cluster. Cheap to share behind an `Arc`; all state is in the
/// store.
#[derive(Debug)]
pub struct Discovery {
    store: SharedStore,
    identity: ClusterIdentity,
    advertised: Addresses,
    /// Whether this cluster takes part in induced peering (introduces its peers to each other
    /// and accepts introductions). Not stored: an operator switch, applied at every start.
    induced: bool,
    /// Mutual TLS towards other clusters' discovery services (ADR 0014), when configured.
    tls: Option<PeerTls>,
    /// The service's registry: calls to other clusters count there (`grpc_client_*`).
    metrics: trellis_runtime::metrics::Metrics,
    /// Serialises, within this process, the writes that touch many induced records at once
    /// (applying a Neighborhood, ending a peering). A large one commits in several chunks
    /// ([`batch::Batch::commit`]); two of them interleaving chunk by chunk could each re-decide
    /// over the other's half. Replicas on one etcd stay correct through the record guards; the
    /// lock only keeps one process from racing itself.
    bulk: tokio::sync::Mutex<()>,
    /// At most this many clusters one hub may introduce (`--max-induced-per-hub`): each
    /// becomes a record here, a NetworkConfig exchange and a tunnel.
    max_induced_per_hub: usize,
    /// Full peers that just sent us a Neighborhood, for the sender ([`Discovery::heard`]).
    heard: std::sync::Mutex<BTreeSet<ClusterId>>,
    heard_wake: tokio::sync::Notify,
}

/// The default of `--max-induced-per-hub`: three quarters of a gateway's default 256 per-peer
/// slots (`--wireguard-ports`), so that one hub's introductions, each a slot and possibly an
/// IPAM remap range, leave the rest to the leaf's full peerings and other hubs (issue 32: at
/// 4096, one hub could take every slot and starve them). A mesh of more than 193 clusters
/// around one hub raises it, with the slots and the IPAM pools.
pub const MAX_INDUCED_PER_HUB: usize = 192;

impl Discovery {
    /// Opens the service on `store`. The first start records the identity; later ones must
    /// agree with it (every peer knows us by it).
    pub async fn open(
        store: SharedStore,
        identity: ClusterIdentity,
        advertised: Addresses,
    ) -> Result<Self> {
        let wanted = LocalIdentity {
            identity: identity.clone(),
        };
        loop {
            if let Some(kv) = store.get(IDENTITY_KEY).await? {
                let stored: LocalIdentity = decode(IDENTITY_KEY, &kv.value)?;
                if stored != wanted {
                    return Err(Error::FailedPrecondition(format!(
                        "the store belongs to cluster {:?} (name {:?}), but this process was \
                         started as {:?} (name {:?}); a cluster's identity never changes, so use \
                         the original flags or another store",
                        stored.identity.id.as_str(),
                        stored.identity.name,
                        identity.id.as_str(),
                        identity.name
                    )));
                }
                break;
            }
            let created = store
                .txn(
                    Txn::new()
                        .when(Compare::absent(IDENTITY_KEY))
                        .then(Op::put(IDENTITY_KEY, encode(&wanted)?)),
                )
                .await?;
            if created.succeeded {
                tracing::info!(cluster.id = %identity.id, "recorded the local cluster identity");
                break;
            }
        }
        Ok(Self {
            store,
            identity,
            advertised,
            induced: true,
            tls: None,
            metrics: trellis_runtime::metrics::Metrics::new(),
            bulk: tokio::sync::Mutex::new(()),
            max_induced_per_hub: MAX_INDUCED_PER_HUB,
            heard: std::sync::Mutex::new(BTreeSet::new()),
            heard_wake: tokio::sync::Notify::new(),
        })
    }

    /// Calls other clusters over mutual TLS with `tls` (ADR 0014): Neighborhoods go to peers'
    /// peer listeners, verified against their pinned CAs.
    #[must_use]
    pub fn with_tls(mut self, tls: Option<PeerTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Counts calls to other clusters in `metrics` (the service's registry).
    pub fn with_metrics(mut self, metrics: &trellis_runtime::metrics::Metrics) -> Self {
        self.metrics = metrics.clone();
        self
    }

    /// The service's registry.
    pub fn metrics(&self) -> &trellis_runtime::metrics::Metrics {
        &self.metrics
    }

    /// The mutual-TLS setup towards other clusters, when configured.
    pub fn tls(&self) -> Option<&PeerTls> {
        self.tls.as_ref()
    }

    /// Switches induced peering off (`--no-induced`): the Neighborhoods this cluster sends
    /// list nobody, and those it receives introduce nobody. Both are still exchanged, so
    /// switching it off on a running mesh withdraws every induced peering built through or
    /// onto this cluster, and switching it back on restores them.
    #[must_use]
    pub fn without_induced_peering(mut self) -> Self {
        self.induced = false;
        self
    }

    /// Caps how many clusters one hub's Neighborhood may introduce.
    #[must_use]
    pub fn with_max_induced_per_hub(mut self, max: usize) -> Self {
        self.max_induced_per_hub = max;
        self
    }

    /// Whether induced peering is enabled on this cluster.
    pub fn induced_peering(&self) -> bool {
        self.induced
    }

    /// This cluster's identity.
    pub fn identity(&self) -> &ClusterIdentity {
        &self.identity
    }

    /// The addresses this cluster advertises.
    pub fn advertised(&self) -> &Addresses {
        &self.advertised
    }

    /// The store, for the watch and the Neighborhood sender.
    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    /// Every record as of one revision.
    pub async fn snapshot(&self) -> Result<Snapshot> {
        let listing = self.store.list(CLUSTERS_PREFIX).await?;
        let mut records = BTreeMap::new();
        for kv in listing.kvs {
            let record: ForeignClusterRecord = decode(&kv.key, &kv.value)?;
            records.insert(record.identity.id.clone(), (record, kv.mod_revision));
        }
        Ok(Snapshot {
            records,
            revision: listing.revision,
        })
    }

    /// [`Self::snapshot`] of the records the neighborhood sender acts on: full peers' and those
    /// `also` names (former peers it owes a withdrawal); every other record is decoded only as
    /// far as its ID and kind. A leaf of an n-leaf hub holds n-1 induced records, and a pass
    /// that decoded them all made its neighborhood sender cost O(n) per change.
    pub async fn sender_snapshot(&self, also: impl Fn(&ClusterId) -> bool) -> Result<Snapshot> {
        let listing = self.store.list(CLUSTERS_PREFIX).await?;
        let mut records = BTreeMap::new();
        for kv in listing.kvs {
            let head: RecordHead = decode(&kv.key, &kv.value)?;
            if head.kind != Kind::Full && !also(&head.identity.id) {
                continue;
            }
            let record: ForeignClusterRecord = decode(&kv.key, &kv.value)?;
            records.insert(record.identity.id.clone(), (record, kv.mod_revision));
        }
        Ok(Snapshot {
            records,
            revision: listing.revision,
        })
    }

    /// One record; NOT_FOUND when unknown.
    pub async fn get(&self, id: &ClusterId) -> Result<Versioned> {
        self.find(id)
            .await?
            .ok_or_else(|| Error::NotFound(format!("no ForeignCluster {:?}", id.as_str())))
    }

    async fn find(&self, id: &ClusterId) -> Result<Option<Versioned>> {
        let key = cluster_key(id);
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some((decode(&key, &kv.value)?, kv.mod_revision))),
            None => Ok(None),
        }
    }

    /// Records of `kind` (all with `None`), ordered by ID, with the snapshot's revision.
    pub async fn list(&self, kind: Option<Kind>) -> Result<(Vec<Versioned>, i64)> {
        let snapshot = self.snapshot().await?;
        let records = snapshot
            .records
            .into_values()
            .filter(|(r, _)| kind.is_none_or(|k| r.kind == k))
            .collect();
        Ok((records, snapshot.revision))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use trellis_store::MemoryStore;

    use super::*;
    use crate::records::Source;

    fn identity(id: &str) -> ClusterIdentity {
        ClusterIdentity::parse("id", id, "name", "").expect("identity")
    }

    #[tokio::test]
    async fn the_sender_snapshot_holds_full_peers_and_those_asked_for_only() {
        let store: SharedStore = Arc::new(MemoryStore::new());
        let core = Discovery::open(store.clone(), identity("me"), Addresses::default())
            .await
            .expect("opens");
        let mut former =
            ForeignClusterRecord::new(identity("former"), Kind::Induced, Source::Neighborhood);
        former.previous_kind = Some(Kind::Full);
        let records = [
            ForeignClusterRecord::new(identity("hub"), Kind::Full, Source::Manual),
            ForeignClusterRecord::new(identity("leaf-1"), Kind::Induced, Source::Neighborhood),
            ForeignClusterRecord::new(identity("leaf-2"), Kind::Induced, Source::Neighborhood),
            former,
        ];
        for record in &records {
            let key = cluster_key(&record.identity.id);
            store
                .put(&key, encode(record).expect("encodes"))
                .await
                .expect("put");
        }
        let leaf_2 = ClusterId::parse("id", "leaf-2").expect("id");
        let snapshot = core
            .sender_snapshot(|id| *id == leaf_2)
            .await
            .expect("snapshot");
        let ids: Vec<&str> = snapshot.records.keys().map(ClusterId::as_str).collect();
        assert_eq!(ids, ["hub", "leaf-2"]);
        let whole = core.snapshot().await.expect("snapshot");
        assert_eq!(whole.revision, snapshot.revision);
        assert_eq!(whole.records.len(), 4);
        // What the records say in full, the snapshot holds in full.
        let hub = ClusterId::parse("id", "hub").expect("id");
        assert_eq!(snapshot.records[&hub].0, whole.records[&hub].0);
        // The sender's watch filter reads the kinds alone.
        for (record, concerns) in records.iter().zip([true, false, false, true]) {
            let head: RecordHead = decode("k", &encode(record).expect("encodes")).expect("decodes");
            assert_eq!(
                head.full_now_or_before(),
                concerns,
                "{}",
                record.identity.id
            );
            assert_eq!(head.identity.id, record.identity.id);
        }
    }
}
