//! The Neighborhood sender (ADR 0006): a reconciler that makes every full peer P
//! with networking enabled hold "our other networked full peers, minus P".
//!
//! Desired state is computed from the `clusters/` records; what each peer acknowledged is in
//! `outbox/<peer>`. A pass sends to every peer whose acknowledged list differs (a new
//! generation, above everything it was sent before), an empty list to former peers still in the
//! outbox (withdrawal), and, on the periodic resync, re-sends the acknowledged generation to
//! everyone (idempotent; heals a peer that lost its store). Passes run on every store change
//! under `clusters/`, on the resync tick, and when a failed peer's backoff expires. All state is
//! in the store, so a restarted process simply runs a pass.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt as _, StreamExt as _};
use tokio::time::Instant;
use trellis_api::ClusterId;
use trellis_error::{Error, Result};
use trellis_runtime::resync::Resync;
use trellis_runtime::retry::{KeyedBackoff, RetryPolicy};
use trellis_runtime::{Shutdown, timer};
use trellis_store::WatchStream;

use crate::core::{Discovery, Snapshot};
use crate::records::{CLUSTERS_PREFIX, Neighbor, Outbox};
use crate::remote::{self, Outgoing};

/// Timing of the sender.
#[derive(Debug, Clone, Copy)]
pub struct SenderTiming {
    /// Re-send everything this often even without changes.
    pub resync: Duration,
    /// First retry delay after a failed send; doubles per failure.
    pub retry_initial: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
}

impl SenderTiming {
    /// The retry policy of failed sends: `retry_initial` doubling to `retry_max`.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::exponential(self.retry_initial, self.retry_max)
    }
}

/// The peers we failed to reach (and ourselves, for a pass that failed): when to try again.
#[derive(Debug)]
struct Retries {
    backoff: KeyedBackoff<ClusterId>,
    /// "Stale" answers in a row, per peer: after [`STALE_BEFORE_BACKOFF`] they back off like
    /// failures.
    stale: BTreeMap<ClusterId, u32>,
}

/// A peer may answer "stale" once legitimately (our store was restored from an old backup:
/// we renumber above its generation and send again at once); more in a row means it is buggy
/// or hostile, and re-sending at once would make the hub spin writing its store.
const STALE_BEFORE_BACKOFF: u32 = 2;

/// Largest `current_generation` a peer may claim. Generations come from store revisions, so
/// an honest peer is nowhere near it; the margin keeps every `+ 1` we do above it far from
/// `i64::MAX`.
const MAX_PEER_GENERATION: i64 = i64::MAX / 4;

impl Retries {
    fn new(timing: &SenderTiming) -> Self {
        Self {
            backoff: KeyedBackoff::new(timing.retry_policy()),
            stale: BTreeMap::new(),
        }
    }

    /// A failure of `peer`: it backs off; returns its failures in a row.
    fn failed(&mut self, peer: ClusterId, now: Instant) -> u32 {
        self.stale.remove(&peer);
        self.backoff.failed(peer, now)
    }

    /// A "stale" answer of `peer`: sent to again at once, unless it keeps answering so, when
    /// it backs off like a failure. Returns the stale answers in a row.
    fn stale(&mut self, peer: ClusterId, now: Instant) -> u32 {
        let stale = self.stale.get(&peer).map_or(0, |s| *s).saturating_add(1);
        self.stale.insert(peer.clone(), stale);
        if stale >= STALE_BEFORE_BACKOFF {
            self.backoff.failed(peer, now);
        } else {
            self.backoff.retry_now(peer, now);
        }
        stale
    }

    /// A success (or a reason to try again at once): `peer` no longer backs off. Whether it
    /// did.
    fn reset(&mut self, peer: &ClusterId) -> bool {
        self.stale.remove(peer);
        self.backoff.reset(peer)
    }

    fn retain(&mut self, mut keep: impl FnMut(&ClusterId) -> bool) {
        self.stale.retain(|peer, _| keep(peer));
        self.backoff.retain(keep);
    }

