//! The source side: reflecting a slice to a target records the reflection (which addresses
//! hold a hub-path allocation for that target, and its generation) before delivering it, so a
//! resend or a withdrawal knows what it holds; withdrawing it releases what it no longer
//! uses. Generations only grow, and a target holding a higher one gets ours renumbered above
//! it, so a reflection recorded again from nothing is never taken for a stale one.

use std::collections::BTreeSet;

use trellis_api::pb::types::ForeignCluster;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Op, Txn};

use super::reflected::Applied;
use super::translation::{Path, Translation};
use super::{Endpoints, advertised, unchanged};
use crate::model::Slice;
use crate::records::{OUTGOING_PREFIX, OutgoingRecord, decode, encode, outgoing_key};

/// The answer of [`Endpoints::reflect`].
#[derive(Debug, Clone)]
pub struct Reflected {
    pub slice: Slice,
    pub translations: Vec<Translation>,
    pub generation: i64,
    pub delivered: bool,
}

/// The answer of [`Endpoints::unreflect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unreflected {
    pub unreflected: bool,
    pub released: u32,
    pub delivered: bool,
}

/// The generation of a new version of a reflection: above the previous one and at least the
/// wall clock in milliseconds, like the broker's NetworkConfig generations (ADR 0012). A
/// reflection recorded again from nothing (the exporter's or hub's endpoints store lost, the
/// reflection withdrawn and made again) thus starts above every generation a consumer still
/// holds from before, as long as the clock did not step back by more than the time between the
/// two; [`Endpoints::reflect_as`] renumbers above what the consumer holds when it did.
pub(crate) fn next_generation(previous: Option<i64>) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2));
    previous.map_or(1, |p| p.saturating_add(1)).max(now)
}

impl Endpoints {
    /// Translates `slice` for `target` and records the reflection; with `deliver`, pushes it
    /// to the target's endpoints service.
    #[tracing::instrument(skip(self, slice), fields(target.id = %target.id, slice.namespace = %slice.namespace, slice.name = %slice.name))]
    pub async fn reflect(
        &self,
        target: &ClusterIdentity,
        slice: Slice,
        deliver: bool,
    ) -> Result<Reflected> {
        self.reflect_as(target, slice, deliver, None).await
    }

