//! Seeded randomness for the chaos tests: the seed comes from `TRELLIS_CHAOS_SEED` (to replay a
//! run) or the clock, and is printed; everything random in a run is drawn from one [`Rng`].

/// The environment variable that replays a chaos run.
pub const SEED_VAR: &str = "TRELLIS_CHAOS_SEED";

/// A small deterministic generator (xorshift64*): the sequence is a function of the seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The generator of `seed` (xorshift has no sequence for 0, which counts as 1).
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The seed of [`SEED_VAR`] when set (and a number), else one from the clock; printed
    /// either way with how to replay it.
    pub fn from_env() -> (u64, Self) {
        let seed = std::env::var(SEED_VAR)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
                    | 1
            });
        eprintln!("chaos seed {seed} ({SEED_VAR}={seed} replays it)");
        (seed, Self::new(seed))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// `items` in a random order (Fisher-Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_its_sequence() {
        let (mut a, mut b) = (Rng::new(42), Rng::new(42));
        let mut other = Rng::new(43);
        let first: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
        assert_eq!(first, (0..5).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_ne!(first, (0..5).map(|_| other.next_u64()).collect::<Vec<_>>());
    }

    #[test]
    fn shuffling_keeps_every_item() {
        let mut items: Vec<usize> = (0..20).collect();
        Rng::new(7).shuffle(&mut items);
        let mut sorted = items.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
        assert_ne!(items, sorted, "seed 7 moves something");
    }
}
