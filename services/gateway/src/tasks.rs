//! The gateway's own long-running tasks beside the reconciler: applying the outcome of the
//! replicas' election to the core, and watching the userspace engine's threads.

use std::sync::Arc;
use std::time::Duration;

use trellis_runtime::Shutdown;
use trellis_runtime::retry::RetryPolicy;

use crate::core::Gateway;
use crate::dataplane::engine::Engine;
use crate::replicas;

/// Applies each outcome of the election to the core until `shutdown`; one that cannot be
/// applied is tried again about every second (the retry policy's fixed wait).
pub(crate) async fn follow_election(
    core: Arc<Gateway>,
    mut view: tokio::sync::watch::Receiver<replicas::View>,
    shutdown: Shutdown,
) {
    let mut backoff = RetryPolicy::fixed(Duration::from_secs(1)).backoff();
    loop {
        let current = view.borrow_and_update().clone();
        let active = current.active;
        if let Err(err) = core.follow_view(current).await {
            tracing::warn!(active, error = %err, "could not follow the election; retrying");
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = backoff.wait() => continue,
            }
        }
        backoff.reset();
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = view.changed() => if changed.is_err() { return },
        }
    }
}

/// Returns when one of the engine's threads has ended while the gateway runs: the server's
/// supervision then fails the service, so that it is restarted (a dead receiving thread would
/// otherwise leave every tunnel UP on paper and silent in fact).
pub(crate) async fn watch_engine(engine: Arc<Engine>, shutdown: Shutdown) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let stopped = engine.stopped_threads();
        if !stopped.is_empty() {
            tracing::error!(threads = ?stopped, "the userspace wireguard engine lost a thread");
            return;
        }
    }
}
