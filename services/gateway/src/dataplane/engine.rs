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
//!   peer's [`Tunn`] gets its own 24-bit index, and boringtun puts it in the upper 24 bits of
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
//! one size for one destination to the kernel as a single UDP GSO send ([`GsoBatch`]). Where
//! the kernel lacks GRO, GSO or `recvmmsg`, `quinn-udp` falls back to one datagram per call.
//! [`Io::PerDatagram`] keeps the first engine's one-syscall-per-datagram path, so the two can
//! be measured side by side (`engine-pair`).

use std::collections::HashMap;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsFd as _, AsRawFd as _};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use defguard_boringtun::device::tun::TunSocket;
use defguard_boringtun::noise::errors::WireGuardError;
use defguard_boringtun::noise::handshake::parse_handshake_anon;
use defguard_boringtun::noise::rate_limiter::RateLimiter;
use defguard_boringtun::noise::{Packet, Tunn, TunnResult};
use defguard_boringtun::x25519::{PublicKey, StaticSecret};
use ipnet::IpNet;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use quinn_udp::{RecvMeta, Transmit, UdpSocketState};

/// Buffers hold the largest UDP payload, so no datagram or TUN read is ever truncated.
const BUF: usize = 1 << 16;

/// The TUN thread's wake-up token (peer indices are 24-bit, so never this).
const WAKER: Token = Token(usize::MAX);

/// Handshake messages per second (all peers together) before cookies are demanded, as
/// boringtun's own device sets it.
const HANDSHAKE_RATE_LIMIT: u64 = 100;

/// Handshake messages waiting for the handshake thread; more are dropped (kernel WireGuard
/// queues 4096 per device; ours serves one gateway's peers, a few hundred at most).
const HANDSHAKE_QUEUE: usize = 1024;

/// Under load, handshake messages per second one source address may send, and its burst: kernel
/// WireGuard's `ratelimiter.c` values (20 packets/s, burst 5).
const SOURCE_RATE: f64 = 20.0;
const SOURCE_BURST: f64 = 5.0;

/// Sources tracked at once under load; a new source beyond that is refused until old ones
/// expire (the table of a spoofing flood must not grow without bound).
const MAX_SOURCES: usize = 16_384;

/// How often the WireGuard timers run. boringtun's timers have one-second granularity; four
/// passes a second keep handshake retries close to their 5 s schedule.
const TICK: Duration = Duration::from_millis(250);

/// How long the receiving thread blocks before checking whether the engine stops.
const RECV_TIMEOUT: Duration = Duration::from_millis(200);

/// Peer indices are 24 bits: boringtun keeps the low 8 bits of a session index for itself.
const INDEX_MASK: u32 = 0x00ff_ffff;

/// What WireGuard adds to a data packet: type, receiver index, counter, AEAD tag.
const DATA_OVERHEAD: usize = 32;

/// The largest datagram `encapsulate` can write for a short packet: a handshake initiation
/// (when the session is not up yet, the packet is queued and an initiation goes out instead).
const HANDSHAKE_INIT_LEN: usize = 148;

/// The most UDP payload one GSO send carries. The kernel refuses more than 64 KiB of payload
/// in one send (and more than 64 segments on older kernels, which `quinn-udp` reports).
const GSO_BYTES: usize = 65_000;

/// The batched socket's receive and send buffers (see [`Engine::start_with`]).
const SOCKET_BUFFER: usize = 4 << 20;

/// How long a sender waits for room in the socket's send buffer before it drops the datagram.
const SEND_WAIT: Duration = Duration::from_millis(100);

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

/// Why a datagram at the WireGuard port was dropped (the `reason` label of
/// `trellis_gateway_dropped_datagrams_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Not a WireGuard message: wrong type, wrong length.
    Malformed,
    /// A handshake message whose MAC1 does not match our public key (or MAC2 under load).
    Mac,
    /// Authentic as far as it can be checked, but for no peer we have: an unknown receiver
    /// index, or a handshake initiation from a static key we have no peer for.
    UnknownPeer,
    /// A counter (data) or timestamp (handshake) already seen.
    Replay,
    /// Authentication failed: a bad AEAD tag, a handshake that does not decrypt.
    Decrypt,
    /// Decrypted, but the inner source is outside the peer's AllowedIPs.
    SourceNotAllowed,
    /// A handshake message refused under load: its source sent more than its share, or the
    /// handshake queue was full.
    RateLimited,
    /// Decrypted, but the TUN interface would not take it (its queue full).
    TunWrite,
    /// Any other refusal by the protocol (no session for the index, unexpected message).
    Other,
    /// Received while this replica is a standby: only the active replica answers for the
    /// cluster's key (a remote still pointing here after a failover, or a probe).
    Standby,
}

