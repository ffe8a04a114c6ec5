//! Authorization of cluster-facing RPCs (ADR 0014):
//!
//! - [`PeerMethods`] and [`GateLayer`]: the peer listener serves only the cluster-facing methods
//!   of a service (plus health and reflection), and without a client certificate only those
//!   meant for first contact (the handshake, GetIdentity);
//! - [`Authz`]: what a handler asks — who is the verified caller, and is it the cluster the
//!   request speaks for;
//! - [`spawn_trust_sync`]: keeps a [`TrustStore`] equal to the CAs pinned in the local
//!   discovery service's full peers.

use std::time::Duration;

use tokio_stream::StreamExt as _;
use trellis_api::pb::discovery::WatchForeignClustersRequest;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::types as pb;
use trellis_api::peers::is_full_peer;
use trellis_error::{Error, Result};

use crate::admission::{AdmissionLayer, Check};
use crate::client::TracedChannel;
use crate::retry::RetryPolicy;
use crate::tls::{Caller, PeerIdentity, PinnedCa, TrustStore, caller, caller_of};

/// Which gRPC methods (full paths, `/package.Service/Method`) the peer listener serves.
#[derive(Debug, Clone, Copy)]
pub struct PeerMethods {
    /// Allowed to callers with a verified certificate.
    pub authenticated: &'static [&'static str],
    /// Allowed without a client certificate too (first contact).
    pub anonymous: &'static [&'static str],
}

/// Always served: health checks and reflection (so `grpcurl ... list` works with TLS flags).
fn always(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.Health/") || path.starts_with("/grpc.reflection.")
}

impl PeerMethods {
    /// Whether `caller` may call `path` on the peer listener; the refusal says why.
    pub fn allows(&self, caller: &Caller, path: &str) -> std::result::Result<(), String> {
        if always(path) || self.anonymous.contains(&path) {
            return Ok(());
        }
        if !self.authenticated.contains(&path) {
            return Err(format!(
                "{path} is not served to other clusters (intra-cluster only)"
            ));
        }
        match caller {
            Caller::Peer(_) | Caller::Plaintext => Ok(()),
            Caller::Anonymous => Err(format!(
                "{path} needs a client certificate of a peered cluster"
            )),
        }
    }
}

/// A tower layer enforcing [`PeerMethods`] before any handler runs.
pub type GateLayer = AdmissionLayer<PeerMethods>;

impl Check for PeerMethods {
    fn check<B>(&self, request: &http::Request<B>) -> std::result::Result<(), tonic::Status> {
        let caller = caller_of(request.extensions());
        self.allows(&caller, request.uri().path()).map_err(|why| {
            let who = match &caller {
                Caller::Peer(p) => p.cluster_id.clone(),
                _ => "an unauthenticated caller".to_owned(),
            };
            tracing::warn!(caller = %who, path = request.uri().path(), reason = %why, "refused a call on the peer listener");
            tonic::Status::permission_denied(why)
        })
    }
}

/// A handler's authorization: off (no TLS; the identity a request claims is trusted, as before
/// ADR 0014) or on, with the trust store whose pinned CAs define the peers.
#[derive(Debug, Clone, Default)]
pub struct Authz {
    trust: Option<TrustStore>,
}

impl Authz {
    /// No mutual TLS: nothing is checked here.
    pub fn off() -> Self {
        Self { trust: None }
    }

    /// Mutual TLS: cluster-facing RPCs need a verified, still pinned caller.
    pub fn on(trust: TrustStore) -> Self {
        Self { trust: Some(trust) }
    }

    pub fn enabled(&self) -> bool {
        self.trust.is_some()
    }

    /// The verified caller of cluster-facing RPC `rpc`: `Ok(None)` when authorization is off;
    /// `PermissionDenied` (logged) when it is on and the caller has no certificate, came in on
    /// the plaintext listener, or its CA is no longer pinned (unpeered since it connected).
    pub fn peer<T>(&self, request: &tonic::Request<T>, rpc: &str) -> Result<Option<PeerIdentity>> {
        let Some(trust) = &self.trust else {
            return Ok(None);
        };
        match caller(request) {
            Caller::Peer(peer) if trust.admits(&peer.cluster_id, &peer.ca_fingerprint) => {
                Ok(Some(peer))
            }
            Caller::Peer(peer) => {
                tracing::warn!(caller = %peer.cluster_id, rpc, "refused: the caller's CA is no longer pinned (not a peer)");
                Err(Error::PermissionDenied(format!(
                    "{rpc}: cluster {} is not a peer of this cluster",
                    peer.cluster_id
                )))
            }
            other => {
                tracing::warn!(caller = ?other, rpc, "refused a cluster-facing call without a verified client certificate");
                Err(Error::PermissionDenied(format!(
                    "{rpc} needs mutual TLS with a certificate of a peered cluster (the peer listener)"
                )))
            }
        }
    }

