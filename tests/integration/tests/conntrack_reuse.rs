//! Replies of a removed peer's connections never enter the tunnel of a new peer that reuses
//! its WireGuard port (issue 15, item 11), with real packets through real tunnels, as root, in
//! namespaces this test creates and always removes.
//!
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

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use trellis_api::pb::peering::UnpeerRequest;
use trellis_api::pb::types::PeeringKind;
use trellis_netlab::netns::{connect_in, exec, listen_in};
use trellis_netlab::{Fabric, FabricOptions, Service, StoreKind};

const OLD_OR_NEW: [usize; 2] = [0, 2];
const L: usize = 1;
const LIMIT: Duration = Duration::from_secs(120);
const PORT: u16 = 7777;

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft", "ping", "conntrack"])
}

/// The address `from`'s pod uses for `to`'s pod (as `Fabric::reach` computes it, for one pair).
async fn address(fabric: &Fabric, from: usize, to: usize) -> Ipv4Addr {
    let view = fabric.view(from, to, false).await.expect("view");
    let site = &fabric.topology.sites[to];
    let offset = u32::from(site.pod_ip) - u32::from(site.pod_cidr.network());
    Ipv4Addr::from(u32::from(view.network()) + offset)
}

/// The packet count of the rule counting what `L`'s pod sends into `interface` from our port.
fn leaked(gw_ns: &str) -> u64 {
    let out = exec(gw_ns, "nft", &["list", "chain", "ip", "leakcount", "post"]).expect("nft");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no counter in {text}"))
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
    fabric.clusters[L]
        .broker()
        .expect("broker")
        .unpeer(UnpeerRequest {
            cluster_id: fabric.clusters[old].id.clone(),
        })
        .await
        .expect("Unpeer");
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
