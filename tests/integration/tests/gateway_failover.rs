//! Gateway replicas fail over with real packets (issue 33), as root, in network namespaces this
//! test creates and always removes: hub B and leaves A and C, all with pod CIDR 10.0.0.0/16,
//! three nodes each, **two gateway replicas per cluster** (nodes 0 and 1, one store). While
//! long-lived TCP connections (a message every 50 ms, each echo checked) and a 10 ms UDP probe
//! run from the pod of A's node 2 to the pods of node 2 of B (leaf to hub) and of C (leaf to
//! leaf, induced: the direct tunnel), the active gateway of each cluster in turn is killed with
//! SIGKILL. The standby must take over under a new epoch, every route agent and every tunnel
//! must follow it, and the killed replica must come back as a standby (no pre-emption).
//!
//! Every TCP connection must survive every failover and the cut: through A's own (which
//! opened them) and through B's and C's, where they are the peer's and were handed off to the
//! standby (ADR 0023), push connections included (after the switch only the server speaks, the
//! side that looks like a connection of its own), and through a store outage, and while C's
//! active has lost its zone rules for its own side (the tunnel guard drops what misses its
//! zone). The probes must come back. Every gap is printed as `measured:`.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`python3`; CI
//! runs as root and fails instead. Heavy (36 processes): one at a time in the `heavy` group.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use trellis_api::pb::gateway::ListTunnelsRequest;
use trellis_api::pb::route::GetStatusRequest;
use trellis_api::pb::route::route_client::RouteClient;
use trellis_integration::failover::{self, FLOWS, PORT, PodProcess, replica_status};
use trellis_netlab::{Fabric, FabricOptions, Service};

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const LIMIT: Duration = Duration::from_secs(90);
/// TCP connections per destination.
const CONNECTIONS: usize = 25;
/// Connections per destination on which only the server speaks.
const PUSHED: usize = 5;
/// How long a standby may take to say it is active after the kill (generous: the target is
/// under 2 s, this bound only catches a takeover that never comes).
const TAKEOVER: Duration = Duration::from_secs(10);
/// The longest gap between probe answers while nothing fails over (store outage, standby
/// restart), in milliseconds.
const QUIET_GAP_MS: f64 = 500.0;

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft", "ping", "python3"])
}

/// The address a pod of cluster `from` uses for `to`'s pod `pod_ip`.
async fn address(fabric: &Fabric, from: usize, to: usize, pod_ip: Ipv4Addr) -> Ipv4Addr {
    failover::address(fabric, from, to, pod_ip)
        .await
        .expect("view")
}

/// The node of `cluster`'s one active replica, once exactly one says it is active, with its
/// epoch (with every log when there is none, or two).
async fn the_active(fabric: &Fabric, cluster: usize, bound: Duration) -> (usize, u64) {
    failover::the_active(fabric, cluster, bound)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()))
}

