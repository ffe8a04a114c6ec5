//! The reconciler: makes the store match what discovery says we are peered with. For every
//! remote we must exchange NetworkConfigs with, it keeps our NetworkConfig current (local IPAM
//! subnets and the gateway's endpoint and key for that remote), delivers it until the remote
//! decides (directly to a full peer's broker, or through the hub's forwarder for an induced
//! peer), and writes the TunnelEndpoint once both directions are decided. Everything held for
//! a remote that is no longer wanted is torn down. Runs on every wake-up (handlers, discovery
//! changes) and periodically; every step is idempotent, so a restart simply runs it again.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use futures::StreamExt as _;
use tracing::Instrument as _;
use trellis_api::ClusterId;
use trellis_api::convert::identity_to_pb;
use trellis_api::model::{NatView, NetworkSpec, TunnelEndpoint};
use trellis_api::pb::discovery::WatchForeignClustersResponse;
use trellis_api::pb::gateway::GetGatewayInfoRequest;
use trellis_api::pb::ipam::{
    FreeSubnetsPerClusterRequest, GetLocalSubnetsRequest, ListClusterSubnetsRequest,
};
use trellis_api::pb::peering::{RelayRequest, RelayWithdrawalRequest, SubmitNetworkConfigRequest};
use trellis_api::pb::types as pb;
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;
use trellis_runtime::foreign_clusters::Followed;
use trellis_runtime::propagation::{resumed_span, traceparent_of};
use trellis_runtime::resync::Resync;
use trellis_runtime::retry::{KeyedBackoff, RetryPolicy};
use trellis_store::{Compare, Op, Txn};

use crate::core::{Broker, Dirty, Lane};
use crate::records::{
    Decision, IN_PREFIX, IncomingNc, NOTIFY_PREFIX, OUT_PREFIX, OutgoingNc, PendingNotify,
    TUNNELS_PREFIX, TunnelRecord, decode, encode, in_key, nc_name, out_key, tombstone_key,
    tunnel_key,
};
use trellis_api::peers::{Peers, Remote, Route};

/// The waits before retrying after a failed delivery: 200 ms doubling to 10 s, per remote.
const RETRY: RetryPolicy =
    RetryPolicy::exponential(Duration::from_millis(200), Duration::from_secs(10));

/// Remotes worked on at the same time within one pass: deliveries wait on other clusters,
/// so one slow remote must not hold up the others.
const CONCURRENCY: usize = 16;

/// Runs until `shutdown`, in two lanes: full peers and induced peers are reconciled by
/// separate loops ([`Lane`]), each with its own pending work and retries, so work for a full
/// peering (its NetworkConfig exchange and tunnel) never waits behind a pass over induced
/// exchanges, which each wait on a relay through a hub. Within a lane, a pass looks at every
/// remote of the lane on the periodic resync (and after a failure it could not pin on one
/// remote), otherwise only at the remotes something happened to ([`Broker::wake_for`]), so the
/// work per event does not grow with the number of peers.
pub async fn run(broker: Arc<Broker>, resync: Duration, shutdown: Shutdown) {
    trellis_runtime::telemetry::spawn(follow_discovery(broker.clone(), shutdown.clone()));
    let induced = trellis_runtime::telemetry::spawn(run_lane(
        broker.clone(),
        Lane::Induced,
        resync,
        shutdown.clone(),
    ));
    run_lane(broker, Lane::Full, resync, shutdown).await;
    let _ = induced.await;
}

/// One lane's loop.
async fn run_lane(broker: Arc<Broker>, lane: Lane, resync: Duration, shutdown: Shutdown) {
    let wake = broker.lane_wake(lane);
    let mut periodic = Resync::new(resync);
    let mut retries = Retries::default();
    loop {
        let now = Instant::now();
        let mut dirty = broker.take_dirty(lane);
        if periodic.due(now) {
            dirty.all = true;
        }
        dirty.all |= retries.all_due(now);
        dirty.ids.extend(retries.due(now));
        if dirty.all || !dirty.ids.is_empty() {
            let own = own_look(&dirty, &retries);
            let outcome = if dirty.all {
                let outcome = pass(&broker, lane).await;
                periodic.ran(now, Instant::now());
                match outcome {
                    Ok(mut failed) if !own.is_empty() => {
                        pass_for(&broker, lane, &own).await.map(|more| {
                            failed.ids.extend(more.ids);
                            failed.all |= more.all;
                            failed
                        })
                    }
                    other => other,
                }
            } else {
                pass_for(&broker, lane, &dirty.ids).await
            };
            let now = Instant::now();
            match outcome {
                Ok(failed) => {
                    if dirty.all {
                        // A full pass looked at everything: only its own failures remain.
                        retries.settle_all_but(&failed);
                    } else {
                        retries.settle(dirty.ids.iter().filter(|id| !failed.ids.contains(*id)));
                    }
                    for id in failed.ids {
                        retries.failed(id, now);
                    }
                    if failed.all {
                        retries.failed_all(now);
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, ?lane, "reconciliation failed; retrying");
                    retries.failed_all(now);
                    for id in dirty.ids {
                        retries.failed(id, now);
                    }
                }
            }
        }
        let wake_at = retries
            .next_due()
            .map_or(periodic.next(), |at| at.min(periodic.next()));
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = wake.notified() => {}
            () = tokio::time::sleep_until(wake_at) => {}
        }
    }
}

/// The remotes a full pass must also look at one by one: a full pass takes a settled exchange
/// on trust (it compares only our side of it, so a pass over hundreds of remotes reads little),
/// but a remote woken for its own reason (a network config it sent us, say with a new key) or
/// waiting for a retry needs the whole look, or its change waits for nothing and is lost.
fn own_look(dirty: &Dirty, retries: &Retries) -> BTreeSet<ClusterId> {
    if !dirty.all {
        return BTreeSet::new();
    }
    dirty
        .ids
        .iter()
        .chain(retries.remotes.keys())
        .cloned()
        .collect()
}

