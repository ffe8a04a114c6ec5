//! The `trellis.gateway.v1.Gateway` gRPC handlers: validate the request into domain values
//! (errors name the field), call [`Gateway`], map the answer back. Nothing else happens here.

use std::pin::Pin;
use std::sync::Arc;
use std::time::SystemTime;

use futures::Stream;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::WatchStream;
use tonic::{Request, Response, Status};
use trellis_api::ClusterId;
use trellis_api::pb::gateway::gateway_server::Gateway as GatewayApi;
use trellis_api::pb::gateway::{self as pb, TunnelState, get_gateway_info_result as info_result};
use trellis_api::pb::types as types_pb;
use trellis_error::Error;
use trellis_runtime::batch;

use crate::core::{Gateway, RouteSet, State, TunnelStatus};
use crate::dataplane::Mode;

/// The gRPC face of one [`Gateway`].
#[derive(Debug, Clone)]
pub struct GatewayService {
    core: Arc<Gateway>,
}

impl GatewayService {
    /// One GetGatewayInfo, alone or as an item of a batch.
    async fn info_one(
        &self,
        req: pb::GetGatewayInfoRequest,
    ) -> trellis_error::Result<pb::GetGatewayInfoResponse> {
        let peer = if req.cluster_id.is_empty() {
            None
        } else {
            Some(ClusterId::parse("cluster_id", &req.cluster_id)?)
        };
        let info = self.core.info(peer.as_ref()).await?;
        Ok(pb::GetGatewayInfoResponse {
            endpoint: info.endpoint.to_string(),
            public_key: info.public_key.to_string(),
            mode: mode_to_proto(info.mode).into(),
            listen_port: u32::from(info.listen_port),
            unused_port_grace_seconds: u32::try_from(info.unused_port_grace.as_secs())
                .unwrap_or(u32::MAX),
            stateless_wire: info.stateless_wire,
        })
    }

    pub fn new(core: Arc<Gateway>) -> Self {
        Self { core }
    }
}

fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(t)
}

fn state(s: State) -> TunnelState {
    match s {
        State::Connecting => TunnelState::Connecting,
        State::Up => TunnelState::Up,
        State::Down => TunnelState::Down,
        State::Error => TunnelState::Error,
    }
}

fn tunnel_status(t: TunnelStatus) -> pb::TunnelStatus {
    let te = &t.plan.endpoint;
    let stats = t.stats.unwrap_or_default();
    pb::TunnelStatus {
        remote: Some(types_pb::ClusterIdentity {
            cluster_id: te.remote.id.to_string(),
            cluster_name: te.remote.name.clone(),
        }),
        kind: te.kind.to_proto().into(),
        interface_name: t.plan.interface.clone(),
        remote_endpoint: stats
            .endpoint
            .map_or_else(|| te.remote_endpoint.to_string(), |a| a.to_string()),
        remote_public_key: te.remote_public_key.to_string(),
        routed_cidrs: t.plan.routed().iter().map(ToString::to_string).collect(),
        last_handshake_time: stats.last_handshake.map(timestamp),
        rx_bytes: stats.rx_bytes,
        tx_bytes: stats.tx_bytes,
        probe_rtt: None,
        last_probe_time: None,
        state: state(t.state).into(),
        message: t.message,
        applied_generation: te.generation,
        listen_port: u32::from(t.plan.listen_port),
        path: match (stats.last_handshake, stats.relayed) {
            (None, _) => pb::TunnelPath::Unspecified,
            (Some(_), false) => pb::TunnelPath::Direct,
            (Some(_), true) => pb::TunnelPath::Relayed,
        }
        .into(),
    }
}

#[tonic::async_trait]
impl GatewayApi for GatewayService {
    async fn get_gateway_info(
        &self,
        request: Request<pb::GetGatewayInfoRequest>,
    ) -> Result<Response<pb::GetGatewayInfoResponse>, Status> {
        Ok(Response::new(self.info_one(request.into_inner()).await?))
    }

