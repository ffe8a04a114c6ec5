//! The chaos run (issue 20): one hub and ten leaves, every cluster six real service processes
//! (IPAM, gateway, discovery, forwarder, broker, endpoints), each on its own real etcd. Two
//! rounds of faults, drawn from a printed seed (`TRELLIS_CHAOS_SEED=<n>` replays the same plan;
//! how the processes interleave with it still varies):
//!
//! 1. during the peering storm: the ten leaves peer with the hub at once, each leaf's operator
//!    re-running `Peer` until it succeeds (it is idempotent);
//! 2. after the mesh has converged.
//!
//! Each round injects, in a random order with random pauses between them:
//! - kill -9 of every kind of Trellis process, once on the hub and once on a random leaf, each
//!   restarted after a random delay of up to 1.5 s (after its etcd, when that is down too);
//! - kill -9 of the etcds behind the hub's broker and the hub's forwarder, of one other random
//!   hub service's and of one random leaf service's, each restarted on its data after 1 to 4 s;
//! - a random leaf cut from the hub for 20 s, and only from the hub: nftables drops every packet
//!   a process of either cluster sends to a port of the other (both directions, told apart by
//!   the group ID each cluster's processes run with, see `trellis_integration::cut`), while the
//!   leaf still reaches the other leaves and they it.
//!
//! A service that exits on its own (its etcd gone) is restarted, as a kubelet would, and
//! counted. After each round the mesh must converge (the same twice, 3 s apart) to exactly:
//! - the expected TunnelEndpoints, no duplicate: hub↔leaf full, leaf↔leaf induced, nothing else;
//! - both ends of every tunnel agreeing on the NAT views;
//! - in every IPAM one mapping per peer and none of anything else;
//! - in every broker one NetworkConfig each way per peer, processed at its current generation,
//!   and no other;
//! - no relay left at the hub.
//!
//! After round 2 nothing is lost: every tunnel, with its NAT views and public key, is the one
//! from before the round. Every fault is counted; counts and convergence times are printed as
//! "measured:" lines (recorded in bench/notes/outro.md). Needs etcd, root and `nft`: skipped
//! loudly without them, except in CI, which runs as root with both.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{ListNetworkConfigsRequest, ListRelaysRequest, PeerRequest};
use trellis_api::pb::types::NetworkConfigState;
use trellis_integration::cut::Cut;
use trellis_integration::join_all;
use trellis_integration::peering::{expected_hub_mesh, nat_views_agree, remote_id, token};
use trellis_integration::processes::{Options, ProcessCluster, Service};
use trellis_integration::rng::Rng;
use trellis_testkit::{in_ci, require_tool};

const HUB: &str = "hub";
const LEAVES: [&str; 10] = [
    "leaf-1", "leaf-2", "leaf-3", "leaf-4", "leaf-5", "leaf-6", "leaf-7", "leaf-8", "leaf-9",
    "leaf-10",
];
/// Generous: a deadline for convergence (and for the storm's peerings), not a performance
/// assertion. Well under nextest's limit for this test (480 s in .config/nextest.toml), so that
/// a mesh that does not converge fails with what is still wrong rather than a bare timeout.
const CONVERGE: Duration = Duration::from_secs(200);
/// How long a leaf stays cut from the hub.
const CUT: Duration = Duration::from_secs(20);
/// Group IDs of the clusters' processes: the hub's, then one per leaf.
const GID_BASE: u32 = 47_100;
/// How many clusters start at once (each starts six etcds and six processes; two cores).
const STARTING_AT_ONCE: usize = 3;

fn ms(n: usize) -> Duration {
    Duration::from_millis(n as u64)
}

/// One fault; clusters by index in the mesh (0 is the hub).
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// kill -9 of a service process.
    Kill(usize, Service),
    /// kill -9 of the etcd behind a service.
    KillEtcd(usize, Service),
    /// A leaf cut from the hub.
    Cut(usize),
}

/// What undoes a fault, when it is due.
#[derive(Debug)]
enum Repair {
    Restart(usize, Service),
    RestartEtcd(usize, Service),
    Heal(usize, Cut),
}

