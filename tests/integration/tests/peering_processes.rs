//! Induced peering with the real binaries, each service on its own real etcd (as in
//! production): hub B peers with leaves A and C, all three with the same pod and
//! external CIDRs; A and C end with induced TunnelEndpoints for each other (relayed by B's
//! forwarder), B with full ones for both, and the NAT views agree on both ends of every tunnel.
//! The fault tests SIGKILL, during the induced exchange, B's forwarder and C's broker, then a
//! leaf's discovery and the IPAMs of a leaf and of the hub, and check that the mesh still
//! completes with the same result: every TunnelEndpoint, NAT views agreeing on both ends, one
//! IPAM mapping per remote, no duplicated NetworkConfigs, no relay left on the hub.
//!
//! Needs etcd (and etcdctl) and the service binaries (`cargo build --workspace --bins`, which
//! `make test` does first); skips loudly without etcd (fails in CI).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::time::Duration;

use ipnet::IpNet;
use trellis_api::pb::discovery::ListForeignClustersRequest;
use trellis_api::pb::ipam::{ClusterSubnets, ListClusterSubnetsRequest};
use trellis_api::pb::peering::*;
use trellis_api::pb::types::{self as types, PeeringKind, TunnelEndpoint};
use trellis_integration::peering::{self, peer};
use trellis_integration::processes::{ProcessCluster, Service};

const POD_CIDR: &str = "10.0.0.0/16";
const EXTERNAL_CIDR: &str = "10.201.0.0/16";
const HUB: &str = "hub-b";
const LEAF_A: &str = "leaf-a";
const LEAF_C: &str = "leaf-c";
/// Generous: 15 processes and 15 etcds share two cores with the other test.
const LIMIT: Duration = Duration::from_secs(60);

/// Hub B and leaves A and C, all real processes.
struct Mesh {
    b: ProcessCluster,
    a: ProcessCluster,
    c: ProcessCluster,
}

impl Mesh {
    /// Starts the three clusters; `None` when etcd is missing (the test is skipped).
    async fn start() -> Option<Self> {
        // One loud skip for the whole mesh (each cluster would announce its own otherwise).
        trellis_testkit::require_tool("etcd")?;
        let (b, a, c) = tokio::join!(
            ProcessCluster::start(HUB, POD_CIDR, EXTERNAL_CIDR),
            ProcessCluster::start(LEAF_A, POD_CIDR, EXTERNAL_CIDR),
            ProcessCluster::start(LEAF_C, POD_CIDR, EXTERNAL_CIDR),
        );
        Some(Self {
            b: b.expect("b starts")?,
            a: a.expect("a starts")?,
            c: c.expect("c starts")?,
        })
    }

    fn all(&self) -> [&ProcessCluster; 3] {
        [&self.a, &self.b, &self.c]
    }

