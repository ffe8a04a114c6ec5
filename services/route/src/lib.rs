//! `trellis-route`: the node agent of one Trellis cluster (one per node; a DaemonSet in
//! Kubernetes). It follows the local gateway's `WatchRoutes` stream and programs its node so
//! that pod traffic for remote clusters reaches the gateway node over a VXLAN overlay, and the
//! replies of traffic the gateway DNATs to this node's pods find their way back (docs/adr/0016).
//!
//! - [`remote`]: the port to the gateway: its `WatchRoutes` stream, converted to updates in the
//!   agent's terms;
//! - [`plan`]: the wanted state of a node from one update (pure);
//! - [`node`]: reading and programming the node (VXLAN, routes, rp_filter, MSS clamp);
//! - [`agent`]: the follow-and-reconcile loop;
//! - [`grpc`]: the status RPC; [`config`]: the flags.

pub mod agent;
pub mod config;
pub mod grpc;
pub mod node;
pub mod plan;
pub mod remote;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::server::NamedService;
use tonic::service::Routes;
use trellis_api::pb::route::route_server::RouteServer;
use trellis_runtime::{Bootstrap, Service, Shutdown};

use crate::agent::Agent;
pub use crate::config::Config;
use crate::grpc::RouteService;
use crate::plan::NodeSettings;

/// A running agent (its core is the [`Agent`]).
pub type Started = trellis_runtime::Started<Agent>;

/// Checks the node, binds, serves status and starts following the gateway.
pub async fn start(config: Config, shutdown: Shutdown) -> anyhow::Result<Started> {
    let node_ip = config.node_ip;
    // A wrong --proc-sys-net would only show at the first reconcile; say so at start.
    let forwarding = config.proc_sys_net.join("ipv4/ip_forward");
    if !tokio::fs::try_exists(&forwarding).await.unwrap_or(false) {
        anyhow::bail!(
            "--proc-sys-net {}: no ipv4/ip_forward there; name the node's /proc/sys/net (or a \
             mount of it)",
            config.proc_sys_net.display()
        );
    }
    let (underlay, detected_mtu, node_network) = node::underlay(node_ip).await?;
    let node_cidrs = if config.node_cidrs.is_empty() {
        vec![node_network]
    } else {
        config.node_cidrs.clone()
    };
    // Bound first: its registry records the calls to the gateway.
    let mut boot = Bootstrap::bind(Service::ROUTE, &config.base, &shutdown).await?;
    let node = NodeSettings {
        name: config.node_name.clone(),
        ip: node_ip,
        interface: config.interface.clone(),
        vxlan_id: config.vxlan_id,
        vxlan_port: config.vxlan_port,
        underlay_mtu: config.underlay_mtu.unwrap_or(detected_mtu),
        proc_sys_net: config.proc_sys_net.clone(),
        node_cidrs,
        refused: node::Refused::registered(boot.metrics()),
    };
    tracing::info!(node = %node.name, node_ip = %node.ip, underlay = %underlay, underlay_mtu = node.underlay_mtu, node_cidrs = ?node.node_cidrs, gateways = ?config.gateway, "route agent ready");
    let agent = Arc::new(Agent {
        node,
        underlay,
        gateways: config.gateway.clone(),
        local_token: boot.local_token().clone(),
        metrics: boot.metrics().clone(),
        resync: Duration::from_secs(config.resync_interval),
        status: Mutex::new(agent::Status::default()),
    });
    boot.spawn(agent::run(agent.clone(), shutdown));
    let routes = Routes::new(RouteServer::new(RouteService::new(agent.clone())));
    Ok(boot.serve(routes, &[RouteServer::<RouteService>::NAME], agent))
}

/// Runs the agent until `shutdown`.
pub async fn run(config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    start(config, shutdown).await?.finished().await
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[tokio::test]
    async fn a_proc_sys_net_without_net_sysctls_is_refused_at_start_naming_the_flag() {
        let config = Config::try_parse_from([
            "trellis-route",
            "--cluster-id",
            "a",
            "--gateway",
            "127.0.0.1:7106",
            "--node-name",
            "n1",
            "--node-ip",
            "127.0.0.1",
            "--proc-sys-net",
            "/nonexistent/proc/sys/net",
        ])
        .expect("parses");
        let err = start(config, Shutdown::new()).await.expect_err("refused");
        let text = format!("{err:#}");
        assert!(
            text.contains("--proc-sys-net /nonexistent/proc/sys/net"),
            "{text}"
        );
    }
}
