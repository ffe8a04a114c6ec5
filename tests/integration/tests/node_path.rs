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

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use trellis_api::pb::gateway::ListTunnelsRequest;
use trellis_api::pb::route::GetStatusRequest;
use trellis_api::pb::route::route_client::RouteClient;
use trellis_integration::peering::unpeer;
use trellis_integration::prom::{parse, parser_python, scrape_in};
use trellis_netlab::fabric::reaches;
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
    let target = fabric.pod_address(A, C, c2.pod_ip).await.expect("view");
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
                    let target = fabric
                        .pod_address(from, to, dst.pod_ip)
                        .await
                        .expect("view");
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
    let target = fabric.pod_address(A, C, c2.pod_ip).await.expect("view");
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
    // (VXLAN, then WireGuard) with the MSS clamped, no black hole. Path MTU discovery would
    // rescue an unclamped connection here (each node answers "fragmentation needed" for a
    // packet larger than its route's MTU), so every node of the three clusters drops those
    // ICMP messages, as many real networks do: the transfer only completes if no packet ever
    // needed one, i.e. if both ends' SYNs were clamped. The drops are counted: none may happen.
    let nodes: Vec<String> = fabric
        .topology
        .sites
        .iter()
        .flat_map(|s| s.nodes.iter().map(|n| n.netns.clone()))
        .collect();
    for ns in &nodes {
        nft_in(ns, PMTU_BLACKHOLE);
    }
    for pod in [&a1.pod_ns, &c2.pod_ns] {
        // No path MTU learned by earlier traffic may help either.
        ip(&["-n", pod, "route", "flush", "cache"]).expect("flush");
    }
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
    // Waits for the server with small connections, then fetches once: a black-holed transfer
    // stalls and times out instead of being retried.
    let script = format!(
        "import socket, sys, time, urllib.request\n\
         for _ in range(100):\n\
         \x20   try:\n\
         \x20       socket.create_connection(('{target}', 8080), timeout=2).close(); break\n\
         \x20   except OSError:\n\
         \x20       time.sleep(0.2)\n\
         try:\n\
         \x20   data = urllib.request.urlopen('{url}', timeout=15).read()\n\
         except OSError as e:\n\
         \x20   sys.stdout.write('failed: ' + repr(e)); sys.exit(0)\n\
         sys.stdout.write(str(len(data)) + ' ' + str(sum(data) % 1000003))\n"
    );
    let started = Instant::now();
    let fetched = exec(&a1.pod_ns, "python3", &["-c", &script]).expect("client runs");
    let elapsed = started.elapsed();
    let _ = server.kill();
    let _ = server.wait();
    let dropped: u64 = nodes
        .iter()
        .map(|ns| counter_packets(ns, "pmtu", "dropped"))
        .sum();
    for ns in &nodes {
        nft_in(ns, "delete table ip pmtu\n");
    }
    let expected = format!(
        "{} {}",
        payload.len(),
        payload.iter().map(|b| u64::from(*b)).sum::<u64>() % 1_000_003
    );
    assert_eq!(
        String::from_utf8_lossy(&fetched.stdout),
        expected,
        "{} (\"fragmentation needed\" dropped: {dropped})",
        String::from_utf8_lossy(&fetched.stderr)
    );
    assert_eq!(
        dropped, 0,
        "a packet needed fragmentation despite the clamp"
    );
    eprintln!(
        "measured: 4 MB from C/n2 to A/n1 over HTTP in {} ms, without path MTU discovery",
        elapsed.as_millis()
    );
}

/// An nftables table `ip pmtu` dropping (and counting) every ICMP "fragmentation needed" a
/// node sends or forwards.
const PMTU_BLACKHOLE: &str = "table ip pmtu {}\ndelete table ip pmtu\n\
    table ip pmtu {\n  counter dropped {}\n  \
    chain output {\n    type filter hook output priority filter; policy accept;\n    \
    icmp type destination-unreachable icmp code frag-needed counter name \"dropped\" drop\n  }\n  \
    chain forward {\n    type filter hook forward priority filter; policy accept;\n    \
    icmp type destination-unreachable icmp code frag-needed counter name \"dropped\" drop\n  }\n}\n";

