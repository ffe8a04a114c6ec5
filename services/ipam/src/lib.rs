//! `trellis-ipam`: the IPAM service of one Trellis cluster (DESIGN.md "IPAM RPCs", thesis
//! §4.2, §5.3.3, §5.4, §6.4).
//!
//! - [`subnets`]: the local ranges and pools, validated at start;
//! - [`alloc`]: the pure remapping arithmetic;
//! - [`records`]: what is stored, under which keys;
//! - [`core`]: the operations, as optimistic transactions on the store;
//! - [`metrics`]: pools and external addresses in use and free, for Prometheus;
//! - [`grpc`]: the thin gRPC layer;
//! - [`config`]: the flags.

pub mod alloc;
pub mod config;
pub mod core;
pub mod grpc;
pub mod metrics;
pub mod records;
pub mod subnets;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::pb::ipam::ipam_server::IpamServer;
use trellis_runtime::Shutdown;
use trellis_runtime::client::{Timeouts, local_channel};
use trellis_runtime::config::ports;
use trellis_runtime::peer::Authz;
use trellis_runtime::server::{GrpcServer, cluster_facing};

pub use crate::config::Config;
pub use crate::core::Ipam;
use crate::grpc::IpamService;

/// Largest request accepted, in bytes. IPAM requests are a few strings; anything bigger is
/// an abuse and is refused by the transport before it reaches a handler.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// The gRPC routes of the IPAM service.
pub fn routes(core: Arc<Ipam>, authz: Authz) -> Routes {
    Routes::new(
        IpamServer::new(IpamService::with_authz(core, authz))
            .max_decoding_message_size(MAX_REQUEST_BYTES),
    )
}

/// A running IPAM server.
#[derive(Debug)]
pub struct Started {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The mutual-TLS listener for other clusters, when TLS is on.
    pub peer_addr: Option<SocketAddr>,
    /// The `/metrics` listener, unless `--metrics-listen off`.
    pub metrics_addr: Option<SocketAddr>,
    /// The domain core, for in-process callers (the lab, tests).
    pub core: Arc<Ipam>,
    /// Finishes when the server has stopped.
    pub task: JoinHandle<anyhow::Result<()>>,
}

/// Opens the store, checks the configuration against it, binds and starts serving.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let local = config.local_subnets()?;
    // Bound first: its registry records the store's operations and the clients' calls.
    let server = GrpcServer::for_service(&config.common, ports::IPAM, ports::IPAM_METRICS).await?;
    let store = config.common.open_store(server.metrics()).await?;
    let tls = config.tls.load(&config.common.cluster_id)?;
    let core = Arc::new(Ipam::open(store, local).await.context("opening the IPAM")?);
    let mut background = Vec::new();
    let (peer, authz) = match (&tls, config.discovery.as_deref()) {
        (None, _) => (None, Authz::off()),
        (Some(_), None) => {
            anyhow::bail!("--peer-listen needs --discovery (where the peers' CAs are pinned)")
        }
        (Some(_), Some(discovery)) => {
            cluster_facing(
                tls.as_ref(),
                &config.tls,
                local_channel(
                    "discovery",
                    discovery,
                    Timeouts::default(),
                    &config.common.local_token()?,
                    server.metrics(),
                )?,
                grpc::PEER_METHODS,
                &shutdown,
                &mut background,
            )
            .await?
        }
    };
    let server = server
        .with_peer_listener(peer)
        .with_cluster_facing(grpc::PEER_METHODS);
    let addr = server.local_addr();
    let metrics_addr = server.metrics_addr();
    metrics::register(server.metrics(), &core);
    let peer_addr = server.peer_addr();
    let routes = routes(core.clone(), authz);
    let task = server.spawn(
        routes,
        &[IpamServer::<IpamService>::NAME],
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

/// Runs the IPAM until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    let started = start(config, shutdown).await?;
    started.task.await.context("IPAM server task")?
}
