//! The gateway's control plane, in-process on loopback with a memory store and no data plane:
//! keys and per-peer ports through GetGatewayInfo, tunnel status from the desired state, and
//! bad input refused with a status naming the field.

// Tests spawn plainly: there is no service subscriber to keep (services/clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::sync::Arc;

use clap::Parser;
use tonic::Code;
use tonic::transport::Channel;
use trellis_api::ClusterIdentity;
use trellis_api::model::{NatView, TunnelEndpoint, WgKey};
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::gateway::*;
use trellis_gateway::Config;
use trellis_gateway::core::{Gateway, Settings};
use trellis_gateway::dataplane::Mode;
use trellis_gateway::keys::KeyPair;
use trellis_gateway::ports::{PortPolicy, PortRange};
use trellis_runtime::Shutdown;
use trellis_store::SharedStore;

struct Server {
    client: GatewayClient<Channel>,
    core: Arc<Gateway>,
    shutdown: Shutdown,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn serve(extra: &[&str]) -> Server {
    let mut args = vec![
        "trellis-gateway",
        "--listen",
        "127.0.0.1:0",
        "--store",
        "memory://",
        "--cluster-id",
        "a",
        "--dataplane",
        "none",
    ];
    args.extend_from_slice(extra);
    let config = Config::try_parse_from(args).expect("config parses");
    let shutdown = Shutdown::new();
    let started = trellis_gateway::start(config, shutdown.clone())
        .await
        .expect("starts");
    let channel = Channel::from_shared(format!("http://{}", started.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connects");
    Server {
        client: GatewayClient::new(channel),
        core: started.core,
        shutdown,
    }
}

async fn info(
    client: &mut GatewayClient<Channel>,
    peer: &str,
) -> Result<GetGatewayInfoResponse, tonic::Status> {
    client
        .get_gateway_info(GetGatewayInfoRequest {
            cluster_id: peer.into(),
        })
        .await
        .map(tonic::Response::into_inner)
}

fn identity(id: &str) -> ClusterIdentity {
    ClusterIdentity::parse("cluster_id", id, "cluster_name", id).expect("valid")
}

fn te(remote: &str, nat_octet: u8) -> TunnelEndpoint {
    let net = |s: String| s.parse().expect("net");
    TunnelEndpoint {
        remote: identity(remote),
        kind: trellis_api::model::PeeringKind::Full,
        via: None,
        local_pod_cidr: net("10.0.0.0/16".into()),
        local_external_cidr: net("10.201.0.0/16".into()),
        local_nat: NatView {
            pod_cidr_nat: net("10.90.0.0/16".into()),
            external_cidr_nat: net("10.91.0.0/16".into()),
        },
        remote_pod_cidr: net("10.0.0.0/16".into()),
        remote_external_cidr: net("10.201.0.0/16".into()),
        remote_nat: NatView {
            pod_cidr_nat: net(format!("10.{nat_octet}.0.0/16")),
            external_cidr_nat: net(format!("10.{}.0.0/16", nat_octet + 1)),
        },
        remote_endpoint: "192.0.2.9:51840".parse().expect("addr"),
        remote_public_key: WgKey::from_bytes([9; 32]),
        remote_candidates: Vec::new(),
        stateless_wire: false,
        generation: 1,
    }
}

#[tokio::test]
async fn each_peer_gets_its_own_stable_port_and_the_shared_key() {
    let mut s = serve(&["--wireguard-ports", "40000-40009"]).await;
    let b = info(&mut s.client, "b").await.expect("b");
    let c = info(&mut s.client, "c").await.expect("c");
    assert_eq!(b.endpoint, "127.0.0.1:40000");
    assert_eq!(c.endpoint, "127.0.0.1:40001");
    assert_eq!(c.listen_port, 40001);
    assert_eq!(b.public_key, c.public_key);
    assert_eq!(b.public_key, s.core.public_key().to_string());
    assert_eq!(b.mode, WireguardMode::None as i32);
    assert_eq!(
        info(&mut s.client, "b").await.expect("again").endpoint,
        b.endpoint
    );
    let base = info(&mut s.client, "").await.expect("base");
    assert_eq!(base.listen_port, 40000);
    // The grace period of ports without a tunnel, which callers renew within (ADR 0007).
    assert_eq!(base.unused_port_grace_seconds, 600);
    let s = serve(&["--unused-port-grace", "90"]).await;
    let mut client = s.client.clone();
    let said = info(&mut client, "b").await.expect("b");
    assert_eq!(said.unused_port_grace_seconds, 90);
}

#[tokio::test]
async fn a_dns_name_endpoint_is_published_with_each_peers_port() {
    let mut s = serve(&[
        "--wireguard-ports",
        "40000-40009",
        "--endpoint-address",
        "GW.Hub.Example.",
    ])
    .await;
    let b = info(&mut s.client, "b").await.expect("b");
    assert_eq!(b.endpoint, "gw.hub.example:40000");
    // What the broker puts in its NetworkConfig spec accepts it.
    let spec = trellis_api::pb::types::NetworkConfigSpec {
        pod_cidr: "10.0.0.0/16".into(),
        external_cidr: "10.201.0.0/16".into(),
        endpoint: b.endpoint.clone(),
        public_key: b.public_key,
        stateless_wire: b.stateless_wire,
    };
    let parsed = trellis_api::model::NetworkSpec::from_proto("spec", Some(&spec)).expect("valid");
    assert_eq!(parsed.endpoint.to_string(), b.endpoint);
}

/// GetGatewayInfoBatch answers each item as its GetGatewayInfo would, in order (a peer keeps
/// the port it was given alone); a bad cluster ID is that item's own InvalidArgument; more than
/// 256 items are refused as a whole, naming `requests`, and allocate nothing.
#[tokio::test]
async fn batch_items_are_answered_as_their_unary_calls_each_on_its_own() {
    use get_gateway_info_result::Result as Answer;
    let mut s = serve(&["--wireguard-ports", "40000-40009"]).await;
    let b = info(&mut s.client, "b").await.expect("b");
    let ask = |id: &str| GetGatewayInfoRequest {
        cluster_id: id.into(),
    };
    let results = s
        .client
        .get_gateway_info_batch(GetGatewayInfoBatchRequest {
            requests: vec![ask("c"), ask("no spaces"), ask("b"), ask("")],
        })
        .await
        .expect("a batch")
        .into_inner()
        .results;
    assert_eq!(results.len(), 4);
    let Some(Answer::Response(c)) = &results[0].result else {
        panic!("item 0: {:?}", results[0]);
    };
    assert_eq!(c.endpoint, "127.0.0.1:40001");
    match &results[1].result {
        Some(Answer::Error(e)) => {
            assert_eq!(e.code, Code::InvalidArgument as i32);
            assert!(e.message.contains("cluster_id"), "{e:?}");
        }
        other => panic!("item 1: {other:?}"),
    }
    assert_eq!(
        results[2].result,
        Some(Answer::Response(b)),
        "b keeps its port"
    );
    let Some(Answer::Response(base)) = &results[3].result else {
        panic!("item 3: {:?}", results[3]);
    };
    assert_eq!(base.listen_port, 40000);

    let many = (0..257).map(|i| ask(&format!("p{i}"))).collect();
    let err = s
        .client
        .get_gateway_info_batch(GetGatewayInfoBatchRequest { requests: many })
        .await
        .expect_err("too many");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("requests"), "{}", err.message());
    assert_eq!(
        info(&mut s.client, "d").await.expect("d").endpoint,
        "127.0.0.1:40002",
        "the refused batch allocated a port"
    );
}

#[tokio::test]
async fn bad_cluster_ids_are_refused_naming_the_field() {
    let mut s = serve(&[]).await;
    let err = info(&mut s.client, "no spaces").await.expect_err("invalid");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("cluster_id"), "{}", err.message());
    let err = s
        .client
        .get_tunnel_status(GetTunnelStatusRequest {
            cluster_id: "b".into(),
        })
        .await
        .expect_err("no tunnel");
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test]
async fn a_full_range_is_resource_exhausted_and_stores_nothing() {
    let mut s = serve(&["--wireguard-ports", "40000-40001"]).await;
    info(&mut s.client, "b").await.expect("b");
    info(&mut s.client, "c").await.expect("c");
    let err = info(&mut s.client, "d").await.expect_err("full");
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(err.message().contains("40000-40001"), "{}", err.message());
    assert_eq!(
        info(&mut s.client, "c").await.expect("c kept").listen_port,
        40001
    );
}

fn gateway(store: SharedStore, keys: KeyPair, range: PortRange) -> Gateway {
    gateway_with_grace(store, keys, range, std::time::Duration::from_secs(600))
}

fn gateway_with_grace(
    store: SharedStore,
    keys: KeyPair,
    range: PortRange,
    unused_port_grace: std::time::Duration,
) -> Gateway {
    gateway_with(
        store,
        keys,
        range,
        unused_port_grace,
        std::time::Duration::ZERO,
    )
}

fn gateway_with(
    store: SharedStore,
    keys: KeyPair,
    range: PortRange,
    unused_port_grace: std::time::Duration,
    quarantine: std::time::Duration,
) -> Gateway {
    Gateway::new(
        store,
        Settings {
            identity: identity("a"),
            endpoint_host: trellis_api::model::EndpointHost::Ip("192.0.2.1".parse().expect("ip")),
            ports: PortPolicy {
                range,
                unused_grace: unused_port_grace,
                quarantine,
            },
            shared_port: None,
            interface_prefix: "tg".into(),
            node_name: "node-0".into(),
            node_ip: None,
            tunnel_mtu: 1420,
            stateless_wire: false,
        },
        Mode::None,
        keys,
        None,
    )
}

#[tokio::test]
async fn concurrent_allocations_never_share_a_port_and_survive_a_restart() {
    let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let keys = KeyPair::load_or_create(&store).await.expect("key");
    let range = PortRange::new(40000, 40099).expect("range");
    // Two "replicas" on one store, racing.
    let one = Arc::new(gateway(store.clone(), keys.clone(), range));
    let two = Arc::new(gateway(store.clone(), keys.clone(), range));
    let mut tasks = Vec::new();
    for i in 0..40 {
        let g = if i % 2 == 0 { one.clone() } else { two.clone() };
        tasks.push(tokio::spawn(async move {
            let id =
                trellis_api::ClusterId::parse("cluster_id", &format!("p{}", i / 2)).expect("id");
            (
                i / 2,
                g.info(Some(&id)).await.expect("allocated").listen_port,
            )
        }));
    }
    let mut by_peer = BTreeMap::new();
    for t in tasks {
        let (peer, port) = t.await.expect("task");
        // Both replicas asked for each peer: they must agree.
        if let Some(previous) = by_peer.insert(peer, port) {
            assert_eq!(previous, port, "peer p{peer}");
        }
    }
    let mut ports: Vec<u16> = by_peer.values().copied().collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 20, "unique ports: {by_peer:?}");

