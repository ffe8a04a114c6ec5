//! The `trellis.peering.v1.Broker` gRPC handlers: validate the request into domain values
//! (errors name the field), call [`Broker`], map the answer back. The TunnelEndpoint watch's
//! server stream is built in [`watch`].

pub mod watch;

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};
use trellis_api::convert::{
    addresses_from_pb, addresses_to_pb, generations_from_pb, identity_from_pb, identity_to_pb,
    timestamp,
};
use trellis_api::model::{NetworkSpec, PeeringKind};
use trellis_api::pb::peering::broker_server::Broker as BrokerApi;
use trellis_api::pb::peering::{self as pb};
use trellis_api::pb::types;
use trellis_api::{ClusterId, ClusterIdentity, address};
use trellis_error::{Error, Result};

use trellis_runtime::batch;
use trellis_runtime::peer::{Authz, PeerMethods};
use trellis_runtime::tls::{CaCertHash, PeerIdentity};

use crate::core::Broker;
use crate::core::receive::Received;
use crate::peering_id::PeeringId;
use crate::records::{Decision, nc_name};
use crate::{join_tokens, reconcile, token};

/// The gRPC face of one [`Broker`].
#[derive(Debug, Clone)]
pub struct BrokerService {
    core: Arc<Broker>,
    authz: Authz,
}

impl BrokerService {
    /// Without mutual TLS: the identities requests claim are trusted.
    pub fn new(core: Arc<Broker>) -> Self {
        Self::with_authz(core, Authz::off())
    }

    /// With `authz` checking cluster-facing calls against the caller's certificate (ADR 0014).
    pub fn with_authz(core: Arc<Broker>, authz: Authz) -> Self {
        Self { core, authz }
    }

    /// One SubmitNetworkConfig request, alone or as an item of a batch: `peer` is the caller's
    /// verified identity, `rpc` the method it called (for errors).
    async fn submit_one(
        &self,
        peer: Option<&PeerIdentity>,
        rpc: &str,
        request: pb::SubmitNetworkConfigRequest,
    ) -> Result<pb::SubmitNetworkConfigResponse, Status> {
        let nc = request
            .network_config
            .ok_or_else(|| Error::invalid("network_config", "is required"))?;
        let origin = identity_from_pb("network_config.origin", nc.origin.as_ref())?;
        let destination = identity_from_pb("network_config.destination", nc.destination.as_ref())?;
        let via = via_of("network_config.via", nc.via.as_ref())?;
        check_pair(
            &self.core.identity().id,
            "network_config",
            &nc.name,
            &origin,
            &destination,
            via.as_ref(),
        )?;
        // A cluster submits only as itself; a relayed one only as the hub it names in `via`.
        let (claim, expected) = sender(via.as_ref(), &origin, "network_config.origin");
        self.authz.require(peer, rpc, claim, expected.as_str())?;
        let (generation, held_generation) = generations_from_pb(&nc)?;
        let spec = NetworkSpec::from_proto("network_config.spec", nc.spec.as_ref())?;
        let direct = via.is_none().then(|| origin.id.clone());
        let answer = self
            .core
            .receive(Received {
                origin,
                via,
                spec,
                generation,
                held_generation,
            })
            .await?;
        // Only a full peer, calling directly (checked by `receive`), has a peering with us to
        // be told of.
        let peering_id = match &direct {
            Some(origin) => self.core.peering_id(origin).await?,
            None => None,
        };
        Ok(pb::SubmitNetworkConfigResponse {
            peering_id: peering_id.map(|id| id.to_string()).unwrap_or_default(),
            accepted: answer.accepted,
            status: Some(types::NetworkConfigStatus {
                receiver_generation: answer.receiver_generation,
                ..status_of(&answer.decision)
            }),
        })
    }
}

/// At most this many IDs per GetObservedEndpoints call.
const MAX_OBSERVED: usize = 1024;

/// Far above what one CA certificate takes, far below what would cost us to parse.
const MAX_CA_PEM: usize = 16 * 1024;

