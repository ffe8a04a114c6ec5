//! The `trellis.discovery.v1.Discovery` gRPC handlers: validate the request into domain values
//! (errors name the field), call [`Discovery`], map the answer back. Nothing else happens here.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use trellis_api::ClusterId;
use trellis_api::pb::discovery::discovery_server::Discovery as DiscoveryApi;
use trellis_api::pb::discovery::{self as pb};
use trellis_api::pb::types::WatchEventType;
use trellis_error::{Error, Result};

use crate::convert::{
    addresses_from_pb, addresses_to_pb, foreign_cluster_to_pb, identity_from_pb, identity_to_pb,
    kind_filter, neighbors_from_pb,
};
use crate::core::{Discovery, PeeringUpdate, ReceivedNeighborhood};
use crate::records::Mechanism;
use crate::remote;
use crate::watch::{self, EventType, WatchError};
use trellis_api::address;
use trellis_runtime::peer::{Authz, PeerMethods};

/// Largest pinned CA certificate accepted (PEM): a P-256 CA is under 1 KiB.
const MAX_CA_CERTIFICATE_BYTES: usize = 16 * 1024;

/// The gRPC face of one [`Discovery`].
#[derive(Debug, Clone)]
pub struct DiscoveryService {
    core: Arc<Discovery>,
    bookmark_every: Duration,
    authz: Authz,
}

/// The methods the peer listener serves (ADR 0014): GetIdentity to anyone (manual discovery
/// happens before peering), Neighborhoods to verified peers.
pub const PEER_METHODS: PeerMethods = PeerMethods {
    authenticated: &["/trellis.discovery.v1.Discovery/PublishNeighborhood"],
    anonymous: &["/trellis.discovery.v1.Discovery/GetIdentity"],
};

impl DiscoveryService {
    /// `bookmark_every`: how long a watch may stay silent before it reports progress. Without
    /// mutual TLS: the sender a Neighborhood claims is trusted.
    pub fn new(core: Arc<Discovery>, bookmark_every: Duration) -> Self {
        Self::with_authz(core, bookmark_every, Authz::off())
    }

    /// With `authz` checking the caller's certificate against the Neighborhood's sender.
    pub fn with_authz(core: Arc<Discovery>, bookmark_every: Duration, authz: Authz) -> Self {
        Self {
            core,
            bookmark_every,
            authz,
        }
    }
}

fn cluster_id(value: &str) -> Result<ClusterId> {
    ClusterId::parse("cluster_id", value)
}

type WatchStream =
    Pin<Box<dyn Stream<Item = Result<pb::WatchForeignClustersResponse, Status>> + Send>>;

fn watch_status(err: WatchError) -> Status {
    match err {
        WatchError::Compacted(msg) => Error::OutOfRange(format!(
            "{msg}; restart with start_revision = 0 (or list, then watch from its revision + 1)"
        ))
        .into(),
        WatchError::Failed(err) => err.into(),
    }
}

#[tonic::async_trait]
impl DiscoveryApi for DiscoveryService {
    async fn get_identity(
        &self,
        _request: Request<pb::GetIdentityRequest>,
    ) -> Result<Response<pb::GetIdentityResponse>, Status> {
        Ok(Response::new(pb::GetIdentityResponse {
            identity: Some(identity_to_pb(self.core.identity())),
            addresses: Some(addresses_to_pb(self.core.advertised())),
            // The service starts without TLS only when plaintext was asked for.
            plaintext_peering: self.core.tls().is_none(),
        }))
    }

    async fn add_foreign_cluster(
        &self,
        request: Request<pb::AddForeignClusterRequest>,
    ) -> Result<Response<pb::AddForeignClusterResponse>, Status> {
        let req = request.into_inner();
        let addr = address::required("discovery_address", &req.discovery_address)?;
        let expected = if req.expected_cluster_id.is_empty() {
            None
        } else {
            Some(ClusterId::parse(
                "expected_cluster_id",
                &req.expected_cluster_id,
            )?)
        };
        let (identity, addresses) = remote::get_identity(
            self.core.tls(),
            self.core.metrics(),
            "discovery_address",
            &addr,
        )
        .await?;
        if let Some(expected) = expected
            && expected != identity.id
        {
            return Err(Error::FailedPrecondition(format!(
                "the discovery service at {addr} belongs to cluster {:?}, not the expected {:?}",
                identity.id.as_str(),
                expected.as_str()
            ))
            .into());
        }
        let (record, revision) = self
            .core
            .discovered(&identity, &addresses, Mechanism::Manual, &addr)
            .await?;
        Ok(Response::new(pb::AddForeignClusterResponse {
            foreign_cluster: Some(foreign_cluster_to_pb(&record, revision)),
        }))
    }

    async fn remove_foreign_cluster(
        &self,
        request: Request<pb::RemoveForeignClusterRequest>,
    ) -> Result<Response<pb::RemoveForeignClusterResponse>, Status> {
        let id = cluster_id(&request.into_inner().cluster_id)?;
        let removed = self.core.remove(&id).await?;
        Ok(Response::new(pb::RemoveForeignClusterResponse { removed }))
    }

