//! Endpoint reflection over a real induced peering: hub B and leaves A and C with the same pod
//! CIDR, peered through the brokers (token handshake, NetworkConfigs, the hub's forwarder), each
//! cluster in process with memory stores. B's endpoints service reflects a slice whose endpoint
//! runs in A to C; the address must be the one C uses to reach A directly (C's remap of A, as
//! A's IPAM learned it from the induced NetworkConfig status), not one of B's external CIDR.

use std::time::Duration;

use ipnet::IpNet;
use trellis_api::pb::endpoints::{ReflectEndpointSliceRequest, TranslationPath};
use trellis_api::pb::types::{self as types, ClusterIdentity};
use trellis_integration::cluster::InProcessCluster;
use trellis_integration::peering::{eventually, host_at, peer, pod_view, tunnel_to, web_slice};

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_in_a_reflected_by_the_hub_to_c_is_reached_directly() {
    let b = InProcessCluster::start_with_endpoints("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let c = InProcessCluster::start("leaf-c", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("c starts");
    let mut mapper = b.endpoints().await.expect("connects");
    peer(&a, &b).await;
    peer(&c, &b).await;
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || tunnel_to(&c, "leaf-a")).await;
    eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    eventually("B's tunnel to C", LIMIT, || tunnel_to(&b, "leaf-c")).await;
    assert_eq!(c_to_a.kind, types::PeeringKind::Induced as i32);

    // A pod running in A at home IP 10.0.0.7, as B addresses it.
    let b_view_a = pod_view(&b, "leaf-a").await;
    let c_view_a: IpNet = c_to_a.remote_pod_cidr_nat.parse().expect("cidr");
    assert_eq!(c_view_a, pod_view(&c, "leaf-a").await);
    let answer = mapper
        .reflect_endpoint_slice(ReflectEndpointSliceRequest {
            target: Some(ClusterIdentity {
                cluster_id: "leaf-c".into(),
                cluster_name: String::new(),
            }),
            slice: Some(web_slice(host_at(b_view_a, 7))),
            deliver: false,
        })
        .await
        .expect("reflects")
        .into_inner();
    let t = &answer.translations[0];
    assert_eq!(t.path, TranslationPath::Induced as i32, "{t:?}");
    assert_eq!(
        t.translated_address,
        host_at(c_view_a, 7),
        "C's direct view of A"
    );

    // A pod of B itself: through C's view of B's pod CIDR, as the tunnel says.
    let c_to_b = tunnel_to(&c, "hub-b").await.expect("tunnel");
    let c_view_b: IpNet = c_to_b.remote_pod_cidr_nat.parse().expect("cidr");
    let answer = mapper
        .reflect_endpoint_slice(ReflectEndpointSliceRequest {
            target: Some(ClusterIdentity {
                cluster_id: "leaf-c".into(),
                cluster_name: String::new(),
            }),
            slice: Some(web_slice("10.0.0.9".into())),
            deliver: false,
        })
        .await
        .expect("reflects")
        .into_inner();
    assert_eq!(
        answer.translations[0].path,
        TranslationPath::LocalNat as i32
    );
    assert_eq!(
        answer.translations[0].translated_address,
        host_at(c_view_b, 9)
    );
}
