//! When a reconciler's periodic repair pass (its resync, the pass over everything) is due: every
//! `period`, but never sooner than [`SHARE`] times the last pass's duration after it ended. The
//! repair path then takes at most a tenth of the loop's time however long a pass grows (hundreds
//! of peers, a busy machine), and event-driven work keeps the rest. Before, the next pass was
//! due `period` after the last one started: a pass that took longer than the period was followed
//! at once by the next, and the loop did nothing else.

use std::time::Duration;

use tokio::time::Instant;

/// The wait after a pass, in multiples of its duration (at least).
pub const SHARE: u32 = 9;

/// The schedule of one loop's periodic pass.
#[derive(Debug, Clone)]
pub struct Resync {
    period: Duration,
    next: Instant,
}

impl Resync {
    /// Due at once (a loop starts with a pass over everything), then every `period`.
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            next: Instant::now(),
        }
    }

    /// Whether the periodic pass is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        now >= self.next
    }

    /// When it is due next.
    pub fn next(&self) -> Instant {
        self.next
    }

    /// A pass over everything ran from `started` to `ended` (periodic or not: either way it
    /// repaired what the next periodic one would).
    pub fn ran(&mut self, started: Instant, ended: Instant) {
        let took = ended.saturating_duration_since(started);
        self.next = ended + self.period.max(took.saturating_mul(SHARE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_pass_waits_the_period_or_nine_times_the_last_pass() {
        let mut resync = Resync::new(Duration::from_secs(2));
        let start = Instant::now();
        assert!(resync.due(start));

        // A quick pass: due one period after it ended.
        resync.ran(start, start + Duration::from_millis(100));
        assert_eq!(resync.next(), start + Duration::from_millis(2100));
        assert!(!resync.due(start + Duration::from_secs(2)));
        assert!(resync.due(start + Duration::from_millis(2100)));

        // A pass longer than the period: the loop is not left with back-to-back passes.
        let later = start + Duration::from_secs(10);
        resync.ran(later, later + Duration::from_secs(3));
        assert_eq!(resync.next(), later + Duration::from_secs(3 + 27));
    }
}
