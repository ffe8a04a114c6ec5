//! The client side: a channel recording `grpc_client_*` for every call made through it, with
//! the same labels as the server side, and for a call that got no response the code the
//! caller sees.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::calls::{Finish, GrpcFamilies, code_name, split_path};

/// A client channel recording `grpc_client_started_total`, `grpc_client_handled_total` and
/// `grpc_client_handling_seconds` into its service's registry (see
/// [`Metrics::meter_channel`](super::Metrics::meter_channel)); every channel of
/// [`crate::client`] and [`crate::tls`] is one. The labels are the server metrics' (service,
/// method, code): never the peer, so the series stay bounded by the API.
#[derive(Debug, Clone)]
pub struct MeteredChannel {
    pub(super) inner: tonic::transport::Channel,
    /// `None`: records nothing (no `/metrics` listener, or a tool).
    pub(super) metrics: Option<GrpcFamilies>,
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