/// When to look again at what a pass left unfinished. Each remote backs off on its own: while
/// leaves are still peering with the hub, many remotes fail for a while, and one shared backoff
/// grown on their failures would also hold back every remote that failed once, later.
#[derive(Debug)]
struct Retries {
    /// Per remote: its failures in a row and when it is due.
    remotes: KeyedBackoff<ClusterId>,
    /// The same for a failure not tied to one remote (a full pass).
    all: KeyedBackoff<()>,
}

impl Default for Retries {
    fn default() -> Self {
        Self {
            remotes: KeyedBackoff::new(RETRY),
            all: KeyedBackoff::new(RETRY),
        }
    }
}

impl Retries {
    fn failed(&mut self, id: ClusterId, now: Instant) {
        self.remotes.failed(id, now);
    }

    fn failed_all(&mut self, now: Instant) {
        self.all.failed((), now);
    }

    fn settle<'a>(&mut self, ids: impl Iterator<Item = &'a ClusterId>) {
        for id in ids {
            self.remotes.reset(id);
        }
    }

    fn settle_all_but(&mut self, failed: &Unsettled) {
        self.remotes.retain(|id| failed.ids.contains(id));
        if !failed.all {
            self.all.reset(&());
        }
    }

    fn all_due(&self, now: Instant) -> bool {
        self.all.is_due(&(), now)
    }

    fn due(&self, now: Instant) -> Vec<ClusterId> {
        self.remotes.due(now).cloned().collect()
    }

    fn next_due(&self) -> Option<Instant> {
        self.remotes
            .next_due()
            .into_iter()
            .chain(self.all.next_due())
            .min()
    }
}

/// Wakes the reconciler on every change of the local ForeignClusters, after the broker's copy
/// of them has taken the change in. The stream is only a trigger: each pass re-reads what it
/// acts on from discovery, so a missed event costs at most a resync.
async fn follow_discovery(broker: Arc<Broker>, shutdown: Shutdown) {
    let mut seen = HashMap::new();
    broker
        .foreign_clusters()
        .follow(
            broker.clients().discovery_channel(),
            shutdown,
            |followed| match followed {
                Followed::Restarted => seen.clear(),
                Followed::Event(event) => wake_for_event(&broker, event, &mut seen),
            },
        )
        .await;
}

/// A change of an induced record concerns that remote only; anything else (a full peer: a
/// hub whose change moves the routes of the remotes it introduced; a deletion, which may carry
/// only the ID) is looked at in a pass over every remote. The snapshot at the start of a watch
/// is all ADDED events, so a restarted watch also ends in such a pass.
///
/// A record rewritten with nothing the reconciler reads changed (a hub's new Neighborhood
/// generation refreshes every record it lists) wakes nothing: `seen` holds what the reconciler
/// reads of each record since this watch started, as a digest ([`relevant_digest`]).
fn wake_for_event(
    broker: &Broker,
    event: &WatchForeignClustersResponse,
    seen: &mut HashMap<String, u64>,
) {
    if let Some(fc) = event.foreign_cluster.as_ref()
        && let Some(identity) = fc.identity.as_ref()
        && event.r#type != pb::WatchEventType::Deleted as i32
    {
        let relevant = relevant_digest(fc);
        if seen.get(&identity.cluster_id) == Some(&relevant) {
            return;
        }
        seen.insert(identity.cluster_id.clone(), relevant);
    } else if let Some(identity) = event
        .foreign_cluster
        .as_ref()
        .and_then(|fc| fc.identity.as_ref())
    {
        seen.remove(&identity.cluster_id);
    }
    let induced = event
        .foreign_cluster
        .as_ref()
        .filter(|fc| fc.kind == pb::PeeringKind::Induced as i32)
        .and_then(|fc| fc.identity.as_ref())
        .and_then(|identity| ClusterId::parse("cluster_id", &identity.cluster_id).ok());
    match (pb::WatchEventType::try_from(event.r#type), induced) {
        (Ok(pb::WatchEventType::Bookmark), _) => {}
        (Ok(pb::WatchEventType::Added | pb::WatchEventType::Modified), Some(id)) => {
            broker.wake_for(&id, Lane::Induced);
        }
        _ => broker.wake(),
    }
}

/// A digest of [`relevant_part`]: what `seen` keeps per remote instead of a second copy of
/// every record (issue 17). A collision would only delay a wake until the next pass.
fn relevant_digest(fc: &pb::ForeignCluster) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    prost::Message::encode_to_vec(&relevant_part(fc)).hash(&mut hasher);
    hasher.finish()
}

/// What [`Peers::from_foreign_clusters`] reads of a record: without timestamps, revision,
/// Neighborhood generation and the reasons and messages of conditions.
fn relevant_part(fc: &pb::ForeignCluster) -> pb::ForeignCluster {
    let mut out = fc.clone();
    out.create_time = None;
    out.update_time = None;
    out.revision = 0;
    if let Some(induced) = out.induced.as_mut() {
        induced.neighborhood_generation = 0;
    }
    out.conditions = fc
        .conditions
        .iter()
        .map(|c| pb::Condition {
            r#type: c.r#type.clone(),
            status: c.status,
            ..Default::default()
        })
        .collect();
    out
}

/// What a pass left unfinished: remotes to retry, or (`all`) something not tied to one remote.
#[derive(Debug, Default)]
pub struct Unsettled {
    pub all: bool,
    pub ids: BTreeSet<ClusterId>,
}

/// The remotes we hold any state for (NetworkConfigs or a TunnelEndpoint).
async fn held(broker: &Broker) -> Result<BTreeSet<ClusterId>> {
    let mut held = BTreeSet::new();
    for prefix in [OUT_PREFIX, IN_PREFIX, TUNNELS_PREFIX] {
        for kv in broker.store().list(prefix).await?.kvs {
            if let Some(id) = kv
                .key
                .strip_prefix(prefix)
                .and_then(|id| ClusterId::parse("key", id).ok())
            {
                held.insert(id);
            }
        }
    }
    Ok(held)
}

