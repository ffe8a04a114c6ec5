//! A cluster moves to a new CA while peered (ADR 0027), in process, driven by the real
//! `trellisctl certs rotate-ca`: the hub of two leaves (certificates Trellis makes for itself,
//! `--tls-dir`) replaces its CA while the leaves' induced mesh stands and two streams of calls
//! run over mutual TLS, 100 a second each, a new connection (a new TLS handshake) every 20
//! calls: leaf A calling the hub's broker, trusting what leaf A's discovery pins for the hub
//! (as leaf A's own services do), and the hub's broker identity (its certificate files as the
//! hub's broker serves them) calling leaf A's broker. No call may fail. Afterwards both leaves
//! pin the new CA, a certificate of the old CA is refused, and the mesh is whole.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tonic::Code;
use trellis_api::pb::discovery::GetForeignClusterRequest;
use trellis_api::pb::peering::GetObservedEndpointsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::types;
use trellis_integration::cluster::{InProcessCluster, Options};
use trellis_integration::peering::{eventually, peer, tunnel_to};
use trellis_runtime::client::Timeouts;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::tls::{ClusterCa, PeerTls, PinnedCa, peer_channel};

const EVERY: Duration = Duration::from_millis(10);
const LIMIT: Duration = Duration::from_secs(40);

fn identity(id: &str) -> types::ClusterIdentity {
    types::ClusterIdentity {
        cluster_id: id.into(),
        cluster_name: id.into(),
    }
}

/// The CA `of`'s discovery pins for `remote` (PEM).
async fn pinned(of: &InProcessCluster, remote: &str) -> String {
    of.discovery()
        .await
        .expect("connects")
        .get_foreign_cluster(GetForeignClusterRequest {
            cluster_id: remote.into(),
        })
        .await
        .expect("known")
        .into_inner()
        .foreign_cluster
        .and_then(|fc| fc.full)
        .map(|full| full.ca_certificate)
        .unwrap_or_default()
}

/// Calls `GetObservedEndpoints` of the broker at `at` (cluster `callee`) as `caller` every
/// [`EVERY`] until `stop`, a new connection every 20 calls, `refresh` run before each new
/// connection (what a service's trust sync and certificate reload do meanwhile); the number of
/// calls and the failures.
async fn calls(
    caller: &'static str,
    callee: &'static str,
    at: std::net::SocketAddr,
    mut tls: impl FnMut() -> PeerTls,
    stop: Arc<AtomicBool>,
) -> (u32, Vec<String>) {
    let started = Instant::now();
    let (mut made, mut failed) = (0u32, Vec::new());
    let mut next = Instant::now();
    let mut client = None;
    while !stop.load(Ordering::Relaxed) {
        if made % 20 == 0 {
            let channel = peer_channel(
                &tls(),
                "test",
                &at.to_string(),
                Some(callee),
                Timeouts::default(),
                &Metrics::new(),
            )
            .expect("channel");
            client = Some(BrokerClient::new(channel));
        }
        let answer = client
            .as_mut()
            .expect("connected")
            .get_observed_endpoints(GetObservedEndpointsRequest {
                requester: Some(identity(caller)),
                cluster_ids: vec![caller.into()],
            })
            .await;
        if let Err(status) = answer {
            failed.push(format!(
                "{caller} -> {callee} at {:.2} s: {status:?}",
                started.elapsed().as_secs_f64()
            ));
        }
        made += 1;
        next += EVERY;
        tokio::time::sleep_until(next.into()).await;
    }
    (made, failed)
}

/// The hub's broker identity with a fresh certificate of `ca`, trusting leaf A's CA.
fn as_hub(ca: &ClusterCa, leaf_a_ca: &str) -> PeerTls {
    let cert = ca.issue("broker").expect("a certificate");
    let tls = PeerTls::new("hub", ca.cert_pem(), &cert.cert_pem, cert.key_pem())
        .expect("an identity of the hub");
    tls.trust()
        .pin(PinnedCa::from_pem("leaf-a", leaf_a_ca).expect("A's CA"));
    tls
}

