//! Prometheus metrics of one service (issue 19): a registry per service (not per process, so
//! the lab's in-process services each expose their own), the gRPC server metrics every
//! [`crate::server::GrpcServer`] records through [`GrpcMetricsLayer`], the gRPC client metrics
//! of every channel [`crate::client`] and [`crate::tls`] build ([`MeteredChannel`]), the store
//! metrics of the store [`crate::config::CommonConfig::open_store`] opens
//! ([`trellis_store::metered`]), and the `/metrics` listener (`--metrics-listen`), encoded by
//! `prometheus-client` and served as OpenMetrics or the classic text format, whichever the
//! scraper's `Accept` asks for ([`crate::exposition`]), through axum on a tonic server that
//! also accepts HTTP/1.1 — no second HTTP stack.
//!
//! Gauges that mirror store state are refreshed at scrape time by the hooks a service
//! registers with [`Metrics::on_scrape`], so a scrape shows what the store holds at that
//! moment; counters and histograms are updated where the event happens.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll, ready};
use std::time::Instant;

use anyhow::Context as _;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use trellis_store::metered::StoreMetrics;

use crate::exposition::{self, Format};
use crate::shutdown::Shutdown;

/// The metric types, for services registering their own.
pub use prometheus_client;

/// Labels as ordered name/value pairs.
pub type Labels = Vec<(&'static str, String)>;

type Hook = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// A histogram constructor with the latency buckets used everywhere: 100 µs to ~13 s.
pub use trellis_store::metered::LatencyBuckets;

/// A family of latency histograms.
pub type LatencyFamily = Family<Labels, Histogram, LatencyBuckets>;

/// The metrics of one service. Cheap to clone; clones share the registry.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<RwLock<Registry>>,
    hooks: Arc<RwLock<Vec<Hook>>>,
    grpc: GrpcFamilies,
    client: GrpcFamilies,
    store: StoreMetrics,
    /// Whether `/metrics` is served: only then do channels and the store record (nothing
    /// would read it otherwise, and `ipam-bench` measures against exactly that).
    served: Arc<AtomicBool>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// An empty registry with the gRPC server and client metrics and the store metrics
    /// registered; not [served](Self::served) yet.
    pub fn new() -> Self {
        let metrics = Self {
            registry: Arc::new(RwLock::new(Registry::default())),
            hooks: Arc::default(),
            grpc: GrpcFamilies::default(),
            client: GrpcFamilies::default(),
            store: StoreMetrics::default(),
            served: Arc::default(),
        };
        metrics.register(
            "grpc_server_started",
            "RPCs started on the server",
            metrics.grpc.started.clone(),
        );
        metrics.register(
            "grpc_server_handled",
            "RPCs completed on the server, by gRPC status code",
            metrics.grpc.handled.clone(),
        );
        metrics.register(
            "grpc_server_handling_seconds",
            "Time from request to the end of the response (trailers), seconds",
            metrics.grpc.seconds.clone(),
        );
        // The client side, with go-grpc-prometheus' names: calls this service makes, to its
        // own cluster's services and to other clusters'.
        metrics.register(
            "grpc_client_started",
            "RPCs started by this service as a client",
            metrics.client.started.clone(),
        );
        metrics.register(
            "grpc_client_handled",
            "RPCs this service made that completed, by gRPC status code (no response: the code the client maps the transport error to)",
            metrics.client.handled.clone(),
        );
        metrics.register(
            "grpc_client_handling_seconds",
            "Time from sending a request to the end of the response (trailers), seconds",
            metrics.client.seconds.clone(),
        );
        metrics
            .store
            .register(&mut metrics.registry.write().unwrap_or_else(|e| e.into_inner()));
        metrics
    }

    /// Whether `/metrics` is served (see [`crate::server::GrpcServer::with_metrics_listener`]).
    pub fn served(&self) -> bool {
        self.served.load(Ordering::Relaxed)
    }

    pub(crate) fn set_served(&self, served: bool) {
        self.served.store(served, Ordering::Relaxed);
    }

    /// `store`, recording `trellis_store_*` into this registry when it is served; `store`
    /// itself otherwise.
    pub fn meter_store(&self, store: trellis_store::SharedStore) -> trellis_store::SharedStore {
        if self.served() {
            trellis_store::metered::metered(store, &self.store)
        } else {
            store
        }
    }

    /// `channel`, recording `grpc_client_*` into this registry when it is served.
    pub fn meter_channel(&self, channel: tonic::transport::Channel) -> MeteredChannel {
        MeteredChannel {
            inner: channel,
            metrics: self.served().then(|| self.client.clone()),
        }
    }

    /// Registers `metric` as `name` (counters get `_total` appended by the encoder).
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.registry
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .register(name, help, metric);
    }

    /// Registers a collector: metrics whose label sets come and go with what they describe
    /// (e.g. one series per tunnel), encoded from the collector's own state at every scrape.
    pub fn register_collector(&self, collector: impl prometheus_client::collector::Collector) {
        self.registry
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .register_collector(Box::new(collector));
    }

    /// Runs `hook` before every scrape (to refresh gauges that mirror the store).
    pub fn on_scrape<F, Fut>(&self, hook: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.hooks
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::new(move || Box::pin(hook())));
    }

    /// The layer recording the gRPC server metrics into this registry, for a server serving
    /// `services` (and health and reflection): see [`KnownRoutes`].
    pub fn grpc_layer(&self, services: &[&str]) -> GrpcMetricsLayer {
        GrpcMetricsLayer {
            metrics: self.grpc.clone(),
            known: Arc::new(KnownRoutes::of(services)),
        }
    }

    /// Refreshes and renders the registry in `format`.
    pub async fn render_as(&self, format: Format) -> String {
        let openmetrics = self.render().await;
        match format {
            Format::OpenMetrics => openmetrics,
            Format::Text => exposition::to_text(&openmetrics),
        }
    }

    /// Refreshes and renders the registry in OpenMetrics.
    pub async fn render(&self) -> String {
        let hooks: Vec<Hook> = self.hooks.read().unwrap_or_else(|e| e.into_inner()).clone();
        futures::future::join_all(hooks.iter().map(|h| h())).await;
        let mut out = String::new();
        let registry = self.registry.read().unwrap_or_else(|e| e.into_inner());
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &registry);
        out
    }
}