    /// When `peer` is due again, if it backs off.
    fn due_at(&self, peer: &ClusterId) -> Option<Instant> {
        self.backoff.due_at(peer)
    }

    /// Whether `peer` backs off and is not due at `now`.
    fn waiting(&self, peer: &ClusterId, now: Instant) -> bool {
        self.due_at(peer).is_some_and(|at| at > now)
    }
}

/// What one pass decided to send to one peer.
#[derive(Debug)]
struct Job {
    address: String,
    outgoing: Outgoing,
    /// [`Outbox::digest_of`] the neighbours sent.
    digest: String,
    /// The outbox entry and its revision (0 = none yet).
    outbox: Option<(Outbox, i64)>,
    /// The peer is no longer a networked full peer: withdraw, then forget it.
    farewell: bool,
}

/// Runs the sender until `shutdown`.
pub async fn run(core: Arc<Discovery>, timing: SenderTiming, shutdown: Shutdown) {
    let mut retries = Retries::new(&timing);
    let mut periodic = Resync::new(timing.resync);
    let mut changes = None;
    loop {
        if changes.is_none() {
            // Watch before reading, so no change slips between the pass and the wait.
            match core.store().watch(CLUSTERS_PREFIX, None).await {
                Ok(stream) => changes = Some(stream),
                Err(err) => {
                    tracing::warn!(error = %err, "cannot watch foreign clusters; relying on the periodic resync")
                }
            }
        }
        let started = Instant::now();
        let resync = periodic.due(started);
        let outcome = pass(&core, resync, &mut retries).await;
        if resync {
            periodic.ran(started, Instant::now());
        }
        if let Err(err) = outcome {
            tracing::warn!(error = %err, "neighborhood pass failed; retrying");
            retries.failed(core.identity().id.clone(), Instant::now());
        } else {
            retries.reset(&core.identity().id);
        }
        let wake = retries
            .backoff
            .next_due()
            .map_or(periodic.next(), |due| due.min(periodic.next()));
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = timer::until(wake) => break,
                heard = core.heard() => {
                    // A peer we are backing off from just spoke to us as a peer: whatever it
                    // refused for not knowing us yet, it accepts now. Not a backoff matter.
                    let mut retry = false;
                    for peer in heard {
                        retry |= retries.reset(&peer);
                    }
                    if retry {
                        break;
                    }
                }
                event = async {
                    match changes.as_mut() {
                        Some(stream) => stream.next().await,
                        None => std::future::pending().await,
                    }
                } => {
                    match event {
                        Some(Ok(event)) if !concerns_sender(&event) => continue,
                        Some(Ok(_)) => {}
                        _ => changes = None,
                    }
                    if !let_burst_settle(&mut changes, &shutdown).await {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

/// Whether a pass sends to a peer: when what it should hold changed, on the periodic resync,
/// and when a failed send to it is due again (a failed resync re-send is retried like any
/// other send) — never while its backoff runs. A due retry must be acted on: the loop sleeps
/// until the earliest backoff, so one left due would wake it at once, pass after pass (at 254
/// leaves every leaf spun so between two resyncs, decoding its whole table each time).
fn sends(changed: bool, resync: bool, due: Option<Instant>, now: Instant) -> bool {
    match due {
        Some(at) if at > now => false,
        Some(_) => true,
        None => changed || resync,
    }
}

/// How long the sender lets a burst of changes accumulate before a pass (ADR 0006).
pub const COALESCE: Duration = Duration::from_millis(100);

/// The longest a burst that keeps going holds a pass back.
pub const COALESCE_MAX: Duration = Duration::from_millis(500);

/// After a change that concerns the sender: waits [`COALESCE`], takes every event queued
/// meanwhile, and waits again while those include more changes that concern it, for at most
/// [`COALESCE_MAX`] in all. A burst (a hub's leaves joining one after another) is then one pass
/// per half second rather than one per 100 ms: each pass sends every peer whose list changed
/// all its neighbours, so at 254 leaves the passes of a burst were 4 % of the leaves' CPU and
/// a third of the hub discovery's. A lone change still waits only [`COALESCE`]. `false` when
/// `shutdown` came first; `changes` becomes `None` when its stream ends or fails.
async fn let_burst_settle(changes: &mut Option<WatchStream>, shutdown: &Shutdown) -> bool {
    let until = Instant::now() + COALESCE_MAX;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = timer::until(until.min(Instant::now() + COALESCE)) => {}
        }
        let mut more = false;
        while let Some(stream) = changes.as_mut() {
            match stream.next().now_or_never() {
                Some(Some(Ok(event))) => more |= concerns_sender(&event),
                Some(_) => *changes = None,
                None => break,
            }
        }
        if !more || Instant::now() >= until {
            return true;
        }
    }
}

/// Whether a change under `clusters/` can change what the sender sends: the Neighborhoods are
/// made of full records only, so an induced record (every record a hub's Neighborhood creates
/// or refreshes) that was not full before needs no pass.
fn concerns_sender(event: &trellis_store::WatchEvent) -> bool {
    match event {
        trellis_store::WatchEvent::Put(kv) => {
            trellis_store::record::decode::<crate::records::RecordHead>(&kv.key, &kv.value)
                .map_or(true, |head| head.full_now_or_before())
        }
        trellis_store::WatchEvent::Delete { .. } => true,
    }
}

/// The Neighborhood each networked full peer should hold: the other networked full peers.
/// With induced peering off every list is empty: peers still get (empty) Neighborhoods, which
/// withdraws anything an earlier run introduced.
///
/// Each peer's list is every other peer, so the lists hold n(n-1) entries in all: a pass
/// builds one only for a peer it sends to, and compares the others by digest, from one hash
/// per peer ([`Neighbor::hash64`]).
struct Desired {
    /// Every networked full peer, ordered by ID: its discovery address and itself as a
    /// neighbour, with its hash.
    peers: Vec<(ClusterId, String, Neighbor, u64)>,
    induced: bool,
}

impl Desired {
    fn of(snapshot: &Snapshot, induced: bool) -> Self {
        let peers = snapshot
            .records
            .values()
            .filter(|(r, _)| r.is_networked_full_peer())
            .map(|(r, _)| {
                let neighbor = Neighbor {
                    identity: r.identity.clone(),
                    addresses: r
                        .full
                        .as_ref()
                        .map(|f| f.addresses.clone())
                        .unwrap_or_default(),
                };
                let hash = neighbor.hash64();
                (
                    r.identity.id.clone(),
                    r.discovery_endpoint().to_owned(),
                    neighbor,
                    hash,
                )
            })
            .collect();
        Self { peers, induced }
    }

    fn contains(&self, peer: &ClusterId) -> bool {
        self.peers.binary_search_by(|(id, ..)| id.cmp(peer)).is_ok()
    }

    /// The entries of every peer but the one at `index`.
    fn others(&self, index: usize) -> impl Iterator<Item = &(ClusterId, String, Neighbor, u64)> {
        let induced = self.induced;
        self.peers
            .iter()
            .enumerate()
            .filter(move |(i, _)| induced && *i != index)
            .map(|(_, entry)| entry)
    }

    /// [`Outbox::digest_of`] the list of the peer at `index`.
    fn digest(&self, index: usize) -> String {
        Outbox::digest_of_hashes(self.others(index).map(|(.., hash)| *hash))
    }

    /// The list of the peer at `index`.
    fn neighbors(&self, index: usize) -> Vec<Neighbor> {
        self.others(index).map(|(_, _, n, _)| n.clone()).collect()
    }
}

async fn pass(core: &Arc<Discovery>, resync: bool, retries: &mut Retries) -> Result<()> {
    // Outboxes first: their peers' records are read in full even when no longer full peers'
    // (only this loop writes outboxes).
    let mut outboxes = core.outboxes().await?;
    let snapshot = core.sender_snapshot(|id| outboxes.contains_key(id)).await?;
    let now = Instant::now();
    let mut jobs = Vec::new();
    let next_generation = |ob: Option<&(Outbox, i64)>| {
        ob.map_or(snapshot.revision, |(o, _)| {
            snapshot
                .revision
                .max(o.generation.saturating_add(1))
                .max(o.floor)
        })
    };
    let desired = Desired::of(&snapshot, core.induced_peering());
    // A peer neither desired nor holding anything from us has nothing left to retry: its
    // backoff would only wake the loop.
    retries.retain(|peer| {
        peer == &core.identity().id || desired.contains(peer) || outboxes.contains_key(peer)
    });
    for (index, (peer, address, ..)) in desired.peers.iter().enumerate() {
        let outbox = outboxes.remove(peer);
        let digest = desired.digest(index);
        let changed = outbox.as_ref().is_none_or(|(o, _)| o.digest != digest);
        if !sends(changed, resync, retries.due_at(peer), now) {
            continue;
        }
        if address.is_empty() {
            tracing::warn!(cluster.id = %peer, "full peer advertised no discovery address; cannot send its neighborhood");
            continue;
        }
        let generation = if changed {
            next_generation(outbox.as_ref())
        } else {
            outbox
                .as_ref()
                .map_or(snapshot.revision, |(o, _)| o.generation)
        };
        let Some((record, _)) = snapshot.records.get(peer) else {
            continue;
        };
        jobs.push(Job {
            address: address.clone(),
            outgoing: Outgoing {
                sender: core.identity().clone(),
                recipient: record.identity.clone(),
                neighbors: desired.neighbors(index),
                generation,
            },
            digest,
            outbox,
            farewell: false,
        });
    }
    // Former peers still holding something from us: tell them it is empty.
    for (peer, (outbox, revision)) in outboxes {
        let address = snapshot
            .records
            .get(&peer)
            .map(|(r, _)| r.discovery_endpoint().to_owned())
            .unwrap_or_default();
        if address.is_empty() {
            // Forgotten entirely: nobody left to tell.
            core.forget_outbox(&peer, revision).await?;
            continue;
        }
        let pinned = snapshot
            .records
            .get(&peer)
            .and_then(|(r, _)| r.full.as_ref())
            .is_some_and(|f| !f.ca_certificate.is_empty());
        if core.tls().is_some() && !pinned {
            // With mutual TLS an unpeered cluster can no longer be reached (unpeering cleared
            // its CA, and it dropped ours); its unpeering already withdrew what we introduced.
            tracing::info!(cluster.id = %peer, "former peer no longer pinned; dropping its neighborhood outbox");
            core.forget_outbox(&peer, revision).await?;
            continue;
        }
        if retries.waiting(&peer, now) {
            continue;
        }
        let generation = next_generation(Some(&(outbox.clone(), revision)));
        jobs.push(Job {
            address,
            outgoing: Outgoing {
                sender: core.identity().clone(),
                recipient: outbox.peer.clone(),
                neighbors: Vec::new(),
                generation,
            },
            digest: Outbox::digest_of(&[]),
            outbox: Some((outbox, revision)),
            farewell: true,
        });
    }
    let results = futures::future::join_all(jobs.into_iter().map(|job| async move {
        let result =
            remote::publish_neighborhood(core.tls(), core.metrics(), &job.address, &job.outgoing)
                .await;
        (job, result)
    }))
    .await;
    for (job, result) in results {
        let peer = job.outgoing.recipient.id.clone();
        match settle(core, &job, result).await {
            Ok(true) => {
                retries.reset(&peer);
            }
            Ok(false) => {
                // The peer holds a newer generation; the floor is recorded: go again at once,
                // unless it keeps saying so.
                let stale = retries.stale(peer.clone(), Instant::now());
                if stale >= STALE_BEFORE_BACKOFF {
                    tracing::warn!(cluster.id = %peer, stale, "peer keeps answering stale; backing off");
                }
            }
            Err(err) => {
                let failures = retries.failed(peer.clone(), Instant::now());
                // A first refusal is routine right after a handshake: we record the peer a
                // moment before it records us. Persisting failures are worth a warning.
                if failures < 3 {
                    tracing::info!(cluster.id = %peer, address = %job.address, error = %err, failures, "sending neighborhood failed; will retry");
                } else {
                    tracing::warn!(cluster.id = %peer, address = %job.address, error = %err, failures, "sending neighborhood failed; will retry");
                }
            }
        }
    }
    Ok(())
}

/// Records the outcome of one send; `Ok(false)` when it must be redone right away.
async fn settle(core: &Discovery, job: &Job, result: Result<crate::core::Applied>) -> Result<bool> {
    let revision = job.outbox.as_ref().map_or(0, |(_, rev)| *rev);
    let floor = job.outbox.as_ref().map_or(0, |(o, _)| o.floor);
    match result {
        Ok(applied) if applied.applied => {
            if job.farewell {
                core.forget_outbox(&job.outgoing.recipient.id, revision)
                    .await?;
                tracing::info!(cluster.id = %job.outgoing.recipient.id, "withdrew neighborhood from former peer");
            } else {
                let acknowledged = Outbox {
                    peer: job.outgoing.recipient.clone(),
                    generation: job.outgoing.generation,
                    digest: job.digest.clone(),
                    count: job.outgoing.neighbors.len(),
                    floor,
                };
                let changed = job.outbox.as_ref().is_none_or(|(o, _)| o != &acknowledged);
                if changed {
                    core.acknowledge(&acknowledged, revision).await?;
                    tracing::info!(cluster.id = %job.outgoing.recipient.id, generation = job.outgoing.generation, neighbors = job.outgoing.neighbors.len(), "neighborhood acknowledged");
                }
            }
            Ok(true)
        }
        Ok(applied)
            if applied.current_generation < job.outgoing.generation
                || applied.current_generation > MAX_PEER_GENERATION =>
        {
            // "Stale" means the peer holds a generation at least as high as ours; anything
            // else is a buggy or hostile answer: nothing to renumber from, retry with backoff.
            Err(Error::FailedPrecondition(format!(
                "peer {} answered stale with an implausible current_generation {} (we sent {})",
                job.outgoing.recipient.id, applied.current_generation, job.outgoing.generation
            )))
        }
        Ok(applied) => {
            // Stale: the peer holds a higher generation (e.g. our store was restored from an
            // old backup). Continue numbering above it.
            let mut outbox = job.outbox.as_ref().map_or_else(
                || Outbox {
                    peer: job.outgoing.recipient.clone(),
                    generation: 0,
                    digest: String::new(),
                    count: 0,
                    floor: 0,
                },
                |(o, _)| o.clone(),
            );
            outbox.floor = applied.current_generation.saturating_add(1);
            // Force a real send next time: what it holds is not what we think it holds.
            outbox.digest.clear();
            outbox.generation = applied.current_generation;
            core.acknowledge(&outbox, revision).await?;
            Ok(false)
        }
        Err(Error::PermissionDenied(_) | Error::FailedPrecondition(_)) if job.farewell => {
            // The former peer no longer accepts anything from us: it has dropped us and with
            // us everything we introduced.
            core.forget_outbox(&job.outgoing.recipient.id, revision)
                .await?;
            Ok(true)
        }
        Err(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use trellis_api::ClusterIdentity;
    use trellis_api::peers::{Condition, PEERED_REASON};
    use trellis_store::{KeyValue, WatchEvent};

    use super::*;
    use crate::records::{
        Addresses, ForeignClusterRecord, FullPeering, Kind, Source, Status, cluster_key, encode,
    };

    /// The time [`let_burst_settle`] takes while a record of `kind` changes every 50 ms for 2 s (none
    /// with `None`).
    async fn settling_under(kind: Option<Kind>) -> Duration {
        let shutdown = Shutdown::new();
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut changes: Option<WatchStream> = Some(Box::pin(rx));
        let start = Instant::now();
        let settled = async {
            assert!(let_burst_settle(&mut changes, &shutdown).await);
            start.elapsed()
        };
        let feed = async {
            for i in 0..40 {
                timer::period(Duration::from_millis(50)).await;
                if let Some(kind) = kind {
                    let identity =
                        ClusterIdentity::parse("id", &format!("c-{i}"), "name", "").expect("id");
                    let record = ForeignClusterRecord::new(identity, kind, Source::Manual);
                    let _ = tx.unbounded_send(Ok(put(&record)));
                }
            }
        };
        tokio::join!(settled, feed).0
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_change_waits_the_short_window_and_a_burst_at_most_the_long_one() {
        assert_eq!(settling_under(None).await, COALESCE);
        assert_eq!(settling_under(Some(Kind::Full)).await, COALESCE_MAX);
        // Induced records are not the sender's concern: they hold no pass back.
        assert_eq!(settling_under(Some(Kind::Induced)).await, COALESCE);
    }

    fn put(record: &ForeignClusterRecord) -> WatchEvent {
        let key = cluster_key(&record.identity.id);
        WatchEvent::Put(KeyValue {
            value: encode(record).expect("encodes").into(),
            key,
            create_revision: 2,
            mod_revision: 3,
            version: 2,
            lease: None,
        })
    }

    /// A peer whose retry is due is sent to even when nothing changed and no resync is due,
    /// so no due backoff is left to wake the loop again at once; a running backoff holds any
    /// send back.
    #[test]
    fn a_due_retry_is_sent_and_a_running_backoff_holds_back() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        assert!(sends(false, false, Some(now), now));
        for (changed, resync) in [(false, false), (true, false), (false, true), (true, true)] {
            assert!(!sends(changed, resync, Some(later), now));
            assert_eq!(sends(changed, resync, None, now), changed || resync);
        }
    }

    /// A first "stale" answer is sent to again at once; a second in a row backs off like a
    /// failure; a failure or a success starts the count over.
    #[test]
    fn a_peer_answering_stale_again_backs_off_and_the_count_starts_over() {
        let timing = SenderTiming {
            resync: Duration::from_secs(60),
            retry_initial: Duration::from_millis(200),
            retry_max: Duration::from_secs(30),
        };
        let peer = ClusterId::parse("id", "leaf").expect("valid cluster ID");
        let now = Instant::now();
        let mut retries = Retries::new(&timing);
        assert_eq!(retries.stale(peer.clone(), now), 1);
        assert_eq!(retries.due_at(&peer), Some(now), "sent to again at once");
        assert_eq!(retries.stale(peer.clone(), now), 2);
        assert!(retries.waiting(&peer, now), "backs off");
        assert_eq!(retries.backoff.failures(&peer), 1);

        assert_eq!(retries.failed(peer.clone(), now), 2);
        assert_eq!(
            retries.stale(peer.clone(), now),
            1,
            "a failure ends the streak"
        );
        assert!(retries.reset(&peer));
        assert_eq!(retries.stale(peer.clone(), now), 1, "so does a success");
        assert!(!retries.waiting(&peer, now));
    }

    /// A leaf receiving a hub's Neighborhood writes one induced record per neighbour; none of
    /// them can change what the leaf itself sends, so none may cost a pass (with n leaves that
    /// would be n passes over n records per Neighborhood).
    #[test]
    fn only_full_records_concern_the_sender() {
        let identity = |id: &str| ClusterIdentity::parse("id", id, "name", "").expect("identity");
        let induced =
            ForeignClusterRecord::new(identity("leaf-b"), Kind::Induced, Source::Neighborhood);
        assert!(!concerns_sender(&put(&induced)));

        let full = ForeignClusterRecord::new(identity("hub"), Kind::Full, Source::Peering);
        assert!(concerns_sender(&put(&full)));

        let mut demoted = induced.clone();
        demoted.previous_kind = Some(Kind::Full);
        assert!(concerns_sender(&put(&demoted)));

        assert!(concerns_sender(&WatchEvent::Delete {
            key: cluster_key(&induced.identity.id),
            mod_revision: 4,
        }));
    }

    /// A snapshot of `full` networked full peers, one full peer without networking and one
    /// induced record.
    fn snapshot(full: usize) -> Snapshot {
        let identity = |id: &str| ClusterIdentity::parse("id", id, "name", "").expect("identity");
        let peer = |id: String, networking: bool| {
            let mut record = ForeignClusterRecord::new(identity(&id), Kind::Full, Source::Peering);
            record.set_condition(Condition::Peered, Status::True, PEERED_REASON, "");
            record.full = Some(FullPeering {
                outgoing: true,
                incoming: true,
                networking,
                addresses: Addresses {
                    discovery: format!("{id}.example:7101"),
                    ..Addresses::default()
                },
                ca_certificate: String::new(),
            });
            record
        };
        let mut records: Vec<ForeignClusterRecord> = (0..full)
            .map(|i| peer(format!("leaf-{i:03}"), true))
            .collect();
        records.push(peer("quiet".into(), false));
        records.push(ForeignClusterRecord::new(
            identity("far"),
            Kind::Induced,
            Source::Neighborhood,
        ));
        Snapshot {
            records: records
                .into_iter()
                .map(|r| (r.identity.id.clone(), (r, 3)))
                .collect(),
            revision: 3,
        }
    }

    /// Each networked full peer's list is every other one, and the digest a pass compares,
    /// made from one hash per peer, is the digest of that list as sent: otherwise every pass
    /// would re-send every Neighborhood (or none).
    #[test]
    fn a_peers_digest_is_the_digest_of_the_list_it_is_sent() {
        let snapshot = snapshot(5);
        let desired = Desired::of(&snapshot, true);
        let ids: Vec<&str> = desired.peers.iter().map(|(id, ..)| id.as_str()).collect();
        assert_eq!(
            ids,
            ["leaf-000", "leaf-001", "leaf-002", "leaf-003", "leaf-004"]
        );
        for (index, (id, address, ..)) in desired.peers.iter().enumerate() {
            assert!(desired.contains(id));
            assert_eq!(address, &format!("{id}.example:7101"));
            let neighbors = desired.neighbors(index);
            let named: Vec<&str> = neighbors.iter().map(|n| n.identity.id.as_str()).collect();
            let expected: Vec<&str> = ids.iter().copied().filter(|o| *o != id.as_str()).collect();
            assert_eq!(named, expected);
            assert_eq!(desired.digest(index), Outbox::digest_of(&neighbors));
        }
        assert!(!desired.contains(&ClusterId::parse("id", "quiet").expect("id")));
        assert!(!desired.contains(&ClusterId::parse("id", "far").expect("id")));
        // Two peers' lists differ, and so do their digests.
        assert_ne!(desired.digest(0), desired.digest(1));

        let off = Desired::of(&snapshot, false);
        assert_eq!(off.peers.len(), 5);
        assert!(off.neighbors(2).is_empty());
        assert_eq!(off.digest(2), Outbox::digest_of(&[]));
    }

    /// A digest changes with any neighbour's content, its count or their order.
    #[test]
    fn a_digest_tells_lists_apart() {
        let desired = Desired::of(&snapshot(3), true);
        let list = desired.neighbors(0);
        let mut moved = list.clone();
        moved[1].addresses.discovery = "elsewhere:7101".into();
        let mut reversed = list.clone();
        reversed.reverse();
        let digests = [
            Outbox::digest_of(&list),
            Outbox::digest_of(&moved),
            Outbox::digest_of(&reversed),
            Outbox::digest_of(&list[..1]),
        ];
        for (i, a) in digests.iter().enumerate() {
            for b in &digests[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert!(digests[3].ends_with(":1"));
    }
}
