//! A gateway node that goes silent (issue 32), with real packets in network namespaces this
//! test creates and always removes: three clusters (hub B, leaves A and C) of three nodes each,
//! built as in `node_path.rs`. A's node 2 is cut from the gateway node n0 by a partition that
//! drops every frame both ways (no FIN, no RST: a node that lost power), then A's gateway moves
//! to n1, as relabelling a node does. The route agent of n2 was following the old gateway's
//! `WatchRoutes` over a connection that now delivers nothing; it must notice, follow the moved
//! gateway and point its node's remote prefixes at n1, so n2's pod reaches the remote pods
//! again. Before client keepalive, the agent waited on that stream forever and n2's traffic
//! kept going into the VXLAN towards n0: a black hole until someone restarted the agent.
//!
//! Only n2 is cut from n0: the lab runs A's other services on n0 (in the cluster they run on
//! other nodes), and the moved gateway on n1 must still reach its broker there.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`etcd`; CI runs
//! as root and fails instead. Heavy: one at a time in the `heavy` test group.

use std::time::{Duration, Instant};

use trellis_netlab::fabric::reaches;
use trellis_netlab::partition::Partition;
use trellis_netlab::{Fabric, FabricOptions, StoreKind};

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const NODES: usize = 3;
const LIMIT: Duration = Duration::from_secs(90);
/// How soon after the move n2's pod must reach the remote pods again.
const FOLLOWED_WITHIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pods_follow_a_gateway_that_moved_off_a_node_gone_silent() {
    if !trellis_netlab::netns::can_run(
        "pods_follow_a_gateway_that_moved_off_a_node_gone_silent",
        &["ip", "nft", "ping", "etcd"],
    ) {
        return;
    }
    // The gateway keeps its state in etcd, as deployed: its keys and ports survive the move.
    let mut options = FabricOptions::three_clusters();
    options.store = StoreKind::EtcdPerService;
    options.nodes = NODES;
    let mut fabric = Fabric::up(options).await.expect("fabric up");
    fabric
        .wait_mesh(LIMIT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));

    let site = fabric.topology.sites[A].clone();
    let n2 = site.nodes[2].clone();
    let mut targets = Vec::new();
    for remote in [B, C] {
        let pod = fabric.topology.sites[remote].nodes[1].pod_ip;
        targets.push((
            remote,
            fabric.pod_address(A, remote, pod).await.expect("view"),
        ));
    }
    // Positive control: n2's pod reaches both remote pods through the gateway node n0.
    for (remote, target) in &targets {
        assert!(
            reaches(&n2.pod_ns, *target, LIMIT).await,
            "before the partition, A/n2 never reached {}/n1 at {target}\n{}",
            fabric.clusters[*remote].id,
            fabric.logs()
        );
    }

    let _partition = Partition::nodes(&site, &[2], &[0]).expect("partition");
    // The partition cuts n2's path: it runs through n0.
    let (_, probe) = targets[0];
    assert!(
        !reaches(&n2.pod_ns, probe, Duration::from_secs(3)).await,
        "A/n2 still reaches {probe} with n0 cut off"
    );

    let uplink = fabric
        .topology
        .add_node_uplink(A, 1)
        .expect("a second uplink");
    fabric.clusters[A]
        .move_gateway(&site, 1, uplink)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
    let moved = Instant::now();
    for (remote, target) in &targets {
        let left = FOLLOWED_WITHIN.saturating_sub(moved.elapsed());
        assert!(
            reaches(&n2.pod_ns, *target, left).await,
            "A/n2 did not reach {}/n1 at {target} within {FOLLOWED_WITHIN:?} of the gateway \
             moving off the silent n0\n{}",
            fabric.clusters[*remote].id,
            fabric.logs()
        );
    }
    eprintln!(
        "measured: A/n2 reaches B and C again {} ms after the gateway moved off the silent n0",
        moved.elapsed().as_millis()
    );
}
