//! The Multi-Cluster Services path through Kubernetes, each cluster with its own **fake**
//! Kubernetes API server (`trellis_testkit::FakeApiServer`, ADR 0019: the real HTTP/JSON
//! protocol, kube's client and watchers unmodified; no admission, no controllers) and its
//! endpoints service on a real etcd: hub B, leaves A and C peered through the brokers (C an
//! induced peer of A). A `ServiceExport` plus EndpointSlices in A's API server become, in B's
//! and C's, a ServiceImport, a derived Service and translated slices (C's at its direct view of
//! A); scaling up and down follows; a second exporter (C) merges into B's import, and
//! conflicting ports raise the Conflict condition; a restart of either endpoints service loses
//! and duplicates nothing; deleting the ServiceExport, or the Service, withdraws it; unpeering
//! removes what the peer brought.
//!
//! Needs etcd; skips loudly without it (fails in CI).

use std::collections::BTreeMap;
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use trellis_api::pb::endpoints::{
    EndpointPort, ExportServiceRequest, ExportedEndpoint, ListExportsRequest,
    UnexportServiceRequest,
};
use trellis_endpoints::kube::derived_service_name;
use trellis_endpoints::mcs::ServiceExport;
use trellis_integration::cluster::{InProcessCluster, Options};
use trellis_integration::peering::unpeer;
use trellis_integration::peering::{eventually, host_at, peer, pod_view, tunnel_to};
use trellis_testkit::{Etcd, FakeApiServer};

/// Generous: three clusters, three etcds and three fake API servers share two cores.
const LIMIT: Duration = Duration::from_secs(90);

/// The derived Service of shop/web in `site`'s API server: (uid, clusterIP).
fn derived_service(site: &Site) -> Option<(String, String)> {
    let derived = derived_service_name("shop", "web");
    site.api
        .objects("v1", "services", "shop")
        .into_iter()
        .find(|o| o["metadata"]["name"] == derived.as_str())
        .map(|o| {
            (
                o["metadata"]["uid"].as_str().unwrap_or("").to_owned(),
                o["spec"]["clusterIP"].as_str().unwrap_or("").to_owned(),
            )
        })
}

/// One cluster: its fake API server, its endpoints etcd, the cluster.
struct Site {
    api: FakeApiServer,
    _etcd: Etcd,
    cluster: InProcessCluster,
}

async fn site(id: &str) -> Option<Site> {
    let etcd = Etcd::start_or_skip()?;
    let api = FakeApiServer::start().await.expect("fake api server");
    let options = Options {
        endpoints: true,
        endpoints_store: Some(etcd.url(&format!("/{id}/endpoints"))),
        kubeconfig: Some(api.kubeconfig()),
        ..Options::default()
    };
    let cluster = InProcessCluster::start_with(id, "10.0.0.0/16", "10.201.0.0/16", options)
        .await
        .expect("cluster starts");
    Some(Site {
        api,
        _etcd: etcd,
        cluster,
    })
}

async fn client(api: &FakeApiServer) -> kube::Client {
    let config = kube::Config::new(api.url().parse().expect("url"));
    kube::Client::try_from(config).expect("kube client")
}

/// Writes (create or replace) `object` through the kube client, as kubectl apply would.
async fn put<K>(api: &Api<K>, object: K)
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = object.meta().name.clone().expect("name");
    match api.get_opt(&name).await.expect("get") {
        None => {
            api.create(&PostParams::default(), &object)
                .await
                .expect("create");
        }
        Some(held) => {
            let mut object = object;
            object.meta_mut().resource_version = held.meta().resource_version.clone();
            api.replace(&name, &PostParams::default(), &object)
                .await
                .expect("replace");
        }
    }
}

fn service(port: i32, target: i32) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": port, "targetPort": target, "protocol": "TCP"}]}
    }))
    .expect("service")
}