/// Faults injected, by kind.
#[derive(Debug, Default, Clone)]
struct Faults {
    /// kill -9 of Trellis processes, by service.
    kills: BTreeMap<Service, usize>,
    hub_kills: usize,
    leaf_kills: usize,
    /// kill -9 of etcds, by `(hub or leaf, service)`.
    etcd_kills: BTreeMap<(&'static str, Service), usize>,
    /// Leaves cut from the hub for [`CUT`].
    cuts: usize,
    /// Processes that exited on their own (their etcd gone) and were restarted.
    exits: usize,
}

impl Faults {
    fn total(&self) -> usize {
        self.hub_kills + self.leaf_kills + self.etcd_kills.values().sum::<usize>() + self.cuts
    }

    fn add(&mut self, other: &Faults) {
        for (k, n) in &other.kills {
            *self.kills.entry(*k).or_default() += n;
        }
        for (k, n) in &other.etcd_kills {
            *self.etcd_kills.entry(*k).or_default() += n;
        }
        self.hub_kills += other.hub_kills;
        self.leaf_kills += other.leaf_kills;
        self.cuts += other.cuts;
        self.exits += other.exits;
    }
}

impl fmt::Display for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kills: Vec<String> = self.kills.iter().map(|(s, n)| format!("{s} {n}")).collect();
        let etcds: Vec<String> = self
            .etcd_kills
            .iter()
            .map(|((at, s), n)| format!("{at} {s} {n}"))
            .collect();
        write!(
            f,
            "{} faults: {} process kills ({}; hub {}, leaves {}), {} etcd kills ({}), {} cuts of \
             a leaf from the hub ({} s each); {} processes exited on their own and were restarted",
            self.total(),
            self.hub_kills + self.leaf_kills,
            kills.join(", "),
            self.hub_kills,
            self.leaf_kills,
            self.etcd_kills.values().sum::<usize>(),
            etcds.join(", "),
            self.cuts,
            CUT.as_secs(),
            self.exits
        )
    }
}

/// A round's faults, in a random order: every kind of process killed on the hub and on a
/// random leaf; the hub's broker and forwarder etcds, one other hub service's etcd and a random
/// leaf service's etcd killed; a random leaf cut from the hub.
fn plan(rng: &mut Rng) -> Vec<Fault> {
    let leaf = |rng: &mut Rng| 1 + rng.below(LEAVES.len());
    let mut plan = Vec::new();
    for service in Service::ALL {
        plan.push(Fault::Kill(0, service));
        plan.push(Fault::Kill(leaf(rng), service));
    }
    plan.push(Fault::KillEtcd(0, Service::Broker));
    plan.push(Fault::KillEtcd(0, Service::Forwarder));
    let others = [
        Service::Ipam,
        Service::Gateway,
        Service::Discovery,
        Service::Endpoints,
    ];
    plan.push(Fault::KillEtcd(0, others[rng.below(others.len())]));
    let service = Service::ALL[rng.below(Service::ALL.len())];
    plan.push(Fault::KillEtcd(leaf(rng), service));
    plan.push(Fault::Cut(leaf(rng)));
    rng.shuffle(&mut plan);
    plan
}

/// The round's log: what happened when, for the failure message.
struct Log {
    started: Instant,
    lines: Vec<String>,
}

impl Log {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            lines: Vec::new(),
        }
    }

    fn push(&mut self, what: String) {
        let line = format!("{:>6} ms {what}", self.started.elapsed().as_millis());
        eprintln!("chaos: {line}");
        self.lines.push(line);
    }
}

