//! ReflectEndpointSlice against real in-process IPAMs and discoveries (hub B, leaves A and C,
//! all with pod CIDR 10.0.0.0/16): every translation path, the fallback when the home
//! cluster's IPAM is down, unmapping, delivery to the target, and refusals of bad input.

mod common;

use std::time::{Duration, Instant};

use common::{Fabric, at};
use tonic::Code;
use trellis_api::pb::endpoints::{
    AddressType, Endpoint, EndpointPort, EndpointSlice, ReflectEndpointSliceRequest,
    ReflectEndpointSliceResponse, TranslationPath, UnreflectEndpointSliceRequest,
};
use trellis_api::pb::ipam::ListEndpointMappingsRequest;

fn slice(name: &str, addresses: Vec<String>) -> EndpointSlice {
    EndpointSlice {
        namespace: "shop".into(),
        name: name.into(),
        service_name: "web".into(),
        address_type: AddressType::Ipv4.into(),
        endpoints: addresses
            .iter()
            .map(|a| Endpoint {
                addresses: vec![a.clone()],
                ..Default::default()
            })
            .collect(),
        ports: vec![EndpointPort {
            name: "http".into(),
            port: Some(8080),
            ..Default::default()
        }],
        labels: Default::default(),
        service: None,
    }
}

async fn reflect(
    fabric: &Fabric,
    slice: EndpointSlice,
    deliver: bool,
) -> Result<ReflectEndpointSliceResponse, tonic::Status> {
    fabric
        .b
        .endpoints()
        .await
        .reflect_endpoint_slice(ReflectEndpointSliceRequest {
            target: Some(fabric.c.identity()),
            slice: Some(slice),
            deliver,
        })
        .await
        .map(tonic::Response::into_inner)
}

fn path(r: &ReflectEndpointSliceResponse, i: usize) -> TranslationPath {
    TranslationPath::try_from(r.translations[i].path).expect("known path")
}

async fn hub_mappings(fabric: &Fabric) -> Vec<String> {
    fabric
        .b
        .ipam()
        .await
        .list_endpoint_mappings(ListEndpointMappingsRequest {})
        .await
        .expect("list mappings")
        .into_inner()
        .mappings
        .into_iter()
        .map(|m| m.ip)
        .collect()
}

#[tokio::test]
async fn every_path_gets_the_address_the_target_can_reach() {
    let fabric = Fabric::start(true).await;
    let c_view_a = fabric.c_view_a.expect("induced");
    // A pod running in A (10.0.0.7 at home), as B addresses it; a pod of B itself; a pod of C.
    let in_a = at(fabric.b_view_a.pod, 7);
    let in_b = at(common::POD_CIDR.parse().expect("cidr"), 9);
    let in_c = at(fabric.b_view_c.pod, 5);
    let response = reflect(
        &fabric,
        slice("web-1", vec![in_a.clone(), in_b, in_c]),
        false,
    )
    .await
    .expect("reflects");

    // Induced: C's own remap of A, as held in A's IPAM (LocalNat for C), not B's view of A.
    assert_eq!(path(&response, 0), TranslationPath::Induced, "{response:?}");
    assert_eq!(
        response.translations[0].translated_address,
        at(c_view_a.pod, 7)
    );
    assert_ne!(c_view_a.pod, fabric.b_view_a.pod);
    assert_eq!(
        response.translations[0]
            .home_cluster
            .as_ref()
            .map(|h| h.cluster_id.as_str()),
        Some("a")
    );
    // Local pod: C's view of B's pod CIDR.
    assert_eq!(path(&response, 1), TranslationPath::LocalNat);
    assert_eq!(
        response.translations[1].translated_address,
        at(fabric.c_view_b.pod, 9)
    );
    // A pod of C itself: its home IP.
    assert_eq!(path(&response, 2), TranslationPath::TargetHome);
    assert_eq!(response.translations[2].translated_address, "10.0.0.5");
    // The translated slice carries the same addresses, in order.
    let translated_slice = response.slice.as_ref().expect("slice");
    let got: Vec<&str> = translated_slice
        .endpoints
        .iter()
        .map(|e| e.addresses[0].as_str())
        .collect();
    let want: Vec<&str> = response
        .translations
        .iter()
        .map(|t| t.translated_address.as_str())
        .collect();
    assert_eq!(got, want);
    // Nothing was allocated in B's external CIDR.
    assert!(hub_mappings(&fabric).await.is_empty());

    // A forgets C (its IPAM no longer holds C's mapping): the hub path, in C's view of B's
    // external CIDR.
    fabric
        .a
        .ipam()
        .await
        .free_subnets_per_cluster(trellis_api::pb::ipam::FreeSubnetsPerClusterRequest {
            cluster_id: "c".into(),
        })
        .await
        .expect("free");
    let response = reflect(&fabric, slice("web-1", vec![in_a.clone()]), false)
        .await
        .expect("reflects");
    assert_eq!(
        path(&response, 0),
        TranslationPath::HubExternal,
        "{response:?}"
    );
    let translated: std::net::IpAddr = response.translations[0]
        .translated_address
        .parse()
        .expect("ip");
    assert!(
        fabric.c_view_b.external.contains(&translated),
        "{translated}"
    );
    assert_eq!(hub_mappings(&fabric).await, vec![in_a.clone()]);
}

