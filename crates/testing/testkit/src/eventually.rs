//! Waiting for a condition that holds only after the system under test has converged.
//!
//! One poller for every test in the workspace, so that every wait looks again at the same
//! pace, measures its limit on the same clock and, when it gives up, says what it waited for
//! and what it saw last.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// How long [`eventually`] rests between two looks at least: short, so a test is not slowed by
/// its waits, and no shorter, so a cheap check does not keep a core busy.
pub const POLL: Duration = Duration::from_millis(50);

/// What one look of a check returns: the value waited for, or not yet (with what was seen
/// instead, when the check can say).
pub trait Observation<T> {
    /// `Ok` ends the wait; `Err` carries the observation a timeout reports, if any.
    fn into_found(self) -> Result<T, Option<String>>;
}

impl<T> Observation<T> for Option<T> {
    fn into_found(self) -> Result<T, Option<String>> {
        self.ok_or(None)
    }
}

impl<T, E: fmt::Display> Observation<T> for Result<T, E> {
    fn into_found(self) -> Result<T, Option<String>> {
        self.map_err(|seen| Some(seen.to_string()))
    }
}

/// A wait that ran out: what it waited for, how long, and the last observation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedOut {
    /// What the test waited for.
    pub what: String,
    /// How long it waited.
    pub limit: Duration,
    /// What the last look saw, when the check said.
    pub last: Option<String>,
}

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "timed out after {:?} waiting for {}",
            self.limit, self.what
        )?;
        if let Some(last) = &self.last {
            write!(f, "; last seen: {last}")?;
        }
        Ok(())
    }
}

impl std::error::Error for TimedOut {}

/// Looks with `check` until it yields a value, and returns it; panics naming `what` and the last
/// observation once `limit` has passed.
///
/// `check` returns an `Option` (nothing to report while waiting) or a `Result` whose error says
/// what it saw instead. It is always looked at once, and once more after the limit, so a limit
/// shorter than one look cannot fail a condition that already holds.
pub async fn eventually<T, O, F, Fut>(what: &str, limit: Duration, check: F) -> T
where
    O: Observation<T>,
    F: FnMut() -> Fut,
    Fut: Future<Output = O>,
{
    match within(what, limit, check).await {
        Ok(found) => found,
        Err(timed_out) => panic!("{timed_out}"),
    }
}

/// Looks with `probe` until it answers `want`; panics naming `what`, the last answer and `want`
/// once `limit` has passed. The shape of most waits: a state that must converge to a value.
pub async fn eventually_eq<T, F, Fut>(what: &str, limit: Duration, want: T, probe: F)
where
    T: PartialEq + fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = T>,
{
    if let Err(timed_out) = within_eq(what, limit, want, probe).await {
        panic!("{timed_out}");
    }
}

/// [`eventually_eq`] for a test that adds to the failure before it panics: returns the timeout
/// (its last observation the last answer and `want`) instead of panicking with it.
pub async fn within_eq<T, F, Fut>(
    what: &str,
    limit: Duration,
    want: T,
    mut probe: F,
) -> Result<(), TimedOut>
where
    T: PartialEq + fmt::Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = T>,
{
    let want = &want;
    within(what, limit, || {
        let got = probe();
        async move {
            let got = got.await;
            if got == *want {
                Ok(())
            } else {
                Err(format!("still {got:?}, want {want:?}"))
            }
        }
    })
    .await
}

/// [`eventually`] for a test that adds to the failure (log tails, a diagnosis) before it panics:
/// returns the timeout instead of panicking with it.
pub async fn within<T, O, F, Fut>(what: &str, limit: Duration, mut check: F) -> Result<T, TimedOut>
where
    O: Observation<T>,
    F: FnMut() -> Fut,
    Fut: Future<Output = O>,
{
    let deadline = Instant::now() + limit;
    loop {
        let started = Instant::now();
        let last = match check().await.into_found() {
            Ok(found) => return Ok(found),
            Err(last) => last,
        };
        if Instant::now() >= deadline {
            return Err(TimedOut {
                what: what.to_owned(),
                limit,
                last,
            });
        }
        // A check that takes long (many clusters, many calls) rests as long as it took, so the
        // poller never spends more than half of its time looking.
        tokio::time::sleep(POLL.max(started.elapsed())).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn returns_what_the_check_finds_once_it_holds() {
        let looks = AtomicU32::new(0);
        let found = eventually("the third look", Duration::from_secs(5), || async {
            let n = looks.fetch_add(1, Ordering::SeqCst) + 1;
            (n >= 3).then_some(n)
        })
        .await;
        assert_eq!(found, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_names_the_wait_and_the_last_observation() {
        let looks = AtomicU32::new(0);
        let err = within("a value", Duration::from_secs(1), || async {
            let n = looks.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(format!("look {n}"))
        })
        .await
        .expect_err("never holds");
        assert_eq!(err.what, "a value");
        let last = looks.load(Ordering::SeqCst) - 1;
        assert_eq!(err.last, Some(format!("look {last}")));
        assert_eq!(
            err.to_string(),
            format!("timed out after 1s waiting for a value; last seen: look {last}")
        );
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "timed out after 1s waiting for nothing")]
    async fn eventually_panics_when_the_limit_passes() {
        eventually("nothing", Duration::from_secs(1), || async { None::<()> }).await;
    }

    #[tokio::test(start_paused = true)]
    #[should_panic(expected = "waiting for two; last seen: still 1, want 2")]
    async fn eventually_eq_reports_the_last_answer_and_the_wanted_one() {
        eventually_eq("two", Duration::from_secs(1), 2, || async { 1 }).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_limit_still_looks_once() {
        let found = eventually("at once", Duration::ZERO, || async { Some(7) }).await;
        assert_eq!(found, 7);
    }
}
