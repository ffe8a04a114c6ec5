//! The gateway's tunnel guard (issue 14, ADR 0016) against a peer that misbehaves, with real
//! packets through a real WireGuard tunnel, as root, in namespaces this test creates and always
//! removes.
//!
//! A well-behaved gateway cannot even emit the packets the guard exists for: its AllowedIPs
//! route only our mapped ranges into the tunnel, and our NAT rewrites the rest. So after the
//! usual three clusters × three nodes are up (hub B, leaves A and C, one pod CIDR), leaf C's
//! gateway is killed with SIGKILL and, in its namespace, an **impersonator** takes its place:
//! `wireguard-go` (an independent userspace WireGuard) holding C's private key (read from C's
//! gateway store), C's listen port for A and A's public key and endpoint, with AllowedIPs
//! 0.0.0.0/0. A's gateway sees its peer C come back (once the impersonator's handshake
//! timestamps pass the killed gateway's last one: `wireguard-go` and boringtun count TAI64N
//! from bases 27 s apart); C now sends whatever it likes through the real tunnel, from C's real
//! pod range (what C's pods use) and from the range A addresses C by (which A does not
//! translate, so even the gateway node's own replies route back into the tunnel).
//!
//! From it, towards A:
//! - (a) node addresses: a non-gateway node's and the gateway node's node-network addresses and
//!   their pod-side addresses (the pod CIDR's first host of each node's slice, as C addresses
//!   it), each with a TCP listener on every address (like a kubelet);
//! - (b) Trellis services: A's gateway gRPC port on its bridge address, the route agent's port
//!   on a non-gateway node;
//! - (c) another peer's range: B's pod as A addresses it (A's tunnel to B is counted: the
//!   probe never gets an answer either way, since B's AllowedIPs refuse A's translated source);
//! - (d) A's pod on a non-gateway node at the address C's pods use.
//!
//! Three phases, each probing every target from both sources:
//! 1. the guards as the gateway (`ip trellis-guard`) and the route agents (the node guard in
//!    `ip trellis-route`) apply them: (a)-(c) stay unanswered, no listener on a node address
//!    accepts anything and (c) does not leave through A's tunnel to B, while (d) answers;
//! 2. the node guards deleted over and over (their agents put them back on each resync): the
//!    gateway's guard alone stops everything but the non-gateway node's pod-side address, which
//!    lies inside the pod CIDR it must let through;
//! 3. every guard deleted (the control): every (a) and (b) target answers and (c) leaves
//!    through A's tunnel to B (B's AllowedIPs then drop A's translated source, so (c) never
//!    answers either way), which shows the probes see what the guards stop.
//!
//! With `TRELLIS_TEST_NO_GUARD=1` phase 1 runs without the guards too, and the test fails.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`python3`/
//! `wireguard-go`/`wg` (`scripts/setup.sh` installs them); CI runs as root and fails instead.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use trellis_api::pb::peering::ListTunnelEndpointsRequest;
use trellis_api::pb::types::{PeeringKind, TunnelEndpoint};
use trellis_gateway::keys::KeyPair;
use trellis_netlab::netns::{exec, ip, listen_in};
use trellis_netlab::topology::link_counters;
use trellis_netlab::{Fabric, FabricOptions, Service, Site, StoreKind};
use trellis_testkit::{in_ci, require_tool};

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const LIMIT: Duration = Duration::from_secs(90);
/// The port every node-address listener takes (kubelet's).
const NODE_PORT: u16 = 10250;
/// The pod listener's port.
const POD_PORT: u16 = 8080;
/// The route agents' gRPC port.
const ROUTE_PORT: u16 = 7107;
/// The impersonator's routing table and rule priority in C's gateway namespace.
const TABLE: &str = "4711";
/// Pings sent towards B's range to count what leaves through A's tunnel to B.
const LEAK_PINGS: u64 = 20;

fn can_run(test: &str) -> bool {
    if !trellis_netlab::netns::is_root() {
        assert!(!in_ci(), "{test} needs root, and CI runs as root");
        eprintln!("SKIPPED: {test}: needs root (network namespaces)");
        return false;
    }
    ["ip", "nft", "ping", "python3", "wireguard-go", "wg"]
        .iter()
        .all(|tool| require_tool(tool).is_some())
}

