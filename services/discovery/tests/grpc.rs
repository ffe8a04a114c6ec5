//! The gRPC boundary, in process on memory stores: validation (errors name the field and
//! nothing is stored), peering, Neighborhood exchange between several running services, the
//! resumable watch, and manual discovery.

// Tests spawn plainly: there is no service subscriber to keep (services/clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::time::{Duration, Instant};

use clap::Parser as _;
use tokio_stream::StreamExt as _;
use tonic::Code;
use tonic::transport::Channel;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::*;
use trellis_api::pb::types::{
    ClusterIdentity, ConditionStatus, ForeignCluster, Neighbor, Neighborhood, PeeringKind,
    ServiceAddresses, WatchEventType,
};
use trellis_api::peers::Condition;
use trellis_discovery::{Config, Started, start};
use trellis_runtime::Shutdown;
use trellis_testkit::peering::full_peering;

struct Cluster {
    id: String,
    started: Started,
    client: DiscoveryClient<Channel>,
    _stop: Guard,
}

/// Cancels the service's shutdown token when the test ends.
struct Guard(Shutdown);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

async fn cluster(id: &str) -> Cluster {
    cluster_at(id, "127.0.0.1:0").await
}

async fn cluster_at(id: &str, listen: &str) -> Cluster {
    cluster_with(id, listen, &[]).await
}

async fn cluster_with(id: &str, listen: &str, extra: &[&str]) -> Cluster {
    // Logs go to the test's captured output, shown when it fails.
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let mut args = vec![
        "trellis-discovery",
        "--store",
        "memory://",
        "--insecure-plaintext-peering",
        "--cluster-id",
        id,
        "--listen",
        listen,
        "--neighborhood-resync",
        "1",
        "--neighborhood-retry-max",
        "1",
        "--watch-bookmark",
        "1",
    ];
    args.extend_from_slice(extra);
    let config = Config::try_parse_from(args).expect("config parses");
    let shutdown = Shutdown::new();
    let started = start(config, shutdown.clone()).await.expect("starts");
    let client = DiscoveryClient::connect(format!("http://{}", started.addr))
        .await
        .expect("connects");
    Cluster {
        id: id.to_owned(),
        started,
        client,
        _stop: Guard(shutdown),
    }
}

fn ident(id: &str) -> Option<ClusterIdentity> {
    Some(ClusterIdentity {
        cluster_id: id.into(),
        cluster_name: format!("{id} name"),
    })
}

/// Marks `peer` as a full peer with networking on `on`.
async fn peer(on: &mut Cluster, peer: &Cluster) {
    peer_with(on, &peer.id, &peer.started.addr.to_string(), true).await;
}

async fn peer_with(on: &mut Cluster, id: &str, discovery: &str, peered: bool) {
    on.client
        .update_peering(UpdatePeeringRequest {
            identity: ident(id),
            peered,
            ..full_peering(
                ClusterIdentity::default(),
                ServiceAddresses {
                    discovery: discovery.into(),
                    ..Default::default()
                },
            )
        })
        .await
        .expect("update peering");
}

async fn list(c: &Cluster) -> Vec<ForeignCluster> {
    c.client
        .clone()
        .list_foreign_clusters(ListForeignClustersRequest { kind: 0 })
        .await
        .expect("lists")
        .into_inner()
        .foreign_clusters
}

