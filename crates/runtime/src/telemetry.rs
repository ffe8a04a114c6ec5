//! Logs and traces. Log lines go to stderr (text or JSON, filtered by `RUST_LOG`); spans are
//! exported over OTLP/gRPC with a batch exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
//! Every span carries `service.name`, `trellis.cluster.id` and `trellis.cluster.name`, so a
//! trace that crosses clusters stays readable in Jaeger.
//!
//! A process runs one service, so one global subscriber does. The lab runs many services in one
//! process (ADR 0013); there each service gets a subscriber of its own ([`service_dispatch`]),
//! with its own tracer and resource, and every task it starts carries that subscriber along
//! ([`spawn`]; the gRPC server does the same for each request), so a lab's spans say which
//! service of which cluster emitted them, as the processes' do.

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{KeyValue, global};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Dispatch;
use tracing::instrument::WithSubscriber as _;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How log lines are written (the `--log-format` flag of [`crate::config::BaseConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Who is emitting: the resource attributes of every exported span.
#[derive(Debug, Clone)]
pub struct ServiceIdentity {
    /// `trellis-<svc>`.
    pub service: &'static str,
    pub cluster_id: String,
    pub cluster_name: String,
}

impl ServiceIdentity {
    /// The OpenTelemetry resource for this identity.
    pub fn resource(&self) -> Resource {
        Resource::builder()
            .with_service_name(self.service)
            .with_attributes([
                KeyValue::new("trellis.cluster.id", self.cluster_id.clone()),
                KeyValue::new("trellis.cluster.name", self.cluster_name.clone()),
            ])
            .build()
    }
}

/// Keeps the span exporter alive; [`Telemetry::shutdown`] flushes what is still batched.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Flushes pending spans and stops the exporter. Blocking work runs off the async workers
    /// because the exporter needs them to make progress.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let flushed = tokio::task::spawn_blocking(move || provider.shutdown()).await;
            if let Ok(Err(err)) = flushed {
                tracing::warn!(error = %err, "span exporter did not shut down cleanly");
            }
        }
    }
}

/// The OTLP endpoint from the standard environment variable, if any.
fn otlp_endpoint() -> Option<String> {
    std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|v| !v.trim().is_empty())
}

/// The span filter when `RUST_LOG` is unset: every span the services open at `info` (request,
/// reconcile and relay spans), not the HTTP/2 plumbing.
const SPAN_FILTER: &str = "info,h2=warn,hyper=warn,tower=warn";

/// A tracer provider exporting over OTLP with `identity`'s resource, when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set. Must run inside a Tokio runtime.
fn provider(identity: &ServiceIdentity) -> anyhow::Result<Option<SdkTracerProvider>> {
    if otlp_endpoint().is_none() {
        return Ok(None);
    }
    // The builder reads OTEL_EXPORTER_OTLP_ENDPOINT (and the other standard variables).
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .context("building the OTLP span exporter")?;
    Ok(Some(
        SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(identity.resource())
            .build(),
    ))
}

/// Colours only for a terminal: a log collector (a pod's log, a file) would keep the escape
/// codes, and colouring every span's fields cost the hub's forwarder about 1 % of its CPU.
fn stderr_is_terminal() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
}

fn env_filter(default_filter: &str) -> EnvFilter {
    EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter))
}

/// A subscriber for one in-process service (the lab): log lines as the process's own
/// subscriber writes them (filtered by `RUST_LOG`, else `log_filter`), and, when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set, spans exported by a tracer of the service's own, with
/// `identity` as the resource, filtered by `RUST_LOG`, else at `info` (a quiet lab still
/// exports the spans of a peering). `None` without an OTLP endpoint: the global subscriber
/// then serves every service. Run the service's start under it
/// (`start(..).with_subscriber(dispatch)`): what it spawns through [`spawn`], and its gRPC
/// server, keep it. Shut the returned [`Telemetry`] down to flush.
pub fn service_dispatch(
    identity: &ServiceIdentity,
    log_filter: &str,
) -> anyhow::Result<Option<(Dispatch, Telemetry)>> {
    let Some(provider) = provider(identity)? else {
        return Ok(None);
    };
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(identity.service))
        .with_filter(env_filter(SPAN_FILTER));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(stderr_is_terminal())
        .with_target(false)
        .with_filter(env_filter(log_filter));
    let dispatch = Dispatch::new(tracing_subscriber::registry().with(fmt).with(otel));
    Ok(Some((
        dispatch,
        Telemetry {
            provider: Some(provider),
        },
    )))
}

/// `tokio::spawn` that keeps the current subscriber: how services start their tasks, so that in
/// the lab the spans of a task belong to the service that started it.
pub fn spawn<F>(future: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    tokio::spawn(future.with_current_subscriber())
}

/// A tower layer running every request under one subscriber (see [`service_dispatch`]).
#[derive(Debug, Clone)]
pub struct DispatchLayer {
    dispatch: Dispatch,
}

impl DispatchLayer {
    pub fn new(dispatch: Dispatch) -> Self {
        Self { dispatch }
    }
}

impl<S> tower::Layer<S> for DispatchLayer {
    type Service = DispatchService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DispatchService {
            inner,
            dispatch: self.dispatch.clone(),
        }
    }
}

/// See [`DispatchLayer`].
#[derive(Debug, Clone)]
pub struct DispatchService<S> {
    inner: S,
    dispatch: Dispatch,
}

impl<S, R> tower::Service<R> for DispatchService<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tracing::instrument::WithDispatch<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        // The handler's future is created here too: build it under the subscriber.
        let future = tracing::dispatcher::with_default(&self.dispatch, || self.inner.call(request));
        future.with_subscriber(self.dispatch.clone())
    }
}

/// Installs the global subscriber and propagator. Must run inside a Tokio runtime (the OTLP
/// exporter's gRPC client needs one). A second call in the same process (tests) keeps the
/// first subscriber.
pub fn init(identity: &ServiceIdentity, format: LogFormat) -> anyhow::Result<Telemetry> {
    init_with_default(identity, format, "info,h2=warn,hyper=warn,tower=warn")
}

/// [`init`] with another filter than `info` when `RUST_LOG` is unset (the lab runs hundreds
/// of services in one process and keeps them quiet unless asked).
pub fn init_with_default(
    identity: &ServiceIdentity,
    format: LogFormat,
    default_filter: &str,
) -> anyhow::Result<Telemetry> {
    global::set_text_map_propagator(TraceContextPropagator::new());

    let filter = || env_filter(default_filter);
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(stderr_is_terminal())
            .with_target(false)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    };

    let provider = provider(identity)?;
    // Spans are never filtered below `info` by default, even where logs are (the lab's `warn`).
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(identity.service))
            .with_filter(env_filter(SPAN_FILTER))
    });
    if let Some(p) = &provider {
        global::set_tracer_provider(p.clone());
    }

    let installed = tracing_subscriber::registry()
        .with(fmt.with_filter(filter()))
        .with(otel)
        .try_init()
        .is_ok();
    if installed {
        tracing::info!(
            service = identity.service,
            cluster.id = %identity.cluster_id,
            cluster.name = %identity.cluster_name,
            otlp = provider.is_some(),
            "telemetry ready"
        );
    }
    Ok(Telemetry { provider })
}
