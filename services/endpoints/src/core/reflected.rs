//! The target side: the slices peers reflected to us, stored generation-checked (a generation
//! names one content, so a re-send is idempotent and a lower one is stale) and, with
//! Kubernetes access, written as EndpointSlices. Kubernetes is written before the store, so a
//! slice that cannot be written is never recorded as held.

use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Op, Txn};

use super::{Endpoints, unchanged};
use crate::model::Slice;
use crate::records::{
    REFLECTED_PREFIX, ReflectedRecord, decode, encode, reflected_key, reflected_source_prefix,
};

/// The answer of [`Endpoints::apply`] (target side), and of a delivery (source side).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Whether the offered generation is now held (new, or an idempotent re-send).
    pub applied: bool,
    /// The generation held after the call: the offered one, or the higher one that refused it.
    pub held: i64,
    /// The Kubernetes object written for it, with Kubernetes access.
    pub object_name: Option<String>,
}

fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

impl Endpoints {
    /// Stores (and writes into Kubernetes) a slice `source` reflected to us. Returns whether
    /// this generation is now held, the generation held, and the Kubernetes object name.
    #[tracing::instrument(skip(self, slice), fields(source.id = %source.id, slice.namespace = %slice.namespace, slice.name = %slice.name))]
    pub async fn apply(
        &self,
        source: &ClusterIdentity,
        slice: Slice,
        generation: i64,
    ) -> Result<Applied> {
        self.full_peer(&source.id, Error::PermissionDenied).await?;
        let key = reflected_key(&source.id, &slice.namespace, &slice.name);
        let mut contention = Contention::on(&self.store, "applying a reflected slice");
        loop {
            let held = match self.store.get(&key).await? {
                Some(kv) => Some((decode::<ReflectedRecord>(&key, &kv.value)?, kv.mod_revision)),
                None => None,
            };
            // A generation names one content of the slice: the one held is an idempotent
            // re-send, a lower one is stale. Neither touches Kubernetes.
            if let Some((rec, _)) = &held
                && rec.generation >= generation
            {
                let current = rec.generation == generation;
                if !current {
                    tracing::info!(
                        held = rec.generation,
                        offered = generation,
                        "ignored a stale reflected slice"
                    );
                }
                return Ok(Applied {
                    applied: current,
                    held: rec.generation,
                    object_name: rec.object_name.clone(),
                });
            }
            // Kubernetes first: if the object cannot be written (e.g. an unmanaged slice of
            // that name exists), nothing is stored.
            let object_name = match &self.writer {
                Some(writer) if self.mark_readiness => {
                    let reach = self.reachability().await?;
                    Some(writer.apply(source, &reach.mark(&slice)).await?)
                }
                Some(writer) => Some(writer.apply(source, &slice).await?),
                None => None,
            };
            let record = ReflectedRecord {
                source: source.clone(),
                slice: slice.clone(),
                generation,
                object_name: object_name.clone(),
                update_time_nanos: now_nanos(),
            };
            let revision = held.as_ref().map_or(0, |(_, r)| *r);
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, revision)],
                    success: vec![Op::put(&key, encode(&record)?)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                tracing::info!(
                    generation,
                    object = object_name.as_deref().unwrap_or(""),
                    endpoints = record.slice.endpoints.len(),
                    "applied reflected slice"
                );
                // An export we pass on to our other peers may have changed.
                self.exports_changed.notify_one();
                self.imports_changed();
                return Ok(Applied {
                    applied: true,
                    held: generation,
                    object_name,
                });
            }
            contention.lost().await?;
        }
    }

    /// Deletes a slice `source` reflected to us, and its Kubernetes object.
    #[tracing::instrument(skip(self), fields(source.id = %source.id))]
    pub async fn delete(
        &self,
        source: &ClusterIdentity,
        namespace: &str,
        name: &str,
    ) -> Result<bool> {
        self.full_peer(&source.id, Error::PermissionDenied).await?;
        self.forget(source, namespace, name).await
    }

    /// Drops a slice `source` reflected to us and its Kubernetes object, whether or not
    /// `source` is still a peer (the export reconciler drops what a former peer brought).
    pub(crate) async fn forget(
        &self,
        source: &ClusterIdentity,
        namespace: &str,
        name: &str,
    ) -> Result<bool> {
        let key = reflected_key(&source.id, namespace, name);
        // Also when nothing is stored: a crash between the Kubernetes write and the store
        // commit may have left our object behind. The writer only deletes what it manages.
        if let Some(writer) = &self.writer {
            writer.delete(source, namespace, name).await?;
        }
        let mut contention = Contention::on(&self.store, "deleting a reflected slice");
        loop {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(false);
            };
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![unchanged(&key, kv.mod_revision)],
                    success: vec![Op::delete(&key)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                tracing::info!(source.id = %source.id, namespace, name, "deleted reflected slice");
                // An export in transit through us may have gone with it.
                self.exports_changed.notify_one();
                self.imports_changed();
                return Ok(true);
            }
            contention.lost().await?;
        }
    }

    /// The slices reflected to us, by (source, namespace, name).
    pub async fn list(
        &self,
        source: Option<&ClusterId>,
        namespace: Option<&str>,
    ) -> Result<Vec<ReflectedRecord>> {
        let prefix = source.map_or_else(|| REFLECTED_PREFIX.to_owned(), reflected_source_prefix);
        let mut out = Vec::new();
        for kv in self.store.list(&prefix).await?.kvs {
            let rec: ReflectedRecord = decode(&kv.key, &kv.value)?;
            if namespace.is_none_or(|ns| rec.slice.namespace == ns) {
                out.push(rec);
            }
        }
        out.sort_by(|a, b| {
            (&a.source.id, &a.slice.namespace, &a.slice.name).cmp(&(
                &b.source.id,
                &b.slice.namespace,
                &b.slice.name,
            ))
        });
        Ok(out)
    }
}