fn condition(fc: &ForeignCluster, kind: Condition) -> Option<ConditionStatus> {
    fc.conditions
        .iter()
        .find(|c| c.r#type == kind.as_str())
        .and_then(|c| ConditionStatus::try_from(c.status).ok())
}

fn id_of(fc: &ForeignCluster) -> &str {
    fc.identity.as_ref().map_or("", |i| i.cluster_id.as_str())
}

/// The active induced records on `c`, as (id, origin) pairs.
async fn induced(c: &Cluster) -> Vec<(String, String)> {
    list(c)
        .await
        .iter()
        .filter(|fc| fc.kind == PeeringKind::Induced as i32)
        .filter(|fc| condition(fc, Condition::Withdrawn) != Some(ConditionStatus::True))
        .map(|fc| {
            let origin = fc
                .induced
                .as_ref()
                .and_then(|i| i.origin.as_ref())
                .map_or(String::new(), |o| o.cluster_id.clone());
            (id_of(fc).to_owned(), origin)
        })
        .collect()
}

/// Polls `c`'s active induced records until they equal `want` (a generous deadline).
async fn wait_induced(c: &Cluster, want: &[(&str, &str)], what: &str) {
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect();
    trellis_testkit::eventually_eq(what, Duration::from_secs(20), want, || induced(c)).await;
}

fn neighborhood(
    sender: &str,
    recipient: &str,
    neighbors: &[&str],
    generation: i64,
) -> PublishNeighborhoodRequest {
    PublishNeighborhoodRequest {
        neighborhood: Some(Neighborhood {
            sender: ident(sender),
            recipient: ident(recipient),
            neighbors: neighbors
                .iter()
                .map(|n| Neighbor {
                    identity: ident(n),
                    addresses: Some(ServiceAddresses::default()),
                })
                .collect(),
            generation,
            create_time: None,
        }),
    }
}

#[tokio::test]
async fn get_identity_returns_the_configured_identity_and_address() {
    let mut a = cluster("leaf-a").await;
    let got = a
        .client
        .get_identity(GetIdentityRequest {})
        .await
        .expect("answers")
        .into_inner();
    assert_eq!(got.identity.expect("identity").cluster_id, "leaf-a");
    assert_eq!(
        got.addresses.expect("addresses").discovery,
        a.started.addr.to_string()
    );
}

#[tokio::test]
async fn bad_neighborhoods_are_refused_and_nothing_is_stored() {
    let mut a = cluster("a").await;
    // "hub" is a networked full peer of a; "stranger" is not.
    peer_with(&mut a, "hub", "127.0.0.1:1", true).await;
    let before = list(&a).await;

    let mut bad_address = neighborhood("hub", "a", &["c"], 5);
    if let Some(n) = bad_address.neighborhood.as_mut() {
        n.neighbors[0].addresses = Some(ServiceAddresses {
            broker: "http://c:7102".into(),
            ..Default::default()
        });
    }
    let mut bad_id = neighborhood("hub", "a", &["c"], 5);
    if let Some(n) = bad_id.neighborhood.as_mut() {
        n.neighbors[0].identity = ident("c/../x");
    }
    let cases = [
        (
            neighborhood("hub", "a", &["c", "a"], 5),
            Code::InvalidArgument,
            "neighborhood.neighbors[1].identity.cluster_id",
        ),
        (
            neighborhood("hub", "a", &["c", "d", "c"], 5),
            Code::InvalidArgument,
            "neighborhood.neighbors[2].identity.cluster_id",
        ),
        (
            neighborhood("hub", "a", &["hub"], 5),
            Code::InvalidArgument,
            "neighborhood.neighbors[0].identity.cluster_id",
        ),
        (
            neighborhood("hub", "someone-else", &["c"], 5),
            Code::InvalidArgument,
            "neighborhood.recipient.cluster_id",
        ),
        (
            neighborhood("hub", "a", &["c"], 0),
            Code::InvalidArgument,
            "neighborhood.generation",
        ),
        (
            bad_address,
            Code::InvalidArgument,
            "neighborhood.neighbors[0].addresses.broker",
        ),
        (
            bad_id,
            Code::InvalidArgument,
            "neighborhood.neighbors[0].identity.cluster_id",
        ),
        (
            neighborhood("stranger", "a", &["c"], 5),
            Code::PermissionDenied,
            "stranger",
        ),
        (
            PublishNeighborhoodRequest { neighborhood: None },
            Code::InvalidArgument,
            "neighborhood",
        ),
    ];
    for (request, code, mentions) in cases {
        let err = a
            .client
            .publish_neighborhood(request.clone())
            .await
            .expect_err("refused");
        assert_eq!(err.code(), code, "{request:?}: {err:?}");
        assert!(
            err.message().contains(mentions),
            "{mentions:?} not in {:?}",
            err.message()
        );
    }
    let after = list(&a).await;
    assert_eq!(before, after, "a refused Neighborhood changes nothing");

    // A sender that was a peer but no longer has networking is refused too.
    a.client
        .update_peering(UpdatePeeringRequest {
            identity: ident("hub"),
            peered: true,
            networking_enabled: false,
            ..Default::default()
        })
        .await
        .expect("update");
    let err = a
        .client
        .publish_neighborhood(neighborhood("hub", "a", &["c"], 6))
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::PermissionDenied);
    assert!(induced(&a).await.is_empty());
}