/// After a takeover by the replica on node `new`: milliseconds since `killed` until every route
/// agent of `cluster` routes to that node (in sync), and until every tunnel of the new active
/// had a handshake after `kill_time`.
async fn follow_up(
    fabric: &Fabric,
    cluster: usize,
    new: usize,
    killed: Instant,
    kill_time: std::time::SystemTime,
) -> (u128, u128) {
    let site = &fabric.topology.sites[cluster];
    let gateway_node = site.nodes[new].name.clone();
    let (mut nodes_at, mut handshakes_at) = (None, None);
    while nodes_at.is_none() || handshakes_at.is_none() {
        if killed.elapsed() > LIMIT {
            panic!(
                "cluster {cluster} never settled after the takeover (nodes {nodes_at:?}, \
                 handshakes {handshakes_at:?})\n{}\n{}",
                tunnels(fabric).await,
                fabric.logs()
            );
        }
        if nodes_at.is_none() {
            let mut all = true;
            for node in &site.nodes {
                let addr = std::net::SocketAddr::new(node.node_ip.into(), 7107);
                let followed = async {
                    let channel = trellis_netlab::netns::channel_in(&node.netns, addr)?;
                    let status = RouteClient::new(channel)
                        .get_status(GetStatusRequest {})
                        .await?
                        .into_inner();
                    anyhow::Ok(status.gateway_node_name == gateway_node && status.in_sync)
                }
                .await
                .unwrap_or(false);
                all &= followed;
            }
            if all {
                nodes_at = Some(killed.elapsed().as_millis());
            }
        }
        if handshakes_at.is_none() {
            let fresh = async {
                let tunnels = fabric.clusters[cluster]
                    .gateway_replica(new)?
                    .list_tunnels(ListTunnelsRequest {})
                    .await?
                    .into_inner()
                    .tunnels;
                anyhow::Ok(
                    !tunnels.is_empty()
                        && tunnels.iter().all(|t| {
                            t.last_handshake_time
                                .and_then(|ts| std::time::SystemTime::try_from(ts).ok())
                                .is_some_and(|at| at > kill_time)
                        }),
                )
            }
            .await
            .unwrap_or(false);
            if fresh {
                handshakes_at = Some(killed.elapsed().as_millis());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (
        nodes_at.unwrap_or_default(),
        handshakes_at.unwrap_or_default(),
    )
}

/// Every replica's tunnels: peer, state, where it sends, last handshake (for failures).
async fn tunnels(fabric: &Fabric) -> String {
    let mut out = String::new();
    for (i, cluster) in fabric.clusters.iter().enumerate() {
        for node in cluster.gateway_replica_nodes() {
            let listed = async {
                let active = replica_status(fabric, i, node).await?.active;
                let tunnels = cluster
                    .gateway_replica(node)?
                    .list_tunnels(ListTunnelsRequest {})
                    .await?
                    .into_inner()
                    .tunnels;
                anyhow::Ok((active, tunnels))
            }
            .await;
            match listed {
                Ok((active, tunnels)) => {
                    for t in tunnels {
                        out.push_str(&format!(
                            "{} n{node} (active {active}) -> {}: state {} endpoint {} handshake {:?}\n",
                            cluster.id,
                            t.remote.map(|r| r.cluster_id).unwrap_or_default(),
                            t.state,
                            t.remote_endpoint,
                            t.last_handshake_time
                        ));
                    }
                }
                Err(err) => out.push_str(&format!("{} n{node}: {err:#}\n", cluster.id)),
            }
        }
    }
    out
}

fn python_in(ns: &str, script: &std::path::Path, args: &[String]) -> PodProcess {
    failover::python_in(ns, script, args).expect("python3 starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_takes_over_each_clusters_tunnels_and_node_path_after_a_kill() {
    if !can_run("a_standby_takes_over_each_clusters_tunnels_and_node_path_after_a_kill") {
        return;
    }
    let mut options = FabricOptions::three_clusters();
    options.nodes = 3;
    options.gateways = 2;
    let started = Instant::now();
    let mut fabric = Fabric::up(options).await.expect("fabric up");
    fabric
        .wait_mesh(LIMIT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
    eprintln!(
        "measured: 3 clusters x 3 nodes x 2 gateway replicas up and peered in {} ms",
        started.elapsed().as_millis()
    );
    for cluster in [A, B, C] {
        let (node, epoch) = the_active(&fabric, cluster, LIMIT).await;
        eprintln!("cluster {cluster}: the active replica is on node {node}, epoch {epoch}");
    }

    let pods = Pods::up(&fabric).await;
    let targets = pods.targets(false);

    // A's own failover: every connection was opened from A, so the new active picks each up
    // right from whichever side sends first.
    let flows = pods.flows("a", &targets);
    tokio::time::sleep(Duration::from_secs(3)).await;
    fail_over(&mut fabric, A).await;
    let summary = flows.stop();
    let broken = report(&summary);
    none_broken(
        &broken,
        "connections broken by the failover of the cluster that opened them",
        &fabric,
    );
    probes_resumed(&summary, &fabric);

    // The hub's and C's failovers: the connections were opened by A's pod, so on B and C they
    // are the peer's. The push connections make sure that after the switch the first packet
    // of each comes from B's or C's pod. Under the stateless wire (the default here) no
    // conntrack entry holds their translation, so the new active's engine carries them as
    // the old one did; under the double NAT they need the handoff (ADR 0023), which
    // `each_clusters_active_cut_off_is_replaced_by_its_standby_and_steps_down_on_return`
    // exercises.
    let flows = pods.flows("bc", &pods.targets(true));
    tokio::time::sleep(Duration::from_secs(3)).await;
    fail_over(&mut fabric, B).await;
    fail_over(&mut fabric, C).await;
    let summary = flows.stop();
    let broken = report(&summary);
    none_broken(
        &broken,
        "connections broken by the failovers of the clusters that did not open them",
        &fabric,
    );
    probes_resumed(&summary, &fabric);
}

/// Hub B and leaves A and C on one pod CIDR, three nodes each and two gateway replicas per
/// cluster, peered; every tunnel under the double NAT (`--no-stateless-wire`, ADR 0008) when
/// `double_nat`, under the stateless wire convention (the default, ADR 0034) otherwise.
async fn replicated_fabric(double_nat: bool) -> Fabric {
    let mut options = FabricOptions::three_clusters();
    options.nodes = 3;
    options.gateways = 2;
    if double_nat {
        options.extra_args = vec![(Service::Gateway, vec!["--no-stateless-wire".into()])];
    }
    let fabric = Fabric::up(options).await.expect("fabric up");
    fabric
        .wait_mesh(LIMIT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
    fabric
}

/// Fails, with every log, when any connection broke.
fn none_broken(broken: &[String], what: &str, fabric: &Fabric) {
    assert!(
        broken.is_empty(),
        "{what}:\n{}\n{}",
        broken.join("\n"),
        fabric.logs()
    );
}

/// Every probe of `summary` came back after the failovers (its longest gap is a bound on the
/// outage, not a performance target: those are measured, in `measured:` lines).
fn probes_resumed(summary: &serde_json::Value, fabric: &Fabric) {
    for target in summary.as_array().expect("targets") {
        if target["connections"].is_null() {
            let gap = target["max_gap_ms"].as_f64().unwrap_or(f64::MAX);
            assert!(
                gap < 10_000.0,
                "the probe {} never came back ({gap} ms)\n{}",
                target["target"],
                fabric.logs()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_and_a_standby_restart_lose_no_probe_and_never_make_two_actives() {
    if !can_run("a_store_outage_and_a_standby_restart_lose_no_probe_and_never_make_two_actives") {
        return;
    }
    let mut fabric = replicated_fabric(false).await;
    let (active, epoch) = the_active(&fabric, A, LIMIT).await;
    let standby = 1 - active;

    let pods = Pods::up(&fabric).await;
    let flows = pods.flows("outage", &pods.targets(false));
    tokio::time::sleep(Duration::from_secs(2)).await;

    // A checker samples both replicas every 100 ms: never two actives, never a failover.
    let mut samples = 0;
    let outage = Duration::from_secs(60);
    fabric.clusters[A]
        .etcd_mut(Service::Gateway)
        .expect("etcd")
        .kill();
    let stopped = Instant::now();
    while stopped.elapsed() < outage {
        // Both must answer: a replica that cannot be asked would count as "not active".
        let mut actives = Vec::new();
        for node in [0, 1] {
            let s = replica_status(&fabric, A, node)
                .await
                .unwrap_or_else(|e| panic!("replica on node {node} did not answer: {e:#}"));
            if s.active {
                actives.push((node, s.epoch));
            }
        }
        samples += 1;
        assert!(
            actives.len() < 2,
            "two active replicas during the store outage: {actives:?}"
        );
        assert!(
            actives.is_empty() || actives == [(active, epoch)],
            "the active changed during the store outage: {actives:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fabric.clusters[A]
        .etcd_mut(Service::Gateway)
        .expect("etcd")
        .restart()
        .expect("etcd restarts");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(the_active(&fabric, A, TAKEOVER).await, (active, epoch));
    eprintln!(
        "measured: {samples} samples of both replicas during a {outage:?} store outage, never two actives"
    );

    // The standby killed and restarted.
    fabric.clusters[A]
        .gateway_replica_mut(standby)
        .expect("replica")
        .kill9();
    tokio::time::sleep(Duration::from_secs(2)).await;
    fabric.clusters[A]
        .gateway_replica_mut(standby)
        .expect("replica")
        .restart()
        .await
        .expect("the standby restarts");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(the_active(&fabric, A, TAKEOVER).await, (active, epoch));

    let summary = flows.stop();
    let broken = report(&summary);
    // No failover happens here: every connection only has to outlast the outage. About one
    // run in eight used to lose one at a random moment: a reply of C's pod that missed its
    // conntrack zone (ADR 0023), now dropped by the tunnel guard.
    none_broken(
        &broken,
        "connections broken during the store outage and the standby's restart",
        &fabric,
    );
    for target in summary.as_array().expect("targets") {
        if target["connections"].is_null() {
            let sent = target["sent"].as_u64().unwrap_or(0);
            let received = target["received"].as_u64().unwrap_or(0);
            let gap = target["max_gap_ms"].as_f64().unwrap_or(f64::MAX);
            eprintln!(
                "measured: {} probes lost of {sent}, longest gap {gap:.0} ms",
                sent - received
            );
            // The flows wait a second for the probes still on their way when they stop; one
            // may still be dropped by a machine this loaded. The gap bound is
            // far below what a pause of the active would cost (the outage lasts a minute, a
            // takeover seconds) and above the machine's own hiccups: on a loaded CI machine
            // every probe target saw 170-200 ms at the moment the standby was killed (its
            // process and interfaces torn down on the same 2 cores), with no probe lost.
            assert!(
                sent - received <= 3 && gap < QUIET_GAP_MS,
                "probes lost: {} of {sent}, longest gap {gap} ms\n{}",
                sent - received,
                fabric.logs()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_clusters_active_cut_off_is_replaced_by_its_standby_and_steps_down_on_return() {
    if !can_run("each_clusters_active_cut_off_is_replaced_by_its_standby_and_steps_down_on_return")
    {
        return;
    }
    // The double NAT, whose connections the peers opened need the handoff (ADR 0023).
    let fabric = replicated_fabric(true).await;
    let pods = Pods::up(&fabric).await;
    let flows = pods.flows("cut", &pods.targets(true));
    tokio::time::sleep(Duration::from_secs(2)).await;
    for cluster in [A, B, C] {
        cut_over(&fabric, cluster, pods.dir.path()).await;
    }

    let summary = flows.stop();
    let broken = report(&summary);
    none_broken(&broken, "connections broken by the cuts", &fabric);
    probes_resumed(&summary, &fabric);
}

/// A packet of a peer's connection that misses its conntrack zone on the way out (seen once
/// in CI: one packet of one connection, on a gateway whose rules were in place) finds no entry
/// in the default zone, starts one there untranslated and, sent into the tunnel like that,
/// reached the peer as a new connection from our pod: the peer's pod answered it with a reset
/// that killed the real connection. Here C's active loses every zone rule for its own side for
/// a few seconds (until its next repair pass puts them back): every reply of C's pod misses its
/// zone, and the tunnel guard must drop them all, so the connections only stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_packet_that_missed_its_conntrack_zone_never_leaves_through_a_tunnel() {
    if !can_run("a_packet_that_missed_its_conntrack_zone_never_leaves_through_a_tunnel") {
        return;
    }
    // Zones exist only under the double NAT.
    let fabric = replicated_fabric(true).await;
    let (active, _) = the_active(&fabric, C, LIMIT).await;
    let ns = fabric.topology.sites[C].nodes[active].netns.clone();
    let pods = Pods::up(&fabric).await;
    let flows = pods.flows("zones", &pods.targets(false));
    tokio::time::sleep(Duration::from_secs(2)).await;

    let removed = remove_destination_zones(&ns);
    assert!(removed > 0, "C's active had no zone rule for its side");
    let started = Instant::now();
    while destination_zones(&ns).is_empty() {
        assert!(
            started.elapsed() < LIMIT,
            "the repair pass never restored the zone rules\n{}",
            fabric.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "measured: C's {removed} zone rules for its own side were missing for {} ms",
        started.elapsed().as_millis()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;

    let summary = flows.stop();
    let broken = report(&summary);
    none_broken(
        &broken,
        "connections broken by packets that missed their zone",
        &fabric,
    );
    probes_resumed(&summary, &fabric);
}

/// The handles of the `pre_raw` rules in `ns` that put our side's packets into a peer's zone
/// (by destination; the tunnels' own rules go by interface).
fn destination_zones(ns: &str) -> Vec<String> {
    let out = trellis_netlab::netns::exec(
        ns,
        "nft",
        &["-a", "list", "chain", "ip", "trellis", "pre_raw"],
    )
    .expect("nft runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("ip daddr") && l.contains("ct zone set") && !l.contains("iifname"))
        .filter_map(|l| l.rsplit("# handle ").next().map(|h| h.trim().to_owned()))
        .collect()
}

/// Removes those rules; how many there were.
fn remove_destination_zones(ns: &str) -> usize {
    let handles = destination_zones(ns);
    for handle in &handles {
        let out = trellis_netlab::netns::exec(
            ns,
            "nft",
            &[
                "delete", "rule", "ip", "trellis", "pre_raw", "handle", handle,
            ],
        )
        .expect("nft runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    handles.len()
}

/// Cuts off the node of `cluster`'s active replica (node 0, the first elected): its node
/// network, its uplink and with them its way to the gateway's store (forwarded into the
/// namespace by this test, so dropped there). The replica on node 1 must take over; once the
/// links are back, the old one must hear it and step down, never taking the role back.
async fn cut_over(fabric: &Fabric, cluster: usize, dir: &std::path::Path) {
    let (old, epoch) = the_active(fabric, cluster, LIMIT).await;
    assert_eq!(old, 0, "the first replica is elected first");
    let n0 = fabric.topology.sites[cluster].nodes[0].netns.clone();
    let store_port = trellis_netlab::NsCluster::etcd_addr(Service::Gateway).port();
    let rules = dir.join("cut.nft");
    std::fs::write(
        &rules,
        format!(
            "table ip trellis-test-cut {{\n  chain out {{\n    type filter hook output \
             priority 0; policy accept;\n    tcp dport {store_port} drop\n    tcp sport \
             {store_port} drop\n  }}\n}}\n"
        ),
    )
    .expect("rules written");
    let cut = Instant::now();
    trellis_netlab::netns::ip(&["-n", &n0, "link", "set", "node", "down"]).expect("node link down");
    fabric
        .topology
        .set_uplink(cluster, false)
        .expect("uplink down");
    let out = trellis_netlab::netns::exec(&n0, "nft", &["-f", &rules.display().to_string()])
        .expect("nft runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let took_over = loop {
        if let Ok(s) = replica_status(fabric, cluster, 1).await
            && s.active
        {
            assert!(s.epoch > epoch, "{s:?}");
            break cut.elapsed();
        }
        assert!(
            cut.elapsed() < TAKEOVER,
            "node 1 never took over\n{}",
            fabric.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!(
        "measured: cluster {cluster}: node 0 cut off; the replica on node 1 said it is active \
         after {} ms",
        took_over.as_millis()
    );
    // Cut off from everything, the old active cannot know; once back it hears the new active
    // (a higher epoch) and steps down, and the new one draws back any peer it touched.
    tokio::time::sleep(Duration::from_secs(3)).await;
    trellis_netlab::netns::ip(&["-n", &n0, "link", "set", "node", "up"]).expect("node link up");
    fabric
        .topology
        .set_uplink(cluster, true)
        .expect("uplink up");
    let out =
        trellis_netlab::netns::exec(&n0, "nft", &["delete", "table", "ip", "trellis-test-cut"])
            .expect("nft runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let back = Instant::now();
    loop {
        if let Ok(s) = replica_status(fabric, cluster, 0).await
            && !s.active
        {
            break;
        }
        assert!(
            back.elapsed() < TAKEOVER,
            "node 0 never stepped down\n{}",
            fabric.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "measured: cluster {cluster}: the returning replica stepped down {} ms after its links \
         came back",
        back.elapsed().as_millis()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (now, now_epoch) = the_active(fabric, cluster, TAKEOVER).await;
    assert_eq!(now, 1, "the returning replica must not take the role back");
    assert!(now_epoch > epoch);
}

/// The pods the flows run between: a flows server on the pod of node 2 of B and of C, the
/// client on the pod of A's node 2, which reaches both.
struct Pods {
    dir: tempfile::TempDir,
    script: std::path::PathBuf,
    _servers: [PodProcess; 2],
    client_ns: String,
    to_b: Ipv4Addr,
    to_c: Ipv4Addr,
}

impl Pods {
    async fn up(fabric: &Fabric) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("flows.py");
        std::fs::write(&script, FLOWS).expect("script written");
        let (b2, c2, a2) = (
            fabric.topology.sites[B].nodes[2].clone(),
            fabric.topology.sites[C].nodes[2].clone(),
            fabric.topology.sites[A].nodes[2].clone(),
        );
        let servers =
            [&b2, &c2].map(|n| python_in(&n.pod_ns, &script, &["serve".into(), PORT.to_string()]));
        let to_b = address(fabric, A, B, b2.pod_ip).await;
        let to_c = address(fabric, A, C, c2.pod_ip).await;
        for to in [to_b, to_c] {
            let started = Instant::now();
            while !trellis_netlab::netns::exec(
                &a2.pod_ns,
                "ping",
                &["-n", "-c", "1", "-W", "1", &to.to_string()],
            )
            .expect("ping runs")
            .status
            .success()
            {
                assert!(
                    started.elapsed() < LIMIT,
                    "A/n2 never reached {to}\n{}",
                    fabric.logs()
                );
            }
        }
        // The servers listen by now (they started before the pings answered).
        Self {
            dir,
            script,
            _servers: servers,
            client_ns: a2.pod_ns,
            to_b,
            to_c,
        }
    }

    /// Echoed TCP connections and a probe to both pods; with `push`, also connections on
    /// which only the server speaks (after a switch on the server's side, the side that did
    /// not open them speaks first: without the handoff, ADR 0023, every one is reset).
    fn targets(&self, push: bool) -> Vec<String> {
        let mut targets = Vec::new();
        for to in [self.to_b, self.to_c] {
            targets.push(format!("tcp:{to}:{PORT}:{CONNECTIONS}"));
            targets.push(format!("udp:{to}:{PORT}"));
            if push {
                targets.push(format!("push:{to}:{PORT}:{PUSHED}"));
            }
        }
        targets
    }

    fn flows(&self, name: &str, targets: &[String]) -> Flows {
        Flows::start(
            &self.client_ns,
            &self.script,
            self.dir.path(),
            name,
            targets,
        )
    }
}

/// The flows script running in a pod, until [`Flows::stop`].
struct Flows(failover::Flows);

impl Flows {
    fn start(
        ns: &str,
        script: &std::path::Path,
        dir: &std::path::Path,
        name: &str,
        targets: &[String],
    ) -> Self {
        Self(failover::Flows::start(ns, script, dir, name, targets).expect("flows start"))
    }

    /// Stops the flows; their summary.
    fn stop(self) -> serde_json::Value {
        self.0.stop().expect("the flows' summary")
    }
}

/// Prints what the flows measured; the broken connections.
fn report(summary: &serde_json::Value) -> Vec<String> {
    let mut broken = Vec::new();
    for target in summary.as_array().expect("targets") {
        eprintln!(
            "measured: {} longest gap {:.0} ms ({})",
            target["target"],
            target["max_gap_ms"].as_f64().unwrap_or(-1.0),
            if target["connections"].is_null() {
                format!(
                    "{} of {} probes answered",
                    target["received"], target["sent"]
                )
            } else {
                format!(
                    "{} connections, {} echoes",
                    target["connections"], target["echoes"]
                )
            }
        );
        if let Some(gaps) = target["gaps"].as_array() {
            eprintln!("  gaps over 100 ms [s since start, ms]: {gaps:?}");
        }
        for b in target["broken"].as_array().into_iter().flatten() {
            broken.push(format!("{}: {b}", target["target"]));
        }
        let answered = target["echoes"]
            .as_u64()
            .or(target["received"].as_u64())
            .unwrap_or(0);
        assert!(answered > 0, "nothing came back from {}", target["target"]);
    }
    broken
}

/// Kills `cluster`'s active replica: the standby must take over under a new epoch, every node
/// and tunnel follow it, and the killed replica comes back as a standby (no pre-emption).
async fn fail_over(fabric: &mut Fabric, cluster: usize) {
    let (old, epoch) = the_active(fabric, cluster, LIMIT).await;
    let killed = Instant::now();
    let kill_time = std::time::SystemTime::now();
    fabric.clusters[cluster]
        .gateway_replica_mut(old)
        .expect("replica")
        .kill9();
    let (new, new_epoch) = the_active(fabric, cluster, TAKEOVER).await;
    eprintln!(
        "measured: cluster {cluster}: the replica on node {new} said it is active {} ms after \
         the kill of node {old}'s (epoch {epoch} -> {new_epoch})",
        killed.elapsed().as_millis()
    );
    assert_ne!(new, old, "the killed replica cannot be the active");
    assert!(new_epoch > epoch, "a takeover is a new epoch");
    let (nodes, handshakes) = follow_up(fabric, cluster, new, killed, kill_time).await;
    eprintln!(
        "measured: cluster {cluster}: every node followed the new active after {nodes} ms, \
         every tunnel of the new active handshook after {handshakes} ms"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    fabric.clusters[cluster]
        .gateway_replica_mut(old)
        .expect("replica")
        .restart()
        .await
        .expect("the killed replica restarts");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        the_active(fabric, cluster, TAKEOVER).await,
        (new, new_epoch),
        "a returning replica must not pre-empt a healthy active"
    );
    let back = replica_status(fabric, cluster, old).await.expect("status");
    assert!(!back.active && back.epoch == new_epoch, "{back:?}");
}
