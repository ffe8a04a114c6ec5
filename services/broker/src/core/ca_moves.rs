//! A cluster moving to its next CA while peered (ADR 0027): a peer telling us its new CA, which
//! we pin in place of the one pinned at the handshake, and ours told to every full peer once
//! our services serve the new CA's certificates.
//!
//! The peer's call is only taken from a certificate that chains to the CA pinned now (the
//! authorization layer checks it; while the move is announced its services serve a cross
//! certificate signed by the old CA), so nobody but the cluster itself can move its pin.

use trellis_api::ClusterIdentity;
use trellis_api::convert::addresses_from_pb;
use trellis_api::peers::PEERED_REASON;
use trellis_error::{Error, Result};
use trellis_runtime::tls::{PeerTls, PinnedCa};

use super::Broker;

/// What one full peer answered to our announcement: whether it pins our CA now.
pub(crate) type Announced = (ClusterIdentity, Result<bool>);

impl Broker {
    fn require_tls(&self) -> Result<&PeerTls> {
        self.ports.tls().ok_or_else(|| {
            Error::FailedPrecondition(
                "this cluster runs without mutual TLS between clusters \
                 (--insecure-plaintext-peering): there is no CA to pin or announce"
                    .into(),
            )
        })
    }

    /// The full peer `caller` moved to the CA `pem`: it is pinned for `caller` from now on.
    /// False when it was pinned already.
    pub async fn update_peer_ca(&self, caller: &ClusterIdentity, pem: &str) -> Result<bool> {
        let tls = self.require_tls()?;
        let ca = PinnedCa::from_pem(caller.id.as_str(), pem)
            .map_err(|e| Error::invalid("ca_certificate", e.to_string()))?;
        let _peering = self.lock_peering(&caller.id).await;
        let peers = self.peers().await?;
        let Some((remote, addresses, _)) = peers.full.get(&caller.id).cloned() else {
            return Err(Error::PermissionDenied(format!(
                "{} is not a full peer of {}",
                caller.id, self.identity.id
            )));
        };
        if tls.trust().is_pinned(caller.id.as_str(), ca.fingerprint()) {
            return Ok(false);
        }
        let addresses = addresses_from_pb("addresses", Some(&addresses))?;
        self.record_peering(&remote, Some(&addresses), true, PEERED_REASON, Some(&ca))
            .await?;
        tracing::info!(remote.id = %caller.id, ca.sha256 = %ca.fingerprint(), "a peer moved to its next CA: pinned it");
        self.pin(&caller.id, Some(ca));
        Ok(true)
    }

    /// Tells every full peer our CA as our services use it now; the CA's fingerprint and each
    /// peer's answer, by cluster ID.
    pub async fn announce_ca(&self) -> Result<(String, Vec<Announced>)> {
        let tls = self.require_tls()?;
        let pem = tls.ca_pem();
        let fingerprint = PinnedCa::from_pem(self.identity.id.as_str(), &pem)?
            .fingerprint()
            .to_owned();
        let peers = self.peers().await?;
        let calls = peers.full.into_values().map(|(remote, addresses, _)| {
            let pem = pem.clone();
            async move {
                let answer = if addresses.broker.is_empty() {
                    Err(Error::FailedPrecondition(format!(
                        "{} advertises no broker",
                        remote.id
                    )))
                } else {
                    self.ports
                        .peers()
                        .update_peer_ca(&addresses.broker, &remote.id, &self.identity, &pem)
                        .await
                        .map(|_| true)
                };
                if let Err(err) = &answer {
                    tracing::warn!(remote.id = %remote.id, error = %err, "could not announce our CA to a peer");
                }
                (remote, answer)
            }
        });
        let mut answers = futures::future::join_all(calls).await;
        answers.sort_by(|a, b| a.0.id.cmp(&b.0.id));
        tracing::info!(ca.sha256 = %fingerprint, peers = answers.len(), pinned = answers.iter().filter(|a| a.1.is_ok()).count(), "announced our CA");
        Ok((fingerprint, answers))
    }
}