#[tokio::test]
async fn neighborhoods_create_refresh_ignore_stale_and_withdraw() {
    let mut a = cluster("a").await;
    peer_with(&mut a, "hub", "127.0.0.1:1", true).await;
    // "c" is also a direct full peer of a: never turned induced.
    peer_with(&mut a, "c", "127.0.0.1:2", true).await;

    let r = a
        .client
        .publish_neighborhood(neighborhood("hub", "a", &["c", "d", "e"], 10))
        .await
        .expect("applied")
        .into_inner();
    assert!(r.applied);
    assert_eq!(r.current_generation, 10);
    let mut got = induced(&a).await;
    got.sort();
    assert_eq!(
        got,
        [
            ("d".to_owned(), "hub".to_owned()),
            ("e".into(), "hub".into())
        ]
    );

    // An equal generation is an idempotent re-send: nothing changes, not even revisions.
    let revision_before = a
        .client
        .list_foreign_clusters(ListForeignClustersRequest { kind: 0 })
        .await
        .expect("lists")
        .into_inner()
        .revision;
    let r = a
        .client
        .publish_neighborhood(neighborhood("hub", "a", &["c", "d", "e"], 10))
        .await
        .expect("applied")
        .into_inner();
    assert!(r.applied);
    let revision_after = a
        .client
        .list_foreign_clusters(ListForeignClustersRequest { kind: 0 })
        .await
        .expect("lists")
        .into_inner()
        .revision;
    assert_eq!(revision_before, revision_after);

    // A stale generation is ignored.
    let r = a
        .client
        .publish_neighborhood(neighborhood("hub", "a", &[], 9))
        .await
        .expect("answered")
        .into_inner();
    assert!(!r.applied);
    assert_eq!(r.current_generation, 10);
    assert_eq!(induced(&a).await.len(), 2);

    // Dropping e withdraws it (the record stays, Withdrawn=True).
    a.client
        .publish_neighborhood(neighborhood("hub", "a", &["d"], 11))
        .await
        .expect("applied");
    assert_eq!(induced(&a).await, [("d".to_owned(), "hub".to_owned())]);
    let e = a
        .client
        .get_foreign_cluster(GetForeignClusterRequest {
            cluster_id: "e".into(),
        })
        .await
        .expect("e still listed")
        .into_inner()
        .foreign_cluster
        .expect("record");
    assert_eq!(
        condition(&e, Condition::Withdrawn),
        Some(ConditionStatus::True)
    );
    assert_eq!(
        condition(&e, Condition::InducedPeering),
        Some(ConditionStatus::False)
    );

    // The hub unpeering withdraws everything it introduced.
    peer_with(&mut a, "hub", "127.0.0.1:1", false).await;
    assert!(induced(&a).await.is_empty());
    // A withdrawn induced record may be removed; an active full peer may not.
    let removed = a
        .client
        .remove_foreign_cluster(RemoveForeignClusterRequest {
            cluster_id: "e".into(),
        })
        .await
        .expect("removes")
        .into_inner();
    assert!(removed.removed);
    let err = a
        .client
        .remove_foreign_cluster(RemoveForeignClusterRequest {
            cluster_id: "c".into(),
        })
        .await
        .expect_err("peered");
    assert_eq!(err.code(), Code::FailedPrecondition);
}