impl DropReason {
    /// Every reason, in label order.
    pub const ALL: [DropReason; 10] = [
        Self::Malformed,
        Self::Mac,
        Self::UnknownPeer,
        Self::Replay,
        Self::Decrypt,
        Self::SourceNotAllowed,
        Self::RateLimited,
        Self::TunWrite,
        Self::Other,
        Self::Standby,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::Mac => "mac",
            Self::UnknownPeer => "unknown_peer",
            Self::Replay => "replay",
            Self::Decrypt => "decrypt",
            Self::SourceNotAllowed => "source_not_allowed",
            Self::RateLimited => "rate_limited",
            Self::TunWrite => "tun_write",
            Self::Other => "other",
            Self::Standby => "standby",
        }
    }

    fn of(err: &WireGuardError) -> Self {
        match err {
            WireGuardError::InvalidMac => Self::Mac,
            WireGuardError::DuplicateCounter
            | WireGuardError::InvalidCounter
            | WireGuardError::WrongTai64nTimestamp => Self::Replay,
            WireGuardError::InvalidAeadTag => Self::Decrypt,
            WireGuardError::InvalidPacket | WireGuardError::IncorrectPacketLength => {
                Self::Malformed
            }
            WireGuardError::WrongIndex => Self::UnknownPeer,
            _ => Self::Other,
        }
    }
}

/// What one peer is configured with (nothing secret: our private key is the engine's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    pub public_key: [u8; 32],
    pub endpoint: SocketAddr,
    pub allowed_ips: Vec<IpNet>,
    /// Persistent keepalive in seconds, 0 for none.
    pub keepalive: u16,
}

/// A peer's counters.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub last_handshake: Option<SystemTime>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub endpoint: Option<SocketAddr>,
}

struct Peer {
    index: u32,
    name: String,
    public_key: [u8; 32],
    tun: TunSocket,
    tunn: Mutex<Tunn>,
    /// Where the peer is now: the configured endpoint until an authenticated message came from
    /// elsewhere (roaming).
    endpoint: RwLock<SocketAddr>,
    /// The endpoint last configured: a reconfiguration with the same one keeps a roamed
    /// endpoint (a remote gateway that failed over to its standby is where its handshake came
    /// from, not where its NetworkConfig said).
    configured: Mutex<SocketAddr>,
    allowed_ips: RwLock<Vec<IpNet>>,
    keepalive: Mutex<u16>,
}

impl Peer {
    fn tunn(&self) -> MutexGuard<'_, Tunn> {
        // A panic while holding the lock cannot leave the session half-updated in a way we
        // could repair; keep going with what it holds.
        self.tunn.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn endpoint(&self) -> SocketAddr {
        *self.endpoint.read().unwrap_or_else(|e| e.into_inner())
    }

    fn allows(&self, source: IpAddr) -> bool {
        self.allowed_ips
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|net| net.contains(&source))
    }
}

#[derive(Default)]
struct Peers {
    by_index: HashMap<u32, Arc<Peer>>,
    by_key: HashMap<[u8; 32], u32>,
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
    registry: mio::Registry,
    waker: Waker,
    stop: AtomicBool,
    /// A standby replica's engine: every peer ready, nothing sent, everything received dropped
    /// ([`Engine::set_standby`]).
    standby: AtomicBool,
    next_index: AtomicU32,
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
    /// Binds UDP `port` (0: any free port) and starts the threads, with batched I/O.
    pub fn start(port: u16, private_key: [u8; 32]) -> io::Result<Self> {
        Self::start_with(port, private_key, Io::Batched)
    }

