//! WatchTunnelEndpoints over the store's watch: a snapshot (start revision 0: ADDED events and
//! a BOOKMARK at the listing's revision), then every change from the next revision on. The
//! store replays from an inclusive revision, so a client resuming at "last revision + 1"
//! neither misses nor repeats a change; deletions carry the last content from the tombstone the
//! deleting transaction wrote.

use std::sync::Arc;

use futures::StreamExt as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use trellis_api::pb::peering::WatchTunnelEndpointsResponse;
use trellis_api::pb::types::WatchEventType;
use trellis_error::Error;
use trellis_store::WatchEvent;

use crate::core::Broker;
use crate::records::{TOMBSTONES_PREFIX, TUNNELS_PREFIX, TunnelRecord, decode};

/// Events buffered per watcher before the sender waits for a slow client.
const BUFFER: usize = 64;

type Item = Result<WatchTunnelEndpointsResponse, Status>;

fn event(kind: WatchEventType, tunnel: Option<&TunnelRecord>, revision: i64) -> Item {
    Ok(WatchTunnelEndpointsResponse {
        r#type: kind.into(),
        tunnel_endpoint: tunnel.map(|t| t.to_proto(revision)),
        revision,
    })
}

/// Starts a watch from `start` (0 = snapshot first). Its task ends when the client leaves (the
/// response stream is dropped), even if no change ever comes to fail a send.
pub fn watch(broker: Arc<Broker>, start: i64) -> ReceiverStream<Item> {
    let (tx, rx) = mpsc::channel(BUFFER);
    trellis_runtime::telemetry::spawn(async move {
        tokio::select! {
            result = follow(&broker, start, &tx) => {
                if let Err(status) = result {
                    let _ = tx.send(Err(status)).await;
                }
            }
            () = tx.closed() => {}
        }
    });
    ReceiverStream::new(rx)
}

async fn follow(broker: &Broker, start: i64, tx: &mpsc::Sender<Item>) -> Result<(), Status> {
    let next = if start == 0 {
        let (tunnels, revision) = broker.tunnels().await?;
        for (tunnel, _) in &tunnels {
            if tx
                .send(event(WatchEventType::Added, Some(tunnel), revision))
                .await
                .is_err()
            {
                return Ok(());
            }
        }
        if tx
            .send(event(WatchEventType::Bookmark, None, revision))
            .await
            .is_err()
        {
            return Ok(());
        }
        revision + 1
    } else {
        start
    };
    let mut changes = broker
        .store()
        .watch(TUNNELS_PREFIX, Some(next))
        .await
        .map_err(|e| out_of_range(Error::from(e)))?;
    while let Some(change) = changes.next().await {
        let item = match change.map_err(|e| out_of_range(Error::from(e)))? {
            WatchEvent::Put(kv) => {
                let tunnel: TunnelRecord = decode(&kv.key, &kv.value)?;
                let kind = if kv.create_revision == kv.mod_revision {
                    WatchEventType::Added
                } else {
                    WatchEventType::Modified
                };
                event(kind, Some(&tunnel), kv.mod_revision)
            }
            WatchEvent::Delete { key, mod_revision } => {
                let id = key.strip_prefix(TUNNELS_PREFIX).unwrap_or(&key);
                let tombstone = broker
                    .store()
                    .get(&format!("{TOMBSTONES_PREFIX}{id}"))
                    .await
                    .map_err(Error::from)?;
                let last = tombstone.and_then(|kv| decode::<TunnelRecord>(&kv.key, &kv.value).ok());
                event(WatchEventType::Deleted, last.as_ref(), mod_revision)
            }
        };
        if tx.send(item).await.is_err() {
            return Ok(());
        }
    }
    Ok(())
}

fn out_of_range(err: Error) -> Status {
    match err {
        Error::OutOfRange(msg) => Error::OutOfRange(format!(
            "{msg}; restart with start_revision = 0 (or list, then watch from its revision + 1)"
        ))
        .into(),
        other => other.into(),
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests poll plainly: no retry policy is involved
mod tests {
    use std::time::Duration;

    use trellis_api::ClusterIdentity;
    use trellis_store::MemoryStore;

    use super::*;
    use crate::remote::Ports;

    fn broker() -> Arc<Broker> {
        let ports = Ports::new(
            "127.0.0.1:9",
            "127.0.0.1:9",
            "127.0.0.1:9",
            None,
            &trellis_runtime::local_auth::LocalToken::off(),
            &trellis_runtime::metrics::Metrics::new(),
        )
        .expect("valid addresses");
        let identity = ClusterIdentity::parse("id", "leaf-a", "name", "").expect("identity");
        Arc::new(Broker::new(
            identity,
            Arc::new(MemoryStore::new()),
            ports,
            None,
        ))
    }

    /// A client that leaves a quiet watch (no tunnel changes) must not leave its task behind:
    /// the task used to notice only when its next event failed to send, so on a quiet store
    /// every departed watcher stayed, holding a store watch. The task's share of the broker
    /// tells whether it is still there.
    #[tokio::test]
    async fn a_departed_client_ends_its_quiet_watch() {
        let broker = broker();
        let mut stream = watch(broker.clone(), 0);
        let bookmark = stream
            .next()
            .await
            .expect("an event")
            .expect("the snapshot's bookmark");
        assert_eq!(bookmark.r#type, WatchEventType::Bookmark as i32);
        // Positive control: while the client is there, its task holds the broker.
        assert_eq!(Arc::strong_count(&broker), 2, "the watch task runs");

        drop(stream);
        let bound = Duration::from_secs(5);
        let ended = tokio::time::timeout(bound, async {
            while Arc::strong_count(&broker) > 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            ended.is_ok(),
            "the watch task still runs {bound:?} after its client left"
        );
    }
}
