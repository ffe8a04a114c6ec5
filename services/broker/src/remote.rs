//! gRPC clients: this cluster's discovery, IPAM and gateway, and other clusters' brokers and
//! forwarders. Channels connect lazily, carry trace context, and are bounded by timeouts so a
//! dead service costs seconds; remote channels are cached per address.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use trellis_api::ClusterId;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{
    RelayRequest, RelayResponse, SubmitNetworkConfigRequest, SubmitNetworkConfigResponse,
};
use trellis_error::Result;
use trellis_runtime::batch::{self, Batchers, Relayer, Submitter};
use trellis_runtime::client::{Timeouts, TracedChannel, local_channel};
use trellis_runtime::local_auth::LocalToken;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::tls::{
    CaCertHash, PeerTls, PinnedCa, cluster_channel, first_contact_channel, peer_channel_pinned,
    pinned_handshake_channel,
};

/// Local services answer from their stores; remote ones may be far away.
const LOCAL: Timeouts = Timeouts {
    connect: Duration::from_secs(2),
    request: Duration::from_secs(10),
};
const REMOTE: Timeouts = Timeouts {
    connect: Duration::from_secs(3),
    request: Duration::from_secs(15),
};

/// Every client the broker uses.
#[derive(Debug)]
pub struct Clients {
    discovery: TracedChannel,
    ipam: TracedChannel,
    gateway: TracedChannel,
    /// Mutual TLS towards other clusters (ADR 0014); plaintext when absent.
    tls: Option<PeerTls>,
    /// Remote channels by (address, expected cluster).
    remote: Mutex<HashMap<(String, String), TracedChannel>>,
    /// `SubmitNetworkConfig` to remote brokers and `Relay` to hubs' forwarders, batched.
    submitters: Batchers<SubmitNetworkConfigRequest, SubmitNetworkConfigResponse>,
    relayers: Batchers<RelayRequest, RelayResponse>,
    /// The broker's registry: every channel's calls count there (`grpc_client_*`).
    metrics: Metrics,
}

impl Clients {
    /// Channels to the local services (validated addresses; nothing connects yet), which
    /// carry the local token (ADR 0020).
    pub fn new(
        discovery: &str,
        ipam: &str,
        gateway: &str,
        tls: Option<PeerTls>,
        local_token: &LocalToken,
        metrics: &Metrics,
    ) -> Result<Self> {
        Ok(Self {
            discovery: local_channel("discovery", discovery, LOCAL, local_token, metrics)?,
            ipam: local_channel("ipam", ipam, LOCAL, local_token, metrics)?,
            gateway: local_channel("gateway", gateway, LOCAL, local_token, metrics)?,
            tls,
            remote: Mutex::new(HashMap::new()),
            submitters: Batchers::default(),
            relayers: Batchers::default(),
            metrics: metrics.clone(),
        })
    }

    /// The mutual-TLS setup, when on.
    pub fn tls(&self) -> Option<&PeerTls> {
        self.tls.as_ref()
    }

    /// The local discovery service's channel.
    pub fn discovery_channel(&self) -> TracedChannel {
        self.discovery.clone()
    }

    pub fn discovery(&self) -> DiscoveryClient<TracedChannel> {
        DiscoveryClient::new(self.discovery.clone())
    }

    pub fn ipam(&self) -> IpamClient<TracedChannel> {
        IpamClient::new(self.ipam.clone())
    }

    pub fn gateway(&self) -> GatewayClient<TracedChannel> {
        GatewayClient::new(self.gateway.clone())
    }