    let again = KeyPair::load_or_create(&store).await.expect("same key");
    assert_eq!(again.public(), keys.public());
    let restarted = gateway(store, again, range);
    let p3 = trellis_api::ClusterId::parse("cluster_id", "p3").expect("id");
    assert_eq!(
        restarted.info(Some(&p3)).await.expect("p3").listen_port,
        by_peer[&3]
    );
}

#[tokio::test]
async fn removing_a_tunnel_releases_its_port_but_not_a_pending_one() {
    let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let keys = KeyPair::load_or_create(&store).await.expect("key");
    let range = PortRange::new(40000, 40009).expect("range");
    let g = gateway(store, keys, range);
    let id = |s: &str| trellis_api::ClusterId::parse("cluster_id", s).expect("id");
    // d asked for its endpoint (NetworkConfig exchange under way) but has no tunnel yet.
    assert_eq!(g.info(Some(&id("d"))).await.expect("d").listen_port, 40000);
    let desired: BTreeMap<_, _> = [
        (id("b"), std::sync::Arc::new(te("b", 80))),
        (id("c"), std::sync::Arc::new(te("c", 83))),
    ]
    .into();
    assert_eq!(g.apply(&desired, &Vec::new()).await.expect("applied"), 0);
    let tunnels = g.tunnels().await;
    assert_eq!(tunnels.len(), 2);
    assert_eq!(tunnels[0].plan.slot, 40001);
    assert_eq!(tunnels[0].plan.routed().len(), 2);
    assert!(
        tunnels[0].message.contains("--dataplane none"),
        "{}",
        tunnels[0].message
    );
    assert_eq!(tunnels[1].plan.interface, g.interface_name(&id("c")));

    let only_c: BTreeMap<_, _> = [(id("c"), std::sync::Arc::new(te("c", 83)))].into();
    g.apply(&only_c, &Vec::new()).await.expect("applied");
    assert!(g.tunnel(&id("b")).await.is_none());
    // b's port is free again, but quarantined (its mark may still be on connections): a port
    // nobody held goes first. d's is still held.
    assert_eq!(g.info(Some(&id("e"))).await.expect("e").listen_port, 40003);
    assert_eq!(g.info(Some(&id("d"))).await.expect("d").listen_port, 40000);
}

