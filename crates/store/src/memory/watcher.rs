//! Watch streams over a memory store: history replay, then live events, with transparent
//! catch-up from the history when a watcher falls behind the live buffer.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};

use tokio::sync::broadcast::{self, error::RecvError};

use super::Shared;
use super::state::{Batch, State};
use crate::error::StoreError;
use crate::kv::Revision;
use crate::watch::{WatchEvent, WatchStream};

pub(super) fn watch(
    shared: &Arc<Shared>,
    prefix: &str,
    start: Option<Revision>,
) -> Result<WatchStream, StoreError> {
    let state = shared.lock();
    let mut watcher = Watcher {
        shared: Arc::downgrade(shared),
        prefix: prefix.to_owned(),
        live: shared.events.subscribe(),
        next: state.revision() + 1,
        pending: VecDeque::new(),
        done: false,
    };
    if let Some(start) = start {
        // A start below 1 means the beginning, as for the etcd backend.
        watcher.next = start.max(1);
        watcher.replay(&state)?;
    }
    drop(state);
    Ok(Box::pin(futures::stream::unfold(
        watcher,
        |mut watcher| async move {
            let item = watcher.next_item().await?;
            Some((item, watcher))
        },
    )))
}

struct Watcher {
    /// Weak so that a watch does not keep a dropped store alive.
    shared: Weak<Shared>,
    prefix: String,
    live: broadcast::Receiver<Arc<Batch>>,
    /// The lowest revision not yet delivered.
    next: Revision,
    pending: VecDeque<WatchEvent>,
    done: bool,
}

impl Watcher {
    async fn next_item(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(Ok(event));
            }
            if self.done {
                return None;
            }
            let batch = match self.live.recv().await {
                Ok(batch) => batch,
                Err(RecvError::Lagged(missed)) => {
                    tracing::debug!(
                        missed,
                        next = self.next,
                        "memory watcher lagged; catching up"
                    );
                    let Some(shared) = self.shared.upgrade() else {
                        return self.fail(closed());
                    };
                    if let Err(err) = self.catch_up(&shared) {
                        return self.fail(err);
                    }
                    continue;
                }
                Err(RecvError::Closed) => return self.fail(closed()),
            };
            self.take(&batch);
        }
    }

    /// Resubscribes and queues every retained revision from `next` on, atomically with
    /// respect to commits, so nothing is missed or seen twice.
    fn catch_up(&mut self, shared: &Shared) -> Result<(), StoreError> {
        let state = shared.lock();
        self.live = shared.events.subscribe();
        self.replay(&state)
    }

    /// Queues the history from `next` on; the caller holds the lock it subscribed under.
    fn replay(&mut self, state: &State) -> Result<(), StoreError> {
        let batches = state
            .replay(self.next)
            .map_err(|oldest| StoreError::Compacted {
                requested: self.next,
                compacted: oldest,
            })?;
        for batch in &batches {
            self.take(batch);
        }
        self.next = self.next.max(state.revision() + 1);
        Ok(())
    }

    fn take(&mut self, batch: &Batch) {
        if batch.revision < self.next {
            return;
        }
        self.next = batch.revision + 1;
        let prefix = &self.prefix;
        self.pending.extend(
            batch
                .events
                .iter()
                .filter(|event| event.key().starts_with(prefix.as_str()))
                .cloned(),
        );
    }

    fn fail(&mut self, err: StoreError) -> Option<Result<WatchEvent, StoreError>> {
        self.done = true;
        Some(Err(err))
    }
}

fn closed() -> StoreError {
    StoreError::Unavailable("memory store was dropped".to_owned())
}
