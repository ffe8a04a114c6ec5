//! The peers' CAs, pinned at the peering handshake and changed at run time (peering, unpeering,
//! a sync from discovery). Verifiers read the store at every TLS handshake instead of copying
//! it into a rustls configuration, so an unpinned CA is refused from the next connection on.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, RwLock};

use rustls::pki_types::{CertificateDer, TrustAnchor};
use trellis_error::{Error, Result};

use super::identity::cluster_uri;
use super::pem::{fingerprint, parse_certs, pem_of};

/// A peer cluster's CA, pinned: which cluster it speaks for, and its trust anchor.
#[derive(Clone)]
pub struct PinnedCa {
    pub(super) cluster_id: String,
    pub(super) pem: String,
    pub(super) der: CertificateDer<'static>,
    pub(super) anchor: TrustAnchor<'static>,
    pub(super) fingerprint: String,
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
    pub(super) fn from_der(cluster_id: &str, der: CertificateDer<'static>) -> Result<Self> {
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
///
/// A peer that moved to a new CA (ADR 0027) is pinned with the new one only, so new
/// connections must chain to it; connections it opened before, authenticated by the CA it
/// moved from, stay admitted until they close ([`TrustStore::admits`]), as connections keep
/// their session across a certificate renewal. Unpinning the peer forgets both.
#[derive(Clone, Default)]
pub struct TrustStore {
    pinned: Arc<RwLock<BTreeMap<String, Arc<PinnedCa>>>>,
    /// Per peer, the fingerprints of the CAs it moved away from while pinned (the last few).
    moved_from: Arc<RwLock<BTreeMap<String, Vec<String>>>>,
}

/// How many CAs a peer moved away from are remembered.
const MOVED_FROM: usize = 4;

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
            if let Some(held) = pinned.insert(ca.cluster_id.clone(), Arc::new(ca)) {
                self.moved(&held);
            }
        }
        changed
    }

    /// Pins without logging: for the throw-away stores of self-checks.
    pub(super) fn insert_quiet(&self, ca: PinnedCa) {
        if let Ok(mut pinned) = self.pinned.write() {
            pinned.insert(ca.cluster_id.clone(), Arc::new(ca));
        }
    }

    /// Remembers that `from`'s cluster moved away from it.
    fn moved(&self, from: &PinnedCa) {
        if let Ok(mut moved) = self.moved_from.write() {
            let list = moved.entry(from.cluster_id.clone()).or_default();
            list.retain(|f| *f != from.fingerprint);
            list.push(from.fingerprint.clone());
            if list.len() > MOVED_FROM {
                list.remove(0);
            }
        }
    }

    /// Forgets cluster `id`'s CA: its certificates are refused from now on.
    pub fn unpin(&self, id: &str) -> bool {
        if let Ok(mut moved) = self.moved_from.write() {
            moved.remove(id);
        }
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
                match pinned.get(id) {
                    Some(held) if held.fingerprint == ca.fingerprint => {}
                    held => {
                        tracing::info!(remote.id = %id, ca.sha256 = %ca.fingerprint, "pinned a peer's CA");
                        if let Some(held) = held {
                            self.moved(held);
                        }
                    }
                }
            }
            for id in pinned.keys() {
                if !next.contains_key(id) {
                    tracing::info!(remote.id = %id, "unpinned a peer's CA");
                    if let Ok(mut moved) = self.moved_from.write() {
                        moved.remove(id);
                    }
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

    /// Whether a connection authenticated as `id` by the CA of fingerprint `fingerprint` may
    /// still call: `id` is pinned with that CA, or moved from it to the one pinned now (a
    /// connection opened before the move). Never after `id` was unpinned.
    pub fn admits(&self, id: &str, fingerprint: &str) -> bool {
        if self.get(id).is_none() {
            return false;
        }
        self.is_pinned(id, fingerprint)
            || self.moved_from.read().is_ok_and(|m| {
                m.get(id)
                    .is_some_and(|l| l.iter().any(|f| f == fingerprint))
            })
    }

    /// Every pinned CA.
    pub fn snapshot(&self) -> Vec<Arc<PinnedCa>> {
        self.pinned
            .read()
            .map(|p| p.values().cloned().collect())
            .unwrap_or_default()
    }
}
