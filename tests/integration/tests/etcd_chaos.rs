//! The store fails, not our processes (issue 20 item 5): one hub and three leaves, every
//! service a real process on its own real etcd. During a peering storm (the three leaves peer
//! with the hub at once) the etcds behind the hub's broker and forwarder and a leaf's IPAM are
//! killed with SIGKILL and restarted on their data; after convergence the hub's broker,
//! forwarder and discovery etcds and a leaf's gateway etcd (the WireGuard private key) are
//! killed and restarted again. A service that exits while its store is gone is restarted, as
//! Kubernetes would (counted). Both times the mesh must converge to exactly the expected
//! tunnels with agreeing NAT views, no IPAM mapping of a non-peer, no relay left at the hub;
//! and after the second round nothing is lost: every tunnel, NAT view and public key is the one
//! from before the faults. Fault counts and convergence times are printed ("measured:").

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::PeerRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{ListRelaysRequest, ListTunnelEndpointsRequest};
use trellis_api::pb::types::TunnelEndpoint;
use trellis_integration::peering::{expected_hub_mesh, remote_id, token};
use trellis_integration::processes::{ProcessCluster, Service};

const HUB: &str = "hub";
const LEAVES: [&str; 3] = ["leaf-1", "leaf-2", "leaf-3"];
/// Generous: a deadline for convergence, not a performance assertion.
const CONVERGE: Duration = Duration::from_secs(240);
/// How long a killed etcd stays down.
const DOWN: Duration = Duration::from_secs(2);

async fn tunnels(cluster: &ProcessCluster) -> Vec<TunnelEndpoint> {
    match cluster.broker().await {
        Ok(mut b) => b
            .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
            .await
            .map(|r| r.into_inner().tunnel_endpoints)
            .unwrap_or_default(),
        Err(_) => Vec::new(),
    }
}

/// What must survive a store failure: per holder, each tunnel's remote, kind, NAT views and
/// key.
type Snapshot = BTreeSet<(String, String, i32, [String; 4], String)>;

