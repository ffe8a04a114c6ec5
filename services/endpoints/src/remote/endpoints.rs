//! The port to other clusters' endpoints services: a reflected slice delivered to its target,
//! or withdrawn from it. Channels are cached per (cluster, address) and bounded by the
//! delivery timeouts; an unreachable target is told apart from one that refused, since only
//! the first is worth trying again unchanged.

use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::endpoints::{ApplyReflectedSliceRequest, DeleteReflectedSliceRequest};
use trellis_api::{ClusterId, ClusterIdentity, convert};
use trellis_error::{Error, Result};
use trellis_runtime::client::TracedChannel;
use trellis_runtime::tls::cluster_channel;

use super::Clients;
use crate::core::reflected::Applied;
use crate::model::Slice;

impl Clients {
    /// Delivers `slice`, reflected by `source` at `generation`, to the endpoints service of
    /// cluster `target` at `address`.
    pub async fn apply_reflected_slice(
        &self,
        target: &ClusterId,
        address: &str,
        source: &ClusterIdentity,
        slice: &Slice,
        generation: i64,
    ) -> Result<Applied> {
        let answer = self
            .remote_endpoints(target, address)?
            .apply_reflected_slice(ApplyReflectedSliceRequest {
                source: Some(convert::identity_to_pb(source)),
                slice: Some(slice.to_pb()),
                generation,
            })
            .await
            .map_err(|s| match s.code() {
                tonic::Code::Unavailable
                | tonic::Code::Cancelled
                | tonic::Code::DeadlineExceeded => remote_error(target, s),
                _ => Error::from(s).context(format!("cluster {target} refused the slice")),
            })?
            .into_inner();
        Ok(Applied {
            applied: answer.applied,
            // A target that does not say holds at least what it refused.
            held: answer.held_generation.max(generation),
            object_name: Some(answer.object_name).filter(|n| !n.is_empty()),
        })
    }

    /// Withdraws slice `namespace/name`, reflected by `source`, from the endpoints service of
    /// cluster `target` at `address`.
    pub async fn delete_reflected_slice(
        &self,
        target: &ClusterId,
        address: &str,
        source: &ClusterIdentity,
        namespace: &str,
        name: &str,
    ) -> Result<()> {
        self.remote_endpoints(target, address)?
            .delete_reflected_slice(DeleteReflectedSliceRequest {
                source: Some(convert::identity_to_pb(source)),
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })
            .await
            .map_err(|s| remote_error(target, s))?;
        Ok(())
    }

    /// The endpoints service of cluster `id`, at `address`.
    fn remote_endpoints(
        &self,
        id: &ClusterId,
        address: &str,
    ) -> Result<EndpointMapperClient<TracedChannel>> {
        let key = (id.clone(), address.to_owned());
        if let Ok(cache) = self.remote_endpoints.lock()
            && let Some(found) = cache.get(&key)
        {
            return Ok(EndpointMapperClient::new(found.clone()));
        }
        let created = cluster_channel(
            self.tls.as_ref(),
            "addresses.endpoints",
            address,
            id.as_str(),
            self.deliver_timeouts,
            &self.metrics,
        )?;
        if let Ok(mut cache) = self.remote_endpoints.lock() {
            cache.insert(key, created.clone());
        }
        Ok(EndpointMapperClient::new(created))
    }
}

/// A failure of another cluster's endpoints service.
fn remote_error(target: &ClusterId, status: tonic::Status) -> Error {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => {
            Error::Unavailable(format!(
                "endpoints service of cluster {target} unreachable: {}",
                status.message()
            ))
        }
        _ => Error::from(status).context(format!("cluster {target}")),
    }
}
