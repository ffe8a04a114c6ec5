//! Peerings that fail for a while converge once the cause is gone, and a teardown leaves
//! nothing behind (issue 15, items 2 and 5): a NetworkConfig the hub could not map for want of
//! a free range converges when a range is freed; WireGuard ports handed out for clusters that
//! never got a tunnel go back to the range; an IPAM mapping whose teardown failed (the IPAM was
//! down) or that nothing holds any more is freed by the broker's reconciliation.
//!
//! In process with memory stores, except the IPAM outage, which needs the IPAM's state to
//! survive a restart: real processes on real etcd (skipped loudly without etcd, failing in CI).

use std::time::Duration;

use tonic::Code;
use trellis_api::pb::gateway::GetGatewayInfoRequest;
use trellis_api::pb::ipam::{GetSubnetsPerClusterRequest, ListClusterSubnetsRequest};
use trellis_api::pb::peering::ListNetworkConfigsRequest;
use trellis_api::pb::types::{self as types, NetworkConfig, TunnelEndpoint};
use trellis_integration::cluster::{InProcessCluster, Options};
use trellis_integration::peering::{self, answered_tunnel_to, eventually, peer, tunnel_to};
use trellis_integration::processes::{ProcessCluster, Service};

/// Generous: the broker backs off up to 10 s between retries of one remote.
const LIMIT: Duration = Duration::from_secs(90);

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

/// The NetworkConfig `origin` sent to `cluster`, as `cluster`'s broker holds it.
async fn incoming(cluster: &InProcessCluster, origin: &str) -> Option<NetworkConfig> {
    cluster
        .broker()
        .await
        .ok()?
        .list_network_configs(ListNetworkConfigsRequest {
            cluster_id: origin.into(),
        })
        .await
        .ok()?
        .into_inner()
        .network_configs
        .into_iter()
        .find(|nc| nc.origin.as_ref().is_some_and(|o| o.cluster_id == origin))
}

/// The remote cluster IDs `cluster`'s IPAM holds a mapping for.
async fn mapped(
    ipam: &mut trellis_api::pb::ipam::ipam_client::IpamClient<tonic::transport::Channel>,
) -> Option<Vec<String>> {
    Some(
        ipam.list_cluster_subnets(ListClusterSubnetsRequest {})
            .await
            .ok()?
            .into_inner()
            .clusters
            .into_iter()
            .map(|c| c.cluster_id)
            .collect(),
    )
}

async fn unpeer(cluster: &impl peering::Peerable, remote: &str) {
    let answer = peering::unpeer(cluster, remote).await;
    assert!(
        answer.unpeered,
        "{} was peered with {remote}",
        cluster.cluster_id()
    );
}

/// Both ends hold a TunnelEndpoint for each other, each one's view of the other being what the
/// other learned as its local NAT.
fn assert_consistent(x_to_y: &TunnelEndpoint, y_to_x: &TunnelEndpoint) {
    assert_eq!(x_to_y.local_pod_cidr_nat, y_to_x.remote_pod_cidr_nat);
    assert_eq!(x_to_y.remote_pod_cidr_nat, y_to_x.local_pod_cidr_nat);
    assert_eq!(
        x_to_y.local_external_cidr_nat,
        y_to_x.remote_external_cidr_nat
    );
    assert_eq!(
        x_to_y.remote_external_cidr_nat,
        y_to_x.local_external_cidr_nat
    );
}

