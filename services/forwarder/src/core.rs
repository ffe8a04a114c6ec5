//! The forwarder's operations. Every relay is persisted before it is acknowledged, then
//! delivered at once when the other end answers, otherwise by the retry loop ([`retry_loop`])
//! with backoff. Both ends are idempotent per generation, so re-delivery after a crash is
//! harmless; completed relays are deleted, relays refused for good after `--failed-retention`.
//!
//! The retry loop works from an in-memory due queue (`Schedule`): read from the store once
//! at start, then kept up to date by every write of a relay (`Forwarder::save`), so a wake
//! costs one store read per due relay, not a listing of all of them. Attempts run
//! concurrently (at most `--delivery-concurrency`), but never two at once towards the same
//! cluster: a destination that hangs until the delivery timeout ties up one slot, and the
//! relays to everyone else go on.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tracing::Instrument as _;
use trellis_api::convert::identity_to_pb;
use trellis_api::model::NetworkSpec;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{
    ReportNetworkConfigStatusRequest, SubmitNetworkConfigRequest, SubmitNetworkConfigResponse,
    WithdrawNetworkConfigRequest,
};
use trellis_api::pb::types as pb;
use trellis_api::peers::{is_routable_full_peer, network_config_name};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;
use trellis_runtime::batch::{self, Batchers, Submitter};
use trellis_runtime::client::{Timeouts, TracedChannel, local_channel};
use trellis_runtime::foreign_clusters::{self, ForeignClusters};
use trellis_runtime::metrics::Metrics;
use trellis_runtime::propagation::{resumed_span, traceparent_of};
use trellis_runtime::retry::{RetryPolicy, Retryable as _};
use trellis_runtime::tls::{PeerTls, cluster_channel};
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, SharedStore, Txn};

use crate::ends::Ends;
use crate::records::{
    RELAYS_PREFIX, RelayRecord, RelayedStatus, State, decode, encode, now_nanos, relay_key,
};

/// A remote broker gets this long per delivery; the origin is waiting on the first attempt.
const DELIVERY: Timeouts = Timeouts {
    connect: Duration::from_secs(2),
    request: Duration::from_secs(5),
};
const LOCAL: Timeouts = Timeouts {
    connect: Duration::from_secs(2),
    request: Duration::from_secs(10),
};
/// The first wait before a failed delivery is retried; it doubles up to `--retry-max`.
const RETRY_MIN: Duration = Duration::from_millis(200);
/// An attempt made while the caller waits (Relay, RelayStatus, RelayWithdrawal) owns its
/// relay this long: the retry loop leaves it alone meanwhile rather than send it twice. The
/// attempt rewrites the record before then, so only a crash lets this pass.
const INLINE_GRACE: Duration =
    Duration::from_secs(DELIVERY.connect.as_secs() + DELIVERY.request.as_secs() + 1);
/// How long the loop waits before retrying a relay whose processing failed on our side (the
/// store or the local discovery service did not answer): a fixed second.
const LOCAL_RETRY: RetryPolicy = RetryPolicy::fixed(Duration::from_secs(1));
/// The longest the retry loop sleeps with nothing due (a safety net; every write wakes it).
const IDLE: Duration = Duration::from_secs(60);

fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// How relays are retried and kept.
#[derive(Debug, Clone, Copy)]
pub struct Delivery {
    /// Longest wait between two attempts of one relay.
    pub retry_max: Duration,
    /// Attempts in flight at once, over all destinations (each cluster gets one at a time).
    pub concurrency: usize,
    /// How long a relay refused for good (state Failed), or delivered but never answered
    /// (state Delivered), is kept for operators before it is deleted.
    pub retention: Duration,
}

impl Delivery {
    /// The retry policy of a relay's deliveries: [`RETRY_MIN`] doubling to `retry_max`.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::exponential(RETRY_MIN, self.retry_max)
    }
}

/// The retry loop's in-memory due queue: which relay needs work when, and which cluster that
/// work calls. Mirrors the store (every successful write of a relay updates it), so it only
/// has to be read from the store once per process.
#[derive(Debug, Default)]
struct Schedule {
    /// (due, key), earliest first.
    queue: BTreeSet<(i64, String)>,
    /// What is queued per key: its due time and the cluster it calls (none to delete it).
    entries: HashMap<String, (i64, Option<ClusterId>)>,
}

impl Schedule {
    fn set(&mut self, key: &str, work: Option<(i64, Option<ClusterId>)>) {
        if let Some((due, _)) = self.entries.remove(key) {
            self.queue.remove(&(due, key.to_owned()));
        }
        if let Some((due, target)) = work {
            self.queue.insert((due, key.to_owned()));
            self.entries.insert(key.to_owned(), (due, target));
        }
    }

    /// Takes up to `free` relays due at `now` whose cluster has no attempt in flight (marking
    /// it busy); returns them and when the next one not yet due will be.
    fn take_due(
        &mut self,
        now: i64,
        busy: &mut HashSet<ClusterId>,
        free: usize,
    ) -> (Vec<(String, Option<ClusterId>)>, Option<i64>) {
        let mut taken = Vec::new();
        let mut next = None;
        for (due, key) in &self.queue {
            if *due > now {
                next = Some(*due);
                break;
            }
            if taken.len() >= free {
                break;
            }
            let target = self.entries.get(key).and_then(|(_, t)| t.clone());
            if let Some(cluster) = &target
                && !busy.insert(cluster.clone())
            {
                continue;
            }
            taken.push((key.clone(), target));
        }
        for (key, _) in &taken {
            self.set(key, None);
        }
        (taken, next)
    }
}

