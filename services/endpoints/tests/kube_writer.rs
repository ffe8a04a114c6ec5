//! The Kubernetes EndpointSlice writer against a mock API server (ADR 0011): a tower-test
//! service behind `kube::Client` receives every HTTP request the writer sends; the tests assert
//! method, path and body exactly and answer as the API server would. No cluster is needed.

// Tests spawn plainly: there is no service subscriber to keep (services/clippy.toml).
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tonic::Code;
use tower_test::mock::{Handle, SendResponse};
use trellis_api::ClusterIdentity;
use trellis_api::pb::endpoints as pb;
use trellis_endpoints::KubeWriter;
use trellis_endpoints::kube::{derived_service_name, object_name};
use trellis_endpoints::model::Slice;

type ApiHandle = Handle<Request<Body>, Response<Body>>;

const COLLECTION: &str = "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices";

fn mock() -> (KubeWriter, ApiHandle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (
        KubeWriter::new(kube::Client::new(service, "default")),
        handle,
    )
}

fn source() -> ClusterIdentity {
    ClusterIdentity::parse("id", "b", "name", "cluster b").expect("identity")
}

fn slice_pb(addresses: &[&str]) -> pb::EndpointSlice {
    pb::EndpointSlice {
        namespace: "shop".into(),
        name: "web-1".into(),
        service_name: "web".into(),
        address_type: pb::AddressType::Ipv4.into(),
        endpoints: addresses
            .iter()
            .map(|a| pb::Endpoint {
                addresses: vec![(*a).into()],
                conditions: Some(pb::EndpointConditions {
                    ready: Some(true),
                    serving: None,
                    terminating: None,
                }),
                node_name: "node-7".into(),
                ..Default::default()
            })
            .collect(),
        ports: vec![pb::EndpointPort {
            name: "http".into(),
            port: Some(8080),
            ..Default::default()
        }],
        labels: [("app".to_owned(), "web".to_owned())].into(),
        service: None,
    }
}

fn slice(addresses: &[&str]) -> Slice {
    Slice::from_pb("slice", Some(&slice_pb(addresses))).expect("valid slice")
}

fn name() -> String {
    object_name(&source().id, "web-1")
}

/// The exact object the writer must send for `addresses` (node names are dropped: they are the
/// source cluster's nodes).
fn expected(addresses: &[&str]) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name(),
            "namespace": "shop",
            "labels": {
                "app": "web",
                "endpointslice.kubernetes.io/managed-by": "trellis.io",
                // The Service Trellis derived for the import, never the local "web".
                "kubernetes.io/service-name": derived_service_name("shop", "web"),
                "multicluster.kubernetes.io/service-name": "web",
                "trellis.io/source-cluster-id": "b"
            },
            "annotations": {
                "trellis.io/source-cluster-id": "b",
                "trellis.io/source-cluster-name": "cluster b",
                "trellis.io/source-slice": "shop/web-1"
            }
        },
        "addressType": "IPv4",
        "endpoints": addresses.iter().map(|a| json!({"addresses": [a], "conditions": {"ready": true}})).collect::<Vec<_>>(),
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
    })
}

/// As stored by the API server: our object plus server-set metadata.
fn stored(mut object: Value, resource_version: &str) -> Value {
    object["metadata"]["resourceVersion"] = json!(resource_version);
    object["metadata"]["uid"] = json!("uid-1");
    object
}

/// Someone else's slice of the same name.
fn unmanaged() -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name(),
            "namespace": "shop",
            "resourceVersion": "3",
            "labels": {
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                "kubernetes.io/service-name": "web"
            }
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.9.9.9"]}]
    })
}

fn api_status(code: u16, reason: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": if code < 300 { "Success" } else { "Failure" },
        "message": reason,
        "reason": reason,
        "code": code
    })
}

/// The next request: (method, path, query, JSON body or Null), and the responder.
async fn next(
    handle: &mut ApiHandle,
) -> (Method, String, String, Value, SendResponse<Response<Body>>) {
    let (request, send) = tokio::time::timeout(Duration::from_secs(5), handle.next_request())
        .await
        .expect("a request within 5 s")
        .expect("the client is alive");
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let query = request.uri().query().unwrap_or("").to_owned();
    let bytes = request
        .into_body()
        .collect_bytes()
        .await
        .expect("request body");
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("JSON body")
    };
    (method, path, query, body, send)
}

fn respond(send: SendResponse<Response<Body>>, code: u16, body: &Value) {
    send.send_response(
        Response::builder()
            .status(StatusCode::from_u16(code).expect("status"))
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(body).expect("json")))
            .expect("response"),
    );
}

/// No further request reaches the API server.
async fn no_more_requests(handle: &mut ApiHandle) {
    let more = tokio::time::timeout(Duration::from_millis(200), handle.next_request()).await;
    assert!(
        matches!(more, Err(_) | Ok(None)),
        "unexpected request {:?}",
        more.ok()
            .flatten()
            .map(|(r, _)| format!("{} {}", r.method(), r.uri()))
    );
}