    fn logs(&self) -> String {
        self.all()
            .iter()
            .map(|cluster| cluster.logs(25))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Polls `check` until it yields a value or [`LIMIT`] passes; on timeout fails with the
    /// last observation (`Err`) and the services' log tails.
    async fn eventually<T, F, Fut>(&self, what: &str, check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, String>>,
    {
        trellis_testkit::within(what, LIMIT, check)
            .await
            .unwrap_or_else(|timed_out| panic!("{timed_out}\n{}", self.logs()))
    }
}

async fn tunnels(cluster: &ProcessCluster) -> Result<Vec<TunnelEndpoint>, String> {
    peering::tunnels(cluster)
        .await
        .map_err(|e| format!("{}: {e:#}", cluster.id))
}

fn remote_of(t: &TunnelEndpoint) -> &str {
    t.remote.as_ref().map_or("", |r| r.cluster_id.as_str())
}

async fn relays(hub: &ProcessCluster) -> Result<Vec<RelayRecord>, String> {
    let mut forwarder = hub.forwarder().await.map_err(|e| format!("{e:#}"))?;
    Ok(forwarder
        .list_relays(ListRelaysRequest::default())
        .await
        .map_err(|e| e.to_string())?
        .into_inner()
        .relays)
}

async fn cluster_subnets(cluster: &ProcessCluster) -> Result<Vec<ClusterSubnets>, String> {
    let mut ipam = cluster.ipam().await.map_err(|e| format!("{e:#}"))?;
    Ok(ipam
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .map_err(|e| e.to_string())?
        .into_inner()
        .clusters)
}

async fn network_configs(cluster: &ProcessCluster) -> Result<Vec<types::NetworkConfig>, String> {
    let mut broker = cluster.broker().await.map_err(|e| format!("{e:#}"))?;
    Ok(broker
        .list_network_configs(ListNetworkConfigsRequest::default())
        .await
        .map_err(|e| e.to_string())?
        .into_inner()
        .network_configs)
}

/// The TunnelEndpoints of the whole mesh, by (local, remote).
type Tunnels = BTreeMap<(String, String), TunnelEndpoint>;

/// Waits until every cluster holds a TunnelEndpoint for each of the two others and the hub's
/// forwarder holds no relay any more (every exchange acknowledged), then returns the tunnels.
async fn converged(mesh: &Mesh) -> Tunnels {
    let expected: BTreeSet<(String, String)> = [
        (LEAF_A, HUB),
        (LEAF_A, LEAF_C),
        (HUB, LEAF_A),
        (HUB, LEAF_C),
        (LEAF_C, HUB),
        (LEAF_C, LEAF_A),
    ]
    .into_iter()
    .map(|(l, r)| (l.to_owned(), r.to_owned()))
    .collect();
    mesh.eventually("the full mesh of TunnelEndpoints", || async {
        let mut all = Tunnels::new();
        for cluster in mesh.all() {
            for t in tunnels(cluster).await? {
                all.insert((cluster.id.clone(), remote_of(&t).to_owned()), t);
            }
        }
        let have: BTreeSet<_> = all.keys().cloned().collect();
        if have == expected {
            Ok(())
        } else {
            Err(format!("tunnels {have:?}"))
        }
    })
    .await;
    mesh.eventually("the hub's relays to drain", || async {
        let relays = relays(&mesh.b).await?;
        if relays.is_empty() {
            Ok(())
        } else {
            Err(format!("relays {relays:?}"))
        }
    })
    .await;
    // A drained relay means the destination answered; the answer reaches the sender's broker
    // a moment later (its status on the sender's NetworkConfig).
    mesh.eventually(
        "every NetworkConfig's decision to reach its sender",
        || async {
            for cluster in mesh.all() {
                for nc in network_configs(cluster).await? {
                    if nc.status.as_ref().map(|s| s.state)
                        != Some(types::NetworkConfigState::Processed as i32)
                    {
                        return Err(format!("{}: {} not processed yet", cluster.id, nc.name));
                    }
                }
            }
            Ok(())
        },
    )
    .await;
    // A snapshot taken after every exchange completed.
    let mut all = Tunnels::new();
    for cluster in mesh.all() {
        for t in tunnels(cluster).await.expect("lists tunnels") {
            all.insert((cluster.id.clone(), remote_of(&t).to_owned()), t);
        }
    }
    all
}

fn tunnel<'t>(all: &'t Tunnels, local: &str, remote: &str) -> &'t TunnelEndpoint {
    all.get(&(local.to_owned(), remote.to_owned()))
        .unwrap_or_else(|| panic!("{local} has no tunnel to {remote}: {all:#?}"))
}

fn net(cidr: &str) -> IpNet {
    cidr.parse()
        .unwrap_or_else(|e| panic!("{cidr:?} is not a CIDR: {e}"))
}

