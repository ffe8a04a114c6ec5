//! A copy of the local discovery service's ForeignClusters, kept current by its
//! `WatchForeignClusters` stream, for the checks made on every relayed or received
//! NetworkConfig (ADR 0015).
//!
//! Those checks used to read each record from discovery: one gRPC round trip per cluster per
//! NetworkConfig. The hub's forwarder made two per relay, and at 100 leaves discovery answered
//! more lookups than the forwarder relayed NetworkConfigs. A copy answers from memory.
//!
//! The copy lags discovery by the watch's delivery, so it is trusted in one direction only: a
//! cached record the caller's `accept` admits is used; a missing record, or one `accept`
//! refuses, is read from discovery ([`read`]). A check therefore never refuses because of a
//! stale copy. It may admit on one during the lag, the window any read followed by an action
//! has: the other end refuses what it no longer accepts, and the reconcilers act on fresh
//! listings.
//!
//! Until the watch has delivered its first snapshot (and after it breaks, until the next
//! snapshot), every lookup reads through. A watch to a discovery whose node went silent breaks
//! through the channel's keepalive ([`crate::client::KEEPALIVE`], about 15 s), so that lag is
//! bounded too: without it the copy froze and kept admitting what discovery no longer did.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio_stream::StreamExt as _;
use trellis_api::ClusterId;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::{
    GetForeignClusterRequest, WatchForeignClustersRequest, WatchForeignClustersResponse,
};
use trellis_api::pb::types as pb;
use trellis_error::{Error, Result};

use crate::Shutdown;
use crate::client::TracedChannel;
use crate::retry::RetryPolicy;

/// The waits before the watch is opened again after it broke: 200 ms doubling to 10 s.
const RETRY: RetryPolicy =
    RetryPolicy::exponential(Duration::from_millis(200), Duration::from_secs(10));

/// What [`ForeignClusters::follow`] reports to its caller, after the copy has taken it in.
#[derive(Debug, Clone, Copy)]
pub enum Followed<'a> {
    /// A new stream starts: its snapshot follows (as ADDED events, then a BOOKMARK).
    Restarted,
    /// One event of the stream.
    Event(&'a WatchForeignClustersResponse),
}

#[derive(Debug, Default)]
struct Copy {
    /// Whether `records` holds a complete snapshot and every change since.
    synced: bool,
    /// Boxed: a record is several hundred bytes, and a table keeps up to twice as many slots
    /// as entries (a copy per broker and forwarder, each holding every peer; issue 17).
    records: HashMap<String, Box<pb::ForeignCluster>>,
    /// The snapshot of a stream that has not reached its BOOKMARK yet.
    incoming: HashMap<String, Box<pb::ForeignCluster>>,
}

/// The copy, shared by every clone.
#[derive(Debug, Clone, Default)]
pub struct ForeignClusters {
    copy: Arc<RwLock<Copy>>,
}

fn id_of(fc: Option<&pb::ForeignCluster>) -> Option<&str> {
    fc.and_then(|fc| fc.identity.as_ref())
        .map(|identity| identity.cluster_id.as_str())
}

impl ForeignClusters {
    /// An empty copy: every lookup reads through until [`Self::follow`] has synced it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether lookups are answered from the copy.
    pub fn synced(&self) -> bool {
        self.copy.read().is_ok_and(|copy| copy.synced)
    }

    /// A new stream starts: lookups read through until its snapshot is complete (a record
    /// deleted while no stream was open would otherwise stay). [`Self::follow`] calls it; it
    /// is public so that a test can stage a copy that lags discovery.
    pub fn restart(&self) {
        if let Ok(mut copy) = self.copy.write() {
            copy.synced = false;
            copy.incoming.clear();
        }
    }