    async fn get_gateway_info_batch(
        &self,
        request: Request<pb::GetGatewayInfoBatchRequest>,
    ) -> Result<Response<pb::GetGatewayInfoBatchResponse>, Status> {
        let results = batch::serve_packed(
            request.into_inner().requests,
            |item| self.info_one(item),
            |r| pb::GetGatewayInfoResult {
                result: Some(
                    r.map_or_else(info_result::Result::Error, info_result::Result::Response),
                ),
            },
        )
        .await?;
        Ok(Response::new(pb::GetGatewayInfoBatchResponse { results }))
    }

    async fn list_tunnels(
        &self,
        _request: Request<pb::ListTunnelsRequest>,
    ) -> Result<Response<pb::ListTunnelsResponse>, Status> {
        let tunnels = self.core.tunnels().await;
        Ok(Response::new(pb::ListTunnelsResponse {
            tunnels: tunnels.into_iter().map(tunnel_status).collect(),
        }))
    }

    async fn get_tunnel_status(
        &self,
        request: Request<pb::GetTunnelStatusRequest>,
    ) -> Result<Response<pb::GetTunnelStatusResponse>, Status> {
        let req = request.into_inner();
        let peer = ClusterId::parse("cluster_id", &req.cluster_id)?;
        let tunnel = self
            .core
            .tunnel(&peer)
            .await
            .ok_or_else(|| Error::NotFound(format!("no tunnel to cluster {peer}")))?;
        Ok(Response::new(pb::GetTunnelStatusResponse {
            tunnel: Some(tunnel_status(tunnel)),
        }))
    }

    type WatchRoutesStream = RoutesStream;

    async fn watch_routes(
        &self,
        request: Request<pb::WatchRoutesRequest>,
    ) -> Result<Response<Self::WatchRoutesStream>, Status> {
        let node = trellis_api::ident::dns_label("node_name", &request.into_inner().node_name)?;
        tracing::info!(node = %node, "route agent subscribed");
        let stream =
            WatchStream::new(self.core.watch_routes()).map(|routes| Ok(route_set(&routes)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_replica_status(
        &self,
        _request: Request<pb::GetReplicaStatusRequest>,
    ) -> Result<Response<pb::GetReplicaStatusResponse>, Status> {
        let status = self.core.replica_status();
        let leader = status.view.leader.as_ref();
        Ok(Response::new(pb::GetReplicaStatusResponse {
            replica: status.replica.clone(),
            active: status.view.active,
            epoch: status.view.epoch(),
            active_replica: leader.map(|l| l.replica.clone()).unwrap_or_default(),
            active_node_name: leader.map(|l| l.node_name.clone()).unwrap_or_default(),
            warm: status.warm,
            peers: status
                .peers
                .into_iter()
                .map(|p| pb::ReplicaPeer {
                    replica: p.replica,
                    since_heartbeat: prost_types::Duration::try_from(p.since).ok(),
                    active: p.active,
                    warm: p.warm,
                    epoch: p.epoch,
                })
                .collect(),
        }))
    }
}

/// The stream of WatchRoutes.
pub type RoutesStream = Pin<Box<dyn Stream<Item = Result<pb::WatchRoutesResponse, Status>> + Send>>;

fn route_set(routes: &RouteSet) -> pb::WatchRoutesResponse {
    pb::WatchRoutesResponse {
        remote_prefixes: routes.prefixes.iter().map(ToString::to_string).collect(),
        gateway_node_name: routes.gateway_node_name.clone(),
        gateway_node_ip: routes
            .gateway_node_ip
            .map(|ip| ip.to_string())
            .unwrap_or_default(),
        tunnel_mtu: routes.tunnel_mtu,
        epoch: routes.epoch,
    }
}

/// The wire enum of a data-plane mode.
fn mode_to_proto(mode: Mode) -> pb::WireguardMode {
    match mode {
        Mode::None => pb::WireguardMode::None,
        Mode::Userspace => pb::WireguardMode::Userspace,
        Mode::Kernel => pb::WireguardMode::Kernel,
    }
}

/// The gRPC routes of the gateway service.
pub fn routes(core: Arc<Gateway>) -> tonic::service::Routes {
    tonic::service::Routes::new(
        trellis_api::pb::gateway::gateway_server::GatewayServer::new(GatewayService::new(core))
            .max_decoding_message_size(crate::MAX_REQUEST_BYTES),
    )
}
