//! `trellis-gateway`: the gateway of one Trellis cluster (DESIGN.md "Data plane"; ADRs 0007,
//! 0008, 0009). It runs inside whatever network namespace it is started in.
//!
//! - [`keys`]: the WireGuard key pair, generated once and kept in the store;
//! - [`ports`]: one slot per remote peer (its mark and table; in kernel mode its listen
//!   port), persisted and unique;
//! - [`names`]: interface names, connection marks and routing tables per peer;
//! - [`dataplane`]: the userspace WireGuard engine (one UDP port for every peer), WireGuard
//!   interfaces, routes, policy rules and nftables NAT (root only);
//! - [`source`]: the broker's TunnelEndpoints, followed with a resumable watch;
//! - [`mappings`]: the IPAM's external-CIDR endpoint mappings (hub-path DNAT), polled;
//! - [`reconcile`]: the loop applying them;
//! - [`replicas`]: the election of the cluster's active gateway among its replicas;
//! - [`core`]: the operations; [`records`]: what is stored, under which keys;
//! - [`metrics`]: per-tunnel Prometheus metrics (bytes, packets, handshake age, state);
//! - [`grpc`]: the thin gRPC layer; [`config`]: the flags.

pub mod config;
pub mod core;
pub mod dataplane;
pub mod grpc;
pub mod keys;
pub mod mappings;
pub mod metrics;
pub mod names;
pub mod ports;
pub mod reconcile;
pub mod records;
pub mod replicas;
pub mod source;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::ClusterIdentity;
use trellis_api::pb::gateway::gateway_server::GatewayServer;
use trellis_runtime::Shutdown;
use trellis_runtime::config::ports as default_ports;
use trellis_runtime::server::GrpcServer;

pub use crate::config::Config;
pub use crate::core::Gateway;
use crate::core::Settings;
use crate::dataplane::Mode;
use crate::dataplane::engine::Engine;
use crate::dataplane::linux::Linux;
use crate::dataplane::wireguard::Flavor;
use crate::grpc::GatewayService;
use crate::keys::KeyPair;
use crate::ports::PortPolicy;

/// Largest request accepted, in bytes: gateway requests carry at most a cluster ID.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// The gRPC routes of the gateway service.
pub fn routes(core: Arc<Gateway>) -> Routes {
    Routes::new(
        GatewayServer::new(GatewayService::new(core)).max_decoding_message_size(MAX_REQUEST_BYTES),
    )
}

/// A running gateway.
#[derive(Debug)]
pub struct Started {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The `/metrics` listener, unless `--metrics-listen off`.
    pub metrics_addr: Option<SocketAddr>,
    /// The domain core, for in-process callers (the lab, tests).
    pub core: Arc<Gateway>,
    /// Finishes when the server and the reconciler have stopped (the data plane removed).
    pub task: JoinHandle<anyhow::Result<()>>,
}

