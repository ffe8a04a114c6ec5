//! The port to other clusters: their brokers (the handshake, unpeering notices, our
//! NetworkConfigs submitted to full peers) and their forwarders (our NetworkConfigs relayed
//! through a hub to its leaves, and withdrawn again). Over mutual TLS when it is on (ADR 0014),
//! each channel must reach the cluster it is meant for; channels and batchers are cached per
//! (address, expected cluster).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use trellis_api::convert::{addresses_from_pb, addresses_to_pb, identity_from_pb, identity_to_pb};
use trellis_api::model::Addresses;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{
    GetObservedEndpointsRequest, HandshakeRequest, NotifyUnpeerRequest, RelayRequest,
    RelayResponse, RelayWithdrawalRequest, SubmitNetworkConfigRequest, SubmitNetworkConfigResponse,
    UpdatePeerCaRequest,
};
use trellis_api::pb::types::{NetworkConfig, NetworkConfigRef, NetworkConfigStatus};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::batch::{self, Batchers, Relayer, Submitter};
use trellis_runtime::client::{Timeouts, TracedChannel};
use trellis_runtime::metrics::Metrics;
use trellis_runtime::tls::{
    CaCertHash, PeerTls, PinnedCa, cluster_channel, first_contact_channel, peer_channel_pinned,
    pinned_handshake_channel,
};

use crate::peering_id::PeeringId;
use crate::records::{PendingNotify, nc_name};

/// Remote services may be far away.
const REMOTE: Timeouts = Timeouts {
    connect: Duration::from_secs(3),
    request: Duration::from_secs(15),
};

/// What we send a broker we handshake with.
#[derive(Debug, Clone, Copy)]
pub struct HandshakeOffer<'a> {
    pub token: &'a str,
    pub identity: &'a ClusterIdentity,
    pub addresses: &'a Addresses,
    /// Our CA certificate (PEM; empty without TLS).
    pub ca_certificate: &'a str,
    pub peering_id: &'a PeeringId,
}

/// What the broker we handshook with answered.
#[derive(Debug, Clone)]
pub struct HandshakeReply {
    pub identity: ClusterIdentity,
    pub addresses: Addresses,
    /// Its CA certificate (PEM; empty without TLS), checked by the caller.
    pub ca_certificate: String,
}

/// Other clusters' brokers and forwarders.
#[derive(Debug)]
pub struct PeerClusters {
    /// Mutual TLS towards other clusters (ADR 0014); plaintext when absent.
    tls: Option<PeerTls>,
    /// Remote channels by (address, expected cluster).
    remote: Mutex<HashMap<(String, String), TracedChannel>>,
    /// `SubmitNetworkConfig` to remote brokers and `Relay` to hubs' forwarders, batched.
    submitters: Batchers<SubmitNetworkConfigRequest, SubmitNetworkConfigResponse>,
    relayers: Batchers<RelayRequest, RelayResponse>,
    /// The broker's registry: every channel's calls count there (`grpc_client_*`).
    metrics: Metrics,
}

impl PeerClusters {
    pub(super) fn new(tls: Option<PeerTls>, metrics: &Metrics) -> Self {
        Self {
            tls,
            remote: Mutex::new(HashMap::new()),
            submitters: Batchers::default(),
            relayers: Batchers::default(),
            metrics: metrics.clone(),
        }
    }

    /// The mutual-TLS setup, when on.
    pub fn tls(&self) -> Option<&PeerTls> {
        self.tls.as_ref()
    }