    /// [`Engine::start`] with the socket path `io`.
    pub fn start_with(port: u16, private_key: [u8; 32], io: Io) -> io::Result<Self> {
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
            registry,
            waker,
            stop: AtomicBool::new(false),
            standby: AtomicBool::new(false),
            next_index: AtomicU32::new(seed),
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

    /// Datagrams dropped so far, by reason.
    pub fn dropped(&self) -> Vec<(DropReason, u64)> {
        DropReason::ALL
            .iter()
            .zip(&self.shared.dropped)
            .map(|(r, n)| (*r, n.load(Ordering::Relaxed)))
            .collect()
    }

    /// Creates the TUN interface `name` and the peer behind it; returns the peer's index.
    /// Sends a handshake initiation at once: a restarted gateway must not wait for the peer's
    /// rekey timers (15 s) before its tunnels carry traffic again.
    pub fn add_peer(&self, name: &str, config: &PeerConfig) -> io::Result<u32> {
        let shared = &self.shared;
        let tun = TunSocket::new(name)
            .and_then(TunSocket::set_non_blocking)
            .map_err(|e| io_err(format!("creating tun interface {name}: {e:?}")))?;
        let fd = tun.as_raw_fd();
        let peer = {
            let mut peers = shared.write_peers();
            if let Some(other) = peers.by_key.get(&config.public_key) {
                let other = peers.by_index.get(other).map(|p| p.name.clone());
                return Err(io_err(format!(
                    "the public key of {name} is already the key of {}",
                    other.unwrap_or_default()
                )));
            }
            let index = loop {
                let candidate = shared.next_index.fetch_add(1, Ordering::Relaxed) & INDEX_MASK;
                if !peers.by_index.contains_key(&candidate) {
                    break candidate;
                }
            };
            let peer = Arc::new(Peer {
                index,
                name: name.to_owned(),
                public_key: config.public_key,
                tun,
                tunn: Mutex::new(shared.tunn(config, index)),
                endpoint: RwLock::new(config.endpoint),
                configured: Mutex::new(config.endpoint),
                allowed_ips: RwLock::new(config.allowed_ips.clone()),
                keepalive: Mutex::new(config.keepalive),
            });
            peers.by_index.insert(index, peer.clone());
            peers.by_key.insert(config.public_key, index);
            peer
        };
        // Registered after the peer is findable by index, so no readiness event finds nobody.
        if let Err(err) = shared.registry.register(
            &mut SourceFd(&fd),
            Token(peer.index as usize),
            Interest::READABLE,
        ) {
            self.remove_peer(peer.index);
            return Err(err);
        }
        if !shared.standby.load(Ordering::Relaxed) {
            shared.initiate(&peer);
        }
        Ok(peer.index)
    }

    /// Applies `config` to the peer `index`: endpoint and AllowedIPs change in place (the
    /// session survives), a new keepalive starts a new session. A new public key is refused:
    /// the key is the peer's identity in the demultiplexer, so such a peer is replaced.
    pub fn update_peer(&self, index: u32, config: &PeerConfig) -> io::Result<()> {
        let shared = &self.shared;
        let Some(peer) = shared.peer(index) else {
            return Err(io_err(format!("no peer with index {index}")));
        };
        if peer.public_key != config.public_key {
            return Err(io_err(format!(
                "the peer behind {} changed its public key",
                peer.name
            )));
        }
        let mut configured = peer.configured.lock().unwrap_or_else(|e| e.into_inner());
        if *configured != config.endpoint {
            *configured = config.endpoint;
            *peer.endpoint.write().unwrap_or_else(|e| e.into_inner()) = config.endpoint;
        }
        drop(configured);
        *peer.allowed_ips.write().unwrap_or_else(|e| e.into_inner()) = config.allowed_ips.clone();
        let mut keepalive = peer.keepalive.lock().unwrap_or_else(|e| e.into_inner());
        if *keepalive != config.keepalive {
            *keepalive = config.keepalive;
            *peer.tunn() = shared.tunn(config, index);
            drop(keepalive);
            if !shared.standby.load(Ordering::Relaxed) {
                shared.initiate(&peer);
            }
        }
        Ok(())
    }

    /// Whether the engine is a standby's.
    pub fn is_standby(&self) -> bool {
        self.shared.standby.load(Ordering::Relaxed)
    }

    /// Makes the engine a standby's (`true`: it sends nothing, not even keepalives, and drops
    /// every datagram, counted as [`DropReason::Standby`]) or the active's. Becoming active
    /// starts a fresh session with every peer and sends each an initiation at once: its
    /// timestamp is this moment's, newer than any the previous active sent, so every remote
    /// accepts it and, the message being authenticated, moves its endpoint for us here
    /// (roaming): no control-plane message is needed.
    pub fn set_standby(&self, standby: bool) {
        let shared = &self.shared;
        if shared.standby.swap(standby, Ordering::SeqCst) == standby || standby {
            return;
        }
        let peers = shared.all_peers();
        for peer in &peers {
            let keepalive = *peer.keepalive.lock().unwrap_or_else(|e| e.into_inner());
            let config = PeerConfig {
                public_key: peer.public_key,
                endpoint: peer.endpoint(),
                allowed_ips: Vec::new(),
                keepalive,
            };
            *peer.tunn() = shared.tunn(&config, peer.index);
            // Where the previous active last heard the peer may be out of date (the peer's
            // cluster failed over too): its published endpoint gets the same initiation.
            let configured = *peer.configured.lock().unwrap_or_else(|e| e.into_inner());
            let also = (configured != peer.endpoint()).then_some(configured);
            shared.initiate_to(peer, also);
        }
    }

    /// Sends every peer a new handshake initiation now, keeping the current sessions until the
    /// new ones complete: an active that hears a deposed active come back (its links restored)
    /// re-points the peers the deposed one may have drawn to itself with its last packets.
    pub fn reassert(&self) {
        if self.shared.standby.load(Ordering::Relaxed) {
            return;
        }
        let peers = self.shared.all_peers();
        let mut buf = [0u8; 256];
        for peer in peers {
            let result = peer.tunn().format_handshake_initiation(&mut buf, true);
            if let TunnResult::WriteToNetwork(packet) = result {
                self.shared.send(packet, peer.endpoint());
            }
        }
    }

    /// Every peer whose endpoint moved away from its configured one (roaming), by public key:
    /// what the active tells its standbys, so that a takeover reaches peers where they are.
    pub fn roamed(&self) -> Vec<([u8; 32], SocketAddr)> {
        let peers = self.shared.peers.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<([u8; 32], SocketAddr)> = peers
            .by_index
            .values()
            .filter(|p| *p.configured.lock().unwrap_or_else(|e| e.into_inner()) != p.endpoint())
            .map(|p| (p.public_key, p.endpoint()))
            .collect();
        out.sort();
        out
    }

    /// Points every peer at the endpoint the active last heard it from (`roamed`, by public
    /// key), and every other peer back at its configured endpoint. For a standby: its
    /// takeover then starts where the peers are.
    pub fn follow_roamed(&self, roamed: &[([u8; 32], SocketAddr)]) {
        let peers = self.shared.peers.read().unwrap_or_else(|e| e.into_inner());
        for peer in peers.by_index.values() {
            let configured = *peer.configured.lock().unwrap_or_else(|e| e.into_inner());
            let to = roamed
                .iter()
                .find(|(key, _)| *key == peer.public_key)
                .map_or(configured, |(_, at)| *at);
            if peer.endpoint() != to {
                *peer.endpoint.write().unwrap_or_else(|e| e.into_inner()) = to;
            }
        }
    }

    /// Removes the peer `index`; its TUN interface disappears once no thread holds it.
    pub fn remove_peer(&self, index: u32) {
        let removed = {
            let mut peers = self.shared.write_peers();
            let removed = peers.by_index.remove(&index);
            if let Some(peer) = &removed {
                peers.by_key.remove(&peer.public_key);
            }
            removed
        };
        if let Some(peer) = removed {
            let fd = peer.tun.as_raw_fd();
            let _ = self.shared.registry.deregister(&mut SourceFd(&fd));
        }
    }

    /// The counters of the peer `index`.
    pub fn counters(&self, index: u32) -> Option<Counters> {
        let peer = self.shared.peer(index)?;
        let (since, tx, rx, _, _) = peer.tunn().stats();
        Some(Counters {
            last_handshake: since.and_then(|d| SystemTime::now().checked_sub(d)),
            rx_bytes: rx as u64,
            tx_bytes: tx as u64,
            endpoint: Some(peer.endpoint()),
        })
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

impl Shared {
    fn write_peers(&self) -> std::sync::RwLockWriteGuard<'_, Peers> {
        self.peers.write().unwrap_or_else(|e| e.into_inner())
    }

    fn peer(&self, index: u32) -> Option<Arc<Peer>> {
        self.peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_index
            .get(&index)
            .cloned()
    }

    /// Every peer, taken out of the lock (a pass over all of them must not hold it).
    fn all_peers(&self) -> Vec<Arc<Peer>> {
        self.peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .by_index
            .values()
            .cloned()
            .collect()
    }

    fn peer_by_key(&self, key: &[u8; 32]) -> Option<Arc<Peer>> {
        let peers = self.peers.read().unwrap_or_else(|e| e.into_inner());
        let index = peers.by_key.get(key)?;
        peers.by_index.get(index).cloned()
    }

    fn tunn(&self, config: &PeerConfig, index: u32) -> Tunn {
        Tunn::new(
            self.secret.clone(),
            PublicKey::from(config.public_key),
            None,
            (config.keepalive > 0).then_some(config.keepalive),
            index,
            Some(self.mac1_only.clone()),
        )
    }

    fn count(&self, reason: DropReason) {
        if let Some(n) = DropReason::ALL
            .iter()
            .position(|r| *r == reason)
            .and_then(|i| self.dropped.get(i))
        {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `to` as the socket addresses it (IPv4 peers as mapped IPv6 on a dual-stack socket).
    fn socket_addr(&self, to: SocketAddr) -> SocketAddr {
        match (self.dual_stack, to) {
            (true, SocketAddr::V4(v4)) => {
                SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
            }
            _ => to,
        }
    }

    fn send(&self, datagram: &[u8], to: SocketAddr) {
        self.send_segments(datagram, datagram.len(), to);
    }

    /// Sends `contents`, consecutive datagrams of `segment` bytes (the last may be shorter),
    /// to `to`: one UDP GSO send on the batched socket, one send per datagram otherwise.
    fn send_segments(&self, contents: &[u8], segment: usize, to: SocketAddr) {
        let to = self.socket_addr(to);
        let Some(state) = &self.batched else {
            for datagram in contents.chunks(segment.max(1)) {
                if let Err(err) = self.socket.send_to(datagram, to) {
                    tracing::trace!(%to, error = %err, "sending a wireguard datagram failed");
                }
            }
            return;
        };
        let transmit = |contents: &[u8], segment: Option<usize>| {
            let transmit = Transmit {
                destination: to,
                ecn: None,
                contents,
                segment_size: segment,
                src_ip: None,
            };
            // The socket is non-blocking (recvmmsg must not wait for a full batch); a full
            // send buffer waits here, as a blocking send would, so TCP inside the tunnel sees
            // back-pressure rather than loss.
            let deadline = Instant::now() + SEND_WAIT;
            loop {
                match state.try_send((&self.socket).into(), &transmit) {
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            return Err(err);
                        }
                        let mut fds = [PollFd::new(self.socket.as_fd(), PollFlags::POLLOUT)];
                        let _ = nix::poll::poll(&mut fds, PollTimeout::from(10u8));
                    }
                    other => return other,
                }
            }
        };
        let segment_size = (contents.len() > segment).then_some(segment);
        match transmit(contents, segment_size) {
            Ok(()) => {}
            // A device without segmentation offload refuses GSO sends (quinn-udp then turns GSO
            // off for good): send this batch one datagram at a time.
            Err(err) if segment_size.is_some() && state.max_gso_segments() <= 1 => {
                tracing::debug!(error = %err, "udp segmentation offload refused; sending datagrams singly");
                for datagram in contents.chunks(segment) {
                    if let Err(err) = transmit(datagram, None) {
                        tracing::trace!(%to, error = %err, "sending a wireguard datagram failed");
                    }
                }
            }
            Err(err) => {
                tracing::trace!(%to, error = %err, "sending wireguard datagrams failed");
            }
        }
    }

    /// The most datagrams one GSO send may carry.
    fn gso_segments(&self) -> usize {
        self.batched
            .as_ref()
            .map_or(1, UdpSocketState::max_gso_segments)
            .max(1)
    }

    /// Starts a handshake with `peer` now.
    fn initiate(&self, peer: &Peer) {
        self.initiate_to(peer, None);
    }

    /// Starts a handshake with `peer` now, sent to its endpoint and to `also`.
    fn initiate_to(&self, peer: &Peer, also: Option<SocketAddr>) {
        let mut buf = [0u8; 256];
        let result = peer.tunn().format_handshake_initiation(&mut buf, false);
        if let TunnResult::WriteToNetwork(packet) = result {
            self.send(packet, peer.endpoint());
            if let Some(to) = also {
                self.send(packet, to);
            }
        }
    }

    /// One datagram from the socket. Handshake initiations and responses go to the handshake
    /// thread (dropped when its queue is full); data and cookie replies are handled here.
    fn receive(&self, from: SocketAddr, datagram: &[u8], dst: &mut [u8]) {
        if self.standby.load(Ordering::Relaxed) {
            return self.count(DropReason::Standby);
        }
        if matches!(datagram.first(), Some(1 | 2)) {
            if self
                .handshake_queue
                .try_send((from, datagram.to_vec()))
                .is_err()
            {
                self.count(DropReason::RateLimited);
            }
            return;
        }
        self.handle(from, datagram, dst);
    }

    /// One datagram: check it, find its peer, let the peer's session handle it.
    fn handle(&self, from: SocketAddr, datagram: &[u8], dst: &mut [u8]) {
        let handshake = matches!(datagram.first(), Some(1 | 2));
        let load = if handshake {
            self.handshakes.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            0
        };
        let packet = match self.limiter.verify_packet(Some(from.ip()), datagram, dst) {
            Ok(packet) => packet,
            Err(TunnResult::WriteToNetwork(cookie)) => {
                self.send(cookie, from);
                return;
            }
            Err(TunnResult::Err(err)) => return self.count(DropReason::of(&err)),
            Err(_) => return self.count(DropReason::Other),
        };
        // Under load, a source with a valid cookie still gets only its share of our
        // Diffie-Hellman work.
        if load > HANDSHAKE_RATE_LIMIT
            && !self
                .sources
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .allow(from.ip(), Instant::now())
        {
            return self.count(DropReason::RateLimited);
        }
        let cookie_reply = matches!(packet, Packet::PacketCookieReply(_));
        let peer = match &packet {
            Packet::HandshakeInit(init) => {
                match parse_handshake_anon(&self.secret, &self.public, init) {
                    Ok(half) => self.peer_by_key(&half.peer_static_public),
                    Err(_) => return self.count(DropReason::Decrypt),
                }
            }
            Packet::HandshakeResponse(p) => self.peer(p.receiver_idx >> 8),
            Packet::PacketCookieReply(p) => self.peer(p.receiver_idx >> 8),
            Packet::PacketData(p) => self.peer(p.receiver_idx >> 8),
        };
        let Some(peer) = peer else {
            return self.count(DropReason::UnknownPeer);
        };
        let mut tunn = peer.tunn();
        let result = tunn.decapsulate(Some(from.ip()), datagram, dst);
        // Only an authenticated message moves the peer's endpoint (WireGuard's roaming): data, a
        // keepalive, a handshake this session completed. A cookie reply authenticates nobody,
        // and neither does anything answered with one.
        let authenticated = !cookie_reply
            && match &result {
                TunnResult::Err(_) => false,
                TunnResult::WriteToNetwork(reply) => reply.first() != Some(&3),
                _ => true,
            };
        match result {
            TunnResult::Done => {}
            TunnResult::Err(err) => {
                drop(tunn);
                return self.count(DropReason::of(&err));
            }
            TunnResult::WriteToNetwork(reply) => {
                self.send(reply, from);
                // Packets queued while the session was being established go out now.
                let mut queued = [0u8; BUF];
                while let TunnResult::WriteToNetwork(packet) =
                    tunn.decapsulate(None, &[], &mut queued)
                {
                    self.send(packet, from);
                }
            }
            TunnResult::WriteToTunnelV4(inner, source) => {
                drop(tunn);
                if !peer.allows(IpAddr::V4(source)) {
                    return self.count(DropReason::SourceNotAllowed);
                }
                if peer.tun.write4(inner) == 0 {
                    self.count(DropReason::TunWrite);
                }
            }
            TunnResult::WriteToTunnelV6(inner, source) => {
                drop(tunn);
                if !peer.allows(IpAddr::V6(source)) {
                    return self.count(DropReason::SourceNotAllowed);
                }
                if peer.tun.write6(inner) == 0 {
                    self.count(DropReason::TunWrite);
                }
            }
        }
        // The peer is where this came from. A read lock first: this runs for every datagram,
        // and the endpoint almost never changes.
        if authenticated && peer.endpoint() != from {
            *peer.endpoint.write().unwrap_or_else(|e| e.into_inner()) = from;
        }
    }

    /// Everything a TUN has to read, encrypted into `batch` and sent to the peer in GSO
    /// batches.
    fn drain_batched(&self, peer: &Peer, src: &mut [u8], batch: &mut GsoBatch) {
        let to = peer.endpoint();
        let max_segments = self.gso_segments();
        let mut send = |to: SocketAddr, contents: &[u8], segment: usize| {
            self.send_segments(contents, segment, to)
        };
        // Edge-triggered: read until the TUN says it is empty.
        while let Ok(packet) = peer.tun.read(src) {
            let room = (packet.len() + DATA_OVERHEAD).max(HANDSHAKE_INIT_LEN);
            let slot = batch.slot(to, room, max_segments, &mut send);
            let result = peer.tunn().encapsulate(packet, slot);
            match result {
                TunnResult::WriteToNetwork(datagram) => {
                    let len = datagram.len();
                    batch.commit(len, &mut send);
                }
                TunnResult::Err(err) => {
                    tracing::trace!(interface = %peer.name, error = ?err, "could not encapsulate")
                }
                _ => {}
            }
        }
        batch.flush(&mut send);
    }

    /// Everything a TUN has to read: encrypt each packet and send it to the peer.
    fn drain(&self, peer: &Peer, src: &mut [u8], dst: &mut [u8]) {
        // Edge-triggered: read until the TUN says it is empty.
        while let Ok(packet) = peer.tun.read(src) {
            let result = peer.tunn().encapsulate(packet, dst);
            match result {
                TunnResult::WriteToNetwork(datagram) => self.send(datagram, peer.endpoint()),
                TunnResult::Err(err) => {
                    tracing::trace!(interface = %peer.name, error = ?err, "could not encapsulate")
                }
                _ => {}
            }
        }
    }
}

/// Canonical form of a datagram's source: IPv4 peers reach a dual-stack socket as mapped
/// IPv6 addresses.
fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => addr,
        },
        v4 => v4,
    }
}

