//! A stand-in for the local broker's `WatchTunnelEndpoints`, until `trellis-broker` lands:
//! a test publishes TunnelEndpoints into it (put/delete), and it serves them with the proto's
//! watch semantics (start_revision 0 = snapshot as ADDED + BOOKMARK, then live changes; a
//! positive start replays history from that revision; OUT_OF_RANGE below the compaction
//! point). Every other Broker RPC is UNIMPLEMENTED.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use trellis_api::pb::trellis::peering::v1 as pb;
use trellis_api::pb::types::{TunnelEndpoint, WatchEventType};

#[derive(Debug, Default)]
struct State {
    revision: i64,
    records: BTreeMap<String, TunnelEndpoint>,
    history: Vec<pb::WatchTunnelEndpointsResponse>,
    /// Starts below this revision are OUT_OF_RANGE.
    compacted: i64,
}

/// The stand-in; clones share the same records.
#[derive(Debug, Clone)]
pub struct StandinBroker {
    state: Arc<Mutex<State>>,
    revision: watch::Sender<i64>,
}

impl Default for StandinBroker {
    fn default() -> Self {
        Self {
            state: Arc::default(),
            revision: watch::channel(0).0,
        }
    }
}

fn remote_id(te: &TunnelEndpoint) -> String {
    te.remote
        .as_ref()
        .map(|r| r.cluster_id.clone())
        .unwrap_or_default()
}

impl StandinBroker {
    fn record(&self, kind: WatchEventType, te: TunnelEndpoint) {
        let revision = {
            let mut s = self.state.lock().expect("lock");
            s.revision += 1;
            let revision = s.revision;
            s.history.push(pb::WatchTunnelEndpointsResponse {
                r#type: kind.into(),
                tunnel_endpoint: Some(te),
                revision,
            });
            revision
        };
        self.revision.send_replace(revision);
    }

    /// Creates or replaces the TunnelEndpoint for its remote cluster.
    pub fn put(&self, te: TunnelEndpoint) {
        let id = remote_id(&te);
        let existed = self
            .state
            .lock()
            .expect("lock")
            .records
            .insert(id, te.clone())
            .is_some();
        let kind = if existed {
            WatchEventType::Modified
        } else {
            WatchEventType::Added
        };
        self.record(kind, te);
    }

    /// Deletes the TunnelEndpoint for `cluster_id`.
    pub fn delete(&self, cluster_id: &str) {
        let removed = self.state.lock().expect("lock").records.remove(cluster_id);
        if let Some(te) = removed {
            self.record(WatchEventType::Deleted, te);
        }
    }

    /// Forgets history below the current revision (resuming watches get OUT_OF_RANGE).
    pub fn compact(&self) {
        let mut s = self.state.lock().expect("lock");
        s.compacted = s.revision;
        s.history.clear();
    }

    /// The gRPC service.
    pub fn service(self) -> pb::broker_server::BrokerServer<Self> {
        pb::broker_server::BrokerServer::new(self)
    }
}

type WatchStream =
    Pin<Box<dyn Stream<Item = Result<pb::WatchTunnelEndpointsResponse, Status>> + Send>>;

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented(
        "stand-in broker: only WatchTunnelEndpoints",
    ))
}

#[tonic::async_trait]
impl pb::broker_server::Broker for StandinBroker {
    async fn get_token(
        &self,
        _: Request<pb::GetTokenRequest>,
    ) -> Result<Response<pb::GetTokenResponse>, Status> {
        unimplemented()
    }

    async fn rotate_token(
        &self,
        _: Request<pb::RotateTokenRequest>,
    ) -> Result<Response<pb::RotateTokenResponse>, Status> {
        unimplemented()
    }

    async fn peer(
        &self,
        _: Request<pb::PeerRequest>,
    ) -> Result<Response<pb::PeerResponse>, Status> {
        unimplemented()
    }

    async fn unpeer(
        &self,
        _: Request<pb::UnpeerRequest>,
    ) -> Result<Response<pb::UnpeerResponse>, Status> {
        unimplemented()
    }

    async fn handshake(
        &self,
        _: Request<pb::HandshakeRequest>,
    ) -> Result<Response<pb::HandshakeResponse>, Status> {
        unimplemented()
    }

    async fn submit_network_config(
        &self,
        _: Request<pb::SubmitNetworkConfigRequest>,
    ) -> Result<Response<pb::SubmitNetworkConfigResponse>, Status> {
        unimplemented()
    }

    async fn report_network_config_status(
        &self,
        _: Request<pb::ReportNetworkConfigStatusRequest>,
    ) -> Result<Response<pb::ReportNetworkConfigStatusResponse>, Status> {
        unimplemented()
    }

    async fn withdraw_network_config(
        &self,
        _: Request<pb::WithdrawNetworkConfigRequest>,
    ) -> Result<Response<pb::WithdrawNetworkConfigResponse>, Status> {
        unimplemented()
    }

    async fn notify_unpeer(
        &self,
        _: Request<pb::NotifyUnpeerRequest>,
    ) -> Result<Response<pb::NotifyUnpeerResponse>, Status> {
        unimplemented()
    }

    async fn list_network_configs(
        &self,
        _: Request<pb::ListNetworkConfigsRequest>,
    ) -> Result<Response<pb::ListNetworkConfigsResponse>, Status> {
        unimplemented()
    }

    async fn list_tunnel_endpoints(
        &self,
        _: Request<pb::ListTunnelEndpointsRequest>,
    ) -> Result<Response<pb::ListTunnelEndpointsResponse>, Status> {
        unimplemented()
    }

    type WatchTunnelEndpointsStream = WatchStream;

    async fn watch_tunnel_endpoints(
        &self,
        request: Request<pb::WatchTunnelEndpointsRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let start = request.into_inner().start_revision;
        let (tx, rx) = mpsc::channel(64);
        let mut next = {
            let s = self.state.lock().expect("lock");
            if start > 0 && start <= s.compacted {
                return Err(Status::out_of_range(format!(
                    "revision {start} is compacted (history starts after {})",
                    s.compacted
                )));
            }
            if start == 0 {
                for te in s.records.values() {
                    let _ = tx.try_send(Ok(pb::WatchTunnelEndpointsResponse {
                        r#type: WatchEventType::Added.into(),
                        tunnel_endpoint: Some(te.clone()),
                        revision: s.revision,
                    }));
                }
                let _ = tx.try_send(Ok(pb::WatchTunnelEndpointsResponse {
                    r#type: WatchEventType::Bookmark.into(),
                    tunnel_endpoint: None,
                    revision: s.revision,
                }));
                s.revision + 1
            } else {
                start
            }
        };
        let state = self.state.clone();
        let mut revisions = self.revision.subscribe();
        tokio::spawn(async move {
            loop {
                let events: Vec<_> = state
                    .lock()
                    .expect("lock")
                    .history
                    .iter()
                    .filter(|e| e.revision >= next)
                    .cloned()
                    .collect();
                for event in events {
                    next = event.revision + 1;
                    if tx.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    changed = revisions.changed() => if changed.is_err() { return },
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
