//! The `trellis.route.v1.Route` gRPC handlers.

use std::sync::Arc;

use tonic::{Request, Response, Status};
use trellis_api::pb::route as pb;
use trellis_api::pb::route::route_server::Route as RouteApi;

use crate::agent::Agent;

/// The gRPC face of one [`Agent`].
#[derive(Debug, Clone)]
pub struct RouteService {
    agent: Arc<Agent>,
}

impl RouteService {
    pub fn new(agent: Arc<Agent>) -> Self {
        Self { agent }
    }
}

#[tonic::async_trait]
impl RouteApi for RouteService {
    async fn get_status(
        &self,
        _request: Request<pb::GetStatusRequest>,
    ) -> Result<Response<pb::GetStatusResponse>, Status> {
        let status = self.agent.status();
        let node = &self.agent.node;
        let wanted = status.wanted.as_ref();
        let refused = node.refused.prefixes();
        Ok(Response::new(pb::GetStatusResponse {
            node_name: node.name.clone(),
            node_ip: node.ip.to_string(),
            gateway_node_name: wanted.map(|w| w.gateway_node.clone()).unwrap_or_default(),
            gateway_node_ip: wanted
                .and_then(|w| w.vxlan.remote.or(w.is_gateway_node.then_some(node.ip)))
                .map(|ip| ip.to_string())
                .unwrap_or_default(),
            is_gateway_node: wanted.is_some_and(|w| w.is_gateway_node),
            routed_prefixes: wanted
                .map(|w| {
                    w.routes
                        .iter()
                        .filter(|p| !refused.contains(p))
                        .map(ToString::to_string)
                        .collect()
                })
                .unwrap_or_default(),
            interface_name: node.interface.clone(),
            overlay_mtu: wanted.map_or(0, |w| w.vxlan.mtu),
            in_sync: status.in_sync,
            message: status.message,
            refused_prefixes: refused.iter().map(ToString::to_string).collect(),
        }))
    }
}