    async fn get_foreign_cluster(
        &self,
        request: Request<pb::GetForeignClusterRequest>,
    ) -> Result<Response<pb::GetForeignClusterResponse>, Status> {
        let id = cluster_id(&request.into_inner().cluster_id)?;
        let (record, revision) = self.core.get(&id).await?;
        Ok(Response::new(pb::GetForeignClusterResponse {
            foreign_cluster: Some(foreign_cluster_to_pb(&record, revision)),
        }))
    }

    async fn list_foreign_clusters(
        &self,
        request: Request<pb::ListForeignClustersRequest>,
    ) -> Result<Response<pb::ListForeignClustersResponse>, Status> {
        let kind = kind_filter("kind", request.into_inner().kind)?;
        let (records, revision) = self.core.list(kind).await?;
        Ok(Response::new(pb::ListForeignClustersResponse {
            foreign_clusters: records
                .iter()
                .map(|(r, rev)| foreign_cluster_to_pb(r, *rev))
                .collect(),
            revision,
        }))
    }

    type WatchForeignClustersStream = WatchStream;

    async fn watch_foreign_clusters(
        &self,
        request: Request<pb::WatchForeignClustersRequest>,
    ) -> Result<Response<Self::WatchForeignClustersStream>, Status> {
        let req = request.into_inner();
        let kind = kind_filter("kind", req.kind)?;
        if req.start_revision < 0 {
            return Err(Error::invalid("start_revision", "must not be negative").into());
        }
        let events = watch::watch(
            self.core.clone(),
            req.start_revision,
            kind,
            self.bookmark_every,
        )
        .await
        .map_err(watch_status)?;
        let stream = ReceiverStream::new(events).map(|item| {
            let event = item.map_err(watch_status)?;
            let kind = match event.kind {
                EventType::Added => WatchEventType::Added,
                EventType::Modified => WatchEventType::Modified,
                EventType::Deleted => WatchEventType::Deleted,
                EventType::Bookmark => WatchEventType::Bookmark,
            };
            Ok(pb::WatchForeignClustersResponse {
                r#type: kind.into(),
                foreign_cluster: event
                    .record
                    .as_ref()
                    .map(|(r, rev)| foreign_cluster_to_pb(r, *rev)),
                revision: event.revision,
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn publish_neighborhood(
        &self,
        request: Request<pb::PublishNeighborhoodRequest>,
    ) -> Result<Response<pb::PublishNeighborhoodResponse>, Status> {
        const RPC: &str = "PublishNeighborhood";
        let peer = self.authz.peer(&request, RPC)?;
        let n = request
            .into_inner()
            .neighborhood
            .ok_or_else(|| Error::invalid("neighborhood", "is required"))?;
        let received = ReceivedNeighborhood {
            sender: identity_from_pb("neighborhood.sender", n.sender.as_ref())?,
            recipient: identity_from_pb("neighborhood.recipient", n.recipient.as_ref())?,
            neighbors: neighbors_from_pb(&n.neighbors)?,
            generation: n.generation,
        };
        // Only a hub speaks for its own Neighborhood.
        self.authz.require(
            peer.as_ref(),
            RPC,
            "neighborhood.sender",
            received.sender.id.as_str(),
        )?;
        let applied = self.core.receive_neighborhood(&received).await?;
        Ok(Response::new(pb::PublishNeighborhoodResponse {
            applied: applied.applied,
            current_generation: applied.current_generation,
        }))
    }

    async fn update_peering(
        &self,
        request: Request<pb::UpdatePeeringRequest>,
    ) -> Result<Response<pb::UpdatePeeringResponse>, Status> {
        let req = request.into_inner();
        if req.expected_revision < 0 {
            return Err(Error::invalid("expected_revision", "must not be negative").into());
        }
        if req.ca_certificate.len() > MAX_CA_CERTIFICATE_BYTES {
            return Err(Error::invalid(
                "ca_certificate",
                format!("is longer than {MAX_CA_CERTIFICATE_BYTES} bytes"),
            )
            .into());
        }
        let update = PeeringUpdate {
            identity: identity_from_pb("identity", req.identity.as_ref())?,
            peered: req.peered,
            addresses: if req.peered {
                addresses_from_pb("addresses", req.addresses.as_ref())?
            } else {
                Default::default()
            },
            outgoing: req.outgoing_peering_enabled,
            incoming: req.incoming_peering_enabled,
            networking: req.networking_enabled,
            reason: req.reason,
            message: req.message,
            expected_revision: req.expected_revision,
            ca_certificate: if req.peered {
                req.ca_certificate
            } else {
                String::new()
            },
        };
        let (record, revision) = self.core.update_peering(&update).await?;
        Ok(Response::new(pb::UpdatePeeringResponse {
            foreign_cluster: Some(foreign_cluster_to_pb(&record, revision)),
        }))
    }
}

/// The gRPC routes of the discovery service.
pub fn routes(
    core: Arc<Discovery>,
    bookmark_every: Duration,
    authz: Authz,
) -> tonic::service::Routes {
    tonic::service::Routes::new(
        trellis_api::pb::discovery::discovery_server::DiscoveryServer::new(
            DiscoveryService::with_authz(core, bookmark_every, authz),
        )
        .max_decoding_message_size(crate::MAX_REQUEST_BYTES),
    )
}
