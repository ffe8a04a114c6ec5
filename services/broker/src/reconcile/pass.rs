//! One reconciliation pass: over every remote of a lane, or over the remotes woken. A pass
//! reads what we hold before who we are peered with, exchanges NetworkConfigs with the wanted
//! remotes of its lane ([`super::exchange`]) and tears down the unwanted ones
//! ([`super::teardown`]) once a fresh read of discovery confirms they are gone.

use std::collections::BTreeSet;

use trellis_api::ClusterId;
use trellis_api::pb::types as pb;
use trellis_api::peers::{Peers, Remote};
use trellis_error::Result;

use super::Unsettled;
use super::exchange::{PassKind, ensure_all};
use super::teardown::{free_orphaned_mappings, mapped, teardown};
use crate::core::Broker;
use crate::core::lanes::Lane;
use crate::records::{
    IN_PREFIX, IncomingNc, NOTIFY_PREFIX, OUT_PREFIX, OutgoingNc, PendingNotify, TUNNELS_PREFIX,
    TunnelRecord, decode, in_key, out_key, tunnel_key,
};

/// The remotes we hold any state for (NetworkConfigs or a TunnelEndpoint).
async fn held(broker: &Broker) -> Result<BTreeSet<ClusterId>> {
    let mut held = BTreeSet::new();
    for prefix in [OUT_PREFIX, IN_PREFIX, TUNNELS_PREFIX] {
        for kv in broker.store().list(prefix).await?.kvs {
            if let Some(id) = kv
                .key
                .strip_prefix(prefix)
                .and_then(|id| ClusterId::parse("key", id).ok())
            {
                held.insert(id);
            }
        }
    }
    Ok(held)
}

