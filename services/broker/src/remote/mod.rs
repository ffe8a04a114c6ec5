//! The broker's ports to other services: this cluster's discovery, IPAM and gateway, and other
//! clusters' brokers and forwarders. Each port builds its requests and converts the answers, so
//! the core and the reconciler speak in domain terms and never see the generated gRPC surface.
//! Channels connect lazily, carry trace context, and are bounded by timeouts so a dead service
//! costs seconds; remote channels are cached per address.
//!
//! A refusal comes back as an [`Error`] naming what was asked where the port knows why it is
//! asked; a method asked for different reasons (the gateway's info, freeing a mapping) or
//! whose failure the caller only logs leaves that to its callers.
//!
//! - [`discovery`]: our identity, the ForeignClusters (read, and the watch-fed copy), peerings;
//! - [`ipam`]: the local subnets, the mappings of remote ranges, how remotes address us;
//! - [`gateway`]: the gateway's endpoint and WireGuard key;
//! - [`peers`]: other clusters' brokers and forwarders: the handshake, unpeering notices and
//!   the NetworkConfig deliveries (batched).
//!
//! [`Error`]: trellis_error::Error

pub mod discovery;
pub mod gateway;
pub mod ipam;
pub mod peers;

use std::time::Duration;

use trellis_error::Result;
use trellis_runtime::client::{Timeouts, local_channel};
use trellis_runtime::local_auth::LocalToken;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::tls::PeerTls;

use self::discovery::Discovery;
use self::gateway::Gateway;
use self::ipam::Ipam;
use self::peers::PeerClusters;

/// Local services answer from their stores; remote ones may be far away.
const LOCAL: Timeouts = Timeouts {
    connect: Duration::from_secs(2),
    request: Duration::from_secs(10),
};

/// Every port the broker uses.
#[derive(Debug)]
pub struct Ports {
    discovery: Discovery,
    ipam: Ipam,
    gateway: Gateway,
    peers: PeerClusters,
}

impl Ports {
    /// Channels to the local services (validated addresses; nothing connects yet), which
    /// carry the local token (ADR 0020), and to other clusters over `tls` when it is on. Every
    /// channel's calls count in `metrics` (`grpc_client_*`).
    pub fn new(
        discovery: &str,
        ipam: &str,
        gateway: &str,
        tls: Option<PeerTls>,
        local_token: &LocalToken,
        metrics: &Metrics,
    ) -> Result<Self> {
        Ok(Self {
            discovery: Discovery::new(local_channel(
                "discovery",
                discovery,
                LOCAL,
                local_token,
                metrics,
            )?),
            ipam: Ipam::new(local_channel("ipam", ipam, LOCAL, local_token, metrics)?),
            gateway: Gateway::new(local_channel(
                "gateway",
                gateway,
                LOCAL,
                local_token,
                metrics,
            )?),
            peers: PeerClusters::new(tls, metrics),
        })
    }

    pub fn discovery(&self) -> &Discovery {
        &self.discovery
    }

    pub fn ipam(&self) -> &Ipam {
        &self.ipam
    }

    pub fn gateway(&self) -> &Gateway {
        &self.gateway
    }

    pub fn peers(&self) -> &PeerClusters {
        &self.peers
    }

    /// The mutual-TLS setup towards other clusters, when on.
    pub fn tls(&self) -> Option<&PeerTls> {
        self.peers.tls()
    }
}
