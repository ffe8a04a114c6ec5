//! The agent's loop: follow the `WatchRoutes` stream of every gateway replica, reconcile the
//! node after every message of the newest election and on a periodic resync, and reconnect
//! with backoff when a stream breaks (a restarted or moved gateway is followed from its first
//! message). With replicas, the standby that takes over says so on its own stream at once
//! (a higher epoch), so the node follows it without waiting for the old active's stream to
//! end. A gateway whose node went silent breaks its stream too, through the channel's
//! keepalive (`trellis_runtime::client::KEEPALIVE`): without it the agent waited on the dead
//! stream forever and kept routing towards the old gateway node.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use trellis_runtime::local_auth::LocalToken;
use trellis_runtime::retry::{self, RetryPolicy};
use trellis_runtime::{Shutdown, timer};

use crate::node;
use crate::plan::{self, NodeSettings, Wanted};
use crate::remote::{Received, RoutesStream};

/// How often `--gateway` names are resolved again (a replica that appears is followed).
const RESOLVE_EVERY: Duration = Duration::from_secs(5);

/// The waits before a replica's stream is opened again after it broke: 200 ms doubling to 5 s.
const FOLLOW_RETRY: RetryPolicy =
    RetryPolicy::exponential(Duration::from_millis(200), Duration::from_secs(5));

/// What GetStatus reports.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub wanted: Option<Wanted>,
    pub in_sync: bool,
    pub message: String,
}

/// The agent of one node.
#[derive(Debug)]
pub struct Agent {
    pub node: NodeSettings,
    pub underlay: String,
    /// `--gateway`: every replica's address (or a name resolving to all of them).
    pub gateways: Vec<String>,
    /// Sent to the gateway (ADR 0020).
    pub local_token: LocalToken,
    /// The agent's registry: its calls to the gateway count there (`grpc_client_*`).
    pub metrics: trellis_runtime::metrics::Metrics,
    pub resync: Duration,
    pub status: Mutex<Status>,
}

impl Agent {
    /// A copy of the current status.
    pub fn status(&self) -> Status {
        self.status.lock().map(|s| s.clone()).unwrap_or_default()
    }

    fn record(&self, wanted: Option<Wanted>, result: &anyhow::Result<usize>) {
        if let Ok(mut status) = self.status.lock() {
            if wanted.is_some() {
                status.wanted = wanted;
            }
            status.in_sync = result.is_ok();
            status.message = match result {
                Ok(_) => String::new(),
                Err(err) => format!("{err:#}"),
            };
        }
    }

    /// Reconciles the node with `wanted`.
    async fn reconcile(&self, wanted: &Wanted) {
        let result = async {
            let observed = node::observe(&self.node.interface).await?;
            node::apply(&self.node, &self.underlay, wanted, &observed).await
        }
        .await;
        match &result {
            Ok(0) => {}
            Ok(changes) => tracing::info!(
                changes,
                gateway_node = %wanted.gateway_node,
                is_gateway_node = wanted.is_gateway_node,
                routes = wanted.routes.len(),
                "node reconciled"
            ),
            Err(err) => tracing::warn!(
                error = format!("{err:#}"),
                "node reconciliation failed; retried at the next resync"
            ),
        }
        self.record(Some(wanted.clone()), &result);
    }
}

/// A message of one replica's stream: the replica's address and what it sent.
type Message = (String, Received);

/// Whether a message of epoch `epoch` is to be applied after one of `applied` was: the newest
/// election wins, and among the messages of one epoch (the active's and its standbys', which
/// name the same active) the latest. Epoch 0 (no election yet) only until any election is known.
pub fn supersedes(epoch: u64, applied: Option<u64>) -> bool {
    applied.is_none_or(|applied| epoch >= applied)
}

