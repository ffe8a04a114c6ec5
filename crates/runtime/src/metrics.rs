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
//!
//! This file keeps the registry ([`Metrics`]) and the `/metrics` listener; the gRPC metrics
//! are cut by side:
//!
//! - `calls`: what one call records, server or client side (the families, the labels, the
//!   status code at the end of the response);
//! - `layer`: the server side, [`GrpcMetricsLayer`], naming only the routes a server serves;
//! - `channel`: the client side, [`MeteredChannel`];
//! - `tests`: their unit tests, scraping a served registry.

mod calls;
mod channel;
mod layer;
#[cfg(test)]
mod tests;

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use anyhow::Context as _;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use trellis_store::metered::StoreMetrics;

use self::calls::GrpcFamilies;
pub use self::channel::MeteredChannel;
use self::layer::KnownRoutes;
pub use self::layer::{GrpcMetricsLayer, GrpcMetricsService};
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
    /// `services` (and health and reflection): see [`layer::KnownRoutes`].
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
