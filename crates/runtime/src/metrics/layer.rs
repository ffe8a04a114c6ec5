//! The server side: a tower layer recording `grpc_server_*` for every request a server
//! receives, labelled only with the routes that server serves ([`KnownRoutes`]), so that what
//! callers send cannot grow the registry.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::calls::{Finish, GrpcFamilies, split_path};

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
pub(super) struct KnownRoutes(HashSet<&'static str>);

impl KnownRoutes {
    /// The methods of `services`, health and reflection.
    pub(super) fn of(services: &[&str]) -> Self {
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
    pub(super) fn labels(&self, path: &str) -> (String, String) {
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
    pub(super) metrics: GrpcFamilies,
    pub(super) known: Arc<KnownRoutes>,
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