#[tokio::test]
async fn a_hub_sends_neighborhoods_and_withdraws_on_unpeer() {
    let mut b = cluster("b").await;
    let mut a = cluster("a").await;
    let mut c = cluster("c").await;
    let mut d = cluster("d").await;
    for leaf in [&mut a, &mut c, &mut d] {
        let hub_addr = b.started.addr.to_string();
        peer_with(leaf, "b", &hub_addr, true).await;
    }
    peer(&mut b, &a).await;
    peer(&mut b, &c).await;
    peer(&mut b, &d).await;

    wait_induced(&a, &[("c", "b"), ("d", "b")], "a learns c and d").await;
    wait_induced(&c, &[("a", "b"), ("d", "b")], "c learns a and d").await;

    // Unpeering d on the hub withdraws d on a and c, and everything on d.
    peer_with(&mut b, "d", &d.started.addr.to_string(), false).await;
    wait_induced(&a, &[("c", "b")], "a drops d").await;
    wait_induced(&c, &[("a", "b")], "c drops d").await;
    wait_induced(&d, &[], "d is told its neighborhood is empty").await;
}

#[tokio::test]
async fn the_sender_retries_an_unreachable_peer_until_it_answers() {
    let mut b = cluster("b").await;
    let mut a = cluster("a").await;
    peer(&mut b, &a).await;
    peer_with(&mut a, "b", &b.started.addr.to_string(), true).await;
    // c's discovery is not up yet: b keeps retrying it.
    let c_addr = trellis_testkit::free_port();
    let c_addr = format!("127.0.0.1:{c_addr}");
    peer_with(&mut b, "c", &c_addr, true).await;
    wait_induced(&a, &[("c", "b")], "a learns c even though c is down").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Now c comes up on that address and peers with b: it gets its Neighborhood.
    let mut c = cluster_at("c", &c_addr).await;
    peer_with(&mut c, "b", &b.started.addr.to_string(), true).await;
    wait_induced(&c, &[("a", "b")], "c learns a after its retries succeed").await;
}

