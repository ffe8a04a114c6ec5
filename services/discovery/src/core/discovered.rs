//! The records discovery mechanisms create and let go of: a cluster found
//! ([`Discovery::discovered`]) or no longer found ([`Discovery::lost`]), and the deletions that
//! end a record, an operator's ([`Discovery::remove`]) or the collection of withdrawn ones
//! ([`Discovery::collect_withdrawn`]).

use std::collections::BTreeSet;

use trellis_api::peers::Condition;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;

use super::batch::Batch;
use super::{Discovery, Versioned};
use crate::records::{Addresses, ForeignClusterRecord, FullPeering, Kind, Mechanism, Status};

impl Discovery {
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
}
