//! Unpeering notices (issue 15, item 3), with real service processes on real etcds: an old
//! notice must not undo a later re-peering (neither one held back by a partition nor one
//! already on the wire when the new peering began, nor one naming no peering still on its way),
//! an unpeering whose notice was persisted when the broker crashed is completed on restart, on
//! both sides, a broker restarted on an emptied store learns its peering's ID again, and two
//! brokers unpeering each other at once both deliver their notices.

use std::time::Duration;

use tonic::transport::Channel;
use trellis_api::pb::discovery::ListForeignClustersRequest;
use trellis_api::pb::peering::NotifyUnpeerRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::types::{self as types, ConditionStatus};
use trellis_api::peers::{Condition, UNPEERED_REASON};
use trellis_broker::peering_id::PeeringId;
use trellis_integration::peering::unpeer;
use trellis_integration::peering::{
    eventually, no_tunnel_to, peer, peer_request, token, tunnel_to,
};
use trellis_integration::processes::{Options, ProcessCluster, Service};

const LIMIT: Duration = Duration::from_secs(60);

/// Whether `cluster`'s discovery holds `remote` as an established full peer.
async fn peered_with(cluster: &ProcessCluster, remote: &str) -> bool {
    let list = cluster
        .discovery()
        .await
        .expect("connects")
        .list_foreign_clusters(ListForeignClustersRequest::default())
        .await
        .expect("lists")
        .into_inner()
        .foreign_clusters;
    list.iter().any(|fc| {
        fc.identity.as_ref().is_some_and(|i| i.cluster_id == remote)
            && fc.kind == types::PeeringKind::Full as i32
            && fc.conditions.iter().any(|c| {
                c.r#type == Condition::Peered.as_str() && c.status == ConditionStatus::True as i32
            })
    })
}

/// What `cluster`'s broker stores about `remote` under the key `key_of` names, with the key.
async fn broker_record(
    cluster: &ProcessCluster,
    remote: &str,
    key_of: fn(&trellis_api::ClusterId) -> String,
) -> (String, Option<trellis_store::KeyValue>) {
    let store = cluster
        .store(Service::Broker)
        .await
        .expect("opens the store");
    let key = key_of(&trellis_api::ClusterId::parse("id", remote).expect("id"));
    let kv = store.get(&key).await.expect("reads");
    (key, kv)
}

/// The ID `cluster`'s broker keeps for its current peering with `remote`.
async fn peering_id(cluster: &ProcessCluster, remote: &str) -> PeeringId {
    let (key, kv) = broker_record(cluster, remote, trellis_broker::records::peering_key).await;
    let kv = kv.unwrap_or_else(|| panic!("{} keeps no peering ID for {remote}", cluster.id));
    trellis_store::record::decode(&key, &kv.value).expect("decodes")
}

async fn both_tunnels(a: &ProcessCluster, b: &ProcessCluster) {
    eventually("a's tunnel to b", LIMIT, || tunnel_to(a, &b.id)).await;
    eventually("b's tunnel to a", LIMIT, || tunnel_to(b, &a.id)).await;
}

/// Leaf `a` peered with hub `b` (whose services other clusters reach only through gates when
/// `gated`), with both tunnels up; `None` without etcd (skipped, loudly).
async fn peered_pair(gated: bool) -> Option<(ProcessCluster, ProcessCluster)> {
    peered_pair_gated(false, gated).await
}

/// [`peered_pair`], each side behind gates or not.
async fn peered_pair_gated(
    a_gated: bool,
    b_gated: bool,
) -> Option<(ProcessCluster, ProcessCluster)> {
    let gated = |gated| Options {
        gated,
        ..Options::default()
    };
    let a = ProcessCluster::start_with("leaf-a", "10.0.0.0/16", "10.201.0.0/16", gated(a_gated))
        .await
        .expect("a starts")?;
    let b = ProcessCluster::start_with("hub-b", "10.0.0.0/16", "10.201.0.0/16", gated(b_gated))
        .await
        .expect("b starts")
        .expect("etcd is there");
    peer(&a, &b).await;
    both_tunnels(&a, &b).await;
    Some((a, b))
}

