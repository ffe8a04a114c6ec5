//! Inter-cluster mutual TLS (ADR 0014).
//!
//! - [`ClusterCa`]: a cluster's CA (generated once) and the service certificates it issues, each
//!   naming the cluster in a SAN URI `spiffe://trellis/cluster/<id>/<service>`;
//! - [`TrustStore`]: the peers' CAs pinned at the peering handshake, changed at run time;
//! - [`PeerTls`]: a service's own certificate (re-read when its files change) plus the trust
//!   store, giving rustls server and client configurations whose verifiers read the trust store
//!   at every TLS handshake;
//! - [`incoming`]: the accept loop of the peer listener, whose connections carry the verified
//!   caller ([`PeerConnectInfo`]) into every request's extensions;
//! - [`peer_channel`], [`handshake_channel`] (and [`cluster_channel`], [`first_contact_channel`],
//!   plaintext without TLS): client channels to other clusters.
//!
//! A caller's cluster is the owner of the pinned CA its chain verifies against, and its
//! certificate must name that same cluster: a peer's CA cannot mint another cluster's identity.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType, string::Ia5String,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, TrustAnchor, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Endpoint;
use tonic::transport::server::Connected;
use trellis_error::{Error, Result};

use crate::client::{Timeouts, TracedChannel};
use crate::metrics::Metrics;
use crate::propagation::TraceInterceptor;

/// Every Trellis identity URI starts with this, followed by the cluster ID.
pub const URI_PREFIX: &str = "spiffe://trellis/cluster/";

/// Lifetime of a service certificate issued by [`ClusterCa::issue`].
pub const SERVICE_CERT_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);

/// Lifetime of a generated cluster CA.
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// How long a TLS handshake on the peer listener may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Refused and timed-out handshakes on the peer listener, which anyone who reaches it can
/// cause: logged once per period ([`crate::log_limit`]).
static REFUSED_HANDSHAKES: crate::log_limit::LogLimit =
    crate::log_limit::LogLimit::new(crate::log_limit::PERIOD);

/// The SAN URI naming a cluster (its CA carries it).
pub fn cluster_uri(cluster_id: &str) -> String {
    format!("{URI_PREFIX}{cluster_id}")
}

/// The SAN URI naming one service of a cluster.
pub fn service_uri(cluster_id: &str, service: &str) -> String {
    format!("{URI_PREFIX}{cluster_id}/{service}")
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn algorithms() -> WebPkiSupportedAlgorithms {
    rustls::crypto::ring::default_provider().signature_verification_algorithms
}

fn tls_error(context: &str) -> impl Fn(String) -> Error + '_ {
    move |e| Error::invalid(context, e)
}

fn rcgen_error(context: &str) -> impl Fn(rcgen::Error) -> Error + '_ {
    move |e| Error::Internal(format!("{context}: {e}"))
}

/// SHA-256 of a DER certificate, lowercase hex: how operators and logs name a CA.
pub fn fingerprint(der: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, der)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
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

    /// The CA certificate, PEM: what peers pin.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA's private key, PEM. A secret: only the issuing tool needs it.
    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
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

/// The PEM text of a DER certificate.
fn pem_of(der: &CertificateDer<'_>) -> String {
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

fn parse_certs(field: &str, pem: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::invalid(field, format!("is not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(Error::invalid(field, "holds no certificate"));
    }
    Ok(certs)
}

/// A peer cluster's CA, pinned: which cluster it speaks for, and its trust anchor.
#[derive(Clone)]
pub struct PinnedCa {
    cluster_id: String,
    pem: String,
    der: CertificateDer<'static>,
    anchor: TrustAnchor<'static>,
    fingerprint: String,
}

impl fmt::Debug for PinnedCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedCa")
            .field("cluster_id", &self.cluster_id)
            .field("fingerprint", &self.fingerprint)
            .finish()
    }
}

impl PinnedCa {
    /// Parses cluster `cluster_id`'s CA certificate (exactly one PEM certificate, whose SAN
    /// must name that cluster).
    pub fn from_pem(cluster_id: &str, pem: &str) -> Result<Self> {
        let field = "ca_certificate";
        let mut certs = parse_certs(field, pem)?;
        if certs.len() != 1 {
            return Err(Error::invalid(field, "must hold exactly one certificate"));
        }
        let der = certs.remove(0);
        Self::from_der_with_pem(cluster_id, der, pem.to_owned())
    }

