//! Support for multi-process tests: start a Trellis service binary as a real process, wait
//! until its gRPC health check says SERVING, kill it with SIGKILL, start it again with the
//! same flags. Binaries are the ones `make test` builds before running the tests.

pub mod cluster;
pub mod command;
pub mod cut;
pub mod dns;
pub mod failover;
pub mod gate;
pub mod lab;
pub mod mcs;
pub mod otlp;
pub mod peering;
pub mod processes;
pub mod prom;

/// Network namespaces for data-plane tests; moved to [`trellis_netlab`], re-exported for
/// existing users.
pub use trellis_netlab::netns;

/// Seeded randomness for the chaos tests; moved to [`trellis_testkit`], re-exported for
/// existing users.
pub use trellis_testkit::rng;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

/// Path of a workspace binary: `$TRELLIS_BIN_DIR` when set, else the one built next to the
/// running test (`<target>/<profile>/<name>`).
pub use trellis_netlab::bins::bin_path;

/// The flags of a standalone `trellis-ipam` listening on `listen` with its state in `store`,
/// as cluster `cluster` with pod CIDR 10.0.0.0/16 and external CIDR 10.201.0.0/16, serving
/// other clusters in plaintext (no TLS), then `extra`.
pub fn ipam_args(listen: &str, store: &str, cluster: &str, extra: &[&str]) -> Vec<String> {
    [
        trellis_testkit::PLAINTEXT_PEERING,
        "--listen",
        listen,
        "--store",
        store,
        "--cluster-id",
        cluster,
        "--pod-cidr",
        "10.0.0.0/16",
        "--external-cidr",
        "10.201.0.0/16",
    ]
    .iter()
    .chain(extra)
    .map(|s| (*s).to_owned())
    .collect()
}

/// A service binary running as a child process, killed on drop.
#[derive(Debug)]
pub struct ServiceProcess {
    binary: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// The group ID the process runs with (`setgid` before exec), if not ours.
    gid: Option<u32>,
    addr: SocketAddr,
    grpc_service: String,
    log: PathBuf,
    _log_dir: tempfile::TempDir,
    child: Option<Child>,
    /// Length of the log when the current child was spawned: what it wrote starts there.
    log_start: u64,
}

/// What every Trellis server logs once it holds its listening socket
/// (`trellis_runtime::server::GrpcServer::serve`).
const SERVING_LOG_LINE: &str = "serving gRPC";

impl ServiceProcess {
    /// Starts `binary` with `args` (which must include `--listen addr`) and waits until
    /// `grpc_service` reports SERVING.
    pub async fn start(
        binary: &str,
        args: Vec<String>,
        addr: SocketAddr,
        grpc_service: &str,
    ) -> anyhow::Result<Self> {
        Self::start_with_env(binary, args, Vec::new(), addr, grpc_service).await
    }

    /// Like [`ServiceProcess::start`], with extra environment variables.
    pub async fn start_with_env(
        binary: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
        addr: SocketAddr,
        grpc_service: &str,
    ) -> anyhow::Result<Self> {
        Self::start_as(binary, args, env, None, addr, grpc_service).await
    }

    /// Like [`ServiceProcess::start_with_env`], running with group ID `gid` when given (every
    /// restart too), so that nftables can tell this process's packets from others'
    /// (`meta skgid`, see [`cut::Cut`]). The user stays ours: a root test keeps its process
    /// root, able to read the binaries wherever they are.
    pub async fn start_as(
        binary: &str,
        args: Vec<String>,
        env: Vec<(String, String)>,
        gid: Option<u32>,
        addr: SocketAddr,
        grpc_service: &str,
    ) -> anyhow::Result<Self> {
        let log_dir = tempfile::tempdir()?;
        let mut this = Self {
            binary: bin_path(binary)?,
            args,
            env,
            gid,
            addr,
            grpc_service: grpc_service.to_owned(),
            log: log_dir.path().join("service.log"),
            _log_dir: log_dir,
            child: None,
            log_start: 0,
        };
        this.spawn().await?;
        Ok(this)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        self.log_start = log.metadata()?.len();
        let mut command = Command::new(&self.binary);
        if let Some(gid) = self.gid {
            std::os::unix::process::CommandExt::gid(&mut command, gid);
        }
        let child = command
            .args(&self.args)
            .env("RUST_LOG", "info")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        self.wait_serving(Duration::from_secs(30)).await
    }

    async fn wait_serving(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!(
                    "{} exited with {status}:\n{}",
                    self.binary.display(),
                    self.log_tail(40)
                );
            }
            // Ports are picked before the child binds them: another process may have taken
            // ours and answer the health check. The child's own log says it is listening.
            if self.health().await == Some(ServingStatus::Serving) && self.logged_serving() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} not serving after {timeout:?}:\n{}",
                    self.binary.display(),
                    self.log_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the current child has logged that it serves.
    fn logged_serving(&self) -> bool {
        let Ok(text) = std::fs::read(&self.log) else {
            return false;
        };
        let start = usize::try_from(self.log_start).unwrap_or(usize::MAX);
        text.get(start..)
            .is_some_and(|new| String::from_utf8_lossy(new).contains(SERVING_LOG_LINE))
    }

    async fn health(&self) -> Option<ServingStatus> {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .ok()?
            .connect_timeout(Duration::from_millis(500))
            .connect()
            .await
            .ok()?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: self.grpc_service.clone(),
            })
            .await
            .ok()?;
        ServingStatus::try_from(response.into_inner().status).ok()
    }

    /// The process ID of the running child; `None` once killed.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The gRPC address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A connected channel to the service.
    pub async fn channel(&self) -> anyhow::Result<Channel> {
        Ok(Channel::from_shared(format!("http://{}", self.addr))?
            .connect()
            .await?)
    }

    /// Whether the process has exited on its own (a killed one counts too).
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|child| child.try_wait().ok().flatten().is_some())
    }

    /// SIGKILL: no shutdown hook, no flush; whatever is not in the store is lost.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits (without blocking the async runtime, which may host the
    /// process's clients or collectors) for it to exit; returns the exit status.
    pub async fn terminate(&mut self) -> anyhow::Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("not running")?;
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM failed");
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("still running 60 s after SIGTERM:\n{}", self.log_tail(20));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the binary again with the same flags.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill9();
        self.spawn().await
    }

    /// The last `lines` lines the process wrote.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A loopback address with a free port.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], trellis_testkit::free_port()))
}

/// Awaits every task, in order; a panicked task fails the test.
pub async fn join_all<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        out.push(task.await.expect("task panicked"));
    }
    out
}
