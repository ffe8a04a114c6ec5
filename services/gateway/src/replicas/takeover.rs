//! Fencing: an active that hears no other replica renews its record, and a standby that has
//! not heard the active for `--failover-after` claims the role with the next epoch. Both are
//! compare-and-swaps on the store's active record ([`claim`]): the store decides, so two
//! replicas never hold one epoch, and a replica that cannot reach the store never takes over.

use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::Replicas;
use super::election::{Change, Election, Leader};
use super::heartbeat::Heartbeat;
use super::store::{claim, read_active, timed};
use crate::records::{ActiveRecord, now_nanos};

impl Replicas {
    /// How often an active that hears no other replica renews its record.
    pub(super) fn renew_every(&self) -> Duration {
        (self.settings.failover_after / 3).max(Duration::from_millis(10))
    }

    /// Notes the active record's revision as read at `now`; whether it moved since the last
    /// read.
    pub(super) fn moved(&self, revision: i64, now: Instant) -> bool {
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
    pub(super) async fn renew(&self, election: &mut Election) {
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

    /// Claims the active role with the next epoch; the store decides. `heard` hands over the
    /// heartbeats that came while the store was read: one from the active calls it off.
    pub(super) async fn take_over(
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
}
