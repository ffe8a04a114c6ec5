//! The discovery service's domain logic over the store. Every write is a read, a decision and a
//! transaction guarded by the mod revisions of everything the decision depended on; on conflict
//! it re-reads and decides again. Several replicas on one etcd are therefore safe without a
//! process-local lock, and a process killed between two steps leaves the old or the new state.

use std::collections::{BTreeMap, BTreeSet};

use trellis_api::peers::{Condition, PEERED_REASON, UNPEERED_REASON};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::tls::PeerTls;
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::records::{
    Addresses, CLUSTERS_PREFIX, ForeignClusterRecord, FullPeering, IDENTITY_KEY, Inbox,
    InducedPeering, Kind, LocalIdentity, Mechanism, Neighbor, OUTBOX_PREFIX, Outbox, Source,
    Status, cluster_key, decode, encode, inbox_key, now_nanos, outbox_key, tombstone_key,
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

/// One record's write: the guard on the revision it was read at, and its ops.
type Group = (Vec<Compare>, Vec<Op>);

/// Writes to several records, each guarded by the revision it was read at, plus `guards` that
/// every write depends on (the sender's record, the inbox).
///
/// A batch that fits one transaction commits atomically. A larger one (a Neighborhood with
/// more neighbours than etcd's `--max-txn-ops` allows in one transaction) commits in chunks in
/// order, each chunk under the shared guards, and the `last` writes (the inbox, the peer's own
/// record) in the final chunk: every chunk is idempotent (a re-read skips records already
/// written), and the final one is the commit point that says the whole change is applied.
#[derive(Default)]
struct Batch {
    guards: Vec<Compare>,
    groups: Vec<Group>,
    last: Vec<Group>,
    written: Vec<ClusterId>,
}

impl Batch {
    /// Writes `after` over `before` (read at `revision`, 0 = absent) unless nothing but the
    /// bookkeeping would change.
    fn put(
        &mut self,
        before: Option<&ForeignClusterRecord>,
        revision: i64,
        after: ForeignClusterRecord,
    ) -> Result<()> {
        if let Some(group) = self.put_group(before, revision, after)? {
            self.groups.push(group);
        }
        Ok(())
    }

    /// Like [`Batch::put`], committed in the final chunk.
    fn put_last(
        &mut self,
        before: Option<&ForeignClusterRecord>,
        revision: i64,
        after: ForeignClusterRecord,
    ) -> Result<()> {
        if let Some(group) = self.put_group(before, revision, after)? {
            self.last.push(group);
        }
        Ok(())
    }

    fn put_group(
        &mut self,
        before: Option<&ForeignClusterRecord>,
        revision: i64,
        mut after: ForeignClusterRecord,
    ) -> Result<Option<Group>> {
        if let Some(old) = before
            && same_content(old, &after)
        {
            return Ok(None);
        }
        after.previous_kind = before.map(|b| b.kind);
        after.update_time = now_nanos();
        let key = cluster_key(&after.identity.id);
        self.written.push(after.identity.id.clone());
        Ok(Some((
            vec![Compare::mod_revision(key.clone(), revision)],
            vec![Op::put(key, encode(&after)?)],
        )))
    }

    /// Deletes a record, leaving its last content as a tombstone at the same revision.
    fn delete(&mut self, before: &ForeignClusterRecord, revision: i64) -> Result<()> {
        let key = cluster_key(&before.identity.id);
        self.groups.push((
            vec![Compare::mod_revision(key.clone(), revision)],
            vec![
                Op::delete(key),
                Op::put(tombstone_key(before.identity.id.as_str()), encode(before)?),
            ],
        ));
        Ok(())
    }

    fn guard(&mut self, key: String, revision: i64) {
        self.guards.push(Compare::mod_revision(key, revision));
    }

    /// A write committed in the final chunk (the inbox).
    fn op(&mut self, op: Op) {
        self.last.push((Vec::new(), vec![op]));
    }

    fn is_empty(&self) -> bool {
        self.groups.is_empty() && self.last.is_empty()
    }

    /// Commits; `None` when a guard failed (re-read and decide again: chunks already committed
    /// are then found written and skipped).
    async fn commit(self, store: &SharedStore) -> Result<Option<i64>> {
        let last = |groups: Vec<Group>| {
            groups.into_iter().fold(
                Txn {
                    compares: self.guards.clone(),
                    ..Txn::default()
                },
                |mut txn, (compares, ops)| {
                    txn.compares.extend(compares);
                    txn.success.extend(ops);
                    txn
                },
            )
        };
        let whole = last(self.groups.iter().chain(&self.last).cloned().collect());
        let txns = if whole.oversize().is_none() {
            vec![whole]
        } else {
            let mut txns = Txn::chunks(&self.guards, self.groups).map_err(Error::Internal)?;
            let tail = last(self.last);
            if let Some(why) = tail.oversize() {
                return Err(Error::Internal(format!("final chunk: {why}")));
            }
            txns.push(tail);
            txns
        };
        let chunks = txns.len();
        let mut revision = None;
        for (i, txn) in txns.into_iter().enumerate() {
            let outcome = store.txn(txn).await?;
            if !outcome.succeeded {
                if i > 0 {
                    tracing::debug!(
                        committed = i,
                        chunks,
                        "a chunked write lost a guard midway; re-reading"
                    );
                }
                return Ok(None);
            }
            revision = Some(outcome.revision);
        }
        Ok(revision)
    }
}

/// Equal but for the bookkeeping fields a write refreshes.
fn same_content(a: &ForeignClusterRecord, b: &ForeignClusterRecord) -> bool {
    let strip = |r: &ForeignClusterRecord| {
        let mut r = r.clone();
        r.update_time = 0;
        r.previous_kind = None;
        r
    };
    strip(a) == strip(b)
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
    /// ([`Batch::commit`]); two of them interleaving chunk by chunk could each re-decide over
    /// the other's half. Replicas on one etcd stay correct through the record guards; the lock
    /// only keeps one process from racing itself.
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

    /// Forgets a cluster. Refused while peered, and for induced records their origin still
    /// lists (they belong to the origin's Neighborhood); withdrawn induced records may go.
    pub async fn remove(&self, id: &ClusterId) -> Result<bool> {
        let mut contention = Contention::on(&self.store, "removing a ForeignCluster");
        loop {
            let Some((record, revision)) = self.find(id).await? else {
                return Ok(false);
            };
            if record.is(Condition::Peered) {
                return Err(Error::FailedPrecondition(format!(
                    "cluster {:?} is peered; unpeer it first",
                    id.as_str()
                )));
            }
            if record.kind == Kind::Induced && !record.is(Condition::Withdrawn) {
                let origin = record
                    .induced
                    .as_ref()
                    .map(|i| i.origin.id.to_string())
                    .unwrap_or_default();
                return Err(Error::FailedPrecondition(format!(
                    "cluster {:?} is induced by hub {origin:?}, whose Neighborhood still lists \
                     it; it goes when the hub withdraws it",
                    id.as_str()
                )));
            }
            let mut batch = Batch::default();
            batch.delete(&record, revision)?;
            if batch.commit(&self.store).await?.is_some() {
                tracing::info!(cluster.id = %id, "removed foreign cluster");
                return Ok(true);
            }
            contention.lost().await?;
        }
    }

    /// Deletes the records withdrawn (`Withdrawn=True`, not peered) since at least `retention`
    /// before `now` (nanoseconds since the epoch): what unpeering and Neighborhood updates leave
    /// behind (issue 19). Each deletion is guarded by the revision the record was read at, so a
    /// record revived in the meantime stays; it leaves the usual watch tombstone. Returns the
    /// IDs deleted.
    pub async fn collect_withdrawn(
        &self,
        retention: std::time::Duration,
        now: i64,
    ) -> Result<Vec<ClusterId>> {
        let cutoff = now.saturating_sub(i64::try_from(retention.as_nanos()).unwrap_or(i64::MAX));
        let snapshot = self.snapshot().await?;
        let mut deleted = Vec::new();
        for (id, (record, revision)) in &snapshot.records {
            let Some(withdrawn) = record.condition(Condition::Withdrawn) else {
                continue;
            };
            if withdrawn.status != Status::True
                || record.is(Condition::Peered)
                || withdrawn.last_transition > cutoff
            {
                continue;
            }
            let mut batch = Batch::default();
            batch.delete(record, *revision)?;
            // A lost race means the record changed: the next pass looks at it again.
            if batch.commit(&self.store).await?.is_some() {
                tracing::info!(cluster.id = %id, "collected withdrawn foreign cluster");
                deleted.push(id.clone());
            }
        }
        Ok(deleted)
    }

    /// Records that `mechanism` found `identity` at `address` (its discovery service answered
    /// GetIdentity with `addresses`). Never peers.
    pub async fn discovered(
        &self,
        identity: &ClusterIdentity,
        addresses: &Addresses,
        mechanism: Mechanism,
        address: &str,
    ) -> Result<Versioned> {
        if identity.id == self.identity.id {
            return Err(Error::FailedPrecondition(format!(
                "{address} is this cluster's own discovery service (cluster {:?})",
                identity.id.as_str()
            )));
        }
        let mut contention = Contention::on(&self.store, "recording a discovered cluster");
        loop {
            let found = self.find(&identity.id).await?;
            let (before, revision) = match &found {
                Some((r, rev)) => (Some(r), *rev),
                None => (None, 0),
            };
            let mut after = before.cloned().unwrap_or_else(|| {
                ForeignClusterRecord::new(identity.clone(), Kind::Full, mechanism.source())
            });
            if after.kind == Kind::Induced && after.is(Condition::Withdrawn) {
                // What the record stood for has gone; our own finding makes it a plain full
                // (not peered) record again.
                after.kind = Kind::Full;
                after.induced = None;
                after.conditions.retain(|c| {
                    c.kind != Condition::InducedPeering.as_str()
                        && c.kind != Condition::Withdrawn.as_str()
                });
            }
            if after.kind == Kind::Full {
                let full = after.full.get_or_insert_with(FullPeering::default);
                if !after
                    .conditions
                    .iter()
                    .any(|c| c.kind == Condition::Peered.as_str() && c.status == Status::True)
                {
                    // Before peering, what GetIdentity returned is the best we know.
                    full.addresses = addresses.clone();
                }
            }
            if !identity.name.is_empty() {
                after.identity.name = identity.name.clone();
            }
            after.discovery_address = address.to_owned();
            after.found_by.insert(mechanism);
            after.set_condition(
                Condition::Discovered,
                Status::True,
                "IdentityConfirmed",
                &format!("found by {mechanism:?} at {address}; its discovery service answered"),
            );
            if after.kind == Kind::Full && after.is(Condition::Withdrawn) {
                after.set_condition(
                    Condition::Withdrawn,
                    Status::False,
                    "Rediscovered",
                    "found again",
                );
            }
            let mut batch = Batch::default();
            batch.put(before, revision, after.clone())?;
            if batch.is_empty() {
                return Ok((after, revision));
            }
            if let Some(rev) = batch.commit(&self.store).await? {
                if before.is_none() {
                    tracing::info!(cluster.id = %identity.id, %address, mechanism = ?mechanism, "discovered foreign cluster");
                }
                return Ok((after, rev));
            }
            contention.lost().await?;
        }
    }

    /// Records that `mechanism` no longer finds the clusters it found at addresses outside
    /// `still_found`; a cluster no mechanism finds any more gets Discovered=False.
    pub async fn lost(
        &self,
        mechanism: Mechanism,
        still_found: &BTreeSet<String>,
        reason: &str,
    ) -> Result<Vec<ClusterId>> {
        let mut contention = Contention::on(&self.store, "recording lost clusters");
        loop {
            let snapshot = self.snapshot().await?;
            let mut batch = Batch::default();
            for (record, revision) in snapshot.records.values() {
                if !record.found_by.contains(&mechanism)
                    || still_found.contains(&record.discovery_address)
                {
                    continue;
                }
                let mut after = record.clone();
                after.found_by.remove(&mechanism);
                if after.found_by.is_empty() {
                    after.set_condition(
                        Condition::Discovered,
                        Status::False,
                        reason,
                        &format!("{mechanism:?} no longer finds {}", record.discovery_address),
                    );
                    if after.kind == Kind::Full && !after.is(Condition::Peered) {
                        after.set_condition(
                            Condition::Withdrawn,
                            Status::True,
                            reason,
                            "no longer found",
                        );
                    }
                }
                batch.put(Some(record), *revision, after)?;
            }
            let written = batch.written.clone();
            if batch.is_empty() || batch.commit(&self.store).await?.is_some() {
                for id in &written {
                    tracing::info!(cluster.id = %id, mechanism = ?mechanism, %reason, "foreign cluster no longer found");
                }
                return Ok(written);
            }
            contention.lost().await?;
        }
    }

    /// Records the outcome of a full peering (or its end); see UpdatePeering in the proto.
    pub async fn update_peering(&self, update: &PeeringUpdate) -> Result<Versioned> {
        let id = &update.identity.id;
        if *id == self.identity.id {
            return Err(Error::invalid(
                "identity.cluster_id",
                "is this cluster's own ID; a cluster does not peer with itself",
            ));
        }
        let _bulk = self.bulk.lock().await;
        let mut contention = Contention::on(&self.store, "updating a peering");
        loop {
            let snapshot = self.snapshot().await?;
            let found = snapshot.records.get(id);
            let revision = found.map_or(0, |(_, rev)| *rev);
            if update.expected_revision != 0 && update.expected_revision != revision {
                return Err(Error::Aborted(format!(
                    "ForeignCluster {:?} is at revision {revision}, not the expected {}",
                    id.as_str(),
                    update.expected_revision
                )));
            }
            let before = found.map(|(r, _)| r);
            let reason = if update.reason.is_empty() {
                if update.peered {
                    PEERED_REASON
                } else {
                    UNPEERED_REASON
                }
            } else {
                update.reason.as_str()
            };
            let mut after = match before {
                Some(r) => r.clone(),
                None if update.peered => {
                    ForeignClusterRecord::new(update.identity.clone(), Kind::Full, Source::Peering)
                }
                None => {
                    return Err(Error::NotFound(format!(
                        "no ForeignCluster {:?} to mark unpeered",
                        id.as_str()
                    )));
                }
            };
            if !update.identity.name.is_empty() {
                after.identity.name = update.identity.name.clone();
            }
            let mut batch = Batch::default();
            if update.peered {
                if after.kind == Kind::Induced {
                    after.kind = Kind::Full;
                    after.induced = None;
                    after.set_condition(
                        Condition::InducedPeering,
                        Status::False,
                        "FullPeeringEstablished",
                        "peered directly; no longer induced",
                    );
                }
                let ca_certificate = if update.ca_certificate.is_empty() {
                    after
                        .full
                        .as_ref()
                        .map(|f| f.ca_certificate.clone())
                        .unwrap_or_default()
                } else {
                    update.ca_certificate.clone()
                };
                after.full = Some(FullPeering {
                    outgoing: update.outgoing,
                    incoming: update.incoming,
                    networking: update.networking,
                    addresses: update.addresses.clone(),
                    ca_certificate,
                });
                after.set_condition(Condition::Peered, Status::True, reason, &update.message);
                if after.condition(Condition::Withdrawn).is_some() {
                    after.set_condition(Condition::Withdrawn, Status::False, reason, "peered");
                }
            } else {
                if let Some(full) = after.full.as_mut() {
                    full.outgoing = false;
                    full.incoming = false;
                    full.networking = false;
                    full.ca_certificate.clear();
                }
                after.set_condition(Condition::Peered, Status::False, reason, &update.message);
                if after.found_by.is_empty() {
                    after.set_condition(
                        Condition::Withdrawn,
                        Status::True,
                        reason,
                        "unpeered and no discovery mechanism finds it",
                    );
                }
            }
            let became_hub_source = after.is_networked_full_peer();
            // The peer's own record commits last: if a chunked withdrawal below is cut short,
            // the peering still reads as it was and the caller's retry finishes the work.
            batch.put_last(before, revision, after.clone())?;
            if !became_hub_source {
                // Whatever this cluster introduced as a hub is gone with the peering.
                self.withdraw_introduced(
                    &snapshot,
                    id,
                    &BTreeSet::new(),
                    "OriginUnpeered",
                    &mut batch,
                )?;
                let inbox = inbox_key(id);
                let held = self.store.get(&inbox).await?;
                if let Some(kv) = held {
                    batch.guard(inbox.clone(), kv.mod_revision);
                    batch.op(Op::delete(inbox));
                }
            }
            if batch.is_empty() {
                return Ok((after, revision));
            }
            if let Some(rev) = batch.commit(&self.store).await? {
                tracing::info!(cluster.id = %id, peered = update.peered, networking = update.networking, "peering updated");
                return Ok((after, rev));
            }
            contention.lost().await?;
        }
    }

    /// Adds to `batch` the withdrawal of every record `origin` introduced and `keep` does not
    /// list: moved to an alternative origin when another hub lists it too, else Withdrawn.
    fn withdraw_introduced(
        &self,
        snapshot: &Snapshot,
        origin: &ClusterId,
        keep: &BTreeSet<ClusterId>,
        reason: &str,
        batch: &mut Batch,
    ) -> Result<()> {
        for (id, (record, revision)) in &snapshot.records {
            if keep.contains(id) || record.kind != Kind::Induced {
                continue;
            }
            let Some(induced) = record.induced.as_ref() else {
                continue;
            };
            let mut after = record.clone();
            if induced.origin.id == *origin {
                if record.is(Condition::Withdrawn) {
                    continue;
                }
                let Some(next) = after.induced.as_mut() else {
                    continue;
                };
                if next.alternative_origins.is_empty() {
                    after.set_condition(
                        Condition::InducedPeering,
                        Status::False,
                        reason,
                        &format!("hub {origin} no longer lists it"),
                    );
                    after.set_condition(
                        Condition::Withdrawn,
                        Status::True,
                        reason,
                        &format!("hub {origin} no longer lists it"),
                    );
                    tracing::info!(cluster.id = %id, origin = %origin, %reason, "withdrawing induced cluster");
                } else {
                    next.origin = next.alternative_origins.remove(0);
                    tracing::info!(cluster.id = %id, origin = %next.origin.id, "induced cluster moved to an alternative origin");
                }
            } else if induced.alternative_origins.iter().any(|o| o.id == *origin) {
                if let Some(next) = after.induced.as_mut() {
                    next.alternative_origins.retain(|o| o.id != *origin);
                }
            } else {
                continue;
            }
            batch.put(Some(record), *revision, after)?;
        }
        Ok(())
    }

    /// Checks what only the recipient can check: addressed to us, not listing us.
    fn check_neighborhood(&self, n: &ReceivedNeighborhood) -> Result<()> {
        if n.recipient.id != self.identity.id {
            return Err(Error::invalid(
                "neighborhood.recipient.cluster_id",
                format!(
                    "is {:?} but this is cluster {:?} (misrouted or replayed Neighborhood)",
                    n.recipient.id.as_str(),
                    self.identity.id.as_str()
                ),
            ));
        }
        if n.sender.id == self.identity.id {
            return Err(Error::invalid(
                "neighborhood.sender.cluster_id",
                "is this cluster's own ID",
            ));
        }
        if n.neighbors.len() > self.max_induced_per_hub {
            return Err(Error::invalid(
                "neighborhood.neighbors",
                format!(
                    "lists {} clusters; a hub may introduce at most {} \
                     (--max-induced-per-hub of the recipient)",
                    n.neighbors.len(),
                    self.max_induced_per_hub
                ),
            ));
        }
        let mut seen = BTreeSet::new();
        for (i, neighbor) in n.neighbors.iter().enumerate() {
            let field = format!("neighborhood.neighbors[{i}].identity.cluster_id");
            if neighbor.identity.id == self.identity.id {
                return Err(Error::invalid(
                    field,
                    "names the recipient itself; a Neighborhood lists the sender's other peers",
                ));
            }
            if neighbor.identity.id == n.sender.id {
                return Err(Error::invalid(field, "names the sender itself"));
            }
            if !seen.insert(&neighbor.identity.id) {
                return Err(Error::invalid(
                    field,
                    format!("{:?} is listed twice", neighbor.identity.id.as_str()),
                ));
            }
        }
        if n.generation <= 0 {
            return Err(Error::invalid(
                "neighborhood.generation",
                "must be positive (generations start at 1)",
            ));
        }
        Ok(())
    }

    /// Applies a hub's Neighborhood (PublishNeighborhood): creates, refreshes and withdraws the
    /// induced records it introduced, in one transaction.
    /// Wakes the Neighborhood sender for `peer`, which just sent us a Neighborhood as a full
    /// peer: it has recorded the peering, so what we failed to send it because it had not yet
    /// (our send right after the handshake usually overtakes its own record of us) is
    /// accepted now. Without this the send waited for its backoff, up to
    /// `--neighborhood-retry-max`.
    fn heard_from(&self, peer: &ClusterId) {
        self.heard
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(peer.clone());
        self.heard_wake.notify_one();
    }

    /// Waits until a full peer sent us a Neighborhood, then returns every such peer since the
    /// last call.
    pub async fn heard(&self) -> BTreeSet<ClusterId> {
        loop {
            let heard = std::mem::take(
                &mut *self
                    .heard
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            if !heard.is_empty() {
                return heard;
            }
            self.heard_wake.notified().await;
        }
    }

    pub async fn receive_neighborhood(&self, n: &ReceivedNeighborhood) -> Result<Applied> {
        self.check_neighborhood(n)?;
        let sender = &n.sender.id;
        let _bulk = self.bulk.lock().await;
        let mut contention = Contention::on(&self.store, "applying a Neighborhood");
        loop {
            let snapshot = self.snapshot().await?;
            let Some((sender_record, sender_revision)) = snapshot.records.get(sender) else {
                return Err(Error::PermissionDenied(format!(
                    "cluster {:?} is not a full peer of this cluster; only full peers with \
                     networking enabled may send Neighborhoods",
                    sender.as_str()
                )));
            };
            if !sender_record.is_networked_full_peer() {
                return Err(Error::PermissionDenied(format!(
                    "cluster {:?} is not a full peer with networking enabled; only those may \
                     send Neighborhoods",
                    sender.as_str()
                )));
            }
            self.heard_from(sender);
            let inbox = inbox_key(sender);
            let held = self.store.get(&inbox).await?;
            let (held_generation, inbox_revision) = match &held {
                Some(kv) => (
                    decode::<Inbox>(&inbox, &kv.value)?.generation,
                    kv.mod_revision,
                ),
                None => (0, 0),
            };
            if n.generation < held_generation {
                tracing::info!(origin = %sender, generation = n.generation, held = held_generation, "ignoring a stale neighborhood");
                return Ok(Applied {
                    applied: false,
                    current_generation: held_generation,
                });
            }
            let mut batch = Batch::default();
            batch.guard(cluster_key(sender), *sender_revision);
            batch.guard(inbox.clone(), inbox_revision);
            // With induced peering off, a Neighborhood introduces nobody (and so withdraws
            // whatever an earlier one introduced); its generation is still acknowledged.
            let neighbors: &[Neighbor] = if self.induced { &n.neighbors } else { &[] };
            let listed: BTreeSet<ClusterId> =
                neighbors.iter().map(|x| x.identity.id.clone()).collect();
            for neighbor in neighbors {
                let found = snapshot.records.get(&neighbor.identity.id);
                if let Some(after) = self.introduce(n, neighbor, found.map(|(r, _)| r)) {
                    batch.put(
                        found.map(|(r, _)| r),
                        found.map_or(0, |(_, rev)| *rev),
                        after,
                    )?;
                }
            }
            let reason = if !self.induced {
                "InducedPeeringDisabled"
            } else if n.neighbors.is_empty() {
                "NeighborhoodWithdrawn"
            } else {
                "NeighborDropped"
            };
            self.withdraw_introduced(&snapshot, sender, &listed, reason, &mut batch)?;
            if n.generation != held_generation {
                batch.op(Op::put(
                    inbox,
                    encode(&Inbox {
                        generation: n.generation,
                    })?,
                ));
            }
            if batch.is_empty() {
                return Ok(Applied {
                    applied: true,
                    current_generation: n.generation,
                });
            }
            if batch.commit(&self.store).await?.is_some() {
                tracing::info!(origin = %sender, generation = n.generation, neighbors = n.neighbors.len(), induced = self.induced, "applied neighborhood");
                return Ok(Applied {
                    applied: true,
                    current_generation: n.generation,
                });
            }
            contention.lost().await?;
        }
    }

    /// What a neighbour's record becomes; `None` to leave it alone (a full peer).
    fn introduce(
        &self,
        n: &ReceivedNeighborhood,
        neighbor: &Neighbor,
        found: Option<&ForeignClusterRecord>,
    ) -> Option<ForeignClusterRecord> {
        let induced = InducedPeering {
            origin: n.sender.clone(),
            addresses: neighbor.addresses.clone(),
            generation: n.generation,
            alternative_origins: Vec::new(),
        };
        let message = format!("listed by hub {}", n.sender.id);
        let mut after = match found {
            None => ForeignClusterRecord::new(
                neighbor.identity.clone(),
                Kind::Induced,
                Source::Neighborhood,
            ),
            // A cluster we peer with directly stays full: induced peering is for the others.
            Some(r) if r.kind == Kind::Full && r.is(Condition::Peered) => return None,
            Some(r) => r.clone(),
        };
        match after.induced.as_mut() {
            Some(current)
                if after.kind == Kind::Induced
                    && current.origin.id != n.sender.id
                    && !after.conditions.iter().any(|c| {
                        c.kind == Condition::Withdrawn.as_str() && c.status == Status::True
                    }) =>
            {
                // Another hub introduced it first and still lists it: remember this one as an
                // alternative origin.
                if !current
                    .alternative_origins
                    .iter()
                    .any(|o| o.id == n.sender.id)
                {
                    current.alternative_origins.push(n.sender.clone());
                }
                return Some(after);
            }
            Some(current) if after.kind == Kind::Induced && current.origin.id == n.sender.id => {
                // The generation is not refreshed here: a new generation that changes nothing
                // about this neighbour must not rewrite its record (n records per generation
                // on every leaf); it is set below only when the record changes.
                current.origin = n.sender.clone();
                current.addresses = neighbor.addresses.clone();
            }
            _ => {
                // New, withdrawn, or a full record we only discovered (never peered): the hub's
                // Neighborhood makes it an induced peer.
                after.kind = Kind::Induced;
                after.full = None;
                after.induced = Some(induced);
            }
        }
        if !neighbor.identity.name.is_empty() {
            after.identity.name = neighbor.identity.name.clone();
        }
        after.set_condition(
            Condition::InducedPeering,
            Status::True,
            "NeighborhoodUpdated",
            &message,
        );
        if after.condition(Condition::Withdrawn).is_some() {
            after.set_condition(
                Condition::Withdrawn,
                Status::False,
                "NeighborhoodUpdated",
                &message,
            );
        }
        if found.is_some_and(|old| same_content(old, &after)) {
            return None;
        }
        if let Some(current) = after.induced.as_mut()
            && current.origin.id == n.sender.id
        {
            current.generation = n.generation;
        }
        Some(after)
    }

    /// Every Neighborhood acknowledgement we hold, by peer, with its revision.
    pub async fn outboxes(&self) -> Result<BTreeMap<ClusterId, (Outbox, i64)>> {
        let listing = self.store.list(OUTBOX_PREFIX).await?;
        let mut out = BTreeMap::new();
        for kv in listing.kvs {
            let outbox: Outbox = decode(&kv.key, &kv.value)?;
            out.insert(outbox.peer.id.clone(), (outbox, kv.mod_revision));
        }
        Ok(out)
    }

    /// Records what `peer` acknowledged, if nobody changed it since `revision` (0 = absent).
    pub async fn acknowledge(&self, outbox: &Outbox, revision: i64) -> Result<bool> {
        let key = outbox_key(&outbox.peer.id);
        let outcome = self
            .store
            .txn(
                Txn::new()
                    .when(Compare::mod_revision(key.clone(), revision))
                    .then(Op::put(key, encode(outbox)?)),
            )
            .await?;
        Ok(outcome.succeeded)
    }

    /// Forgets what `peer` acknowledged (it is no longer a networked full peer and has been
    /// told, or cannot be told any more).
    pub async fn forget_outbox(&self, peer: &ClusterId, revision: i64) -> Result<bool> {
        let key = outbox_key(peer);
        let outcome = self
            .store
            .txn(
                Txn::new()
                    .when(Compare::mod_revision(key.clone(), revision))
                    .then(Op::delete(key)),
            )
            .await?;
        Ok(outcome.succeeded)
    }
}
