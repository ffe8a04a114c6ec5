//! The port to this cluster's discovery: the ForeignCluster records (the shared resource
//! model, handed over as discovery stores them) and this cluster's identity.

use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::{
    GetForeignClusterRequest, GetIdentityRequest, ListForeignClustersRequest,
};
use trellis_api::pb::types::ForeignCluster;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::Result;
use trellis_runtime::client::TracedChannel;

use super::{Clients, local_error};

impl Clients {
    fn discovery(&self) -> DiscoveryClient<TracedChannel> {
        DiscoveryClient::new(self.discovery.clone())
    }

    /// The ForeignCluster record of `id`, or `None` when discovery does not know it.
    pub async fn foreign_cluster(&self, id: &ClusterId) -> Result<Option<ForeignCluster>> {
        match self
            .discovery()
            .get_foreign_cluster(GetForeignClusterRequest {
                cluster_id: id.to_string(),
            })
            .await
        {
            Ok(response) => Ok(response.into_inner().foreign_cluster),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(local_error("discovery", status)),
        }
    }

    /// Every ForeignCluster record discovery holds.
    pub async fn foreign_clusters(&self) -> Result<Vec<ForeignCluster>> {
        Ok(self
            .discovery()
            .list_foreign_clusters(ListForeignClustersRequest::default())
            .await
            .map_err(|s| local_error("discovery", s))?
            .into_inner()
            .foreign_clusters)
    }

    /// This cluster's identity, from discovery.
    pub async fn local_identity(&self) -> Result<ClusterIdentity> {
        let response = self
            .discovery()
            .get_identity(GetIdentityRequest {})
            .await
            .map_err(|s| local_error("discovery", s))?
            .into_inner();
        trellis_api::convert::identity_from_pb("identity", response.identity.as_ref())
    }
}
