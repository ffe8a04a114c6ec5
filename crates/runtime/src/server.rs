//! The gRPC server every service runs: its own routes plus `grpc.health.v1.Health` and server
//! reflection (v1 and v1alpha, so any grpcurl works), W3C trace context on every request, and
//! a graceful stop: on shutdown health turns NOT_SERVING, new connections are refused, in-flight
//! requests get the grace period to finish.
//!
//! Each request runs under the subscriber that was current when the server started serving
//! (its span is created there too): in the lab, where every service has a subscriber of its own
//! ([`crate::telemetry::service_dispatch`]), a request's spans are its service's, although
//! tonic runs connections on tasks of its own.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tonic::service::Routes;
use tonic::transport::Server;
use tonic_health::ServingStatus;

use crate::metrics::{Metrics, MetricsListen, MetricsListener};
use crate::peer::{GateLayer, PeerMethods};
use crate::propagation::server_span;
use crate::shutdown::Shutdown;
use crate::supervise::Fault;
use crate::telemetry::DispatchLayer;
use crate::tls::PeerTls;

/// Streams one connection may have open at once on either listener. Without it tonic's builder
/// lifts hyper's limit (200) and a single connection could open streams without bound; the
/// Trellis callers that share a connection keep far fewer calls in flight (a client queues
/// streams beyond the limit, it does not fail them).
pub const MAX_CONCURRENT_STREAMS: u32 = 256;

/// A bound, not yet serving, gRPC server. Binding first lets callers learn the real port when
/// they asked for port 0.
#[derive(Debug)]
pub struct GrpcServer {
    listener: TcpListener,
    addr: SocketAddr,
    peer: Option<PeerListener>,
    metrics: Metrics,
    metrics_listener: Option<MetricsListener>,
    local_token: crate::local_auth::LocalToken,
    cluster_facing: Vec<&'static str>,
    fault: Fault,
}

/// The mutual-TLS listener for other clusters (ADR 0014): the same routes, behind a gate that
/// lets through only the cluster-facing methods.
#[derive(Debug)]
pub struct PeerListener {
    listener: TcpListener,
    addr: SocketAddr,
    tls: PeerTls,
    methods: PeerMethods,
}