/// The methods the peer listener serves (ADR 0014).
pub const PEER_METHODS: PeerMethods = PeerMethods {
    authenticated: &[
        "/trellis.peering.v1.Broker/SubmitNetworkConfig",
        "/trellis.peering.v1.Broker/SubmitNetworkConfigBatch",
        "/trellis.peering.v1.Broker/ReportNetworkConfigStatus",
        "/trellis.peering.v1.Broker/WithdrawNetworkConfig",
        "/trellis.peering.v1.Broker/NotifyUnpeer",
        "/trellis.peering.v1.Broker/UpdatePeerCa",
        "/trellis.peering.v1.Broker/GetObservedEndpoints",
    ],
    anonymous: &["/trellis.peering.v1.Broker/Handshake"],
};

/// Who must be calling about a NetworkConfig (reference): its `via` hub when relayed,
/// otherwise `direct` (the origin or the destination, depending on the RPC).
fn sender<'a>(
    via: Option<&'a ClusterIdentity>,
    direct: &'a ClusterIdentity,
    direct_field: &'static str,
) -> (&'static str, &'a ClusterId) {
    match via {
        Some(hub) => ("network_config.via", &hub.id),
        None => (direct_field, &direct.id),
    }
}

fn status_of(decision: &Decision) -> types::NetworkConfigStatus {
    match decision {
        Decision::Processed {
            view,
            observed_generation,
        } => view.to_status(*observed_generation),
        Decision::Rejected {
            message,
            observed_generation,
        } => types::NetworkConfigStatus {
            state: types::NetworkConfigState::Rejected.into(),
            observed_generation: *observed_generation,
            message: message.clone(),
            ..Default::default()
        },
        Decision::Pending {
            message,
            observed_generation,
        } => types::NetworkConfigStatus {
            state: types::NetworkConfigState::Pending.into(),
            observed_generation: *observed_generation,
            message: message.clone(),
            ..Default::default()
        },
    }
}

/// The optional `via` of a NetworkConfig: absent or empty means direct.
fn via_of(field: &str, via: Option<&types::ClusterIdentity>) -> Result<Option<ClusterIdentity>> {
    via.filter(|v| !v.cluster_id.is_empty())
        .map(|v| identity_from_pb(field, Some(v)))
        .transpose()
}

/// Checks that a NetworkConfig (reference) is (origin → us \[via\]) and names it consistently.
fn check_pair(
    us: &ClusterId,
    prefix: &str,
    name: &str,
    origin: &ClusterIdentity,
    destination: &ClusterIdentity,
    via: Option<&ClusterIdentity>,
) -> Result<()> {
    if destination.id != *us {
        return Err(Error::invalid(
            format!("{prefix}.destination.cluster_id"),
            format!("is {}, not this cluster ({us})", destination.id),
        ));
    }
    if origin.id == *us {
        return Err(Error::invalid(
            format!("{prefix}.origin.cluster_id"),
            "is this cluster",
        ));
    }
    if let Some(via) = via
        && (via.id == origin.id || via.id == *us)
    {
        return Err(Error::invalid(
            format!("{prefix}.via.cluster_id"),
            "names the origin or the destination",
        ));
    }
    let expected = nc_name(&origin.id, &destination.id);
    if name != expected {
        return Err(Error::invalid(
            format!("{prefix}.name"),
            format!("is {name:?}; expected {expected:?}"),
        ));
    }
    Ok(())
}

fn join_token_to_pb(token: &join_tokens::JoinToken) -> pb::JoinToken {
    pb::JoinToken {
        id: token.id.clone(),
        create_time: Some(timestamp(token.record.created_nanos)),
        expire_time: Some(timestamp(token.record.expires_nanos)),
        description: token.record.description.clone(),
    }
}

#[tonic::async_trait]
impl BrokerApi for BrokerService {
    async fn get_token(
        &self,
        _request: Request<pb::GetTokenRequest>,
    ) -> Result<Response<pb::GetTokenResponse>, Status> {
        let token = self.core.token().await?;
        let advertised_broker = self
            .core
            .advertised()
            .await
            .map(|a| a.broker)
            .unwrap_or_default();
        Ok(Response::new(pb::GetTokenResponse {
            token: token.current,
            create_time: Some(timestamp(token.created_nanos)),
            ca_cert_hash: self.core.ca_cert_hash().unwrap_or_default(),
            advertised_broker,
        }))
    }