/// Injects `plan` with random pauses, repairing each fault when due; returns once everything
/// is repaired.
async fn inject(
    all: &mut [ProcessCluster],
    plan: &[Fault],
    rng: &mut Rng,
    log: &mut Log,
) -> Faults {
    let mut faults = Faults::default();
    let mut repairs: Vec<(Instant, Repair)> = Vec::new();
    for &fault in plan {
        repair_due(all, &mut repairs, &mut faults, log).await;
        let now = Instant::now();
        match fault {
            Fault::Kill(i, service) => {
                all[i].kill9(service).expect("kills a process");
                *faults.kills.entry(service).or_default() += 1;
                if i == 0 {
                    faults.hub_kills += 1;
                } else {
                    faults.leaf_kills += 1;
                }
                log.push(format!("kill -9 {}'s {service}", all[i].id));
                repairs.push((now + ms(rng.below(1500)), Repair::Restart(i, service)));
            }
            Fault::KillEtcd(i, service) => {
                all[i].kill9_etcd(service).expect("kills an etcd");
                let at = if i == 0 { "hub" } else { "leaf" };
                *faults.etcd_kills.entry((at, service)).or_default() += 1;
                log.push(format!("kill -9 the etcd of {}'s {service}", all[i].id));
                repairs.push((
                    now + ms(1000 + rng.below(3000)),
                    Repair::RestartEtcd(i, service),
                ));
            }
            Fault::Cut(leaf) => {
                let cut = all[leaf]
                    .cut_from(&all[0])
                    .expect("cuts a leaf from the hub");
                faults.cuts += 1;
                log.push(format!("cut {} from the hub", all[leaf].id));
                repairs.push((now + CUT, Repair::Heal(leaf, cut)));
            }
        }
        tokio::time::sleep(ms(100 + rng.below(900))).await;
    }
    while let Some(next) = repairs.iter().map(|(at, _)| *at).min() {
        tokio::time::sleep_until(next.into()).await;
        repair_due(all, &mut repairs, &mut faults, log).await;
    }
    faults
}

/// Performs every repair that is due, earliest first.
async fn repair_due(
    all: &mut [ProcessCluster],
    repairs: &mut Vec<(Instant, Repair)>,
    faults: &mut Faults,
    log: &mut Log,
) {
    loop {
        let now = Instant::now();
        let Some(k) = (0..repairs.len())
            .filter(|&k| repairs[k].0 <= now)
            .min_by_key(|&k| repairs[k].0)
        else {
            return;
        };
        let (_, repair) = repairs.swap_remove(k);
        match repair {
            Repair::Restart(i, service) => {
                // A kubelet would restart it into a crash loop until its store is back: start
                // it once the store is.
                let etcd_back = repairs.iter().find_map(|(at, r)| {
                    matches!(r, Repair::RestartEtcd(j, s) if *j == i && *s == service)
                        .then_some(*at)
                });
                if let Some(at) = etcd_back {
                    repairs.push((at + ms(10), Repair::Restart(i, service)));
                    continue;
                }
                all[i].restart(service).await.expect("restarts a process");
                log.push(format!("restarted {}'s {service}", all[i].id));
            }
            Repair::RestartEtcd(i, service) => {
                all[i].restart_etcd(service).expect("restarts an etcd");
                log.push(format!("restarted the etcd of {}'s {service}", all[i].id));
                let killed = repairs
                    .iter()
                    .any(|(_, r)| matches!(r, Repair::Restart(j, s) if *j == i && *s == service));
                if !killed && all[i].exited(service) {
                    all[i].restart(service).await.expect("restarts a process");
                    faults.exits += 1;
                    log.push(format!(
                        "{}'s {service} had exited without its etcd, restarted it",
                        all[i].id
                    ));
                }
            }
            Repair::Heal(leaf, cut) => {
                drop(cut);
                log.push(format!("healed the cut of {} from the hub", all[leaf].id));
            }
        }
    }
}

/// Restarts every service that exited on its own, as a kubelet would.
async fn revive(all: &mut [ProcessCluster], faults: &mut Faults, log: &mut Log) {
    for cluster in all.iter_mut() {
        for service in Service::ALL {
            if cluster.exited(service) {
                cluster.restart(service).await.expect("restarts a process");
                faults.exits += 1;
                log.push(format!(
                    "{}'s {service} had exited, restarted it",
                    cluster.id
                ));
            }
        }
    }
}

/// What must survive the faults: per holder, each tunnel's remote, kind, NAT views and key.
type Snapshot = BTreeSet<(String, String, i32, [String; 4], String)>;

async fn snapshot(all: &[ProcessCluster]) -> Snapshot {
    let mut out = Snapshot::new();
    for cluster in all {
        for t in cluster.tunnel_endpoints().await {
            out.insert((
                cluster.id.clone(),
                remote_id(&t),
                t.kind,
                [
                    t.local_pod_cidr_nat.clone(),
                    t.remote_pod_cidr_nat.clone(),
                    t.local_external_cidr_nat.clone(),
                    t.remote_external_cidr_nat.clone(),
                ],
                t.remote_public_key.clone(),
            ));
        }
    }
    out
}

