use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use super::layer::KnownRoutes;
use super::*;
use crate::server::GrpcServer;

fn local() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

async fn scrape(addr: SocketAddr) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("http");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}

/// The value of the sample line starting with `series`, if any.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test]
async fn served_rpcs_are_counted_by_service_method_and_code() {
    let server = GrpcServer::bind(local())
        .await
        .expect("bind")
        .with_metrics_listener(MetricsListen::At(local()))
        .await
        .expect("metrics bind");
    let grpc = server.local_addr();
    let metrics = server.metrics_addr().expect("metrics listener");
    let shutdown = Shutdown::new();
    let task = server.spawn(
        tonic::service::Routes::default(),
        &[],
        shutdown.clone(),
        Duration::from_secs(1),
        Vec::new(),
    );
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .expect("uri")
        .connect()
        .await
        .expect("connects");
    let mut health = HealthClient::new(channel);
    for _ in 0..2 {
        health
            .check(HealthCheckRequest::default())
            .await
            .expect("serving");
    }
    let err = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .expect_err("unknown service");
    assert_eq!(err.code(), tonic::Code::NotFound);
    // A stream the client drops before its end.
    let watch = health
        .watch(HealthCheckRequest::default())
        .await
        .expect("watch");
    drop(watch);

    let labels = |method: &str, code: &str| {
        format!(
            "grpc_server_handled_total{{grpc_service=\"grpc.health.v1.Health\",grpc_method=\"{method}\",grpc_code=\"{code}\"}}"
        )
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let text = loop {
        let text = scrape(metrics).await;
        if value(&text, &labels("Watch", "Cancelled")).is_some()
            || tokio::time::Instant::now() > deadline
        {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(value(&text, &labels("Check", "OK")), Some(2.0), "{text}");
    assert_eq!(
        value(&text, &labels("Check", "NotFound")),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, &labels("Watch", "Cancelled")),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "grpc_server_handling_seconds_count{grpc_service=\"grpc.health.v1.Health\",grpc_method=\"Check\"}"
        ),
        Some(3.0),
        "{text}"
    );
    // Asked for nothing in particular: the text format, counters typed under the name
    // their samples have.
    assert!(
        text.contains("# TYPE grpc_server_handled_total counter\n") && !text.contains("# EOF"),
        "{text}"
    );
    shutdown.cancel();
    task.await.expect("joins").expect("stops cleanly");
}

/// A service's calls count in its own registry by service, method and the code the server
/// answered (an error status included), and a call that gets no response at all (nothing
/// listens) counts as `Unavailable`.
#[tokio::test]
async fn client_calls_are_counted_by_the_code_answered() {
    let server = GrpcServer::bind(local())
        .await
        .expect("bind")
        .with_metrics_listener(MetricsListen::At(local()))
        .await
        .expect("metrics bind");
    let grpc = server.local_addr();
    let scrape_at = server.metrics_addr().expect("metrics listener");
    let metrics = server.metrics().clone();
    assert!(metrics.served());
    let shutdown = Shutdown::new();
    let task = server.spawn(
        tonic::service::Routes::default(),
        &[],
        shutdown.clone(),
        Duration::from_secs(1),
        Vec::new(),
    );
    let timeouts = crate::client::Timeouts::default();
    let channel =
        crate::client::channel("address", &grpc.to_string(), timeouts, &metrics).expect("channel");
    let mut health = HealthClient::new(channel);
    health
        .check(HealthCheckRequest::default())
        .await
        .expect("serving");
    let err = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .expect_err("unknown service");
    assert_eq!(err.code(), tonic::Code::NotFound);

    // A port nothing listens on: refused, no response.
    let closed = TcpListener::bind(local()).await.expect("bind");
    let closed_addr = closed.local_addr().expect("addr");
    drop(closed);
    let dead = crate::client::channel("address", &closed_addr.to_string(), timeouts, &metrics)
        .expect("channel");
    let err = HealthClient::new(dead)
        .check(HealthCheckRequest::default())
        .await
        .expect_err("nothing listens");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");

    let text = scrape(scrape_at).await;
    let handled = |code: &str| {
        format!(
            "grpc_client_handled_total{{grpc_service=\"grpc.health.v1.Health\",grpc_method=\"Check\",grpc_code=\"{code}\"}}"
        )
    };
    assert_eq!(value(&text, &handled("OK")), Some(1.0), "{text}");
    assert_eq!(value(&text, &handled("NotFound")), Some(1.0), "{text}");
    assert_eq!(value(&text, &handled("Unavailable")), Some(1.0), "{text}");
    assert_eq!(
        value(
            &text,
            "grpc_client_handling_seconds_count{grpc_service=\"grpc.health.v1.Health\",grpc_method=\"Check\"}"
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "grpc_client_started_total{grpc_service=\"grpc.health.v1.Health\",grpc_method=\"Check\"}"
        ),
        Some(3.0),
        "{text}"
    );
    shutdown.cancel();
    task.await.expect("joins").expect("stops cleanly");
}

/// Without a `/metrics` listener nothing records: a channel passes calls through.
#[tokio::test]
async fn an_unserved_registry_meters_nothing() {
    let metrics = Metrics::new();
    assert!(!metrics.served());
    let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy();
    assert!(metrics.meter_channel(channel).metrics.is_none());
    let store: trellis_store::SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let same = metrics.meter_store(store.clone());
    assert!(Arc::ptr_eq(&store, &same), "the store is not wrapped");
}

/// Calls `path` on `channel` (an empty health request; any answer will do), returning the
/// code answered.
async fn call_path(channel: tonic::transport::Channel, path: String) -> tonic::Code {
    let mut grpc = tonic::client::Grpc::new(channel);
    if grpc.ready().await.is_err() {
        return tonic::Code::Unavailable;
    }
    let path = http::uri::PathAndQuery::try_from(path).expect("a valid path");
    let codec = tonic_prost::ProstCodec::<
        HealthCheckRequest,
        tonic_health::pb::HealthCheckResponse,
    >::default();
    match grpc
        .unary(
            tonic::Request::new(HealthCheckRequest::default()),
            path,
            codec,
        )
        .await
    {
        Ok(_) => tonic::Code::Ok,
        Err(status) => status.code(),
    }
}

/// Calls every path of `paths` on `channel`, 32 at a time; returns how many got each code.
async fn call_paths(
    channel: &tonic::transport::Channel,
    paths: impl Iterator<Item = String>,
) -> std::collections::BTreeMap<String, usize> {
    use futures::StreamExt as _;
    let codes: Vec<tonic::Code> = futures::stream::iter(paths)
        .map(|path| call_path(channel.clone(), path))
        .buffer_unordered(32)
        .collect()
        .await;
    let mut counts = std::collections::BTreeMap::new();
    for code in codes {
        *counts.entry(format!("{code:?}")).or_default() += 1;
    }
    counts
}

/// The sample lines of the gRPC server metrics.
fn server_series(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("grpc_server_"))
        .count()
}

