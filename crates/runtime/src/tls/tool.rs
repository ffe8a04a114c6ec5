//! How a tool (trellisctl) reaches one cluster's TLS listeners. Unlike a service it pins no
//! set of peers: it trusts the one CA it is given, and it may present a certificate of any
//! cluster, which the server then judges.

use std::fmt;
use std::sync::{Arc, RwLock};

use trellis_error::Result;

use super::channel::client_config;
use super::endpoint::TlsEndpoint;
use super::identity::ca_cluster_id;
use super::peer_tls::{OwnCert, load_certified};
use super::trust::{PinnedCa, TrustStore};
use super::verification::algorithms;
use super::verifiers::PeerServerVerifier;
use crate::client::Timeouts;

/// How a tool (trellisctl) calls one cluster's TLS listeners: the server must chain to that
/// cluster's CA and name that cluster; optionally the tool presents a certificate — whichever
/// cluster it belongs to: the server decides whether it trusts it. `Debug` shows no key.
#[derive(Clone)]
pub struct ToolTls {
    cluster_id: String,
    // Visible to the handshake tests, which connect with it directly.
    pub(super) config: Arc<rustls::ClientConfig>,
}

impl fmt::Debug for ToolTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolTls")
            .field("cluster_id", &self.cluster_id)
            .finish_non_exhaustive()
    }
}

impl ToolTls {
    /// From the server cluster's CA certificate and, to present one, a certificate and its key
    /// (all PEM).
    pub fn new(ca_pem: &str, identity: Option<(&str, &str)>) -> Result<Self> {
        let cluster_id = ca_cluster_id(ca_pem)?;
        let trust = TrustStore::default();
        trust.insert_quiet(PinnedCa::from_pem(&cluster_id, ca_pem)?);
        let own = identity
            .map(|(cert, key)| load_certified(cert, key))
            .transpose()?
            .map(|certified| {
                Arc::new(OwnCert {
                    current: RwLock::new(Arc::new(certified)),
                })
            });
        let config = client_config(
            PeerServerVerifier {
                trust: Some(trust),
                expected: Some(cluster_id.clone()),
                pin: None,
                algorithms: algorithms(),
            },
            own,
        )?;
        Ok(Self { cluster_id, config })
    }

    /// The cluster whose servers are accepted.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// An endpoint for `address` (see [`TlsEndpoint::new`]).
    pub fn endpoint(&self, field: &str, address: &str, timeouts: Timeouts) -> Result<TlsEndpoint> {
        TlsEndpoint::new(field, address, timeouts, self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::ClusterCa;

    #[test]
    fn a_tool_needs_a_trellis_ca_and_a_matching_key() {
        let ca = ClusterCa::generate("hub").expect("CA");
        let other = ca.issue("other").expect("cert");
        // A service certificate names no cluster by itself (its SAN has a service part).
        let err = ToolTls::new(&other.cert_pem, None).expect_err("not a CA of a cluster");
        assert!(err.to_string().contains("ca_certificate"), "{err}");
        let issued = ca.issue("trellisctl").expect("cert");
        let err = ToolTls::new(ca.cert_pem(), Some((&issued.cert_pem, other.key_pem())))
            .expect_err("key of another certificate");
        assert!(err.to_string().contains("tls key"), "{err}");
    }
}
