//! A remote cluster's ranges, both ways: how we address its pod and external CIDRs
//! ([`Ipam::subnets_for`], remapped from the pools when they conflict) and how it addresses
//! ours ([`Ipam::set_local_nat`]). The allocation table is cached per epoch ([`Allocated`]), so
//! that neither a new mapping nor an external allocation looking for its endpoint's owner
//! lists the whole table. New mappings are decided and committed in passes: the request that
//! gets the allocation lock serves every request waiting with it, in one transaction, so
//! concurrent new peers share one commit instead of queueing for one each.

use std::net::IpAddr;

use ipnet::IpNet;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, Txn};

use super::{Ipam, Snapshot, put, unchanged};
use crate::alloc::{conflicts, first_free};
use crate::records::{
    ClusterRecord, EPOCH_KEY, LocalNat, QuarantineRecord, RemoteView, cluster_key, encode,
    freed_key, now_nanos, quarantine_key,
};

/// The NAT ranges of every mapped cluster as of one epoch revision: what a new allocation
/// must avoid. Every change of them (an allocation, the end of a free) rewrites the epoch key,
/// so while its revision is unchanged this is still the table; a moved epoch (another replica,
/// a free) means one listing to rebuild it. This replica's own allocations update it in
/// place. Without it every new mapping listed and decoded the whole table: O(n) per peer,
/// O(n²) for a cluster joining a mesh of n.
#[derive(Debug)]
pub(super) struct Allocated {
    epoch_revision: i64,
    nat: std::collections::HashMap<ClusterId, [IpNet; 2]>,
    /// The ranges of freed clusters, by cluster ID, with when they were freed (the epoch
    /// moves with every free, so this too is current while the revision is).
    quarantined: std::collections::HashMap<String, QuarantineRecord>,
}

