//! `trellis-broker`: the peering broker of one Trellis cluster (DESIGN.md, thesis §3.2,
//! §3.4.1–3.4.2, §5.3, §6.2).
//!
//! - [`token`]: the peering token;
//! - [`core`]: handshake, peering, unpeering, receiving NetworkConfigs and statuses;
//! - [`reconcile`]: sending our NetworkConfigs, TunnelEndpoints, teardown;
//! - [`records`]: what is stored, under which keys;
//! - [`watch`]: the TunnelEndpoint watch the gateway consumes;
//! - [`remote`]: clients of the local services and of other clusters;
//! - [`grpc`]: the thin gRPC layer; [`config`]: the flags.

pub mod config;
pub mod core;
pub mod grpc;
pub mod peering_id;
pub mod reconcile;
pub mod records;
pub mod remote;
pub mod token;
pub mod watch;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::ClusterIdentity;
use trellis_api::model::PeeringKind;
use trellis_api::pb::peering::broker_server::BrokerServer;
use trellis_runtime::Shutdown;
use trellis_runtime::config::ports;
use trellis_runtime::metrics::prometheus_client::metrics::{family::Family, gauge::Gauge};
use trellis_runtime::metrics::{Labels, Metrics};
use trellis_runtime::server::{GrpcServer, cluster_facing};

pub use crate::config::Config;
pub use crate::core::Broker;
use crate::grpc::BrokerService;
use crate::remote::Clients;

/// Largest request accepted, in bytes: a NetworkConfig is a few hundred bytes.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// A running broker.
#[derive(Debug)]
pub struct Started {
    pub addr: SocketAddr,
    /// The mutual-TLS listener for other clusters, when TLS is on.
    pub peer_addr: Option<SocketAddr>,
    /// The `/metrics` listener, unless `--metrics-listen off`.
    pub metrics_addr: Option<SocketAddr>,
    pub core: Arc<Broker>,
    pub task: JoinHandle<anyhow::Result<()>>,
}

/// Opens the store, binds, starts serving and reconciling.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let common = &config.common;
    let identity = ClusterIdentity::parse(
        "--cluster-id",
        &common.cluster_id,
        "--cluster-name",
        common.cluster_name(),
    )?;
    if let Some(initial) = &config.token {
        token::check_format("--token", initial)?;
    }
    // Bound first: its registry records the store's operations and the clients' calls.
    let server = GrpcServer::for_service(common, ports::BROKER, ports::BROKER_METRICS).await?;
    let store = common.open_store(server.metrics()).await?;
    let tls = config.tls.load(identity.id.as_str())?;
    let clients = Clients::new(
        &config.discovery,
        &config.ipam,
        &config.gateway,
        tls.clone(),
        &common.local_token()?,
        server.metrics(),
    )?;
    let core = Arc::new(
        Broker::new(identity, store, clients, config.token.clone())
            .with_allowed_remote_ranges(config.allowed_remote_cidrs.clone()),
    );
    core.token()
        .await
        .context("initialising the peering token")?;
    let mut background = Vec::new();
    let (peer, authz) = cluster_facing(
        tls.as_ref(),
        &config.tls,
        core.clients().discovery_channel(),
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
    let peer_addr = server.peer_addr();
    register_metrics(server.metrics(), &core);
    let routes = Routes::new(
        BrokerServer::new(BrokerService::with_authz(core.clone(), authz))
            .max_decoding_message_size(MAX_REQUEST_BYTES),
    );
    background.push(trellis_runtime::telemetry::spawn(reconcile::run(
        core.clone(),
        config.resync(),
        shutdown.clone(),
    )));
    let task = server.spawn(
        routes,
        &[BrokerServer::<BrokerService>::NAME],
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

/// `trellis_tunnel_endpoints{kind}`: the TunnelEndpoints the broker holds (what
/// ListTunnelEndpoints returns), counted from the store at every scrape.
fn register_metrics(metrics: &Metrics, core: &Arc<Broker>) {
    let tunnels: Family<Labels, Gauge> = Family::default();
    metrics.register(
        "trellis_tunnel_endpoints",
        "TunnelEndpoints held by the broker, by peering kind",
        tunnels.clone(),
    );
    let core = core.clone();
    metrics.on_scrape(move || {
        let (core, tunnels) = (core.clone(), tunnels.clone());
        async move {
            let Ok((list, _)) = core.tunnels().await else {
                return;
            };
            for (kind, name) in [
                (PeeringKind::Full, "full"),
                (PeeringKind::Induced, "induced"),
            ] {
                let n = list.iter().filter(|(t, _)| t.kind == kind).count();
                tunnels
                    .get_or_create(&vec![("kind", name.to_owned())])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
    });
}

/// Runs the broker until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    let started = start(config, shutdown).await?;
    started.task.await.context("broker server task")?
}
