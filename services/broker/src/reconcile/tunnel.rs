//! The TunnelEndpoint of a remote, what the gateway builds the tunnel from: written once both
//! NetworkConfigs are decided over the same route, and removed first when the remote is torn
//! down, leaving a tombstone so that watchers see the deletion with its last content.

use trellis_api::ClusterId;
use trellis_api::model::TunnelEndpoint;
use trellis_error::Result;
use trellis_store::{Compare, Op, Txn};

use crate::core::Broker;
use crate::records::{
    Decision, IncomingNc, OutgoingNc, TunnelRecord, decode, encode, in_key, out_key, tombstone_key,
    tunnel_key,
};

/// Writes (or updates) the TunnelEndpoint once both directions are decided for the same route.
pub(super) async fn write_tunnel(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let (Some(out_kv), Some(in_kv)) = (
        store.get(&out_key(id)).await?,
        store.get(&in_key(id)).await?,
    ) else {
        return Ok(());
    };
    let out: OutgoingNc = decode(&out_key(id), &out_kv.value)?;
    let incoming: IncomingNc = decode(&in_key(id), &in_kv.value)?;
    let (Some(theirs_of_us), Some(ours_of_them)) = (
        out.current_decision().and_then(Decision::view),
        incoming.decision.view(),
    ) else {
        return Ok(());
    };
    if incoming.via != out.via {
        // The two directions travelled different routes (a hub change in flight); wait until
        // both NetworkConfigs agree.
        return Ok(());
    }
    let key = tunnel_key(id);
    let existing = match store.get(&key).await? {
        Some(kv) => Some((decode::<TunnelRecord>(&key, &kv.value)?, kv.mod_revision)),
        None => None,
    };
    let generation = existing.as_ref().map_or(0, |(t, _)| t.generation) + 1;
    let mut tunnel = TunnelEndpoint::merge(
        incoming.remote.clone(),
        out.via.clone(),
        (&out.spec, theirs_of_us),
        (&incoming.spec, ours_of_them),
        generation,
    );
    // The candidates come from the hub (`core::candidates`), not from the NetworkConfigs.
    if let Some((current, _)) = &existing
        && current.via == tunnel.via
    {
        tunnel.remote_candidates = current.remote_candidates.clone();
    }
    if let Some((current, _)) = &existing
        && (TunnelEndpoint {
            generation: current.generation,
            ..tunnel.clone()
        }) == *current
    {
        return Ok(());
    }
    let committed = store
        .txn(Txn {
            compares: vec![Compare::ModRevision {
                key: key.clone(),
                revision: existing.map_or(0, |(_, r)| r),
            }],
            success: vec![Op::Put {
                key,
                value: encode(&tunnel)?,
                lease: None,
            }],
            failure: vec![],
        })
        .await?;
    if committed.succeeded {
        tracing::info!(
            remote.id = %id,
            kind = ?tunnel.kind,
            remote_pod_cidr_nat = %tunnel.remote_nat.pod_cidr_nat,
            local_pod_cidr_nat = %tunnel.local_nat.pod_cidr_nat,
            generation,
            "tunnel endpoint ready"
        );
        if tunnel.via.is_some() && tunnel.remote_candidates.is_empty() {
            broker.wake_candidates();
        }
    }
    Ok(())
}

/// Deletes the TunnelEndpoint of `id`, leaving a tombstone for watchers.
pub(super) async fn remove_tunnel(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let Some(kv) = store.get(&tunnel_key(id)).await? else {
        return Ok(());
    };
    store
        .txn(
            Txn::new()
                .when(Compare::mod_revision(tunnel_key(id), kv.mod_revision))
                .then(Op::delete(tunnel_key(id)))
                .then(Op::put(tombstone_key(id), kv.value)),
        )
        .await?;
    Ok(())
}
