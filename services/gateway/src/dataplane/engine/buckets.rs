//! [`TokenBuckets`]: a token bucket per key with a bounded table, what the engine holds a
//! sender to its share with: handshake sources under load, and relayed pairs.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// How often buckets that refilled completely are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Token buckets by key, each refilling at `rate` per second up to `burst`; at most `max`
/// keys at once (a new key beyond that is refused until old ones are swept), so a flood of
/// new keys cannot grow the table without bound.
#[derive(Debug)]
pub(super) struct TokenBuckets<K> {
    buckets: HashMap<K, (f64, Instant)>,
    swept: Option<Instant>,
    max: usize,
}

impl<K: Hash + Eq> TokenBuckets<K> {
    pub(super) fn new(max: usize) -> Self {
        Self {
            buckets: HashMap::new(),
            swept: None,
            max,
        }
    }

    /// Whether `key` may send one more now; takes its token if so.
    pub(super) fn allow(&mut self, key: K, rate: f64, burst: f64, now: Instant) -> bool {
        // A bucket untouched for as long as it takes to refill is full: it need not be kept.
        let full_after = Duration::from_secs_f64((burst / rate.max(f64::MIN_POSITIVE)).min(3600.0));
        if self
            .swept
            .is_none_or(|at| now.duration_since(at) >= SWEEP_EVERY)
        {
            self.buckets
                .retain(|_, (_, at)| now.duration_since(*at) < full_after.max(SWEEP_EVERY));
            self.swept = Some(now);
        }
        if !self.buckets.contains_key(&key) && self.buckets.len() >= self.max {
            return false;
        }
        let (tokens, at) = self.buckets.entry(key).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * rate).min(burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_over_its_rate_is_held_while_another_passes_and_the_table_is_bounded() {
        let mut buckets = TokenBuckets::new(2);
        let now = Instant::now();
        let flood = (0..20).filter(|_| buckets.allow(1, 10.0, 5.0, now)).count();
        assert_eq!(flood, 5, "the burst, then nothing");
        assert!(buckets.allow(2, 10.0, 5.0, now), "another key is untouched");
        assert!(
            !buckets.allow(3, 10.0, 5.0, now),
            "a third key beyond the table's bound"
        );
        assert!(buckets.allow(1, 10.0, 5.0, now + Duration::from_millis(150)));
        // Once swept, the full buckets make room.
        assert!(buckets.allow(3, 10.0, 5.0, now + Duration::from_secs(5)));
    }
}