    /// A CA met as DER in a server's chain (first contact with a pinned hash).
    fn from_der(cluster_id: &str, der: CertificateDer<'static>) -> Result<Self> {
        let pem = pem_of(&der);
        Self::from_der_with_pem(cluster_id, der, pem)
    }

    fn from_der_with_pem(
        cluster_id: &str,
        der: CertificateDer<'static>,
        pem: String,
    ) -> Result<Self> {
        let field = "ca_certificate";
        let anchor = webpki::anchor_from_trusted_cert(&der)
            .map_err(|e| Error::invalid(field, format!("is not a usable CA certificate: {e}")))?
            .to_owned();
        let parsed = webpki::EndEntityCert::try_from(&der)
            .map_err(|e| Error::invalid(field, format!("is not a certificate: {e}")))?;
        let wanted = cluster_uri(cluster_id);
        if !parsed.valid_uri_names().any(|u| u == wanted) {
            return Err(Error::invalid(
                field,
                format!("does not name cluster {cluster_id} ({wanted})"),
            ));
        }
        Ok(Self {
            cluster_id: cluster_id.to_owned(),
            pem,
            fingerprint: fingerprint(&der),
            der,
            anchor,
        })
    }

    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// SHA-256 of the certificate, hex.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

/// The pinned CAs of the peers, by cluster ID. Clones share the set; verifiers read it at
/// every TLS handshake, so pinning and unpinning apply to the next connection.
#[derive(Clone, Default)]
pub struct TrustStore {
    pinned: Arc<RwLock<BTreeMap<String, Arc<PinnedCa>>>>,
}

impl fmt::Debug for TrustStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pinned = self.snapshot();
        f.debug_map()
            .entries(pinned.iter().map(|p| (&p.cluster_id, &p.fingerprint)))
            .finish()
    }
}

impl TrustStore {
    /// Pins `ca` for its cluster (replacing the previous one). True when something changed.
    pub fn pin(&self, ca: PinnedCa) -> bool {
        let Ok(mut pinned) = self.pinned.write() else {
            return false;
        };
        let changed = pinned
            .get(&ca.cluster_id)
            .is_none_or(|held| held.fingerprint != ca.fingerprint);
        if changed {
            tracing::info!(remote.id = %ca.cluster_id, ca.sha256 = %ca.fingerprint, "pinned a peer's CA");
            pinned.insert(ca.cluster_id.clone(), Arc::new(ca));
        }
        changed
    }

    /// Pins without logging: for the throw-away stores of self-checks.
    fn insert_quiet(&self, ca: PinnedCa) {
        if let Ok(mut pinned) = self.pinned.write() {
            pinned.insert(ca.cluster_id.clone(), Arc::new(ca));
        }
    }

    /// Forgets cluster `id`'s CA: its certificates are refused from now on.
    pub fn unpin(&self, id: &str) -> bool {
        let removed = self
            .pinned
            .write()
            .is_ok_and(|mut p| p.remove(id).is_some());
        if removed {
            tracing::info!(remote.id = %id, "unpinned a peer's CA");
        }
        removed
    }

    /// Replaces the whole set (what a sync from discovery found).
    pub fn replace(&self, cas: impl IntoIterator<Item = PinnedCa>) {
        let next: BTreeMap<String, Arc<PinnedCa>> = cas
            .into_iter()
            .map(|ca| (ca.cluster_id.clone(), Arc::new(ca)))
            .collect();
        if let Ok(mut pinned) = self.pinned.write() {
            for (id, ca) in &next {
                if pinned
                    .get(id)
                    .is_none_or(|h| h.fingerprint != ca.fingerprint)
                {
                    tracing::info!(remote.id = %id, ca.sha256 = %ca.fingerprint, "pinned a peer's CA");
                }
            }
            for id in pinned.keys() {
                if !next.contains_key(id) {
                    tracing::info!(remote.id = %id, "unpinned a peer's CA");
                }
            }
            *pinned = next;
        }
    }

    /// The CA pinned for `id`.
    pub fn get(&self, id: &str) -> Option<Arc<PinnedCa>> {
        self.pinned.read().ok()?.get(id).cloned()
    }

    /// Whether `id` is still pinned with the CA of fingerprint `fingerprint`.
    pub fn is_pinned(&self, id: &str, fingerprint: &str) -> bool {
        self.get(id).is_some_and(|ca| ca.fingerprint == fingerprint)
    }

