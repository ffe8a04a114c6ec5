//! Receiving a remote's decision on our NetworkConfig (its status), which tells the IPAM how
//! the remote addresses us, and the `via` rule every call about a stored NetworkConfig is
//! checked against (ADR 0012).

use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, Txn};

use super::Broker;
use super::lanes::Lane;
use crate::records::{Decision, OutgoingNc, decode, encode, out_key};

impl Broker {
    /// Refuses a peer's decision about us whose views lie outside the allowed space.
    pub fn check_remote_decision(&self, prefix: &str, decision: &Decision) -> Result<()> {
        if let Some(view) = decision.view() {
            self.allowed
                .check(&format!("{prefix}.pod_cidr_nat"), view.pod_cidr_nat)?;
            self.allowed.check(
                &format!("{prefix}.external_cidr_nat"),
                view.external_cidr_nat,
            )?;
        }
        Ok(())
    }

    /// Writes `out` over `nc/out/<remote>` if it is still at `revision`; whether it was.
    pub(super) async fn replace_outgoing(
        &self,
        key: &str,
        revision: i64,
        out: &OutgoingNc,
    ) -> Result<bool> {
        let committed = self
            .store
            .txn(
                Txn::new()
                    .when(Compare::mod_revision(key, revision))
                    .then(Op::put(key, encode(out)?)),
            )
            .await?;
        Ok(committed.succeeded)
    }

    /// Stores a remote's decision on our NetworkConfig and tells the IPAM how it addresses us.
    /// Returns false for a stale decision.
    /// `receiver_generation` is the remote's own NC generation when it decided (0: unknown).
    pub async fn decided(
        &self,
        remote: &ClusterId,
        decision: Decision,
        receiver_generation: i64,
    ) -> Result<bool> {
        self.check_remote_decision("status", &decision)?;
        let key = out_key(remote);
        let mut contention = Contention::on(&self.store, "recording a network config status");
        loop {
            let Some(kv) = self.store.get(&key).await? else {
                return Err(Error::NotFound(format!(
                    "no network config towards {remote}"
                )));
            };
            let mut out: OutgoingNc = decode(&key, &kv.value)?;
            if decision.observed_generation() != out.generation {
                return Ok(false);
            }
            let known = out.decision.as_ref() == Some(&decision);
            if known && out.receiver_generation == receiver_generation {
                return Ok(true);
            }
            if !known && let Decision::Processed { view, .. } = &decision {
                self.ports
                    .ipam()
                    .set_local_nat(remote, &out.remote.name, view)
                    .await?;
            }
            out.decision = Some(decision.clone());
            out.receiver_generation = receiver_generation;
            let committed = self.replace_outgoing(&key, kv.mod_revision, &out).await?;
            if committed {
                tracing::info!(remote.id = %remote, generation = out.generation, "the remote decided on our network config");
                self.wake_for(remote, Lane::of_via(out.via.as_ref()));
                return Ok(true);
            }
            contention.lost().await?;
        }
    }
}

/// The `via` rule (ADR 0012): a call about a stored NetworkConfig may name a `via` only if it
/// is the hub the stored record was exchanged through; a direct NetworkConfig takes none. The
/// stored hub was checked to have introduced the counterpart when the record was written
/// (`receive` for ours, the route of the pass for theirs), so a peer naming itself as `via`
/// speaks for no exchange it does not relay.
pub fn check_via(
    remote: &ClusterId,
    stored: Option<&ClusterIdentity>,
    claimed: Option<&ClusterIdentity>,
) -> Result<()> {
    match (stored, claimed) {
        (None, None) => Ok(()),
        (Some(hub), Some(via)) if hub.id == via.id => Ok(()),
        (None, Some(via)) => Err(Error::PermissionDenied(format!(
            "the network config with {remote} is direct; {} does not relay it",
            via.id
        ))),
        (Some(hub), Some(via)) => Err(Error::PermissionDenied(format!(
            "the network config with {remote} is relayed by {}, not by {}",
            hub.id, via.id
        ))),
        (Some(hub), None) => Err(Error::PermissionDenied(format!(
            "the network config with {remote} is relayed by {}; only it may speak for it",
            hub.id
        ))),
    }
}
