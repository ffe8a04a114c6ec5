//! One UDP port for every peer (issue 18, ADR 0022), with real packets and the real control
//! plane, as root, in network namespaces this test creates and always removes
//! ([`trellis_netlab`]).
//!
//! A hub and 20 leaves, **all with pod CIDR 10.0.0.0/16** (and one external CIDR), every leaf
//! peered with the hub and induced peering off, so the hub's gateway holds 20 tunnels whose
//! peers' real ranges are all the same. The test checks that:
//!
//! - the hub's gateway binds exactly one UDP socket (`ss -ulnp` in its namespace), on the
//!   WireGuard port, and every tunnel reports it (`ListTunnels`);
//! - packets cross every tunnel, in both directions (each leaf's pod pings the hub's pod at the
//!   address its cluster uses for it, and the hub's pod pings every leaf's pod);
//! - hostile datagrams sent at the port (garbage, a data message for no session, a handshake
//!   initiation from a key the hub does not know, and every datagram of a live leaf duplicated
//!   in flight by nftables `dup`: replays) are dropped and counted in
//!   `trellis_gateway_dropped_datagrams_total{reason}`, and every tunnel still carries packets;
//! - a SIGKILLed and restarted hub gateway carries every leaf's packets again (waited for with a
//!   generous deadline; the time is printed, not asserted). The stores here are `memory://`
//!   (21 etcds per service would not fit the machine), so the restarted gateway has a new key
//!   and the leaves learn it from new NetworkConfigs: the slow case. With a persisted key
//!   (etcd), `gateway_dataplane` measures the fast one.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`ss` or the
//! Prometheus parser; CI runs as root and fails instead. Heavy (147 processes): one at a time
//! in the `netns` test group.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use defguard_boringtun::noise::{Tunn, TunnResult};
use defguard_boringtun::x25519::{PublicKey, StaticSecret};
use ipnet::Ipv4Net;
use trellis_api::pb::gateway::TunnelState;
use trellis_api::pb::types::PeeringKind;
use trellis_integration::prom::{parse, parser_python, scrape_in};
use trellis_netlab::netns::{exec, in_netns};
use trellis_netlab::{Fabric, FabricOptions, Service, StoreKind};

const LEAVES: usize = 20;
const HUB: usize = 0;
/// Generous: 147 processes start on a small machine.
const LIMIT: Duration = Duration::from_secs(240);
const WIREGUARD_PORT: u16 = 51840;
const GATEWAY_METRICS: u16 = 9106;

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft", "ping", "ss"]) && parser_python().is_some()
}

/// The hub's pod as cluster `viewer` addresses it, or a leaf's pod as the hub does.
async fn pod_seen_by(fabric: &Fabric, viewer: usize, remote: usize) -> Ipv4Addr {
    let view: Ipv4Net = fabric.view(viewer, remote, false).await.expect("ipam view");
    let site = &fabric.topology.sites[remote];
    let offset = u32::from(site.pod_ip) - u32::from(site.pod_cidr.network());
    Ipv4Addr::from(u32::from(view.network()) + offset)
}

