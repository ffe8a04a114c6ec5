//! Forgetting a cluster (FreeSubnetsPerCluster) in steps that survive a crash: the record is
//! marked, the endpoint mappings made for it or into its pod CIDR are released, and the record
//! gives way to a tombstone and a quarantine of its ranges. [`Ipam::open`] finishes what a
//! restart interrupted.

use trellis_api::ClusterId;
use trellis_error::Result;
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, Txn};

use super::{Ipam, put, unchanged};
use crate::records::{
    ClusterRecord, ENDPOINTS_PREFIX, EPOCH_KEY, EndpointRecord, FreedRecord, QuarantineRecord,
    cluster_key, decode, encode, external_key, freed_key, now_nanos, quarantine_key,
};

impl Ipam {
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

    pub(super) async fn finish_interrupted_frees(&self) -> Result<()> {
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
}