/// `a` unpeers `b` while calls to `b`'s broker hang, so its notice waits at `b`'s gate; then
/// `from` peers with `to`, and the gate opens 2 s later with the handshake under way (a silent
/// partition healing under both calls). The Unpeer must succeed; the Peer's answer is returned.
async fn notice_stalled_while_peering(
    a: &ProcessCluster,
    b: &ProcessCluster,
    from: &ProcessCluster,
    to: &ProcessCluster,
) -> Result<tonic::Response<trellis_api::pb::peering::PeerResponse>, tonic::Status> {
    let gate = b.stall_broker();
    let unpeering = tokio::spawn({
        let mut a = a.broker().await.expect("connects");
        let b = b.id.clone();
        async move {
            a.unpeer(trellis_api::pb::peering::UnpeerRequest { cluster_id: b })
                .await
        }
    });
    eventually("the notice waits at b's gate", LIMIT, || async {
        (gate.stalled() > 0).then_some(())
    })
    .await;
    let peering = tokio::spawn({
        let mut from = from.broker().await.expect("connects");
        let request = peer_request(to, token(to).await);
        async move { from.peer(request).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    b.partition(false);
    let unpeered = unpeering.await.expect("joins");
    assert!(unpeered.is_ok(), "{unpeered:?}");
    peering.await.expect("joins")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_unpeer_notice_does_not_undo_a_later_re_peering() {
    let Some((a, b)) = peered_pair(true).await else {
        return;
    };

    // b is cut off: a's unpeering notice cannot be delivered and stays pending.
    b.partition(true);
    let unpeered = unpeer(&a, &b.id).await;
    assert!(unpeered.unpeered, "{unpeered:?}");
    assert!(peered_with(&b, &a.id).await, "b never heard of it");
    // The operator peers them again (the handshake reaches b's broker on another path), then
    // the partition heals: the old notice must not end the new peering.
    peer(&a, &b).await;
    b.partition(false);
    both_tunnels(&a, &b).await;
    // Several resync periods (2 s) and notice retries later, nothing has undone it.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        peered_with(&b, &a.id).await,
        "an old unpeering notice ended the new peering on b:\n{}",
        a.logs(30)
    );
    assert!(peered_with(&a, &b.id).await);
    assert!(tunnel_to(&b, &a.id).await.is_some(), "b lost its tunnel");
    assert!(tunnel_to(&a, &b.id).await.is_some(), "a lost its tunnel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpeering_persisted_before_a_crash_is_completed_on_both_sides_after_restart() {
    let Some((mut a, b)) = peered_pair(false).await else {
        return;
    };

    // a's broker dies right after Unpeer persisted its intent, the notice, and before it
    // changed anything else: that is what its store holds when it comes back.
    a.kill9(Service::Broker).expect("kill");
    let store = a.store(Service::Broker).await.expect("opens the store");
    let remote = trellis_api::ClusterIdentity::parse("id", &b.id, "name", &b.id).expect("id");
    let pending = trellis_broker::records::PendingNotify {
        remote: remote.clone(),
        broker: b.addr(Service::Broker).to_string(),
        reason: UNPEERED_REASON.into(),
        ca_certificate: String::new(),
        peering_id: Some(peering_id(&a, &b.id).await),
    };
    store
        .put(
            &trellis_broker::records::notify_key(&remote.id),
            trellis_store::record::encode(&pending).expect("encodes"),
        )
        .await
        .expect("writes the notice");
    a.restart(Service::Broker).await.expect("restarts");

    eventually("a no longer peered with b", LIMIT, || async {
        (!peered_with(&a, &b.id).await).then_some(())
    })
    .await;
    eventually("b no longer peered with a", LIMIT, || async {
        (!peered_with(&b, &a.id).await).then_some(())
    })
    .await;
    eventually("both tunnels gone", LIMIT, || async {
        no_tunnel_to(&a, &b.id).await?;
        no_tunnel_to(&b, &a.id).await
    })
    .await;
}

/// A notice already on the wire when the new peering began reaches the receiver after it:
/// the sender can no longer cancel it, so the receiver must see that it ends an earlier
/// peering. The test captures the notice `a` would send (what its store holds while `b` is cut
/// off), lets the re-peering cancel it on `a`, then delivers it to `b` exactly as `a`'s broker
/// would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpeer_notice_on_the_wire_when_a_new_peering_began_does_not_end_it() {
    let Some((a, b)) = peered_pair(true).await else {
        return;
    };
    let first = peering_id(&a, &b.id).await;
    assert_eq!(peering_id(&b, &a.id).await, first, "both sides keep one ID");

    // The notice a sends when it unpeers b, as its store holds it while b is cut off.
    b.partition(true);
    unpeer(&a, &b.id).await;
    let store = a.store(Service::Broker).await.expect("opens the store");
    let b_id = trellis_api::ClusterId::parse("id", &b.id).expect("id");
    let key = trellis_broker::records::notify_key(&b_id);
    let kv = store
        .get(&key)
        .await
        .expect("reads")
        .expect("a keeps the undelivered notice");
    let notice: trellis_broker::records::PendingNotify =
        trellis_store::record::decode(&key, &kv.value).expect("decodes");
    assert_eq!(notice.peering_id.as_ref(), Some(&first));

    // The operator peers them again; the partition heals.
    peer(&a, &b).await;
    b.partition(false);
    both_tunnels(&a, &b).await;
    let second = peering_id(&b, &a.id).await;
    assert_ne!(second, first, "a new peering has a new ID");

    // The old notice arrives now, from a, as a's broker sends it.
    let wire = |id: &PeeringId| NotifyUnpeerRequest {
        identity: Some(trellis_api::pb::types::ClusterIdentity {
            // a's identity, as its broker sends it (processes are named after their ID).
            cluster_id: a.id.clone(),
            cluster_name: a.id.clone(),
        }),
        reason: notice.reason.clone(),
        peering_id: id.to_string(),
    };
    let answer = b
        .broker()
        .await
        .expect("connects")
        .notify_unpeer(wire(&first))
        .await
        .expect("b answers")
        .into_inner();
    assert!(
        !answer.unpeered,
        "b ended the new peering for an old notice"
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        peered_with(&b, &a.id).await,
        "b dropped the new peering:\n{}",
        b.logs(30)
    );
    assert!(tunnel_to(&b, &a.id).await.is_some(), "b lost its tunnel");
    assert!(tunnel_to(&a, &b.id).await.is_some(), "a lost its tunnel");

    // The control: a notice for the current peering still ends it.
    let answer = b
        .broker()
        .await
        .expect("connects")
        .notify_unpeer(wire(&second))
        .await
        .expect("b answers")
        .into_inner();
    assert!(
        answer.unpeered,
        "a notice for the current peering was ignored"
    );
    eventually("b no longer peered with a", LIMIT, || async {
        (!peered_with(&b, &a.id).await).then_some(())
    })
    .await;
}

/// A broker restarted on an emptied store has lost its peering IDs while discovery keeps the
/// peerings: the peer names the ID it keeps in its answer to the NetworkConfig the broker sends
/// it again, and the broker keeps it, so that its unpeering notices name the peering again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restarted_on_an_emptied_store_learns_its_peering_id_again_from_the_peer() {
    let Some((mut a, b)) = peered_pair(false).await else {
        return;
    };
    let first = peering_id(&a, &b.id).await;

    a.kill9(Service::Broker).expect("kill");
    let store = a.store(Service::Broker).await.expect("opens the store");
    for kv in store.list("").await.expect("lists").kvs {
        store.delete(&kv.key).await.expect("deletes");
    }
    a.restart(Service::Broker).await.expect("restarts");
    both_tunnels(&a, &b).await;
    let b_id = trellis_api::ClusterId::parse("id", &b.id).expect("id");
    let key = trellis_broker::records::peering_key(&b_id);
    let learned = eventually("a keeps a peering ID for b again", LIMIT, || async {
        store.get(&key).await.expect("reads")
    })
    .await;
    let learned: PeeringId = trellis_store::record::decode(&key, &learned.value).expect("decodes");
    assert_eq!(learned, first, "a learned another peering's ID");
    assert_eq!(peering_id(&b, &a.id).await, first);
}

/// An unpeering notice that names no peering (from a broker that lost its IDs and has not heard
/// them again, or from a peer built before IDs) would end whichever peering the receiver holds.
/// If it is still on its way (a silent partition heals under it) while a new peering's
/// handshake reaches the receiver by another path, it must arrive before that handshake, never
/// after: the receiver would end the new peering while the sender keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpeer_notice_without_a_peering_id_still_on_its_way_does_not_end_a_new_peering() {
    let Some((a, b)) = peered_pair(true).await else {
        return;
    };

    // a forgets the peering's ID (the exchange is settled, so nothing tells it again).
    let store = a.store(Service::Broker).await.expect("opens the store");
    let b_id = trellis_api::ClusterId::parse("id", &b.id).expect("id");
    let key = trellis_broker::records::peering_key(&b_id);
    assert!(store.delete(&key).await.expect("deletes"));

    // a unpeers b, the notice (naming no peering) waits at b's gate, and a peers b again (the
    // handshake reaches b's broker directly) while it is still on its way.
    let peered = notice_stalled_while_peering(&a, &b, &a, &b).await;
    assert!(peered.is_ok(), "{peered:?}");

    // Notice retries and resyncs (2 s) later, both sides keep the new peering.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        peered_with(&b, &a.id).await,
        "the notice ended the new peering on b while a keeps it:\n{}\n{}",
        a.logs(30),
        b.logs(30)
    );
    assert!(peered_with(&a, &b.id).await);
    both_tunnels(&a, &b).await;
}