    /// A channel to cluster `expected` at `address`: over mutual TLS (the server must chain to
    /// `expected`'s pinned CA) when TLS is on.
    fn remote_channel(
        &self,
        field: &str,
        address: &str,
        expected: &ClusterId,
    ) -> Result<TracedChannel> {
        let key = (address.to_owned(), expected.to_string());
        if let Ok(cache) = self.remote.lock()
            && let Some(found) = cache.get(&key)
        {
            return Ok(found.clone());
        }
        let created = cluster_channel(
            self.tls.as_ref(),
            field,
            address,
            expected.as_str(),
            REMOTE,
            &self.metrics,
        )?;
        if let Ok(mut cache) = self.remote.lock() {
            cache.insert(key, created.clone());
        }
        Ok(created)
    }

    /// Cluster `expected`'s broker.
    pub fn broker(
        &self,
        address: &str,
        expected: &ClusterId,
    ) -> Result<BrokerClient<TracedChannel>> {
        Ok(BrokerClient::new(self.remote_channel(
            "broker_address",
            address,
            expected,
        )?))
    }

    /// Cluster `expected`'s broker's `SubmitNetworkConfig`, batched with our other submissions
    /// to it.
    pub fn submitter(&self, address: &str, expected: &ClusterId) -> Result<Submitter> {
        self.submitters
            .get_or_make((address.to_owned(), expected.to_string()), || {
                Ok(batch::submitter(self.remote_channel(
                    "broker_address",
                    address,
                    expected,
                )?))
            })
    }

    /// Cluster `expected`'s broker after we unpeered it: over mutual TLS its server must chain
    /// to `ca_pem` (no longer pinned). Not cached.
    pub fn unpinned_broker(
        &self,
        address: &str,
        expected: &ClusterId,
        ca_pem: &str,
    ) -> Result<BrokerClient<TracedChannel>> {
        match &self.tls {
            Some(tls) if !ca_pem.is_empty() => {
                let ca = PinnedCa::from_pem(expected.as_str(), ca_pem)?;
                Ok(BrokerClient::new(peer_channel_pinned(
                    tls,
                    "broker_address",
                    address,
                    ca,
                    REMOTE,
                    &self.metrics,
                )?))
            }
            _ => self.broker(address, expected),
        }
    }

    /// The broker we handshake with: first contact, so no pinned CA yet (TLS without a client
    /// certificate when TLS is on; ADR 0014). Not cached.
    pub fn handshake_broker(&self, address: &str) -> Result<BrokerClient<TracedChannel>> {
        Ok(BrokerClient::new(first_contact_channel(
            self.tls.as_ref(),
            "broker_address",
            address,
            REMOTE,
            &self.metrics,
        )?))
    }

    /// The broker we handshake with, reachable only if its certificate chains to the CA `pin`
    /// names (`ca_cert_hash`). Needs TLS.
    pub fn pinned_handshake_broker(
        &self,
        address: &str,
        pin: CaCertHash,
    ) -> Result<BrokerClient<TracedChannel>> {
        let tls = self.tls.as_ref().ok_or_else(|| {
            trellis_error::Error::FailedPrecondition(
                "ca_cert_hash pins the remote's CA over mutual TLS, and this broker runs \
                 without it (--peer-listen and the --tls-* files)"
                    .into(),
            )
        })?;
        Ok(BrokerClient::new(pinned_handshake_channel(
            tls,
            "broker_address",
            address,
            pin,
            REMOTE,
            &self.metrics,
        )?))
    }

    /// Hub `expected`'s forwarder's `Relay`, batched with our other relays through it.
    pub fn relayer(&self, address: &str, expected: &ClusterId) -> Result<Relayer> {
        self.relayers
            .get_or_make((address.to_owned(), expected.to_string()), || {
                Ok(batch::relayer(self.remote_channel(
                    "forwarder",
                    address,
                    expected,
                )?))
            })
    }

    /// Hub `expected`'s forwarder.
    pub fn forwarder(
        &self,
        address: &str,
        expected: &ClusterId,
    ) -> Result<ForwarderClient<TracedChannel>> {
        Ok(ForwarderClient::new(self.remote_channel(
            "forwarder",
            address,
            expected,
        )?))
    }
}
