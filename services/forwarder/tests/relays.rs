//! The forwarder's relays against both store backends, in the style of the store conformance
//! suite: each case is a function taking a fresh, empty store, and [`cases!`] runs it once on
//! the memory store and once on a real etcd process (trellis-testkit; skipped loudly without
//! etcd, failed in CI).
//!
//! The hub's discovery service is the real one (its core and gRPC routes, on loopback), with
//! its full peerings recorded through `Discovery::update_peering`, as the broker does after a
//! handshake. The peers' brokers are [`FakeBroker`]s: a real broker needs a whole cluster
//! behind it (IPAM, gateway, an induced record of the origin), which `tests/integration`
//! covers end to end; here they only have to answer, refuse or stay silent on demand.

// Tests spawn plainly: there is no service subscriber to keep (services/clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};
use trellis_api::model::{Addresses, NetworkSpec};
use trellis_api::pb::peering as ppb;
use trellis_api::pb::peering::broker_server::{Broker as BrokerApi, BrokerServer};
use trellis_api::pb::types as pb;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_discovery::Discovery;
use trellis_discovery::core::PeeringUpdate;
use trellis_forwarder::core::{Delivery, Forwarder, OriginWait, Passthrough};
use trellis_forwarder::records::{RELAYS_PREFIX, RelayRecord, State, encode, now_nanos, relay_key};
use trellis_runtime::Shutdown;
use trellis_runtime::peer::Authz;
use trellis_store::metered::StoreMetrics;
use trellis_store::{MemoryStore, SharedStore};
use trellis_testkit::{Etcd, eventually};

/// Runs each case on both backends, as `trellis_store::conformance_tests!` does.
macro_rules! cases {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let store: trellis_store::SharedStore =
                        std::sync::Arc::new(trellis_store::MemoryStore::new());
                    super::$case(store).await;
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let Some(etcd) = trellis_testkit::Etcd::start_or_skip() else {
                        return;
                    };
                    let store = super::etcd_store(&etcd).await;
                    super::$case(store).await;
                }
            )*
        }
    };
}

cases!(
    ids_containing_the_old_separator_keep_separate_relays,
    old_layout_relays_are_migrated_and_served,
    a_dead_destination_does_not_hold_up_the_others,
    failed_relays_are_collected_after_the_retention,
    a_relay_refused_while_the_other_way_arrives_is_retried_at_once,
    relays_are_authorized_from_the_watched_copy_which_never_refuses_alone,
    an_origin_that_stopped_waiting_gets_the_status_reported,
    a_relay_answered_in_its_reply_writes_nothing,
    an_origin_that_stops_waiting_is_answered_once_the_relay_is_stored,
    a_withdrawal_during_a_first_attempt_is_not_undone_by_its_retry,
    a_relay_whose_caller_gave_up_does_not_hold_back_its_withdrawal,
    a_relay_answered_in_its_reply_reads_nothing_once_the_store_is_listed,
    a_relay_stored_by_another_forwarder_is_read_once_a_write_shows_it,
);

/// The forwarder's store on a fresh etcd, through a prefixed URL as the services use it.
async fn etcd_store(etcd: &Etcd) -> SharedStore {
    trellis_store::open(&etcd.url("forwarder"))
        .await
        .unwrap_or_else(|err| panic!("{err}; etcd log:\n{}", etcd.log_tail(20)))
}

/// Long enough for anything that must happen on a loaded CI machine.
const LIMIT: Duration = Duration::from_secs(60);

fn identity(id: &str) -> ClusterIdentity {
    ClusterIdentity::parse("cluster_id", id, "cluster_name", &format!("name-{id}"))
        .expect("valid identity")
}

fn id(s: &str) -> ClusterId {
    ClusterId::parse("cluster_id", s).expect("valid id")
}

/// A distinct spec per `n`, so records can be told apart by content.
/// `origin`'s first NetworkConfig (generation 1, holding none of `destination`'s), spec `n`.
fn passthrough(origin: &str, destination: &str, n: u8) -> Passthrough {
    Passthrough {
        origin: identity(origin),
        destination: identity(destination),
        spec: spec(n),
        generation: 1,
        held_generation: 0,
    }
}

fn spec(n: u8) -> NetworkSpec {
    NetworkSpec::from_proto(
        "spec",
        Some(&pb::NetworkConfigSpec {
            pod_cidr: format!("10.{n}.0.0/16"),
            external_cidr: format!("10.{}.0.0/16", 100 + n),
            endpoint: format!("192.0.2.{n}:51840"),
            public_key: "AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=".into(),
            // Odd specs offer the stateless wire convention: records that carry it intact
            // compare equal.
            stateless_wire: n % 2 == 1,
        }),
    )
    .expect("valid spec")
}

/// A loopback address nothing listens on: connections are refused at once.
fn refusing() -> String {
    format!("127.0.0.1:{}", trellis_testkit::free_port())
}

/// What one [`FakeBroker`] received.
#[derive(Debug, Default, Clone)]
struct Received {
    /// Submitted NetworkConfigs: (origin, destination, generation).
    submitted: Vec<(String, String, i64)>,
    /// Relayed statuses: (origin, destination).
    statuses: Vec<(String, String)>,
    /// Withdrawn NetworkConfigs: (origin, destination).
    withdrawn: Vec<(String, String)>,
}

/// A stand-in for a peer's broker (see the module doc): accepts every NetworkConfig with a
/// `PROCESSED` decision, or refuses it with `PERMISSION_DENIED` when built refusing, and
/// records what it got.
#[derive(Debug, Clone, Default)]
struct FakeBroker {
    received: Arc<Mutex<Received>>,
    refuse: bool,
    /// When set, the first NetworkConfig is held until released, then refused as not yet
    /// introduced (the real broker's FAILED_PRECONDITION); later ones are accepted.
    introduction: Option<Arc<Introduction>>,
}

