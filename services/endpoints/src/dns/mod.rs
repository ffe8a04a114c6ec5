//! `clusterset.local` DNS (the MCS DNS specification): with `--dns-listen`, the endpoints
//! service answers names for the Services this cluster imports, on UDP and TCP.
//!
//! - [`zone`]: the zone built from the imports, and what it answers;
//! - [`server`]: the hickory-server front answering from the latest zone;
//! - [`metrics`]: queries by response code, names held.
//!
//! [`run_zone`] rebuilds the zone from the store after every import change, every change of
//! the clusterset IPs the Kubernetes import side wrote, and every resync (reachability of the
//! exporting clusters changes without an import changing). A rebuild that fails (the IPAM or
//! discovery not answering) keeps the last zone. Nothing of the zone is stored: after a
//! restart it is rebuilt from the stored imports, and on the Kubernetes path only once the
//! import side wrote the clusterset IPs, so a restarted server never answers a Service's
//! endpoints where its clusterset IP belongs.

pub mod metrics;
pub mod server;
pub mod zone;

use std::sync::Arc;
use std::time::Duration;

use hickory_proto::rr::Name;
use tokio::sync::watch;
use trellis_error::Result;
use trellis_runtime::Shutdown;

use crate::core::Endpoints;
pub use metrics::DnsMetrics;
pub use server::{DnsServer, ZoneView};
pub use zone::{Answer, Zone, ZoneEndpoint, ZoneService};

/// The zone's name and the TTL of its records.
#[derive(Debug, Clone)]
pub struct ZoneSettings {
    pub origin: Name,
    pub ttl: u32,
}

impl Endpoints {
    /// What the zone holds now, or `None` while the Kubernetes import side has not yet written
    /// the clusterset IPs.
    pub async fn zone_services(&self) -> Result<Option<Vec<ZoneService>>> {
        let clusterset_ips = if self.writer().is_some() {
            let held = self.clusterset_ips.lock().ok().and_then(|h| h.clone());
            match held {
                None => return Ok(None),
                Some(ips) => Some(ips),
            }
        } else {
            None
        };
        let records = self.import_records().await?;
        if records.is_empty() {
            // Nothing imported: no reason to ask the IPAM and discovery every resync (a
            // 255-cluster lab would make 500 such calls every 2 s for nothing).
            return Ok(Some(Vec::new()));
        }
        let reach = self.reachability().await?;
        let mut services = zone::services(
            &records,
            &reach,
            &clusterset_ips.clone().unwrap_or_default(),
        );
        if let Some(ips) = &clusterset_ips {
            // With Kubernetes a ClusterSetIP import is answered by its clusterset IP: one
            // without it yet waits.
            services.retain(|s| {
                s.headless
                    || ips
                        .get(&(s.namespace.clone(), s.name.clone()))
                        .is_some_and(|i| !i.is_empty())
            });
        }
        Ok(Some(services))
    }
}

/// Rebuilds the zone into `zone` until `shutdown` (see the module doc).
pub async fn run_zone(
    core: Arc<Endpoints>,
    settings: ZoneSettings,
    zone: watch::Sender<Option<Arc<Zone>>>,
    metrics: DnsMetrics,
    resync: Duration,
    shutdown: Shutdown,
) {
    let mut changed = core.zone_changed.subscribe();
    let mut serial: u32 = 0;
    loop {
        changed.mark_unchanged();
        match core.zone_services().await {
            Ok(Some(services)) => {
                serial = serial.wrapping_add(1);
                let built = Zone::build(&settings.origin, settings.ttl, serial, &services);
                metrics.zone_built(built.len());
                zone.send_replace(Some(Arc::new(built)));
            }
            Ok(None) => tracing::debug!("dns zone waits for the import side's clusterset ips"),
            Err(err) => {
                tracing::warn!(error = %err, "rebuilding the dns zone failed; answering from the last one");
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = changed.changed() => {}
            () = trellis_runtime::timer::period(resync) => {}
        }
    }
}
