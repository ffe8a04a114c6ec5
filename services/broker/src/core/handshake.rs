//! Starting a peering: answering a remote's handshake ([`Broker::handshake`]) and sending ours
//! ([`Broker::peer`]), with the checks on the CA certificates the two sides exchange (ADR 0010,
//! ADR 0014). Both end in the same bookkeeping (`peering`): the discovery record, the pinned
//! CA and the peering ID.

use trellis_api::model::Addresses;
use trellis_api::peers::{PEERED_REASON, Peers};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::tls::{CaCertHash, Caller, PeerTls, PinnedCa};

use super::Broker;
use crate::join_tokens::{self, Verdict};
use crate::peering_id::PeeringId;
use crate::records::notify_key;
use crate::remote::peers::HandshakeOffer;
use crate::token;

impl Broker {
    /// A new peering with `remote` supersedes an unpeering of it that was never acknowledged:
    /// the old notice must not end the new peering when it finally gets through.
    async fn cancel_notice(&self, remote: &ClusterId) -> Result<()> {
        if self.store.delete(&notify_key(remote)).await? {
            tracing::info!(remote.id = %remote, "a new peering cancels an undelivered unpeering notice");
        }
        Ok(())
    }

    /// Checks a CA certificate a peer sent in the handshake (ADR 0014): with TLS on it is
    /// required, must name the peer and must not be ours. Returns what to pin.
    fn peer_ca(&self, field: &str, remote: &ClusterId, pem: &str) -> Result<Option<PinnedCa>> {
        let Some(tls) = self.ports.tls() else {
            return Ok(None);
        };
        if pem.is_empty() {
            return Err(Error::invalid(
                field,
                format!(
                    "is required: {} runs with mutual TLS between clusters",
                    self.identity.id
                ),
            ));
        }
        let ca = PinnedCa::from_pem(remote.as_str(), pem)
            .map_err(|e| Error::invalid(field, e.to_string()))?;
        let ours = PinnedCa::from_pem(self.identity.id.as_str(), &tls.ca_pem())?;
        if ca.fingerprint() == ours.fingerprint() {
            return Err(Error::invalid(field, "is this cluster's own CA"));
        }
        Ok(Some(ca))
    }

    /// The re-handshake rule (ADR 0014): a handshake for an identity we are already peered
    /// with must present the CA we pinned for it, and must come over mutual TLS from a
    /// certificate of that cluster. The handshake method itself takes callers without a
    /// certificate (first contact), and a CA certificate is public (servers send it in their
    /// chain), so without both checks any holder of our token could take over the identity:
    /// replace its addresses and peering ID and cancel our unpeering notice to it. The peer
    /// itself re-handshakes over mutual TLS ([`Broker::peer`]). Re-admitting a cluster that
    /// lost its CA, its certificate or its records is an operator's decision: `Unpeer` it here,
    /// then it peers again like a new cluster.
    async fn refuse_takeover(
        &self,
        remote: &ClusterId,
        ca: &PinnedCa,
        caller: &Caller,
    ) -> Result<()> {
        let Some(record) = self.ports.discovery().foreign_cluster(remote).await? else {
            return Ok(());
        };
        let peers = Peers::from_foreign_clusters(std::slice::from_ref(&record));
        let pinned = record
            .full
            .map(|f| f.ca_certificate)
            .filter(|pem| !pem.is_empty());
        let (true, Some(pinned)) = (peers.is_full_peer(remote), pinned) else {
            return Ok(());
        };
        let pinned = PinnedCa::from_pem(remote.as_str(), &pinned)?;
        if pinned.fingerprint() != ca.fingerprint() {
            tracing::warn!(remote.id = %remote, pinned = pinned.fingerprint(), presented = ca.fingerprint(), "refused a handshake presenting another ca for a peered cluster");
            return Err(Error::PermissionDenied(format!(
                "cluster {remote} is peered with another CA; an operator must unpeer it before it \
                 can peer again with a new one"
            )));
        }
        match caller {
            Caller::Peer(peer)
                if peer.cluster_id == remote.as_str()
                    && peer.ca_fingerprint == pinned.fingerprint() =>
            {
                Ok(())
            }
            other => {
                let who = match other {
                    Caller::Peer(peer) => peer.cluster_id.clone(),
                    Caller::Anonymous | Caller::Plaintext => "no client certificate".to_owned(),
                };
                tracing::warn!(remote.id = %remote, caller = %who, "refused a handshake for a peered cluster that did not come from its certificate");
                Err(Error::PermissionDenied(format!(
                    "cluster {remote} is already peered: a new handshake for it must come over \
                     mutual TLS with its own certificate (its broker's Peer does so); if it lost \
                     its certificate or its records, an operator unpeers it here first"
                )))
            }
        }
    }

