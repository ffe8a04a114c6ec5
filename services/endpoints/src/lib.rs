//! `trellis-endpoints`: the endpoint-mapping service of one Trellis cluster (docs/architecture.md,
//! endpoint reflection).
//!
//! - [`model`]: validated EndpointSlices; [`convert`]: their wire form;
//! - [`remote`]: the ports to the local IPAM and discovery, and to other clusters' IPAMs and
//!   endpoints services, with timeouts and bounded retries;
//! - [`core`]: the service, cut into [`core::outgoing`] (reflections this cluster records
//!   and delivers), [`core::translation`] (translation per target: local NAT, target home,
//!   induced through the home cluster's IPAM, hub path), `release` (release of hub-path
//!   allocations) and [`core::reflected`] (reflected-slice storage, the target side);
//! - [`exports`]: exported Services and the reconciler reflecting them to every peer;
//! - [`kube_source`]: the Kubernetes export source (`ServiceExport` watchers);
//! - [`imports`]: the Kubernetes import side (ServiceImport, derived Service, slices);
//! - [`mcs`]: the Multi-Cluster Services API objects;
//! - [`kube`]: the Kubernetes EndpointSlice writer;
//! - [`dns`]: `clusterset.local` DNS answered from the imports (`--dns-listen`);
//! - [`records`]: what is stored, under which keys;
//! - [`metrics`]: slices imported and exported, for Prometheus;
//! - [`grpc`]: the thin gRPC layer;
//! - [`config`]: the flags.

pub mod config;
pub mod convert;
pub mod core;
pub mod dns;
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

use std::sync::Arc;

use anyhow::Context as _;
use tonic::server::NamedService;
use trellis_api::pb::endpoints::endpoint_mapper_server::EndpointMapperServer;
use trellis_runtime::{Bootstrap, Service, Shutdown};

pub use crate::config::Config;
pub use crate::core::Endpoints;
use crate::grpc::EndpointsService;
pub use crate::grpc::routes;
pub use crate::kube::KubeWriter;
use crate::remote::{ClientSettings, Clients};

/// Largest request accepted, in bytes: a slice of 1000 endpoints with long names and labels
/// stays well below; anything bigger is refused by the transport.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// A running endpoints server.
pub type Started = trellis_runtime::Started<Endpoints>;

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
    let (mut boot, opened) =
        Bootstrap::open(Service::ENDPOINTS, &config.common, &config.tls, &shutdown).await?;
    let (identity, store, tls) = (opened.identity, opened.store, opened.tls);
    let clients = Clients::new(ClientSettings {
        ipam: config.ipam.clone(),
        discovery: config.discovery.clone(),
        local: config.local_timeouts(),
        remote_ipam: config.remote_ipam_timeouts(),
        remote_ipam_attempts: config.remote_ipam_attempts,
        deliver: config.deliver_timeouts(),
        tls: tls.clone(),
        local_token: boot.local_token().clone(),
        metrics: boot.metrics().clone(),
    })?;
    let authz = boot
        .cluster_facing(Some(clients.discovery_channel()), grpc::PEER_METHODS)
        .await?;
    let mut core = Endpoints::new(store, identity, clients, writer);
    if client.is_some() {
        core = core.with_readiness_marking();
    }
    let core = Arc::new(core);
    metrics::register(boot.metrics(), &core);
    boot.spawn(exports::run_reconciler(
        core.clone(),
        exports::RESYNC,
        std::time::Duration::from_millis(config.export_resend),
        shutdown.clone(),
    ));
    if let Some(client) = client {
        boot.spawn(kube_source::run_export_source(
            core.clone(),
            client.clone(),
            exports::RESYNC,
            shutdown.clone(),
        ));
        boot.spawn(imports::run_import_sync(
            core.clone(),
            imports::ImportWriter::new(client),
            exports::RESYNC,
            shutdown.clone(),
        ));
    }
    if let Some(listen) = config.dns_listen {
        // Boxed: the server's bind would otherwise grow every caller's start-up future.
        Box::pin(start_dns(&mut boot, &core, &config, listen, &shutdown)).await?;
    }
    let routes = routes(core.clone(), authz);
    Ok(boot.serve(
        routes,
        &[EndpointMapperServer::<EndpointsService>::NAME],
        core,
    ))
}

/// Binds the clusterset DNS server on `listen` and starts it and the zone builder.
async fn start_dns(
    boot: &mut Bootstrap,
    core: &Arc<Endpoints>,
    config: &Config,
    listen: std::net::SocketAddr,
    shutdown: &Shutdown,
) -> anyhow::Result<()> {
    let dns_metrics = dns::DnsMetrics::register(boot.metrics());
    let (zone, view) = tokio::sync::watch::channel(None);
    let server = dns::DnsServer::bind(listen, view, dns_metrics.clone()).await?;
    tracing::info!(address = %server.local_addr(), zone = %config.dns_domain, "serving clusterset dns");
    boot.spawn(server.serve(shutdown.clone()));
    boot.spawn(dns::run_zone(
        core.clone(),
        dns::ZoneSettings {
            origin: config.dns_domain.clone(),
            ttl: config.dns_ttl,
        },
        zone,
        dns_metrics,
        exports::RESYNC,
        shutdown.clone(),
    ));
    Ok(())
}

/// Runs the endpoints service until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    start(config, shutdown).await?.finished().await
}