#[tokio::test]
async fn without_induced_peering_the_hub_path_is_used() {
    let fabric = Fabric::start(false).await;
    let in_a = at(fabric.b_view_a.pod, 7);
    let response = reflect(&fabric, slice("web-1", vec![in_a]), false)
        .await
        .expect("reflects");
    assert_eq!(path(&response, 0), TranslationPath::HubExternal);
    assert_eq!(response.translations[0].detail, "", "no failure to report");
    let translated: std::net::IpAddr = response.translations[0]
        .translated_address
        .parse()
        .expect("ip");
    assert!(fabric.c_view_b.external.contains(&translated));
}

#[tokio::test]
async fn remote_ipam_down_takes_the_hub_path_in_bounded_time() {
    let mut fabric = Fabric::start(true).await;
    fabric.a.stop_ipam().await;
    let in_a = at(fabric.b_view_a.pod, 7);
    let started = Instant::now();
    let response = reflect(
        &fabric,
        slice("web-1", vec![in_a.clone(), at(fabric.b_view_a.pod, 8)]),
        false,
    )
    .await
    .expect("reflects despite A's IPAM being down");
    let elapsed = started.elapsed();
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    for i in 0..2 {
        assert_eq!(
            path(&response, i),
            TranslationPath::HubExternal,
            "{response:?}"
        );
        let detail = &response.translations[i].detail;
        assert!(
            detail.contains("remote IPAM of cluster a") && detail.contains("unreachable"),
            "{detail}"
        );
        let translated: std::net::IpAddr = response.translations[i]
            .translated_address
            .parse()
            .expect("ip");
        assert!(fabric.c_view_b.external.contains(&translated));
    }
}

#[tokio::test]
async fn vanished_endpoints_release_their_hub_allocations() {
    let fabric = Fabric::start(false).await;
    let one = at(fabric.b_view_a.pod, 7);
    let two = at(fabric.b_view_a.pod, 8);
    reflect(
        &fabric,
        slice("web-1", vec![one.clone(), two.clone()]),
        false,
    )
    .await
    .expect("reflects");
    // Another slice to the same target shares endpoint `two`.
    reflect(&fabric, slice("web-2", vec![two.clone()]), false)
        .await
        .expect("reflects");
    assert_eq!(hub_mappings(&fabric).await, vec![one.clone(), two.clone()]);

    // `one` disappears from web-1: released; `two` stays.
    reflect(&fabric, slice("web-1", vec![two.clone()]), false)
        .await
        .expect("reflects");
    assert_eq!(hub_mappings(&fabric).await, vec![two.clone()]);

    // web-1 goes away: `two` is still used by web-2.
    let mut b = fabric.b.endpoints().await;
    let gone = b
        .unreflect_endpoint_slice(UnreflectEndpointSliceRequest {
            target: Some(fabric.c.identity()),
            namespace: "shop".into(),
            name: "web-1".into(),
            deliver: false,
        })
        .await
        .expect("unreflects")
        .into_inner();
    assert!(gone.unreflected);
    assert_eq!(gone.released_addresses, 0);
    assert_eq!(hub_mappings(&fabric).await, vec![two.clone()]);

    // web-2 goes away: released.
    let gone = b
        .unreflect_endpoint_slice(UnreflectEndpointSliceRequest {
            target: Some(fabric.c.identity()),
            namespace: "shop".into(),
            name: "web-2".into(),
            deliver: false,
        })
        .await
        .expect("unreflects")
        .into_inner();
    assert_eq!(gone.released_addresses, 1);
    assert!(hub_mappings(&fabric).await.is_empty());
}

