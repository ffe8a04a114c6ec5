//! Warnings that anyone who reaches a listener can trigger (a refused TLS handshake on the peer
//! listener, a call without the local token) are limited: one per period, which says how many
//! were held back since the last. Otherwise a client opening connections in a loop fills the
//! log, and the disk or the log pipeline behind it, at the rate it likes.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The period of the limited warnings: at most one line per 10 s for each kind, per process.
pub const PERIOD: Duration = Duration::from_secs(10);

/// One event logged per `period`; the others counted.
#[derive(Debug)]
pub struct LogLimit {
    period: Duration,
    /// When the last event was let through, and how many were held back since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    /// At most one event per `period`.
    pub const fn new(period: Duration) -> Self {
        Self {
            period,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last one logged)` when this event is to be logged, `None`
    /// when it is only counted.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (last, held) = &mut *state;
        if last.is_some_and(|at| now.saturating_duration_since(at) < self.period) {
            *held += 1;
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(held))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;
    use std::net::SocketAddr;
    use std::sync::Arc;

    use tokio::io::AsyncWriteExt as _;

    use super::*;

    #[test]
    fn one_event_per_period_passes_and_says_how_many_were_held_back() {
        let limit = LogLimit::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(limit.admit_at(t0), Some(0));
        for s in 1..10 {
            assert_eq!(limit.admit_at(t0 + Duration::from_secs(s)), None);
        }
        assert_eq!(limit.admit_at(t0 + Duration::from_secs(10)), Some(9));
        assert_eq!(limit.admit_at(t0 + Duration::from_secs(11)), None);
        assert_eq!(limit.admit_at(t0 + Duration::from_secs(25)), Some(1));
    }

    /// The log lines written through it.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn count(&self, needle: &str) -> usize {
            let text = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
            String::from_utf8_lossy(&text).matches(needle).count()
        }
    }

    /// 50 connections that fail their TLS handshake on the peer listener write one warning
    /// (plus at most one more if the period ends during the test), not 50.
    #[tokio::test]
    async fn refused_tls_handshakes_are_not_logged_one_by_one() {
        const REFUSED: &str = "refused a TLS connection on the peer listener";
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);

        let ca = crate::tls::ClusterCa::generate("leaf-a").expect("CA");
        let cert = ca.issue("broker").expect("cert");
        let tls = crate::tls::PeerTls::new("leaf-a", ca.cert_pem(), &cert.cert_pem, cert.key_pem())
            .expect("tls");
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("binds");
        let addr = listener.local_addr().expect("addr");
        let _incoming = crate::tls::incoming(listener, &tls).expect("incoming");
        let mut connections = Vec::new();
        for _ in 0..50 {
            let mut tcp = tokio::net::TcpStream::connect(addr)
                .await
                .expect("connects");
            // Not a TLS ClientHello: the handshake fails at once.
            tcp.write_all(b"GET / HTTP/1.1\r\n\r\n")
                .await
                .expect("writes");
            connections.push(tcp);
        }
        // Positive control: the first refusal is logged.
        let deadline = Instant::now() + Duration::from_secs(10);
        while captured.count(REFUSED) == 0 {
            assert!(Instant::now() < deadline, "no refusal logged");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Let the other 49 handshakes fail too.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = std::io::stderr().flush();
        let logged = captured.count(REFUSED);
        assert!(logged <= 2, "{logged} warnings for 50 refused handshakes");
    }

    /// 50 calls without the local token get 50 UNAUTHENTICATED answers but one warning (at
    /// most two).
    #[tokio::test]
    async fn calls_without_the_local_token_are_not_logged_one_by_one() {
        const REFUSED: &str = "refused an intra-cluster call without this cluster's local token";
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);

        let server = crate::server::GrpcServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("binds")
            .with_local_token(
                crate::local_auth::LocalToken::new("0123456789abcdef-local").expect("token"),
            );
        let addr = server.local_addr();
        let shutdown = crate::Shutdown::new();
        let task = server.spawn(
            tonic::service::Routes::default(),
            &[],
            shutdown.clone(),
            Duration::from_secs(1),
            Vec::new(),
        );
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await
            .expect("connects");
        let mut reflection = tonic::client::Grpc::new(channel);
        for _ in 0..50 {
            reflection.ready().await.expect("ready");
            let refused = reflection
                .unary::<_, tonic_health::pb::HealthCheckResponse, _>(
                    tonic::Request::new(tonic_health::pb::HealthCheckRequest::default()),
                    http::uri::PathAndQuery::from_static("/trellis.ipam.v1.Ipam/GetLocalSubnets"),
                    tonic_prost::ProstCodec::default(),
                )
                .await
                .expect_err("no token");
            assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        }
        let logged = captured.count(REFUSED);
        assert!(logged >= 1, "the refusal is logged");
        assert!(logged <= 2, "{logged} warnings for 50 refused calls");
        shutdown.cancel();
        task.await.expect("joins").expect("stops cleanly");
    }
}
