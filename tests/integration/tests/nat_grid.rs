//! Induced peering across NATs (issue 36): the grid {none, one-to-one, easy, hard} for leaf A ×
//! the same for leaf C, in one fabric, with real packets through real nftables NAT routers
//! ([`trellis_netlab::nat`], whose behaviour `nat_lab.rs` proves first).
//!
//! One hub (reachable, no NAT) and eight leaves, two behind each kind of router: A-side leaves
//! `an a1 ae ah` and C-side leaves `cn c1 ce ch` (none, one-to-one, easy, hard). Every leaf
//! advertises its private address (the router's inside), which no other cluster can route to;
//! the hub sees each leaf at its router's public mapping, and the leaves learn those reflexive
//! endpoints from it (`Broker.GetObservedEndpoints`, written into their induced TunnelEndpoints
//! as candidates), then send their first handshakes to every candidate at once.
//!
//! For every cell (A-side leaf, C-side leaf) the A pod pings the C pod and back, and the test
//! reads which path each gateway's tunnel to the other takes. Every cell with at least one side
//! not `hard` must be **direct**: both pings answer, and each gateway sends to the other's
//! public address (the router's, or the uplink without one), never the private one. `hard` ×
//! `hard` cannot punch through (each side's router picks a port per destination that nobody
//! can learn, and filters on it): it must be **relayed** by the hub, and reach all the same.
//! The test prints the grid with the time each cell took.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`; CI runs as root
//! and fails instead.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use trellis_api::pb::gateway::{GetTunnelStatusRequest, TunnelPath};
use trellis_netlab::cluster::StoreKind;
use trellis_netlab::{Fabric, FabricOptions, NatKind};

const A_SIDE: [&str; 4] = ["an", "a1", "ae", "ah"];
const C_SIDE: [&str; 4] = ["cn", "c1", "ce", "ch"];

fn options() -> FabricOptions {
    let mut o = FabricOptions::three_clusters();
    o.names = std::iter::once("hub")
        .chain(A_SIDE)
        .chain(C_SIDE)
        .map(str::to_owned)
        .collect();
    o.hub = 0;
    o.store = StoreKind::Memory;
    o.nat = std::iter::once(NatKind::None)
        .chain(NatKind::ALL)
        .chain(NatKind::ALL)
        .collect();
    // The brokers' default candidates refresh: a new induced TunnelEndpoint asks its hub at
    // once, then every second for a while.
    o
}

/// The endpoint `i`'s gateway uses for `j` and whether it relays through the hub, once it had
/// a handshake.
async fn endpoint_in_use(fabric: &Fabric, i: usize, j: usize) -> Option<(SocketAddr, bool)> {
    let status = fabric.clusters[i]
        .gateway()
        .ok()?
        .get_tunnel_status(GetTunnelStatusRequest {
            cluster_id: fabric.clusters[j].id.clone(),
        })
        .await
        .ok()?
        .into_inner()
        .tunnel?;
    status.last_handshake_time?;
    let relayed = status.path == TunnelPath::Relayed as i32;
    Some((status.remote_endpoint.parse().ok()?, relayed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cell_with_one_side_not_hard_is_direct_and_hard_by_hard_is_relayed() {
    if !trellis_netlab::netns::can_run("nat_grid", &["ip", "nft", "ping"]) {
        return;
    }
    let started = Instant::now();
    let fabric = Fabric::up(options()).await.expect("fabric");
    fabric
        .wait_mesh(Duration::from_secs(90))
        .await
        .expect("every induced peering between the leaves is decided");
    let meshed = started.elapsed();
    let mut grid =
        String::from("| A \\ C | none | one-to-one | easy | hard |\n|---|---|---|---|---|\n");
    let mut failures = Vec::new();
    for (ai, a_kind) in NatKind::ALL.into_iter().enumerate() {
        let a = 1 + ai;
        grid.push_str(&format!("| {a_kind} |"));
        for (ci, c_kind) in NatKind::ALL.into_iter().enumerate() {
            let c = 1 + A_SIDE.len() + ci;
            let expect_direct = !(a_kind == NatKind::Hard && c_kind == NatKind::Hard);
            let expect = if expect_direct { "direct" } else { "relayed" };
            let cell = Instant::now();
            let there = fabric
                .pod_address(a, c, fabric.topology.sites[c].pod_ip)
                .await
                .expect("A's view of C");
            let back = fabric
                .pod_address(c, a, fabric.topology.sites[a].pod_ip)
                .await
                .expect("C's view of A");
            let bound = Duration::from_secs(30);
            let pod_a = &fabric.topology.sites[a].pod_ns;
            let pod_c = &fabric.topology.sites[c].pod_ns;
            let reached = trellis_netlab::fabric::reaches(pod_a, there, bound).await
                && trellis_netlab::fabric::reaches(pod_c, back, bound).await;
            let took = cell.elapsed();
            let public = |k: usize| IpAddr::from(fabric.routers[k].public_ip);
            // The gateways' tunnel status follows their counters a little behind the packets.
            let settled = Instant::now();
            let (a_uses, c_uses, path) = loop {
                let (a_uses, c_uses) = (
                    endpoint_in_use(&fabric, a, c).await,
                    endpoint_in_use(&fabric, c, a).await,
                );
                let direct = reached
                    && a_uses.is_some_and(|(e, relayed)| e.ip() == public(c) && !relayed)
                    && c_uses.is_some_and(|(e, relayed)| e.ip() == public(a) && !relayed);
                let relayed = reached
                    && a_uses.is_some_and(|(_, relayed)| relayed)
                    && c_uses.is_some_and(|(_, relayed)| relayed);
                let path = match (reached, direct, relayed) {
                    (true, true, _) => "direct",
                    (true, _, true) => "relayed",
                    (true, false, false) => "reached (mixed paths)",
                    (false, _, _) => "unreachable",
                };
                if path == expect || !reached || settled.elapsed() > Duration::from_secs(10) {
                    break (a_uses, c_uses, path);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            grid.push_str(&format!(" {path} {:.1}s |", took.as_secs_f64()));
            if path != expect {
                failures.push(format!(
                    "{a_kind} x {c_kind}: {path}; A uses {a_uses:?} for C (public {}), C uses {c_uses:?} for A (public {})",
                    public(c),
                    public(a)
                ));
            }
        }
        grid.push('\n');
    }
    eprintln!("mesh decided in {:.1}s\n{grid}", meshed.as_secs_f64());
    assert!(
        failures.is_empty(),
        "{}\n{grid}\n{}",
        failures.join("\n"),
        fabric.logs()
    );
}