/// Controls a [`FakeBroker`]'s first NetworkConfig.
#[derive(Debug, Default)]
struct Introduction {
    calls: std::sync::atomic::AtomicUsize,
    /// The first NetworkConfig arrived and is held.
    entered: std::sync::atomic::AtomicBool,
    release: tokio::sync::Notify,
}

impl Introduction {
    /// Waits until the first NetworkConfig (`what`) is held at the destination.
    async fn held(&self, what: &str) {
        eventually(
            &format!("{what} to be held at the destination"),
            LIMIT,
            || async {
                self.entered
                    .load(std::sync::atomic::Ordering::SeqCst)
                    .then_some(())
            },
        )
        .await;
    }
}

/// A (a plain fake broker) and C (which holds the first NetworkConfig it receives until
/// released, then refuses it as not yet introduced: see [`Introduction`]), serving until
/// `shutdown`, with their addresses.
async fn a_and_introduced_c(
    shutdown: &Shutdown,
) -> (FakeBroker, String, FakeBroker, String, Arc<Introduction>) {
    let introduction = Arc::new(Introduction::default());
    let c = FakeBroker {
        introduction: Some(introduction.clone()),
        ..FakeBroker::default()
    };
    let c_addr = c.start(shutdown).await;
    let a = FakeBroker::default();
    let a_addr = a.start(shutdown).await;
    (a, a_addr, c, c_addr, introduction)
}

impl FakeBroker {
    fn received(&self) -> Received {
        self.received.lock().expect("not poisoned").clone()
    }

    /// Serves on `listener` until `shutdown`.
    fn serve(&self, listener: TcpListener, shutdown: &Shutdown) {
        let service = BrokerServer::new(self.clone());
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    TcpListenerStream::new(listener),
                    shutdown.cancelled_owned(),
                )
                .await
        });
    }

    /// Serves on a fresh loopback port; returns the address.
    async fn start(&self, shutdown: &Shutdown) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("address");
        self.serve(listener, shutdown);
        addr.to_string()
    }
}

fn pair_of(reference: Option<&pb::NetworkConfigRef>) -> (String, String) {
    let id = |i: Option<&pb::ClusterIdentity>| i.map(|i| i.cluster_id.clone()).unwrap_or_default();
    reference.map_or_else(Default::default, |r| {
        (id(r.origin.as_ref()), id(r.destination.as_ref()))
    })
}

#[tonic::async_trait]
impl BrokerApi for FakeBroker {
    async fn get_token(
        &self,
        _: Request<ppb::GetTokenRequest>,
    ) -> Result<Response<ppb::GetTokenResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn rotate_token(
        &self,
        _: Request<ppb::RotateTokenRequest>,
    ) -> Result<Response<ppb::RotateTokenResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn create_join_token(
        &self,
        _: Request<ppb::CreateJoinTokenRequest>,
    ) -> Result<Response<ppb::CreateJoinTokenResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn list_join_tokens(
        &self,
        _: Request<ppb::ListJoinTokensRequest>,
    ) -> Result<Response<ppb::ListJoinTokensResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn revoke_join_token(
        &self,
        _: Request<ppb::RevokeJoinTokenRequest>,
    ) -> Result<Response<ppb::RevokeJoinTokenResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn peer(
        &self,
        _: Request<ppb::PeerRequest>,
    ) -> Result<Response<ppb::PeerResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn unpeer(
        &self,
        _: Request<ppb::UnpeerRequest>,
    ) -> Result<Response<ppb::UnpeerResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn handshake(
        &self,
        _: Request<ppb::HandshakeRequest>,
    ) -> Result<Response<ppb::HandshakeResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn submit_network_config(
        &self,
        request: Request<ppb::SubmitNetworkConfigRequest>,
    ) -> Result<Response<ppb::SubmitNetworkConfigResponse>, Status> {
        if self.refuse {
            return Err(Status::permission_denied("this fake broker refuses"));
        }
        if let Some(intro) = &self.introduction
            && intro
                .calls
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                == 0
        {
            intro
                .entered
                .store(true, std::sync::atomic::Ordering::SeqCst);
            intro.release.notified().await;
            return Err(Status::failed_precondition(
                "the origin has not (yet) been introduced to us; retry later",
            ));
        }
        let nc = request.into_inner().network_config.unwrap_or_default();
        let id = |i: &Option<pb::ClusterIdentity>| {
            i.as_ref().map(|i| i.cluster_id.clone()).unwrap_or_default()
        };
        self.received.lock().expect("not poisoned").submitted.push((
            id(&nc.origin),
            id(&nc.destination),
            nc.generation,
        ));
        Ok(Response::new(ppb::SubmitNetworkConfigResponse {
            // A relayed NetworkConfig names no peering.
            peering_id: String::new(),
            accepted: true,
            status: Some(pb::NetworkConfigStatus {
                pod_cidr_nat: "10.250.0.0/16".into(),
                external_cidr_nat: "10.251.0.0/16".into(),
                state: pb::NetworkConfigState::Processed as i32,
                observed_generation: nc.generation,
                message: String::new(),
                update_time: None,
                receiver_generation: 0,
            }),
        }))
    }
    async fn submit_network_config_batch(
        &self,
        request: Request<ppb::SubmitNetworkConfigBatchRequest>,
    ) -> Result<Response<ppb::SubmitNetworkConfigBatchResponse>, Status> {
        // Each item as its own call, concurrently, as the real broker does.
        let calls = request
            .into_inner()
            .requests
            .into_iter()
            .map(|item| self.submit_network_config(Request::new(item)));
        let results = futures::future::join_all(calls).await;
        Ok(Response::new(ppb::SubmitNetworkConfigBatchResponse {
            results: trellis_runtime::batch::submit_results(
                results
                    .into_iter()
                    .map(|r| r.map(Response::into_inner))
                    .collect(),
            ),
        }))
    }
    async fn report_network_config_status(
        &self,
        request: Request<ppb::ReportNetworkConfigStatusRequest>,
    ) -> Result<Response<ppb::ReportNetworkConfigStatusResponse>, Status> {
        let pair = pair_of(request.into_inner().network_config.as_ref());
        self.received
            .lock()
            .expect("not poisoned")
            .statuses
            .push(pair);
        Ok(Response::new(ppb::ReportNetworkConfigStatusResponse {
            applied: true,
        }))
    }
    async fn withdraw_network_config(
        &self,
        request: Request<ppb::WithdrawNetworkConfigRequest>,
    ) -> Result<Response<ppb::WithdrawNetworkConfigResponse>, Status> {
        let reference = request.into_inner().network_config.unwrap_or_default();
        let id = |i: &Option<pb::ClusterIdentity>| {
            i.as_ref().map(|i| i.cluster_id.clone()).unwrap_or_default()
        };
        self.received
            .lock()
            .expect("not poisoned")
            .withdrawn
            .push((id(&reference.origin), id(&reference.destination)));
        Ok(Response::new(ppb::WithdrawNetworkConfigResponse {
            removed: true,
        }))
    }
    async fn notify_unpeer(
        &self,
        _: Request<ppb::NotifyUnpeerRequest>,
    ) -> Result<Response<ppb::NotifyUnpeerResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn update_peer_ca(
        &self,
        _: Request<ppb::UpdatePeerCaRequest>,
    ) -> Result<Response<ppb::UpdatePeerCaResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn announce_ca(
        &self,
        _: Request<ppb::AnnounceCaRequest>,
    ) -> Result<Response<ppb::AnnounceCaResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn get_observed_endpoints(
        &self,
        _: Request<ppb::GetObservedEndpointsRequest>,
    ) -> Result<Response<ppb::GetObservedEndpointsResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn list_network_configs(
        &self,
        _: Request<ppb::ListNetworkConfigsRequest>,
    ) -> Result<Response<ppb::ListNetworkConfigsResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    async fn list_tunnel_endpoints(
        &self,
        _: Request<ppb::ListTunnelEndpointsRequest>,
    ) -> Result<Response<ppb::ListTunnelEndpointsResponse>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
    type WatchTunnelEndpointsStream =
        tokio_stream::Pending<Result<ppb::WatchTunnelEndpointsResponse, Status>>;
    async fn watch_tunnel_endpoints(
        &self,
        _: Request<ppb::WatchTunnelEndpointsRequest>,
    ) -> Result<Response<Self::WatchTunnelEndpointsStream>, Status> {
        Err(Status::unimplemented("fake broker"))
    }
}

