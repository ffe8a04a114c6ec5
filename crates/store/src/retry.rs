//! Retrying optimistic transactions. Every service commits with compare-and-swap and, when a
//! concurrent writer won, re-reads and decides again; [`Contention`] bounds that loop and
//! spreads the retries of racing writers with a short random wait. Every lost race is reported
//! to the store ([`crate::Store::retried`]), which a metered store counts.

use std::time::Duration;

use rand::Rng as _;
use trellis_error::{Error, Result};

use crate::SharedStore;

/// Lost races after which an operation gives up with [`Error::Aborted`].
pub const MAX_ATTEMPTS: u32 = 100;

/// Counts the lost races of one operation.
#[derive(Debug)]
pub struct Contention {
    attempt: u32,
    what: &'static str,
    store: Option<SharedStore>,
}

impl Contention {
    /// Races lost on `store`'s compare-and-swap, which is told of each retry (and counts it
    /// when metered); `what` names the operation in the error ("allocating subnets").
    pub fn on(store: &SharedStore, what: &'static str) -> Self {
        Self {
            attempt: 0,
            what,
            store: Some(store.clone()),
        }
    }

    /// Races lost somewhere else than a Trellis store (a Kubernetes object's
    /// `resourceVersion`): bounded and spread the same way, not counted as store retries.
    pub fn elsewhere(what: &'static str) -> Self {
        Self {
            attempt: 0,
            what,
            store: None,
        }
    }

    /// Counts a lost race without waiting: the caller already knows how to avoid the
    /// collision (e.g. skip an address another writer just took).
    pub fn skip(&mut self) -> Result<()> {
        self.attempt += 1;
        if self.attempt >= MAX_ATTEMPTS {
            return Err(Error::Aborted(format!(
                "{}: gave up after {MAX_ATTEMPTS} conflicting concurrent updates",
                self.what
            )));
        }
        if let Some(store) = &self.store {
            store.retried();
        }
        Ok(())
    }

    /// Counts a lost race and waits up to 2^attempt ms (at most 32 ms), randomly, so racing
    /// writers spread out.
    pub async fn lost(&mut self) -> Result<()> {
        self.skip()?;
        let cap_ms = 1u64 << self.attempt.min(5);
        let wait = rand::rng().random_range(0..=cap_ms);
        tokio::time::sleep(Duration::from_millis(wait)).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_the_bound_with_aborted_naming_the_operation() {
        let store: SharedStore = std::sync::Arc::new(crate::MemoryStore::new());
        let mut contention = Contention::on(&store, "allocating subnets");
        for _ in 1..MAX_ATTEMPTS {
            contention.lost().await.expect("still within the bound");
        }
        let err = contention.lost().await.expect_err("bound reached");
        assert!(
            matches!(&err, Error::Aborted(m) if m.starts_with("allocating subnets")),
            "{err}"
        );
    }
}
