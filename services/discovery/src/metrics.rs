//! The discovery service's Prometheus metrics (issue 19): the ForeignClusters it holds by kind
//! (`trellis_foreign_clusters{kind}`, what `ListForeignClusters` returns) and by condition
//! (`trellis_foreign_cluster_conditions{kind,condition,status}`), read from the store at every
//! scrape so they never drift from it; a condition no record has is absent.

use std::collections::BTreeMap;
use std::sync::Arc;

use trellis_runtime::metrics::prometheus_client::metrics::{family::Family, gauge::Gauge};
use trellis_runtime::metrics::{Labels, Metrics};

use crate::core::Discovery;
use crate::records::{Kind, Status};

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Full => "full",
        Kind::Induced => "induced",
    }
}

fn status_name(status: Status) -> &'static str {
    match status {
        Status::True => "True",
        Status::False => "False",
        Status::Unknown => "Unknown",
    }
}

/// Registers the ForeignCluster gauges of `core` on `metrics`.
pub fn register(metrics: &Metrics, core: &Arc<Discovery>) {
    let clusters: Family<Labels, Gauge> = Family::default();
    let conditions: Family<Labels, Gauge> = Family::default();
    metrics.register(
        "trellis_foreign_clusters",
        "ForeignClusters held by discovery, by peering kind",
        clusters.clone(),
    );
    metrics.register(
        "trellis_foreign_cluster_conditions",
        "ForeignClusters by kind and by the status of each of their conditions",
        conditions.clone(),
    );
    let core = core.clone();
    metrics.on_scrape(move || {
        let (core, clusters, conditions) = (core.clone(), clusters.clone(), conditions.clone());
        async move {
            // A store that does not answer leaves the last values (the scrape still succeeds).
            let Ok((records, _)) = core.list(None).await else {
                return;
            };
            let mut by_kind: BTreeMap<&str, i64> = [("full", 0), ("induced", 0)].into();
            let mut by_condition: BTreeMap<(&str, String, &str), i64> = BTreeMap::new();
            for (record, _) in &records {
                let kind = kind_name(record.kind);
                *by_kind.entry(kind).or_default() += 1;
                for c in &record.conditions {
                    *by_condition
                        .entry((kind, c.kind.clone(), status_name(c.status)))
                        .or_default() += 1;
                }
            }
            for (kind, n) in by_kind {
                clusters
                    .get_or_create(&vec![("kind", kind.to_owned())])
                    .set(n);
            }
            // Rebuilt whole: a condition that no record has any more disappears.
            conditions.clear();
            for ((kind, condition, status), n) in by_condition {
                conditions
                    .get_or_create(&vec![
                        ("kind", kind.to_owned()),
                        ("condition", condition),
                        ("status", status.to_owned()),
                    ])
                    .set(n);
            }
        }
    });
}
