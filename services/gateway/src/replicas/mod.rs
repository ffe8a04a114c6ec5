//! Gateway replicas (ADR 0023): two or more gateways of one cluster, on different nodes, with
//! one store. One is active; the others are warm standbys, whose data plane holds every
//! tunnel, NAT map and guard but routes nothing and sends nothing.
//!
//! - Detection: every replica sends an authenticated UDP heartbeat ([`heartbeat`]) to every
//!   other each `--heartbeat-interval`; a standby that has not heard the active for
//!   `--failover-after` takes over.
//! - Fencing: taking over is a compare-and-swap on the store's `replicas/active` record with
//!   the next epoch ([`claim`]), so two replicas never hold one epoch, and a replica that
//!   cannot reach the store never takes over. An active steps down when it hears or reads a
//!   higher epoch; it never stops because the store is unreachable (a store outage alone
//!   never cuts traffic).
//! - Handoff ([`handoff`]): the active tells its standbys which translated connections the
//!   peers opened through it, so the one that takes over continues them.
//!
//! The outcome is a [`View`] that the core follows: the data plane turns active or standby,
//! and the route agents are told which node is the gateway node, under which epoch.
//!
//! This module holds the types, the metrics and the construction ([`Replicas::bind`]); the
//! rest is cut by what it does:
//!
//! - [`election`]: the rules, pure (who is active, from what was heard and read);
//! - [`heartbeat`] and [`handoff`]: the two datagrams' wire formats and checks;
//! - `run`: the election loop, what a heartbeat changes, publishing the [`View`];
//! - `store`: the store's side (members, the active record, roamed endpoints), every call
//!   bounded in time;
//! - `takeover`: renewing the active record and taking over, fenced by the store;
//! - `socket`: the heartbeat socket, receiving heartbeats and handoff parts, sending ours;
//! - `conntrack`: the handoff's two sides on this namespace's connection tracking.

pub mod election;
pub mod handoff;
pub mod heartbeat;

mod conntrack;
mod run;
mod socket;
mod store;
mod takeover;
#[cfg(test)]
mod tests;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::net::UdpSocket;
use tokio::sync::watch;
use trellis_runtime::log_limit::LogLimit;
use trellis_runtime::metrics::prometheus_client::metrics::counter::Counter;
use trellis_runtime::metrics::prometheus_client::metrics::family::Family;
use trellis_runtime::metrics::prometheus_client::metrics::gauge::Gauge;
use trellis_runtime::metrics::{Labels, Metrics};
use trellis_store::SharedStore;

use self::heartbeat::Heartbeat;
pub use self::store::{claim, members, read_active};
use crate::dataplane::engine::Engine;
use crate::records::{ActiveRecord, MemberRecord, now_nanos};

/// This replica's settings (its flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Its name among the replicas (`--replica-id`).
    pub replica: String,
    pub node_name: String,
    pub node_ip: Option<IpAddr>,
    /// Its `--endpoint-address`, as text.
    pub endpoint_host: String,
    /// The gateway's public key (base64).
    pub public_key: String,
    /// Where heartbeats are received (`--heartbeat-listen`).
    pub listen: SocketAddr,
    pub interval: Duration,
    pub failover_after: Duration,
}

/// What the election decided, for the core: whether this replica is the active, and the active
/// record it follows (its own while active).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    pub active: bool,
    pub leader: Option<ActiveRecord>,
}

impl View {
    /// The epoch of the active followed; 0 before any is known.
    pub fn epoch(&self) -> u64 {
        self.leader.as_ref().map_or(0, |l| l.epoch)
    }
}

/// What this replica last heard from another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatus {
    pub replica: String,
    pub since: Duration,
    pub active: bool,
    pub warm: bool,
    pub epoch: u64,
}

/// This replica's part in the election (GetReplicaStatus).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub replica: String,
    pub view: View,
    pub warm: bool,
    pub peers: Vec<PeerStatus>,
}

/// The election's metrics.
#[derive(Debug, Clone, Default)]
struct ReplicaMetrics {
    active: Gauge,
    epoch: Gauge,
    failovers: Counter,
    heard_age: Family<Labels, Gauge<f64, AtomicU64>>,
    warm: Family<Labels, Gauge>,
    refused: Family<Labels, Counter>,
    handed_off: Gauge,
    handoff_errors: Counter,
}

