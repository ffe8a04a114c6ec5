//! WatchForeignClusters over [`Store::watch`](trellis_store::Store::watch): an optional snapshot
//! (start revision 0), then the store's change events turned into ADDED / MODIFIED / DELETED,
//! filtered by kind, with idle BOOKMARKs.
//!
//! Exactly-once comes from the store: events are replayed from an inclusive revision, so a
//! client resuming at "last revision + 1" neither misses nor repeats a change. What a single
//! store event lacks is supplied by the records themselves: `previous_kind` tells a filtered
//! watch that a record left or entered its kind, and the tombstone written by the deleting
//! transaction (same revision) gives a deletion its last content.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use tokio::sync::mpsc;
use trellis_api::ClusterIdentity;
use trellis_error::Error;
use trellis_store::{StoreError, WatchEvent};

use crate::core::{Discovery, Versioned};
use crate::records::{CLUSTERS_PREFIX, ForeignClusterRecord, Kind, Source, decode, tombstone_key};

/// Events buffered per watcher before the sender waits for a slow client.
const BUFFER: usize = 64;

/// What happened to a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
    Bookmark,
}

/// One event of a watch.
#[derive(Debug, Clone)]
pub struct Event {
    pub kind: EventType,
    /// The record (after the change, or its last content); `None` for bookmarks.
    pub record: Option<Versioned>,
    /// Revision of the change, or of the snapshot.
    pub revision: i64,
}

/// Why a watch ended.
#[derive(Debug, Clone)]
pub enum WatchError {
    /// The start revision is older than the store's history: restart from 0.
    Compacted(String),
    /// Anything else.
    Failed(Error),
}

/// The receiving end of a watch; dropping it stops the watch.
pub type Events = mpsc::Receiver<Result<Event, WatchError>>;

/// Starts a watch (see WatchForeignClusters in the proto). Fails right away when the start
/// revision is compacted.
pub async fn watch(
    core: Arc<Discovery>,
    start_revision: i64,
    filter: Option<Kind>,
    bookmark_every: Duration,
) -> Result<Events, WatchError> {
    let (tx, rx) = mpsc::channel(BUFFER);
    let (snapshot, from) = if start_revision == 0 {
        let snapshot = core.snapshot().await.map_err(WatchError::Failed)?;
        let from = snapshot.revision + 1;
        (Some(snapshot), from)
    } else {
        (None, start_revision)
    };
    let stream = core
        .store()
        .watch(CLUSTERS_PREFIX, Some(from))
        .await
        .map_err(store_error)?;
    trellis_runtime::telemetry::spawn(async move {
        if let Some(snapshot) = snapshot {
            for (record, revision) in snapshot.records.into_values() {
                if filter.is_none_or(|k| record.kind == k) {
                    let event = Event {
                        kind: EventType::Added,
                        record: Some((record, revision)),
                        revision: snapshot.revision,
                    };
                    if tx.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
            }
            let mark = Event {
                kind: EventType::Bookmark,
                record: None,
                revision: snapshot.revision,
            };
            if tx.send(Ok(mark)).await.is_err() {
                return;
            }
        }
        follow(core, stream, filter, bookmark_every, from - 1, tx).await;
    });
    Ok(rx)
}

fn store_error(err: StoreError) -> WatchError {
    match err {
        StoreError::Compacted { .. } => WatchError::Compacted(err.to_string()),
        other => WatchError::Failed(other.into()),
    }
}

async fn follow(
    core: Arc<Discovery>,
    mut stream: trellis_store::WatchStream,
    filter: Option<Kind>,
    bookmark_every: Duration,
    mut delivered: i64,
    tx: mpsc::Sender<Result<Event, WatchError>>,
) {
    // The highest revision processed (sent or filtered out) and the highest the client knows.
    let mut processed = delivered;
    let mut idle = tokio::time::interval(bookmark_every);
    idle.tick().await;
    loop {
        let next = tokio::select! {
            next = stream.next() => next,
            _ = idle.tick() => {
                if processed > delivered {
                    let mark = Event { kind: EventType::Bookmark, record: None, revision: processed };
                    if tx.send(Ok(mark)).await.is_err() {
                        return;
                    }
                    delivered = processed;
                }
                continue;
            }
            () = tx.closed() => return,
        };
        let event = match next {
            Some(Ok(event)) => event,
            Some(Err(err)) => {
                let _ = tx.send(Err(store_error(err))).await;
                return;
            }
            None => {
                let _ = tx
                    .send(Err(WatchError::Failed(Error::Unavailable(
                        "the store ended the watch".into(),
                    ))))
                    .await;
                return;
            }
        };
        processed = event.revision();
        let translated = match translate(&core, event, filter).await {
            Ok(t) => t,
            Err(err) => {
                let _ = tx.send(Err(WatchError::Failed(err))).await;
                return;
            }
        };
        if let Some(event) = translated {
            if tx.send(Ok(event)).await.is_err() {
                return;
            }
            delivered = processed;
            idle.reset();
        }
    }
}

/// The client-facing event for one store event, or `None` when the filter hides it.
async fn translate(
    core: &Discovery,
    event: WatchEvent,
    filter: Option<Kind>,
) -> Result<Option<Event>, Error> {
    match event {
        WatchEvent::Put(kv) => {
            let record: ForeignClusterRecord = decode(&kv.key, &kv.value)?;
            let created = kv.create_revision == kv.mod_revision;
            let now = filter.is_none_or(|k| record.kind == k);
            let before =
                !created && filter.is_none_or(|k| record.previous_kind.unwrap_or(record.kind) == k);
            let kind = match (before, now) {
                (_, true) if created => EventType::Added,
                (true, true) => EventType::Modified,
                (false, true) => EventType::Added,
                (true, false) => EventType::Deleted,
                (false, false) => return Ok(None),
            };
            Ok(Some(Event {
                kind,
                record: Some((record, kv.mod_revision)),
                revision: kv.mod_revision,
            }))
        }
        WatchEvent::Delete { key, mod_revision } => {
            let id = key.strip_prefix(CLUSTERS_PREFIX).unwrap_or(&key);
            let tomb_key = tombstone_key(id);
            let last = match core.store().get(&tomb_key).await? {
                // Written by the deleting transaction itself, so it is this deletion's.
                Some(kv) if kv.mod_revision == mod_revision => {
                    Some(decode::<ForeignClusterRecord>(&tomb_key, &kv.value)?)
                }
                _ => None,
            };
            let record = match last {
                Some(record) => {
                    if filter.is_some_and(|k| record.kind != k) {
                        return Ok(None);
                    }
                    record
                }
                // The tombstone was overwritten by a later deletion: report what we know.
                None => {
                    let identity = ClusterIdentity::parse("cluster_id", id, "cluster_name", "")?;
                    ForeignClusterRecord::new(
                        identity,
                        filter.unwrap_or(Kind::Full),
                        Source::Peering,
                    )
                }
            };
            Ok(Some(Event {
                kind: EventType::Deleted,
                record: Some((record, mod_revision)),
                revision: mod_revision,
            }))
        }
    }
}