/// Everything wrong with the mesh now (empty: exactly the expected mesh).
async fn violations(all: &[ProcessCluster]) -> Vec<String> {
    let mut wrong = Vec::new();
    let mut held = Vec::new();
    for cluster in all {
        held.push((cluster.id.clone(), cluster.tunnel_endpoints().await));
    }
    for (holder, ts) in &held {
        let expected = expected_hub_mesh(HUB, &LEAVES, holder);
        let seen: Vec<(String, i32)> = ts.iter().map(|t| (remote_id(t), t.kind)).collect();
        let unique: BTreeSet<(String, i32)> = seen.iter().cloned().collect();
        if unique.len() != seen.len() {
            wrong.push(format!("{holder} holds duplicate tunnels: {seen:?}"));
        }
        if unique != expected {
            wrong.push(format!("{holder} holds {unique:?}, expected {expected:?}"));
        }
        for t in ts {
            let other = remote_id(t);
            let back = held
                .iter()
                .find(|(id, _)| *id == other)
                .and_then(|(_, theirs)| theirs.iter().find(|b| remote_id(b) == *holder));
            match back {
                None => wrong.push(format!("{holder} has a tunnel to {other}, not back")),
                Some(back) if !nat_views_agree(t, back) => {
                    wrong.push(format!("{holder}<->{other}: NAT views disagree"));
                }
                Some(_) => {}
            }
        }
    }
    for cluster in all {
        let peers: BTreeSet<String> = expected_hub_mesh(HUB, &LEAVES, &cluster.id)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        ipam_violations(cluster, &peers, &mut wrong).await;
        network_config_violations(cluster, &peers, &mut wrong).await;
    }
    match all[0].forwarder().await {
        Ok(mut f) => match f.list_relays(ListRelaysRequest::default()).await {
            Ok(r) if r.get_ref().relays.is_empty() => {}
            Ok(r) => wrong.push(format!(
                "the hub still holds {} relays",
                r.into_inner().relays.len()
            )),
            Err(e) => wrong.push(format!("the hub's relays: {e}")),
        },
        Err(e) => wrong.push(format!("the hub's forwarder: {e}")),
    }
    wrong
}

/// One IPAM mapping per peer, none of anything else.
async fn ipam_violations(
    cluster: &ProcessCluster,
    peers: &BTreeSet<String>,
    wrong: &mut Vec<String>,
) {
    let id = &cluster.id;
    let mapped: Vec<String> = match cluster.ipam().await {
        Ok(mut ipam) => match ipam
            .list_cluster_subnets(ListClusterSubnetsRequest {})
            .await
        {
            Ok(r) => r
                .into_inner()
                .clusters
                .into_iter()
                .map(|m| m.cluster_id)
                .collect(),
            Err(e) => return wrong.push(format!("{id}: IPAM mappings: {e}")),
        },
        Err(e) => return wrong.push(format!("{id}: IPAM unreachable: {e}")),
    };
    let unique: BTreeSet<String> = mapped.iter().cloned().collect();
    if unique.len() != mapped.len() {
        wrong.push(format!("{id}: duplicate IPAM mappings {mapped:?}"));
    }
    if unique != *peers {
        wrong.push(format!(
            "{id}: IPAM maps {unique:?}, its peers are {peers:?}"
        ));
    }
}

/// One NetworkConfig each way per peer, processed at its generation; no other.
async fn network_config_violations(
    cluster: &ProcessCluster,
    peers: &BTreeSet<String>,
    wrong: &mut Vec<String>,
) {
    let id = &cluster.id;
    let configs = match cluster.broker().await {
        Ok(mut b) => match b
            .list_network_configs(ListNetworkConfigsRequest::default())
            .await
        {
            Ok(r) => r.into_inner().network_configs,
            Err(e) => return wrong.push(format!("{id}: NetworkConfigs: {e}")),
        },
        Err(e) => return wrong.push(format!("{id}: broker unreachable: {e}")),
    };
    let name = |c: &Option<trellis_api::pb::types::ClusterIdentity>| {
        c.as_ref().map(|c| c.cluster_id.clone()).unwrap_or_default()
    };
    let pairs: Vec<(String, String)> = configs
        .iter()
        .map(|c| (name(&c.origin), name(&c.destination)))
        .collect();
    let unique: BTreeSet<(String, String)> = pairs.iter().cloned().collect();
    if unique.len() != pairs.len() {
        wrong.push(format!("{id}: duplicate NetworkConfigs {pairs:?}"));
    }
    let expected: BTreeSet<(String, String)> = peers
        .iter()
        .flat_map(|p| [(id.clone(), p.clone()), (p.clone(), id.clone())])
        .collect();
    if unique != expected {
        wrong.push(format!(
            "{id}: NetworkConfigs {:?} missing, {:?} extra",
            expected.difference(&unique).collect::<Vec<_>>(),
            unique.difference(&expected).collect::<Vec<_>>()
        ));
    }
    for c in &configs {
        let processed = c.status.as_ref().is_some_and(|s| {
            s.state == NetworkConfigState::Processed as i32 && s.observed_generation == c.generation
        });
        if !processed {
            wrong.push(format!(
                "{id}: NetworkConfig {} not processed at generation {}: {:?}",
                c.name, c.generation, c.status
            ));
        }
    }
}