/// One `GetObservedEndpoints` call as the hub, over a new connection to leaf A's broker at `at`.
async fn observe_from(tls: &PeerTls, at: std::net::SocketAddr) -> Result<(), tonic::Status> {
    BrokerClient::new(
        peer_channel(
            tls,
            "test",
            &at.to_string(),
            Some("leaf-a"),
            Timeouts::default(),
            &Metrics::new(),
        )
        .expect("channel"),
    )
    .get_observed_endpoints(GetObservedEndpointsRequest {
        requester: Some(identity("hub")),
        cluster_ids: vec!["hub".into()],
    })
    .await
    .map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hub_moves_to_a_new_ca_while_peered_and_the_old_one_is_refused_afterwards() {
    let options = Options {
        tls: true,
        endpoints: true,
        managed_cert_lifetime: Some(3600),
        ..Options::default()
    };
    let start = |id: &'static str| {
        InProcessCluster::start_with(id, "10.0.0.0/16", "10.201.0.0/16", options.clone())
    };
    let hub = start("hub").await.expect("the hub starts");
    let a = start("leaf-a").await.expect("leaf A starts");
    let c = start("leaf-c").await.expect("leaf C starts");
    peer(&a, &hub).await;
    peer(&c, &hub).await;
    eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;

    let hub_tls = hub.tls.as_ref().expect("tls");
    let dir = hub_tls.managed_dir();
    let read = |path: &str| std::fs::read_to_string(dir.join(path)).expect("readable");
    let old_ca = ClusterCa::load("hub", &read("ca/ca.pem"), &read("ca/ca-key.pem")).expect("CA");
    let before = pinned(&a, "hub").await;
    assert_eq!(
        before,
        old_ca.cert_pem(),
        "A pinned the hub's CA at the handshake"
    );

    // Leaf A calling the hub, trusting what leaf A's discovery pins for it now.
    let a_tls = a.tls.as_ref().expect("tls");
    let as_a = a_tls.client("broker", &[&hub]).expect("A's identity");
    let a_discovery = a.discovery().await.expect("connects");
    let pins = Arc::new(std::sync::Mutex::new(before.clone()));
    let follow = {
        let pins = pins.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let watching = stop.clone();
        let task = tokio::spawn(async move {
            let mut discovery = a_discovery;
            while !watching.load(Ordering::Relaxed) {
                if let Ok(answer) = discovery
                    .get_foreign_cluster(GetForeignClusterRequest {
                        cluster_id: "hub".into(),
                    })
                    .await
                    && let Some(full) = answer.into_inner().foreign_cluster.and_then(|f| f.full)
                {
                    *pins.lock().expect("lock") = full.ca_certificate;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        (stop, task)
    };
    let stop = Arc::new(AtomicBool::new(false));
    let a_to_hub = tokio::spawn(calls(
        "leaf-a",
        "hub",
        hub_tls.broker,
        {
            let pins = pins.clone();
            move || {
                let pem = pins.lock().expect("lock").clone();
                as_a.trust()
                    .pin(PinnedCa::from_pem("hub", &pem).expect("a CA"));
                as_a.clone()
            }
        },
        stop.clone(),
    ));
    // The hub's broker calling leaf A: its certificate files as the broker serves them.
    // Between the new CA and the broker's new certificate, the files do not match: the broker
    // keeps its current identity then, and so does this.
    let a_ca = a_tls.ca.cert_pem().to_owned();
    let hub_dir = dir.clone();
    let mut last: Option<PeerTls> = None;
    let hub_to_a = tokio::spawn(calls(
        "hub",
        "leaf-a",
        a_tls.broker,
        move || {
            let read = |path: &str| std::fs::read_to_string(hub_dir.join(path)).unwrap_or_default();
            let loaded = PeerTls::new(
                "hub",
                &read("ca/ca.pem"),
                &read("broker/cert.pem"),
                &read("broker/key.pem"),
            );
            if let Ok(tls) = loaded {
                tls.trust()
                    .pin(PinnedCa::from_pem("leaf-a", &a_ca).expect("A's CA"));
                last = Some(tls);
            }
            last.clone().expect("the hub broker's identity")
        },
        stop.clone(),
    ));

    tokio::time::sleep(Duration::from_secs(2)).await;
    let bin = trellis_integration::bin_path("trellisctl").expect("trellisctl is built");
    let rotated = tokio::process::Command::new(bin)
        .args([
            "--broker",
            &hub.services.broker.to_string(),
            "--output",
            "json",
            "certs",
            "rotate-ca",
            "--tls-dir",
            &dir.display().to_string(),
            "--cluster-id",
            "hub",
            "--wait",
            "60s",
        ])
        .output()
        .await
        .expect("trellisctl runs");
    let stdout = String::from_utf8_lossy(&rotated.stdout);
    let stderr = String::from_utf8_lossy(&rotated.stderr);
    assert!(
        rotated.status.success(),
        "rotate-ca failed:\n{stdout}\n{stderr}"
    );
    eprintln!("rotate-ca said:\n{stderr}{stdout}");
    let view: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    let new_ca = read("ca/ca.pem");
    let new_fingerprint = PinnedCa::from_pem("hub", &new_ca)
        .expect("the new CA")
        .fingerprint()
        .to_owned();
    assert_eq!(view["ca_sha256"], new_fingerprint.as_str());
    assert_ne!(new_ca, old_ca.cert_pem(), "the CA changed");
    let services: Vec<&str> = view["services"]
        .as_array()
        .expect("services")
        .iter()
        .filter_map(|s| s.as_str())
        .collect();
    assert_eq!(
        services,
        ["broker", "discovery", "endpoints", "forwarder", "ipam"],
        "every cluster-facing service moved"
    );
    for peer in view["peers"].as_array().expect("peers") {
        assert_eq!(peer["pinned"], true, "{peer}");
    }
    // Calls go on after the announcement, over new connections.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let (a_calls, a_failed) = a_to_hub.await.expect("A's calls");
    let (hub_calls, hub_failed) = hub_to_a.await.expect("the hub's calls");
    follow.0.store(true, Ordering::Relaxed);
    follow.1.await.expect("follows");
    eprintln!(
        "measured: leaf A -> hub {a_calls} calls, {} failed; hub -> leaf A {hub_calls} calls, {} failed",
        a_failed.len(),
        hub_failed.len()
    );
    assert!(
        a_calls >= 300 && hub_calls >= 300,
        "{a_calls}, {hub_calls} calls"
    );
    assert!(a_failed.is_empty(), "failed: {a_failed:#?}");
    assert!(hub_failed.is_empty(), "failed: {hub_failed:#?}");

    // Both leaves pin the new CA, and refuse a certificate of the old one.
    for leaf in [&a, &c] {
        assert_eq!(
            pinned(leaf, "hub").await,
            new_ca,
            "{} pins the new CA",
            leaf.id
        );
    }
    // A certificate of the old CA is refused by leaf A's broker, where one of the new CA (no
    // cross certificate needed any more) is taken at the same moment.
    let new_ca_key = read("ca/ca-key.pem");
    let new_ca_of_hub = ClusterCa::load("hub", &new_ca, &new_ca_key).expect("the new CA");
    let err = observe_from(&as_hub(&old_ca, a_tls.ca.cert_pem()), a_tls.broker)
        .await
        .expect_err("the old CA is refused");
    assert!(
        matches!(
            err.code(),
            Code::Unavailable | Code::Unknown | Code::Cancelled
        ),
        "refused at the TLS handshake: {err:?}"
    );
    observe_from(&as_hub(&new_ca_of_hub, a_tls.ca.cert_pem()), a_tls.broker)
        .await
        .expect("a certificate of the new CA is taken");

    // `diagnose --tls-dir` reads the hub's certificates there: every service's is of the new
    // CA, in time, and the move was announced.
    let s = &hub.services;
    let diagnosed = tokio::process::Command::new(
        trellis_integration::bin_path("trellisctl").expect("trellisctl is built"),
    )
    .args([
        "--discovery",
        &s.discovery.to_string(),
        "--broker",
        &s.broker.to_string(),
        "--forwarder",
        &s.forwarder.to_string(),
        "--ipam",
        &s.ipam.to_string(),
        "--gateway",
        &s.gateway.to_string(),
        "--endpoints",
        &s.endpoints.to_string(),
        "--output",
        "json",
        "diagnose",
        "--tls-dir",
        &dir.display().to_string(),
    ])
    .output()
    .await
    .expect("trellisctl runs");
    let report: serde_json::Value =
        serde_json::from_slice(&diagnosed.stdout).expect("diagnose prints JSON");
    let own: Vec<&serde_json::Value> = report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter(|f| f["check"] == "own_certificate" || f["check"] == "not_checked")
        .collect();
    assert!(own.is_empty(), "{own:#?}");
    assert!(
        report["checked"]["certificates"].as_u64().unwrap_or(0) >= 6,
        "the CA and five services' certificates: {report}"
    );

    // The mesh stands: full and induced tunnels, and the leaves still talk to the hub.
    for (from, to) in [(&a, "hub"), (&c, "hub"), (&a, "leaf-c"), (&c, "leaf-a")] {
        assert!(
            tunnel_to(from, to).await.is_some(),
            "{} lost its tunnel to {to}",
            from.id
        );
    }
    c.stop().await;
    a.stop().await;
    hub.stop().await;
}

/// The same move in network namespaces, every service a process of its own: the hub of two
/// leaves (no NAT) replaces its CA with `trellisctl certs rotate-ca` run in its namespace,
/// while a pod of leaf A sends a 10 ms UDP probe and two TCP streams to a pod of leaf C across
/// their induced tunnel. No probe is lost, no stream breaks, and both leaves pin the new CA.
/// Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`python3`; CI
/// runs as root and fails instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_ping_across_an_induced_tunnel_while_the_hub_moves_to_a_new_ca() {
    use trellis_integration::failover::{Flows, PodPair, measured, udp_probes};
    use trellis_netlab::cluster::StoreKind;
    use trellis_netlab::{Fabric, FabricOptions};

    let test = "pods_ping_across_an_induced_tunnel_while_the_hub_moves_to_a_new_ca";
    if !trellis_netlab::netns::can_run(test, &["ip", "nft", "ping", "python3"]) {
        return;
    }
    const HUB: usize = 0;
    const A: usize = 1;
    const C: usize = 2;
    let mut options = FabricOptions::three_clusters();
    options.names = ["hub", "a", "c"].map(str::to_owned).to_vec();
    options.hub = HUB;
    options.store = StoreKind::Memory;
    options.tls = true;
    let fabric = Fabric::up(options).await.expect("fabric");
    fabric
        .wait_mesh(LIMIT)
        .await
        .expect("the mesh over mutual TLS");
    let pinned_by = |i: usize| {
        let fabric = &fabric;
        async move {
            fabric.clusters[i]
                .discovery()
                .expect("discovery")
                .get_foreign_cluster(GetForeignClusterRequest {
                    cluster_id: "hub".into(),
                })
                .await
                .expect("the hub is known")
                .into_inner()
                .foreign_cluster
                .and_then(|fc| fc.full)
                .map(|full| full.ca_certificate)
                .unwrap_or_default()
        }
    };
    let dir = fabric.clusters[HUB].tls_dir().expect("TLS");
    let old = std::fs::read_to_string(dir.join("ca").join("ca.pem")).expect("the hub's CA");
    assert_eq!(pinned_by(A).await, old, "A pinned the hub's CA");

    let work = tempfile::tempdir().expect("tempdir");
    let pair = PodPair::start(&fabric, A, C, work.path(), LIMIT)
        .await
        .expect("A's pod reaches C's");
    let flows = Flows::start(
        &pair.from_pod,
        &pair.script,
        work.path(),
        "rotation",
        &pair.targets,
    )
    .expect("flows");
    tokio::time::sleep(Duration::from_secs(2)).await;

    let bin = trellis_integration::bin_path("trellisctl").expect("trellisctl is built");
    let hub = &fabric.clusters[HUB];
    let rotated = std::process::Command::new("ip")
        .args(["netns", "exec", &hub.ns])
        .arg(bin)
        .args([
            "--broker",
            &hub.addr(trellis_netlab::cluster::Service::Broker)
                .to_string(),
            "certs",
            "rotate-ca",
            "--tls-dir",
            &dir.display().to_string(),
            "--cluster-id",
            "hub",
            "--wait",
            "60s",
        ])
        .output()
        .expect("trellisctl runs");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&rotated.stderr),
        String::from_utf8_lossy(&rotated.stdout)
    );
    assert!(rotated.status.success(), "rotate-ca failed:\n{said}");
    eprintln!("rotate-ca said:\n{said}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let summary = flows.stop().expect("flows stop");
    let m = measured(&summary);
    let (sent, received) = udp_probes(&summary);
    eprintln!(
        "measured: probes {received}/{sent} across the CA move, longest probe gap {:.0} ms",
        m.probe_gap_ms
    );
    assert!(m.broken.is_empty(), "broken: {:?}", m.broken);
    assert!(
        sent > 100 && received + 1 >= sent,
        "probes lost while the hub moved to a new CA: {received} of {sent}"
    );
    let new = std::fs::read_to_string(dir.join("ca").join("ca.pem")).expect("the new CA");
    assert_ne!(new, old, "the hub's CA changed");
    for leaf in [A, C] {
        assert_eq!(pinned_by(leaf).await, new, "leaf {leaf} pins the new CA");
    }
}

/// `UpdatePeerCa` and `AnnounceCa` refuse what they must, clearly, and change nothing: a CA that
/// is no certificate, one naming another cluster, one far too long, a caller speaking for
/// another cluster; and both RPCs on a cluster without TLS. The well-formed call next to them
/// is taken (the positive control), and pins what it says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_peer_ca_is_refused_naming_the_field_and_nothing_changes() {
    use trellis_api::pb::peering::{AnnounceCaRequest, UpdatePeerCaRequest};

    let hub = InProcessCluster::start_tls("hub", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("the hub starts");
    let a = InProcessCluster::start_tls("leaf-a", "10.0.0.0/16", "10.202.0.0/16")
        .await
        .expect("leaf A starts");
    peer(&a, &hub).await;
    let hub_tls = hub.tls.as_ref().expect("tls");
    let a_tls = a.tls.as_ref().expect("tls");
    let as_a = a_tls.client("broker", &[&hub]).expect("A's identity");
    let mut broker = BrokerClient::new(
        peer_channel(
            &as_a,
            "test",
            &hub_tls.broker.to_string(),
            Some("hub"),
            Timeouts::default(),
            &Metrics::new(),
        )
        .expect("channel"),
    );
    let before = pinned(&hub, "leaf-a").await;
    assert_eq!(before, a_tls.ca.cert_pem(), "the hub pinned A's CA");
    let update = |id: &str, pem: String| UpdatePeerCaRequest {
        identity: Some(identity(id)),
        ca_certificate: pem,
    };
    let other = ClusterCa::generate("leaf-c").expect("a CA of another cluster");
    for (what, request, code, names) in [
        (
            "no certificate",
            update("leaf-a", "not a certificate".into()),
            Code::InvalidArgument,
            "ca_certificate",
        ),
        (
            "a CA of another cluster",
            update("leaf-a", other.cert_pem().to_owned()),
            Code::InvalidArgument,
            "ca_certificate",
        ),
        (
            "far too long",
            update("leaf-a", "x".repeat(20 * 1024)),
            Code::InvalidArgument,
            "ca_certificate",
        ),
        (
            "speaking for another cluster",
            update("leaf-c", other.cert_pem().to_owned()),
            Code::PermissionDenied,
            "leaf-a",
        ),
    ] {
        let err = broker.update_peer_ca(request).await.expect_err(what);
        assert_eq!(err.code(), code, "{what}: {err:?}");
        assert!(err.message().contains(names), "{what}: {err:?}");
        assert_eq!(
            pinned(&hub, "leaf-a").await,
            before,
            "{what} changed the pin"
        );
    }
    // The control: A's own next CA is taken and pinned.
    let (next, _) = a_tls.ca.next().expect("A's next CA");
    let taken = broker
        .update_peer_ca(update("leaf-a", next.cert_pem().to_owned()))
        .await
        .expect("A's own new CA")
        .into_inner();
    assert!(taken.changed);
    assert_eq!(pinned(&hub, "leaf-a").await, next.cert_pem());

    // Without TLS there is no CA to announce or pin.
    let plain = InProcessCluster::start("plain", "10.0.0.0/16", "10.203.0.0/16")
        .await
        .expect("a plaintext cluster starts");
    let mut local = plain.broker().await.expect("connects");
    let err = local
        .announce_ca(AnnounceCaRequest {})
        .await
        .expect_err("no TLS");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("mutual TLS"), "{err:?}");
    let err = local
        .update_peer_ca(update("leaf-a", next.cert_pem().to_owned()))
        .await
        .expect_err("no TLS");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    plain.stop().await;
    a.stop().await;
    hub.stop().await;
}
