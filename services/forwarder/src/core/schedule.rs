//! The retry loop and its in-memory due queue. The queue mirrors the store, so a wake costs
//! one store read per due relay rather than a listing of all of them; the loop runs due work
//! concurrently but one attempt at a time per cluster called, so one destination that hangs
//! ties up a single slot while the relays to everyone else go on.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument as _;
use trellis_api::ClusterId;
use trellis_error::Result;
use trellis_runtime::Shutdown;
use trellis_runtime::propagation::resumed_span;
use trellis_runtime::retry::RetryPolicy;

use super::{Forwarder, nanos};
use crate::records::{RELAYS_PREFIX, RelayRecord, State, decode, now_nanos};

/// How long the loop waits before retrying a relay whose processing failed on our side (the
/// store or the local discovery service did not answer): a fixed second.
const LOCAL_RETRY: RetryPolicy = RetryPolicy::fixed(Duration::from_secs(1));
/// The longest the retry loop sleeps with nothing due (a safety net; every write wakes it).
const IDLE: Duration = Duration::from_secs(60);

/// The retry loop's in-memory due queue: which relay needs work when, and which cluster that
/// work calls. Mirrors the store (every successful write of a relay updates it), so it only
/// has to be read from the store once per process.
#[derive(Debug, Default)]
pub(super) struct Schedule {
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
pub(super) fn work_of(
    record: &RelayRecord,
    retention: Duration,
) -> Option<(i64, Option<ClusterId>)> {
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

impl Forwarder {
    /// Queues `work` for `key` (none: nothing to do) and wakes the retry loop.
    pub(super) fn schedule(&self, key: &str, work: Option<(i64, Option<ClusterId>)>) {
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
                    () = backoff.wait() => {}
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
            () = trellis_runtime::timer::until(tokio::time::Instant::now() + wait) => {}
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