    async fn rotate_token(
        &self,
        request: Request<pb::RotateTokenRequest>,
    ) -> Result<Response<pb::RotateTokenResponse>, Status> {
        let grace = match request.into_inner().grace_period {
            None => Duration::ZERO,
            Some(d) if d.seconds < 0 || d.nanos < 0 => {
                return Err(Error::invalid("grace_period", "must not be negative").into());
            }
            Some(d) => Duration::new(
                u64::try_from(d.seconds).unwrap_or(0),
                u32::try_from(d.nanos).unwrap_or(0),
            ),
        };
        let token = token::rotate(self.core.store(), grace).await?;
        Ok(Response::new(pb::RotateTokenResponse {
            previous_token_expire_time: token
                .previous
                .as_ref()
                .map(|_| timestamp(token.previous_expires_nanos)),
            token: token.current,
        }))
    }

    async fn create_join_token(
        &self,
        request: Request<pb::CreateJoinTokenRequest>,
    ) -> Result<Response<pb::CreateJoinTokenResponse>, Status> {
        let req = request.into_inner();
        let requested = req
            .ttl
            .map(|d| {
                Duration::try_from(d)
                    .map_err(|_| Error::invalid("ttl", "must be a positive duration"))
            })
            .transpose()?;
        let ttl = join_tokens::ttl("ttl", requested)?;
        let description = join_tokens::description("description", &req.description)?;
        let (token, made) = join_tokens::create(self.core.store(), ttl, description).await?;
        Ok(Response::new(pb::CreateJoinTokenResponse {
            token,
            join_token: Some(join_token_to_pb(&made)),
        }))
    }

    async fn list_join_tokens(
        &self,
        _request: Request<pb::ListJoinTokensRequest>,
    ) -> Result<Response<pb::ListJoinTokensResponse>, Status> {
        let tokens = join_tokens::list(self.core.store()).await?;
        Ok(Response::new(pb::ListJoinTokensResponse {
            join_tokens: tokens.iter().map(join_token_to_pb).collect(),
        }))
    }

    async fn revoke_join_token(
        &self,
        request: Request<pb::RevokeJoinTokenRequest>,
    ) -> Result<Response<pb::RevokeJoinTokenResponse>, Status> {
        let id = join_tokens::parse_id("id", &request.into_inner().id)?;
        let revoked = join_tokens::revoke(self.core.store(), &id).await?;
        Ok(Response::new(pb::RevokeJoinTokenResponse { revoked }))
    }

    async fn peer(
        &self,
        request: Request<pb::PeerRequest>,
    ) -> Result<Response<pb::PeerResponse>, Status> {
        let req = request.into_inner();
        let address = address::required("broker_address", &req.broker_address)?;
        if req.token.is_empty() {
            return Err(Error::invalid("token", "is required (the remote's GetToken)").into());
        }
        let expected = (!req.expected_cluster_id.is_empty())
            .then(|| ClusterId::parse("expected_cluster_id", &req.expected_cluster_id))
            .transpose()?;
        let pin = (!req.ca_cert_hash.is_empty())
            .then(|| CaCertHash::parse("ca_cert_hash", &req.ca_cert_hash))
            .transpose()?;
        let (identity, addresses) = self
            .core
            .peer(&address, &req.token, expected.as_ref(), pin)
            .await?;
        Ok(Response::new(pb::PeerResponse {
            identity: Some(identity_to_pb(&identity)),
            addresses: Some(addresses_to_pb(&addresses)),
        }))
    }

    async fn unpeer(
        &self,
        request: Request<pb::UnpeerRequest>,
    ) -> Result<Response<pb::UnpeerResponse>, Status> {
        let id = ClusterId::parse("cluster_id", &request.into_inner().cluster_id)?;
        let unpeered = self.core.unpeer(&id).await?;
        Ok(Response::new(pb::UnpeerResponse { unpeered }))
    }

