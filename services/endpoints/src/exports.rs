//! Exported Services (ADR 0017): what this cluster
//! exports, and the one reconciler that reflects exports to every networked full peer.
//!
//! An export is stored under `export/<namespace>/<name>` (it survives a restart). The
//! reconciler computes the desired reflections: every own export to every networked full peer
//! (labelled with [`ORIGIN_LABEL`] = us), and every export a peer sent us directly to every
//! other networked full peer (transit: a hub passes a leaf's export to its other leaves, and
//! the existing translation gives each the address it uses for the leaf directly when they are
//! induced peers, the hub's external CIDR otherwise). It compares them with the outgoing
//! reflections it owns (`OutgoingRecord::export`) and converges: it reflects what is missing or
//! changed through [`Endpoints::reflect_as`] (delivered to the peer) and withdraws what is no
//! longer wanted. It also drops every slice a cluster that is no longer a networked full peer
//! reflected to us. It runs after every export or import change and on a fixed resync, so a new
//! peer gets every existing export and an unpeered one is forgotten within one resync; each pass
//! is idempotent (a slice already delivered unchanged is not sent again).
//!
//! Every `--export-resend` a pass also resends what it delivered, so a peer that lost it (its
//! store rebuilt, a flap of its view of us) gets it back. A resend costs no translation: it
//! delivers the earlier translation again with the same generation (a target that holds it
//! writes nothing), unless what the translation depends on moved since: the local IPAM's
//! records of the target and the origin (one listing per resend pass) or, for an export in transit, whether the induced path
//! from its origin to the target exists (one remote IPAM call per origin and target). Then it
//! translates again.
//!
//! A slice in transit that took the hub path because the induced path from its origin to the
//! target did not exist yet (their induced peering still under way when the target joined or
//! the origin exported) is looked at on every pass while it is younger than one resend period,
//! not only at the next resend: once the induced path exists it is translated again, so the
//! target moves to the direct address within a pass of the path coming up rather than after up
//! to a whole resend period (60 s by default) on the hub path.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use trellis_api::peers::is_networked_full_peer;
use trellis_api::{ClusterId, ClusterIdentity, convert};
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;
use trellis_store::retry::Contention;
use trellis_store::{Compare, Op, Txn};

use crate::core::Endpoints;
use crate::core::translation::Path;
use crate::model::{AddressType, Conditions, Endpoint, Slice};
use crate::records::{
    EXPORT_PREFIX, ExportRecord, ExportSource, OUTGOING_PREFIX, OutgoingRecord, decode, encode,
    export_key,
};
use crate::remote::ipam::ClusterSubnets;

/// Label naming the cluster an exported slice comes from (the MCS API's label on imported
/// slices). Set by the exporter; a slice in transit keeps it.
pub const ORIGIN_LABEL: &str = "multicluster.kubernetes.io/source-cluster";

/// How often the reconciler re-reads the peers even when no export changed: the bound on how
/// long a new or removed peer waits for its exports.
pub const RESYNC: Duration = Duration::from_secs(2);

/// An export and the peers it is currently reflected to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportView {
    pub export: ExportRecord,
    pub reflected_to: Vec<ClusterId>,
}

/// What the reconciler last delivered for one (target, namespace, name).
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The slice as we address it (what the pass wanted reflected).
    slice: Slice,
    /// The slice as translated for the target, and its generation: what a resend sends again.
    translated: Slice,
    generation: i64,
    /// The local IPAM's records of the target and of the slice's origin when it was
    /// translated (how we address them, how they address us).
    subnets: Vec<ClusterSubnets>,
    /// Whether an address took the induced path (a slice in transit from an induced peer of the
    /// target).
    induced: bool,
    /// When it was translated.
    at: tokio::time::Instant,
}

/// What the reconciler last delivered, per (target, namespace, name): a pass skips slices the
/// target already holds unchanged. Lost on restart, which only costs one translation.
pub type Delivered = HashMap<(ClusterId, String, String), Delivery>;

fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The EndpointSlice an export is reflected as: named after the Service, one endpoint per
/// address, the export's readiness as the endpoint's.
pub fn slice_of(export: &ExportRecord) -> Slice {
    let address_type = match export
        .endpoints
        .first()
        .and_then(|e| e.address.parse::<IpAddr>().ok())
    {
        Some(IpAddr::V6(_)) => AddressType::IPv6,
        _ => AddressType::IPv4,
    };
    Slice {
        namespace: export.namespace.clone(),
        name: export.name.clone(),
        service_name: export.name.clone(),
        address_type,
        endpoints: export
            .endpoints
            .iter()
            .map(|e| Endpoint {
                addresses: vec![e.address.clone()],
                conditions: Conditions {
                    ready: Some(e.ready),
                    serving: Some(e.ready),
                    terminating: None,
                },
                hostname: e.hostname.clone(),
                node_name: None,
                zone: None,
            })
            .collect(),
        ports: export.ports.clone(),
        labels: BTreeMap::new(),
        service: export.service.clone(),
    }
}

/// Kubernetes wins (ADR 0017): a `ServiceExport` takes over a gRPC export of the same name,
/// while `ExportService`/`UnexportService` cannot change what a `ServiceExport` exports.
fn refuse_takeover(held: &ExportRecord, by: ExportSource) -> Result<()> {
    if held.source == ExportSource::Kubernetes && by == ExportSource::Grpc {
        return Err(Error::FailedPrecondition(format!(
            "{}/{} is exported by a Kubernetes ServiceExport, which wins over ExportService; change or delete the ServiceExport instead",
            held.namespace, held.name
        )));
    }
    Ok(())
}

/// Same content (everything but the update time).
fn same_export(a: &ExportRecord, b: &ExportRecord) -> bool {
    a.ports == b.ports
        && a.endpoints == b.endpoints
        && a.source == b.source
        && a.service == b.service
}

/// `outgoing/<target>/<namespace>/<name>` → (namespace, name).
fn outgoing_names(key: &str) -> Option<(String, String)> {
    let mut parts = key.strip_prefix(OUTGOING_PREFIX)?.splitn(3, '/');
    let _target = parts.next()?;
    Some((parts.next()?.to_owned(), parts.next()?.to_owned()))
}

impl Endpoints {
    /// Stores (or replaces) an export after checking that every address is one of our pods.
    /// The record's shape (names, ports, address syntax) is validated by the caller.
    #[tracing::instrument(skip(self, export), fields(namespace = %export.namespace, name = %export.name))]
    pub async fn export(&self, mut export: ExportRecord) -> Result<ExportRecord> {
        let pod_cidr = self.pod_cidr().await?;
        for (i, endpoint) in export.endpoints.iter().enumerate() {
            let field = format!("endpoints[{i}].address");
            let ip: IpAddr = endpoint
                .address
                .parse()
                .map_err(|_| Error::invalid(&field, "is not an IP address"))?;
            if !pod_cidr.contains(&ip) {
                return Err(Error::invalid(
                    field,
                    format!("{ip} is not in this cluster's pod CIDR {pod_cidr}"),
                ));
            }
        }
        export.update_time_nanos = now_nanos();
        let key = export_key(&export.namespace, &export.name);
        let mut contention = Contention::on(&self.store, "storing an export");
        loop {
            let held = self.store.get(&key).await?;
            let revision = match &held {
                Some(kv) => {
                    let held: ExportRecord = decode(&key, &kv.value)?;
                    refuse_takeover(&held, export.source)?;
                    if same_export(&held, &export) {
                        // Nothing changed (a resync of the Kubernetes source): no write, no pass.
                        return Ok(held);
                    }
                    kv.mod_revision
                }
                None => 0,
            };
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![Compare::ModRevision {
                        key: key.clone(),
                        revision,
                    }],
                    success: vec![Op::put(&key, encode(&export)?)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                break;
            }
            contention.lost().await?;
        }
        tracing::info!(
            endpoints = export.endpoints.len(),
            ports = export.ports.len(),
            "exported service"
        );
        self.exports_changed.notify_one();
        // An exporting cluster imports its own export too.
        self.imports_changed();
        Ok(export)
    }

