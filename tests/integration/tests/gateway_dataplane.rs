//! The gateway's data plane with real packets (issue 6), as root, in network namespaces this
//! test creates and always removes: three clusters A, B (the hub) and C, **all with pod CIDR
//! 10.0.0.0/16**, each a gateway namespace and a pod namespace (pod 10.0.0.10, default route
//! via the gateway), the gateways joined by a bridge in a fourth namespace playing the internet
//! (192.0.2.0/24). The real `trellis-gateway` binary runs in each gateway namespace with the
//! userspace data plane and its store in a real etcd.
//!
//! The broker does not exist yet, so each gateway's TunnelEndpoints come from a **stand-in**
//! serving only `Broker.WatchTunnelEndpoints` ([`StandinBroker`]) inside the gateway's
//! namespace; the test computes them the way the broker will: endpoints and keys from each
//! gateway's `GetGatewayInfo(peer)`, every remote pod CIDR remapped by the viewer (A sees C at
//! 10.83/16, C sees A at 10.81/16, everyone sees B at 10.82/16), external CIDRs distinct and not
//! remapped. Replace the stand-in with the real broker once it lands.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`nc`/`etcd`;
//! CI runs as root and fails instead.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Channel;
use trellis_api::ClusterIdentity;
use trellis_api::model::{NatView, PeeringKind, TunnelEndpoint, WgKey};
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::gateway::{GetGatewayInfoRequest, ListTunnelsRequest, TunnelState};
use trellis_integration::bin_path;
use trellis_integration::netns::{
    Namespaces, channel_in, exec, forward_into, ip, is_root, listen_in,
};
use trellis_integration::standin_broker::StandinBroker;
use trellis_testkit::{Etcd, in_ci, require_tool};

const GATEWAY_ADDR: &str = "127.0.0.1:7106";
const BROKER_ADDR: &str = "127.0.0.1:7102";
const ETCD_ADDR: &str = "127.0.0.1:2379";
const NAMES: [&str; 3] = ["a", "b", "c"];

/// Whether the test can run here; prints `SKIPPED:` otherwise (and fails in CI).
fn can_run(test: &str) -> bool {
    if !is_root() {
        assert!(!in_ci(), "{test} needs root, and CI runs as root");
        eprintln!("SKIPPED: {test}: needs root (network namespaces)");
        return false;
    }
    ["ip", "nft", "ping", "nc", "etcd"]
        .iter()
        .all(|tool| require_tool(tool).is_some())
}

