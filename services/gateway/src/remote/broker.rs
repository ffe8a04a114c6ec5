//! The gateway's port to the local broker: its TunnelEndpoints, followed with
//! `Broker.WatchTunnelEndpoints`. A watch from revision 0 delivers the current records as
//! ADDED and a BOOKMARK, then changes; the follower publishes a complete desired set only at
//! that BOOKMARK (so a half-received snapshot never removes tunnels) and after each live change,
//! resumes an interrupted stream at the last revision + 1, and starts over from 0 when the
//! broker answers OUT_OF_RANGE (compacted history) or the stream broke before the snapshot was
//! complete.

use std::time::Duration;

use futures::FutureExt as _;
use tokio::sync::watch;
use tonic::Code;
use trellis_api::ClusterId;
use trellis_api::model::TunnelEndpoint;
use trellis_api::pb::trellis::peering::v1 as peering;
use trellis_api::pb::types::WatchEventType;
use trellis_runtime::Shutdown;
use trellis_runtime::client::{Timeouts, local_channel};
use trellis_runtime::local_auth::LocalToken;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::retry::{self, RetryPolicy};

use crate::core::Desired;

/// The waits after a failed or ended watch: 200 ms doubling to 5 s.
const RETRY: RetryPolicy =
    RetryPolicy::exponential(Duration::from_millis(200), Duration::from_secs(5));

/// How long after start an unreachable broker is only logged at info (see [`run`]).
const START_GRACE: Duration = Duration::from_secs(30);

/// The state of a watch consumer, independent of the transport.
#[derive(Debug, Default)]
pub struct Follower {
    /// The last revision received (meaningful once `synced`).
    revision: i64,
    /// Whether a snapshot's BOOKMARK was received on the current watch cycle.
    synced: bool,
    current: Desired,
    snapshot: Desired,
}

impl Follower {
    /// The start revision of the next watch call.
    pub fn resume_from(&self) -> i64 {
        if self.synced { self.revision + 1 } else { 0 }
    }

    /// Called before each watch call.
    pub fn on_stream_start(&mut self) {
        if !self.synced {
            self.snapshot.clear();
        }
    }

    /// The broker's history no longer reaches our revision: take a fresh snapshot. The
    /// current set stays published until that snapshot is complete.
    pub fn restart(&mut self) {
        self.synced = false;
        self.revision = 0;
    }