/// Where `/metrics` is served: an address, or nowhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricsListen {
    /// Serve on this address (port 0 picks a free one); failing to bind is an error.
    At(SocketAddr),
    /// The service's default port, not asked for: when it is taken (several clusters on one
    /// host, as in tests and benchmarks) the service warns and runs without metrics rather
    /// than failing. In Kubernetes every pod has the port to itself.
    Default(SocketAddr),
    /// No metrics listener.
    Off,
}

impl std::str::FromStr for MetricsListen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("off") {
            return Ok(Self::Off);
        }
        s.parse()
            .map(Self::At)
            .map_err(|e| format!("{s:?} is neither HOST:PORT nor \"off\": {e}"))
    }
}

/// A bound `/metrics` listener.
#[derive(Debug)]
pub struct MetricsListener {
    listener: TcpListener,
    addr: SocketAddr,
}

impl MetricsListener {
    /// Binds `addr`.
    pub async fn bind(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} (metrics)"))?;
        let addr = listener.local_addr()?;
        Ok(Self { listener, addr })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves `GET /metrics` until `shutdown`.
    pub async fn serve(self, metrics: Metrics, shutdown: Shutdown) -> anyhow::Result<()> {
        tracing::info!(addr = %self.addr, "serving metrics on /metrics");
        let router = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move |headers: http::HeaderMap| {
                let metrics = metrics.clone();
                async move {
                    let accept = headers
                        .get(http::header::ACCEPT)
                        .and_then(|v| v.to_str().ok());
                    let format = Format::negotiate(accept);
                    (
                        [(http::header::CONTENT_TYPE, format.content_type())],
                        metrics.render_as(format).await,
                    )
                }
            }),
        );
        tonic::transport::Server::builder()
            .accept_http1(true)
            .add_routes(tonic::service::Routes::from(router))
            .serve_with_incoming_shutdown(TcpListenerStream::new(self.listener), async move {
                shutdown.cancelled().await;
            })
            .await
            .context("metrics server failed")
    }
}

/// The gRPC metrics of one side (server or client), with the conventional names and labels.
#[derive(Debug, Clone)]
struct GrpcFamilies {
    started: Family<Labels, Counter>,
    handled: Family<Labels, Counter>,
    seconds: LatencyFamily,
}

impl Default for GrpcFamilies {
    fn default() -> Self {
        Self {
            started: Family::default(),
            handled: Family::default(),
            seconds: Family::new_with_constructor(LatencyBuckets),
        }
    }
}

/// The label values of a call to a path the server does not serve.
const UNKNOWN: &str = "unknown";

