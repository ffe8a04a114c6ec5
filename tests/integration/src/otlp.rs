//! An in-process OTLP/gRPC trace receiver, standing in for Jaeger's collector: services under
//! test export to it through `OTEL_EXPORTER_OTLP_ENDPOINT`, and tests read back what arrived.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tokio_stream::wrappers::TcpListenerStream;

/// One received span with the resource attributes of the process that sent it.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub name: String,
    /// Lowercase hex.
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub resource: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(attrs: &[KeyValue]) -> BTreeMap<String, String> {
    attrs
        .iter()
        .filter_map(|kv| {
            let value = match kv.value.as_ref()?.value.as_ref()? {
                Value::StringValue(s) => s.clone(),
                Value::IntValue(i) => i.to_string(),
                Value::BoolValue(b) => b.to_string(),
                other => format!("{other:?}"),
            };
            Some((kv.key.clone(), value))
        })
        .collect()
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = Vec::new();
        for rs in request.into_inner().resource_spans {
            let resource = rs.resource.map(|r| text(&r.attributes)).unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    received.push(ReceivedSpan {
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        resource: resource.clone(),
                    });
                }
            }
        }
        if let Ok(mut spans) = self.spans.lock() {
            spans.extend(received);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A running receiver; stops when dropped.
#[derive(Debug)]
pub struct OtlpReceiver {
    addr: SocketAddr,
    collector: Collector,
    task: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    /// Listens on a free loopback port.
    pub async fn start() -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let collector = Collector::default();
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(TcpListenerStream::new(listener));
        let task = tokio::spawn(async move {
            let _ = server.await;
        });
        Ok(Self {
            addr,
            collector,
            task,
        })
    }

    /// The value for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.collector
            .spans
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