    /// Applies one event; returns the new desired set when it should be published.
    pub fn on_event(&mut self, event: &peering::WatchTunnelEndpointsResponse) -> Option<&Desired> {
        let kind = WatchEventType::try_from(event.r#type).unwrap_or(WatchEventType::Unspecified);
        if kind == WatchEventType::Bookmark {
            self.revision = event.revision;
            if !self.synced {
                self.synced = true;
                self.current = std::mem::take(&mut self.snapshot);
                return Some(&self.current);
            }
            return None;
        }
        let changed = match (kind, event.tunnel_endpoint.as_ref()) {
            (WatchEventType::Added | WatchEventType::Modified, Some(wire)) => {
                match TunnelEndpoint::from_proto("tunnel_endpoint", wire) {
                    Ok(te) => {
                        let target = if self.synced {
                            &mut self.current
                        } else {
                            &mut self.snapshot
                        };
                        target.insert(te.remote.id.clone(), std::sync::Arc::new(te));
                        true
                    }
                    Err(err) => {
                        // Keep whatever we had for that peer: a malformed record changes nothing.
                        tracing::warn!(revision = event.revision, error = %err, "ignoring an invalid tunnel endpoint");
                        false
                    }
                }
            }
            (WatchEventType::Deleted, Some(wire)) => {
                let id = wire
                    .remote
                    .as_ref()
                    .and_then(|r| ClusterId::parse("remote.cluster_id", &r.cluster_id).ok());
                match id {
                    Some(id) => {
                        let target = if self.synced {
                            &mut self.current
                        } else {
                            &mut self.snapshot
                        };
                        target.remove(&id).is_some()
                    }
                    None => {
                        tracing::warn!(
                            revision = event.revision,
                            "ignoring a deletion without a valid remote cluster id"
                        );
                        false
                    }
                }
            }
            _ => {
                tracing::warn!(
                    revision = event.revision,
                    kind = event.r#type,
                    "ignoring a malformed watch event"
                );
                false
            }
        };
        if self.synced {
            self.revision = event.revision;
            return changed.then_some(&self.current);
        }
        None
    }
}

/// Follows the broker at `broker` until `shutdown`, publishing desired sets on `desired`.
pub async fn run(
    broker: String,
    local_token: LocalToken,
    metrics: Metrics,
    desired: watch::Sender<Option<Desired>>,
    shutdown: Shutdown,
) {
    // The request timeout bounds the call until the stream's headers; the stream itself is
    // unbounded, but the channel's keepalive (`trellis_runtime::client::KEEPALIVE`) fails it
    // when the broker's node goes silent, and the loop below then watches again.
    let channel = match local_channel(
        "broker",
        &broker,
        Timeouts::default(),
        &local_token,
        &metrics,
    ) {
        Ok(c) => c,
        Err(err) => {
            tracing::error!(error = %err, "cannot follow the broker's tunnel endpoints");
            return;
        }
    };
    let mut client = peering::broker_client::BrokerClient::new(channel);
    let mut follower = Follower::default();
    let mut backoff = RETRY.backoff();
    // A gateway usually starts before its broker (the broker calls it): until the first watch
    // opens, and for a grace period, an unreachable broker is expected, not worth a warning.
    let started = std::time::Instant::now();
    let mut watched = false;
    loop {
        follower.on_stream_start();
        let start_revision = follower.resume_from();
        let request = peering::WatchTunnelEndpointsRequest { start_revision };
        let opened = tokio::select! {
            opened = client.watch_tunnel_endpoints(request) => opened,
            () = shutdown.cancelled() => return,
        };
        let ended = match opened {
            Ok(response) => {
                watched = true;
                tracing::info!(broker = %broker, start_revision, "watching tunnel endpoints");
                let mut stream = response.into_inner();
                loop {
                    let next = tokio::select! {
                        next = stream.message() => next,
                        () = shutdown.cancelled() => return,
                    };
                    let mut event = match next {
                        Ok(Some(event)) => event,
                        Ok(None) => break tonic::Status::unavailable("the broker ended the watch"),
                        Err(status) => break status,
                    };
                    backoff.reset();
                    // Every event already received is applied before the set is published:
                    // one copy of the set per burst, not one per event (at a mesh of n peers
                    // forming, copies per event made the following cost n²).
                    let mut changed = false;
                    let mut ended = None;
                    loop {
                        changed |= follower.on_event(&event).is_some();
                        match stream.message().now_or_never() {
                            Some(Ok(Some(next))) => event = next,
                            Some(Ok(None)) => {
                                ended =
                                    Some(tonic::Status::unavailable("the broker ended the watch"));
                                break;
                            }
                            Some(Err(status)) => {
                                ended = Some(status);
                                break;
                            }
                            None => break,
                        }
                    }
                    if changed {
                        let set = follower.current.clone();
                        tracing::info!(
                            tunnels = set.len(),
                            revision = follower.revision,
                            "desired tunnels changed"
                        );
                        desired.send_replace(Some(set));
                    }
                    if let Some(status) = ended {
                        break status;
                    }
                }
            }
            Err(status) => status,
        };
        let wait = backoff.next_delay();
        if ended.code() == Code::OutOfRange {
            tracing::info!("broker history compacted; taking a new snapshot");
            follower.restart();
        } else if !watched && started.elapsed() < START_GRACE {
            tracing::info!(code = ?ended.code(), message = ended.message(), retry_ms = wait.as_millis() as u64, "broker not answering yet; waiting for it");
        } else {
            tracing::warn!(code = ?ended.code(), message = ended.message(), retry_ms = wait.as_millis() as u64, "tunnel endpoint watch interrupted");
        }
        tokio::select! {
            () = retry::wait(wait) => {},
            () = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_api::pb::types as types_pb;

    /// 32 bytes of 0x01, base64.
    const KEY: &str = "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=";

    fn te(remote: &str) -> types_pb::TunnelEndpoint {
        types_pb::TunnelEndpoint {
            remote: Some(types_pb::ClusterIdentity {
                cluster_id: remote.into(),
                cluster_name: remote.into(),
            }),
            kind: types_pb::PeeringKind::Full.into(),
            local_pod_cidr: "10.0.0.0/16".into(),
            local_pod_cidr_nat: "10.81.0.0/16".into(),
            local_external_cidr: "10.201.0.0/16".into(),
            local_external_cidr_nat: "10.201.0.0/16".into(),
            remote_pod_cidr: "10.0.0.0/16".into(),
            remote_pod_cidr_nat: "10.83.0.0/16".into(),
            remote_external_cidr: "10.203.0.0/16".into(),
            remote_external_cidr_nat: "10.203.0.0/16".into(),
            remote_endpoint: "192.0.2.3:51840".into(),
            remote_public_key: KEY.into(),
            ..Default::default()
        }
    }

    fn event(
        kind: WatchEventType,
        te: Option<types_pb::TunnelEndpoint>,
        revision: i64,
    ) -> peering::WatchTunnelEndpointsResponse {
        peering::WatchTunnelEndpointsResponse {
            r#type: kind.into(),
            tunnel_endpoint: te,
            revision,
        }
    }

    #[test]
    fn publishes_a_snapshot_only_at_its_bookmark_then_every_change() {
        let mut f = Follower::default();
        assert_eq!(f.resume_from(), 0);
        f.on_stream_start();
        assert!(
            f.on_event(&event(WatchEventType::Added, Some(te("b")), 7))
                .is_none()
        );
        assert!(
            f.on_event(&event(WatchEventType::Added, Some(te("c")), 7))
                .is_none()
        );
        let set = f
            .on_event(&event(WatchEventType::Bookmark, None, 7))
            .expect("snapshot complete");
        assert_eq!(set.len(), 2);
        assert_eq!(f.resume_from(), 8);
        let set = f
            .on_event(&event(WatchEventType::Deleted, Some(te("b")), 9))
            .expect("deletion");
        assert_eq!(set.len(), 1);
        assert_eq!(f.resume_from(), 10);
    }

    #[test]
    fn invalid_records_change_nothing_but_advance_the_revision() {
        let mut f = Follower::default();
        f.on_event(&event(WatchEventType::Bookmark, None, 3));
        let mut bad = te("b");
        bad.remote_pod_cidr_nat = "10.83.0.0/24".into();
        assert!(
            f.on_event(&event(WatchEventType::Added, Some(bad), 4))
                .is_none()
        );
        assert_eq!(f.resume_from(), 5);
    }

    #[test]
    fn a_restart_keeps_the_published_set_until_the_new_snapshot_completes() {
        let mut f = Follower::default();
        f.on_event(&event(WatchEventType::Added, Some(te("b")), 2));
        f.on_event(&event(WatchEventType::Bookmark, None, 2));
        f.restart();
        assert_eq!(f.resume_from(), 0);
        f.on_stream_start();
        assert!(
            f.on_event(&event(WatchEventType::Added, Some(te("c")), 9))
                .is_none()
        );
        let set = f
            .on_event(&event(WatchEventType::Bookmark, None, 9))
            .expect("new snapshot");
        assert_eq!(set.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["c"]);
    }
}
