//! Supervision of a service's background work. A reconciler that panicked or returned, or a
//! data-plane thread that died, leaves a process that still answers health checks but no
//! longer does its job; nothing would ever restart it. Trellis is crash-only instead: any
//! process can be killed at any moment and, once restarted, converges. So a failure of
//! background work fails the whole service:
//!
//! - its health turns NOT_SERVING at once, for "" and for every service it serves (the
//!   readiness probe takes it out of rotation, the liveness probe sees it failing);
//! - serving stops after the grace period, the other background tasks are aborted;
//! - [`crate::server::GrpcServer::spawn`]'s task ends with the failure as its error, so the
//!   binary exits non-zero ([`crate::launch()`]) and the orchestrator restarts it at once,
//!   without waiting for the liveness probe's failures to add up.
//!
//! The server watches the background tasks it is given itself (a task that panics, or returns
//! before the shutdown). Work it cannot see — OS threads, a task inside another task — reports
//! through a [`Fault`] ([`crate::server::GrpcServer::fault`]): [`Fault::report`] directly, or an
//! [`Armed`] guard that reports when dropped without [`Armed::disarm`] (a thread that panics
//! or returns unexpectedly drops it).

use std::fmt;
use std::sync::{Arc, OnceLock};

use tokio_util::sync::CancellationToken;

/// The one failure of a service: reported at most once (the first report wins), from any task
/// or thread, without blocking. Cheap to clone; clones report the same failure.
#[derive(Clone, Default)]
pub struct Fault {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    reason: OnceLock<String>,
    reported: CancellationToken,
}

impl fmt::Debug for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fault")
            .field("reason", &self.reason())
            .finish()
    }
}

impl Fault {
    /// Nothing reported yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reports that the service can no longer do its job, because of `reason` (e.g. "the
    /// wg-udp thread exited"): the service fails (see the module documentation). Later
    /// reports are logged and otherwise ignored.
    pub fn report(&self, reason: impl Into<String>) {
        let reason = reason.into();
        if self.inner.reason.set(reason.clone()).is_ok() {
            tracing::error!(reason = %reason, "the service failed; it stops so that it is restarted");
            self.inner.reported.cancel();
        } else {
            tracing::error!(reason = %reason, "another failure of a service already failing");
        }
    }

    /// The failure reported, if any.
    pub fn reason(&self) -> Option<&str> {
        self.inner.reason.get().map(String::as_str)
    }

    /// Waits for a failure; returns its reason.
    pub async fn reported(&self) -> String {
        self.inner.reported.cancelled().await;
        self.reason().unwrap_or_default().to_owned()
    }

    /// A guard for work that must not end while the service runs (a thread's loop): dropped
    /// without [`Armed::disarm`] — the work returned or panicked — it reports that `what`
    /// ended.
    pub fn arm(&self, what: impl Into<String>) -> Armed {
        Armed {
            fault: Some(self.clone()),
            what: what.into(),
        }
    }
}

/// See [`Fault::arm`].
#[derive(Debug)]
pub struct Armed {
    fault: Option<Fault>,
    what: String,
}

impl Armed {
    /// The work ends as intended (a shutdown): nothing is reported.
    pub fn disarm(mut self) {
        self.fault = None;
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        if let Some(fault) = self.fault.take() {
            let how = if std::thread::panicking() {
                "panicked"
            } else {
                "ended"
            };
            fault.report(format!("{} {how} while the service was running", self.what));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_report_wins() {
        let fault = Fault::new();
        assert_eq!(fault.reason(), None);
        fault.clone().report("first");
        fault.report("second");
        assert_eq!(fault.reason(), Some("first"));
    }

    #[tokio::test]
    async fn a_guard_reports_a_thread_that_panics_or_returns_but_not_one_disarmed() {
        let fault = Fault::new();
        let armed = fault.arm("the clean thread");
        std::thread::spawn(move || armed.disarm())
            .join()
            .expect("joins");
        assert_eq!(fault.reason(), None, "a disarmed guard reports nothing");

        let armed = fault.arm("the wg-udp thread");
        let panicked = std::thread::spawn(move || {
            let _armed = armed;
            panic!("boom");
        })
        .join();
        assert!(panicked.is_err());
        let reason = tokio::time::timeout(std::time::Duration::from_secs(5), fault.reported())
            .await
            .expect("reported");
        assert_eq!(
            reason,
            "the wg-udp thread panicked while the service was running"
        );

        let other = Fault::new();
        let armed = other.arm("the tun thread");
        std::thread::spawn(move || drop(armed))
            .join()
            .expect("joins");
        assert_eq!(
            other.reason(),
            Some("the tun thread ended while the service was running")
        );
    }
}
