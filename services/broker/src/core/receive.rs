//! Receiving a NetworkConfig destined to us: who may send it, the checks on its ranges and its
//! WireGuard key, our NAT decision from the IPAM, and storing it. A new incarnation of the
//! remote's NetworkConfig also makes the next pass send ours again (ADR 0012).

use std::sync::PoisonError;

use trellis_api::ClusterId;
use trellis_api::ClusterIdentity;
use trellis_api::model::{NetworkSpec, WgKey};
use trellis_api::peers::Peers;
use trellis_error::{Error, Result};
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, Txn};

use super::lanes::Lane;
use super::{Broker, local};
use crate::records::{
    Decision, IN_PREFIX, IncomingNc, OutgoingNc, decode, encode, in_key, out_key,
};
use crate::remote::ipam::Mapping;

/// A NetworkConfig received from a remote, validated.
#[derive(Debug, Clone)]
pub struct Received {
    pub origin: ClusterIdentity,
    pub via: Option<ClusterIdentity>,
    pub spec: NetworkSpec,
    pub generation: i64,
    /// The generation of our NetworkConfig the origin holds (0: none).
    pub held_generation: i64,
}

/// The answer to a received NetworkConfig.
#[derive(Debug, Clone)]
pub struct Answer {
    /// False when a higher generation is already held.
    pub accepted: bool,
    pub generation: i64,
    pub decision: Decision,
    /// The generation of our own NetworkConfig towards the origin (0: none yet), told to the
    /// origin with the decision (ADR 0012).
    pub receiver_generation: i64,
}

/// What the duplicate-key check needs of one held NetworkConfig, as of a store revision.
#[derive(Debug)]
pub(super) struct HeldKey {
    revision: i64,
    remote: ClusterId,
    key: WgKey,
    rejected: bool,
}

impl HeldKey {
    fn of(held: &IncomingNc, revision: i64) -> Self {
        Self {
            revision,
            remote: held.remote.id.clone(),
            key: held.spec.public_key,
            rejected: matches!(held.decision, Decision::Rejected { .. }),
        }
    }
}

impl Broker {
    /// Refuses a peer's spec whose ranges lie outside the allowed space.
    pub fn check_remote_spec(&self, prefix: &str, spec: &NetworkSpec) -> Result<()> {
        self.allowed
            .check(&format!("{prefix}.pod_cidr"), spec.pod_cidr)?;
        self.allowed
            .check(&format!("{prefix}.external_cidr"), spec.external_cidr)
    }

