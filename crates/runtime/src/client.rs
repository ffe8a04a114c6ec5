//! Channels to other Trellis services: bounded connect and request timeouts, so a dead peer
//! costs a caller seconds rather than forever, trace propagation on every call, and the gRPC
//! client metrics of the calling service ([`crate::metrics::MeteredChannel`]).
//!
//! Every channel also checks its connection's liveness ([`KEEPALIVE`]): a watch stream (a route
//! agent's `WatchRoutes`, the gateway's `WatchTunnelEndpoints`, the trust sync's and the
//! ForeignClusters copy's `WatchForeignClusters`) only receives, so without it a server that
//! vanished without closing the connection (its node lost power, a partition drops packets)
//! left the stream waiting forever: no request timeout covers a stream after its headers.

use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::Endpoint;
use trellis_error::{Error, Result};

use crate::metrics::{MeteredChannel, Metrics};
use crate::propagation::TraceInterceptor;

/// A channel that propagates the caller's trace context and records the caller's client
/// metrics.
pub type TracedChannel = InterceptedService<MeteredChannel, TraceInterceptor>;

/// Timeouts of a client channel.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// TCP + HTTP/2 connection setup.
    pub connect: Duration,
    /// One unary request, end to end.
    pub request: Duration,
}

/// How a channel notices that its server vanished without closing the connection: an HTTP/2
/// PING after `interval` without a frame from the server, even with no call open, and the
/// connection fails, with every stream on it, when the PING goes unanswered for `timeout`. The
/// callers' loops then reconnect as after any broken stream. Below it, TCP keepalive (the same
/// idle time, a probe every `timeout`, the connection dropped after three unanswered) ends an
/// idle connection in the kernel even while nothing drives its HTTP/2 side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    pub interval: Duration,
    pub timeout: Duration,
}

/// Every channel's liveness check: a dead server is noticed within 15 s of its last frame.
/// Our servers (hyper's HTTP/2) answer PINGs at any rate: they enforce no minimum interval.
pub const KEEPALIVE: Keepalive = Keepalive {
    interval: Duration::from_secs(10),
    timeout: Duration::from_secs(5),
};

/// Unanswered TCP keepalive probes before the kernel drops the connection.
const TCP_KEEPALIVE_PROBES: u32 = 3;

impl Keepalive {
    /// The TCP keepalive of a socket a connector opens itself (the mutual-TLS channels).
    pub(crate) fn tcp(self) -> socket2::TcpKeepalive {
        socket2::TcpKeepalive::new()
            .with_time(self.interval)
            .with_interval(self.timeout)
            .with_retries(TCP_KEEPALIVE_PROBES)
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(3),
            request: Duration::from_secs(10),
        }
    }
}

/// A lazily connecting channel to `address` (`host:port` or `http://host:port`). Fails only on a
/// malformed address, named as `field`. Sends no local token: for other clusters' services,
/// and for local ones when local authentication is off (see [`local_channel`]). Its calls count
/// in `metrics`, the calling service's.
pub fn channel(
    field: &str,
    address: &str,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    endpoint_channel(
        field,
        address,
        timeouts,
        TraceInterceptor::default(),
        metrics,
    )
}

/// Like [`channel`], to a service of this cluster: every call carries the local token
/// (`--local-token-file`), when there is one. Never use it towards another cluster.
pub fn local_channel(
    field: &str,
    address: &str,
    timeouts: Timeouts,
    token: &crate::local_auth::LocalToken,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    endpoint_channel(
        field,
        address,
        timeouts,
        TraceInterceptor::with_local_token(token.clone()),
        metrics,
    )
}

/// Makes the tasks a channel spawns (its request buffer, its connections) run under the
/// subscriber current where the channel is made. In the lab every service has a subscriber of
/// its own (ADR 0021); a buffer task under the process default would drop the service's
/// request spans there, and closing a span through a registry that does not know it panics
/// and kills the channel for good (every later call: "transport error").
pub fn keep_subscriber(endpoint: Endpoint) -> Endpoint {
    endpoint.executor(CurrentSubscriber)
}

/// What every channel the runtime builds has, plaintext ([`channel`]) or mutual TLS
/// ([`crate::tls::peer_channel`]): `timeouts`, no Nagle delay, [`KEEPALIVE`] (HTTP/2, and TCP
/// where tonic opens the socket) and the current subscriber ([`keep_subscriber`]).
pub(crate) fn configure(endpoint: Endpoint, timeouts: Timeouts) -> Endpoint {
    let endpoint = endpoint
        .connect_timeout(timeouts.connect)
        .timeout(timeouts.request)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE.interval)
        .keep_alive_timeout(KEEPALIVE.timeout)
        .keep_alive_while_idle(true)
        .tcp_keepalive(Some(KEEPALIVE.interval))
        .tcp_keepalive_interval(Some(KEEPALIVE.timeout))
        .tcp_keepalive_retries(Some(TCP_KEEPALIVE_PROBES));
    keep_subscriber(endpoint)
}