/// Opens the store, loads the key, prepares the data plane, binds, serves, and follows the
/// broker when one is configured.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let common = &config.common;
    let identity = ClusterIdentity::parse(
        "cluster-id",
        &common.cluster_id,
        "cluster-name",
        common.cluster_name(),
    )?;
    let endpoint_host = config.endpoint_host()?;
    // Bound first: its registry records the store's operations and the clients' calls.
    let server = GrpcServer::for_service(
        common,
        default_ports::GATEWAY,
        default_ports::GATEWAY_METRICS,
    )
    .await?;
    let store = common.open_store(server.metrics()).await?;
    let keys = KeyPair::load_or_create(&store)
        .await
        .context("loading the gateway key")?;
    let node_name = config.node_name()?;
    let replicas = Arc::new(
        replicas::Replicas::bind(
            replicas::Settings {
                replica: config.replica_id()?,
                node_name: node_name.clone(),
                node_ip: config.node_ip,
                endpoint_host: endpoint_host.to_string(),
                public_key: keys.public().to_string(),
                listen: config.heartbeat_listen,
                interval: std::time::Duration::from_millis(config.heartbeat_interval),
                failover_after: std::time::Duration::from_millis(config.failover_after),
            },
            store.clone(),
            &keys.private_bytes(),
            server.metrics(),
        )
        .await?,
    );
    let mode = Mode::resolve(config.dataplane);
    let flavor = match mode {
        Mode::None => None,
        Mode::Userspace => {
            let port = config.wireguard_port;
            let private = keys.private_bytes();
            let engine = tokio::task::spawn_blocking(move || Engine::start(port, private))
                .await
                .context("engine start task")?
                .context("starting the userspace wireguard engine")?;
            Some(Flavor::Userspace(Arc::new(engine)))
        }
        Mode::Kernel => Some(Flavor::Kernel),
    };
    let engine = match &flavor {
        Some(Flavor::Userspace(engine)) => Some(engine.clone()),
        _ => None,
    };
    if let Some(engine) = &engine {
        replicas.set_engine(engine.clone());
    }
    let shared_port = match &flavor {
        Some(Flavor::Userspace(engine)) => Some(engine.port()),
        _ => None,
    };
    let dataplane = match flavor {
        Some(flavor) => Some(
            Linux::start(
                flavor,
                keys.clone(),
                config.persistent_keepalive,
                config.interface_prefix.clone(),
                config.tunnel_mtu(),
            )
            .await
            .context("preparing the data plane (needs root in the gateway's namespace)")?,
        ),
        None => None,
    };
    if dataplane.is_some() && config.handoff_interval > 0 {
        replicas.enable_handoff(std::time::Duration::from_millis(config.handoff_interval));
    }
    tracing::info!(mode = ?mode, public_key = %keys.public(), endpoint = %endpoint_host, port = ?shared_port, slots = %config.wireguard_ports, tunnel_mtu = config.tunnel_mtu(), "gateway ready");
    let settings = Settings {
        identity,
        endpoint_host,
        ports: PortPolicy {
            range: config.wireguard_ports,
            unused_grace: config.unused_port_grace(),
            quarantine: config.port_quarantine(),
        },
        shared_port,
        interface_prefix: config.interface_prefix.clone(),
        node_name,
        node_ip: config.node_ip,
        tunnel_mtu: config.tunnel_mtu(),
    };
    if let Some(dp) = &dataplane {
        server.metrics().register(
            "trellis_gateway_refused_routes",
            "A peer's routed ranges the gateway does not route because each overlaps a network \
             of its node (node network, bridge, overlay): the peer is unreachable there; reserve \
             the node network in the IPAM (--reserved) so the peer is remapped",
            dp.refused_metric(),
        );
    }
    let core = Arc::new(
        Gateway::new(store, settings, mode, keys, dataplane).with_replicas(replicas.clone()),
    );
    let addr = server.local_addr();
    let metrics_addr = server.metrics_addr();
    metrics::register(server.metrics(), &core);

    let mut background = Vec::new();
    let (desired_tx, desired_rx) = tokio::sync::watch::channel(None);
    if let Some(broker) = config.broker.clone() {
        background.push(trellis_runtime::telemetry::spawn(source::run(
            broker,
            common.local_token()?,
            server.metrics().clone(),
            desired_tx,
            shutdown.clone(),
        )));
    } else {
        tracing::info!("no --broker: serving keys, ports and status only");
        drop(desired_tx);
    }
    let (mappings_tx, mappings_rx) = tokio::sync::watch::channel(None);
    if let Some(ipam) = config.ipam.clone() {
        background.push(trellis_runtime::telemetry::spawn(mappings::run(
            ipam,
            common.local_token()?,
            server.metrics().clone(),
            config.mappings_period(),
            mappings_tx,
            shutdown.clone(),
        )));
    } else {
        tracing::info!("no --ipam: no hub-path DNAT");
        drop(mappings_tx);
    }
    if let Some(engine) = engine {
        background.push(trellis_runtime::telemetry::spawn(watch_engine(
            engine,
            shutdown.clone(),
        )));
    }
    background.push(trellis_runtime::telemetry::spawn(follow_election(
        core.clone(),
        replicas.subscribe(),
        shutdown.clone(),
    )));
    background.push(trellis_runtime::telemetry::spawn(
        replicas.clone().run(shutdown.clone()),
    ));
    background.push(trellis_runtime::telemetry::spawn(reconcile::run(
        core.clone(),
        desired_rx,
        mappings_rx,
        config.resync(),
        shutdown.clone(),
    )));

    let routes = routes(core.clone());
    let task = server.spawn(
        routes,
        &[GatewayServer::<GatewayService>::NAME],
        shutdown,
        common.shutdown_grace(),
        background,
    );
    Ok(Started {
        addr,
        metrics_addr,
        core,
        task,
    })
}

/// Applies each outcome of the election to the core until `shutdown`; one that cannot be
/// applied is tried again every second.
async fn follow_election(
    core: Arc<Gateway>,
    mut view: tokio::sync::watch::Receiver<replicas::View>,
    shutdown: Shutdown,
) {
    loop {
        let current = view.borrow_and_update().clone();
        let active = current.active;
        if let Err(err) = core.follow_view(current).await {
            tracing::warn!(active, error = %err, "could not follow the election; retrying");
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(std::time::Duration::from_secs(1)) => continue,
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            changed = view.changed() => if changed.is_err() { return },
        }
    }
}

/// Runs the gateway until `shutdown`.
/// Returns when one of the engine's threads has ended while the gateway runs: the server's
/// supervision then fails the service, so that it is restarted (a dead receiving thread would
/// otherwise leave every tunnel UP on paper and silent in fact).
async fn watch_engine(engine: Arc<Engine>, shutdown: Shutdown) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let stopped = engine.stopped_threads();
        if !stopped.is_empty() {
            tracing::error!(threads = ?stopped, "the userspace wireguard engine lost a thread");
            return;
        }
    }
}

pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    let started = start(config, shutdown).await?;
    started.task.await.context("gateway server task")?
}
