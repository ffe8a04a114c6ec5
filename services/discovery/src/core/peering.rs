//! The outcome of a full peering, or its end (UpdatePeering): the peer's own record, and
//! with the end of a networked peering the withdrawal of everything the peer introduced as a
//! hub.

use std::collections::BTreeSet;

use trellis_api::peers::{Condition, PEERED_REASON, UNPEERED_REASON};
use trellis_error::{Error, Result};
use trellis_store::Op;
use trellis_store::retry::Contention;

use super::batch::Batch;
use super::{Discovery, PeeringUpdate, Versioned};
use crate::records::{ForeignClusterRecord, FullPeering, Kind, Source, Status, inbox_key};

impl Discovery {
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
}
