//! A cluster's certificate authority: generated once, loaded back from its PEM files, issuing
//! the certificates of the cluster's services. Only the issuing tool holds the key; services
//! get the CA certificate and their own certificate.

use std::fmt;
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, string::Ia5String,
};
use rustls::pki_types::{CertificateDer, UnixTime};
use trellis_error::{Error, Result};

use super::identity::{cluster_uri, service_uri};
use super::pem::{fingerprint, parse_certs};
use super::trust::{PinnedCa, TrustStore};
use super::verification::verify_chain;

/// Lifetime of a service certificate issued by [`ClusterCa::issue`].
pub const SERVICE_CERT_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);

/// Lifetime of a generated cluster CA.
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

fn rcgen_error(context: &str) -> impl Fn(rcgen::Error) -> Error + '_ {
    move |e| Error::Internal(format!("{context}: {e}"))
}

fn uri(value: String) -> Result<SanType> {
    Ia5String::try_from(value.clone())
        .map(SanType::URI)
        .map_err(|e| Error::invalid("cluster_id", format!("{value:?} is no URI: {e}")))
}

/// The parameters of cluster `cluster_id`'s CA. Deterministic apart from the validity, so a CA
/// loaded from its PEM files can issue again (rcgen needs the issuer's name and key usages).
fn ca_params(cluster_id: &str, not_before: SystemTime) -> Result<CertificateParams> {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, "trellis");
    name.push(DnType::CommonName, format!("trellis CA {cluster_id}"));
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.subject_alt_names = vec![uri(cluster_uri(cluster_id))?];
    params.not_before = not_before.into();
    params.not_after = (not_before + CA_LIFETIME).into();
    Ok(params)
}

/// A cluster's certificate authority: self-signed, naming the cluster, issuing the
/// certificates of the cluster's services. Its `Debug` shows the fingerprint, never the key.
pub struct ClusterCa {
    cluster_id: String,
    params: CertificateParams,
    key: KeyPair,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa")
            .field("cluster_id", &self.cluster_id)
            .field("fingerprint", &fingerprint(&self.cert_der))
            .finish_non_exhaustive()
    }
}

/// A service certificate and its private key, PEM. `Debug` hides the key.
#[derive(Clone)]
pub struct ServiceCert {
    pub cert_pem: String,
    key_pem: String,
}

impl fmt::Debug for ServiceCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceCert")
            .field("cert_pem", &format_args!("{} bytes", self.cert_pem.len()))
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl ServiceCert {
    /// The private key, PEM (PKCS#8). A secret.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }
}

/// What [`ClusterCa::issue_with`] puts in a certificate; tests use it for expired certificates
/// or certificates that claim another cluster.
#[derive(Debug, Clone)]
pub struct IssueOptions {
    /// The service name in the SAN URI.
    pub service: String,
    /// The cluster the SAN URI names; normally the CA's own.
    pub cluster_id: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl ClusterCa {
    /// A new CA for `cluster_id` (ECDSA P-256, valid ten years).
    pub fn generate(cluster_id: &str) -> Result<Self> {
        let key = KeyPair::generate().map_err(rcgen_error("generating the CA key"))?;
        let params = ca_params(cluster_id, SystemTime::now() - Duration::from_secs(3600))?;
        let cert = params
            .self_signed(&key)
            .map_err(rcgen_error("self-signing the CA"))?;
        Ok(Self {
            cluster_id: cluster_id.to_owned(),
            params,
            key,
            cert_pem: cert.pem(),
            cert_der: cert.der().clone(),
        })
    }

    /// A CA generated earlier by [`ClusterCa::generate`], from its certificate and key (PEM).
    /// Checked by issuing a throw-away certificate and verifying it against the certificate.
    pub fn load(cluster_id: &str, cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key = KeyPair::from_pem(key_pem)
            .map_err(|e| Error::invalid("ca key", format!("is no usable private key: {e}")))?;
        let pinned = PinnedCa::from_pem(cluster_id, cert_pem)?;
        let ca = Self {
            cluster_id: cluster_id.to_owned(),
            params: ca_params(cluster_id, SystemTime::now())?,
            key,
            cert_pem: cert_pem.to_owned(),
            cert_der: pinned.der.clone(),
        };
        let probe = ca.issue("probe")?;
        let trust = TrustStore::default();
        trust.insert_quiet(pinned);
        let chain = parse_certs("probe", &probe.cert_pem)?;
        verify_chain(
            &trust,
            &chain[0],
            &[],
            UnixTime::now(),
            webpki::KeyUsage::client_auth(),
            None,
        )
        .map_err(|e| {
            Error::invalid(
                "ca",
                format!("the key and certificate do not form a Trellis CA for {cluster_id}: {e}"),
            )
        })?;
        Ok(ca)
    }

    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The CA certificate's SHA-256 fingerprint (hex), as a pinned CA shows it.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert_der)
    }