    /// Handshakes with the broker at `address`. Already `peered` with its cluster, the
    /// server must chain to the CA pinned for it (and the remote takes the handshake only
    /// from our certificate); otherwise this is first contact, where `pin` (`ca_cert_hash`)
    /// names the CA the server must chain to, and without it whoever answers gets the token.
    pub async fn handshake(
        &self,
        address: &str,
        peered: Option<&ClusterId>,
        pin: Option<CaCertHash>,
        offer: HandshakeOffer<'_>,
    ) -> Result<HandshakeReply> {
        let mut client = match (peered, pin) {
            (Some(id), _) => self.broker(address, id)?,
            (None, Some(pin)) => self.pinned_handshake_broker(address, pin)?,
            (None, None) => {
                if self.tls.is_some() {
                    tracing::warn!(remote = %address, "first contact is unpinned: the token goes to whoever answers at this address (pass ca_cert_hash, as `trellisctl token --join` prints it)");
                }
                self.handshake_broker(address)?
            }
        };
        let answer = client
            .handshake(HandshakeRequest {
                token: offer.token.to_owned(),
                identity: Some(identity_to_pb(offer.identity)),
                addresses: Some(addresses_to_pb(offer.addresses)),
                ca_certificate: offer.ca_certificate.to_owned(),
                peering_id: offer.peering_id.to_string(),
            })
            .await
            .map_err(|status| {
                if pin.is_some() && status.message().contains("pinned CA") {
                    return Error::PermissionDenied(format!(
                        "the broker at {address} does not present a certificate of the CA \
                         pinned by ca_cert_hash; nothing was sent ({})",
                        status.message()
                    ));
                }
                if let Some(id) = peered {
                    return Error::from(status).context(format!(
                        "handshake with {address} over mutual TLS (we are peered with {id}; a \
                         remote whose CA changed must be unpeered here first)"
                    ));
                }
                Error::from(status).context(format!("handshake with {address}"))
            })?
            .into_inner();
        let unusable = |e: Error| {
            Error::FailedPrecondition(format!(
                "the broker at {address} answered an unusable handshake: {e}"
            ))
        };
        Ok(HandshakeReply {
            identity: identity_from_pb("identity", answer.identity.as_ref()).map_err(unusable)?,
            addresses: addresses_from_pb("addresses", answer.addresses.as_ref())
                .map_err(unusable)?,
            ca_certificate: answer.ca_certificate,
        })
    }

    /// Tells the remote of `pending` that `ours` (this cluster) unpeered it. The remote is no
    /// longer pinned by then: over mutual TLS its server must chain to the CA kept in the
    /// notice.
    pub async fn notify_unpeer(
        &self,
        ours: &ClusterIdentity,
        pending: &PendingNotify,
    ) -> Result<()> {
        let mut client =
            self.unpinned_broker(&pending.broker, &pending.remote.id, &pending.ca_certificate)?;
        client
            .notify_unpeer(NotifyUnpeerRequest {
                identity: Some(identity_to_pb(ours)),
                reason: pending.reason.clone(),
                peering_id: pending
                    .peering_id
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
            })
            .await?;
        Ok(())
    }

    /// Tells the full peer `id` (its broker at `address`) that our CA is `ca_certificate` from
    /// now on; whether its pin changed.
    pub async fn update_peer_ca(
        &self,
        address: &str,
        id: &ClusterId,
        ours: &ClusterIdentity,
        ca_certificate: &str,
    ) -> Result<bool> {
        let answer = self
            .broker(address, id)?
            .update_peer_ca(UpdatePeerCaRequest {
                identity: Some(identity_to_pb(ours)),
                ca_certificate: ca_certificate.to_owned(),
            })
            .await?;
        Ok(answer.into_inner().changed)
    }

    /// Where the hub `hub` (its broker at `address`) sees the gateways of `ids`: one
    /// `(cluster, endpoint)` per cluster it sees. Answers that do not parse are left out.
    pub async fn observed_endpoints(
        &self,
        address: &str,
        hub: &ClusterId,
        requester: &ClusterIdentity,
        ids: &[ClusterId],
    ) -> Result<Vec<(ClusterId, SocketAddr)>> {
        let answer = self
            .broker(address, hub)?
            .get_observed_endpoints(GetObservedEndpointsRequest {
                requester: Some(identity_to_pb(requester)),
                cluster_ids: ids.iter().map(ToString::to_string).collect(),
            })
            .await?
            .into_inner();
        Ok(answer
            .observed
            .into_iter()
            .filter_map(|o| {
                let id = ClusterId::parse("observed.cluster_id", &o.cluster_id).ok()?;
                let endpoint = trellis_api::model::candidate("observed.endpoint", &o.endpoint);
                match endpoint {
                    Ok(endpoint) => Some((id, endpoint)),
                    Err(err) => {
                        tracing::warn!(hub = %hub, remote.id = %id, error = %err, "ignoring an unusable observed endpoint");
                        None
                    }
                }
            })
            .collect())
    }