    /// Removes an export made by `source`; the reconciler withdraws its reflections.
    #[tracing::instrument(skip(self))]
    pub async fn unexport(
        &self,
        namespace: &str,
        name: &str,
        source: ExportSource,
    ) -> Result<bool> {
        let key = export_key(namespace, name);
        let mut contention = Contention::on(&self.store, "removing an export");
        let removed = loop {
            let Some(kv) = self.store.get(&key).await? else {
                break false;
            };
            let held: ExportRecord = decode(&key, &kv.value)?;
            if held.source != source {
                if source == ExportSource::Kubernetes {
                    // A gRPC export of the same name is not the Kubernetes source's to remove.
                    break false;
                }
                refuse_takeover(&held, source)?;
            }
            let committed = self
                .store
                .txn(Txn {
                    compares: vec![Compare::ModRevision {
                        key: key.clone(),
                        revision: kv.mod_revision,
                    }],
                    success: vec![Op::delete(&key)],
                    failure: vec![],
                })
                .await?;
            if committed.succeeded {
                break true;
            }
            contention.lost().await?;
        };
        tracing::info!(removed, "unexported service");
        self.exports_changed.notify_one();
        if removed {
            self.imports_changed();
        }
        Ok(removed)
    }

    /// The slice one of our exports is reflected (and imported here) as: [`slice_of`] labelled
    /// with us as its origin.
    pub(crate) fn own_slice(&self, export: &ExportRecord) -> Slice {
        let mut slice = slice_of(export);
        slice
            .labels
            .insert(ORIGIN_LABEL.to_owned(), self.local().id.to_string());
        slice
    }

    /// Every stored export (both sources).
    pub(crate) async fn stored_exports(&self) -> Result<Vec<ExportRecord>> {
        self.store
            .list(EXPORT_PREFIX)
            .await?
            .kvs
            .iter()
            .map(|kv| decode(&kv.key, &kv.value))
            .collect()
    }

    /// The outgoing reflections the reconciler owns: (target, namespace, name).
    async fn owned_reflections(&self) -> Result<Vec<(ClusterIdentity, String, String)>> {
        let mut out = Vec::new();
        for kv in self.store.list(OUTGOING_PREFIX).await?.kvs {
            let rec: OutgoingRecord = decode(&kv.key, &kv.value)?;
            if let (true, Some((namespace, name))) = (rec.export, outgoing_names(&kv.key)) {
                out.push((rec.target, namespace, name));
            }
        }
        Ok(out)
    }

    /// Every export, ordered by (namespace, name), with the peers it is reflected to.
    pub async fn list_exports(&self) -> Result<Vec<ExportView>> {
        let mut reflected: BTreeMap<(String, String), BTreeSet<ClusterId>> = BTreeMap::new();
        for (target, namespace, name) in self.owned_reflections().await? {
            reflected
                .entry((namespace, name))
                .or_default()
                .insert(target.id);
        }
        let mut out: Vec<ExportView> = self
            .stored_exports()
            .await?
            .into_iter()
            .map(|export| {
                let to = reflected
                    .remove(&(export.namespace.clone(), export.name.clone()))
                    .unwrap_or_default();
                ExportView {
                    export,
                    reflected_to: to.into_iter().collect(),
                }
            })
            .collect();
        out.sort_by(|a, b| {
            (&a.export.namespace, &a.export.name).cmp(&(&b.export.namespace, &b.export.name))
        });
        Ok(out)
    }

    /// The networked full peers, from discovery.
    async fn export_targets(&self) -> Result<BTreeMap<ClusterId, ClusterIdentity>> {
        let list = self.clients.foreign_clusters().await?;
        Ok(list
            .iter()
            .filter(|fc| is_networked_full_peer(fc))
            .filter_map(|fc| convert::identity_from_pb("identity", fc.identity.as_ref()).ok())
            .filter(|identity| identity.id != self.local().id)
            .map(|identity| (identity.id.clone(), identity))
            .collect())
    }

    /// Every reflection this cluster should hold, by (target, namespace, slice name): each own
    /// export to every peer, and each export a peer sent us directly to every other peer
    /// (transit, so a leaf's export reaches the hub's other leaves; their translation takes
    /// the induced path where there is one).
    async fn desired(
        &self,
        targets: &BTreeMap<ClusterId, ClusterIdentity>,
    ) -> Result<BTreeMap<(ClusterId, String, String), Slice>> {
        let mut desired = BTreeMap::new();
        for export in self.stored_exports().await? {
            let slice = self.own_slice(&export);
            for target in targets.keys() {
                desired.insert(
                    (target.clone(), slice.namespace.clone(), slice.name.clone()),
                    slice.clone(),
                );
            }
        }
        for import in self.list(None, None).await? {
            let Some(slice) = transit_of(&import.source.id, &import.slice) else {
                continue;
            };
            if !targets.contains_key(&import.source.id) {
                continue;
            }
            for target in targets.keys().filter(|t| **t != import.source.id) {
                desired.insert(
                    (target.clone(), slice.namespace.clone(), slice.name.clone()),
                    slice.clone(),
                );
            }
        }
        Ok(desired)
    }

