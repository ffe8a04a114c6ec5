//! What one gRPC call records, on either side: the started and handled counters and the
//! latency histogram ([`GrpcFamilies`]), and the end of the call, which is the status code in
//! the response headers (trailers-only) or trailers, or `Cancelled` when the body is dropped
//! before them.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::{Labels, LatencyBuckets, LatencyFamily};

/// The gRPC metrics of one side (server or client), with the conventional names and labels.
#[derive(Debug, Clone)]
pub(super) struct GrpcFamilies {
    pub(super) started: Family<Labels, Counter>,
    pub(super) handled: Family<Labels, Counter>,
    pub(super) seconds: LatencyFamily,
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

/// `/pkg.Service/Method` split into service and method.
pub(super) fn split_path(path: &str) -> (&str, &str) {
    let trimmed = path.trim_start_matches('/');
    trimmed.split_once('/').unwrap_or((trimmed, ""))
}

/// The name gRPC gives a status code in metrics (`OK`, `NotFound`, ...).
pub(super) fn code_name(code: &str) -> String {
    let code = code.trim().parse::<i32>().unwrap_or(2);
    match tonic::Code::from_i32(code) {
        tonic::Code::Ok => "OK".to_owned(),
        other => format!("{other:?}"),
    }
}

/// What is recorded when the response ends.
#[derive(Debug)]
pub(super) struct Finish {
    metrics: GrpcFamilies,
    service: String,
    method: String,
    start: Instant,
}

impl Finish {
    /// Counts the start of a call to `service`'s `method`.
    pub(super) fn start(metrics: &GrpcFamilies, (service, method): (String, String)) -> Self {
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

    pub(super) fn record(self, code: String) {
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
    pub(super) fn on_response(
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