    /// Receives a NetworkConfig destined to us, decides how we address its origin, stores both.
    #[tracing::instrument(skip_all, fields(remote.id = %nc.origin.id, generation = nc.generation))]
    pub async fn receive(&self, nc: Received) -> Result<Answer> {
        self.check_remote_spec("network_config.spec", &nc.spec)?;
        let ids = match &nc.via {
            None => vec![&nc.origin.id],
            Some(hub) => vec![&hub.id, &nc.origin.id],
        };
        self.check_peers(&ids, |peers| {
            may_send(
                &self.identity.id,
                peers,
                &nc.origin.id,
                nc.via.as_ref().map(|v| &v.id),
            )
        })
        .await?;

        let ours = self.outgoing(&nc.origin.id).await?;
        let receiver_generation = ours.as_ref().map_or(0, |o| o.generation);
        let key = in_key(&nc.origin.id);
        let held = match self.store.get(&key).await? {
            Some(kv) => Some((decode::<IncomingNc>(&key, &kv.value)?, kv.mod_revision)),
            None => None,
        };
        if let Some((held, _)) = &held {
            if held.generation > nc.generation {
                return Ok(Answer {
                    accepted: false,
                    generation: held.generation,
                    decision: held.decision.clone(),
                    receiver_generation,
                });
            }
            // A pending decision (no free range when we last tried) is made again: the
            // sender re-submits exactly so that we look once more.
            if held.generation == nc.generation
                && held.spec == nc.spec
                && held.via == nc.via
                && !matches!(held.decision, Decision::Pending { .. })
            {
                return Ok(Answer {
                    accepted: true,
                    generation: held.generation,
                    decision: held.decision.clone(),
                    receiver_generation,
                });
            }
        }

        self.refuse_duplicate_key(&nc, ours.as_ref()).await?;
        let decision = self.decide(&nc).await?;
        if let Some((held, _)) = &held
            && held.generation == nc.generation
            && held.spec == nc.spec
            && held.via == nc.via
            && held.decision == decision
        {
            // Still pending for the same reason: nothing to write on each re-submission.
            return Ok(Answer {
                accepted: true,
                generation: held.generation,
                decision,
                receiver_generation,
            });
        }
        let record = IncomingNc {
            remote: nc.origin.clone(),
            via: nc.via.clone(),
            spec: nc.spec,
            generation: nc.generation,
            decision: decision.clone(),
        };
        let revision = held.as_ref().map_or(0, |(_, r)| *r);
        let committed = self
            .store
            .txn(Txn {
                compares: vec![Compare::ModRevision {
                    key: key.clone(),
                    revision,
                }],
                success: vec![Op::Put {
                    key,
                    value: encode(&record)?,
                    lease: None,
                }],
                failure: vec![],
            })
            .await?;
        if !committed.succeeded {
            return Err(Error::Aborted(format!(
                "a concurrent NetworkConfig from {} arrived; retry",
                nc.origin.id
            )));
        }
        tracing::info!(remote.id = %nc.origin.id, via = ?nc.via.as_ref().map(|v| v.id.to_string()), "received a network config");
        // A new incarnation of the remote's NC (generations are wall-clock seeded, ADR 0012)
        // may come from a remote that lost our NC (a teardown, a withdrawal, a rebuilt store):
        // forget the decision on ours so the next pass sends it again, unless the decision
        // came from this very incarnation.
        if held
            .as_ref()
            .is_none_or(|(h, _)| h.generation < nc.generation)
        {
            self.resend(&nc.origin.id, nc.generation, nc.held_generation)
                .await?;
        }
        self.wake_for(&nc.origin.id, Lane::of_via(nc.via.as_ref()));
        Ok(Answer {
            accepted: true,
            generation: nc.generation,
            decision,
            receiver_generation,
        })
    }

    /// Remembers our gateway's WireGuard public key (the reconciler, whenever it reads it).
    pub fn note_own_key(&self, key: WgKey) {
        *self.own_key.lock().unwrap_or_else(PoisonError::into_inner) = Some(key);
    }

    /// Our gateway's WireGuard public key: the one our NetworkConfig to the origin carries, the
    /// one last read, or the gateway's answer.
    async fn own_key(&self, ours: Option<&OutgoingNc>) -> Result<WgKey> {
        if let Some(out) = ours {
            return Ok(out.spec.public_key);
        }
        let known = *self.own_key.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(key) = known {
            return Ok(key);
        }
        let info = self
            .ports
            .gateway()
            .info(None)
            .await
            .map_err(local("asking the gateway for its public key"))?;
        let key = WgKey::parse("public_key", &info.public_key).map_err(|e| {
            Error::Internal(format!("the gateway answered an unusable public key: {e}"))
        })?;
        self.note_own_key(key);
        Ok(key)
    }