    /// [`Self::reflect`] for the export reconciler, which owns the reflection: with `home`, every
    /// address must run in that cluster (an export carries only its exporter's endpoints; a
    /// peer cannot have us pass on addresses of another cluster, ours included).
    pub(crate) async fn reflect_as(
        &self,
        target: &ClusterIdentity,
        slice: Slice,
        deliver: bool,
        home: Option<&ClusterId>,
    ) -> Result<Reflected> {
        let export = home.is_some();
        if target.id == self.local.id {
            return Err(Error::invalid(
                "target.cluster_id",
                "is this cluster; a slice is reflected to a peer",
            ));
        }
        let peer = self
            .full_peer(&target.id, Error::FailedPrecondition)
            .await?;
        let key = outgoing_key(&target.id, &slice.namespace, &slice.name);
        let mut contention = Contention::on(&self.store, "recording a reflection");
        let (reflected, released) = loop {
            let previous = match self.store.get(&key).await? {
                Some(kv) => Some((decode::<OutgoingRecord>(&key, &kv.value)?, kv.mod_revision)),
                None => None,
            };
            let (translated, translations) = self.translate(target, &slice).await?;
            if let Some(home) = home
                && let Some(t) = translations
                    .iter()
                    .find(|t| t.home.as_ref().is_none_or(|h| h.id != *home))
            {
                return Err(Error::PermissionDenied(format!(
                    "{} does not run in cluster {home}, whose export this is",
                    t.original
                )));
            }
            let hub_external: BTreeSet<String> = translations
                .iter()
                .filter(|t| t.path == Path::HubExternal)
                .map(|t| t.original.clone())
                .collect();
            let (generation, revision, dropped) = match &previous {
                Some((rec, revision)) => (
                    next_generation(Some(rec.generation)),
                    *revision,
                    rec.hub_external
                        .difference(&hub_external)
                        .cloned()
                        .collect(),
                ),
                None => (next_generation(None), 0, Vec::new()),
            };
            let record = OutgoingRecord {
                target: target.clone(),
                generation,
                hub_external,
                export,
            };
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, revision)],
                    success: vec![Op::put(&key, encode(&record)?)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                break (
                    Reflected {
                        slice: translated,
                        translations,
                        generation,
                        delivered: false,
                    },
                    dropped,
                );
            }
            contention.lost().await?;
        };
        let released = self.release(&target.id, &key, released).await?;
        tracing::info!(
            generation = reflected.generation,
            addresses = reflected.translations.len(),
            released,
            "reflected endpoint slice"
        );
        let mut reflected = reflected;
        if deliver {
            let mut answer = self
                .deliver_apply(&target.id, &peer, &reflected.slice, reflected.generation)
                .await?;
            if !answer.applied {
                // The target holds a higher generation of this slice: ours started again below
                // it (our store lost while the clock is behind the one that numbered the
                // target's copy). Renumber above it and deliver once more.
                tracing::warn!(
                    held = answer.held,
                    offered = reflected.generation,
                    "target holds a higher generation of the slice; renumbering above it"
                );
                reflected.generation = self.renumber(&key, answer.held).await?;
                answer = self
                    .deliver_apply(&target.id, &peer, &reflected.slice, reflected.generation)
                    .await?;
            }
            if !answer.applied {
                return Err(Error::Aborted(format!(
                    "cluster {} holds generation {} of {}/{}, above ours {}, after renumbering",
                    target.id,
                    answer.held,
                    reflected.slice.namespace,
                    reflected.slice.name,
                    reflected.generation
                )));
            }
            reflected.delivered = true;
        }
        Ok(reflected)
    }

    /// Delivers an earlier translation of a reflection again, unchanged and with the same
    /// generation (the export reconciler's resend): a target that still holds it answers
    /// without writing anything; one that lost it stores it again. `applied = false` when the
    /// target holds a higher generation (then reflect again, which renumbers).
    pub(crate) async fn redeliver(
        &self,
        target: &ClusterIdentity,
        translated: &Slice,
        generation: i64,
    ) -> Result<Applied> {
        let peer = self
            .full_peer(&target.id, Error::FailedPrecondition)
            .await?;
        self.deliver_apply(&target.id, &peer, translated, generation)
            .await
    }

    /// Moves the generation of the reflection at `key` above `held` (what the target holds);
    /// returns the new generation.
    async fn renumber(&self, key: &str, held: i64) -> Result<i64> {
        let mut contention = Contention::on(&self.store, "renumbering a reflection");
        loop {
            let Some(kv) = self.store.get(key).await? else {
                return Err(Error::Aborted(format!(
                    "reflection {key} was withdrawn while it was being delivered"
                )));
            };
            let mut record: OutgoingRecord = decode(key, &kv.value)?;
            record.generation = next_generation(Some(record.generation.max(held)));
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(key, kv.mod_revision)],
                    success: vec![Op::put(key, encode(&record)?)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                return Ok(record.generation);
            }
            contention.lost().await?;
        }
    }

    /// Stops reflecting `namespace/name` to `target`.
    #[tracing::instrument(skip(self), fields(target.id = %target.id))]
    pub async fn unreflect(
        &self,
        target: &ClusterIdentity,
        namespace: &str,
        name: &str,
        deliver: bool,
    ) -> Result<Unreflected> {
        let key = outgoing_key(&target.id, namespace, name);
        let mut contention = Contention::on(&self.store, "forgetting a reflection");
        let held = loop {
            let Some(kv) = self.store.get(&key).await? else {
                break None;
            };
            let rec: OutgoingRecord = decode(&key, &kv.value)?;
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, kv.mod_revision)],
                    success: vec![Op::delete(&key)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                break Some(rec);
            }
            contention.lost().await?;
        };
        let released = match &held {
            Some(rec) => {
                self.release(&target.id, &key, rec.hub_external.iter().cloned().collect())
                    .await?
            }
            None => 0,
        };
        let mut delivered = false;
        if deliver {
            let peer = self
                .full_peer(&target.id, Error::FailedPrecondition)
                .await?;
            let address = advertised(&peer)
                .map(|a| a.endpoints.clone())
                .unwrap_or_default();
            if address.is_empty() {
                return Err(Error::FailedPrecondition(format!(
                    "cluster {} advertises no endpoints service address",
                    target.id
                )));
            }
            self.clients
                .delete_reflected_slice(&target.id, &address, &self.local, namespace, name)
                .await?;
            delivered = true;
        }
        tracing::info!(
            unreflected = held.is_some(),
            released,
            "stopped reflecting endpoint slice"
        );
        Ok(Unreflected {
            unreflected: held.is_some(),
            released,
            delivered,
        })
    }

    async fn deliver_apply(
        &self,
        target_id: &ClusterId,
        peer: &ForeignCluster,
        slice: &Slice,
        generation: i64,
    ) -> Result<Applied> {
        let target = peer
            .identity
            .as_ref()
            .map(|i| i.cluster_id.clone())
            .unwrap_or_default();
        let address = advertised(peer)
            .map(|a| a.endpoints.clone())
            .unwrap_or_default();
        if address.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "cluster {target} advertises no endpoints service address"
            )));
        }
        self.clients
            .apply_reflected_slice(target_id, &address, &self.local, slice, generation)
            .await
    }

    /// Every reflection this cluster records as source (for operators and tests).
    pub async fn outgoing(&self) -> Result<Vec<OutgoingRecord>> {
        self.store
            .list(OUTGOING_PREFIX)
            .await?
            .kvs
            .iter()
            .map(|kv| decode(&kv.key, &kv.value))
            .collect()
    }
}