    /// Every pinned CA.
    pub fn snapshot(&self) -> Vec<Arc<PinnedCa>> {
        self.pinned
            .read()
            .map(|p| p.values().cloned().collect())
            .unwrap_or_default()
    }
}

/// A verified caller (or server): its cluster, the service its certificate names, and the CA
/// it chained to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    pub cluster_id: String,
    pub service: String,
    pub ca_fingerprint: String,
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

/// The server side: optional client certificates, verified against the trust store.
#[derive(Debug)]
struct PeerClientVerifier {
    trust: TrustStore,
    algorithms: WebPkiSupportedAlgorithms,
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
struct PeerServerVerifier {
    trust: Option<TrustStore>,
    expected: Option<String>,
    /// First contact with a pinned CA (`--ca-cert-hash`): the chain must anchor at it.
    pin: Option<CaCertHash>,
    algorithms: WebPkiSupportedAlgorithms,
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

/// This service's certificate and key, swappable for renewal.
struct OwnCert {
    current: RwLock<Arc<CertifiedKey>>,
}

impl fmt::Debug for OwnCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnCert").finish_non_exhaustive()
    }
}

impl OwnCert {
    fn get(&self) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|c| c.clone())
    }
}

impl ResolvesServerCert for OwnCert {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.get()
    }
}

impl rustls::client::ResolvesClientCert for OwnCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.get()
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Where a service's TLS material lives (see [`crate::config::PeerTlsConfig`]).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub ca_cert: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn read(path: &Path, what: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the {what} {}: {e}", path.display()))
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

struct Inner {
    cluster_id: String,
    own_ca: PinnedCa,
    own: Arc<OwnCert>,
    trust: TrustStore,
    files: Option<TlsFiles>,
    loaded: RwLock<(Option<SystemTime>, Option<SystemTime>)>,
}

/// A service's mutual-TLS setup towards other clusters: its cluster's CA certificate, its own
/// certificate and key, and the peers' pinned CAs. `Debug` shows no key.
#[derive(Clone)]
pub struct PeerTls {
    inner: Arc<Inner>,
}

impl fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerTls")
            .field("cluster_id", &self.inner.cluster_id)
            .field("ca.sha256", &self.inner.own_ca.fingerprint)
            .field("pinned", &self.inner.trust)
            .finish_non_exhaustive()
    }
}

/// A certificate (chain) and its key, checked to match each other only.
fn load_certified(cert_pem: &str, key_pem: &str) -> Result<CertifiedKey> {
    let chain = parse_certs("tls cert", cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| Error::invalid("tls key", format!("is no PEM private key: {e}")))?;
    let signing = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| Error::invalid("tls key", format!("is not usable: {e}")))?;
    let certified = CertifiedKey::new(chain, signing);
    certified
        .keys_match()
        .map_err(|e| Error::invalid("tls key", format!("does not match the certificate: {e}")))?;
    Ok(certified)
}

fn certified_key(
    cluster_id: &str,
    own_ca: &PinnedCa,
    cert_pem: &str,
    key_pem: &str,
) -> Result<CertifiedKey> {
    let certified = load_certified(cert_pem, key_pem)?;
    let chain = &certified.cert;
    // Our own certificate must chain to our own CA and name our cluster, or peers would refuse
    // every call: better to fail at start.
    let own = TrustStore::default();
    own.insert_quiet(own_ca.clone());
    verify_chain(
        &own,
        &chain[0],
        &chain[1..],
        UnixTime::now(),
        webpki::KeyUsage::client_auth(),
        Some(cluster_id),
    )
    .map_err(|e| {
        Error::invalid(
            "tls cert",
            format!("is not a valid certificate of cluster {cluster_id} from its CA: {e}"),
        )
    })?;
    // Served with our CA, so that a peer pinning it by hash at first contact finds it.
    if chain.iter().any(|c| c.as_ref() == own_ca.der.as_ref()) {
        return Ok(certified);
    }
    let mut served = chain.clone();
    served.push(own_ca.der.clone());
    Ok(CertifiedKey::new(served, certified.key.clone()))
}

