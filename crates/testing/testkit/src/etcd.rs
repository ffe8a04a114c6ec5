//! [`Etcd`]: a real, single-node etcd process for tests, bound to loopback only.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use std::{env, thread};

use anyhow::{Context, bail};
use tempfile::TempDir;

use crate::etcd_tls::EtcdTlsFiles;
use crate::ports::free_port;
use crate::tools::{require_tool, tool_path};

/// How long etcd may take to become healthy (it usually takes well under a second).
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Fresh ports to try when etcd cannot bind: another test may have taken a port between
/// [`free_port`] releasing it and etcd binding it.
const START_ATTEMPTS: usize = 3;

/// Prefix of every etcd's temporary directory.
const DIR_PREFIX: &str = "trellis-etcd-";

/// The file in an etcd's directory naming the process that owns it (the test process).
const OWNER_FILE: &str = "owner.pid";

/// A directory without an owner file is an orphan once it is this old.
const UNOWNED_AGE: Duration = Duration::from_secs(24 * 3600);

/// Removes the etcd directories under `tmp` whose owning process is gone: a test process
/// killed (a timeout, SIGKILL) never runs the drop that removes its directory, and each holds
/// about 120 MB of preallocated WAL; hundreds of them once filled this machine's disk. A
/// directory of a live process, or of unknown owner and younger than [`UNOWNED_AGE`], stays.
/// Returns how many were removed.
fn sweep_orphaned_dirs(tmp: &std::path::Path) -> usize {
    let Ok(entries) = fs::read_dir(tmp) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = entry.file_name().to_string_lossy().starts_with(DIR_PREFIX);
        if !ours || !path.is_dir() {
            continue;
        }
        let owner = fs::read_to_string(path.join(OWNER_FILE))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok());
        let orphan = match owner {
            Some(pid) => !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            None => entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > UNOWNED_AGE),
        };
        if orphan && fs::remove_dir_all(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// A running etcd: a single-node cluster on two free loopback ports with its data in a
/// temporary directory. Killed (and the directory removed) on drop.
///
/// Blocking (plain `std::process`), so it works from sync and async tests alike; from an async
/// test, start it before spawning work onto the runtime, or inside `spawn_blocking`.
///
/// ```no_run
/// # fn demo() {
/// let Some(etcd) = trellis_testkit::Etcd::start_or_skip() else { return };
/// let url = etcd.url("ipam"); // etcd://127.0.0.1:PORT/ipam
/// # let _ = url; }
/// ```
#[derive(Debug)]
pub struct Etcd {
    binary: PathBuf,
    dir: TempDir,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    /// With [`Etcd::start_tls`]: the certificates, and the plain-HTTP port etcd answers
    /// `/health` on (its client port then speaks only TLS).
    tls: Option<(EtcdTlsFiles, u16)>,
}

impl Etcd {
    /// Starts etcd and waits until it serves requests; the error includes etcd's log tail.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(false)
    }

    /// Starts an etcd that, like a production one, serves clients only over TLS and requires a
    /// client certificate its CA signed (`--client-cert-auth`). [`Etcd::tls_files`] has the
    /// files a service needs; [`Etcd::url`] is `etcds://…`.
    pub fn start_tls() -> anyhow::Result<Self> {
        Self::start_with(true)
    }

    /// [`Etcd::start_tls`], or `None` when etcd is not installed (skips loudly, fails in CI).
    ///
    /// # Panics
    ///
    /// If etcd is installed but does not start.
    pub fn start_tls_or_skip() -> Option<Self> {
        require_tool("etcd")?;
        match Self::start_tls() {
            Ok(etcd) => Some(etcd),
            Err(err) => panic!("{err:#}"),
        }
    }

    /// The certificates of an etcd started with [`Etcd::start_tls`].
    pub fn tls_files(&self) -> Option<&EtcdTlsFiles> {
        self.tls.as_ref().map(|(files, _)| files)
    }

    fn start_with(tls: bool) -> anyhow::Result<Self> {
        let binary = tool_path("etcd")
            .context("etcd not found on PATH or in .tools/bin (scripts/setup.sh installs it)")?;
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            let removed = sweep_orphaned_dirs(&env::temp_dir());
            if removed > 0 {
                eprintln!("removed {removed} etcd directories of test processes that are gone");
            }
        });
        let mut failures = Vec::new();
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::Builder::new()
                .prefix(DIR_PREFIX)
                .tempdir()
                .context("creating etcd's temporary directory")?;
            fs::write(dir.path().join(OWNER_FILE), std::process::id().to_string())
                .context("writing the owner of etcd's temporary directory")?;
            let mut etcd = Self {
                binary: binary.clone(),
                dir,
                client_port: free_port(),
                peer_port: free_port(),
                child: None,
                tls: None,
            };
            if tls {
                let files = crate::etcd_tls::write(etcd.dir.path())?;
                etcd.tls = Some((files, free_port()));
            }
            match etcd.launch() {
                Ok(()) => return Ok(etcd),
                Err(err) => failures.push(format!("{err:#}")),
            }
        }
        bail!(
            "etcd failed to start {START_ATTEMPTS} times:\n{}",
            failures.join("\n---\n")
        )
    }

    /// Starts etcd, or returns `None` when it is not installed (see
    /// [`require_tool`]: skips loudly, fails in CI).
    ///
    /// # Panics
    ///
    /// If etcd is installed but does not start: that is a broken test environment.
    pub fn start_or_skip() -> Option<Self> {
        require_tool("etcd")?;
        match Self::start() {
            Ok(etcd) => Some(etcd),
            Err(err) => panic!("{err:#}"),
        }
    }

    /// The client endpoint, `127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// A store URL for this etcd with the given key prefix: `etcd://127.0.0.1:PORT/prefix`
    /// (`etcds://` for a TLS etcd).
    pub fn url(&self, prefix: &str) -> String {
        format!(
            "{}://{}/{}",
            if self.tls.is_some() { "etcds" } else { "etcd" },
            self.endpoint(),
            prefix.trim_start_matches('/')
        )
    }

    /// The directory etcd keeps its data in (survives [`Etcd::kill`] and [`Etcd::restart`]).
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Whether etcd is up and reports itself healthy right now.
    pub fn is_healthy(&self) -> bool {
        health_check(self.health_port())
    }

    /// Where plain HTTP `/health` is answered: the client port, or for a TLS etcd its metrics
    /// port.
    fn health_port(&self) -> u16 {
        self.tls
            .as_ref()
            .map_or(self.client_port, |(_, port)| *port)
    }

    /// Kills etcd with SIGKILL (a crash, for fault tests) and reaps it. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Errors only mean it already exited.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same data directory and ports (killing it first if it still
    /// runs), and waits until it serves requests.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.launch()
    }

    /// The last `lines` lines of etcd's combined stdout and stderr, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = fs::read_to_string(self.log_path()).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn launch(&mut self) -> anyhow::Result<()> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .context("opening etcd's log file")?;
        // Tied: a test or lab killed hard takes its etcds with it.
        let child = crate::spawn_tied(self.command(&log)?)
            .with_context(|| format!("spawning {}", self.binary.display()))?;
        self.child = Some(child);
        self.wait_ready().with_context(|| {
            format!(
                "etcd on 127.0.0.1:{} did not become ready; log tail:\n{}",
                self.client_port,
                self.log_tail(30)
            )
        })
    }

    fn command(&self, log: &File) -> anyhow::Result<Command> {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(&self.binary);
        command
            .arg(format!("--name={}", self.member_name()))
            .arg(format!("--data-dir={}", self.data_dir().display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster={}={peer}", self.member_name()))
            .arg("--initial-cluster-state=new")
            .arg("--logger=zap")
            .arg("--log-outputs=stderr")
            .arg("--log-level=error");
        if let Some((files, health_port)) = &self.tls {
            command
                .arg("--client-cert-auth")
                .arg(format!("--trusted-ca-file={}", files.ca.display()))
                .arg(format!("--cert-file={}", files.server_cert.display()))
                .arg(format!("--key-file={}", files.server_key.display()))
                .arg(format!(
                    "--listen-metrics-urls=http://127.0.0.1:{health_port}"
                ));
        }
        command
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("duplicating etcd's log file")?)
            .stderr(log.try_clone().context("duplicating etcd's log file")?);
        // etcd reads every flag from ETCD_* variables too; a developer's own settings must not
        // leak into the test cluster.
        for (name, _) in env::vars_os() {
            if name.to_string_lossy().starts_with("ETCD") {
                command.env_remove(name);
            }
        }
        Ok(command)
    }

    /// The member name: unique per instance (its data directory's), stable across restarts.
    fn member_name(&self) -> String {
        self.dir.path().file_name().map_or_else(
            || "trellis-test".to_owned(),
            |n| n.to_string_lossy().into_owned(),
        )
    }

    /// Whether the etcd on our client port is the member we started.
    fn answers_as_ours(&self) -> bool {
        http_request(self.client_port, "POST", "/v3/cluster/member/list", "{}").is_some_and(
            |response| {
                is_ok(&response)
                    && response.contains(&format!(r#""name":"{}""#, self.member_name()))
            },
        )
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = &mut self.child
                && let Some(status) = child.try_wait().context("polling etcd")?
            {
                self.child = None;
                bail!("etcd exited with {status}");
            }
            if health_check(self.health_port()) {
                // Another test's etcd may have bound our port first: then ours exits, but a
                // health check can still reach that one. Only our member name proves it is ours
                // (a TLS etcd's client port needs a certificate: its fresh CA is proof enough).
                if self.tls.is_some() || self.answers_as_ours() {
                    return Ok(());
                }
                bail!(
                    "127.0.0.1:{} is served by another etcd (not member {})",
                    self.client_port,
                    self.member_name()
                );
            }
            if Instant::now() >= deadline {
                bail!("etcd not healthy after {}s", READY_TIMEOUT.as_secs());
            }
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `GET /health` on the client port: etcd answers `{"health":"true"}` once it has a leader
/// and serves reads.
fn health_check(port: u16) -> bool {
    http_request(port, "GET", "/health", "")
        .is_some_and(|response| is_ok(&response) && response.contains(r#""health":"true""#))
}

/// Whether a raw HTTP response has status 200 (Go answers an HTTP/1.0 request in kind).
fn is_ok(response: &str) -> bool {
    response.split(' ').nth(1) == Some("200")
}

/// One HTTP/1.0 request to etcd's client port (which also serves HTTP); the raw response.
pub(crate) fn http_request(port: u16, method: &str, path: &str, body: &str) -> Option<String> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let timeout = Duration::from_secs(1);
    let mut stream = TcpStream::connect_timeout(&addr, timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.set_write_timeout(Some(timeout)).ok()?;
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    Some(response)
}

#[cfg(test)]
mod tests {
    #[test]
    fn directories_of_processes_that_are_gone_are_swept_and_live_ones_kept() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let gone = {
            let mut child = std::process::Command::new("true")
                .spawn()
                .expect("true runs");
            let pid = child.id();
            child.wait().expect("exits");
            pid
        };
        let dir = |name: &str, owner: Option<u32>| {
            let path = tmp.path().join(name);
            fs::create_dir(&path).expect("dir");
            if let Some(pid) = owner {
                fs::write(path.join(OWNER_FILE), pid.to_string()).expect("owner");
            }
            path
        };
        let orphan = dir("trellis-etcd-orphan", Some(gone));
        let live = dir("trellis-etcd-live", Some(std::process::id()));
        let young = dir("trellis-etcd-young", None);
        let other = dir("someone-else", Some(gone));
        assert_eq!(sweep_orphaned_dirs(tmp.path()), 1);
        assert!(!orphan.exists());
        assert!(live.exists() && young.exists() && other.exists());
    }

    use super::*;

    /// base64 of "trellis" and "works", for etcd's JSON gateway.
    const KEY: &str = "dHJlbGxpcw==";
    const VALUE: &str = "d29ya3M=";

    fn put(etcd: &Etcd) -> Option<String> {
        let body = format!(r#"{{"key":"{KEY}","value":"{VALUE}"}}"#);
        http_request(etcd.client_port, "POST", "/v3/kv/put", &body)
    }

    fn get(etcd: &Etcd) -> Option<String> {
        let body = format!(r#"{{"key":"{KEY}"}}"#);
        http_request(etcd.client_port, "POST", "/v3/kv/range", &body)
    }

    #[test]
    fn etcd_serves_reads_and_writes() {
        let Some(etcd) = Etcd::start_or_skip() else {
            return;
        };
        assert!(etcd.is_healthy());
        assert_eq!(etcd.endpoint(), format!("127.0.0.1:{}", etcd.client_port));
        assert_eq!(
            etcd.url("/ipam"),
            format!("etcd://{}/ipam", etcd.endpoint())
        );

        let put = put(&etcd).expect("put answered");
        assert!(is_ok(&put), "{put}");
        let got = get(&etcd).expect("range answered");
        assert!(got.contains(VALUE), "{got}");
    }

    #[test]
    fn etcd_survives_kill_and_restart_with_its_data() {
        let Some(mut etcd) = Etcd::start_or_skip() else {
            return;
        };
        put(&etcd).expect("put answered");
        etcd.kill();
        assert!(!etcd.is_healthy());
        etcd.kill();

        etcd.restart().expect("restart");
        let got = get(&etcd).expect("range answered");
        assert!(got.contains(VALUE), "data survives a restart: {got}");
    }

    #[test]
    fn an_etcd_whose_port_another_etcd_holds_is_not_taken_for_ready() {
        let Some(first) = Etcd::start_or_skip() else {
            return;
        };
        let mut second = Etcd {
            binary: first.binary.clone(),
            dir: tempfile::Builder::new()
                .prefix("trellis-etcd-")
                .tempdir()
                .expect("temporary directory"),
            client_port: first.client_port,
            peer_port: free_port(),
            child: None,
            tls: None,
        };
        let err = second
            .launch()
            .expect_err("the port belongs to the first etcd");
        assert!(
            format!("{err:#}").contains("exited") || format!("{err:#}").contains("another etcd"),
            "{err:#}"
        );
        assert!(first.answers_as_ours());
    }

    #[test]
    fn drop_stops_etcd_and_removes_its_data() {
        let Some(etcd) = Etcd::start_or_skip() else {
            return;
        };
        let port = etcd.client_port;
        let dir = etcd.dir.path().to_owned();
        drop(etcd);
        assert!(!health_check(port));
        assert!(!dir.exists());
    }
}
