//! Watch streams over etcd: one etcd watch stream per store watch, cancelled by dropping it.

use std::collections::VecDeque;

use etcd_client::{EventType, WatchOptions, WatchResponse};

use super::errors::{from_etcd, request};
use super::keys::Keys;
use crate::error::StoreError;
use crate::kv::Revision;
use crate::watch::{WatchEvent, WatchStream};

pub(super) async fn watch(
    client: &etcd_client::Client,
    keys: &Keys,
    prefix: &str,
    start: Option<Revision>,
) -> Result<WatchStream, StoreError> {
    let (key, end) = keys.range(prefix);
    let mut options = WatchOptions::new().with_range(end);
    if let Some(start) = start {
        // etcd reads a start of 0 as "now"; ours means "from the beginning".
        options = options.with_start_revision(start.max(1));
    }
    let mut stream = request(
        "watch",
        None,
        client.watch_client().watch(key, Some(options)),
    )
    .await?;
    // Only once etcd confirms the watcher exists is every later write guaranteed to reach it.
    match request("watch", None, stream.message()).await? {
        Some(created) if created.canceled() => return Err(cancelled(&created, start)),
        Some(created) if created.created() => {}
        Some(_) => {
            return Err(StoreError::Internal(
                "etcd answered a watch request with events before confirming it".to_owned(),
            ));
        }
        None => {
            return Err(StoreError::Unavailable(
                "etcd closed the watch stream before creating the watch".to_owned(),
            ));
        }
    }
    let watcher = Watcher {
        stream,
        keys: keys.clone(),
        next: start,
        pending: VecDeque::new(),
        done: false,
    };
    Ok(Box::pin(futures::stream::unfold(
        watcher,
        |mut watcher| async move {
            let item = watcher.next_item().await?;
            Some((item, watcher))
        },
    )))
}

struct Watcher {
    /// Owns both directions of the etcd watch stream: dropping it cancels the watch.
    stream: etcd_client::WatchStream,
    keys: Keys,
    /// The lowest revision not yet delivered, when known (for the compaction error).
    next: Option<Revision>,
    pending: VecDeque<Result<WatchEvent, StoreError>>,
    done: bool,
}

impl Watcher {
    async fn next_item(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        loop {
            if let Some(item) = self.pending.pop_front() {
                if let Ok(event) = &item {
                    self.next = Some(event.revision() + 1);
                }
                return Some(item);
            }
            if self.done {
                return None;
            }
            match self.stream.message().await {
                Ok(Some(response)) if response.canceled() => {
                    self.fail(cancelled(&response, self.next));
                }
                Ok(Some(response)) => self.take(&response),
                Ok(None) => self.fail(StoreError::Unavailable(
                    "etcd ended the watch stream".to_owned(),
                )),
                Err(err) => self.fail(from_etcd("watch", err, None)),
            }
        }
    }

    fn take(&mut self, response: &WatchResponse) {
        for event in response.events() {
            let converted = match (event.event_type(), event.kv()) {
                (_, None) => Err(StoreError::Internal(
                    "etcd sent a watch event without a key".to_owned(),
                )),
                (EventType::Put, Some(kv)) => self.keys.kv(kv).map(WatchEvent::Put),
                (EventType::Delete, Some(kv)) => {
                    self.keys.strip(kv.key()).map(|key| WatchEvent::Delete {
                        key,
                        mod_revision: kv.mod_revision(),
                    })
                }
            };
            match converted {
                Ok(event) => self.pending.push_back(Ok(event)),
                Err(err) => return self.fail(err),
            }
        }
    }

    /// Queues `err` as the stream's last item.
    fn fail(&mut self, err: StoreError) {
        tracing::debug!(error = %err, "etcd watch ended");
        self.pending.push_back(Err(err));
        self.done = true;
    }
}

fn cancelled(response: &WatchResponse, requested: Option<Revision>) -> StoreError {
    if response.compact_revision() > 0 {
        StoreError::Compacted {
            requested: requested.unwrap_or_default(),
            compacted: response.compact_revision(),
        }
    } else {
        StoreError::Unavailable(format!(
            "etcd cancelled the watch: {}",
            response.cancel_reason()
        ))
    }
}