#[tokio::test]
async fn creates_a_managed_slice_linked_to_its_service() {
    let (writer, mut handle) = mock();
    let write = tokio::spawn(async move { writer.apply(&source(), &slice(&["10.3.0.7"])).await });

    let (method, path, _, body, send) = next(&mut handle).await;
    assert_eq!(
        (method, path),
        (Method::GET, format!("{COLLECTION}/{}", name()))
    );
    assert_eq!(body, Value::Null);
    respond(send, 404, &api_status(404, "NotFound"));

    let (method, path, query, body, send) = next(&mut handle).await;
    assert_eq!((method, path.as_str()), (Method::POST, COLLECTION));
    assert!(!query.contains("dryRun"), "{query}");
    assert_eq!(body, expected(&["10.3.0.7"]));
    respond(send, 201, &stored(body, "10"));

    assert_eq!(write.await.expect("task").expect("written"), name());
    no_more_requests(&mut handle).await;
}

#[tokio::test]
async fn updates_its_own_slice_with_the_read_resource_version() {
    let (writer, mut handle) = mock();
    let write = tokio::spawn(async move {
        writer
            .apply(&source(), &slice(&["10.3.0.7", "10.3.0.8"]))
            .await
    });

    let (method, path, _, _, send) = next(&mut handle).await;
    assert_eq!(
        (method, path),
        (Method::GET, format!("{COLLECTION}/{}", name()))
    );
    respond(send, 200, &stored(expected(&["10.3.0.7"]), "10"));

    let (method, path, _, body, send) = next(&mut handle).await;
    assert_eq!(
        (method, path),
        (Method::PUT, format!("{COLLECTION}/{}", name()))
    );
    let mut want = expected(&["10.3.0.7", "10.3.0.8"]);
    want["metadata"]["resourceVersion"] = json!("10");
    assert_eq!(body, want);
    respond(send, 200, &stored(body, "11"));

    write.await.expect("task").expect("written");
    no_more_requests(&mut handle).await;
}

#[tokio::test]
async fn a_conflicting_update_is_read_and_decided_again() {
    let (writer, mut handle) = mock();
    let write = tokio::spawn(async move { writer.apply(&source(), &slice(&["10.3.0.8"])).await });

    let (_, _, _, _, send) = next(&mut handle).await;
    respond(send, 200, &stored(expected(&["10.3.0.7"]), "10"));
    let (method, _, _, _, send) = next(&mut handle).await;
    assert_eq!(method, Method::PUT);
    respond(send, 409, &api_status(409, "Conflict"));
    // Re-read: someone already wrote what we want, so nothing more is sent.
    let (method, _, _, _, send) = next(&mut handle).await;
    assert_eq!(method, Method::GET);
    respond(send, 200, &stored(expected(&["10.3.0.8"]), "12"));

    write.await.expect("task").expect("written");
    no_more_requests(&mut handle).await;
}

#[tokio::test]
async fn an_up_to_date_slice_is_not_written_again() {
    let (writer, mut handle) = mock();
    let write = tokio::spawn(async move { writer.apply(&source(), &slice(&["10.3.0.7"])).await });
    let (method, _, _, _, send) = next(&mut handle).await;
    assert_eq!(method, Method::GET);
    respond(send, 200, &stored(expected(&["10.3.0.7"]), "10"));
    write.await.expect("task").expect("written");
    no_more_requests(&mut handle).await;
}

#[tokio::test]
async fn an_unmanaged_slice_is_never_overwritten() {
    let (writer, mut handle) = mock();
    let write = tokio::spawn(async move { writer.apply(&source(), &slice(&["10.3.0.7"])).await });
    let (method, _, _, _, send) = next(&mut handle).await;
    assert_eq!(method, Method::GET);
    respond(send, 200, &unmanaged());
    let err = write.await.expect("task").expect_err("refused");
    assert!(
        matches!(&err, trellis_error::Error::AlreadyExists(m) if m.contains("not managed by Trellis")),
        "{err}"
    );
    no_more_requests(&mut handle).await;
}

