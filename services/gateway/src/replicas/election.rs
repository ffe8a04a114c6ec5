//! Who is active, decided from what a replica has heard and read: pure, with time passed in,
//! so every rule is unit-tested.
//!
//! - A standby follows the newest active it knows of (highest epoch, from the store or from
//!   a heartbeat). It takes over when that active has been silent for `failover_after`, or
//!   when no active is known once it has listened that long after starting (so a replica
//!   that starts next to a healthy active never pre-empts it). Taking over is a claim on the
//!   store ([`super::claim`]): the store decides, and a replica that cannot reach it stays a
//!   standby.
//! - An active steps down when it hears an active with a higher epoch, or reads one in the
//!   store. Nothing else makes it stop: not a store it cannot reach, not standbys gone silent.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The active as known: its replica ID and epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    pub replica: String,
    pub epoch: u64,
}

/// What the replica must do after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// It was active and is not any more.
    StepDown,
}

/// When a replica was last heard, and what it said.
#[derive(Debug, Clone, Copy)]
pub struct Heard {
    pub at: Instant,
    pub active: bool,
    pub epoch: u64,
}

/// One replica's view of the election.
#[derive(Debug)]
pub struct Election {
    me: String,
    failover_after: Duration,
    started: Instant,
    /// Our epoch while we are the active.
    active: Option<u64>,
    /// The newest active known.
    leader: Option<Leader>,
    /// Since when the leader counts as alive: its last heartbeat as the active, or the moment
    /// we learnt of it (a new leader gets `failover_after` to be heard).
    leader_seen: Instant,
    heard: BTreeMap<String, Heard>,
}

impl Election {
    pub fn new(me: &str, failover_after: Duration, now: Instant) -> Self {
        Self {
            me: me.to_owned(),
            failover_after,
            started: now,
            active: None,
            leader: None,
            leader_seen: now,
            heard: BTreeMap::new(),
        }
    }

    /// Our epoch, while we are the active.
    pub fn active(&self) -> Option<u64> {
        self.active
    }

    /// The newest active known (ourselves while active).
    pub fn leader(&self) -> Option<&Leader> {
        self.leader.as_ref()
    }

    /// Every other replica heard since start.
    pub fn heard(&self) -> &BTreeMap<String, Heard> {
        &self.heard
    }

    fn follow(&mut self, leader: Leader, now: Instant) {
        if self.leader.as_ref() != Some(&leader) {
            self.leader = Some(leader);
            self.leader_seen = now;
        }
    }

    /// A heartbeat from another replica.
    pub fn on_heartbeat(
        &mut self,
        replica: &str,
        active: bool,
        epoch: u64,
        now: Instant,
    ) -> Option<Change> {
        if replica == self.me {
            return None;
        }
        self.heard.insert(
            replica.to_owned(),
            Heard {
                at: now,
                active,
                epoch,
            },
        );
        if !active {
            return None;
        }
        let claim = Leader {
            replica: replica.to_owned(),
            epoch,
        };
        match self.active {
            Some(mine) if epoch > mine => {
                self.active = None;
                self.follow(claim, now);
                Some(Change::StepDown)
            }
            // An older active that has not heard of us yet: it steps down when it does.
            Some(_) => None,
            None => {
                if self.leader.as_ref().is_none_or(|l| epoch >= l.epoch) {
                    self.follow(claim, now);
                    self.leader_seen = now;
                }
                None
            }
        }
    }

    /// The store's active record, as just read (`None`: there is none).
    pub fn on_record(&mut self, record: Option<Leader>, now: Instant) -> Option<Change> {
        let record = record?;
        match self.active {
            Some(mine)
                if record.epoch > mine || (record.epoch == mine && record.replica != self.me) =>
            {
                self.active = None;
                self.follow(record, now);
                Some(Change::StepDown)
            }
            Some(_) => None,
            None => {
                if self.leader.as_ref().is_none_or(|l| record.epoch > l.epoch) {
                    self.follow(record, now);
                }
                None
            }
        }
    }

    /// Whether this standby should claim the active role now.
    pub fn should_take_over(&self, now: Instant) -> bool {
        if self.active.is_some() || now.duration_since(self.started) < self.failover_after {
            return false;
        }
        match &self.leader {
            None => true,
            // Our own previous run: nobody else took over, and that run is gone.
            Some(l) if l.replica == self.me => true,
            Some(_) => now.duration_since(self.leader_seen) >= self.failover_after,
        }
    }

