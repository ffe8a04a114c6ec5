//! Certificates Trellis makes for itself (`--tls-dir`): no openssl, no files prepared by hand.
//!
//! The directory is shared by a cluster's services (a volume in compose, the lab's run
//! directory). The first service to start creates the cluster's CA in `ca/` (`ca.pem`,
//! `ca-key.pem`); the others find it there. Each service then issues its own certificate from
//! it into `<service>/` (`cert.pem`, `key.pem`), valid for `--tls-cert-lifetime`, and issues a
//! new one when a third of that lifetime is left; [`PeerTls::reload`](super::PeerTls::reload)
//! swaps it in without a restart, so open connections keep their session and new ones present
//! the new certificate.
//!
//! Creation is atomic where services race: the CA is written into a directory of its own and
//! renamed into place, so a loser of the race loads the winner's CA, never half of one; a
//! certificate and its key are written to temporary files and renamed. Keys are mode 0600 in
//! directories of mode 0700.
//!
//! The CA can be replaced while the cluster is peered ([`rotate_ca`], `trellisctl certs
//! rotate-ca`, ADR 0027): the next CA, with a certificate of it signed by the current one
//! (`cross.pem`), is written to `ca-next/` and swapped for `ca/`. Each service then finds its
//! certificate no longer chains to the CA, issues a new one and serves it followed by the
//! cross certificate, which peers still pinning the old CA verify through.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;

use super::ca::{ClusterCa, IssueOptions};
use super::expiry::pem_not_after;
use super::peer_tls::{PeerTls, TlsFiles};

/// A service's certificate lifetime unless `--tls-cert-lifetime` says otherwise: short, since
/// renewal is automatic.
pub const MANAGED_CERT_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);

/// One service's view of a managed TLS directory.
#[derive(Debug, Clone)]
pub struct ManagedTls {
    dir: PathBuf,
    cluster_id: String,
    service: String,
    lifetime: Duration,
}

fn mkdir(path: &Path) -> anyhow::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .with_context(|| format!("cannot create {}", path.display()))
}

/// Writes `contents` to `path` through a temporary file renamed into place.
fn write_atomically(path: &Path, contents: &str, mode: u32) -> anyhow::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    file.write_all(contents.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("cannot move {} into place", path.display()))
}

fn load_ca(ca_dir: &Path, cluster_id: &str) -> anyhow::Result<ClusterCa> {
    let read = |name: &str| {
        fs::read_to_string(ca_dir.join(name))
            .with_context(|| format!("cannot read {}", ca_dir.join(name).display()))
    };
    ClusterCa::load(cluster_id, &read("ca.pem")?, &read("ca-key.pem")?)
        .with_context(|| format!("the CA in {}", ca_dir.display()))
}

/// A rotation interrupted between its two renames left `ca-next/` and no `ca/`: finish it
/// (rather than let a service make a brand-new CA no peer knows).
fn finish_rotation(dir: &Path) -> anyhow::Result<()> {
    let (ca, next) = (dir.join("ca"), dir.join("ca-next"));
    if !ca.join("ca.pem").exists() && next.join("ca.pem").exists() {
        match fs::rename(&next, &ca) {
            Ok(()) => {
                tracing::info!(dir = %ca.display(), "finished moving to the cluster's next CA")
            }
            // Another service finished it first.
            Err(_) if ca.join("ca.pem").exists() => {}
            Err(err) => {
                return Err(err).with_context(|| {
                    format!("cannot move {} to {}", next.display(), ca.display())
                });
            }
        }
    }
    Ok(())
}

/// What [`rotate_ca`] did: the SHA-256 fingerprints of the CA before and after, and whether
/// it went on with a move not yet announced rather than starting one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotation {
    pub previous: String,
    pub current: String,
    pub resumed: bool,
}

/// Marks a CA whose move is not yet announced to every peer; holds the previous CA's
/// fingerprint. Another move before it is announced would leave peers pinning a CA that
/// vouches for nothing the cluster serves.
const ANNOUNCING: &str = "announcing";

