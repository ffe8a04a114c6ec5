//! A peering's bookkeeping and its end. Starting and ending a peering both go through the
//! per-remote lock, the record in the local discovery service, the CA pinned in our trust store
//! and the stored peering ID; ending it is [`Broker::unpeer`] here, [`Broker::notified_unpeer`]
//! when the remote ends it, and the unpeering notices in between, stored before anything
//! changes so that a crash is rolled forward (ADR 0010).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, PoisonError};

use trellis_api::model::Addresses;
use trellis_api::peers::UNPEERED_REASON;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::Result;
use trellis_runtime::tls::PinnedCa;

use super::Broker;
use crate::peering_id::PeeringId;
use crate::records::{NOTIFY_PREFIX, PendingNotify, encode, notify_key, peering_key};

/// The locks of one remote (in this process: the broker runs as one replica per cluster, and
/// its Deployment is `Recreate` so that a rollout never runs two). Whoever takes both takes
/// `sending` first.
#[derive(Debug, Default, Clone)]
pub(super) struct RemoteLocks {
    /// Over the peering's state: starting it, ending it, acting on a notice about it, so a
    /// notice is never rolled forward over a peering started again in between. A notice that
    /// names no peering is delivered under it too ([`Broker::deliver_ended`]).
    peering: Arc<tokio::sync::Mutex<()>>,
    /// Over what we send the remote about the peering: our unpeering notice's delivery and our
    /// handshake, so that a notice still on its way reaches it before our next handshake.
    /// Never taken on behalf of the remote's own calls: a handshake waiting on the remote's
    /// notice must leave our side free to take that notice (the remote answers the handshake
    /// only once its notice is through).
    sending: Arc<tokio::sync::Mutex<()>>,
}

impl Broker {
    fn remote_locks(&self, remote: &ClusterId) -> RemoteLocks {
        self.remote_locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(remote.clone())
            .or_default()
            .clone()
    }

    /// Serialises starting, ending and acting on notices about the peering with `remote`.
    pub(super) async fn lock_peering(
        &self,
        remote: &ClusterId,
    ) -> tokio::sync::OwnedMutexGuard<()> {
        self.remote_locks(remote).peering.lock_owned().await
    }

    /// Serialises what we send `remote` about the peering: the delivery of our unpeering
    /// notice, our handshake. Taken before [`Broker::lock_peering`] by whoever takes both.
    pub(super) async fn lock_sending(
        &self,
        remote: &ClusterId,
    ) -> tokio::sync::OwnedMutexGuard<()> {
        self.remote_locks(remote).sending.lock_owned().await
    }

    /// The sending locks of every cluster an unpeering notice may be on its way to that a
    /// handshake with `address` could reach: the `expected` cluster; without it, the full peer
    /// that advertises `address` and every cluster with a pending notice (few, and only until
    /// delivered). Taken in ID order, the one order every holder of several uses.
    pub(super) async fn lock_notified(
        &self,
        address: &str,
        expected: Option<&ClusterId>,
    ) -> Result<BTreeMap<ClusterId, tokio::sync::OwnedMutexGuard<()>>> {
        let mut ids = BTreeSet::new();
        match expected {
            Some(expected) => {
                ids.insert(expected.clone());
            }
            None => {
                let peers = self.peers().await?;
                ids.extend(
                    peers
                        .full
                        .iter()
                        .filter(|(_, (_, addresses, _))| addresses.broker == address)
                        .map(|(id, _)| id.clone()),
                );
                for kv in self.store.list(NOTIFY_PREFIX).await?.kvs {
                    let pending: PendingNotify = crate::records::decode(&kv.key, &kv.value)?;
                    ids.insert(pending.remote.id);
                }
            }
        }
        let mut held = BTreeMap::new();
        for id in ids {
            let guard = self.lock_sending(&id).await;
            held.insert(id, guard);
        }
        Ok(held)
    }

    /// Pins (or, `None` on unpeering, unpins) a peer's CA in our own trust store at once; the
    /// trust sync from discovery would do it a moment later.
    pub(super) fn pin(&self, remote: &ClusterId, ca: Option<PinnedCa>) {
        if let Some(tls) = self.ports.tls() {
            match ca {
                Some(ca) => {
                    tls.trust().pin(ca);
                }
                None => {
                    tls.trust().unpin(remote.as_str());
                }
            }
        }
    }

