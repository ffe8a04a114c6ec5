//! When passes run. Each lane's loop takes the work the broker recorded for it, runs a pass
//! over every remote (periodically, or after a failure not tied to one remote) or over the
//! woken ones, and backs off per remote on failures. The discovery watch wakes the lanes on the
//! changes that concern them, and only on changes the reconciler reads.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use trellis_api::ClusterId;
use trellis_api::pb::types as pb;
use trellis_runtime::Shutdown;
use trellis_runtime::resync::Resync;
use trellis_runtime::retry::{KeyedBackoff, RetryPolicy};

use super::Unsettled;
use super::pass::{pass, pass_for};
use crate::core::Broker;
use crate::core::lanes::{Dirty, Lane};
use crate::remote::discovery::{EventKind, Followed, ForeignClusterEvent};

/// The waits before retrying after a failed delivery: 200 ms doubling to 10 s, per remote.
const RETRY: RetryPolicy =
    RetryPolicy::exponential(Duration::from_millis(200), Duration::from_secs(10));

/// One lane's loop.
pub(super) async fn run_lane(
    broker: Arc<Broker>,
    lane: Lane,
    resync: Duration,
    shutdown: Shutdown,
) {
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
            () = trellis_runtime::timer::until(wake_at) => {}
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
pub(super) async fn follow_discovery(broker: Arc<Broker>, shutdown: Shutdown) {
    let mut seen = HashMap::new();
    broker
        .ports()
        .discovery()
        .follow(shutdown, |followed| match followed {
            Followed::Restarted => seen.clear(),
            Followed::Event(event) => wake_for_event(&broker, &event, &mut seen),
        })
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
    event: &ForeignClusterEvent<'_>,
    seen: &mut HashMap<String, u64>,
) {
    if let Some(fc) = event.cluster
        && let Some(id) = event.cluster_id()
        && event.kind != EventKind::Deleted
    {
        let relevant = relevant_digest(fc);
        if seen.get(id) == Some(&relevant) {
            return;
        }
        seen.insert(id.to_owned(), relevant);
    } else if let Some(id) = event.cluster_id() {
        seen.remove(id);
    }
    let induced = event
        .cluster
        .filter(|fc| fc.kind == pb::PeeringKind::Induced as i32)
        .and(event.cluster_id())
        .and_then(|id| ClusterId::parse("cluster_id", id).ok());
    match (event.kind, induced) {
        (EventKind::Bookmark, _) => {}
        (EventKind::Added | EventKind::Modified, Some(id)) => {
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

/// What [`Peers::from_foreign_clusters`](trellis_api::peers::Peers::from_foreign_clusters)
/// reads of a record: without timestamps, revision, Neighborhood generation and the reasons and
/// messages of conditions.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::broker;

    fn condition(kind: &str, status: pb::ConditionStatus, message: &str) -> pb::Condition {
        pb::Condition {
            r#type: kind.into(),
            status: status as i32,
            message: message.into(),
            ..Default::default()
        }
    }

    fn modified(fc: &pb::ForeignCluster) -> ForeignClusterEvent<'_> {
        ForeignClusterEvent {
            kind: EventKind::Modified,
            cluster: Some(fc),
        }
    }

    fn induced(id: &str, hub: &str, generation: i64) -> pb::ForeignCluster {
        pb::ForeignCluster {
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

        wake_for_event(&broker, &modified(&induced("leaf-b", "hub", 10)), &mut seen);
        let dirty = broker.take_dirty(Lane::Induced);
        assert!(!dirty.all);
        assert_eq!(
            dirty.ids.iter().map(ClusterId::as_str).collect::<Vec<_>>(),
            ["leaf-b"]
        );

        for generation in 11..20 {
            wake_for_event(
                &broker,
                &modified(&induced("leaf-b", "hub", generation)),
                &mut seen,
            );
        }
        let dirty = broker.take_dirty(Lane::Induced);
        assert!(!dirty.all && dirty.ids.is_empty(), "{dirty:?}");

        // Another origin changes the route: the remote is looked at again.
        wake_for_event(
            &broker,
            &modified(&induced("leaf-b", "hub-2", 21)),
            &mut seen,
        );
        assert_eq!(broker.take_dirty(Lane::Induced).ids.len(), 1);
        // Induced events are work for the induced lane only.
        let full = broker.take_dirty(Lane::Full);
        assert!(!full.all && full.ids.is_empty(), "{full:?}");

        // A full record (a hub) may move every route it carries: everything is looked at.
        let mut hub = induced("hub", "x", 1);
        hub.kind = pb::PeeringKind::Full as i32;
        hub.induced = None;
        wake_for_event(&broker, &modified(&hub), &mut seen);
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