    /// Refuses a NetworkConfig whose WireGuard key is ours or another remote's (issue 32). The
    /// gateway's engine tells peers apart by their keys and refuses a key it already holds, so
    /// of two remotes announcing one key, the one added second (in cluster-ID order, on every
    /// pass after a restart) gets no tunnel: a peer could knock out another's tunnel by
    /// announcing its key. A key's first holder keeps it: the newcomer is refused and nothing
    /// is stored. Its own earlier NetworkConfig and refused ones do not count.
    async fn refuse_duplicate_key(&self, nc: &Received, ours: Option<&OutgoingNc>) -> Result<()> {
        let key = nc.spec.public_key;
        if key == self.own_key(ours).await? {
            tracing::warn!(remote.id = %nc.origin.id, "refused a network config announcing our own wireguard key");
            return Err(Error::invalid(
                "network_config.spec.public_key",
                format!("is the WireGuard key of {}'s own gateway", self.identity.id),
            ));
        }
        // The listing is the truth; only records changed since the last check are read and
        // decoded, and the listing carries no values. Reading and decoding every held
        // NetworkConfig on every one received made a leaf's share of an n-leaf mesh cost n²
        // decodes (15 % of a 255-cluster lab's CPU); copying every value to list them, 8 % of
        // a 254-leaf hub's leaves.
        let listing = self.store.list_revisions(IN_PREFIX).await?;
        let changed: Vec<&String> = {
            let memo = self
                .held_keys
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            listing
                .keys
                .iter()
                .filter(|(k, revision)| memo.get(k).is_none_or(|h| h.revision != *revision))
                .map(|(k, _)| k)
                .collect()
        };
        let mut fresh = Vec::with_capacity(changed.len());
        for k in changed {
            // `None`: gone since the listing.
            let held = match self.store.get(k).await? {
                Some(kv) => Some(HeldKey::of(
                    &decode::<IncomingNc>(&kv.key, &kv.value)?,
                    kv.mod_revision,
                )),
                None => None,
            };
            fresh.push((k.clone(), held));
        }
        let holder = {
            let mut memo = self
                .held_keys
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for (k, held) in fresh {
                match held {
                    Some(held) => memo.insert(k, held),
                    None => memo.remove(&k),
                };
            }
            let listed = listing
                .keys
                .iter()
                .filter(|(k, _)| memo.contains_key(k))
                .count();
            if memo.len() > listed {
                let keep: std::collections::HashSet<&str> =
                    listing.keys.iter().map(|(k, _)| k.as_str()).collect();
                memo.retain(|k, _| keep.contains(k.as_str()));
            }
            memo.values()
                .filter(|held| held.remote != nc.origin.id && held.key == key && !held.rejected)
                .map(|held| held.remote.clone())
                .min()
        };
        if let Some(holder) = holder {
            tracing::warn!(remote.id = %nc.origin.id, holder = %holder, "refused a network config announcing another peer's wireguard key");
            return Err(Error::AlreadyExists(format!(
                "network_config.spec.public_key: cluster {holder} already uses this WireGuard key \
                 with {}; each peer needs its own",
                self.identity.id
            )));
        }
        Ok(())
    }

    /// Clears the decision on our NC towards `remote`, so that the pass delivers it again;
    /// not when the remote's incarnation that just sent generation `theirs` holds ours: it
    /// decided on ours while its own NC was at `theirs`, or it says it holds our current
    /// generation (`held`).
    async fn resend(&self, remote: &ClusterId, theirs: i64, held: i64) -> Result<()> {
        let key = out_key(remote);
        let mut contention = Contention::on(&self.store, "re-sending our network config");
        loop {
            let Some(kv) = self.store.get(&key).await? else {
                return Ok(());
            };
            let mut out: OutgoingNc = decode(&key, &kv.value)?;
            if out.decision.is_none() {
                return Ok(());
            }
            if out.receiver_generation == theirs || held == out.generation {
                tracing::debug!(remote.id = %remote, "the remote's new network config comes from the incarnation that holds ours");
                return Ok(());
            }
            out.decision = None;
            let committed = self.replace_outgoing(&key, kv.mod_revision, &out).await?;
            if committed {
                tracing::info!(remote.id = %remote, "the remote sent a new incarnation: re-sending ours");
                return Ok(());
            }
            contention.lost().await?;
        }
    }

