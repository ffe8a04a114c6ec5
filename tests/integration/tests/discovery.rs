//! `trellis-discovery` as real processes on real etcd: a hub's Neighborhoods reach its leaves,
//! unpeering withdraws, a SIGKILLed leaf restarts with everything; and grpcurl lists, calls and
//! streams the service.

use std::io::Read as _;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::*;
use trellis_api::pb::types::{
    ClusterIdentity, ConditionStatus, ForeignCluster, PeeringKind, ServiceAddresses,
};
use trellis_api::peers::{Condition, UNPEERED_REASON};
use trellis_integration::command::grpcurl;
use trellis_integration::{ServiceProcess, free_addr};
use trellis_testkit::peering::full_peering;
use trellis_testkit::{Etcd, require_tool};

const DISCOVERY: &str = "trellis.discovery.v1.Discovery";

/// How long a change may take to propagate between processes before the test fails. Generous:
/// the sender acts on the store watch at once, this only bounds a stuck system.
const PROPAGATION: Duration = Duration::from_secs(30);

async fn start_discovery(etcd: &Etcd, cluster: &str) -> ServiceProcess {
    let addr = free_addr();
    let args = [
        "--listen",
        &addr.to_string(),
        "--store",
        &etcd.url(&format!("discovery-{cluster}")),
        "--insecure-plaintext-peering",
        "--cluster-id",
        cluster,
        "--cluster-name",
        &format!("cluster {cluster}"),
        "--advertise-discovery",
        &addr.to_string(),
        "--neighborhood-resync",
        "2",
        "--neighborhood-retry-max",
        "1",
        // One test sends a Neighborhood larger than an etcd transaction, above the default cap.
        "--max-induced-per-hub",
        "1024",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    ServiceProcess::start("trellis-discovery", args, addr, DISCOVERY)
        .await
        .expect("trellis-discovery starts")
}

async fn client(p: &ServiceProcess) -> DiscoveryClient<Channel> {
    DiscoveryClient::new(p.channel().await.expect("connects"))
}

/// Tells `on` (as its broker would) that it is peered with `peer`, networking enabled.
async fn peer(on: &ServiceProcess, peer_id: &str, peer_addr: SocketAddr, peered: bool) {
    client(on)
        .await
        .update_peering(UpdatePeeringRequest {
            peered,
            reason: if peered {
                "HandshakeCompleted"
            } else {
                UNPEERED_REASON
            }
            .into(),
            ..full_peering(
                ClusterIdentity {
                    cluster_id: peer_id.into(),
                    cluster_name: format!("cluster {peer_id}"),
                },
                ServiceAddresses {
                    discovery: peer_addr.to_string(),
                    ..Default::default()
                },
            )
        })
        .await
        .expect("update peering");
}

fn condition(fc: &ForeignCluster, kind: Condition) -> Option<ConditionStatus> {
    fc.conditions
        .iter()
        .find(|c| c.r#type == kind.as_str())
        .and_then(|c| ConditionStatus::try_from(c.status).ok())
}

/// The active induced records of `p`: (cluster, origin), and the withdrawn ones' IDs.
async fn induced(p: &ServiceProcess) -> (Vec<(String, String)>, Vec<String>) {
    let listed = client(p)
        .await
        .list_foreign_clusters(ListForeignClustersRequest {
            kind: PeeringKind::Induced as i32,
        })
        .await
        .expect("lists")
        .into_inner()
        .foreign_clusters;
    let mut active = Vec::new();
    let mut withdrawn = Vec::new();
    for fc in listed {
        let id = fc
            .identity
            .as_ref()
            .map(|i| i.cluster_id.clone())
            .unwrap_or_default();
        if condition(&fc, Condition::Withdrawn) == Some(ConditionStatus::True) {
            withdrawn.push(id);
        } else {
            let origin = fc
                .induced
                .as_ref()
                .and_then(|i| i.origin.as_ref())
                .map(|o| o.cluster_id.clone())
                .unwrap_or_default();
            active.push((id, origin));
        }
    }
    (active, withdrawn)
}

async fn wait_for(p: &ServiceProcess, active: &[&str], withdrawn: &[&str], what: &str) {
    let want_active: Vec<(String, String)> = active
        .iter()
        .map(|id| ((*id).to_owned(), "b".to_owned()))
        .collect();
    let want_withdrawn: Vec<String> = withdrawn.iter().map(|s| (*s).to_owned()).collect();
    let want = (want_active, want_withdrawn);
    if let Err(timed_out) = trellis_testkit::within_eq(what, PROPAGATION, want, || induced(p)).await
    {
        panic!("{timed_out}\n{}", p.log_tail(30));
    }
}

#[tokio::test]
async fn hub_neighborhoods_reach_leaves_withdraw_on_unpeer_and_survive_sigkill() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let b = start_discovery(&etcd, "b").await;
    let mut a = start_discovery(&etcd, "a").await;
    let c = start_discovery(&etcd, "c").await;
    let d = start_discovery(&etcd, "d").await;

    // Each leaf's broker peered with the hub, and the hub's broker with each leaf.
    for leaf in [&a, &c, &d] {
        peer(leaf, "b", b.addr(), true).await;
    }
    for (id, leaf) in [("a", &a), ("c", &c), ("d", &d)] {
        peer(&b, id, leaf.addr(), true).await;
    }
    wait_for(&a, &["c", "d"], &[], "a learns c and d through b").await;
    wait_for(&c, &["a", "d"], &[], "c learns a and d through b").await;
    wait_for(&d, &["a", "c"], &[], "d learns a and c through b").await;

    // The hub drops d: a and c withdraw d; d is told its Neighborhood is empty.
    peer(&b, "d", d.addr(), false).await;
    wait_for(&a, &["c"], &["d"], "a withdraws d").await;
    wait_for(&c, &["a"], &["d"], "c withdraws d").await;
    wait_for(&d, &[], &["a", "c"], "d withdraws a and c").await;

    // SIGKILL a's discovery and restart it on the same store: nothing is lost.
    a.kill9();
    a.restart().await.expect("a restarts");
    wait_for(&a, &["c"], &["d"], "a keeps its records across SIGKILL").await;
    let got = client(&a)
        .await
        .get_identity(GetIdentityRequest {})
        .await
        .expect("identity")
        .into_inner();
    assert_eq!(got.identity.expect("identity").cluster_id, "a");

    // The restarted a keeps working: d peers with the hub again and reappears on a.
    peer(&b, "d", d.addr(), true).await;
    wait_for(&a, &["c", "d"], &[], "a learns d again after the restart").await;
}

/// Kills the streaming grpcurl when the test ends, whatever happens.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every complete JSON message grpcurl printed so far (it prints them one after the other).
fn messages(text: &str) -> Vec<serde_json::Value> {
    serde_json::Deserializer::from_str(text)
        .into_iter::<serde_json::Value>()
        .map_while(Result::ok)
        .collect()
}

fn summary(m: &serde_json::Value) -> (String, String) {
    (
        m["type"].as_str().unwrap_or_default().to_owned(),
        m["foreignCluster"]["identity"]["clusterId"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

#[tokio::test]
async fn grpcurl_lists_calls_and_streams_the_discovery_service() {
    let Some(grpcurl_bin) = require_tool("grpcurl") else {
        return;
    };
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let hub = start_discovery(&etcd, "hub").await;
    let addr = hub.addr().to_string();

    let listed = grpcurl(&grpcurl_bin, &["-plaintext", &addr, "list"]);
    assert!(listed.lines().any(|l| l == DISCOVERY), "{listed}");
    assert!(
        listed.lines().any(|l| l == "grpc.health.v1.Health"),
        "{listed}"
    );

    peer(&hub, "leaf-1", free_addr(), true).await;
    let got: serde_json::Value = serde_json::from_str(&grpcurl(
        &grpcurl_bin,
        &[
            "-plaintext",
            "-d",
            r#"{"kind": "PEERING_KIND_FULL"}"#,
            &addr,
            &format!("{DISCOVERY}/ListForeignClusters"),
        ],
    ))
    .expect("JSON");
    let clusters = got["foreignClusters"].as_array().expect("foreignClusters");
    assert_eq!(clusters.len(), 1, "{got}");
    assert_eq!(clusters[0]["identity"]["clusterId"], "leaf-1");
    assert_eq!(clusters[0]["kind"], "PEERING_KIND_FULL");
    assert!(
        got["revision"]
            .as_str()
            .is_some_and(|r| r.parse::<i64>().is_ok()),
        "{got}"
    );

    // Stream the watch from a grpcurl child while changes happen.
    let mut child = Child(
        Command::new(&grpcurl_bin)
            .args([
                "-plaintext",
                "-d",
                r#"{"start_revision": 0}"#,
                &addr,
                &format!("{DISCOVERY}/WatchForeignClusters"),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("grpcurl starts"),
    );
    let mut stdout = child.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0
                || tx
                    .send(String::from_utf8_lossy(&buf[..n]).into_owned())
                    .is_err()
            {
                return;
            }
        }
    });
    let mut text = String::new();
    let mut wait_for = |count: usize| {
        let deadline = Instant::now() + PROPAGATION;
        loop {
            let got = messages(&text);
            if got.len() >= count {
                return got;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "grpcurl printed only: {text}");
            if let Ok(chunk) = rx.recv_timeout(left.min(Duration::from_millis(200))) {
                text.push_str(&chunk);
            }
        }
    };
    let snapshot = wait_for(2);
    assert_eq!(
        summary(&snapshot[0]),
        ("WATCH_EVENT_TYPE_ADDED".into(), "leaf-1".into())
    );
    assert_eq!(summary(&snapshot[1]).0, "WATCH_EVENT_TYPE_BOOKMARK");

    peer(&hub, "leaf-2", free_addr(), true).await;
    peer(&hub, "leaf-1", free_addr(), false).await;
    let got = wait_for(4);
    assert_eq!(
        summary(&got[2]),
        ("WATCH_EVENT_TYPE_ADDED".into(), "leaf-2".into())
    );
    assert_eq!(
        summary(&got[3]),
        ("WATCH_EVENT_TYPE_MODIFIED".into(), "leaf-1".into())
    );
    assert_eq!(
        got[3]["foreignCluster"]["conditions"]
            .as_array()
            .expect("conditions")
            .iter()
            .find(|c| c["type"] == Condition::Peered.as_str())
            .map(|c| c["status"].clone()),
        Some(serde_json::json!("CONDITION_STATUS_FALSE"))
    );
    let revisions: Vec<i64> = got[2..]
        .iter()
        .map(|m| {
            m["revision"]
                .as_str()
                .and_then(|r| r.parse().ok())
                .expect("revision")
        })
        .collect();
    assert!(revisions[0] < revisions[1], "{revisions:?}");
}

/// Publishes `neighbors` as hub `b`'s Neighborhood for `leaf` at `generation`.
async fn publish(leaf: &ServiceProcess, neighbors: &[String], generation: i64) {
    let answer = client(leaf)
        .await
        .publish_neighborhood(PublishNeighborhoodRequest {
            neighborhood: Some(trellis_api::pb::types::Neighborhood {
                sender: Some(ClusterIdentity {
                    cluster_id: "b".into(),
                    cluster_name: "cluster b".into(),
                }),
                recipient: Some(ClusterIdentity {
                    cluster_id: "leaf".into(),
                    cluster_name: "cluster leaf".into(),
                }),
                neighbors: neighbors
                    .iter()
                    .map(|id| trellis_api::pb::types::Neighbor {
                        identity: Some(ClusterIdentity {
                            cluster_id: id.clone(),
                            cluster_name: String::new(),
                        }),
                        addresses: Some(ServiceAddresses::default()),
                    })
                    .collect(),
                generation,
                create_time: None,
            }),
        })
        .await
        .unwrap_or_else(|status| panic!("generation {generation} refused: {status}"))
        .into_inner();
    assert!(answer.applied, "generation {generation}: {answer:?}");
    assert_eq!(answer.current_generation, generation);
}

/// The `neighborhood_generation` of every active induced record of `p`.
async fn induced_generations(p: &ServiceProcess) -> Vec<i64> {
    client(p)
        .await
        .list_foreign_clusters(ListForeignClustersRequest {
            kind: PeeringKind::Induced as i32,
        })
        .await
        .expect("lists")
        .into_inner()
        .foreign_clusters
        .iter()
        .filter(|fc| condition(fc, Condition::Withdrawn) != Some(ConditionStatus::True))
        .filter_map(|fc| fc.induced.as_ref().map(|i| i.neighborhood_generation))
        .collect()
}

/// etcd refuses a transaction of more than 128 operations (its default `--max-txn-ops`), which
/// used to cap a hub at about 126 leaves and keep a leaf from unpeering a bigger hub. A
/// 300-neighbour Neighborhood applies on a real etcd, a new generation that changes nothing
/// rewrites no record, a smaller one withdraws the dropped half, and unpeering the hub withdraws
/// all 300.
#[tokio::test]
async fn neighborhoods_larger_than_an_etcd_transaction_apply_and_unpeering_withdraws_them() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let leaf = start_discovery(&etcd, "leaf").await;
    peer(&leaf, "b", free_addr(), true).await;
    let all: Vec<String> = (0..300).map(|i| format!("n{i:03}")).collect();

    publish(&leaf, &all, 1).await;
    let (active, withdrawn) = induced(&leaf).await;
    assert_eq!(active.len(), 300, "{}", leaf.log_tail(20));
    assert!(withdrawn.is_empty(), "{withdrawn:?}");

    // Same neighbours, new generation: nothing about them changed, so no record is rewritten.
    publish(&leaf, &all, 2).await;
    let generations = induced_generations(&leaf).await;
    assert_eq!(generations.len(), 300);
    assert!(
        generations.iter().all(|g| *g == 1),
        "records rewritten: {generations:?}"
    );

    publish(&leaf, &all[..150], 3).await;
    let (active, withdrawn) = induced(&leaf).await;
    assert_eq!((active.len(), withdrawn.len()), (150, 150));

    publish(&leaf, &all, 4).await;
    assert_eq!(induced(&leaf).await.0.len(), 300);

    peer(&leaf, "b", free_addr(), false).await;
    let (active, withdrawn) = induced(&leaf).await;
    assert!(active.is_empty(), "{} still active", active.len());
    assert_eq!(withdrawn.len(), 300);
}