/// Whether we hold any state for `id`.
async fn holds(broker: &Broker, id: &ClusterId) -> Result<bool> {
    for key in [out_key(id), in_key(id), tunnel_key(id)] {
        if broker.store().get(&key).await?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The gateway's key and address, the same for every remote: a settled exchange whose
/// NetworkConfig still carries them needs no per-remote question on a periodic pass.
struct GatewayBasics {
    public_key: String,
    /// The host of the gateway's endpoint (an IP or a DNS name; the port is per remote).
    endpoint_host: Option<trellis_api::model::EndpointHost>,
}

async fn gateway_basics(broker: &Broker) -> Result<GatewayBasics> {
    let info = broker
        .clients()
        .gateway()
        .get_gateway_info(GetGatewayInfoRequest {
            cluster_id: String::new(),
        })
        .await
        .map_err(|s| Error::from(s).context("asking the gateway for its endpoint"))?
        .into_inner();
    if let Ok(key) = trellis_api::model::WgKey::parse("public_key", &info.public_key) {
        broker.note_own_key(key);
    }
    Ok(GatewayBasics {
        public_key: info.public_key,
        endpoint_host: trellis_api::model::Endpoint::parse("endpoint", &info.endpoint)
            .ok()
            .map(|e| e.host().clone()),
    })
}

/// Runs [`ensure`] for `remotes`, [`CONCURRENCY`] at a time; returns those that failed.
async fn ensure_all(
    broker: &Broker,
    remotes: Vec<&Remote>,
    basics: Option<&GatewayBasics>,
) -> Result<BTreeSet<ClusterId>> {
    let mut failed = BTreeSet::new();
    if remotes.is_empty() {
        return Ok(failed);
    }
    let subnets = broker
        .clients()
        .ipam()
        .get_local_subnets(GetLocalSubnetsRequest {})
        .await
        .map_err(|s| Error::from(s).context("reading the local subnets"))?
        .into_inner();
    let (pod, external) = (&subnets.pod_cidr, &subnets.external_cidr);
    // Each future is made when a slot frees. Made up front, every pass over 254 remotes held
    // 254 of them: 176 MiB of the 255-cluster in-process lab's peak heap (issue 17).
    let mut waiting = remotes.into_iter();
    let mut running = futures::stream::FuturesUnordered::new();
    for remote in waiting.by_ref().take(CONCURRENCY) {
        running.push(ensure_one(broker, remote, pod, external, basics));
    }
    while let Some(result) = running.next().await {
        if let Err(id) = result {
            failed.insert(id);
        }
        if let Some(remote) = waiting.next() {
            running.push(ensure_one(broker, remote, pod, external, basics));
        }
    }
    Ok(failed)
}

/// [`ensure`], its failure logged and reduced to the remote's ID.
async fn ensure_one(
    broker: &Broker,
    remote: &Remote,
    pod: &str,
    external: &str,
    basics: Option<&GatewayBasics>,
) -> std::result::Result<(), ClusterId> {
    ensure(broker, remote, pod, external, basics)
        .await
        .map_err(|err| {
            tracing::warn!(remote.id = %remote.identity.id, error = %err, "network config exchange incomplete");
            remote.identity.id.clone()
        })
}

/// One reconciliation over every remote of `lane`: the periodic resync, and whatever cannot
/// be pinned on one remote (peering changes, a restart). The full lane also delivers pending
/// unpeering notices and frees orphaned IPAM mappings.
pub async fn pass(broker: &Broker, lane: Lane) -> Result<Unsettled> {
    // What we hold is read before who we peer with: a NetworkConfig received meanwhile was
    // checked against a newer discovery listing than ours and must not look unwanted. The
    // IPAM's mappings are read first of all, for the same reason.
    // An IPAM that does not answer holds up only this reconciliation, not the rest of the pass.
    let mapped = match lane {
        Lane::Full => Some(mapped(broker).await.inspect_err(
            |err| tracing::warn!(error = %err, "cannot reconcile the ipam's mappings"),
        )),
        Lane::Induced => None,
    };
    let held = held(broker).await?;
    let peers = broker.view().await?;
    let mut unsettled = Unsettled::default();

    if lane == Lane::Full {
        for kv in broker.store().list(NOTIFY_PREFIX).await?.kvs {
            let pending: PendingNotify = decode(&kv.key, &kv.value)?;
            if !broker.act_on_notice(&pending.remote.id).await? {
                unsettled.all = true;
            }
        }
    }

    let mine: Vec<&Remote> = peers
        .desired
        .values()
        .filter(|remote| Lane::of_route(&remote.route) == lane)
        .collect();
    if !mine.is_empty() {
        let basics = gateway_basics(broker).await?;
        unsettled.ids = ensure_all(broker, mine, Some(&basics)).await?;
    }

    let mut unwanted = Vec::new();
    for id in held.iter().filter(|id| !peers.desired.contains_key(*id)) {
        if held_lane(broker, id).await? == lane {
            unwanted.push(id);
        }
    }
    if !unwanted.is_empty() {
        // Tearing down is not undone by a later pass (the remote does not re-send what we
        // already decided on), so confirm with a fresh listing first.
        let fresh = broker.peers().await?;
        for id in unwanted
            .into_iter()
            .filter(|id| !fresh.desired.contains_key(*id))
        {
            if let Err(err) = teardown(broker, id, "PeeringGone").await {
                tracing::warn!(remote.id = %id, error = %err, "teardown incomplete");
                unsettled.ids.insert(id.clone());
            }
        }
    }
    let orphans_left = match mapped {
        Some(Ok(mapped)) => !free_orphaned_mappings(broker, mapped, &held, &peers)
            .await?
            .is_empty(),
        Some(Err(_)) => true,
        None => false,
    };
    unsettled.all |= orphans_left;
    Ok(unsettled)
}

/// The lane of a remote we hold state for, from that state: relayed through a hub (our
/// NetworkConfig, theirs or the tunnel names one) or direct. Decides which lane tears it down
/// once it is no longer wanted, so the two never both do.
async fn held_lane(broker: &Broker, id: &ClusterId) -> Result<Lane> {
    let store = broker.store();
    if let Some(kv) = store.get(&out_key(id)).await? {
        let out: OutgoingNc = decode(&out_key(id), &kv.value)?;
        return Ok(Lane::of_via(out.via.as_ref()));
    }
    if let Some(kv) = store.get(&in_key(id)).await? {
        let incoming: IncomingNc = decode(&in_key(id), &kv.value)?;
        return Ok(Lane::of_via(incoming.via.as_ref()));
    }
    if let Some(kv) = store.get(&tunnel_key(id)).await? {
        let tunnel: TunnelRecord = decode(&tunnel_key(id), &kv.value)?;
        return Ok(Lane::of_via(tunnel.via.as_ref()));
    }
    Ok(Lane::Full)
}

/// From this many remotes woken at once (a hub's Neighborhood introduced them together), one
/// listing of every cluster costs less than a lookup per remote and per hub.
const LIST_FROM: usize = 8;

/// Where [`peers_for`] reads discovery's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// The watch-fed copy where it holds a record (a record it lacks is read from discovery):
    /// may lag discovery.
    Copy,
    /// Discovery itself: to confirm an absence before acting on it.
    Fresh,
}

/// The records of `ids` (unknown ones absent) from `source`.
async fn records_of(
    broker: &Broker,
    ids: &[&ClusterId],
    source: Source,
) -> Result<Vec<pb::ForeignCluster>> {
    match source {
        Source::Copy => {
            broker
                .foreign_clusters()
                .lookup(&broker.clients().discovery_channel(), ids, |_| true)
                .await
        }
        Source::Fresh => broker.foreign_clusters_of(ids).await,
    }
}

/// The peering view of `ids` and of the hubs that introduced them: enough to route each of
/// them, from a few records rather than a listing of every cluster (or from a whole view
/// when many remotes are woken at once).
async fn peers_for(broker: &Broker, ids: &BTreeSet<ClusterId>, source: Source) -> Result<Peers> {
    if ids.len() >= LIST_FROM {
        return match source {
            Source::Copy => broker.view().await,
            Source::Fresh => broker.peers().await,
        };
    }
    let mut records = records_of(broker, &ids.iter().collect::<Vec<_>>(), source).await?;
    let first = Peers::from_foreign_clusters(&records);
    let hubs: Vec<&ClusterId> = first
        .induced
        .values()
        .flatten()
        .filter(|hub| !ids.contains(*hub))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    if hubs.is_empty() {
        return Ok(first);
    }
    // Only the hubs are looked up again; the remotes' records are those read just now.
    records.extend(records_of(broker, &hubs, source).await?);
    Ok(Peers::from_foreign_clusters(&records))
}

/// One reconciliation of the remotes `ids` only, those of `lane`; a remote that belongs to
/// the other lane (its route changed since it was woken) is handed over to it.
pub async fn pass_for(broker: &Broker, lane: Lane, ids: &BTreeSet<ClusterId>) -> Result<Unsettled> {
    // Held before the peering view, as in [`pass`].
    let mut held = BTreeSet::new();
    for id in ids {
        if holds(broker, id).await? {
            held.insert(id.clone());
        }
    }
    let peers = peers_for(broker, ids, Source::Copy).await?;
    let mut mine = Vec::new();
    for id in ids {
        if let Some(remote) = peers.desired.get(id) {
            if Lane::of_route(&remote.route) == lane {
                mine.push(remote);
            } else {
                broker.wake_for(id, lane.other());
            }
        }
    }
    let mut unsettled = Unsettled {
        all: false,
        ids: ensure_all(broker, mine, None).await?,
    };
    let unwanted: BTreeSet<ClusterId> = held
        .iter()
        .filter(|id| !peers.desired.contains_key(*id))
        .cloned()
        .collect();
    if unwanted.is_empty() {
        return Ok(unsettled);
    }
    // Tearing down is not undone by a later pass, and the view above may lag discovery:
    // confirm with a fresh one. A remote wanted after all is woken by the watch event that
    // brings its change to the copy.
    let fresh = peers_for(broker, &unwanted, Source::Fresh).await?;
    for id in unwanted
        .iter()
        .filter(|id| !fresh.desired.contains_key(*id))
    {
        if held_lane(broker, id).await? != lane {
            broker.wake_for(id, lane.other());
            continue;
        }
        if let Err(err) = teardown(broker, id, "PeeringGone").await {
            tracing::warn!(remote.id = %id, error = %err, "teardown incomplete");
            unsettled.ids.insert(id.clone());
        }
    }
    Ok(unsettled)
}

/// Our spec for `remote`: the local CIDRs and the gateway's endpoint and key for that peer.
async fn local_spec(
    broker: &Broker,
    remote: &ClusterId,
    pod: &str,
    external: &str,
) -> Result<NetworkSpec> {
    let info = broker
        .clients()
        .gateway()
        .get_gateway_info(GetGatewayInfoRequest {
            cluster_id: remote.to_string(),
        })
        .await
        .map_err(|s| Error::from(s).context("asking the gateway for its endpoint"))?
        .into_inner();
    let wire = pb::NetworkConfigSpec {
        pod_cidr: pod.to_owned(),
        external_cidr: external.to_owned(),
        endpoint: info.endpoint,
        public_key: info.public_key,
    };
    NetworkSpec::from_proto("local", Some(&wire)).map_err(|e| {
        Error::Internal(format!(
            "the local IPAM or gateway answered unusable parameters: {e}"
        ))
    })
}

/// The decision in a status, when the receiver has made one.
pub fn decision_from_status(
    spec: &NetworkSpec,
    status: Option<&pb::NetworkConfigStatus>,
) -> Result<Option<Decision>> {
    let Some(status) = status else {
        return Ok(None);
    };
    match pb::NetworkConfigState::try_from(status.state) {
        Ok(pb::NetworkConfigState::Processed) => Ok(Some(Decision::Processed {
            view: NatView::for_spec("status", spec, status)?,
            observed_generation: status.observed_generation,
        })),
        Ok(pb::NetworkConfigState::Rejected) => Ok(Some(Decision::Rejected {
            message: status.message.clone(),
            observed_generation: status.observed_generation,
        })),
        _ => Ok(None),
    }
}

/// Keeps the exchange with `remote` going. While it is unfinished (no decision on our
/// NetworkConfig, or no TunnelEndpoint yet) the work runs in the exchange's trace, resumed
/// from the stored traceparent, so one peering setup is one trace across passes, processes
/// and clusters; settled exchanges add nothing to it on later resyncs.
///
/// With `basics` (a periodic pass), a settled exchange whose NetworkConfig still carries the
/// gateway's key and address is left alone: anything that changes it for one remote (its new
/// NetworkConfig, its decision, discovery) wakes a pass for that remote.
async fn ensure(
    broker: &Broker,
    remote: &Remote,
    pod: &str,
    external: &str,
    basics: Option<&GatewayBasics>,
) -> Result<()> {
    let id = &remote.identity.id;
    let key = out_key(id);
    let existing = match broker.store().get(&key).await? {
        Some(kv) => Some((decode::<OutgoingNc>(&key, &kv.value)?, kv.mod_revision)),
        None => None,
    };
    let unfinished = match &existing {
        Some((out, _)) => {
            out.current_decision().is_none() || broker.store().get(&tunnel_key(id)).await?.is_none()
        }
        None => true,
    };
    if let (false, Some((out, _)), Some(basics)) = (unfinished, &existing, basics) {
        let same_gateway = out.spec.public_key.to_string() == basics.public_key
            && basics.endpoint_host.as_ref() == Some(out.spec.endpoint.host());
        let forwarder = match &remote.route {
            Route::Direct { .. } => None,
            Route::Relayed { forwarder, .. } => Some(forwarder.as_str()),
        };
        let same_route = out.via.as_ref() == remote.via()
            && out.forwarder.as_deref() == forwarder
            && out.spec.pod_cidr.to_string() == pod
            && out.spec.external_cidr.to_string() == external;
        if same_gateway && same_route {
            return Ok(());
        }
    }
    let span = if unfinished {
        let stored = existing.as_ref().and_then(|(o, _)| o.trace.as_deref());
        let root = resumed_span("network config exchange", stored);
        tracing::info_span!(parent: &root, "exchange", remote.id = %id, remote.via = ?remote.via().map(|v| v.id.as_str()))
    } else {
        tracing::Span::none()
    };
    exchange(broker, remote, pod, external, existing)
        .instrument(span)
        .await
}

async fn exchange(
    broker: &Broker,
    remote: &Remote,
    pod: &str,
    external: &str,
    existing: Option<(OutgoingNc, i64)>,
) -> Result<()> {
    let id = &remote.identity.id;
    let key = out_key(id);
    let spec = local_spec(broker, id, pod, external).await?;
    let forwarder = match &remote.route {
        Route::Direct { .. } => None,
        Route::Relayed { forwarder, .. } => Some(forwarder.clone()),
    };
    let via = remote.via().cloned();
    let out = match existing {
        Some((out, _)) if out.spec == spec && out.via == via && out.forwarder == forwarder => out,
        previous => {
            let generation = next_generation(previous.as_ref().map(|(o, _)| o.generation));
            let trace = previous
                .as_ref()
                .and_then(|(o, _)| o.trace.clone())
                .or_else(|| traceparent_of(&tracing::Span::current()));
            let out = OutgoingNc {
                trace,
                remote: remote.identity.clone(),
                via,
                forwarder,
                spec,
                generation,
                decision: None,
                receiver_generation: 0,
            };
            let revision = previous.map_or(0, |(_, r)| r);
            let committed = broker
                .store()
                .txn(Txn {
                    compares: vec![Compare::ModRevision {
                        key: key.clone(),
                        revision,
                    }],
                    success: vec![Op::Put {
                        key: key.clone(),
                        value: encode(&out)?,
                        lease: None,
                    }],
                    failure: vec![],
                })
                .await?;
            if !committed.succeeded {
                return Err(Error::Aborted(
                    "our network config changed concurrently".into(),
                ));
            }
            out
        }
    };

    if out.current_decision().is_none() {
        deliver(broker, remote, &out).await?;
    }
    write_tunnel(broker, id).await
}

/// The generation of a new version of our NC: above the previous one and at least the wall
/// clock in milliseconds. A new incarnation (after a teardown, a withdrawal or a rebuilt store,
/// where the previous generation is gone) is thus above every generation a receiver or a hub's
/// forwarder still holds from an earlier one, as long as the clock does not step back by more
/// than the time between the two incarnations (ADR 0012).
pub fn next_generation(previous: Option<i64>) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2));
    previous.map_or(1, |p| p.saturating_add(1)).max(now)
}