/// Replaces cluster `cluster_id`'s CA in the managed directory `dir` by its next one, cross-signed
/// by the current one ([`ClusterCa::next`]). Safe to run again after an interruption: a next CA
/// already written is the one moved to, and a move not yet announced ([`announced`]) is
/// returned as it is instead of starting another. The services pick the CA up at their next
/// renewal check.
pub fn rotate_ca(dir: &Path, cluster_id: &str) -> anyhow::Result<Rotation> {
    let (ca_dir, next_dir) = (dir.join("ca"), dir.join("ca-next"));
    finish_rotation(dir)?;
    let current = load_ca(&ca_dir, cluster_id)?;
    if let Ok(previous) = fs::read_to_string(ca_dir.join(ANNOUNCING)) {
        return Ok(Rotation {
            previous: previous.trim().to_owned(),
            current: current.fingerprint(),
            resumed: true,
        });
    }
    if !next_dir.join("ca.pem").exists() {
        let (next, cross) = current.next()?;
        let tmp = dir.join(format!("ca-next.tmp.{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        mkdir(&tmp)?;
        write_atomically(&tmp.join("ca-key.pem"), &next.key_pem(), 0o600)?;
        write_atomically(&tmp.join("ca.pem"), next.cert_pem(), 0o644)?;
        write_atomically(&tmp.join("cross.pem"), &cross, 0o644)?;
        write_atomically(&tmp.join(ANNOUNCING), &current.fingerprint(), 0o644)?;
        fs::rename(&tmp, &next_dir)
            .with_context(|| format!("cannot move {} into place", next_dir.display()))?;
    }
    let next = load_ca(&next_dir, cluster_id)?;
    // Two renames: a crash between them leaves only ca-next/, which the next reader of the
    // directory moves into place ([`finish_rotation`]).
    let old = dir.join(format!("ca-old.{}", std::process::id()));
    fs::rename(&ca_dir, &old).with_context(|| format!("cannot move {} aside", ca_dir.display()))?;
    finish_rotation(dir)?;
    // The old key has signed what it had to (the cross certificate): it goes.
    fs::remove_dir_all(&old).with_context(|| format!("cannot remove {}", old.display()))?;
    let rotation = Rotation {
        previous: current.fingerprint(),
        current: next.fingerprint(),
        resumed: false,
    };
    tracing::info!(previous = %rotation.previous, current = %rotation.current, "moved the cluster to its next CA");
    Ok(rotation)
}

/// The move to the current CA is announced to every peer: the next [`rotate_ca`] starts a
/// new one.
pub fn announced(dir: &Path) -> anyhow::Result<()> {
    let marker = dir.join("ca").join(ANNOUNCING);
    match fs::remove_file(&marker) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            Err(err).with_context(|| format!("cannot remove {}", marker.display()))
        }
        _ => Ok(()),
    }
}

impl ManagedTls {
    pub fn new(dir: &Path, cluster_id: &str, service: &str, lifetime: Duration) -> Self {
        Self {
            dir: dir.to_owned(),
            cluster_id: cluster_id.to_owned(),
            service: service.to_owned(),
            lifetime,
        }
    }

    /// Where the CA, this service's certificate and its key are.
    pub fn files(&self) -> TlsFiles {
        let own = self.dir.join(&self.service);
        TlsFiles {
            ca_cert: self.dir.join("ca").join("ca.pem"),
            cert: own.join("cert.pem"),
            key: own.join("key.pem"),
        }
    }

    /// The cluster's CA: the one in the directory, or a new one put there first.
    pub fn ca(&self) -> anyhow::Result<ClusterCa> {
        mkdir(&self.dir)?;
        let ca_dir = self.dir.join("ca");
        finish_rotation(&self.dir)?;
        if !ca_dir.join("ca.pem").exists() {
            let ca = ClusterCa::generate(&self.cluster_id)?;
            let tmp = self
                .dir
                .join(format!("ca.tmp.{}.{}", self.service, std::process::id()));
            mkdir(&tmp)?;
            write_atomically(&tmp.join("ca-key.pem"), &ca.key_pem(), 0o600)?;
            write_atomically(&tmp.join("ca.pem"), ca.cert_pem(), 0o644)?;
            // Whoever renames first wins; the others load the winner's CA below.
            match fs::rename(&tmp, &ca_dir) {
                Ok(()) => tracing::info!(dir = %ca_dir.display(), "created the cluster's CA"),
                Err(_) => {
                    let _ = fs::remove_dir_all(&tmp);
                }
            }
        }
        load_ca(&ca_dir, &self.cluster_id)
    }

    /// Whether this service needs a new certificate: none yet, unreadable, not of the
    /// cluster's current CA (it moved to its next one), or a third of its lifetime or less left.
    pub fn due(&self, now: SystemTime) -> bool {
        let files = self.files();
        let (Ok(pem), Ok(key), Ok(ca)) = (
            fs::read_to_string(&files.cert),
            fs::read_to_string(&files.key),
            fs::read_to_string(&files.ca_cert),
        ) else {
            return true;
        };
        if PeerTls::new(&self.cluster_id, &ca, &pem, &key).is_err() {
            return true;
        }
        match pem_not_after(&pem) {
            Ok(end) => end
                .duration_since(now)
                .map_or(true, |left| left < self.lifetime / 3),
            Err(_) => true,
        }
    }

