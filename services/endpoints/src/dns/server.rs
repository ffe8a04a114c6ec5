//! The DNS server: hickory-server on UDP and TCP at `--dns-listen`, answering every question
//! from the latest [`Zone`] (swapped whole by [`super::run_zone`]) without touching the store,
//! so a flood of queries costs no store or peer calls. Until the first zone is built (right
//! after start, before the first import pass on the Kubernetes path) every answer is
//! SERVFAIL, which resolvers retry, rather than an NXDOMAIN they would cache.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use hickory_proto::op::{Edns, Header, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::Record;
use hickory_server::ServerFuture;
use hickory_server::authority::MessageResponseBuilder;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::watch;
use trellis_runtime::Shutdown;

use super::metrics::DnsMetrics;
use super::zone::{Answer, Zone};

/// Largest UDP answer offered to EDNS clients: the size that avoids IP fragmentation on
/// common paths (the DNS flag day 2020 recommendation).
const EDNS_PAYLOAD: u16 = 1232;

/// How long an idle TCP connection is kept.
const TCP_TIMEOUT: Duration = Duration::from_secs(10);

/// The zone a server answers from; `None` until the first one is built.
pub type ZoneView = watch::Receiver<Option<Arc<Zone>>>;

struct Handler {
    zone: ZoneView,
    metrics: DnsMetrics,
}

impl Handler {
    /// The response code, the answer records, and the SOA for a negative answer, all from one
    /// zone (a rebuild between two reads could otherwise pair them from different zones).
    fn respond(&self, request: &Request) -> (ResponseCode, Vec<Record>, Option<Record>) {
        let header = request.header();
        if header.message_type() != MessageType::Query {
            return (ResponseCode::FormErr, Vec::new(), None);
        }
        if header.op_code() != OpCode::Query {
            return (ResponseCode::NotImp, Vec::new(), None);
        }
        let Ok(info) = request.request_info() else {
            return (ResponseCode::FormErr, Vec::new(), None);
        };
        let Some(zone) = self.zone.borrow().clone() else {
            return (ResponseCode::ServFail, Vec::new(), None);
        };
        // Negative answers carry the SOA, whose minimum tells resolvers how long to cache them.
        match zone.answer(info.query.name(), info.query.query_type()) {
            Answer::Records(records) if records.is_empty() => {
                (ResponseCode::NoError, records, Some(zone.soa().clone()))
            }
            Answer::Records(records) => (ResponseCode::NoError, records, None),
            Answer::NxDomain => (ResponseCode::NXDomain, Vec::new(), Some(zone.soa().clone())),
            Answer::Refused => (ResponseCode::Refused, Vec::new(), None),
        }
    }
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        let (code, answers, soa) = self.respond(request);
        self.metrics.answered(code);
        let mut header = Header::response_from_request(request.header());
        header.set_authoritative(matches!(
            code,
            ResponseCode::NoError | ResponseCode::NXDomain
        ));
        header.set_recursion_available(false);
        header.set_response_code(code);
        let mut builder = MessageResponseBuilder::from_message_request(request);
        if let Some(edns) = request.edns() {
            let mut ours = Edns::new();
            ours.set_max_payload(edns.max_payload().clamp(512, EDNS_PAYLOAD));
            builder.edns(ours);
        }
        let message = builder.build(header, answers.iter(), [], soa.iter(), []);
        match response.send_response(message).await {
            Ok(info) => info,
            Err(err) => {
                tracing::debug!(error = %err, "could not send a dns answer");
                let mut failed = Header::new();
                failed.set_response_code(ResponseCode::ServFail);
                failed.into()
            }
        }
    }
}

/// A DNS server bound on UDP and TCP.
pub struct DnsServer {
    addr: SocketAddr,
    server: ServerFuture<Handler>,
}

impl std::fmt::Debug for DnsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl DnsServer {
    /// Binds UDP and TCP on `listen` (port 0: one free port for both).
    pub async fn bind(
        listen: SocketAddr,
        zone: ZoneView,
        metrics: DnsMetrics,
    ) -> anyhow::Result<Self> {
        let udp = UdpSocket::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen} (dns, udp)"))?;
        let addr = udp.local_addr()?;
        let tcp = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr} (dns, tcp)"))?;
        let mut server = ServerFuture::new(Handler { zone, metrics });
        server.register_socket(udp);
        server.register_listener(tcp, TCP_TIMEOUT);
        Ok(Self { addr, server })
    }

    /// Where it answers (UDP and TCP).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until `shutdown`, then stops taking queries and lets those in flight finish.
    pub async fn serve(mut self, shutdown: Shutdown) {
        shutdown.cancelled().await;
        if let Err(err) = self.server.shutdown_gracefully().await {
            tracing::warn!(error = %err, "the dns server stopped with an error");
        }
    }
}