async fn deliver(broker: &Broker, remote: &Remote, out: &OutgoingNc) -> Result<()> {
    let id = &remote.identity.id;
    // Tells the remote we hold its NC, so that ours does not make it send its own again.
    let held_generation = broker.incoming(id).await?.map_or(0, |i| i.generation);
    let nc = pb::NetworkConfig {
        name: nc_name(&broker.identity().id, id),
        origin: Some(identity_to_pb(broker.identity())),
        destination: Some(identity_to_pb(&remote.identity)),
        via: out.via.as_ref().map(identity_to_pb),
        spec: Some(out.spec.to_proto()),
        status: None,
        generation: out.generation,
        update_time: None,
        held_generation,
    };
    let status = match &remote.route {
        Route::Direct { broker: address } => {
            broker
                .clients()
                .submitter(address, id)?
                .call(SubmitNetworkConfigRequest {
                    network_config: Some(nc),
                })
                .await
                .map_err(|s| {
                    Error::from(s).context(format!("submitting our network config to {id}"))
                })?
                .status
        }
        Route::Relayed { forwarder, hub } => {
            broker
                .clients()
                .relayer(forwarder, &hub.id)?
                .call(RelayRequest {
                    network_config: Some(nc),
                })
                .await
                .map_err(|s| {
                    Error::from(s).context(format!(
                        "relaying our network config to {id} through {}",
                        hub.id
                    ))
                })?
                .status
        }
    };
    if let Some(decision) = decision_from_status(&out.spec, status.as_ref())? {
        let receiver_generation = status.as_ref().map_or(0, |s| s.receiver_generation);
        broker.decided(id, decision, receiver_generation).await?;
    } else if let Some(waiting) = status
        .as_ref()
        .filter(|s| s.state == pb::NetworkConfigState::Pending as i32 && !s.message.is_empty())
    {
        // The remote cannot decide yet (no free range): an unfinished exchange, retried with
        // this remote's backoff until it decides.
        return Err(Error::Unavailable(format!(
            "{id} has not decided on our network config yet: {}",
            waiting.message
        )));
    }
    Ok(())
}