fn client_config(
    verifier: PeerServerVerifier,
    own: Option<Arc<OwnCert>>,
) -> Result<Arc<rustls::ClientConfig>> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| Error::Internal(format!("TLS client configuration: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    let mut config = match own {
        Some(own) => builder.with_client_cert_resolver(own),
        None => builder.with_no_client_auth(),
    };
    config.resumption = rustls::client::Resumption::disabled();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The cluster a Trellis CA certificate names (its SAN URI `spiffe://trellis/cluster/<id>`).
pub fn ca_cluster_id(ca_pem: &str) -> Result<String> {
    let certs = parse_certs("ca_certificate", ca_pem)?;
    ca_cluster_id_der(certs[0].as_ref())
}

/// [`ca_cluster_id`] of a DER certificate.
fn ca_cluster_id_der(der: &[u8]) -> Result<String> {
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

/// How a tool (trellisctl) calls one cluster's TLS listeners: the server must chain to that
/// cluster's CA and name that cluster; optionally the tool presents a certificate — whichever
/// cluster it belongs to: the server decides whether it trusts it. `Debug` shows no key.
#[derive(Clone)]
pub struct ToolTls {
    cluster_id: String,
    config: Arc<rustls::ClientConfig>,
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

impl PeerTls {
    /// From PEM strings: our cluster's CA certificate, our certificate (chain) and key.
    pub fn new(cluster_id: &str, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self> {
        let own_ca = PinnedCa::from_pem(cluster_id, ca_pem)?;
        let certified = certified_key(cluster_id, &own_ca, cert_pem, key_pem)?;
        Ok(Self {
            inner: Arc::new(Inner {
                cluster_id: cluster_id.to_owned(),
                own_ca,
                own: Arc::new(OwnCert {
                    current: RwLock::new(Arc::new(certified)),
                }),
                trust: TrustStore::default(),
                files: None,
                loaded: RwLock::new((None, None)),
            }),
        })
    }

    /// From files (PEM); [`PeerTls::reload`] re-reads the certificate and key when they change.
    pub fn from_files(cluster_id: &str, files: &TlsFiles) -> anyhow::Result<Self> {
        let ca = read(&files.ca_cert, "CA certificate")?;
        let cert = read(&files.cert, "certificate")?;
        let key = read(&files.key, "private key")?;
        let own_ca = PinnedCa::from_pem(cluster_id, &ca)
            .map_err(|e| anyhow::anyhow!("{}: {e}", files.ca_cert.display()))?;
        let certified = certified_key(cluster_id, &own_ca, &cert, &key)
            .map_err(|e| anyhow::anyhow!("{}: {e}", files.cert.display()))?;
        Ok(Self {
            inner: Arc::new(Inner {
                cluster_id: cluster_id.to_owned(),
                own_ca,
                own: Arc::new(OwnCert {
                    current: RwLock::new(Arc::new(certified)),
                }),
                trust: TrustStore::default(),
                files: Some(files.clone()),
                loaded: RwLock::new((modified(&files.cert), modified(&files.key))),
            }),
        })
    }

    pub fn cluster_id(&self) -> &str {
        &self.inner.cluster_id
    }

    /// Our cluster's CA certificate (PEM), sent to peers at the handshake.
    pub fn ca_pem(&self) -> &str {
        &self.inner.own_ca.pem
    }

    /// The pinned peers.
    pub fn trust(&self) -> &TrustStore {
        &self.inner.trust
    }

    /// Replaces our certificate and key (renewal): new connections present the new one, open
    /// connections keep theirs.
    pub fn renew(&self, cert_pem: &str, key_pem: &str) -> Result<()> {
        let certified = certified_key(
            &self.inner.cluster_id,
            &self.inner.own_ca,
            cert_pem,
            key_pem,
        )?;
        if let Ok(mut current) = self.inner.own.current.write() {
            *current = Arc::new(certified);
        }
        tracing::info!("renewed the service certificate");
        Ok(())
    }

    /// Re-reads the certificate and key files when their modification times changed. True when
    /// a new certificate is in use. A broken new pair keeps the old one (and says why).
    pub fn reload(&self) -> anyhow::Result<bool> {
        let Some(files) = &self.inner.files else {
            return Ok(false);
        };
        let now = (modified(&files.cert), modified(&files.key));
        let unchanged = self.inner.loaded.read().is_ok_and(|l| *l == now);
        if unchanged {
            return Ok(false);
        }
        let cert = read(&files.cert, "certificate")?;
        let key = read(&files.key, "private key")?;
        self.renew(&cert, &key)?;
        if let Ok(mut loaded) = self.inner.loaded.write() {
            *loaded = now;
        }
        Ok(true)
    }

    /// Checks the files every `period` until `shutdown` (certificate renewal without restart).
    pub fn spawn_reloader(
        &self,
        period: Duration,
        shutdown: crate::Shutdown,
    ) -> tokio::task::JoinHandle<()> {
        let tls = self.clone();
        crate::telemetry::spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(period) => {}
                }
                if let Err(err) = tls.reload() {
                    tracing::warn!(
                        error = format!("{err:#}"),
                        "keeping the current certificate"
                    );
                }
            }
        })
    }

    /// The server configuration of the peer listener.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>> {
        let verifier = Arc::new(PeerClientVerifier {
            trust: self.inner.trust.clone(),
            algorithms: algorithms(),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Internal(format!("TLS server configuration: {e}")))?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(self.inner.own.clone());
        config.alpn_protocols = vec![b"h2".to_vec()];
        // No session resumption: a resumed session skips the client verifier, so a CA unpinned
        // since would still get in.
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
        Ok(Arc::new(config))
    }

    fn client_config_with(
        &self,
        verifier: PeerServerVerifier,
        present: bool,
    ) -> Result<Arc<rustls::ClientConfig>> {
        client_config(verifier, present.then(|| self.inner.own.clone()))
    }

    /// A client configuration presenting our certificate and requiring the server to chain to
    /// a pinned CA (`expected`'s when given).
    pub fn client_config(&self, expected: Option<&str>) -> Result<Arc<rustls::ClientConfig>> {
        self.client_config_with(
            PeerServerVerifier {
                trust: Some(self.inner.trust.clone()),
                expected: expected.map(str::to_owned),
                pin: None,
                algorithms: algorithms(),
            },
            true,
        )
    }

    /// The first-contact configuration of the handshake: no client certificate, any server
    /// certificate (the token authenticates; ADR 0014).
    pub fn handshake_client_config(&self) -> Result<Arc<rustls::ClientConfig>> {
        self.client_config_with(
            PeerServerVerifier {
                trust: None,
                expected: None,
                pin: None,
                algorithms: algorithms(),
            },
            false,
        )
    }

    /// [`PeerTls::handshake_client_config`] that accepts only a server whose chain anchors at
    /// the CA `pin` names.
    pub fn pinned_handshake_client_config(
        &self,
        pin: CaCertHash,
    ) -> Result<Arc<rustls::ClientConfig>> {
        self.client_config_with(
            PeerServerVerifier {
                trust: None,
                expected: None,
                pin: Some(pin),
                algorithms: algorithms(),
            },
            false,
        )
    }

    /// The hash of this cluster's CA, what a join command pins.
    pub fn own_ca_hash(&self) -> Result<CaCertHash> {
        CaCertHash::of_der(self.inner.own_ca.der.as_ref())
    }
}