/// What the loop must do with `record` and when: deliver it (calling the returned cluster)
/// or, for a relay kept only for operators, delete it once the retention has passed.
fn work_of(record: &RelayRecord, retention: Duration) -> Option<(i64, Option<ClusterId>)> {
    match record.state {
        State::Pending | State::Withdrawing => Some((
            record.next_attempt_nanos,
            Some(record.destination.id.clone()),
        )),
        State::StatusPending => Some((record.next_attempt_nanos, Some(record.origin.id.clone()))),
        State::Failed | State::Delivered => {
            Some((record.updated_nanos.saturating_add(nanos(retention)), None))
        }
        State::Completed => None,
    }
}

/// What a relay request asks for.
#[derive(Debug, Clone)]
pub struct Passthrough {
    pub origin: ClusterIdentity,
    pub destination: ClusterIdentity,
    pub spec: NetworkSpec,
    pub generation: i64,
    /// The generation of the destination's NetworkConfig the origin holds (0: none).
    pub held_generation: i64,
}

/// The forwarder of one hub cluster.
#[derive(Debug)]
pub struct Forwarder {
    identity: ClusterIdentity,
    store: SharedStore,
    discovery: TracedChannel,
    /// The local discovery service's records, as its watch last delivered them
    /// ([`Forwarder::follow_discovery`]): what a relay is authorized against.
    foreign_clusters: ForeignClusters,
    /// Mutual TLS towards other clusters (ADR 0014); plaintext when absent.
    tls: Option<PeerTls>,
    /// Broker channels by (address, cluster).
    brokers: Mutex<HashMap<(String, String), TracedChannel>>,
    /// Deliveries to each broker, batched (ADR 0012).
    submitters: Batchers<SubmitNetworkConfigRequest, SubmitNetworkConfigResponse>,
    /// The forwarder's registry: its channels' calls count there (`grpc_client_*`).
    metrics: Metrics,
    delivery: Delivery,
    /// The retry loop's due queue.
    schedule: Mutex<Schedule>,
    /// Wakes the retry loop (something was scheduled).
    wake: Notify,
    /// Relays whose other direction arrived while an attempt of theirs was in flight: if that
    /// attempt fails for a reason that may be gone now, it is retried at once, not after its
    /// backoff ([`Forwarder::expedite`]).
    expedited: Mutex<HashSet<String>>,
    /// First attempts running with nothing stored for their relay (see
    /// [`Forwarder::relay_answering`]), by key, and how many. A withdrawal of that relay waits
    /// for them to end ([`Forwarder::unstored_ended`]), so that an attempt's outcome is never
    /// stored (and retried) after the withdrawal.
    unstored: Mutex<HashMap<String, u32>>,
    /// Wakes withdrawals waiting for such attempts.
    unstored_end: Notify,
    /// Which relays may be stored ([`MaybeStored`]): accepting a relay known to be absent, the
    /// usual case, reads nothing.
    maybe_stored: Mutex<MaybeStored>,
}

/// The keys of the relays that may be stored, kept by this process's writes (the forwarder is
/// the only writer of its store), each with the revision of its last write known to have
/// committed. A key is added before a put is sent ([`UNKNOWN`] until it commits) and
/// forgotten when a delete commits after every put of it known to have committed, so a write
/// whose outcome is unknown, or a put racing a delete, leaves it in: a key too many only
/// costs a read. Until the retry loop has listed the store at start (`complete`), absence
/// means nothing and every read goes to the store. On etcd a relay accepted and answered at
/// once read the store twice (its own key and the other direction's), at a hub n·(n-1) times.
#[derive(Debug, Default)]
struct MaybeStored {
    complete: bool,
    keys: HashMap<String, i64>,
}

/// The revision of a put that has not committed (or whose outcome is unknown).
const UNKNOWN: i64 = 0;

impl MaybeStored {
    /// Whether `key` is known not to be stored.
    fn absent(&self, key: &str) -> bool {
        self.complete && !self.keys.contains_key(key)
    }

    /// A put of `key` is about to be sent.
    fn putting(&mut self, key: &str) {
        self.keys.entry(key.to_owned()).or_insert(UNKNOWN);
    }

    /// A put of `key` committed at `revision`.
    fn put(&mut self, key: &str, revision: i64) {
        let known = self.keys.entry(key.to_owned()).or_insert(UNKNOWN);
        *known = (*known).max(revision);
    }

    /// A delete of `key` committed at `revision`.
    fn deleted(&mut self, key: &str, revision: i64) {
        if self
            .keys
            .get(key)
            .is_some_and(|known| *known != UNKNOWN && *known < revision)
        {
            self.keys.remove(key);
        }
    }

    /// The store's listing at start: from now on absence is known.
    fn listed(&mut self, kvs: &[trellis_store::KeyValue]) {
        for kv in kvs {
            self.keys
                .entry(kv.key.clone())
                .and_modify(|known| {
                    if *known != UNKNOWN {
                        *known = (*known).max(kv.mod_revision);
                    }
                })
                .or_insert(kv.mod_revision);
        }
        self.complete = true;
    }
}

/// Whether the origin still waits for a relay's first attempt (its Relay call, or its item of a
/// RelayBatch that may stop waiting). The attempt and the waiter settle it once, atomically:
/// either the attempt answers the origin in the reply, or the waiter gave up first and the
/// status goes through ReportNetworkConfigStatus; never neither.
///
/// It also holds the relay while only its first attempt knows of it (nothing stored yet, see
/// [`Forwarder::relay_answering`]): an origin that stops waiting is answered PENDING only once
/// the relay is stored ([`Forwarder::stop_waiting`]).
#[derive(Debug, Default)]
pub struct OriginWait {
    state: AtomicU8,
    unstored: tokio::sync::Mutex<Option<(String, RelayRecord)>>,
}

const WAITING: u8 = 0;
const ANSWERED: u8 = 1;
const ABANDONED: u8 = 2;