/// Writes (or updates) the TunnelEndpoint once both directions are decided for the same route.
async fn write_tunnel(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let (Some(out_kv), Some(in_kv)) = (
        store.get(&out_key(id)).await?,
        store.get(&in_key(id)).await?,
    ) else {
        return Ok(());
    };
    let out: OutgoingNc = decode(&out_key(id), &out_kv.value)?;
    let incoming: IncomingNc = decode(&in_key(id), &in_kv.value)?;
    let (Some(theirs_of_us), Some(ours_of_them)) = (
        out.current_decision().and_then(Decision::view),
        incoming.decision.view(),
    ) else {
        return Ok(());
    };
    if incoming.via != out.via {
        // The two directions travelled different routes (a hub change in flight); wait until
        // both NetworkConfigs agree.
        return Ok(());
    }
    let key = tunnel_key(id);
    let existing = match store.get(&key).await? {
        Some(kv) => Some((decode::<TunnelRecord>(&key, &kv.value)?, kv.mod_revision)),
        None => None,
    };
    let generation = existing.as_ref().map_or(0, |(t, _)| t.generation) + 1;
    let tunnel = TunnelEndpoint::merge(
        incoming.remote.clone(),
        out.via.clone(),
        (&out.spec, theirs_of_us),
        (&incoming.spec, ours_of_them),
        generation,
    );
    if let Some((current, _)) = &existing
        && (TunnelEndpoint {
            generation: current.generation,
            ..tunnel.clone()
        }) == *current
    {
        return Ok(());
    }
    let committed = store
        .txn(Txn {
            compares: vec![Compare::ModRevision {
                key: key.clone(),
                revision: existing.map_or(0, |(_, r)| r),
            }],
            success: vec![Op::Put {
                key,
                value: encode(&tunnel)?,
                lease: None,
            }],
            failure: vec![],
        })
        .await?;
    if committed.succeeded {
        tracing::info!(
            remote.id = %id,
            kind = ?tunnel.kind,
            remote_pod_cidr_nat = %tunnel.remote_nat.pod_cidr_nat,
            local_pod_cidr_nat = %tunnel.local_nat.pod_cidr_nat,
            generation,
            "tunnel endpoint ready"
        );
    }
    Ok(())
}

