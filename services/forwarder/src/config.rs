//! Command-line flags of `trellis-forwarder` (each also `TRELLIS_<FLAG>`).

use std::time::Duration;

use clap::Parser;
use trellis_runtime::CommonConfig;
use trellis_runtime::config::HasCommon;
use trellis_runtime::config::PeerTlsConfig;
use trellis_runtime::config::address_arg;

/// The forwarding service of a hub cluster: relays passthrough NetworkConfigs (and their
/// statuses and withdrawals) between two of its full peers that are induced peers of each
/// other, persisting each relay until the other end acknowledges it.
#[derive(Debug, Clone, Parser)]
#[command(name = "trellis-forwarder", version, about, long_about = None)]
pub struct Config {
    #[command(flatten)]
    pub common: CommonConfig,

    #[command(flatten)]
    pub tls: PeerTlsConfig,

    /// Address of this cluster's discovery service ("host:port"): who our full peers are and
    /// where their brokers listen.
    #[arg(long, env = "TRELLIS_DISCOVERY", value_name = "HOST:PORT", value_parser = address_arg)]
    pub discovery: String,

    /// Longest wait between two delivery attempts of a relay whose other end is unreachable,
    /// in seconds (attempts back off from 200 ms up to this).
    #[arg(
        long,
        env = "TRELLIS_RETRY_MAX",
        value_name = "SECONDS",
        default_value_t = 10
    )]
    pub retry_max: u64,
}

impl HasCommon for Config {
    fn common(&self) -> &CommonConfig {
        &self.common
    }
}

impl Config {
    /// The longest retry wait.
    pub fn retry_max(&self) -> Duration {
        Duration::from_secs(self.retry_max.max(1))
    }
}
