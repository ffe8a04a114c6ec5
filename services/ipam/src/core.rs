//! The IPAM's domain logic over the store. Every operation is a read, a decision, and a
//! transaction that commits only if what was read is unchanged; on conflict it re-reads and
//! decides again. That makes several replicas on one etcd safe without a process-local lock,
//! and a process killed between two steps leaves either the old or the new state.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use trellis_api::net::{Family, ip_to_u128, net_bounds, translate, u128_to_ip};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Compare, KeyValue, Op, SharedStore, Txn};

use crate::alloc::{conflicts, first_free};
use crate::records::{
    CLUSTERS_PREFIX, ClusterRecord, ENDPOINTS_PREFIX, EPOCH_KEY, EXTERNAL_PREFIX, EndpointRecord,
    FreedRecord, LOCAL_KEY, LocalNat, QUARANTINE_PREFIX, QuarantineRecord, RemoteView,
    SUBNETS_PREFIX, cluster_key, decode, encode, endpoint_key, external_key, freed_key, now_nanos,
    quarantine_key,
};
use crate::subnets::{LocalRanges, LocalSubnets};

/// Point reads of candidate external addresses before falling back to one listing.
const MAX_PROBES: u128 = 16;

/// How an endpoint IP was translated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MappingPath {
    /// A local pod, through the target's view of our pod CIDR.
    LocalNat,
    /// A pod of the target itself: its home IP.
    Home,
    /// A third cluster's pod, through our external CIDR.
    External,
}

/// The answer of [`Ipam::map_endpoint_ip`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    pub ip: IpAddr,
    pub path: MappingPath,
}

/// The IPAM of one cluster. Cheap to share behind an `Arc`; holds no state of its own beyond
/// the validated configuration.
#[derive(Debug)]
pub struct Ipam {
    store: SharedStore,
    local: LocalSubnets,
    /// Serializes this replica's range allocations, and holds the ranges they must avoid. The
    /// epoch transaction alone keeps allocations correct, across replicas too, but concurrent
    /// allocators in one process would mostly lose the epoch race to each other and retry
    /// with backoff.
    allocating: tokio::sync::Mutex<Option<Allocated>>,
}

/// The NAT ranges of every mapped cluster as of one epoch revision: what a new allocation
/// must avoid. Every change of them (an allocation, the end of a free) rewrites the epoch key,
/// so while its revision is unchanged this is still the table; a moved epoch (another replica,
/// a free) means one listing to rebuild it. This replica's own allocations update it in
/// place. Without it every new mapping listed and decoded the whole table: O(n) per peer,
/// O(n²) for a cluster joining a mesh of n.
#[derive(Debug)]
struct Allocated {
    epoch_revision: i64,
    nat: std::collections::HashMap<ClusterId, [IpNet; 2]>,
    /// The ranges of freed clusters, by cluster ID, with when they were freed (the epoch
    /// moves with every free, so this too is current while the revision is).
    quarantined: std::collections::HashMap<String, QuarantineRecord>,
}

impl Allocated {
    fn of(snapshot: &Snapshot) -> Self {
        Self {
            epoch_revision: snapshot.epoch_revision,
            nat: snapshot
                .records
                .iter()
                .filter_map(|(r, _)| {
                    r.remote
                        .map(|v| (r.id.clone(), [v.pod_cidr_nat, v.external_cidr_nat]))
                })
                .collect(),
            quarantined: snapshot.quarantined.iter().cloned().collect(),
        }
    }

    /// The ranges still in quarantine (freed less than `quarantine` ago) for a cluster other
    /// than `id`.
    fn quarantined_for(&self, id: &ClusterId, quarantine: std::time::Duration) -> Vec<IpNet> {
        let limit = i64::try_from(quarantine.as_nanos()).unwrap_or(i64::MAX);
        let now = now_nanos();
        self.quarantined
            .iter()
            .filter(|(cluster, q)| {
                cluster.as_str() != id.as_str() && now.saturating_sub(q.freed_nanos) < limit
            })
            .flat_map(|(_, q)| q.ranges.iter().copied())
            .collect()
    }
}

