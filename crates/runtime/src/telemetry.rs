//! Logs and traces. Log lines go to stderr (text or JSON, filtered by `RUST_LOG`); spans are
//! exported over OTLP/gRPC with a batch exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
//! Every span carries `service.name`, `trellis.cluster.id` and `trellis.cluster.name`, so a
//! trace that crosses clusters stays readable in Jaeger.

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{KeyValue, global};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::LogFormat;

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

    let filter =
        || EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let fmt = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_target(false)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    };

    let provider = match otlp_endpoint() {
        Some(_) => {
            // The builder reads OTEL_EXPORTER_OTLP_ENDPOINT (and the other standard variables).
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .build()
                .context("building the OTLP span exporter")?;
            Some(
                SdkTracerProvider::builder()
                    .with_batch_exporter(exporter)
                    .with_resource(identity.resource())
                    .build(),
            )
        }
        None => None,
    };
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(identity.service))
            .with_filter(filter())
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