/// A tonic executor: [`crate::telemetry::spawn`], which keeps the current subscriber.
#[derive(Debug, Clone, Copy)]
struct CurrentSubscriber;

impl<F> hyper::rt::Executor<F> for CurrentSubscriber
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, future: F) {
        crate::telemetry::spawn(future);
    }
}

fn endpoint_channel(
    field: &str,
    address: &str,
    timeouts: Timeouts,
    interceptor: TraceInterceptor,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    let uri = if address.contains("://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    };
    let endpoint = Endpoint::from_shared(uri)
        .map_err(|e| Error::invalid(field, format!("{address:?} is not a usable address: {e}")))?;
    Ok(InterceptedService::new(
        metrics.meter_channel(configure(endpoint, timeouts).connect_lazy()),
        interceptor,
    ))
}

#[cfg(test)]
mod tests {
    use std::task::Poll;

    use tokio_stream::wrappers::TcpListenerStream;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    use tracing::instrument::WithSubscriber as _;
    use tracing::{Dispatch, Instrument as _};
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// A watch whose server vanished without closing the connection (a crashed node, a
    /// partition that drops packets) must end, so the follower reconnects: the client's own
    /// HTTP/2 PINGs go unanswered. Without keepalive the stream waited forever, since a client
    /// that only receives never learns its server is gone.
    #[tokio::test]
    async fn a_watch_through_a_network_gone_silent_ends_within_the_keepalive_bound() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let server = listener.local_addr().expect("its address");
        let (_reporter, health) = tonic_health::server::health_reporter();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        let relay = trellis_testkit::SilentRelay::start(server)
            .await
            .expect("a relay");
        let channel = channel(
            "address",
            &relay.addr.to_string(),
            Timeouts::default(),
            &Metrics::new(),
        )
        .expect("a valid address");
        let mut watch = HealthClient::new(channel)
            .watch(HealthCheckRequest::default())
            .await
            .expect("the watch opens")
            .into_inner();
        // Positive control: the stream delivers through the relay.
        let first = watch.message().await.expect("a first status");
        assert!(first.is_some(), "the server's current status");

        relay.silence();
        let started = std::time::Instant::now();
        // A PING `interval` after the last frame, unanswered for `timeout`; slack for a busy
        // test machine.
        let bound = KEEPALIVE.interval + KEEPALIVE.timeout + Duration::from_secs(5);
        let ended = tokio::time::timeout(bound, watch.message()).await;
        let elapsed = started.elapsed();
        match ended {
            Err(_) => panic!("the watch still waits {bound:?} after the network went silent"),
            Ok(Ok(Some(message))) => panic!("a message through a silent relay: {message:?}"),
            Ok(outcome) => eprintln!(
                "measured: the watch ended {} ms after the network went silent: {outcome:?}",
                elapsed.as_millis()
            ),
        }
        // Ended by the keepalive, not by a connection the relay closed.
        assert!(
            elapsed >= KEEPALIVE.interval,
            "ended after {elapsed:?}, before any PING could have gone unanswered"
        );
    }

    /// The lab runs each service under a subscriber of its own while the process has another
    /// default (ADR 0021). A request span created under the service's subscriber and last
    /// dropped by the channel's buffer task (a cancelled request still queued) used to be
    /// closed through the task's subscriber, the process default: its registry does not know
    /// the span and panicked ("tried to drop a ref to Id(..)"), killing the channel for good
    /// (the lab_traces failure in CI). Current-thread runtime, so the buffer task runs only
    /// when the test yields, after the caller has dropped its own references.
    #[tokio::test(flavor = "current_thread")]
    async fn a_cancelled_request_does_not_kill_a_channel_made_under_a_service_subscriber() {
        // The process default: a registry of its own that records no span (as the lab's, at
        // `warn`), so an ID of the service's registry is unknown there.
        let _ = tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(tracing_subscriber::filter::LevelFilter::ERROR),
        );

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let address = listener.local_addr().expect("its address").to_string();
        let (_reporter, health) = tonic_health::server::health_reporter();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );

        // The service's: layered like the lab's (a bare registry never removes a span).
        let service = Dispatch::new(
            tracing_subscriber::registry().with(tracing_subscriber::filter::LevelFilter::TRACE),
        );
        let outcome = async move {
            let channel = channel("address", &address, Timeouts::default(), &Metrics::new())
                .expect("a valid address");
            let mut client = HealthClient::new(channel);
            let parent = tracing::info_span!("parent");
            let child = tracing::info_span!(parent: &parent, "child");
            {
                let mut other = client.clone();
                let mut cancelled =
                    Box::pin(other.check(HealthCheckRequest::default()).instrument(child));
                // Queue the request (with its span) in the channel's buffer, then cancel it.
                assert!(matches!(futures::poll!(&mut cancelled), Poll::Pending));
            }
            drop(parent);
            client.check(HealthCheckRequest::default()).await
        }
        .with_subscriber(service)
        .await;
        assert!(
            outcome.is_ok(),
            "the channel survives a cancelled request: {outcome:?}"
        );
    }
}
