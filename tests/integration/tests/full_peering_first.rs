//! Full peerings first (issue 17): work for a full peering is never queued behind induced
//! work. In process with memory stores: a hub whose forwarder holds every relay (a
//! [`Hold`] in front of it, advertised as the forwarder), so the induced exchanges of a
//! joining leaf stay in flight; the leaf's full tunnel with the hub must still be written,
//! before any of those relays has been given up on. Then the relays are let through and the
//! induced pair converges.

use std::time::Duration;

use trellis_api::pb::peering::ListRelaysRequest;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_integration::cluster::{InProcessCluster, Options};
use trellis_integration::gate::Hold;
use trellis_integration::peering::{eventually, peer, tunnel_to};

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaf_joining_a_hub_busy_with_induced_relays_gets_its_full_tunnel_first() {
    // Every relay through the hub is held until the end of the test.
    let relays = Hold::start().await.expect("relay hold");
    // The hub's calls to leaf-l's broker are held until leaf-l's induced relays are in flight,
    // so the hub's NetworkConfig reaches leaf-l while leaf-l waits on those relays.
    let to_l = Hold::start().await.expect("broker hold");
    let hub = InProcessCluster::start_with(
        "hub",
        "10.0.0.0/16",
        "10.201.0.0/16",
        Options {
            advertise_forwarder: Some(relays.addr),
            ..Options::default()
        },
    )
    .await
    .expect("hub starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.202.0.0/16")
        .await
        .expect("leaf-a starts");
    let l = InProcessCluster::start_with(
        "leaf-l",
        "10.0.0.0/16",
        "10.203.0.0/16",
        Options {
            advertise_broker: Some(to_l.addr),
            ..Options::default()
        },
    )
    .await
    .expect("leaf-l starts");

    peer(&a, &hub).await;
    eventually("leaf-a's tunnel to the hub", LIMIT, || tunnel_to(&a, "hub")).await;
    eventually("the hub's tunnel to leaf-a", LIMIT, || {
        tunnel_to(&hub, "leaf-a")
    })
    .await;
    assert_eq!(relays.requests(), 0, "one leaf: nothing to relay yet");

    peer(&l, &hub).await;
    // leaf-a and leaf-l are introduced to each other and both relay their NetworkConfig
    // through the hub: two requests held, neither given up on.
    eventually("both induced relays in flight", LIMIT, || async {
        (relays.requests() >= 2).then_some(())
    })
    .await;
    to_l.release(l.services.broker);

    eventually("leaf-l's tunnel to the hub", LIMIT, || tunnel_to(&l, "hub")).await;
    eventually("the hub's tunnel to leaf-l", LIMIT, || {
        tunnel_to(&hub, "leaf-l")
    })
    .await;
    assert_eq!(
        relays.cancelled(),
        0,
        "the full tunnel waited until an induced relay was given up on ({} relay requests held)",
        relays.requests()
    );
    assert!(tunnel_to(&l, "leaf-a").await.is_none(), "relays are held");
    let mut forwarder = ForwarderClient::connect(format!("http://{}", hub.services.forwarder))
        .await
        .expect("forwarder");
    let held = forwarder
        .list_relays(ListRelaysRequest::default())
        .await
        .expect("lists relays")
        .into_inner();
    assert!(
        held.relays.is_empty(),
        "nothing reached the forwarder: {held:?}"
    );

    // Let the relays through: the induced pair converges.
    relays.release(hub.services.forwarder);
    eventually("leaf-l's tunnel to leaf-a", LIMIT, || {
        tunnel_to(&l, "leaf-a")
    })
    .await;
    eventually("leaf-a's tunnel to leaf-l", LIMIT, || {
        tunnel_to(&a, "leaf-l")
    })
    .await;
}