#[tokio::test]
async fn watch_snapshots_then_follows_and_resumes_without_gaps_or_repeats() {
    let mut a = cluster("a").await;
    peer_with(&mut a, "p1", "127.0.0.1:1", true).await;
    let mut stream = a
        .client
        .watch_foreign_clusters(WatchForeignClustersRequest {
            start_revision: 0,
            kind: 0,
        })
        .await
        .expect("watches")
        .into_inner();
    let first = stream.next().await.expect("event").expect("ok");
    assert_eq!(first.r#type, WatchEventType::Added as i32);
    assert_eq!(id_of(first.foreign_cluster.as_ref().expect("fc")), "p1");
    let mark = stream.next().await.expect("event").expect("ok");
    assert_eq!(mark.r#type, WatchEventType::Bookmark as i32);
    assert_eq!(mark.revision, first.revision);

    peer_with(&mut a, "p2", "127.0.0.1:2", true).await;
    let added = stream.next().await.expect("event").expect("ok");
    assert_eq!(added.r#type, WatchEventType::Added as i32);
    assert_eq!(id_of(added.foreign_cluster.as_ref().expect("fc")), "p2");
    drop(stream);

    // While disconnected: p2 unpeered, p3 added, p3 removed... (p3 must be unpeered to go).
    peer_with(&mut a, "p2", "127.0.0.1:2", false).await;
    peer_with(&mut a, "p3", "127.0.0.1:3", true).await;
    peer_with(&mut a, "p3", "127.0.0.1:3", false).await;
    a.client
        .remove_foreign_cluster(RemoveForeignClusterRequest {
            cluster_id: "p3".into(),
        })
        .await
        .expect("removes");

    let mut resumed = a
        .client
        .watch_foreign_clusters(WatchForeignClustersRequest {
            start_revision: added.revision + 1,
            kind: 0,
        })
        .await
        .expect("watches")
        .into_inner();
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let e = resumed.next().await.expect("event").expect("ok");
        if e.r#type == WatchEventType::Bookmark as i32 {
            continue;
        }
        seen.push((
            WatchEventType::try_from(e.r#type).expect("type"),
            id_of(e.foreign_cluster.as_ref().expect("fc")).to_owned(),
            e.revision,
        ));
    }
    let kinds: Vec<_> = seen.iter().map(|(k, id, _)| (*k, id.as_str())).collect();
    assert_eq!(
        kinds,
        [
            (WatchEventType::Modified, "p2"),
            (WatchEventType::Added, "p3"),
            (WatchEventType::Modified, "p3"),
            (WatchEventType::Deleted, "p3"),
        ]
    );
    assert!(
        seen.windows(2).all(|w| w[0].2 < w[1].2),
        "revision order: {seen:?}"
    );
    // Nothing else is pending: no change is repeated (bookmarks carry no record).
    let quiet = Instant::now() + Duration::from_millis(1500);
    while let Ok(next) = tokio::time::timeout_at(quiet.into(), resumed.next()).await {
        let next = next.expect("event").expect("ok");
        assert_eq!(next.r#type, WatchEventType::Bookmark as i32, "{next:?}");
    }
}

#[tokio::test]
async fn filtered_watch_reports_an_induced_record_turning_full_as_delete_and_add() {
    let mut a = cluster("a").await;
    peer_with(&mut a, "hub", "127.0.0.1:1", true).await;
    let watch = |kind: PeeringKind| {
        let mut client = a.client.clone();
        async move {
            client
                .watch_foreign_clusters(WatchForeignClustersRequest {
                    start_revision: 0,
                    kind: kind as i32,
                })
                .await
                .expect("watches")
                .into_inner()
        }
    };
    let mut induced_only = watch(PeeringKind::Induced).await;
    let mut full_only = watch(PeeringKind::Full).await;
    async fn next(
        s: &mut tonic::Streaming<WatchForeignClustersResponse>,
    ) -> WatchForeignClustersResponse {
        s.next().await.expect("event").expect("ok")
    }
    // Snapshots: the induced watch is empty, the full one has the hub.
    assert_eq!(
        next(&mut induced_only).await.r#type,
        WatchEventType::Bookmark as i32
    );
    assert_eq!(
        next(&mut full_only).await.r#type,
        WatchEventType::Added as i32
    );
    assert_eq!(
        next(&mut full_only).await.r#type,
        WatchEventType::Bookmark as i32
    );

    a.client
        .publish_neighborhood(neighborhood("hub", "a", &["x"], 1))
        .await
        .expect("applied");
    let e = next(&mut induced_only).await;
    assert_eq!(
        (e.r#type, id_of(e.foreign_cluster.as_ref().expect("fc"))),
        (WatchEventType::Added as i32, "x")
    );

    // a peers with x directly: it leaves the induced watch and enters the full one.
    peer_with(&mut a, "x", "127.0.0.1:9", true).await;
    let e = next(&mut induced_only).await;
    assert_eq!(
        (e.r#type, id_of(e.foreign_cluster.as_ref().expect("fc"))),
        (WatchEventType::Deleted as i32, "x")
    );
    let e = loop {
        let e = next(&mut full_only).await;
        if e.r#type != WatchEventType::Bookmark as i32 {
            break e;
        }
    };
    assert_eq!(
        (e.r#type, id_of(e.foreign_cluster.as_ref().expect("fc"))),
        (WatchEventType::Added as i32, "x")
    );
}

#[tokio::test]
async fn manual_discovery_learns_the_remote_identity_and_never_peers() {
    let mut a = cluster("a").await;
    let b = cluster("b").await;
    let added = a
        .client
        .add_foreign_cluster(AddForeignClusterRequest {
            discovery_address: b.started.addr.to_string(),
            expected_cluster_id: String::new(),
        })
        .await
        .expect("adds")
        .into_inner()
        .foreign_cluster
        .expect("record");
    assert_eq!(id_of(&added), "b");
    assert_eq!(added.kind, PeeringKind::Full as i32);
    assert_eq!(
        condition(&added, Condition::Discovered),
        Some(ConditionStatus::True)
    );
    assert_eq!(condition(&added, Condition::Peered), None);

    let err = a
        .client
        .add_foreign_cluster(AddForeignClusterRequest {
            discovery_address: b.started.addr.to_string(),
            expected_cluster_id: "not-b".into(),
        })
        .await
        .expect_err("wrong id");
    assert_eq!(err.code(), Code::FailedPrecondition);
    let err = a
        .client
        .add_foreign_cluster(AddForeignClusterRequest {
            discovery_address: a.started.addr.to_string(),
            expected_cluster_id: String::new(),
        })
        .await
        .expect_err("ourselves");
    assert_eq!(err.code(), Code::FailedPrecondition);
    for bad in ["", "b", "http://127.0.0.1:1", "127.0.0.1:0"] {
        let err = a
            .client
            .add_foreign_cluster(AddForeignClusterRequest {
                discovery_address: bad.into(),
                expected_cluster_id: String::new(),
            })
            .await
            .expect_err("malformed");
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}");
        assert!(err.message().contains("discovery_address"), "{err:?}");
    }
    assert_eq!(list(&a).await.len(), 1);
}

/// A FAKE `Discovery` server (a real one never answers this way): every `PublishNeighborhood`
/// is answered "stale" with the configured `current_generation`, and counted.
mod stale_peer {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio_stream::Stream;
    use tonic::{Request, Response, Status};
    use trellis_api::pb::discovery::discovery_server::{Discovery, DiscoveryServer};
    use trellis_api::pb::discovery::*;

    pub(crate) struct Fake {
        pub(crate) calls: Arc<AtomicUsize>,
        pub(crate) current_generation: i64,
    }

    type Watch = Pin<Box<dyn Stream<Item = Result<WatchForeignClustersResponse, Status>> + Send>>;

    #[tonic::async_trait]
    impl Discovery for Fake {
        async fn get_identity(
            &self,
            _: Request<GetIdentityRequest>,
        ) -> Result<Response<GetIdentityResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn add_foreign_cluster(
            &self,
            _: Request<AddForeignClusterRequest>,
        ) -> Result<Response<AddForeignClusterResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn remove_foreign_cluster(
            &self,
            _: Request<RemoveForeignClusterRequest>,
        ) -> Result<Response<RemoveForeignClusterResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn get_foreign_cluster(
            &self,
            _: Request<GetForeignClusterRequest>,
        ) -> Result<Response<GetForeignClusterResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn list_foreign_clusters(
            &self,
            _: Request<ListForeignClustersRequest>,
        ) -> Result<Response<ListForeignClustersResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
        type WatchForeignClustersStream = Watch;
        async fn watch_foreign_clusters(
            &self,
            _: Request<WatchForeignClustersRequest>,
        ) -> Result<Response<Watch>, Status> {
            Err(Status::unimplemented("fake"))
        }
        async fn publish_neighborhood(
            &self,
            _: Request<PublishNeighborhoodRequest>,
        ) -> Result<Response<PublishNeighborhoodResponse>, Status> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Ok(Response::new(PublishNeighborhoodResponse {
                applied: false,
                current_generation: self.current_generation,
            }))
        }
        async fn update_peering(
            &self,
            _: Request<UpdatePeeringRequest>,
        ) -> Result<Response<UpdatePeeringResponse>, Status> {
            Err(Status::unimplemented("fake"))
        }
    }

    /// Serves the fake on a free loopback port; returns its address and call counter.
    pub(crate) async fn serve(current_generation: i64) -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binds");
        let addr = listener.local_addr().expect("address").to_string();
        let calls = Arc::new(AtomicUsize::new(0));
        let fake = Fake {
            calls: calls.clone(),
            current_generation,
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DiscoveryServer::new(fake))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (addr, calls)
    }
}

/// A peer that always answers "stale" (with an absurd or a plausible generation) must neither
/// crash the hub's sender (`i64::MAX + 1`) nor make it spin: after repeated stale answers it
/// backs off like after a failure. The bound is loose (the backoff here is at most 1 s, so a
/// few calls a second); a spinning sender makes thousands.
#[tokio::test]
async fn a_peer_answering_stale_forever_is_backed_off_and_cannot_overflow_the_sender() {
    for current_generation in [i64::MAX, 5] {
        let mut hub = cluster("hub").await;
        let (addr, calls) = stale_peer::serve(current_generation).await;
        peer_with(&mut hub, "liar", &addr, true).await;
        // Another, honest peer joins later: the sender must still be alive to tell it.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let seen = calls.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            seen <= 40,
            "current_generation {current_generation}: {seen} PublishNeighborhood calls in 3 s; the sender spins"
        );
        assert!(
            seen >= 2,
            "current_generation {current_generation}: only {seen} call(s) in 3 s; the sender stopped retrying (crashed?)"
        );
        let mut honest = cluster("honest").await;
        peer(&mut hub, &honest).await;
        peer_with(&mut honest, "hub", &hub.started.addr.to_string(), true).await;
        wait_induced(
            &honest,
            &[("liar", "hub")],
            "the sender still serves other peers",
        )
        .await;
    }
}

/// A hub may introduce at most `--max-induced-per-hub` clusters (issue 15, item 10): a larger
/// Neighborhood is refused whole, naming the field, and changes nothing; one within the cap
/// is applied.
#[tokio::test]
async fn a_neighborhood_introducing_more_than_the_cap_is_refused_whole() {
    let mut a = cluster_with("a", "127.0.0.1:0", &["--max-induced-per-hub", "2"]).await;
    peer_with(&mut a, "hub", "127.0.0.1:1", true).await;
    let err = a
        .client
        .publish_neighborhood(neighborhood("hub", "a", &["c", "d", "e"], 5))
        .await
        .expect_err("over the cap");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("neighborhood.neighbors"), "{err:?}");
    assert!(err.message().contains("at most 2"), "{err:?}");
    assert!(induced(&a).await.is_empty());
    a.client
        .publish_neighborhood(neighborhood("hub", "a", &["c", "d"], 6))
        .await
        .expect("within the cap");
    wait_induced(&a, &[("c", "hub"), ("d", "hub")], "two introductions").await;
    assert!(Config::try_parse_from(["trellis-discovery", "--max-induced-per-hub", "0"]).is_err());
}

