//! One tower service for every check a listener makes before any handler runs (which methods
//! the peer listener serves, the local token on the plaintext one): a [`Check`] admits a
//! request or answers it with a gRPC status, and [`Admission`] does the rest once.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Decides whether a request reaches the handlers.
pub trait Check: Clone + Send + 'static {
    /// `Err`: the status the caller gets instead (the check logs why).
    fn check<B>(&self, request: &http::Request<B>) -> Result<(), tonic::Status>;
}

/// A layer running `C` in front of a service.
#[derive(Debug, Clone)]
pub struct AdmissionLayer<C> {
    check: C,
}

impl<C> AdmissionLayer<C> {
    pub fn new(check: C) -> Self {
        Self { check }
    }
}

impl<S, C: Clone> tower::Layer<S> for AdmissionLayer<C> {
    type Service = Admission<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        Admission {
            inner,
            check: self.check.clone(),
        }
    }
}

/// See [`AdmissionLayer`].
#[derive(Debug, Clone)]
pub struct Admission<S, C> {
    inner: S,
    check: C,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = std::result::Result<T, E>> + Send>>;

impl<S, B, C> tower::Service<http::Request<B>> for Admission<S, C>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
    C: Check,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        match self.check.check(&request) {
            Ok(()) => Box::pin(self.inner.call(request)),
            Err(status) => Box::pin(std::future::ready(Ok(status.into_http()))),
        }
    }
}