/// One peer that cannot get a slot must not hold the others back: with a one-slot range held
/// by b's tunnel, publishing {c} (b removed, c added) removes b's tunnel at once (its routes
/// withdrawn, its slot freed) and gives c an error status saying why; c gets the slot once
/// its quarantine has passed.
#[tokio::test]
async fn a_peer_without_a_slot_does_not_hold_back_removals_and_gets_the_freed_slot_later() {
    let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let keys = KeyPair::load_or_create(&store).await.expect("key");
    let range = PortRange::new(40000, 40000).expect("range");
    let quarantine = std::time::Duration::from_secs(1);
    let g = gateway_with(
        store.clone(),
        keys,
        range,
        std::time::Duration::from_secs(600),
        quarantine,
    );
    let id = |s: &str| trellis_api::ClusterId::parse("cluster_id", s).expect("id");
    let routes = g.watch_routes();
    let prefixes = || -> Vec<String> {
        routes
            .borrow()
            .prefixes
            .iter()
            .map(ToString::to_string)
            .collect()
    };
    let only_b: BTreeMap<_, _> = [(id("b"), std::sync::Arc::new(te("b", 80)))].into();
    assert_eq!(g.apply(&only_b, &Vec::new()).await.expect("applied"), 0);
    assert_eq!(g.tunnel(&id("b")).await.expect("b").plan.slot, 40000);
    assert_eq!(prefixes(), ["10.80.0.0/16", "10.81.0.0/16"]);

    let only_c: BTreeMap<_, _> = [(id("c"), std::sync::Arc::new(te("c", 83)))].into();
    let published = std::time::Instant::now();
    let failed = g
        .apply(&only_c, &Vec::new())
        .await
        .expect("a pass with one peer short of a slot still applies the others");
    assert_eq!(failed, 1, "c has no slot yet");
    assert!(g.tunnel(&id("b")).await.is_none(), "b's tunnel is still up");
    assert_eq!(
        prefixes(),
        Vec::<String>::new(),
        "b's routes are still announced"
    );
    assert_eq!(
        trellis_gateway::ports::lookup(&store, &id("b"))
            .await
            .expect("reads"),
        None,
        "b still holds its slot"
    );
    let c = g.tunnel(&id("c")).await.expect("c has a status");
    assert_eq!(c.state, trellis_gateway::core::State::Error);
    assert!(
        c.message.contains("no free WireGuard port"),
        "{}",
        c.message
    );

    // The reconciler retries a pass that left a tunnel unconfigured; c gets b's slot once
    // the quarantine is over, not before.
    loop {
        let failed = g.apply(&only_c, &Vec::new()).await.expect("applied");
        if failed == 0 {
            break;
        }
        assert!(
            published.elapsed() < std::time::Duration::from_secs(10),
            "c still has no slot: {}",
            g.tunnel(&id("c")).await.expect("c").message
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        published.elapsed() >= quarantine,
        "the slot was reused before its quarantine ended"
    );
    assert_eq!(g.tunnel(&id("c")).await.expect("c").plan.slot, 40000);
    assert_eq!(prefixes(), ["10.83.0.0/16", "10.84.0.0/16"]);
}

/// Issue 15 item 5: ports handed out for peers that never get a tunnel go back to the range
/// once nobody asked for them during the grace period, at the latest when the range is full;
/// a port asked for again, or bound to a tunnel, stays.
#[tokio::test]
async fn ports_without_a_tunnel_return_after_the_grace_period_and_bound_ones_stay() {
    let store: SharedStore = Arc::new(trellis_store::MemoryStore::new());
    let keys = KeyPair::load_or_create(&store).await.expect("key");
    let range = PortRange::new(40000, 40002).expect("range");
    let grace = std::time::Duration::from_secs(1);
    let g = gateway_with_grace(store, keys, range, grace);
    let id = |s: &str| trellis_api::ClusterId::parse("cluster_id", s).expect("id");
    for peer in ["b", "bogus-1", "bogus-2"] {
        g.info(Some(&id(peer))).await.expect("a free port");
    }
    let err = g.info(Some(&id("c"))).await.expect_err("full");
    assert!(
        matches!(err, trellis_error::Error::ResourceExhausted(_)),
        "{err}"
    );
    let desired: BTreeMap<_, _> = [(id("b"), std::sync::Arc::new(te("b", 80)))].into();
    g.apply(&desired, &Vec::new()).await.expect("applied");

    tokio::time::sleep(grace * 2).await;
    // The range is full: the made-up peers' ports are released for c; b's tunnel keeps its own.
    let c = g.info(Some(&id("c"))).await.expect("a released port");
    assert_ne!(c.listen_port, 40000);
    assert_eq!(g.info(Some(&id("b"))).await.expect("b").listen_port, 40000);
    let d = g
        .info(Some(&id("d")))
        .await
        .expect("the other released port");
    assert_ne!(d.listen_port, c.listen_port);
    // c and d are fresh: the range is full again.
    assert!(g.info(Some(&id("e"))).await.is_err());
}

/// The node path: WatchRoutes sends the full set at once and again after every change (a
/// removed peer's prefixes disappear), with the gateway's node; bad input is refused.
#[tokio::test]
async fn watch_routes_streams_every_peers_prefixes_and_the_gateway_node() {
    let mut server = serve(&["--node-name", "gw-node", "--node-ip", "100.64.0.1"]).await;
    for bad in ["Not_A_Label", "", "a.b", &"n".repeat(64)] {
        let err = server
            .client
            .watch_routes(WatchRoutesRequest {
                node_name: bad.to_owned(),
            })
            .await
            .expect_err("a bad node name is refused");
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}");
        assert!(err.message().contains("node_name"), "{}", err.message());
    }

    let mut stream = server
        .client
        .watch_routes(WatchRoutesRequest {
            node_name: "node-1".into(),
        })
        .await
        .expect("subscribes")
        .into_inner();
    let first = next(&mut stream).await;
    assert!(first.remote_prefixes.is_empty(), "{first:?}");
    assert_eq!(
        (
            first.gateway_node_name.as_str(),
            first.gateway_node_ip.as_str()
        ),
        ("gw-node", "100.64.0.1")
    );
    assert_eq!(
        first.tunnel_mtu, 1420,
        "the default 1500-byte underlay minus 80"
    );

    let id = |s: &str| trellis_api::ClusterId::parse("cluster_id", s).expect("id");
    let both: BTreeMap<_, _> = [
        (id("b"), std::sync::Arc::new(te("b", 80))),
        (id("c"), std::sync::Arc::new(te("c", 83))),
    ]
    .into();
    server
        .core
        .apply(&both, &Vec::new())
        .await
        .expect("applied");
    assert_eq!(
        next(&mut stream).await.remote_prefixes,
        [
            "10.80.0.0/16",
            "10.81.0.0/16",
            "10.83.0.0/16",
            "10.84.0.0/16"
        ]
    );
    let only_c: BTreeMap<_, _> = [(id("c"), std::sync::Arc::new(te("c", 83)))].into();
    server
        .core
        .apply(&only_c, &Vec::new())
        .await
        .expect("applied");
    assert_eq!(
        next(&mut stream).await.remote_prefixes,
        ["10.83.0.0/16", "10.84.0.0/16"]
    );
}

