//! Conntrack state never mixes up peers, with real packets through real tunnels, as root, in
//! namespaces these tests create and always remove:
//! - replies of a removed peer's connections never enter the tunnel of a new peer that reuses
//!   its WireGuard port (issue 15, item 11);
//! - two peers with the same pod CIDR and the same view of us, whose pods at the same address
//!   send from the same UDP port to the same pod of ours, are two flows (issue 32): each peer's
//!   connections live in a conntrack zone of their own;
//! - a range of ours freed with a peer is not handed to the next peer while our pods' flows
//!   towards the old peer may still be running (issue 32): the IPAM quarantines it;
//! - a hub-path connection whose mapping is gone no longer follows its translation into the
//!   tunnel of whichever peer holds the old destination's range next (issue 32): the gateway
//!   flushes the connections DNAT'ed to a removed mapping's destination.
//!
//! The first test:
//! The gateway marks a connection that arrives from a peer's tunnel with the peer's
//! conntrack mark, and routes the replies by that mark (`ip rule fwmark → table → tunnel`).
//! Marks derive from the peer's listen port, and ports are reused once a peer is gone. So the
//! test gives hub L's gateway exactly one port (`--wireguard-ports 51840-51840`) and two leaves
//! with the same pod CIDR: the leaf that wins the port (the "old" peer) opens a long-lived TCP
//! connection to L's pod; L unpeers it, and the other leaf (the "new" peer) gets the port, the
//! mark and the routing table. L's pod then writes on the old connection. Without flushing the
//! old peer's conntrack entries its replies are marked and routed into the new peer's tunnel;
//! the test counts them in L's gateway namespace (`oifname <new tunnel> tcp sport 7777`) and
//! requires none. A connection of the new peer to the same server is then counted as the
//! control: the counter sees what it is meant to see.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`conntrack`
//! (`scripts/setup.sh` installs them); CI runs as root and fails instead.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use trellis_api::pb::endpoints::TranslationPath;
use trellis_api::pb::types::PeeringKind;
use trellis_integration::peering::unpeer;
use trellis_netlab::netns::{connect_in, exec, listen_in, nft_packets, udp_in};
use trellis_netlab::{Fabric, FabricOptions, Service, StoreKind};

const OLD_OR_NEW: [usize; 2] = [0, 2];
const L: usize = 1;
const LIMIT: Duration = Duration::from_secs(120);
const PORT: u16 = 7777;
/// The UDP port of the flows of the zone and quarantine tests, at both ends.
const FLOW_PORT: u16 = 5000;

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft", "ping", "conntrack"])
}

/// The address `from`'s pod uses for `to`'s pod (as `Fabric::reach` computes it, for one pair).
async fn address(fabric: &Fabric, from: usize, to: usize) -> Ipv4Addr {
    let pod = fabric.topology.sites[to].pod_ip;
    fabric.pod_address(from, to, pod).await.expect("view")
}

/// The packet count of the rule counting what `L`'s pod sends into `interface` from our port.
fn leaked(gw_ns: &str) -> u64 {
    nft_packets(gw_ns, &["chain", "ip", "leakcount", "post"])
}

/// Loads `script` (a whole nftables table) into `ns`.
fn nft_load(ns: &str, script: &str) {
    let mut nft = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("nft");
    std::io::Write::write_all(&mut nft.stdin.take().expect("stdin"), script.as_bytes())
        .expect("script");
    assert!(nft.wait().expect("nft").success(), "nft -f:\n{script}");
}

/// The packet count of the one counter rule of `chain` in table `table` of `ns`.
fn counted(ns: &str, table: &str, chain: &str) -> u64 {
    nft_packets(ns, &["chain", "ip", table, chain])
}