impl OriginWait {
    /// The attempt takes the answer upon itself, unless the origin stopped waiting.
    fn answer(&self) -> bool {
        self.state
            .compare_exchange(WAITING, ANSWERED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The origin stops waiting, unless the attempt already took the answer upon itself (its
    /// reply is then moments away).
    pub fn abandon(&self) -> bool {
        self.state
            .compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

/// A first attempt running with nothing stored for its relay (`Forwarder::unstored`), counted
/// in while this lives. Counted out when dropped: when the attempt ends, and also when it is
/// cancelled with the call that waits on it (the origin's deadline passed, its connection
/// dropped), which would otherwise hold every later withdrawal of the relay back for good.
struct Unstored<'a> {
    forwarder: &'a Forwarder,
    key: &'a str,
}

impl<'a> Unstored<'a> {
    fn start(forwarder: &'a Forwarder, key: &'a str) -> Self {
        forwarder.count_unstored(key, true);
        Self { forwarder, key }
    }
}

impl Drop for Unstored<'_> {
    fn drop(&mut self) {
        self.forwarder.count_unstored(self.key, false);
    }
}

impl Forwarder {
    pub fn new(
        identity: ClusterIdentity,
        store: SharedStore,
        discovery: &str,
        delivery: Delivery,
        tls: Option<PeerTls>,
        local_token: &trellis_runtime::local_auth::LocalToken,
        metrics: &Metrics,
    ) -> Result<Self> {
        Ok(Self {
            identity,
            store,
            discovery: local_channel("discovery", discovery, LOCAL, local_token, metrics)?,
            foreign_clusters: ForeignClusters::new(),
            tls,
            metrics: metrics.clone(),
            brokers: Mutex::new(HashMap::new()),
            submitters: Batchers::default(),
            delivery: Delivery {
                concurrency: delivery.concurrency.max(1),
                ..delivery
            },
            schedule: Mutex::new(Schedule::default()),
            wake: Notify::new(),
            expedited: Mutex::new(HashSet::new()),
            unstored: Mutex::new(HashMap::new()),
            unstored_end: Notify::new(),
            maybe_stored: Mutex::new(MaybeStored::default()),
        })
    }

    /// Queues `work` for `key` (none: nothing to do) and wakes the retry loop.
    fn schedule(&self, key: &str, work: Option<(i64, Option<ClusterId>)>) {
        if let Ok(mut schedule) = self.schedule.lock() {
            schedule.set(key, work);
        }
        self.wake.notify_one();
    }

    /// Fills the due queue from the store: once per process, before the retry loop starts.
    /// Returns how many relays are held.
    async fn load_schedule(&self) -> Result<usize> {
        let listing = self.store.list(RELAYS_PREFIX).await?;
        if let Ok(mut known) = self.maybe_stored.lock() {
            known.listed(&listing.kvs);
        }
        let mut held = 0;
        for kv in &listing.kvs {
            match decode::<RelayRecord>(&kv.key, &kv.value) {
                Ok(record) => {
                    self.schedule(&kv.key, work_of(&record, self.delivery.retention));
                    held += 1;
                }
                Err(err) => {
                    tracing::warn!(key = %kv.key, error = %err, "skipping an undecodable relay");
                }
            }
        }
        Ok(held)
    }

    pub fn identity(&self) -> &ClusterIdentity {
        &self.identity
    }

    /// The store the forwarder keeps its relays in.
    pub fn store(&self) -> &SharedStore {
        &self.store
    }

    /// Keeps the copy of discovery's records that relays are authorized against current,
    /// until `shutdown`. Without it running, every check reads discovery.
    pub async fn follow_discovery(&self, shutdown: Shutdown) {
        self.foreign_clusters
            .follow(self.discovery.clone(), shutdown, |_| {})
            .await;
    }

    /// The copy of discovery's records relays are authorized against.
    pub fn foreign_clusters(&self) -> &ForeignClusters {
        &self.foreign_clusters
    }

    /// The ends `ids` of a relay (clusters that are not full peers are absent). A record from
    /// the watch-fed copy is used when it lets the cluster be relayed for; any other is read
    /// from discovery, so a stale copy never refuses a relay.
    async fn peers(&self, ids: &[&ClusterId]) -> Result<Ends> {
        Ok(self
            .foreign_clusters
            .lookup_with(&self.discovery, ids, is_routable_full_peer, Ends::entry)
            .await?
            .into_iter()
            .collect())
    }

    /// [`Self::peers`] read from discovery: for withdrawals, which must know whether the
    /// destination is gone.
    async fn fresh_peers(&self, ids: &[&ClusterId]) -> Result<Ends> {
        Ok(foreign_clusters::read(&self.discovery, ids)
            .await?
            .iter()
            .map(Ends::entry)
            .collect())
    }

    /// The local discovery service's channel.
    pub fn discovery_channel(&self) -> TracedChannel {
        self.discovery.clone()
    }

    /// Cluster `expected`'s broker at `address` (over mutual TLS when on: the server must
    /// chain to `expected`'s pinned CA).
    fn broker(&self, address: &str, expected: &ClusterId) -> Result<BrokerClient<TracedChannel>> {
        Ok(BrokerClient::new(self.broker_channel(address, expected)?))
    }

    /// [`Self::broker`]'s `SubmitNetworkConfig`, batched with our other deliveries to it.
    fn submitter(&self, address: &str, expected: &ClusterId) -> Result<Submitter> {
        self.submitters
            .get_or_make((address.to_owned(), expected.to_string()), || {
                Ok(batch::submitter(self.broker_channel(address, expected)?))
            })
    }

    fn broker_channel(&self, address: &str, expected: &ClusterId) -> Result<TracedChannel> {
        let key = (address.to_owned(), expected.to_string());
        if let Ok(cache) = self.brokers.lock()
            && let Some(found) = cache.get(&key)
        {
            return Ok(found.clone());
        }
        let created = cluster_channel(
            self.tls.as_ref(),
            "broker",
            address,
            expected.as_str(),
            DELIVERY,
            &self.metrics,
        )?;
        if let Ok(mut cache) = self.brokers.lock() {
            cache.insert(key, created.clone());
        }
        Ok(created)
    }

    /// Both ends must be full peers of this hub with networking: exactly the clusters this
    /// hub advertises to each other in its Neighborhoods.
    async fn authorize(&self, origin: &ClusterId, destination: &ClusterId) -> Result<Ends> {
        let peers = self.peers(&[origin, destination]).await?;
        peers.broker_of(origin, "origin")?;
        peers.broker_of(destination, "destination")?;
        Ok(peers)
    }

    async fn load(&self, key: &str) -> Result<Option<(RelayRecord, i64)>> {
        let absent = self
            .maybe_stored
            .lock()
            .is_ok_and(|known| known.absent(key));
        if absent {
            return Ok(None);
        }
        Ok(match self.store.get(key).await? {
            Some(kv) => Some((decode(key, &kv.value)?, kv.mod_revision)),
            None => None,
        })
    }

    /// Replaces the record at `key` if it is still at `revision`; `None` deletes it. Every
    /// write of a relay goes through here, which keeps the due queue in step with the store.
    async fn save(&self, key: &str, revision: i64, record: Option<&RelayRecord>) -> Result<bool> {
        Ok(self.save_at(key, revision, record).await?.is_some())
    }

    /// [`Self::save`], returning the record's new revision when it committed: the revision of
    /// the transaction, which is the key's mod revision, so the caller need not read it back.
    async fn save_at(
        &self,
        key: &str,
        revision: i64,
        record: Option<&RelayRecord>,
    ) -> Result<Option<i64>> {
        let op = match record {
            Some(r) => Op::Put {
                key: key.to_owned(),
                value: encode(r)?,
                lease: None,
            },
            None => Op::Delete {
                key: key.to_owned(),
            },
        };
        if record.is_some()
            && let Ok(mut known) = self.maybe_stored.lock()
        {
            known.putting(key);
        }
        let done = self
            .store
            .txn(Txn {
                compares: vec![Compare::ModRevision {
                    key: key.to_owned(),
                    revision,
                }],
                success: vec![op],
                failure: vec![],
            })
            .await?;
        if done.succeeded {
            self.schedule(
                key,
                record.and_then(|r| work_of(r, self.delivery.retention)),
            );
        }
        if let Ok(mut known) = self.maybe_stored.lock() {
            match (done.succeeded, record) {
                (true, Some(_)) => known.put(key, done.revision),
                (true, None) => known.deleted(key, done.revision),
                // The key is not as this process believed: someone else wrote it (during a
                // rollout, the forwarder it replaces). Read it from now on.
                (false, _) => known.putting(key),
            }
        }
        if done.succeeded && record.is_none() {
            // A relay that is gone has no attempt left to expedite.
            self.take_expedited(key);
        }
        Ok(done.succeeded.then_some(done.revision))
    }

    /// Accepts a passthrough NetworkConfig and tries to deliver it at once.
    pub async fn relay(&self, nc: Passthrough) -> Result<(State, Option<RelayedStatus>, bool)> {
        self.relay_answering(nc, &OriginWait::default()).await
    }

    /// [`Self::relay`] for an origin that may stop waiting for the answer (`wait`): a status
    /// obtained after it stopped is reported through ReportNetworkConfigStatus instead.
    #[tracing::instrument(skip_all, fields(origin = %nc.origin.id, destination = %nc.destination.id, generation = nc.generation))]
    pub async fn relay_answering(
        &self,
        nc: Passthrough,
        wait: &OriginWait,
    ) -> Result<(State, Option<RelayedStatus>, bool)> {
        let peers = self.authorize(&nc.origin.id, &nc.destination.id).await?;
        if let Err(err) = self.expedite(&nc.destination.id, &nc.origin.id).await {
            tracing::debug!(error = %err, "could not expedite the relay the other way");
        }
        let key = relay_key(&nc.origin.id, &nc.destination.id);
        let mut contention = Contention::on(&self.store, "accepting a relay");
        // `None`: nothing is stored for this relay (the usual case: a relay is deleted once
        // answered). Its first attempt then runs before anything is written: answered in the
        // reply, the relay costs the store nothing; otherwise the attempt stores its outcome,
        // and an origin that stops waiting first has the relay stored before it is answered
        // PENDING ([`Self::stop_waiting`]). Either way the relay is stored before the origin
        // is told anything but its outcome (ADR 0012).
        let (record, revision) = loop {
            let existing = self.load(&key).await?;
            if let Some((held, _)) = &existing
                && held.generation > nc.generation
            {
                return Ok((held.state, held.status.clone(), false));
            }
            let now = now_nanos();
            let record = RelayRecord {
                origin: nc.origin.clone(),
                destination: nc.destination.clone(),
                spec: nc.spec.clone(),
                generation: nc.generation,
                held_generation: nc.held_generation,
                state: State::Pending,
                status: None,
                reason: String::new(),
                attempts: 0,
                last_error: String::new(),
                created_nanos: now,
                updated_nanos: now,
                next_attempt_nanos: now + nanos(INLINE_GRACE),
                trace: traceparent_of(&tracing::Span::current()),
            };
            let Some((_, revision)) = existing else {
                break (record, None);
            };
            if let Some(revision) = self.save_at(&key, revision, Some(&record)).await? {
                break (record, Some(revision));
            }
            contention.lost().await?;
        };
        // Per relay, debug: a hub relays n·(n-1) of them to converge; ListRelays and the
        // traces show them one by one.
        tracing::debug!(origin = %nc.origin.id, destination = %nc.destination.id, stored = revision.is_some(), "accepted a relay");
        let _running = match revision {
            Some(_) => None,
            None => {
                *wait.unstored.lock().await = Some((key.clone(), record.clone()));
                Some(Unstored::start(self, &key))
            }
        };
        let outcome = self
            .attempt(&key, record, revision, Some(wait), Some(peers))
            .await?;
        Ok((outcome.0, outcome.1, true))
    }

    /// Counts a first attempt with nothing stored for `key` in or out (see [`Unstored`]).
    fn count_unstored(&self, key: &str, starting: bool) {
        let Ok(mut unstored) = self.unstored.lock() else {
            return;
        };
        if starting {
            *unstored.entry(key.to_owned()).or_default() += 1;
        } else if let Some(n) = unstored.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                unstored.remove(key);
                self.unstored_end.notify_waiters();
            }
        }
    }

    /// Returns once no first attempt with nothing stored runs for `key` (each is bounded by the
    /// delivery timeout).
    async fn unstored_ended(&self, key: &str) {
        loop {
            let ended = self.unstored_end.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let running = self
                .unstored
                .lock()
                .is_ok_and(|unstored| unstored.contains_key(key));
            if !running {
                return;
            }
            ended.await;
        }
    }

    /// Whether a stored relay wins over the outcome of a first attempt of generation `ours`
    /// that started with nothing stored: a newer NetworkConfig, or a withdrawal.
    fn stored_wins(held: &RelayRecord, ours: i64) -> bool {
        held.generation > ours || held.state == State::Withdrawing
    }

    /// The origin stops waiting for the first attempt of its relay (an item of a RelayBatch
    /// past its wait). Returns whether it did; `false`: the attempt has the answer and replies
    /// in a moment. A relay nothing is stored for yet is stored first, so that the PENDING the
    /// origin is then answered means accepted (ADR 0012); the attempt stores its outcome over
    /// it when it ends.
    pub async fn stop_waiting(&self, wait: &OriginWait) -> Result<bool> {
        if !wait.abandon() {
            return Ok(false);
        }
        let mut unstored = wait.unstored.lock().await;
        if let Some((key, record)) = unstored.take() {
            self.store_first(&key, &record, |held| {
                held.generation == record.generation || Self::stored_wins(held, record.generation)
            })
            .await?;
        }
        Ok(true)
    }

    /// Stores `record` at `key` unless `keep` says the record stored there wins.
    async fn store_first(
        &self,
        key: &str,
        record: &RelayRecord,
        keep: impl Fn(&RelayRecord) -> bool,
    ) -> Result<()> {
        let mut contention = Contention::on(&self.store, "storing a relay");
        loop {
            let current = self.load(key).await?;
            if current.as_ref().is_some_and(|(held, _)| keep(held)) {
                return Ok(());
            }
            if self
                .save(key, current.map_or(0, |(_, r)| r), Some(record))
                .await?
            {
                return Ok(());
            }
            contention.lost().await?;
        }
    }

    /// The relay from `origin` to `destination` is due at once if it waits for a retry: it was
    /// called when `destination` just relayed towards `origin`, so `destination` knows `origin`
    /// now, and the usual reason for the earlier failure (the NetworkConfig overtook the
    /// Neighborhood) is gone. Saves waiting for the backoff. A relay with an attempt in flight
    /// (which may be failing for that very reason right now) is marked, so that a failure of
    /// that attempt is retried at once too: the event it waits for has happened.
    async fn expedite(&self, origin: &ClusterId, destination: &ClusterId) -> Result<()> {
        let key = relay_key(origin, destination);
        let now = now_nanos();
        // A first attempt running before anything is stored (see `relay_answering`) is not
        // found here: if it fails, it waits only the first, short backoff.
        if let Some((mut record, revision)) = self.load(&key).await?
            && record.state == State::Pending
        {
            if record.attempts > 0 && record.next_attempt_nanos > now {
                record.next_attempt_nanos = now;
                // Saving queues it for now (and wakes the retry loop).
                self.save(&key, revision, Some(&record)).await?;
            } else if let Ok(mut expedited) = self.expedited.lock() {
                expedited.insert(key);
            }
        }
        Ok(())
    }

    /// Whether a failed attempt of `key` is to be retried at once (see [`Self::expedite`]).
    fn take_expedited(&self, key: &str) -> bool {
        self.expedited
            .lock()
            .map(|mut expedited| expedited.remove(key))
            .unwrap_or(false)
    }

    /// The destination's status for a NetworkConfig it received through us.
    pub async fn relay_status(
        &self,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        status: RelayedStatus,
    ) -> Result<State> {
        let peers = self.authorize(&origin.id, &destination.id).await?;
        let key = relay_key(&origin.id, &destination.id);
        let mut contention = Contention::on(&self.store, "accepting a relayed status");
        loop {
            let (mut record, revision) = match self.load(&key).await? {
                Some(found) => found,
                None => {
                    return Err(Error::NotFound(format!(
                        "no relay from {} to {} is in flight (already completed, or never relayed)",
                        origin.id, destination.id
                    )));
                }
            };
            if status.observed_generation < record.generation {
                return Ok(record.state);
            }
            record.state = State::StatusPending;
            record.status = Some(status.clone());
            record.attempts = 0;
            record.next_attempt_nanos = now_nanos() + nanos(INLINE_GRACE);
            if let Some(revision) = self.save_at(&key, revision, Some(&record)).await? {
                return Ok(self
                    .attempt(&key, record, Some(revision), None, Some(peers))
                    .await?
                    .0);
            }
            contention.lost().await?;
        }
    }

    /// The origin withdraws its NetworkConfig: drop any pending relay and tell the destination.
    pub async fn relay_withdrawal(
        &self,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        reason: String,
    ) -> Result<State> {
        // The destination may already be gone from our peers (that is often why the origin
        // withdraws): then there is nobody left to tell.
        let peers = self.fresh_peers(&[&origin.id, &destination.id]).await?;
        peers.broker_of(&origin.id, "origin")?;
        let key = relay_key(&origin.id, &destination.id);
        // A first attempt delivering with nothing stored ends (and stores its outcome) first:
        // stored after the withdrawal, a retry would deliver the NetworkConfig again.
        self.unstored_ended(&key).await;
        if peers.broker_of(&destination.id, "destination").is_err() {
            if let Some((_, revision)) = self.load(&key).await? {
                self.save(&key, revision, None).await?;
            }
            return Ok(State::Completed);
        }
        let now = now_nanos();
        let record = RelayRecord {
            origin: origin.clone(),
            destination: destination.clone(),
            spec: match self.load(&key).await? {
                Some((held, _)) => held.spec,
                None => {
                    return self
                        .withdraw_without_record(origin, destination, &reason)
                        .await;
                }
            },
            generation: 0,
            held_generation: 0,
            state: State::Withdrawing,
            status: None,
            reason,
            attempts: 0,
            last_error: String::new(),
            created_nanos: now,
            updated_nanos: now,
            next_attempt_nanos: now + nanos(INLINE_GRACE),
            trace: traceparent_of(&tracing::Span::current()),
        };
        let mut contention = Contention::on(&self.store, "accepting a withdrawal");
        loop {
            let revision = self.load(&key).await?.map_or(0, |(_, r)| r);
            if let Some(revision) = self.save_at(&key, revision, Some(&record)).await? {
                return Ok(self
                    .attempt(&key, record, Some(revision), None, None)
                    .await?
                    .0);
            }
            contention.lost().await?;
        }
    }

    /// A withdrawal with no relay record to hold it: delivered once, synchronously; the
    /// origin retries on failure.
    async fn withdraw_without_record(
        &self,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        reason: &str,
    ) -> Result<State> {
        let peers = self.fresh_peers(&[&destination.id]).await?;
        let broker = peers.broker_of(&destination.id, "destination")?;
        self.send_withdrawal(&broker, origin, destination, reason)
            .await?;
        Ok(State::Completed)
    }

    async fn send_withdrawal(
        &self,
        broker: &str,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        reason: &str,
    ) -> Result<()> {
        self.broker(broker, &destination.id)?
            .withdraw_network_config(WithdrawNetworkConfigRequest {
                network_config: Some(pb::NetworkConfigRef {
                    name: network_config_name(&origin.id, &destination.id),
                    origin: Some(identity_to_pb(origin)),
                    destination: Some(identity_to_pb(destination)),
                    via: Some(identity_to_pb(&self.identity)),
                }),
                reason: reason.to_owned(),
            })
            .await
            .map_err(Error::from)?;
        Ok(())
    }

    /// One delivery attempt of `record` (stored at `revision`; `None`: nothing stored yet, see
    /// [`Self::relay_answering`]), recording the outcome.
    /// `answering_origin` is set when the origin waits on this attempt (its Relay call): a
    /// status obtained now goes back in that reply instead of through a later report.
    /// Returns the state after the attempt and the destination's status when known.
    async fn attempt(
        &self,
        key: &str,
        mut record: RelayRecord,
        revision: Option<i64>,
        answering_origin: Option<&OriginWait>,
        known: Option<Ends>,
    ) -> Result<(State, Option<RelayedStatus>)> {
        // Both ends, as just checked by the caller when it did.
        let peers = match known {
            Some(peers) => peers,
            None => {
                self.peers(&[&record.origin.id, &record.destination.id])
                    .await?
            }
        };
        let result: Result<Option<State>> = async {
            match record.state {
                State::Pending | State::Delivered => {
                    let broker = peers.broker_of(&record.destination.id, "destination")?;
                    let answer = self
                        .submitter(&broker, &record.destination.id)?
                        .call(SubmitNetworkConfigRequest {
                            network_config: Some(pb::NetworkConfig {
                                name: network_config_name(
                                    &record.origin.id,
                                    &record.destination.id,
                                ),
                                origin: Some(identity_to_pb(&record.origin)),
                                destination: Some(identity_to_pb(&record.destination)),
                                via: Some(identity_to_pb(&self.identity)),
                                spec: Some(record.spec.to_proto()),
                                status: None,
                                generation: record.generation,
                                update_time: None,
                                held_generation: record.held_generation,
                            }),
                        })
                        .await
                        .map_err(Error::from)?;
                    let decided = answer.status.filter(|s| {
                        matches!(
                            pb::NetworkConfigState::try_from(s.state),
                            Ok(pb::NetworkConfigState::Processed
                                | pb::NetworkConfigState::Rejected)
                        )
                    });
                    match decided {
                        Some(s) => {
                            record.status = Some(RelayedStatus::from_pb(s));
                            // The origin is told in the Relay reply (when it waits on this
                            // attempt) or through ReportNetworkConfigStatus, rejections too.
                            Ok(Some(State::StatusPending))
                        }
                        None => Ok(Some(State::Delivered)),
                    }
                }
                State::StatusPending => {
                    let broker = peers.broker_of(&record.origin.id, "origin")?;
                    let status = record
                        .status
                        .clone()
                        .ok_or_else(|| Error::Internal("a status relay without a status".into()))?;
                    self.broker(&broker, &record.origin.id)?
                        .report_network_config_status(ReportNetworkConfigStatusRequest {
                            network_config: Some(pb::NetworkConfigRef {
                                name: network_config_name(
                                    &record.origin.id,
                                    &record.destination.id,
                                ),
                                origin: Some(identity_to_pb(&record.origin)),
                                destination: Some(identity_to_pb(&record.destination)),
                                via: Some(identity_to_pb(&self.identity)),
                            }),
                            status: Some(status.to_pb()),
                        })
                        .await
                        .map_err(Error::from)?;
                    Ok(None)
                }
                State::Withdrawing => {
                    let broker = peers.broker_of(&record.destination.id, "destination")?;
                    self.send_withdrawal(
                        &broker,
                        &record.origin,
                        &record.destination,
                        &record.reason,
                    )
                    .await?;
                    Ok(None)
                }
                State::Failed => Ok(Some(State::Failed)),
                State::Completed => Ok(None),
            }
        }
        .await;

        let now = now_nanos();
        // Taken on every outcome, so a marker never outlives the attempt it was meant for.
        let expedited = self.take_expedited(key);
        let (origin_id, destination_id) = (record.origin.id.clone(), record.destination.id.clone());
        let next = match result {
            // Done: nothing left to keep.
            Ok(None) => None,
            Ok(Some(State::StatusPending)) if answering_origin.is_some_and(OriginWait::answer) => {
                // The origin gets the status in its Relay reply: complete.
                let status = record.status.clone();
                if let Some(revision) = revision {
                    self.save(key, revision, None).await?;
                }
                tracing::debug!(origin = %record.origin.id, destination = %record.destination.id, "relay completed");
                let rejected = status
                    .as_ref()
                    .is_some_and(|s| s.state == pb::NetworkConfigState::Rejected as i32);
                return Ok((
                    if rejected {
                        State::Failed
                    } else {
                        State::Completed
                    },
                    status,
                ));
            }
            Ok(Some(state)) => {
                record.state = state;
                record.attempts = 0;
                record.last_error.clear();
                record.next_attempt_nanos = if state == State::StatusPending {
                    now
                } else {
                    0
                };
                Some(record)
            }
            // Given up for good only when the other end refused the content itself; anything
            // else (unreachable, not peered yet, a bug a restart may clear) is retried.
            Err(err) if err.is_permanent() => {
                tracing::warn!(origin = %record.origin.id, destination = %record.destination.id, error = %err, "relay refused for good");
                record.state = State::Failed;
                record.last_error = err.to_string();
                record.next_attempt_nanos = 0;
                Some(record)
            }
            Err(err) => {
                record.attempts += 1;
                record.last_error = err.to_string();
                record.next_attempt_nanos = if expedited {
                    // The other direction arrived meanwhile: what this attempt was refused
                    // for is likely gone.
                    now
                } else {
                    let wait = self.delivery.retry_policy().delay_after(record.attempts);
                    now.saturating_add(nanos(wait))
                };
                tracing::debug!(origin = %record.origin.id, destination = %record.destination.id, attempts = record.attempts, error = %err, "relay delivery will be retried");
                Some(record)
            }
        };
        let state = next.as_ref().map_or(State::Completed, |r| r.state);
        let status = next.as_ref().and_then(|r| r.status.clone());
        match (&next, revision) {
            (Some(r), Some(revision)) => {
                let mut stored = r.clone();
                stored.updated_nanos = now;
                self.save(key, revision, Some(&stored)).await?;
            }
            (Some(r), None) => {
                // A first attempt with nothing stored: its outcome is stored now, over what an
                // origin that stopped waiting had stored (the same relay, still pending), never
                // over a newer generation or a withdrawal.
                let mut stored = r.clone();
                stored.updated_nanos = now;
                // Held while storing: an origin that stops waiting meanwhile finds the relay
                // stored, not a stale copy to store over this outcome.
                let _unstored = match answering_origin {
                    Some(wait) => {
                        let mut unstored = wait.unstored.lock().await;
                        unstored.take();
                        Some(unstored)
                    }
                    None => None,
                };
                self.store_first(key, &stored, |held| {
                    Self::stored_wins(held, stored.generation)
                })
                .await?;
            }
            (None, Some(revision)) => {
                self.save(key, revision, None).await?;
                tracing::debug!(origin = %origin_id, destination = %destination_id, "relay completed");
            }
            (None, None) => {
                tracing::debug!(origin = %origin_id, destination = %destination_id, "relay completed");
            }
        }
        Ok((state, status))
    }

    /// Does the work queued for `key` if it is due: one delivery attempt, or deleting a relay
    /// kept past its retention. Reads the record afresh (it may have changed since it was
    /// queued) and queues it again if it is not due after all.
    async fn process(&self, key: &str) -> Result<()> {
        let Some((record, revision)) = self.load(key).await? else {
            return Ok(());
        };
        let work = work_of(&record, self.delivery.retention);
        match work {
            Some((due, _)) if due > now_nanos() => self.schedule(key, work),
            None => {}
            Some((_, None)) => {
                let deleted = self.save(key, revision, None).await?;
                if deleted {
                    tracing::info!(origin = %record.origin.id, destination = %record.destination.id, state = ?record.state, last_error = %record.last_error, "deleted a relay kept past its retention");
                }
            }
            Some((_, Some(_))) => {
                let span = resumed_span("relay retry", record.trace.as_deref());
                self.attempt(key, record, Some(revision), None, None)
                    .instrument(span)
                    .await?;
            }
        }
        Ok(())
    }

    /// [`Self::process`], and on a failure of our own (store, local discovery) the relay is
    /// queued again shortly rather than dropped from the queue.
    async fn process_or_requeue(&self, key: &str, target: Option<ClusterId>) {
        if let Err(err) = self.process(key).await {
            tracing::warn!(key = %key, error = %err, "relay attempt failed");
            let due = now_nanos().saturating_add(nanos(LOCAL_RETRY.delay_after(1)));
            if let Ok(mut schedule) = self.schedule.lock()
                && !schedule.entries.contains_key(key)
            {
                schedule.set(key, Some((due, target)));
            }
        }
    }

    /// Moves relays stored in the old key layout to the current one ([`crate::migrate`]);
    /// returns how many moved. Run on start, before serving.
    pub async fn migrate_relay_keys(&self) -> Result<usize> {
        crate::migrate::relay_keys(&self.store).await
    }

    /// Relays still held, optionally for one cluster.
    pub async fn list(&self, cluster: Option<&ClusterId>) -> Result<Vec<RelayRecord>> {
        let listing = self.store.list(RELAYS_PREFIX).await?;
        let mut out = Vec::new();
        for kv in listing.kvs {
            let record: RelayRecord = decode(&kv.key, &kv.value)?;
            if cluster.is_none_or(|c| record.origin.id == *c || record.destination.id == *c) {
                out.push(record);
            }
        }
        Ok(out)
    }
}

/// Runs the retry loop until `shutdown`: fills the due queue from the store, then runs each
/// relay's work when it is due, at most `--delivery-concurrency` at once and one at a time
/// per cluster called. Attempts still running at shutdown are dropped (the records stay and
/// the next start retries them).
pub async fn retry_loop(forwarder: Arc<Forwarder>, shutdown: Shutdown) {
    let mut backoff = forwarder.delivery.retry_policy().backoff();
    loop {
        match forwarder.load_schedule().await {
            Ok(held) => {
                tracing::info!(relays = held, "relay retries started");
                break;
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot read the relays; retrying");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                }
            }
        }
    }
    let mut running = tokio::task::JoinSet::new();
    // The cluster each running task calls, by task.
    let mut calling: HashMap<tokio::task::Id, ClusterId> = HashMap::new();
    let mut busy: HashSet<ClusterId> = HashSet::new();
    loop {
        let free = forwarder.delivery.concurrency.saturating_sub(running.len());
        let (ready, next) = match forwarder.schedule.lock() {
            Ok(mut schedule) => schedule.take_due(now_nanos(), &mut busy, free),
            Err(_) => return,
        };
        for (key, target) in ready {
            let worker = forwarder.clone();
            let cluster = target.clone();
            // With the current subscriber: in the lab, the relay's spans are this forwarder's.
            let task = running.spawn(
                tracing::instrument::WithSubscriber::with_current_subscriber(async move {
                    worker.process_or_requeue(&key, target).await
                }),
            );
            if let Some(cluster) = cluster {
                calling.insert(task.id(), cluster);
            }
        }
        let wait = next.map_or(IDLE, |due| {
            Duration::from_nanos(u64::try_from(due - now_nanos()).unwrap_or(0)).min(IDLE)
        });
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = forwarder.wake.notified() => {}
            Some(done) = running.join_next_with_id() => {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(err) => {
                        tracing::warn!(error = %err, "a relay attempt ended abnormally");
                        err.id()
                    }
                };
                if let Some(cluster) = calling.remove(&id) {
                    busy.remove(&cluster);
                }
            }
            () = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ClusterId {
        ClusterId::parse("id", s).expect("valid id")
    }

    #[test]
    fn a_key_is_known_absent_only_after_the_listing_and_a_delete_after_its_puts() {
        let mut known = MaybeStored::default();
        assert!(
            !known.absent("relays/a/b"),
            "nothing is known before the listing"
        );
        known.putting("relays/a/b");
        known.listed(&[]);
        assert!(!known.absent("relays/a/b"), "a put in flight may be stored");
        assert!(known.absent("relays/x/y"));
        // A delete committing while a put of the same key is unconfirmed leaves it in.
        known.deleted("relays/a/b", 5);
        assert!(!known.absent("relays/a/b"));
        known.put("relays/a/b", 7);
        // An older delete (its removal ran late) does not forget a newer put.
        known.deleted("relays/a/b", 6);
        assert!(!known.absent("relays/a/b"));
        known.deleted("relays/a/b", 8);
        assert!(known.absent("relays/a/b"));
    }

    #[test]
    fn the_queue_hands_out_one_relay_per_cluster_and_due_ones_only() {
        let mut schedule = Schedule::default();
        schedule.set("relays/a/dead", Some((1, Some(id("dead")))));
        schedule.set("relays/b/dead", Some((2, Some(id("dead")))));
        schedule.set("relays/a/up", Some((3, Some(id("up")))));
        schedule.set("relays/x/gone", Some((4, None)));
        schedule.set("relays/a/later", Some((50, Some(id("later")))));
        // Rescheduling replaces: not handed out twice.
        schedule.set("relays/a/up", Some((5, Some(id("up")))));

        let mut busy = HashSet::new();
        let (taken, next) = schedule.take_due(10, &mut busy, 10);
        let keys: Vec<&str> = taken.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["relays/a/dead", "relays/x/gone", "relays/a/up"]);
        assert_eq!(next, Some(50));
        assert!(busy.contains(&id("dead")) && busy.contains(&id("up")));

        // The other relay to the busy cluster waits for it; once free it is handed out.
        let (taken, _) = schedule.take_due(10, &mut busy, 10);
        assert!(taken.is_empty(), "{taken:?}");
        busy.remove(&id("dead"));
        let (taken, _) = schedule.take_due(10, &mut busy, 10);
        assert_eq!(taken, [("relays/b/dead".to_owned(), Some(id("dead")))]);

        // No more than `free` at once.
        schedule.set("relays/p/q1", Some((1, Some(id("q1")))));
        schedule.set("relays/p/q2", Some((1, Some(id("q2")))));
        let (taken, _) = schedule.take_due(10, &mut HashSet::new(), 1);
        assert_eq!(taken.len(), 1);
    }
}