    /// The hash peers pin our CA by (`None` without TLS).
    pub fn ca_cert_hash(&self) -> Option<String> {
        self.ports
            .tls()
            .and_then(|t| t.own_ca_hash().ok())
            .map(|h| h.to_string())
    }

    /// Our CA certificate for the handshake (empty without TLS).
    fn our_ca(&self) -> String {
        self.ports.tls().map(PeerTls::ca_pem).unwrap_or_default()
    }

    /// Answers a remote's handshake: checks the token, records the caller as a full peer,
    /// returns who we are and where our services are. `transport` is who the connection it
    /// came on authenticated (checked for a cluster we are already peered with).
    #[tracing::instrument(skip_all, fields(remote.id = %caller.id))]
    pub async fn handshake(
        &self,
        transport: &Caller,
        presented: &str,
        caller: &ClusterIdentity,
        addresses: &Addresses,
        ca_certificate: &str,
        peering_id: Option<&PeeringId>,
    ) -> Result<(ClusterIdentity, Addresses, String)> {
        let token = self.token().await?;
        if !token::accepts(&token, presented) {
            match join_tokens::check(&self.store, presented).await? {
                Verdict::Accepted { id } => {
                    tracing::info!(remote.id = %caller.id, join_token.id = %id, "a join token authenticates a handshake");
                }
                Verdict::Refused(why) => {
                    tracing::warn!(remote.id = %caller.id, reason = %why, "refused a handshake with a join token");
                    return Err(Error::PermissionDenied(why));
                }
                Verdict::NotAJoinToken => {
                    tracing::warn!(remote.id = %caller.id, "refused a handshake with a wrong or expired token");
                    return Err(Error::PermissionDenied(
                        "the peering token is wrong or expired".into(),
                    ));
                }
            }
        }
        if caller.id == self.identity.id {
            return Err(Error::invalid(
                "identity.cluster_id",
                "is our own cluster ID",
            ));
        }
        if addresses.broker.is_empty() {
            return Err(Error::invalid(
                "addresses.broker",
                "is required: we must be able to reach the caller's broker",
            ));
        }
        let ca = self.peer_ca("ca_certificate", &caller.id, ca_certificate)?;
        // Without TLS nothing authenticates the caller: a re-handshake is taken as it comes
        // (plaintext trusts everyone who reaches the services; README, ADR 0014).
        if let Some(ca) = &ca {
            self.refuse_takeover(&caller.id, ca, transport).await?;
        }
        let ours = self.advertised().await?;
        let _peering = self.lock_peering(&caller.id).await;
        self.cancel_notice(&caller.id).await?;
        self.keep_peering_id(&caller.id, peering_id).await?;
        self.record_peering(
            caller,
            Some(addresses),
            true,
            "HandshakeAccepted",
            ca.as_ref(),
        )
        .await?;
        self.pin(&caller.id, ca);
        tracing::info!(remote.id = %caller.id, remote.name = %caller.name, "accepted a peering handshake");
        self.wake();
        Ok((self.identity.clone(), ours, self.our_ca()))
    }

