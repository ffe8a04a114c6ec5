//! The userspace WireGuard engine: ONE UDP socket for every peer, ONE TUN interface per peer
//! (ADR 0022).
//!
//! Keeping an interface per peer keeps what ADR 0007/0008 built on it: a peer's real CIDRs may
//! overlap another peer's (or ours), because each peer's packets enter and leave through its
//! own interface, where its NAT, connection mark and routing table apply. What changes is
//! that the interfaces no longer own a UDP port each: this engine owns the gateway's one
//! WireGuard port and demultiplexes every datagram by the WireGuard message itself:
//!
//! - data, handshake responses and cookie replies carry the receiver index we chose; every
//!   peer's [`Tunn`](defguard_boringtun::noise::Tunn) gets its own 24-bit index, and boringtun puts it in the upper 24 bits of
//!   each session index, so `receiver_index >> 8` names the peer;
//! - a handshake initiation names nobody in clear: after its MAC1 is checked (the sender knows
//!   our public key; under load the cookie too, before any Diffie-Hellman), boringtun's
//!   `parse_handshake_anon` decrypts the initiator's static key, which names the peer.
//!
//! The cryptography is boringtun's `noise` layer; nothing here encrypts or authenticates.
//! Datagrams that fit no peer, fail to authenticate, replay a counter or carry an inner source
//! outside the peer's AllowedIPs are dropped and counted by reason ([`DropReason`]).
//!
//! Four threads do the work, so both directions use a core each: one receives from the socket
//! and writes into the TUNs, one waits on every TUN (`mio`) and sends to the socket, one runs
//! the WireGuard timers (handshake retries, keepalives, rekeys) four times a second, and one
//! handles handshake messages, which the receiving thread hands over through a bounded queue.
//! Latency is the number of wake-ups (ADR 0032): the two hot threads can keep polling for a
//! short window after their last packet before they sleep (`busy`, opt-in), the TUN thread
//! reading the socket too while it polls, and what the kernel answers while the receiving
//! thread writes into a TUN (an echo reply, an acknowledgement) is sent by that thread at
//! once; the sending buffers and the receiving ones each sit behind one lock, so whichever
//! thread drains a TUN, or receives from the socket, handles its packets in order.
//!
//! Handshakes are where an attacker who knows public keys can make us work (every member of a
//! fabric learns every gateway's key from the NetworkConfigs), so they get the defences of
//! kernel WireGuard: one cookie secret for the whole engine (its [`RateLimiter`] demands
//! cookies above [`HANDSHAKE_RATE_LIMIT`] handshakes a second; the per-peer sessions only check
//! MAC1 again, so no second secret can ping-pong a peer's cookie), a token bucket per source
//! address once under that load ([`SourceBuckets`]), their Diffie-Hellman work on a thread of
//! their own (a flood of initiations cannot slow other peers' data), and a peer's endpoint
//! that only moves on an authenticated message (data, a keepalive, a completed handshake),
//! never on one that was only answered with a cookie or refused.
//!
//! The socket is batched ([`Io::Batched`], `quinn-udp`): one `recvmmsg` returns up to 32
//! buffers, each of which may hold many datagrams of one sender coalesced by UDP GRO; the TUN
//! thread encrypts what a TUN has to read into one buffer and hands consecutive datagrams of
//! one size for one destination to the kernel as a single UDP GSO send ([`GsoBatch`](gso::GsoBatch)). Where
//! the kernel lacks GRO, GSO or `recvmmsg`, `quinn-udp` falls back to one datagram per call.
//! [`Io::PerDatagram`] keeps the first engine's one-syscall-per-datagram path, so the two can
//! be measured side by side (`engine-pair`).
//!
//! The TUN interfaces carry super-packets where the kernel offers it (ADR 0030): a read may
//! return up to 64 KiB of one TCP (or UDP) flow, which is split into its segments before they
//! are encrypted, and the packets decrypted for one peer are gathered and coalesced per flow
//! before they are written. [`Options::tun_offload`] turns this off.
//!
//! This module holds the engine and what its threads share, their construction and their
//! end; the rest is cut along the engine's seams, each hot path kept in one module with the
//! loop that drives it:
//!
//! - `peers`: the peers table (by index and by public key), adding, updating and removing
//!   a peer with its TUN interface, its counters;
//! - `standby`: what the replicas' election asks of the engine: standby or active, a new
//!   handshake with every peer, the roamed endpoints shared between replicas;
//! - `receive`: the socket's receiving thread (per datagram or batched), demultiplexing
//!   every datagram to its peer's session and into its TUN;
//! - `send`: the TUN thread, encrypting what the TUNs hold and sending it, singly or in GSO
//!   sends;
//! - [`translate`]: the stateless rewrite of a packet's addresses before it is encrypted, for a
//!   peer configured with one ([`PeerConfig::translation`]);
//! - `gso`: [`GsoBatch`](gso::GsoBatch), the datagrams of one GSO send;
//! - `tun`: a peer's TUN interface with the kernel's offloads, the reader that splits
//!   super-packets and the writer that coalesces what is written;
//! - `handshakes`: the handshake thread, the per-source buckets under load, starting a
//!   handshake, and the timer thread;
//! - `relay`: relaying the datagrams of leaves that cannot reach each other through the hub
//!   that introduced them, and choosing a peer's route (direct or through its hub);
//! - `resend`: the data datagrams lately sent directly to a peer with a relay, resent through
//!   the hub when its direct path dies, so a switch to the relay loses nothing;
//! - `busy`: how long a hot thread keeps polling after its last packet before it sleeps;
//! - `buckets`: the token buckets by key (handshake sources under load, relayed pairs);
//! - `drops`: why datagrams are dropped ([`DropReason`]) and their counters.

