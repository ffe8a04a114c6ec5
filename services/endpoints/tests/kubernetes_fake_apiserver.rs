//! The import side against a **fake** Kubernetes API server (`trellis_testkit::FakeApiServer`,
//! ADR 0019), with real in-process IPAMs and discoveries (hub B, leaves A and C, A-C network
//! parameters exchanged, B's discovery introducing A and C to each other): an endpoint C reaches
//! over its induced peering with A is written ready, and not ready once C's IPAM no longer
//! addresses A (the induced peering is gone) instead of keeping a wrong address usable; an
//! exported Service named like a local non-Trellis Service (`trellis-ipam`) never touches it:
//! the import gets a derived Service. A last test pins the fake's own semantics (409s,
//! preconditions, label selectors, watch replay and 410) through the unmodified kube client.

mod common;

use common::{Cluster, Fabric, at, until};
use serde_json::{Value, json};
use trellis_api::pb::endpoints::ExportServiceRequest;
use trellis_api::pb::ipam::FreeSubnetsPerClusterRequest;
use trellis_endpoints::kube::derived_service_name;
use trellis_testkit::FakeApiServer;

fn request(name: &str, address: String) -> ExportServiceRequest {
    trellis_testkit::exports::export_request("shop", name, &[(address, true)])
}

/// (address, ready) of every endpoint of the imported slices attached to `service`'s derived
/// Service in `api`.
fn imported(api: &FakeApiServer, service: &str) -> Vec<(String, bool)> {
    let derived = derived_service_name("shop", service);
    let mut out: Vec<(String, bool)> = api
        .objects("discovery.k8s.io/v1", "endpointslices", "shop")
        .into_iter()
        .filter(|o| o["metadata"]["labels"]["kubernetes.io/service-name"] == derived.as_str())
        .flat_map(|o| o["endpoints"].as_array().cloned().unwrap_or_default())
        .map(|e| {
            (
                e["addresses"][0].as_str().unwrap_or("").to_owned(),
                e["conditions"]["ready"].as_bool().unwrap_or(true),
            )
        })
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn an_endpoint_whose_home_becomes_unreachable_is_written_not_ready_fake_api_server() {
    let api = FakeApiServer::start().await.expect("fake api server");
    let a = Cluster::start("a", "10.101.0.0/16", None).await;
    let b = Cluster::start("b", "10.102.0.0/16", None).await;
    let c = Cluster::start_kube("c", "10.103.0.0/16", &api.kubeconfig()).await;
    // A and C exchanged network parameters (A's IPAM maps for C, so B's translation takes the
    // induced path), but C's discovery has no peering with A.
    let fabric = Fabric::connect(a, b, c, true).await;
    let c_view_a = fabric.c_view_a.expect("induced");
    let pods = common::POD_CIDR.parse().expect("cidr");
    fabric
        .a
        .endpoints()
        .await
        .export_service(request("web", at(pods, 7)))
        .await
        .expect("exports");
    // C reaches A directly (B introduced them): ready, as A exported it.
    until(
        "ready over the induced peering",
        vec![(at(c_view_a.pod, 7), true)],
        || async { imported(&api, "web") },
    )
    .await;
    // C's IPAM forgets A (the induced peering is torn down): the address C holds no longer
    // leads to A, and the endpoint is written not ready.
    let freed = fabric
        .c
        .ipam()
        .await
        .free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
            cluster_id: "a".into(),
        })
        .await
        .expect("frees")
        .into_inner();
    assert!(freed.existed);
    until(
        "not ready once A is unreachable",
        vec![(at(c_view_a.pod, 7), false)],
        || async { imported(&api, "web") },
    )
    .await;
}