/// The mesh's tunnels have the right kinds and agree on both ends of each link; identical real
/// CIDRs are remapped.
fn assert_consistent(all: &Tunnels) {
    for (local, remote, kind) in [
        (LEAF_A, HUB, PeeringKind::Full),
        (HUB, LEAF_A, PeeringKind::Full),
        (LEAF_C, HUB, PeeringKind::Full),
        (HUB, LEAF_C, PeeringKind::Full),
        (LEAF_A, LEAF_C, PeeringKind::Induced),
        (LEAF_C, LEAF_A, PeeringKind::Induced),
    ] {
        let here = tunnel(all, local, remote);
        let there = tunnel(all, remote, local);
        assert_eq!(here.kind, kind as i32, "{local}→{remote}: {here:?}");
        let via = here.via.as_ref().map(|v| v.cluster_id.as_str());
        match kind {
            PeeringKind::Induced => assert_eq!(via, Some(HUB), "{local}→{remote}: {here:?}"),
            _ => assert!(via.is_none_or(str::is_empty), "{local}→{remote}: {here:?}"),
        }
        // How `here` addresses `there` (its decision) is what `there` learned as its local NAT
        // for `here`, for pod and external CIDRs.
        assert_eq!(
            here.remote_pod_cidr_nat, there.local_pod_cidr_nat,
            "{local}→{remote} pod NAT: {here:?} vs {there:?}"
        );
        assert_eq!(
            here.remote_external_cidr_nat, there.local_external_cidr_nat,
            "{local}→{remote} external NAT: {here:?} vs {there:?}"
        );
        // Real CIDRs as the other end advertised them, remapped because they equal ours.
        assert_eq!(here.local_pod_cidr, POD_CIDR);
        assert_eq!(here.local_external_cidr, EXTERNAL_CIDR);
        assert_eq!(here.remote_pod_cidr, POD_CIDR);
        assert_eq!(here.remote_external_cidr, EXTERNAL_CIDR);
        for nat in [&here.remote_pod_cidr_nat, &here.remote_external_cidr_nat] {
            let nat = net(nat);
            assert!(
                !nat.contains(&net(POD_CIDR)) && !net(POD_CIDR).contains(&nat),
                "{local}→{remote}: {nat} overlaps the local pod CIDR: {here:?}"
            );
            assert!(
                !nat.contains(&net(EXTERNAL_CIDR)) && !net(EXTERNAL_CIDR).contains(&nat),
                "{local}→{remote}: {nat} overlaps the local external CIDR: {here:?}"
            );
        }
        assert!(!here.remote_public_key.is_empty(), "{here:?}");
        assert!(!here.remote_endpoint.is_empty(), "{here:?}");
    }
    // Leaves tunnel to each other's own gateway, not to the hub's.
    assert_eq!(
        tunnel(all, LEAF_A, LEAF_C).remote_public_key,
        tunnel(all, HUB, LEAF_C).remote_public_key,
        "A tunnels to C's own key"
    );
    assert_eq!(
        tunnel(all, LEAF_C, LEAF_A).remote_public_key,
        tunnel(all, HUB, LEAF_A).remote_public_key,
        "C tunnels to A's own key"
    );
}

fn other_two(id: &str) -> [&'static str; 2] {
    match id {
        HUB => [LEAF_A, LEAF_C],
        LEAF_A => [HUB, LEAF_C],
        _ => [HUB, LEAF_A],
    }
}

/// Each IPAM holds exactly one record per remote, consistent with the TunnelEndpoints, and its
/// NAT ranges overlap neither each other nor the local CIDRs.
async fn assert_ipam_mappings_unique(mesh: &Mesh, all: &Tunnels) {
    for cluster in mesh.all() {
        let records = cluster_subnets(cluster).await.expect("lists subnets");
        let ids: Vec<&str> = records.iter().map(|r| r.cluster_id.as_str()).collect();
        let mut expected = other_two(&cluster.id).to_vec();
        expected.sort_unstable();
        assert_eq!(
            ids, expected,
            "{}: one IPAM record per remote: {records:#?}",
            cluster.id
        );
        let mut ranges: Vec<(String, IpNet)> = vec![
            ("local pod".into(), net(POD_CIDR)),
            ("local external".into(), net(EXTERNAL_CIDR)),
        ];
        for record in &records {
            let t = tunnel(all, &cluster.id, &record.cluster_id);
            assert_eq!(record.remote_pod_cidr, POD_CIDR, "{record:?}");
            assert_eq!(
                record.remote_pod_cidr_nat, t.remote_pod_cidr_nat,
                "{record:?}"
            );
            assert_eq!(
                record.local_pod_cidr_nat, t.local_pod_cidr_nat,
                "{record:?}"
            );
            assert_eq!(
                record.remote_external_cidr_nat, t.remote_external_cidr_nat,
                "{record:?}"
            );
            assert_eq!(
                record.local_external_cidr_nat, t.local_external_cidr_nat,
                "{record:?}"
            );
            ranges.push((
                format!("{} pod", record.cluster_id),
                net(&record.remote_pod_cidr_nat),
            ));
            ranges.push((
                format!("{} external", record.cluster_id),
                net(&record.remote_external_cidr_nat),
            ));
        }
        for (i, (what, range)) in ranges.iter().enumerate() {
            for (other, other_range) in &ranges[i + 1..] {
                assert!(
                    !range.contains(other_range) && !other_range.contains(range),
                    "{}: {what} {range} overlaps {other} {other_range}: {records:#?}",
                    cluster.id
                );
            }
        }
    }
}