impl ReplicaMetrics {
    fn register(&self, metrics: &Metrics) {
        metrics.register(
            "trellis_gateway_active",
            "1 on the cluster's active gateway replica, 0 on a standby",
            self.active.clone(),
        );
        metrics.register(
            "trellis_gateway_epoch",
            "The epoch of the active replica this replica follows (its own while active); each \
             takeover is a new epoch",
            self.epoch.clone(),
        );
        metrics.register(
            "trellis_gateway_failovers",
            "Times this replica took over from another active replica",
            self.failovers.clone(),
        );
        metrics.register(
            "trellis_gateway_replica_heartbeat_age_seconds",
            "Seconds since the last heartbeat of each other replica: a standby silent for more \
             than the failover time cannot take over, an active silent that long is replaced",
            self.heard_age.clone(),
        );
        metrics.register(
            "trellis_gateway_replica_warm",
            "1 when that replica said in its last heartbeat that its data plane holds every \
             desired tunnel (a standby could take over at once), 0 otherwise",
            self.warm.clone(),
        );
        metrics.register(
            "trellis_gateway_heartbeats_refused",
            "Heartbeats and handoff datagrams refused, by reason: malformed, tag (not from a holder of the gateway's \
             key: another cluster's gateway, a replica with another key, a forgery), stale (a \
             replay, or a replica whose clock is more than 2 s off)",
            self.refused.clone(),
        );
        metrics.register(
            "trellis_gateway_handoff_connections",
            "Connections opened by peers and translated here: on the active, those it last told \
             its standbys of; on a standby, those it holds in its connection tracking to continue \
             after a takeover",
            self.handed_off.clone(),
        );
        metrics.register(
            "trellis_gateway_handoff_errors",
            "Handed-off connections a standby could not enter in (or remove from) its connection \
             tracking, and reads of the active's table that failed (see the log)",
            self.handoff_errors.clone(),
        );
    }
}

/// The replicas' election, as this replica runs it.
#[derive(Debug)]
pub struct Replicas {
    settings: Settings,
    store: SharedStore,
    key: ring::hmac::Key,
    socket: Arc<UdpSocket>,
    /// Where the other replicas send our heartbeats.
    advertised: SocketAddr,
    view: watch::Sender<View>,
    /// Whether our data plane holds every desired tunnel (set by the core).
    warm: Arc<AtomicBool>,
    /// Where our heartbeats go: every other member's address, from the store and from the
    /// heartbeats themselves (a replica that restarted on a new port is answered at once,
    /// before the next read of the store shows its new address).
    targets: Mutex<std::collections::BTreeMap<String, SocketAddr>>,
    /// The last heartbeat of every other replica, and when it came.
    peers: Mutex<std::collections::BTreeMap<String, (Instant, Heartbeat)>>,
    metrics: ReplicaMetrics,
    store_down: LogLimit,
    /// The userspace engine, once started: the active shares where it hears roamed peers,
    /// a standby points its peers there.
    engine: std::sync::OnceLock<Arc<Engine>>,
    /// At most one re-handshake with every peer a second, however many heartbeats a deposed
    /// active sends before it hears of us.
    reassert: LogLimit,
    /// The error about a member with another key, at most once per period (it is read every
    /// second).
    odd_key: LogLimit,
    /// The active record's revision as last read, and since when it has been that one: a
    /// record that keeps changing is an active that renews it, alive though silent to us.
    observed: Mutex<Option<(i64, Instant)>>,
    /// The revision of our own record while active (what a renewal compares).
    mine: Mutex<Option<i64>>,
    /// The roamed endpoints last written (active) or applied (standby).
    roamed: Mutex<Option<std::collections::BTreeMap<String, SocketAddr>>>,
    /// How often the active hands its connections to the standbys (`--handoff-interval`),
    /// once a data plane that tracks them is there.
    handoff: std::sync::OnceLock<Duration>,
    /// Handoff errors, at most once per period.
    handoff_log: LogLimit,
}

