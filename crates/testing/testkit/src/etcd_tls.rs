//! Certificates for an etcd that requires TLS and client certificates ([`crate::Etcd::start_tls`]):
//! a test CA, etcd's server certificate for 127.0.0.1, a client certificate the CA signed, and
//! a second, unrelated CA for tests of a wrong one. Written as PEM files into etcd's directory.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The PEM files of a TLS etcd, for the flags of the service under test.
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    /// The CA that signed etcd's server certificate and the client certificate.
    pub ca: PathBuf,
    /// A client certificate etcd accepts, and its key.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A CA that signed nothing etcd uses (for "wrong CA" tests).
    pub other_ca: PathBuf,
    /// etcd's own server certificate and key.
    pub(crate) server_cert: PathBuf,
    pub(crate) server_key: PathBuf,
}

fn ca(name: &str) -> anyhow::Result<(CertificateParams, KeyPair, String)> {
    let key = KeyPair::generate().context("generating a CA key")?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let pem = params.self_signed(&key).context("self-signing a CA")?.pem();
    Ok((params, key, pem))
}

fn leaf(
    issuer: &Issuer<'_, &KeyPair>,
    name: &str,
    server: bool,
) -> anyhow::Result<(String, String)> {
    let key = KeyPair::generate().context("generating a key")?;
    let mut params = CertificateParams::default();
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    if server {
        params.subject_alt_names = vec![
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::DnsName("localhost".try_into().context("dns name")?),
        ];
    }
    let cert = params.signed_by(&key, issuer).context("signing")?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Writes a fresh set of files into `dir`.
pub(crate) fn write(dir: &Path) -> anyhow::Result<EtcdTlsFiles> {
    let (ca_params, ca_key, ca_pem) = ca("trellis test etcd CA")?;
    let issuer = Issuer::from_params(&ca_params, &ca_key);
    let (server_cert, server_key) = leaf(&issuer, "etcd", true)?;
    let (client_cert, client_key) = leaf(&issuer, "trellis-service", false)?;
    let (_, _, other_pem) = ca("some other CA")?;
    let files = EtcdTlsFiles {
        ca: dir.join("ca.pem"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client-key.pem"),
        other_ca: dir.join("other-ca.pem"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server-key.pem"),
    };
    for (path, pem) in [
        (&files.ca, &ca_pem),
        (&files.client_cert, &client_cert),
        (&files.client_key, &client_key),
        (&files.other_ca, &other_pem),
        (&files.server_cert, &server_cert),
        (&files.server_key, &server_key),
    ] {
        std::fs::write(path, pem).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(files)
}
