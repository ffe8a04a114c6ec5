//! Removing what is held for a remote: the ordered teardown of a remote no longer wanted (ADR
//! 0010), the state dropped when a remote withdraws its NetworkConfig, and freeing the IPAM
//! mappings of clusters nothing is held for. Each step survives a failure at any point, because
//! a teardown is not undone by a later pass.

use std::collections::BTreeSet;

use trellis_api::ClusterId;
use trellis_api::peers::Peers;
use trellis_error::Result;
use trellis_store::{Op, Txn};

use super::pass::holds;
use super::tunnel::remove_tunnel;
use crate::core::Broker;
use crate::core::lanes::Lane;
use crate::records::{IncomingNc, OutgoingNc, decode, in_key, out_key, tombstone_key, tunnel_key};

/// Removes everything held for `id`, in an order that survives a failure at any step: the
/// TunnelEndpoint first (leaving a tombstone for watchers), so the data plane drops the peer at
/// once; then our induced NetworkConfig is withdrawn through its hub (best effort: the hub may
/// be the reason it is gone); then the IPAM mapping is freed; the NetworkConfigs go last. Until
/// they are gone the remote counts as held, so a failed step (the IPAM restarting) is retried
/// by the next pass instead of leaking the mapping.
pub async fn teardown(broker: &Broker, id: &ClusterId, reason: &str) -> Result<()> {
    let store = broker.store();
    remove_tunnel(broker, id).await?;
    if let Some(kv) = store.get(&out_key(id)).await? {
        let out: OutgoingNc = decode(&out_key(id), &kv.value)?;
        if let (Some(hub), Some(forwarder)) = (&out.via, &out.forwarder) {
            let withdrawn = broker
                .ports()
                .peers()
                .relay_withdrawal(forwarder, hub, broker.identity(), &out.remote, reason)
                .await;
            if let Err(err) = withdrawn {
                tracing::info!(remote.id = %id, hub.id = %hub.id, error = %err, "could not withdraw through the hub; the remote withdraws on its own");
            }
        }
    }
    free_mapping(broker, id).await?;
    remove_state(broker, id).await?;
    tracing::info!(remote.id = %id, reason, "tore down the network configs and tunnel");
    Ok(())
}

async fn free_mapping(broker: &Broker, id: &ClusterId) -> Result<bool> {
    broker
        .ports()
        .ipam()
        .free_mapping(id)
        .await
        .map_err(|e| e.context("freeing the remote's IPAM mapping"))
}

/// The IPAM reconciliation against the peer set: frees the mappings of clusters we neither
/// exchange with nor hold anything for. They are left by a teardown that predates the ordered
/// one above, by an allocation that raced a teardown, or by a caller of the IPAM. `mapped` was
/// listed before `held` and before the peering view, so a mapping made for a NetworkConfig
/// received meanwhile (whose sender discovery listed as a peer first) is not among them; the
/// candidates are confirmed against a fresh view before anything is freed.
pub(super) async fn free_orphaned_mappings(
    broker: &Broker,
    mapped: BTreeSet<ClusterId>,
    held: &BTreeSet<ClusterId>,
    peers: &Peers,
) -> Result<BTreeSet<ClusterId>> {
    let candidates: Vec<ClusterId> = mapped
        .into_iter()
        .filter(|id| !held.contains(id) && !peers.desired.contains_key(id))
        .collect();
    let mut failed = BTreeSet::new();
    if candidates.is_empty() {
        return Ok(failed);
    }
    let fresh = broker.peers().await?;
    for id in candidates
        .into_iter()
        .filter(|id| !fresh.desired.contains_key(id))
    {
        if holds(broker, &id).await? {
            continue;
        }
        match free_mapping(broker, &id).await {
            Ok(existed) => {
                if existed {
                    tracing::info!(remote.id = %id, "freed the ipam mapping of a cluster that is no peer");
                }
            }
            Err(err) => {
                tracing::warn!(remote.id = %id, error = %err, "could not free an orphaned ipam mapping");
                failed.insert(id);
            }
        }
    }
    Ok(failed)
}

/// The remote clusters the IPAM holds a mapping for.
pub(super) async fn mapped(broker: &Broker) -> Result<BTreeSet<ClusterId>> {
    broker.ports().ipam().mapped().await
}

/// Deletes both NetworkConfigs and the TunnelEndpoint of `id` in one transaction.
pub async fn remove_state(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let mut ops = vec![
        Op::Delete { key: out_key(id) },
        Op::Delete { key: in_key(id) },
    ];
    if let Some(kv) = store.get(&tunnel_key(id)).await? {
        ops.push(Op::Delete {
            key: tunnel_key(id),
        });
        ops.push(Op::Put {
            key: tombstone_key(id),
            value: kv.value.to_vec(),
            lease: None,
        });
    }
    store
        .txn(Txn {
            compares: vec![],
            success: ops,
            failure: vec![],
        })
        .await?;
    Ok(())
}

/// The remote withdrew its NetworkConfig towards us: forget it and the tunnel built on it.
pub async fn withdrawn(broker: &Broker, id: &ClusterId) -> Result<bool> {
    let store = broker.store();
    let held = match store.get(&in_key(id)).await? {
        Some(kv) => Some(decode::<IncomingNc>(&in_key(id), &kv.value)?),
        None => None,
    };
    let existed = held.is_some();
    // Our own NC goes too: the next pass sends a new incarnation, which makes the remote send
    // its NC again (see `Broker::receive`), so a withdrawal heals instead of leaving one side
    // without a tunnel.
    let mut ops = vec![
        Op::Delete { key: in_key(id) },
        Op::Delete { key: out_key(id) },
    ];
    if let Some(kv) = store.get(&tunnel_key(id)).await? {
        ops.push(Op::Delete {
            key: tunnel_key(id),
        });
        ops.push(Op::Put {
            key: tombstone_key(id),
            value: kv.value.to_vec(),
            lease: None,
        });
    }
    store
        .txn(Txn {
            compares: vec![],
            success: ops,
            failure: vec![],
        })
        .await?;
    broker.wake_for(id, Lane::of_via(held.and_then(|h| h.via).as_ref()));
    Ok(existed)
}