fn slice(port: i32, endpoints: &[(&str, bool)]) -> EndpointSlice {
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "web-x1", "namespace": "shop",
                     "labels": {"kubernetes.io/service-name": "web",
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints.iter().map(|(a, ready)| json!({
            "addresses": [a], "conditions": {"ready": ready}, "nodeName": "node-1"
        })).collect::<Vec<_>>(),
    }))
    .expect("slice")
}

fn service_export() -> ServiceExport {
    ServiceExport::new(
        serde_json::from_value(json!({"name": "web", "namespace": "shop"})).expect("meta"),
        Value::Null,
    )
}

/// The port of the exported Service shop/web.
const SERVICE_PORT: i64 = 80;

/// Exports shop/web from `site` with Service port 80, the given targetPort and endpoints.
async fn export(site: &Site, port: i32, endpoints: &[(&str, bool)]) {
    export_at(site, 80, port, endpoints).await;
}

/// Exports shop/web from `site` with the given Service port, targetPort and endpoints.
async fn export_at(site: &Site, service_port: i32, port: i32, endpoints: &[(&str, bool)]) {
    let client = client(&site.api).await;
    put(
        &Api::<Service>::namespaced(client.clone(), "shop"),
        service(service_port, port),
    )
    .await;
    put(
        &Api::<EndpointSlice>::namespaced(client.clone(), "shop"),
        slice(port, endpoints),
    )
    .await;
    put(
        &Api::<ServiceExport>::namespaced(client, "shop"),
        service_export(),
    )
    .await;
}

/// What `site`'s API server holds for the import of shop/web: the ServiceImport's
/// (clusters, ports, Conflict status), whether its `spec.ips` is the derived Service's cluster
/// IP (what `clusterset.local` DNS answers), the derived Service's ports, and every imported
/// slice's (source cluster, [(address, ready)]) sorted; `None` parts are absent.
#[derive(Debug, Clone, PartialEq)]
struct Imported {
    clusters: Option<Vec<String>>,
    import_ports: Option<Vec<i64>>,
    conflict: Option<String>,
    ips: Option<Ips>,
    service_ports: Option<Vec<i64>>,
    slices: Vec<(String, Vec<(String, bool)>)>,
}

/// A ServiceImport's `spec.ips` against its derived Service's `clusterIP`.
#[derive(Debug, Clone, PartialEq)]
enum Ips {
    /// Equal to `[clusterIP]`, and the Service has one.
    ClusterIp,
    /// Anything else: (`spec.ips`, the Service's `clusterIP`).
    Wrong(Value, Value),
}

