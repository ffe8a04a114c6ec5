//! The waits a service takes, named by what they are for. `services/clippy.toml` refuses a
//! bare `tokio::time::sleep` in a service: a loop that sleeps a fixed time after a failure is a
//! retry loop written by hand, and retries wait through [`crate::retry`] ([`Backoff::wait`],
//! [`crate::retry::retry`], a [`crate::retry::KeyedBackoff`]'s due time) so that one policy
//! decides how long and one classification decides whether. What is left is named here: the
//! period of a periodic pass, and an instant a schedule computed.
//!
//! [`Backoff::wait`]: crate::retry::Backoff::wait

use std::time::Duration;

use tokio::time::Instant;

/// The pause between two passes of a periodic loop (a resync, a refresh, a poll, a pause that
/// lets a burst of changes settle). Not a wait after a failure: that is
/// [`crate::retry::Backoff::wait`].
pub async fn period(every: Duration) {
    tokio::time::sleep(every).await;
}

/// Wakes at `at`: an instant a schedule computed (the next due key of a keyed backoff, the next
/// resync, the end of a coalescing window).
pub async fn until(at: Instant) {
    tokio::time::sleep_until(at).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_period_and_a_deadline_wait_as_long_as_they_say() {
        let start = Instant::now();
        period(Duration::from_secs(3)).await;
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        until(start + Duration::from_secs(5)).await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        // A deadline already past returns at once.
        until(start).await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }
}