/// A hub: its real discovery service (on its own memory store) and a forwarder on the store
/// under test. Everything stops when dropped.
struct Hub {
    forwarder: Arc<Forwarder>,
    discovery: Arc<Discovery>,
    /// The paths of the calls the discovery service answered.
    discovery_calls: Calls,
    shutdown: Shutdown,
}

/// Records the path of every call a server admits (a check that admits everything).
#[derive(Debug, Clone, Default)]
struct Calls(Arc<Mutex<Vec<String>>>);

impl Calls {
    fn count(&self, method: &str) -> usize {
        self.0
            .lock()
            .expect("not poisoned")
            .iter()
            .filter(|path| path.ends_with(method))
            .count()
    }
}

impl trellis_runtime::admission::Check for Calls {
    fn check<B>(&self, request: &tonic::codegen::http::Request<B>) -> Result<(), Status> {
        self.0
            .lock()
            .expect("not poisoned")
            .push(request.uri().path().to_owned());
        Ok(())
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Hub {
    async fn start(store: SharedStore) -> Self {
        Self::start_with(store, DELIVERY).await
    }

    async fn start_with(store: SharedStore, delivery: Delivery) -> Self {
        let shutdown = Shutdown::new();
        let discovery = Arc::new(
            Discovery::open(
                Arc::new(MemoryStore::new()),
                identity("hub"),
                Addresses::default(),
            )
            .await
            .expect("discovery opens"),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let discovery_addr = listener.local_addr().expect("address");
        let routes =
            trellis_discovery::routes(discovery.clone(), Duration::from_secs(10), Authz::off());
        let stop = shutdown.clone();
        let discovery_calls = Calls::default();
        let admission = trellis_runtime::admission::AdmissionLayer::new(discovery_calls.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .layer(admission)
                .add_routes(routes)
                .serve_with_incoming_shutdown(
                    TcpListenerStream::new(listener),
                    stop.cancelled_owned(),
                )
                .await
        });
        let forwarder = Arc::new(
            Forwarder::new(
                identity("hub"),
                store,
                &discovery_addr.to_string(),
                delivery,
                None,
                &trellis_runtime::local_auth::LocalToken::off(),
                &trellis_runtime::metrics::Metrics::new(),
            )
            .expect("forwarder"),
        );
        Self {
            forwarder,
            discovery,
            discovery_calls,
            shutdown,
        }
    }

    /// Records `cluster` as a full peer of the hub with networking, its broker at `broker`.
    async fn peer(&self, cluster: &str, broker: &str) {
        self.peer_with(cluster, broker, true).await;
    }

    /// Records `cluster` as a full peer of the hub, with networking or without.
    async fn peer_with(&self, cluster: &str, broker: &str, networking: bool) {
        self.discovery
            .update_peering(&PeeringUpdate {
                identity: identity(cluster),
                peered: true,
                addresses: Addresses {
                    broker: broker.to_owned(),
                    ..Addresses::default()
                },
                outgoing: true,
                incoming: true,
                networking,
                reason: String::new(),
                message: String::new(),
                expected_revision: 0,
                ca_certificate: String::new(),
            })
            .await
            .expect("peering recorded");
    }

    /// Starts keeping the forwarder's copy of the discovery records (stopped with the hub).
    fn follow_discovery(&self) {
        let forwarder = self.forwarder.clone();
        let stop = self.shutdown.clone();
        tokio::spawn(async move { forwarder.follow_discovery(stop).await });
    }

    /// Starts the forwarder's retry loop (stopped with the hub).
    fn run_retries(&self) {
        tokio::spawn(trellis_forwarder::core::retry_loop(
            self.forwarder.clone(),
            self.shutdown.clone(),
        ));
    }

    async fn relay(&self, origin: &str, destination: &str, spec_n: u8) -> State {
        self.forwarder
            .relay(passthrough(origin, destination, spec_n))
            .await
            .expect("relay accepted")
            .0
    }

    /// The relays held, by (origin, destination).
    async fn relays(&self) -> BTreeMap<(String, String), RelayRecord> {
        self.forwarder
            .list(None)
            .await
            .expect("lists")
            .into_iter()
            .map(|r| ((r.origin.id.to_string(), r.destination.id.to_string()), r))
            .collect()
    }
}

/// The tests' delivery settings: short backoff, retention long enough to never matter.
const DELIVERY: Delivery = Delivery {
    retry_max: Duration::from_secs(1),
    concurrency: 16,
    retention: Duration::from_secs(3600),
};

/// A loopback address that accepts TCP connections and then never says a word: every call
/// to it hangs until the caller's timeout, like a peer whose packets are blackholed after
/// the handshake. Stops with `shutdown`.
async fn blackhole(shutdown: &Shutdown) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let addr = listener.local_addr().expect("address");
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok((socket, _)) => held.push(socket),
                    Err(_) => return,
                },
            }
        }
    });
    addr.to_string()
}

