//! Pinning a cluster's CA before first contact (the `--ca-cert-hash sha256:HEX` of a join
//! command, as kubeadm's `--discovery-token-ca-cert-hash`): the SHA-256 of the CA certificate's
//! DER SubjectPublicKeyInfo. A leaf given the hub's hash out of band refuses, during the TLS
//! handshake and so before any token is sent, a server whose chain does not anchor at that CA.
//! Servers send their CA with their certificate so that the client can find it.

use std::fmt;

use rustls::pki_types::{CertificateDer, UnixTime};
use trellis_error::{Error, Result};

use super::identity::ca_cluster_id_der;
use super::pem::parse_certs;
use super::trust::{PinnedCa, TrustStore};
use super::verification::verify_chain;

/// The SHA-256 of a CA's SubjectPublicKeyInfo.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CaCertHash([u8; 32]);

impl CaCertHash {
    /// Parses `sha256:` followed by 64 hexadecimal digits; the error names `field`.
    pub fn parse(field: &str, text: &str) -> Result<Self> {
        let hex = text.strip_prefix("sha256:").ok_or_else(|| {
            Error::invalid(
                field,
                "must start with \"sha256:\" (as `trellisctl token --join` prints it)",
            )
        })?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(Error::invalid(
                field,
                "must be sha256: followed by 64 hexadecimal digits",
            ));
        }
        let mut out = [0u8; 32];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| Error::invalid(field, "is not hexadecimal"))?;
        }
        Ok(Self(out))
    }

    /// The hash of the CA certificate `der`.
    pub fn of_der(der: &[u8]) -> Result<Self> {
        let der = CertificateDer::from(der);
        let anchor = webpki::anchor_from_trusted_cert(&der).map_err(|e| {
            Error::invalid("ca_certificate", format!("is not a CA certificate: {e}"))
        })?;
        // The anchor holds the SubjectPublicKeyInfo's contents; the hash is over the whole
        // DER structure, so the SEQUENCE header goes back in front.
        let contents: &[u8] = anchor.subject_public_key_info.as_ref();
        let mut spki = vec![0x30];
        let len = contents.len();
        if len < 0x80 {
            spki.push(u8::try_from(len).unwrap_or(0));
        } else if len < 0x100 {
            spki.extend([0x81, u8::try_from(len).unwrap_or(0)]);
        } else {
            spki.extend([
                0x82,
                u8::try_from(len >> 8).unwrap_or(0),
                (len & 0xff) as u8,
            ]);
        }
        spki.extend_from_slice(contents);
        let digest = ring::digest::digest(&ring::digest::SHA256, &spki);
        let mut out = [0u8; 32];
        out.copy_from_slice(digest.as_ref());
        Ok(Self(out))
    }

    /// The hash of the CA certificate in `pem`.
    pub fn of_pem(pem: &str) -> Result<Self> {
        let certs = parse_certs("ca_certificate", pem)?;
        Self::of_der(certs[0].as_ref())
    }

    /// Checks a server's chain during first contact: one of its certificates is the pinned CA,
    /// and the server certificate chains to it and names that CA's cluster.
    pub(super) fn verify(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<(), rustls::Error> {
        let refused = || {
            rustls::Error::General(format!(
                "the server's certificate does not chain to the pinned CA {self}"
            ))
        };
        let ca = intermediates
            .iter()
            .find(|c| Self::of_der(c.as_ref()).is_ok_and(|h| h == *self))
            .ok_or_else(refused)?;
        let cluster = ca_cluster_id_der(ca.as_ref()).map_err(|_| refused())?;
        let pinned =
            PinnedCa::from_der(&cluster, ca.clone().into_owned()).map_err(|_| refused())?;
        let trust = TrustStore::default();
        trust.insert_quiet(pinned);
        verify_chain(
            &trust,
            end_entity,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
            Some(&cluster),
        )
        .map(drop)
    }
}

impl fmt::Display for CaCertHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sha256:")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for CaCertHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CaCertHash({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::ClusterCa;

    #[test]
    fn a_ca_cert_hash_is_the_sha256_of_the_spki_and_parses_back() {
        let ca = ClusterCa::generate("hub").expect("CA");
        let hash = CaCertHash::of_pem(ca.cert_pem()).expect("hash");
        let key = rcgen::KeyPair::from_pem(&ca.key_pem()).expect("key");
        let spki = rcgen::PublicKeyData::subject_public_key_info(&key);
        let expected = ring::digest::digest(&ring::digest::SHA256, &spki);
        let hex: String = expected
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hash.to_string(), format!("sha256:{hex}"));
        assert_eq!(
            CaCertHash::parse("ca_cert_hash", &hash.to_string()).expect("parses"),
            hash
        );
        for bad in [
            "",
            "sha256:",
            "md5:00",
            "sha256:zz",
            &format!("sha1:{hex}"),
            &hex,
        ] {
            let err = CaCertHash::parse("ca_cert_hash", bad).expect_err(bad);
            assert!(err.to_string().contains("ca_cert_hash"), "{err}");
        }
    }
}
