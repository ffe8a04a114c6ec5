//! [`Gate`]: a TCP proxy in front of one service that a test opens and closes, to play a
//! network partition between clusters while the test itself still reaches every service
//! directly. Closing refuses new connections and cuts the open ones (gRPC clients keep their
//! HTTP/2 connections, so refusing new ones alone would change nothing).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A proxy to one address; open until [`Gate::close`].
#[derive(Debug)]
pub struct Gate {
    /// Where to connect instead of the target.
    pub addr: SocketAddr,
    open: Arc<AtomicBool>,
    /// Bumped on close: every proxied connection drops when it changes.
    cut: watch::Sender<u64>,
    task: JoinHandle<()>,
}

impl Gate {
    /// A gate on a free loopback port, forwarding to `target`.
    pub async fn start(target: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let open = Arc::new(AtomicBool::new(true));
        let (cut, _) = watch::channel(0u64);
        let task = tokio::spawn({
            let (open, cut) = (open.clone(), cut.clone());
            async move {
                while let Ok((inside, _)) = listener.accept().await {
                    if !open.load(Ordering::SeqCst) {
                        drop(inside);
                        continue;
                    }
                    let mut cut = cut.subscribe();
                    tokio::spawn(async move {
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
            open,
            cut,
            task,
        })
    }

    /// Refuses new connections and cuts the open ones.
    pub fn close(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.cut.send_modify(|n| *n += 1);
    }

    /// Lets connections through again.
    pub fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.task.abort();
        self.cut.send_modify(|n| *n += 1);
    }
}