    /// Submits our NetworkConfig `nc` to the broker of the full peer `remote` at `address`,
    /// batched with our other submissions to it; the remote's status, if it gave one, and the
    /// ID it keeps for our peering (a malformed one is left out, with a warning: it only ever
    /// fills a gap in our own records).
    pub async fn submit(
        &self,
        address: &str,
        remote: &ClusterId,
        nc: NetworkConfig,
    ) -> Result<(Option<NetworkConfigStatus>, Option<PeeringId>)> {
        let answer = self
            .submitter(address, remote)?
            .call(SubmitNetworkConfigRequest {
                network_config: Some(nc),
            })
            .await
            .map_err(|s| {
                Error::from(s).context(format!("submitting our network config to {remote}"))
            })?;
        Ok((answer.status, told_peering_id(remote, &answer.peering_id)))
    }

    /// Relays our NetworkConfig `nc` to the induced peer `remote` through the forwarder of
    /// `hub` at `forwarder`, batched with our other relays through it; the remote's status, if
    /// it gave one.
    pub async fn relay(
        &self,
        forwarder: &str,
        hub: &ClusterId,
        remote: &ClusterId,
        nc: NetworkConfig,
    ) -> Result<Option<NetworkConfigStatus>> {
        let answer = self
            .relayer(forwarder, hub)?
            .call(RelayRequest {
                network_config: Some(nc),
            })
            .await
            .map_err(|s| {
                Error::from(s).context(format!(
                    "relaying our network config to {remote} through {hub}"
                ))
            })?;
        Ok(answer.status)
    }

    /// Withdraws the NetworkConfig `origin` relayed to `destination` through the forwarder of
    /// `hub` at `forwarder`, for `reason`.
    pub async fn relay_withdrawal(
        &self,
        forwarder: &str,
        hub: &ClusterIdentity,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        reason: &str,
    ) -> Result<()> {
        let request = RelayWithdrawalRequest {
            network_config: Some(NetworkConfigRef {
                name: nc_name(&origin.id, &destination.id),
                origin: Some(identity_to_pb(origin)),
                destination: Some(identity_to_pb(destination)),
                via: Some(identity_to_pb(hub)),
            }),
            reason: reason.to_owned(),
        };
        self.forwarder(forwarder, &hub.id)?
            .relay_withdrawal(request)
            .await?;
        Ok(())
    }

    /// A channel to cluster `expected` at `address`: over mutual TLS (the server must chain to
    /// `expected`'s pinned CA) when TLS is on.
    fn remote_channel(
        &self,
        field: &str,
        address: &str,
        expected: &ClusterId,
    ) -> Result<TracedChannel> {
        let key = (address.to_owned(), expected.to_string());
        if let Ok(cache) = self.remote.lock()
            && let Some(found) = cache.get(&key)
        {
            return Ok(found.clone());
        }
        let created = cluster_channel(
            self.tls.as_ref(),
            field,
            address,
            expected.as_str(),
            REMOTE,
            &self.metrics,
        )?;
        if let Ok(mut cache) = self.remote.lock() {
            cache.insert(key, created.clone());
        }
        Ok(created)
    }

    /// Cluster `expected`'s broker.
    fn broker(&self, address: &str, expected: &ClusterId) -> Result<BrokerClient<TracedChannel>> {
        Ok(BrokerClient::new(self.remote_channel(
            "broker_address",
            address,
            expected,
        )?))
    }

