//! Exports across an induced mesh, every cluster in process with memory stores and its own
//! endpoints service: hub B and leaves A and C with the same pod CIDR, peered through the
//! brokers (token handshake, NetworkConfigs, the hub's forwarder). A exports a Service with
//! `ExportService`; B imports it from A and passes it on to C, translated for C: the address C
//! uses to reach A directly over their induced peering (asked from A's IPAM), not one of B's
//! external CIDR. Changes and unexport follow. Unpeering A from B removes everything A brought
//! to B (and through B to C) and everything B brought to A. B never passes on, as A's export,
//! an address that does not run in A.

use std::time::Duration;

use ipnet::IpNet;
use trellis_api::pb::endpoints::{
    EndpointPort, ListReflectedSlicesRequest, ReflectEndpointSliceRequest, UnexportServiceRequest,
};
use trellis_api::pb::types;
use trellis_integration::cluster::{InProcessCluster, Options};
use trellis_integration::gate::Hold;
use trellis_integration::peering::unpeer;
use trellis_integration::peering::{eventually, host_at, peer, pod_view, tunnel_to, web_slice};
use trellis_testkit::exports::export_request;

const LIMIT: Duration = Duration::from_secs(60);

/// A held slice: (slice name, service name, [(address, ready)]).
type Held = (String, String, Vec<(String, bool)>);

/// What `cluster` holds from `source`: (slice name, service name, [(address, ready)]), sorted.
async fn held(cluster: &InProcessCluster, source: &str) -> Vec<Held> {
    let mut out: Vec<_> = cluster
        .endpoints()
        .await
        .expect("connects")
        .list_reflected_slices(ListReflectedSlicesRequest {
            source_cluster_id: source.into(),
            namespace: String::new(),
        })
        .await
        .expect("lists")
        .into_inner()
        .reflected_slices
        .into_iter()
        .filter_map(|r| r.slice)
        .map(|s| {
            assert_eq!(s.namespace, "shop");
            assert_eq!(s.ports.first().and_then(|p| p.port), Some(8080));
            let endpoints = s
                .endpoints
                .into_iter()
                .map(|e| {
                    (
                        e.addresses.join(","),
                        e.conditions.and_then(|c| c.ready).unwrap_or(true),
                    )
                })
                .collect();
            (s.name, s.service_name, endpoints)
        })
        .collect();
    out.sort();
    out
}

/// Waits until `cluster` holds exactly `want` from `source`.
async fn until_held(what: &str, cluster: &InProcessCluster, source: &str, want: Vec<Held>) {
    trellis_testkit::eventually_eq(what, LIMIT, want, || held(cluster, source)).await;
}

