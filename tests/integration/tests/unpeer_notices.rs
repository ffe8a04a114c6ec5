//! Unpeering notices (issue 15, item 3), with real service processes on real etcds: an old
//! notice must not undo a later re-peering, and an unpeering whose notice was persisted when
//! the broker crashed is completed on restart, on both sides.

use std::time::Duration;

use trellis_api::pb::discovery::ListForeignClustersRequest;
use trellis_api::pb::peering::UnpeerRequest;
use trellis_api::pb::types::{self as types, ConditionStatus};
use trellis_integration::peering::{eventually, peer, tunnel_to};
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
            && fc
                .conditions
                .iter()
                .any(|c| c.r#type == "Peered" && c.status == ConditionStatus::True as i32)
    })
}

async fn both_tunnels(a: &ProcessCluster, b: &ProcessCluster) {
    eventually("a's tunnel to b", LIMIT, || tunnel_to(a, &b.id)).await;
    eventually("b's tunnel to a", LIMIT, || tunnel_to(b, &a.id)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_unpeer_notice_does_not_undo_a_later_re_peering() {
    let Some(a) = ProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts")
    else {
        return;
    };
    let gated = Options {
        gated: true,
        ..Options::default()
    };
    let b = ProcessCluster::start_with("hub-b", "10.0.0.0/16", "10.201.0.0/16", gated)
        .await
        .expect("b starts")
        .expect("etcd is there");
    peer(&a, &b).await;
    both_tunnels(&a, &b).await;

    // b is cut off: a's unpeering notice cannot be delivered and stays pending.
    b.partition(true);
    let unpeered = a
        .broker()
        .await
        .expect("connects")
        .unpeer(UnpeerRequest {
            cluster_id: b.id.clone(),
        })
        .await
        .expect("unpeers")
        .into_inner();
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
    let Some(mut a) = ProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts")
    else {
        return;
    };
    let b = ProcessCluster::start("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts")
        .expect("etcd is there");
    peer(&a, &b).await;
    both_tunnels(&a, &b).await;

    // a's broker dies right after Unpeer persisted its intent, the notice, and before it
    // changed anything else: that is what its store holds when it comes back.
    a.kill9(Service::Broker).expect("kill");
    let store = trellis_store::open(
        &a.etcd(Service::Broker)
            .expect("etcd")
            .url(&a.store_prefix(Service::Broker)),
    )
    .await
    .expect("opens a's broker store");
    let remote = trellis_api::ClusterIdentity::parse("id", &b.id, "name", &b.id).expect("id");
    let pending = trellis_broker::records::PendingNotify {
        remote: remote.clone(),
        broker: b.addr(Service::Broker).to_string(),
        reason: "Unpeered".into(),
        ca_certificate: String::new(),
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
        (tunnel_to(&a, &b.id).await.is_none() && tunnel_to(&b, &a.id).await.is_none()).then_some(())
    })
    .await;
}
