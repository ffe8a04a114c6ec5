//! Channels to other Trellis services: bounded connect and request timeouts, so a dead peer
//! costs a caller seconds rather than forever, and trace propagation on every call.

use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use trellis_error::{Error, Result};

use crate::propagation::TraceInterceptor;

/// A channel that propagates the caller's trace context.
pub type TracedChannel = InterceptedService<Channel, TraceInterceptor>;

/// Timeouts of a client channel.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// TCP + HTTP/2 connection setup.
    pub connect: Duration,
    /// One unary request, end to end.
    pub request: Duration,
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
/// and for local ones when local authentication is off (see [`local_channel`]).
pub fn channel(field: &str, address: &str, timeouts: Timeouts) -> Result<TracedChannel> {
    endpoint_channel(field, address, timeouts, TraceInterceptor::default())
}

/// Like [`channel`], to a service of this cluster: every call carries the local token
/// (`--local-token-file`), when there is one. Never use it towards another cluster.
pub fn local_channel(
    field: &str,
    address: &str,
    timeouts: Timeouts,
    token: &crate::local_auth::LocalToken,
) -> Result<TracedChannel> {
    endpoint_channel(
        field,
        address,
        timeouts,
        TraceInterceptor::with_local_token(token.clone()),
    )
}

fn endpoint_channel(
    field: &str,
    address: &str,
    timeouts: Timeouts,
    interceptor: TraceInterceptor,
) -> Result<TracedChannel> {
    let uri = if address.contains("://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    };
    let endpoint = Endpoint::from_shared(uri)
        .map_err(|e| Error::invalid(field, format!("{address:?} is not a usable address: {e}")))?
        .connect_timeout(timeouts.connect)
        .timeout(timeouts.request)
        .tcp_nodelay(true);
    Ok(InterceptedService::new(
        endpoint.connect_lazy(),
        interceptor,
    ))
}