    /// The local IPAM's records (how we address each peer and how each addresses us): what
    /// every translation depends on locally.
    async fn subnets(&self) -> Result<Arc<Vec<ClusterSubnets>>> {
        Ok(Arc::new(self.clients.cluster_subnets().await?))
    }

    /// One reconciler pass: drop what a peer that is gone brought us, reflect every export
    /// (ours, and those in transit) to every networked full peer, withdraw owned reflections
    /// whose export or peer is gone; with `resend`, deliver again what was delivered unchanged
    /// (see the module documentation). A failure for one (peer, slice) is logged and retried on
    /// the next pass; it does not stop the others. Returns how many steps failed.
    pub async fn reconcile_exports(
        &self,
        delivered: &mut Delivered,
        resend: bool,
        resend_period: Duration,
    ) -> Result<usize> {
        // Imports listed before the peers are read: an import is stored only while its source
        // is a peer, so one stored after a stale read of the peers cannot be dropped here.
        let imports = self.list(None, None).await?;
        // Nothing exported, imported or reflected: no pass needs the peers. Every endpoints
        // service of a fresh cluster listed every peer from discovery every two seconds, which
        // at 255 peered clusters was the largest cost of a lab with nothing exported.
        if imports.is_empty()
            && self.store.list(EXPORT_PREFIX).await?.kvs.is_empty()
            && self.store.list(OUTGOING_PREFIX).await?.kvs.is_empty()
        {
            delivered.clear();
            return Ok(0);
        }
        let targets = self.export_targets().await?;
        let mut failed = 0;
        // Imports first, so an export in transit from a peer that is gone is withdrawn below.
        for import in imports {
            if targets.contains_key(&import.source.id) {
                continue;
            }
            if let Err(err) = self
                .forget(&import.source, &import.slice.namespace, &import.slice.name)
                .await
            {
                failed += 1;
                tracing::warn!(source.id = %import.source.id, namespace = %import.slice.namespace, name = %import.slice.name, error = %err, "dropping what a former peer reflected failed; retrying on the next pass");
            }
        }
        let desired = self.desired(&targets).await?;
        for (target, namespace, name) in self.owned_reflections().await? {
            let key = (target.id.clone(), namespace.clone(), name.clone());
            if desired.contains_key(&key) {
                continue;
            }
            // A peer that went away cannot be told; its own endpoints service drops what we
            // brought when it forgets us. We still release our hub-path allocations.
            let peer = targets.contains_key(&target.id);
            match self.unreflect(&target, &namespace, &name, peer).await {
                Ok(_) => {
                    delivered.remove(&key);
                }
                Err(err) => {
                    failed += 1;
                    tracing::warn!(target.id = %target.id, namespace, name, error = %err, "withdrawing an export failed; retrying on the next pass");
                }
            }
        }
        delivered.retain(|(target, _, _), _| targets.contains_key(target));
        // Read at most once per pass, before any translation: a change after it shows at the
        // next resend.
        let mut subnets: Option<Arc<Vec<ClusterSubnets>>> = None;
        let mut induced_routes: HashMap<(ClusterId, ClusterId), bool> = HashMap::new();
        for (key, slice) in desired {
            let Some(target) = targets.get(&key.0) else {
                continue;
            };
            let Some(home) = slice
                .labels
                .get(ORIGIN_LABEL)
                .and_then(|origin| ClusterId::parse("origin", origin).ok())
            else {
                continue;
            };
            // A recheck keeps its delivery's age, so a translation that still takes the hub
            // path does not extend the window.
            let mut since = None;
            if let Some(held) = delivered.get(&key)
                && held.slice == slice
            {
                let in_transit = home != self.local().id;
                let awaiting_path =
                    in_transit && !held.induced && held.at.elapsed() < resend_period;
                if !resend && !awaiting_path {
                    continue;
                }
                let induced = if in_transit {
                    match induced_routes.get(&(home.clone(), target.id.clone())) {
                        Some(induced) => *induced,
                        None => {
                            let induced = match self.induced_route(&home, target).await {
                                Ok(induced) => induced,
                                // Between resends an origin's IPAM that does not answer leaves
                                // the hub path in place; a resend fails as before.
                                Err(err) if !resend => {
                                    tracing::debug!(origin.id = %home, target.id = %target.id, error = %err, "cannot tell yet whether the induced path is up");
                                    false
                                }
                                Err(err) => return Err(err),
                            };
                            induced_routes.insert((home.clone(), target.id.clone()), induced);
                            induced
                        }
                    }
                } else {
                    false
                };
                if !resend {
                    if !induced {
                        // Still no induced path: the hub path stands until the next pass.
                        continue;
                    }
                    since = Some(held.at);
                }
                let current = match &subnets {
                    Some(s) => s.clone(),
                    None => subnets.insert(self.subnets().await?).clone(),
                };
                if resend
                    && held.subnets == relevant(&current, &target.id, &home)
                    && held.induced == induced
                {
                    match self
                        .redeliver(target, &held.translated, held.generation)
                        .await
                    {
                        Ok(answer) if answer.applied => continue,
                        // The target holds a higher generation: translated and renumbered below.
                        Ok(_) => {}
                        Err(err) => {
                            // Kept: the next resend tries again, still without translating.
                            failed += 1;
                            tracing::warn!(target.id = %target.id, namespace = %key.1, name = %key.2, error = %err, "resending an export failed; retrying at the next resend");
                            continue;
                        }
                    }
                }
            }
            let translated_with = match &subnets {
                Some(s) => s.clone(),
                None => subnets.insert(self.subnets().await?).clone(),
            };
            match self
                .reflect_as(target, slice.clone(), true, Some(&home))
                .await
            {
                Ok(reflected) => {
                    let induced = reflected
                        .translations
                        .iter()
                        .any(|t| t.path == Path::Induced);
                    let subnets = relevant(&translated_with, &key.0, &home);
                    delivered.insert(
                        key,
                        Delivery {
                            slice,
                            translated: reflected.slice,
                            generation: reflected.generation,
                            subnets,
                            induced,
                            at: since.unwrap_or_else(tokio::time::Instant::now),
                        },
                    );
                }
                Err(err) => {
                    failed += 1;
                    tracing::warn!(target.id = %target.id, namespace = %key.1, name = %key.2, error = %err, "reflecting an export failed; retrying on the next pass");
                    delivered.remove(&key);
                }
            }
        }
        Ok(failed)
    }
}

