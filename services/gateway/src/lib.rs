//! `trellis-gateway`: the gateway of one Trellis cluster (docs/architecture.md "Data plane"; ADRs 0007,
//! 0008, 0009). It runs inside whatever network namespace it is started in.
//!
//! - [`keys`]: the WireGuard key pair, generated once and kept in the store;
//! - [`ports`]: one slot per remote peer (its mark and table; in kernel mode its listen
//!   port), persisted and unique;
//! - [`names`]: interface names, connection marks and routing tables per peer;
//! - [`dataplane`]: the userspace WireGuard engine (one UDP port for every peer), WireGuard
//!   interfaces, routes, policy rules and nftables NAT (root only);
//! - [`remote`]: the ports to the broker (its TunnelEndpoints, followed with a resumable watch)
//!   and to the IPAM (its external-CIDR endpoint mappings, polled);
//! - [`mappings`]: those mappings (hub-path DNAT) in the gateway's terms;
//! - [`reconcile`]: the loop applying them; `tasks`: following the election, watching the
//!   engine's threads;
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
pub mod remote;
pub mod replicas;
mod tasks;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tonic::server::NamedService;
use trellis_api::pb::gateway::gateway_server::GatewayServer;
use trellis_runtime::{Bootstrap, Service, Shutdown};

pub use crate::config::Config;
pub use crate::core::Gateway;
use crate::core::Settings;
use crate::dataplane::Mode;
use crate::dataplane::engine::{self, Engine, RelayPolicy};
use crate::dataplane::linux::Linux;
use crate::dataplane::wireguard::Flavor;
use crate::grpc::GatewayService;
pub use crate::grpc::routes;
use crate::keys::KeyPair;
use crate::ports::PortPolicy;

/// Largest request accepted, in bytes: gateway requests carry at most a cluster ID.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

/// A running gateway; its task finishes when the server and the reconciler have stopped (the
/// data plane removed).
pub type Started = trellis_runtime::Started<Gateway>;

/// Opens the store, loads the key, prepares the data plane, binds, serves, and follows the
/// broker when one is configured.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let common = &config.common;
    let endpoint_host = config.endpoint_host()?;
    let (mut boot, opened) = Bootstrap::open(Service::GATEWAY, common, None, &shutdown).await?;
    let (identity, store) = (opened.identity, opened.store);
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
            boot.metrics(),
        )
        .await?,
    );
    let mode = Mode::resolve(config.dataplane);
    let flavor = match mode {
        Mode::None => None,
        Mode::Userspace => {
            let port = config.wireguard_port;
            let private = keys.private_bytes();
            let options = engine::Options {
                tun_offload: !config.no_tun_offload,
                busy_poll: Duration::from_micros(config.busy_poll_us),
                busy_poll_budget_percent: config.busy_poll_budget_percent,
                ..engine::Options::default()
            };
            let engine =
                tokio::task::spawn_blocking(move || Engine::start_with(port, private, options))
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
        engine.set_relay_policy(RelayPolicy {
            enabled: !config.no_relay,
            rate: f64::from(config.relay_rate),
            burst: (f64::from(config.relay_rate) / 10.0).max(1.0),
        });
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
        // Only the userspace engine translates: kernel WireGuard cannot rewrite what it sends,
        // and without a data plane nothing does.
        stateless_wire: !config.no_stateless_wire && shared_port.is_some(),
    };
    if let Some(dp) = &dataplane {
        boot.metrics().register(
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
    metrics::register(boot.metrics(), &core);

    let (desired_tx, desired_rx) = tokio::sync::watch::channel(None);
    if let Some(broker) = config.broker.clone() {
        boot.spawn(remote::broker::run(
            broker,
            boot.local_token().clone(),
            boot.metrics().clone(),
            desired_tx,
            shutdown.clone(),
        ));
    } else {
        tracing::info!("no --broker: serving keys, ports and status only");
        drop(desired_tx);
    }
    let (mappings_tx, mappings_rx) = tokio::sync::watch::channel(None);
    if let Some(ipam) = config.ipam.clone() {
        boot.spawn(remote::ipam::run(
            ipam,
            boot.local_token().clone(),
            boot.metrics().clone(),
            config.mappings_period(),
            mappings_tx,
            shutdown.clone(),
        ));
    } else {
        tracing::info!("no --ipam: no hub-path DNAT");
        drop(mappings_tx);
    }
    if let Some(engine) = engine {
        boot.spawn(tasks::watch_engine(engine, shutdown.clone()));
    }
    boot.spawn(tasks::follow_election(
        core.clone(),
        replicas.subscribe(),
        shutdown.clone(),
    ));
    boot.spawn(replicas.clone().run(shutdown.clone()));
    boot.spawn(reconcile::run(
        core.clone(),
        desired_rx,
        mappings_rx,
        config.resync(),
        shutdown.clone(),
    ));

    let routes = routes(core.clone());
    Ok(boot.serve(routes, &[GatewayServer::<GatewayService>::NAME], core))
}

/// Runs the gateway until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    start(config, shutdown).await?.finished().await
}