/// A relay record as an older forwarder stored it.
fn held(origin: &str, destination: &str, spec_n: u8, state: State) -> RelayRecord {
    let now = now_nanos();
    RelayRecord {
        origin: identity(origin),
        destination: identity(destination),
        spec: spec(spec_n),
        generation: 1,
        held_generation: 0,
        state,
        status: None,
        reason: String::new(),
        attempts: 0,
        last_error: String::new(),
        created_nanos: now,
        updated_nanos: now,
        next_attempt_nanos: if state == State::Failed { 0 } else { now },
        trace: None,
    }
}

/// ("a--b" → "c") and ("a" → "b--c") are two relays; under `relays/<origin>--<destination>`
/// they were one key, and the second overwrote the first.
async fn ids_containing_the_old_separator_keep_separate_relays(store: SharedStore) {
    let hub = Hub::start(store).await;
    for cluster in ["a--b", "c", "a", "b--c"] {
        // Nobody answers: both relays stay in flight.
        hub.peer(cluster, &refusing()).await;
    }
    assert_eq!(hub.relay("a--b", "c", 1).await, State::Pending);
    assert_eq!(hub.relay("a", "b--c", 2).await, State::Pending);

    let relays = hub.relays().await;
    let keys: Vec<_> = relays.keys().cloned().collect();
    assert_eq!(
        keys,
        [
            ("a".to_owned(), "b--c".to_owned()),
            ("a--b".to_owned(), "c".to_owned())
        ],
        "{relays:#?}"
    );
    assert_eq!(relays[&("a--b".into(), "c".into())].spec, spec(1));
    assert_eq!(relays[&("a".into(), "b--c".into())].spec, spec(2));
    assert_ne!(
        relay_key(&id("a--b"), &id("c")),
        relay_key(&id("a"), &id("b--c"))
    );
}