    /// Our NAT decision for a received spec, from the IPAM. A changed spec (a higher
    /// generation with other CIDRs) frees the old mapping first.
    async fn decide(&self, nc: &Received) -> Result<Decision> {
        let ipam = self.ports.ipam();
        let answer = match ipam.map_remote(&nc.origin, &nc.spec).await? {
            Mapping::RangesChanged(_) => {
                tracing::info!(remote.id = %nc.origin.id, "the remote's CIDRs changed: remapping");
                ipam.free_mapping(&nc.origin.id)
                    .await
                    .map_err(local("freeing the remote's old mapping"))?;
                ipam.map_remote(&nc.origin, &nc.spec).await?
            }
            other => other,
        };
        match answer {
            Mapping::Mapped(view) => Ok(Decision::Processed {
                view,
                observed_generation: nc.generation,
            }),
            // No free range to remap into passes when another peering frees one: the decision
            // waits, and the sender's re-submissions make it again (ADR 0010).
            Mapping::Exhausted(message) => {
                tracing::warn!(remote.id = %nc.origin.id, reason = message.as_str(), "cannot decide on a network config yet");
                Ok(Decision::Pending {
                    message,
                    observed_generation: nc.generation,
                })
            }
            // The spec itself is unusable: only a new spec is worth deciding again.
            Mapping::Refused(message) => {
                tracing::warn!(remote.id = %nc.origin.id, reason = message.as_str(), "rejected a network config");
                Ok(Decision::Rejected {
                    message,
                    observed_generation: nc.generation,
                })
            }
            // Freed a moment ago: the IPAM contradicts itself.
            Mapping::RangesChanged(message) => Err(Error::FailedPrecondition(message)
                .context("asking the IPAM for the remote's mapping")),
        }
    }
}

/// Whether `peers` let `origin` send us (`us`) a NetworkConfig: directly as a full peer, or
/// `via` a full peer that introduced it. A relaying hub we do not hold as a full peer is
/// refused for now, not for good: during a peering storm the hub may relay as soon as it holds
/// us, before our side of the peering is recorded (or while our discovery's store is down), and
/// a relay refused for good stayed failed at the hub although the peering completed a moment
/// later. A hub that never becomes our full peer only makes its forwarder retry.
fn may_send(
    us: &ClusterId,
    peers: &Peers,
    origin: &ClusterId,
    via: Option<&ClusterId>,
) -> Result<()> {
    match via {
        None if !peers.is_full_peer(origin) => Err(Error::PermissionDenied(format!(
            "cluster {origin} is not a full peer of {us}"
        ))),
        None => Ok(()),
        Some(hub) if !peers.is_full_peer(hub) => Err(Error::FailedPrecondition(format!(
            "the relaying hub {hub} is not (yet) a full peer of {us}; retry later"
        ))),
        Some(hub) if !peers.introduced_by(origin, hub) => Err(Error::FailedPrecondition(format!(
            "cluster {origin} has not (yet) been introduced to us by {hub}; retry later"
        ))),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_runtime::retry::Retryable as _;

    #[test]
    fn a_stranger_is_refused_for_good_but_a_hub_not_yet_peered_only_for_now() {
        let id = |s: &str| ClusterId::parse("id", s).expect("id");
        let (us, leaf, hub) = (id("leaf-2"), id("leaf-1"), id("hub"));
        let none = Peers::default();
        let direct = may_send(&us, &none, &leaf, None).expect_err("not a peer");
        assert!(matches!(direct, Error::PermissionDenied(_)), "{direct}");
        assert!(direct.is_permanent());
        let relayed = may_send(&us, &none, &leaf, Some(&hub)).expect_err("hub not peered yet");
        assert!(matches!(relayed, Error::FailedPrecondition(_)), "{relayed}");
        assert!(
            !relayed.is_permanent(),
            "the hub's forwarder must retry, not give up: {relayed}"
        );
        assert!(
            relayed.to_string().contains("relaying hub hub"),
            "{relayed}"
        );
    }
}
