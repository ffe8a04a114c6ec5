//! `trellis-discovery`: the discovery service of one Trellis cluster (DESIGN.md, thesis §3.4.3,
//! §5.1-5.2, §6.1; ADR 0006).
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
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::ClusterIdentity;
use trellis_api::pb::discovery::discovery_server::DiscoveryServer;
use trellis_runtime::Shutdown;
use trellis_runtime::client::{Timeouts, local_channel};
use trellis_runtime::config::ports;
use trellis_runtime::peer::Authz;
use trellis_runtime::server::{GrpcServer, cluster_facing};

pub use crate::config::Config;
pub use crate::core::Discovery;
use crate::grpc::DiscoveryService;
use crate::neighborhood::SenderTiming;

/// Largest request accepted, in bytes. A Neighborhood of a few hundred peers with all their
/// addresses fits comfortably; anything bigger is refused by the transport.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// First retry delay after a failed Neighborhood send.
const RETRY_INITIAL: Duration = Duration::from_millis(200);

/// The gRPC routes of the discovery service.
pub fn routes(core: Arc<Discovery>, bookmark_every: Duration, authz: Authz) -> Routes {
    Routes::new(
        DiscoveryServer::new(DiscoveryService::with_authz(core, bookmark_every, authz))
            .max_decoding_message_size(MAX_REQUEST_BYTES),
    )
}

/// A running discovery service.
#[derive(Debug)]
pub struct Started {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The mutual-TLS listener for other clusters, when TLS is on.
    pub peer_addr: Option<SocketAddr>,
    /// The `/metrics` listener, unless `--metrics-listen off`.
    pub metrics_addr: Option<SocketAddr>,
    /// The domain core, for in-process callers (the lab, tests).
    pub core: Arc<Discovery>,
    /// Finishes when the server and every background task have stopped.
    pub task: JoinHandle<anyhow::Result<()>>,
}

/// Opens the store, checks the identity against it, binds, starts serving and starts the
/// background tasks (Neighborhood sender, DNS-SRV, mDNS).
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let common = &config.common;
    let identity = ClusterIdentity::parse(
        "cluster-id",
        &common.cluster_id,
        "cluster-name",
        common.cluster_name(),
    )?;
    // Bound first: its registry records the store's operations and the clients' calls.
    let server =
        GrpcServer::for_service(common, ports::DISCOVERY, ports::DISCOVERY_METRICS).await?;
    let store = common.open_store(server.metrics()).await?;
    let tls = config.tls.load(identity.id.as_str())?;
    let addr = server.local_addr();
    let metrics_addr = server.metrics_addr();
    let mut background = Vec::new();
    // The pinned CAs are this service's own full peers: the trust sync watches them through
    // our own plaintext listener, like every other service watches its discovery.
    let (peer, authz) = cluster_facing(
        tls.as_ref(),
        &config.tls,
        local_channel(
            "listen",
            &loopback(addr).to_string(),
            Timeouts::default(),
            &common.local_token()?,
            server.metrics(),
        )?,
        grpc::PEER_METHODS,
        &shutdown,
        &mut background,
    )
    .await?;
    let server = server
        .with_peer_listener(peer)
        .with_cluster_facing(grpc::PEER_METHODS);
    let peer_addr = server.peer_addr();
    let advertised = config.advertised(peer_addr.unwrap_or(addr));
    let mut core = Discovery::open(store, identity, advertised.clone())
        .await
        .context("opening the discovery service")?
        .with_tls(tls)
        .with_metrics(server.metrics())
        .with_max_induced_per_hub(config.max_induced_per_hub);
    if config.no_induced {
        tracing::info!("induced peering disabled: neighborhoods introduce nobody");
        core = core.without_induced_peering();
    }
    let core = Arc::new(core);
    metrics::register(server.metrics(), &core);

    background.push(trellis_runtime::telemetry::spawn(neighborhood::run(
        core.clone(),
        SenderTiming {
            resync: config.neighborhood_resync(),
            retry_initial: RETRY_INITIAL,
            retry_max: config.neighborhood_retry_max(),
        },
        shutdown.clone(),
    )));
    background.push(trellis_runtime::telemetry::spawn(tombstones::run(
        core.clone(),
        config.tombstone_retention(),
        shutdown.clone(),
    )));
    if !config.dns_domains.is_empty() {
        let settings = dns::DnsSettings {
            domains: config.dns_domains.clone(),
            nameserver: config.dns_nameserver,
            refresh: config.dns_refresh(),
        };
        tracing::info!(domains = ?settings.domains, "dns-srv discovery enabled");
        background.push(trellis_runtime::telemetry::spawn(dns::run(
            core.clone(),
            settings,
            shutdown.clone(),
        )));
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
        background.push(trellis_runtime::telemetry::spawn(mdns::run(
            core.clone(),
            settings,
            shutdown.clone(),
        )));
    }

    let routes = routes(core.clone(), config.watch_bookmark(), authz);
    let task = server.spawn(
        routes,
        &[DiscoveryServer::<DiscoveryService>::NAME],
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
    let started = start(config, shutdown).await?;
    started.task.await.context("discovery server task")?
}