    async fn handshake(
        &self,
        request: Request<pb::HandshakeRequest>,
    ) -> Result<Response<pb::HandshakeResponse>, Status> {
        let transport = trellis_runtime::tls::caller(&request);
        let req = request.into_inner();
        if req.token.is_empty() || req.token.len() > 256 {
            return Err(
                Error::PermissionDenied("the peering token is wrong or expired".into()).into(),
            );
        }
        let caller = identity_from_pb("identity", req.identity.as_ref())?;
        let addresses = addresses_from_pb("addresses", req.addresses.as_ref())?;
        let peering_id = PeeringId::parse_optional("peering_id", &req.peering_id)?;
        let (identity, ours, ca_certificate) = self
            .core
            .handshake(
                &transport,
                &req.token,
                &caller,
                &addresses,
                &req.ca_certificate,
                peering_id.as_ref(),
            )
            .await?;
        Ok(Response::new(pb::HandshakeResponse {
            identity: Some(identity_to_pb(&identity)),
            addresses: Some(addresses_to_pb(&ours)),
            ca_certificate,
        }))
    }

    async fn submit_network_config(
        &self,
        request: Request<pb::SubmitNetworkConfigRequest>,
    ) -> Result<Response<pb::SubmitNetworkConfigResponse>, Status> {
        let peer = self.authz.peer(&request, "SubmitNetworkConfig")?;
        self.submit_one(peer.as_ref(), "SubmitNetworkConfig", request.into_inner())
            .await
            .map(Response::new)
    }

    async fn submit_network_config_batch(
        &self,
        request: Request<pb::SubmitNetworkConfigBatchRequest>,
    ) -> Result<Response<pb::SubmitNetworkConfigBatchResponse>, Status> {
        const RPC: &str = "SubmitNetworkConfigBatch";
        let peer = self.authz.peer(&request, RPC)?;
        let requests = request.into_inner().requests;
        batch::check_len(requests.len())?;
        let results =
            batch::serve(requests, |item| self.submit_one(peer.as_ref(), RPC, item)).await;
        Ok(Response::new(pb::SubmitNetworkConfigBatchResponse {
            results: batch::submit_results(results),
        }))
    }

    async fn report_network_config_status(
        &self,
        request: Request<pb::ReportNetworkConfigStatusRequest>,
    ) -> Result<Response<pb::ReportNetworkConfigStatusResponse>, Status> {
        const RPC: &str = "ReportNetworkConfigStatus";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let reference = req
            .network_config
            .ok_or_else(|| Error::invalid("network_config", "is required"))?;
        let origin = identity_from_pb("network_config.origin", reference.origin.as_ref())?;
        let destination =
            identity_from_pb("network_config.destination", reference.destination.as_ref())?;
        if origin.id != self.core.identity().id {
            return Err(
                Error::invalid("network_config.origin.cluster_id", "is not this cluster").into(),
            );
        }
        // The decision comes from the destination itself, or from the hub relaying it.
        let via = via_of("network_config.via", reference.via.as_ref())?;
        let (claim, expected) = sender(via.as_ref(), &destination, "network_config.destination");
        self.authz
            .require(peer.as_ref(), RPC, claim, expected.as_str())?;
        let expected = nc_name(&origin.id, &destination.id);
        if reference.name != expected {
            return Err(Error::invalid(
                "network_config.name",
                format!("is {:?}; expected {expected:?}", reference.name),
            )
            .into());
        }
        let out = self.core.outgoing(&destination.id).await?.ok_or_else(|| {
            Error::NotFound(format!("no network config towards {}", destination.id))
        })?;
        crate::core::statuses::check_via(&destination.id, out.via.as_ref(), via.as_ref())?;
        let Some(decision) =
            reconcile::exchange::decision_from_status(&out.spec, req.status.as_ref())?
        else {
            return Err(Error::invalid("status.state", "must be PROCESSED or REJECTED").into());
        };
        let receiver_generation = req.status.as_ref().map_or(0, |s| s.receiver_generation);
        if receiver_generation < 0 {
            return Err(
                Error::invalid("status.receiver_generation", "must not be negative").into(),
            );
        }
        let applied = self
            .core
            .decided(&destination.id, decision, receiver_generation)
            .await?;
        Ok(Response::new(pb::ReportNetworkConfigStatusResponse {
            applied,
        }))
    }

