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
        let read = |name: &str| {
            fs::read_to_string(ca_dir.join(name))
                .with_context(|| format!("cannot read {}", ca_dir.join(name).display()))
        };
        let ca = ClusterCa::load(&self.cluster_id, &read("ca.pem")?, &read("ca-key.pem")?)
            .with_context(|| format!("the CA in {}", ca_dir.display()))?;
        Ok(ca)
    }

    /// Whether this service needs a new certificate: none yet, unreadable, or a third of its
    /// lifetime or less left.
    pub fn due(&self, now: SystemTime) -> bool {
        let Ok(pem) = fs::read_to_string(self.files().cert) else {
            return true;
        };
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
        write_atomically(&files.key, cert.key_pem(), 0o600)?;
        write_atomically(&files.cert, &cert.cert_pem, 0o644)?;
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