impl Allocated {
    pub(super) fn of(snapshot: &Snapshot) -> Self {
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

    /// The cluster whose pod CIDR, as we address it, holds `ip`, as of this table.
    fn pod_owner(&self, ip: IpAddr) -> Option<&ClusterId> {
        self.nat
            .iter()
            .find(|(_, [pod_cidr_nat, _])| pod_cidr_nat.contains(&ip))
            .map(|(id, _)| id)
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

/// Requests one allocation pass takes at most: four writes each, within one etcd transaction
/// (128 operations by default).
const MAX_PASS: usize = 24;

/// A GetSubnetsPerCluster waiting for an allocation pass ([`Ipam::subnets_for`]).
#[derive(Debug)]
pub(super) struct Wanted {
    cluster: ClusterIdentity,
    pod_cidr: IpNet,
    external_cidr: IpNet,
    answer: tokio::sync::oneshot::Sender<Result<RemoteView>>,
}

/// What a pass decided for one request that needs a commit.
#[derive(Debug)]
struct Planned {
    /// The record to write and the revision it was read at; none for a second request for
    /// the same cluster in one pass, which gets the first one's answer.
    record: Option<(ClusterRecord, i64)>,
    view: RemoteView,
}

/// One request's decision.
#[derive(Debug)]
enum Plan {
    /// Mapped already as asked: the answer, nothing to write.
    Mapped(RemoteView),
    Allocate(Planned),
}

fn already_mapped(
    id: &ClusterId,
    view: &RemoteView,
    pod_cidr: IpNet,
    external_cidr: IpNet,
) -> Error {
    Error::FailedPrecondition(format!(
        "cluster {id} is already mapped for pod CIDR {} and external CIDR {}; \
         free it (FreeSubnetsPerCluster) before mapping {pod_cidr} and {external_cidr}",
        view.pod_cidr, view.external_cidr
    ))
}

/// Where a pair of ranges could not be found: `(what, the wanted network)`.
type Shortage = (&'static str, IpNet);

impl Ipam {
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
        // Allocations are decided and committed in passes: whoever gets the allocation lock
        // takes every request waiting (its own included) and commits them in one transaction.
        // One at a time, 16 concurrent new peers queued behind each other's store round trips
        // (on etcd, each a write to disk): p99 23 ms where a pass of 16 takes one commit.
        let (answer, mut answered) = tokio::sync::oneshot::channel();
        self.wait_for_pass(Wanted {
            cluster: cluster.clone(),
            pod_cidr,
            external_cidr,
            answer,
        });
        loop {
            tokio::select! {
                biased;
                result = &mut answered => match result {
                    Ok(result) => return result,
                    // The pass that took this request was cancelled (its caller left) before
                    // answering: wait for the next one. Whatever it committed is found there.
                    Err(_) => {
                        let (answer, again) = tokio::sync::oneshot::channel();
                        answered = again;
                        self.wait_for_pass(Wanted {
                            cluster: cluster.clone(),
                            pod_cidr,
                            external_cidr,
                            answer,
                        });
                    }
                },
                mut allocated = self.allocating.lock() => {
                    let batch = self.take_waiting();
                    if !batch.is_empty() {
                        self.allocation_pass(&mut allocated, batch).await;
                    }
                }
            }
        }
    }

    /// The cluster the kept allocation table says owns `ip`, when the table is at hand (no
    /// pass is using it). The table may be behind another replica's work: callers check the
    /// owner's record.
    pub(super) fn kept_pod_owner(&self, ip: IpAddr) -> Option<ClusterId> {
        let table = self.allocating.try_lock().ok()?;
        table.as_ref()?.pod_owner(ip).cloned()
    }

    /// Keeps the table a listing has just read, unless the one kept is as new or a pass is
    /// using it: a replica that never allocates still learns its peers' ranges once.
    pub(super) fn keep_table(&self, snapshot: &Snapshot) {
        let Ok(mut table) = self.allocating.try_lock() else {
            return;
        };
        if table
            .as_ref()
            .is_none_or(|kept| kept.epoch_revision < snapshot.epoch_revision)
        {
            *table = Some(Allocated::of(snapshot));
        }
    }

    fn wait_for_pass(&self, wanted: Wanted) {
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(wanted);
    }

    fn take_waiting(&self) -> Vec<Wanted> {
        let mut waiting = self
            .waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = waiting.len().min(MAX_PASS);
        waiting.drain(..n).collect()
    }

    /// Decides and commits `batch` in one transaction (again after a lost race, re-reading
    /// everything), answering each request: with its ranges once committed, or at once with
    /// what it already has or why it cannot have any.
    async fn allocation_pass(&self, allocated: &mut Option<Allocated>, mut batch: Vec<Wanted>) {
        let mut contention = Contention::on(&self.store, "allocating subnets");
        loop {
            let (epoch_revision, planned) = match self.plan_pass(allocated, &mut batch).await {
                Ok(planned) => planned,
                Err(err) => {
                    for wanted in batch {
                        let _ = wanted.answer.send(Err(err.clone()));
                    }
                    return;
                }
            };
            if planned.is_empty() {
                return;
            }
            let committed = match self.commit_pass(epoch_revision, &planned).await {
                Ok(committed) => committed,
                Err(err) => {
                    for (wanted, _) in planned {
                        let _ = wanted.answer.send(Err(err.clone()));
                    }
                    return;
                }
            };
            if let Some(revision) = committed {
                let table = allocated.get_or_insert_with(|| Allocated {
                    epoch_revision: 0,
                    nat: std::collections::HashMap::new(),
                    quarantined: std::collections::HashMap::new(),
                });
                // The transaction's revision is the epoch key's new mod revision.
                table.epoch_revision = revision;
                for (wanted, plan) in planned {
                    let view = plan.view;
                    if let Some(rec) = &plan.record {
                        let id = &rec.0.id;
                        table
                            .nat
                            .insert(id.clone(), [view.pod_cidr_nat, view.external_cidr_nat]);
                        table.quarantined.remove(id.as_str());
                        tracing::info!(
                            cluster.id = %id,
                            pod_cidr = %view.pod_cidr,
                            pod_cidr_nat = %view.pod_cidr_nat,
                            external_cidr = %view.external_cidr,
                            external_cidr_nat = %view.external_cidr_nat,
                            remapped = view.pod_cidr != view.pod_cidr_nat
                                || view.external_cidr != view.external_cidr_nat,
                            "mapped remote subnets"
                        );
                    }
                    let _ = wanted.answer.send(Ok(view));
                }
                return;
            }
            if let Err(err) = contention.lost().await {
                for (wanted, _) in planned {
                    let _ = wanted.answer.send(Err(err.clone()));
                }
                return;
            }
            batch = planned.into_iter().map(|(wanted, _)| wanted).collect();
        }
    }

    /// Decides every request of `batch` against one read of the table: those that need an
    /// allocation come back with it (their ranges clear of the table's and of each other's),
    /// with the epoch revision they were decided at; the others are answered here.
    async fn plan_pass(
        &self,
        allocated: &mut Option<Allocated>,
        batch: &mut Vec<Wanted>,
    ) -> Result<(i64, Vec<(Wanted, Planned)>)> {
        // The epoch and every request's record at once: read one after another, a pass of 24
        // new peers waited 25 store round trips before deciding anything. The commit compares
        // each record's revision and the epoch's, so reads a moment apart decide nothing wrong.
        // A record that cannot be read fails its own request only.
        let records = futures::future::join_all(batch.iter().map(|w| self.record(&w.cluster.id)));
        let (epoch, records) = tokio::join!(self.store.get(EPOCH_KEY), records);
        let epoch_revision = epoch?.map_or(0, |kv| kv.mod_revision);
        let table = match allocated.take() {
            Some(table) if table.epoch_revision == epoch_revision => table,
            _ => Allocated::of(&self.snapshot().await?),
        };
        let table = allocated.insert(table);
        let mut used = self.local.blocked();
        used.extend(table.nat.values().flatten());
        let mut planned: Vec<(Wanted, Planned)> = Vec::new();
        for (wanted, existing) in batch.drain(..).zip(records) {
            let (id, pod_cidr, external_cidr) =
                (&wanted.cluster.id, wanted.pod_cidr, wanted.external_cidr);
            // The same new cluster twice in one pass: one allocation, the same answer.
            let first = planned
                .iter()
                .find(|(w, p)| p.record.is_some() && &w.cluster.id == id)
                .map(|(_, p)| p.view);
            if let Some(view) = first {
                if view.pod_cidr == pod_cidr && view.external_cidr == external_cidr {
                    planned.push((wanted, Planned { record: None, view }));
                } else {
                    let err = already_mapped(id, &view, pod_cidr, external_cidr);
                    let _ = wanted.answer.send(Err(err));
                }
                continue;
            }
            let plan = existing.and_then(|existing| {
                self.plan_one(
                    table,
                    &used,
                    &wanted.cluster,
                    existing,
                    (pod_cidr, external_cidr),
                )
            });
            match plan {
                Ok(Plan::Mapped(view)) => {
                    let _ = wanted.answer.send(Ok(view));
                }
                Ok(Plan::Allocate(plan)) => {
                    used.extend([plan.view.pod_cidr_nat, plan.view.external_cidr_nat]);
                    planned.push((wanted, plan));
                }
                Err(err) => {
                    let _ = wanted.answer.send(Err(err));
                }
            }
        }
        Ok((table.epoch_revision, planned))
    }

    /// One request, with its cluster's record as the pass read it (`existing`), against the
    /// table and the ranges the pass has handed out so far (`used`).
    fn plan_one(
        &self,
        table: &Allocated,
        used: &[IpNet],
        cluster: &ClusterIdentity,
        existing: Option<(ClusterRecord, i64)>,
        (pod_cidr, external_cidr): (IpNet, IpNet),
    ) -> Result<Plan> {
        let id = &cluster.id;
        if let Some((rec, _)) = &existing {
            if rec.freeing {
                return Err(Error::FailedPrecondition(format!(
                    "cluster {id} is being freed; retry when FreeSubnetsPerCluster completes"
                )));
            }
            if let Some(view) = rec.remote {
                if view.pod_cidr == pod_cidr && view.external_cidr == external_cidr {
                    return Ok(Plan::Mapped(view));
                }
                return Err(already_mapped(id, &view, pod_cidr, external_cidr));
            }
        }
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
        // Ranges of clusters freed a short while ago only when nothing else is free: a full
        // pool must not refuse peers, and a quarantined range is no worse than the reuse it
        // delays.
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
                    self.pick_pair(pod_cidr, external_cidr, used.to_vec())
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
        Ok(Plan::Allocate(Planned {
            record: Some((rec, revision)),
            view,
        }))
    }

    /// Commits a pass's allocations in one transaction, if neither the epoch (at
    /// `epoch_revision`) nor any of their records changed meanwhile. Returns the
    /// transaction's revision when it committed.
    async fn commit_pass(
        &self,
        epoch_revision: i64,
        planned: &[(Wanted, Planned)],
    ) -> Result<Option<i64>> {
        let records = planned.iter().filter_map(|(_, p)| p.record.as_ref());
        let mut compares = vec![unchanged(EPOCH_KEY, epoch_revision)];
        let mut success = vec![put(EPOCH_KEY, Vec::new())];
        for (rec, revision) in records {
            let id = &rec.id;
            compares.push(unchanged(cluster_key(id), *revision));
            // A new mapping starts a new peering: the tombstone of an earlier free goes, so
            // this peering's SetLocalNat is accepted.
            success.extend([
                put(cluster_key(id), encode(rec)?),
                Op::delete(freed_key(id)),
                Op::delete(quarantine_key(id)),
            ]);
        }
        let committed = self
            .store
            .txn(Txn {
                compares,
                success,
                failure: vec![],
            })
            .await?;
        Ok(committed.succeeded.then_some(committed.revision))
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
}