/// UDP sockets bound by the gateway process in `ns`: `(local address, port)` per socket.
fn gateway_udp_sockets(ns: &str) -> Vec<String> {
    let out = exec(ns, "ss", &["-H", "-u", "-l", "-n", "-p"]).expect("ss runs");
    let heartbeat = format!("127.0.0.1:{HEARTBEAT_PORT}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("trellis-gatewa"))
        .filter_map(|l| l.split_whitespace().nth(3).map(str::to_owned))
        .filter(|addr| *addr != heartbeat)
        .collect()
}

/// Where the gateways receive their replicas' heartbeats (pinned here so that the one socket
/// counted above is WireGuard's).
const HEARTBEAT_PORT: u16 = 7116;

/// The hub gateway's drop counters by reason.
fn dropped(fabric: &Fabric) -> BTreeMap<String, f64> {
    let python = parser_python().expect("checked in can_run");
    let ns = &fabric.topology.sites[HUB].gw_ns;
    let text = scrape_in(ns, SocketAddr::from(([127, 0, 0, 1], GATEWAY_METRICS)));
    parse(&python, &text)
        .into_iter()
        .filter(|s| s.name == "trellis_gateway_dropped_datagrams_total")
        .filter_map(|s| Some((s.labels.get("reason")?.clone(), s.value)))
        .collect()
}

/// Sends `datagrams` from leaf `from`'s gateway namespace to `to`.
fn send_from(fabric: &Fabric, from: usize, to: SocketAddr, datagrams: Vec<Vec<u8>>) {
    let ns = fabric.topology.sites[from].gw_ns.clone();
    in_netns(&ns, move || -> std::io::Result<()> {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        for d in &datagrams {
            socket.send_to(d, to)?;
        }
        Ok(())
    })
    .expect("sent");
}

/// Pings every `(from, address)` until each answered once.
async fn all_answer(fabric: &Fabric, pairs: &[(usize, Ipv4Addr)], what: &str) -> Duration {
    let started = Instant::now();
    for (from, address) in pairs {
        fabric
            .wait_ping(*from, *address, LIMIT)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:#}"));
    }
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_peers_on_one_cidr_share_one_udp_port_survive_hostile_datagrams_and_a_restart() {
    let test =
        "twenty_peers_on_one_cidr_share_one_udp_port_survive_hostile_datagrams_and_a_restart";
    if !can_run(test) {
        return;
    }
    let mut names = vec!["hub".to_owned()];
    names.extend((1..=LEAVES).map(|i| format!("l{i}")));
    let options = FabricOptions {
        names: names.clone(),
        hub: HUB,
        pod_cidr: "10.0.0.0/16".into(),
        pod_cidrs: Vec::new(),
        external_cidr: "10.201.0.0/16".into(),
        hub_no_induced: true,
        store: StoreKind::Memory,
        extra_args: vec![(
            Service::Gateway,
            vec![
                "--metrics-listen".into(),
                format!("0.0.0.0:{GATEWAY_METRICS}"),
                "--heartbeat-listen".into(),
                format!("127.0.0.1:{HEARTBEAT_PORT}"),
            ],
        )],
        cluster_args: Vec::new(),
        nodes: 1,
        node_networks: Vec::new(),
        unreserved: Vec::new(),
        endpoint_names: false,
        gateways: 1,
        nat: Vec::new(),
        tls: false,
    };
    let started = Instant::now();
    let mut fabric = Fabric::up(options).await.expect("fabric up");
    let leaves: Vec<usize> = (1..=LEAVES).collect();
    let mut expected: Vec<(&str, PeeringKind)> = names[1..]
        .iter()
        .map(|n| (n.as_str(), PeeringKind::Full))
        .collect();
    expected.sort_by(|a, b| a.0.cmp(b.0));
    fabric
        .wait_tunnel_endpoints(HUB, &expected, LIMIT)
        .await
        .expect("the hub's tunnel endpoints");
    eprintln!(
        "measured: hub and {LEAVES} leaves up and peered {} ms after the start",
        started.elapsed().as_millis()
    );

    // One socket, however many peers.
    let hub_ns = fabric.topology.sites[HUB].gw_ns.clone();
    let sockets = gateway_udp_sockets(&hub_ns);
    assert_eq!(
        sockets.len(),
        1,
        "the hub's gateway binds exactly one UDP socket: {sockets:?}"
    );
    assert!(
        sockets[0].ends_with(&format!(":{WIREGUARD_PORT}")),
        "{sockets:?}"
    );
    for leaf in &leaves {
        let endpoint = fabric
            .wireguard_endpoint(*leaf, HUB)
            .await
            .expect("the leaf's endpoint for the hub");
        assert_eq!(endpoint.port(), WIREGUARD_PORT, "leaf {leaf}");
    }

    // Packets cross every tunnel, both ways.
    let mut to_hub = Vec::new();
    let mut from_hub = Vec::new();
    for leaf in &leaves {
        to_hub.push((*leaf, pod_seen_by(&fabric, *leaf, HUB).await));
        from_hub.push((HUB, pod_seen_by(&fabric, HUB, *leaf).await));
    }
    let took = all_answer(&fabric, &to_hub, "leaf to hub").await;
    all_answer(&fabric, &from_hub, "hub to leaf").await;
    eprintln!(
        "measured: every leaf's pod reached the hub's pod within {} ms",
        took.as_millis()
    );
    let tunnels = fabric.clusters[HUB]
        .gateway_tunnels()
        .await
        .expect("ListTunnels");
    assert_eq!(tunnels.len(), LEAVES);
    for t in &tunnels {
        assert_eq!(t.listen_port, u32::from(WIREGUARD_PORT), "{t:?}");
        assert_eq!(t.state, TunnelState::Up as i32, "{t:?}");
    }
    let mut interfaces: Vec<&str> = tunnels.iter().map(|t| t.interface_name.as_str()).collect();
    interfaces.sort_unstable();
    interfaces.dedup();
    assert_eq!(interfaces.len(), LEAVES, "one interface per peer");

    // Hostile datagrams, from leaf 1's gateway namespace.
    let before = dropped(&fabric);
    let hub_wg = fabric
        .wireguard_endpoint(1, HUB)
        .await
        .expect("the hub's endpoint");
    let hub_key = fabric.clusters[HUB]
        .gateway()
        .expect("gateway client")
        .get_gateway_info(trellis_api::pb::gateway::GetGatewayInfoRequest::default())
        .await
        .expect("GetGatewayInfo")
        .into_inner()
        .public_key;
    let hub_key: [u8; 32] = base64_decode(&hub_key).try_into().expect("32-byte key");
    let mut garbage = vec![b"not wireguard at all".to_vec(), vec![4, 0, 0, 0, 1]];
    garbage.extend((0..8).map(|i| vec![i; 100]));
    // A data message for an index nobody handed out.
    let mut no_session = vec![4, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff];
    no_session.extend_from_slice(&[0u8; 40]);
    // A well-formed handshake initiation (MAC1 right) from a key the hub has no peer for.
    let stranger = StaticSecret::from([7u8; 32]);
    let mut foreign = Tunn::new(stranger, PublicKey::from(hub_key), None, None, 1, None);
    let mut buf = [0u8; 256];
    let initiation = match foreign.format_handshake_initiation(&mut buf, false) {
        TunnResult::WriteToNetwork(p) => p.to_vec(),
        other => panic!("no handshake initiation: {other:?}"),
    };
    let mut hostile = garbage.clone();
    hostile.push(no_session);
    hostile.push(initiation);
    send_from(&fabric, 1, hub_wg, hostile);
    // Replays: leaf 1's gateway sends every WireGuard datagram to the hub twice.
    let leaf_ns = fabric.topology.sites[1].gw_ns.clone();
    let dup = format!(
        "table ip replay {{\n  chain out {{\n    type filter hook output priority 0;\n    \
         ip daddr {hub} udp dport {WIREGUARD_PORT} dup to {hub}\n  }}\n}}\n",
        hub = hub_wg.ip()
    );
    let rules = tempfile::NamedTempFile::new().expect("rules file");
    std::fs::write(rules.path(), dup).expect("write rules");
    let rules_path = rules.path().to_str().expect("utf-8").to_owned();
    let out = exec(&leaf_ns, "nft", &["-f", &rules_path]).expect("nft");
    assert!(
        out.status.success(),
        "nft dup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (leaf1, hub_pod) = to_hub[0];
    let replayed = fabric
        .ping(leaf1, hub_pod, &["-c", "5", "-i", "0.2", "-W", "2"])
        .expect("ping");
    exec(&leaf_ns, "nft", &["delete", "table", "ip", "replay"]).expect("nft delete");
    assert!(
        replayed.status.success(),
        "duplicates do not break the tunnel: {}",
        String::from_utf8_lossy(&replayed.stdout)
    );
    let deadline = Instant::now() + LIMIT;
    let after = loop {
        let after = dropped(&fabric);
        let grew = |reason: &str, by: f64| {
            after.get(reason).copied().unwrap_or(0.0) - before.get(reason).copied().unwrap_or(0.0)
                >= by
        };
        if grew("malformed", garbage.len() as f64)
            && grew("unknown_peer", 2.0)
            && grew("replay", 5.0)
        {
            break after;
        }
        assert!(
            Instant::now() < deadline,
            "drops not counted: before {before:?}, after {after:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    eprintln!("measured: drops before {before:?}, after {after:?}");
    // Every tunnel still carries packets.
    all_answer(&fabric, &to_hub, "leaf to hub after the hostile datagrams").await;

    // A restarted gateway resumes every tunnel.
    fabric.clusters[HUB]
        .kill9(Service::Gateway)
        .expect("kill the hub's gateway");
    let killed = Instant::now();
    fabric.clusters[HUB]
        .restart(Service::Gateway)
        .await
        .expect("restart the hub's gateway");
    let serving = killed.elapsed();
    let took = all_answer(&fabric, &to_hub, "leaf to hub after the restart").await;
    eprintln!(
        "measured: gateway serving again {} ms after SIGKILL; every leaf reached the hub's pod {} ms after that",
        serving.as_millis(),
        took.as_millis()
    );
    assert_eq!(gateway_udp_sockets(&hub_ns).len(), 1);
    all_answer(&fabric, &from_hub, "hub to leaf after the restart").await;

    for cluster in &mut fabric.clusters {
        let _ = cluster.stop_all().await;
    }
}

/// Standard base64 (the key as the API carries it).
fn base64_decode(text: &str) -> Vec<u8> {
    trellis_api::model::WgKey::parse("public_key", text)
        .expect("a WireGuard key")
        .as_bytes()
        .to_vec()
}
