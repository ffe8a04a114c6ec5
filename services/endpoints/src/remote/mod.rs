//! The endpoints service's ports to other services: this cluster's IPAM and discovery, other
//! clusters' IPAMs (the induced path) and endpoints services (delivery). Each port builds its
//! requests and converts the answers, so the core works in its own terms only:
//!
//! - [`discovery`]: the ForeignCluster records of the peers;
//! - [`ipam`]: the local IPAM (who owns an address, how it is mapped for a target, the
//!   records of each peer) and other clusters' IPAMs ([`ipam::RemoteIpam`]);
//! - [`endpoints`]: delivering reflected slices to other clusters' endpoints services.
//!
//! Channels connect lazily, carry trace context and are bounded by timeouts; remote IPAM
//! channels are cached per cluster (replaced when the cluster advertises a new address), and a
//! call to one is retried a bounded number of times when it is unavailable, so a dead home
//! cluster costs at most `attempts × timeout`. With mutual TLS configured (ADR 0014) every
//! channel to another cluster presents our certificate and verifies the server against that
//! cluster's pinned CA.

use std::collections::HashMap;
use std::sync::Mutex;

use trellis_api::ClusterId;
use trellis_error::{Error, Result};
use trellis_runtime::client::{Timeouts, TracedChannel, local_channel};
use trellis_runtime::tls::PeerTls;

pub mod discovery;
pub mod endpoints;
pub mod ipam;

/// The endpoints service's ports: the channels to every service it calls, and their settings.
#[derive(Debug)]
pub struct Clients {
    ipam: TracedChannel,
    discovery: TracedChannel,
    remote_ipam_timeouts: Timeouts,
    remote_ipam_attempts: u32,
    deliver_timeouts: Timeouts,
    remote_ipams: Mutex<HashMap<ClusterId, (String, TracedChannel)>>,
    remote_endpoints: Mutex<HashMap<(ClusterId, String), TracedChannel>>,
    tls: Option<PeerTls>,
    metrics: trellis_runtime::metrics::Metrics,
}

/// Settings of [`Clients::new`].
#[derive(Debug, Clone)]
pub struct ClientSettings {
    pub ipam: String,
    pub discovery: String,
    pub local: Timeouts,
    pub remote_ipam: Timeouts,
    pub remote_ipam_attempts: u32,
    pub deliver: Timeouts,
    /// Mutual TLS towards other clusters, when configured.
    pub tls: Option<PeerTls>,
    /// Sent to the local IPAM and discovery only (ADR 0020).
    pub local_token: trellis_runtime::local_auth::LocalToken,
    /// The service's registry: every channel's calls count there (`grpc_client_*`).
    pub metrics: trellis_runtime::metrics::Metrics,
}

impl Clients {
    /// Channels to the local services (validated addresses; nothing connects yet).
    pub fn new(settings: ClientSettings) -> Result<Self> {
        Ok(Self {
            ipam: local_channel(
                "ipam",
                &settings.ipam,
                settings.local,
                &settings.local_token,
                &settings.metrics,
            )?,
            discovery: local_channel(
                "discovery",
                &settings.discovery,
                settings.local,
                &settings.local_token,
                &settings.metrics,
            )?,
            remote_ipam_timeouts: settings.remote_ipam,
            remote_ipam_attempts: settings.remote_ipam_attempts.max(1),
            deliver_timeouts: settings.deliver,
            remote_ipams: Mutex::new(HashMap::new()),
            remote_endpoints: Mutex::new(HashMap::new()),
            tls: settings.tls,
            metrics: settings.metrics,
        })
    }

    /// The channel to this cluster's discovery (the trust store follows its full peers).
    pub fn discovery_channel(&self) -> TracedChannel {
        self.discovery.clone()
    }
}

/// A local service's failure, keeping its kind; an unreachable one names the service.
pub(crate) fn local_error(service: &str, status: tonic::Status) -> Error {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => {
            Error::Unavailable(format!("local {service} unreachable: {}", status.message()))
        }
        _ => Error::from(status).context(format!("local {service}")),
    }
}