/// Whether we hold any state for `id`.
pub(super) async fn holds(broker: &Broker, id: &ClusterId) -> Result<bool> {
    for key in [out_key(id), in_key(id), tunnel_key(id)] {
        if broker.store().get(&key).await?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// One reconciliation over every remote of `lane`: the periodic resync, and whatever cannot
/// be pinned on one remote (peering changes, a restart). The full lane also delivers pending
/// unpeering notices and frees orphaned IPAM mappings.
pub async fn pass(broker: &Broker, lane: Lane) -> Result<Unsettled> {
    // What we hold is read before who we peer with: a NetworkConfig received meanwhile was
    // checked against a newer discovery listing than ours and must not look unwanted. The
    // IPAM's mappings are read first of all, for the same reason.
    // An IPAM that does not answer holds up only this reconciliation, not the rest of the pass.
    let mapped = match lane {
        Lane::Full => Some(mapped(broker).await.inspect_err(
            |err| tracing::warn!(error = %err, "cannot reconcile the ipam's mappings"),
        )),
        Lane::Induced => None,
    };
    let held = held(broker).await?;
    let peers = broker.view().await?;
    let mut unsettled = Unsettled::default();

    if lane == Lane::Full {
        for kv in broker.store().list(NOTIFY_PREFIX).await?.kvs {
            let pending: PendingNotify = decode(&kv.key, &kv.value)?;
            if !broker.act_on_notice(&pending.remote.id).await? {
                unsettled.all = true;
            }
        }
    }

    let mine: Vec<&Remote> = peers
        .desired
        .values()
        .filter(|remote| Lane::of_route(&remote.route) == lane)
        .collect();
    if !mine.is_empty() {
        unsettled.ids = ensure_all(broker, mine, PassKind::Periodic).await?;
    }

    let mut unwanted = Vec::new();
    for id in held.iter().filter(|id| !peers.desired.contains_key(*id)) {
        if held_lane(broker, id).await? == lane {
            unwanted.push(id);
        }
    }
    if !unwanted.is_empty() {
        // Tearing down is not undone by a later pass (the remote does not re-send what we
        // already decided on), so confirm with a fresh listing first.
        let fresh = broker.peers().await?;
        for id in unwanted
            .into_iter()
            .filter(|id| !fresh.desired.contains_key(*id))
        {
            if let Err(err) = teardown(broker, id, "PeeringGone").await {
                tracing::warn!(remote.id = %id, error = %err, "teardown incomplete");
                unsettled.ids.insert(id.clone());
            }
        }
    }
    let orphans_left = match mapped {
        Some(Ok(mapped)) => !free_orphaned_mappings(broker, mapped, &held, &peers)
            .await?
            .is_empty(),
        Some(Err(_)) => true,
        None => false,
    };
    unsettled.all |= orphans_left;
    Ok(unsettled)
}

/// The lane of a remote we hold state for, from that state: relayed through a hub (our
/// NetworkConfig, theirs or the tunnel names one) or direct. Decides which lane tears it down
/// once it is no longer wanted, so the two never both do.
async fn held_lane(broker: &Broker, id: &ClusterId) -> Result<Lane> {
    let store = broker.store();
    if let Some(kv) = store.get(&out_key(id)).await? {
        let out: OutgoingNc = decode(&out_key(id), &kv.value)?;
        return Ok(Lane::of_via(out.via.as_ref()));
    }
    if let Some(kv) = store.get(&in_key(id)).await? {
        let incoming: IncomingNc = decode(&in_key(id), &kv.value)?;
        return Ok(Lane::of_via(incoming.via.as_ref()));
    }
    if let Some(kv) = store.get(&tunnel_key(id)).await? {
        let tunnel: TunnelRecord = decode(&tunnel_key(id), &kv.value)?;
        return Ok(Lane::of_via(tunnel.via.as_ref()));
    }
    Ok(Lane::Full)
}

/// From this many remotes woken at once (a hub's Neighborhood introduced them together), one
/// listing of every cluster costs less than a lookup per remote and per hub.
const LIST_FROM: usize = 8;

/// Where [`peers_for`] reads discovery's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// The watch-fed copy where it holds a record (a record it lacks is read from discovery):
    /// may lag discovery.
    Copy,
    /// Discovery itself: to confirm an absence before acting on it.
    Fresh,
}

/// The records of `ids` (unknown ones absent) from `source`.
async fn records_of(
    broker: &Broker,
    ids: &[&ClusterId],
    source: Source,
) -> Result<Vec<pb::ForeignCluster>> {
    match source {
        Source::Copy => broker.ports().discovery().lookup(ids).await,
        Source::Fresh => broker.foreign_clusters_of(ids).await,
    }
}

/// The peering view of `ids` and of the hubs that introduced them: enough to route each of
/// them, from a few records rather than a listing of every cluster (or from a whole view
/// when many remotes are woken at once).
async fn peers_for(broker: &Broker, ids: &BTreeSet<ClusterId>, source: Source) -> Result<Peers> {
    if ids.len() >= LIST_FROM {
        return match source {
            Source::Copy => broker.view().await,
            Source::Fresh => broker.peers().await,
        };
    }
    let mut records = records_of(broker, &ids.iter().collect::<Vec<_>>(), source).await?;
    let first = Peers::from_foreign_clusters(&records);
    let hubs: Vec<&ClusterId> = first
        .induced
        .values()
        .flatten()
        .filter(|hub| !ids.contains(*hub))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if hubs.is_empty() {
        return Ok(first);
    }
    // Only the hubs are looked up again; the remotes' records are those read just now.
    records.extend(records_of(broker, &hubs, source).await?);
    Ok(Peers::from_foreign_clusters(&records))
}

/// One reconciliation of the remotes `ids` only, those of `lane`; a remote that belongs to
/// the other lane (its route changed since it was woken) is handed over to it.
pub async fn pass_for(broker: &Broker, lane: Lane, ids: &BTreeSet<ClusterId>) -> Result<Unsettled> {
    // Held before the peering view, as in [`pass`].
    let mut held = BTreeSet::new();
    for id in ids {
        if holds(broker, id).await? {
            held.insert(id.clone());
        }
    }
    let peers = peers_for(broker, ids, Source::Copy).await?;
    let mut mine = Vec::new();
    for id in ids {
        if let Some(remote) = peers.desired.get(id) {
            if Lane::of_route(&remote.route) == lane {
                mine.push(remote);
            } else {
                broker.wake_for(id, lane.other());
            }
        }
    }
    let mut unsettled = Unsettled {
        all: false,
        ids: ensure_all(broker, mine, PassKind::Woken).await?,
    };
    let unwanted: BTreeSet<ClusterId> = held
        .iter()
        .filter(|id| !peers.desired.contains_key(*id))
        .cloned()
        .collect();
    if unwanted.is_empty() {
        return Ok(unsettled);
    }
    // Tearing down is not undone by a later pass, and the view above may lag discovery:
    // confirm with a fresh one. A remote wanted after all is woken by the watch event that
    // brings its change to the copy.
    let fresh = peers_for(broker, &unwanted, Source::Fresh).await?;
    for id in unwanted
        .iter()
        .filter(|id| !fresh.desired.contains_key(*id))
    {
        if held_lane(broker, id).await? != lane {
            broker.wake_for(id, lane.other());
            continue;
        }
        if let Err(err) = teardown(broker, id, "PeeringGone").await {
            tracing::warn!(remote.id = %id, error = %err, "teardown incomplete");
            unsettled.ids.insert(id.clone());
        }
    }
    Ok(unsettled)
}

#[cfg(test)]
mod tests {
    use trellis_api::ClusterIdentity;
    use trellis_api::model::NetworkSpec;

    use super::*;
    use crate::reconcile::broker;
    use crate::records::encode;

    /// Our NetworkConfig towards `id` over a direct route: state held for a full peer.
    async fn hold_full_peer_state(broker: &Broker, id: &ClusterId) {
        let spec = NetworkSpec::from_proto(
            "spec",
            Some(&pb::NetworkConfigSpec {
                pod_cidr: "10.0.0.0/16".into(),
                external_cidr: "10.1.0.0/16".into(),
                endpoint: "192.0.2.1:51820".into(),
                public_key: "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".into(),
                stateless_wire: false,
            }),
        )
        .expect("spec");
        let out = OutgoingNc {
            remote: ClusterIdentity::parse("remote", id.as_str(), "name", "").expect("identity"),
            via: None,
            forwarder: None,
            spec,
            generation: 1,
            decision: None,
            receiver_generation: 0,
            trace: None,
        };
        broker
            .store()
            .put(&out_key(id), encode(&out).expect("encoded"))
            .await
            .expect("written");
    }

    /// The broker's copy of discovery's records, synced to exactly `records`.
    fn copy_holds(broker: &Broker, records: Vec<pb::ForeignCluster>) {
        broker.ports().discovery().stage(records);
        assert!(broker.foreign_clusters().synced());
    }

    /// Passes read who is wanted from the watch-fed copy, which may lag discovery; a remote
    /// that looks unwanted there is torn down only once discovery confirms it (here discovery
    /// does not answer, so nothing is torn down).
    #[tokio::test]
    async fn a_remote_absent_from_a_lagging_copy_is_not_torn_down_unconfirmed() {
        let broker = broker();
        let id = ClusterId::parse("id", "leaf-b").expect("id");
        hold_full_peer_state(&broker, &id).await;
        copy_holds(&broker, vec![]);
        assert!(pass(&broker, Lane::Full).await.is_err());
        assert!(holds(&broker, &id).await.expect("read"), "torn down");

        // The same for a pass over that remote only, whose copy says it is no peer.
        let not_peered = pb::ForeignCluster {
            identity: Some(pb::ClusterIdentity {
                cluster_id: id.to_string(),
                cluster_name: "name".into(),
            }),
            kind: pb::PeeringKind::Full as i32,
            ..Default::default()
        };
        copy_holds(&broker, vec![not_peered]);
        let ids = BTreeSet::from([id.clone()]);
        assert!(pass_for(&broker, Lane::Full, &ids).await.is_err());
        assert!(holds(&broker, &id).await.expect("read"), "torn down");
    }
}