#[tokio::test]
async fn deletes_only_its_own_slice_with_preconditions() {
    // Ours: deleted, guarded by the read's resourceVersion and uid.
    let (writer, mut handle) = mock();
    let delete = tokio::spawn(async move { writer.delete(&source(), "shop", "web-1").await });
    let (method, path, _, _, send) = next(&mut handle).await;
    assert_eq!(
        (method, path),
        (Method::GET, format!("{COLLECTION}/{}", name()))
    );
    respond(send, 200, &stored(expected(&["10.3.0.7"]), "10"));
    let (method, path, _, body, send) = next(&mut handle).await;
    assert_eq!(
        (method, path),
        (Method::DELETE, format!("{COLLECTION}/{}", name()))
    );
    assert_eq!(
        body["preconditions"],
        json!({"resourceVersion": "10", "uid": "uid-1"}),
        "{body}"
    );
    respond(send, 200, &api_status(200, "Success"));
    assert!(delete.await.expect("task").expect("deleted"));
    no_more_requests(&mut handle).await;

    // Someone else's: left alone.
    let (writer, mut handle) = mock();
    let delete = tokio::spawn(async move { writer.delete(&source(), "shop", "web-1").await });
    let (method, _, _, _, send) = next(&mut handle).await;
    assert_eq!(method, Method::GET);
    respond(send, 200, &unmanaged());
    assert!(!delete.await.expect("task").expect("no error"));
    no_more_requests(&mut handle).await;

    // Ours but from another source cluster: left alone too.
    let (writer, mut handle) = mock();
    let delete = tokio::spawn(async move { writer.delete(&source(), "shop", "web-1").await });
    let (_, _, _, _, send) = next(&mut handle).await;
    let mut other = stored(expected(&["10.3.0.7"]), "10");
    other["metadata"]["annotations"]["trellis.io/source-cluster-id"] = json!("x");
    respond(send, 200, &other);
    assert!(!delete.await.expect("task").expect("no error"));
    no_more_requests(&mut handle).await;

    // Absent: nothing to do.
    let (writer, mut handle) = mock();
    let delete = tokio::spawn(async move { writer.delete(&source(), "shop", "web-1").await });
    let (_, _, _, _, send) = next(&mut handle).await;
    respond(send, 404, &api_status(404, "NotFound"));
    assert!(!delete.await.expect("task").expect("no error"));
    no_more_requests(&mut handle).await;
}

/// Through the gRPC service: ApplyReflectedSlice writes the object, DeleteReflectedSlice
/// deletes it, and a name held by an unmanaged slice is refused with nothing stored.
#[tokio::test]
async fn apply_and_delete_propagate_to_kubernetes_through_the_service() {
    let (writer, mut handle) = mock();
    let b = common::Cluster::start("b", "10.102.0.0/16", None).await;
    let c = common::Cluster::start("c", "10.103.0.0/16", Some(writer)).await;
    c.peer_with(&b).await;
    let mut client = c.endpoints().await;
    let b_identity = trellis_api::pb::types::ClusterIdentity {
        cluster_id: "b".into(),
        cluster_name: "cluster b".into(),
    };

    // Unmanaged object in the way: ALREADY_EXISTS, nothing stored.
    let api = tokio::spawn(async move {
        let (_, _, _, _, send) = next(&mut handle).await;
        respond(send, 200, &unmanaged());
        handle
    });
    let status = client
        .apply_reflected_slice(pb::ApplyReflectedSliceRequest {
            source: Some(b_identity.clone()),
            slice: Some(slice_pb(&["10.3.0.7"])),
            generation: 1,
        })
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    let mut handle = api.await.expect("api task");
    let held = common::reflected(&mut client, "").await;
    assert!(held.is_empty());

    // Free name: created, and the object name is recorded.
    let api = tokio::spawn(async move {
        let (_, _, _, _, send) = next(&mut handle).await;
        respond(send, 404, &api_status(404, "NotFound"));
        let (method, _, _, body, send) = next(&mut handle).await;
        assert_eq!(method, Method::POST);
        assert_eq!(body, expected(&["10.3.0.7"]));
        respond(send, 201, &stored(body, "20"));
        handle
    });
    let applied = client
        .apply_reflected_slice(pb::ApplyReflectedSliceRequest {
            source: Some(b_identity.clone()),
            slice: Some(slice_pb(&["10.3.0.7"])),
            generation: 5,
        })
        .await
        .expect("applied")
        .into_inner();
    assert!(applied.applied);
    assert_eq!(applied.object_name, name());
    let mut handle = api.await.expect("api task");

    // A stale generation: ignored without touching Kubernetes; the held one is a re-send.
    let stale = client
        .apply_reflected_slice(pb::ApplyReflectedSliceRequest {
            source: Some(b_identity.clone()),
            slice: Some(slice_pb(&["10.3.0.9"])),
            generation: 4,
        })
        .await
        .expect("answered")
        .into_inner();
    assert!(!stale.applied);
    let resent = client
        .apply_reflected_slice(pb::ApplyReflectedSliceRequest {
            source: Some(b_identity.clone()),
            slice: Some(slice_pb(&["10.3.0.7"])),
            generation: 5,
        })
        .await
        .expect("answered")
        .into_inner();
    assert!(resent.applied);
    no_more_requests(&mut handle).await;
    let held = common::reflected(&mut client, "").await;
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].generation, 5);
    assert_eq!(held[0].object_name, name());

    // Deleted: the object goes too.
    let api = tokio::spawn(async move {
        let (_, _, _, _, send) = next(&mut handle).await;
        respond(send, 200, &stored(expected(&["10.3.0.7"]), "20"));
        let (method, path, _, _, send) = next(&mut handle).await;
        assert_eq!(
            (method, path),
            (Method::DELETE, format!("{COLLECTION}/{}", name()))
        );
        respond(send, 200, &api_status(200, "Success"));
        handle
    });
    let deleted = client
        .delete_reflected_slice(pb::DeleteReflectedSliceRequest {
            source: Some(b_identity),
            namespace: "shop".into(),
            name: "web-1".into(),
        })
        .await
        .expect("deleted")
        .into_inner();
    assert!(deleted.deleted);
    api.await.expect("api task");
    let held = common::reflected(&mut client, "").await;
    assert!(held.is_empty());
}
