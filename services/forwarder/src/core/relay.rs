//! Accepting a relay (an origin's NetworkConfig) and a destination's status for it. A relay's
//! first attempt runs while the origin waits ([`OriginWait`]), often before anything is
//! stored for it; what it takes to keep that safe (counting such attempts, storing the relay
//! before an origin that stops waiting is answered) lives here with it. So does expediting:
//! a relay arriving one way is the signal that the relay the other way may now succeed.

use std::sync::atomic::{AtomicU8, Ordering};

use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::propagation::traceparent_of;
use trellis_store::retry::Contention;

use super::{Forwarder, INLINE_GRACE, Passthrough, nanos};
use crate::records::{RelayRecord, RelayedStatus, State, now_nanos, relay_key};

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
    pub(super) unstored: tokio::sync::Mutex<Option<(String, RelayRecord)>>,
}

const WAITING: u8 = 0;
const ANSWERED: u8 = 1;
const ABANDONED: u8 = 2;

impl OriginWait {
    /// The attempt takes the answer upon itself, unless the origin stopped waiting.
    pub(super) fn answer(&self) -> bool {
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
    pub(super) async fn unstored_ended(&self, key: &str) {
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
    pub(super) fn stored_wins(held: &RelayRecord, ours: i64) -> bool {
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
    pub(super) fn take_expedited(&self, key: &str) -> bool {
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
}