#[tokio::test]
async fn an_import_never_writes_into_a_local_service_of_the_same_name_fake_api_server() {
    let api = FakeApiServer::start().await.expect("fake api server");
    let client =
        kube::Client::try_from(kube::Config::new(api.url().parse().expect("url"))).expect("client");
    let services: kube::Api<k8s_openapi::api::core::v1::Service> =
        kube::Api::namespaced(client, "shop");
    let local: k8s_openapi::api::core::v1::Service = serde_json::from_value(json!({
        "metadata": {"name": "trellis-ipam", "namespace": "shop"},
        "spec": {"selector": {"app": "trellis-ipam"}, "ports": [{"port": 7104}]}
    }))
    .expect("service");
    let local = services
        .create(&Default::default(), &local)
        .await
        .expect("creates");
    let a = Cluster::start("a", "10.101.0.0/16", None).await;
    let b = Cluster::start_kube("b", "10.102.0.0/16", &api.kubeconfig()).await;
    let (_, b_view_a) = common::network(&a, &b).await;
    a.peer_with(&b).await;
    b.peer_with(&a).await;
    let pods = common::POD_CIDR.parse().expect("cidr");
    a.endpoints()
        .await
        .export_service(request("trellis-ipam", at(pods, 9)))
        .await
        .expect("exports");
    until(
        "B imports A's trellis-ipam",
        vec![(at(b_view_a.pod, 9), true)],
        || async { imported(&api, "trellis-ipam") },
    )
    .await;
    let derived = derived_service_name("shop", "trellis-ipam");
    until("the derived service exists", true, || async {
        api.objects("v1", "services", "shop")
            .iter()
            .any(|s| s["metadata"]["name"] == derived.as_str())
    })
    .await;
    // The local Service is exactly as created, and no imported slice attaches to it.
    let held: Vec<Value> = api
        .objects("v1", "services", "shop")
        .into_iter()
        .filter(|s| s["metadata"]["name"] == "trellis-ipam")
        .collect();
    assert_eq!(held.len(), 1);
    assert_eq!(
        held[0]["metadata"]["resourceVersion"].as_str(),
        local.metadata.resource_version.as_deref()
    );
    assert!(
        api.objects("discovery.k8s.io/v1", "endpointslices", "shop")
            .iter()
            .all(|s| s["metadata"]["labels"]["kubernetes.io/service-name"] != "trellis-ipam")
    );
    let import = api
        .objects("multicluster.x-k8s.io/v1beta1", "serviceimports", "shop")
        .into_iter()
        .find(|o| o["metadata"]["name"] == "trellis-ipam")
        .expect("a serviceimport");
    assert_eq!(
        import["metadata"]["annotations"]["multicluster.kubernetes.io/derived-service"],
        derived.as_str()
    );
    assert_eq!(import["spec"]["type"], "ClusterSetIP");
}

