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

    /// Delivery attempts in flight at once, over all destinations. Each cluster is called by
    /// at most one of them at a time, so a destination that never answers holds one slot
    /// (until the delivery timeout, 7 s) while relays to the others go on.
    #[arg(
        long,
        env = "TRELLIS_DELIVERY_CONCURRENCY",
        value_name = "N",
        default_value_t = 16,
        value_parser = clap::value_parser!(u16).range(1..)
    )]
    pub delivery_concurrency: u16,

    /// How long a relay the destination refused for good (state FAILED) stays listed by
    /// ListRelays for operators before it is deleted, in seconds. The origin keeps re-sending
    /// on its own, so deleting it loses nothing but the diagnostic.
    #[arg(
        long,
        env = "TRELLIS_FAILED_RETENTION",
        value_name = "SECONDS",
        default_value_t = 3600
    )]
    pub failed_retention: u64,
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

    /// How relays are retried and kept.
    pub fn delivery(&self) -> crate::core::Delivery {
        crate::core::Delivery {
            retry_max: self.retry_max(),
            concurrency: usize::from(self.delivery_concurrency),
            retention: Duration::from_secs(self.failed_retention),
        }
    }
}
