//! The mesh converges again after a peer fails or comes back (issue 15, item 1), with real
//! service processes on real etcds: a leaf unpeered and re-peered by the hub while the third
//! leaf is cut off, and a broker restarted on an empty store. Each ends with the induced
//! tunnel back on both ends with consistent views.

use std::time::Duration;

use trellis_api::pb::types;
use trellis_integration::peering::unpeer;
use trellis_integration::peering::{eventually, no_tunnel_to, peer, tunnel_to};
use trellis_integration::processes::{Options, ProcessCluster, Service};

const LIMIT: Duration = Duration::from_secs(90);

/// Waits until `a` and `c` hold induced tunnels to each other whose views agree.
async fn induced_pair(a: &ProcessCluster, c: &ProcessCluster, what: &str) {
    eventually(what, LIMIT, || async {
        let ac = tunnel_to(a, &c.id).await?;
        let ca = tunnel_to(c, &a.id).await?;
        (ac.kind == types::PeeringKind::Induced as i32
            && ca.kind == types::PeeringKind::Induced as i32
            && ac.local_pod_cidr_nat == ca.remote_pod_cidr_nat
            && ca.local_pod_cidr_nat == ac.remote_pod_cidr_nat
            && ac.remote_public_key != ca.remote_public_key)
            .then_some(())
    })
    .await;
}

async fn start(id: &str, gated: bool) -> Option<ProcessCluster> {
    let options = Options {
        gated,
        ..Options::default()
    };
    ProcessCluster::start_with(id, "10.0.0.0/16", "10.201.0.0/16", options)
        .await
        .unwrap_or_else(|e| panic!("{id} starts: {e:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaf_unpeered_and_re_peered_while_the_third_is_cut_off_gets_its_tunnel_back() {
    let Some(b) = start("hub", false).await else {
        return;
    };
    let a = start("leaf-a", false).await.expect("etcd");
    let c = start("leaf-c", true).await.expect("etcd");
    peer(&a, &b).await;
    peer(&c, &b).await;
    induced_pair(&a, &c, "the first induced tunnel").await;

    // C is cut off from everyone; meanwhile the hub unpeers A and A peers again.
    c.partition(true);
    unpeer(&b, &a.id).await;
    eventually("A drops its tunnel to C", LIMIT, || async {
        no_tunnel_to(&a, &c.id).await
    })
    .await;
    peer(&a, &b).await;
    eventually("A's full tunnel to the hub again", LIMIT, || {
        tunnel_to(&a, &b.id)
    })
    .await;
    c.partition(false);
    induced_pair(
        &a,
        &c,
        "the induced tunnel back on both ends after the partition",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restarted_on_an_empty_store_gets_every_tunnel_back() {
    let Some(b) = start("hub", false).await else {
        return;
    };
    let mut a = start("leaf-a", false).await.expect("etcd");
    let c = start("leaf-c", false).await.expect("etcd");
    peer(&a, &b).await;
    peer(&c, &b).await;
    induced_pair(&a, &c, "the first induced tunnel").await;
    let before = tunnel_to(&c, &a.id).await.expect("C's tunnel to A");

    // A's broker loses its whole store (a rebuilt etcd) and comes back.
    a.kill9(Service::Broker).expect("kill");
    let keys = a.wipe_store(Service::Broker).await;
    assert!(!keys.is_empty(), "the broker kept nothing?");
    a.restart(Service::Broker).await.expect("restarts");

    induced_pair(&a, &c, "the induced tunnel back on both ends").await;
    eventually("A's full tunnel to the hub back", LIMIT, || {
        tunnel_to(&a, &b.id)
    })
    .await;
    eventually("the hub's tunnel to A back", LIMIT, || tunnel_to(&b, &a.id)).await;
    let after = tunnel_to(&c, &a.id).await.expect("C's tunnel to A");
    assert_eq!(
        after.remote_public_key, before.remote_public_key,
        "A's gateway key did not change; only its broker forgot"
    );
}