/// Removes everything held for `id`, in an order that survives a failure at any step: the
/// TunnelEndpoint first (leaving a tombstone for watchers), so the data plane drops the peer at
/// once; then our induced NetworkConfig is withdrawn through its hub (best effort: the hub may
/// be the reason it is gone); then the IPAM mapping is freed; the NetworkConfigs go last. Until
/// they are gone the remote counts as held, so a failed step (the IPAM restarting) is retried
/// by the next pass instead of leaking the mapping.
pub async fn teardown(broker: &Broker, id: &ClusterId, reason: &str) -> Result<()> {
    let store = broker.store();
    remove_tunnel(broker, id).await?;
    if let Some(kv) = store.get(&out_key(id)).await? {
        let out: OutgoingNc = decode(&out_key(id), &kv.value)?;
        if let (Some(hub), Some(forwarder)) = (&out.via, &out.forwarder) {
            let request = RelayWithdrawalRequest {
                network_config: Some(pb::NetworkConfigRef {
                    name: nc_name(&broker.identity().id, id),
                    origin: Some(identity_to_pb(broker.identity())),
                    destination: Some(identity_to_pb(&out.remote)),
                    via: Some(identity_to_pb(hub)),
                }),
                reason: reason.to_owned(),
            };
            if let Err(err) = async {
                broker
                    .clients()
                    .forwarder(forwarder, &hub.id)?
                    .relay_withdrawal(request)
                    .await
                    .map_err(Error::from)
            }
            .await
            {
                tracing::info!(remote.id = %id, hub.id = %hub.id, error = %err, "could not withdraw through the hub; the remote withdraws on its own");
            }
        }
    }
    free_mapping(broker, id).await?;
    remove_state(broker, id).await?;
    tracing::info!(remote.id = %id, reason, "tore down the network configs and tunnel");
    Ok(())
}

async fn free_mapping(broker: &Broker, id: &ClusterId) -> Result<bool> {
    let answer = broker
        .clients()
        .ipam()
        .free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
            cluster_id: id.to_string(),
        })
        .await
        .map_err(|s| Error::from(s).context("freeing the remote's IPAM mapping"))?;
    Ok(answer.into_inner().existed)
}

/// Deletes the TunnelEndpoint of `id`, leaving a tombstone for watchers.
async fn remove_tunnel(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let Some(kv) = store.get(&tunnel_key(id)).await? else {
        return Ok(());
    };
    store
        .txn(
            Txn::new()
                .when(Compare::mod_revision(tunnel_key(id), kv.mod_revision))
                .then(Op::delete(tunnel_key(id)))
                .then(Op::put(tombstone_key(id), kv.value)),
        )
        .await?;
    Ok(())
}

/// The IPAM reconciliation against the peer set: frees the mappings of clusters we neither
/// exchange with nor hold anything for. They are left by a teardown that predates the ordered
/// one above, by an allocation that raced a teardown, or by a caller of the IPAM. `mapped` was
/// listed before `held` and before the peering view, so a mapping made for a NetworkConfig
/// received meanwhile (whose sender discovery listed as a peer first) is not among them; the
/// candidates are confirmed against a fresh view before anything is freed.
async fn free_orphaned_mappings(
    broker: &Broker,
    mapped: BTreeSet<ClusterId>,
    held: &BTreeSet<ClusterId>,
    peers: &Peers,
) -> Result<BTreeSet<ClusterId>> {
    let candidates: Vec<ClusterId> = mapped
        .into_iter()
        .filter(|id| !held.contains(id) && !peers.desired.contains_key(id))
        .collect();
    let mut failed = BTreeSet::new();
    if candidates.is_empty() {
        return Ok(failed);
    }
    let fresh = broker.peers().await?;
    for id in candidates
        .into_iter()
        .filter(|id| !fresh.desired.contains_key(id))
    {
        if holds(broker, &id).await? {
            continue;
        }
        match free_mapping(broker, &id).await {
            Ok(existed) => {
                if existed {
                    tracing::info!(remote.id = %id, "freed the ipam mapping of a cluster that is no peer");
                }
            }
            Err(err) => {
                tracing::warn!(remote.id = %id, error = %err, "could not free an orphaned ipam mapping");
                failed.insert(id);
            }
        }
    }
    Ok(failed)
}

