//! The rustls verifiers of both sides. They hold the trust store itself (a shared handle), not a
//! snapshot: each handshake asks [`super::verification::verify_chain`] against the store as it
//! is then. The server side asks
//! for a client certificate without requiring one (the peering handshake has none yet; the
//! method gate decides per RPC).

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::pin::CaCertHash;
use super::trust::TrustStore;
use super::verification::verify_chain;

/// The server side: optional client certificates, verified against the trust store.
#[derive(Debug)]
pub(super) struct PeerClientVerifier {
    pub(super) trust: TrustStore,
    pub(super) algorithms: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for PeerClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        // The handshake RPC has no certificate yet; the method gate decides per RPC.
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        verify_chain(
            &self.trust,
            end_entity,
            intermediates,
            now,
            webpki::KeyUsage::client_auth(),
            None,
        )
        .map(|_| ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The client side: the server must chain to a pinned CA (`expected`'s when given). With
/// `trust` absent, any certificate is accepted (first contact at the handshake, ADR 0014): the
/// TLS signatures are still checked, the identity is not.
#[derive(Debug)]
pub(super) struct PeerServerVerifier {
    pub(super) trust: Option<TrustStore>,
    pub(super) expected: Option<String>,
    /// First contact with a pinned CA (`--ca-cert-hash`): the chain must anchor at it.
    pub(super) pin: Option<CaCertHash>,
    pub(super) algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PeerServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if let Some(trust) = &self.trust {
            verify_chain(
                trust,
                end_entity,
                intermediates,
                now,
                webpki::KeyUsage::server_auth(),
                self.expected.as_deref(),
            )?;
        }
        if let Some(pin) = &self.pin {
            pin.verify(end_entity, intermediates, now)?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