/// Distinct paths the server does not serve, with a long tail like an attacker's: under an
/// unknown service (refused by both listeners' checks), and under health and reflection
/// (which both listeners let through, to an UNIMPLEMENTED answer).
fn unknown_paths(tag: &str, range: std::ops::Range<usize>) -> impl Iterator<Item = String> {
    let tail = "x".repeat(200);
    range.map(move |i| match i % 3 {
        0 => format!("/junk.{tag}{i}.Service/Method{i}{tail}"),
        1 => format!("/grpc.health.v1.Health/{tag}{i}{tail}"),
        _ => format!("/grpc.reflection.v1.ServerReflection/{tag}{i}{tail}"),
    })
}

/// An unauthenticated caller cannot grow the registry: 10,000 distinct paths the server
/// does not serve, sent to the peer listener without a client certificate and to the
/// plaintext listener without the local token, leave `/metrics` small and add no series
/// (the labels name only routes the server serves); the refusals are still counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_paths_from_unauthenticated_callers_do_not_grow_the_registry() {
    const PATHS: usize = 10_000;
    const METHODS: crate::peer::PeerMethods = crate::peer::PeerMethods {
        authenticated: &["/trellis.peering.v1.Broker/SubmitNetworkConfig"],
        anonymous: &["/trellis.peering.v1.Broker/Handshake"],
    };
    let ca = crate::tls::ClusterCa::generate("leaf-a").expect("CA");
    let cert = ca.issue("broker").expect("cert");
    let tls = crate::tls::PeerTls::new("leaf-a", ca.cert_pem(), &cert.cert_pem, cert.key_pem())
        .expect("tls");
    let peer = crate::server::PeerListener::bind(local(), tls.clone(), METHODS)
        .await
        .expect("peer bind");
    let mut server = GrpcServer::bind(local())
        .await
        .expect("bind")
        .with_metrics_listener(MetricsListen::At(local()))
        .await
        .expect("metrics bind")
        .with_local_token(
            crate::local_auth::LocalToken::new("0123456789abcdef-local").expect("token"),
        );
    server.set_cluster_facing(Some(peer), METHODS);
    let plain_addr = server.local_addr();
    let peer_addr = server.peer_addr().expect("peer listener");
    let scrape_at = server.metrics_addr().expect("metrics listener");
    let shutdown = Shutdown::new();
    let task = server.spawn(
        tonic::service::Routes::default(),
        &[],
        shutdown.clone(),
        Duration::from_secs(1),
        Vec::new(),
    );
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{plain_addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connects");
    let anonymous = crate::tls::TlsEndpoint::new(
        "peer",
        &peer_addr.to_string(),
        crate::client::Timeouts::default(),
        tls.handshake_client_config().expect("client config"),
    )
    .expect("endpoint")
    .connect()
    .await
    .expect("connects without a client certificate");

    // Positive control: both listeners answer and are counted.
    for channel in [&plain, &anonymous] {
        HealthClient::new(channel.clone())
            .check(HealthCheckRequest::default())
            .await
            .expect("serving");
    }
    // Every kind of unknown path once, on both listeners: the series they may add.
    let mut warmup = call_paths(&plain, unknown_paths("warm", 0..30)).await;
    for (code, n) in call_paths(&anonymous, unknown_paths("warm", 0..30)).await {
        *warmup.entry(code).or_default() += n;
    }
    assert_eq!(
        warmup.keys().map(String::as_str).collect::<Vec<_>>(),
        ["PermissionDenied", "Unauthenticated", "Unimplemented"],
        "{warmup:?}"
    );
    let before = scrape(scrape_at).await;
    assert_eq!(
        value(
            &before,
            "grpc_server_handled_total{grpc_service=\"grpc.health.v1.Health\",grpc_method=\"Check\",grpc_code=\"OK\"}"
        ),
        Some(2.0),
        "{before}"
    );

    let plain_codes = call_paths(&plain, unknown_paths("plain", 0..PATHS)).await;
    let peer_codes = call_paths(&anonymous, unknown_paths("peer", 0..PATHS)).await;
    assert_eq!(
        plain_codes.values().sum::<usize>() + peer_codes.values().sum::<usize>(),
        2 * PATHS,
        "{plain_codes:?} {peer_codes:?}"
    );
    let after = scrape(scrape_at).await;
    assert!(
        after.len() < 256 * 1024,
        "/metrics grew to {} bytes with {} series after {PATHS} distinct unknown paths on \
         each listener ({} series before)",
        after.len(),
        server_series(&after),
        server_series(&before)
    );
    assert_eq!(
        server_series(&after),
        server_series(&before),
        "the series grew with the paths: {after}"
    );
    // Operators still see the refusals, under a fixed label.
    let refused = |code: &str| {
        value(
            &after,
            &format!(
                "grpc_server_handled_total{{grpc_service=\"unknown\",grpc_method=\"unknown\",grpc_code=\"{code}\"}}"
            ),
        )
    };
    let total = |codes: &std::collections::BTreeMap<String, usize>, code: &str| {
        codes.get(code).copied().unwrap_or_default() + warmup.get(code).copied().unwrap_or_default()
    };
    assert_eq!(
        refused("Unauthenticated"),
        Some(total(&plain_codes, "Unauthenticated") as f64),
        "{after}"
    );
    assert_eq!(
        refused("PermissionDenied"),
        Some(total(&peer_codes, "PermissionDenied") as f64),
        "{after}"
    );
    shutdown.cancel();
    task.await.expect("joins").expect("stops cleanly");
}

