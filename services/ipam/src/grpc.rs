//! The `trellis.ipam.v1.Ipam` gRPC handlers: validate the request into domain values (errors
//! name the field), call [`Ipam`], map the answer back. Nothing else happens here.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use tonic::{Request, Response, Status};
use trellis_api::pb::ipam::ipam_server::Ipam as IpamApi;
use trellis_api::pb::ipam::{
    self as pb, MappingPath as PbPath, get_subnets_per_cluster_result as subnets_result,
    set_local_nat_result as local_nat_result,
};
use trellis_api::{ClusterId, ClusterIdentity, wire};
use trellis_error::{Error, Result};
use trellis_runtime::batch;
use trellis_runtime::peer::{Authz, PeerMethods};

use crate::core::{Ipam, MappingPath};
use crate::records::ClusterRecord;

/// The gRPC face of one [`Ipam`].
#[derive(Debug, Clone)]
pub struct IpamService {
    core: Arc<Ipam>,
    authz: Authz,
}

/// The methods the peer listener serves (ADR 0014): the queries a full peer's endpoints service
/// makes on the induced path. Everything else stays intra-cluster.
pub const PEER_METHODS: PeerMethods = PeerMethods {
    authenticated: &[
        "/trellis.ipam.v1.Ipam/DoesClusterMappingExist",
        "/trellis.ipam.v1.Ipam/MapEndpointIp",
    ],
    anonymous: &[],
};

impl IpamService {
    /// Without mutual TLS: every caller is trusted.
    pub fn new(core: Arc<Ipam>) -> Self {
        Self::with_authz(core, Authz::off())
    }

    /// With `authz`: on the peer listener only verified full peers, and only induced mappings.
    pub fn with_authz(core: Arc<Ipam>, authz: Authz) -> Self {
        Self { core, authz }
    }

    fn cidr(&self, field: &str, value: &str) -> Result<IpNet> {
        wire::require_family_net(field, wire::cidr(field, value)?, self.core.family())
    }

    fn ip(&self, value: &str) -> Result<IpAddr> {
        wire::require_family_ip("ip", wire::ip("ip", value)?, self.core.family())
    }

    /// One GetSubnetsPerCluster, alone or as an item of a batch.
    async fn subnets_one(
        &self,
        req: pb::GetSubnetsPerClusterRequest,
    ) -> Result<pb::GetSubnetsPerClusterResponse> {
        let cluster = cluster(&req.cluster_id, &req.cluster_name)?;
        let pod = self.cidr("pod_cidr", &req.pod_cidr)?;
        let external = self.cidr("external_cidr", &req.external_cidr)?;
        let view = self.core.subnets_for(&cluster, pod, external).await?;
        Ok(pb::GetSubnetsPerClusterResponse {
            pod_cidr_nat: view.pod_cidr_nat.to_string(),
            external_cidr_nat: view.external_cidr_nat.to_string(),
        })
    }

    /// One SetLocalNat, alone or as an item of a batch.
    async fn local_nat_one(&self, req: pb::SetLocalNatRequest) -> Result<pb::SetLocalNatResponse> {
        let cluster = cluster(&req.cluster_id, &req.cluster_name)?;
        let pod = self.cidr("pod_cidr", &req.pod_cidr)?;
        let external = self.cidr("external_cidr", &req.external_cidr)?;
        self.core.set_local_nat(&cluster, pod, external).await?;
        Ok(pb::SetLocalNatResponse {})
    }
}

fn cluster_id(value: &str) -> Result<ClusterId> {
    ClusterId::parse("cluster_id", value)
}

fn cluster(id: &str, name: &str) -> Result<ClusterIdentity> {
    ClusterIdentity::parse("cluster_id", id, "cluster_name", name)
}

fn text<T: ToString>(value: Option<T>) -> String {
    value.map(|v| v.to_string()).unwrap_or_default()
}