/// Each broker holds exactly one NetworkConfig per direction per remote (and the hub's broker
/// none of the relayed leaf-to-leaf ones).
async fn assert_network_configs_unique(mesh: &Mesh) {
    for cluster in mesh.all() {
        let ncs = network_configs(cluster).await.expect("lists NCs");
        let pairs: Vec<(String, String)> = ncs
            .iter()
            .map(|nc| {
                (
                    nc.origin
                        .as_ref()
                        .map_or(String::new(), |o| o.cluster_id.clone()),
                    nc.destination
                        .as_ref()
                        .map_or(String::new(), |d| d.cluster_id.clone()),
                )
            })
            .collect();
        let mut expected: Vec<(String, String)> = other_two(&cluster.id)
            .iter()
            .flat_map(|remote| {
                [
                    (cluster.id.clone(), (*remote).to_owned()),
                    ((*remote).to_owned(), cluster.id.clone()),
                ]
            })
            .collect();
        expected.sort();
        let mut sorted = pairs.clone();
        sorted.sort();
        assert_eq!(
            sorted, expected,
            "{}: one NetworkConfig per direction per remote: {ncs:#?}",
            cluster.id
        );
        for nc in &ncs {
            let status = nc.status.as_ref();
            assert_eq!(
                status.map(|s| s.state),
                Some(types::NetworkConfigState::Processed as i32),
                "{}: {nc:?}",
                cluster.id
            );
        }
    }
}

