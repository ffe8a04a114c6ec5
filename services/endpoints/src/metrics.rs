//! The endpoints service's Prometheus metrics (issue 19), read from the store at every scrape:
//! `trellis_endpoints_imported_slices{source}`, the EndpointSlices other clusters reflected to
//! us (what `ListReflectedSlices` returns), and `trellis_endpoints_exported_slices{target}`,
//! the reflections this cluster made as source and still records.

use std::collections::BTreeMap;
use std::sync::Arc;

use trellis_runtime::metrics::prometheus_client::metrics::{family::Family, gauge::Gauge};
use trellis_runtime::metrics::{Labels, Metrics};

use crate::core::Endpoints;

fn set(family: &Family<Labels, Gauge>, label: &'static str, counts: BTreeMap<String, i64>) {
    // Rebuilt whole: a cluster with nothing reflected any more disappears.
    family.clear();
    for (cluster, n) in counts {
        family.get_or_create(&vec![(label, cluster)]).set(n);
    }
}

/// Registers the reflection gauges of `core` on `metrics`.
pub fn register(metrics: &Metrics, core: &Arc<Endpoints>) {
    let imported: Family<Labels, Gauge> = Family::default();
    let exported: Family<Labels, Gauge> = Family::default();
    metrics.register(
        "trellis_endpoints_imported_slices",
        "EndpointSlices reflected to this cluster, by source cluster",
        imported.clone(),
    );
    metrics.register(
        "trellis_endpoints_exported_slices",
        "EndpointSlices this cluster reflected to others, by target cluster",
        exported.clone(),
    );
    let core = core.clone();
    metrics.on_scrape(move || {
        let (core, imported, exported) = (core.clone(), imported.clone(), exported.clone());
        async move {
            // A store that does not answer leaves the last values (the scrape still succeeds).
            if let Ok(slices) = core.list(None, None).await {
                let mut counts = BTreeMap::new();
                for s in slices {
                    *counts.entry(s.source.id.to_string()).or_default() += 1;
                }
                set(&imported, "source", counts);
            }
            if let Ok(outgoing) = core.outgoing().await {
                let mut counts = BTreeMap::new();
                for o in outgoing {
                    *counts.entry(o.target.id.to_string()).or_default() += 1;
                }
                set(&exported, "target", counts);
            }
        }
    });
}
