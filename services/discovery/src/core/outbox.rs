//! What the Neighborhood sender reads and writes through the service: which full peers just
//! sent us a Neighborhood (so it retries them at once), and what each peer acknowledged.

use std::collections::{BTreeMap, BTreeSet};

use trellis_api::ClusterId;
use trellis_error::Result;
use trellis_store::{Compare, Op, Txn};

use super::Discovery;
use crate::records::{OUTBOX_PREFIX, Outbox, decode, encode, outbox_key};

impl Discovery {
    /// Wakes the Neighborhood sender for `peer`, which just sent us a Neighborhood as a full
    /// peer: it has recorded the peering, so what we failed to send it because it had not yet
    /// (our send right after the handshake usually overtakes its own record of us) is
    /// accepted now. Without this the send waited for its backoff, up to
    /// `--neighborhood-retry-max`.
    pub(super) fn heard_from(&self, peer: &ClusterId) {
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