fn slice(name: &str, service: &str, net: IpNet, hosts: &[(u32, bool)]) -> Held {
    (
        name.into(),
        service.into(),
        hosts
            .iter()
            .map(|(h, ready)| (host_at(net, *h), *ready))
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leafs_export_reaches_the_other_leaf_directly_and_unpeering_removes_what_it_brought() {
    let b = InProcessCluster::start_with_endpoints("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start_with_endpoints("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let c = InProcessCluster::start_with_endpoints("leaf-c", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("c starts");
    peer(&a, &b).await;
    peer(&c, &b).await;
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || tunnel_to(&c, "leaf-a")).await;
    eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    eventually("B's tunnel to C", LIMIT, || tunnel_to(&b, "leaf-c")).await;
    eventually("B's tunnel to A", LIMIT, || tunnel_to(&b, "leaf-a")).await;
    assert_eq!(c_to_a.kind, types::PeeringKind::Induced as i32);
    let c_view_a: IpNet = c_to_a.remote_pod_cidr_nat.parse().expect("cidr");
    let b_view_a = pod_view(&b, "leaf-a").await;
    let a_view_b = pod_view(&a, "hub-b").await;
    let b_external: IpNet = "10.201.0.0/16".parse().expect("cidr");
    assert!(!b_external.contains(&c_view_a.network()));

    // A exports two pods of its own, one not ready yet.
    let mut a_mapper = a.endpoints().await.expect("connects");
    a_mapper
        .export_service(export_request(
            "shop",
            "web",
            &[("10.0.0.7".into(), true), ("10.0.0.8".into(), false)],
        ))
        .await
        .expect("exports");
    until_held(
        "B imports A's export",
        &b,
        "leaf-a",
        vec![slice("web", "web", b_view_a, &[(7, true), (8, false)])],
    )
    .await;
    until_held(
        "C gets A's export through B at its direct view of A",
        &c,
        "hub-b",
        vec![slice(
            "web.leaf-a",
            "web",
            c_view_a,
            &[(7, true), (8, false)],
        )],
    )
    .await;
    // B passes it on to C only, never back to A; C passes nothing on.
    assert_eq!(held(&a, "hub-b").await, vec![]);
    assert_eq!(held(&b, "leaf-c").await, vec![]);

    // Scaling: one more pod, the other one ready now.
    a_mapper
        .export_service(export_request(
            "shop",
            "web",
            &[
                ("10.0.0.7".into(), true),
                ("10.0.0.8".into(), true),
                ("10.0.0.9".into(), true),
            ],
        ))
        .await
        .expect("exports");
    until_held(
        "C follows the scale-up",
        &c,
        "hub-b",
        vec![slice(
            "web.leaf-a",
            "web",
            c_view_a,
            &[(7, true), (8, true), (9, true)],
        )],
    )
    .await;

    // Unexport: gone at B and at C.
    let unexported = a_mapper
        .unexport_service(UnexportServiceRequest {
            namespace: "shop".into(),
            name: "web".into(),
        })
        .await
        .expect("unexports")
        .into_inner();
    assert!(unexported.unexported);
    until_held("B forgets A's export", &b, "leaf-a", vec![]).await;
    until_held("C forgets A's export", &c, "hub-b", vec![]).await;

    // A cannot have B pass on what is not A's: a slice A reflects by hand, labelled as A's
    // export but holding one of B's pods, stays at B.
    let mut evil = web_slice(host_at(a_view_b, 5));
    evil.name = "evil".into();
    evil.ports = vec![EndpointPort {
        port: Some(8080),
        ..Default::default()
    }];
    evil.labels.insert(
        "multicluster.kubernetes.io/source-cluster".into(),
        "leaf-a".into(),
    );
    a_mapper
        .reflect_endpoint_slice(ReflectEndpointSliceRequest {
            target: Some(types::ClusterIdentity {
                cluster_id: "hub-b".into(),
                cluster_name: String::new(),
            }),
            slice: Some(evil),
            deliver: true,
        })
        .await
        .expect("reflects");

    // Exported again by A, and B exports one of its own pods. C gets exactly those: B tried the
    // slice "evil.leaf-a" in the same pass as "web.leaf-a", before it.
    a_mapper
        .export_service(export_request("shop", "web", &[("10.0.0.7".into(), true)]))
        .await
        .expect("exports");
    b.endpoints()
        .await
        .expect("connects")
        .export_service(export_request("shop", "api", &[("10.0.0.5".into(), true)]))
        .await
        .expect("exports");
    until_held(
        "C holds both",
        &c,
        "hub-b",
        vec![
            slice("api", "api", pod_view(&c, "hub-b").await, &[(5, true)]),
            slice("web.leaf-a", "web", c_view_a, &[(7, true)]),
        ],
    )
    .await;
    until_held(
        "A imports B's export",
        &a,
        "hub-b",
        vec![slice("api", "api", a_view_b, &[(5, true)])],
    )
    .await;

    // B unpeers A: B drops what A brought, C loses it through B, A drops what B brought.
    let unpeered = unpeer(&b, "leaf-a").await;
    assert!(unpeered.unpeered);
    until_held("B drops A's import", &b, "leaf-a", vec![]).await;
    until_held(
        "C keeps only B's own export",
        &c,
        "hub-b",
        vec![slice(
            "api",
            "api",
            pod_view(&c, "hub-b").await,
            &[(5, true)],
        )],
    )
    .await;
    until_held("A drops B's export", &a, "hub-b", vec![]).await;

    a.stop().await;
    b.stop().await;
    c.stop().await;
}

/// A leaf's export the hub passes on before the induced path from that leaf to the other one is
/// up (here every relay through the hub is held, so their induced peering waits) takes the hub
/// path; once the path is up the other leaf gets the direct address within a few passes, not at
/// the export's next resend (60 s after the hub's endpoints service started).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_passed_on_before_the_induced_path_moves_to_it_once_the_path_is_up() {
    let relays = Hold::start().await.expect("relay hold");
    let b = InProcessCluster::start_with(
        "hub-b",
        "10.0.0.0/16",
        "10.201.0.0/16",
        Options {
            endpoints: true,
            advertise_forwarder: Some(relays.addr),
            ..Options::default()
        },
    )
    .await
    .expect("b starts");
    let a = InProcessCluster::start_with_endpoints("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let c = InProcessCluster::start_with_endpoints("leaf-c", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("c starts");
    peer(&a, &b).await;
    peer(&c, &b).await;
    eventually("B's tunnel to A", LIMIT, || tunnel_to(&b, "leaf-a")).await;
    eventually("B's tunnel to C", LIMIT, || tunnel_to(&b, "leaf-c")).await;
    a.endpoints()
        .await
        .expect("connects")
        .export_service(export_request("shop", "web", &[("10.0.0.7".into(), true)]))
        .await
        .expect("exports");
    let on_hub_path = eventually("C gets A's export through B", LIMIT, || async {
        held(&c, "hub-b").await.into_iter().next()
    })
    .await;

    relays.release(b.services.forwarder);
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || tunnel_to(&c, "leaf-a")).await;
    eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    let c_view_a: IpNet = c_to_a.remote_pod_cidr_nat.parse().expect("cidr");
    let first: std::net::IpAddr = on_hub_path.2[0].0.parse().expect("an address");
    assert!(
        !c_view_a.contains(&first),
        "{first} was already the direct address ({c_view_a}) while relays were held"
    );
    trellis_testkit::eventually_eq(
        "C moves to its direct view of A well before the next resend",
        Duration::from_secs(20),
        vec![slice("web.leaf-a", "web", c_view_a, &[(7, true)])],
        || held(&c, "hub-b"),
    )
    .await;
}