/// The remote clusters the IPAM holds a mapping for.
async fn mapped(broker: &Broker) -> Result<BTreeSet<ClusterId>> {
    let listing = broker
        .clients()
        .ipam()
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .map_err(|s| Error::from(s).context("listing the IPAM's mappings"))?
        .into_inner();
    Ok(listing
        .clusters
        .iter()
        .filter_map(|c| ClusterId::parse("cluster_id", &c.cluster_id).ok())
        .collect())
}

/// Deletes both NetworkConfigs and the TunnelEndpoint of `id` in one transaction.
pub async fn remove_state(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let mut ops = vec![
        Op::Delete { key: out_key(id) },
        Op::Delete { key: in_key(id) },
    ];
    if let Some(kv) = store.get(&tunnel_key(id)).await? {
        ops.push(Op::Delete {
            key: tunnel_key(id),
        });
        ops.push(Op::Put {
            key: tombstone_key(id),
            value: kv.value,
            lease: None,
        });
    }
    store
        .txn(Txn {
            compares: vec![],
            success: ops,
            failure: vec![],
        })
        .await?;
    Ok(())
}

/// The remote withdrew its NetworkConfig towards us: forget it and the tunnel built on it.
pub async fn withdrawn(broker: &Broker, id: &ClusterId) -> Result<bool> {
    let store = broker.store();
    let held = match store.get(&in_key(id)).await? {
        Some(kv) => Some(decode::<IncomingNc>(&in_key(id), &kv.value)?),
        None => None,
    };
    let existed = held.is_some();
    // Our own NC goes too: the next pass sends a new incarnation, which makes the remote send
    // its NC again (see `Broker::receive`), so a withdrawal heals instead of leaving one side
    // without a tunnel.
    let mut ops = vec![
        Op::Delete { key: in_key(id) },
        Op::Delete { key: out_key(id) },
    ];
    if let Some(kv) = store.get(&tunnel_key(id)).await? {
        ops.push(Op::Delete {
            key: tunnel_key(id),
        });
        ops.push(Op::Put {
            key: tombstone_key(id),
            value: kv.value,
            lease: None,
        });
    }
    store
        .txn(Txn {
            compares: vec![],
            success: ops,
            failure: vec![],
        })
        .await?;
    broker.wake_for(id, Lane::of_via(held.and_then(|h| h.via).as_ref()));
    Ok(existed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_api::ClusterIdentity;
    use trellis_store::MemoryStore;

    use crate::remote::Clients;

    fn broker() -> Broker {
        let clients = Clients::new(
            "127.0.0.1:9",
            "127.0.0.1:9",
            "127.0.0.1:9",
            None,
            &trellis_runtime::local_auth::LocalToken::off(),
            &trellis_runtime::metrics::Metrics::new(),
        )
        .expect("valid addresses");
        let identity = ClusterIdentity::parse("id", "leaf-a", "name", "").expect("identity");
        Broker::new(identity, Arc::new(MemoryStore::new()), clients, None)
    }

    /// Our NetworkConfig towards `id` over a direct route: state held for a full peer.
    async fn hold_full_peer_state(broker: &Broker, id: &ClusterId) {
        let spec = NetworkSpec::from_proto(
            "spec",
            Some(&pb::NetworkConfigSpec {
                pod_cidr: "10.0.0.0/16".into(),
                external_cidr: "10.1.0.0/16".into(),
                endpoint: "192.0.2.1:51820".into(),
                public_key: "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".into(),
            }),
        )
        .expect("spec");
        let out = OutgoingNc {
            remote: ClusterIdentity::parse("remote", id.as_str(), "name", "").expect("identity"),
            via: None,
            forwarder: None,
            spec,
            generation: 1,
            decision: None,
            receiver_generation: 0,
            trace: None,
        };
        broker
            .store()
            .put(&out_key(id), encode(&out).expect("encoded"))
            .await
            .expect("written");
    }

    /// The broker's copy of discovery's records, synced to exactly `records`.
    fn copy_holds(broker: &Broker, records: Vec<pb::ForeignCluster>) {
        let copy = broker.foreign_clusters();
        copy.restart();
        for fc in records {
            copy.apply(&WatchForeignClustersResponse {
                r#type: pb::WatchEventType::Added as i32,
                foreign_cluster: Some(fc),
                revision: 1,
            });
        }
        copy.apply(&WatchForeignClustersResponse {
            r#type: pb::WatchEventType::Bookmark as i32,
            foreign_cluster: None,
            revision: 1,
        });
        assert!(copy.synced());
    }

    /// Passes read who is wanted from the watch-fed copy, which may lag discovery; a remote
    /// that looks unwanted there is torn down only once discovery confirms it (here discovery
    /// does not answer, so nothing is torn down).
    #[tokio::test]
    async fn a_remote_absent_from_a_lagging_copy_is_not_torn_down_unconfirmed() {
        let broker = broker();
        let id = ClusterId::parse("id", "leaf-b").expect("id");
        hold_full_peer_state(&broker, &id).await;
        copy_holds(&broker, vec![]);
        assert!(pass(&broker, Lane::Full).await.is_err());
        assert!(holds(&broker, &id).await.expect("read"), "torn down");

        // The same for a pass over that remote only, whose copy says it is no peer.
        let not_peered = pb::ForeignCluster {
            identity: Some(pb::ClusterIdentity {
                cluster_id: id.to_string(),
                cluster_name: "name".into(),
            }),
            kind: pb::PeeringKind::Full as i32,
            ..Default::default()
        };
        copy_holds(&broker, vec![not_peered]);
        let ids = BTreeSet::from([id.clone()]);
        assert!(pass_for(&broker, Lane::Full, &ids).await.is_err());
        assert!(holds(&broker, &id).await.expect("read"), "torn down");
    }

    fn condition(kind: &str, status: pb::ConditionStatus, message: &str) -> pb::Condition {
        pb::Condition {
            r#type: kind.into(),
            status: status as i32,
            message: message.into(),
            ..Default::default()
        }
    }

    fn induced(id: &str, hub: &str, generation: i64) -> WatchForeignClustersResponse {
        WatchForeignClustersResponse {
            r#type: pb::WatchEventType::Modified as i32,
            foreign_cluster: Some(pb::ForeignCluster {
                identity: Some(pb::ClusterIdentity {
                    cluster_id: id.into(),
                    cluster_name: String::new(),
                }),
                kind: pb::PeeringKind::Induced as i32,
                induced: Some(pb::InducedPeering {
                    origin: Some(pb::ClusterIdentity {
                        cluster_id: hub.into(),
                        cluster_name: String::new(),
                    }),
                    neighborhood_generation: generation,
                    ..Default::default()
                }),
                conditions: vec![condition(
                    trellis_api::peers::Condition::InducedPeering.as_str(),
                    pb::ConditionStatus::True,
                    &format!("generation {generation}"),
                )],
                revision: generation,
                ..Default::default()
            }),
            revision: generation,
        }
    }

    /// A hub's every new Neighborhood rewrites each induced record it lists; with n leaves
    /// that is n events per leaf per Neighborhood. Only the first (and real changes) may make
    /// work, and only for that remote.
    #[tokio::test]
    async fn induced_record_events_wake_only_their_remote_and_only_on_real_changes() {
        let broker = broker();
        let _ = broker.take_dirty(Lane::Induced);
        let _ = broker.take_dirty(Lane::Full);
        let mut seen = HashMap::new();

        wake_for_event(&broker, &induced("leaf-b", "hub", 10), &mut seen);
        let dirty = broker.take_dirty(Lane::Induced);
        assert!(!dirty.all);
        assert_eq!(
            dirty.ids.iter().map(ClusterId::as_str).collect::<Vec<_>>(),
            ["leaf-b"]
        );

        for generation in 11..20 {
            wake_for_event(&broker, &induced("leaf-b", "hub", generation), &mut seen);
        }
        let dirty = broker.take_dirty(Lane::Induced);
        assert!(!dirty.all && dirty.ids.is_empty(), "{dirty:?}");

        // Another origin changes the route: the remote is looked at again.
        wake_for_event(&broker, &induced("leaf-b", "hub-2", 21), &mut seen);
        assert_eq!(broker.take_dirty(Lane::Induced).ids.len(), 1);
        // Induced events are work for the induced lane only.
        let full = broker.take_dirty(Lane::Full);
        assert!(!full.all && full.ids.is_empty(), "{full:?}");

        // A full record (a hub) may move every route it carries: everything is looked at.
        let mut hub = induced("hub", "x", 1);
        if let Some(fc) = hub.foreign_cluster.as_mut() {
            fc.kind = pb::PeeringKind::Full as i32;
            fc.induced = None;
        }
        wake_for_event(&broker, &hub, &mut seen);
        assert!(broker.take_dirty(Lane::Full).all);
        assert!(broker.take_dirty(Lane::Induced).all);
    }

    fn id(name: &str) -> ClusterId {
        ClusterId::parse("id", name).expect("valid cluster ID")
    }

    #[test]
    fn a_full_pass_still_looks_at_each_woken_or_retrying_remote_on_its_own() {
        // A leaf's hub came back with a new key and sent its network config just as the
        // periodic full pass fell due: the full pass takes the settled exchange on trust, so
        // without its own look the new key never reached the tunnel (a CI run: one leaf cut off
        // from its hub for good).
        let now = Instant::now();
        let mut retries = Retries::default();
        retries.failed(id("leaf-r"), now);
        let woken = Dirty {
            all: true,
            ids: BTreeSet::from([id("hub")]),
        };
        assert_eq!(
            own_look(&woken, &retries),
            BTreeSet::from([id("hub"), id("leaf-r")])
        );
        let only_woken = Dirty {
            all: false,
            ids: BTreeSet::from([id("hub")]),
        };
        assert!(
            own_look(&only_woken, &retries).is_empty(),
            "without a full pass the woken remotes get their own pass anyway"
        );
    }

    /// Whether `wait` is `base` plus the policy's jitter at most.
    fn jittered(wait: Duration, base: Duration) -> bool {
        (base..=base + base / 4).contains(&wait)
    }

    #[test]
    fn a_remote_that_keeps_failing_does_not_delay_another() {
        let now = Instant::now();
        let mut retries = Retries::default();
        for _ in 0..6 {
            retries.failed(id("leaf-a"), now);
        }
        retries.failed(id("leaf-c"), now);
        let first = retries.next_due().expect("a retry is due") - now;
        assert!(jittered(first, RETRY.initial), "{first:?}");
        assert_eq!(retries.due(now + RETRY.initial * 5 / 4), vec![id("leaf-c")]);
        assert!(retries.due(now + RETRY.max * 5 / 4).contains(&id("leaf-a")));
    }

    #[test]
    fn a_success_resets_a_remote_and_a_full_pass_keeps_only_its_failures() {
        let now = Instant::now();
        let mut retries = Retries::default();
        retries.failed(id("leaf-a"), now);
        retries.failed(id("leaf-a"), now);
        retries.settle([id("leaf-a")].iter());
        retries.failed(id("leaf-a"), now);
        let first = retries.next_due().expect("a retry is due") - now;
        assert!(jittered(first, RETRY.initial), "{first:?}");

        retries.failed(id("leaf-c"), now);
        retries.failed_all(now);
        let failed = Unsettled {
            all: false,
            ids: BTreeSet::from([id("leaf-c")]),
        };
        retries.settle_all_but(&failed);
        assert!(!retries.all_due(now + RETRY.max * 5 / 4));
        assert_eq!(retries.due(now + RETRY.max * 5 / 4), vec![id("leaf-c")]);
    }
}
