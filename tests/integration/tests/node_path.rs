//! The node path (issue 14) with real packets, as root, in network namespaces this test creates
//! and always removes: three clusters (hub B, leaves A and C), **all with pod CIDR 10.0.0.0/16**,
//! each **three nodes** on a node network of its own. Node 0 runs the six services and the
//! gateway (userspace WireGuard); every node runs `trellis-route` and has a pod in its /24 of
//! the pod CIDR; the nodes route each other's slices (a host-routed pod network) and nothing
//! else. A pod on node 1 or 2 reaches a remote cluster only if its route agent carried the
//! remote prefixes into the VXLAN to the gateway node, and the replies of traffic the gateway
//! DNATs to it only come back if the agent got the return path right.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`python3`; CI runs
//! as root and fails instead. Heavy (27 processes): one at a time in the `netns` test group.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use trellis_api::pb::peering::UnpeerRequest;
use trellis_integration::prom::{parse, parser_python, scrape_in};
use trellis_netlab::netns::{exec, ip};
use trellis_netlab::topology::link_counters;
use trellis_netlab::{Fabric, FabricOptions, Service, StoreKind};

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const NODES: usize = 3;
const LIMIT: Duration = Duration::from_secs(90);

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft", "ping", "python3"])
}

async fn up() -> Fabric {
    up_with(StoreKind::Memory).await
}

