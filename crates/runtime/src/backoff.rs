//! The one exponential backoff for loops that retry a failing dependency (a watch that broke, a
//! peer that does not answer): doubles from `initial` up to `max`, with up to 25 % random
//! jitter so many clients of one restarted server do not retry in lockstep; a success resets
//! it.

use std::time::Duration;

use rand::Rng as _;

/// Exponential backoff with jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `initial`, never waits longer than `max` (plus jitter).
    pub fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            next: initial,
        }
    }

    /// How long to wait before the next attempt; doubles the one after.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        jittered(base)
    }

    /// The wait after `failures` consecutive failures (1 = the first), as [`Self::next_delay`]
    /// would give it: for callers that persist a failure count with each retried item (a
    /// relay record) instead of keeping one `Backoff` alive per item.
    pub fn after_failures(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        jittered(self.initial.saturating_mul(1 << doublings).min(self.max))
    }

    /// After a success: the next failure waits `initial` again.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

/// `base` plus up to 25 % random jitter.
fn jittered(base: Duration) -> Duration {
    let jitter_ms = u64::try_from(base.as_millis() / 4).unwrap_or(u64::MAX);
    base + Duration::from_millis(rand::rng().random_range(0..=jitter_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_with_bounded_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        let waits: Vec<u128> = (0..5).map(|_| b.next_delay().as_millis()).collect();
        for (wait, base) in waits.iter().zip([100, 200, 400, 400, 400]) {
            assert!((base..=base + base / 4).contains(wait), "{waits:?}");
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(125));
    }

    #[test]
    fn after_failures_matches_the_sequence_and_never_overflows() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        for (failures, base) in [
            (0, 100),
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 400),
            (u32::MAX, 400),
        ] {
            let wait = b.after_failures(failures).as_millis();
            assert!(
                (base..=base + base / 4).contains(&wait),
                "{failures}: {wait}"
            );
        }
    }
}
