//! The gateway's tunnel guard (issue 14, ADR 0016) against a peer that misbehaves, with real
//! packets through a real WireGuard tunnel, as root, in namespaces this test creates and always
//! removes.
//!
//! A well-behaved gateway cannot even emit the packets the guard exists for: its AllowedIPs
//! route only our mapped ranges into the tunnel, and our NAT rewrites the rest. So after the
//! usual three clusters × three nodes are up (hub B, leaves A and C, one pod CIDR), one
//! cluster's gateway (the peer; leaf C towards leaf A, "ours", unless the IPAM's choices make
//! another assignment necessary, see `choose_roles`) is killed with SIGKILL and, in its
//! namespace, an **impersonator** takes its place: `wireguard-go` (an independent userspace
//! WireGuard) holding the peer's private key (read from its gateway store), its listen port
//! for us and our public key and endpoint, with AllowedIPs 0.0.0.0/0. Our gateway sees its
//! peer come back (once the impersonator's handshake timestamps pass the killed gateway's last
//! one: `wireguard-go` and boringtun count TAI64N from bases 27 s apart); the peer now sends
//! whatever it likes through the real tunnel, from its real pod range (what its pods use) and
//! from the range we address it by (which we do not translate, so even the gateway node's own
//! replies route back into the tunnel).
//!
//! From it, towards us:
//! - (a) node addresses: a non-gateway node's and the gateway node's node-network addresses and
//!   their pod-side addresses (the pod CIDR's first host of each node's slice, as the peer
//!   addresses it), each with a TCP listener on every address (like a kubelet);
//! - (b) Trellis services: our gateway's gRPC port on its bridge address, the route agent's
//!   port on a non-gateway node;
//! - (c) another peer's range: the third cluster's pod (or external range) as we address it
//!   (what leaves through our tunnel to the third is counted: without the guards the third's
//!   AllowedIPs usually refuse our translated source, so an answer cannot be relied on);
//! - (d) our pod on a non-gateway node at the address the peer's pods use;
//! - (e) an address of our external CIDR that no hub-path mapping uses, as the peer addresses
//!   it: our DNAT turns it into our real external address, which nothing of ours holds, so the
//!   gateway node would route it out of its default route (a real node has one; the test gives
//!   our gateway node one, through a neighbour that drops everything) with the peer's source
//!   translated. What leaves the underlay interface towards it is counted (an nftables counter
//!   in the gateway node's postrouting hook).
//!
//! Three phases, each probing every target from both sources:
//! 1. the guards as the gateway (`ip trellis-guard`) and the route agents (the node guard in
//!    `ip trellis-route`) apply them: (a)-(c) stay unanswered, no listener on a node address
//!    accepts anything, (c) does not leave through our tunnel to the third and (e) does not
//!    leave the underlay, while (d) answers;
//! 2. the node guards deleted over and over (their agents put them back on each resync): the
//!    gateway's guard alone stops everything but the non-gateway node's pod-side address, which
//!    lies inside the pod CIDR it must let through, and (e) still does not leave;
//! 3. every guard deleted (the control): every (a) and (b) target answers and (c) leaves
//!    through our tunnel to the third (and, where the address plans line up, even gets its
//!    answer back), and (e) leaves the underlay, which shows the probes see what the guards
//!    stop.
//!
//! With `TRELLIS_TEST_NO_GUARD=1` phase 1 runs without the guards too, and the test fails.
//!
//! The first test runs under the double NAT (every gateway with `--no-stateless-wire`), the
//! second under the stateless wire convention (the default, ADR 0034): the peer's traffic is untracked at our gateway, the peer addresses
//! us in our own terms (the targets are our real addresses), and the source its pods use is our
//! view of it; the impersonator undoes our engine's translation of the answers in its own
//! namespace, as a stateless peer's engine would.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`python3`/
//! `wireguard-go`/`wg` (`scripts/setup.sh` installs them); CI runs as root and fails instead.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use trellis_api::pb::types::TunnelEndpoint;
use trellis_gateway::keys::KeyPair;
use trellis_netlab::netns::{exec, ip, listen_in, nft_apply, nft_packets};
use trellis_netlab::topology::{UPLINK, host, link_counters};
use trellis_netlab::{Fabric, FabricOptions, Service, Site, StoreKind};

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
/// The impersonator's routing table in the peer's gateway namespace.
const TABLE: &str = "4711";
/// Pings sent towards the third cluster's range to count what leaves through our tunnel to it.
const LEAK_PINGS: u64 = 20;
/// Host of our external CIDR probed as (e): far above what the IPAM hands out to mappings
/// here (checked against our gateway's DNAT map all the same).
const UNMAPPED_HOST: u32 = 0xc809;
/// Host of the uplink's /24 the test makes our gateway node's default gateway: no site has it,
/// and its neighbour entry is a MAC nobody owns, so what is routed there leaves and is lost.
const BLACKHOLE_HOST: u32 = 254;
/// The nftables table counting what leaves our gateway node's underlay towards (e).
const UNDERLAY_COUNT: &str = "tlunderlay";
/// The impersonator's nftables table undoing our engine's translation (stateless wire only).
const UNTRANSLATE: &str = "tluntranslate";

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(
        test,
        &["ip", "nft", "ping", "python3", "wireguard-go", "wg"],
    )
}

