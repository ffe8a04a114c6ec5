//! The broker's Prometheus metrics: `trellis_tunnel_endpoints{kind}`, the TunnelEndpoints it
//! holds (what ListTunnelEndpoints returns), counted from the store at every scrape.

use std::sync::Arc;

use trellis_api::model::PeeringKind;
use trellis_runtime::metrics::prometheus_client::metrics::{family::Family, gauge::Gauge};
use trellis_runtime::metrics::{Labels, Metrics};

use crate::core::Broker;

/// Registers `trellis_tunnel_endpoints{kind}` in `metrics`, read from `core` at every scrape.
pub fn register(metrics: &Metrics, core: &Arc<Broker>) {
    let tunnels: Family<Labels, Gauge> = Family::default();
    metrics.register(
        "trellis_tunnel_endpoints",
        "TunnelEndpoints held by the broker, by peering kind",
        tunnels.clone(),
    );
    let core = core.clone();
    metrics.on_scrape(move || {
        let (core, tunnels) = (core.clone(), tunnels.clone());
        async move {
            let Ok((list, _)) = core.tunnels().await else {
                return;
            };
            for (kind, name) in [
                (PeeringKind::Full, "full"),
                (PeeringKind::Induced, "induced"),
            ] {
                let n = list.iter().filter(|(t, _)| t.kind == kind).count();
                tunnels
                    .get_or_create(&vec![("kind", name.to_owned())])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    });
}