/// The address the other replicas reach `listen` at: its own IP, or the node's for a wildcard
/// listener (loopback without `--node-ip`: a replica alone).
fn advertised(listen: SocketAddr, bound: u16, node_ip: Option<IpAddr>) -> SocketAddr {
    let ip = if listen.ip().is_unspecified() {
        node_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
    } else {
        listen.ip()
    };
    SocketAddr::new(ip, bound)
}

impl Replicas {
    /// Binds the heartbeat socket. `private_key` keys the heartbeats' tag.
    pub async fn bind(
        settings: Settings,
        store: SharedStore,
        private_key: &[u8; 32],
        metrics: &Metrics,
    ) -> anyhow::Result<Self> {
        if settings.failover_after < settings.interval * 2 {
            anyhow::bail!(
                "--failover-after ({} ms) must be at least twice --heartbeat-interval ({} ms): \
                 one late heartbeat would otherwise fail the active over",
                settings.failover_after.as_millis(),
                settings.interval.as_millis()
            );
        }
        let socket = UdpSocket::bind(settings.listen)
            .await
            .with_context(|| format!("binding --heartbeat-listen {}", settings.listen))?;
        let bound = socket.local_addr()?.port();
        let advertised = advertised(settings.listen, bound, settings.node_ip);
        let replica_metrics = ReplicaMetrics::default();
        replica_metrics.register(metrics);
        Ok(Self {
            key: heartbeat::key(private_key),
            settings,
            store,
            socket: Arc::new(socket),
            advertised,
            view: watch::Sender::new(View::default()),
            warm: Arc::new(AtomicBool::new(false)),
            targets: Mutex::new(std::collections::BTreeMap::new()),
            peers: Mutex::new(std::collections::BTreeMap::new()),
            metrics: replica_metrics,
            store_down: LogLimit::new(trellis_runtime::log_limit::PERIOD),
            engine: std::sync::OnceLock::new(),
            reassert: LogLimit::new(Duration::from_secs(1)),
            odd_key: LogLimit::new(trellis_runtime::log_limit::PERIOD),
            observed: Mutex::new(None),
            mine: Mutex::new(None),
            roamed: Mutex::new(None),
            handoff: std::sync::OnceLock::new(),
            handoff_log: LogLimit::new(trellis_runtime::log_limit::PERIOD),
        })
    }

    /// Hands the active's translated connections to the standbys every `every` (a data
    /// plane with connection tracking only; before [`Replicas::run`]).
    pub fn enable_handoff(&self, every: Duration) {
        let _ = self.handoff.set(every);
    }

    /// The userspace engine whose roamed endpoints are shared between the replicas.
    pub fn set_engine(&self, engine: Arc<Engine>) {
        let _ = self.engine.set(engine);
    }

    /// The election's outcome, now and after each change.
    pub fn subscribe(&self) -> watch::Receiver<View> {
        self.view.subscribe()
    }

    /// Where the core reports whether the data plane holds every desired tunnel.
    pub fn warm_flag(&self) -> Arc<AtomicBool> {
        self.warm.clone()
    }

    /// This replica's part in the election now.
    pub fn status(&self) -> Status {
        let now = Instant::now();
        let peers = self
            .peers
            .lock()
            .map(|p| {
                p.values()
                    .map(|(at, beat)| PeerStatus {
                        replica: beat.replica.clone(),
                        since: now.duration_since(*at),
                        active: beat.active,
                        warm: beat.warm,
                        epoch: beat.epoch,
                    })
                    .collect()
            })
            .unwrap_or_default();
        Status {
            replica: self.settings.replica.clone(),
            view: self.view.borrow().clone(),
            warm: self.warm.load(Ordering::Relaxed),
            peers,
        }
    }

    /// The address our heartbeats are received at, as the other replicas reach it.
    pub fn heartbeat_addr(&self) -> SocketAddr {
        self.advertised
    }

    fn member(&self) -> MemberRecord {
        MemberRecord {
            replica: self.settings.replica.clone(),
            node_name: self.settings.node_name.clone(),
            heartbeat: self.advertised,
            public_key: self.settings.public_key.clone(),
            started_nanos: now_nanos(),
        }
    }

    fn targets(&self) -> Vec<SocketAddr> {
        self.targets
            .lock()
            .map(|t| t.values().copied().collect())
            .unwrap_or_default()
    }
}