    /// How long the followed active has been silent (zero while active or never followed).
    pub fn leader_silence(&self, now: Instant) -> Duration {
        match (&self.leader, self.active) {
            (Some(_), None) => now.duration_since(self.leader_seen),
            _ => Duration::ZERO,
        }
    }

    /// Our claim of `epoch` succeeded.
    pub fn won(&mut self, epoch: u64, now: Instant) {
        self.active = Some(epoch);
        self.follow(
            Leader {
                replica: self.me.clone(),
                epoch,
            },
            now,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_millis(300);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn leader(replica: &str, epoch: u64) -> Leader {
        Leader {
            replica: replica.into(),
            epoch,
        }
    }

    #[test]
    fn a_replica_alone_takes_over_only_after_listening_for_failover_after() {
        let t0 = Instant::now();
        let e = Election::new("a", AFTER, t0);
        assert!(
            !e.should_take_over(t0 + ms(100)),
            "it may not have heard the active yet"
        );
        assert!(e.should_take_over(t0 + AFTER));
    }

    #[test]
    fn a_starting_replica_never_preempts_an_active_it_hears() {
        let t0 = Instant::now();
        let mut e = Election::new("b", AFTER, t0);
        for i in 0..50 {
            let now = t0 + ms(100 * i);
            assert_eq!(e.on_heartbeat("a", true, 4, now), None);
            assert!(!e.should_take_over(now + ms(50)), "at {i}");
        }
        assert!(e.should_take_over(t0 + ms(4900) + AFTER), "silent now");
    }

    #[test]
    fn a_standby_takes_over_when_the_active_is_silent_for_failover_after() {
        let t0 = Instant::now();
        let mut e = Election::new("b", AFTER, t0);
        e.on_record(Some(leader("a", 3)), t0);
        e.on_heartbeat("a", true, 3, t0 + ms(400));
        assert!(!e.should_take_over(t0 + ms(699)));
        assert!(e.should_take_over(t0 + ms(700)));
        // Standbys' heartbeats do not keep the active alive.
        e.on_heartbeat("c", false, 3, t0 + ms(700));
        assert!(e.should_take_over(t0 + ms(701)));
    }

    #[test]
    fn a_new_leader_from_the_store_gets_failover_after_to_be_heard() {
        let t0 = Instant::now();
        let mut e = Election::new("c", AFTER, t0);
        e.on_record(Some(leader("a", 3)), t0);
        assert!(e.should_take_over(t0 + ms(400)));
        // Another standby won epoch 4 meanwhile.
        e.on_record(Some(leader("b", 4)), t0 + ms(400));
        assert!(!e.should_take_over(t0 + ms(500)));
        // An older record does not go back.
        e.on_record(Some(leader("a", 3)), t0 + ms(500));
        assert_eq!(e.leader(), Some(&leader("b", 4)));
    }

    #[test]
    fn an_active_steps_down_only_for_a_higher_epoch() {
        let t0 = Instant::now();
        let mut e = Election::new("a", AFTER, t0);
        e.won(5, t0);
        assert!(!e.should_take_over(t0 + ms(1000)));
        assert_eq!(e.on_heartbeat("b", true, 4, t0), None, "an older active");
        assert_eq!(
            e.on_record(Some(leader("a", 5)), t0),
            None,
            "its own record"
        );
        assert_eq!(e.on_heartbeat("b", false, 9, t0), None, "a standby");
        assert_eq!(e.active(), Some(5));
        assert_eq!(
            e.on_heartbeat("b", true, 6, t0 + ms(1)),
            Some(Change::StepDown)
        );
        assert_eq!(e.active(), None);
        assert_eq!(e.leader(), Some(&leader("b", 6)));
    }

    #[test]
    fn an_active_steps_down_for_a_record_of_another_replica() {
        let t0 = Instant::now();
        let mut e = Election::new("a", AFTER, t0);
        e.won(5, t0);
        assert_eq!(e.on_record(None, t0), None, "a store without a record");
        assert_eq!(
            e.on_record(Some(leader("b", 6)), t0),
            Some(Change::StepDown)
        );
        let mut e = Election::new("a", AFTER, t0);
        e.won(5, t0);
        assert_eq!(
            e.on_record(Some(leader("b", 5)), t0),
            Some(Change::StepDown),
            "the same epoch under another name means ours was never the store's"
        );
    }

    #[test]
    fn our_own_previous_run_named_in_the_store_is_taken_over_after_listening() {
        let t0 = Instant::now();
        let mut e = Election::new("a", AFTER, t0);
        e.on_record(Some(leader("a", 2)), t0);
        assert!(!e.should_take_over(t0 + ms(10)));
        assert!(e.should_take_over(t0 + AFTER));
    }
}
