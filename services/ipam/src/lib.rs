//! `trellis-ipam`: the IPAM service of one Trellis cluster (docs/architecture.md,
//! "IPAM").
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

use std::sync::Arc;

use anyhow::Context as _;
use tonic::server::NamedService;
use trellis_api::pb::ipam::ipam_server::IpamServer;
use trellis_runtime::client::Timeouts;
use trellis_runtime::{Bootstrap, Service, Shutdown};

pub use crate::config::Config;
pub use crate::core::Ipam;
use crate::grpc::IpamService;
pub use crate::grpc::routes;

/// Largest request accepted, in bytes. IPAM requests are a few strings; anything bigger is
/// an abuse and is refused by the transport before it reaches a handler.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// A running IPAM server.
pub type Started = trellis_runtime::Started<Ipam>;

/// Opens the store, checks the configuration against it, binds and starts serving.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let local = config.local_subnets()?;
    let (mut boot, opened) =
        Bootstrap::open(Service::IPAM, &config.common, &config.tls, &shutdown).await?;
    let (store, tls) = (opened.store, opened.tls);
    let core = Arc::new(Ipam::open(store, local).await.context("opening the IPAM")?);
    // Only TLS pins peers' CAs, which is all the IPAM asks of discovery.
    let discovery = config
        .discovery
        .as_deref()
        .filter(|_| tls.is_some())
        .map(|address| boot.local_channel("discovery", address, Timeouts::default()))
        .transpose()?;
    let authz = boot.cluster_facing(discovery, grpc::PEER_METHODS).await?;
    metrics::register(boot.metrics(), &core);
    let routes = routes(core.clone(), authz);
    Ok(boot.serve(routes, &[IpamServer::<IpamService>::NAME], core))
}

/// Runs the IPAM until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    start(config, shutdown).await?.finished().await
}
