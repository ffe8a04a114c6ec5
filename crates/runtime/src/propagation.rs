//! W3C trace context across gRPC: the server side continues the caller's trace, the client
//! side sends the current span's context, so one peering setup is one trace across services
//! and clusters.

use opentelemetry::global;
use opentelemetry::propagation::{Extractor, Injector};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(key, value);
        }
    }
}

/// The span of one incoming gRPC request, child of the caller's span when the request
/// carries a `traceparent`. Used as the server's `trace_fn`.
pub fn server_span(request: &http::Request<()>) -> tracing::Span {
    let path = request.uri().path();
    let span = tracing::info_span!(
        "grpc.server",
        otel.name = path.trim_start_matches('/'),
        otel.kind = "server",
        rpc.system = "grpc",
    );
    let parent =
        global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(request.headers())));
    // A failure only means the span is not exported (no OTLP layer installed).
    let _ = span.set_parent(parent);
    span
}

/// The W3C `traceparent` of `span`, to store with work that continues later (a retry loop,
/// another reconciler pass): `None` when no trace is being recorded.
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    let mut carrier = std::collections::HashMap::new();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut carrier));
    carrier.remove("traceparent")
}

/// A root span named `name` that continues the trace in `traceparent` (as stored by
/// [`traceparent_of`]); a new trace when there is none or it does not parse. Work that resumes
/// from the store runs in it, so one peering setup stays one trace across passes and
/// processes.
pub fn resumed_span(name: &'static str, traceparent: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!(parent: None, "resumed", otel.name = name);
    if let Some(tp) = traceparent {
        let carrier: std::collections::HashMap<String, String> =
            [("traceparent".to_owned(), tp.to_owned())].into();
        let parent = global::get_text_map_propagator(|p| p.extract(&carrier));
        // A failure only means the span is not exported (no OTLP layer installed).
        let _ = span.set_parent(parent);
    }
    span
}

/// Adds the current span's context to every outgoing request, and on channels to this
/// cluster's own services the local token ([`crate::local_auth`]; off by default).
#[derive(Debug, Clone, Default)]
pub struct TraceInterceptor {
    local_token: crate::local_auth::LocalToken,
}

impl TraceInterceptor {
    /// An interceptor that also sends `token` (for channels to local services only).
    pub fn with_local_token(token: crate::local_auth::LocalToken) -> Self {
        Self { local_token: token }
    }
}

impl tonic::service::Interceptor for TraceInterceptor {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        let cx = tracing::Span::current().context();
        global::get_text_map_propagator(|p| {
            p.inject_context(&cx, &mut MetadataInjector(request.metadata_mut()));
        });
        self.local_token.attach(request.metadata_mut());
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tonic::service::Interceptor as _;
    use tracing_subscriber::layer::SubscriberExt as _;

    /// Runs `f` with an OpenTelemetry-backed subscriber (no exporter: spans only need valid
    /// contexts here).
    fn with_otel<T>(f: impl FnOnce() -> T) -> T {
        global::set_text_map_propagator(TraceContextPropagator::new());
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, f)
    }

    #[test]
    fn the_server_span_continues_the_callers_trace() {
        with_otel(|| {
            let request = http::Request::builder()
                .uri("/trellis.ipam.v1.Ipam/MapEndpointIp")
                .header(
                    "traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                )
                .body(())
                .expect("request");
            let span = server_span(&request);
            let cx = span.context();
            let sc = cx.span().span_context().clone();
            assert_eq!(
                sc.trace_id().to_string(),
                "4bf92f3577b34da6a3ce929d0e0e4736"
            );
            assert_ne!(
                sc.span_id().to_string(),
                "00f067aa0ba902b7",
                "a child, not the caller's span"
            );
        });
    }

    #[test]
    fn without_a_traceparent_the_server_starts_a_new_trace() {
        with_otel(|| {
            let request = http::Request::builder()
                .uri("/x/y")
                .body(())
                .expect("request");
            let span = server_span(&request);
            assert!(span.context().span().span_context().is_valid());
        });
    }

    #[test]
    fn a_stored_traceparent_resumes_the_same_trace() {
        with_otel(|| {
            let first = tracing::info_span!("first pass");
            let stored = traceparent_of(&first).expect("recorded");
            let trace_id = first.context().span().span_context().trace_id();
            let later = resumed_span("later pass", Some(&stored));
            assert_eq!(later.context().span().span_context().trace_id(), trace_id);
            let fresh = resumed_span("no parent", None);
            assert_ne!(fresh.context().span().span_context().trace_id(), trace_id);
            let garbage = resumed_span("bad parent", Some("not a traceparent"));
            assert_ne!(garbage.context().span().span_context().trace_id(), trace_id);
        });
    }

    #[test]
    fn the_interceptor_sends_the_current_trace() {
        with_otel(|| {
            let span = tracing::info_span!("caller");
            let _entered = span.enter();
            let trace_id = span.context().span().span_context().trace_id();
            let request = TraceInterceptor::default()
                .call(tonic::Request::new(()))
                .expect("interceptor never fails");
            let header = request
                .metadata()
                .get("traceparent")
                .expect("traceparent sent")
                .to_str()
                .expect("ascii");
            assert!(header.contains(&trace_id.to_string()), "{header}");
        });
    }
}
