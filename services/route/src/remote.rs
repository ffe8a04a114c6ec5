//! The agent's port to its gateway: one replica's `WatchRoutes` stream, each message
//! converted at this edge into a [`RoutesUpdate`] in the agent's own terms (validated: a field
//! this agent cannot use is named in the error), so the planning and the node code never see
//! the wire types.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::Ipv4Net;
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::gateway::{WatchRoutesRequest, WatchRoutesResponse};
use trellis_error::{Error, Result};
use trellis_runtime::client::{Timeouts, local_channel};
use trellis_runtime::local_auth::LocalToken;
use trellis_runtime::metrics::Metrics;

/// Where the gateway node is, as one routes message says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatewayIp {
    /// Its node IP.
    V4(Ipv4Addr),
    /// Not an IP address (the gateway runs without `--node-ip`): only the gateway node itself
    /// can do without it. The text as received, for the error.
    Unusable(String),
}

/// One message of the gateway's `WatchRoutes` stream, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutesUpdate {
    /// The election the message belongs to (0: none yet).
    pub epoch: u64,
    /// The node the active gateway runs on (never empty).
    pub gateway_node: String,
    pub gateway_ip: GatewayIp,
    /// Every remote prefix the cluster's tunnels carry, truncated to their network.
    pub remote_prefixes: BTreeSet<Ipv4Net>,
    /// The tunnels' MTU, when the gateway says.
    pub tunnel_mtu: Option<u32>,
}

impl TryFrom<WatchRoutesResponse> for RoutesUpdate {
    type Error = Error;

    fn try_from(message: WatchRoutesResponse) -> Result<Self> {
        if message.gateway_node_name.is_empty() {
            return Err(Error::invalid(
                "gateway_node_name",
                "is empty: the gateway runs without --node-name",
            ));
        }
        let gateway_ip = match message.gateway_node_ip.parse::<IpAddr>() {
            Ok(IpAddr::V4(ip)) => GatewayIp::V4(ip),
            Ok(IpAddr::V6(_)) => {
                return Err(Error::invalid(
                    "gateway_node_ip",
                    "is IPv6; the overlay is IPv4 only",
                ));
            }
            Err(_) => GatewayIp::Unusable(message.gateway_node_ip),
        };
        let mut remote_prefixes = BTreeSet::new();
        for (i, text) in message.remote_prefixes.iter().enumerate() {
            let net: Ipv4Net = text.parse().map_err(|_| {
                Error::invalid(
                    format!("remote_prefixes[{i}]"),
                    format!("{text:?} is not an IPv4 CIDR"),
                )
            })?;
            remote_prefixes.insert(net.trunc());
        }
        Ok(Self {
            epoch: message.epoch,
            gateway_node: message.gateway_node_name,
            gateway_ip,
            remote_prefixes,
            tunnel_mtu: (message.tunnel_mtu != 0).then_some(message.tunnel_mtu),
        })
    }
}

/// A message as the agent receives it: its epoch (also for a message it cannot use, so that
/// an older election's is still told apart) and the update, or why it cannot be used.
pub type Received = (u64, Result<RoutesUpdate>);

/// The open `WatchRoutes` stream of one gateway replica.
pub struct RoutesStream(tonic::Streaming<WatchRoutesResponse>);

impl std::fmt::Debug for RoutesStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RoutesStream")
    }
}

impl RoutesStream {
    /// Opens the stream of the replica at `address` for `node_name`, sending the local token;
    /// its calls count in `metrics`.
    pub async fn open(
        address: &str,
        node_name: &str,
        token: &LocalToken,
        metrics: &Metrics,
    ) -> anyhow::Result<Self> {
        let channel = local_channel("--gateway", address, Timeouts::default(), token, metrics)?;
        let response = GatewayClient::new(channel)
            .watch_routes(WatchRoutesRequest {
                node_name: node_name.to_owned(),
            })
            .await
            .map_err(|s| anyhow::anyhow!("WatchRoutes: {}", s.message()))?;
        Ok(Self(response.into_inner()))
    }

    /// The next message, or `None` once the stream has ended or broken.
    pub async fn next(&mut self) -> Option<Received> {
        match self.0.message().await {
            Ok(Some(message)) => Some((message.epoch, RoutesUpdate::try_from(message))),
            Ok(None) | Err(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(prefixes: &[&str]) -> WatchRoutesResponse {
        WatchRoutesResponse {
            remote_prefixes: prefixes.iter().map(|p| (*p).to_owned()).collect(),
            gateway_node_name: "n0".into(),
            gateway_node_ip: "100.64.1.1".into(),
            tunnel_mtu: 1420,
            epoch: 1,
        }
    }

    #[test]
    fn a_message_becomes_an_update_in_the_agents_terms() {
        let update =
            RoutesUpdate::try_from(message(&["10.83.1.7/16", "10.81.0.0/16"])).expect("usable");
        assert_eq!(
            update.gateway_ip,
            GatewayIp::V4(Ipv4Addr::new(100, 64, 1, 1))
        );
        let prefixes: Vec<String> = update
            .remote_prefixes
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            prefixes,
            ["10.81.0.0/16", "10.83.0.0/16"],
            "truncated and sorted"
        );
        assert_eq!(update.tunnel_mtu, Some(1420));
        let mut m = message(&[]);
        m.tunnel_mtu = 0;
        assert_eq!(RoutesUpdate::try_from(m).expect("usable").tunnel_mtu, None);
    }

    #[test]
    fn unusable_messages_name_the_field() {
        let err =
            RoutesUpdate::try_from(message(&["10.83.0.0/16", "nonsense"])).expect_err("bad prefix");
        assert!(err.to_string().contains("remote_prefixes[1]"), "{err}");
        let mut m = message(&[]);
        m.gateway_node_ip = "fd00::1".into();
        let err = RoutesUpdate::try_from(m.clone()).expect_err("IPv6");
        assert!(err.to_string().contains("gateway_node_ip"), "{err}");
        m.gateway_node_ip = String::new();
        assert_eq!(
            RoutesUpdate::try_from(m.clone())
                .expect("usable on the gateway node")
                .gateway_ip,
            GatewayIp::Unusable(String::new())
        );
        m.gateway_node_name = String::new();
        let err = RoutesUpdate::try_from(m).expect_err("no gateway node");
        assert!(err.to_string().contains("gateway_node_name"), "{err}");
    }
}
