//! The import side with Kubernetes (ADR 0019, 0029): what peers reflected to us (stored under
//! `reflected/<source>/...`, the only source of truth) and our own exports (an exporting
//! cluster imports its own export, as the MCS API has it) become, per imported Service
//! (`namespace`, Service name), one `ServiceImport` (ClusterSetIP or Headless, the merged
//! ports, affinity and policies, the exporting clusters, a `Conflict` condition), one
//! selector-less derived Service ([`crate::kube::derived_service_name`]) and the EndpointSlices
//! attached to it, one per exporting cluster's slice, so exports of the same Service by several
//! clusters merge into one import.
//!
//! [`run_import_sync`] converges Kubernetes on the store after every import change, every
//! [`crate::exports::RESYNC`] and at start, idempotently (read, compare, write only what
//! differs, with the read resourceVersion as precondition): a restart re-derives everything
//! from the store and duplicates nothing, and whatever Trellis wrote for an import that is gone
//! (unpeered, withdrawn, or left behind by a crash) is deleted. Only objects carrying Trellis'
//! ownership marks are ever updated or deleted.
//!
//! Readiness: an endpoint whose address this cluster can no longer reach is written not ready
//! (see [`Reachability`]), instead of steering traffic to a wrong address.
//!
//! - [`mod@merge`]: the MCS rules that make one import of every exporter's export;
//! - [`objects`]: the Kubernetes objects of an import and the writer that converges them.

mod merge;
mod objects;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use trellis_api::ClusterId;
use trellis_api::pb::types::ForeignCluster;
use trellis_api::peers::{is_introduced, is_networked_full_peer};
use trellis_error::Result;
use trellis_runtime::Shutdown;

use crate::core::Endpoints;
use crate::exports::ORIGIN_LABEL;
use crate::model::Slice;
use crate::records::ReflectedRecord;

pub use merge::{CONFLICT_CONDITION, ConflictKind, Import, merge};
pub use objects::ImportWriter;
pub(crate) use objects::with_transition_time;

/// Which addresses this cluster can reach now, from its own IPAM (which cluster an address
/// belongs to, as we address it) and discovery (whether we still have a networked peering with
/// that cluster: a full peer with networking, or an induced peer its hub still introduces).
#[derive(Debug, Clone, Default)]
pub struct Reachability {
    /// How we address each known cluster's pod and external CIDRs.
    ranges: Vec<(IpNet, ClusterId)>,
    reachable: BTreeSet<ClusterId>,
}

/// Whether `fc` is a peering our traffic can use.
fn is_networked(fc: &ForeignCluster) -> bool {
    is_networked_full_peer(fc) || is_introduced(fc)
}

impl Reachability {
    /// `ranges` (how we address each cluster) of which the `reachable` clusters' count.
    pub fn new(ranges: Vec<(IpNet, ClusterId)>, reachable: BTreeSet<ClusterId>) -> Self {
        Self { ranges, reachable }
    }

    /// Whether `address` belongs to a cluster we have a networked peering with.
    pub fn reaches(&self, address: &str) -> bool {
        let Ok(ip) = address.parse::<IpAddr>() else {
            // Names (FQDN slices) are resolved by whoever uses them.
            return true;
        };
        self.ranges
            .iter()
            .any(|(net, id)| net.contains(&ip) && self.reachable.contains(id))
    }

    /// `slice` with every endpoint we cannot reach marked neither ready nor serving.
    pub fn mark(&self, slice: &Slice) -> Slice {
        let mut marked = slice.clone();
        for endpoint in &mut marked.endpoints {
            if !endpoint.addresses.iter().all(|a| self.reaches(a)) {
                endpoint.conditions.ready = Some(false);
                endpoint.conditions.serving = Some(false);
            }
        }
        marked
    }
}

/// The cluster whose export a reflected slice is: its origin label, else its source.
pub(crate) fn origin_of(record: &ReflectedRecord) -> String {
    record
        .slice
        .labels
        .get(ORIGIN_LABEL)
        .cloned()
        .unwrap_or_else(|| record.source.id.to_string())
}

impl Endpoints {
    /// What this cluster imports: every slice peers reflected to us and, as the MCS API has
    /// it (an exporting cluster imports its own export too), the slice of each of our own
    /// exports, from us.
    pub async fn import_records(&self) -> Result<Vec<ReflectedRecord>> {
        let mut records = self.list(None, None).await?;
        for export in self.stored_exports().await? {
            records.push(ReflectedRecord {
                source: self.local().clone(),
                slice: self.own_slice(&export),
                generation: 0,
                object_name: None,
                update_time_nanos: export.update_time_nanos,
            });
        }
        Ok(records)
    }

