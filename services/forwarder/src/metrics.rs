//! The forwarder's Prometheus metrics (issue 19): `trellis_forwarder_relays{state}`, the relays
//! it holds by state (pending, delivered, status_pending, failed, withdrawing; completed relays
//! are deleted, so what is counted is what is in flight or failed), read from the store at
//! every scrape: the same set `ListRelays` returns; and `trellis_forwarder_relay_retries_total`,
//! the delivery attempts that failed and were scheduled again.

use std::sync::Arc;

use trellis_runtime::metrics::prometheus_client::metrics::{family::Family, gauge::Gauge};
use trellis_runtime::metrics::{Labels, Metrics};

use crate::core::Forwarder;
use crate::records::State;

const STATES: [(State, &str); 5] = [
    (State::Pending, "pending"),
    (State::Delivered, "delivered"),
    (State::StatusPending, "status_pending"),
    (State::Failed, "failed"),
    (State::Withdrawing, "withdrawing"),
];

/// Registers the relay gauges of `core` on `metrics`.
pub fn register(metrics: &Metrics, core: &Arc<Forwarder>) {
    let relays: Family<Labels, Gauge> = Family::default();
    metrics.register(
        "trellis_forwarder_relays",
        "Relays the forwarder holds (in flight or failed), by state",
        relays.clone(),
    );
    metrics.register(
        "trellis_forwarder_relay_retries",
        "Relay delivery attempts that failed and were scheduled again",
        core.retried().clone(),
    );
    let core = core.clone();
    metrics.on_scrape(move || {
        let (core, relays) = (core.clone(), relays.clone());
        async move {
            // A store that does not answer leaves the last values (the scrape still succeeds).
            let Ok(list) = core.list(None).await else {
                return;
            };
            for (state, name) in STATES {
                let n = list.iter().filter(|r| r.state == state).count();
                relays
                    .get_or_create(&vec![("state", name.to_owned())])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    });
}