/// The three clusters, every gateway offering the stateless wire convention (the default)
/// when `stateless`, none (`--no-stateless-wire`) otherwise (ADR 0034).
async fn up(stateless: bool) -> Fabric {
    let mut options = FabricOptions::three_clusters();
    // The peer's gateway key is read from its store: etcd, which outlives the killed process.
    options.store = StoreKind::EtcdPerService;
    options.nodes = 3;
    if !stateless {
        options.extra_args = vec![(Service::Gateway, vec!["--no-stateless-wire".into()])];
    }
    let fabric = Fabric::up(options).await.expect("fabric up");
    fabric
        .wait_mesh(LIMIT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
    fabric
}

/// `i`'s TunnelEndpoint for `j`.
async fn tunnel_endpoint(fabric: &Fabric, i: usize, j: usize) -> TunnelEndpoint {
    let id = &fabric.clusters[j].id;
    trellis_integration::peering::answered_tunnel_to(&fabric.clusters[i], id)
        .await
        .expect("ListTunnelEndpoints")
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

/// The impersonated peer: a `wireguard-go` device in its gateway's namespace, and the source
/// addresses probes leave it from.
struct Impersonator {
    ns: String,
    device: String,
    _process: Killed,
    /// An address in the peer's real pod CIDR (what its pods send from; we translate it).
    real: Ipv4Addr,
    /// An address in our view of the peer's pod CIDR (we do not translate it).
    seen: Ipv4Addr,
    /// The source a well-behaved peer's pods send from as they reach us: `real` under the
    /// double NAT (we translate it), `seen` under the stateless wire (the peer translated it,
    /// and our engine accepts nothing else from its tunnel).
    sender: Ipv4Addr,
}

impl Impersonator {
    /// Replaces `evil`'s (killed) gateway towards `ours`. Under the stateless wire
    /// (`stateless`), it also undoes in its namespace what our engine does to what it sends
    /// back (our real ranges into the peer's views of them, our view of the peer into its
    /// real range), so that its sockets see the answers as a stateless peer's pods would.
    async fn start(fabric: &Fabric, run: &str, evil: usize, ours: usize, stateless: bool) -> Self {
        let ns = fabric.topology.sites[evil].gw_ns.clone();
        let c_to_a = tunnel_endpoint(fabric, evil, ours).await;
        let a_to_c = tunnel_endpoint(fabric, ours, evil).await;
        let listen_port = a_to_c
            .remote_endpoint
            .parse::<SocketAddr>()
            .expect("the peer's endpoint")
            .port();
        let url = fabric.clusters[evil]
            .store_url(Service::Gateway)
            .expect("the peer's gateway store is etcd");
        let store = trellis_store::open(&url)
            .await
            .expect("the peer's gateway store");
        let key = KeyPair::load_or_create(&store)
            .await
            .expect("the peer's key");
        assert_eq!(
            key.public().to_string(),
            a_to_c.remote_public_key,
            "the stored key is the one we know the peer by"
        );

        let device = format!("ev{run}");
        let process = Command::new("ip")
            .args(["netns", "exec", &ns, "wireguard-go", "-f", &device])
            // Older wireguard-go releases refuse to run on Linux without it.
            .env("WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("wireguard-go");
        let process = Killed(process);
        trellis_testkit::eventually(
            &format!("wireguard-go to make {device}"),
            Duration::from_secs(10),
            || async { ip(&["-n", &ns, "link", "show", &device]).ok() },
        )
        .await;
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

        // Host 200.7 of the peer's real pod CIDR: outside every node's slice, so no pod has it.
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
        if stateless {
            untranslate(&ns, &device, &a_to_c, (real, seen));
            // Our real addresses are the targets now, and this namespace holds some of them
            // in its own cluster's terms (the same pod CIDR): the probes' rules must come
            // before the local table, or those targets answer from here.
            for args in [
                ["rule", "add", "pref", "200", "lookup", "local"],
                ["rule", "del", "pref", "0", "lookup", "local"],
            ] {
                let mut all = vec!["-n", ns.as_str()];
                all.extend(args);
                ip(&all).unwrap_or_else(|e| panic!("{e:#}"));
            }
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
            sender: if stateless { seen } else { real },
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
        // wireguard-go's control socket is host-wide and outlives a killed process.
        let _ = std::fs::remove_file(format!("/var/run/wireguard/{}.sock", self.device));
    }
}

/// Stateless rewrites in the impersonator's namespace, ahead of conntrack, of what arrives on
/// `device`: `real` (where our engine sends answers to `seen`) back to `seen`, and our real
/// pod and external ranges as the peer sees them back to our real ones. `a_to_c` is our
/// TunnelEndpoint for the peer.
fn untranslate(
    ns: &str,
    device: &str,
    a_to_c: &TunnelEndpoint,
    (real, seen): (Ipv4Addr, Ipv4Addr),
) {
    let mut rules = vec![format!(
        "iifname \"{device}\" ip daddr {real} ip daddr set {seen}"
    )];
    for (ours, theirs) in [
        (&a_to_c.local_pod_cidr, &a_to_c.local_pod_cidr_nat),
        (&a_to_c.local_external_cidr, &a_to_c.local_external_cidr_nat),
    ] {
        let (ours, theirs) = (net(ours), net(theirs));
        if ours != theirs {
            rules.push(format!(
                "iifname \"{device}\" ip saddr {theirs} ip saddr set ip saddr & {} | {}",
                ours.hostmask(),
                ours.network()
            ));
        }
    }
    let script = format!(
        "table ip {UNTRANSLATE} {{\n  chain pre {{\n    type filter hook prerouting priority \
         raw - 10;\n    {}\n  }}\n}}\n",
        rules.join("\n    ")
    );
    nft_apply(ns, &script).unwrap_or_else(|e| panic!("{e:#}\n{script}"));
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
            &evil.sender.to_string(),
            &to.to_string(),
        ],
    )
    .expect("ping runs");
    link_counters(ns, dev).expect("counters").tx_packets - before.tx_packets
}

/// Gives our gateway node `ns` a default route out of its underlay interface (what a real node
/// has), to a neighbour that drops everything, and a counter of what leaves the underlay
/// towards `to`.
fn count_underlay(ns: &str, uplink_ip: Ipv4Addr, to: Ipv4Addr) {
    let uplink = Ipv4Net::new(uplink_ip, 24).expect("/24").trunc();
    let gateway = host(uplink, BLACKHOLE_HOST).to_string();
    ip(&[
        "-n",
        ns,
        "neigh",
        "replace",
        &gateway,
        "lladdr",
        "02:00:00:00:fe:fe",
        "dev",
        UPLINK,
        "nud",
        "permanent",
    ])
    .unwrap_or_else(|e| panic!("{e:#}"));
    ip(&[
        "-n", ns, "route", "replace", "default", "via", &gateway, "dev", UPLINK,
    ])
    .unwrap_or_else(|e| panic!("{e:#}"));
    let script = format!(
        "table ip {UNDERLAY_COUNT} {{\n  chain post {{\n    type filter hook postrouting \
         priority 300;\n    oifname \"{UPLINK}\" ip daddr {to} counter\n  }}\n}}\n"
    );
    let mut nft = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("nft");
    std::io::Write::write_all(&mut nft.stdin.take().expect("stdin"), script.as_bytes())
        .expect("script");
    assert!(nft.wait().expect("nft").success(), "the underlay counter");
}

/// The packets the underlay counter of `ns` has seen.
fn underlay_count(ns: &str) -> u64 {
    nft_packets(ns, &["table", "ip", UNDERLAY_COUNT])
}

/// Packets that left the underlay of `ns` towards (e) while `LEAK_PINGS` pings went from the
/// peer's pods' source to `to` (the address as the peer addresses it).
fn leaked_out(evil: &Impersonator, ns: &str, to: Ipv4Addr) -> u64 {
    let before = underlay_count(ns);
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
            &evil.sender.to_string(),
            &to.to_string(),
        ],
    )
    .expect("ping runs");
    underlay_count(ns) - before
}