/// A consistent view of the allocation table.
struct Snapshot {
    epoch_revision: i64,
    records: Vec<(ClusterRecord, i64)>,
    /// `(cluster ID, its quarantined ranges)` of freed clusters.
    quarantined: Vec<(String, QuarantineRecord)>,
}

/// Where a pair of ranges could not be found: `(what, the wanted network)`.
type Shortage = (&'static str, IpNet);

fn put(key: impl Into<String>, value: Vec<u8>) -> Op {
    Op::Put {
        key: key.into(),
        value,
        lease: None,
    }
}

fn unchanged(key: impl Into<String>, revision: i64) -> Compare {
    Compare::ModRevision {
        key: key.into(),
        revision,
    }
}

fn translated(ip: IpAddr, from: IpNet, to: IpNet) -> Result<IpAddr> {
    translate(ip, from, to).ok_or_else(|| {
        Error::Internal(format!(
            "cannot translate {ip} from {from} to {to}: sizes differ"
        ))
    })
}

impl Ipam {
    /// Opens the IPAM on `store`. The first replica records the local ranges; later ones must
    /// agree with them, because every mapping depends on them. Frees interrupted by a crash
    /// are finished here.
    pub async fn open(store: SharedStore, local: LocalSubnets) -> Result<Self> {
        let wanted = encode(&local.ranges)?;
        loop {
            if let Some(kv) = store.get(LOCAL_KEY).await? {
                let stored: LocalRanges = decode(LOCAL_KEY, &kv.value)?;
                if stored != local.ranges {
                    return Err(Error::FailedPrecondition(format!(
                        "the store holds pod CIDR {}, service CIDR {}, external CIDR {} for this \
                         cluster, but this process was started with {}, {}, {}; every mapping \
                         depends on them, so they cannot change under an existing store",
                        stored.pod_cidr,
                        fmt_opt(stored.service_cidr),
                        stored.external_cidr,
                        local.ranges.pod_cidr,
                        fmt_opt(local.ranges.service_cidr),
                        local.ranges.external_cidr,
                    )));
                }
                break;
            }
            let created = store
                .txn(Txn {
                    compares: vec![unchanged(LOCAL_KEY, 0)],
                    success: vec![put(LOCAL_KEY, wanted.clone())],
                    failure: vec![],
                })
                .await?;
            if created.succeeded {
                break;
            }
        }
        let ipam = Self {
            store,
            local,
            allocating: tokio::sync::Mutex::new(None),
        };
        ipam.finish_interrupted_frees().await?;
        Ok(ipam)
    }

    /// The local configuration.
    /// The store the IPAM keeps its state in.
    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    pub fn local(&self) -> &LocalSubnets {
        &self.local
    }

    /// The address family every request must use.
    pub fn family(&self) -> Family {
        self.local.family()
    }

    async fn snapshot(&self) -> Result<Snapshot> {
        let listing = self.store.list(SUBNETS_PREFIX).await?;
        let mut snapshot = Snapshot {
            epoch_revision: 0,
            records: Vec::new(),
            quarantined: Vec::new(),
        };
        for kv in listing.kvs {
            if kv.key == EPOCH_KEY {
                snapshot.epoch_revision = kv.mod_revision;
            } else if let Some(cluster) = kv.key.strip_prefix(QUARANTINE_PREFIX) {
                snapshot
                    .quarantined
                    .push((cluster.to_owned(), decode(&kv.key, &kv.value)?));
            } else if kv.key.starts_with(CLUSTERS_PREFIX) {
                snapshot
                    .records
                    .push((decode(&kv.key, &kv.value)?, kv.mod_revision));
            }
        }
        Ok(snapshot)
    }

    async fn record(&self, id: &ClusterId) -> Result<Option<(ClusterRecord, i64)>> {
        let key = cluster_key(id);
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some((decode(&key, &kv.value)?, kv.mod_revision))),
            None => Ok(None),
        }
    }

    /// A record that new mappings may reference.
    async fn live_record(&self, id: &ClusterId) -> Result<(ClusterRecord, i64)> {
        match self.record(id).await? {
            Some((rec, _)) if rec.freeing => {
                Err(Error::NotFound(format!("cluster {id} is being freed")))
            }
            Some(found) => Ok(found),
            None => Err(Error::NotFound(format!("no mapping for cluster {id}"))),
        }
    }

    fn pick(&self, wanted: IpNet, used: &[IpNet]) -> Option<IpNet> {
        if conflicts(wanted, used) {
            first_free(self.family(), wanted.prefix_len(), &self.local.pools, used)
        } else {
            Some(wanted)
        }
    }

    /// Our views of a pod and an external CIDR, clear of `used` and of each other.
    fn pick_pair(
        &self,
        pod_cidr: IpNet,
        external_cidr: IpNet,
        mut used: Vec<IpNet>,
    ) -> std::result::Result<(IpNet, IpNet), Shortage> {
        let pod_cidr_nat = self.pick(pod_cidr, &used).ok_or(("pod CIDR", pod_cidr))?;
        used.push(pod_cidr_nat);
        let external_cidr_nat = self
            .pick(external_cidr, &used)
            .ok_or(("external CIDR", external_cidr))?;
        Ok((pod_cidr_nat, external_cidr_nat))
    }

    /// How we address `cluster`'s pod and external CIDRs: unchanged when free, otherwise the
    /// first free range of the same prefix length in the pools. Idempotent.
    #[tracing::instrument(skip(self, cluster), fields(cluster.id = %cluster.id))]
    pub async fn subnets_for(
        &self,
        cluster: &ClusterIdentity,
        pod_cidr: IpNet,
        external_cidr: IpNet,
    ) -> Result<RemoteView> {
        let id = &cluster.id;
        if conflicts(pod_cidr, &[external_cidr]) {
            return Err(Error::invalid(
                "external_cidr",
                format!("{external_cidr} overlaps pod_cidr {pod_cidr}"),
            ));
        }
        // A cluster we already map (the usual case: every resync asks again) is one point
        // read; anything else takes the allocation path below, which re-reads and decides.
        if let Some((rec, _)) = self.record(id).await?
            && !rec.freeing
            && let Some(view) = rec.remote
            && view.pod_cidr == pod_cidr
            && view.external_cidr == external_cidr
        {
            return Ok(view);
        }
        let mut allocated = self.allocating.lock().await;
        let mut contention = Contention::on(&self.store, "allocating subnets");
        loop {
            let epoch_revision = self
                .store
                .get(EPOCH_KEY)
                .await?
                .map_or(0, |kv| kv.mod_revision);
            let table = match allocated.take() {
                Some(table) if table.epoch_revision == epoch_revision => table,
                _ => Allocated::of(&self.snapshot().await?),
            };
            let table = allocated.insert(table);
            let existing = self.record(id).await?;
            if let Some((rec, _)) = &existing {
                if rec.freeing {
                    return Err(Error::FailedPrecondition(format!(
                        "cluster {id} is being freed; retry when FreeSubnetsPerCluster completes"
                    )));
                }
                if let Some(view) = rec.remote {
                    if view.pod_cidr == pod_cidr && view.external_cidr == external_cidr {
                        return Ok(view);
                    }
                    return Err(Error::FailedPrecondition(format!(
                        "cluster {id} is already mapped for pod CIDR {} and external CIDR {}; \
                         free it (FreeSubnetsPerCluster) before mapping {pod_cidr} and {external_cidr}",
                        view.pod_cidr, view.external_cidr
                    )));
                }
            }

            let mut used = self.local.blocked();
            used.extend(
                table
                    .nat
                    .iter()
                    .filter(|(cluster, _)| *cluster != id)
                    .flat_map(|(_, ranges)| *ranges),
            );
            let exhausted = |what: &str, net: IpNet| {
                Error::ResourceExhausted(format!(
                    "no free /{} left in the pools ({}) for cluster {id}'s {what} {net}",
                    net.prefix_len(),
                    self.local
                        .pools
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            };
            // Ranges of clusters freed a short while ago only when nothing else is free: a
            // full pool must not refuse peers, and a quarantined range is no worse than the
            // reuse it delays.
            let quarantined = table.quarantined_for(id, self.local.quarantine);
            let strict: Vec<IpNet> = used.iter().chain(&quarantined).copied().collect();
            let (pod_cidr_nat, external_cidr_nat) =
                match self.pick_pair(pod_cidr, external_cidr, strict) {
                    Err(_) if !quarantined.is_empty() => {
                        tracing::warn!(
                            cluster.id = %id,
                            quarantined = quarantined.len(),
                            "no free range outside the quarantine of freed clusters: handing out a quarantined one"
                        );
                        self.pick_pair(pod_cidr, external_cidr, used)
                    }
                    picked => picked,
                }
                .map_err(|(what, net)| exhausted(what, net))?;
            let view = RemoteView {
                pod_cidr,
                pod_cidr_nat,
                external_cidr,
                external_cidr_nat,
            };

            let (mut rec, revision) = match existing {
                Some(found) => found,
                None => (ClusterRecord::new(id.clone(), cluster.name.clone()), 0),
            };
            if !cluster.name.is_empty() {
                rec.name.clone_from(&cluster.name);
            }
            rec.remote = Some(view);
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![
                        unchanged(EPOCH_KEY, table.epoch_revision),
                        unchanged(cluster_key(id), revision),
                    ],
                    // A new mapping starts a new peering: the tombstone of an earlier free
                    // goes, so this peering's SetLocalNat is accepted.
                    success: vec![
                        put(cluster_key(id), encode(&rec)?),
                        put(EPOCH_KEY, Vec::new()),
                        Op::delete(freed_key(id)),
                        Op::delete(quarantine_key(id)),
                    ],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                // The transaction's revision is the epoch key's new mod revision.
                table.epoch_revision = committed.revision;
                table
                    .nat
                    .insert(id.clone(), [pod_cidr_nat, external_cidr_nat]);
                table.quarantined.remove(id.as_str());
                tracing::info!(
                    cluster.id = %id,
                    pod_cidr = %pod_cidr,
                    pod_cidr_nat = %pod_cidr_nat,
                    external_cidr = %external_cidr,
                    external_cidr_nat = %external_cidr_nat,
                    remapped = pod_cidr != pod_cidr_nat || external_cidr != external_cidr_nat,
                    "mapped remote subnets"
                );
                return Ok(view);
            }
            contention.lost().await?;
        }
    }

    /// Records how `cluster` addresses us. The ranges must have our prefix lengths: a remap
    /// never changes the size of a network.
    #[tracing::instrument(skip(self, cluster), fields(cluster.id = %cluster.id))]
    pub async fn set_local_nat(
        &self,
        cluster: &ClusterIdentity,
        pod_cidr: IpNet,
        external_cidr: IpNet,
    ) -> Result<()> {
        let ours = &self.local.ranges;
        for (field, theirs, mine) in [
            ("pod_cidr", pod_cidr, ours.pod_cidr),
            ("external_cidr", external_cidr, ours.external_cidr),
        ] {
            if theirs.prefix_len() != mine.prefix_len() {
                return Err(Error::invalid(
                    field,
                    format!(
                        "{theirs} is a /{} but ours ({mine}) is a /{}; a remap keeps the prefix length",
                        theirs.prefix_len(),
                        mine.prefix_len()
                    ),
                ));
            }
        }
        let id = &cluster.id;
        let nat = LocalNat {
            pod_cidr,
            external_cidr,
        };
        let mut contention = Contention::on(&self.store, "recording local NAT");
        loop {
            let (mut rec, revision) = match self.record(id).await? {
                Some((rec, _)) if rec.freeing => {
                    return Err(Error::FailedPrecondition(format!(
                        "cluster {id} is being freed; retry when FreeSubnetsPerCluster completes"
                    )));
                }
                Some(found) => found,
                None => {
                    // Without a record, this is either the first half of a new exchange (their
                    // decision arrived before their NetworkConfig) or a late decision of a
                    // peering already torn down: the tombstone tells them apart.
                    if self.store.get(&freed_key(id)).await?.is_some() {
                        return Err(Error::FailedPrecondition(format!(
                            "cluster {id} was freed (FreeSubnetsPerCluster); a new peering maps \
                             its subnets (GetSubnetsPerCluster) before SetLocalNat"
                        )));
                    }
                    (ClusterRecord::new(id.clone(), cluster.name.clone()), 0)
                }
            };
            let renamed = !cluster.name.is_empty() && rec.name != cluster.name;
            if rec.local_nat == Some(nat) && !renamed {
                return Ok(());
            }
            if renamed {
                rec.name.clone_from(&cluster.name);
            }
            rec.local_nat = Some(nat);
            let mut compares = vec![unchanged(cluster_key(id), revision)];
            if revision == 0 {
                // Creating the record: only while no free has happened since the check above.
                compares.push(Compare::absent(freed_key(id)));
            }
            let committed = self
                .store
                .txn(Txn {
                    compares,
                    success: vec![put(cluster_key(id), encode(&rec)?)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                tracing::info!(cluster.id = %id, local_pod_cidr_nat = %pod_cidr, local_external_cidr_nat = %external_cidr, "recorded how the remote addresses us");
                return Ok(());
            }
            contention.lost().await?;
        }
    }

    /// Forgets `id`: marks the record, releases every endpoint mapping made for it or pointing
    /// into its pod CIDR, then replaces the record by a tombstone ([`FreedRecord`]) and the
    /// ranges we addressed it by are quarantined ([`QuarantineRecord`]). A crash
    /// midway leaves the mark, and the next call (or the next start) finishes. Returns whether
    /// a record existed; the tombstone is left either way, since a decision of the peering
    /// being torn down may still be on its way.
    #[tracing::instrument(skip(self), fields(cluster.id = %id))]
    pub async fn free(&self, id: &ClusterId) -> Result<bool> {
        let freed_nanos = now_nanos();
        let tombstone = encode(&FreedRecord { freed_nanos })?;
        let mut contention = Contention::on(&self.store, "freeing a cluster");
        let (rec, revision) = loop {
            let Some((mut rec, revision)) = self.record(id).await? else {
                let left = self
                    .store
                    .txn(
                        Txn::new()
                            .when(Compare::absent(cluster_key(id)))
                            .then(Op::put(freed_key(id), tombstone.clone())),
                    )
                    .await?;
                if left.succeeded {
                    return Ok(false);
                }
                contention.lost().await?;
                continue;
            };
            if rec.freeing {
                break (rec, revision);
            }
            rec.freeing = true;
            let marked = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(cluster_key(id), revision)],
                    success: vec![put(cluster_key(id), encode(&rec)?)],
                    failure: vec![],
                })
                .await?;
            if marked.succeeded {
                break (rec, marked.revision);
            }
            contention.lost().await?;
        };

        let released = self.release_endpoints_of(&rec).await?;
        // Nobody writes a record marked as freeing, so this compare only guards against a
        // concurrent free that already finished. The epoch moves: the ranges are free again
        // (after their quarantine), and every allocator's table of used ranges
        // ([`Allocated`]) must be read anew.
        let mut success = vec![
            Op::Delete {
                key: cluster_key(id),
            },
            put(freed_key(id), tombstone),
            put(EPOCH_KEY, Vec::new()),
        ];
        if let Some(view) = rec.remote {
            success.push(put(
                quarantine_key(id),
                encode(&QuarantineRecord {
                    freed_nanos,
                    ranges: vec![view.pod_cidr_nat, view.external_cidr_nat],
                })?,
            ));
        }
        self.store
            .txn(Txn {
                compares: vec![unchanged(cluster_key(id), revision)],
                success,
                failure: vec![],
            })
            .await?;
        tracing::info!(cluster.id = %id, endpoints_released = released, "freed cluster subnets");
        Ok(true)
    }

    async fn finish_interrupted_frees(&self) -> Result<()> {
        let snapshot = self.snapshot().await?;
        for (rec, _) in snapshot.records.iter().filter(|(r, _)| r.freeing) {
            tracing::info!(cluster.id = %rec.id, "finishing a free interrupted by a restart");
            self.free(&rec.id).await?;
        }
        Ok(())
    }

    /// Removes `rec`'s cluster from every endpoint mapping; mappings of endpoints that live in
    /// its pod CIDR go entirely, since that range may soon belong to someone else.
    async fn release_endpoints_of(&self, rec: &ClusterRecord) -> Result<usize> {
        let listing = self.store.list(ENDPOINTS_PREFIX).await?;
        let mut released = 0;
        for kv in listing.kvs {
            let mut current = Some(kv);
            let mut contention = Contention::on(&self.store, "releasing endpoint mappings");
            while let Some(kv) = current.take() {
                let mut er: EndpointRecord = decode(&kv.key, &kv.value)?;
                let inside = rec.remote.is_some_and(|v| v.pod_cidr_nat.contains(&er.ip));
                if !inside && !er.clusters.remove(&rec.id) {
                    break;
                }
                let ops = if inside || er.clusters.is_empty() {
                    vec![
                        Op::Delete {
                            key: kv.key.clone(),
                        },
                        Op::Delete {
                            key: external_key(er.external_ip),
                        },
                    ]
                } else {
                    vec![put(kv.key.clone(), encode(&er)?)]
                };
                let committed = self
                    .store
                    .txn(Txn {
                        compares: vec![unchanged(&kv.key, kv.mod_revision)],
                        success: ops,
                        failure: vec![],
                    })
                    .await?;
                if committed.succeeded {
                    released += 1;
                } else {
                    contention.lost().await?;
                    current = self.store.get(&kv.key).await?;
                }
            }
        }
        Ok(released)
    }

    /// Translates an endpoint IP for target `id` (see the proto for the three paths).
    #[tracing::instrument(skip(self), fields(cluster.id = %id))]
    pub async fn map_endpoint_ip(
        &self,
        id: &ClusterId,
        ip: IpAddr,
        induced: bool,
    ) -> Result<Mapped> {
        let local = &self.local.ranges;
        let (rec, _) = self.live_record(id).await?;
        if local.pod_cidr.contains(&ip) {
            let nat = rec.local_nat.ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "cluster {id} has not told us how it addresses our pod CIDR yet (SetLocalNat)"
                ))
            })?;
            let ip = translated(ip, local.pod_cidr, nat.pod_cidr)?;
            return Ok(Mapped {
                ip,
                path: MappingPath::LocalNat,
            });
        }
        if induced {
            return Err(Error::invalid(
                "ip",
                format!(
                    "{ip} is not in the local pod CIDR {}; an induced mapping is answered by the \
                     endpoint's home cluster",
                    local.pod_cidr
                ),
            ));
        }
        if let Some(view) = rec.remote.filter(|v| v.pod_cidr_nat.contains(&ip)) {
            let ip = translated(ip, view.pod_cidr_nat, view.pod_cidr)?;
            return Ok(Mapped {
                ip,
                path: MappingPath::Home,
            });
        }
        let external = self.map_external(id, ip).await?;
        Ok(Mapped {
            ip: external,
            path: MappingPath::External,
        })
    }

    /// The external path: one address of our external CIDR per original IP, shared by all
    /// targets, returned in the target's view of our external CIDR.
    async fn map_external(&self, id: &ClusterId, ip: IpAddr) -> Result<IpAddr> {
        let local = &self.local.ranges;
        let mut contention = Contention::on(&self.store, "mapping an endpoint");
        // After losing a candidate address to another allocator, continue after it.
        let mut hint = None;
        loop {
            let (rec, rec_revision) = self.live_record(id).await?;
            let nat = rec.local_nat.ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "cluster {id} has not told us how it addresses our external CIDR yet (SetLocalNat)"
                ))
            })?;
            let key = endpoint_key(ip);
            let (txn, external_ip, allocated_at) = match self.store.get(&key).await? {
                Some(kv) => {
                    let mut er: EndpointRecord = decode(&key, &kv.value)?;
                    if er.clusters.contains(id) {
                        return translated(er.external_ip, local.external_cidr, nat.external_cidr);
                    }
                    er.clusters.insert(id.clone());
                    let txn = Txn {
                        compares: vec![
                            unchanged(&key, kv.mod_revision),
                            unchanged(cluster_key(id), rec_revision),
                        ],
                        success: vec![put(&key, encode(&er)?)],
                        failure: vec![],
                    };
                    (txn, er.external_ip, None)
                }
                None => {
                    // The owner's record is guarded too: freeing it (which first marks it)
                    // must not race with a new mapping into its range.
                    let (owner_id, owner_revision) = self.owner_of(ip).await?;
                    let (external_ip, offset) = self.next_external(ip, hint).await?;
                    let er = EndpointRecord {
                        ip,
                        external_ip,
                        clusters: BTreeSet::from([id.clone()]),
                    };
                    let txn = Txn {
                        compares: vec![
                            unchanged(&key, 0),
                            unchanged(external_key(external_ip), 0),
                            unchanged(cluster_key(id), rec_revision),
                            unchanged(cluster_key(&owner_id), owner_revision),
                        ],
                        success: vec![
                            put(&key, encode(&er)?),
                            put(external_key(external_ip), ip.to_string().into_bytes()),
                        ],
                        failure: vec![],
                    };
                    (txn, external_ip, Some(offset))
                }
            };
            if self.store.txn(txn).await?.succeeded {
                return translated(external_ip, local.external_cidr, nat.external_cidr);
            }
            match allocated_at {
                // Someone else committed meanwhile (most likely took this very address):
                // retry at once from the next address instead of waiting.
                Some(offset) => {
                    hint = Some(offset + 1);
                    contention.skip()?;
                }
                None => contention.lost().await?,
            }
        }
    }

    /// The live remote cluster whose pod CIDR (as we address it) holds `ip`, with its
    /// record's revision, or `NotFound`.
    async fn owner_of(&self, ip: IpAddr) -> Result<(ClusterId, i64)> {
        self.snapshot()
            .await?
            .records
            .into_iter()
            .find(|(r, _)| !r.freeing && r.remote.is_some_and(|v| v.pod_cidr_nat.contains(&ip)))
            .map(|(r, revision)| (r.id, revision))
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "{ip} is neither in the local pod CIDR {} nor in any remote cluster's pod CIDR",
                    self.local.ranges.pod_cidr
                ))
            })
    }

    /// A free address of our external CIDR for `ip`, and its offset in the usable range.
    /// Probing starts at a hash of `ip` (or at `hint`, after losing an address to another
    /// allocator), so concurrent allocations for different endpoints start far apart and
    /// nothing shared is written besides the reservation itself. After [`MAX_PROBES`] taken
    /// addresses the reservations are listed once to find a free one or prove there is none.
    async fn next_external(&self, ip: IpAddr, hint: Option<u128>) -> Result<(IpAddr, u128)> {
        let external = self.local.ranges.external_cidr;
        let (first, last) = usable_hosts(external);
        let size = last - first + 1;
        let start = hint.unwrap_or_else(|| spread(ip_to_u128(ip))) % size;
        let family = self.family();
        let candidate = |offset: u128| {
            u128_to_ip(family, first + offset)
                .map(|ip| (ip, offset))
                .ok_or_else(|| Error::Internal(format!("offset {offset} outside {external}")))
        };
        for step in 0..MAX_PROBES.min(size) {
            let (address, offset) = candidate((start + step) % size)?;
            if self.store.get(&external_key(address)).await?.is_none() {
                return Ok((address, offset));
            }
        }
        let taken: BTreeSet<u128> = self
            .store
            .list(EXTERNAL_PREFIX)
            .await?
            .kvs
            .iter()
            .filter_map(|kv| kv.key.strip_prefix(EXTERNAL_PREFIX)?.parse::<IpAddr>().ok())
            .map(ip_to_u128)
            .collect();
        let free = (0..size)
            .map(|step| (start + step) % size)
            .find(|offset| !taken.contains(&(first + offset)))
            .ok_or_else(|| {
                Error::ResourceExhausted(format!(
                    "the external CIDR {external} has no free address left ({size} in use)"
                ))
            })?;
        candidate(free)
    }

    /// Releases what [`Ipam::map_endpoint_ip`] allocated for `id`. Returns whether the
    /// external address went back to the pool.
    #[tracing::instrument(skip(self), fields(cluster.id = %id))]
    pub async fn unmap_endpoint_ip(&self, id: &ClusterId, ip: IpAddr) -> Result<bool> {
        let key = endpoint_key(ip);
        let mut contention = Contention::on(&self.store, "unmapping an endpoint");
        loop {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(false);
            };
            let mut er: EndpointRecord = decode(&key, &kv.value)?;
            if !er.clusters.remove(id) {
                return Ok(false);
            }
            let release = er.clusters.is_empty();
            let ops = if release {
                vec![
                    Op::Delete { key: key.clone() },
                    Op::Delete {
                        key: external_key(er.external_ip),
                    },
                ]
            } else {
                vec![put(&key, encode(&er)?)]
            };
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, kv.mod_revision)],
                    success: ops,
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                return Ok(release);
            }
            contention.lost().await?;
        }
    }

    /// The real pod IP behind `ip`, an address in our view of `id`'s pod CIDR.
    pub async fn home_pod_ip(&self, id: &ClusterId, ip: IpAddr) -> Result<IpAddr> {
        let (rec, _) = self.live_record(id).await?;
        let view = rec.remote.ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "the pod CIDR of cluster {id} is not known yet (GetSubnetsPerCluster)"
            ))
        })?;
        if !view.pod_cidr_nat.contains(&ip) {
            return Err(Error::invalid(
                "ip",
                format!(
                    "{ip} is not in cluster {id}'s pod CIDR as we address it ({})",
                    view.pod_cidr_nat
                ),
            ));
        }
        translated(ip, view.pod_cidr_nat, view.pod_cidr)
    }

    /// The remote cluster whose pod CIDR (as we address it) holds `ip`.
    pub async fn cluster_identity(&self, ip: IpAddr) -> Result<Option<ClusterIdentity>> {
        let snapshot = self.snapshot().await?;
        Ok(snapshot
            .records
            .into_iter()
            .map(|(r, _)| r)
            .find(|r| !r.freeing && r.remote.is_some_and(|v| v.pod_cidr_nat.contains(&ip)))
            .map(|r| ClusterIdentity {
                id: r.id,
                name: r.name,
            }))
    }

    /// Whether an induced mapping for `id` can be answered: we know how `id` addresses us.
    pub async fn mapping_exists(&self, id: &ClusterId) -> Result<bool> {
        Ok(
            matches!(self.record(id).await?, Some((rec, _)) if !rec.freeing && rec.local_nat.is_some()),
        )
    }

    /// Every remote cluster's record, by ID.
    pub async fn list_clusters(&self) -> Result<Vec<ClusterRecord>> {
        let mut records: Vec<ClusterRecord> = self
            .snapshot()
            .await?
            .records
            .into_iter()
            .map(|(r, _)| r)
            .collect();
        records.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(records)
    }

    /// Every external-CIDR endpoint mapping, by original IP.
    pub async fn list_endpoint_mappings(&self) -> Result<Vec<EndpointRecord>> {
        let kvs: Vec<KeyValue> = self.store.list(ENDPOINTS_PREFIX).await?.kvs;
        let mut out = kvs
            .iter()
            .map(|kv| decode::<EndpointRecord>(&kv.key, &kv.value))
            .collect::<Result<Vec<_>>>()?;
        out.sort_by_key(|e| ip_to_u128(e.ip));
        Ok(out)
    }
}

/// Scatters an address over the integers (splitmix64 of its folded bits), so that the
/// probe sequences of different endpoints start far apart.
fn spread(value: u128) -> u128 {
    let mut z = (value as u64) ^ ((value >> 64) as u64);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    u128::from(z ^ (z >> 31))
}

/// The addresses of `net` that may be handed out: for IPv4 networks larger than /31, all but
/// the network and broadcast addresses; for IPv6, all but the subnet-router anycast address.
pub(crate) fn usable_hosts(net: IpNet) -> (u128, u128) {
    let (lo, hi) = net_bounds(net);
    match net {
        IpNet::V4(v4) if v4.prefix_len() <= 30 => (lo + 1, hi - 1),
        IpNet::V6(v6) if v6.prefix_len() <= 127 => (lo + 1, hi),
        _ => (lo, hi),
    }
}

fn fmt_opt(net: Option<IpNet>) -> String {
    net.map_or_else(|| "(none)".to_owned(), |n| n.to_string())
}
