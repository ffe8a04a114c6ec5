//! The reconciliation loop: applies what changed in the desired set (TunnelEndpoints and
//! hub-path endpoint mappings) whenever it changes, everything again every resync interval
//! (repairing whatever someone changed underneath) and sooner after a failure, and removes
//! every tunnel on a graceful stop.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use trellis_runtime::retry::RetryPolicy;
use trellis_runtime::{Shutdown, timer};

use crate::core::{Desired, Gateway};
use crate::dataplane::linux::Pass;
use crate::mappings::Mappings;

/// The wait before retrying a pass that left some tunnel unconfigured: a fixed 2 s.
const RETRY: RetryPolicy = RetryPolicy::fixed(Duration::from_secs(2));

/// Runs until `shutdown`. Nothing is applied before the first desired set arrives: an empty
/// data plane is not the same as "not known yet".
///
/// `mappings` (the IPAM's hub-path endpoint mappings) do not hold the data plane back: until
/// they are known the tunnels are applied without hub-path DNAT.
pub async fn run(
    core: Arc<Gateway>,
    mut desired: watch::Receiver<Option<Desired>>,
    mut mappings: watch::Receiver<Option<Mappings>>,
    resync: Duration,
    shutdown: Shutdown,
) {
    // The next repair pass: the resync, or sooner after a failure.
    let mut due = Instant::now() + resync;
    let mut backoff = RETRY.backoff();
    let mut source_alive = true;
    let mut mappings_alive = true;
    loop {
        // Woken by a change: apply what changed. By the timer (resync, or the retry after a
        // failure): check everything.
        let pass = tokio::select! {
            changed = desired.changed(), if source_alive => {
                source_alive = changed.is_ok();
                Pass::Changes
            }
            changed = mappings.changed(), if mappings_alive => {
                mappings_alive = changed.is_ok();
                Pass::Changes
            }
            () = timer::until(due) => Pass::Repair,
            () = shutdown.cancelled() => break,
        };
        let current = desired.borrow_and_update().clone();
        let hub = mappings.borrow_and_update().clone().unwrap_or_default();
        let Some(current) = current else {
            // Nothing to repair before the first desired set: the next timer is a resync away.
            // (Leaving `due` in the past made every later turn of this loop a Repair that
            // returned at once: a gateway without its broker spun a core.)
            due = Instant::now() + resync;
            continue;
        };
        let wait = match core.apply_pass(&current, &hub, pass).await {
            Ok(0) => {
                backoff.reset();
                resync
            }
            Ok(failed) => {
                tracing::warn!(failed, "some tunnels are not configured; retrying soon");
                backoff.next_delay()
            }
            Err(err) => {
                tracing::warn!(error = %err, "reconciliation failed; retrying soon");
                backoff.next_delay()
            }
        };
        due = Instant::now() + wait;
    }
    core.clear_dataplane().await;
    tracing::info!("data plane removed");
}