/// What a connection of the peer listener tells every request on it (a request extension;
/// read it with [`caller`]).
#[derive(Debug, Clone)]
pub struct PeerConnectInfo {
    pub remote_addr: Option<SocketAddr>,
    /// The verified caller; `None` when it presented no certificate.
    pub peer: Option<PeerIdentity>,
}

/// A TLS connection accepted on the peer listener.
#[derive(Debug)]
pub struct PeerStream {
    inner: tokio_rustls::server::TlsStream<TcpStream>,
    info: PeerConnectInfo,
}

impl Connected for PeerStream {
    type ConnectInfo = PeerConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The accepted, TLS-established connections of `listener`. Each handshake runs in a task of
/// its own (a slow client holds up nobody); a refused one is logged with the remote address
/// and why. The loop ends when the stream is dropped.
pub fn incoming(
    listener: TcpListener,
    tls: &PeerTls,
) -> Result<ReceiverStream<io::Result<PeerStream>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config()?);
    let trust = tls.trust().clone();
    crate::telemetry::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = tx.closed() => return,
                accepted = listener.accept() => accepted,
            };
            let (tcp, remote) = match accepted {
                Ok(found) => found,
                Err(err) => {
                    tracing::warn!(error = %err, "peer listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let (acceptor, tx, trust) = (acceptor.clone(), tx.clone(), trust.clone());
            crate::telemetry::spawn(async move {
                let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
                    .await
                {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(err)) => {
                        if let Some(held_back) = REFUSED_HANDSHAKES.admit() {
                            tracing::warn!(remote = %remote, error = %err, held_back, "refused a TLS connection on the peer listener");
                        }
                        return;
                    }
                    Err(_) => {
                        if let Some(held_back) = REFUSED_HANDSHAKES.admit() {
                            tracing::warn!(remote = %remote, held_back, "TLS handshake timed out on the peer listener");
                        }
                        return;
                    }
                };
                let peer = match stream.get_ref().1.peer_certificates() {
                    None | Some([]) => None,
                    Some([leaf, rest @ ..]) => match verify_chain(
                        &trust,
                        leaf,
                        rest,
                        UnixTime::now(),
                        webpki::KeyUsage::client_auth(),
                        None,
                    ) {
                        Ok(peer) => Some(peer),
                        Err(err) => {
                            if let Some(held_back) = REFUSED_HANDSHAKES.admit() {
                                tracing::warn!(remote = %remote, error = %err, held_back, "refused a TLS connection on the peer listener");
                            }
                            return;
                        }
                    },
                };
                let info = PeerConnectInfo {
                    remote_addr: Some(remote),
                    peer,
                };
                let _ = tx
                    .send(Ok(PeerStream {
                        inner: stream,
                        info,
                    }))
                    .await;
            });
        }
    });
    Ok(ReceiverStream::new(rx))
}