    async fn withdraw_network_config(
        &self,
        request: Request<pb::WithdrawNetworkConfigRequest>,
    ) -> Result<Response<pb::WithdrawNetworkConfigResponse>, Status> {
        const RPC: &str = "WithdrawNetworkConfig";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let reference = req
            .network_config
            .ok_or_else(|| Error::invalid("network_config", "is required"))?;
        let origin = identity_from_pb("network_config.origin", reference.origin.as_ref())?;
        let destination =
            identity_from_pb("network_config.destination", reference.destination.as_ref())?;
        let via = via_of("network_config.via", reference.via.as_ref())?;
        check_pair(
            &self.core.identity().id,
            "network_config",
            &reference.name,
            &origin,
            &destination,
            via.as_ref(),
        )?;
        let (claim, expected) = sender(via.as_ref(), &origin, "network_config.origin");
        self.authz
            .require(peer.as_ref(), RPC, claim, expected.as_str())?;
        // Nothing held: nothing to withdraw, and no stored hub to check a `via` against.
        let Some(held) = self.core.incoming(&origin.id).await? else {
            return Ok(Response::new(pb::WithdrawNetworkConfigResponse {
                removed: false,
            }));
        };
        crate::core::statuses::check_via(&origin.id, held.via.as_ref(), via.as_ref())?;
        let removed = reconcile::teardown::withdrawn(&self.core, &origin.id).await?;
        tracing::info!(remote.id = %origin.id, reason = req.reason, removed, "the remote withdrew its network config");
        Ok(Response::new(pb::WithdrawNetworkConfigResponse { removed }))
    }

    async fn notify_unpeer(
        &self,
        request: Request<pb::NotifyUnpeerRequest>,
    ) -> Result<Response<pb::NotifyUnpeerResponse>, Status> {
        const RPC: &str = "NotifyUnpeer";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let caller = identity_from_pb("identity", req.identity.as_ref())?;
        self.authz
            .require(peer.as_ref(), RPC, "identity", caller.id.as_str())?;
        let ends = PeeringId::parse_optional("peering_id", &req.peering_id)?;
        let unpeered = self
            .core
            .notified_unpeer(&caller, &req.reason, ends.as_ref())
            .await?;
        Ok(Response::new(pb::NotifyUnpeerResponse { unpeered }))
    }

    async fn update_peer_ca(
        &self,
        request: Request<pb::UpdatePeerCaRequest>,
    ) -> Result<Response<pb::UpdatePeerCaResponse>, Status> {
        const RPC: &str = "UpdatePeerCa";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let caller = identity_from_pb("identity", req.identity.as_ref())?;
        self.authz
            .require(peer.as_ref(), RPC, "identity", caller.id.as_str())?;
        if req.ca_certificate.len() > MAX_CA_PEM {
            return Err(Error::invalid(
                "ca_certificate",
                format!("is longer than {MAX_CA_PEM} bytes"),
            )
            .into());
        }
        let changed = self
            .core
            .update_peer_ca(&caller, &req.ca_certificate)
            .await?;
        Ok(Response::new(pb::UpdatePeerCaResponse { changed }))
    }

    async fn announce_ca(
        &self,
        _request: Request<pb::AnnounceCaRequest>,
    ) -> Result<Response<pb::AnnounceCaResponse>, Status> {
        let (ca_sha256, answers) = self.core.announce_ca().await?;
        let peers = answers
            .into_iter()
            .map(|(peer, answer)| pb::CaAnnouncement {
                peer: Some(identity_to_pb(&peer)),
                pinned: answer.is_ok(),
                error: answer.err().map(|e| e.to_string()).unwrap_or_default(),
            })
            .collect();
        Ok(Response::new(pb::AnnounceCaResponse { ca_sha256, peers }))
    }

    async fn get_observed_endpoints(
        &self,
        request: Request<pb::GetObservedEndpointsRequest>,
    ) -> Result<Response<pb::GetObservedEndpointsResponse>, Status> {
        const RPC: &str = "GetObservedEndpoints";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let requester = identity_from_pb("requester", req.requester.as_ref())?;
        self.authz
            .require(peer.as_ref(), RPC, "requester", requester.id.as_str())?;
        if req.cluster_ids.len() > MAX_OBSERVED {
            return Err(Error::invalid(
                "cluster_ids",
                format!("{} IDs, at most {MAX_OBSERVED}", req.cluster_ids.len()),
            )
            .into());
        }
        let ids = req
            .cluster_ids
            .iter()
            .enumerate()
            .map(|(i, id)| ClusterId::parse(&format!("cluster_ids[{i}]"), id))
            .collect::<Result<Vec<_>>>()?;
        let observed = self.core.observed_for(&requester, &ids).await?;
        Ok(Response::new(pb::GetObservedEndpointsResponse {
            observed: observed
                .into_iter()
                .map(|(id, seen)| pb::ObservedEndpoint {
                    cluster_id: id.to_string(),
                    endpoint: seen.endpoint.to_string(),
                    last_handshake_time: Some(prost_types::Timestamp::from(seen.last_handshake)),
                })
                .collect(),
        }))
    }