async fn up() -> Fabric {
    let mut options = FabricOptions::three_clusters();
    // C's gateway key is read from its store: etcd, which outlives the killed process.
    options.store = StoreKind::EtcdPerService;
    options.nodes = 3;
    let fabric = Fabric::up(options).await.expect("fabric up");
    for (i, others) in [(A, [B, C]), (B, [A, C]), (C, [A, B])] {
        let expected: Vec<(&str, PeeringKind)> = others
            .iter()
            .map(|&o| {
                let kind = if i == B || o == B {
                    PeeringKind::Full
                } else {
                    PeeringKind::Induced
                };
                (fabric.clusters[o].id.as_str(), kind)
            })
            .collect();
        fabric
            .wait_tunnel_endpoints(i, &expected, LIMIT)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
    }
    fabric
}

/// `i`'s TunnelEndpoint for `j`.
async fn tunnel_endpoint(fabric: &Fabric, i: usize, j: usize) -> TunnelEndpoint {
    let id = &fabric.clusters[j].id;
    fabric.clusters[i]
        .broker()
        .expect("broker")
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await
        .expect("ListTunnelEndpoints")
        .into_inner()
        .tunnel_endpoints
        .into_iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| &r.cluster_id == id))
        .unwrap_or_else(|| panic!("{i} has no tunnel endpoint for {id}"))
}

/// `addr` moved from `from` into `to` with the same host bits.
fn rebase(addr: Ipv4Addr, from: Ipv4Net, to: Ipv4Net) -> Ipv4Addr {
    assert!(from.contains(&addr), "{addr} not in {from}");
    Ipv4Addr::from(u32::from(to.network()) | (u32::from(addr) & u32::from(from.hostmask())))
}

fn net(text: &str) -> Ipv4Net {
    text.parse()
        .unwrap_or_else(|e| panic!("CIDR {text:?}: {e}"))
}

/// A child process killed on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A TCP listener inside a namespace that accepts and closes, counting connections.
fn listener(ns: &str, addr: SocketAddr) -> (tokio::task::JoinHandle<()>, Arc<AtomicUsize>) {
    let listener = listen_in(ns, addr).unwrap_or_else(|e| panic!("listen on {addr} in {ns}: {e}"));
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let task = tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    (task, accepted)
}

/// The impersonated peer: a `wireguard-go` device in C's gateway namespace, and the source
/// addresses probes leave it from.
struct Impersonator {
    ns: String,
    device: String,
    _process: Killed,
    /// An address in C's real pod CIDR (what C's pods send from; A translates it).
    real: Ipv4Addr,
    /// An address in A's view of C's pod CIDR (A does not translate it).
    seen: Ipv4Addr,
}