/// A peer's unpeering notice still on its way (a silent partition heals under it) while the
/// cluster it unpeered asks to peer again: the notice's sender answers the handshake only once
/// its notice is through, and the handshake's sender must take the notice meanwhile. A broker
/// that held its peering's lock across its own handshake waited for the notice, the notice's
/// sender for the handshake: the handshake timed out (`mesh_chaos`, seed 1796285431427397987).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_sent_while_the_peers_notice_is_on_its_way_waits_for_it_and_succeeds() {
    let Some((a, b)) = peered_pair(true).await else {
        return;
    };
    let first = peering_id(&a, &b.id).await;

    // a unpeers b, the notice waits at b's gate, and b peers a again (b reaches a directly)
    // while it is still on its way.
    let peered = notice_stalled_while_peering(&a, &b, &b, &a).await;
    assert!(
        peered.is_ok(),
        "b's handshake failed: {peered:?}\n{}\n{}",
        a.logs(30),
        b.logs(30)
    );

    // The notice ended the old peering, the handshake began the new one, on both sides.
    eventually("a peered with b again", LIMIT, || async {
        peered_with(&a, &b.id).await.then_some(())
    })
    .await;
    assert!(peered_with(&b, &a.id).await);
    let second = peering_id(&b, &a.id).await;
    assert_ne!(second, first, "b still keeps the old peering");
    assert_eq!(
        peering_id(&a, &b.id).await,
        second,
        "a keeps another peering"
    );
    both_tunnels(&a, &b).await;
}

