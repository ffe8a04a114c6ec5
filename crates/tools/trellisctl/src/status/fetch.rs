//! The calls behind `status`: the health probe every service gets first (`diagnose` probes a
//! peer's services with it too), then one call per section, each failing on its own so that
//! the others still show.

use std::time::SystemTime;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::{GetIdentityRequest, ListForeignClustersRequest};
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::gateway::{
    GetGatewayInfoRequest, GetReplicaStatusRequest, ListTunnelsRequest,
};
use trellis_api::pb::peering::ListTunnelEndpointsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_runtime::client::TracedChannel;

use super::{
    ForeignClusterView, GatewayView, LocalIdentityView, ReplicaView, ServiceHealthView,
    TunnelEndpointView, TunnelView,
};
use crate::cli::Globals;
use crate::error::CtlError;
use crate::identity::AddressesView;
use crate::names;
use crate::service::Target;

pub(super) type Connected = Result<TracedChannel, CtlError>;

/// Connects to `target` and asks its health; also returns the channel for further calls.
pub(crate) async fn probe(target: Target, globals: &Globals) -> (ServiceHealthView, Connected) {
    let view = ServiceHealthView {
        service: target.service,
        address: target.address.clone(),
        health: "unreachable".into(),
        error: None,
    };
    let connected = globals.connect(&target).await;
    check(target, view, connected).await
}

/// [`probe`] over TLS as `tls` says (a peer's service, checked against the CA pinned for it),
/// whatever the flags say; `tls` is the error when the pinned CA is unusable.
pub(crate) async fn probe_over(
    target: Target,
    tls: Result<trellis_runtime::tls::ToolTls, String>,
    timeout: std::time::Duration,
) -> (ServiceHealthView, Connected) {
    let view = ServiceHealthView {
        service: target.service,
        address: target.address.clone(),
        health: "unreachable".into(),
        error: None,
    };
    let connected = match tls {
        Err(err) => Err(CtlError::Unreachable {
            service: target.service,
            address: target.address.clone(),
            reason: format!("the CA pinned for this peer is unusable: {err}"),
        }),
        Ok(tls) => crate::connect::connect(&target, Some(&tls), timeout)
            .await
            .map(|channel| {
                crate::cli::traced(channel, trellis_runtime::local_auth::LocalToken::off())
            }),
    };
    check(target, view, connected).await
}

/// The health of `target` through `connected`.
async fn check(
    target: Target,
    mut view: ServiceHealthView,
    connected: Connected,
) -> (ServiceHealthView, Connected) {
    let channel = match connected {
        Ok(channel) => channel,
        Err(err) => {
            view.error = Some(match &err {
                CtlError::Unreachable {
                    service, reason, ..
                } => format!(
                    "{reason} (is {} running? set {})",
                    service.binary(),
                    service.flag()
                ),
                other => other.to_string(),
            });
            return (view, Err(err));
        }
    };
    let answer = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: target.service.grpc_name().into(),
        })
        .await;
    match answer {
        Ok(reply) => {
            let status = reply.into_inner().status;
            view.health = match ServingStatus::try_from(status) {
                Ok(ServingStatus::Serving) => "serving",
                Ok(ServingStatus::NotServing) => "not_serving",
                _ => "unknown",
            }
            .into();
        }
        Err(status) => {
            view.health = "error".into();
            view.error = Some(CtlError::rpc(&target, "Health/Check", &status).to_string());
        }
    }
    (view, Ok(channel))
}

pub(super) async fn identity(
    target: &Target,
    channel: Connected,
) -> Result<LocalIdentityView, CtlError> {
    let reply = DiscoveryClient::new(channel?)
        .get_identity(GetIdentityRequest {})
        .await
        .map_err(|s| CtlError::rpc(target, "GetIdentity", &s))?
        .into_inner();
    let id = reply.identity.unwrap_or_default();
    Ok(LocalIdentityView {
        cluster_id: id.cluster_id,
        cluster_name: id.cluster_name,
        addresses: AddressesView::from_pb(reply.addresses.as_ref()),
        plaintext_peering: reply.plaintext_peering,
    })
}

pub(super) async fn foreign_clusters(
    target: &Target,
    channel: Connected,
) -> Result<Vec<ForeignClusterView>, CtlError> {
    let reply = DiscoveryClient::new(channel?)
        .list_foreign_clusters(ListForeignClustersRequest::default())
        .await
        .map_err(|s| CtlError::rpc(target, "ListForeignClusters", &s))?
        .into_inner();
    Ok(reply
        .foreign_clusters
        .iter()
        .map(ForeignClusterView::from_pb)
        .collect())
}

pub(super) async fn tunnel_endpoints(
    target: &Target,
    channel: Connected,
) -> Result<Vec<TunnelEndpointView>, CtlError> {
    let reply = BrokerClient::new(channel?)
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await
        .map_err(|s| CtlError::rpc(target, "ListTunnelEndpoints", &s))?
        .into_inner();
    Ok(reply
        .tunnel_endpoints
        .iter()
        .map(TunnelEndpointView::from_pb)
        .collect())
}

pub(super) async fn gateway_info(
    target: &Target,
    channel: Connected,
) -> Result<GatewayView, CtlError> {
    let mut client = GatewayClient::new(channel?);
    let reply = client
        .get_gateway_info(GetGatewayInfoRequest::default())
        .await
        .map_err(|s| CtlError::rpc(target, "GetGatewayInfo", &s))?
        .into_inner();
    let replica = client
        .get_replica_status(GetReplicaStatusRequest {})
        .await
        .ok()
        .map(|r| ReplicaView::from_pb(&r.into_inner()));
    Ok(GatewayView {
        mode: names::wireguard_mode(reply.mode),
        endpoint: reply.endpoint,
        public_key: reply.public_key,
        replica,
    })
}

pub(super) async fn tunnels(
    target: &Target,
    channel: Connected,
    now: SystemTime,
) -> Result<Vec<TunnelView>, CtlError> {
    let reply = GatewayClient::new(channel?)
        .list_tunnels(ListTunnelsRequest {})
        .await
        .map_err(|s| CtlError::rpc(target, "ListTunnels", &s))?
        .into_inner();
    Ok(reply
        .tunnels
        .iter()
        .map(|t| TunnelView::from_pb(t, now))
        .collect())
}