/// The fake's own semantics, through the unmodified kube client: what the tests above rely on.
#[tokio::test]
async fn the_fake_api_server_refuses_conflicts_checks_preconditions_and_expires_old_watches() {
    use futures::StreamExt as _;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{DeleteParams, PostParams, Preconditions, WatchEvent, WatchParams};

    let api = FakeApiServer::start().await.expect("fake api server");
    let client =
        kube::Client::try_from(kube::Config::new(api.url().parse().expect("url"))).expect("client");
    let maps: kube::Api<ConfigMap> = kube::Api::namespaced(client, "shop");
    let code = |err: kube::Error| match err {
        kube::Error::Api(status) => (status.code, status.reason.clone()),
        other => panic!("expected an API status, got {other:?}"),
    };
    let map: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "m", "labels": {"app": "x"}}, "data": {"k": "1"}
    }))
    .expect("map");
    let first = maps
        .create(&PostParams::default(), &map)
        .await
        .expect("creates");
    assert!(first.metadata.uid.is_some());
    let err = maps
        .create(&PostParams::default(), &map)
        .await
        .expect_err("exists");
    assert_eq!(code(err), (409, "AlreadyExists".to_owned()));
    let mut update = first.clone();
    update.data = Some([("k".to_owned(), "2".to_owned())].into());
    let second = maps
        .replace("m", &PostParams::default(), &update)
        .await
        .expect("replaces");
    let version = |m: &ConfigMap| -> u64 {
        m.metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok())
            .expect("numeric resourceVersion")
    };
    assert!(version(&second) > version(&first));
    // A replace with the first resourceVersion is stale.
    let err = maps
        .replace("m", &PostParams::default(), &update)
        .await
        .expect_err("stale");
    assert_eq!(code(err), (409, "Conflict".to_owned()));
    // Label selectors select.
    let listed = maps
        .list(&kube::api::ListParams::default().labels("app=x"))
        .await
        .expect("lists");
    assert_eq!(listed.items.len(), 1);
    let listed = maps
        .list(&kube::api::ListParams::default().labels("app!=x"))
        .await
        .expect("lists");
    assert!(listed.items.is_empty());
    // A watch from the first version replays the change; after compaction it is expired.
    let mut events = maps
        .watch(
            &WatchParams::default().timeout(5),
            first.metadata.resource_version.as_deref().expect("rv"),
        )
        .await
        .expect("watches")
        .boxed();
    match events.next().await {
        Some(Ok(WatchEvent::Modified(m))) => assert_eq!(m.data, update.data),
        other => panic!("expected MODIFIED, got {other:?}"),
    }
    api.compact();
    let mut events = maps
        .watch(
            &WatchParams::default().timeout(5),
            first.metadata.resource_version.as_deref().expect("rv"),
        )
        .await
        .expect("watches")
        .boxed();
    match events.next().await {
        Some(Ok(WatchEvent::Error(status))) => assert_eq!(status.code, 410),
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
    // Delete with a wrong uid precondition is refused; with the right one it deletes.
    let wrong = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("not-the-uid".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let err = maps.delete("m", &wrong).await.expect_err("precondition");
    assert_eq!(code(err), (409, "Conflict".to_owned()));
    let right = DeleteParams {
        preconditions: Some(Preconditions {
            uid: second.metadata.uid.clone(),
            resource_version: second.metadata.resource_version.clone(),
        }),
        ..DeleteParams::default()
    };
    maps.delete("m", &right).await.expect("deletes");
    assert!(maps.get_opt("m").await.expect("gets").is_none());
}

#[tokio::test]
async fn the_fake_api_server_assigns_cluster_ips_keeps_them_and_refuses_to_change_them() {
    use k8s_openapi::api::core::v1::Service;
    use kube::api::{DeleteParams, PostParams};

    let api = FakeApiServer::start().await.expect("fake api server");
    let client =
        kube::Client::try_from(kube::Config::new(api.url().parse().expect("url"))).expect("client");
    let services: kube::Api<Service> = kube::Api::namespaced(client, "shop");
    let service = |name: &str, extra: Value| -> Service {
        let mut spec = json!({"ports": [{"port": 80}]});
        if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
            s.extend(e.clone());
        }
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).expect("service")
    };
    let ip = |s: &Service| s.spec.as_ref().and_then(|s| s.cluster_ip.clone());
    let ips = |s: &Service| s.spec.as_ref().and_then(|s| s.cluster_ips.clone());
    let net: ipnet::Ipv4Net = FakeApiServer::SERVICE_CIDR.parse().expect("cidr");

    let web = services
        .create(&PostParams::default(), &service("web", json!({})))
        .await
        .expect("creates");
    let first = ip(&web).expect("a cluster IP is assigned");
    assert!(
        net.contains(&first.parse::<std::net::Ipv4Addr>().expect("an IPv4")),
        "{first}"
    );
    assert_eq!(ips(&web), Some(vec![first.clone()]));
    // Headless and ExternalName Services get none.
    let headless = services
        .create(
            &PostParams::default(),
            &service("headless", json!({"clusterIP": "None"})),
        )
        .await
        .expect("creates");
    assert_eq!(ip(&headless).as_deref(), Some("None"));
    let external = services
        .create(
            &PostParams::default(),
            &service(
                "external",
                json!({"type": "ExternalName", "externalName": "example.org"}),
            ),
        )
        .await
        .expect("creates");
    assert_eq!(ip(&external), None);
    // A replace that leaves the IP out keeps it; one that changes it is refused.
    let mut update = service("web", json!({"ports": [{"port": 81}]}));
    update.metadata.resource_version = web.metadata.resource_version.clone();
    let updated = services
        .replace("web", &PostParams::default(), &update)
        .await
        .expect("replaces");
    assert_eq!(ip(&updated), Some(first.clone()));
    let mut change = service("web", json!({"clusterIP": "10.96.255.1"}));
    change.metadata.resource_version = updated.metadata.resource_version.clone();
    match services
        .replace("web", &PostParams::default(), &change)
        .await
    {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 422, "{status:?}"),
        other => panic!("expected 422, got {other:?}"),
    }
    // Deleted and created again: another IP, as the real allocator gives.
    services
        .delete("web", &DeleteParams::default())
        .await
        .expect("deletes");
    let again = services
        .create(&PostParams::default(), &service("web", json!({})))
        .await
        .expect("creates");
    let second = ip(&again).expect("a cluster IP is assigned");
    assert_ne!(second, first);
}