/// Hub L with leaves X and Y, every pod CIDR 10.0.0.0/16, no induced peering between the
/// leaves (what they send each other is not the point).
async fn two_leaves() -> Fabric {
    let mut options = FabricOptions::three_clusters();
    options.names = ["x", "l", "y"].map(str::to_owned).to_vec();
    options.store = StoreKind::EtcdPerService;
    options.hub_no_induced = true;
    let fabric = Fabric::up(options).await.expect("fabric up");
    let id = |i: usize| fabric.clusters[i].id.clone();
    let mut leaves: Vec<(String, PeeringKind)> = OLD_OR_NEW
        .iter()
        .map(|&i| (id(i), PeeringKind::Full))
        .collect();
    leaves.sort();
    let leaves: Vec<(&str, PeeringKind)> = leaves.iter().map(|(i, k)| (i.as_str(), *k)).collect();
    fabric
        .wait_tunnel_endpoints(L, &leaves, LIMIT)
        .await
        .expect("L's tunnels");
    for leaf in OLD_OR_NEW {
        fabric
            .wait_tunnel_endpoints(leaf, &[(id(L).as_str(), PeeringKind::Full)], LIMIT)
            .await
            .expect("the leaf's tunnel");
    }
    fabric
}

/// Two peers whose pods send the very same UDP datagrams (same source address and port, to
/// the same address and port, as both address L alike) are two flows at L: L's pod sees two
/// sources, and each leaf gets only the answers to what it sent. In one shared conntrack table
/// the second peer's datagrams match the first peer's entry and take its translation, so L's
/// pod sees one source and answers the second leaf's datagrams to the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_flow_from_two_peers_is_two_flows() {
    if !can_run("conntrack_zones") {
        return;
    }
    let fabric = two_leaves().await;
    let [x, y] = OLD_OR_NEW;
    let sites = &fabric.topology.sites;
    let to_l = address(&fabric, x, L).await;
    // The premise: the same source and destination from both leaves.
    assert_eq!(
        to_l,
        address(&fabric, y, L).await,
        "both leaves' IPAMs map L alike (first free range)"
    );
    assert_eq!(
        sites[x].pod_ip, sites[y].pod_ip,
        "the leaves' pods share an address"
    );
    for leaf in OLD_OR_NEW {
        fabric
            .wait_ping(leaf, to_l, LIMIT)
            .await
            .expect("the leaf reaches L's pod");
    }
    // How L addresses each leaf's pod: the sources its pod must see.
    let sources = [address(&fabric, L, x).await, address(&fabric, L, y).await];

    // L's pod answers every datagram to where it came from and notes who sent what.
    let server = Arc::new(
        udp_in(
            &sites[L].pod_ns,
            SocketAddr::from(([0, 0, 0, 0], FLOW_PORT)),
        )
        .expect("udp in L"),
    );
    let seen: Arc<Mutex<BTreeMap<IpAddr, BTreeSet<String>>>> = Arc::default();
    let echo = {
        let (server, seen) = (server.clone(), seen.clone());
        tokio::spawn(async move {
            let mut buf = [0u8; 64];
            while let Ok((n, from)) = server.recv_from(&mut buf).await {
                let payload = String::from_utf8_lossy(&buf[..n]).into_owned();
                seen.lock()
                    .expect("lock")
                    .entry(from.ip())
                    .or_default()
                    .insert(payload);
                let _ = server.send_to(&buf[..n], from).await;
            }
        })
    };
    let clients = OLD_OR_NEW.map(|leaf| {
        udp_in(
            &sites[leaf].pod_ns,
            SocketAddr::from((sites[leaf].pod_ip, FLOW_PORT)),
        )
        .expect("udp in a leaf")
    });
    let payload = |leaf: usize| format!("from {}", fabric.clusters[leaf].id);
    let destination = SocketAddr::from((to_l, FLOW_PORT));
    for _ in 0..20 {
        for (client, leaf) in clients.iter().zip(OLD_OR_NEW) {
            client
                .send_to(payload(leaf).as_bytes(), destination)
                .await
                .expect("send");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What came back to each leaf, until a second passes without anything.
    let mut answered = Vec::new();
    for client in &clients {
        let mut got = BTreeSet::new();
        let mut buf = [0u8; 64];
        while let Ok(Ok((n, _))) =
            tokio::time::timeout(Duration::from_secs(1), client.recv_from(&mut buf)).await
        {
            got.insert(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        answered.push(got);
    }
    echo.abort();
    let seen = seen.lock().expect("lock").clone();
    let entries = exec(&sites[L].gw_ns, "conntrack", &["-L", "-p", "udp"]).expect("conntrack");
    let want: BTreeMap<IpAddr, BTreeSet<String>> = sources
        .iter()
        .zip(OLD_OR_NEW)
        .map(|(src, leaf)| (IpAddr::V4(*src), BTreeSet::from([payload(leaf)])))
        .collect();
    let want_answers: Vec<BTreeSet<String>> = OLD_OR_NEW
        .iter()
        .map(|&leaf| BTreeSet::from([payload(leaf)]))
        .collect();
    assert!(
        seen == want && answered == want_answers,
        "L's pod saw {seen:?} (expected each leaf from its own source: {want:?}); the leaves \
         got back {answered:?} (expected {want_answers:?}); L's conntrack:\n{}",
        String::from_utf8_lossy(&entries.stdout)
    );
}

/// A range L freed with one peer is not the next peer's while L's pods may still send towards
/// it. X and Y are both mapped; the one L addresses through the higher range ("new") is
/// unpeered first, so that, once the other ("old") is unpeered too, the next mapping's first
/// free range is old's. L's pod streams UDP to old's pod throughout; old is unpeered and new
/// peers again. What leaves L's gateway into new's tunnel from L's pod on the stream's port is
/// counted and must stay 0 while the stream demonstrably runs (counted where it enters L's
/// gateway); the control is L's pod sending the same way to new's pod, which the counter sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freed_range_is_not_handed_to_the_next_peer_while_flows_towards_it_run() {
    if !can_run("ipam_quarantine") {
        return;
    }
    let fabric = two_leaves().await;
    for leaf in OLD_OR_NEW {
        fabric
            .wait_ping(leaf, address(&fabric, leaf, L).await, LIMIT)
            .await
            .expect("the leaf reaches L's pod");
    }
    let ranges = [
        fabric.view(L, OLD_OR_NEW[0], false).await.expect("view"),
        fabric.view(L, OLD_OR_NEW[1], false).await.expect("view"),
    ];
    let (old, new, old_range) = if ranges[0].network() < ranges[1].network() {
        (OLD_OR_NEW[0], OLD_OR_NEW[1], ranges[0])
    } else {
        (OLD_OR_NEW[1], OLD_OR_NEW[0], ranges[1])
    };
    let id = |i: usize| fabric.clusters[i].id.clone();
    let unpeer = |leaf: usize| {
        let fabric = &fabric;
        async move {
            unpeer(&fabric.clusters[L], &fabric.clusters[leaf].id).await;
            // L's IPAM has freed the leaf's ranges once it no longer lists them.
            let started = Instant::now();
            while fabric.view(L, leaf, false).await.is_ok() {
                assert!(started.elapsed() < LIMIT, "L's IPAM keeps {leaf}'s mapping");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    unpeer(new).await;
    fabric
        .wait_tunnel_endpoints(new, &[], LIMIT)
        .await
        .expect("new forgets L");

    // L's pod streams towards old's pod, 50 datagrams a second, from here to the end.
    let l_site = &fabric.topology.sites[L];
    let to_old = address(&fabric, L, old).await;
    let streamer =
        Arc::new(udp_in(&l_site.pod_ns, SocketAddr::from(([0, 0, 0, 0], 0))).expect("udp in L"));
    let stream = {
        let streamer = streamer.clone();
        tokio::spawn(async move {
            loop {
                // Unconnected: the ICMP errors while no route exists do not stop it.
                let _ = streamer
                    .send_to(b"stream", SocketAddr::from((to_old, FLOW_PORT)))
                    .await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    unpeer(old).await;
    fabric
        .wait_tunnel_endpoints(L, &[], LIMIT)
        .await
        .expect("L holds no tunnel");
    fabric.peer(new, L).await.expect("new peers with L again");
    fabric
        .wait_tunnel_endpoints(L, &[(id(new).as_str(), PeeringKind::Full)], LIMIT)
        .await
        .expect("new's tunnel");
    let new_range = fabric.view(L, new, false).await.expect("view");
    let to_new = address(&fabric, L, new).await;
    fabric
        .wait_ping(L, to_new, LIMIT)
        .await
        .expect("L's pod reaches new's pod");

    let interface = trellis_gateway::names::interface_name(
        "tg",
        &trellis_api::ClusterId::parse("cluster_id", &id(L)).expect("id"),
        &trellis_api::ClusterId::parse("cluster_id", &id(new)).expect("id"),
    );
    let pod = l_site.pod_ip;
    nft_load(
        &l_site.gw_ns,
        &format!(
            "table ip quarantine {{\n  chain pre {{\n    type filter hook prerouting priority -400;\n    \
             ip saddr {pod} ip daddr {to_old} udp dport {FLOW_PORT} counter\n  }}\n  \
             chain post {{\n    type filter hook postrouting priority 300;\n    \
             oifname \"{interface}\" ip saddr {pod} udp dport {FLOW_PORT} counter\n  }}\n}}\n"
        ),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (streamed, leaked_packets) = (
        counted(&l_site.gw_ns, "quarantine", "pre"),
        counted(&l_site.gw_ns, "quarantine", "post"),
    );
    stream.abort();
    eprintln!(
        "old {} was at {old_range}; new {} is now at {new_range}; {streamed} datagrams of the \
         stream to {to_old} reached L's gateway, {leaked_packets} entered {interface}",
        id(old),
        id(new)
    );
    assert!(
        streamed > 0,
        "the stream towards {to_old} never reached L's gateway"
    );
    assert_eq!(
        leaked_packets,
        0,
        "L's pod's stream towards the removed peer's range {old_range} entered the tunnel of \
         {} (now mapped at {new_range})",
        id(new)
    );

    // The control: L's pod sending the same way to new's pod is counted.
    for _ in 0..5 {
        streamer
            .send_to(b"control", SocketAddr::from((to_new, FLOW_PORT)))
            .await
            .expect("send");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        counted(&l_site.gw_ns, "quarantine", "post") > 0,
        "the counter saw none of L's pod's datagrams to new's pod"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_of_a_removed_peer_never_enter_the_tunnel_of_the_peer_that_reuses_its_port() {
    if !can_run("conntrack_reuse") {
        return;
    }
    let mut options = FabricOptions::three_clusters();
    options.names = ["x", "l", "y"].map(str::to_owned).to_vec();
    options.store = StoreKind::EtcdPerService;
    options.hub_no_induced = true;
    options.extra_args = vec![(
        Service::Gateway,
        vec![
            "--wireguard-ports".into(),
            "51840-51840".into(),
            // The quarantine of a freed port would keep the new peer out for its duration;
            // this test is about what the flush alone guarantees.
            "--port-quarantine".into(),
            "0".into(),
        ],
    )];
    let fabric = Fabric::up(options).await.expect("fabric up");
    let l_id = fabric.clusters[L].id.clone();

    // Whichever leaf got L's only port first is the old peer.
    let started = Instant::now();
    let (old, new) = loop {
        let seen = fabric.tunnel_endpoints(L).await;
        if let [(id, PeeringKind::Full)] = seen.as_slice() {
            let old = OLD_OR_NEW
                .into_iter()
                .find(|&i| &fabric.clusters[i].id == id)
                .expect("a leaf");
            break (
                old,
                OLD_OR_NEW
                    .into_iter()
                    .find(|&i| i != old)
                    .expect("the other"),
            );
        }
        assert!(
            started.elapsed() < LIMIT,
            "L never held one tunnel: {seen:?}\n{}",
            fabric.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let l_pod_from_old = address(&fabric, old, L).await;
    fabric
        .wait_ping(old, l_pod_from_old, LIMIT)
        .await
        .expect("old peer reaches L's pod");

    // The long-lived connection, from the old peer's pod to L's pod.
    let l_site = &fabric.topology.sites[L];
    let listener = listen_in(&l_site.pod_ns, SocketAddr::from(([0, 0, 0, 0], PORT)))
        .expect("listen in L's pod");
    let mut client = connect_in(
        &fabric.topology.sites[old].pod_ns,
        SocketAddr::from((l_pod_from_old, PORT)),
    )
    .await
    .expect("connect from the old peer's pod");
    let (mut server, _) = listener.accept().await.expect("accept");
    server.write_all(b"hello").await.expect("write");
    let mut buf = [0u8; 5];
    client.read_exact(&mut buf).await.expect("read");
    assert_eq!(&buf, b"hello");

    // L unpeers the old peer; the new one gets the port, the mark and the table.
    unpeer(&fabric.clusters[L], &fabric.clusters[old].id).await;
    fabric
        .wait_tunnel_endpoints(
            L,
            &[(fabric.clusters[new].id.as_str(), PeeringKind::Full)],
            LIMIT,
        )
        .await
        .expect("the new peer's tunnel");
    let l_pod_from_new = address(&fabric, new, L).await;
    fabric
        .wait_ping(new, l_pod_from_new, LIMIT)
        .await
        .expect("new peer reaches L's pod");

    let interface = trellis_gateway::names::interface_name(
        "tg",
        &trellis_api::ClusterId::parse("cluster_id", &l_id).expect("id"),
        &trellis_api::ClusterId::parse("cluster_id", &fabric.clusters[new].id).expect("id"),
    );
    let script = format!(
        "table ip leakcount {{\n  chain post {{\n    type filter hook postrouting priority 300;\n    \
         oifname \"{interface}\" tcp sport {PORT} counter\n  }}\n}}\n"
    );
    let mut nft = std::process::Command::new("ip")
        .args(["netns", "exec", &l_site.gw_ns, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("nft");
    std::io::Write::write_all(&mut nft.stdin.take().expect("stdin"), script.as_bytes())
        .expect("script");
    assert!(nft.wait().expect("nft").success(), "counter rule");

    // L's pod writes on the old connection: the first segment leaves at once, then its
    // retransmissions (200 ms, 400 ms, ...).
    server.write_all(b"after").await.expect("write");
    tokio::time::sleep(Duration::from_secs(7)).await;
    let leaked_packets = leaked(&l_site.gw_ns);
    let entries = exec(&l_site.gw_ns, "conntrack", &["-L"]).expect("conntrack");
    assert_eq!(
        leaked_packets,
        0,
        "replies of the removed peer's connection entered the new peer's tunnel {interface}; \
         L's conntrack:\n{}",
        String::from_utf8_lossy(&entries.stdout)
    );

    // The control: the new peer's own connection to the server is counted.
    let mut control = connect_in(
        &fabric.topology.sites[new].pod_ns,
        SocketAddr::from((l_pod_from_new, PORT)),
    )
    .await
    .expect("connect from the new peer's pod");
    let (mut accepted, _) = listener.accept().await.expect("accept");
    accepted.write_all(b"control").await.expect("write");
    let mut buf = [0u8; 7];
    control.read_exact(&mut buf).await.expect("read");
    assert!(
        leaked(&l_site.gw_ns) > 0,
        "the counter saw none of the new peer's own connection"
    );
}

/// A hub-path connection outlives neither its mapping nor the peer it leads to. Hub L (no
/// induced peering) reflects leaf X's pod to leaf A through L's external CIDR; A's pod streams
/// UDP to it and X's pod answers. X is unpeered (its endpoints' mappings go with it) and Y, unpeered before, peers
/// again and is given X's range at once (`--range-quarantine 0`: what the flush alone
/// guarantees). Without a flush the stream's conntrack entry at L kept its DNAT to X's pod as L
/// addressed it, now Y's range, and entered Y's tunnel; the counter on Y's tunnel must stay at
/// 0 while the stream demonstrably still arrives from A, and sees L's pod sending to Y's pod
/// (the control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_path_flow_never_follows_its_removed_mapping_into_the_next_peers_tunnel() {
    if !can_run("hub_path_flush") {
        return;
    }
    const A: usize = 0;
    const HUB: usize = 1;
    const LEAVES: [usize; 2] = [2, 3];
    let mut options = FabricOptions::three_clusters();
    options.names = ["a", "l", "x", "y"].map(str::to_owned).to_vec();
    options.store = StoreKind::EtcdPerService;
    options.hub_no_induced = true;
    options.extra_args = vec![(Service::Ipam, vec!["--range-quarantine".into(), "0".into()])];
    let external: ipnet::IpNet = options.external_cidr.parse().expect("external CIDR");
    let fabric = Fabric::up(options).await.expect("fabric up");
    let id = |i: usize| fabric.clusters[i].id.clone();
    let mut peers: Vec<String> = [A, LEAVES[0], LEAVES[1]].map(id).to_vec();
    peers.sort();
    let full = |ids: &[String]| -> Vec<(String, PeeringKind)> {
        ids.iter().map(|i| (i.clone(), PeeringKind::Full)).collect()
    };
    let wait_hub = |ids: Vec<(String, PeeringKind)>| {
        let fabric = &fabric;
        async move {
            let ids: Vec<(&str, PeeringKind)> = ids.iter().map(|(i, k)| (i.as_str(), *k)).collect();
            fabric
                .wait_tunnel_endpoints(HUB, &ids, LIMIT)
                .await
                .expect("L's tunnels");
        }
    };
    wait_hub(full(&peers)).await;
    let ranges = [
        fabric.view(HUB, LEAVES[0], false).await.expect("view"),
        fabric.view(HUB, LEAVES[1], false).await.expect("view"),
    ];
    let (old, new, old_range) = if ranges[0].network() < ranges[1].network() {
        (LEAVES[0], LEAVES[1], ranges[0])
    } else {
        (LEAVES[1], LEAVES[0], ranges[1])
    };
    let unpeer = |leaf: usize| {
        let fabric = &fabric;
        async move {
            unpeer(&fabric.clusters[HUB], &fabric.clusters[leaf].id).await;
            let started = Instant::now();
            while fabric.view(HUB, leaf, false).await.is_ok() {
                assert!(started.elapsed() < LIMIT, "L's IPAM keeps {leaf}'s mapping");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    unpeer(new).await;
    fabric
        .wait_tunnel_endpoints(new, &[], LIMIT)
        .await
        .expect("new forgets L");

    // L reflects old's pod to A; A's pod streams to it through L.
    let (path, mapped) = fabric.reflect_pod(HUB, old, A).await.expect("reflection");
    assert_eq!(path, TranslationPath::HubExternal);
    fabric
        .wait_ping(A, mapped, LIMIT)
        .await
        .expect("A reaches old's pod through L");
    // Old's pod answers, so the stream is an established connection (which the tunnel guard
    // lets through whatever its destination).
    let old_site = &fabric.topology.sites[old];
    let echoer = udp_in(
        &old_site.pod_ns,
        SocketAddr::from((old_site.pod_ip, FLOW_PORT)),
    )
    .expect("udp in old");
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let echo = {
        let answered = answered.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 64];
            while let Ok((n, from)) = echoer.recv_from(&mut buf).await {
                if echoer.send_to(&buf[..n], from).await.is_ok() {
                    answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        })
    };
    let a_site = &fabric.topology.sites[A];
    let streamer = udp_in(&a_site.pod_ns, SocketAddr::from(([0, 0, 0, 0], 0))).expect("udp in A");
    let stream = tokio::spawn(async move {
        loop {
            let _ = streamer
                .send_to(b"stream", SocketAddr::from((mapped, FLOW_PORT)))
                .await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    let started = Instant::now();
    while answered.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(started.elapsed() < LIMIT, "old's pod never got A's stream");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    unpeer(old).await;
    let mut rest: Vec<String> = vec![id(A)];
    wait_hub(full(&rest)).await;
    fabric.peer(new, HUB).await.expect("new peers with L again");
    rest.push(id(new));
    rest.sort();
    wait_hub(full(&rest)).await;
    let new_range = fabric.view(HUB, new, false).await.expect("view");
    assert_eq!(
        new_range, old_range,
        "the premise: without a quarantine new is given old's range"
    );
    let l_site = &fabric.topology.sites[HUB];
    let to_new = address(&fabric, HUB, new).await;
    fabric
        .wait_ping(HUB, to_new, LIMIT)
        .await
        .expect("L's pod reaches new's pod");
    // L's gateway has applied the mappings without old's endpoint. Its DNAT is keyed by the
    // address as A sends it: A's view of L's external CIDR under the double NAT, L's real
    // external address under the stateless wire (A's engine translated it).
    let real = trellis_gateway::dataplane::rebase(
        mapped.into(),
        fabric.view(A, HUB, true).await.expect("view").into(),
        external,
    )
    .expect("the mapping is in A's view of L's external CIDR");
    let started = Instant::now();
    loop {
        let out = exec(&l_site.gw_ns, "nft", &["list", "table", "ip", "trellis"]).expect("nft");
        let table = String::from_utf8_lossy(&out.stdout);
        if !table.contains(&format!("{mapped} :")) && !table.contains(&format!("{real} :")) {
            break;
        }
        assert!(
            started.elapsed() < LIMIT,
            "L keeps the hub-path DNAT of {mapped}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let interface = |peer: usize| {
        trellis_gateway::names::interface_name(
            "tg",
            &trellis_api::ClusterId::parse("cluster_id", &id(HUB)).expect("id"),
            &trellis_api::ClusterId::parse("cluster_id", &id(peer)).expect("id"),
        )
    };
    let (from_a, into_new) = (interface(A), interface(new));
    nft_load(
        &l_site.gw_ns,
        &format!(
            "table ip hubflush {{\n  chain pre {{\n    type filter hook prerouting priority -400;\n    \
             iifname \"{from_a}\" udp dport {FLOW_PORT} counter\n  }}\n  \
             chain post {{\n    type filter hook postrouting priority 300;\n    \
             oifname \"{into_new}\" udp dport {FLOW_PORT} counter\n  }}\n}}\n"
        ),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (streamed, leaked_packets) = (
        counted(&l_site.gw_ns, "hubflush", "pre"),
        counted(&l_site.gw_ns, "hubflush", "post"),
    );
    stream.abort();
    echo.abort();
    let entries = exec(&l_site.gw_ns, "conntrack", &["-L", "-p", "udp"]).expect("conntrack");
    eprintln!(
        "old {} and new {} were both at {old_range}; {streamed} datagrams of A's stream to \
         {mapped} reached L's gateway, {leaked_packets} entered {into_new}",
        id(old),
        id(new)
    );
    assert!(streamed > 0, "A's stream never reached L's gateway");
    assert_eq!(
        leaked_packets,
        0,
        "A's hub-path stream to the removed mapping {mapped} entered the tunnel of {}, now at \
         {old_range}; L's conntrack:\n{}",
        id(new),
        String::from_utf8_lossy(&entries.stdout)
    );

    // The control: L's pod sending to new's pod on the same port is counted.
    let control = udp_in(&l_site.pod_ns, SocketAddr::from(([0, 0, 0, 0], 0))).expect("udp in L");
    for _ in 0..5 {
        control
            .send_to(b"control", SocketAddr::from((to_new, FLOW_PORT)))
            .await
            .expect("send");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        counted(&l_site.gw_ns, "hubflush", "post") > 0,
        "the counter saw none of L's pod's datagrams to new's pod"
    );
}