    async fn list_network_configs(
        &self,
        request: Request<pb::ListNetworkConfigsRequest>,
    ) -> Result<Response<pb::ListNetworkConfigsResponse>, Status> {
        let filter = request.into_inner().cluster_id;
        let filter = (!filter.is_empty())
            .then(|| ClusterId::parse("cluster_id", &filter))
            .transpose()?;
        let (outs, ins) = self.core.network_configs().await?;
        let us = self.core.identity();
        let mut list: Vec<types::NetworkConfig> = outs
            .iter()
            .map(|o| types::NetworkConfig {
                name: nc_name(&us.id, &o.remote.id),
                origin: Some(identity_to_pb(us)),
                destination: Some(identity_to_pb(&o.remote)),
                via: o.via.as_ref().map(identity_to_pb),
                spec: Some(o.spec.to_proto()),
                status: o.decision.as_ref().map(|d| types::NetworkConfigStatus {
                    receiver_generation: o.receiver_generation,
                    ..status_of(d)
                }),
                generation: o.generation,
                update_time: None,
                held_generation: 0,
            })
            .chain(ins.iter().map(|i| types::NetworkConfig {
                name: nc_name(&i.remote.id, &us.id),
                origin: Some(identity_to_pb(&i.remote)),
                destination: Some(identity_to_pb(us)),
                via: i.via.as_ref().map(identity_to_pb),
                spec: Some(i.spec.to_proto()),
                status: Some(status_of(&i.decision)),
                generation: i.generation,
                update_time: None,
                held_generation: 0,
            }))
            .filter(|nc| {
                filter.as_ref().is_none_or(|f| {
                    [&nc.origin, &nc.destination]
                        .iter()
                        .any(|c| c.as_ref().is_some_and(|c| c.cluster_id == f.as_str()))
                })
            })
            .collect();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(pb::ListNetworkConfigsResponse {
            network_configs: list,
        }))
    }

    async fn list_tunnel_endpoints(
        &self,
        request: Request<pb::ListTunnelEndpointsRequest>,
    ) -> Result<Response<pb::ListTunnelEndpointsResponse>, Status> {
        let req = request.into_inner();
        let filter = (!req.cluster_id.is_empty())
            .then(|| ClusterId::parse("cluster_id", &req.cluster_id))
            .transpose()?;
        let kind = match types::PeeringKind::try_from(req.kind) {
            Ok(types::PeeringKind::Unspecified) => None,
            Ok(types::PeeringKind::Full) => Some(PeeringKind::Full),
            Ok(types::PeeringKind::Induced) => Some(PeeringKind::Induced),
            Err(_) => return Err(Error::invalid("kind", "is not a known peering kind").into()),
        };
        let (tunnels, revision) = self.core.tunnels().await?;
        let tunnel_endpoints = tunnels
            .iter()
            .filter(|(t, _)| {
                filter.as_ref().is_none_or(|f| t.remote.id == *f)
                    && kind.is_none_or(|k| t.kind == k)
            })
            .map(|(t, r)| t.to_proto(*r))
            .collect();
        Ok(Response::new(pb::ListTunnelEndpointsResponse {
            tunnel_endpoints,
            revision,
        }))
    }

    type WatchTunnelEndpointsStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::WatchTunnelEndpointsResponse, Status>>;

    async fn watch_tunnel_endpoints(
        &self,
        request: Request<pb::WatchTunnelEndpointsRequest>,
    ) -> Result<Response<Self::WatchTunnelEndpointsStream>, Status> {
        let start = request.into_inner().start_revision;
        if start < 0 {
            return Err(Error::invalid("start_revision", "must not be negative").into());
        }
        Ok(Response::new(watch::watch(self.core.clone(), start)))
    }
}
