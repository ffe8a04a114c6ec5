//! Certificates as text: PEM in (what operators and files hold) and out (a CA met as DER in a
//! server's chain, kept as PEM like the pinned ones), and the SHA-256 fingerprint logs and
//! operators name a certificate by. Everything else in [`super`] works on DER.

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use trellis_error::{Error, Result};

/// SHA-256 of a DER certificate, lowercase hex: how operators and logs name a CA.
pub fn fingerprint(der: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, der)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The PEM text of a DER certificate.
pub(super) fn pem_of(der: &CertificateDer<'_>) -> String {
    use base64::Engine as _;
    let text = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in text.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(line));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

pub(super) fn parse_certs(field: &str, pem: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::invalid(field, format!("is not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(Error::invalid(field, "holds no certificate"));
    }
    Ok(certs)
}
