//! The port to the local gateway: the endpoint and WireGuard key our NetworkConfigs announce.

use trellis_api::ClusterId;
use trellis_api::pb::gateway::GetGatewayInfoRequest;
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_error::Result;
use trellis_runtime::client::TracedChannel;

/// The gateway's endpoint and public key as it spells them: they go into our NetworkConfigs
/// as they are, and the reconciler compares them with what it announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayInfo {
    /// `host:port`; the port may differ per remote.
    pub endpoint: String,
    pub public_key: String,
}

/// The local gateway.
#[derive(Debug)]
pub struct Gateway {
    channel: TracedChannel,
}

impl Gateway {
    pub(super) fn new(channel: TracedChannel) -> Self {
        Self { channel }
    }

    /// The gateway's endpoint and key towards `remote`, or in general (`None`: the key and
    /// the endpoint's host are the same for every remote).
    pub async fn info(&self, remote: Option<&ClusterId>) -> Result<GatewayInfo> {
        let answer = GatewayClient::new(self.channel.clone())
            .get_gateway_info(GetGatewayInfoRequest {
                cluster_id: remote.map(ToString::to_string).unwrap_or_default(),
            })
            .await?
            .into_inner();
        Ok(GatewayInfo {
            endpoint: answer.endpoint,
            public_key: answer.public_key,
        })
    }
}