/// Who plays whom: `ours` (whose guards are probed), `evil` (the impersonated peer) and
/// `third` (whose range `evil` must not reach through `ours`), and the address of `third` the
/// probes use, as `ours` addresses it.
struct Roles {
    ours: usize,
    evil: usize,
    third: usize,
    third_target: Ipv4Addr,
    third_what: String,
}

fn overlap(a: Ipv4Net, b: Ipv4Net) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The first assignment (leaf A ours, leaf C impersonated, hub B third, then the others) where
/// one of the third's ranges, as we address it, lies outside the peer's views of us. Each
/// cluster's IPAM maps independently, so the peer may address us with the very prefix we use
/// for the third; a destination from the peer's tunnel is read in the peer's plan first (our
/// DNAT), so such a prefix leads to our own pods and cannot probe the third.
async fn choose_roles(fabric: &Fabric) -> Roles {
    let mut seen = Vec::new();
    for (ours, evil, third) in [
        (A, C, B),
        (C, A, B),
        (A, B, C),
        (C, B, A),
        (B, A, C),
        (B, C, A),
    ] {
        let mut theirs = Vec::new();
        for external in [false, true] {
            theirs.push(fabric.view(evil, ours, external).await.expect("view"));
        }
        for external in [false, true] {
            let view = fabric.view(ours, third, external).await.expect("view");
            seen.push(format!(
                "{ours} sees {third} at {view}; {evil} sees {ours} at {theirs:?}"
            ));
            if theirs.iter().any(|t| overlap(*t, view)) {
                continue;
            }
            let site = &fabric.topology.sites[third];
            let (target, what) = if external {
                (
                    host(view, 10),
                    "an address of the third cluster's external range",
                )
            } else {
                (
                    rebase(site.nodes[1].pod_ip, site.pod_cidr, view),
                    "the third cluster's pod",
                )
            };
            return Roles {
                ours,
                evil,
                third,
                third_target: target,
                third_what: format!("(c) {what}, as we address it"),
            };
        }
    }
    panic!("every range of every third cluster is shadowed: {seen:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_sending_anything_through_its_tunnel_reaches_only_our_pods() {
    if !can_run("a_peer_sending_anything_through_its_tunnel_reaches_only_our_pods") {
        return;
    }
    hostile_peer(false).await;
}

/// The same under the stateless wire convention (ADR 0034): the peer's traffic is untracked
/// here, the peer addresses us in our own terms (no DNAT of ours to lean on) and our engine
/// takes only our views of the peer as sources. The guard must stop the same things.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_the_stateless_wire_a_peer_sending_anything_reaches_only_our_pods() {
    if !can_run("under_the_stateless_wire_a_peer_sending_anything_reaches_only_our_pods") {
        return;
    }
    hostile_peer(true).await;
}