fn cluster_subnets(rec: ClusterRecord) -> pb::ClusterSubnets {
    pb::ClusterSubnets {
        cluster_id: rec.id.to_string(),
        cluster_name: rec.name,
        remote_pod_cidr: text(rec.remote.map(|v| v.pod_cidr)),
        remote_pod_cidr_nat: text(rec.remote.map(|v| v.pod_cidr_nat)),
        remote_external_cidr: text(rec.remote.map(|v| v.external_cidr)),
        remote_external_cidr_nat: text(rec.remote.map(|v| v.external_cidr_nat)),
        local_pod_cidr_nat: text(rec.local_nat.map(|n| n.pod_cidr)),
        local_external_cidr_nat: text(rec.local_nat.map(|n| n.external_cidr)),
    }
}

#[tonic::async_trait]
impl IpamApi for IpamService {
    async fn get_subnets_per_cluster(
        &self,
        request: Request<pb::GetSubnetsPerClusterRequest>,
    ) -> Result<Response<pb::GetSubnetsPerClusterResponse>, Status> {
        Ok(Response::new(self.subnets_one(request.into_inner()).await?))
    }

    async fn set_local_nat(
        &self,
        request: Request<pb::SetLocalNatRequest>,
    ) -> Result<Response<pb::SetLocalNatResponse>, Status> {
        Ok(Response::new(
            self.local_nat_one(request.into_inner()).await?,
        ))
    }

    async fn get_subnets_per_cluster_batch(
        &self,
        request: Request<pb::GetSubnetsPerClusterBatchRequest>,
    ) -> Result<Response<pb::GetSubnetsPerClusterBatchResponse>, Status> {
        let results = batch::serve_packed(
            request.into_inner().requests,
            |item| self.subnets_one(item),
            |r| pb::GetSubnetsPerClusterResult {
                result: Some(r.map_or_else(
                    subnets_result::Result::Error,
                    subnets_result::Result::Response,
                )),
            },
        )
        .await?;
        Ok(Response::new(pb::GetSubnetsPerClusterBatchResponse {
            results,
        }))
    }

    async fn set_local_nat_batch(
        &self,
        request: Request<pb::SetLocalNatBatchRequest>,
    ) -> Result<Response<pb::SetLocalNatBatchResponse>, Status> {
        let results = batch::serve_packed(
            request.into_inner().requests,
            |item| self.local_nat_one(item),
            |r| pb::SetLocalNatResult {
                result: Some(r.map_or_else(
                    local_nat_result::Result::Error,
                    local_nat_result::Result::Response,
                )),
            },
        )
        .await?;
        Ok(Response::new(pb::SetLocalNatBatchResponse { results }))
    }

    async fn free_subnets_per_cluster(
        &self,
        request: Request<pb::FreeSubnetsPerClusterRequest>,
    ) -> Result<Response<pb::FreeSubnetsPerClusterResponse>, Status> {
        let id = cluster_id(&request.into_inner().cluster_id)?;
        let existed = self.core.free(&id).await?;
        Ok(Response::new(pb::FreeSubnetsPerClusterResponse { existed }))
    }

    async fn map_endpoint_ip(
        &self,
        request: Request<pb::MapEndpointIpRequest>,
    ) -> Result<Response<pb::MapEndpointIpResponse>, Status> {
        const RPC: &str = "MapEndpointIp";
        let peer = self.authz.peer_or_local(&request, RPC)?;
        let req = request.into_inner();
        let id = cluster_id(&req.cluster_id)?;
        let ip = self.ip(&req.ip)?;
        if let Some(peer) = &peer
            && !req.induced
        {
            // A non-induced mapping allocates from our external CIDR (the hub path): only our
            // own endpoints service decides that.
            tracing::warn!(caller = %peer.cluster_id, rpc = RPC, "refused: another cluster asked for a non-induced mapping");
            return Err(Error::PermissionDenied(format!(
                "{RPC}: cluster {} may only ask for induced mappings (induced = true)",
                peer.cluster_id
            ))
            .into());
        }
        let mapped = self.core.map_endpoint_ip(&id, ip, req.induced).await?;
        let path = match mapped.path {
            MappingPath::LocalNat => PbPath::LocalNat,
            MappingPath::Home => PbPath::Home,
            MappingPath::External => PbPath::External,
        };
        Ok(Response::new(pb::MapEndpointIpResponse {
            ip: mapped.ip.to_string(),
            path: path.into(),
        }))
    }