fn endpoint(field: &str, address: &str, timeouts: Timeouts) -> Result<(Endpoint, String)> {
    let bare = address
        .split_once("://")
        .map_or(address, |(_, rest)| rest)
        .trim_end_matches('/');
    let endpoint = Endpoint::from_shared(format!("http://{bare}"))
        .map_err(|e| Error::invalid(field, format!("{address:?} is not a usable address: {e}")))?;
    Ok((
        crate::client::configure(endpoint, timeouts),
        bare.to_owned(),
    ))
}

/// The connector of a TLS channel: TCP (with [`crate::client::KEEPALIVE`]) to the target, then
/// TLS with our configuration, both within the connect timeout.
#[derive(Clone)]
struct TlsConnect {
    connector: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
    target: String,
    timeout: Duration,
}

type TlsConnecting = Pin<
    Box<
        dyn Future<Output = io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>> + Send,
    >,
>;

impl tower::Service<http::Uri> for TlsConnect {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = TlsConnecting;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: http::Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let connect = async {
                let tcp = TcpStream::connect(&this.target).await?;
                tcp.set_nodelay(true)?;
                // tonic sets TCP keepalive only on sockets it opens itself.
                socket2::SockRef::from(&tcp).set_tcp_keepalive(&crate::client::KEEPALIVE.tcp())?;
                this.connector.connect(this.name.clone(), tcp).await
            };
            match tokio::time::timeout(this.timeout, connect).await {
                Ok(Ok(stream)) => Ok(TokioIo::new(stream)),
                Ok(Err(err)) => Err(err),
                Err(_) => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("TLS connection to {} timed out", this.target),
                )),
            }
        })
    }
}

/// A TLS endpoint not connected yet: [`TlsEndpoint::connect`] connects now (tools that report
/// an unreachable server before any call), [`TlsEndpoint::connect_lazy`] on first use.
pub struct TlsEndpoint {
    endpoint: Endpoint,
    connect: TlsConnect,
}

impl fmt::Debug for TlsEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsEndpoint")
            .field("target", &self.connect.target)
            .finish_non_exhaustive()
    }
}

