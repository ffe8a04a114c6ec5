//! Connections to the local cluster's services: an eager connect bounded by `--timeout` (so an
//! unreachable service is reported as such, with the cause, before any call), and the
//! translation of connection failures into plain words.

use std::error::Error as StdError;
use std::io;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use trellis_runtime::client::Timeouts;
use trellis_runtime::tls::ToolTls;

use crate::error::CtlError;
// Their old path: they moved to `service` so that `error` can name them without a cycle.
pub use crate::service::{Service, Target};

type Connecting = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Channel, tonic::transport::Error>> + Send>,
>;

/// Connects to `target` (over TLS with `tls`), waiting at most `timeout`; every call on the
/// channel is bounded by `timeout` too.
pub async fn connect(
    target: &Target,
    tls: Option<&ToolTls>,
    timeout: Duration,
) -> Result<Channel, CtlError> {
    let unreachable = |reason: String| CtlError::Unreachable {
        service: target.service,
        address: target.address.clone(),
        reason,
    };
    let connecting = match tls {
        Some(tls) => {
            let timeouts = Timeouts {
                connect: timeout,
                request: timeout,
            };
            let endpoint = tls
                .endpoint(target.service.flag(), &target.address, timeouts)
                .map_err(|e| unreachable(format!("not a usable address: {e}")))?;
            Box::pin(endpoint.connect()) as Connecting
        }
        None => {
            let endpoint = Endpoint::from_shared(format!("http://{}", target.address))
                .map_err(|e| unreachable(format!("not a usable address: {e}")))?
                .connect_timeout(timeout)
                .timeout(timeout)
                .tcp_nodelay(true);
            Box::pin(async move { endpoint.connect().await })
        }
    };
    // connect_timeout bounds the TCP connect (and TLS); the outer timeout also bounds name
    // resolution and the HTTP/2 handshake.
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(channel)) => Ok(channel),
        Ok(Err(err)) => Err(unreachable(describe(&err, timeout))),
        Err(_) => Err(unreachable(no_answer(timeout))),
    }
}

fn no_answer(timeout: Duration) -> String {
    format!("no answer within {} (see --timeout)", seconds(timeout))
}

/// "3s", "0.5s".
pub fn seconds(duration: Duration) -> String {
    let secs = duration.as_secs_f64();
    if secs.fract() == 0.0 {
        format!("{secs:.0}s")
    } else {
        format!("{secs}s")
    }
}

/// The root cause of a connection failure, in plain words ("connection refused").
pub fn describe(err: &(dyn StdError + 'static), timeout: Duration) -> String {
    let mut current: Option<&(dyn StdError + 'static)> = Some(err);
    let mut last = err.to_string();
    while let Some(e) = current {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            return describe_io(io, timeout);
        }
        let text = e.to_string();
        if text.contains("timed out") || text.contains("elapsed") {
            return no_answer(timeout);
        }
        if !text.is_empty() {
            last = text;
        }
        current = e.source();
    }
    last
}

fn describe_io(err: &io::Error, timeout: Duration) -> String {
    match err.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".into(),
        io::ErrorKind::ConnectionReset => "connection reset".into(),
        io::ErrorKind::TimedOut => no_answer(timeout),
        io::ErrorKind::HostUnreachable => "host unreachable".into(),
        io::ErrorKind::NetworkUnreachable => "network unreachable".into(),
        io::ErrorKind::AddrNotAvailable => "address not available".into(),
        _ => {
            // e.g. "failed to lookup address information: Name or service not known"
            let text = err.to_string();
            match text.find(" (os error") {
                Some(cut) => text[..cut].to_owned(),
                None => text,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Wrapper(io::Error);
    impl std::fmt::Display for Wrapper {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("transport error")
        }
    }
    impl StdError for Wrapper {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn the_io_cause_is_found_under_wrappers() {
        let refused = Wrapper(io::Error::from(io::ErrorKind::ConnectionRefused));
        assert_eq!(
            describe(&refused, Duration::from_secs(1)),
            "connection refused"
        );
        let timed_out = Wrapper(io::Error::from(io::ErrorKind::TimedOut));
        assert_eq!(
            describe(&timed_out, Duration::from_millis(500)),
            "no answer within 0.5s (see --timeout)"
        );
        let other = Wrapper(io::Error::other("failed to lookup address information"));
        assert_eq!(
            describe(&other, Duration::from_secs(1)),
            "failed to lookup address information"
        );
    }

    #[tokio::test]
    async fn a_port_nothing_listens_on_is_refused_with_the_service_named() {
        // Bind, learn the port, close: nothing listens there any more.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("binds")
            .port();
        let target = Target {
            service: Service::Broker,
            address: format!("127.0.0.1:{port}"),
        };
        let err = connect(&target, None, Duration::from_secs(2))
            .await
            .expect_err("nothing listens");
        assert_eq!(
            err.to_string(),
            format!(
                "cannot reach the broker at 127.0.0.1:{port}: connection refused \
                 (is trellis-broker running? set --broker)"
            )
        );
        assert_eq!(err.exit_code(), 1);
    }
}