    /// Cluster `expected`'s broker's `SubmitNetworkConfig`, batched with our other submissions
    /// to it.
    fn submitter(&self, address: &str, expected: &ClusterId) -> Result<Submitter> {
        self.submitters
            .get_or_make((address.to_owned(), expected.to_string()), || {
                Ok(batch::submitter(self.remote_channel(
                    "broker_address",
                    address,
                    expected,
                )?))
            })
    }

    /// Cluster `expected`'s broker after we unpeered it: over mutual TLS its server must chain
    /// to `ca_pem` (no longer pinned). Not cached.
    fn unpinned_broker(
        &self,
        address: &str,
        expected: &ClusterId,
        ca_pem: &str,
    ) -> Result<BrokerClient<TracedChannel>> {
        match &self.tls {
            Some(tls) if !ca_pem.is_empty() => {
                let ca = PinnedCa::from_pem(expected.as_str(), ca_pem)?;
                Ok(BrokerClient::new(peer_channel_pinned(
                    tls,
                    "broker_address",
                    address,
                    ca,
                    REMOTE,
                    &self.metrics,
                )?))
            }
            _ => self.broker(address, expected),
        }
    }

    /// The broker we handshake with: first contact, so no pinned CA yet (TLS without a client
    /// certificate when TLS is on; ADR 0014). Not cached.
    fn handshake_broker(&self, address: &str) -> Result<BrokerClient<TracedChannel>> {
        Ok(BrokerClient::new(first_contact_channel(
            self.tls.as_ref(),
            "broker_address",
            address,
            REMOTE,
            &self.metrics,
        )?))
    }

    /// The broker we handshake with, reachable only if its certificate chains to the CA `pin`
    /// names (`ca_cert_hash`). Needs TLS.
    fn pinned_handshake_broker(
        &self,
        address: &str,
        pin: CaCertHash,
    ) -> Result<BrokerClient<TracedChannel>> {
        let tls = self.tls.as_ref().ok_or_else(|| {
            Error::FailedPrecondition(
                "ca_cert_hash pins the remote's CA over mutual TLS, and this broker runs \
                 without it (--peer-listen and the --tls-* files)"
                    .into(),
            )
        })?;
        Ok(BrokerClient::new(pinned_handshake_channel(
            tls,
            "broker_address",
            address,
            pin,
            REMOTE,
            &self.metrics,
        )?))
    }

    /// Hub `expected`'s forwarder's `Relay`, batched with our other relays through it.
    fn relayer(&self, address: &str, expected: &ClusterId) -> Result<Relayer> {
        self.relayers
            .get_or_make((address.to_owned(), expected.to_string()), || {
                Ok(batch::relayer(self.remote_channel(
                    "forwarder",
                    address,
                    expected,
                )?))
            })
    }

    /// Hub `expected`'s forwarder.
    fn forwarder(
        &self,
        address: &str,
        expected: &ClusterId,
    ) -> Result<ForwarderClient<TracedChannel>> {
        Ok(ForwarderClient::new(self.remote_channel(
            "forwarder",
            address,
            expected,
        )?))
    }
}

/// The peering ID a remote named in its answer: none when it named none, and none (with a
/// warning) when what it named is malformed, since it only ever fills a gap in our records.
fn told_peering_id(remote: &ClusterId, text: &str) -> Option<PeeringId> {
    PeeringId::parse_optional("peering_id", text)
        .inspect_err(|err| tracing::warn!(remote.id = %remote, error = %err, "ignoring an unusable peering id"))
        .ok()
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_malformed_peering_id_in_an_answer_is_left_out() {
        let remote = ClusterId::parse("id", "hub").expect("id");
        let id = PeeringId::random();
        assert_eq!(told_peering_id(&remote, id.as_str()), Some(id));
        assert_eq!(told_peering_id(&remote, ""), None, "a peer before IDs");
        for malformed in ["NOT-HEX", "0123456789ABCDEF", &"a".repeat(65)] {
            assert_eq!(told_peering_id(&remote, malformed), None, "{malformed}");
        }
    }
}