/// Every service wrote only below its own prefix in its own etcd, and each etcd holds what
/// that service is expected to keep (the forwarder: no relay once every exchange completed).
async fn assert_each_service_uses_its_own_etcd(mesh: &Mesh) {
    // Skips this check loudly without etcdctl (fails in CI, which has it).
    if trellis_testkit::require_tool("etcdctl").is_none() {
        return;
    }
    for cluster in mesh.all() {
        let remotes = other_two(&cluster.id);
        for service in Service::ALL {
            let prefix = format!("/{}/", cluster.store_prefix(service));
            let keys = tokio::task::block_in_place(|| cluster.etcd_keys(service))
                .unwrap_or_else(|e| panic!("{}: reading {service}'s etcd: {e:#}", cluster.id));
            let stray: Vec<&String> = keys.iter().filter(|k| !k.starts_with(&prefix)).collect();
            assert!(
                stray.is_empty(),
                "{}: {service}'s etcd holds keys outside {prefix}: {stray:?}",
                cluster.id
            );
            let own: BTreeSet<&str> = keys
                .iter()
                .filter_map(|k| k.strip_prefix(&prefix))
                .collect();
            let has = |key: &str| own.contains(key);
            let any_under = |p: &str| own.iter().any(|k| k.starts_with(p));
            // Keys only the other services write must not appear in this one's etcd.
            let foreign = [
                ("subnets/", Service::Ipam),
                ("nc/", Service::Broker),
                ("tunnels/", Service::Broker),
                ("relays/", Service::Forwarder),
                ("ports/", Service::Gateway),
                ("clusters/", Service::Discovery),
                ("reflected/", Service::Endpoints),
                ("outgoing/", Service::Endpoints),
            ];
            for (p, owner) in foreign {
                if owner != service {
                    assert!(
                        !any_under(p),
                        "{}: {service}'s etcd holds {owner}'s {p} keys: {own:?}",
                        cluster.id
                    );
                }
            }
            match service {
                Service::Ipam => {
                    for remote in remotes {
                        assert!(has(&format!("subnets/clusters/{remote}")), "{own:?}");
                    }
                }
                Service::Broker => {
                    for remote in remotes {
                        assert!(has(&format!("tunnels/{remote}")), "{own:?}");
                        assert!(has(&format!("nc/out/{remote}")), "{own:?}");
                        assert!(has(&format!("nc/in/{remote}")), "{own:?}");
                    }
                    assert!(has("token"), "{own:?}");
                }
                Service::Discovery => {
                    for remote in remotes {
                        assert!(has(&format!("clusters/{remote}")), "{own:?}");
                    }
                }
                Service::Gateway => assert!(has("key"), "{own:?}"),
                Service::Forwarder => assert!(
                    !any_under("relays/"),
                    "{}: the forwarder keeps completed relays: {own:?}",
                    cluster.id
                ),
                // Nothing is reflected in these tests.
                Service::Endpoints => assert!(
                    !any_under("reflected/") && !any_under("outgoing/"),
                    "{}: the endpoints service holds reflections: {own:?}",
                    cluster.id
                ),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn induced_mesh_with_one_etcd_per_service_and_identical_pod_cidrs() {
    let Some(mesh) = Mesh::start().await else {
        return;
    };
    peer(&mesh.a, &mesh.b).await;
    peer(&mesh.c, &mesh.b).await;

    let all = converged(&mesh).await;
    assert_consistent(&all);
    // A addresses B and C through different ranges (their real CIDRs are the same).
    assert_ne!(
        tunnel(&all, LEAF_A, HUB).remote_pod_cidr_nat,
        tunnel(&all, LEAF_A, LEAF_C).remote_pod_cidr_nat
    );
    assert_ipam_mappings_unique(&mesh, &all).await;
    assert_network_configs_unique(&mesh).await;
    assert_each_service_uses_its_own_etcd(&mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_completes_after_sigkill_of_the_forwarder_and_a_leaf_broker() {
    let Some(mut mesh) = Mesh::start().await else {
        return;
    };
    peer(&mesh.a, &mesh.b).await;
    peer(&mesh.c, &mesh.b).await;
    // Both leaves are peered with B: the induced exchange A↔C is about to go through B's
    // forwarder. Kill it before it can relay anything.
    mesh.b
        .kill9(Service::Forwarder)
        .expect("kills B's forwarder");

    // Wait until the leaves know each other (B's Neighborhoods arrived), so their brokers are
    // trying to relay to the dead forwarder.
    for (leaf, other) in [(&mesh.a, LEAF_C), (&mesh.c, LEAF_A)] {
        mesh.eventually("the induced ForeignClusters on the leaves", || async {
            let mut discovery = leaf.discovery().await.map_err(|e| format!("{e:#}"))?;
            let listed = discovery
                .list_foreign_clusters(ListForeignClustersRequest {
                    kind: PeeringKind::Induced as i32,
                })
                .await
                .map_err(|e| e.to_string())?
                .into_inner()
                .foreign_clusters;
            listed
                .iter()
                .any(|fc| fc.identity.as_ref().is_some_and(|i| i.cluster_id == other))
                .then_some(())
                .ok_or_else(|| format!("{}: {listed:?}", leaf.id))
        })
        .await;
    }

    // C's broker dies too; B's forwarder comes back: the relay of A's NetworkConfig to C is
    // accepted and persisted but cannot be delivered.
    mesh.c.kill9(Service::Broker).expect("kills C's broker");
    mesh.b
        .restart(Service::Forwarder)
        .await
        .expect("restarts B's forwarder");
    let pending = mesh
        .eventually("a pending relay from A to C on the hub", || async {
            let relays = relays(&mesh.b).await?;
            relays
                .iter()
                .find(|r| {
                    let to_c = r.network_config.as_ref().is_some_and(|nc| {
                        nc.origin.as_ref().is_some_and(|o| o.cluster_id == LEAF_A)
                            && nc
                                .destination
                                .as_ref()
                                .is_some_and(|d| d.cluster_id == LEAF_C)
                    });
                    to_c && r.state == RelayState::Pending as i32 && r.attempts >= 1
                })
                .cloned()
                .ok_or_else(|| format!("relays {relays:?}"))
        })
        .await;
    assert!(!pending.last_error.is_empty(), "{pending:?}");
    // The relay survives another crash of the forwarder while it is pending.
    mesh.b
        .kill9(Service::Forwarder)
        .expect("kills B's forwarder");
    mesh.b
        .restart(Service::Forwarder)
        .await
        .expect("restarts B's forwarder");
    mesh.c
        .restart(Service::Broker)
        .await
        .expect("restarts C's broker");

    // As soon as C's IPAM has mapped A (C's broker is deciding on A's NetworkConfig), C's
    // broker dies again (possibly mid-decision); the retried decision must reuse that mapping.
    let first = mesh
        .eventually("C's IPAM to map A", || async {
            let records = cluster_subnets(&mesh.c).await?;
            records
                .iter()
                .find(|r| r.cluster_id == LEAF_A && !r.remote_pod_cidr_nat.is_empty())
                .cloned()
                .ok_or_else(|| format!("records {records:?}"))
        })
        .await;
    mesh.c.kill9(Service::Broker).expect("kills C's broker");
    mesh.c
        .restart(Service::Broker)
        .await
        .expect("restarts C's broker");

    let all = converged(&mesh).await;
    let c_to_a = tunnel(&all, LEAF_C, LEAF_A);
    assert_eq!(
        (
            &c_to_a.remote_pod_cidr_nat,
            &c_to_a.remote_external_cidr_nat
        ),
        (&first.remote_pod_cidr_nat, &first.remote_external_cidr_nat),
        "C keeps the mapping of A it allocated before the crash"
    );
    assert_consistent(&all);
    assert_ipam_mappings_unique(&mesh, &all).await;
    assert_network_configs_unique(&mesh).await;
    assert_each_service_uses_its_own_etcd(&mesh).await;
}

/// Waits until both ends of `x`↔`y` hold a full TunnelEndpoint.
async fn full_tunnels(mesh: &Mesh, x: &ProcessCluster, y: &ProcessCluster) {
    for (local, remote) in [(x, y), (y, x)] {
        let t = mesh
            .eventually(
                &format!("{}'s tunnel to {}", local.id, remote.id),
                || async {
                    tunnels(local)
                        .await?
                        .into_iter()
                        .find(|t| remote_of(t) == remote.id)
                        .ok_or_else(|| format!("{}: no tunnel to {}", local.id, remote.id))
                },
            )
            .await;
        assert_eq!(t.kind, PeeringKind::Full as i32, "{t:?}");
    }
}

/// The relay of `origin`'s NetworkConfig to `destination` on the hub, once it is pending after
/// at least one failed delivery.
async fn failing_relay(mesh: &Mesh, origin: &str, destination: &str) -> RelayRecord {
    mesh.eventually(
        &format!("a failing relay from {origin} to {destination} on the hub"),
        || async {
            let relays = relays(&mesh.b).await?;
            relays
                .iter()
                .find(|r| {
                    r.network_config.as_ref().is_some_and(|nc| {
                        nc.origin.as_ref().is_some_and(|o| o.cluster_id == origin)
                            && nc
                                .destination
                                .as_ref()
                                .is_some_and(|d| d.cluster_id == destination)
                    }) && r.state == RelayState::Pending as i32
                        && r.attempts >= 1
                        && !r.last_error.is_empty()
                })
                .cloned()
                .ok_or_else(|| format!("relays {relays:?}"))
        },
    )
    .await
}

/// Neither leaf holds an induced TunnelEndpoint yet.
async fn assert_no_induced_tunnels(mesh: &Mesh, when: &str) {
    for leaf in [&mesh.a, &mesh.c] {
        let induced: Vec<TunnelEndpoint> = tunnels(leaf)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", leaf.id))
            .into_iter()
            .filter(|t| t.kind == PeeringKind::Induced as i32)
            .collect();
        assert!(
            induced.is_empty(),
            "{}: induced tunnels {when}: {induced:?}",
            leaf.id
        );
    }
}

/// The windows are held open by the faults themselves, so each kill lands at a known step of
/// the exchange, not at a lucky moment:
///
/// 1. C is peered with B; C's IPAM dies. A peers with B, which introduces A and C to each
///    other: A stores its passthrough NetworkConfig for C and hands it to B's forwarder, whose
///    deliveries fail because C's broker cannot decide without its IPAM. No induced tunnel can
///    exist yet. Here A's discovery and B's IPAM are SIGKILLed.
/// 2. C's IPAM comes back: C decides on A's NetworkConfig (mapping A in its IPAM) and sends its
///    own, but A's broker cannot take it (nor finish) without A's discovery, so still no induced
///    tunnel. Here C's IPAM is SIGKILLed again, after its mapping of A, and restarted.
/// 3. A's discovery and B's IPAM come back; the mesh must complete as if nothing happened, with
///    C keeping the mapping of A it made before the crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mesh_completes_after_sigkill_of_a_leaf_discovery_and_of_ipams_during_the_exchange() {
    let Some(mut mesh) = Mesh::start().await else {
        return;
    };
    peer(&mesh.c, &mesh.b).await;
    full_tunnels(&mesh, &mesh.c, &mesh.b).await;
    mesh.c.kill9(Service::Ipam).expect("kills C's IPAM");

    // Step 1: the exchange is under way and stuck at C.
    peer(&mesh.a, &mesh.b).await;
    full_tunnels(&mesh, &mesh.a, &mesh.b).await;
    mesh.eventually("A's NetworkConfig for C", || async {
        let ncs = network_configs(&mesh.a).await?;
        ncs.iter()
            .find(|nc| {
                nc.origin.as_ref().is_some_and(|o| o.cluster_id == LEAF_A)
                    && nc
                        .destination
                        .as_ref()
                        .is_some_and(|d| d.cluster_id == LEAF_C)
            })
            .map(|_| ())
            .ok_or_else(|| format!("A's NCs {ncs:?}"))
    })
    .await;
    let stuck = failing_relay(&mesh, LEAF_A, LEAF_C).await;
    assert_no_induced_tunnels(&mesh, "while C's IPAM is down").await;
    mesh.a
        .kill9(Service::Discovery)
        .expect("kills A's discovery");
    mesh.b.kill9(Service::Ipam).expect("kills B's IPAM");

    // Step 2: C decides on A's NetworkConfig; A cannot finish without its discovery.
    mesh.c
        .restart(Service::Ipam)
        .await
        .expect("restarts C's IPAM");
    let first = mesh
        .eventually("C's IPAM to map A", || async {
            let records = cluster_subnets(&mesh.c).await?;
            records
                .iter()
                .find(|r| r.cluster_id == LEAF_A && !r.remote_pod_cidr_nat.is_empty())
                .cloned()
                .ok_or_else(|| format!("records {records:?}"))
        })
        .await;
    assert_no_induced_tunnels(&mesh, "while A's discovery is down").await;
    // C's own NetworkConfig for A is on its way and cannot be taken by A.
    failing_relay(&mesh, LEAF_C, LEAF_A).await;
    mesh.c.kill9(Service::Ipam).expect("kills C's IPAM again");
    mesh.c
        .restart(Service::Ipam)
        .await
        .expect("restarts C's IPAM again");

    // Step 3.
    mesh.a
        .restart(Service::Discovery)
        .await
        .expect("restarts A's discovery");
    mesh.b
        .restart(Service::Ipam)
        .await
        .expect("restarts B's IPAM");

    let all = converged(&mesh).await;
    let c_to_a = tunnel(&all, LEAF_C, LEAF_A);
    assert_eq!(
        (
            &c_to_a.remote_pod_cidr_nat,
            &c_to_a.remote_external_cidr_nat
        ),
        (&first.remote_pod_cidr_nat, &first.remote_external_cidr_nat),
        "C keeps the mapping of A it allocated before its IPAM crashed (the relay first failed \
         with: {})",
        stuck.last_error
    );
    assert_consistent(&all);
    assert_ipam_mappings_unique(&mesh, &all).await;
    assert_network_configs_unique(&mesh).await;
    assert_each_service_uses_its_own_etcd(&mesh).await;
}
