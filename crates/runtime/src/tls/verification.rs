//! The one check behind every verifier, the peer listener's per-connection identity and the
//! self-checks of loaded CAs and certificates: a chain verified against the pinned CAs, and the
//! caller's SPIFFE identity read from it.
//!
//! A caller's cluster is the owner of the pinned CA its chain verifies against, and its
//! certificate must name that same cluster: a peer's CA cannot mint another cluster's identity.

use std::sync::Arc;

use rustls::CertificateError;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, TrustAnchor, UnixTime};

use super::identity::{PeerIdentity, URI_PREFIX};
use super::trust::{PinnedCa, TrustStore};

pub(super) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

pub(super) fn algorithms() -> WebPkiSupportedAlgorithms {
    rustls::crypto::ring::default_provider().signature_verification_algorithms
}

fn pki_error(e: webpki::Error) -> rustls::Error {
    rustls::Error::InvalidCertificate(match e {
        webpki::Error::CertExpired { .. } => CertificateError::Expired,
        webpki::Error::CertNotValidYet { .. } => CertificateError::NotValidYet,
        webpki::Error::UnknownIssuer => CertificateError::UnknownIssuer,
        webpki::Error::InvalidSignatureForPublicKey => CertificateError::BadSignature,
        webpki::Error::CertRevoked => CertificateError::Revoked,
        other => {
            return rustls::Error::General(format!("certificate refused: {other}"));
        }
    })
}

/// Verifies `end_entity` (with `intermediates`) against the pinned CAs (only `expected`'s when
/// given) at `now`, and finds whose: the anchoring CA's cluster, which the certificate's SAN
/// must name too.
pub fn verify_chain(
    trust: &TrustStore,
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    now: UnixTime,
    usage: webpki::KeyUsage,
    expected: Option<&str>,
) -> std::result::Result<PeerIdentity, rustls::Error> {
    let pinned: Vec<Arc<PinnedCa>> = trust
        .snapshot()
        .into_iter()
        .filter(|ca| expected.is_none_or(|e| ca.cluster_id == e))
        .collect();
    if pinned.is_empty() {
        return Err(rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer,
        ));
    }
    let cert = webpki::EndEntityCert::try_from(end_entity).map_err(pki_error)?;
    let anchors: Vec<TrustAnchor<'_>> = pinned.iter().map(|ca| ca.anchor.clone()).collect();
    let path = cert
        .verify_for_usage(
            algorithms().all,
            &anchors,
            intermediates,
            now,
            usage,
            None,
            None,
        )
        .map_err(pki_error)?;
    let anchor = path.anchor();
    let named: Vec<&str> = cert.valid_uri_names().collect();
    for ca in &pinned {
        if ca.anchor.subject != anchor.subject
            || ca.anchor.subject_public_key_info != anchor.subject_public_key_info
        {
            continue;
        }
        let prefix = format!("{URI_PREFIX}{}/", ca.cluster_id);
        let service = named.iter().find_map(|u| {
            u.strip_prefix(&prefix)
                .filter(|s| !s.is_empty() && !s.contains('/'))
        });
        if let Some(service) = service {
            return Ok(PeerIdentity {
                cluster_id: ca.cluster_id.clone(),
                service: service.to_owned(),
                ca_fingerprint: ca.fingerprint.clone(),
            });
        }
    }
    Err(rustls::Error::InvalidCertificate(
        CertificateError::NotValidForName,
    ))
}