/// Relays stored under the old `relays/<origin>--<destination>` keys are moved to the new
/// layout on start, old keys gone; a second run changes nothing; a store caught half-way
/// (some keys moved, one pair under both layouts) converges; the moved relays are delivered.
async fn old_layout_relays_are_migrated_and_served(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (origin, destination) = (FakeBroker::default(), FakeBroker::default());
    let origin_addr = origin.start(&shutdown).await;
    let destination_addr = destination.start(&shutdown).await;

    let old = |o: &str, d: &str| format!("{RELAYS_PREFIX}{o}--{d}");
    // The layout is a contract with stores written by earlier versions: spelled out here.
    let new = |o: &str, d: &str| format!("{RELAYS_PREFIX}{o}/{d}");
    assert_eq!(relay_key(&id("a--b"), &id("c")), new("a--b", "c"));
    let put = |key: String, record: RelayRecord| {
        let store = store.clone();
        async move {
            store
                .put(&key, encode(&record).expect("encodes"))
                .await
                .expect("put");
        }
    };
    // Old layout: a pending relay the loop must deliver, a failed one kept for operators.
    put(old("x", "y"), held("x", "y", 1, State::Pending)).await;
    put(old("a--b", "c"), held("a--b", "c", 2, State::Failed)).await;
    // Already moved by an earlier, interrupted start.
    put(new("m", "n"), held("m", "n", 3, State::Failed)).await;
    // Both layouts for one pair: the new one was written later and wins.
    put(old("p", "q"), held("p", "q", 4, State::Failed)).await;
    put(new("p", "q"), held("p", "q", 5, State::Failed)).await;

    let hub = Hub::start(store.clone()).await;
    hub.forwarder.migrate_relay_keys().await.expect("migrates");

    let listing = store.list(RELAYS_PREFIX).await.expect("lists");
    let keys: Vec<String> = listing.kvs.iter().map(|kv| kv.key.clone()).collect();
    let mut want = vec![
        new("x", "y"),
        new("a--b", "c"),
        new("m", "n"),
        new("p", "q"),
    ];
    want.sort();
    assert_eq!(keys, want, "old keys must be gone");
    let relays = hub.relays().await;
    assert_eq!(relays[&("x".into(), "y".into())].spec, spec(1));
    assert_eq!(relays[&("a--b".into(), "c".into())].spec, spec(2));
    assert_eq!(relays[&("m".into(), "n".into())].spec, spec(3));
    assert_eq!(relays[&("p".into(), "q".into())].spec, spec(5));

    // Twice changes nothing: same keys at the same revisions.
    hub.forwarder
        .migrate_relay_keys()
        .await
        .expect("migrates again");
    let again = store.list(RELAYS_PREFIX).await.expect("lists");
    let revisions = |l: &trellis_store::Listing| {
        l.kvs
            .iter()
            .map(|kv| (kv.key.clone(), kv.mod_revision))
            .collect::<Vec<_>>()
    };
    assert_eq!(revisions(&again), revisions(&listing));

    // Served afterwards: the moved pending relay reaches y, and y's decision reaches x.
    hub.peer("x", &origin_addr).await;
    hub.peer("y", &destination_addr).await;
    hub.run_retries();
    eventually(
        "the migrated relay to be delivered and completed",
        LIMIT,
        || async {
            let delivered = destination
                .received()
                .submitted
                .contains(&("x".into(), "y".into(), 1));
            let answered = origin
                .received()
                .statuses
                .contains(&("x".into(), "y".into()));
            let gone = !hub.relays().await.contains_key(&("x".into(), "y".into()));
            (delivered && answered && gone).then_some(())
        },
    )
    .await;
}

/// Relays to a destination that never answers must not hold up relays to healthy ones. The
/// store holds (as left by an earlier run, or accepted while those destinations were down)
/// many pending relays to a blackholed destination, listed first, and one to each of four
/// healthy destinations. Each attempt at the dead one lasts until the delivery timeout, so a
/// forwarder retrying one relay at a time reaches the healthy ones only after all of those.
async fn a_dead_destination_does_not_hold_up_the_others(store: SharedStore) {
    const DEAD_ORIGINS: usize = 40;
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let dead = blackhole(&shutdown).await;
    let origin = FakeBroker::default();
    let origin_addr = origin.start(&shutdown).await;
    let healthy: Vec<(String, FakeBroker)> = (1..=4)
        .map(|n| (format!("h{n}"), FakeBroker::default()))
        .collect();

    let put = |record: RelayRecord| {
        let store = store.clone();
        async move {
            let key = relay_key(&record.origin.id, &record.destination.id);
            store
                .put(&key, encode(&record).expect("encodes"))
                .await
                .expect("put");
        }
    };
    for n in 0..DEAD_ORIGINS {
        put(held(&format!("d{n:02}"), "dead", 1, State::Pending)).await;
    }
    for (name, _) in &healthy {
        put(held("z", name, 2, State::Pending)).await;
    }

    let hub = Hub::start(store).await;
    hub.peer("dead", &dead).await;
    for n in 0..DEAD_ORIGINS {
        hub.peer(&format!("d{n:02}"), &refusing()).await;
    }
    hub.peer("z", &origin_addr).await;
    for (name, broker) in &healthy {
        hub.peer(name, &broker.start(&shutdown).await).await;
    }
    hub.run_retries();

    eventually(
        "every relay to a healthy destination to complete",
        LIMIT,
        || async {
            let reported = origin.received().statuses;
            let all = healthy.iter().all(|(name, broker)| {
                broker
                    .received()
                    .submitted
                    .contains(&("z".into(), name.clone(), 1))
                    && reported.contains(&("z".into(), name.clone()))
            });
            let relays = hub.relays().await;
            let gone = healthy
                .iter()
                .all(|(name, _)| !relays.contains_key(&("z".into(), name.clone())));
            (all && gone).then_some(())
        },
    )
    .await;
    // The dead destination's relays are all still held, waiting for it.
    let relays = hub.relays().await;
    let waiting = relays
        .iter()
        .filter(|((_, d), r)| d == "dead" && r.state == State::Pending)
        .count();
    assert_eq!(waiting, DEAD_ORIGINS, "{relays:#?}");
}

/// A relay the destination refused for good is kept (state Failed) for operators, then
/// deleted once the retention has passed.
async fn failed_relays_are_collected_after_the_retention(store: SharedStore) {
    const RETENTION: Duration = Duration::from_secs(3);
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let refuser = FakeBroker {
        refuse: true,
        ..FakeBroker::default()
    };
    let hub = Hub::start_with(
        store,
        Delivery {
            retention: RETENTION,
            ..DELIVERY
        },
    )
    .await;
    hub.peer("o", &refusing()).await;
    hub.peer("r", &refuser.start(&shutdown).await).await;
    assert_eq!(hub.relay("o", "r", 1).await, State::Failed);
    let pair = ("o".to_owned(), "r".to_owned());
    let failed = hub
        .relays()
        .await
        .remove(&pair)
        .expect("the failed relay is kept");
    assert_eq!(failed.state, State::Failed);
    assert!(
        failed.last_error.contains("refuses"),
        "{}",
        failed.last_error
    );

    hub.run_retries();
    eventually("the failed relay to be collected", LIMIT, || async {
        let relays = hub.relays().await;
        if let Some(held) = relays.get(&pair) {
            assert_eq!(held.state, State::Failed);
            return None;
        }
        // Not before the retention: it was last updated at `updated_nanos`.
        let kept =
            Duration::from_nanos(u64::try_from(now_nanos() - failed.updated_nanos).unwrap_or(0));
        assert!(
            kept >= RETENTION,
            "collected after {kept:?}, before the retention"
        );
        Some(())
    })
    .await;
}