    pub(super) async fn record_peering(
        &self,
        remote: &ClusterIdentity,
        addresses: Option<&Addresses>,
        peered: bool,
        reason: &str,
        ca: Option<&PinnedCa>,
    ) -> Result<()> {
        self.ports
            .discovery()
            .update_peering(remote, addresses, peered, reason, ca)
            .await
    }

    /// Ends the full peering with `id`: marks it unpeered (the reconciler tears down what was
    /// built on it) and tells the remote, retrying later if it is unreachable.
    #[tracing::instrument(skip(self))]
    pub async fn unpeer(&self, id: &ClusterId) -> Result<bool> {
        let _sending = self.lock_sending(id).await;
        let peering = self.lock_peering(id).await;
        let peers = self.peers().await?;
        let Some((remote, addresses, _)) = peers.full.get(id).cloned() else {
            return Ok(false);
        };
        // Kept to reach the remote over mutual TLS once it is unpinned.
        let ca_certificate = self
            .ports
            .tls()
            .and_then(|t| t.trust().get(id.as_str()))
            .map(|ca| ca.pem().to_owned())
            .unwrap_or_default();
        // The notice is the unpeering's intent and is written first: a crash after it is rolled
        // forward by the reconciler ([`Broker::act_on_notice`]); a crash before it leaves the
        // peering as it was.
        let peering_id = self.peering_id(id).await?;
        let pending = (!addresses.broker.is_empty()).then(|| PendingNotify {
            remote: remote.clone(),
            broker: addresses.broker.clone(),
            reason: UNPEERED_REASON.into(),
            ca_certificate,
            peering_id,
        });
        if let Some(pending) = &pending {
            self.store.put(&notify_key(id), encode(pending)?).await?;
        }
        self.end_peering(&remote).await?;
        if let Some(pending) = &pending {
            self.deliver_ended(pending, peering).await;
        }
        tracing::info!(remote.id = %id, "unpeered");
        self.wake();
        Ok(true)
    }

    /// The ID of the current peering with `remote`, if it has one.
    pub async fn peering_id(&self, remote: &ClusterId) -> Result<Option<PeeringId>> {
        let key = peering_key(remote);
        match self.store.get(&key).await? {
            Some(kv) => Ok(Some(crate::records::decode(&key, &kv.value)?)),
            None => Ok(None),
        }
    }

    /// Keeps the ID of the peering with `remote` being recorded (forgets any older one when
    /// the caller sent none, so that its notices end whatever peering there is).
    pub(super) async fn keep_peering_id(
        &self,
        remote: &ClusterId,
        id: Option<&PeeringId>,
    ) -> Result<()> {
        let key = peering_key(remote);
        match id {
            Some(id) => self.store.put(&key, encode(id)?).await.map(drop)?,
            None => self.store.delete(&key).await.map(drop)?,
        }
        Ok(())
    }

    /// The full peer `remote` named `told` as our peering's ID in its answer to our
    /// NetworkConfig: kept if we keep none (our store was emptied), so that an unpeering notice
    /// names this peering again and cannot end a later one. A different ID of our own stands:
    /// it came from a handshake, the remote's word does not replace it.
    pub async fn learn_peering_id(&self, remote: &ClusterId, told: &PeeringId) -> Result<()> {
        if self.peering_id(remote).await?.is_some() {
            return Ok(());
        }
        let _peering = self.lock_peering(remote).await;
        if self.peering_id(remote).await?.is_some()
            || !self.peers_of(&[remote]).await?.is_full_peer(remote)
        {
            return Ok(());
        }
        self.keep_peering_id(remote, Some(told)).await?;
        tracing::info!(remote.id = %remote, peering_id = %told, "learned our peering's id from the remote");
        Ok(())
    }

    /// Our side of ending the peering with `remote`: discovery marks it unpeered (the
    /// reconciler tears down what was built on it) and its CA is no longer trusted.
    async fn end_peering(&self, remote: &ClusterIdentity) -> Result<()> {
        self.record_peering(remote, None, false, UNPEERED_REASON, None)
            .await?;
        self.keep_peering_id(&remote.id, None).await?;
        self.pin(&remote.id, None);
        Ok(())
    }