/// Health and reflection: served by every server. Reflection's own descriptors are not in
/// the sets [`api_methods`] reads.
const ALWAYS_SERVED: &[&str] = &[
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];
const REFLECTION_METHODS: &[&str] = &[
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// Every method of the API and of health, as `/package.Service/Method`, read once per process
/// from their file descriptors.
fn api_methods() -> &'static [String] {
    static METHODS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    METHODS.get_or_init(|| {
        let mut out: Vec<String> = REFLECTION_METHODS.iter().map(|m| (*m).to_owned()).collect();
        for encoded in [
            trellis_api::FILE_DESCRIPTOR_SET,
            tonic_health::pb::FILE_DESCRIPTOR_SET,
        ] {
            // Built into the binary by the same build that generated the services: a set
            // that does not decode leaves only health and reflection labelled, and is logged.
            let set = match <prost_types::FileDescriptorSet as prost::Message>::decode(encoded) {
                Ok(set) => set,
                Err(err) => {
                    tracing::error!(error = %err, "cannot read the API's file descriptors; server metrics label its methods unknown");
                    continue;
                }
            };
            for file in &set.file {
                for service in &file.service {
                    for method in &service.method {
                        out.push(format!(
                            "/{}.{}/{}",
                            file.package(),
                            service.name(),
                            method.name()
                        ));
                    }
                }
            }
        }
        out
    })
}

/// The routes a server serves, the only paths its metrics name: every other path (anyone can
/// send any `:path`, before any authentication) counts under [`UNKNOWN`], so the series stay
/// bounded by the API whatever callers send.
#[derive(Debug)]
struct KnownRoutes(std::collections::HashSet<&'static str>);

impl KnownRoutes {
    /// The methods of `services`, health and reflection.
    fn of(services: &[&str]) -> Self {
        Self(
            api_methods()
                .iter()
                .filter(|path| {
                    let (service, _) = split_path(path);
                    services.contains(&service) || ALWAYS_SERVED.contains(&service)
                })
                .map(String::as_str)
                .collect(),
        )
    }

    /// The service and method labels of a call to `path`.
    fn labels(&self, path: &str) -> (String, String) {
        if self.0.contains(path) {
            let (service, method) = split_path(path);
            (service.to_owned(), method.to_owned())
        } else {
            (UNKNOWN.to_owned(), UNKNOWN.to_owned())
        }
    }
}

/// A tower layer recording `grpc_server_started_total`, `grpc_server_handled_total` and
/// `grpc_server_handling_seconds` for every request. It sits outside the listeners' checks
/// (the local token, the peer gate), so refused calls count too, by their code.
#[derive(Debug, Clone)]
pub struct GrpcMetricsLayer {
    metrics: GrpcFamilies,
    known: Arc<KnownRoutes>,
}

impl<S> tower::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetricsService {
            inner,
            metrics: self.metrics.clone(),
            known: self.known.clone(),
        }
    }
}

/// See [`GrpcMetricsLayer`].
#[derive(Debug, Clone)]
pub struct GrpcMetricsService<S> {
    inner: S,
    metrics: GrpcFamilies,
    known: Arc<KnownRoutes>,
}

/// `/pkg.Service/Method` split into service and method.
fn split_path(path: &str) -> (&str, &str) {
    let trimmed = path.trim_start_matches('/');
    trimmed.split_once('/').unwrap_or((trimmed, ""))
}

/// The name gRPC gives a status code in metrics (`OK`, `NotFound`, ...).
fn code_name(code: &str) -> String {
    let code = code.trim().parse::<i32>().unwrap_or(2);
    match tonic::Code::from_i32(code) {
        tonic::Code::Ok => "OK".to_owned(),
        other => format!("{other:?}"),
    }
}

/// What is recorded when the response ends.
#[derive(Debug)]
struct Finish {
    metrics: GrpcFamilies,
    service: String,
    method: String,
    start: Instant,
}

impl Finish {
    /// Counts the start of a call to `service`'s `method`.
    fn start(metrics: &GrpcFamilies, (service, method): (String, String)) -> Self {
        let labels: Labels = vec![
            ("grpc_service", service.clone()),
            ("grpc_method", method.clone()),
        ];
        metrics.started.get_or_create(&labels).inc();
        Self {
            metrics: metrics.clone(),
            service,
            method,
            start: Instant::now(),
        }
    }