/// Applies an nftables script in `ns`.
fn nft_in(ns: &str, script: &str) {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("rules.nft");
    std::fs::write(&path, script).expect("write");
    let out = exec(ns, "nft", &["-f", path.to_str().expect("utf-8")]).expect("nft runs");
    assert!(
        out.status.success(),
        "nft in {ns}: {}\n{script}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The packets of the named counter `name` of table `ip <table>` in `ns`.
fn counter_packets(ns: &str, table: &str, name: &str) -> u64 {
    let out = exec(ns, "nft", &["-j", "list", "counter", "ip", table, name]).expect("nft runs");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "nft -j in {ns}: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    json["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|o| o["counter"]["packets"].as_u64())
        .unwrap_or_else(|| panic!("no counter {name} in {ns}: {json}"))
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
    let target = fabric.pod_address(A, C, c2.pod_ip).await.expect("view");
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
    unpeer(&fabric.clusters[C], &fabric.clusters[B].id).await;
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
                    let target = fabric
                        .pod_address(from, to, dst.pod_ip)
                        .await
                        .expect("view");
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
        let what = format!("{} to send to {uplink}", fabric.clusters[peer].id);
        let moved = trellis_testkit::within(&what, LIMIT, || async {
            match fabric.wireguard_endpoint(peer, A).await {
                Ok(endpoint) if endpoint.ip() == std::net::IpAddr::V4(uplink) => Ok(()),
                seen => Err(format!("{seen:?}")),
            }
        })
        .await;
        if let Err(timed_out) = moved {
            panic!("{timed_out}\n{}", fabric.logs());
        }
    }
}

/// What the route agent of `node` received from its gateway, as its GetStatus reports it: the
/// prefixes it routes and those it refused (sorted, together).
async fn agent_prefixes(node: &trellis_netlab::topology::Node) -> Vec<String> {
    let channel = trellis_netlab::netns::channel_in(
        &node.netns,
        SocketAddr::new(std::net::IpAddr::V4(node.node_ip), 7107),
    )
    .expect("channel");
    let status = RouteClient::new(channel)
        .get_status(GetStatusRequest {})
        .await
        .expect("GetStatus")
        .into_inner();
    let mut all = status.routed_prefixes;
    all.extend(status.refused_prefixes);
    all.sort();
    all
}

