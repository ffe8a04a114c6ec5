//! [`SilentRelay`]: a TCP relay in front of one address that a test can make go **silent**, as
//! a crashed node or a partition that drops packets does: from [`SilentRelay::silence`] on,
//! every byte either side sends is swallowed, nothing is delivered and no connection is closed
//! (no FIN, no RST). A client that only waits (a watch stream) learns nothing from the network;
//! only its own liveness checks (HTTP/2 PINGs, timeouts) can end the wait.
//!
//! The relay runs in the test process, so it works for any server on loopback (in-process or a
//! child process), without root. It differs from a real packet drop in one way: the relay's
//! kernel still acknowledges what it swallows, so TCP keepalive and retransmission timeouts do
//! not fire; a test of those needs real drops (nftables, `trellis_netlab::partition`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// A relay to one address on a free loopback port ([`SilentRelay::addr`]); it forwards until
/// [`SilentRelay::silence`]. Dropping it closes every connection it holds.
#[derive(Debug)]
pub struct SilentRelay {
    /// Where to connect instead of the target.
    pub addr: SocketAddr,
    silent: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl SilentRelay {
    /// A relay on a free loopback port, forwarding to `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let silent = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let silent = silent.clone();
            async move {
                // Owned here, so aborting the relay's task drops every connection's task.
                let mut connections = JoinSet::new();
                while let Ok((inside, _)) = listener.accept().await {
                    connections.spawn(relay(inside, target, silent.clone()));
                    while connections.try_join_next().is_some() {}
                }
            }
        });
        Ok(Self { addr, silent, task })
    }

    /// Swallows everything from now on, on open connections and on new ones, closing nothing.
    pub fn silence(&self) {
        self.silent.store(true, Ordering::SeqCst);
    }

    /// Relays new connections again (a partition healed). A connection open while the relay
    /// was silent has lost bytes and stays silent.
    pub fn restore(&self) {
        self.silent.store(false, Ordering::SeqCst);
    }

    /// Whether the relay swallows.
    pub fn is_silent(&self) -> bool {
        self.silent.load(Ordering::SeqCst)
    }
}

impl Drop for SilentRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One connection: relayed both ways while the relay speaks; once silent, swallowed for good.
async fn relay(inside: TcpStream, target: SocketAddr, silent: Arc<AtomicBool>) {
    let outside = if silent.load(Ordering::SeqCst) {
        None
    } else {
        TcpStream::connect(target).await.ok()
    };
    let Some(outside) = outside else {
        // Nobody to relay to (silent, or the target refused): swallow what the client sends.
        let (from, _to) = inside.into_split();
        swallow(from).await;
        return std::future::pending::<()>().await;
    };
    let (in_read, in_write) = inside.into_split();
    let (out_read, out_write) = outside.into_split();
    let silenced = Arc::new(AtomicBool::new(false));
    tokio::join!(
        pump(in_read, out_write, silent.clone(), silenced.clone()),
        pump(out_read, in_write, silent, silenced),
    );
}

/// Copies `from` to `to` until either ends or the relay goes silent, then swallows `from`.
/// Once this connection was silenced (either direction), `to` is never closed: a silent
/// network delivers no FIN.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    silent: Arc<AtomicBool>,
    silenced: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if silent.load(Ordering::SeqCst) {
            silenced.store(true, Ordering::SeqCst);
            swallow(from).await;
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    if silent.load(Ordering::SeqCst) || silenced.load(Ordering::SeqCst) {
        // Hold `to` (whose drop would send a FIN) until the relay is dropped.
        let _keep = to;
        std::future::pending::<()>().await;
    }
}

/// Reads and discards everything until the peer closes.
async fn swallow(mut from: OwnedReadHalf) {
    let mut buf = vec![0u8; 16 * 1024];
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
    // Keep our side open: the half is dropped only with the relay.
    let _keep = from;
    std::future::pending::<()>().await;
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An echo server on loopback.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("binds");
        let addr = listener.local_addr().expect("an address");
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(stream: &mut TcpStream) -> std::io::Result<[u8; 4]> {
        stream.write_all(b"ping").await?;
        let mut answer = [0u8; 4];
        stream.read_exact(&mut answer).await?;
        Ok(answer)
    }

    #[tokio::test]
    async fn a_silent_relay_delivers_nothing_and_closes_nothing() {
        let relay = SilentRelay::start(echo().await).await.expect("relay");
        let mut open = TcpStream::connect(relay.addr).await.expect("connects");
        assert_eq!(round_trip(&mut open).await.expect("echo"), *b"ping");

        relay.silence();
        let hung = tokio::time::timeout(Duration::from_millis(500), round_trip(&mut open)).await;
        assert!(hung.is_err(), "nothing comes back: {hung:?}");
        let mut fresh = TcpStream::connect(relay.addr).await.expect("accepted");
        let hung = tokio::time::timeout(Duration::from_millis(300), round_trip(&mut fresh)).await;
        assert!(hung.is_err(), "nor on a new connection: {hung:?}");
        // No FIN either: a read still waits.
        let mut byte = [0u8; 1];
        let waited = tokio::time::timeout(Duration::from_millis(300), open.read(&mut byte)).await;
        assert!(waited.is_err(), "the connection stays open: {waited:?}");

        relay.restore();
        let mut healed = TcpStream::connect(relay.addr).await.expect("connects");
        assert_eq!(round_trip(&mut healed).await.expect("echo"), *b"ping");
    }
}
