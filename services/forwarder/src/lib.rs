//! `trellis-forwarder`: the forwarding service of a hub cluster. It relays passthrough
//! NetworkConfigs from one full peer to another (induced peers of each other), relays the
//! destination's status back, and relays withdrawals (thesis §5.3, §6.2.3; Trellis replaces
//! Liqo's reflector between namespaces with this service).
//!
//! - [`core`]: accepting, persisting, delivering and retrying relays; `ends`: what a relay
//!   needs to know of the clusters at its two ends;
//! - [`records`]: what is stored (only relays in flight); [`migrate`]: moving records of an
//!   earlier key layout on start;
//! - [`metrics`]: relays by state, for Prometheus;
//! - [`grpc`]: the thin gRPC layer; [`config`]: the flags.

pub mod config;
pub mod core;
mod ends;
pub mod grpc;
pub mod metrics;
pub mod migrate;
pub mod records;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::ClusterIdentity;
use trellis_api::pb::peering::forwarder_server::ForwarderServer;
use trellis_runtime::Shutdown;
use trellis_runtime::config::ports;
use trellis_runtime::server::{GrpcServer, cluster_facing};

pub use crate::config::Config;
pub use crate::core::Forwarder;
use crate::grpc::ForwarderService;

/// Largest request accepted, in bytes.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// A running forwarder.
#[derive(Debug)]
pub struct Started {
    pub addr: SocketAddr,
    /// The mutual-TLS listener for other clusters, when TLS is on.
    pub peer_addr: Option<SocketAddr>,
    /// The `/metrics` listener, unless `--metrics-listen off`.
    pub metrics_addr: Option<SocketAddr>,
    pub core: Arc<Forwarder>,
    pub task: JoinHandle<anyhow::Result<()>>,
}

/// Opens the store, binds, starts serving and retrying relays.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let common = &config.common;
    let identity = ClusterIdentity::parse(
        "--cluster-id",
        &common.cluster_id,
        "--cluster-name",
        common.cluster_name(),
    )?;
    // Bound first: its registry records the store's operations and the clients' calls.
    let server =
        GrpcServer::for_service(common, ports::FORWARDER, ports::FORWARDER_METRICS).await?;
    let store = common.open_store(server.metrics()).await?;
    let tls = config.tls.load(identity.id.as_str())?;
    let core = Arc::new(Forwarder::new(
        identity,
        store,
        &config.discovery,
        config.delivery(),
        tls.clone(),
        &common.local_token()?,
        server.metrics(),
    )?);
    // Before serving and retrying, so both only ever see the current layout.
    core.migrate_relay_keys()
        .await
        .context("moving relays of the old key layout")?;
    let mut background = Vec::new();
    let (peer, authz) = cluster_facing(
        tls.as_ref(),
        &config.tls,
        core.discovery_channel(),
        grpc::PEER_METHODS,
        &shutdown,
        &mut background,
    )
    .await?;
    let server = server
        .with_peer_listener(peer)
        .with_cluster_facing(grpc::PEER_METHODS);
    let addr = server.local_addr();
    let metrics_addr = server.metrics_addr();
    metrics::register(server.metrics(), &core);
    let peer_addr = server.peer_addr();
    let routes = Routes::new(
        ForwarderServer::new(ForwarderService::with_authz(core.clone(), authz))
            .max_decoding_message_size(MAX_REQUEST_BYTES),
    );
    let follower = core.clone();
    let stop = shutdown.clone();
    background.push(trellis_runtime::telemetry::spawn(async move {
        follower.follow_discovery(stop).await;
    }));
    background.push(trellis_runtime::telemetry::spawn(core::retry_loop(
        core.clone(),
        shutdown.clone(),
    )));
    let task = server.spawn(
        routes,
        &[ForwarderServer::<ForwarderService>::NAME],
        shutdown,
        common.shutdown_grace(),
        background,
    );
    Ok(Started {
        addr,
        peer_addr,
        metrics_addr,
        core,
        task,
    })
}

/// Runs the forwarder until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    let started = start(config, shutdown).await?;
    started.task.await.context("forwarder server task")?
}