/// Two brokers unpeer each other at the same moment, each notice held at the other's gate
/// until both gates open together. Each side's handler of the other's notice must get through
/// while its own delivery is on its way: a broker that held the peering's lock across its
/// delivery kept the other's notice waiting for it, both calls waited until they timed out
/// (15 s), and both notices were left for the reconciler to send again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_brokers_unpeering_each_other_at_once_both_deliver_their_notices() {
    let Some((a, b)) = peered_pair_gated(true, true).await else {
        return;
    };
    let gates = [a.stall_broker(), b.stall_broker()];
    let unpeering = |mut from: BrokerClient<Channel>, to: &ProcessCluster| {
        let request = trellis_api::pb::peering::UnpeerRequest {
            cluster_id: to.id.clone(),
        };
        tokio::spawn(async move { from.unpeer(request).await })
    };
    let a_unpeers = unpeering(a.broker().await.expect("connects"), &b);
    let b_unpeers = unpeering(b.broker().await.expect("connects"), &a);
    eventually("both notices wait at the other's gate", LIMIT, || async {
        gates.iter().all(|g| g.stalled() > 0).then_some(())
    })
    .await;
    a.partition(false);
    b.partition(false);
    for (side, unpeered) in [("a", a_unpeers.await), ("b", b_unpeers.await)] {
        let unpeered = unpeered.expect("joins");
        assert!(unpeered.is_ok(), "{side}'s Unpeer failed: {unpeered:?}");
    }

    // Each Unpeer returns once its notice was delivered or given up on: none may be left.
    for (side, remote, cluster) in [("a", &b.id, &a), ("b", &a.id, &b)] {
        let (_, notice) = broker_record(cluster, remote, trellis_broker::records::notify_key).await;
        assert!(
            notice.is_none(),
            "{side}'s notice was not delivered:\n{}\n{}",
            a.logs(30),
            b.logs(30)
        );
    }
    assert!(!peered_with(&a, &b.id).await);
    assert!(!peered_with(&b, &a.id).await);
}
