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
//! - [`election`]: the rules, pure; this module: the sockets, the store and the loop.
//!
//! The outcome is a [`View`] that the core follows: the data plane turns active or standby,
//! and the route agents are told which node is the gateway node, under which epoch.

pub mod election;
pub mod handoff;
pub mod heartbeat;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use trellis_error::{Error, Result};
use trellis_runtime::log_limit::LogLimit;
use trellis_runtime::metrics::prometheus_client::metrics::counter::Counter;
use trellis_runtime::metrics::prometheus_client::metrics::family::Family;
use trellis_runtime::metrics::prometheus_client::metrics::gauge::Gauge;
use trellis_runtime::metrics::{Labels, Metrics};
use trellis_runtime::{Shutdown, cmd};
use trellis_store::{Compare, Op, SharedStore, Txn};

use self::election::{Change, Election, Leader};
use self::heartbeat::{Heartbeat, Refusal};
use crate::dataplane::engine::Engine;
use crate::records::{self, ActiveRecord, MemberRecord, RoamedRecord, decode, encode, now_nanos};

/// How long one store operation of the election may take: the loop must not wait on a store
/// that went away (heartbeats go on meanwhile, on their own task).
const STORE_TIMEOUT: Duration = Duration::from_secs(1);

/// How often the store is read (members and the active record) while other replicas exist,
/// and while this replica is alone.
const SYNC: Duration = Duration::from_secs(1);
const SYNC_ALONE: Duration = Duration::from_secs(5);

/// Heartbeats waiting for the election loop; more are dropped (and the sender is heard on its
/// next one).
const QUEUE: usize = 1024;

/// This network namespace's connection tracking table, as text.
const CONNTRACK_TABLE: &str = "/proc/net/nf_conntrack";

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

async fn timed<T>(what: &str, op: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(STORE_TIMEOUT, op).await.map_err(|_| {
        Error::Unavailable(format!(
            "{what}: no answer from the store in {STORE_TIMEOUT:?}"
        ))
    })?
}

/// The active record and its revision.
pub async fn read_active(store: &SharedStore) -> Result<Option<(ActiveRecord, i64)>> {
    let Some(kv) = store.get(records::ACTIVE_KEY).await? else {
        return Ok(None);
    };
    Ok(Some((
        decode(records::ACTIVE_KEY, &kv.value)?,
        kv.mod_revision,
    )))
}

/// Writes `record` as the active one if the record is still the one read at `revision`
/// (`None`: if there is none). The record's new revision when it was written.
pub async fn claim(
    store: &SharedStore,
    revision: Option<i64>,
    record: &ActiveRecord,
) -> Result<Option<i64>> {
    let compare = match revision {
        Some(revision) => Compare::mod_revision(records::ACTIVE_KEY, revision),
        None => Compare::absent(records::ACTIVE_KEY),
    };
    let outcome = store
        .txn(
            Txn::new()
                .when(compare)
                .then(Op::put(records::ACTIVE_KEY, encode(record)?)),
        )
        .await?;
    Ok(outcome.succeeded.then_some(outcome.revision))
}