/// No retry tails (issue 17): a relay refused because the destination had not yet been
/// introduced to the origin waits for the destination, not for its backoff. A→C has failed
/// often (its next failure would back off for an hour); while an attempt of it is in flight
/// at C, C relays the other way (so C knows A now), then the attempt is refused as not yet
/// introduced: it is retried at once and delivered.
async fn a_relay_refused_while_the_other_way_arrives_is_retried_at_once(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (_a, a_addr, c, c_addr, introduction) = a_and_introduced_c(&shutdown).await;

    let mut record = held("a", "c", 1, State::Pending);
    record.attempts = 40;
    store
        .put(
            &relay_key(&id("a"), &id("c")),
            encode(&record).expect("encodes"),
        )
        .await
        .expect("put");
    let hub = Hub::start_with(
        store,
        Delivery {
            retry_max: Duration::from_secs(3600),
            ..DELIVERY
        },
    )
    .await;
    hub.peer("a", &a_addr).await;
    hub.peer("c", &c_addr).await;
    hub.run_retries();

    introduction.held("the retry of A→C").await;
    assert_eq!(hub.relay("c", "a", 2).await, State::Completed);
    introduction.release.notify_one();
    eventually("A→C to be delivered", LIMIT, || async {
        c.received()
            .submitted
            .contains(&("a".into(), "c".into(), 1))
            .then_some(())
    })
    .await;
}

/// With the discovery watch followed, a relay between peers the copy knows reads nothing from
/// discovery; a cached record that would refuse the relay (networking off) is read again before
/// the refusal, and a change reaches the copy.
async fn relays_are_authorized_from_the_watched_copy_which_never_refuses_alone(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (a, c) = (FakeBroker::default(), FakeBroker::default());
    let (a_addr, c_addr) = (a.start(&shutdown).await, c.start(&shutdown).await);
    let hub = Hub::start(store).await;
    hub.peer("a", &a_addr).await;
    hub.peer("c", &c_addr).await;
    hub.peer_with("mute", &a_addr, false).await;
    hub.follow_discovery();
    eventually("the forwarder's copy to hold every peer", LIMIT, || async {
        let copy = hub.forwarder.foreign_clusters();
        ["a", "c", "mute"]
            .iter()
            .all(|id| copy.cached(id).is_some())
            .then_some(())
    })
    .await;

    let before = hub.discovery_calls.count("/GetForeignCluster");
    assert_eq!(hub.relay("a", "c", 1).await, State::Completed);
    assert_eq!(hub.relay("c", "a", 2).await, State::Completed);
    assert_eq!(
        hub.discovery_calls.count("/GetForeignCluster"),
        before,
        "relays between known peers are checked against the copy"
    );

    let refused = hub.forwarder.relay(passthrough("mute", "a", 3)).await;
    assert!(
        matches!(refused, Err(trellis_error::Error::PermissionDenied(_))),
        "{refused:?}"
    );
    assert_eq!(
        hub.discovery_calls.count("/GetForeignCluster"),
        before + 1,
        "a cached record that would refuse is read again from discovery first"
    );

    // Networking turned on: the copy follows, and the relay goes through.
    hub.peer("mute", &a_addr).await;
    eventually("the copy to see mute's networking", LIMIT, || async {
        hub.forwarder
            .foreign_clusters()
            .cached("mute")
            .and_then(|fc| fc.full)
            .is_some_and(|full| full.networking_enabled)
            .then_some(())
    })
    .await;
    assert_eq!(hub.relay("mute", "c", 4).await, State::Completed);
}

/// An item of a RelayBatch stops waiting after a while (its origin is answered PENDING): the
/// status its attempt obtains afterwards must reach the origin through
/// ReportNetworkConfigStatus, not be dropped as if it had been answered in the reply.
async fn an_origin_that_stopped_waiting_gets_the_status_reported(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (a, c) = (FakeBroker::default(), FakeBroker::default());
    let (a_addr, c_addr) = (a.start(&shutdown).await, c.start(&shutdown).await);
    let hub = Hub::start(store).await;
    hub.peer("a", &a_addr).await;
    hub.peer("c", &c_addr).await;
    hub.run_retries();

    let wait = OriginWait::default();
    assert!(wait.abandon(), "nobody answered yet");
    let (state, status, _) = hub
        .forwarder
        .relay_answering(passthrough("a", "c", 1), &wait)
        .await
        .expect("relay accepted");
    assert_eq!(state, State::StatusPending, "not answered in the reply");
    assert!(status.is_some(), "the destination decided");
    eventually("the status to be reported to the origin", LIMIT, || async {
        a.received()
            .statuses
            .contains(&("a".into(), "c".into()))
            .then_some(())
    })
    .await;
    eventually("the relay to complete", LIMIT, || async {
        hub.relays().await.is_empty().then_some(())
    })
    .await;

    // While the origin waits, the status comes in the reply and nothing is reported.
    let waiting = OriginWait::default();
    let (state, _, _) = hub
        .forwarder
        .relay_answering(passthrough("c", "a", 2), &waiting)
        .await
        .expect("relay accepted");
    assert_eq!(state, State::Completed);
    assert!(!waiting.abandon(), "the attempt answered");
    assert!(!c.received().statuses.contains(&("c".into(), "a".into())));
}

/// The store's revision: it moves with every write.
async fn revision(store: &SharedStore) -> i64 {
    store.list(RELAYS_PREFIX).await.expect("lists").revision
}