impl PeerListener {
    /// Binds the peer listen address.
    pub async fn bind(
        addr: SocketAddr,
        tls: PeerTls,
        methods: PeerMethods,
    ) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} (peer listener)"))?;
        let addr = listener.local_addr()?;
        Ok(Self {
            listener,
            addr,
            tls,
            methods,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl GrpcServer {
    /// Binds the listen address.
    pub async fn bind(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let addr = listener.local_addr()?;
        Ok(Self {
            listener,
            addr,
            peer: None,
            metrics: Metrics::new(),
            metrics_listener: None,
            local_token: crate::local_auth::LocalToken::off(),
            cluster_facing: Vec::new(),
            fault: Fault::new(),
        })
    }

    /// Where the service's components report that they can no longer do their job (a
    /// data-plane thread that died): the service then fails as when one of its background
    /// tasks does (see [`GrpcServer::spawn`] and [`crate::supervise`]).
    pub fn fault(&self) -> &Fault {
        &self.fault
    }

    /// Requires `token` from callers on the plaintext listener (ADR 0020), except for health,
    /// reflection and the methods given to [`Self::with_cluster_facing`].
    pub fn with_local_token(mut self, token: crate::local_auth::LocalToken) -> Self {
        self.local_token = token;
        self
    }

    /// The service's cluster-facing methods: on the plaintext listener they need no local
    /// token (other clusters call them there in plaintext mode; with TLS their handlers refuse
    /// them there).
    pub fn with_cluster_facing(mut self, methods: PeerMethods) -> Self {
        self.set_cluster_facing(None, methods);
        self
    }

    /// [`Self::with_cluster_facing`], also serving on `peer` (mutual TLS) when given.
    pub(crate) fn set_cluster_facing(&mut self, peer: Option<PeerListener>, methods: PeerMethods) {
        if peer.is_some() {
            self.peer = peer;
        }
        self.cluster_facing = methods
            .authenticated
            .iter()
            .chain(methods.anonymous)
            .copied()
            .collect();
    }

    /// Also serves this service's `/metrics` where `listen` says (see
    /// [`crate::config::BaseConfig::metrics_listen`]).
    pub async fn with_metrics_listener(mut self, listen: MetricsListen) -> anyhow::Result<Self> {
        self.metrics_listener = match listen {
            MetricsListen::At(addr) => Some(MetricsListener::bind(addr).await?),
            MetricsListen::Default(addr) => match MetricsListener::bind(addr).await {
                Ok(listener) => Some(listener),
                Err(err) => {
                    tracing::warn!(
                        error = format!("{err:#}"),
                        "no metrics listener: the default port is taken; set --metrics-listen"
                    );
                    None
                }
            },
            MetricsListen::Off => None,
        };
        // Channels and the store record only where someone scrapes: set before the service
        // opens its store and builds its channels through `metrics()`.
        self.metrics.set_served(self.metrics_listener.is_some());
        Ok(self)
    }

    /// This service's metrics: register domain metrics here, open the store
    /// ([`crate::config::CommonConfig::open_store`]) and build channels ([`crate::client`],
    /// [`crate::tls`]) with them, so store operations and outgoing calls count here too.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The metrics listener's address, when there is one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener
            .as_ref()
            .map(MetricsListener::local_addr)
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The peer listener's address, when there is one.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer.as_ref().map(PeerListener::local_addr)
    }

    /// Serves in a task of its own (see [`GrpcServer::serve`]), supervising `background`, the
    /// service's other tasks, which watch the same `shutdown` ([`crate::supervise`]):
    ///
    /// - one that panics or returns before the shutdown, or a report to [`GrpcServer::fault`],
    ///   fails the service: health turns NOT_SERVING at once, serving stops after `grace`, the
    ///   other tasks are aborted and the task ends with the failure as its error (the binary
    ///   exits non-zero, so it is restarted);
    /// - on the shutdown, once serving has stopped, they get `grace` to finish and are aborted
    ///   after it; a panic in one of them is reported as the service's error.
    pub fn spawn(
        self,
        routes: Routes,
        services: &'static [&'static str],
        shutdown: Shutdown,
        grace: Duration,
        background: Vec<tokio::task::JoinHandle<()>>,
    ) -> tokio::task::JoinHandle<anyhow::Result<()>> {
        crate::telemetry::spawn(async move {
            let fault = self.fault.clone();
            // Serving stops on the shutdown, or on a failure.
            let stop = shutdown.child_token();
            let mut served = Box::pin(self.serve(routes, services, stop.clone(), grace));
            let mut tasks = background;
            let mut failed: Option<String> = None;
            let mut panicked_on_shutdown: Option<String> = None;
            let served = loop {
                tokio::select! {
                    served = &mut served => break served,
                    ended = next_ended(&mut tasks), if !tasks.is_empty() => {
                        match (ended, shutdown.is_cancelled()) {
                            (Ok(()), true) => {}
                            (Err(err), true) => panicked_on_shutdown = Some(ended_why(err)),
                            (Ok(()), false) => fault.report(
                                "a background task of the service ended while it was serving",
                            ),
                            (Err(err), false) => fault.report(ended_why(err)),
                        }
                    }
                    reason = fault.reported(), if failed.is_none() && !shutdown.is_cancelled() => {
                        failed = Some(reason);
                        stop.cancel();
                    }
                }
            };
            if let Some(reason) = failed {
                for task in tasks {
                    task.abort();
                }
                return Err(anyhow::anyhow!(reason)).context("the service failed");
            }
            for mut task in tasks {
                match tokio::time::timeout(grace, &mut task).await {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => panicked_on_shutdown = Some(ended_why(err)),
                    Err(_) => task.abort(),
                }
            }
            if let Some(why) = panicked_on_shutdown {
                return Err(anyhow::anyhow!(why))
                    .context("a background task of the service panicked");
            }
            served
        })
    }

    /// Serves `routes` (whose gRPC service names are `services`, reported healthy) until
    /// `shutdown`, then drains for at most `grace`.
    pub async fn serve(
        self,
        routes: Routes,
        services: &[&'static str],
        shutdown: Shutdown,
        grace: Duration,
    ) -> anyhow::Result<()> {
        let (reporter, health) = tonic_health::server::health_reporter();
        for name in services.iter().copied().chain([""]) {
            reporter
                .set_service_status(name, ServingStatus::Serving)
                .await;
        }

        let routes = crate::reflection::add_to(routes.add_service(health), services)?;
        let routes = crate::reflection::answer_unserved(routes, services);

        // No /metrics listener, no recording: nobody could read it (and the benchmark measures
        // the layer's cost against exactly this).
        let grpc_metrics = self
            .metrics_listener
            .is_some()
            .then(|| self.metrics.grpc_layer(services));
        let dispatch = tracing::dispatcher::get_default(Clone::clone);
        let traced = {
            let dispatch = dispatch.clone();
            move |request: &http::Request<()>| {
                tracing::dispatcher::with_default(&dispatch, || server_span(request))
            }
        };

        let draining = shutdown.clone();
        let owned: Vec<&'static str> = services.to_vec();
        let stop = async move {
            draining.cancelled().await;
            for name in owned.into_iter().chain([""]) {
                reporter
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
        };

        let peer = match self.peer {
            Some(peer) => {
                tracing::info!(addr = %peer.addr, services = ?services, "serving gRPC to other clusters over mutual TLS");
                let incoming = crate::tls::incoming(peer.listener, &peer.tls)?;
                let stopped = shutdown.clone();
                Some(
                    Server::builder()
                        .trace_fn(traced.clone())
                        .http2_keepalive_interval(Some(Duration::from_secs(30)))
                        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
                        .layer(DispatchLayer::new(dispatch.clone()))
                        .layer(tower::util::option_layer(grpc_metrics.clone()))
                        .layer(GateLayer::new(peer.methods))
                        .add_routes(routes.clone())
                        .serve_with_incoming_shutdown(incoming, async move {
                            stopped.cancelled().await;
                        }),
                )
            }
            None => None,
        };
        tracing::info!(addr = %self.addr, services = ?services, local_token = self.local_token.is_on(), "serving gRPC");
        let plain = Server::builder()
            .trace_fn(traced)
            .tcp_nodelay(true)
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
            .layer(DispatchLayer::new(dispatch))
            .layer(tower::util::option_layer(grpc_metrics))
            .layer(crate::local_auth::LocalAuth::layer(
                self.local_token.clone(),
                self.cluster_facing.clone(),
            ))
            .add_routes(routes)
            .serve_with_incoming_shutdown(accepted(self.listener), stop);
        let metrics = self.metrics_listener.map(|listener| {
            let metrics = self.metrics.clone();
            let stopped = shutdown.clone();
            crate::telemetry::spawn(async move {
                if let Err(err) = listener.serve(metrics, stopped).await {
                    tracing::error!(error = format!("{err:#}"), "metrics listener stopped");
                }
            })
        });
        let server = async move {
            match peer {
                Some(peer) => tokio::try_join!(plain, peer).map(|_| ()),
                None => plain.await,
            }
        };
        tokio::pin!(server);

        tokio::select! {
            served = &mut server => served.context("gRPC server failed")?,
            () = async { shutdown.cancelled().await; tokio::time::sleep(grace).await } => {
                tracing::warn!(grace_secs = grace.as_secs(), "grace period over, closing remaining connections");
            }
        }
        if let Some(metrics) = metrics {
            metrics.abort();
        }
        tracing::info!(addr = %self.addr, "gRPC server stopped");
        Ok(())
    }
}

/// Waits for the first of `tasks` to end and removes it. Cancel-safe: a task that has not
/// ended stays in `tasks`.
async fn next_ended(
    tasks: &mut Vec<tokio::task::JoinHandle<()>>,
) -> Result<(), tokio::task::JoinError> {
    if tasks.is_empty() {
        return std::future::pending().await;
    }
    let (ended, index, _) = futures::future::select_all(tasks.iter_mut()).await;
    drop(tasks.swap_remove(index));
    ended
}

/// Why a task ended with `err`: its panic message, if it panicked.
fn ended_why(err: tokio::task::JoinError) -> String {
    if !err.is_panic() {
        return format!("a background task of the service was cancelled: {err}");
    }
    let panic = err.into_panic();
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned());
    format!("a background task of the service panicked: {message}")
}

/// The plaintext listener's connections, with Nagle's algorithm off. The builder's own
/// `tcp_nodelay` applies only to listeners tonic binds itself, not to an incoming stream we
/// hand it: without this every unary answer written in two segments (headers and data, then
/// trailers) waited for the caller's delayed ACK, about 40 ms per call on Linux, which made
/// a leaf's peering view (one lookup per remote) take seconds.
fn accepted(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    use tonic_health::pb::health_check_response::ServingStatus as Status;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

    const SERVICE: &str = "test.v1.Thing";

    fn local() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }

    /// A service serving `SERVICE` with `background`, and health watches on "" and `SERVICE`
    /// that have seen SERVING (the positive control for the NOT_SERVING to come).
    struct Watched {
        task: tokio::task::JoinHandle<anyhow::Result<()>>,
        shutdown: Shutdown,
        watches: Vec<tonic::Streaming<HealthCheckResponse>>,
        fault: Fault,
    }

    async fn serve_watched(background: Vec<tokio::task::JoinHandle<()>>) -> Watched {
        let server = GrpcServer::bind(local()).await.expect("binds");
        let addr = server.local_addr();
        let fault = server.fault().clone();
        let shutdown = Shutdown::new();
        let task = server.spawn(
            Routes::default(),
            &[SERVICE],
            shutdown.clone(),
            Duration::from_secs(10),
            background,
        );
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .expect("connects");
        let mut watches = Vec::new();
        for service in ["", SERVICE] {
            let mut watch = HealthClient::new(channel.clone())
                .watch(HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .expect("watch")
                .into_inner();
            let first = watch.message().await.expect("status").expect("a message");
            assert_eq!(first.status(), Status::Serving, "{service:?}");
            watches.push(watch);
        }
        Watched {
            task,
            shutdown,
            watches,
            fault,
        }
    }

    impl Watched {
        /// Asserts that health turns NOT_SERVING for "" and `SERVICE` and that the service
        /// stops by itself with an error containing `reason`, shutdown never asked for.
        async fn assert_fails(mut self, reason: &str) {
            for (watch, service) in self.watches.iter_mut().zip(["", SERVICE]) {
                let next = tokio::time::timeout(Duration::from_secs(10), watch.message())
                    .await
                    .unwrap_or_else(|_| {
                        panic!("health of {service:?} still SERVING 10 s after the failure")
                    })
                    .expect("status")
                    .expect("a message");
                assert_eq!(next.status(), Status::NotServing, "{service:?}");
            }
            drop(self.watches);
            let result = tokio::time::timeout(Duration::from_secs(30), self.task)
                .await
                .expect("the service stops by itself")
                .expect("joins");
            let err = result.expect_err("the service fails, so that it is restarted");
            assert!(format!("{err:#}").contains(reason), "{err:#}");
            assert!(!self.shutdown.is_cancelled());
        }
    }

    /// A background task that panics while the service serves fails the service at once:
    /// health NOT_SERVING, then an error (the process exits non-zero and is restarted).
    #[tokio::test]
    async fn a_background_task_that_panics_fails_the_service() {
        let (trigger, triggered) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = triggered.await;
            panic!("the reconciler broke");
        });
        let watched = serve_watched(vec![task]).await;
        trigger.send(()).expect("task waiting");
        watched.assert_fails("the reconciler broke").await;
    }

    /// A background task that returns while the service serves (not because of a shutdown)
    /// fails it too: whatever it did is no longer done.
    #[tokio::test]
    async fn a_background_task_that_returns_early_fails_the_service() {
        let (trigger, triggered) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = triggered.await;
        });
        let watched = serve_watched(vec![task]).await;
        trigger.send(()).expect("task waiting");
        watched
            .assert_fails("a background task of the service ended")
            .await;
    }

    /// A component the server cannot watch itself (a data-plane thread) reports through the
    /// server's [`Fault`]: the service fails the same way.
    #[tokio::test]
    async fn a_reported_fault_fails_the_service() {
        let watched = serve_watched(Vec::new()).await;
        let armed = watched.fault.arm("the wg-udp thread");
        std::thread::spawn(move || drop(armed))
            .join()
            .expect("joins");
        watched
            .assert_fails("the wg-udp thread ended while the service was running")
            .await;
    }

    /// Tasks that end because of the shutdown are the normal stop: no error.
    #[tokio::test]
    async fn background_tasks_ending_on_shutdown_stop_the_service_cleanly() {
        let shutdown = Shutdown::new();
        let stopped = shutdown.clone();
        let task = tokio::spawn(async move { stopped.cancelled().await });
        let server = GrpcServer::bind(local()).await.expect("binds");
        let served = server.spawn(
            Routes::default(),
            &[SERVICE],
            shutdown.clone(),
            Duration::from_secs(10),
            vec![task],
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!served.is_finished(), "serving until shutdown");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), served)
            .await
            .expect("stops")
            .expect("joins")
            .expect("a clean stop");
    }

    /// One connection cannot open streams without bound: the server holds at most
    /// `MAX_CONCURRENT_STREAMS` of a connection's streams open at once (tonic's builder
    /// otherwise lifts hyper's limit); the client queues the rest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_gets_a_bounded_number_of_concurrent_streams() {
        const STREAMS: u32 = 300;
        let server = GrpcServer::bind(local()).await.expect("binds");
        let addr = server.local_addr();
        let shutdown = Shutdown::new();
        let task = server.spawn(
            Routes::default(),
            &[SERVICE],
            shutdown.clone(),
            Duration::from_secs(1),
            Vec::new(),
        );
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .expect("connects");
        let (opened, mut counted) = tokio::sync::mpsc::unbounded_channel();
        let mut watches = Vec::new();
        for _ in 0..STREAMS {
            let (channel, opened) = (channel.clone(), opened.clone());
            watches.push(tokio::spawn(async move {
                let mut watch = HealthClient::new(channel)
                    .watch(HealthCheckRequest::default())
                    .await
                    .expect("watch")
                    .into_inner();
                watch.message().await.expect("status").expect("a message");
                let _ = opened.send(());
                // Held open until aborted.
                std::future::pending::<()>().await;
            }));
        }
        // Positive control: the streams the server allows are all answered...
        for n in 0..MAX_CONCURRENT_STREAMS.min(STREAMS) {
            tokio::time::timeout(Duration::from_secs(20), counted.recv())
                .await
                .unwrap_or_else(|_| panic!("only {n} streams answered"))
                .expect("sender alive");
        }
        // ...and no more while they stay open.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut more = 0;
        while counted.try_recv().is_ok() {
            more += 1;
        }
        assert_eq!(
            more,
            0,
            "{} streams open at once on one connection",
            MAX_CONCURRENT_STREAMS + more
        );
        for watch in watches {
            watch.abort();
        }
        shutdown.cancel();
        task.await.expect("joins").expect("stops cleanly");
    }

    /// Connections accepted by a service have TCP_NODELAY set (see [`accepted`]).
    #[tokio::test]
    async fn accepted_connections_have_nagle_off() {
        use futures::StreamExt as _;
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("address");
        let mut incoming = accepted(listener);
        let _client = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connects");
        let stream = incoming
            .next()
            .await
            .expect("a connection")
            .expect("accepted");
        assert!(
            stream.nodelay().expect("reads the option"),
            "Nagle still on for an accepted connection"
        );
    }
}
