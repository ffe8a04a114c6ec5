//! Peering two clusters the way an operator does (and reading the tunnels that result), and telling a discovery service that a
//! cluster is its peer the way a broker does: the calls every multi-cluster test and lab makes
//! before what it tests.
//!
//! The sequence is written once, so a change to the peering API changes one place, and
//! in-process clusters, process clusters and namespace labs all peer alike.

use std::future::Future;
use std::net::SocketAddr;

use anyhow::Context as _;
use tonic::transport::Channel;
use trellis_api::pb::discovery::UpdatePeeringRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{
    GetTokenRequest, ListTunnelEndpointsRequest, PeerRequest, PeerResponse, UnpeerRequest,
    UnpeerResponse,
};
use trellis_api::pb::types::{ClusterIdentity, ServiceAddresses, TunnelEndpoint};

/// A cluster whose broker a test can call and other clusters can peer with.
pub trait Peerable: Sync {
    /// The cluster ID.
    fn cluster_id(&self) -> &str;
    /// The broker address other clusters peer with (the peer listener when TLS is on).
    fn peering_broker(&self) -> SocketAddr;
    /// A client of the cluster's broker (its local listener).
    fn broker_client(&self) -> impl Future<Output = anyhow::Result<BrokerClient<Channel>>> + Send;
}

/// `of`'s current peering token, or why there is none.
pub async fn try_token(of: &impl Peerable) -> anyhow::Result<String> {
    Ok(of
        .broker_client()
        .await
        .with_context(|| format!("connects to {}'s broker", of.cluster_id()))?
        .get_token(GetTokenRequest {})
        .await
        .context("GetToken")?
        .into_inner()
        .token)
}

/// `of`'s current peering token; panics without one.
pub async fn token(of: &impl Peerable) -> String {
    try_token(of)
        .await
        .unwrap_or_else(|err| panic!("gets a token: {err:#}"))
}

/// The request with which a cluster peers with `to` using `token`, expecting `to`'s cluster ID
/// (and no CA pin).
pub fn peer_request(to: &impl Peerable, token: String) -> PeerRequest {
    PeerRequest {
        broker_address: to.peering_broker().to_string(),
        token,
        expected_cluster_id: to.cluster_id().to_string(),
        ca_cert_hash: String::new(),
    }
}

/// `from` asks its broker to peer with `to` using `token`; panics only if `from`'s broker
/// cannot be reached, so a test can look at a refusal.
pub async fn peer_with_token(
    from: &impl Peerable,
    to: &impl Peerable,
    token: String,
) -> Result<PeerResponse, tonic::Status> {
    from.broker_client()
        .await
        .expect("connects to the broker")
        .peer(peer_request(to, token))
        .await
        .map(tonic::Response::into_inner)
}

/// `from` peers with `to` through `to`'s current token, or says why not.
pub async fn try_peer(from: &impl Peerable, to: &impl Peerable) -> anyhow::Result<PeerResponse> {
    let token = try_token(to).await?;
    Ok(from
        .broker_client()
        .await
        .with_context(|| format!("connects to {}'s broker", from.cluster_id()))?
        .peer(peer_request(to, token))
        .await
        .with_context(|| format!("{} peers with {}", from.cluster_id(), to.cluster_id()))?
        .into_inner())
}

/// `from` peers with `to` through `to`'s current token; panics if the peering is refused or
/// answered by another cluster.
pub async fn peer(from: &impl Peerable, to: &impl Peerable) {
    let answer = peer_with_token(from, to, token(to).await)
        .await
        .unwrap_or_else(|err| {
            panic!(
                "{} peers with {}: {err:?}",
                from.cluster_id(),
                to.cluster_id()
            )
        });
    assert_eq!(
        answer.identity.map(|i| i.cluster_id).as_deref(),
        Some(to.cluster_id())
    );
}

/// `from` unpeers `remote` through its broker and returns the answer (whether there was a
/// peering to end); panics if the call fails.
pub async fn unpeer(from: &impl Peerable, remote: &str) -> UnpeerResponse {
    from.broker_client()
        .await
        .expect("connects to the broker")
        .unpeer(UnpeerRequest {
            cluster_id: remote.to_owned(),
        })
        .await
        .unwrap_or_else(|err| panic!("{} unpeers {remote}: {err:?}", from.cluster_id()))
        .into_inner()
}

/// The cluster's TunnelEndpoints.
pub async fn tunnels(cluster: &impl Peerable) -> anyhow::Result<Vec<TunnelEndpoint>> {
    Ok(cluster
        .broker_client()
        .await?
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await?
        .into_inner()
        .tunnel_endpoints)
}

/// The cluster's TunnelEndpoint towards `remote`; `None` also while its broker cannot be
/// reached (callers poll through restarts). For waiting until a tunnel exists only: absence
/// checks use [`no_tunnel_to`] or [`answered_tunnel_to`].
pub async fn tunnel_to(cluster: &impl Peerable, remote: &str) -> Option<TunnelEndpoint> {
    tunnels(cluster)
        .await
        .ok()?
        .into_iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == remote))
}

/// The cluster's TunnelEndpoint towards `remote` as its broker answers; an error when the
/// broker cannot be asked. What absence checks use: an unreachable broker must not read as "no
/// tunnel".
pub async fn answered_tunnel_to(
    cluster: &impl Peerable,
    remote: &str,
) -> anyhow::Result<Option<TunnelEndpoint>> {
    Ok(tunnels(cluster)
        .await?
        .into_iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == remote)))
}

/// `Some` once the cluster's broker answers that it holds no TunnelEndpoint towards `remote`;
/// `None` while it holds one and while it cannot be reached (for [`crate::eventually()`]: absence is
/// proven by an answer, never by a failed call).
pub async fn no_tunnel_to(cluster: &impl Peerable, remote: &str) -> Option<()> {
    match answered_tunnel_to(cluster, remote).await {
        Ok(None) => Some(()),
        Ok(Some(_)) | Err(_) => None,
    }
}

/// What a broker tells its discovery service once a handshake with `identity` completed: a
/// full peer (both directions, networking on) reachable at `addresses`. A test changes the
/// fields it is about with struct update syntax.
pub fn full_peering(
    identity: ClusterIdentity,
    addresses: ServiceAddresses,
) -> UpdatePeeringRequest {
    UpdatePeeringRequest {
        identity: Some(identity),
        peered: true,
        addresses: Some(addresses),
        outgoing_peering_enabled: true,
        incoming_peering_enabled: true,
        networking_enabled: true,
        reason: String::new(),
        message: String::new(),
        expected_revision: 0,
        ca_certificate: String::new(),
    }
}
