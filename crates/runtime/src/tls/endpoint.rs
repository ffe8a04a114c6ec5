//! A TLS connection as tonic sees it: an endpoint whose connector opens TCP (with the
//! runtime's keepalive, which tonic sets only on sockets it opens itself) and then TLS with a
//! given rustls configuration, both within the connect timeout.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tonic::transport::Endpoint;
use trellis_error::{Error, Result};

use crate::client::Timeouts;

fn tls_error(context: &str) -> impl Fn(String) -> Error + '_ {
    move |e| Error::invalid(context, e)
}

fn endpoint(field: &str, address: &str, timeouts: Timeouts) -> Result<(Endpoint, String)> {
    let bare = address
        .split_once("://")
        .map_or(address, |(_, rest)| rest)
        .trim_end_matches('/');
    let endpoint = Endpoint::from_shared(format!("http://{bare}"))
        .map_err(|e| Error::invalid(field, format!("{address:?} is not a usable address: {e}")))?;
    Ok((
        crate::client::configure(endpoint, timeouts),
        bare.to_owned(),
    ))
}

/// The connector of a TLS channel: TCP (with [`crate::client::KEEPALIVE`]) to the target, then
/// TLS with our configuration, both within the connect timeout.
#[derive(Clone)]
struct TlsConnect {
    connector: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
    target: String,
    timeout: Duration,
}

type TlsConnecting = Pin<
    Box<
        dyn Future<Output = io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>> + Send,
    >,
>;

impl tower::Service<http::Uri> for TlsConnect {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = TlsConnecting;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let connect = async {
                let tcp = TcpStream::connect(&this.target).await?;
                tcp.set_nodelay(true)?;
                // tonic sets TCP keepalive only on sockets it opens itself.
                socket2::SockRef::from(&tcp).set_tcp_keepalive(&crate::client::KEEPALIVE.tcp())?;
                this.connector.connect(this.name.clone(), tcp).await
            };
            match tokio::time::timeout(this.timeout, connect).await {
                Ok(Ok(stream)) => Ok(TokioIo::new(stream)),
                Ok(Err(err)) => Err(err),
                Err(_) => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("TLS connection to {} timed out", this.target),
                )),
            }
        })
    }
}

/// A TLS endpoint not connected yet: [`TlsEndpoint::connect`] connects now (tools that report
/// an unreachable server before any call), [`TlsEndpoint::connect_lazy`] on first use.
pub struct TlsEndpoint {
    endpoint: Endpoint,
    connect: TlsConnect,
}

impl fmt::Debug for TlsEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsEndpoint")
            .field("target", &self.connect.target)
            .finish_non_exhaustive()
    }
}

impl TlsEndpoint {
    /// `address` (`host:port`, optionally with a scheme) over TLS with `config`. Fails only on a
    /// malformed address, named as `field`.
    pub fn new(
        field: &str,
        address: &str,
        timeouts: Timeouts,
        config: Arc<rustls::ClientConfig>,
    ) -> Result<Self> {
        let (endpoint, target) = endpoint(field, address, timeouts)?;
        let host = target
            .rsplit_once(':')
            .map_or(target.as_str(), |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let name = ServerName::try_from(host.clone())
            .map_err(|e| tls_error(field)(format!("{host:?} is no host name: {e}")))?;
        Ok(Self {
            endpoint,
            connect: TlsConnect {
                connector: tokio_rustls::TlsConnector::from(config),
                name,
                target,
                timeout: timeouts.connect,
            },
        })
    }

    /// Connects now.
    pub async fn connect(
        self,
    ) -> std::result::Result<tonic::transport::Channel, tonic::transport::Error> {
        self.endpoint.connect_with_connector(self.connect).await
    }

    /// Connects on first use.
    pub fn connect_lazy(self) -> tonic::transport::Channel {
        self.endpoint.connect_with_connector_lazy(self.connect)
    }
}
