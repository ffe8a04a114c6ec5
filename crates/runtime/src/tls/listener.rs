//! The server side towards other clusters: the peer listener's rustls configuration and its
//! accept loop, whose connections carry the verified caller ([`PeerConnectInfo`]) into every
//! request's extensions, where [`caller`] finds it.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::UnixTime;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;
use trellis_error::{Error, Result};

use super::identity::PeerIdentity;
use super::peer_tls::PeerTls;
use super::verification::{algorithms, provider, verify_chain};
use super::verifiers::PeerClientVerifier;

/// How long a TLS handshake on the peer listener may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Refused and timed-out handshakes on the peer listener, which anyone who reaches it can
/// cause: logged once per period ([`crate::log_limit`]).
static REFUSED_HANDSHAKES: crate::log_limit::LogLimit =
    crate::log_limit::LogLimit::new(crate::log_limit::PERIOD);

impl PeerTls {
    /// The server configuration of the peer listener.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>> {
        let verifier = Arc::new(PeerClientVerifier {
            trust: self.trust().clone(),
            algorithms: algorithms(),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Internal(format!("TLS server configuration: {e}")))?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(self.own_cert().clone());
        config.alpn_protocols = vec![b"h2".to_vec()];
        // No session resumption: a resumed session skips the client verifier, so a CA unpinned
        // since would still get in.
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
        Ok(Arc::new(config))
    }
}

/// What a connection of the peer listener tells every request on it (a request extension;
/// read it with [`caller`]).
#[derive(Debug, Clone)]
pub struct PeerConnectInfo {
    pub remote_addr: Option<SocketAddr>,
    /// The verified caller; `None` when it presented no certificate.
    pub peer: Option<PeerIdentity>,
}

/// A TLS connection accepted on the peer listener.
#[derive(Debug)]
pub struct PeerStream {
    inner: tokio_rustls::server::TlsStream<TcpStream>,
    info: PeerConnectInfo,
}

impl Connected for PeerStream {
    type ConnectInfo = PeerConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The accepted, TLS-established connections of `listener`. Each handshake runs in a task of
/// its own (a slow client holds up nobody); a refused one is logged with the remote address
/// and why. The loop ends when the stream is dropped.
pub fn incoming(
    listener: TcpListener,
    tls: &PeerTls,
) -> Result<ReceiverStream<io::Result<PeerStream>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config()?);
    let trust = tls.trust().clone();
    crate::telemetry::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = tx.closed() => return,
                accepted = listener.accept() => accepted,
            };
            let (tcp, remote) = match accepted {
                Ok(found) => found,
                Err(err) => {
                    tracing::warn!(error = %err, "peer listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, tx, trust) = (acceptor.clone(), tx.clone(), trust.clone());
            crate::telemetry::spawn(async move {
                let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
                    .await
                {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(err)) => {
                        if let Some(held_back) = REFUSED_HANDSHAKES.admit() {
                            tracing::warn!(remote = %remote, error = %err, held_back, "refused a TLS connection on the peer listener");
                        }
                        return;
                    }
                    Err(_) => {
                        if let Some(held_back) = REFUSED_HANDSHAKES.admit() {
                            tracing::warn!(remote = %remote, held_back, "TLS handshake timed out on the peer listener");
                        }
                        return;
                    }
                };
                let peer = match stream.get_ref().1.peer_certificates() {
                    None | Some([]) => None,
                    Some([leaf, rest @ ..]) => match verify_chain(
                        &trust,
                        leaf,
                        rest,
                        UnixTime::now(),
                        webpki::KeyUsage::client_auth(),
                        None,
                    ) {
                        Ok(peer) => Some(peer),
                        Err(err) => {
                            if let Some(held_back) = REFUSED_HANDSHAKES.admit() {
                                tracing::warn!(remote = %remote, error = %err, held_back, "refused a TLS connection on the peer listener");
                            }
                            return;
                        }
                    },
                };
                let info = PeerConnectInfo {
                    remote_addr: Some(remote),
                    peer,
                };
                let _ = tx
                    .send(Ok(PeerStream {
                        inner: stream,
                        info,
                    }))
                    .await;
            });
        }
    });
    Ok(ReceiverStream::new(rx))
}

/// Who sent a request, as far as the transport knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The plaintext listener: an intra-cluster caller, or anyone who reached it.
    Plaintext,
    /// The peer listener, without a client certificate.
    Anonymous,
    /// The peer listener, with a verified certificate.
    Peer(PeerIdentity),
}

/// The caller of a request (from its extensions).
pub fn caller<T>(request: &tonic::Request<T>) -> Caller {
    caller_of(request.extensions())
}

/// The caller from request extensions (tonic's or http's).
pub fn caller_of(extensions: &http::Extensions) -> Caller {
    match extensions.get::<PeerConnectInfo>() {
        None => Caller::Plaintext,
        Some(PeerConnectInfo { peer: None, .. }) => Caller::Anonymous,
        Some(PeerConnectInfo {
            peer: Some(peer), ..
        }) => Caller::Peer(peer.clone()),
    }
}
