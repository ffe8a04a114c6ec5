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
/// malformed address, named as `field`.
pub fn channel(field: &str, address: &str, timeouts: Timeouts) -> Result<TracedChannel> {
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
        TraceInterceptor,
    ))
}