async fn snapshot(all: &[ProcessCluster]) -> Snapshot {
    let mut out = Snapshot::new();
    for cluster in all {
        for t in tunnels(cluster).await {
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

/// Everything wrong with the mesh now (empty: the exact expected mesh).
async fn violations(all: &[ProcessCluster]) -> Vec<String> {
    let mut wrong = Vec::new();
    let mut held = Vec::new();
    for cluster in all {
        held.push((cluster.id.clone(), tunnels(cluster).await));
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
                Some(back)
                    if t.local_pod_cidr_nat != back.remote_pod_cidr_nat
                        || t.remote_pod_cidr_nat != back.local_pod_cidr_nat
                        || t.local_external_cidr_nat != back.remote_external_cidr_nat =>
                {
                    wrong.push(format!("{holder}<->{other}: views disagree"));
                }
                Some(_) => {}
            }
        }
    }
    let ids: BTreeSet<String> = all.iter().map(|c| c.id.clone()).collect();
    for cluster in all {
        let Ok(mut ipam) = cluster.ipam().await else {
            wrong.push(format!("{}: IPAM unreachable", cluster.id));
            continue;
        };
        let mapped: Vec<String> = ipam
            .list_cluster_subnets(ListClusterSubnetsRequest {})
            .await
            .map(|r| r.into_inner().clusters)
            .unwrap_or_default()
            .into_iter()
            .map(|m| m.cluster_id)
            .collect();
        let unique: BTreeSet<&String> = mapped.iter().collect();
        if unique.len() != mapped.len() {
            wrong.push(format!(
                "{}: duplicate IPAM mappings {mapped:?}",
                cluster.id
            ));
        }
        for m in &mapped {
            if !ids.contains(m) || *m == cluster.id {
                wrong.push(format!("{}: IPAM maps {m}", cluster.id));
            }
        }
    }
    match all[0].forwarder().await {
        Ok(mut f) => {
            let relays = f
                .list_relays(ListRelaysRequest::default())
                .await
                .map(|r| r.into_inner().relays)
                .unwrap_or_default();
            if !relays.is_empty() {
                wrong.push(format!("the hub still holds {} relays", relays.len()));
            }
        }
        Err(e) => wrong.push(format!("the hub's forwarder: {e}")),
    }
    wrong
}

/// Faults injected, by kind.
#[derive(Debug, Default)]
struct Faults {
    etcd_kills: usize,
    service_restarts: usize,
}

/// Restarts every service that exited (while its etcd was gone), as a kubelet would.
async fn revive(all: &mut [ProcessCluster], faults: &mut Faults) {
    for cluster in all.iter_mut() {
        for service in Service::ALL {
            if cluster.exited(service) {
                eprintln!("{}: {service} exited, restarting it", cluster.id);
                cluster.restart(service).await.expect("restarts");
                faults.service_restarts += 1;
            }
        }
    }
}

/// Kills the etcds of `(cluster index, service)` with SIGKILL, keeps them down for [`DOWN`],
/// restarts them and any service that died meanwhile.
async fn kill_etcds(all: &mut [ProcessCluster], which: &[(usize, Service)], faults: &mut Faults) {
    for &(i, service) in which {
        all[i].kill9_etcd(service).expect("kills etcd");
        faults.etcd_kills += 1;
        eprintln!("killed the etcd of {}'s {service}", all[i].id);
    }
    tokio::time::sleep(DOWN).await;
    for &(i, service) in which {
        all[i].restart_etcd(service).expect("etcd restarts");
    }
    revive(all, faults).await;
}

/// Waits until the mesh is exactly as expected (twice, 3 s apart), restarting dead services;
/// returns how long that took.
async fn converge(all: &mut [ProcessCluster], faults: &mut Faults, what: &str) -> Duration {
    let started = Instant::now();
    loop {
        revive(all, faults).await;
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
            "{what}: still wrong after {CONVERGE:?}:\n{}\n{}",
            wrong.join("\n"),
            all.iter()
                .map(|c| c.logs(15))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What a leaf's operator does: `Peer` with the hub until it succeeds (it is idempotent);
/// returns how many calls it took.
async fn peer_until_done(
    id: String,
    broker: std::net::SocketAddr,
    hub_broker: std::net::SocketAddr,
    token: String,
) -> usize {
    let deadline = Instant::now() + CONVERGE;
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
        match answer.await {
            Ok(_) => return tries,
            Err(err) => {
                assert!(Instant::now() < deadline, "{id} never peered: {err:?}");
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_etcds_during_a_peering_storm_and_after_it_lose_nothing() {
    let Some(hub) = ProcessCluster::start(HUB, "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("the hub starts")
    else {
        return;
    };
    let mut all = vec![hub];
    for (i, leaf) in LEAVES.iter().enumerate() {
        let external = format!("10.{}.0.0/16", 202 + i);
        all.push(
            ProcessCluster::start(leaf, "10.0.0.0/16", &external)
                .await
                .expect("a leaf starts")
                .expect("etcd is there"),
        );
    }
    let mut faults = Faults::default();
    let hub_token = token(&all[0]).await;

    // Round 1: the storm. Each leaf's operator re-runs `peer` until it succeeds (Peer is
    // idempotent), while the hub's broker and forwarder etcds and leaf-1's IPAM etcd die.
    let started = Instant::now();
    let hub_broker = all[0].addr(Service::Broker);
    let storm: Vec<_> = all[1..]
        .iter()
        .map(|leaf| {
            let (id, broker, token) = (
                leaf.id.clone(),
                leaf.addr(Service::Broker),
                hub_token.clone(),
            );
            tokio::spawn(peer_until_done(id, broker, hub_broker, token))
        })
        .collect();
    // At once: the handshakes and the NetworkConfig exchanges are in flight.
    kill_etcds(
        &mut all,
        &[
            (0, Service::Broker),
            (0, Service::Forwarder),
            (1, Service::Ipam),
        ],
        &mut faults,
    )
    .await;
    let mut attempts = 0;
    for leaf in storm {
        attempts += leaf.await.expect("a leaf's peering");
    }
    let first = converge(&mut all, &mut faults, "after the storm").await;
    let storm_total = started.elapsed();
    eprintln!(
        "measured: storm round converged {} ms after the peerings started ({} ms after the last \
         fault), {attempts} peer attempts for {} leaves, faults {faults:?}",
        storm_total.as_millis(),
        first.as_millis(),
        LEAVES.len()
    );
    let before = snapshot(&all).await;
    assert_eq!(
        before.len(),
        LEAVES.len() * 2 + LEAVES.len() * (LEAVES.len() - 1),
        "every tunnel is there: {before:?}"
    );

    // Round 2: after convergence, the hub's broker, forwarder and discovery etcds and leaf-2's
    // gateway etcd (its WireGuard private key) die together.
    let kills_before = faults.etcd_kills;
    kill_etcds(
        &mut all,
        &[
            (0, Service::Broker),
            (0, Service::Forwarder),
            (0, Service::Discovery),
            (2, Service::Gateway),
        ],
        &mut faults,
    )
    .await;
    let second = converge(&mut all, &mut faults, "after the second round").await;
    let after = snapshot(&all).await;
    assert_eq!(
        after, before,
        "nothing lost or changed: tunnels, NAT views and keys"
    );
    eprintln!(
        "measured: converged round consistent again {} ms after its faults ({} etcd kills); \
         total faults {faults:?}",
        second.as_millis(),
        faults.etcd_kills - kills_before
    );
}