    /// Peers with the cluster whose broker listens at `address`.
    #[tracing::instrument(skip(self, presented))]
    pub async fn peer(
        &self,
        address: &str,
        presented: &str,
        expected: Option<&ClusterId>,
        pin: Option<CaCertHash>,
    ) -> Result<(ClusterIdentity, Addresses)> {
        let ours = self.advertised().await?;
        if ours.broker.is_empty() {
            return Err(Error::FailedPrecondition(
                "the local discovery service advertises no broker address; peers could not reach us".into(),
            ));
        }
        // Already peered, the remote takes a new handshake only over mutual TLS from our
        // certificate (`refuse_takeover`), and the server must chain to its pinned CA.
        let peered = self.peered_at(address, expected).await?;
        // An unpeering notice to this cluster still on its way must reach it before our
        // handshake, never after: it would end the new peering there (a notice from a store
        // that lost its peering IDs names none, so nothing else fences it). Notices go out
        // under their remote's sending lock, so we hold it across the handshake. Only that
        // one: the remote may answer only after its own notice to us is through, which takes
        // our peering lock.
        let mut notified = self.lock_notified(address, expected).await?;
        let peering_id = PeeringId::random();
        let our_ca = self.our_ca();
        let answer = self
            .ports
            .peers()
            .handshake(
                address,
                peered.as_ref(),
                pin,
                HandshakeOffer {
                    token: presented,
                    identity: &self.identity,
                    addresses: &ours,
                    ca_certificate: &our_ca,
                    peering_id: &peering_id,
                },
            )
            .await?;
        let unusable = |e: Error| {
            Error::FailedPrecondition(format!(
                "the broker at {address} answered an unusable handshake: {e}"
            ))
        };
        let (remote, addresses) = (answer.identity, answer.addresses);
        if remote.id == self.identity.id {
            return Err(Error::FailedPrecondition(format!(
                "the broker at {address} is our own"
            )));
        }
        if let Some(expected) = expected.filter(|e| **e != remote.id) {
            return Err(Error::FailedPrecondition(format!(
                "the broker at {address} belongs to cluster {}, not {expected}",
                remote.id
            )));
        }
        if let Some(pin) = pin
            && CaCertHash::of_pem(&answer.ca_certificate).ok() != Some(pin)
        {
            return Err(Error::PermissionDenied(format!(
                "the broker at {address} answered with a CA other than the one ca_cert_hash pins"
            )));
        }
        let ca = self
            .peer_ca("ca_certificate", &remote.id, &answer.ca_certificate)
            .map_err(unusable)?;
        // One remote's locks from here, so two peerings never wait for each other's.
        let held = notified.remove(&remote.id);
        drop(notified);
        let _sending = match held {
            Some(held) => held,
            None => self.lock_sending(&remote.id).await,
        };
        let _peering = self.lock_peering(&remote.id).await;
        self.cancel_notice(&remote.id).await?;
        self.keep_peering_id(&remote.id, Some(&peering_id)).await?;
        self.record_peering(&remote, Some(&addresses), true, PEERED_REASON, ca.as_ref())
            .await?;
        self.pin(&remote.id, ca);
        tracing::info!(remote.id = %remote.id, remote.name = %remote.name, "peered");
        self.wake();
        Ok((remote, addresses))
    }

    /// With mutual TLS on, the full peer we hold a pinned CA for that `address` reaches: the
    /// `expected` cluster, or the one advertising `address` as its broker. `None` without TLS
    /// or when we are not peered with it (first contact).
    async fn peered_at(
        &self,
        address: &str,
        expected: Option<&ClusterId>,
    ) -> Result<Option<ClusterId>> {
        let Some(tls) = self.ports.tls() else {
            return Ok(None);
        };
        let peers = self.peers().await?;
        let found = peers
            .full
            .iter()
            .find(|(id, (_, addresses, _))| match expected {
                Some(expected) => *id == expected,
                None => addresses.broker == address,
            })
            .map(|(id, _)| id.clone());
        Ok(found.filter(|id| tls.trust().get(id.as_str()).is_some()))
    }
}