    /// Acts on the stored unpeering notice for `remote` (the reconciler, for every notice):
    /// completes our side if it is still peered (the broker died between writing the notice
    /// and changing discovery), then delivers the notice. A notice a new peering cancelled in
    /// the meantime is gone and nothing happens. Returns whether nothing is left to do.
    pub async fn act_on_notice(&self, remote: &ClusterId) -> Result<bool> {
        let _sending = self.lock_sending(remote).await;
        let peering = self.lock_peering(remote).await;
        let key = notify_key(remote);
        let Some(kv) = self.store.get(&key).await? else {
            return Ok(true);
        };
        let pending: PendingNotify = crate::records::decode(&key, &kv.value)?;
        if self.peers_of(&[remote]).await?.is_full_peer(remote) {
            tracing::info!(remote.id = %remote, "completing an unpeering interrupted before discovery heard of it");
            self.end_peering(&pending.remote).await?;
            self.wake();
        }
        Ok(self.deliver_ended(&pending, peering).await)
    }

    /// Delivers `pending` once our side of its peering has ended, under the sending lock and
    /// `peering`, the peering lock. A notice that names its peering is fenced by that ID on
    /// the remote's side, so the peering lock is let go first: the remote's own calls about
    /// the peering (its notice to us when both sides unpeer at once, its handshake) are
    /// answered while ours is on its way, instead of both sides' calls waiting for each other
    /// until they time out. One that names none would end whichever peering the remote holds
    /// when it lands, so it keeps the lock: no peering can begin before it is through.
    async fn deliver_ended(
        &self,
        pending: &PendingNotify,
        peering: tokio::sync::OwnedMutexGuard<()>,
    ) -> bool {
        if pending.peering_id.is_some() {
            drop(peering);
        }
        self.deliver_notify(pending).await
    }

    /// Tries to deliver a pending unpeering notice; forgets it once acknowledged.
    pub async fn deliver_notify(&self, pending: &PendingNotify) -> bool {
        let sent = self
            .ports
            .peers()
            .notify_unpeer(&self.identity, pending)
            .await;
        match sent {
            Ok(_) => {
                if let Err(err) = self.store.delete(&notify_key(&pending.remote.id)).await {
                    tracing::warn!(error = %err, "could not forget a delivered unpeering notice");
                }
                true
            }
            Err(err) => {
                tracing::warn!(remote.id = %pending.remote.id, error = %err, "unpeering notice not delivered yet");
                false
            }
        }
    }

    /// The remote `caller` unpeered us, ending the peering `ends` (`None`: whatever peering
    /// there is). A notice for an earlier peering than ours changes nothing.
    pub async fn notified_unpeer(
        &self,
        caller: &ClusterIdentity,
        reason: &str,
        ends: Option<&PeeringId>,
    ) -> Result<bool> {
        let _peering = self.lock_peering(&caller.id).await;
        let peers = self.peers().await?;
        if !peers.is_full_peer(&caller.id) {
            return Ok(false);
        }
        if let (Some(ends), Some(current)) = (ends, self.peering_id(&caller.id).await?)
            && *ends != current
        {
            tracing::warn!(remote.id = %caller.id, notice.peering_id = %ends, peering_id = %current, "ignoring an unpeering notice for an earlier peering");
            return Ok(false);
        }
        self.record_peering(
            caller,
            None,
            false,
            if reason.is_empty() {
                "RemoteUnpeered"
            } else {
                reason
            },
            None,
        )
        .await?;
        self.keep_peering_id(&caller.id, None).await?;
        self.pin(&caller.id, None);
        tracing::info!(remote.id = %caller.id, reason, "the remote unpeered us");
        self.wake();
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The remote's word only fills a gap: an ID of our own came from a handshake and stands,
    /// so an answer naming another one (a peering the remote has not yet given up) changes
    /// nothing here.
    #[tokio::test]
    async fn an_id_of_our_own_stands_against_the_one_the_remote_names() {
        let broker = crate::reconcile::broker();
        let remote = ClusterId::parse("id", "hub").expect("id");
        let (ours, told) = (PeeringId::random(), PeeringId::random());
        broker
            .keep_peering_id(&remote, Some(&ours))
            .await
            .expect("kept");
        broker
            .learn_peering_id(&remote, &told)
            .await
            .expect("nothing to do");
        assert_eq!(broker.peering_id(&remote).await.expect("reads"), Some(ours));
    }
}