    /// Takes in one event of the stream (see [`Self::restart`]).
    pub fn apply(&self, event: &WatchForeignClustersResponse) {
        let Ok(mut copy) = self.copy.write() else {
            return;
        };
        let id = id_of(event.foreign_cluster.as_ref()).map(str::to_owned);
        match (pb::WatchEventType::try_from(event.r#type), id) {
            (Ok(pb::WatchEventType::Bookmark), _) => {
                copy.records = std::mem::take(&mut copy.incoming);
                copy.synced = true;
            }
            (Ok(pb::WatchEventType::Deleted), Some(id)) => {
                copy.records.remove(&id);
                copy.incoming.remove(&id);
            }
            (Ok(pb::WatchEventType::Added | pb::WatchEventType::Modified), Some(id)) => {
                let record = Box::new(event.foreign_cluster.clone().unwrap_or_default());
                if copy.synced {
                    copy.records.insert(id, record);
                } else {
                    copy.incoming.insert(id, record);
                }
            }
            // An event this version does not know, or without an ID: the copy can no longer
            // vouch for itself until the next snapshot.
            _ => copy.synced = false,
        }
    }

    /// The cached record of `id`, if the copy is synced and holds one.
    pub fn cached(&self, id: &str) -> Option<pb::ForeignCluster> {
        self.cached_with(id, Clone::clone)
    }

    /// `f` over the cached record of `id`, if the copy is synced and holds one: what a check
    /// needs of a record without copying it (a record carries the peer's CA certificate).
    pub fn cached_with<R>(&self, id: &str, f: impl FnOnce(&pb::ForeignCluster) -> R) -> Option<R> {
        let copy = self.copy.read().ok()?;
        if !copy.synced {
            return None;
        }
        copy.records.get(id).map(|fc| f(fc))
    }

    /// `f` over every cached record, if the copy is synced: a whole view without a listing.
    /// The copy may lag discovery; a caller that acts on a record's absence confirms with
    /// [`read`] or a listing first.
    pub fn with_records<R>(&self, f: impl FnOnce(&[&pb::ForeignCluster]) -> R) -> Option<R> {
        let copy = self.copy.read().ok()?;
        if !copy.synced {
            return None;
        }
        let records: Vec<&pb::ForeignCluster> = copy.records.values().map(AsRef::as_ref).collect();
        Some(f(&records))
    }

    /// The records of `ids` (unknown ones absent): from the copy where `accept` admits the
    /// cached record, otherwise read from discovery at `channel`.
    pub async fn lookup(
        &self,
        channel: &TracedChannel,
        ids: &[&ClusterId],
        accept: impl Fn(&pb::ForeignCluster) -> bool,
    ) -> Result<Vec<pb::ForeignCluster>> {
        self.lookup_with(channel, ids, accept, Clone::clone).await
    }

    /// [`Self::lookup`], returning `f` of each record instead of the record: a cached one is
    /// not copied out of the copy (a record carries the peer's CA certificate).
    pub async fn lookup_with<T>(
        &self,
        channel: &TracedChannel,
        ids: &[&ClusterId],
        accept: impl Fn(&pb::ForeignCluster) -> bool,
        f: impl Fn(&pb::ForeignCluster) -> T,
    ) -> Result<Vec<T>> {
        let mut found = Vec::with_capacity(ids.len());
        let mut missing = Vec::new();
        for id in ids {
            match self
                .cached_with(id.as_str(), |fc| accept(fc).then(|| f(fc)))
                .flatten()
            {
                Some(t) => found.push(t),
                None => missing.push(*id),
            }
        }
        if !missing.is_empty() {
            found.extend(read(channel, &missing).await?.iter().map(&f));
        }
        Ok(found)
    }

    /// Follows discovery's watch at `channel` until `shutdown`, keeping the copy current and
    /// opening the watch again (on the runtime's retry policy) whenever it breaks. `on_event`
    /// sees every event after the copy took it in, so a reader woken by it finds the change.
    pub async fn follow(
        &self,
        channel: TracedChannel,
        shutdown: Shutdown,
        mut on_event: impl FnMut(Followed<'_>),
    ) {
        let mut backoff = RETRY.backoff();
        loop {
            let opened = DiscoveryClient::new(channel.clone())
                .watch_foreign_clusters(WatchForeignClustersRequest {
                    start_revision: 0,
                    kind: 0,
                })
                .await;
            match opened {
                Ok(stream) => {
                    backoff.reset();
                    self.restart();
                    on_event(Followed::Restarted);
                    let mut stream = stream.into_inner();
                    loop {
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            event = stream.next() => match event {
                                Some(Ok(event)) => {
                                    self.apply(&event);
                                    on_event(Followed::Event(&event));
                                }
                                Some(Err(status)) => {
                                    tracing::debug!(error = %status, "foreign cluster watch ended");
                                    break;
                                }
                                None => break,
                            },
                        }
                    }
                    self.restart();
                }
                Err(status) => {
                    tracing::debug!(error = %status, "cannot watch foreign clusters yet");
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }
}

/// The records of `ids` read from discovery at `channel`, one lookup each (unknown ones
/// absent): what a check that must be current uses.
pub async fn read(channel: &TracedChannel, ids: &[&ClusterId]) -> Result<Vec<pb::ForeignCluster>> {
    let mut client = DiscoveryClient::new(channel.clone());
    let mut found = Vec::with_capacity(ids.len());
    for id in ids {
        let request = GetForeignClusterRequest {
            cluster_id: id.to_string(),
        };
        match client.get_foreign_cluster(request).await {
            Ok(answer) => found.extend(answer.into_inner().foreign_cluster),
            Err(status) if status.code() == tonic::Code::NotFound => {}
            Err(status) => return Err(Error::from(status).context("reading foreign clusters")),
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, broker: &str) -> pb::ForeignCluster {
        pb::ForeignCluster {
            identity: Some(pb::ClusterIdentity {
                cluster_id: id.into(),
                cluster_name: id.into(),
            }),
            kind: pb::PeeringKind::Full as i32,
            full: Some(pb::FullPeering {
                addresses: Some(pb::ServiceAddresses {
                    broker: broker.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn event(
        kind: pb::WatchEventType,
        fc: Option<pb::ForeignCluster>,
    ) -> WatchForeignClustersResponse {
        WatchForeignClustersResponse {
            r#type: kind as i32,
            foreign_cluster: fc,
            revision: 1,
        }
    }

    fn broker_of(fc: Option<pb::ForeignCluster>) -> Option<String> {
        fc.and_then(|fc| fc.full)
            .and_then(|full| full.addresses)
            .map(|a| a.broker)
    }

    #[test]
    fn answers_only_after_a_whole_snapshot_and_follows_changes() {
        let copy = ForeignClusters::new();
        copy.restart();
        copy.apply(&event(pb::WatchEventType::Added, Some(record("a", "a:1"))));
        assert!(!copy.synced());
        assert_eq!(copy.cached("a"), None, "a partial snapshot is not used");
        copy.apply(&event(pb::WatchEventType::Bookmark, None));
        assert!(copy.synced());
        assert_eq!(broker_of(copy.cached("a")).as_deref(), Some("a:1"));

        copy.apply(&event(
            pb::WatchEventType::Modified,
            Some(record("a", "a:2")),
        ));
        copy.apply(&event(pb::WatchEventType::Added, Some(record("b", "b:1"))));
        assert_eq!(broker_of(copy.cached("a")).as_deref(), Some("a:2"));
        assert_eq!(broker_of(copy.cached("b")).as_deref(), Some("b:1"));
        copy.apply(&event(pb::WatchEventType::Deleted, Some(record("a", ""))));
        assert_eq!(copy.cached("a"), None);
    }

    #[test]
    fn a_new_stream_replaces_the_copy_at_its_bookmark() {
        let copy = ForeignClusters::new();
        copy.restart();
        copy.apply(&event(pb::WatchEventType::Added, Some(record("a", "a:1"))));
        copy.apply(&event(pb::WatchEventType::Bookmark, None));
        // The stream broke; "a" was deleted meanwhile, so the new snapshot lacks it.
        copy.restart();
        assert_eq!(
            copy.cached("a"),
            None,
            "nothing is vouched for between streams"
        );
        copy.apply(&event(pb::WatchEventType::Added, Some(record("b", "b:1"))));
        copy.apply(&event(pb::WatchEventType::Bookmark, None));
        assert_eq!(
            copy.cached("a"),
            None,
            "a record missing from the new snapshot is gone"
        );
        assert_eq!(broker_of(copy.cached("b")).as_deref(), Some("b:1"));
    }

    #[test]
    fn the_whole_copy_is_offered_only_when_synced() {
        let copy = ForeignClusters::new();
        let ids = |copy: &ForeignClusters| {
            copy.with_records(|records| {
                let mut ids: Vec<String> = records
                    .iter()
                    .filter_map(|fc| id_of(Some(fc)).map(str::to_owned))
                    .collect();
                ids.sort();
                ids
            })
        };
        assert_eq!(ids(&copy), None, "never synced");
        copy.restart();
        copy.apply(&event(pb::WatchEventType::Added, Some(record("a", "a:1"))));
        assert_eq!(ids(&copy), None, "a partial snapshot is not offered");
        copy.apply(&event(pb::WatchEventType::Bookmark, None));
        copy.apply(&event(pb::WatchEventType::Added, Some(record("b", "b:1"))));
        assert_eq!(ids(&copy), Some(vec!["a".to_owned(), "b".to_owned()]));
        copy.apply(&event(pb::WatchEventType::Deleted, Some(record("a", ""))));
        assert_eq!(ids(&copy), Some(vec!["b".to_owned()]));
        copy.restart();
        assert_eq!(ids(&copy), None, "nothing is offered between streams");
    }

    #[test]
    fn an_event_it_cannot_place_unsyncs_the_copy() {
        let copy = ForeignClusters::new();
        copy.restart();
        copy.apply(&event(pb::WatchEventType::Bookmark, None));
        copy.apply(&event(pb::WatchEventType::Modified, None));
        assert!(!copy.synced());
    }
}
