//! ExportService / UnexportService / ListExports against real in-process IPAMs and discoveries
//! (hub B, leaves A and C): an export is reflected by the reconciler to every networked full
//! peer with the address each one uses, changes follow, unexport withdraws it everywhere, and
//! bad input is refused naming the field with nothing stored.
#![allow(clippy::disallowed_methods)] // tests wait plainly: a window in which nothing may happen, not a retry

mod common;

use std::time::Duration;

use common::{Cluster, Fabric, at, until, view};
use tonic::Code;
use trellis_api::pb::endpoints::{
    ExportServiceRequest, ExportedEndpoint, ListExportsRequest, ReflectedSlice,
    UnexportServiceRequest,
};

fn request(endpoints: &[(String, bool)]) -> ExportServiceRequest {
    trellis_testkit::exports::export_request("shop", "web", endpoints)
}

async fn reflected_from(cluster: &Cluster, source: &str) -> Vec<ReflectedSlice> {
    common::reflected(&mut cluster.endpoints().await, source).await
}

/// (address, ready) of every endpoint of the one slice `source` reflected to `cluster`, or
/// `None` when there is none.
async fn imported(cluster: &Cluster, source: &str) -> Option<Vec<(String, bool)>> {
    let slices = reflected_from(cluster, source).await;
    assert!(slices.len() <= 1, "one export, one slice: {slices:?}");
    let slice = slices.into_iter().next()?.slice.expect("slice");
    assert_eq!(
        (slice.namespace.as_str(), slice.service_name.as_str()),
        ("shop", "web")
    );
    assert_eq!(slice.ports.len(), 1);
    assert_eq!(slice.ports[0].port, Some(8080));
    Some(
        slice
            .endpoints
            .into_iter()
            .map(|e| {
                (
                    e.addresses.join(","),
                    e.conditions.and_then(|c| c.ready).unwrap_or(true),
                )
            })
            .collect(),
    )
}

#[tokio::test]
async fn an_export_reaches_every_full_peer_follows_changes_and_unexport_withdraws_it() {
    let fabric = Fabric::start(false).await;
    let pods = common::POD_CIDR.parse().expect("cidr");
    let a_view_b = view(&fabric.a, &fabric.b).await;
    let c_view_b = fabric.c_view_b;
    let mut hub = fabric.b.endpoints().await;

    hub.export_service(request(&[(at(pods, 7), true), (at(pods, 8), true)]))
        .await
        .expect("export");
    until(
        "A's import",
        Some(vec![
            (at(a_view_b.pod, 7), true),
            (at(a_view_b.pod, 8), true),
        ]),
        || imported(&fabric.a, "b"),
    )
    .await;
    until(
        "C's import",
        Some(vec![
            (at(c_view_b.pod, 7), true),
            (at(c_view_b.pod, 8), true),
        ]),
        || imported(&fabric.c, "b"),
    )
    .await;
    until(
        "B's exports",
        vec!["a".to_owned(), "c".to_owned()],
        || async {
            let exports = fabric
                .b
                .endpoints()
                .await
                .list_exports(ListExportsRequest {})
                .await
                .expect("list exports")
                .into_inner()
                .exports;
            assert_eq!(exports.len(), 1);
            exports[0].reflected_to.clone()
        },
    )
    .await;

    // Scale up, one new endpoint not ready yet; then down.
    hub.export_service(request(&[
        (at(pods, 7), true),
        (at(pods, 8), true),
        (at(pods, 9), false),
    ]))
    .await
    .expect("export again");
    until(
        "A's import after scaling up",
        Some(vec![
            (at(a_view_b.pod, 7), true),
            (at(a_view_b.pod, 8), true),
            (at(a_view_b.pod, 9), false),
        ]),
        || imported(&fabric.a, "b"),
    )
    .await;
    hub.export_service(request(&[(at(pods, 9), true)]))
        .await
        .expect("export again");
    until(
        "C's import after scaling down",
        Some(vec![(at(c_view_b.pod, 9), true)]),
        || imported(&fabric.c, "b"),
    )
    .await;

    let gone = hub
        .unexport_service(UnexportServiceRequest {
            namespace: "shop".into(),
            name: "web".into(),
        })
        .await
        .expect("unexport")
        .into_inner();
    assert!(gone.unexported);
    until("A's import after unexport", None, || {
        imported(&fabric.a, "b")
    })
    .await;
    until("C's import after unexport", None, || {
        imported(&fabric.c, "b")
    })
    .await;
    let again = hub
        .unexport_service(UnexportServiceRequest {
            namespace: "shop".into(),
            name: "web".into(),
        })
        .await
        .expect("unexport is idempotent")
        .into_inner();
    assert!(!again.unexported);
    assert!(
        hub.list_exports(ListExportsRequest {})
            .await
            .expect("list")
            .into_inner()
            .exports
            .is_empty()
    );
}

#[tokio::test]
async fn a_peer_added_later_gets_the_existing_export() {
    let a = Cluster::start("a", "10.101.0.0/16", None).await;
    let b = Cluster::start("b", "10.102.0.0/16", None).await;
    let pods = common::POD_CIDR.parse().expect("cidr");
    a.endpoints()
        .await
        .export_service(request(&[(at(pods, 20), true)]))
        .await
        .expect("export with no peer yet");
    // Peering happens after the export: the reconciler's resync must pick it up.
    let (a_view_b, b_view_a) = common::network(&a, &b).await;
    let _ = a_view_b;
    a.peer_with(&b).await;
    b.peer_with(&a).await;
    until(
        "B's import",
        Some(vec![(at(b_view_a.pod, 20), true)]),
        || imported(&b, "a"),
    )
    .await;
}

#[tokio::test]
async fn bad_exports_are_refused_naming_the_field_and_nothing_is_stored() {
    let fabric = Fabric::start(false).await;
    let pods = common::POD_CIDR.parse().expect("cidr");
    let good = || request(&[(at(pods, 7), true)]);
    let mut cases: Vec<(&str, ExportServiceRequest)> = Vec::new();
    let mut r = good();
    r.namespace = "Shop_1".into();
    cases.push(("namespace", r));
    let mut r = good();
    r.name = "web.v1".into();
    cases.push(("name", r));
    let mut r = good();
    r.ports[0].port = Some(70_000);
    cases.push(("ports[0].port", r));
    let mut r = good();
    r.ports[0].port = Some(0);
    cases.push(("ports[0].port", r));
    let mut r = good();
    r.ports.clear();
    cases.push(("ports", r));
    let mut r = good();
    r.endpoints[0].address = "10.0.0.300".into();
    cases.push(("endpoints[0].address", r));
    // Not one of our pods: our pod CIDR is 10.0.0.0/16.
    let mut r = good();
    r.endpoints.push(ExportedEndpoint {
        address: "192.168.1.1".into(),
        ready: None,
    });
    cases.push(("endpoints[1].address", r));
    let mut hub = fabric.b.endpoints().await;
    for (field, req) in cases {
        let err = hub
            .export_service(req)
            .await
            .expect_err(&format!("{field} must be refused"));
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        assert!(
            err.message().contains(field),
            "{field} not named: {:?}",
            err.message()
        );
    }
    let err = hub
        .unexport_service(UnexportServiceRequest {
            namespace: "shop".into(),
            name: "Web!".into(),
        })
        .await
        .expect_err("bad name");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        hub.list_exports(ListExportsRequest {})
            .await
            .expect("list")
            .into_inner()
            .exports
            .is_empty()
    );
    // Nothing reached a peer either (give the reconciler more than one resync).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(reflected_from(&fabric.a, "b").await.is_empty());
}
