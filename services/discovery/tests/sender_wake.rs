//! No retry tails (issue 17): a Neighborhood send that failed because the peer was not ready
//! waits for the peer, not for a backoff timer. The hub's sender runs with a backoff of an
//! hour; its first send to the leaf fails; once the leaf records the peering it sends the hub
//! a Neighborhood of its own, and that wakes the hub's send at once. In process, memory
//! stores, the hub's real core and gRPC routes, the leaf a whole discovery service.

// Tests spawn plainly: there is no service subscriber to keep (services/clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use clap::Parser as _;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use trellis_api::ClusterIdentity;
use trellis_api::pb::discovery::ListForeignClustersRequest;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::types as pb;
use trellis_discovery::core::PeeringUpdate;
use trellis_discovery::neighborhood::SenderTiming;
use trellis_discovery::records::Addresses;
use trellis_discovery::{Config, Discovery, start};
use trellis_runtime::Shutdown;
use trellis_runtime::peer::Authz;
use trellis_store::MemoryStore;
use trellis_testkit::eventually;
use trellis_testkit::peering::full_peering;

const HOUR: Duration = Duration::from_secs(3600);
const LIMIT: Duration = Duration::from_secs(60);

fn identity(id: &str) -> ClusterIdentity {
    ClusterIdentity::parse("id", id, "name", "").expect("identity")
}

/// The hub records `id` as a networked full peer whose discovery is at `discovery`.
async fn record_peer(hub: &Discovery, id: &str, discovery: &str) {
    hub.update_peering(&PeeringUpdate {
        identity: identity(id),
        peered: true,
        addresses: Addresses {
            discovery: discovery.to_owned(),
            ..Addresses::default()
        },
        outgoing: true,
        incoming: true,
        networking: true,
        reason: String::new(),
        message: String::new(),
        expected_revision: 0,
        ca_certificate: String::new(),
    })
    .await
    .expect("peering recorded");
}

/// A listener that accepts and at once drops every connection, counting them: a peer that is
/// there but refuses to talk.
async fn slamming() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("address");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            drop(socket);
        }
    });
    (addr, accepted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_that_failed_is_retried_when_the_peer_speaks_not_after_its_backoff() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();

    // The hub: core, gRPC routes, and a sender that backs off for an hour after a failure.
    let hub = Arc::new(
        Discovery::open(
            Arc::new(MemoryStore::new()),
            identity("hub"),
            Addresses::default(),
        )
        .await
        .expect("hub opens"),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let hub_addr = listener.local_addr().expect("address");
    let routes = trellis_discovery::routes(hub.clone(), Duration::from_secs(10), Authz::off());
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.cancelled_owned())
            .await
    });
    tokio::spawn(trellis_discovery::neighborhood::run(
        hub.clone(),
        SenderTiming {
            resync: HOUR,
            retry_initial: HOUR,
            retry_max: HOUR,
        },
        shutdown.clone(),
    ));

    // The leaf: a whole discovery service.
    let config = Config::try_parse_from([
        "trellis-discovery",
        "--store",
        "memory://",
        "--insecure-plaintext-peering",
        "--cluster-id",
        "leaf",
        "--listen",
        "127.0.0.1:0",
    ])
    .expect("config parses");
    let leaf = start(config, shutdown.clone()).await.expect("leaf starts");
    let mut leaf_client = DiscoveryClient::connect(format!("http://{}", leaf.addr))
        .await
        .expect("connects");

    // The hub peers with leaf-a (never reached) and the leaf, first known at an address that
    // refuses to talk: the hub's first send fails and backs off for an hour.
    record_peer(
        &hub,
        "leaf-a",
        &format!("127.0.0.1:{}", trellis_testkit::free_port()),
    )
    .await;
    let (refusing, attempts) = slamming().await;
    record_peer(&hub, "leaf", &refusing.to_string()).await;
    eventually("the hub to try the leaf", LIMIT, || async {
        (attempts.load(Ordering::SeqCst) > 0).then_some(())
    })
    .await;
    // The leaf's real address; the hub's send is still in its backoff.
    record_peer(&hub, "leaf", &leaf.addr.to_string()).await;

    // The leaf records the peering and, as every cluster does, sends the hub its own
    // (empty) Neighborhood: the hub's send follows at once, an hour early.
    leaf_client
        .update_peering(full_peering(
            pb::ClusterIdentity {
                cluster_id: "hub".into(),
                cluster_name: String::new(),
            },
            pb::ServiceAddresses {
                discovery: hub_addr.to_string(),
                ..Default::default()
            },
        ))
        .await
        .expect("leaf records the hub");
    eventually(
        "the hub's Neighborhood to reach the leaf (still backing off?)",
        LIMIT,
        || {
            let mut leaf_client = leaf_client.clone();
            async move {
                let induced = leaf_client
                    .list_foreign_clusters(ListForeignClustersRequest {
                        kind: pb::PeeringKind::Induced as i32,
                    })
                    .await
                    .expect("lists")
                    .into_inner()
                    .foreign_clusters;
                induced
                    .iter()
                    .any(|fc| {
                        fc.identity
                            .as_ref()
                            .is_some_and(|i| i.cluster_id == "leaf-a")
                    })
                    .then_some(())
            }
        },
    )
    .await;
}