#[tokio::test]
async fn delivered_slices_are_stored_on_the_target_and_deleted_with_it() {
    let fabric = Fabric::start(true).await;
    let in_a = at(fabric.b_view_a.pod, 7);
    let started_ms = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis(),
    )
    .expect("millis");
    let response = reflect(&fabric, slice("web-1", vec![in_a.clone()]), true)
        .await
        .expect("reflects");
    assert!(response.delivered);
    let mut c = fabric.c.endpoints().await;
    let held = common::reflected(&mut c, "").await;
    assert_eq!(held.len(), 1);
    assert_eq!(
        held[0].source.as_ref().map(|s| s.cluster_id.as_str()),
        Some("b")
    );
    // Generations start at the wall clock in milliseconds (a source that lost its store starts
    // above what it sent before).
    let first = held[0].generation;
    assert!(
        first >= started_ms,
        "generation {first} below the clock {started_ms}"
    );
    assert_eq!(held[0].slice, response.slice);
    assert_eq!(held[0].object_name, "", "no Kubernetes access configured");

    // A newer generation replaces it.
    reflect(
        &fabric,
        slice("web-1", vec![in_a.clone(), at(fabric.b_view_a.pod, 8)]),
        true,
    )
    .await
    .expect("reflects again");
    let held = common::reflected(&mut c, "").await;
    assert!(held[0].generation > first);
    assert_eq!(held[0].slice.as_ref().map(|s| s.endpoints.len()), Some(2));

    let gone = fabric
        .b
        .endpoints()
        .await
        .unreflect_endpoint_slice(UnreflectEndpointSliceRequest {
            target: Some(fabric.c.identity()),
            namespace: "shop".into(),
            name: "web-1".into(),
            deliver: true,
        })
        .await
        .expect("unreflects")
        .into_inner();
    assert!(gone.delivered);
    let held = common::reflected(&mut c, "").await;
    assert!(held.is_empty());
}