    async fn unmap_endpoint_ip(
        &self,
        request: Request<pb::UnmapEndpointIpRequest>,
    ) -> Result<Response<pb::UnmapEndpointIpResponse>, Status> {
        let req = request.into_inner();
        let id = cluster_id(&req.cluster_id)?;
        let ip = self.ip(&req.ip)?;
        let released = self.core.unmap_endpoint_ip(&id, ip).await?;
        Ok(Response::new(pb::UnmapEndpointIpResponse { released }))
    }

    async fn get_home_pod_ip(
        &self,
        request: Request<pb::GetHomePodIpRequest>,
    ) -> Result<Response<pb::GetHomePodIpResponse>, Status> {
        let req = request.into_inner();
        let id = cluster_id(&req.cluster_id)?;
        let ip = self.ip(&req.ip)?;
        let home = self.core.home_pod_ip(&id, ip).await?;
        Ok(Response::new(pb::GetHomePodIpResponse {
            home_ip: home.to_string(),
        }))
    }

    async fn get_cluster_identity(
        &self,
        request: Request<pb::GetClusterIdentityRequest>,
    ) -> Result<Response<pb::GetClusterIdentityResponse>, Status> {
        let ip = self.ip(&request.into_inner().ip)?;
        let found = self.core.cluster_identity(ip).await?;
        Ok(Response::new(pb::GetClusterIdentityResponse {
            cluster_id: text(found.as_ref().map(|c| &c.id)),
            cluster_name: found.map(|c| c.name).unwrap_or_default(),
        }))
    }

    async fn does_cluster_mapping_exist(
        &self,
        request: Request<pb::DoesClusterMappingExistRequest>,
    ) -> Result<Response<pb::DoesClusterMappingExistResponse>, Status> {
        self.authz
            .peer_or_local(&request, "DoesClusterMappingExist")?;
        let id = cluster_id(&request.into_inner().cluster_id)?;
        let exists = self.core.mapping_exists(&id).await?;
        Ok(Response::new(pb::DoesClusterMappingExistResponse {
            exists,
        }))
    }

    async fn list_cluster_subnets(
        &self,
        _request: Request<pb::ListClusterSubnetsRequest>,
    ) -> Result<Response<pb::ListClusterSubnetsResponse>, Status> {
        let clusters = self.core.list_clusters().await?;
        Ok(Response::new(pb::ListClusterSubnetsResponse {
            clusters: clusters.into_iter().map(cluster_subnets).collect(),
        }))
    }

    async fn get_local_subnets(
        &self,
        _request: Request<pb::GetLocalSubnetsRequest>,
    ) -> Result<Response<pb::GetLocalSubnetsResponse>, Status> {
        let local = self.core.local();
        Ok(Response::new(pb::GetLocalSubnetsResponse {
            pod_cidr: local.ranges.pod_cidr.to_string(),
            service_cidr: text(local.ranges.service_cidr),
            external_cidr: local.ranges.external_cidr.to_string(),
            pools: local.pools.iter().map(ToString::to_string).collect(),
            reserved: local.reserved.iter().map(ToString::to_string).collect(),
        }))
    }

    async fn list_endpoint_mappings(
        &self,
        _request: Request<pb::ListEndpointMappingsRequest>,
    ) -> Result<Response<pb::ListEndpointMappingsResponse>, Status> {
        let mappings = self.core.list_endpoint_mappings().await?;
        Ok(Response::new(pb::ListEndpointMappingsResponse {
            mappings: mappings
                .into_iter()
                .map(|m| pb::EndpointMapping {
                    ip: m.ip.to_string(),
                    external_ip: m.external_ip.to_string(),
                    cluster_ids: m.clusters.into_iter().map(String::from).collect(),
                })
                .collect(),
        }))
    }
}

/// The gRPC routes of the IPAM service.
pub fn routes(core: Arc<Ipam>, authz: Authz) -> tonic::service::Routes {
    tonic::service::Routes::new(
        trellis_api::pb::ipam::ipam_server::IpamServer::new(IpamService::with_authz(core, authz))
            .max_decoding_message_size(crate::MAX_REQUEST_BYTES),
    )
}
