//! Following every broker's TunnelEndpoints while the mesh sets up: the counts the clock
//! stops on.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use trellis_api::pb::peering::WatchTunnelEndpointsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::types::{PeeringKind, WatchEventType};
use trellis_runtime::Shutdown;

use super::channel;

/// How many TunnelEndpoints of each kind every followed broker holds, kept current by their
/// WatchTunnelEndpoints streams ([`follow`]): each tunnel is seen when it is written, without
/// polling. (Polling a hundred brokers' listings one after the other took CPU from the mesh
/// being measured and saw the last full tunnel seconds after it was written.)
pub(super) struct Tallies {
    /// Per broker: (full, induced) TunnelEndpoints, and whether its watch has sent its snapshot.
    counts: std::sync::Mutex<Vec<(usize, usize, bool)>>,
    pub(super) changed: tokio::sync::Notify,
}

impl Tallies {
    pub(super) fn new(brokers: usize) -> Self {
        Self {
            counts: std::sync::Mutex::new(vec![(0, 0, false); brokers]),
            changed: tokio::sync::Notify::new(),
        }
    }

    fn set(&self, i: usize, full: usize, induced: usize, watching: bool) {
        if let Ok(mut counts) = self.counts.lock() {
            counts[i] = (full, induced, watching);
        }
        self.changed.notify_one();
    }

    /// Returns once every broker's watch has delivered its snapshot.
    pub(super) async fn wait_all_watching(&self) {
        loop {
            let all = self
                .counts
                .lock()
                .map(|c| c.iter().all(|(_, _, watching)| *watching))
                .unwrap_or(false);
            if all {
                return;
            }
            tokio::select! {
                () = self.changed.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    }

    /// Whether every full tunnel is up (each leaf's to the hub, the hub's to each of the
    /// `leaves`), and the induced TunnelEndpoints held over all leaves.
    pub(super) fn progress(&self, leaves: usize) -> (bool, usize) {
        let Ok(counts) = self.counts.lock() else {
            return (false, 0);
        };
        let (hub, leaf_counts) = counts.split_last().expect("the hub is followed");
        let full_up = hub.0 >= leaves && leaf_counts.iter().all(|(full, _, _)| *full > 0);
        let induced = leaf_counts
            .iter()
            .map(|(_, induced, _)| (*induced).min(leaves - 1))
            .sum();
        (full_up, induced)
    }
}

/// Follows broker `i`'s TunnelEndpoints until `stop`, re-watching from a fresh snapshot after
/// an interrupted stream.
pub(super) async fn follow(i: usize, addr: SocketAddr, tallies: Arc<Tallies>, stop: Shutdown) {
    loop {
        let watched = async {
            let mut stream = BrokerClient::new(channel(addr).await?)
                .watch_tunnel_endpoints(WatchTunnelEndpointsRequest { start_revision: 0 })
                .await?
                .into_inner();
            let mut held: BTreeMap<String, i32> = BTreeMap::new();
            let mut watching = false;
            while let Some(event) = stream.message().await? {
                let remote = event
                    .tunnel_endpoint
                    .as_ref()
                    .and_then(|t| t.remote.as_ref())
                    .map(|r| r.cluster_id.clone());
                match (WatchEventType::try_from(event.r#type), remote) {
                    (Ok(WatchEventType::Bookmark), _) => watching = true,
                    (Ok(WatchEventType::Deleted), Some(remote)) => {
                        held.remove(&remote);
                    }
                    (Ok(WatchEventType::Added | WatchEventType::Modified), Some(remote)) => {
                        let kind = event.tunnel_endpoint.as_ref().map_or(0, |t| t.kind);
                        held.insert(remote, kind);
                    }
                    _ => {}
                }
                let full = held
                    .values()
                    .filter(|k| **k == PeeringKind::Full as i32)
                    .count();
                let induced = held
                    .values()
                    .filter(|k| **k == PeeringKind::Induced as i32)
                    .count();
                tallies.set(i, full, induced, watching);
            }
            anyhow::Ok(())
        };
        tokio::select! {
            () = stop.cancelled() => return,
            _ = watched => {}
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}