    /// Like [`Authz::peer`], for a method intra-cluster callers use too (the IPAM's
    /// `MapEndpointIp`): a call on the plaintext listener is local and passes as `Ok(None)`; on
    /// the peer listener the caller must be a verified, still pinned peer.
    pub fn peer_or_local<T>(
        &self,
        request: &tonic::Request<T>,
        rpc: &str,
    ) -> Result<Option<PeerIdentity>> {
        if self.trust.is_none() || caller(request) == Caller::Plaintext {
            return Ok(None);
        }
        self.peer(request, rpc)
    }

    /// Checks that the verified caller (from [`Authz::peer`]) is cluster `expected`, which the
    /// request names as `claim` (e.g. "network_config.origin"). Off, or no caller: Ok.
    pub fn require(
        &self,
        peer: Option<&PeerIdentity>,
        rpc: &str,
        claim: &str,
        expected: &str,
    ) -> Result<()> {
        match peer {
            Some(peer) if peer.cluster_id != expected => {
                tracing::warn!(caller = %peer.cluster_id, claimed = %expected, field = claim, rpc, "refused: the caller speaks for another cluster");
                Err(Error::PermissionDenied(format!(
                    "{rpc}: the caller is cluster {}, but {claim} is {expected}",
                    peer.cluster_id
                )))
            }
            _ => Ok(()),
        }
    }
}

fn peered_ca(fc: &pb::ForeignCluster) -> Option<PinnedCa> {
    if !is_full_peer(fc) {
        return None;
    }
    let pem = &fc.full.as_ref()?.ca_certificate;
    let id = &fc.identity.as_ref()?.cluster_id;
    if pem.is_empty() {
        return None;
    }
    match PinnedCa::from_pem(id, pem) {
        Ok(ca) => Some(ca),
        Err(err) => {
            tracing::warn!(remote.id = %id, error = %err, "ignoring an unusable pinned CA");
            None
        }
    }
}

/// The wait before the trust sync watches discovery again after its watch ended: a fixed half
/// second, not a growing backoff, because a peer pinned while the watch is down is refused
/// until the sync is back.
const TRUST_SYNC_RETRY: RetryPolicy = RetryPolicy::fixed(Duration::from_millis(500));

/// Keeps `trust` equal to the CAs of the established full peers in the discovery service at
/// `discovery` (a watch of its ForeignClusters; restarted after errors, including a discovery
/// gone silent, which the channel's keepalive turns into one: [`crate::client::KEEPALIVE`]),
/// until `shutdown`.
pub fn spawn_trust_sync(
    discovery: TracedChannel,
    trust: TrustStore,
    shutdown: crate::Shutdown,
) -> tokio::task::JoinHandle<()> {
    crate::telemetry::spawn(async move {
        let mut backoff = TRUST_SYNC_RETRY.backoff();
        loop {
            let run = sync_once(discovery.clone(), &trust);
            tokio::select! {
                () = shutdown.cancelled() => return,
                result = run => {
                    if let Err(err) = result {
                        tracing::debug!(error = %err, "trust sync: restarting the discovery watch");
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    })
}

async fn sync_once(discovery: TracedChannel, trust: &TrustStore) -> Result<()> {
    let mut stream = DiscoveryClient::new(discovery)
        .watch_foreign_clusters(WatchForeignClustersRequest {
            start_revision: 0,
            kind: 0,
        })
        .await
        .map_err(Error::from)?
        .into_inner();
    let mut records: std::collections::BTreeMap<String, Option<PinnedCa>> = Default::default();
    let mut synced = false;
    while let Some(event) = stream.next().await {
        let event = event.map_err(Error::from)?;
        match pb::WatchEventType::try_from(event.r#type) {
            Ok(pb::WatchEventType::Bookmark) => synced = true,
            Ok(pb::WatchEventType::Deleted) => {
                if let Some(id) = event
                    .foreign_cluster
                    .as_ref()
                    .and_then(|fc| fc.identity.as_ref())
                {
                    records.remove(&id.cluster_id);
                }
            }
            Ok(_) => {
                if let Some(fc) = &event.foreign_cluster
                    && let Some(id) = &fc.identity
                {
                    records.insert(id.cluster_id.clone(), peered_ca(fc));
                }
            }
            Err(_) => {}
        }
        if synced {
            trust.replace(records.values().flatten().cloned());
        }
    }
    Err(Error::Unavailable("the discovery watch ended".into()))
}
