//! The SPIFFE names of Trellis: the URI a cluster's CA carries, the URI of each service's
//! certificate, and the identity a verified certificate gives its sender. A CA's URI has no
//! service part and a service's exactly one, so that neither passes for the other.

use rustls::pki_types::CertificateDer;
use trellis_error::{Error, Result};

use super::pem::parse_certs;

/// Every Trellis identity URI starts with this, followed by the cluster ID.
pub const URI_PREFIX: &str = "spiffe://trellis/cluster/";

/// The SAN URI naming a cluster (its CA carries it).
pub fn cluster_uri(cluster_id: &str) -> String {
    format!("{URI_PREFIX}{cluster_id}")
}

/// The SAN URI naming one service of a cluster.
pub fn service_uri(cluster_id: &str, service: &str) -> String {
    format!("{URI_PREFIX}{cluster_id}/{service}")
}

/// A verified caller (or server): its cluster, the service its certificate names, and the CA
/// it chained to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    pub cluster_id: String,
    pub service: String,
    pub ca_fingerprint: String,
}

/// The cluster a Trellis CA certificate names (its SAN URI `spiffe://trellis/cluster/<id>`).
pub fn ca_cluster_id(ca_pem: &str) -> Result<String> {
    let certs = parse_certs("ca_certificate", ca_pem)?;
    ca_cluster_id_der(certs[0].as_ref())
}

/// [`ca_cluster_id`] of a DER certificate.
pub(super) fn ca_cluster_id_der(der: &[u8]) -> Result<String> {
    let field = "ca_certificate";
    let der = CertificateDer::from(der);
    let parsed = webpki::EndEntityCert::try_from(&der)
        .map_err(|e| Error::invalid(field, format!("is not a certificate: {e}")))?;
    parsed
        .valid_uri_names()
        .find_map(|u| {
            u.strip_prefix(URI_PREFIX)
                .filter(|id| !id.is_empty() && !id.contains('/'))
                .map(str::to_owned)
        })
        .ok_or_else(|| {
            Error::invalid(
                field,
                format!("names no Trellis cluster ({URI_PREFIX}<id>)"),
            )
        })
}