impl TlsEndpoint {
    /// `address` (`host:port`, optionally with a scheme) over TLS with `config`. Fails only on a
    /// malformed address, named as `field`.
    pub fn new(
        field: &str,
        address: &str,
        timeouts: Timeouts,
        config: Arc<rustls::ClientConfig>,
    ) -> Result<Self> {
        let (endpoint, target) = endpoint(field, address, timeouts)?;
        let host = target
            .rsplit_once(':')
            .map_or(target.as_str(), |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let name = ServerName::try_from(host.clone())
            .map_err(|e| tls_error(field)(format!("{host:?} is no host name: {e}")))?;
        Ok(Self {
            endpoint,
            connect: TlsConnect {
                connector: tokio_rustls::TlsConnector::from(config),
                name,
                target,
                timeout: timeouts.connect,
            },
        })
    }

    /// Connects now.
    pub async fn connect(
        self,
    ) -> std::result::Result<tonic::transport::Channel, tonic::transport::Error> {
        self.endpoint.connect_with_connector(self.connect).await
    }

    /// Connects on first use.
    pub fn connect_lazy(self) -> tonic::transport::Channel {
        self.endpoint.connect_with_connector_lazy(self.connect)
    }
}

fn tls_channel(
    field: &str,
    address: &str,
    timeouts: Timeouts,
    config: Arc<rustls::ClientConfig>,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    let channel = TlsEndpoint::new(field, address, timeouts, config)?.connect_lazy();
    Ok(InterceptedService::new(
        metrics.meter_channel(channel),
        TraceInterceptor::default(),
    ))
}

/// A channel to another cluster's service over mutual TLS: we present our certificate, the
/// server must chain to the CA pinned for `expected` (any pinned CA when `None`).
pub fn peer_channel(
    tls: &PeerTls,
    field: &str,
    address: &str,
    expected: Option<&str>,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    tls_channel(
        field,
        address,
        timeouts,
        tls.client_config(expected)?,
        metrics,
    )
}

/// A channel to cluster `expected`'s service at `address`: over mutual TLS when `tls` is
/// configured (see [`peer_channel`]), plaintext otherwise (no TLS flags, ADR 0014).
pub fn cluster_channel(
    tls: Option<&PeerTls>,
    field: &str,
    address: &str,
    expected: &str,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    match tls {
        Some(tls) => peer_channel(tls, field, address, Some(expected), timeouts, metrics),
        None => crate::client::channel(field, address, timeouts, metrics),
    }
}

/// A first-contact channel (no client certificate, server unverified: see
/// [`handshake_channel`]) when `tls` is configured, plaintext otherwise.
pub fn first_contact_channel(
    tls: Option<&PeerTls>,
    field: &str,
    address: &str,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    match tls {
        Some(tls) => handshake_channel(tls, field, address, timeouts, metrics),
        None => crate::client::channel(field, address, timeouts, metrics),
    }
}

/// A channel to a cluster whose CA is `ca` but no longer pinned (the unpeering notice): we
/// present our certificate, the server must chain to `ca` and name its cluster.
pub fn peer_channel_pinned(
    tls: &PeerTls,
    field: &str,
    address: &str,
    ca: PinnedCa,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    let only = TrustStore::default();
    let expected = ca.cluster_id.clone();
    only.insert_quiet(ca);
    let config = tls.client_config_with(
        PeerServerVerifier {
            trust: Some(only),
            expected: Some(expected),
            pin: None,
            algorithms: algorithms(),
        },
        true,
    )?;
    tls_channel(field, address, timeouts, config, metrics)
}

/// A channel for the peering handshake that only reaches a server whose chain anchors at the
/// CA `pin` names (`--ca-cert-hash`): a man in the middle never sees the token.
pub fn pinned_handshake_channel(
    tls: &PeerTls,
    field: &str,
    address: &str,
    pin: CaCertHash,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    tls_channel(
        field,
        address,
        timeouts,
        tls.pinned_handshake_client_config(pin)?,
        metrics,
    )
}

/// A channel for the peering handshake: TLS without a client certificate, server unverified
/// (first contact; the token authenticates, ADR 0014).
pub fn handshake_channel(
    tls: &PeerTls,
    field: &str,
    address: &str,
    timeouts: Timeouts,
    metrics: &Metrics,
) -> Result<TracedChannel> {
    tls_channel(
        field,
        address,
        timeouts,
        tls.handshake_client_config()?,
        metrics,
    )
}

/// Who sent a request, as far as the transport knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The plaintext listener: an intra-cluster caller, or anyone who reached it.
    Plaintext,
    /// The peer listener, without a client certificate.
    Anonymous,
    /// The peer listener, with a verified certificate.
    Peer(PeerIdentity),
}

/// The caller of a request (from its extensions).
pub fn caller<T>(request: &tonic::Request<T>) -> Caller {
    caller_of(request.extensions())
}

/// The caller from request extensions (tonic's or http's).
pub fn caller_of(extensions: &http::Extensions) -> Caller {
    match extensions.get::<PeerConnectInfo>() {
        None => Caller::Plaintext,
        Some(PeerConnectInfo { peer: None, .. }) => Caller::Anonymous,
        Some(PeerConnectInfo {
            peer: Some(peer), ..
        }) => Caller::Peer(peer.clone()),
    }
}

mod pin;

pub use pin::CaCertHash;

#[cfg(test)]
mod tests;