    /// The CA certificate, PEM: what peers pin.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's private key, PEM. A secret: only the issuing tool needs it.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// The next CA of this cluster, and a certificate of it signed by this one (a cross
    /// certificate, PEM): served after a service's own certificate, it lets a peer that still
    /// pins this CA verify certificates of the next one, so the cluster can switch to the next
    /// CA at once and tell its peers afterwards (ADR 0027). Both CAs have the same name: only
    /// the key and the validity differ, and a CA loaded from its files issues alike.
    pub fn next(&self) -> Result<(Self, String)> {
        let next = Self::generate(&self.cluster_id)?;
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cross = next
            .params
            .signed_by(&next.key, &issuer)
            .map_err(rcgen_error("cross-signing the next CA"))?;
        Ok((next, cross.pem()))
    }

    /// A certificate for `service` of this cluster, valid [`SERVICE_CERT_LIFETIME`].
    pub fn issue(&self, service: &str) -> Result<ServiceCert> {
        let now = SystemTime::now();
        self.issue_with(&IssueOptions {
            service: service.to_owned(),
            cluster_id: self.cluster_id.clone(),
            not_before: now - Duration::from_secs(300),
            not_after: now + SERVICE_CERT_LIFETIME,
        })
    }

    /// A certificate with explicit contents (see [`IssueOptions`]).
    pub fn issue_with(&self, options: &IssueOptions) -> Result<ServiceCert> {
        let key = KeyPair::generate().map_err(rcgen_error("generating a service key"))?;
        let mut params = CertificateParams::default();
        let mut name = DistinguishedName::new();
        name.push(DnType::OrganizationName, "trellis");
        name.push(
            DnType::CommonName,
            format!("{}.{}", options.service, options.cluster_id),
        );
        params.distinguished_name = name;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.subject_alt_names = vec![uri(service_uri(&options.cluster_id, &options.service))?];
        params.not_before = options.not_before.into();
        params.not_after = options.not_after.into();
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params
            .signed_by(&key, &issuer)
            .map_err(rcgen_error("signing a service certificate"))?;
        Ok(ServiceCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::PeerTls;

    #[test]
    fn a_ca_survives_its_pem_files_and_keeps_issuing() {
        let ca = ClusterCa::generate("leaf-a").expect("CA");
        let loaded = ClusterCa::load("leaf-a", ca.cert_pem(), &ca.key_pem()).expect("loads");
        let cert = loaded.issue("ipam").expect("issues");
        PeerTls::new("leaf-a", ca.cert_pem(), &cert.cert_pem, cert.key_pem()).expect("valid");
        // The wrong key for the certificate is caught at load time.
        let other = ClusterCa::generate("leaf-a").expect("CA");
        ClusterCa::load("leaf-a", ca.cert_pem(), &other.key_pem()).expect_err("mismatch");
        // A CA naming another cluster cannot be pinned for this one.
        PinnedCa::from_pem("leaf-b", ca.cert_pem()).expect_err("names leaf-a");
        // Debug output carries no key material.
        let shown = format!("{ca:?} {cert:?}");
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
    }
}