/// The tunnel MTU the route agents learn is `--underlay-mtu` minus WireGuard's 80 bytes.
#[tokio::test]
async fn watch_routes_announces_the_tunnel_mtu_of_the_underlay() {
    for (underlay, tunnel) in [("1400", 1320), ("9000", 8920)] {
        let mut server = serve(&["--node-name", "gw-node", "--underlay-mtu", underlay]).await;
        let mut stream = server
            .client
            .watch_routes(WatchRoutesRequest {
                node_name: "node-1".into(),
            })
            .await
            .expect("subscribes")
            .into_inner();
        assert_eq!(next(&mut stream).await.tunnel_mtu, tunnel, "{underlay}");
    }
}

async fn next(stream: &mut tonic::Streaming<WatchRoutesResponse>) -> WatchRoutesResponse {
    tokio::time::timeout(std::time::Duration::from_secs(10), stream.message())
        .await
        .expect("a message in time")
        .expect("stream ok")
        .expect("stream open")
}

/// A change pass (what the reconciler runs on every change of the desired set) touches the
/// store for the peers that changed only; a repair pass checks every slot. At a mesh of n
/// peers forming, one store read per peer per change made each gateway's work grow as n².
#[tokio::test]
async fn a_change_pass_reads_the_slots_of_changed_peers_only() {
    use trellis_gateway::dataplane::linux::Pass;
    let counted = Arc::new(trellis_store::counted::Counted::new(Arc::new(
        trellis_store::MemoryStore::new(),
    )));
    let store: SharedStore = counted.clone();
    let keys = KeyPair::load_or_create(&store).await.expect("key");
    let g = gateway(store, keys, PortRange::new(40000, 40099).expect("range"));
    let id = |s: &str| trellis_api::ClusterId::parse("cluster_id", s).expect("id");
    let mut desired: BTreeMap<_, _> = (0..20u8)
        .map(|i| {
            let name = format!("p{i}");
            (id(&name), Arc::new(te(&name, 80)))
        })
        .collect();
    assert_eq!(
        g.apply_pass(&desired, &Vec::new(), Pass::Changes)
            .await
            .expect("applied"),
        0
    );
    let reads = || counted.reads();
    let before = reads();
    desired.insert(id("new"), Arc::new(te("new", 81)));
    g.apply_pass(&desired, &Vec::new(), Pass::Changes)
        .await
        .expect("applied");
    let change = reads() - before;
    assert_eq!(g.tunnels().await.len(), 21, "every peer applied");
    assert!(
        change <= 4,
        "a change pass for one new peer among 21 read the store {change} times"
    );
    // Positive control: a repair pass reads every peer's slot.
    let before = reads();
    g.apply_pass(&desired, &Vec::new(), Pass::Repair)
        .await
        .expect("applied");
    let repair = reads() - before;
    assert!(
        repair >= 21,
        "a repair pass read the store only {repair} times"
    );
    // Removing a peer in a change pass still releases its port.
    desired.remove(&id("p0"));
    g.apply_pass(&desired, &Vec::new(), Pass::Changes)
        .await
        .expect("applied");
    assert!(g.tunnel(&id("p0")).await.is_none());
    assert_eq!(g.tunnels().await.len(), 20);
}