/// Waits until the mesh is exactly as expected (twice, 3 s apart), restarting services that
/// exited; returns how long that took.
async fn converge(
    all: &mut [ProcessCluster],
    faults: &mut Faults,
    seed: u64,
    what: &str,
    log: &mut Log,
) -> Duration {
    let started = Instant::now();
    loop {
        revive(all, faults, log).await;
        let mut wrong = violations(all).await;
        if wrong.is_empty() {
            tokio::time::sleep(Duration::from_secs(3)).await;
            wrong = violations(all).await;
        }
        if wrong.is_empty() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < CONVERGE,
            "seed {seed}, {what}: still wrong after {CONVERGE:?}:\n{}\nfaults:\n{}\n{}",
            wrong.join("\n"),
            log.lines.join("\n"),
            all.iter()
                .map(|c| c.logs(12))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What a leaf's operator does: `Peer` with the hub until it succeeds; returns how many calls
/// it took and when the last one succeeded.
async fn peer_until_done(
    id: String,
    broker: std::net::SocketAddr,
    hub_broker: std::net::SocketAddr,
    token: String,
) -> (usize, Duration) {
    let started = Instant::now();
    let deadline = started + CONVERGE;
    let mut tries = 0;
    loop {
        tries += 1;
        let answer = async {
            let channel = tonic::transport::Channel::from_shared(format!("http://{broker}"))
                .map_err(|e| tonic::Status::internal(e.to_string()))?
                .connect()
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
            BrokerClient::new(channel)
                .peer(PeerRequest {
                    broker_address: hub_broker.to_string(),
                    token: token.clone(),
                    expected_cluster_id: HUB.to_owned(),
                    ca_cert_hash: String::new(),
                })
                .await
        };
        // A call that never answers is a failure too, not a reason to wait forever.
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, answer).await {
            Ok(Ok(_)) => return (tries, started.elapsed()),
            Ok(Err(err)) => {
                assert!(Instant::now() < deadline, "{id} never peered: {err:?}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(_) => panic!("{id}: Peer did not answer within {CONVERGE:?}"),
        }
    }
}

/// Every running process of cluster `i` runs with the cluster's group ID, or a cut would cut
/// nothing.
fn check_gids(all: &[ProcessCluster]) {
    for (i, cluster) in all.iter().enumerate() {
        let gid = (GID_BASE + i as u32).to_string();
        for service in Service::ALL {
            let Some(pid) = cluster.process(service).ok().and_then(|p| p.pid()) else {
                continue;
            };
            let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .expect("reads the process's status");
            let gids: Vec<&str> = status
                .lines()
                .find_map(|l| l.strip_prefix("Gid:"))
                .expect("a Gid line")
                .split_whitespace()
                .collect();
            assert_eq!(gids, [gid.as_str(); 4], "{}'s {service}", cluster.id);
        }
    }
}

/// Root and `nft` for the cuts; `false` (skipped loudly) without them outside CI.
fn can_cut() -> bool {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("chaos");
    if !trellis_netlab::netns::is_root() {
        assert!(!in_ci(), "{test} needs root, and CI runs as root");
        eprintln!("SKIPPED: {test}: needs root (nftables cuts a leaf from the hub)");
        return false;
    }
    require_tool("nft").is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn faults_during_a_ten_leaf_peering_storm_and_after_it_end_in_the_exact_mesh() {
    if !can_cut() {
        return;
    }
    let (seed, mut rng) = Rng::from_env();
    let started = Instant::now();
    let options = |i: usize| Options {
        gid: Some(GID_BASE + i as u32),
        ..Options::default()
    };
    let Some(hub) = ProcessCluster::start_with(HUB, "10.0.0.0/16", "10.201.0.0/16", options(0))
        .await
        .expect("the hub starts")
    else {
        return;
    };
    let mut all = vec![hub];
    let leaves: Vec<(usize, &str)> = LEAVES.iter().copied().enumerate().collect();
    for batch in leaves.chunks(STARTING_AT_ONCE) {
        let starting: Vec<_> = batch
            .iter()
            .map(|&(i, id)| {
                let (id, options) = (id.to_owned(), options(i + 1));
                let external = format!("10.{}.0.0/16", 202 + i);
                tokio::spawn(async move {
                    ProcessCluster::start_with(&id, "10.0.0.0/16", &external, options).await
                })
            })
            .collect();
        for leaf in join_all(starting).await {
            all.push(leaf.expect("a leaf starts").expect("etcd is there"));
        }
    }
    let start_time = started.elapsed();
    check_gids(&all);
    let hub_token = token(&all[0]).await;
    let mut total = Faults::default();

    // Round 1: the storm, with the faults.
    let mut log = Log::new();
    let plan1 = plan(&mut rng);
    eprintln!("round 1 plan: {plan1:?}");
    let hub_broker = all[0].addr(Service::Broker);
    let storm: Vec<_> = all[1..]
        .iter()
        .map(|leaf| {
            let (id, broker) = (leaf.id.clone(), leaf.addr(Service::Broker));
            tokio::spawn(peer_until_done(id, broker, hub_broker, hub_token.clone()))
        })
        .collect();
    let mut faults = inject(&mut all, &plan1, &mut rng, &mut log).await;
    let repaired = log.started.elapsed();
    let peerings: Vec<(usize, Duration)> = join_all(storm).await;
    let calls: usize = peerings.iter().map(|(n, _)| n).sum();
    let (last, (last_calls, last_took)) = LEAVES
        .iter()
        .zip(&peerings)
        .max_by_key(|(_, (_, took))| *took)
        .expect("ten leaves");
    let first = converge(&mut all, &mut faults, seed, "round 1 (the storm)", &mut log).await;
    eprintln!(
        "measured: round 1 (peering storm of {} leaves): {faults}; {calls} Peer calls, the last \
         leaf to peer {last} after {} ms and {last_calls} calls; converged {} ms after the \
         peerings started, {} ms after the last repair",
        LEAVES.len(),
        last_took.as_millis(),
        (repaired + first).as_millis(),
        first.as_millis()
    );
    total.add(&faults);
    check_gids(&all);
    let before = snapshot(&all).await;
    assert_eq!(
        before.len(),
        LEAVES.len() * 2 + LEAVES.len() * (LEAVES.len() - 1),
        "every tunnel is there: {before:?}"
    );

    // Round 2: the same kinds of faults on the converged mesh; nothing may be lost.
    let mut log = Log::new();
    let plan2 = plan(&mut rng);
    eprintln!("round 2 plan: {plan2:?}");
    let mut faults = inject(&mut all, &plan2, &mut rng, &mut log).await;
    let repaired = log.started.elapsed();
    let second = converge(
        &mut all,
        &mut faults,
        seed,
        "round 2 (after convergence)",
        &mut log,
    )
    .await;
    let after = snapshot(&all).await;
    assert_eq!(
        after, before,
        "seed {seed}: nothing lost or changed: tunnels, NAT views and keys"
    );
    eprintln!(
        "measured: round 2 (converged mesh): {faults}; consistent again {} ms after the last \
         repair ({} ms after its first fault); {} tunnels, NAT views and keys as before",
        second.as_millis(),
        (repaired + second).as_millis(),
        after.len()
    );
    total.add(&faults);
    check_gids(&all);
    eprintln!(
        "measured: chaos run, seed {seed}: {total}; {} clusters started in {} ms; whole test {} ms",
        all.len(),
        start_time.as_millis(),
        started.elapsed().as_millis()
    );
}