fn udp_loop(shared: &Shared) {
    let mut src = vec![0u8; BUF];
    let mut dst = vec![0u8; BUF];
    while !shared.stop.load(Ordering::Relaxed) {
        match shared.socket.recv_from(&mut src) {
            Ok((n, from)) => {
                let datagram = src.get(..n).unwrap_or_default();
                shared.receive(canonical(from), datagram, &mut dst);
            }
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(err) => {
                // ICMP errors for earlier sends surface here (ECONNREFUSED); nothing to do.
                tracing::trace!(error = %err, "receiving from the wireguard socket");
            }
        }
    }
}

/// Datagrams of the batched socket: each of the `quinn_udp::BATCH_SIZE` buffers may hold up
/// to 64 KiB of datagrams coalesced by GRO, `stride` bytes apart.
fn udp_loop_batched(shared: &Shared, state: &UdpSocketState) {
    let slots = quinn_udp::BATCH_SIZE;
    let mut bufs: Vec<Vec<u8>> = (0..slots).map(|_| vec![0u8; BUF]).collect();
    let mut slices: Vec<IoSliceMut<'_>> = bufs.iter_mut().map(|b| IoSliceMut::new(b)).collect();
    let mut meta = vec![RecvMeta::default(); slots];
    let mut dst = vec![0u8; BUF];
    let timeout = PollTimeout::try_from(RECV_TIMEOUT).unwrap_or(PollTimeout::NONE);
    while !shared.stop.load(Ordering::Relaxed) {
        match state.recv((&shared.socket).into(), &mut slices, &mut meta) {
            Ok(n) => {
                for (meta, buf) in meta.iter().zip(&slices).take(n) {
                    let from = canonical(meta.addr);
                    let stride = if meta.stride == 0 {
                        meta.len
                    } else {
                        meta.stride
                    };
                    let data = buf.get(..meta.len).unwrap_or_default();
                    for datagram in data.chunks(stride.max(1)) {
                        shared.receive(from, datagram, &mut dst);
                    }
                }
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                let mut fds = [PollFd::new(shared.socket.as_fd(), PollFlags::POLLIN)];
                let _ = nix::poll::poll(&mut fds, timeout);
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => {
                // ICMP errors for earlier sends surface here (ECONNREFUSED); nothing to do.
                tracing::trace!(error = %err, "receiving from the wireguard socket");
            }
        }
    }
}

/// Encrypted datagrams waiting to leave in one UDP GSO send: consecutive datagrams for one
/// destination, all of one size but the last, which may be shorter (the kernel's rule). The
/// engine encrypts straight into [`GsoBatch::slot`], so a batch costs no copy.
pub(crate) struct GsoBatch {
    buf: Vec<u8>,
    /// Bytes of complete datagrams.
    len: usize,
    /// The size of every datagram but the last.
    segment: usize,
    count: usize,
    to: Option<SocketAddr>,
    /// A shorter datagram ended the batch: nothing may follow it.
    closed: bool,
}

impl GsoBatch {
    pub(crate) fn new() -> Self {
        Self {
            buf: vec![0u8; GSO_BYTES + BUF + HANDSHAKE_INIT_LEN + DATA_OVERHEAD],
            len: 0,
            segment: 0,
            count: 0,
            to: None,
            closed: false,
        }
    }

    /// Room for at most `room` bytes for `to`, after the batch so far, which is sent first
    /// if the new datagram cannot join it (another destination, no room, no segment left).
    pub(crate) fn slot(
        &mut self,
        to: SocketAddr,
        room: usize,
        max_segments: usize,
        send: &mut impl FnMut(SocketAddr, &[u8], usize),
    ) -> &mut [u8] {
        if self.count > 0
            && (self.to != Some(to)
                || self.closed
                || self.count >= max_segments
                || self.len + room > GSO_BYTES)
        {
            self.flush(send);
        }
        self.to = Some(to);
        let end = (self.len + room).min(self.buf.len());
        self.buf.get_mut(self.len..end).unwrap_or_default()
    }

    /// The last slot now holds a `len`-byte datagram.
    pub(crate) fn commit(&mut self, len: usize, send: &mut impl FnMut(SocketAddr, &[u8], usize)) {
        if self.count == 0 {
            self.segment = len;
        } else if len > self.segment || self.closed {
            // It cannot join (only the last datagram may differ, and only by being shorter):
            // send the batch without it, then start the next batch with it.
            let (Some(to), start) = (self.to, self.len) else {
                return;
            };
            if let Some(batch) = self.buf.get(..start) {
                send(to, batch, self.segment);
            }
            self.buf.copy_within(start..start + len, 0);
            self.len = 0;
            self.count = 0;
            self.closed = false;
            self.segment = len;
        } else if len < self.segment {
            self.closed = true;
        }
        self.len += len;
        self.count += 1;
    }

    /// Sends what the batch holds.
    pub(crate) fn flush(&mut self, send: &mut impl FnMut(SocketAddr, &[u8], usize)) {
        if let (Some(to), true) = (self.to, self.count > 0)
            && let Some(batch) = self.buf.get(..self.len)
        {
            send(to, batch, self.segment);
        }
        self.len = 0;
        self.count = 0;
        self.closed = false;
    }
}

fn tun_loop(shared: &Shared, mut poll: Poll) {
    let mut events = Events::with_capacity(256);
    let mut src = vec![0u8; BUF];
    let mut dst = vec![0u8; BUF];
    let mut batch = GsoBatch::new();
    while !shared.stop.load(Ordering::Relaxed) {
        if let Err(err) = poll.poll(&mut events, None) {
            if err.kind() != io::ErrorKind::Interrupted {
                tracing::warn!(error = %err, "waiting for the tun interfaces failed");
                std::thread::sleep(TICK);
            }
            continue;
        }
        for event in &events {
            if event.token() == WAKER {
                continue;
            }
            let Ok(index) = u32::try_from(event.token().0) else {
                continue;
            };
            if let Some(peer) = shared.peer(index) {
                if shared.standby.load(Ordering::Relaxed) {
                    // Nothing leaves a standby: what the kernel routed into the TUN is dropped.
                    while peer.tun.read(&mut src).is_ok() {}
                } else if shared.batched.is_some() {
                    shared.drain_batched(&peer, &mut src, &mut batch);
                } else {
                    shared.drain(&peer, &mut src, &mut dst);
                }
            }
        }
    }
}

/// Handshake messages, one at a time, off the thread that carries every peer's data.
fn handshake_loop(shared: &Shared, queue: &std::sync::mpsc::Receiver<(SocketAddr, Vec<u8>)>) {
    let mut dst = vec![0u8; BUF];
    while !shared.stop.load(Ordering::Relaxed) {
        match queue.recv_timeout(RECV_TIMEOUT) {
            Ok((from, datagram)) => shared.handle(from, &datagram, &mut dst),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// A token bucket per source address (IPv6 by /64, as kernel WireGuard groups them), consulted
/// only under load.
#[derive(Default)]
struct SourceBuckets {
    buckets: HashMap<IpAddr, (f64, Instant)>,
    swept: Option<Instant>,
}

impl SourceBuckets {
    fn allow(&mut self, source: IpAddr, now: Instant) -> bool {
        let source = match source {
            IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                IpAddr::V6(Ipv6Addr::from(bits))
            }
            IpAddr::V6(v6) => IpAddr::V4(v6.to_ipv4_mapped().unwrap_or(Ipv4Addr::UNSPECIFIED)),
            v4 => v4,
        };
        // A bucket refills in a quarter of a second; one untouched for a second is full and
        // need not be kept.
        if self
            .swept
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1))
        {
            self.buckets
                .retain(|_, (_, at)| now.duration_since(*at) < Duration::from_secs(1));
            self.swept = Some(now);
        }
        if !self.buckets.contains_key(&source) && self.buckets.len() >= MAX_SOURCES {
            return false;
        }
        let (tokens, at) = self.buckets.entry(source).or_insert((SOURCE_BURST, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * SOURCE_RATE).min(SOURCE_BURST);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

fn timer_loop(shared: &Shared) {
    let mut dst = vec![0u8; BUF];
    let mut last_reset = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(TICK);
        #[cfg(test)]
        assert!(
            !shared.crash_timers.load(Ordering::Relaxed),
            "the timer thread crashes, as the test asked"
        );
        if last_reset.elapsed() >= Duration::from_secs(1) {
            shared.limiter.reset_count();
            shared.handshakes.store(0, Ordering::Relaxed);
            last_reset = Instant::now();
        }
        if shared.standby.load(Ordering::Relaxed) {
            continue;
        }
        let peers = shared.all_peers();
        for peer in peers {
            let result = peer.tunn().update_timers(&mut dst);
            if let TunnResult::WriteToNetwork(packet) = result {
                shared.send(packet, peer.endpoint());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_sources_are_made_ipv4() {
        let mapped: SocketAddr = "[::ffff:192.0.2.7]:51840".parse().expect("addr");
        assert_eq!(
            canonical(mapped),
            "192.0.2.7:51840".parse::<SocketAddr>().expect("addr")
        );
        let v6: SocketAddr = "[2001:db8::1]:51840".parse().expect("addr");
        assert_eq!(canonical(v6), v6);
    }

    /// Feeds `datagrams` (destination, size) through a [`GsoBatch`] the way the TUN thread
    /// does; returns the sends: (destination, contents, segment size).
    fn batched(
        datagrams: &[(SocketAddr, usize)],
        max_segments: usize,
    ) -> Vec<(SocketAddr, Vec<u8>, usize)> {
        let mut sends = Vec::new();
        let mut send = |to: SocketAddr, contents: &[u8], segment: usize| {
            sends.push((to, contents.to_vec(), segment));
        };
        let mut batch = GsoBatch::new();
        for (n, (to, len)) in datagrams.iter().enumerate() {
            let slot = batch.slot(*to, len + DATA_OVERHEAD, max_segments, &mut send);
            // Each datagram's bytes name it, so reordering or loss shows.
            let fill = (n % 251) as u8;
            slot.get_mut(..*len).expect("room").fill(fill);
            batch.commit(*len, &mut send);
        }
        batch.flush(&mut send);
        sends
    }

    #[test]
    fn gso_batches_hold_one_destination_and_one_segment_size_in_order() {
        let a: SocketAddr = "192.0.2.1:51820".parse().expect("addr");
        let b: SocketAddr = "192.0.2.2:51820".parse().expect("addr");
        let c: SocketAddr = "[2001:db8::3]:51820".parse().expect("addr");
        // Interleaved peers, runs of one size, shorter tails, a larger datagram after a run,
        // handshake-sized datagrams, and runs longer than a GSO send may carry.
        let mut input = Vec::new();
        for round in 0..40 {
            for (to, len) in [(a, 1452), (a, 1452), (b, 1452), (a, 1452), (c, 148)] {
                input.push((to, len));
            }
            input.extend(std::iter::repeat_n((b, 1452), 3 + round % 7));
            input.push((b, 600));
            input.push((b, 1452));
            input.extend(std::iter::repeat_n((c, 1000), 70));
            input.push((a, 92));
            input.push((a, 1452));
        }
        for max_segments in [1, 2, 64] {
            let sends = batched(&input, max_segments);
            let mut out = Vec::new();
            for (to, contents, segment) in &sends {
                assert!(
                    contents.len() <= GSO_BYTES,
                    "{} bytes in one send",
                    contents.len()
                );
                let datagrams: Vec<&[u8]> = contents.chunks(*segment).collect();
                assert!(datagrams.len() <= max_segments, "too many segments");
                // Every datagram but the last is `segment` long, so the kernel splits the
                // send exactly where the datagrams were.
                for d in &datagrams[..datagrams.len() - 1] {
                    assert_eq!(d.len(), *segment);
                }
                out.extend(datagrams.iter().map(|d| (*to, d.to_vec())));
            }
            assert_eq!(
                out.len(),
                input.len(),
                "datagrams sent, {max_segments} segments"
            );
            for (n, ((to, len), (sent_to, bytes))) in input.iter().zip(&out).enumerate() {
                assert_eq!(sent_to, to, "datagram {n} went to another destination");
                assert_eq!(bytes.len(), *len, "datagram {n} changed size");
                assert!(
                    bytes.iter().all(|x| *x == (n % 251) as u8),
                    "datagram {n} mixed"
                );
            }
            if max_segments == 64 {
                assert!(
                    sends.len() < input.len() / 4,
                    "runs were not batched: {}",
                    sends.len()
                );
            }
        }
    }

    /// A thread that dies while the engine runs is named (the gateway then fails, so it is
    /// restarted); one stopped by the engine's own shutdown is not.
    #[test]
    fn a_thread_that_dies_is_named_as_stopped() {
        let engine = Engine::start_with(0, [7; 32], Io::PerDatagram).expect("engine starts");
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

    #[test]
    fn errors_map_to_reasons() {
        assert_eq!(
            DropReason::of(&WireGuardError::DuplicateCounter),
            DropReason::Replay
        );
        assert_eq!(
            DropReason::of(&WireGuardError::InvalidAeadTag),
            DropReason::Decrypt
        );
        let labels: std::collections::BTreeSet<&str> =
            DropReason::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), DropReason::ALL.len());
    }
}