async fn up_with(store: StoreKind) -> Fabric {
    let mut options = FabricOptions::three_clusters();
    options.store = store;
    options.nodes = NODES;
    let started = Instant::now();
    let fabric = Fabric::up(options).await.expect("fabric up");
    fabric
        .wait_mesh(LIMIT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
    eprintln!(
        "measured: 3 clusters x {NODES} nodes up and peered, tunnels endpoints complete, in {} ms",
        started.elapsed().as_millis()
    );
    fabric
}

/// The address a pod of cluster `from` uses for `to`'s pod `pod_ip`: the same host bits in
/// `from`'s view of `to`'s pod CIDR.
async fn address(fabric: &Fabric, from: usize, to: usize, pod_ip: Ipv4Addr) -> Ipv4Addr {
    let view: Ipv4Net = fabric.view(from, to, false).await.expect("view");
    let site = &fabric.topology.sites[to];
    let offset = u32::from(pod_ip) - u32::from(site.pod_cidr.network());
    Ipv4Addr::from(u32::from(view.network()) + offset)
}

/// Pings from `pod_ns` until one answer or `bound`; whether it answered.
async fn reaches(pod_ns: &str, to: Ipv4Addr, bound: Duration) -> bool {
    let started = Instant::now();
    loop {
        let out = exec(
            pod_ns,
            "ping",
            &["-n", "-c", "1", "-W", "1", &to.to_string()],
        )
        .expect("ping runs");
        if out.status.success() {
            return true;
        }
        if started.elapsed() > bound {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Our routes (`proto 214`) in a namespace.
fn agent_routes(ns: &str) -> Vec<String> {
    let text = ip(&["-n", ns, "route", "show", "proto", "214"]).expect("ip route");
    text.lines()
        .map(|l| l.split_whitespace().next().unwrap_or("").to_owned())
        .collect()
}

/// How many VXLAN devices a namespace holds.
fn vxlan_devices(ns: &str) -> usize {
    ip(&["-n", ns, "-o", "link", "show", "type", "vxlan"])
        .expect("ip link")
        .lines()
        .count()
}

/// Every remote prefix cluster `i` routes (its views of the others' pod and external CIDRs).
async fn remote_prefixes(fabric: &Fabric, i: usize) -> Vec<String> {
    let mut all = Vec::new();
    for other in [A, B, C].into_iter().filter(|o| *o != i) {
        for external in [false, true] {
            if let Ok(net) = fabric.view(i, other, external).await {
                all.push(net.to_string());
            }
        }
    }
    all.sort();
    all.dedup();
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_on_every_node_reach_every_remote_pod_and_leaf_traffic_skips_the_hub() {
    if !can_run("pods_on_every_node_reach_every_remote_pod_and_leaf_traffic_skips_the_hub") {
        return;
    }
    let fabric = up().await;

    // Every pod of every cluster reaches every pod of the other clusters: once the first pair
    // between non-gateway nodes answers, the others must answer promptly.
    let (a1, c2) = (
        &fabric.topology.sites[A].nodes[1],
        &fabric.topology.sites[C].nodes[2],
    );
    let target = address(&fabric, A, C, c2.pod_ip).await;
    assert!(
        reaches(&a1.pod_ns, target, LIMIT).await,
        "A/n1 never reached C/n2 at {target}\n{}",
        fabric.logs()
    );
    let mut pairs = 0;
    let mut failed = Vec::new();
    for from in [A, B, C] {
        for to in [A, B, C].into_iter().filter(|t| *t != from) {
            for src in &fabric.topology.sites[from].nodes {
                for dst in &fabric.topology.sites[to].nodes {
                    let target = address(&fabric, from, to, dst.pod_ip).await;
                    pairs += 1;
                    if !reaches(&src.pod_ns, target, Duration::from_secs(10)).await {
                        failed.push(format!(
                            "{}/{} -> {}/{} at {target}",
                            fabric.clusters[from].id, src.name, fabric.clusters[to].id, dst.name
                        ));
                    }
                }
            }
        }
    }
    assert_eq!(pairs, 54);
    assert!(
        failed.is_empty(),
        "unreachable: {failed:#?}\n{}",
        fabric.logs()
    );

    // Every node's route agent serves /metrics on its default port (9107) with the gRPC
    // server metrics of the health checks it answered.
    if let Some(python) = parser_python() {
        for site in &fabric.topology.sites {
            for node in &site.nodes {
                let text = scrape_in(&node.netns, SocketAddr::from(([127, 0, 0, 1], 9107)));
                let checks = parse(&python, &text)
                    .into_iter()
                    .find(|s| {
                        s.name == "grpc_server_handled_total"
                            && s.has("grpc_service", "grpc.health.v1.Health")
                            && s.has("grpc_method", "Check")
                            && s.has("grpc_code", "OK")
                    })
                    .unwrap_or_else(|| panic!("{}: no health checks counted:\n{text}", node.netns));
                assert!(checks.value >= 1.0, "{checks:?}");
            }
        }
    }

    // Leaf to leaf between non-gateway nodes goes A's n1 -> A's gateway -> C's gateway -> C's
    // n2, never through the hub: 300 KB of pings add next to nothing at B's uplink.
    let target = address(&fabric, A, C, c2.pod_ip).await;
    let hub_gw = &fabric.topology.sites[B].gw_ns;
    let before = link_counters(hub_gw, "wan").expect("counters");
    let out = exec(
        &a1.pod_ns,
        "ping",
        &[
            "-n",
            "-q",
            "-c",
            "300",
            "-i",
            "0.005",
            "-s",
            "1000",
            &target.to_string(),
        ],
    )
    .expect("ping runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let after = link_counters(hub_gw, "wan").expect("counters");
    let crossed = after.rx_bytes - before.rx_bytes;
    eprintln!(
        "measured: B's uplink received {crossed} bytes while 300 x 1028-byte pings crossed A->C"
    );
    assert!(
        crossed < 30_000,
        "leaf traffic crossed the hub: {crossed} bytes"
    );

    // A 4 MB HTTP transfer between pods on non-gateway nodes of two leaves: nested encapsulation
    // (VXLAN, then WireGuard) with the MSS clamped, no black hole.
    let dir = tempfile::tempdir().expect("dir");
    let payload: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(dir.path().join("blob"), &payload).expect("write");
    let dir_arg = dir.path().to_str().expect("utf-8").to_owned();
    let mut server = std::process::Command::new("ip")
        .args(["netns", "exec", &c2.pod_ns, "python3", "-m", "http.server"])
        .args([
            "--bind",
            &c2.pod_ip.to_string(),
            "--directory",
            &dir_arg,
            "8080",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("http server");
    let url = format!("http://{target}:8080/blob");
    let script = format!(
        "import sys, time, urllib.request\n\
         for _ in range(50):\n\
         \x20   try:\n\
         \x20       data = urllib.request.urlopen('{url}', timeout=20).read(); break\n\
         \x20   except OSError:\n\
         \x20       time.sleep(0.2)\n\
         sys.stdout.write(str(len(data)) + ' ' + str(sum(data) % 1000003))\n"
    );
    let started = Instant::now();
    let fetched = exec(&a1.pod_ns, "python3", &["-c", &script]).expect("client runs");
    let elapsed = started.elapsed();
    let _ = server.kill();
    let _ = server.wait();
    let expected = format!(
        "{} {}",
        payload.len(),
        payload.iter().map(|b| u64::from(*b)).sum::<u64>() % 1_000_003
    );
    assert_eq!(
        String::from_utf8_lossy(&fetched.stdout),
        expected,
        "{}",
        String::from_utf8_lossy(&fetched.stderr)
    );
    eprintln!(
        "measured: 4 MB from C/n2 to A/n1 over HTTP in {} ms",
        elapsed.as_millis()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_agents_and_gateways_recover_without_duplicates_and_unpeering_clears_every_node() {
    if !can_run(
        "killed_agents_and_gateways_recover_without_duplicates_and_unpeering_clears_every_node",
    ) {
        return;
    }
    let mut fabric = up().await;
    let a1 = fabric.topology.sites[A].nodes[1].clone();
    let c2 = fabric.topology.sites[C].nodes[2].clone();
    let target = address(&fabric, A, C, c2.pod_ip).await;
    assert!(
        reaches(&a1.pod_ns, target, LIMIT).await,
        "{}",
        fabric.logs()
    );
    let wanted = remote_prefixes(&fabric, A).await;
    assert_eq!(
        agent_routes(&a1.netns),
        wanted,
        "A's n1 routes exactly A's remote prefixes"
    );

    // kill -9 of a route agent, then a restart: the same routes and one device, no copies.
    fabric.clusters[A].agent_mut(1).expect("agent").kill9();
    let started = Instant::now();
    fabric.clusters[A]
        .agent_mut(1)
        .expect("agent")
        .restart()
        .await
        .expect("restarts");
    assert!(reaches(&a1.pod_ns, target, LIMIT).await);
    eprintln!(
        "measured: traffic back {} ms after a route agent's kill -9",
        started.elapsed().as_millis()
    );
    assert_eq!(agent_routes(&a1.netns), wanted);
    assert_eq!(vxlan_devices(&a1.netns), 1);

    // Someone deletes the overlay device: the agent's resync puts it back.
    ip(&["-n", &a1.netns, "link", "del", "trellis-vx"]).expect("delete");
    assert!(
        reaches(&a1.pod_ns, target, LIMIT).await,
        "repaired by the resync"
    );
    assert_eq!(agent_routes(&a1.netns), wanted);

    // kill -9 of A's gateway: agents keep their routes, the restarted gateway's stream changes
    // nothing, traffic comes back.
    fabric.clusters[A].kill9(Service::Gateway).expect("kill");
    let started = Instant::now();
    fabric.clusters[A]
        .restart(Service::Gateway)
        .await
        .expect("restarts");
    assert!(
        reaches(&a1.pod_ns, target, LIMIT).await,
        "{}",
        fabric.logs()
    );
    eprintln!(
        "measured: traffic back {} ms after the gateway's kill -9",
        started.elapsed().as_millis()
    );
    for node in &fabric.topology.sites[A].nodes {
        assert_eq!(vxlan_devices(&node.netns), 1, "{}", node.name);
    }
    assert_eq!(agent_routes(&a1.netns), wanted);

    // C leaves the hub: every node of A and B drops C's prefixes. Each cluster is checked
    // against its own view of C only: one cluster's view of C may well be the range another
    // uses for a peer that stays (the IPAM of each chooses on its own).
    let c_views = [
        (A, fabric.view(A, C, false).await.expect("view").to_string()),
        (B, fabric.view(B, C, false).await.expect("view").to_string()),
    ];
    fabric.clusters[C]
        .broker()
        .expect("broker")
        .unpeer(UnpeerRequest {
            cluster_id: fabric.clusters[B].id.clone(),
        })
        .await
        .expect("unpeers");
    let deadline = Instant::now() + LIMIT;
    loop {
        let left: Vec<String> = c_views
            .iter()
            .flat_map(|(i, view)| {
                fabric.topology.sites[*i].nodes[1..]
                    .iter()
                    .flat_map(|n| agent_routes(&n.netns))
                    .filter(move |r| r == view)
            })
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "C's prefixes still routed: {left:?}\n{}",
            fabric.logs()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The nftables tables of a namespace.
fn nft_tables(ns: &str) -> Vec<String> {
    let out = exec(ns, "nft", &["list", "tables"]).expect("nft runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Every pair of pods with one end in cluster `i`, each pinged until it answers or `bound`
/// passes; the pairs that never answered.
async fn pairs_touching(fabric: &Fabric, i: usize, bound: Duration) -> Vec<String> {
    let mut failed = Vec::new();
    for from in [A, B, C] {
        for to in [A, B, C] {
            if from == to || (from != i && to != i) {
                continue;
            }
            for src in &fabric.topology.sites[from].nodes {
                for dst in &fabric.topology.sites[to].nodes {
                    let target = address(fabric, from, to, dst.pod_ip).await;
                    if !reaches(&src.pod_ns, target, bound).await {
                        failed.push(format!(
                            "{}/{} -> {}/{} at {target}",
                            fabric.clusters[from].id, src.name, fabric.clusters[to].id, dst.name
                        ));
                    }
                }
            }
        }
    }
    failed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gateway_moving_to_another_node_is_followed_by_every_node_and_by_the_peers() {
    if !can_run("a_gateway_moving_to_another_node_is_followed_by_every_node_and_by_the_peers") {
        return;
    }
    // The gateway keeps its state in etcd, as deployed: its keys and ports survive the move.
    let mut fabric = up_with(StoreKind::EtcdPerService).await;
    let failed = pairs_touching(&fabric, A, LIMIT).await;
    assert!(
        failed.is_empty(),
        "before the move: {failed:#?}\n{}",
        fabric.logs()
    );
    let wanted = remote_prefixes(&fabric, A).await;

    // A's gateway moves from n0 to n1 (which gets a public address of its own).
    let uplink = fabric
        .topology
        .add_node_uplink(A, 1)
        .expect("a second uplink");
    let site = fabric.topology.sites[A].clone();
    let started = Instant::now();
    fabric.clusters[A]
        .move_gateway(&site, 1, uplink)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
    let failed = pairs_touching(&fabric, A, LIMIT).await;
    assert!(
        failed.is_empty(),
        "after the move: {failed:#?}\n{}",
        fabric.logs()
    );
    eprintln!(
        "measured: all 36 pod pairs to and from A answer again {} ms after its gateway moved \
         from n0 to n1",
        started.elapsed().as_millis()
    );

    // Every node of A followed: n0 and n2 route A's remote prefixes into the overlay towards
    // n1, n1 (the gateway node now) routes none itself; one overlay device at most anywhere.
    let nodes = &fabric.topology.sites[A].nodes;
    for node in [&nodes[0], &nodes[2]] {
        assert_eq!(agent_routes(&node.netns), wanted, "{}", node.name);
        assert_eq!(vxlan_devices(&node.netns), 1, "{}", node.name);
    }
    assert!(agent_routes(&nodes[1].netns).is_empty());
    assert!(vxlan_devices(&nodes[1].netns) <= 1);
    // The old gateway took its NAT and guard tables with it; the new one has both.
    let left = nft_tables(&nodes[0].netns);
    assert!(
        !left
            .iter()
            .any(|t| t == "table ip trellis" || t == "table ip trellis-guard"),
        "{left:?}"
    );
    let moved = nft_tables(&nodes[1].netns);
    assert!(moved.iter().any(|t| t == "table ip trellis"), "{moved:?}");
    // The peers send to the new address.
    for peer in [B, C] {
        let deadline = Instant::now() + LIMIT;
        loop {
            match fabric.wireguard_endpoint(peer, A).await {
                Ok(endpoint) if endpoint.ip() == std::net::IpAddr::V4(uplink) => break,
                seen => assert!(
                    Instant::now() < deadline,
                    "{} still sends to {seen:?}\n{}",
                    fabric.clusters[peer].id,
                    fabric.logs()
                ),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}