    /// Issues this service a certificate valid for the lifetime from now, and writes it with
    /// its key.
    pub fn issue(&self, ca: &ClusterCa) -> anyhow::Result<()> {
        let now = SystemTime::now();
        let cert = ca.issue_with(&IssueOptions {
            service: self.service.clone(),
            cluster_id: self.cluster_id.clone(),
            // A minute's slack for clocks a little behind ours.
            not_before: now - Duration::from_secs(60),
            not_after: now + self.lifetime,
        })?;
        let files = self.files();
        if let Some(parent) = files.cert.parent() {
            mkdir(parent)?;
        }
        // Served after the certificate while there is one: peers still pinning the previous
        // CA verify through it.
        let cross = fs::read_to_string(self.dir.join("ca").join("cross.pem")).unwrap_or_default();
        write_atomically(&files.key, cert.key_pem(), 0o600)?;
        write_atomically(&files.cert, &format!("{}{cross}", cert.cert_pem), 0o644)?;
        tracing::info!(
            service = %self.service,
            lifetime_secs = self.lifetime.as_secs(),
            "issued this service's certificate"
        );
        Ok(())
    }

    /// The CA, and this service's certificate when due: what a service does at start.
    pub fn prepare(&self) -> anyhow::Result<TlsFiles> {
        let ca = self.ca()?;
        if self.due(SystemTime::now()) {
            self.issue(&ca)?;
        }
        Ok(self.files())
    }