/// Follows every gateway replica until `shutdown`, applying the message of the newest epoch.
pub async fn run(agent: Arc<Agent>, shutdown: Shutdown) {
    let (tx, mut rx) = mpsc::channel::<Message>(64);
    let live = Arc::new(AtomicUsize::new(0));
    trellis_runtime::telemetry::spawn(discover(agent.clone(), tx, live.clone(), shutdown.clone()));
    let mut last: Option<Wanted> = None;
    let mut applied: Option<u64> = None;
    let mut resync = tokio::time::interval(agent.resync);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = resync.tick() => {
                if let Some(wanted) = &last {
                    agent.reconcile(wanted).await;
                }
            }
            Some((from, (epoch, update))) = rx.recv() => {
                if !supersedes(epoch, applied) {
                    tracing::debug!(gateway = %from, epoch, applied = ?applied, "ignoring a message of an older election");
                    continue;
                }
                match update.and_then(|update| plan::plan(&agent.node, &update)) {
                    Ok(wanted) => {
                        if applied.is_some_and(|a| epoch > a) {
                            tracing::info!(gateway = %from, epoch, gateway_node = %wanted.gateway_node, "following a newly elected gateway replica");
                        }
                        applied = Some(epoch);
                        agent.reconcile(&wanted).await;
                        last = Some(wanted);
                    }
                    Err(err) => {
                        tracing::warn!(gateway = %from, error = %err, "ignoring a routes message this agent cannot apply");
                        agent.record(None, &Err(anyhow::anyhow!("{err}")));
                    }
                }
            }
        }
    }
}

/// Resolves `--gateway` every few seconds and follows every address found, each once.
async fn discover(
    agent: Arc<Agent>,
    tx: mpsc::Sender<Message>,
    live: Arc<AtomicUsize>,
    shutdown: Shutdown,
) {
    let mut followed: BTreeSet<String> = BTreeSet::new();
    loop {
        for entry in &agent.gateways {
            let addresses: Vec<String> = match entry.parse::<SocketAddr>() {
                Ok(addr) => vec![addr.to_string()],
                Err(_) => match tokio::net::lookup_host(entry.as_str()).await {
                    Ok(found) => found.map(|a| a.to_string()).collect(),
                    Err(err) => {
                        tracing::warn!(gateway = %entry, error = %err, "cannot resolve the gateway; retrying");
                        Vec::new()
                    }
                },
            };
            for address in addresses {
                if followed.insert(address.clone()) {
                    trellis_runtime::telemetry::spawn(follow(
                        agent.clone(),
                        address,
                        tx.clone(),
                        live.clone(),
                        shutdown.clone(),
                    ));
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = timer::period(RESOLVE_EVERY) => {}
        }
    }
}

/// Follows one replica's stream, reconnecting with backoff when it breaks (a restarted
/// replica is followed from its first message).
async fn follow(
    agent: Arc<Agent>,
    address: String,
    tx: mpsc::Sender<Message>,
    live: Arc<AtomicUsize>,
    shutdown: Shutdown,
) {
    let mut backoff = FOLLOW_RETRY.backoff();
    loop {
        let stream = RoutesStream::open(
            &address,
            &agent.node.name,
            &agent.local_token,
            &agent.metrics,
        );
        let mut stream = tokio::select! {
            () = shutdown.cancelled() => return,
            stream = stream => match stream {
                Ok(stream) => stream,
                Err(err) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(gateway = %address, error = format!("{err:#}"), retry_ms = wait.as_millis() as u64, "cannot follow the gateway");
                    if live.load(Ordering::Relaxed) == 0 {
                        agent.record(None, &Err(err));
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = retry::wait(wait) => continue,
                    }
                }
            },
        };
        live.fetch_add(1, Ordering::Relaxed);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                message = stream.next() => match message {
                    Some(message) => {
                        backoff.reset();
                        if tx.send((address.clone(), message)).await.is_err() {
                            return;
                        }
                    }
                    None => {
                        tracing::info!(gateway = %address, "the gateway's stream ended; reconnecting");
                        break;
                    }
                },
            }
        }
        live.fetch_sub(1, Ordering::Relaxed);
        let wait = backoff.next_delay();
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = retry::wait(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_election_wins_and_an_older_one_never_goes_back() {
        assert!(
            supersedes(0, None),
            "the first message, before any election"
        );
        assert!(supersedes(3, Some(0)));
        assert!(supersedes(3, Some(3)), "the same election, a newer message");
        assert!(supersedes(4, Some(3)), "a takeover");
        assert!(!supersedes(3, Some(4)), "the old active, still talking");
        assert!(
            !supersedes(0, Some(4)),
            "a replica that has not heard of any election"
        );
    }
}