/// The whole test, under the double NAT or, with `stateless`, the stateless wire.
async fn hostile_peer(stateless: bool) {
    let mut fabric = up(stateless).await;
    let run = fabric.topology.run.clone();
    let roles = choose_roles(&fabric).await;
    let id = |i: usize| fabric.clusters[i].id.clone();
    eprintln!(
        "roles: ours {}, impersonated {}, third {} (probed at {})",
        id(roles.ours),
        id(roles.evil),
        id(roles.third),
        roles.third_target
    );
    let ours = fabric.topology.sites[roles.ours].clone();
    let (n0, n1) = (ours.nodes[0].clone(), ours.nodes[1].clone());

    // Listeners on every address of our gateway node and of a non-gateway node, and in the pod
    // of the non-gateway node.
    let (_l0, at_n0) = listener(&n0.netns, SocketAddr::from(([0, 0, 0, 0], NODE_PORT)));
    let (_l1, at_n1) = listener(&n1.netns, SocketAddr::from(([0, 0, 0, 0], NODE_PORT)));
    let (_lp, at_pod) = listener(&n1.pod_ns, SocketAddr::from((n1.pod_ip, POD_PORT)));

    // How the peer addresses us, before its gateway goes.
    let peer_view = fabric
        .view(roles.evil, roles.ours, false)
        .await
        .expect("view");
    // Under the stateless wire the peer translates: it addresses us in our own terms.
    let as_peer_sees = |addr: Ipv4Addr| {
        if stateless {
            addr
        } else {
            rebase(addr, ours.pod_cidr, peer_view)
        }
    };
    let to_third_dev = route_dev(&ours.gw_ns, roles.third_target);
    // (e): an unmapped address of our external CIDR, real and as the peer addresses it.
    let our_external = net(&tunnel_endpoint(&fabric, roles.ours, roles.evil)
        .await
        .local_external_cidr);
    let unmapped = host(our_external, UNMAPPED_HOST);
    let unmapped_seen = if stateless {
        unmapped
    } else {
        rebase(
            unmapped,
            our_external,
            fabric
                .view(roles.evil, roles.ours, true)
                .await
                .expect("view"),
        )
    };
    let nat = exec(&ours.gw_ns, "nft", &["list", "table", "ip", "trellis"]).expect("nft runs");
    let nat = String::from_utf8_lossy(&nat.stdout);
    assert!(
        !nat.contains(&format!("{unmapped_seen} :")) && !nat.contains(&format!("{unmapped} ")),
        "(e) {unmapped} is mapped after all:\n{nat}"
    );
    count_underlay(&ours.gw_ns, ours.uplink_ip, unmapped);

    fabric.clusters[roles.evil]
        .kill9(Service::Gateway)
        .expect("kill");
    let evil = Impersonator::start(&fabric, &run, roles.evil, roles.ours, stateless).await;

    let first_host = |slice: Ipv4Net| host(slice, 1);
    let n1_pod_side = as_peer_sees(first_host(n1.pod_slice));
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
            what: "(a) the non-gateway node's pod-side address, as the peer addresses it".into(),
            addr: n1_pod_side,
            port: Some(NODE_PORT),
        },
        Target {
            what: "(a) the gateway node's pod-side address, as the peer addresses it".into(),
            addr: as_peer_sees(first_host(n0.pod_slice)),
            port: Some(NODE_PORT),
        },
        Target {
            what: "(b) our gateway's gRPC service".into(),
            addr: ours.uplink_ip,
            port: Some(Service::Gateway.port()),
        },
        Target {
            what: "(b) the non-gateway node's route agent".into(),
            addr: n1.node_ip,
            port: Some(ROUTE_PORT),
        },
        Target {
            what: roles.third_what.clone(),
            addr: roles.third_target,
            port: Some(POD_PORT),
        },
    ];
    let pod_seen = as_peer_sees(n1.pod_ip);
    let pod = SocketAddr::new(IpAddr::V4(pod_seen), POD_PORT);

    // (d) first: the impersonator's handshake with us, then pod traffic through it.
    let started = Instant::now();
    while !evil.pings(evil.sender, pod_seen) {
        assert!(
            started.elapsed() < LIMIT,
            "the impersonator never reached our pod at {pod_seen}\n{}",
            fabric.logs()
        );
    }
    eprintln!(
        "measured: the impersonated peer reached our pod {} ms after it started",
        started.elapsed().as_millis()
    );

    // Phase 1: the guards as the gateway and the agents apply them (unless told to delete
    // them, to see this test fail).
    let off = std::env::var_os("TRELLIS_TEST_NO_GUARD").map(|_| {
        let mut all = gateway_guard(&ours);
        all.extend(node_guards(&ours));
        GuardsOff::start(all)
    });
    if off.is_none() {
        let listed = exec(
            &ours.gw_ns,
            "nft",
            &["list", "table", "ip", "trellis-guard"],
        )
        .expect("nft runs");
        assert!(listed.status.success(), "our gateway has no guard table");
    }
    let accepted_before = at_n0.load(Ordering::SeqCst) + at_n1.load(Ordering::SeqCst);
    let wrong = probe("guarded", &evil, &targets, |_| false);
    let leaks = leaked(&evil, &ours.gw_ns, &to_third_dev, roles.third_target);
    let out = leaked_out(&evil, &ours.gw_ns, unmapped_seen);
    let accepted = at_n0.load(Ordering::SeqCst) + at_n1.load(Ordering::SeqCst) - accepted_before;
    // A lost probe is no proof of a block: the pod is tried until both kinds answer, and its
    // listener (not just any host) must have taken the connection.
    let started = Instant::now();
    let (mut pod_pings, mut pod_accepted) = (false, false);
    while !(pod_pings && pod_accepted) && started.elapsed() < Duration::from_secs(20) {
        pod_pings = pod_pings || evil.pings(evil.sender, pod_seen);
        if !pod_accepted && evil.connects(evil.sender, pod) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        pod_accepted = at_pod.load(Ordering::SeqCst) > 0;
    }
    drop(off);
    eprintln!(
        "guarded: {leaks} of {LEAK_PINGS} pings to the third's range left through {to_third_dev}; \
         {out} to (e) {unmapped_seen} left the underlay towards {unmapped}"
    );
    assert!(
        wrong.is_empty() && accepted == 0 && leaks < LEAK_PINGS / 2 && out == 0,
        "through the guards: {wrong:#?}; {accepted} connections accepted on node addresses; \
         {leaks} of {LEAK_PINGS} pings left through our tunnel to the third ({to_third_dev}); \
         {out} of {LEAK_PINGS} pings to (e), an unmapped address of our external CIDR \
         ({unmapped_seen} as the peer addresses it), left our gateway node's underlay"
    );
    assert!(
        pod_pings && pod_accepted,
        "pod traffic stopped: ping {pod_pings}, tcp accepted by the pod {pod_accepted}"
    );

    // Phase 2: the gateway's guard alone (the agents' node guards deleted). It stops
    // everything but the one node address inside the pod CIDR, which it cannot tell from a pod.
    let off = GuardsOff::start(node_guards(&ours));
    let wrong = probe("gateway guard only", &evil, &targets, |t| {
        t.addr == n1_pod_side
    });
    let leaks = leaked(&evil, &ours.gw_ns, &to_third_dev, roles.third_target);
    let out = leaked_out(&evil, &ours.gw_ns, unmapped_seen);
    drop(off);
    assert!(
        wrong.is_empty() && leaks < LEAK_PINGS / 2 && out == 0,
        "with the gateway's guard alone: {wrong:#?}; {leaks} of {LEAK_PINGS} pings left \
         through our tunnel to the third; {out} of {LEAK_PINGS} pings to (e) left the underlay"
    );

    // Phase 3, the control: with every guard deleted, (a)-(c) get through. (c) leaves through
    // our tunnel to the third; whether the third answers depends on the address plans: its
    // AllowedIPs refuse our translated source, unless the third happens to address us with the
    // prefix we address the peer by (then the peer's probes transit us both ways).
    let mut all = gateway_guard(&ours);
    all.extend(node_guards(&ours));
    let off = GuardsOff::start(all);
    let (to_us, to_third): (Vec<Target>, Vec<Target>) = targets
        .into_iter()
        .partition(|t| !t.what.starts_with("(c)"));
    let wrong = probe("unguarded", &evil, &to_us, |_| true);
    for t in &to_third {
        eprintln!("unguarded: {} {}: {:?}", t.what, t.addr, evil.reaches(t));
    }
    let leaks = leaked(&evil, &ours.gw_ns, &to_third_dev, roles.third_target);
    let out = leaked_out(&evil, &ours.gw_ns, unmapped_seen);
    drop(off);
    eprintln!(
        "unguarded: {leaks} of {LEAK_PINGS} pings to the third's range left through \
         {to_third_dev}; {out} to (e) left the underlay"
    );
    assert!(
        wrong.is_empty() && leaks >= LEAK_PINGS / 2 && out >= LEAK_PINGS / 2,
        "without the guards (the probes prove nothing): {wrong:#?}; {leaks} of {LEAK_PINGS} \
         pings left through our tunnel to the third; {out} of {LEAK_PINGS} pings to (e) left \
         the underlay"
    );
    drop(evil);
}
