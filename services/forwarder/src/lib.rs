//! `trellis-forwarder`: the forwarding service of a hub cluster. It relays passthrough
//! NetworkConfigs from one full peer to another (induced peers of each other), relays the
//! destination's status back, and relays withdrawals (docs/architecture.md; this service stands where
//! Liqo has a reflector between namespaces).
//!
//! - [`core`]: accepting, persisting, delivering and retrying relays, cut into
//!   [`core::relay`] (relays and statuses accepted), `withdrawal`, `delivery` (one attempt),
//!   `ledger` (the stored records), [`core::schedule`] (the due queue and retry loop) and
//!   `peers` (the ends, as discovery knows them); `ends`: what a relay needs to know of the
//!   clusters at its two ends;
//! - `remote`: the port to the brokers at a relay's ends (submit, report a status, withdraw);
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
mod remote;

use std::sync::Arc;

use anyhow::Context as _;
use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::pb::peering::forwarder_server::ForwarderServer;
use trellis_runtime::{Bootstrap, Service, Shutdown};

pub use crate::config::Config;
pub use crate::core::Forwarder;
use crate::grpc::ForwarderService;

/// Largest request accepted, in bytes.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// A running forwarder.
pub type Started = trellis_runtime::Started<Forwarder>;

/// Opens the store, binds, starts serving and retrying relays.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let (mut boot, opened) =
        Bootstrap::open(Service::FORWARDER, &config.common, &config.tls, &shutdown).await?;
    let (identity, store, tls) = (opened.identity, opened.store, opened.tls);
    let core = Arc::new(Forwarder::new(
        identity,
        store,
        &config.discovery,
        config.delivery(),
        tls.clone(),
        boot.local_token(),
        boot.metrics(),
    )?);
    // Before serving and retrying, so both only ever see the current layout.
    core.migrate_relay_keys()
        .await
        .context("moving relays of the old key layout")?;
    let authz = boot
        .cluster_facing(Some(core.discovery_channel()), grpc::PEER_METHODS)
        .await?;
    metrics::register(boot.metrics(), &core);
    let routes = Routes::new(
        ForwarderServer::new(ForwarderService::with_authz(core.clone(), authz))
            .max_decoding_message_size(MAX_REQUEST_BYTES),
    );
    let follower = core.clone();
    let stop = shutdown.clone();
    boot.spawn(async move { follower.follow_discovery(stop).await });
    boot.spawn(core::schedule::retry_loop(core.clone(), shutdown));
    Ok(boot.serve(routes, &[ForwarderServer::<ForwarderService>::NAME], core))
}

/// Runs the forwarder until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    start(config, shutdown).await?.finished().await
}
