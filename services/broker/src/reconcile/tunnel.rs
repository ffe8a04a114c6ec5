//! The TunnelEndpoint of a remote, what the gateway builds the tunnel from: written once both
//! NetworkConfigs are decided over the same route, and removed first when the remote is torn
//! down, leaving a tombstone so that watchers see the deletion with its last content.

use trellis_api::ClusterId;
use trellis_api::model::TunnelEndpoint;
use trellis_error::{Error, Result};
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
    if !committed.succeeded {
        // Someone wrote the record since we read it: the candidate refresh, most likely. The
        // pass retries a failed remote, and the retry merges again over what is there now; an
        // Ok here would leave the record as it was until the next thing that wakes this remote,
        // which for a settled exchange may be never.
        return Err(Error::Aborted(
            "the tunnel endpoint changed concurrently".into(),
        ));
    }
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
    Ok(())
}

/// Deletes the TunnelEndpoint of `id`, leaving a tombstone for watchers.
pub(super) async fn remove_tunnel(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let Some(kv) = store.get(&tunnel_key(id)).await? else {
        return Ok(());
    };
    let committed = store
        .txn(
            Txn::new()
                .when(Compare::mod_revision(tunnel_key(id), kv.mod_revision))
                .then(Op::delete(tunnel_key(id)))
                .then(Op::put(tombstone_key(id), kv.value)),
        )
        .await?;
    if !committed.succeeded {
        // Changed since we read it (the candidate refresh): the teardown stops here and is
        // retried, or it would go on to remove the NetworkConfigs, and with them the last sign
        // that this record is held, leaving the gateway a tunnel nobody removes.
        return Err(Error::Aborted(
            "the tunnel endpoint changed concurrently".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use trellis_api::ClusterIdentity;
    use trellis_api::model::{NatView, NetworkSpec, WgKey};
    use trellis_store::counted::Counted;
    use trellis_store::{MemoryStore, SharedStore};

    use super::*;
    use crate::records::IncomingNc;

    fn identity(id: &str) -> ClusterIdentity {
        ClusterIdentity::parse("id", id, "name", id).expect("identity")
    }

    fn spec(endpoint: &str, key: u8) -> NetworkSpec {
        NetworkSpec {
            pod_cidr: "10.0.0.0/16".parse().expect("net"),
            external_cidr: "10.201.0.0/16".parse().expect("net"),
            endpoint: endpoint.parse().expect("endpoint"),
            public_key: WgKey::from_bytes([key; 32]),
            stateless_wire: false,
        }
    }

    fn view() -> NatView {
        NatView {
            pod_cidr_nat: "10.1.0.0/16".parse().expect("net"),
            external_cidr_nat: "10.2.0.0/16".parse().expect("net"),
        }
    }

    fn processed(observed_generation: i64) -> Decision {
        Decision::Processed {
            view: view(),
            observed_generation,
        }
    }

    async fn tunnel(store: &SharedStore, id: &ClusterId) -> TunnelEndpoint {
        let kv = store
            .get(&tunnel_key(id))
            .await
            .expect("get")
            .expect("a tunnel endpoint");
        decode(&tunnel_key(id), &kv.value).expect("decode")
    }

    /// A leaf C holds an induced TunnelEndpoint for A; A's gateway moves, and A's new
    /// NetworkConfig arrives while the candidate refresh writes the hub's view of A (its new
    /// address) into the same record. The TunnelEndpoint must end up with A's new endpoint:
    /// losing the race may fail this write (the pass retries a failed remote), but never
    /// silently, as it did when the lab saw C send to A's old address for minutes.
    #[tokio::test]
    async fn a_new_endpoint_is_not_lost_to_a_concurrent_candidate_refresh() {
        // The candidate refresh's write lands between our read and our compare-and-put.
        let interleaved = Arc::new(Counted::new(Arc::new(MemoryStore::new())));
        let store: SharedStore = interleaved.clone();
        let broker = crate::reconcile::broker_on(store.clone());
        let a = identity("leaf-a");
        let hub = Some(identity("hub"));
        let out = OutgoingNc {
            remote: a.clone(),
            via: hub.clone(),
            forwarder: Some("192.0.2.2:7103".into()),
            spec: spec("192.0.2.3:51840", 3),
            generation: 7,
            decision: Some(processed(7)),
            receiver_generation: 0,
            trace: None,
        };
        store
            .put(&out_key(&a.id), encode(&out).expect("encode"))
            .await
            .expect("put");
        let mut incoming = IncomingNc {
            remote: a.clone(),
            via: hub,
            spec: spec("192.0.2.1:51840", 1),
            generation: 11,
            decision: processed(11),
        };
        store
            .put(&in_key(&a.id), encode(&incoming).expect("encode"))
            .await
            .expect("put");
        write_tunnel(&broker, &a.id).await.expect("first write");
        let first = tunnel(&store, &a.id).await;
        assert_eq!(first.remote_endpoint.to_string(), "192.0.2.1:51840");

        // A moved: its new NetworkConfig is decided, and the hub already sees A there.
        let moved: SocketAddr = "192.0.2.128:51840".parse().expect("addr");
        incoming.spec = spec(&moved.to_string(), 1);
        incoming.generation = 12;
        incoming.decision = processed(12);
        store
            .put(&in_key(&a.id), encode(&incoming).expect("encode"))
            .await
            .expect("put");
        let mut refreshed = first.clone();
        refreshed.remote_candidates = vec![moved];
        refreshed.generation += 1;
        interleaved.interleave(&tunnel_key(&a.id), encode(&refreshed).expect("encode"));

        let raced = write_tunnel(&broker, &a.id).await;
        let now = tunnel(&store, &a.id).await;
        if now.remote_endpoint.to_string() != moved.to_string() {
            // Lost the race: only an error makes the pass retry this remote.
            let err = raced.expect_err("the new endpoint was dropped without an error");
            assert!(
                matches!(err, trellis_error::Error::Aborted(_)),
                "not a conflict: {err}"
            );
            write_tunnel(&broker, &a.id).await.expect("the retry");
        }
        let now = tunnel(&store, &a.id).await;
        assert_eq!(now.remote_endpoint.to_string(), moved.to_string());
        assert_eq!(
            now.remote_candidates,
            vec![moved],
            "the refresh's candidates kept"
        );
        assert!(now.generation > refreshed.generation, "{now:?}");
    }

    /// The TunnelEndpoint uses the stateless wire convention once both NetworkConfigs offer
    /// it, and drops it, with a new generation for the gateway to apply, as soon as either
    /// side withdraws the offer (a gateway restarted without it).
    #[tokio::test]
    async fn the_tunnel_follows_both_sides_offers_of_the_stateless_wire() {
        let store: SharedStore = Arc::new(MemoryStore::new());
        let broker = crate::reconcile::broker_on(store.clone());
        let a = identity("leaf-a");
        let offering = |endpoint: &str, key: u8, offer: bool| NetworkSpec {
            stateless_wire: offer,
            ..spec(endpoint, key)
        };
        let out = |offer: bool| OutgoingNc {
            remote: a.clone(),
            via: None,
            forwarder: None,
            spec: offering("192.0.2.3:51840", 3, offer),
            generation: 7,
            decision: Some(processed(7)),
            receiver_generation: 0,
            trace: None,
        };
        let incoming = |offer: bool| IncomingNc {
            remote: a.clone(),
            via: None,
            spec: offering("192.0.2.1:51840", 1, offer),
            generation: 11,
            decision: processed(11),
        };
        let mut last: Option<TunnelEndpoint> = None;
        for (ours, theirs, expected) in [
            (true, false, false),
            (true, true, true),
            (true, false, false),
            (false, true, false),
        ] {
            store
                .put(&out_key(&a.id), encode(&out(ours)).expect("encode"))
                .await
                .expect("put");
            store
                .put(&in_key(&a.id), encode(&incoming(theirs)).expect("encode"))
                .await
                .expect("put");
            write_tunnel(&broker, &a.id).await.expect("write");
            let te = tunnel(&store, &a.id).await;
            assert_eq!(te.stateless_wire, expected, "ours {ours}, theirs {theirs}");
            if let Some(last) = last.filter(|l| l.stateless_wire != te.stateless_wire) {
                assert!(te.generation > last.generation, "no new generation: {te:?}");
            }
            last = Some(te);
        }
    }

    /// A teardown that races the candidate refresh must not report the TunnelEndpoint gone
    /// while it is still there: the teardown removes the NetworkConfigs next, and a record left
    /// behind then would keep a tunnel to a remote nothing holds any more.
    #[tokio::test]
    async fn a_removal_racing_a_candidate_refresh_is_not_reported_done() {
        // The candidate refresh's write lands between our read and our compare-and-put.
        let interleaved = Arc::new(Counted::new(Arc::new(MemoryStore::new())));
        let store: SharedStore = interleaved.clone();
        let broker = crate::reconcile::broker_on(store.clone());
        let a = identity("leaf-a");
        let mut record = TunnelEndpoint::merge(
            a.clone(),
            Some(identity("hub")),
            (&spec("192.0.2.3:51840", 3), view()),
            (&spec("192.0.2.1:51840", 1), view()),
            1,
        );
        store
            .put(&tunnel_key(&a.id), encode(&record).expect("encode"))
            .await
            .expect("put");
        record.remote_candidates = vec!["192.0.2.128:51840".parse().expect("addr")];
        record.generation += 1;
        interleaved.interleave(&tunnel_key(&a.id), encode(&record).expect("encode"));

        let raced = remove_tunnel(&broker, &a.id).await;
        let left = store.get(&tunnel_key(&a.id)).await.expect("get");
        if left.is_some() {
            let err = raced.expect_err("reported removed while still there");
            assert!(
                matches!(err, trellis_error::Error::Aborted(_)),
                "not a conflict: {err}"
            );
            remove_tunnel(&broker, &a.id).await.expect("the retry");
        }
        assert!(store.get(&tunnel_key(&a.id)).await.expect("get").is_none());
        assert!(
            store
                .get(&tombstone_key(&a.id))
                .await
                .expect("get")
                .is_some(),
            "watchers see the deletion"
        );
    }
}
