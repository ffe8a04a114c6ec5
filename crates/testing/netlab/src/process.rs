//! [`NsProcess`]: a service binary running inside a network namespace (`ip netns exec`, which
//! enters the namespace and execs the binary, so the child *is* the service and signals reach
//! it directly), logging to a file, with its gRPC health checked from this process through a
//! socket opened inside the namespace. Killed on drop, and with this process however it dies
//! ([`trellis_testkit::spawn_tied`]).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

use crate::netns::channel_in;

/// How long a service may take to report SERVING.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A binary running in a namespace.
#[derive(Debug)]
pub struct NsProcess {
    ns: String,
    binary: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    addr: SocketAddr,
    grpc_service: String,
    log: PathBuf,
    child: Option<Child>,
}

impl NsProcess {
    /// Starts `binary` in `ns` with `args` (which make it listen on `addr`), appending its
    /// output to `log`, and waits until `grpc_service` reports SERVING.
    pub async fn start(
        ns: &str,
        binary: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
        addr: SocketAddr,
        grpc_service: &str,
        log: PathBuf,
    ) -> anyhow::Result<Self> {
        let mut this = Self {
            ns: ns.to_owned(),
            binary,
            args,
            env,
            addr,
            grpc_service: grpc_service.to_owned(),
            log,
            child: None,
        };
        this.spawn()?;
        this.wait_serving().await?;
        Ok(this)
    }

    /// Starts the process (again) without waiting for it to serve.
    pub fn spawn(&mut self) -> anyhow::Result<()> {
        if self.is_running() {
            bail!("{} is already running", self.binary.display());
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &self.ns])
            .arg(&self.binary)
            .args(&self.args)
            .env(
                "RUST_LOG",
                std::env::var("TRELLIS_NETLAB_LOG").unwrap_or_else(|_| "info".into()),
            )
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // Tied: a lab or test killed hard (SIGKILL, a timeout) takes its services with it.
        let child = trellis_testkit::spawn_tied(command)
            .with_context(|| format!("starting {} in {}", self.binary.display(), self.ns))?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the gRPC health check says SERVING; fails early when the process exits.
    pub async fn wait_serving(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                self.child = None;
                bail!(
                    "{} exited with {status}:\n{}",
                    self.binary.display(),
                    self.log_tail(40)
                );
            }
            if self.health().await == Some(ServingStatus::Serving) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{} not serving after {START_TIMEOUT:?}:\n{}",
                    self.binary.display(),
                    self.log_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn health(&self) -> Option<ServingStatus> {
        let channel = self.channel().ok()?;
        let mut client = HealthClient::new(channel);
        let check = client.check(HealthCheckRequest {
            service: self.grpc_service.clone(),
        });
        let response = tokio::time::timeout(Duration::from_secs(2), check)
            .await
            .ok()?
            .ok()?;
        ServingStatus::try_from(response.into_inner().status).ok()
    }

    /// A lazily connecting channel to the service, from inside its namespace.
    pub fn channel(&self) -> anyhow::Result<Channel> {
        channel_in(&self.ns, self.addr)
    }

    /// The gRPC address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The namespace it runs in.
    pub fn netns(&self) -> &str {
        &self.ns
    }

    /// The operating-system process ID, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the process runs (reaps it when it exited).
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(_) => {
                self.child = None;
                false
            }
            None => false,
        }
    }

    /// SIGKILL: no shutdown hook; state outside the store (interfaces, rules) stays behind.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits for the exit (SIGKILL after 20 s, reported as an error); returns how
    /// long the process took to exit.
    pub async fn terminate(&mut self) -> anyhow::Result<Duration> {
        let mut child = self.child.take().context("not running")?;
        let started = Instant::now();
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .context("running kill")?;
        if !sent.success() {
            bail!("kill -TERM {} failed", child.id());
        }
        loop {
            if child.try_wait()?.is_some() {
                return Ok(started.elapsed());
            }
            if started.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "{} still running 20 s after SIGTERM:\n{}",
                    self.binary.display(),
                    self.log_tail(20)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, start again with the same flags, and wait until serving.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill9();
        self.spawn()?;
        self.wait_serving().await
    }

    /// The last `lines` lines the process wrote.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Where the process writes its output.
    pub fn log_path(&self) -> &std::path::Path {
        &self.log
    }
}

impl Drop for NsProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