/// The routes of a namespace's main table for exactly `prefix` (`ip route show exact`).
fn routes_exactly(ns: &str, prefix: &str) -> Vec<String> {
    ip(&["-n", ns, "-o", "route", "show", "exact", prefix])
        .expect("ip route")
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Every node of `site` pings every other node of it on the node network; the pairs that never
/// answered within `bound`.
async fn node_pairs_failing(site: &trellis_netlab::Site, bound: Duration) -> Vec<String> {
    let mut failed = Vec::new();
    for from in &site.nodes {
        for to in site.nodes.iter().filter(|n| n.index != from.index) {
            if !reaches(&from.netns, to.node_ip, bound).await {
                failed.push(format!(
                    "{}/{} -> {}/{} at {}",
                    site.name, from.name, site.name, to.name, to.node_ip
                ));
            }
        }
    }
    failed
}

/// A peer's range on our node network (a hub and a leaf whose nodes sit on 10.9.0.0/16, exactly
/// the other leaf's pod CIDR). Routed as it is, that range replaces the nodes' own connected
/// route on every node (`ip route replace` by the route agents, and by the gateway into the
/// tunnel), and the node guard drops new connections from it: the cluster's nodes lose each
/// other. The hub's IPAM is told its node network (`--reserved`, as TRELLIS_RESERVED does in the
/// deployment) and remaps the leaf; leaf A's is not (an operator who left it unset), so A keeps
/// the leaf's range as it is, and A's route agents and gateway must refuse to route it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_peer_range_on_the_node_network_is_remapped_or_refused_and_the_nodes_stay_reachable() {
    if !can_run(
        "a_peer_range_on_the_node_network_is_remapped_or_refused_and_the_nodes_stay_reachable",
    ) {
        return;
    }
    const NODE_NETWORK: &str = "10.9.0.0/16";
    let mut options = FabricOptions::three_clusters();
    options.store = StoreKind::Memory;
    options.nodes = NODES;
    options.pod_cidrs = vec![
        "10.0.0.0/16".into(),
        "10.0.0.0/16".into(),
        NODE_NETWORK.into(),
    ];
    options.node_networks = vec![NODE_NETWORK.into(), NODE_NETWORK.into()];
    options.unreserved = vec![A];
    let fabric = Fabric::up(options).await.expect("fabric up");
    fabric
        .wait_mesh(LIMIT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
    let (a, b) = (&fabric.topology.sites[A], &fabric.topology.sites[B]);
    assert_eq!(a.node_network, Some(NODE_NETWORK.parse().expect("net")));
    assert_eq!(b.node_network, a.node_network);

    // A's IPAM knows nothing of its node network: it keeps C's range as C announced it.
    let a_view = fabric.view(A, C, false).await.expect("A's view of C");
    assert_eq!(a_view.to_string(), NODE_NETWORK);
    let b_view = fabric.view(B, C, false).await.expect("B's view of C");

    // A's and B's gateways applied their tunnels to C, and every other node's agent was told
    // its cluster's view of C (routed or refused, the node was reconciled with it): whatever
    // that view does to the nodes has happened.
    for i in [A, B] {
        let deadline = Instant::now() + LIMIT;
        loop {
            let tunnels = fabric.clusters[i]
                .gateway()
                .expect("gateway")
                .list_tunnels(ListTunnelsRequest {})
                .await
                .map(|r| r.into_inner().tunnels)
                .unwrap_or_default();
            let applied = tunnels.iter().any(|t| {
                t.remote
                    .as_ref()
                    .is_some_and(|r| r.cluster_id == fabric.clusters[C].id)
                    && t.applied_generation > 0
            });
            if applied {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}'s gateway never applied its tunnel to C: {tunnels:?}\n{}",
                fabric.clusters[i].id,
                fabric.logs()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    // The gateway nodes of A and B route (or refuse) C's range now: the nodes of A and B
    // still reach each other over the node network.
    for site in [a, b] {
        let failed = node_pairs_failing(site, Duration::from_secs(5)).await;
        assert!(
            failed.is_empty(),
            "nodes lost each other once the gateway applied C's tunnel: {failed:#?}\n{}",
            fabric.logs()
        );
    }
    for (i, view) in [(A, a_view), (B, b_view)] {
        for node in &fabric.topology.sites[i].nodes[1..] {
            let what = format!("{}/{} to receive {view}", fabric.clusters[i].id, node.name);
            let received = trellis_testkit::within(&what, LIMIT, || async {
                agent_prefixes(node)
                    .await
                    .contains(&view.to_string())
                    .then_some(())
            })
            .await;
            if let Err(timed_out) = received {
                panic!("{timed_out}\n{}", fabric.logs());
            }
        }
    }
    // And once every agent has it too.
    for site in [a, b] {
        let failed = node_pairs_failing(site, Duration::from_secs(5)).await;
        assert!(
            failed.is_empty(),
            "nodes lost each other once the agents had C's range: {failed:#?}\n{}",
            fabric.logs()
        );
    }

    // B remapped C off its node network, and traffic between them flows both ways.
    let node_network: Ipv4Net = NODE_NETWORK.parse().expect("net");
    assert!(
        !b_view.contains(&node_network.network()) && !node_network.contains(&b_view.network()),
        "B kept C at {b_view}, on its node network {NODE_NETWORK}"
    );
    for (from, from_node, to, to_node) in [(B, 1, C, 2), (C, 1, B, 2), (A, 1, B, 2)] {
        let src = &fabric.topology.sites[from].nodes[from_node];
        let dst = &fabric.topology.sites[to].nodes[to_node];
        let target = fabric
            .pod_address(from, to, dst.pod_ip)
            .await
            .expect("view");
        assert!(
            reaches(&src.pod_ns, target, LIMIT).await,
            "{}/{} never reached {}/{} at {target}\n{}",
            fabric.clusters[from].id,
            src.name,
            fabric.clusters[to].id,
            dst.name,
            fabric.logs()
        );
    }

    // A refused the range: no agent routes it, the gateway node's only route for it is the
    // node network's own, and every agent and the gateway count the refusal.
    for node in &a.nodes {
        assert!(
            !agent_routes(&node.netns).contains(&a_view.to_string()),
            "{} routes {a_view}",
            node.name
        );
        let text = scrape_in(&node.netns, SocketAddr::from(([127, 0, 0, 1], 9107)));
        assert!(
            text.lines()
                .any(|l| l == "trellis_route_refused_prefixes 1"),
            "{}: the refusal is not counted:\n{text}",
            node.name
        );
    }
    let gateway_node = &a.nodes[0].netns;
    let routes = routes_exactly(gateway_node, NODE_NETWORK);
    assert!(
        routes.len() == 1 && routes[0].contains("dev node") && routes[0].contains("proto kernel"),
        "{routes:?}"
    );
    let text = scrape_in(gateway_node, SocketAddr::from(([127, 0, 0, 1], 9106)));
    assert!(
        text.lines()
            .any(|l| l.starts_with("trellis_gateway_refused_routes{") && l.ends_with(" 1")),
        "the gateway does not count the refusal:\n{text}"
    );
}

/// Builds an ICMP echo request with identifier `ident` from `src` to `dst` and either sends it
/// from the namespace it runs in as an ordinary packet (`plain`), or wraps it in Ethernet (to
/// `mac`) and VXLAN (VNI `vni`) and sends that as one UDP datagram to `underlay:port`, `count`
/// times: what a pod needs to inject a packet into another node's overlay device.
const FRAME_SCRIPT: &str = r#"
import socket, struct, sys
mode, mac, src, dst, ident, underlay, port, vni, count = sys.argv[1:]
def csum(b):
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    s += s >> 16
    return ~s & 0xffff
icmp = struct.pack("!BBHHH", 8, 0, 0, int(ident), 1) + b"trellis overlay probe"
icmp = icmp[:2] + struct.pack("!H", csum(icmp)) + icmp[4:]
if mode == "plain":
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    for _ in range(int(count)):
        s.sendto(icmp, (dst, 0))
    sys.exit(0)
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(icmp), 0x7107, 0, 64, 1, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
eth = bytes.fromhex(mac.replace(":", "")) + bytes.fromhex("02deadbeef01") + b"\x08\x00"
vxlan = struct.pack("!II", 0x08000000, int(vni) << 8)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(count)):
    s.sendto(vxlan + eth + ip + icmp, (underlay, int(port)))
"#;

/// The MAC address of `dev` in `ns`.
fn mac_of(ns: &str, dev: &str) -> String {
    let text = ip(&["-n", ns, "-j", "link", "show", "dev", dev]).expect("ip link");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    json[0]["address"].as_str().expect("a MAC").to_owned()
}

/// A pod must not be able to use the overlay: from a pod on A's node 2, a hand-built VXLAN frame
/// (the agents' VNI, to the gateway node's overlay device, carrying an echo request from the pod
/// of A's node 1 to a pod of C) sent to the gateway node's node address, UDP 4800, would be
/// decapsulated there and forwarded into the tunnel to C as if node 1 had sent it. C's pod
/// counts the echo requests it receives by identifier: the same request sent the legitimate
/// way (from A/n1's pod, after the forged frames) must arrive, the forged ones never.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_cannot_inject_packets_into_the_overlay() {
    if !can_run("a_pod_cannot_inject_packets_into_the_overlay") {
        return;
    }
    const FORGED: &str = "29001";
    const LEGIT: &str = "29002";
    let fabric = up().await;
    let a = &fabric.topology.sites[A];
    let (a0, a1, a2) = (&a.nodes[0], &a.nodes[1], &a.nodes[2]);
    let c2 = &fabric.topology.sites[C].nodes[2];
    let target = fabric.pod_address(A, C, c2.pod_ip).await.expect("view");
    assert!(
        reaches(&a1.pod_ns, target, LIMIT).await,
        "A/n1 never reached C/n2 at {target}\n{}",
        fabric.logs()
    );
    nft_in(
        &c2.pod_ns,
        &format!(
            "table ip probe {{\n  counter forged {{}}\n  counter legit {{}}\n  \
             chain input {{\n    type filter hook input priority filter; policy accept;\n    \
             icmp type echo-request icmp id {FORGED} counter name \"forged\"\n    \
             icmp type echo-request icmp id {LEGIT} counter name \"legit\"\n  }}\n}}\n"
        ),
    );
    let mac = mac_of(&a0.netns, "trellis-vx");
    let (src, dst, underlay) = (
        a1.pod_ip.to_string(),
        target.to_string(),
        a0.node_ip.to_string(),
    );
    let send = |ns: &str, mode: &str, ident: &str, count: &str| {
        let out = exec(
            ns,
            "python3",
            &[
                "-c",
                FRAME_SCRIPT,
                mode,
                &mac,
                &src,
                &dst,
                ident,
                &underlay,
                "4800",
                "7107",
                count,
            ],
        )
        .expect("python runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    send(&a2.pod_ns, "vxlan", FORGED, "20");
    // The positive control, sent after the forged frames: the legitimate path delivers it.
    let deadline = Instant::now() + LIMIT;
    while counter_packets(&c2.pod_ns, "probe", "legit") == 0 {
        assert!(
            Instant::now() < deadline,
            "the legitimate probe never arrived\n{}",
            fabric.logs()
        );
        send(&a1.pod_ns, "plain", LEGIT, "1");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let forged = counter_packets(&c2.pod_ns, "probe", "forged");
    assert_eq!(
        forged, 0,
        "{forged} of 20 forged overlay frames from A/n2's pod reached C's pod"
    );
    // And the node path itself still works both ways.
    assert!(reaches(&a2.pod_ns, target, LIMIT).await);
}