/// Item 2: the hub has a single /16 to remap into and both leaves use the hub's own pod CIDR.
/// The first leaf takes the range; the second one's NetworkConfig cannot be mapped. That is a
/// transient condition: once the first leaf unpeers and its range is freed, the second peering
/// converges without anyone touching it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peering_refused_for_want_of_a_free_range_converges_once_one_is_freed() {
    let hub = InProcessCluster::start_with(
        "hub",
        "10.0.0.0/16",
        "10.200.0.0/16",
        Options {
            induced: false,
            ipam_flags: strings(&["--pools", "10.99.0.0/16"]),
            ..Options::default()
        },
    )
    .await
    .expect("hub starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let c = InProcessCluster::start("leaf-c", "10.0.0.0/16", "10.202.0.0/16")
        .await
        .expect("c starts");

    peer(&a, &hub).await;
    let hub_to_a = eventually("the hub's tunnel to A", LIMIT, || tunnel_to(&hub, "leaf-a")).await;
    assert_eq!(hub_to_a.remote_pod_cidr_nat, "10.99.0.0/16");

    peer(&c, &hub).await;
    let pending = eventually(
        "C's network config held undecided by the hub",
        LIMIT,
        || async {
            incoming(&hub, "leaf-c").await.filter(|nc| {
                nc.status.as_ref().is_some_and(|s| {
                    s.state != types::NetworkConfigState::Processed as i32
                        && s.message.contains("no free")
                })
            })
        },
    )
    .await;
    let status = pending.status.expect("a status");
    assert_eq!(
        status.state,
        types::NetworkConfigState::Pending as i32,
        "no free range is a reason to wait, not a refusal: {status:?}"
    );
    assert!(
        answered_tunnel_to(&hub, "leaf-c")
            .await
            .expect("the hub's broker answers")
            .is_none()
    );
    assert!(
        answered_tunnel_to(&c, "hub")
            .await
            .expect("C's broker answers")
            .is_none()
    );

    unpeer(&a, "hub").await;
    let hub_to_c = eventually("the hub's tunnel to C", LIMIT, || tunnel_to(&hub, "leaf-c")).await;
    let c_to_hub = eventually("C's tunnel to the hub", LIMIT, || tunnel_to(&c, "hub")).await;
    assert_eq!(hub_to_c.remote_pod_cidr_nat, "10.99.0.0/16");
    assert_consistent(&hub_to_c, &c_to_hub);
    assert!(
        answered_tunnel_to(&hub, "leaf-a")
            .await
            .expect("the hub's broker answers")
            .is_none()
    );

    a.stop().await;
    c.stop().await;
    hub.stop().await;
}

/// Item 5: ports handed out by GetGatewayInfo for clusters that never get a tunnel (here made-up
/// IDs) go back to the range after the grace period, so they cannot keep a real peering from
/// getting one; a port bound to a tunnel stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ports_handed_out_for_clusters_without_a_tunnel_are_released_after_the_grace_period() {
    let hub = InProcessCluster::start_with(
        "hub",
        "10.0.0.0/16",
        "10.200.0.0/16",
        Options {
            gateway_flags: strings(&[
                "--wireguard-ports",
                "51900-51907",
                "--unused-port-grace",
                "2",
            ]),
            ..Options::default()
        },
    )
    .await
    .expect("hub starts");
    let a = InProcessCluster::start("leaf-a", "10.1.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");

    let gateway = hub.gateway().await.expect("connects to the gateway");
    let info = |id: String| {
        let mut gateway = gateway.clone();
        async move {
            gateway
                .get_gateway_info(GetGatewayInfoRequest { cluster_id: id })
                .await
                .map(tonic::Response::into_inner)
        }
    };
    for i in 0..8 {
        info(format!("bogus-{i}")).await.expect("a port is free");
    }
    let err = info("bogus-8".into())
        .await
        .expect_err("8 ports, 9 clusters");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");

    peer(&a, &hub).await;
    let a_to_hub = eventually("A's tunnel to the hub", LIMIT, || tunnel_to(&a, "hub")).await;
    let hub_to_a = eventually("the hub's tunnel to A", LIMIT, || tunnel_to(&hub, "leaf-a")).await;
    assert_consistent(&a_to_hub, &hub_to_a);
    let port = a_to_hub
        .remote_endpoint
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .expect("the hub's endpoint has a port");
    assert!((51900..=51907).contains(&port), "{port}");

    // The seven other ports went back to the range; the tunnel's port did not.
    for i in 0..7 {
        info(format!("later-{i}"))
            .await
            .expect("the made-up clusters' ports were released");
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again = info("leaf-a".into()).await.expect("leaf-a keeps its port");
    assert_eq!(again.listen_port, u32::from(port));

    a.stop().await;
    hub.stop().await;
}

