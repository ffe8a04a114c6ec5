//! Network namespaces (root only): a guard that deletes the namespaces it created, whatever
//! happens to the test or the program; sockets opened *inside* a namespace from this process
//! (a short-lived thread enters it with `setns`; a socket keeps the namespace it was created
//! in), so a test can serve and call gRPC in a namespace without running there; and a TCP
//! forwarder from a namespace to the host's loopback (for etcd).

use std::fs::File;
use std::net::SocketAddr;
use std::process::Command;

use anyhow::{Context as _, bail};
use hyper_util::rt::TokioIo;
use nix::sched::{CloneFlags, setns};
use tonic::transport::{Channel, Endpoint, Uri};

/// Whether this process may create namespaces.
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Whether namespace test `test` can run here: as root, with every tool of `tools` installed.
/// Outside CI a missing requirement skips the test loudly (a `SKIPPED:` line); CI runs as root
/// with the tools installed, so there it fails instead.
pub fn can_run(test: &str, tools: &[&str]) -> bool {
    if !is_root() {
        assert!(
            !trellis_testkit::in_ci(),
            "{test} needs root, and CI runs as root"
        );
        eprintln!("SKIPPED: {test}: needs root (network namespaces)");
        return false;
    }
    tools
        .iter()
        .all(|tool| trellis_testkit::require_tool(tool).is_some())
}

/// Runs `ip args...`, failing with its stderr.
pub fn ip(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `program args...` inside namespace `ns` (`ip netns exec`), returning its output
/// whatever the exit status.
pub fn exec(ns: &str, program: &str, args: &[&str]) -> anyhow::Result<std::process::Output> {
    Command::new("ip")
        .args(["netns", "exec", ns, program])
        .args(args)
        .output()
        .with_context(|| format!("running {program} in {ns}"))
}

/// Loads nftables `script` inside namespace `ns` (`nft -f -`, one transaction); nft's
/// complaint and the script when it refuses.
pub fn nft_apply(ns: &str, script: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("running nft in {ns}"))?;
    child
        .stdin
        .take()
        .context("nft's stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "nft -f in {ns} failed: {}\n{script}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The packet count of the first counter `nft list <what>` shows inside namespace `ns` (a
/// chain or table holding one counter rule); panics without one, as a test's count would be
/// meaningless.
pub fn nft_packets(ns: &str, what: &[&str]) -> u64 {
    let mut args = vec!["list"];
    args.extend_from_slice(what);
    let out = exec(ns, "nft", &args).expect("nft");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in {text}"))
}

/// Namespaces created by a test, deleted (with every interface and route in them) on drop.
/// Processes running inside must be stopped before, or they keep a namespace alive.
#[derive(Debug, Default)]
pub struct Namespaces {
    names: Vec<String>,
}

impl Namespaces {
    /// The namespaces, in creation order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Creates namespace `name` (loopback up).
    pub fn add(&mut self, name: &str) -> anyhow::Result<()> {
        ip(&["netns", "add", name])?;
        self.names.push(name.to_owned());
        ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in self.names.iter().rev() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// Runs `f` on a fresh thread that has entered namespace `ns`; sockets it creates stay in
/// `ns` for their whole life, wherever they are used afterwards.
pub fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = File::open(&path)?;
        setns(&file, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        f()
    })
    .join()
    .map_err(|_| std::io::Error::other("namespace thread panicked"))?
}

/// A TCP listener bound inside `ns`.
pub fn listen_in(ns: &str, addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let std_listener = in_netns(ns, move || {
        let l = std::net::TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        Ok(l)
    })?;
    tokio::net::TcpListener::from_std(std_listener)
}

/// A TCP connection opened from inside `ns`.
pub async fn connect_in(ns: &str, addr: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let ns = ns.to_owned();
    let stream = tokio::task::spawn_blocking(move || {
        in_netns(&ns, move || {
            let s = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2))?;
            s.set_nonblocking(true)?;
            s.set_nodelay(true)?;
            Ok(s)
        })
    })
    .await
    .map_err(std::io::Error::other)??;
    tokio::net::TcpStream::from_std(stream)
}

/// A UDP socket bound to `addr` inside `ns`.
pub fn udp_in(ns: &str, addr: SocketAddr) -> std::io::Result<tokio::net::UdpSocket> {
    let std_socket = in_netns(ns, move || {
        let s = std::net::UdpSocket::bind(addr)?;
        s.set_nonblocking(true)?;
        Ok(s)
    })?;
    tokio::net::UdpSocket::from_std(std_socket)
}

/// A lazily connecting gRPC channel to `addr` inside `ns`.
pub fn channel_in(ns: &str, addr: SocketAddr) -> anyhow::Result<Channel> {
    let ns = ns.to_owned();
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))?
        .timeout(std::time::Duration::from_secs(10));
    Ok(
        endpoint.connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let ns = ns.clone();
            async move { connect_in(&ns, addr).await.map(TokioIo::new) }
        })),
    )
}

/// Forwards every connection to `listen` inside `ns` to `target` in this process's namespace,
/// until the returned task is aborted.
pub fn forward_into(
    ns: &str,
    listen: SocketAddr,
    target: SocketAddr,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = listen_in(ns, listen)?;
    Ok(tokio::spawn(async move {
        while let Ok((mut inside, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outside) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
                }
            });
        }
    }))
}
