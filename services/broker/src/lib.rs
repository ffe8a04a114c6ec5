//! `trellis-broker`: the peering broker of one Trellis cluster (docs/architecture.md).
//!
//! - [`token`]: the peering token; [`join_tokens`]: join tokens, which expire and can be
//!   revoked;
//! - [`core`]: the [`Broker`]: handshake, peering, unpeering, receiving NetworkConfigs and
//!   statuses, the reconciler's lanes (one submodule each);
//! - [`reconcile`]: scheduling passes, sending our NetworkConfigs, TunnelEndpoints, teardown
//!   (one submodule each);
//! - [`records`]: what is stored, under which keys;
//! - [`remote`]: the ports to the local services and to other clusters, in domain terms;
//! - [`metrics`]: TunnelEndpoints by peering kind, for Prometheus;
//! - [`grpc`]: the thin gRPC layer, with the TunnelEndpoint watch the gateway consumes;
//!   [`config`]: the flags.

pub mod config;
pub mod core;
pub mod grpc;
pub mod join_tokens;
pub mod metrics;
pub mod peering_id;
pub mod reconcile;
pub mod records;
pub mod remote;
pub mod token;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::pb::peering::broker_server::BrokerServer;
use trellis_runtime::{Bootstrap, Service, Shutdown};

pub use crate::config::Config;
pub use crate::core::Broker;
use crate::grpc::BrokerService;
use crate::remote::Ports;

/// Largest request accepted, in bytes: a NetworkConfig is a few hundred bytes.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// A running broker.
pub type Started = trellis_runtime::Started<Broker>;

/// Opens the store, binds, starts serving and reconciling.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    if let Some(initial) = &config.token {
        token::check_format("--token", initial)?;
    }
    let (mut boot, opened) =
        Bootstrap::open(Service::BROKER, &config.common, &config.tls, &shutdown).await?;
    let (identity, store, tls) = (opened.identity, opened.store, opened.tls);
    let ports = Ports::new(
        &config.discovery,
        &config.ipam,
        &config.gateway,
        tls.clone(),
        boot.local_token(),
        boot.metrics(),
    )?;
    let core = Arc::new(
        Broker::new(identity, store, ports, config.token.clone())
            .with_allowed_remote_ranges(config.allowed_remote_cidrs.clone())
            .with_resync(config.resync()),
    );
    core.token()
        .await
        .context("initialising the peering token")?;
    let authz = boot
        .cluster_facing(Some(core.ports().discovery().channel()), grpc::PEER_METHODS)
        .await?;
    metrics::register(boot.metrics(), &core);
    let routes = Routes::new(
        BrokerServer::new(BrokerService::with_authz(core.clone(), authz))
            .max_decoding_message_size(MAX_REQUEST_BYTES),
    );
    boot.spawn(core::candidates::run(
        core.clone(),
        Duration::from_secs(config.candidates_refresh),
        shutdown.clone(),
    ));
    boot.spawn(reconcile::run(core.clone(), config.resync(), shutdown));
    Ok(boot.serve(routes, &[BrokerServer::<BrokerService>::NAME], core))
}

/// Runs the broker until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    start(config, shutdown).await?.finished().await
}