    /// Checks whether renewal is due often enough, issues a new certificate then, and swaps it
    /// into `tls`; until `shutdown`.
    pub fn spawn_renewer(
        self,
        tls: PeerTls,
        at_most: Duration,
        shutdown: crate::Shutdown,
    ) -> tokio::task::JoinHandle<()> {
        let every = self.check_every(at_most);
        crate::telemetry::spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(every) => {}
                }
                let renewed = if self.due(SystemTime::now()) {
                    self.ca().and_then(|ca| self.issue(&ca))
                } else {
                    Ok(())
                };
                if let Err(err) = renewed.and_then(|()| tls.reload().map(|_| ())) {
                    tracing::warn!(
                        error = format!("{err:#}"),
                        "could not renew this service's certificate; keeping the current one"
                    );
                }
            }
        })
    }

    /// How often to check whether renewal is due: often enough that a certificate is renewed
    /// well within the last third of its lifetime.
    pub fn check_every(&self, at_most: Duration) -> Duration {
        (self.lifetime / 12).clamp(
            Duration::from_millis(100),
            at_most.max(Duration::from_millis(100)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_share_one_ca_and_renew_their_own_certificates() {
        let dir = tempfile::tempdir().expect("tempdir");
        let lifetime = Duration::from_secs(3600);
        let broker = ManagedTls::new(dir.path(), "hub", "broker", lifetime);
        let ipam = ManagedTls::new(dir.path(), "hub", "ipam", lifetime);
        let (b, i) = (
            broker.prepare().expect("broker"),
            ipam.prepare().expect("ipam"),
        );
        assert_eq!(b.ca_cert, i.ca_cert, "one CA for the cluster");
        let tls = PeerTls::from_files("hub", &b).expect("a usable setup");
        assert_eq!(tls.cluster_id(), "hub");
        use std::os::unix::fs::PermissionsExt as _;
        for key in [&b.key, &dir.path().join("ca").join("ca-key.pem")] {
            let mode = fs::metadata(key).expect("key").permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", key.display());
        }
        // Fresh: not due; two thirds of the lifetime later: due.
        let now = SystemTime::now();
        assert!(!broker.due(now));
        assert!(broker.due(now + lifetime * 2 / 3 + Duration::from_secs(60)));
        // A restart keeps the certificate that is not due.
        let before = fs::read_to_string(&b.cert).expect("cert");
        broker.prepare().expect("again");
        assert_eq!(fs::read_to_string(&b.cert).expect("cert"), before);
        // Renewal writes a new one that the running setup swaps in.
        broker.issue(&broker.ca().expect("ca")).expect("renews");
        assert_ne!(fs::read_to_string(&b.cert).expect("cert"), before);
        assert!(
            tls.reload().expect("reloads"),
            "the new certificate was not taken"
        );
    }

    /// Whether a peer pinning `ca_pem` takes `files`' certificate chain, as a TLS handshake
    /// checks it.
    fn trusted_by(ca_pem: &str, files: &TlsFiles) -> bool {
        let trust = super::super::trust::TrustStore::default();
        trust.insert_quiet(super::super::trust::PinnedCa::from_pem("hub", ca_pem).expect("a CA"));
        let chain =
            super::super::pem::parse_certs("cert", &fs::read_to_string(&files.cert).expect("cert"))
                .expect("pem");
        super::super::verification::verify_chain(
            &trust,
            &chain[0],
            &chain[1..],
            rustls::pki_types::UnixTime::now(),
            webpki::KeyUsage::client_auth(),
            Some("hub"),
        )
        .is_ok()
    }

    #[test]
    fn a_rotation_moves_every_service_to_the_next_ca_which_peers_of_the_old_one_still_verify() {
        let dir = tempfile::tempdir().expect("tempdir");
        let broker = ManagedTls::new(dir.path(), "hub", "broker", Duration::from_secs(3600));
        let files = broker.prepare().expect("prepared");
        let tls = PeerTls::from_files("hub", &files).expect("a setup");
        let old = fs::read_to_string(&files.ca_cert).expect("ca");
        assert!(!broker.due(SystemTime::now()));

        let rotation = rotate_ca(dir.path(), "hub").expect("rotates");
        assert!(!rotation.resumed);
        let new = fs::read_to_string(&files.ca_cert).expect("ca");
        assert_ne!(old, new);
        assert_eq!(
            rotation.current,
            super::super::trust::PinnedCa::from_pem("hub", &new)
                .expect("ca")
                .fingerprint()
        );
        // The certificate of the old CA is due at once, whatever its lifetime says.
        assert!(broker.due(SystemTime::now()));
        broker.issue(&broker.ca().expect("ca")).expect("issues");
        assert!(
            tls.reload().expect("reloads"),
            "the new CA's certificate is taken"
        );
        assert_eq!(
            tls.ca_pem(),
            new,
            "the CA sent at handshakes is the new one"
        );
        assert!(!broker.due(SystemTime::now()));
        // Served with the cross certificate, it verifies for peers pinning either CA; a
        // certificate of the old CA does not verify for a peer that pins the new one.
        assert!(trusted_by(&old, &files), "a peer pinning the old CA");
        assert!(trusted_by(&new, &files), "a peer pinning the new CA");

        // Not announced yet: running it again goes on with this move, never a third CA.
        let again = rotate_ca(dir.path(), "hub").expect("resumes");
        assert!(again.resumed);
        assert_eq!(again.current, rotation.current);
        assert_eq!(fs::read_to_string(&files.ca_cert).expect("ca"), new);
        announced(dir.path()).expect("marked");
        let next = rotate_ca(dir.path(), "hub").expect("a new move");
        assert!(!next.resumed);
        assert_eq!(next.previous, rotation.current);
        // Nothing left behind: not the old CA's key, not a half-written next CA.
        let leftovers: Vec<_> = fs::read_dir(dir.path())
            .expect("dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "ca" && n != "broker")
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn a_rotation_cut_between_its_renames_is_finished_not_replaced_by_a_new_ca() {
        let dir = tempfile::tempdir().expect("tempdir");
        let broker = ManagedTls::new(dir.path(), "hub", "broker", Duration::from_secs(3600));
        broker.prepare().expect("prepared");
        let current = broker.ca().expect("ca");
        let (next, cross) = current.next().expect("next");
        let next_dir = dir.path().join("ca-next");
        mkdir(&next_dir).expect("dir");
        write_atomically(&next_dir.join("ca.pem"), next.cert_pem(), 0o644).expect("ca");
        write_atomically(&next_dir.join("ca-key.pem"), &next.key_pem(), 0o600).expect("key");
        write_atomically(&next_dir.join("cross.pem"), &cross, 0o644).expect("cross");
        // The crash: the current CA moved aside, the next one not yet in place.
        fs::remove_dir_all(dir.path().join("ca")).expect("gone");
        let loaded = broker.ca().expect("finishes the move");
        assert_eq!(loaded.fingerprint(), next.fingerprint());
    }

    #[test]
    fn services_racing_at_first_start_end_with_one_ca() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().to_owned();
        let handles: Vec<_> = (0..6)
            .map(|i| {
                let path = path.clone();
                std::thread::spawn(move || {
                    ManagedTls::new(&path, "hub", &format!("svc{i}"), MANAGED_CERT_LIFETIME)
                        .prepare()
                        .expect("prepared")
                })
            })
            .collect();
        let files: Vec<TlsFiles> = handles
            .into_iter()
            .map(|h| h.join().expect("joined"))
            .collect();
        let ca = fs::read_to_string(&files[0].ca_cert).expect("ca");
        for f in &files {
            // Every service's certificate chains to the one CA left in the directory.
            PeerTls::from_files("hub", f).expect("chains to the CA in place");
            assert_eq!(fs::read_to_string(&f.ca_cert).expect("ca"), ca);
        }
        let leftovers: Vec<_> = fs::read_dir(&path)
            .expect("dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }
}