fn imported(site: &Site) -> Imported {
    let derived = derived_service_name("shop", "web");
    let import = site
        .api
        .objects("multicluster.x-k8s.io/v1beta1", "serviceimports", "shop")
        .into_iter()
        .find(|o| o["metadata"]["name"] == "web");
    let ports = |list: &Value| {
        list.as_array()
            .map(|ports| ports.iter().filter_map(|p| p["port"].as_i64()).collect())
    };
    let service = site
        .api
        .objects("v1", "services", "shop")
        .into_iter()
        .find(|o| o["metadata"]["name"] == derived.as_str());
    let mut slices: Vec<(String, Vec<(String, bool)>)> = site
        .api
        .objects("discovery.k8s.io/v1", "endpointslices", "shop")
        .into_iter()
        .filter(|o| o["metadata"]["labels"]["kubernetes.io/service-name"] == derived.as_str())
        .map(|o| {
            let origin = o["metadata"]["labels"]["multicluster.kubernetes.io/source-cluster"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            let mut endpoints: Vec<(String, bool)> = o["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| {
                    (
                        e["addresses"][0].as_str().unwrap_or("").to_owned(),
                        e["conditions"]["ready"].as_bool().unwrap_or(true),
                    )
                })
                .collect();
            endpoints.sort();
            (origin, endpoints)
        })
        .collect();
    slices.sort();
    Imported {
        clusters: import.as_ref().map(|i| {
            i["status"]["clusters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["cluster"].as_str().map(str::to_owned))
                .collect()
        }),
        import_ports: import.as_ref().and_then(|i| ports(&i["spec"]["ports"])),
        conflict: import.as_ref().and_then(|i| {
            i["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "Conflict")
                .and_then(|c| c["status"].as_str().map(str::to_owned))
        }),
        ips: import.as_ref().map(|i| {
            let cluster_ip = service
                .as_ref()
                .map_or(Value::Null, |s| s["spec"]["clusterIP"].clone());
            match (&i["spec"]["ips"], cluster_ip.as_str()) {
                (Value::Array(ips), Some(ip)) if !ip.is_empty() && *ips == [json!(ip)] => {
                    Ips::ClusterIp
                }
                (ips, _) => Ips::Wrong(ips.clone(), cluster_ip.clone()),
            }
        }),
        service_ports: service.as_ref().and_then(|s| ports(&s["spec"]["ports"])),
        slices,
    }
}

/// The import of shop/web by `clusters`: the Service's port (80) on the ServiceImport and the
/// derived Service (the endpoints' own port is the slices').
fn present(clusters: &[&str], slices: Vec<(&str, Vec<(String, bool)>)>) -> Imported {
    Imported {
        clusters: Some(clusters.iter().map(|c| (*c).to_owned()).collect()),
        import_ports: Some(vec![SERVICE_PORT]),
        conflict: Some("False".into()),
        ips: Some(Ips::ClusterIp),
        service_ports: Some(vec![SERVICE_PORT]),
        slices: slices.into_iter().map(|(c, e)| (c.to_owned(), e)).collect(),
    }
}

fn absent() -> Imported {
    Imported {
        clusters: None,
        import_ports: None,
        conflict: None,
        ips: None,
        service_ports: None,
        slices: vec![],
    }
}

fn at(net: IpNet, hosts: &[(u32, bool)]) -> Vec<(String, bool)> {
    let mut out: Vec<_> = hosts.iter().map(|(h, r)| (host_at(net, *h), *r)).collect();
    out.sort();
    out
}

async fn until(what: &str, site: &Site, want: &Imported) {
    trellis_testkit::eventually_eq(what, LIMIT, want.clone(), || async { imported(site) }).await;
}

/// (kind/name, uid) of every object in `site`'s API server namespace shop that Trellis
/// wrote: what a restart must neither lose nor duplicate.
fn trellis_objects(site: &Site) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (gv, resource) in [
        ("multicluster.x-k8s.io/v1beta1", "serviceimports"),
        ("v1", "services"),
        ("discovery.k8s.io/v1", "endpointslices"),
    ] {
        for o in site.api.objects(gv, resource, "shop") {
            let labels = &o["metadata"]["labels"];
            if labels["app.kubernetes.io/managed-by"] == "trellis.io"
                || labels["endpointslice.kubernetes.io/managed-by"] == "trellis.io"
            {
                out.insert(
                    format!(
                        "{resource}/{}",
                        o["metadata"]["name"].as_str().unwrap_or("")
                    ),
                    o["metadata"]["uid"].as_str().unwrap_or("").to_owned(),
                );
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_export_through_fake_api_servers_reaches_hub_and_induced_leaf_merges_and_survives_restarts()
 {
    let (Some(mut b), Some(mut a), Some(c)) = (
        site("hub-b").await,
        site("leaf-a").await,
        site("leaf-c").await,
    ) else {
        return;
    };
    peer(&a.cluster, &b.cluster).await;
    peer(&c.cluster, &b.cluster).await;
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || {
        tunnel_to(&c.cluster, "leaf-a")
    })
    .await;
    eventually("A's induced tunnel to C", LIMIT, || {
        tunnel_to(&a.cluster, "leaf-c")
    })
    .await;
    let c_view_a: IpNet = c_to_a.remote_pod_cidr_nat.parse().expect("cidr");
    let b_view_a = pod_view(&b.cluster, "leaf-a").await;
    let b_view_c = pod_view(&b.cluster, "leaf-c").await;

    // A exports shop/web: Service 80 -> 8080, two pods, one not ready.
    export(&a, 8080, &[("10.0.0.7", true), ("10.0.0.8", false)]).await;
    until(
        "B imports A's web",
        &b,
        &present(
            &["leaf-a"],
            vec![("leaf-a", at(b_view_a, &[(7, true), (8, false)]))],
        ),
    )
    .await;
    until(
        "C imports A's web at its direct view of A",
        &c,
        &present(
            &["leaf-a"],
            vec![("leaf-a", at(c_view_a, &[(7, true), (8, false)]))],
        ),
    )
    .await;
    let exports = a
        .cluster
        .endpoints()
        .await
        .expect("connects")
        .list_exports(ListExportsRequest {})
        .await
        .expect("lists")
        .into_inner()
        .exports;
    assert_eq!(exports.len(), 1, "{exports:?}");
    // Kubernetes wins: ExportService and UnexportService cannot change what a ServiceExport
    // exports (ADR 0017).
    let mut mapper = a.cluster.endpoints().await.expect("connects");
    let refused = mapper
        .export_service(ExportServiceRequest {
            namespace: "shop".into(),
            name: "web".into(),
            ports: vec![EndpointPort {
                port: Some(8080),
                ..Default::default()
            }],
            endpoints: vec![ExportedEndpoint {
                address: "10.0.0.99".into(),
                ready: Some(true),
            }],
        })
        .await
        .expect_err("a ServiceExport owns shop/web");
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    let refused = mapper
        .unexport_service(UnexportServiceRequest {
            namespace: "shop".into(),
            name: "web".into(),
        })
        .await
        .expect_err("a ServiceExport owns shop/web");
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );

    // Scale up (a third pod, the second one ready now), then down.
    export(
        &a,
        8080,
        &[("10.0.0.7", true), ("10.0.0.8", true), ("10.0.0.9", true)],
    )
    .await;
    until(
        "C follows the scale-up",
        &c,
        &present(
            &["leaf-a"],
            vec![("leaf-a", at(c_view_a, &[(7, true), (8, true), (9, true)]))],
        ),
    )
    .await;
    export(&a, 8080, &[("10.0.0.9", true)]).await;
    let one_pod = present(&["leaf-a"], vec![("leaf-a", at(b_view_a, &[(9, true)]))]);
    until("B follows the scale-down", &b, &one_pod).await;

    // C exports the same Service: B's import merges both clusters' endpoints.
    export(&c, 8080, &[("10.0.0.20", true)]).await;
    let merged = present(
        &["leaf-a", "leaf-c"],
        vec![
            ("leaf-a", at(b_view_a, &[(9, true)])),
            ("leaf-c", at(b_view_c, &[(20, true)])),
        ],
    );
    until("B merges A's and C's web", &b, &merged).await;
    // C's endpoints listen elsewhere: no conflict (each cluster's slices carry their own
    // port), the import unchanged.
    export(&c, 9090, &[("10.0.0.20", true)]).await;
    until("B merges C's other target port", &b, &merged).await;
    // C's Service port differs: reported, and the import keeps the first exporter's port
    // (A's); C's endpoints leave it.
    export_at(&c, 81, 8080, &[("10.0.0.20", true)]).await;
    let mut conflict = merged.clone();
    conflict.conflict = Some("True".into());
    until("B reports the port conflict", &b, &conflict).await;
    export(&c, 8080, &[("10.0.0.20", true)]).await;
    until("B's conflict is resolved", &b, &merged).await;

    // Restarts lose nothing and duplicate nothing: the same objects (same uids) afterwards.
    let before = trellis_objects(&b);
    assert_eq!(
        before.len(),
        4,
        "import, derived service, two slices: {before:?}"
    );
    b.cluster.restart_endpoints().await.expect("b restarts");
    a.cluster.restart_endpoints().await.expect("a restarts");
    // Long enough for several passes of every reconciler after the restarts.
    tokio::time::sleep(Duration::from_secs(8)).await;
    until("B after the restarts", &b, &merged).await;
    assert_eq!(
        trellis_objects(&b),
        before,
        "same objects after the restarts"
    );
    // C exports web too, and an exporting cluster imports its own export (MCS): its own
    // pod, as it addresses it.
    until(
        "C after the restarts",
        &c,
        &present(
            &["leaf-a", "leaf-c"],
            vec![
                ("leaf-a", at(c_view_a, &[(9, true)])),
                ("leaf-c", vec![("10.0.0.20".to_owned(), true)]),
            ],
        ),
    )
    .await;
    // And the restarted services still follow changes.
    export(&a, 8080, &[("10.0.0.9", true), ("10.0.0.10", true)]).await;
    let mut two = merged.clone();
    two.slices[0].1 = at(b_view_a, &[(9, true), (10, true)]);
    until("B follows A after the restarts", &b, &two).await;

    // C withdraws its export by deleting the ServiceExport; A by deleting the Service.
    Api::<ServiceExport>::namespaced(client(&c.api).await, "shop")
        .delete("web", &DeleteParams::default())
        .await
        .expect("deletes");
    until(
        "B keeps only A's web",
        &b,
        &present(
            &["leaf-a"],
            vec![("leaf-a", at(b_view_a, &[(9, true), (10, true)]))],
        ),
    )
    .await;
    Api::<Service>::namespaced(client(&a.api).await, "shop")
        .delete("web", &DeleteParams::default())
        .await
        .expect("deletes");
    until("B forgets A's web", &b, &absent()).await;
    until("C forgets A's web", &c, &absent()).await;

    // Exported again, then A is unpeered: everything A brought is gone from B and C.
    export(&a, 8080, &[("10.0.0.9", true)]).await;
    until("B imports A's web again", &b, &one_pod).await;
    let unpeered = unpeer(&b.cluster, "leaf-a").await;
    assert!(unpeered.unpeered);
    until("B drops A's import after unpeering", &b, &absent()).await;
    until("C drops A's import after unpeering", &c, &absent()).await;
    assert!(trellis_objects(&b).is_empty(), "{:?}", trellis_objects(&b));
}

/// `clusterset.local` DNS (the MCS DNS specification, CoreDNS's `multicluster` plugin) answers
/// from `ServiceImport.spec.ips`: it must be the derived Service's cluster IP, and follow it
/// when the Service is created again with another one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_import_carries_the_derived_service_cluster_ip_and_follows_it() {
    let (Some(b), Some(a)) = (site("hub-b").await, site("leaf-a").await) else {
        return;
    };
    peer(&a.cluster, &b.cluster).await;
    eventually("B's tunnel to A", LIMIT, || tunnel_to(&b.cluster, "leaf-a")).await;
    let b_view_a = pod_view(&b.cluster, "leaf-a").await;
    export(&a, 8080, &[("10.0.0.7", true)]).await;
    let want = present(&["leaf-a"], vec![("leaf-a", at(b_view_a, &[(7, true)]))]);
    until("B imports A's web with its cluster IP", &b, &want).await;
    let (uid, first) = derived_service(&b).expect("the derived service exists");
    assert!(
        !first.is_empty(),
        "the fake API server assigned a cluster IP"
    );

    // The derived Service goes (an operator, a namespace cleanup): the import side creates it
    // again, with another cluster IP, and the ServiceImport must follow.
    Api::<Service>::namespaced(client(&b.api).await, "shop")
        .delete(
            &derived_service_name("shop", "web"),
            &DeleteParams::default(),
        )
        .await
        .expect("deletes");
    let second = eventually("the derived service to come back", LIMIT, || async {
        derived_service(&b)
            .filter(|(again, _)| *again != uid)
            .map(|(_, ip)| ip)
    })
    .await;
    assert_ne!(second, first, "a new Service, a new cluster IP");
    until("B's ServiceImport follows the new cluster IP", &b, &want).await;
}
