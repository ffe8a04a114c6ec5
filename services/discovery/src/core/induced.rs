//! Received Neighborhoods (PublishNeighborhood): the checks only the recipient can make, and
//! the induced records a hub's Neighborhood creates, refreshes and withdraws. Ending a peering
//! withdraws what the peer introduced through the same [`Discovery::withdraw_introduced`].

use std::collections::BTreeSet;

use trellis_api::ClusterId;
use trellis_api::peers::Condition;
use trellis_error::{Error, Result};
use trellis_store::Op;
use trellis_store::retry::Contention;

use super::batch::{Batch, same_content};
use super::{Applied, Discovery, ReceivedNeighborhood, Snapshot};
use crate::records::{
    ForeignClusterRecord, Inbox, InducedPeering, Kind, Neighbor, Source, Status, cluster_key,
    decode, encode, inbox_key,
};

impl Discovery {
    /// Adds to `batch` the withdrawal of every record `origin` introduced and `keep` does not
    /// list: moved to an alternative origin when another hub lists it too, else Withdrawn.
    pub(super) fn withdraw_introduced(
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
}