#[tokio::test]
async fn bad_input_is_refused_naming_the_field_and_nothing_is_stored() {
    let fabric = Fabric::start(true).await;
    let good = at(fabric.b_view_a.pod, 7);
    let mut b = fabric.b.endpoints().await;
    let cases: Vec<(ReflectEndpointSliceRequest, &str)> = vec![
        (
            ReflectEndpointSliceRequest {
                target: None,
                slice: Some(slice("web-1", vec![good.clone()])),
                deliver: false,
            },
            "target.cluster_id",
        ),
        (
            ReflectEndpointSliceRequest {
                target: Some(fabric.c.identity()),
                slice: Some(slice("web-1", vec![good.clone(), "10.0.0.300".into()])),
                deliver: false,
            },
            "slice.endpoints[1].addresses[0]",
        ),
        (
            ReflectEndpointSliceRequest {
                target: Some(fabric.c.identity()),
                slice: Some(slice("Web_1", vec![good.clone()])),
                deliver: false,
            },
            "slice.name",
        ),
        (
            ReflectEndpointSliceRequest {
                target: Some(fabric.b.identity()),
                slice: Some(slice("web-1", vec![good.clone()])),
                deliver: false,
            },
            "target.cluster_id",
        ),
        (
            ReflectEndpointSliceRequest {
                target: Some(fabric.c.identity()),
                slice: Some(slice("web-1", vec!["fd00::7".into()])),
                deliver: false,
            },
            "slice.endpoints[0].addresses[0]",
        ),
    ];
    for (request, field) in cases {
        let status = b
            .reflect_endpoint_slice(request)
            .await
            .expect_err("refused");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().starts_with(&format!("invalid {field}:")),
            "{field}: {}",
            status.message()
        );
    }
    // An address no cluster owns: refused, nothing allocated.
    let status = b
        .reflect_endpoint_slice(ReflectEndpointSliceRequest {
            target: Some(fabric.c.identity()),
            slice: Some(slice("web-1", vec![good.clone(), "192.168.77.1".into()])),
            deliver: false,
        })
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(
        status.message().contains("slice.endpoints[1].addresses[0]"),
        "{}",
        status.message()
    );
    // A target that is not a peer.
    let status = b
        .reflect_endpoint_slice(ReflectEndpointSliceRequest {
            target: Some(trellis_api::pb::types::ClusterIdentity {
                cluster_id: "stranger".into(),
                cluster_name: String::new(),
            }),
            slice: Some(slice("web-1", vec![good.clone()])),
            deliver: false,
        })
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");

    assert!(hub_mappings(&fabric).await.is_empty());
    let unreflected = b
        .unreflect_endpoint_slice(UnreflectEndpointSliceRequest {
            target: Some(fabric.c.identity()),
            namespace: "shop".into(),
            name: "web-1".into(),
            deliver: false,
        })
        .await
        .expect("unreflect")
        .into_inner();
    assert!(!unreflected.unreflected, "no reflection was recorded");

    // The cluster-facing side: a bad slice or generation is refused, nothing stored.
    let mut c = fabric.c.endpoints().await;
    let status = c
        .apply_reflected_slice(trellis_api::pb::endpoints::ApplyReflectedSliceRequest {
            source: Some(fabric.b.identity()),
            slice: Some(slice("web-1", vec![good.clone()])),
            generation: 0,
        })
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("invalid generation:"),
        "{}",
        status.message()
    );
    let mut bad = slice("web-1", vec![good.clone()]);
    bad.ports[0].port = Some(0);
    let status = c
        .apply_reflected_slice(trellis_api::pb::endpoints::ApplyReflectedSliceRequest {
            source: Some(fabric.b.identity()),
            slice: Some(bad),
            generation: 1,
        })
        .await
        .expect_err("refused");
    assert!(
        status.message().starts_with("invalid slice.ports[0].port:"),
        "{}",
        status.message()
    );
    // A source that is not our peer.
    let status = c
        .apply_reflected_slice(trellis_api::pb::endpoints::ApplyReflectedSliceRequest {
            source: Some(fabric.a.identity()),
            slice: Some(slice("web-1", vec![good])),
            generation: 1,
        })
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let held = common::reflected(&mut c, "").await;
    assert!(held.is_empty());
}

#[tokio::test]
async fn a_silent_remote_ipam_costs_a_bounded_time_and_takes_the_hub_path() {
    let fabric = Fabric::start(true).await;
    // A listener that never answers: TCP connects (the kernel's backlog) but no HTTP/2
    // response ever comes, so only the timeouts end the call.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let mut a = common::Cluster::identity(&fabric.a);
    a.cluster_name = "cluster a".into();
    trellis_api::pb::discovery::discovery_client::DiscoveryClient::connect(format!(
        "http://{}",
        fabric.b.discovery
    ))
    .await
    .expect("connects")
    .update_peering(trellis_api::pb::discovery::UpdatePeeringRequest {
        reason: "HandshakeCompleted".into(),
        ..trellis_testkit::peering::full_peering(
            a,
            trellis_api::pb::types::ServiceAddresses {
                ipam: silent.local_addr().expect("addr").to_string(),
                ..Default::default()
            },
        )
    })
    .await
    .expect("re-peer");
    let started = Instant::now();
    let response = reflect(
        &fabric,
        slice("web-1", vec![at(fabric.b_view_a.pod, 7)]),
        false,
    )
    .await
    .expect("reflects");
    let elapsed = started.elapsed();
    // --remote-ipam-timeout 1000 ms, 2 attempts: about 2-4 s, far below the bound.
    assert!(elapsed < Duration::from_secs(10), "took {elapsed:?}");
    assert_eq!(
        path(&response, 0),
        TranslationPath::HubExternal,
        "{response:?}"
    );
    assert!(
        response.translations[0].detail.contains("unreachable"),
        "{}",
        response.translations[0].detail
    );
    drop(silent);
}
