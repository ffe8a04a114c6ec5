//! Command-line flags of `trellis-broker` (each also `TRELLIS_<FLAG>`).

use std::time::Duration;

use clap::Parser;
use trellis_api::net::AllowedRanges;
use trellis_runtime::CommonConfig;
use trellis_runtime::config::HasCommon;
use trellis_runtime::config::PeerTlsConfig;
use trellis_runtime::config::address_arg;

use crate::core::DEFAULT_RESYNC;

/// The peering broker of one Trellis cluster: token handshake with full peers, NetworkConfig
/// exchange (directly, or relayed by a hub's forwarder for induced peers), TunnelEndpoints for
/// the gateway, and unpeering.
#[derive(Clone, Parser)]
#[command(name = "trellis-broker", version, about, long_about = None)]
pub struct Config {
    #[command(flatten)]
    pub common: CommonConfig,

    #[command(flatten)]
    pub tls: PeerTlsConfig,

    /// Address of this cluster's discovery service ("host:port"): peers are recorded there,
    /// and its ForeignClusters say which NetworkConfigs to exchange.
    #[arg(long, env = "TRELLIS_DISCOVERY", value_name = "HOST:PORT", value_parser = address_arg)]
    pub discovery: String,

    /// Address of this cluster's IPAM service: pod and external CIDRs for our NetworkConfigs,
    /// NAT decisions on received ones.
    #[arg(long, env = "TRELLIS_IPAM", value_name = "HOST:PORT", value_parser = address_arg)]
    pub ipam: String,

    /// Address of this cluster's gateway service: WireGuard endpoint and public key for our
    /// NetworkConfigs.
    #[arg(long, env = "TRELLIS_GATEWAY", value_name = "HOST:PORT", value_parser = address_arg)]
    pub gateway: String,

    /// The peering token to use when the store holds none yet (otherwise a random one is
    /// generated). A secret: prefer the environment variable over the flag.
    // Tokens are base64url and may start with '-'.
    #[arg(
        long,
        env = "TRELLIS_TOKEN",
        value_name = "TOKEN",
        hide_env_values = true,
        allow_hyphen_values = true
    )]
    pub token: Option<String>,

    /// Seconds between two full reconciliations when nothing triggers one earlier. A
    /// reconciliation that takes long is followed by a wait of at least nine times its duration.
    #[arg(
        long,
        env = "TRELLIS_RESYNC",
        value_name = "SECONDS",
        default_value_t = DEFAULT_RESYNC.as_secs()
    )]
    pub resync: u64,

    /// Seconds between two refreshes of the induced peers' candidates: where the hubs that
    /// introduced them see their gateways (their reflexive endpoints, for NAT traversal; ADR
    /// 0025). 0 turns the refresh off.
    #[arg(
        long,
        env = "TRELLIS_CANDIDATES_REFRESH",
        value_name = "SECONDS",
        default_value_t = 10
    )]
    pub candidates_refresh: u64,

    /// Comma-separated CIDRs a peer's pod and external CIDRs, and the ranges it addresses ours
    /// with, must lie in; anything else is refused (InvalidArgument naming the field), because
    /// those ranges are routed into its tunnel. The default is private and shared address
    /// space; add a range here only if a peer really uses it.
    #[arg(
        long,
        env = "TRELLIS_ALLOWED_REMOTE_CIDRS",
        value_name = "CIDRS",
        value_parser = AllowedRanges::parse,
        default_value = AllowedRanges::DEFAULT
    )]
    pub allowed_remote_cidrs: AllowedRanges,
}

/// Shows everything but the token (a secret).
impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("common", &self.common)
            .field("tls", &self.tls)
            .field("discovery", &self.discovery)
            .field("ipam", &self.ipam)
            .field("gateway", &self.gateway)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("resync", &self.resync)
            .field("candidates_refresh", &self.candidates_refresh)
            .field("allowed_remote_cidrs", &self.allowed_remote_cidrs)
            .finish()
    }
}

impl HasCommon for Config {
    fn common(&self) -> &CommonConfig {
        &self.common
    }
}

impl Config {
    /// The resync period.
    pub fn resync(&self) -> Duration {
        Duration::from_secs(self.resync.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generated token is base64url: one in 64 starts with '-', and must still be taken as
    /// the flag's value, not as another flag.
    #[test]
    fn a_token_starting_with_a_hyphen_is_the_tokens_value() {
        let token = "-F0123456789abcdefghijklmnopqrstuvwxyzABCDEF";
        let config = Config::try_parse_from([
            "trellis-broker",
            "--cluster-id",
            "hub",
            "--store",
            "memory://",
            "--discovery",
            "127.0.0.1:7101",
            "--ipam",
            "127.0.0.1:7104",
            "--gateway",
            "127.0.0.1:7106",
            "--insecure-plaintext-peering",
            "--token",
            token,
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(config.token.as_deref(), Some(token));
    }
}