/// Item 5: the broker frees IPAM mappings that no peering holds (left by an earlier failure,
/// an allocation racing a teardown, or an operator's call), and keeps those of its peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipam_mappings_of_clusters_that_are_not_peers_are_freed_by_the_broker() {
    let hub = InProcessCluster::start("hub", "10.0.0.0/16", "10.200.0.0/16")
        .await
        .expect("hub starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    peer(&a, &hub).await;
    eventually("the hub's tunnel to A", LIMIT, || tunnel_to(&hub, "leaf-a")).await;

    let mut ipam = hub.ipam().await.expect("connects to the IPAM");
    ipam.get_subnets_per_cluster(GetSubnetsPerClusterRequest {
        cluster_id: "ghost".into(),
        cluster_name: String::new(),
        pod_cidr: "10.0.0.0/16".into(),
        external_cidr: "10.203.0.0/16".into(),
    })
    .await
    .expect("maps a cluster nobody peers with");
    eventually("the ghost's mapping freed", LIMIT, || {
        let mut ipam = ipam.clone();
        async move {
            let ids = mapped(&mut ipam).await?;
            (!ids.iter().any(|id| id == "ghost")).then_some(ids)
        }
    })
    .await;
    let ids = mapped(&mut ipam).await.expect("lists");
    assert_eq!(ids, ["leaf-a"], "the peer's mapping stays");
    assert!(tunnel_to(&hub, "leaf-a").await.is_some());

    a.stop().await;
    hub.stop().await;
}

/// Item 5: the hub's IPAM is down when the leaf unpeers. The teardown cannot free the mapping
/// then; once the IPAM is back, it does (the broker keeps what it needs to retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpeering_while_the_ipam_is_down_frees_the_mapping_once_it_is_back() {
    let Some(a) = ProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts")
    else {
        return;
    };
    let Some(mut hub) = ProcessCluster::start("hub", "10.0.0.0/16", "10.200.0.0/16")
        .await
        .expect("hub starts")
    else {
        return;
    };
    peer(&a, &hub).await;
    eventually("the hub's tunnel to A", LIMIT, || tunnel_to(&hub, "leaf-a")).await;
    eventually("A's tunnel to the hub", LIMIT, || tunnel_to(&a, "hub")).await;

    hub.kill9(Service::Ipam).expect("kills the hub's IPAM");
    unpeer(&a, "hub").await;
    // The hub learned of the unpeering: its tunnel goes at once, IPAM or not.
    eventually("the hub's tunnel to A gone", LIMIT, || async {
        peering::tunnels(&hub)
            .await
            .ok()
            .filter(|t| t.is_empty())
            .map(|_| ())
    })
    .await;
    // Several resyncs with the IPAM down.
    tokio::time::sleep(Duration::from_secs(5)).await;
    hub.restart(Service::Ipam).await.expect("the IPAM restarts");

    let ipam = hub.ipam().await.expect("connects to the IPAM");
    eventually("the hub's mapping of A freed", LIMIT, || {
        let mut ipam = ipam.clone();
        async move { mapped(&mut ipam).await?.is_empty().then_some(()) }
    })
    .await;
    let mut a_ipam = a.ipam().await.expect("connects to A's IPAM");
    eventually("A's mapping of the hub freed", LIMIT, || {
        let mut ipam = a_ipam.clone();
        async move { mapped(&mut ipam).await?.is_empty().then_some(()) }
    })
    .await;
    assert_eq!(mapped(&mut a_ipam).await, Some(vec![]));
}
