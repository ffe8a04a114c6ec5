//! gRPC clients: this cluster's discovery, IPAM and gateway, and other clusters' brokers and
//! forwarders. Channels connect lazily, carry trace context, and are bounded by timeouts so a
//! dead service costs seconds; remote channels are cached per address.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_error::Result;
use trellis_runtime::client::{Timeouts, TracedChannel, channel};

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
    remote: Mutex<HashMap<String, TracedChannel>>,
}

impl Clients {
    /// Channels to the local services (validated addresses; nothing connects yet).
    pub fn new(discovery: &str, ipam: &str, gateway: &str) -> Result<Self> {
        Ok(Self {
            discovery: channel("discovery", discovery, LOCAL)?,
            ipam: channel("ipam", ipam, LOCAL)?,
            gateway: channel("gateway", gateway, LOCAL)?,
            remote: Mutex::new(HashMap::new()),
        })
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

    fn remote_channel(&self, field: &str, address: &str) -> Result<TracedChannel> {
        if let Ok(cache) = self.remote.lock()
            && let Some(found) = cache.get(address)
        {
            return Ok(found.clone());
        }
        let created = channel(field, address, REMOTE)?;
        if let Ok(mut cache) = self.remote.lock() {
            cache.insert(address.to_owned(), created.clone());
        }
        Ok(created)
    }

    /// Another cluster's broker.
    pub fn broker(&self, address: &str) -> Result<BrokerClient<TracedChannel>> {
        Ok(BrokerClient::new(
            self.remote_channel("broker_address", address)?,
        ))
    }

    /// A hub's forwarder.
    pub fn forwarder(&self, address: &str) -> Result<ForwarderClient<TracedChannel>> {
        Ok(ForwarderClient::new(
            self.remote_channel("forwarder", address)?,
        ))
    }
}