mod buckets;
mod busy;
mod drops;
mod gso;
mod handshakes;
mod peers;
mod receive;
mod relay;
mod resend;
mod send;
mod standby;
pub mod translate;
mod tun;

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use defguard_boringtun::noise::rate_limiter::RateLimiter;
use defguard_boringtun::x25519::{PublicKey, StaticSecret};
use mio::{Poll, Token, Waker};
use quinn_udp::UdpSocketState;

pub use self::busy::{BUSY_POLL_BUDGET_PERCENT, BUSY_POLL_US};
pub use self::drops::DropReason;
use self::handshakes::{
    HANDSHAKE_QUEUE, HANDSHAKE_RATE_LIMIT, SourceBuckets, handshake_loop, timer_loop,
};
use self::peers::Peers;
pub use self::peers::{Counters, PeerConfig};
use self::receive::{Inbound, udp_loop, udp_loop_batched};
pub use self::relay::{
    ANSWER_WITHIN, ASK_EVERY, DIRECT_STALE, RELAY_AFTER, RelayPolicy, SUSPECT_AFTER,
};
pub use self::resend::RESEND_AGE;
use self::send::{Outbound, tun_loop};

/// Buffers hold the largest UDP payload, so no datagram or TUN read is ever truncated.
const BUF: usize = 1 << 16;

/// The TUN thread's wake-up token (peer indices are 24-bit, so never this).
const WAKER: Token = Token(usize::MAX);

/// How often the WireGuard timers run. boringtun's timers have one-second granularity; four
/// passes a second keep handshake retries close to their 5 s schedule.
const TICK: Duration = Duration::from_millis(250);

/// How long the receiving thread blocks before checking whether the engine stops.
const RECV_TIMEOUT: Duration = Duration::from_millis(200);

/// The batched socket's receive and send buffers (see [`Engine::start_with`]).
const SOCKET_BUFFER: usize = 4 << 20;

/// How the engine moves packets through its socket and its TUN interfaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub io: Io,
    /// Opens the TUN interfaces with the kernel's offloads (TSO/USO super-packets, GRO writes)
    /// where the kernel takes them (ADR 0030); off, one packet per read and write.
    pub tun_offload: bool,
    /// How long the sending and receiving threads keep polling after their last packet before
    /// they sleep (`busy`); zero, the default, sleeps at once ([`BUSY_POLL_US`] is where to
    /// start when latency matters more than CPU).
    pub busy_poll: Duration,
    /// The share of the time, in percent, each of those threads may spend polling (100: no
    /// cap; [`BUSY_POLL_BUDGET_PERCENT`] by default).
    pub busy_poll_budget_percent: u8,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            io: Io::Batched,
            tun_offload: true,
            busy_poll: Duration::ZERO,
            busy_poll_budget_percent: BUSY_POLL_BUDGET_PERCENT,
        }
    }
}

/// How the engine moves datagrams through its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Io {
    /// `recvmmsg` with UDP GRO on receive, UDP GSO on send (`quinn-udp`), with its fallbacks.
    #[default]
    Batched,
    /// One `recvfrom` and one `sendto` per datagram: the engine as first built, kept so its
    /// throughput can be measured against the batched path in the same run.
    PerDatagram,
}

