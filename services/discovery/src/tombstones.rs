//! Withdrawn ForeignClusters do not pile up (issue 19): unpeering, and a hub no longer listing
//! a neighbour, leave records with `Withdrawn=True` so operators can see what went and why.
//! This task deletes them once they have been withdrawn for `--tombstone-retention`
//! ([`crate::core::Discovery::collect_withdrawn`]); `trellisctl status` hides them meanwhile
//! unless asked (`--all`).

use std::sync::Arc;
use std::time::Duration;

use trellis_runtime::Shutdown;

use crate::core::Discovery;
use crate::records::now_nanos;

/// How often to look, for a given retention: a quarter of it (a record goes at most 25% late),
/// at least every minute, at most four times a second.
pub fn period(retention: Duration) -> Duration {
    (retention / 4).clamp(Duration::from_millis(250), Duration::from_secs(60))
}

/// Collects withdrawn records every [`period`] until `shutdown`.
pub async fn run(core: Arc<Discovery>, retention: Duration, shutdown: Shutdown) {
    let period = period(retention);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = trellis_runtime::timer::period(period) => {}
        }
        // A failed pass (store unavailable) is retried at the next period.
        if let Err(err) = core.collect_withdrawn(retention, now_nanos()).await {
            tracing::warn!(error = %err, "collecting withdrawn foreign clusters failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_period_follows_the_retention_within_bounds() {
        assert_eq!(period(Duration::from_secs(1)), Duration::from_millis(250));
        assert_eq!(period(Duration::from_secs(8)), Duration::from_secs(2));
        assert_eq!(period(Duration::from_secs(86_400)), Duration::from_secs(60));
    }
}