/// A relay whose destination decides at once is answered in its reply and costs the store
/// nothing: no write ahead of the delivery, no delete after it (issue 17).
async fn a_relay_answered_in_its_reply_writes_nothing(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (a, c) = (FakeBroker::default(), FakeBroker::default());
    let (a_addr, c_addr) = (a.start(&shutdown).await, c.start(&shutdown).await);
    let hub = Hub::start(store.clone()).await;
    hub.peer("a", &a_addr).await;
    hub.peer("c", &c_addr).await;
    hub.run_retries();
    // A first relay warms the destination's channel; the second is the one measured.
    assert_eq!(hub.relay("a", "c", 1).await, State::Completed);
    let before = revision(&store).await;
    assert_eq!(hub.relay("c", "a", 2).await, State::Completed);
    assert!(
        a.received()
            .submitted
            .contains(&("c".into(), "a".into(), 1))
    );
    assert_eq!(
        revision(&store).await,
        before,
        "the relay wrote to the store"
    );
    assert!(hub.relays().await.is_empty());
}

/// Nor does it read the store (its own key, the other direction's), once the forwarder has
/// listed its relays at start: it knows which may be stored (issue 17; on etcd these two
/// reads were a round trip each for every relay of a hub).
async fn a_relay_answered_in_its_reply_reads_nothing_once_the_store_is_listed(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (store, registry) = metered(store);
    let (a, c) = (FakeBroker::default(), FakeBroker::default());
    let (a_addr, c_addr) = (a.start(&shutdown).await, c.start(&shutdown).await);
    // A relay held from before the start is in the listing: still read, and delivered.
    store
        .put(
            &relay_key(&id("c"), &id("a")),
            encode(&held("c", "a", 1, State::Pending)).expect("encodes"),
        )
        .await
        .expect("stored");
    let hub = Hub::start(store).await;
    hub.peer("a", &a_addr).await;
    hub.peer("c", &c_addr).await;
    hub.run_retries();
    // Until the loop has listed the store, absence means nothing and a relay reads its keys.
    until_relays_read_nothing(&hub, &registry, "a", "c").await;
    eventually(
        "the held relay to be delivered and deleted",
        LIMIT,
        || async { hub.relays().await.is_empty().then_some(()) },
    )
    .await;
    assert!(
        a.received()
            .submitted
            .contains(&("c".into(), "a".into(), 1)),
        "the relay held in the store was read and delivered"
    );
}

/// Two forwarders on one store (a rolling update would run the old one and its replacement
/// for a while; the Deployment's Recreate strategy is there to prevent it): what one believes
/// absent, the other may have stored. A relay whose first attempt fails must not be lost to
/// that belief: its write's compare fails, the key is read from then on, and the newer
/// generation is what the store holds.
async fn a_relay_stored_by_another_forwarder_is_read_once_a_write_shows_it(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (metered, registry) = metered(store.clone());
    let (a, b) = (FakeBroker::default(), FakeBroker::default());
    let (a_addr, b_addr) = (a.start(&shutdown).await, b.start(&shutdown).await);
    let c_addr = refusing();
    let new = Hub::start(metered).await;
    let old = Hub::start(store).await;
    for hub in [&new, &old] {
        hub.peer("a", &a_addr).await;
        hub.peer("b", &b_addr).await;
        hub.peer("c", &c_addr).await;
    }
    new.run_retries();
    until_relays_read_nothing(&new, &registry, "a", "b").await;
    // The old forwarder stores a relay the new one believes absent (C refuses connections).
    assert_eq!(old.relay("a", "c", 1).await, State::Pending);

    let newer = Passthrough {
        generation: 2,
        ..passthrough("a", "c", 2)
    };
    let (state, _, accepted) = new
        .forwarder
        .relay(newer)
        .await
        .expect("the relay is accepted despite the other forwarder's record");
    assert_eq!((state, accepted), (State::Pending, true));
    let held = old.relays().await;
    let record = held
        .get(&("a".to_owned(), "c".to_owned()))
        .expect("the relay is held");
    assert_eq!(
        (record.generation, &record.spec),
        (2, &spec(2)),
        "the newer generation is stored"
    );
}

/// `store` with its operations counted, and the registry they are counted in.
fn metered(store: SharedStore) -> (SharedStore, prometheus_client::registry::Registry) {
    let metrics = StoreMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    (trellis_store::metered::metered(store, &metrics), registry)
}

/// Waits until a relay from `origin` to `destination` (both answering) is accepted without a
/// store read: `hub`'s retry loop has listed its store.
async fn until_relays_read_nothing(
    hub: &Hub,
    registry: &prometheus_client::registry::Registry,
    origin: &str,
    destination: &str,
) {
    eventually("a relay that reads nothing", LIMIT, || async {
        let before = store_gets(registry);
        assert_eq!(hub.relay(origin, destination, 1).await, State::Completed);
        (store_gets(registry) == before).then_some(())
    })
    .await;
}

/// How many store reads (`get`) the metrics in `registry` counted.
fn store_gets(registry: &prometheus_client::registry::Registry) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("encodes");
    text.lines()
        .find_map(|line| {
            line.strip_prefix("trellis_store_operation_seconds_count{operation=\"get\"} ")
        })
        .map_or(0, |n| n.parse().expect("a count"))
}

