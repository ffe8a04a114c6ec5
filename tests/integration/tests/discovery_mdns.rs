//! mDNS discovery between two real `trellis-discovery` processes on two network stacks: one in
//! the root namespace, one in a fresh network namespace, joined by a veth pair (multicast works
//! across it; it does not on loopback). Needs root and `ip netns`; without them the test prints
//! `SKIPPED:` and passes (outside CI; in CI it fails, since CI runs as root).

use std::io::Write as _;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::*;
use trellis_api::pb::types::{ConditionStatus, DiscoverySource, ForeignCluster};
use trellis_api::peers::Condition;
use trellis_integration::{ServiceProcess, bin_path};
use trellis_testkit::{eventually, free_port, in_ci, require_tool};

const DISCOVERY: &str = "trellis.discovery.v1.Discovery";

fn skip(why: &str) {
    assert!(!in_ci(), "mdns test cannot run in CI: {why}");
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: mdns_discovers_and_notices_departure_across_a_veth_pair: {why}"
    );
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A network namespace linked to the root one by a veth pair; removed on drop.
struct Netns {
    name: String,
    host_if: String,
    ns_if: String,
    host_ip: String,
    ns_ip: String,
}

impl Netns {
    fn create() -> Result<Self, String> {
        let tag = std::process::id() % 100_000;
        let octet = tag % 250 + 1;
        let this = Self {
            name: format!("trellis-mdns-{tag}"),
            host_if: format!("tmd{tag}h"),
            ns_if: format!("tmd{tag}n"),
            host_ip: format!("10.254.{octet}.1"),
            ns_ip: format!("10.254.{octet}.2"),
        };
        ip(&["netns", "add", &this.name])?;
        ip(&[
            "link",
            "add",
            &this.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &this.ns_if,
        ])?;
        ip(&["link", "set", &this.ns_if, "netns", &this.name])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", this.host_ip),
            "dev",
            &this.host_if,
        ])?;
        ip(&["link", "set", &this.host_if, "up"])?;
        let in_ns = |args: &[&str]| {
            let mut full = vec!["netns", "exec", &this.name, "ip"];
            full.extend_from_slice(args);
            ip(&full)
        };
        in_ns(&[
            "addr",
            "add",
            &format!("{}/24", this.ns_ip),
            "dev",
            &this.ns_if,
        ])?;
        in_ns(&["link", "set", &this.ns_if, "up"])?;
        in_ns(&["link", "set", "lo", "up"])?;
        Ok(this)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// A process started inside the namespace, SIGKILLed on drop.
struct NsProcess(Option<Child>);

impl NsProcess {
    fn terminate(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for NsProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn args(id: &str, listen: SocketAddr, interface: &str) -> Vec<String> {
    [
        "--listen",
        &listen.to_string(),
        "--store",
        "memory://",
        "--insecure-plaintext-peering",
        "--cluster-id",
        id,
        "--mdns",
        "--mdns-interfaces",
        interface,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

async fn connect(addr: SocketAddr) -> DiscoveryClient<Channel> {
    eventually(
        &format!("{addr} to answer"),
        Duration::from_secs(30),
        || DiscoveryClient::connect(format!("http://{addr}")),
    )
    .await
}

fn discovered(fc: &ForeignCluster) -> Option<ConditionStatus> {
    fc.conditions
        .iter()
        .find(|c| c.r#type == Condition::Discovered.as_str())
        .and_then(|c| ConditionStatus::try_from(c.status).ok())
}

async fn wait_discovered(
    client: &mut DiscoveryClient<Channel>,
    id: &str,
    want: ConditionStatus,
    what: &str,
) -> ForeignCluster {
    eventually(what, Duration::from_secs(30), || {
        let mut client = client.clone();
        async move {
            client
                .get_foreign_cluster(GetForeignClusterRequest {
                    cluster_id: id.into(),
                })
                .await
                .ok()
                .and_then(|r| r.into_inner().foreign_cluster)
                .filter(|fc| discovered(fc) == Some(want))
        }
    })
    .await
}

#[tokio::test]
async fn mdns_discovers_and_notices_departure_across_a_veth_pair() {
    if require_tool("ip").is_none() {
        return;
    }
    let netns = match Netns::create() {
        Ok(n) => n,
        Err(why) => {
            skip(&format!(
                "cannot create a network namespace with a veth pair (needs root): {why}"
            ));
            return;
        }
    };
    let a_addr: SocketAddr = format!("{}:{}", netns.host_ip, free_port())
        .parse()
        .expect("addr");
    let b_addr: SocketAddr = format!("{}:{}", netns.ns_ip, free_port())
        .parse()
        .expect("addr");
    let _a = ServiceProcess::start(
        "trellis-discovery",
        args("mdns-a", a_addr, &netns.host_if),
        a_addr,
        DISCOVERY,
    )
    .await
    .expect("a starts");
    let binary = bin_path("trellis-discovery").expect("binary built");
    let mut b = NsProcess(Some(
        Command::new("ip")
            .args(["netns", "exec", &netns.name])
            .arg(&binary)
            .args(args("mdns-b", b_addr, &netns.ns_if))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("b starts"),
    ));
    let mut a_client = connect(a_addr).await;
    let mut b_client = connect(b_addr).await;

    let on_a = wait_discovered(&mut a_client, "mdns-b", ConditionStatus::True, "a finds b").await;
    assert_eq!(on_a.discovery_source, DiscoverySource::Mdns as i32);
    assert_eq!(on_a.discovery_address, b_addr.to_string());
    let on_b = wait_discovered(&mut b_client, "mdns-a", ConditionStatus::True, "b finds a").await;
    assert_eq!(on_b.discovery_address, a_addr.to_string());

    // b stops gracefully (goodbye packet): a notices it is gone.
    b.terminate();
    wait_discovered(
        &mut a_client,
        "mdns-b",
        ConditionStatus::False,
        "a notices b left",
    )
    .await;
}
