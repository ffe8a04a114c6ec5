//! Calls to other clusters' discovery services: GetIdentity on an address just found, and
//! PublishNeighborhood to a full peer. Bounded by timeouts so a dead remote costs seconds. With
//! mutual TLS configured (ADR 0014) GetIdentity is a first contact (TLS, no client certificate,
//! nobody pinned yet) and PublishNeighborhood presents our certificate and verifies the peer's
//! against its pinned CA.

use std::time::Duration;

use trellis_api::ClusterIdentity;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::{GetIdentityRequest, PublishNeighborhoodRequest};
use trellis_api::pb::types as pb;
use trellis_error::{Error, Result};
use trellis_runtime::client::Timeouts;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::tls::{PeerTls, cluster_channel, first_contact_channel};

use crate::convert::{
    addresses_from_pb, identity_from_pb, identity_to_pb, neighbor_to_pb, timestamp,
};
use crate::core::Applied;
use crate::records::{Addresses, Neighbor, now_nanos};

/// Timeouts for remote discovery services: they answer from their store, so a few seconds is
/// plenty, and a sender must not stall on one dead peer.
pub const TIMEOUTS: Timeouts = Timeouts {
    connect: Duration::from_secs(2),
    request: Duration::from_secs(5),
};

/// Asks the discovery service at `address` who it is. A remote that answers nonsense is
/// FAILED_PRECONDITION (it is not a usable Trellis discovery service), not our caller's fault.
pub async fn get_identity(
    tls: Option<&PeerTls>,
    metrics: &Metrics,
    field: &str,
    address: &str,
) -> Result<(ClusterIdentity, Addresses)> {
    let mut client = DiscoveryClient::new(first_contact_channel(
        tls, field, address, TIMEOUTS, metrics,
    )?);
    let answer = client
        .get_identity(GetIdentityRequest {})
        .await
        .map_err(|status| Error::from(status).context(format!("GetIdentity on {address}")))?
        .into_inner();
    let bad = |e: Error| {
        Error::FailedPrecondition(format!(
            "the discovery service at {address} answered an unusable identity: {e}"
        ))
    };
    let identity = identity_from_pb("identity", answer.identity.as_ref()).map_err(bad)?;
    let addresses = addresses_from_pb("addresses", answer.addresses.as_ref()).map_err(bad)?;
    Ok((identity, addresses))
}

/// A Neighborhood to send.
#[derive(Debug, Clone)]
pub struct Outgoing {
    pub sender: ClusterIdentity,
    pub recipient: ClusterIdentity,
    pub neighbors: Vec<Neighbor>,
    pub generation: i64,
}

/// Sends a Neighborhood to the recipient's discovery service at `address`.
pub async fn publish_neighborhood(
    tls: Option<&PeerTls>,
    metrics: &Metrics,
    address: &str,
    n: &Outgoing,
) -> Result<Applied> {
    let mut client = DiscoveryClient::new(cluster_channel(
        tls,
        "discovery_address",
        address,
        n.recipient.id.as_str(),
        TIMEOUTS,
        metrics,
    )?);
    let request = PublishNeighborhoodRequest {
        neighborhood: Some(pb::Neighborhood {
            sender: Some(identity_to_pb(&n.sender)),
            recipient: Some(identity_to_pb(&n.recipient)),
            neighbors: n.neighbors.iter().map(neighbor_to_pb).collect(),
            generation: n.generation,
            create_time: Some(timestamp(now_nanos())),
        }),
    };
    let answer = client
        .publish_neighborhood(request)
        .await
        .map_err(Error::from)?
        .into_inner();
    Ok(Applied {
        applied: answer.applied,
        current_generation: answer.current_generation,
    })
}
