//! `trellis-discovery`: the discovery service of one Trellis cluster (docs/architecture.md,
//! ADR 0006).
//!
//! - [`records`]: what is stored, under which keys;
//! - [`core`]: identity, ForeignClusters and received Neighborhoods, as optimistic
//!   transactions on the store;
//! - [`watch`]: the resumable WatchForeignClusters stream;
//! - [`neighborhood`]: the sender that keeps every full peer's Neighborhood up to date;
//! - [`tombstones`]: deletes withdrawn ForeignClusters after `--tombstone-retention`;
//! - [`dns`] and [`mdns`]: the automatic discovery mechanisms;
//! - [`remote`]: calls to other clusters' discovery services;
//! - [`convert`]: proto mapping of discovery records (shared conversions live in `trellis_api`);
//! - [`metrics`]: ForeignClusters by kind and condition, for Prometheus;
//! - [`grpc`]: the thin gRPC layer;
//! - [`config`]: the flags.

pub mod config;
pub mod convert;
pub mod core;
pub mod dns;
pub mod grpc;
pub mod mdns;
pub mod metrics;
pub mod neighborhood;
pub mod records;
pub mod remote;
pub mod tombstones;
pub mod watch;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tonic::server::NamedService;
use trellis_api::pb::discovery::discovery_server::DiscoveryServer;
use trellis_runtime::client::Timeouts;
use trellis_runtime::{Bootstrap, Service, Shutdown};

pub use crate::config::Config;
pub use crate::core::Discovery;
use crate::grpc::DiscoveryService;
pub use crate::grpc::routes;
use crate::neighborhood::SenderTiming;

/// Largest request accepted, in bytes. A Neighborhood of a few hundred peers with all their
/// addresses fits comfortably; anything bigger is refused by the transport.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// First retry delay after a failed Neighborhood send.
const RETRY_INITIAL: Duration = Duration::from_millis(200);

/// A running discovery service.
pub type Started = trellis_runtime::Started<Discovery>;

/// Opens the store, checks the identity against it, binds, starts serving and starts the
/// background tasks (Neighborhood sender, DNS-SRV, mDNS).
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let (mut boot, opened) =
        Bootstrap::open(Service::DISCOVERY, &config.common, &config.tls, &shutdown).await?;
    let (identity, store, tls) = (opened.identity, opened.store, opened.tls);
    let addr = boot.addr();
    // The pinned CAs are this service's own full peers: the trust sync watches them through
    // our own plaintext listener, like every other service watches its discovery.
    let own = boot.local_channel("listen", &loopback(addr).to_string(), Timeouts::default())?;
    let authz = boot.cluster_facing(Some(own), grpc::PEER_METHODS).await?;
    let advertised = config.advertised(boot.peer_addr().unwrap_or(addr));
    let mut core = Discovery::open(store, identity, advertised.clone())
        .await
        .context("opening the discovery service")?
        .with_tls(tls)
        .with_metrics(boot.metrics())
        .with_max_induced_per_hub(config.max_induced_per_hub);
    if config.no_induced {
        tracing::info!("induced peering disabled: neighborhoods introduce nobody");
        core = core.without_induced_peering();
    }
    let core = Arc::new(core);
    metrics::register(boot.metrics(), &core);

    boot.spawn(neighborhood::run(
        core.clone(),
        SenderTiming {
            resync: config.neighborhood_resync(),
            retry_initial: RETRY_INITIAL,
            retry_max: config.neighborhood_retry_max(),
        },
        shutdown.clone(),
    ));
    boot.spawn(tombstones::run(
        core.clone(),
        config.tombstone_retention(),
        shutdown.clone(),
    ));
    if !config.dns_domains.is_empty() {
        let settings = dns::DnsSettings {
            domains: config.dns_domains.clone(),
            nameserver: config.dns_nameserver,
            refresh: config.dns_refresh(),
        };
        tracing::info!(domains = ?settings.domains, "dns-srv discovery enabled");
        boot.spawn(dns::run(core.clone(), settings, shutdown.clone()));
    }
    if config.mdns {
        let announced: Option<SocketAddr> = advertised.discovery.parse().ok();
        let settings = mdns::MdnsSettings {
            port: announced.map_or(addr.port(), |a| a.port()),
            ip: announced
                .map(|a| a.ip())
                .or((!addr.ip().is_unspecified()).then_some(addr.ip())),
            interfaces: config.mdns_interfaces.clone(),
        };
        boot.spawn(mdns::run(core.clone(), settings, shutdown));
    }

    let routes = routes(core.clone(), config.watch_bookmark(), authz);
    Ok(boot.serve(routes, &[DiscoveryServer::<DiscoveryService>::NAME], core))
}

/// Where this process reaches its own listener: a wildcard address means loopback.
fn loopback(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

/// Runs the discovery service until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    start(config, shutdown).await?.finished().await
}