    /// What this cluster can reach now (see [`Reachability`]).
    pub async fn reachability(&self) -> Result<Reachability> {
        let clusters = self.clients.cluster_subnets().await?;
        let peers = self.clients.foreign_clusters().await?;
        let mut reachable: BTreeSet<ClusterId> = peers
            .iter()
            .filter(|fc| is_networked(fc))
            .filter_map(|fc| fc.identity.as_ref())
            .filter_map(|i| ClusterId::parse("cluster_id", &i.cluster_id).ok())
            .collect();
        // Our own exports' endpoints are our pods.
        reachable.insert(self.local().id.clone());
        let mut ranges = vec![(self.pod_cidr().await?, self.local().id.clone())];
        for c in clusters {
            let Ok(id) = ClusterId::parse("cluster_id", &c.cluster_id) else {
                continue;
            };
            for net in [&c.remote_pod_cidr_nat, &c.remote_external_cidr_nat] {
                if let Ok(net) = net.parse::<IpNet>() {
                    ranges.push((net, id.clone()));
                }
            }
        }
        Ok(Reachability { ranges, reachable })
    }

    /// One pass of the import side: every stored import written into Kubernetes (derived
    /// Service, translated slices with readiness marked, ServiceImport), then everything Trellis
    /// wrote that no import needs any more deleted. Failures are logged and counted; the next
    /// pass retries.
    pub async fn sync_imports(&self, writer: &ImportWriter) -> Result<usize> {
        let Some(slices) = self.writer() else {
            return Ok(0);
        };
        let records = self.import_records().await?;
        let reach = self.reachability().await?;
        let imports = merge(&records);
        let mut failed = 0;
        let mut ips: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
        for (key, import) in &imports {
            match writer.apply_service(import).await {
                Ok(service_ips) => {
                    ips.insert(key.clone(), service_ips);
                }
                Err(err) => {
                    failed += 1;
                    tracing::warn!(namespace = %import.namespace, name = %import.name, error = %err, "writing a derived service failed; retrying on the next pass");
                }
            }
        }
        for record in &records {
            let key = (
                record.slice.namespace.clone(),
                record.slice.service_name.clone(),
            );
            let Some(import) = imports.get(&key) else {
                continue;
            };
            if let Err(err) = slices
                .apply(&record.source, &reach.mark(&import.slice_for(record)))
                .await
            {
                failed += 1;
                tracing::warn!(source.id = %record.source.id, namespace = %record.slice.namespace, name = %record.slice.name, error = %err, "writing an imported endpointslice failed; retrying on the next pass");
            }
        }
        // What clusterset DNS answers: every import whose derived Service has IPs this pass
        // (one whose write failed keeps the IPs it had).
        let mut known = self
            .clusterset_ips
            .lock()
            .ok()
            .and_then(|held| held.clone())
            .unwrap_or_default();
        known.retain(|key, _| imports.contains_key(key));
        for (key, service_ips) in &ips {
            known.insert(
                key.clone(),
                service_ips
                    .iter()
                    .filter_map(|ip| ip.parse().ok())
                    .collect(),
            );
        }
        self.set_clusterset_ips(known);
        for (key, import) in &imports {
            // Without the derived Service's IPs this pass the ServiceImport waits for the next
            // one rather than losing the IPs it has.
            let Some(ips) = ips.get(key) else {
                continue;
            };
            if let Err(err) = writer.apply_import(import, ips).await {
                failed += 1;
                tracing::warn!(namespace = %import.namespace, name = %import.name, error = %err, "writing a serviceimport failed; retrying on the next pass");
            }
        }
        let held: BTreeSet<(String, String)> = records
            .iter()
            .map(|r| {
                (
                    r.source.id.to_string(),
                    format!("{}/{}", r.slice.namespace, r.slice.name),
                )
            })
            .collect();
        if let Err(err) = writer.collect_garbage(&imports, &held).await {
            failed += 1;
            tracing::warn!(error = %err, "removing stale imports from kubernetes failed; retrying on the next pass");
        }
        Ok(failed)
    }
}

/// Runs the import side until `shutdown`: a pass at start, after every import change and every
/// `resync`.
pub async fn run_import_sync(
    core: Arc<Endpoints>,
    writer: ImportWriter,
    resync: std::time::Duration,
    shutdown: Shutdown,
) {
    loop {
        match core.sync_imports(&writer).await {
            Ok(0) => {}
            Ok(failed) => tracing::debug!(failed, "import sync pass had failures"),
            Err(err) => tracing::warn!(error = %err, "import sync pass failed"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = core.imports_changed.notified() => {}
            () = trellis_runtime::timer::period(resync) => {}
        }
    }
}