/// An origin that stops waiting for the first attempt (an item of a RelayBatch past its wait)
/// is answered PENDING, which means accepted: by then the relay is stored, although that
/// attempt started with nothing stored and is still in flight; the attempt's outcome (a
/// refusal to retry) is stored over it, and the retry loop completes the relay.
async fn an_origin_that_stops_waiting_is_answered_once_the_relay_is_stored(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (a, a_addr, c, c_addr, introduction) = a_and_introduced_c(&shutdown).await;
    let hub = Hub::start(store).await;
    hub.peer("a", &a_addr).await;
    hub.peer("c", &c_addr).await;
    hub.run_retries();

    let wait = Arc::new(OriginWait::default());
    let attempt = {
        let (forwarder, wait) = (hub.forwarder.clone(), wait.clone());
        tokio::spawn(async move {
            forwarder
                .relay_answering(passthrough("a", "c", 1), &wait)
                .await
        })
    };
    introduction.held("the first attempt of A→C").await;
    assert!(
        hub.relays().await.is_empty(),
        "stored before the attempt ended"
    );
    assert!(
        hub.forwarder.stop_waiting(&wait).await.expect("stored"),
        "nobody answered yet"
    );
    let stored = hub.relays().await;
    let relay = stored
        .get(&("a".to_owned(), "c".to_owned()))
        .expect("the relay is stored before PENDING is answered");
    assert_eq!((relay.state, relay.generation), (State::Pending, 1));

    introduction.release.notify_one();
    let (state, _, _) = attempt.await.expect("joins").expect("relay accepted");
    assert_eq!(
        state,
        State::Pending,
        "the first attempt was refused, to retry"
    );
    eventually(
        "the retried relay to reach C and its status A",
        LIMIT,
        || async {
            (c.received()
                .submitted
                .contains(&("a".into(), "c".into(), 1))
                && a.received().statuses.contains(&("a".into(), "c".into())))
            .then_some(())
        },
    )
    .await;
    eventually("the relay to complete", LIMIT, || async {
        hub.relays().await.is_empty().then_some(())
    })
    .await;
}

/// A's relay to C, running in a task of its own.
type RelayTask = tokio::task::JoinHandle<
    trellis_error::Result<(
        State,
        Option<trellis_forwarder::records::RelayedStatus>,
        bool,
    )>,
>;

/// A hub with A and an introduced C ([`a_and_introduced_c`]), its retry loop running, and A's
/// relay to C in its first attempt (nothing stored for it yet), held at C until released.
async fn a_first_attempt_held_at_c(
    store: SharedStore,
    shutdown: &Shutdown,
) -> (Hub, FakeBroker, Arc<Introduction>, RelayTask) {
    let (_a, a_addr, c, c_addr, introduction) = a_and_introduced_c(shutdown).await;
    let hub = Hub::start(store).await;
    hub.peer("a", &a_addr).await;
    hub.peer("c", &c_addr).await;
    hub.run_retries();
    let attempt = {
        let forwarder = hub.forwarder.clone();
        tokio::spawn(async move { forwarder.relay(passthrough("a", "c", 1)).await })
    };
    introduction.held("the first attempt of A→C").await;
    (hub, c, introduction, attempt)
}

/// The origin withdraws while the first attempt of its relay (nothing stored for it yet) is
/// still being delivered, and that attempt then fails: the withdrawal waits for the attempt,
/// so the retry the attempt stores is replaced by the withdrawal instead of delivering the
/// NetworkConfig after it.
async fn a_withdrawal_during_a_first_attempt_is_not_undone_by_its_retry(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (hub, c, introduction, attempt) = a_first_attempt_held_at_c(store, &shutdown).await;
    let withdrawal = {
        let forwarder = hub.forwarder.clone();
        tokio::spawn(async move {
            forwarder
                .relay_withdrawal(&identity("a"), &identity("c"), "PeeringGone".into())
                .await
        })
    };
    // Time for the withdrawal to reach the forwarder (which must hold it back).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        c.received().withdrawn.is_empty(),
        "the withdrawal overtook the attempt still being delivered"
    );
    introduction.release.notify_one();
    let (state, _, _) = attempt.await.expect("joins").expect("relay accepted");
    assert_eq!(
        state,
        State::Pending,
        "the first attempt was refused, to retry"
    );
    withdrawal.await.expect("joins").expect("withdrawn");
    eventually(
        "the withdrawal to reach C and the relay to be gone",
        LIMIT,
        || async {
            (c.received().withdrawn.contains(&("a".into(), "c".into()))
                && hub.relays().await.is_empty())
            .then_some(())
        },
    )
    .await;
    // A retry stored after the withdrawal would be due within its first backoff (200 ms).
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !c.received()
            .submitted
            .contains(&("a".into(), "c".into(), 1)),
        "the withdrawn NetworkConfig was delivered after its withdrawal"
    );
}

/// The origin's Relay call is cancelled (its deadline passed, its connection dropped) while the
/// first attempt, with nothing stored, is being delivered: the attempt is dropped with it, and
/// a later withdrawal of that relay, which waits for such attempts to end, is not held back.
async fn a_relay_whose_caller_gave_up_does_not_hold_back_its_withdrawal(store: SharedStore) {
    let shutdown = Shutdown::new();
    let _stop = shutdown.clone().drop_guard();
    let (hub, c, introduction, attempt) = a_first_attempt_held_at_c(store, &shutdown).await;
    attempt.abort();
    assert!(
        attempt.await.is_err_and(|e| e.is_cancelled()),
        "the relay was cancelled"
    );
    let withdrawal = tokio::time::timeout(
        LIMIT,
        hub.forwarder
            .relay_withdrawal(&identity("a"), &identity("c"), "PeeringGone".into()),
    )
    .await
    .expect("the withdrawal is not held back by the cancelled attempt");
    withdrawal.expect("withdrawn");
    introduction.release.notify_one();
    eventually("the withdrawal to reach C", LIMIT, || async {
        c.received()
            .withdrawn
            .contains(&("a".into(), "c".into()))
            .then_some(())
    })
    .await;
}
