//! A service's own side of mutual TLS: its cluster's CA, its certificate and key, and the
//! store of the peers' pinned CAs. The certificate is swappable and re-read when its files
//! change, so that renewal needs no restart. The rustls configurations built from it are in
//! [`super::listener`] (server) and [`super::channel`] (client).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::SignatureScheme;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{PrivateKeyDer, UnixTime};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use trellis_error::{Error, Result};

use super::pem::parse_certs;
use super::pin::CaCertHash;
use super::trust::{PinnedCa, TrustStore};
use super::verification::{provider, verify_chain};

/// This service's certificate and key, swappable for renewal.
pub(super) struct OwnCert {
    pub(super) current: RwLock<Arc<CertifiedKey>>,
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

    /// The DER of the certificate in use (the chain's first).
    pub(super) fn current_leaf(&self) -> Option<Vec<u8>> {
        self.get()?.cert.first().map(|c| c.as_ref().to_vec())
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

impl TlsFiles {
    /// When each file last changed: CA, certificate, key.
    fn modified(&self) -> [Option<SystemTime>; 3] {
        [
            modified(&self.ca_cert),
            modified(&self.cert),
            modified(&self.key),
        ]
    }
}

struct Inner {
    cluster_id: String,
    /// Our cluster's CA: replaced by a reload when the cluster moved to its next CA.
    own_ca: RwLock<PinnedCa>,
    own: Arc<OwnCert>,
    trust: TrustStore,
    files: Option<TlsFiles>,
    /// Modification times of the CA, certificate and key files last loaded.
    loaded: RwLock<[Option<SystemTime>; 3]>,
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
            .field("ca.sha256", &self.own_ca().fingerprint)
            .field("pinned", &self.inner.trust)
            .finish_non_exhaustive()
    }
}

/// A certificate (chain) and its key, checked to match each other only.
pub(super) fn load_certified(cert_pem: &str, key_pem: &str) -> Result<CertifiedKey> {
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

impl PeerTls {
    /// From PEM strings: our cluster's CA certificate, our certificate (chain) and key.
    pub fn new(cluster_id: &str, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self> {
        let own_ca = PinnedCa::from_pem(cluster_id, ca_pem)?;
        let certified = certified_key(cluster_id, &own_ca, cert_pem, key_pem)?;
        Ok(Self {
            inner: Arc::new(Inner {
                cluster_id: cluster_id.to_owned(),
                own_ca: RwLock::new(own_ca),
                own: Arc::new(OwnCert {
                    current: RwLock::new(Arc::new(certified)),
                }),
                trust: TrustStore::default(),
                files: None,
                loaded: RwLock::new([None; 3]),
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
                own_ca: RwLock::new(own_ca),
                own: Arc::new(OwnCert {
                    current: RwLock::new(Arc::new(certified)),
                }),
                trust: TrustStore::default(),
                files: Some(files.clone()),
                loaded: RwLock::new(files.modified()),
            }),
        })
    }

    pub fn cluster_id(&self) -> &str {
        &self.inner.cluster_id
    }

    /// Our cluster's CA, as last loaded.
    fn own_ca(&self) -> PinnedCa {
        self.inner
            .own_ca
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Our cluster's CA certificate (PEM), sent to peers at the handshake.
    pub fn ca_pem(&self) -> String {
        self.own_ca().pem
    }

    /// The pinned peers.
    pub fn trust(&self) -> &TrustStore {
        &self.inner.trust
    }

    /// Our certificate and key as rustls resolves them, for the server and client
    /// configurations.
    pub(super) fn own_cert(&self) -> &Arc<OwnCert> {
        &self.inner.own
    }

    /// Our cluster's CA certificate (DER).
    pub(super) fn own_ca_der(&self) -> Vec<u8> {
        self.own_ca().der.as_ref().to_vec()
    }

    /// Replaces our certificate and key (renewal): new connections present the new one, open
    /// connections keep theirs.
    pub fn renew(&self, cert_pem: &str, key_pem: &str) -> Result<()> {
        self.renew_with(self.own_ca(), cert_pem, key_pem)
    }

    /// [`Self::renew`] with `ca` as our CA from now on (the cluster moved to its next CA): the
    /// certificate must chain to it, or nothing changes.
    fn renew_with(&self, ca: PinnedCa, cert_pem: &str, key_pem: &str) -> Result<()> {
        let certified = certified_key(&self.inner.cluster_id, &ca, cert_pem, key_pem)?;
        let moved = self.own_ca().fingerprint != ca.fingerprint;
        if moved {
            tracing::info!(ca.sha256 = %ca.fingerprint, "this cluster's CA changed: certificates of the new one from now on");
        }
        if let Ok(mut own) = self.inner.own_ca.write() {
            *own = ca;
        }
        if let Ok(mut current) = self.inner.own.current.write() {
            *current = Arc::new(certified);
        }
        tracing::info!("renewed the service certificate");
        Ok(())
    }

    /// Re-reads the CA, certificate and key files when their modification times changed. True
    /// when a new certificate is in use. A broken new set keeps the old one (and says why).
    pub fn reload(&self) -> anyhow::Result<bool> {
        let Some(files) = &self.inner.files else {
            return Ok(false);
        };
        let now = files.modified();
        let unchanged = self.inner.loaded.read().is_ok_and(|l| *l == now);
        if unchanged {
            return Ok(false);
        }
        let ca = read(&files.ca_cert, "CA certificate")?;
        let ca = PinnedCa::from_pem(&self.inner.cluster_id, &ca)
            .map_err(|e| anyhow::anyhow!("{}: {e}", files.ca_cert.display()))?;
        let cert = read(&files.cert, "certificate")?;
        let key = read(&files.key, "private key")?;
        self.renew_with(ca, &cert, &key)?;
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

    /// The hash of this cluster's CA, what a join command pins.
    pub fn own_ca_hash(&self) -> Result<CaCertHash> {
        CaCertHash::of_der(self.own_ca().der.as_ref())
    }
}