impl Impersonator {
    /// Replaces C's (killed) gateway towards A.
    async fn start(fabric: &Fabric, run: &str) -> Self {
        let ns = fabric.topology.sites[C].gw_ns.clone();
        let c_to_a = tunnel_endpoint(fabric, C, A).await;
        let a_to_c = tunnel_endpoint(fabric, A, C).await;
        let listen_port = a_to_c
            .remote_endpoint
            .parse::<SocketAddr>()
            .expect("C's endpoint")
            .port();
        let url = fabric.clusters[C]
            .store_url(Service::Gateway)
            .expect("C's gateway store is etcd");
        let store = trellis_store::open(&url).await.expect("C's gateway store");
        let key = KeyPair::load_or_create(&store).await.expect("C's key");
        assert_eq!(
            key.public().to_string(),
            a_to_c.remote_public_key,
            "the stored key is the one A knows C by"
        );

        let device = format!("ev{run}");
        let process = Command::new("ip")
            .args(["netns", "exec", &ns, "wireguard-go", "-f", &device])
            .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("wireguard-go");
        let process = Killed(process);
        let deadline = Instant::now() + Duration::from_secs(10);
        while ip(&["-n", &ns, "link", "show", &device]).is_err() {
            assert!(Instant::now() < deadline, "wireguard-go made no {device}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let conf = tempfile::NamedTempFile::new().expect("conf");
        std::fs::write(
            conf.path(),
            format!(
                "[Interface]\nPrivateKey = {}\nListenPort = {listen_port}\n\n[Peer]\n\
                 PublicKey = {}\nEndpoint = {}\nAllowedIPs = 0.0.0.0/0\nPersistentKeepalive = 5\n",
                key.private_base64(),
                c_to_a.remote_public_key,
                c_to_a.remote_endpoint
            ),
        )
        .expect("write conf");
        let conf_path = conf.path().to_str().expect("utf-8").to_owned();
        let out = exec(&ns, "wg", &["setconf", &device, &conf_path]).expect("wg runs");
        assert!(
            out.status.success(),
            "wg setconf: {}",
            String::from_utf8_lossy(&out.stderr)
        );

        // Host 200.7 of C's real pod CIDR: outside every node's slice, so no pod of C has it.
        let real = Ipv4Addr::from(u32::from(net(&c_to_a.local_pod_cidr).network()) + 0xc807);
        let seen = rebase(
            real,
            net(&c_to_a.local_pod_cidr),
            net(&c_to_a.local_pod_cidr_nat),
        );
        let (real_host, seen_host) = (format!("{real}/32"), format!("{seen}/32"));
        let (real_s, seen_s) = (real.to_string(), seen.to_string());
        for args in [
            vec!["addr", "add", &real_host, "dev", &device],
            vec!["addr", "add", &seen_host, "dev", &device],
            vec!["link", "set", &device, "mtu", "1420", "up"],
            vec!["route", "add", "default", "dev", &device, "table", TABLE],
            vec![
                "rule", "add", "pref", "100", "from", &real_s, "lookup", TABLE,
            ],
            vec![
                "rule", "add", "pref", "100", "from", &seen_s, "lookup", TABLE,
            ],
        ] {
            let mut all = vec!["-n", ns.as_str()];
            all.extend(args.iter().copied());
            ip(&all).unwrap_or_else(|e| panic!("{e:#}"));
        }
        // Answers come from wherever; the probes' sources are only routed through the device.
        for dev in ["all", device.as_str()] {
            exec(
                &ns,
                "sysctl",
                &["-qw", &format!("net.ipv4.conf.{dev}.rp_filter=0")],
            )
            .expect("sysctl");
        }
        Self {
            ns,
            device,
            _process: process,
            real,
            seen,
        }
    }

    /// Whether a ping from `src` to `to` gets an answer (three tries).
    fn pings(&self, src: Ipv4Addr, to: Ipv4Addr) -> bool {
        exec(
            &self.ns,
            "ping",
            &[
                "-n",
                "-c",
                "3",
                "-i",
                "0.2",
                "-w",
                "2",
                "-I",
                &src.to_string(),
                &to.to_string(),
            ],
        )
        .expect("ping runs")
        .status
        .success()
    }

    /// Whether a TCP connection from `src` to `to` is accepted (or refused: an answer all the
    /// same).
    fn connects(&self, src: Ipv4Addr, to: SocketAddr) -> bool {
        let script = "import socket, sys\n\
                      s = socket.socket()\n\
                      s.settimeout(2)\n\
                      s.bind((sys.argv[1], 0))\n\
                      try:\n\
                      \x20   s.connect((sys.argv[2], int(sys.argv[3])))\n\
                      except ConnectionRefusedError:\n\
                      \x20   pass\n";
        exec(
            &self.ns,
            "python3",
            &[
                "-c",
                script,
                &src.to_string(),
                &to.ip().to_string(),
                &to.port().to_string(),
            ],
        )
        .expect("python runs")
        .status
        .success()
    }

    /// Whether `target` answers a ping or a TCP connection from either source, and which did.
    fn reaches(&self, target: &Target) -> Vec<String> {
        let mut got = Vec::new();
        for (name, src) in [("real", self.real), ("seen", self.seen)] {
            if self.pings(src, target.addr) {
                got.push(format!("ping from {name} {src}"));
            }
            if let Some(port) = target.port
                && self.connects(src, SocketAddr::new(IpAddr::V4(target.addr), port))
            {
                got.push(format!("tcp:{port} from {name} {src}"));
            }
        }
        got
    }
}

impl Drop for Impersonator {
    fn drop(&mut self) {
        let _ = ip(&["-n", &self.ns, "link", "del", &self.device]);
    }
}

/// Something (a)-(c) probe.
#[derive(Debug)]
struct Target {
    what: String,
    addr: Ipv4Addr,
    port: Option<u16>,
}

/// Keeps guards deleted while it lives, every 100 ms (the gateway and the agents put them back
/// on each resync): `(namespace, nft arguments)` per guard.
struct GuardsOff {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GuardsOff {
    fn start(deletes: Vec<(String, Vec<&'static str>)>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                for (ns, args) in &deletes {
                    let _ = exec(ns, "nft", args);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for GuardsOff {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The gateway's tunnel guard of `site`.
fn gateway_guard(site: &Site) -> Vec<(String, Vec<&'static str>)> {
    vec![(
        site.gw_ns.clone(),
        vec!["delete", "table", "ip", "trellis-guard"],
    )]
}

/// The route agents' node guards of `site`.
fn node_guards(site: &Site) -> Vec<(String, Vec<&'static str>)> {
    site.nodes
        .iter()
        .map(|n| {
            (
                n.netns.clone(),
                vec!["delete", "chain", "ip", "trellis-route", "input"],
            )
        })
        .collect()
}

/// The interface A routes `to` through.
fn route_dev(ns: &str, to: Ipv4Addr) -> String {
    let json = ip(&["-n", ns, "-j", "route", "get", &to.to_string()]).expect("route get");
    let v: serde_json::Value = serde_json::from_str(&json).expect("json");
    v[0]["dev"].as_str().expect("dev").to_owned()
}

/// One phase's probes, every target at once. A target `through` says must answer is tried
/// until it does (the deleted guards come back for a moment on every resync); the others are
/// tried once and must not answer. Returns what went otherwise.
fn probe(
    phase: &str,
    evil: &Impersonator,
    targets: &[Target],
    through: impl Fn(&Target) -> bool + Sync,
) -> Vec<String> {
    let one = |target: &Target| -> Option<String> {
        let started = Instant::now();
        let expected = through(target);
        let label = format!("{} {}", target.what, target.addr);
        loop {
            let got = evil.reaches(target);
            match (expected, got.is_empty()) {
                (true, false) => {
                    eprintln!("{phase}: {label} answered: {got:?}");
                    return None;
                }
                (false, true) => return None,
                (false, false) => return Some(format!("{label} answered: {got:?}")),
                (true, true) if started.elapsed() > Duration::from_secs(20) => {
                    return Some(format!("{label} never answered"));
                }
                (true, true) => {}
            }
        }
    };
    std::thread::scope(|scope| {
        let running: Vec<_> = targets
            .iter()
            .map(|t| scope.spawn(move || one(t)))
            .collect();
        running
            .into_iter()
            .filter_map(|r| r.join().expect("probe thread"))
            .collect()
    })
}

/// Packets that left through `dev` in `ns` while `LEAK_PINGS` pings went from `src` to `to`.
fn leaked(evil: &Impersonator, ns: &str, dev: &str, to: Ipv4Addr) -> u64 {
    let before = link_counters(ns, dev).expect("counters");
    exec(
        &evil.ns,
        "ping",
        &[
            "-n",
            "-q",
            "-c",
            &LEAK_PINGS.to_string(),
            "-i",
            "0.05",
            "-W",
            "1",
            "-I",
            &evil.real.to_string(),
            &to.to_string(),
        ],
    )
    .expect("ping runs");
    link_counters(ns, dev).expect("counters").tx_packets - before.tx_packets
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_sending_anything_through_its_tunnel_reaches_only_our_pods() {
    if !can_run("a_peer_sending_anything_through_its_tunnel_reaches_only_our_pods") {
        return;
    }
    let mut fabric = up().await;
    let run = fabric.topology.run.clone();
    let site_a = fabric.topology.sites[A].clone();
    let (n0, n1) = (site_a.nodes[0].clone(), site_a.nodes[1].clone());

    // Listeners on every address of A's gateway node and of a non-gateway node, and in the pod
    // of the non-gateway node.
    let (_l0, at_n0) = listener(&n0.netns, SocketAddr::from(([0, 0, 0, 0], NODE_PORT)));
    let (_l1, at_n1) = listener(&n1.netns, SocketAddr::from(([0, 0, 0, 0], NODE_PORT)));
    let (_lp, at_pod) = listener(&n1.pod_ns, SocketAddr::from((n1.pod_ip, POD_PORT)));

    // How C addresses A, and how A addresses B, before C's gateway goes.
    let c_view_of_a = fabric.view(C, A, false).await.expect("view");
    let a_view_of_b = fabric.view(A, B, false).await.expect("view");
    let as_c_sees = |addr: Ipv4Addr| rebase(addr, site_a.pod_cidr, c_view_of_a);
    let b_pod = fabric.topology.sites[B].nodes[1].pod_ip;
    let b_pod_seen = rebase(b_pod, fabric.topology.sites[B].pod_cidr, a_view_of_b);
    let to_b = route_dev(&site_a.gw_ns, b_pod_seen);

    fabric.clusters[C].kill9(Service::Gateway).expect("kill");
    let evil = Impersonator::start(&fabric, &run).await;

    let first_host = |slice: Ipv4Net| Ipv4Addr::from(u32::from(slice.network()) + 1);
    let n1_pod_side = as_c_sees(first_host(n1.pod_slice));
    let targets = [
        Target {
            what: "(a) the non-gateway node's node address".into(),
            addr: n1.node_ip,
            port: Some(NODE_PORT),
        },
        Target {
            what: "(a) the gateway node's node address".into(),
            addr: n0.node_ip,
            port: Some(NODE_PORT),
        },
        Target {
            what: "(a) the non-gateway node's pod-side address, as C addresses it".into(),
            addr: n1_pod_side,
            port: Some(NODE_PORT),
        },
        Target {
            what: "(a) the gateway node's pod-side address, as C addresses it".into(),
            addr: as_c_sees(first_host(n0.pod_slice)),
            port: Some(NODE_PORT),
        },
        Target {
            what: "(b) A's gateway gRPC service".into(),
            addr: site_a.uplink_ip,
            port: Some(Service::Gateway.port()),
        },
        Target {
            what: "(b) the non-gateway node's route agent".into(),
            addr: n1.node_ip,
            port: Some(ROUTE_PORT),
        },
        Target {
            what: "(c) B's pod, as A addresses it".into(),
            addr: b_pod_seen,
            port: Some(POD_PORT),
        },
    ];
    let pod_seen = as_c_sees(n1.pod_ip);
    let pod = SocketAddr::new(IpAddr::V4(pod_seen), POD_PORT);

    // (d) first: the impersonator's handshake with A, then pod traffic through it.
    let started = Instant::now();
    while !evil.pings(evil.real, pod_seen) {
        assert!(
            started.elapsed() < LIMIT,
            "the impersonator never reached A's pod at {pod_seen}\n{}",
            fabric.logs()
        );
    }
    eprintln!(
        "measured: the impersonated peer reached A's pod {} ms after it started",
        started.elapsed().as_millis()
    );

    // Phase 1: the guards as the gateway and the agents apply them (unless told to delete
    // them, to see this test fail).
    let off = std::env::var_os("TRELLIS_TEST_NO_GUARD").map(|_| {
        let mut all = gateway_guard(&site_a);
        all.extend(node_guards(&site_a));
        GuardsOff::start(all)
    });
    if off.is_none() {
        let listed = exec(
            &site_a.gw_ns,
            "nft",
            &["list", "table", "ip", "trellis-guard"],
        )
        .expect("nft runs");
        assert!(listed.status.success(), "A has no guard table");
    }
    let accepted_before = at_n0.load(Ordering::SeqCst) + at_n1.load(Ordering::SeqCst);
    let wrong = probe("guarded", &evil, &targets, |_| false);
    let leaks = leaked(&evil, &site_a.gw_ns, &to_b, b_pod_seen);
    let accepted = at_n0.load(Ordering::SeqCst) + at_n1.load(Ordering::SeqCst) - accepted_before;
    let pod_pings = evil.pings(evil.real, pod_seen);
    let pod_connects = evil.connects(evil.real, pod);
    drop(off);
    eprintln!("guarded: {leaks} of {LEAK_PINGS} pings to B's range left through {to_b}");
    assert!(
        wrong.is_empty() && accepted == 0 && leaks < LEAK_PINGS / 2,
        "through the guards: {wrong:#?}; {accepted} connections accepted on node addresses; \
         {leaks} of {LEAK_PINGS} pings left through A's tunnel to B ({to_b})"
    );
    assert!(
        pod_pings && pod_connects,
        "pod traffic stopped: ping {pod_pings}, tcp {pod_connects}"
    );
    assert!(
        at_pod.load(Ordering::SeqCst) > 0,
        "the pod's listener saw nothing"
    );

    // Phase 2: the gateway's guard alone (the agents' node guards deleted). It stops
    // everything but the one node address inside the pod CIDR, which it cannot tell from a pod.
    let off = GuardsOff::start(node_guards(&site_a));
    let wrong = probe("gateway guard only", &evil, &targets, |t| {
        t.addr == n1_pod_side
    });
    let leaks = leaked(&evil, &site_a.gw_ns, &to_b, b_pod_seen);
    drop(off);
    assert!(
        wrong.is_empty() && leaks < LEAK_PINGS / 2,
        "with the gateway's guard alone: {wrong:#?}; {leaks} of {LEAK_PINGS} pings left \
         through A's tunnel to B"
    );

    // Phase 3, the control: with every guard deleted, (a)-(c) get through ((c) leaves through
    // A's tunnel to B, where B's AllowedIPs drop it).
    let mut all = gateway_guard(&site_a);
    all.extend(node_guards(&site_a));
    let off = GuardsOff::start(all);
    let wrong = probe("unguarded", &evil, &targets, |t| !t.what.starts_with("(c)"));
    let leaks = leaked(&evil, &site_a.gw_ns, &to_b, b_pod_seen);
    drop(off);
    eprintln!("unguarded: {leaks} of {LEAK_PINGS} pings to B's range left through {to_b}");
    assert!(
        wrong.is_empty() && leaks >= LEAK_PINGS / 2,
        "without the guards (the probes prove nothing): {wrong:#?}; {leaks} of {LEAK_PINGS} \
         pings left through A's tunnel to B"
    );
    drop(evil);
}