struct Shared {
    socket: UdpSocket,
    /// The batched socket's state (GSO/GRO support found at start); `None` for
    /// [`Io::PerDatagram`], whose socket stays blocking.
    batched: Option<UdpSocketState>,
    /// Whether the socket is IPv6 dual-stack (IPv4 peers are then addressed as mapped).
    dual_stack: bool,
    secret: StaticSecret,
    public: PublicKey,
    /// Checks MAC1 (and MAC2 under load) of handshakes before we spend a Diffie-Hellman on
    /// finding their peer: the engine's one cookie secret.
    limiter: RateLimiter,
    /// What every peer's session checks again: MAC1 only, never under load, so a session never
    /// answers with a cookie of its own (boringtun gives a session without a shared limiter a
    /// private one, with its own secret and a limit of 10 a second per peer).
    mac1_only: Arc<RateLimiter>,
    /// Handshake messages this second (reset with the limiter's count): above
    /// [`HANDSHAKE_RATE_LIMIT`], every source is held to its bucket.
    handshakes: AtomicU64,
    sources: Mutex<SourceBuckets>,
    /// Handshake messages for the handshake thread.
    handshake_queue: std::sync::mpsc::SyncSender<(SocketAddr, Vec<u8>)>,
    peers: RwLock<Peers>,
    /// The sending buffers, held by whichever thread drains a TUN ([`Outbound`]).
    outbound: Mutex<Outbound>,
    /// The batched socket's receiving buffers, held by whichever thread receives ([`Inbound`]).
    inbound: Mutex<Inbound>,
    registry: mio::Registry,
    waker: Waker,
    stop: AtomicBool,
    /// A standby replica's engine: every peer ready, nothing sent, everything received dropped
    /// ([`Engine::set_standby`]).
    standby: AtomicBool,
    next_index: AtomicU32,
    /// Our own key's tag in relay headers.
    tag: u64,
    /// What [`Shared::now_ms`] counts from.
    epoch: std::time::Instant,
    relay_policy: RwLock<RelayPolicy>,
    relay_buckets: Mutex<buckets::TokenBuckets<(u64, u64)>>,
    /// Datagrams resent through a hub after a switch to the relay ([`resend`]).
    resent: AtomicU64,
    /// Packets a receiving thread sent itself ([`Engine::answered_at_once`]).
    answered: AtomicU64,
    /// What the TUN thread received while it polled ([`Engine::received_while_polling`]).
    received_while_polling: AtomicU64,
    /// Whether new TUN interfaces are opened with offloads ([`Options::tun_offload`]).
    tun_offload: bool,
    /// The hot threads' busy-polling window ([`Options::busy_poll`]) and budget
    /// ([`Options::busy_poll_budget_percent`]).
    busy_poll: Duration,
    busy_poll_budget_percent: u8,
    /// Nanoseconds the hot threads spent polling ([`Engine::busy_polled`]).
    polled_ns: AtomicU64,
    dropped: [AtomicU64; DropReason::ALL.len()],
    /// Makes the timer thread panic: how the tests show a dead thread is noticed.
    #[cfg(test)]
    crash_timers: AtomicBool,
}

/// The running engine. Dropping it stops its threads; every TUN interface disappears with its
/// peer (or with the process).
pub struct Engine {
    shared: Arc<Shared>,
    port: u16,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

fn io_err(what: impl std::fmt::Display) -> io::Error {
    io::Error::other(what.to_string())
}

/// Binds the one WireGuard socket: dual-stack `[::]:port`, or `0.0.0.0:port` where IPv6 is
/// off.
fn bind(port: u16) -> io::Result<(UdpSocket, bool)> {
    match UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port)) {
        Ok(socket) => Ok((socket, true)),
        Err(err) if err.kind() == io::ErrorKind::AddrInUse => Err(err),
        Err(_) => Ok((UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port))?, false)),
    }
}

impl Engine {
    /// Binds UDP `port` (0: any free port) and starts the threads, with batched I/O and TUN
    /// offloads.
    pub fn start(port: u16, private_key: [u8; 32]) -> io::Result<Self> {
        Self::start_with(port, private_key, Options::default())
    }