/// Every registered replica.
pub async fn members(store: &SharedStore) -> Result<Vec<MemberRecord>> {
    let listing = store.list(records::MEMBERS_PREFIX).await?;
    listing
        .kvs
        .iter()
        .map(|kv| decode(&kv.key, &kv.value))
        .collect()
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

    /// The active writes where it hears roamed peers when that changed; a standby reads it
    /// and points its peers there.
    async fn share_roamed(&self, election: &Election) {
        use base64::Engine as _;
        let Some(engine) = self.engine.get() else {
            return;
        };
        let b64 = base64::engine::general_purpose::STANDARD;
        if let Some(epoch) = election.active() {
            let endpoints: std::collections::BTreeMap<String, SocketAddr> = engine
                .roamed()
                .into_iter()
                .map(|(key, at)| (b64.encode(key), at))
                .collect();
            if self.roamed.lock().ok().and_then(|r| r.clone()).as_ref() == Some(&endpoints) {
                return;
            }
            let record = RoamedRecord {
                epoch,
                endpoints: endpoints.clone(),
            };
            let written = match encode(&record) {
                Ok(value) => timed("sharing the roamed endpoints", async {
                    self.store
                        .put(records::ROAMED_KEY, value)
                        .await
                        .map_err(Error::from)
                })
                .await
                .map(drop),
                Err(err) => Err(err),
            };
            match written {
                Ok(()) => {
                    if let Ok(mut r) = self.roamed.lock() {
                        *r = Some(endpoints);
                    }
                }
                Err(err) => self.store_unavailable("sharing the roamed endpoints", &err),
            }
            return;
        }
        let read = timed("reading the roamed endpoints", async {
            match self.store.get(records::ROAMED_KEY).await? {
                Some(kv) => Ok(Some(decode::<RoamedRecord>(
                    records::ROAMED_KEY,
                    &kv.value,
                )?)),
                None => Ok(None),
            }
        })
        .await;
        match read {
            Ok(record) => {
                let endpoints = record.map(|r| r.endpoints).unwrap_or_default();
                let roamed: Vec<([u8; 32], SocketAddr)> = endpoints
                    .iter()
                    .filter_map(|(key, at)| {
                        let bytes: [u8; 32] = b64.decode(key).ok()?.try_into().ok()?;
                        Some((bytes, *at))
                    })
                    .collect();
                engine.follow_roamed(&roamed);
                if let Ok(mut r) = self.roamed.lock() {
                    *r = None;
                }
            }
            Err(err) => self.store_unavailable("reading the roamed endpoints", &err),
        }
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

    /// Runs the election until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: Shutdown) {
        let (tx, mut rx) = mpsc::channel(QUEUE);
        let (parts_tx, parts_rx) = mpsc::channel(QUEUE);
        let mut tasks = vec![
            trellis_runtime::telemetry::spawn(self.clone().receive(tx, parts_tx)),
            trellis_runtime::telemetry::spawn(self.clone().send(shutdown.clone())),
        ];
        if let Some(every) = self.handoff.get().copied() {
            tasks.push(trellis_runtime::telemetry::spawn(
                self.clone().share_connections(every, shutdown.clone()),
            ));
            tasks.push(trellis_runtime::telemetry::spawn(
                self.clone().hold_connections(parts_rx),
            ));
        }
        let mut election = Election::new(
            &self.settings.replica,
            self.settings.failover_after,
            Instant::now(),
        );
        let mut tick =
            tokio::time::interval((self.settings.interval / 2).max(Duration::from_millis(5)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sync: Option<Instant> = None;
        let mut registered = false;
        let mut last_renewal: Option<Instant> = None;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some((beat, at)) = rx.recv() => {
                    if self.heard(&mut election, beat, at) {
                        last_sync = None;
                    }
                    continue;
                }
                _ = tick.tick() => {}
            }
            let now = Instant::now();
            let period = if self.targets().is_empty() {
                SYNC_ALONE
            } else {
                SYNC
            };
            if last_sync.is_none_or(|at| now.duration_since(at) >= period) {
                last_sync = Some(now);
                self.sync(&mut election, &mut registered).await;
            }
            if last_renewal.is_none_or(|at: Instant| at.elapsed() >= self.renew_every()) {
                last_renewal = Some(Instant::now());
                self.renew(&mut election).await;
            }
            // A store call may have taken long: what was heard meanwhile counts first, or a
            // store that just came back would let us pre-empt an active we did hear.
            while let Ok((beat, at)) = rx.try_recv() {
                if self.heard(&mut election, beat, at) {
                    last_sync = None;
                }
            }
            if election.should_take_over(Instant::now()) {
                self.take_over(&mut election, &mut rx).await;
            }
            for (replica, heard) in election.heard() {
                self.metrics
                    .heard_age
                    .get_or_create(&vec![("replica", replica.clone())])
                    .set(Instant::now().duration_since(heard.at).as_secs_f64());
            }
        }
        for task in tasks {
            task.abort();
        }
    }

    /// How often an active that hears no other replica renews its record.
    fn renew_every(&self) -> Duration {
        (self.settings.failover_after / 3).max(Duration::from_millis(10))
    }

    /// Notes the active record's revision as read at `now`; whether it moved since the last
    /// read.
    fn moved(&self, revision: i64, now: Instant) -> bool {
        let Ok(mut observed) = self.observed.lock() else {
            return false;
        };
        match *observed {
            Some((seen, _)) if seen == revision => false,
            Some(_) => {
                *observed = Some((revision, now));
                true
            }
            None => {
                // First sight: nothing says it moves.
                *observed = Some((
                    revision,
                    now.checked_sub(self.renew_every() * 4).unwrap_or(now),
                ));
                false
            }
        }
    }

    /// While active and hearing no other replica, rewrites our record (compared against our
    /// own last revision) so that a replica cut off from us but not from the store sees an
    /// active that is alive and does not take over. A renewal that finds another record means
    /// another replica took over: we step down.
    async fn renew(&self, election: &mut Election) {
        let Some(epoch) = election.active() else {
            return;
        };
        let now = Instant::now();
        let hears_one = election
            .heard()
            .values()
            .any(|h| now.duration_since(h.at) < self.settings.failover_after);
        if hears_one || self.targets().is_empty() {
            return;
        }
        let Some(revision) = self.mine.lock().ok().and_then(|m| *m) else {
            return;
        };
        let Some(record) = self
            .view
            .borrow()
            .leader
            .clone()
            .filter(|l| l.epoch == epoch)
        else {
            return;
        };
        match timed(
            "renewing the active record",
            claim(&self.store, Some(revision), &record),
        )
        .await
        {
            Ok(Some(written)) => {
                if let Ok(mut mine) = self.mine.lock() {
                    *mine = Some(written);
                }
            }
            Ok(None) => {
                // Someone else's record now: read it and step down.
                if let Ok(Some((other, _))) =
                    timed("reading the active record", read_active(&self.store)).await
                    && election.on_record(
                        Some(Leader {
                            replica: other.replica.clone(),
                            epoch: other.epoch,
                        }),
                        Instant::now(),
                    ) == Some(Change::StepDown)
                {
                    self.stepped_down(election, "renewal");
                    self.publish(election, Some(other));
                }
            }
            Err(err) => self.store_unavailable("renewing the active record", &err),
        }
    }

    /// One heartbeat, received at `at`; whether it names an active newer than any known (its
    /// record is then read at once rather than at the next sync).
    fn heard(&self, election: &mut Election, beat: Heartbeat, at: Instant) -> bool {
        let known = election.leader().map(|l| l.epoch);
        if election.on_heartbeat(&beat.replica, beat.active, beat.epoch, at)
            == Some(Change::StepDown)
        {
            self.stepped_down(election, "heard");
        }
        self.metrics
            .warm
            .get_or_create(&vec![("replica", beat.replica.clone())])
            .set(i64::from(beat.warm));
        let newer = beat.active && known.is_none_or(|k| beat.epoch > k);
        // A deposed active that comes back (its node's links restored) may have sent the peers
        // a packet before it heard of us: whatever it drew to itself is drawn back.
        if let Some(mine) = election.active()
            && beat.active
            && beat.epoch < mine
            && let Some(engine) = self.engine.get()
            && self.reassert.admit().is_some()
        {
            tracing::info!(replica = %beat.replica, epoch = beat.epoch, "a deposed active is back; handshaking with every peer again");
            engine.reassert();
        }
        if let Ok(mut peers) = self.peers.lock() {
            peers.insert(beat.replica.clone(), (at, beat));
        }
        newer
    }

    fn targets(&self) -> Vec<SocketAddr> {
        self.targets
            .lock()
            .map(|t| t.values().copied().collect())
            .unwrap_or_default()
    }

    /// Reads the members and the active record; registers this replica when it is missing.
    async fn sync(&self, election: &mut Election, registered: &mut bool) {
        let store = &self.store;
        match timed("listing the replicas", members(store)).await {
            Ok(list) => {
                let me = &self.settings.replica;
                for other in list.iter().filter(|m| &m.replica != me) {
                    if other.public_key != self.settings.public_key
                        && let Some(held) = self.odd_key.admit()
                    {
                        tracing::error!(held_back = held, replica = %other.replica, "a gateway replica registered with another public key: replicas share the key of their store, so it is not one of ours or its store differs; it never becomes active here");
                    }
                }
                let targets: std::collections::BTreeMap<String, SocketAddr> = list
                    .iter()
                    .filter(|m| &m.replica != me && m.public_key == self.settings.public_key)
                    .map(|m| (m.replica.clone(), m.heartbeat))
                    .collect();
                if let Ok(mut t) = self.targets.lock() {
                    *t = targets;
                }
                let mine = list.iter().find(|m| &m.replica == me);
                if !*registered || mine.is_none_or(|m| m.heartbeat != self.advertised) {
                    let member = self.member();
                    let written = match encode(&member) {
                        Ok(value) => timed("registering this replica", async {
                            store
                                .put(&records::member_key(me), value)
                                .await
                                .map_err(Error::from)
                        })
                        .await
                        .map(drop),
                        Err(err) => Err(err),
                    };
                    match written {
                        Ok(()) => *registered = true,
                        Err(err) => self.store_unavailable("registering this replica", &err),
                    }
                }
            }
            Err(err) => self.store_unavailable("listing the replicas", &err),
        }
        match timed("reading the active record", read_active(store)).await {
            Ok(record) => {
                let leader = record.as_ref().map(|(r, _)| Leader {
                    replica: r.replica.clone(),
                    epoch: r.epoch,
                });
                if election.on_record(leader, Instant::now()) == Some(Change::StepDown) {
                    self.stepped_down(election, "read");
                }
                if let Some((record, revision)) = record {
                    self.moved(revision, Instant::now());
                    self.publish(election, Some(record));
                }
            }
            Err(err) => self.store_unavailable("reading the active record", &err),
        }
        self.share_roamed(election).await;
    }

    fn store_unavailable(&self, what: &str, err: &Error) {
        if let Some(held) = self.store_down.admit() {
            tracing::warn!(what, error = %err, held_back = held, "the store is unreachable; the data plane goes on as it is");
        }
    }

    /// Publishes the view: active or not, and `record` when it is the newest known.
    fn publish(&self, election: &Election, record: Option<ActiveRecord>) {
        let active = election.active().is_some();
        self.view.send_if_modified(|view| {
            let mut changed = view.active != active;
            view.active = active;
            if let Some(record) = record
                && view.leader.as_ref().is_none_or(|l| record.epoch >= l.epoch)
                && view.leader.as_ref() != Some(&record)
            {
                view.leader = Some(record);
                changed = true;
            }
            changed
        });
        self.metrics.active.set(i64::from(active));
        self.metrics
            .epoch
            .set(i64::try_from(self.view.borrow().epoch()).unwrap_or(i64::MAX));
    }

    fn stepped_down(&self, election: &Election, how: &str) {
        let leader = election.leader().cloned();
        tracing::info!(
            replica = %self.settings.replica,
            active = leader.as_ref().map(|l| l.replica.as_str()).unwrap_or(""),
            epoch = leader.as_ref().map_or(0, |l| l.epoch),
            how,
            "stepping down: another replica is active under a newer epoch"
        );
        self.publish(election, None);
    }

    /// Claims the active role with the next epoch; the store decides. `heard` hands over the
    /// heartbeats that came while the store was read: one from the active calls it off.
    async fn take_over(
        &self,
        election: &mut Election,
        heard: &mut mpsc::Receiver<(Heartbeat, Instant)>,
    ) {
        let silent = election.leader_silence(Instant::now());
        let span = tracing::info_span!("gateway.election", replica = %self.settings.replica, silent_ms = silent.as_millis() as u64);
        let _entered = span.enter();
        let read = match timed("reading the active record", read_active(&self.store)).await {
            Ok(read) => read,
            Err(err) => {
                if let Some(held) = self.store_down.admit() {
                    tracing::warn!(error = %err, held_back = held, "the active replica is silent but the store is unreachable: not taking over (the store is the fence)");
                }
                return;
            }
        };
        if let Some((record, revision)) = &read {
            // Silent to us but renewing its record: the active is alive, we are the one cut off.
            if self.moved(*revision, Instant::now())
                || self
                    .observed
                    .lock()
                    .ok()
                    .and_then(|o| *o)
                    .is_some_and(|(_, since)| since.elapsed() < self.renew_every() * 2)
            {
                return;
            }
            if record.public_key != self.settings.public_key {
                if let Some(held) = self.store_down.admit() {
                    tracing::error!(active = %record.replica, held_back = held, "the active record names another gateway key than ours: this replica never becomes active (replicas must share the key of one store)");
                }
                return;
            }
            let leader = Leader {
                replica: record.replica.clone(),
                epoch: record.epoch,
            };
            election.on_record(Some(leader), Instant::now());
            while let Ok((beat, at)) = heard.try_recv() {
                self.heard(election, beat, at);
            }
            if !election.should_take_over(Instant::now()) {
                // Another replica took over meanwhile.
                self.publish(election, Some(record.clone()));
                return;
            }
        }
        let previous = read.as_ref().map(|(r, _)| r.clone());
        let epoch = previous.as_ref().map_or(1, |r| r.epoch + 1);
        let record = ActiveRecord {
            replica: self.settings.replica.clone(),
            epoch,
            node_name: self.settings.node_name.clone(),
            node_ip: self.settings.node_ip,
            endpoint_host: self.settings.endpoint_host.clone(),
            public_key: self.settings.public_key.clone(),
            since_nanos: now_nanos(),
        };
        let revision = read.map(|(_, revision)| revision);
        match timed(
            "claiming the active role",
            claim(&self.store, revision, &record),
        )
        .await
        {
            Ok(Some(written)) => {
                if let Ok(mut mine) = self.mine.lock() {
                    *mine = Some(written);
                }
                election.won(epoch, Instant::now());
                let from = previous.as_ref().map(|r| r.replica.as_str()).unwrap_or("");
                if !from.is_empty() && from != self.settings.replica {
                    self.metrics.failovers.inc();
                }
                tracing::info!(epoch, previous = from, node = %self.settings.node_name, "this replica is now the active gateway");
                self.publish(election, Some(record));
            }
            Ok(None) => tracing::info!(epoch, "another replica claimed the active role first"),
            Err(err) => {
                if let Some(held) = self.store_down.admit() {
                    tracing::warn!(error = %err, held_back = held, "could not claim the active role: the store is unreachable");
                }
            }
        }
    }

    /// Receives heartbeats, hands the authentic and fresh ones to the loop; and handoff
    /// parts, handed to [`Replicas::hold_connections`] when they come from the active we
    /// follow.
    async fn receive(
        self: Arc<Self>,
        tx: mpsc::Sender<(Heartbeat, Instant)>,
        parts: mpsc::Sender<handoff::Part>,
    ) {
        let mut buf = vec![0u8; heartbeat::MAX_LEN.max(handoff::MAX_LEN) + 1];
        let mut last_sent: std::collections::HashMap<String, i64> =
            std::collections::HashMap::new();
        let refused_log = LogLimit::new(trellis_runtime::log_limit::PERIOD);
        loop {
            let Ok((n, from)) = self.socket.recv_from(&mut buf).await else {
                continue;
            };
            let datagram = buf.get(..n).unwrap_or_default();
            let outcome = if datagram.starts_with(handoff::MAGIC) {
                self.take_part(datagram, &parts)
            } else {
                Heartbeat::decode(datagram, &self.key)
                    .and_then(|beat| {
                        if heartbeat::fresh(
                            beat.sent_nanos,
                            last_sent.get(&beat.replica).copied(),
                            now_nanos(),
                        ) {
                            Ok(beat)
                        } else {
                            Err(Refusal::Stale)
                        }
                    })
                    .map(|beat| {
                        last_sent.insert(beat.replica.clone(), beat.sent_nanos);
                        if beat.replica != self.settings.replica
                            && let Ok(mut targets) = self.targets.lock()
                        {
                            targets.insert(beat.replica.clone(), from);
                        }
                        let _ = tx.try_send((beat, Instant::now()));
                    })
            };
            if let Err(reason) = outcome {
                self.metrics
                    .refused
                    .get_or_create(&vec![("reason", reason.label().to_owned())])
                    .inc();
                if let Some(held) = refused_log.admit() {
                    tracing::warn!(%from, reason = reason.label(), held_back = held, "refused a heartbeat or handoff datagram");
                }
            }
        }
    }

    /// One handoff datagram: authentic and fresh, from the active this standby follows (a
    /// deposed active's sets are ignored), it goes to [`Replicas::hold_connections`].
    fn take_part(
        &self,
        datagram: &[u8],
        parts: &mpsc::Sender<handoff::Part>,
    ) -> std::result::Result<(), Refusal> {
        let part = handoff::decode(datagram, &self.key)?;
        if !handoff::fresh(part.sent_nanos, now_nanos()) {
            return Err(Refusal::Stale);
        }
        let view = self.view.borrow().clone();
        let from_leader = view
            .leader
            .as_ref()
            .is_some_and(|l| l.replica == part.replica && l.epoch == part.epoch);
        if self.handoff.get().is_some() && !view.active && from_leader {
            let _ = parts.try_send(part);
        }
        Ok(())
    }

    /// The active's side of the handoff: every `every`, the translated connections the peers
    /// opened (from this namespace's connection tracking), to every other replica.
    async fn share_connections(self: Arc<Self>, every: Duration, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // Set numbers only need to differ from the previous run's.
        let mut set = u32::try_from(now_nanos().rem_euclid(i64::from(u32::MAX))).unwrap_or(0);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let view = self.view.borrow().clone();
            let targets = self.targets();
            if !view.active || targets.is_empty() {
                continue;
            }
            let table = match tokio::fs::read_to_string(CONNTRACK_TABLE).await {
                Ok(table) => table,
                Err(err) => {
                    self.metrics.handoff_errors.inc();
                    if let Some(held) = self.handoff_log.admit() {
                        tracing::warn!(path = CONNTRACK_TABLE, error = %err, held_back = held, "cannot read the connection tracking table: the standbys get no connections to continue after a takeover");
                    }
                    continue;
                }
            };
            let flows = handoff::parse(&table, crate::names::MARK_MASK);
            set = set.wrapping_add(1);
            let datagrams = handoff::encode(
                &self.settings.replica,
                view.epoch(),
                set,
                now_nanos(),
                &flows,
                &self.key,
            );
            self.metrics
                .handed_off
                .set(i64::try_from(flows.len()).unwrap_or(i64::MAX));
            for to in targets {
                for datagram in &datagrams {
                    if let Err(err) = self.socket.send_to(datagram, to).await {
                        tracing::trace!(%to, error = %err, "sending a handoff part failed");
                    }
                }
            }
        }
    }

    /// The standby's side of the handoff: each complete set from the active becomes this
    /// namespace's copy (new connections entered, ended ones removed), so a takeover finds
    /// them tracked and translated as the active had them.
    async fn hold_connections(self: Arc<Self>, mut parts: mpsc::Receiver<handoff::Part>) {
        let mut assembler = handoff::Assembler::default();
        let mut held = std::collections::BTreeSet::new();
        while let Some(part) = parts.recv().await {
            let Some(wanted) = assembler.take(part) else {
                continue;
            };
            if self.view.borrow().active {
                // Ours now: what we track is the truth, and the next standby's business.
                held.clear();
                continue;
            }
            let (insert, remove) = handoff::diff(&held, &wanted);
            for flow in insert {
                let args = flow.insert_args();
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                match cmd::run("conntrack", &args, None).await {
                    Ok(_) => {
                        held.insert(flow);
                    }
                    Err(err) if handoff::already_tracked(&format!("{err:#}")) => {
                        held.insert(flow);
                    }
                    Err(err) => self.handoff_failed(&err),
                }
            }
            for flow in remove {
                let args = flow.delete_args();
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                match cmd::run("conntrack", &args, None).await {
                    Ok(_) => {}
                    Err(err) if format!("{err:#}").contains("0 flow entries") => {}
                    Err(err) => self.handoff_failed(&err),
                }
                held.remove(&flow);
            }
            self.metrics
                .handed_off
                .set(i64::try_from(held.len()).unwrap_or(i64::MAX));
        }
    }

    fn handoff_failed(&self, err: &anyhow::Error) {
        self.metrics.handoff_errors.inc();
        if let Some(held) = self.handoff_log.admit() {
            tracing::warn!(
                error = format!("{err:#}"),
                held_back = held,
                "could not enter a handed-off connection in connection tracking: it may be reset after a takeover"
            );
        }
    }

    /// Sends our heartbeat to every other replica each interval, whatever the store does.
    async fn send(self: Arc<Self>, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(self.settings.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let targets = self.targets();
            if targets.is_empty() {
                continue;
            }
            let view = self.view.borrow().clone();
            let datagram = Heartbeat {
                replica: self.settings.replica.clone(),
                active: view.active,
                warm: self.warm.load(Ordering::Relaxed),
                epoch: view.epoch(),
                sent_nanos: now_nanos(),
            }
            .encode(&self.key);
            for to in targets {
                if let Err(err) = self.socket.send_to(&datagram, to).await {
                    tracing::trace!(%to, error = %err, "sending a heartbeat failed");
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests spawn plainly: there is no service subscriber to keep
mod tests {
    use super::*;

    const KEY: [u8; 32] = [7; 32];

    fn settings(replica: &str) -> Settings {
        Settings {
            replica: replica.into(),
            node_name: replica.into(),
            node_ip: None,
            endpoint_host: format!("{replica}.example"),
            public_key: "the-key".into(),
            listen: "127.0.0.1:0".parse().expect("addr"),
            interval: Duration::from_millis(20),
            failover_after: Duration::from_millis(100),
        }
    }

    async fn start(replica: &str, store: &SharedStore) -> (Arc<Replicas>, Shutdown) {
        let replicas = Arc::new(
            Replicas::bind(settings(replica), store.clone(), &KEY, &Metrics::new())
                .await
                .expect("binds"),
        );
        let shutdown = Shutdown::new();
        tokio::spawn(replicas.clone().run(shutdown.clone()));
        (replicas, shutdown)
    }

    /// Waits until `f` holds of the views (checked every 10 ms), at most 5 s.
    async fn until(what: &str, f: impl Fn() -> bool) {
        let started = Instant::now();
        while !f() {
            assert!(started.elapsed() < Duration::from_secs(5), "never: {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_replica_is_active_a_silent_one_is_replaced_and_a_returning_one_waits() {
        let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
        let (a, stop_a) = start("a", &store).await;
        until("a is active", || a.status().view.active).await;
        let (b, stop_b) = start("b", &store).await;
        until("b follows a", || b.status().view.epoch() == 1).await;
        until("a hears b", || {
            a.status().peers.iter().any(|p| p.replica == "b")
        })
        .await;
        // Healthy and heard: b never claims the role, however long it waits.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(a.status().view.active && !b.status().view.active);

        stop_a.cancel();
        until("b takes over", || b.status().view.active).await;
        let view = b.status().view;
        assert_eq!(view.epoch(), 2, "a takeover is the next epoch");
        assert_eq!(
            view.leader.as_ref().map(|l| l.endpoint_host.as_str()),
            Some("b.example"),
            "the active record says where peers that join later must go"
        );

        // a comes back: it hears b and stays a standby.
        let (a, stop_a) = start("a", &store).await;
        until("a follows b", || a.status().view.epoch() == 2).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!a.status().view.active && b.status().view.active);
        let record = read_active(&store).await.expect("reads").expect("a record");
        assert_eq!((record.0.replica.as_str(), record.0.epoch), ("b", 2));
        stop_a.cancel();
        stop_b.cancel();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replica_with_another_key_never_becomes_active_not_even_when_the_active_dies() {
        let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
        let (a, stop_a) = start("a", &store).await;
        until("a is active", || a.status().view.active).await;
        let mut odd = settings("odd");
        odd.public_key = "another-key".into();
        let odd = Arc::new(
            Replicas::bind(odd, store.clone(), &[9; 32], &Metrics::new())
                .await
                .expect("binds"),
        );
        let stop_odd = Shutdown::new();
        tokio::spawn(odd.clone().run(stop_odd.clone()));
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(a.status().view.active && !odd.status().view.active);
        assert!(
            a.status().peers.iter().all(|p| p.replica != "odd"),
            "its heartbeats, under another key, are refused"
        );

        stop_a.cancel();
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            !odd.status().view.active,
            "a replica with another key took over"
        );
        let record = read_active(&store).await.expect("reads").expect("a record");
        assert_eq!((record.0.replica.as_str(), record.0.epoch), ("a", 1));
        stop_odd.cancel();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forged_heartbeats_neither_keep_a_dead_active_alive_nor_depose_a_live_one() {
        let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
        let (a, stop_a) = start("a", &store).await;
        until("a is active", || a.status().view.active).await;
        let (b, stop_b) = start("b", &store).await;
        until("b follows a", || b.status().view.epoch() == 1).await;
        let forger = tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let forge = |replica: &str, epoch: u64| {
            let wrong_key = heartbeat::key(&[8; 32]);
            Heartbeat {
                replica: replica.into(),
                active: true,
                warm: true,
                epoch,
                sent_nanos: now_nanos(),
            }
            .encode(&wrong_key)
        };
        // A higher epoch, sent to the active under a key it does not hold.
        for _ in 0..20 {
            forger
                .send_to(&forge("b", 99), a.heartbeat_addr())
                .await
                .expect("sends");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            a.status().view.active,
            "a forged heartbeat deposed the active"
        );
        // The active dies; forged "a is alive" heartbeats keep coming to the standby.
        stop_a.cancel();
        let b_addr = b.heartbeat_addr();
        let flood = tokio::spawn(async move {
            loop {
                let _ = forger.send_to(&forge("a", 1), b_addr).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        until("b takes over despite the forgeries", || {
            b.status().view.active
        })
        .await;
        flood.abort();
        stop_b.cancel();
    }

    #[tokio::test]
    async fn a_failover_time_under_two_heartbeats_is_refused_naming_both_flags() {
        let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
        let mut bad = settings("a");
        bad.failover_after = Duration::from_millis(30);
        let err = Replicas::bind(bad, store, &KEY, &Metrics::new())
            .await
            .expect_err("refused");
        let text = err.to_string();
        assert!(
            text.contains("--failover-after") && text.contains("--heartbeat-interval"),
            "{text}"
        );
    }

    #[test]
    fn a_wildcard_listener_is_advertised_at_the_node_ip() {
        let node: IpAddr = "10.1.0.2".parse().expect("ip");
        assert_eq!(
            advertised("0.0.0.0:7116".parse().expect("addr"), 7116, Some(node)),
            "10.1.0.2:7116".parse().expect("addr")
        );
        assert_eq!(
            advertised("0.0.0.0:0".parse().expect("addr"), 40000, None),
            "127.0.0.1:40000".parse().expect("addr")
        );
        assert_eq!(
            advertised("10.9.0.1:0".parse().expect("addr"), 40000, Some(node)),
            "10.9.0.1:40000".parse().expect("addr")
        );
    }
}
