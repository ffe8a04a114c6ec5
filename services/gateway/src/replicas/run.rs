//! The election loop: what runs it ([`Replicas::run`], which starts the socket's and the
//! handoff's tasks beside it), what one heartbeat changes, and how a decision is published as
//! the [`View`](super::View) the core follows. The loop alone owns the [`Election`], so its rules need no
//! lock; the store is read on a period, and at once when a heartbeat names a newer active.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use trellis_runtime::Shutdown;

use super::Replicas;
use super::election::{Change, Election};
use super::heartbeat::Heartbeat;
use crate::records::ActiveRecord;

/// How often the store is read (members and the active record) while other replicas exist,
/// and while this replica is alone.
const SYNC: Duration = Duration::from_secs(1);
const SYNC_ALONE: Duration = Duration::from_secs(5);

/// Heartbeats waiting for the election loop; more are dropped (and the sender is heard on its
/// next one).
const QUEUE: usize = 1024;

impl Replicas {
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

    /// One heartbeat, received at `at`; whether it names an active newer than any known (its
    /// record is then read at once rather than at the next sync).
    pub(super) fn heard(&self, election: &mut Election, beat: Heartbeat, at: Instant) -> bool {
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

    /// Publishes the view: active or not, and `record` when it is the newest known.
    pub(super) fn publish(&self, election: &Election, record: Option<ActiveRecord>) {
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

    pub(super) fn stepped_down(&self, election: &Election, how: &str) {
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
}