    /// [`Engine::start`] with `options`.
    pub fn start_with(port: u16, private_key: [u8; 32], options: Options) -> io::Result<Self> {
        let Options {
            io,
            tun_offload,
            busy_poll,
            busy_poll_budget_percent,
        } = options;
        let (socket, dual_stack) =
            bind(port).map_err(|e| io_err(format!("binding the wireguard port {port}: {e}")))?;
        let batched = match io {
            // quinn-udp makes the socket non-blocking and turns on GRO (and packet info, which
            // we do not use); receiving waits in poll(2) instead of a read timeout.
            Io::Batched => Some(UdpSocketState::new((&socket).into())?),
            Io::PerDatagram => {
                socket.set_read_timeout(Some(RECV_TIMEOUT))?;
                None
            }
        };
        if let Some(state) = &batched {
            // A GSO send or a GRO buffer is 64 KiB at once: the default socket buffers
            // (~200 KiB) hold only a few, and a full receive buffer drops whole bursts.
            // wireguard-go asks for 7 MiB; the kernel caps this at net.core.[rw]mem_max.
            for (what, result) in [
                (
                    "receive",
                    state.set_recv_buffer_size((&socket).into(), SOCKET_BUFFER),
                ),
                (
                    "send",
                    state.set_send_buffer_size((&socket).into(), SOCKET_BUFFER),
                ),
            ] {
                if let Err(err) = result {
                    tracing::debug!(error = %err, "could not enlarge the wireguard socket's {what} buffer");
                }
            }
            tracing::debug!(
                gso_segments = state.max_gso_segments(),
                gro_segments = state.gro_segments(),
                "wireguard socket offloads"
            );
        }
        let port = socket.local_addr()?.port();
        let secret = StaticSecret::from(private_key);
        let public = PublicKey::from(&secret);
        let poll = Poll::new()?;
        let registry = poll.registry().try_clone()?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        // A random first index: a restarted engine's indices differ from its predecessor's, so
        // a peer's packets for an old session fail by index rather than by decryption.
        let seed = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(1);
        let (handshake_queue, queued_handshakes) = std::sync::mpsc::sync_channel(HANDSHAKE_QUEUE);
        let own_tag = relay::tag(public.as_bytes());
        let inbound = Inbound::new(batched.is_some());
        let shared = Arc::new(Shared {
            socket,
            batched,
            dual_stack,
            limiter: RateLimiter::new(&public, HANDSHAKE_RATE_LIMIT),
            mac1_only: Arc::new(RateLimiter::new(&public, u64::MAX)),
            handshakes: AtomicU64::new(0),
            sources: Mutex::new(SourceBuckets::default()),
            handshake_queue,
            secret,
            public,
            peers: RwLock::new(Peers::default()),
            outbound: Mutex::new(Outbound::new()),
            inbound: Mutex::new(inbound),
            registry,
            waker,
            stop: AtomicBool::new(false),
            standby: AtomicBool::new(false),
            next_index: AtomicU32::new(seed),
            tag: own_tag,
            epoch: std::time::Instant::now(),
            relay_policy: RwLock::new(RelayPolicy::default()),
            relay_buckets: Mutex::new(buckets::TokenBuckets::new(relay::MAX_PAIRS)),
            resent: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            received_while_polling: AtomicU64::new(0),
            tun_offload,
            busy_poll,
            busy_poll_budget_percent,
            polled_ns: AtomicU64::new(0),
            dropped: Default::default(),
            #[cfg(test)]
            crash_timers: AtomicBool::new(false),
        });
        let spawn = |name: &str, run: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name.into()).spawn(run)
        };
        let threads = vec![
            spawn("wg-udp", {
                let shared = shared.clone();
                Box::new(move || match &shared.batched {
                    Some(state) => udp_loop_batched(&shared, state),
                    None => udp_loop(&shared),
                })
            })?,
            spawn("wg-tun", {
                let shared = shared.clone();
                Box::new(move || tun_loop(&shared, poll))
            })?,
            spawn("wg-timers", {
                let shared = shared.clone();
                Box::new(move || timer_loop(&shared))
            })?,
            spawn("wg-handshake", {
                let shared = shared.clone();
                Box::new(move || handshake_loop(&shared, &queued_handshakes))
            })?,
        ];
        tracing::info!(
            port,
            dual_stack,
            ?io,
            tun_offload,
            busy_poll_us = busy_poll.as_micros(),
            busy_poll_budget_percent,
            "userspace wireguard engine listening"
        );
        Ok(Self {
            shared,
            port,
            threads,
        })
    }

    /// The UDP port every peer reaches us at.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The engine's threads that ended while it is still running: each carries one direction
    /// or the handshakes of every peer, so the engine is broken until the process restarts.
    pub fn stopped_threads(&self) -> Vec<String> {
        if self.shared.stop.load(Ordering::Relaxed) {
            return Vec::new();
        }
        self.threads
            .iter()
            .filter(|t| t.is_finished())
            .map(|t| t.thread().name().unwrap_or("unnamed").to_owned())
            .collect()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let _ = self.shared.waker.wake();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// A thread that dies while the engine runs is named (the gateway then fails, so it is
    /// restarted); one stopped by the engine's own shutdown is not.
    #[test]
    fn a_thread_that_dies_is_named_as_stopped() {
        let options = Options {
            io: Io::PerDatagram,
            ..Options::default()
        };
        let engine = Engine::start_with(0, [7; 32], options).expect("engine starts");
        assert!(engine.stopped_threads().is_empty());
        engine.shared.crash_timers.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while engine.stopped_threads().is_empty() {
            assert!(
                Instant::now() < deadline,
                "the dead timer thread was not noticed"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(engine.stopped_threads(), vec!["wg-timers".to_owned()]);
        engine.shared.stop.store(true, Ordering::Relaxed);
        assert!(
            engine.stopped_threads().is_empty(),
            "a shutdown is no failure"
        );
    }
}
