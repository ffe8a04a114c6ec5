//! The port to the local IPAM: the ranges this cluster uses, the mappings of remote clusters'
//! ranges into ours (our decision on a NetworkConfig we receive), and how each remote
//! addresses us (its decision on ours).
//!
//! The two calls made once per remote, mapping its ranges and recording how it addresses us,
//! go through batchers: a broker receiving a hub's batch of NetworkConfigs, or hearing the
//! decisions of many induced peers, asks in a few calls instead of one per remote (they were
//! most of a leaf's calls in a 254-leaf mesh).

use std::collections::BTreeSet;

use trellis_api::model::{NatView, NetworkSpec};
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{
    FreeSubnetsPerClusterRequest, GetLocalSubnetsRequest, GetSubnetsPerClusterBatchRequest,
    GetSubnetsPerClusterRequest, GetSubnetsPerClusterResponse, ListClusterSubnetsRequest,
    SetLocalNatBatchRequest, SetLocalNatRequest, SetLocalNatResponse,
    get_subnets_per_cluster_result, set_local_nat_result,
};
use trellis_api::pb::types::NetworkConfigStatus;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::batch::{self, Batcher};
use trellis_runtime::client::TracedChannel;

/// The ranges this cluster uses, as the IPAM spells them (they go into our NetworkConfigs as
/// they are).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalSubnets {
    pub pod_cidr: String,
    pub external_cidr: String,
}

/// The IPAM's answer when asked to map a remote's ranges into ours. The refusals it gives in
/// the normal course of things are answers, not errors: the receiver decides on them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mapping {
    /// How we address the remote's ranges.
    Mapped(NatView),
    /// The IPAM holds a mapping for other ranges of this remote: free it first.
    RangesChanged(String),
    /// No free range to map into (until another peering frees one).
    Exhausted(String),
    /// The remote's ranges themselves are unusable.
    Refused(String),
}

/// The local IPAM.
#[derive(Debug)]
pub struct Ipam {
    channel: TracedChannel,
    mapper: Batcher<GetSubnetsPerClusterRequest, GetSubnetsPerClusterResponse>,
    nat: Batcher<SetLocalNatRequest, SetLocalNatResponse>,
}

impl Ipam {
    pub(super) fn new(channel: TracedChannel) -> Self {
        let mapper = batch::unspaced_over(
            IpamClient::new(channel.clone()),
            |mut client, request| {
                Box::pin(
                    async move { Ok(client.get_subnets_per_cluster(request).await?.into_inner()) },
                )
            },
            |mut client, requests| {
                Box::pin(async move {
                    let batch = GetSubnetsPerClusterBatchRequest { requests };
                    Ok(client
                        .get_subnets_per_cluster_batch(batch)
                        .await?
                        .into_inner()
                        .results)
                })
            },
            |r| match r.result? {
                get_subnets_per_cluster_result::Result::Response(response) => Some(Ok(response)),
                get_subnets_per_cluster_result::Result::Error(error) => Some(Err(error)),
            },
        );
        let nat = batch::unspaced_over(
            IpamClient::new(channel.clone()),
            |mut client, request| {
                Box::pin(async move { Ok(client.set_local_nat(request).await?.into_inner()) })
            },
            |mut client, requests| {
                Box::pin(async move {
                    let batch = SetLocalNatBatchRequest { requests };
                    Ok(client
                        .set_local_nat_batch(batch)
                        .await?
                        .into_inner()
                        .results)
                })
            },
            |r| match r.result? {
                set_local_nat_result::Result::Response(response) => Some(Ok(response)),
                set_local_nat_result::Result::Error(error) => Some(Err(error)),
            },
        );
        Self {
            channel,
            mapper,
            nat,
        }
    }

    fn client(&self) -> IpamClient<TracedChannel> {
        IpamClient::new(self.channel.clone())
    }

    /// The ranges this cluster uses.
    pub async fn local_subnets(&self) -> Result<LocalSubnets> {
        let answer = self
            .client()
            .get_local_subnets(GetLocalSubnetsRequest {})
            .await
            .map_err(|s| Error::from(s).context("reading the local subnets"))?
            .into_inner();
        Ok(LocalSubnets {
            pod_cidr: answer.pod_cidr,
            external_cidr: answer.external_cidr,
        })
    }

    /// Maps `remote`'s ranges in `spec` into ours (idempotent for the same ranges).
    pub async fn map_remote(
        &self,
        remote: &ClusterIdentity,
        spec: &NetworkSpec,
    ) -> Result<Mapping> {
        let request = GetSubnetsPerClusterRequest {
            cluster_id: remote.id.to_string(),
            cluster_name: remote.name.clone(),
            pod_cidr: spec.pod_cidr.to_string(),
            external_cidr: spec.external_cidr.to_string(),
        };
        match self.mapper.call(request).await {
            Ok(answer) => {
                let status = NetworkConfigStatus {
                    pod_cidr_nat: answer.pod_cidr_nat,
                    external_cidr_nat: answer.external_cidr_nat,
                    ..Default::default()
                };
                let view = NatView::for_spec("ipam", spec, &status).map_err(|e| {
                    Error::Internal(format!("the IPAM answered an unusable mapping: {e}"))
                })?;
                Ok(Mapping::Mapped(view))
            }
            Err(status) => {
                let message = status.message().to_owned();
                match status.code() {
                    tonic::Code::FailedPrecondition => Ok(Mapping::RangesChanged(message)),
                    tonic::Code::ResourceExhausted => Ok(Mapping::Exhausted(message)),
                    tonic::Code::InvalidArgument => Ok(Mapping::Refused(message)),
                    _ => {
                        Err(Error::from(status).context("asking the IPAM for the remote's mapping"))
                    }
                }
            }
        }
    }

    /// Frees the mapping of `remote`'s ranges; whether there was one.
    pub async fn free_mapping(&self, remote: &ClusterId) -> Result<bool> {
        let answer = self
            .client()
            .free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
                cluster_id: remote.to_string(),
            })
            .await?;
        Ok(answer.into_inner().existed)
    }

    /// The remote clusters the IPAM holds a mapping for (IDs it spells wrongly left out).
    pub async fn mapped(&self) -> Result<BTreeSet<ClusterId>> {
        let listing = self
            .client()
            .list_cluster_subnets(ListClusterSubnetsRequest {})
            .await
            .map_err(|s| Error::from(s).context("listing the IPAM's mappings"))?
            .into_inner();
        Ok(listing
            .clusters
            .iter()
            .filter_map(|c| ClusterId::parse("cluster_id", &c.cluster_id).ok())
            .collect())
    }

    /// Records how the remote `id` (named `name`) addresses our ranges.
    pub async fn set_local_nat(&self, id: &ClusterId, name: &str, view: &NatView) -> Result<()> {
        self.nat
            .call(SetLocalNatRequest {
                cluster_id: id.to_string(),
                cluster_name: name.to_owned(),
                pod_cidr: view.pod_cidr_nat.to_string(),
                external_cidr: view.external_cidr_nat.to_string(),
            })
            .await
            .map_err(|s| Error::from(s).context("recording how the remote addresses us"))?;
        Ok(())
    }
}