/// The local IPAM's records of `target` and `origin`: what a translation for `target` of
/// `origin`'s addresses depends on locally.
fn relevant(all: &[ClusterSubnets], target: &ClusterId, origin: &ClusterId) -> Vec<ClusterSubnets> {
    all.iter()
        .filter(|c| c.cluster_id == target.as_str() || c.cluster_id == origin.as_str())
        .cloned()
        .collect()
}

/// The slice `source` sent us, as we pass it on to our other peers: only an export its origin
/// sent directly (origin label = source), so nothing travels more than two hops or back to its
/// origin; named `<slice>.<origin>` (a dot never occurs in an export's own name, a DNS label).
fn transit_of(source: &ClusterId, slice: &Slice) -> Option<Slice> {
    if slice.labels.get(ORIGIN_LABEL).map(String::as_str) != Some(source.as_str()) {
        return None;
    }
    let mut transit = slice.clone();
    transit.name = format!("{}.{}", slice.name, source);
    Some(transit)
}

/// Runs the export reconciler until `shutdown`: a pass after every export change and every
/// `resync`.
pub async fn run_reconciler(
    core: Arc<Endpoints>,
    resync: Duration,
    resend: Duration,
    shutdown: Shutdown,
) {
    let mut delivered = Delivered::new();
    let mut last_resend = tokio::time::Instant::now();
    loop {
        let resend_now = last_resend.elapsed() >= resend;
        if resend_now {
            last_resend = tokio::time::Instant::now();
        }
        if let Err(err) = core
            .reconcile_exports(&mut delivered, resend_now, resend)
            .await
        {
            tracing::warn!(error = %err, "export reconciler pass failed");
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = core.exports_changed.notified() => {}
            () = trellis_runtime::timer::period(resync) => {}
        }
    }
}
