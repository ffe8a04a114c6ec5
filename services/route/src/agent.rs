//! The agent's loop: follow the gateway's `WatchRoutes` stream, reconcile the node after every
//! message and on a periodic resync, and reconnect with backoff when the stream breaks (a
//! restarted or moved gateway is followed from its first message). A gateway whose node went
//! silent breaks the stream too, through the channel's keepalive
//! (`trellis_runtime::client::KEEPALIVE`): without it the agent waited on the dead stream
//! forever and kept routing towards the old gateway node.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use trellis_api::pb::gateway::WatchRoutesRequest;
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_runtime::Shutdown;
use trellis_runtime::backoff::Backoff;
use trellis_runtime::client::{Timeouts, local_channel};
use trellis_runtime::local_auth::LocalToken;

use crate::node;
use crate::plan::{self, NodeSettings, Wanted};

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
    pub gateway: String,
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

/// Follows the gateway until `shutdown`.
pub async fn run(agent: Arc<Agent>, shutdown: Shutdown) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let mut last: Option<Wanted> = None;
    let mut resync = tokio::time::interval(agent.resync);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let request = || WatchRoutesRequest {
        node_name: agent.node.name.clone(),
    };
    loop {
        let stream = async {
            let channel = local_channel(
                "--gateway",
                &agent.gateway,
                Timeouts::default(),
                &agent.local_token,
                &agent.metrics,
            )?;
            let response = GatewayClient::new(channel)
                .watch_routes(request())
                .await
                .map_err(|s| anyhow::anyhow!("WatchRoutes: {}", s.message()))?;
            anyhow::Ok(response.into_inner())
        };
        let mut stream = tokio::select! {
            () = shutdown.cancelled() => return,
            stream = stream => match stream {
                Ok(stream) => stream,
                Err(err) => {
                    let wait = backoff.next_delay();
                    tracing::warn!(gateway = %agent.gateway, error = format!("{err:#}"), retry_ms = wait.as_millis() as u64, "cannot follow the gateway");
                    agent.record(None, &Err(err));
                    if let Some(wanted) = &last {
                        // Keep the node as it was (traffic may still flow) but repair it.
                        agent.reconcile(wanted).await;
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(wait) => continue,
                    }
                }
            },
        };
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = resync.tick() => {
                    if let Some(wanted) = &last {
                        agent.reconcile(wanted).await;
                    }
                }
                message = stream.message() => match message {
                    Ok(Some(message)) => {
                        backoff.reset();
                        match plan::plan(&agent.node, &message) {
                            Ok(wanted) => {
                                agent.reconcile(&wanted).await;
                                last = Some(wanted);
                            }
                            Err(err) => {
                                tracing::warn!(error = %err, "ignoring a routes message this agent cannot apply");
                                agent.record(None, &Err(anyhow::anyhow!("{err}")));
                            }
                        }
                    }
                    Ok(None) | Err(_) => {
                        tracing::info!(gateway = %agent.gateway, "the gateway's stream ended; reconnecting");
                        break;
                    }
                },
            }
        }
        let wait = backoff.next_delay();
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}
