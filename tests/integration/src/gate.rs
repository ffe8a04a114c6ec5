//! [`Gate`]: a TCP proxy in front of one service that a test opens and closes, to play a
//! network partition between clusters while the test itself still reaches every service
//! directly. Closing refuses new connections and cuts the open ones (gRPC clients keep their
//! HTTP/2 connections, so refusing new ones alone would change nothing). Stalling cuts the open
//! ones too but keeps the new ones waiting, unanswered, until the gate opens: a silent
//! partition whose calls are still on their way when it heals.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A proxy to one address; open until [`Gate::close`] or [`Gate::stall`].
#[derive(Debug)]
pub struct Gate {
    /// Where to connect instead of the target.
    pub addr: SocketAddr,
    state: watch::Sender<State>,
    /// Bumped on close and stall: every proxied connection drops when it changes.
    cut: watch::Sender<u64>,
    /// Connections accepted while stalled and not yet let through.
    stalled: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

/// What a gate does with a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    Closed,
    Stalled,
}

impl Gate {
    /// A gate on a free loopback port, forwarding to `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (state, _) = watch::channel(State::Open);
        let (cut, _) = watch::channel(0u64);
        let stalled = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let (state, cut, stalled) = (state.clone(), cut.clone(), stalled.clone());
            async move {
                while let Ok((inside, _)) = listener.accept().await {
                    let mut opened = state.subscribe();
                    let now = *opened.borrow_and_update();
                    if now == State::Closed {
                        drop(inside);
                        continue;
                    }
                    let cut = cut.clone();
                    let stalled = stalled.clone();
                    tokio::spawn(async move {
                        if now == State::Stalled {
                            stalled.fetch_add(1, Ordering::SeqCst);
                            let opened = opened.wait_for(|s| *s == State::Open).await.is_ok();
                            stalled.fetch_sub(1, Ordering::SeqCst);
                            if !opened {
                                return;
                            }
                        }
                        let mut cut = cut.subscribe();
                        let Ok(mut outside) = TcpStream::connect(target).await else {
                            return;
                        };
                        let mut inside = inside;
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inside, &mut outside) => {}
                            _ = cut.changed() => {}
                        }
                    });
                }
            }
        });
        Ok(Self {
            addr,
            state,
            cut,
            stalled,
            task,
        })
    }

    /// Refuses new connections and cuts the open ones.
    pub fn close(&self) {
        self.state.send_replace(State::Closed);
        self.cut.send_modify(|n| *n += 1);
    }

    /// Cuts the open connections and keeps new ones waiting, with what their clients sent,
    /// until [`Gate::open`] lets them through.
    pub fn stall(&self) {
        self.state.send_replace(State::Stalled);
        self.cut.send_modify(|n| *n += 1);
    }

    /// Lets connections through again, the stalled ones first.
    pub fn open(&self) {
        self.state.send_replace(State::Open);
    }

    /// Connections waiting at the stalled gate.
    pub fn stalled(&self) -> usize {
        self.stalled.load(Ordering::SeqCst)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.send_modify(|n| *n += 1);
    }
}

/// A proxy that holds every connection until it is released: it accepts, reads what the
/// client sends (keeping it) and answers nothing, then, once [`Hold::release`] names the
/// target, forwards what it kept and everything after. The target need not exist when the
/// hold starts, so a cluster can advertise the hold as one of its services before it runs.
///
/// It also counts, from the HTTP/2 frames the clients send while held, how many gRPC requests
/// arrived ([`Hold::requests`]) and how many the clients gave up on ([`Hold::cancelled`]: a
/// `RST_STREAM`, sent when a request times out): a test can thus tell work in flight from
/// work already abandoned without looking at a clock.
#[derive(Debug)]
pub struct Hold {
    /// Where to connect instead of the target.
    pub addr: SocketAddr,
    target: watch::Sender<Option<SocketAddr>>,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

#[derive(Debug, Default)]
struct Counts {
    requests: std::sync::atomic::AtomicUsize,
    cancelled: std::sync::atomic::AtomicUsize,
}

/// The HTTP/2 client connection preface, before the first frame.
const PREFACE: usize = 24;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_RST_STREAM: u8 = 0x3;

impl Hold {
    /// A hold on a free loopback port.
    pub async fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (target, _) = watch::channel(None);
        let counts = Arc::new(Counts::default());
        let task = tokio::spawn({
            let (target, counts) = (target.clone(), counts.clone());
            async move {
                while let Ok((inside, _)) = listener.accept().await {
                    tokio::spawn(hold(inside, target.subscribe(), counts.clone()));
                }
            }
        });
        Ok(Self {
            addr,
            target,
            counts,
            task,
        })
    }

    /// Forwards every held connection, and every later one, to `target`.
    pub fn release(&self, target: SocketAddr) {
        self.target.send_replace(Some(target));
    }

    /// gRPC requests (HTTP/2 HEADERS frames opening a stream) received while held.
    pub fn requests(&self) -> usize {
        self.counts.requests.load(Ordering::SeqCst)
    }

    /// Requests the clients cancelled (RST_STREAM) while held.
    pub fn cancelled(&self) -> usize {
        self.counts.cancelled.load(Ordering::SeqCst)
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Holds one connection until a target is known, then proxies it.
async fn hold(
    mut inside: TcpStream,
    mut target: watch::Receiver<Option<SocketAddr>>,
    counts: Arc<Counts>,
) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut kept = Vec::new();
    let mut parsed = PREFACE;
    let mut buf = [0u8; 16 * 1024];
    let to = loop {
        if let Some(to) = *target.borrow_and_update() {
            break to;
        }
        tokio::select! {
            read = inside.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    kept.extend_from_slice(&buf[..n]);
                    // Frames: 3 bytes length, 1 type, 1 flags, 4 stream ID, then the payload.
                    while kept.len() >= parsed + 9 {
                        let header = &kept[parsed..parsed + 9];
                        let len = usize::from(header[0]) << 16
                            | usize::from(header[1]) << 8
                            | usize::from(header[2]);
                        match header[3] {
                            FRAME_HEADERS => {
                                counts.requests.fetch_add(1, Ordering::SeqCst);
                            }
                            FRAME_RST_STREAM => {
                                counts.cancelled.fetch_add(1, Ordering::SeqCst);
                            }
                            _ => {}
                        }
                        parsed += 9 + len;
                    }
                }
            },
            changed = target.changed() => if changed.is_err() { return },
        }
    };
    let Ok(mut outside) = TcpStream::connect(to).await else {
        return;
    };
    if outside.write_all(&kept).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
}
