//! `trellis-endpoints`: the endpoint-mapping service of one Trellis cluster (DESIGN.md
//! "Endpoint reflection", thesis §4.2, §5.4, Listing 6.6).
//!
//! - [`model`]: validated EndpointSlices;
//! - [`remote`]: clients of the local IPAM and discovery, and of other clusters' IPAMs and
//!   endpoints services, with timeouts and bounded retries;
//! - [`core`]: translation per target (local NAT, target home, induced through the home
//!   cluster's IPAM, hub path), reflected-slice storage, release of hub-path allocations;
//! - [`exports`]: exported Services and the reconciler reflecting them to every peer;
//! - [`kube_source`]: the Kubernetes export source (`ServiceExport` watchers);
//! - [`imports`]: the Kubernetes import side (ServiceImport, derived Service, slices);
//! - [`mcs`]: the Multi-Cluster Services API objects;
//! - [`kube`]: the Kubernetes EndpointSlice writer;
//! - [`records`]: what is stored, under which keys;
//! - [`metrics`]: slices imported and exported, for Prometheus;
//! - [`grpc`]: the thin gRPC layer;
//! - [`config`]: the flags.

pub mod config;
pub mod core;
pub mod exports;
pub mod grpc;
pub mod imports;
pub mod kube;
pub mod kube_source;
pub mod mcs;
pub mod metrics;
pub mod model;
pub mod records;
pub mod remote;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::ClusterIdentity;
use trellis_api::pb::endpoints::endpoint_mapper_server::EndpointMapperServer;
use trellis_runtime::Shutdown;
use trellis_runtime::config::ports;
use trellis_runtime::peer::Authz;
use trellis_runtime::server::{GrpcServer, cluster_facing};

pub use crate::config::Config;
pub use crate::core::Endpoints;
use crate::grpc::EndpointsService;
pub use crate::kube::KubeWriter;
use crate::remote::{ClientSettings, Clients};

/// Largest request accepted, in bytes: a slice of 1000 endpoints with long names and labels
/// stays well below; anything bigger is refused by the transport.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// The gRPC routes of the endpoints service.
pub fn routes(core: Arc<Endpoints>, authz: Authz) -> Routes {
    Routes::new(
        EndpointMapperServer::new(EndpointsService::with_authz(core, authz))
            .max_decoding_message_size(MAX_REQUEST_BYTES),
    )
}

/// A running endpoints server.
#[derive(Debug)]
pub struct Started {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The mutual-TLS listener for other clusters, when TLS is on.
    pub peer_addr: Option<SocketAddr>,
    /// The `/metrics` listener, unless `--metrics-listen off`.
    pub metrics_addr: Option<SocketAddr>,
    /// The domain core, for in-process callers (the lab, tests).
    pub core: Arc<Endpoints>,
    /// Finishes when the server has stopped.
    pub task: JoinHandle<anyhow::Result<()>>,
}

/// Opens the store, builds the clients (and, with `--kubernetes`, the kube client: the
/// Kubernetes export source and import side run), binds and starts serving.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let client = if config.kubernetes {
        Some(
            config
                .kube_client()
                .await
                .context("connecting to Kubernetes (--kubernetes)")?,
        )
    } else {
        None
    };
    start_inner(config, None, client, shutdown).await
}

/// [`start`] with only a given EndpointSlice writer (the tower-test mock tests): reflected
/// slices are written as they arrive, nothing is watched, no ServiceImport is written;
/// `--kubernetes` is ignored.
pub async fn start_with_writer(
    config: Config,
    writer: Option<KubeWriter>,
    shutdown: Shutdown,
) -> anyhow::Result<Started> {
    start_inner(config, writer, None, shutdown).await
}

async fn start_inner(
    config: Config,
    writer: Option<KubeWriter>,
    client: Option<::kube::Client>,
    shutdown: Shutdown,
) -> anyhow::Result<Started> {
    let writer = writer.or_else(|| client.clone().map(KubeWriter::new));
    let local = ClusterIdentity::parse(
        "cluster-id",
        &config.common.cluster_id,
        "cluster-name",
        config.common.cluster_name(),
    )?;
    let tls = config.tls.load(local.id.as_str())?;
    // Bound first: its registry records the store's operations and the clients' calls.
    let server =
        GrpcServer::for_service(&config.common, ports::ENDPOINTS, ports::ENDPOINTS_METRICS).await?;
    let clients = Clients::new(ClientSettings {
        ipam: config.ipam.clone(),
        discovery: config.discovery.clone(),
        local: config.local_timeouts(),
        remote_ipam: config.remote_ipam_timeouts(),
        remote_ipam_attempts: config.remote_ipam_attempts,
        deliver: config.deliver_timeouts(),
        tls: tls.clone(),
        local_token: config.common.local_token()?,
        metrics: server.metrics().clone(),
    })?;
    let store = config.common.open_store(server.metrics()).await?;
    let mut background = Vec::new();
    let (peer, authz) = cluster_facing(
        tls.as_ref(),
        &config.tls,
        clients.discovery_channel(),
        grpc::PEER_METHODS,
        &shutdown,
        &mut background,
    )
    .await?;
    let mut core = Endpoints::new(store, local, clients, writer);
    if client.is_some() {
        core = core.with_readiness_marking();
    }
    let core = Arc::new(core);
    let server = server
        .with_peer_listener(peer)
        .with_cluster_facing(grpc::PEER_METHODS);
    let addr = server.local_addr();
    let metrics_addr = server.metrics_addr();
    metrics::register(server.metrics(), &core);
    let peer_addr = server.peer_addr();
    background.push(trellis_runtime::telemetry::spawn(exports::run_reconciler(
        core.clone(),
        exports::RESYNC,
        std::time::Duration::from_millis(config.export_resend),
        shutdown.clone(),
    )));
    if let Some(client) = client {
        background.push(trellis_runtime::telemetry::spawn(
            kube_source::run_export_source(
                core.clone(),
                client.clone(),
                exports::RESYNC,
                shutdown.clone(),
            ),
        ));
        background.push(trellis_runtime::telemetry::spawn(imports::run_import_sync(
            core.clone(),
            imports::ImportWriter::new(client),
            exports::RESYNC,
            shutdown.clone(),
        )));
    }
    let routes = routes(core.clone(), authz);
    let task = server.spawn(
        routes,
        &[EndpointMapperServer::<EndpointsService>::NAME],
        shutdown,
        config.common.shutdown_grace(),
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

/// Runs the endpoints service until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    let started = start(config, shutdown).await?;
    started.task.await.context("endpoints server task")?
}