/// One `trellis-gateway` process inside a namespace, killed on drop.
struct GatewayProcess {
    ns: String,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl GatewayProcess {
    fn spawn(&mut self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        // `ip netns exec` enters the namespace and execs the binary: the child is the gateway.
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns])
            .arg(bin_path("trellis-gateway")?)
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM; the time until the process exited (it must, despite boringtun's threads).
    async fn terminate(&mut self) -> Duration {
        let mut child = self.child.take().expect("running");
        let started = Instant::now();
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("kill");
        assert!(sent.success());
        loop {
            if child.try_wait().expect("wait").is_some() {
                return started.elapsed();
            }
            if started.elapsed() > Duration::from_secs(15) {
                let _ = child.kill();
                panic!(
                    "gateway still running 15 s after SIGTERM:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

struct Cluster {
    name: &'static str,
    gw_ns: String,
    pod_ns: String,
    broker: StandinBroker,
    client: GatewayClient<Channel>,
    gateway: GatewayProcess,
}

/// The three clusters. Field order is drop order: processes and servers stop before the
/// namespaces go.
struct Lab {
    clusters: Vec<Cluster>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    _etcd: Etcd,
    inet_ns: String,
    _logs: tempfile::TempDir,
    _namespaces: Namespaces,
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.clusters.clear();
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn uplink_ip(i: usize) -> String {
    format!("192.0.2.{}", i + 1)
}

/// How `viewer` addresses `viewed`'s pods: every pod CIDR is 10.0.0.0/16, so each is remapped,
/// to 10.81/16 (A), 10.82/16 (B), 10.83/16 (C).
fn pod_view(viewed: usize) -> String {
    format!("10.{}.0.0/16", 81 + viewed)
}

fn external(i: usize) -> String {
    format!("10.{}.0.0/16", 201 + i)
}

fn net(s: &str) -> ipnet::IpNet {
    s.parse().expect("net")
}

impl Lab {
    async fn up() -> Self {
        // Unique per run: concurrent test processes and leftovers never collide.
        let run = format!("{:x}", u64::from(std::process::id()) << 20 ^ rand_part());
        let run = &run[run.len().saturating_sub(6)..];
        let mut namespaces = Namespaces::default();
        let inet_ns = format!("tr{run}-inet");
        namespaces.add(&inet_ns).expect("inet ns");
        ip(&["-n", &inet_ns, "link", "add", "br0", "type", "bridge"]).expect("bridge");
        ip(&["-n", &inet_ns, "link", "set", "br0", "up"]).expect("bridge up");

        let etcd = tokio::task::spawn_blocking(Etcd::start)
            .await
            .expect("etcd task")
            .expect("etcd starts");
        let etcd_addr: SocketAddr = etcd.endpoint().parse().expect("etcd addr");
        let logs = tempfile::tempdir().expect("logs");
        let mut tasks = Vec::new();
        let mut clusters = Vec::new();
        for (i, name) in NAMES.iter().enumerate() {
            let gw_ns = format!("tr{run}-gw{name}");
            let pod_ns = format!("tr{run}-pod{name}");
            namespaces.add(&gw_ns).expect("gw ns");
            namespaces.add(&pod_ns).expect("pod ns");
            let port = format!("p{name}");
            for args in [
                vec![
                    "-n", &gw_ns, "link", "add", "wan", "type", "veth", "peer", "name", &port,
                    "netns", &inet_ns,
                ],
                vec!["-n", &inet_ns, "link", "set", &port, "master", "br0", "up"],
                vec![
                    "-n",
                    &gw_ns,
                    "addr",
                    "add",
                    &format!("{}/24", uplink_ip(i)),
                    "dev",
                    "wan",
                ],
                vec!["-n", &gw_ns, "link", "set", "wan", "up"],
                vec![
                    "-n", &gw_ns, "link", "add", "pod", "type", "veth", "peer", "name", "eth0",
                    "netns", &pod_ns,
                ],
                vec!["-n", &gw_ns, "addr", "add", "10.0.0.1/16", "dev", "pod"],
                vec!["-n", &gw_ns, "link", "set", "pod", "up"],
                vec!["-n", &pod_ns, "addr", "add", "10.0.0.10/16", "dev", "eth0"],
                vec!["-n", &pod_ns, "link", "set", "eth0", "up"],
                vec!["-n", &pod_ns, "route", "add", "default", "via", "10.0.0.1"],
            ] {
                ip(&args).expect("topology");
            }
            tasks.push(
                forward_into(&gw_ns, ETCD_ADDR.parse().expect("addr"), etcd_addr)
                    .expect("etcd forwarder"),
            );
            let broker = StandinBroker::default();
            let listener =
                listen_in(&gw_ns, BROKER_ADDR.parse().expect("addr")).expect("broker listener");
            let service = broker.clone().service();
            tasks.push(tokio::spawn(async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(service)
                    .serve_with_incoming(TcpListenerStream::new(listener))
                    .await;
            }));
            let mut gateway = GatewayProcess {
                ns: gw_ns.clone(),
                args: [
                    "--listen",
                    GATEWAY_ADDR,
                    "--store",
                    &format!("etcd://{ETCD_ADDR}/gw-{name}"),
                    "--cluster-id",
                    name,
                    "--dataplane",
                    "userspace",
                    "--endpoint-address",
                    &uplink_ip(i),
                    "--broker",
                    BROKER_ADDR,
                    "--resync-interval",
                    "5",
                ]
                .map(String::from)
                .to_vec(),
                log: logs.path().join(format!("gateway-{name}.log")),
                child: None,
            };
            gateway.spawn().expect("gateway starts");
            let client = GatewayClient::new(
                channel_in(&gw_ns, GATEWAY_ADDR.parse().expect("addr")).expect("channel"),
            );
            clusters.push(Cluster {
                name,
                gw_ns,
                pod_ns,
                broker,
                client,
                gateway,
            });
        }
        let mut lab = Self {
            clusters,
            tasks,
            _etcd: etcd,
            inet_ns,
            _logs: logs,
            _namespaces: namespaces,
        };
        for i in 0..3 {
            lab.wait_serving(i).await;
        }
        // Full peerings A-B and C-B, induced A-C via B.
        for (x, y) in [(0, 1), (2, 1), (0, 2)] {
            lab.publish(x, y).await;
            lab.publish(y, x).await;
        }
        lab
    }

    async fn wait_serving(&mut self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let c = &mut self.clusters[i];
            if c.client
                .get_gateway_info(GetGatewayInfoRequest::default())
                .await
                .is_ok()
            {
                return;
            }
            if let Some(child) = c.gateway.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "gateway {} exited with {status}:\n{}",
                    c.name,
                    c.gateway.log_tail()
                );
            }
            assert!(
                Instant::now() < deadline,
                "gateway {} not serving:\n{}",
                c.name,
                c.gateway.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Publishes X's TunnelEndpoint for Y into X's stand-in broker.
    async fn publish(&mut self, x: usize, y: usize) {
        let identity = |i: usize| {
            ClusterIdentity::parse("cluster_id", NAMES[i], "cluster_name", NAMES[i]).expect("id")
        };
        let theirs = self.clusters[y]
            .client
            .get_gateway_info(GetGatewayInfoRequest {
                cluster_id: NAMES[x].into(),
            })
            .await
            .expect("gateway info")
            .into_inner();
        let induced = x != 1 && y != 1;
        let te = TunnelEndpoint {
            remote: identity(y),
            kind: if induced {
                PeeringKind::Induced
            } else {
                PeeringKind::Full
            },
            via: induced.then(|| identity(1)),
            local_pod_cidr: net("10.0.0.0/16"),
            local_external_cidr: net(&external(x)),
            local_nat: NatView {
                pod_cidr_nat: net(&pod_view(x)),
                external_cidr_nat: net(&external(x)),
            },
            remote_pod_cidr: net("10.0.0.0/16"),
            remote_external_cidr: net(&external(y)),
            remote_nat: NatView {
                pod_cidr_nat: net(&pod_view(y)),
                external_cidr_nat: net(&external(y)),
            },
            remote_endpoint: theirs.endpoint.parse().expect("endpoint"),
            remote_public_key: WgKey::parse("public_key", &theirs.public_key).expect("key"),
            generation: 1,
        };
        self.clusters[x].broker.put(te.to_proto(0));
    }

    /// The address a pod in X uses for the pod in Y.
    fn pod_addr(y: usize) -> String {
        format!("10.{}.0.10", 81 + y)
    }

    fn ping(&self, from: usize, to: usize, args: &[&str]) -> std::process::Output {
        let mut all: Vec<&str> = args.to_vec();
        let target = Self::pod_addr(to);
        all.push(&target);
        exec(&self.clusters[from].pod_ns, "ping", &all).expect("ping runs")
    }

    /// Pings until one answer, returning how long that took.
    async fn wait_ping(&self, from: usize, to: usize, bound: Duration) -> Duration {
        let started = Instant::now();
        loop {
            if self
                .ping(from, to, &["-c", "1", "-W", "1"])
                .status
                .success()
            {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < bound,
                "{} cannot reach {} within {bound:?}:\n{}\n---\n{}",
                NAMES[from],
                NAMES[to],
                self.clusters[from].gateway.log_tail(),
                self.clusters[to].gateway.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn uplink_rx_bytes(&self, i: usize) -> u64 {
        let json = ip(&[
            "-n",
            &self.clusters[i].gw_ns,
            "-s",
            "-j",
            "link",
            "show",
            "dev",
            "wan",
        ])
        .expect("link stats");
        let v: serde_json::Value = serde_json::from_str(&json).expect("json");
        v[0]["stats64"]["rx"]["bytes"].as_u64().expect("rx bytes")
    }

    /// (`ct mark set` rules in our nft table, our ip rules, our interfaces) in X's gateway
    /// namespace.
    fn dataplane_counts(&self, i: usize) -> (usize, usize, usize) {
        let ns = &self.clusters[i].gw_ns;
        let nft = exec(ns, "nft", &["list", "table", "ip", "trellis"]).expect("nft");
        let marks = String::from_utf8_lossy(&nft.stdout)
            .matches("ct mark set")
            .count();
        let rules = ip(&["-n", ns, "-4", "rule", "show", "pref", "1784"])
            .expect("rules")
            .lines()
            .count();
        let links = ip(&["-n", ns, "-o", "link", "show"])
            .expect("links")
            .lines()
            .filter(|l| {
                l.split(':')
                    .nth(1)
                    .is_some_and(|n| n.trim().starts_with("tg"))
            })
            .count();
        (marks, rules, links)
    }
}

fn rand_part() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or_default()
}

fn loss_free(out: &std::process::Output) -> bool {
    out.status.success() && String::from_utf8_lossy(&out.stdout).contains(" 0% packet loss")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_leaf_to_leaf_is_direct_with_identical_pod_cidrs_and_survives_the_hub() {
    if !can_run("gateway_leaf_to_leaf_is_direct_with_identical_pod_cidrs_and_survives_the_hub") {
        return;
    }
    let (a, b, c) = (0, 1, 2);
    let mut lab = Lab::up().await;
    let first = lab.wait_ping(a, c, Duration::from_secs(30)).await;
    eprintln!(
        "measured: first A->C ping answered {} ms after the TunnelEndpoints were published",
        first.as_millis()
    );
    lab.wait_ping(a, b, Duration::from_secs(30)).await;
    lab.wait_ping(c, a, Duration::from_secs(30)).await;

    // TCP from A's pod to C's pod; C's pod sees A at 10.81.0.10 (SNAT on C's ingress).
    let mut server = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.clusters[c].pod_ns,
            "nc",
            "-n",
            "-v",
            "-l",
            "10.0.0.10",
            "5000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nc server");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let client = exec(
        &lab.clusters[a].pod_ns,
        "sh",
        &["-c", "echo hello-from-a | nc -N -w 5 10.83.0.10 5000"],
    )
    .expect("nc client");
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.try_wait().expect("wait").is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = server.kill();
    let out = server.wait_with_output().expect("server output");
    let (got, seen) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        got.contains("hello-from-a"),
        "C's pod received {got:?} (client: {:?})",
        String::from_utf8_lossy(&client.stderr)
    );
    assert!(
        seen.contains("10.81.0.10"),
        "C's pod saw the connection as {seen:?}"
    );

    // A<->C does not cross B: B's uplink receives next to nothing while 50 KB flow.
    let before = lab.uplink_rx_bytes(b);
    let out = lab.ping(a, c, &["-c", "50", "-i", "0.02", "-s", "1000", "-W", "1"]);
    assert!(loss_free(&out), "{}", String::from_utf8_lossy(&out.stdout));
    let through_b = lab.uplink_rx_bytes(b) - before;
    eprintln!(
        "measured: B's uplink received {through_b} bytes while A and C exchanged 100 x 1028-byte ICMP packets"
    );
    assert!(through_b < 2_000, "{through_b} bytes reached B");

    // Status: the tunnel to C is up with traffic counted.
    let tunnels = lab.clusters[a]
        .client
        .list_tunnels(ListTunnelsRequest {})
        .await
        .expect("list")
        .into_inner()
        .tunnels;
    assert_eq!(tunnels.len(), 2);
    let to_c = tunnels
        .iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == "c"))
        .expect("tunnel to c");
    assert_eq!(to_c.state, TunnelState::Up as i32, "{to_c:?}");
    assert!(to_c.rx_bytes > 50_000 && to_c.tx_bytes > 50_000, "{to_c:?}");
    assert!(to_c.last_handshake_time.is_some());
    assert_eq!(to_c.routed_cidrs, vec!["10.83.0.0/16", "10.203.0.0/16"]);

    // The hub goes away entirely: its gateway stops (SIGTERM must work despite boringtun) and
    // its uplink is cut. A<->C keeps working without loss.
    let stopped = lab.clusters[b].gateway.terminate().await;
    eprintln!(
        "measured: B's gateway exited {} ms after SIGTERM",
        stopped.as_millis()
    );
    ip(&["-n", &lab.inet_ns, "link", "set", "pb", "down"]).expect("cut B");
    let out = lab.ping(a, c, &["-c", "30", "-i", "0.05", "-W", "1"]);
    assert!(loss_free(&out), "{}", String::from_utf8_lossy(&out.stdout));
    drop(lab);
}

/// Waits until gateway `i`'s namespace holds exactly `expected` (nft marks, ip rules,
/// interfaces); a duplicate never settles there and fails with the counts seen.
fn wait_counts(lab: &Lab, i: usize, expected: (usize, usize, usize), what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let seen = lab.dataplane_counts(i);
        if seen == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {seen:?}, expected {expected:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_restart_and_removal_reconcile_without_duplicates() {
    if !can_run("gateway_restart_and_removal_reconcile_without_duplicates") {
        return;
    }
    let (a, b, c) = (0, 1, 2);
    let mut lab = Lab::up().await;
    lab.wait_ping(a, c, Duration::from_secs(30)).await;
    lab.wait_ping(a, b, Duration::from_secs(30)).await;
    // Pings can succeed a moment before the last policy-routing rule is in place.
    wait_counts(&lab, a, (2, 2, 2), "both peers set up");

    // SIGKILL mid-traffic: rules and the nft table outlive the process; the restarted gateway
    // (same key and ports from etcd) rebuilds without duplicating them.
    lab.clusters[a].gateway.kill9();
    assert!(
        !lab.ping(a, c, &["-c", "1", "-W", "1"]).status.success(),
        "tunnel gone with the process"
    );
    lab.clusters[a].gateway.spawn().expect("restart");
    let back = lab.wait_ping(a, c, Duration::from_secs(30)).await;
    eprintln!(
        "measured: A->C answered again {} ms after restarting A's gateway (SIGKILL)",
        back.as_millis()
    );
    assert!(back < Duration::from_secs(15), "took {back:?}");
    lab.wait_serving(a).await;
    // Settles at exactly one mark, rule and interface per peer: nothing duplicated.
    wait_counts(&lab, a, (2, 2, 2), "no duplicates after a restart");

    // Graceful stop removes everything; a start brings it back.
    let stopped = lab.clusters[a].gateway.terminate().await;
    eprintln!(
        "measured: A's gateway exited {} ms after SIGTERM",
        stopped.as_millis()
    );
    assert_eq!(lab.dataplane_counts(a), (0, 0, 0), "clean after SIGTERM");
    lab.clusters[a].gateway.spawn().expect("restart");
    lab.wait_ping(a, c, Duration::from_secs(30)).await;

    // Removing C's TunnelEndpoint removes its interface, rule and NAT; B's tunnel stays.
    lab.clusters[a].broker.delete("c");
    let deadline = Instant::now() + Duration::from_secs(15);
    while lab.dataplane_counts(a) != (1, 1, 1) {
        assert!(
            Instant::now() < deadline,
            "still {:?}",
            lab.dataplane_counts(a)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!lab.ping(a, c, &["-c", "1", "-W", "1"]).status.success());
    lab.wait_ping(a, b, Duration::from_secs(10)).await;
    drop(lab);
}