    fn record(self, code: String) {
        let labels: Labels = vec![("grpc_service", self.service), ("grpc_method", self.method)];
        self.metrics
            .seconds
            .get_or_create(&labels)
            .observe(self.start.elapsed().as_secs_f64());
        let mut handled = labels;
        handled.push(("grpc_code", code));
        self.metrics.handled.get_or_create(&handled).inc();
    }

    /// Records at the end of `response`: now for a trailers-only response (an error before
    /// any message carries the status in its headers), else when its body yields the trailers.
    fn on_response(
        self,
        response: http::Response<tonic::body::Body>,
    ) -> http::Response<tonic::body::Body> {
        if let Some(code) = response.headers().get("grpc-status") {
            self.record(code_name(code.to_str().unwrap_or("2")));
            return response;
        }
        response.map(|body| {
            tonic::body::Body::new(MeteredBody {
                inner: body,
                finish: Some(self),
            })
        })
    }
}

impl<S, B> tower::Service<http::Request<B>> for GrpcMetricsService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let finish = Finish::start(&self.metrics, self.known.labels(req.uri().path()));
        let fut = self.inner.call(req);
        Box::pin(async move { Ok(finish.on_response(fut.await?)) })
    }
}

/// A client channel recording `grpc_client_started_total`, `grpc_client_handled_total` and
/// `grpc_client_handling_seconds` into its service's registry (see [`Metrics::meter_channel`]);
/// every channel of [`crate::client`] and [`crate::tls`] is one. The labels are the server
/// metrics' (service, method, code): never the peer, so the series stay bounded by the API.
#[derive(Debug, Clone)]
pub struct MeteredChannel {
    inner: tonic::transport::Channel,
    /// `None`: records nothing (no `/metrics` listener, or a tool).
    metrics: Option<GrpcFamilies>,
}

impl MeteredChannel {
    /// `channel` recording nothing: for tools (trellisctl) that have no registry.
    pub fn unmetered(channel: tonic::transport::Channel) -> Self {
        Self {
            inner: channel,
            metrics: None,
        }
    }
}

/// The code a call that got no response counts under: what tonic turns the transport error
/// into for the caller (a timeout: `Cancelled`; a status inside: its code), else
/// `Unavailable` (connection refused or reset).
fn transport_code(err: &tonic::transport::Error) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(err) = source {
        if let Some(status) = err.downcast_ref::<tonic::Status>() {
            return code_name(&(status.code() as i32).to_string());
        }
        if err.is::<tonic::TimeoutExpired>() {
            return "Cancelled".to_owned();
        }
        source = err.source();
    }
    "Unavailable".to_owned()
}

impl tower::Service<http::Request<tonic::body::Body>> for MeteredChannel {
    type Response = http::Response<tonic::body::Body>;
    type Error = tonic::transport::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower::Service::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let Some(metrics) = &self.metrics else {
            return Box::pin(tower::Service::call(&mut self.inner, req));
        };
        // Our own calls: their paths are the API's.
        let (service, method) = split_path(req.uri().path());
        let finish = Finish::start(metrics, (service.to_owned(), method.to_owned()));
        let fut = tower::Service::call(&mut self.inner, req);
        Box::pin(async move {
            match fut.await {
                Ok(response) => Ok(finish.on_response(response)),
                Err(err) => {
                    finish.record(transport_code(&err));
                    Err(err)
                }
            }
        })
    }
}

/// A response body that records the status from its trailers (or `Cancelled` when dropped
/// before them, e.g. a watch the client closed).
struct MeteredBody {
    inner: tonic::body::Body,
    finish: Option<Finish>,
}

impl http_body::Body for MeteredBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let polled = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &polled {
            Some(Ok(frame)) => {
                if let Some(trailers) = frame.trailers_ref() {
                    let code = trailers
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .map_or_else(|| "Unknown".to_owned(), code_name);
                    if let Some(finish) = self.finish.take() {
                        finish.record(code);
                    }
                }
            }
            Some(Err(_)) => {
                if let Some(finish) = self.finish.take() {
                    finish.record("Unknown".to_owned());
                }
            }
            None => {
                if let Some(finish) = self.finish.take() {
                    finish.record("Unknown".to_owned());
                }
            }
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for MeteredBody {
    fn drop(&mut self) {
        if let Some(finish) = self.finish.take() {
            finish.record("Cancelled".to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

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
        let channel = crate::client::channel("address", &grpc.to_string(), timeouts, &metrics)
            .expect("channel");
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
            codes.get(code).copied().unwrap_or_default()
                + warmup.get(code).copied().unwrap_or_default()
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
}
