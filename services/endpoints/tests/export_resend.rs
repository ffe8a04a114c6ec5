//! What the export reconciler costs and repairs once an export is delivered, with real
//! in-process IPAMs and discoveries (hub B, leaves A and C with an induced peering; A exports,
//! B passes it on to C): the periodic resend (`--export-resend`) translates nothing again and
//! writes nothing while nothing changed, yet still brings back an import a consumer lost; and a
//! consumer that holds a higher generation than the exporter's (an exporter whose store was
//! rebuilt and whose clock is behind) still gets the exporter's changes.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{Cluster, Fabric, at, until};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use trellis_api::pb::endpoints::{
    ApplyReflectedSliceRequest, DeleteReflectedSliceRequest, Endpoint, EndpointConditions,
    EndpointPort, EndpointSlice, ExportServiceRequest, ReflectedSlice,
};
use trellis_api::pb::types::ClusterIdentity;

/// The resend period of these tests: every reconciler pass (one per 2 s resync) resends.
const RESEND_MS: &str = "500";

fn export(hosts: &[String]) -> ExportServiceRequest {
    let ready: Vec<(String, bool)> = hosts.iter().map(|host| (host.clone(), true)).collect();
    trellis_testkit::exports::export_request("shop", "web", &ready)
}

async fn start(id: &'static str, external: &'static str) -> Cluster {
    Cluster::start_with_args(
        id,
        external,
        &[
            "--export-resend",
            RESEND_MS,
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    )
    .await
}

/// The one slice `cluster` holds from `source`, if any.
async fn held(cluster: &Cluster, source: &str) -> Option<ReflectedSlice> {
    let slices = common::reflected(&mut cluster.endpoints().await, source).await;
    assert!(slices.len() <= 1, "one export, one slice: {slices:?}");
    slices.into_iter().next()
}

/// The addresses of the one slice `cluster` holds from `source`.
async fn addresses(cluster: &Cluster, source: &str) -> Option<Vec<String>> {
    held(cluster, source).await.map(|r| {
        r.slice
            .expect("slice")
            .endpoints
            .into_iter()
            .flat_map(|e| e.addresses)
            .collect()
    })
}

/// The sum of every sample of `name` whose labels contain each of `labels`, from the
/// Prometheus text `/metrics` at `addr`.
async fn metric(addr: Option<SocketAddr>, name: &str, labels: &[&str]) -> f64 {
    let addr = addr.expect("the endpoints service serves /metrics");
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connects to /metrics");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("writes");
    let mut text = String::new();
    stream.read_to_string(&mut text).await.expect("reads");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter(|(series, _)| {
            series.split_once('{').map_or(*series, |(n, _)| n).eq(name)
                && labels.iter().all(|want| series.contains(want))
        })
        .filter_map(|(_, value)| value.parse::<f64>().ok())
        .sum()
}

/// Calls a cluster's endpoints service made to its IPAM (local or remote) that translate one
/// address each: the cost of a translation.
async fn translation_calls(cluster: &Cluster) -> f64 {
    let mut total = 0.0;
    for method in ["GetClusterIdentity", "MapEndpointIp", "GetHomePodIp"] {
        total += metric(
            cluster.endpoints_metrics,
            "grpc_client_started_total",
            &[
                "grpc_service=\"trellis.ipam.v1.Ipam\"",
                &format!("grpc_method=\"{method}\""),
            ],
        )
        .await;
    }
    total
}

/// Store transactions (every write of the endpoints service is one).
async fn store_writes(cluster: &Cluster) -> f64 {
    metric(
        cluster.endpoints_metrics,
        "trellis_store_operation_seconds_count",
        &["operation=\"txn\""],
    )
    .await
}

/// Slices a cluster's endpoints service was handed by its peers (every delivery and resend).
async fn applies(cluster: &Cluster) -> f64 {
    metric(
        cluster.endpoints_metrics,
        "grpc_server_started_total",
        &["grpc_method=\"ApplyReflectedSlice\""],
    )
    .await
}

/// Waits until `cluster` has been handed at least `n` more slices than `from`.
async fn until_applies(what: &str, cluster: &Cluster, from: f64, n: f64) {
    trellis_testkit::eventually(what, common::LIMIT, || async {
        let now = applies(cluster).await;
        if now >= from + n {
            Ok(())
        } else {
            Err(format!("{} resends, want {n}", now - from))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resends_of_an_unchanged_export_translate_and_write_nothing_yet_repair_a_lost_import() {
    let a = start("a", "10.101.0.0/16").await;
    let b = start("b", "10.102.0.0/16").await;
    let c = start("c", "10.103.0.0/16").await;
    let fabric = Fabric::connect(a, b, c, true).await;
    let (a, b, c) = (&fabric.a, &fabric.b, &fabric.c);
    let pods = common::POD_CIDR.parse().expect("cidr");
    let c_view_a = fabric.c_view_a.expect("induced").pod;
    a.endpoints()
        .await
        .export_service(export(&[at(pods, 7), at(pods, 8)]))
        .await
        .expect("exports");
    let at_b = Some(vec![at(fabric.b_view_a.pod, 7), at(fabric.b_view_a.pod, 8)]);
    let at_c = Some(vec![at(c_view_a, 7), at(c_view_a, 8)]);
    until("B imports A's web", at_b.clone(), || addresses(b, "a")).await;
    until("C imports A's web through B, induced", at_c.clone(), || {
        addresses(c, "b")
    })
    .await;
    // Settled: one resend reached each consumer since.
    until_applies("settling, B", b, applies(b).await, 1.0).await;
    until_applies("settling, C", c, applies(c).await, 1.0).await;

    let generations = (
        held(b, "a").await.expect("held").generation,
        held(c, "b").await.expect("held").generation,
    );
    let translations = (translation_calls(a).await, translation_calls(b).await);
    let writes = (
        store_writes(a).await,
        store_writes(b).await,
        store_writes(c).await,
    );
    assert!(
        translations.0 > 0.0 && translations.1 > 0.0,
        "the probe sees translations: {translations:?}"
    );
    // Three resends reach each consumer with nothing changed (the positive control: the resend
    // runs)...
    let (from_b, from_c) = (applies(b).await, applies(c).await);
    until_applies("resends to B", b, from_b, 3.0).await;
    until_applies("resends to C", c, from_c, 3.0).await;
    // ...and none of them translated an address again, bumped a generation or wrote a store.
    assert_eq!(
        (translation_calls(a).await, translation_calls(b).await),
        translations,
        "translation calls of (A, B) over three resends of an unchanged export"
    );
    assert_eq!(
        (
            held(b, "a").await.expect("held").generation,
            held(c, "b").await.expect("held").generation
        ),
        generations,
        "generations held by (B, C) over three resends of an unchanged export"
    );
    assert_eq!(
        (
            store_writes(a).await,
            store_writes(b).await,
            store_writes(c).await
        ),
        writes,
        "store writes of (A, B, C) over three resends of an unchanged export"
    );

    // What the resend is for: a consumer that lost its import gets it back.
    let dropped = b
        .endpoints()
        .await
        .delete_reflected_slice(DeleteReflectedSliceRequest {
            source: Some(a.identity()),
            namespace: "shop".into(),
            name: "web".into(),
        })
        .await
        .expect("deletes")
        .into_inner();
    assert!(dropped.deleted);
    assert_eq!(addresses(b, "a").await, None);
    until("B gets A's web back", at_b, || addresses(b, "a")).await;
    until("C gets it back through B", at_c, || addresses(c, "b")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_holding_a_higher_generation_still_gets_the_exporters_changes() {
    let fabric = Fabric::start(false).await;
    let (a, b) = (&fabric.a, &fabric.b);
    let pods = common::POD_CIDR.parse().expect("cidr");
    // B holds A's web at a generation a day ahead of A's clock: what B keeps when A's store is
    // rebuilt while A's clock is behind the one that numbered B's copy.
    let ahead = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis(),
    )
    .expect("millis")
        + 86_400_000;
    let old = at(fabric.b_view_a.pod, 99);
    let applied = b
        .endpoints()
        .await
        .apply_reflected_slice(ApplyReflectedSliceRequest {
            source: Some(ClusterIdentity {
                cluster_id: "a".into(),
                cluster_name: "cluster a".into(),
            }),
            slice: Some(EndpointSlice {
                namespace: "shop".into(),
                name: "web".into(),
                service_name: "web".into(),
                address_type: 1,
                endpoints: vec![Endpoint {
                    addresses: vec![old.clone()],
                    conditions: Some(EndpointConditions {
                        ready: Some(true),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                ports: vec![EndpointPort {
                    name: "http".into(),
                    port: Some(8080),
                    ..Default::default()
                }],
                labels: [(
                    "multicluster.kubernetes.io/source-cluster".to_owned(),
                    "a".to_owned(),
                )]
                .into(),
                service: None,
            }),
            generation: ahead,
        })
        .await
        .expect("applies")
        .into_inner();
    assert!(applied.applied);
    assert_eq!(addresses(b, "a").await, Some(vec![old]));

    a.endpoints()
        .await
        .export_service(export(&[at(pods, 7)]))
        .await
        .expect("exports");
    let want = Some(vec![at(fabric.b_view_a.pod, 7)]);
    let limit = Duration::from_secs(10);
    let followed =
        trellis_testkit::within_eq("B to hold A's export", limit, want, || addresses(b, "a"));
    if let Err(timed_out) = followed.await {
        let generation = held(b, "a").await.map(|r| r.generation);
        panic!("{timed_out} (B's generation {generation:?})");
    }
    assert!(held(b, "a").await.expect("held").generation > ahead);
}