/// Labels name the methods of the services a server serves, health and reflection; any
/// other path, a method of a service served elsewhere included, is "unknown".
#[test]
fn only_served_methods_are_named() {
    let known = KnownRoutes::of(&["trellis.gateway.v1.Gateway"]);
    let named = |service: &str, method: &str| (service.to_owned(), method.to_owned());
    assert_eq!(
        known.labels("/trellis.gateway.v1.Gateway/GetGatewayInfo"),
        named("trellis.gateway.v1.Gateway", "GetGatewayInfo")
    );
    assert_eq!(
        known.labels("/grpc.health.v1.Health/Watch"),
        named("grpc.health.v1.Health", "Watch")
    );
    assert_eq!(
        known.labels("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
        named(
            "grpc.reflection.v1alpha.ServerReflection",
            "ServerReflectionInfo"
        )
    );
    for unknown in [
        "/trellis.gateway.v1.Gateway/NoSuchMethod",
        "/trellis.ipam.v1.Ipam/GetLocalSubnets",
        "/grpc.health.v1.Health/",
        "/",
        "",
    ] {
        assert_eq!(
            known.labels(unknown),
            named("unknown", "unknown"),
            "{unknown:?}"
        );
    }
}

#[tokio::test]
async fn a_taken_default_port_costs_the_metrics_an_explicit_one_fails() {
    let taken = TcpListener::bind(local()).await.expect("bind");
    let addr = taken.local_addr().expect("addr");
    let server = GrpcServer::bind(local())
        .await
        .expect("bind")
        .with_metrics_listener(MetricsListen::Default(addr))
        .await
        .expect("a default port taken is not an error");
    assert_eq!(server.metrics_addr(), None);
    let err = GrpcServer::bind(local())
        .await
        .expect("bind")
        .with_metrics_listener(MetricsListen::At(addr))
        .await
        .expect_err("an explicit address taken is an error");
    assert!(format!("{err:#}").contains(&addr.to_string()), "{err:#}");
    let off = GrpcServer::bind(local())
        .await
        .expect("bind")
        .with_metrics_listener("off".parse().expect("off parses"))
        .await
        .expect("off");
    assert_eq!(off.metrics_addr(), None);
    assert!("nonsense".parse::<MetricsListen>().is_err());
}