/// Issue 19: withdrawn records do not pile up. With `--tombstone-retention 1` a leaf keeps an
/// induced record its hub withdrew, and the hub's own record after unpeering, for about a
/// second (still listed, `Withdrawn=True`), then deletes them; live records stay.
#[tokio::test]
async fn withdrawn_records_are_collected_after_the_retention_and_live_ones_stay() {
    let mut b = cluster("b").await;
    let mut a = cluster_with("a", "127.0.0.1:0", &["--tombstone-retention", "1"]).await;
    let c = cluster("c").await;
    let d = cluster("d").await;
    let hub_addr = b.started.addr.to_string();
    peer_with(&mut a, "b", &hub_addr, true).await;
    peer(&mut b, &a).await;
    peer(&mut b, &c).await;
    peer(&mut b, &d).await;
    wait_induced(&a, &[("c", "b"), ("d", "b")], "a learns c and d").await;

    let ids = |fcs: &[ForeignCluster]| -> Vec<String> {
        let mut ids: Vec<String> = fcs.iter().map(|fc| id_of(fc).to_owned()).collect();
        ids.sort();
        ids
    };
    // The hub drops d: a withdraws it, keeps the tombstone a while, then forgets it.
    peer_with(&mut b, "d", &d.started.addr.to_string(), false).await;
    wait_induced(&a, &[("c", "b")], "a withdraws d").await;
    let forgotten = Duration::from_secs(30);
    let want = vec!["b".into(), "c".into()];
    trellis_testkit::eventually_eq("a to forget d", forgotten, want, || async {
        ids(&list(&a).await)
    })
    .await;

    // a unpeers the hub: the hub's record and what it introduced are withdrawn, then go.
    peer_with(&mut a, "b", &hub_addr, false).await;
    let withdrawn = list(&a).await;
    assert!(
        withdrawn.iter().any(|fc| id_of(fc) == "b"
            && condition(fc, Condition::Withdrawn) == Some(ConditionStatus::True)),
        "the tombstone is kept for the retention first: {withdrawn:?}"
    );
    trellis_testkit::eventually_eq("a to forget b", forgotten, Vec::new(), || async {
        ids(&list(&a).await)
    })
    .await;
    // Without the flag (the default retention) nothing is collected this fast.
    assert!(
        list(&b).await.iter().any(|fc| id_of(fc) == "d"),
        "the hub keeps d's tombstone for the default retention"
    );
}
