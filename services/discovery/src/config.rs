//! Command-line flags of `trellis-discovery` (each also `TRELLIS_<FLAG>`).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use trellis_runtime::CommonConfig;
use trellis_runtime::config::address_arg;
use trellis_runtime::config::{HasCommon, PeerTlsConfig};

use crate::records::Addresses;

/// The discovery service of one Trellis cluster: keeps the cluster's identity and the
/// ForeignClusters it knows (found manually, by DNS-SRV or mDNS, peered, or induced by a hub's
/// Neighborhood), and sends its own Neighborhoods when it is a hub.
#[derive(Debug, Clone, Parser)]
#[command(name = "trellis-discovery", version, about, long_about = None)]
pub struct Config {
    #[command(flatten)]
    pub common: CommonConfig,

    #[command(flatten)]
    pub tls: PeerTlsConfig,

    /// Address of this discovery service as other clusters reach it (returned by GetIdentity).
    /// Defaults to the peer listener with --peer-listen, else to the listen address, when that
    /// is not a wildcard.
    #[arg(long, env = "TRELLIS_ADVERTISE_DISCOVERY", value_name = "HOST:PORT", value_parser = address_arg)]
    pub advertise_discovery: Option<String>,

    /// Address of this cluster's broker as other clusters reach it (returned by GetIdentity).
    #[arg(long, env = "TRELLIS_ADVERTISE_BROKER", value_name = "HOST:PORT", value_parser = address_arg)]
    pub advertise_broker: Option<String>,

    /// Address of this cluster's forwarder as other clusters reach it.
    #[arg(long, env = "TRELLIS_ADVERTISE_FORWARDER", value_name = "HOST:PORT", value_parser = address_arg)]
    pub advertise_forwarder: Option<String>,

    /// Address of this cluster's IPAM as other clusters reach it.
    #[arg(long, env = "TRELLIS_ADVERTISE_IPAM", value_name = "HOST:PORT", value_parser = address_arg)]
    pub advertise_ipam: Option<String>,

    /// Address of this cluster's endpoint mapper as other clusters reach it.
    #[arg(long, env = "TRELLIS_ADVERTISE_ENDPOINTS", value_name = "HOST:PORT", value_parser = address_arg)]
    pub advertise_endpoints: Option<String>,

    /// Address of this cluster's gateway control API as other clusters reach it.
    #[arg(long, env = "TRELLIS_ADVERTISE_GATEWAY", value_name = "HOST:PORT", value_parser = address_arg)]
    pub advertise_gateway: Option<String>,

    /// Comma-separated DNS domains to discover clusters in: each is searched for SRV records
    /// `_trellis._tcp.<domain>` pointing at remote discovery services. Empty disables DNS-SRV
    /// discovery.
    #[arg(
        long,
        env = "TRELLIS_DNS_DOMAINS",
        value_name = "DOMAIN,...",
        value_delimiter = ','
    )]
    pub dns_domains: Vec<String>,

    /// DNS server for SRV lookups (IP:PORT, UDP and TCP); defaults to the system's resolvers.
    #[arg(long, env = "TRELLIS_DNS_NAMESERVER", value_name = "IP:PORT")]
    pub dns_nameserver: Option<SocketAddr>,

    /// Seconds between two DNS-SRV lookups; clusters whose records disappeared are noticed at
    /// the next one.
    #[arg(long, env = "TRELLIS_DNS_REFRESH", value_name = "SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub dns_refresh: u64,

    /// Announce this cluster and discover others over mDNS on the local network.
    #[arg(long, env = "TRELLIS_MDNS")]
    pub mdns: bool,

    /// Comma-separated network interfaces mDNS uses; all when empty.
    #[arg(
        long,
        env = "TRELLIS_MDNS_INTERFACES",
        value_name = "NAME,...",
        value_delimiter = ','
    )]
    pub mdns_interfaces: Vec<String>,

    /// Seconds between two full re-sends of this cluster's Neighborhoods (changes are sent at
    /// once; the resync heals peers that lost state). A re-send that takes long is followed by
    /// a wait of at least nine times its duration.
    #[arg(long, env = "TRELLIS_NEIGHBORHOOD_RESYNC", value_name = "SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub neighborhood_resync: u64,

    /// Longest wait, in seconds, between two attempts to reach an unreachable peer (the wait
    /// doubles from 200 ms up to this).
    #[arg(long, env = "TRELLIS_NEIGHBORHOOD_RETRY_MAX", value_name = "SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub neighborhood_retry_max: u64,

    /// Switch induced peering off for this cluster: as a hub it sends its peers empty
    /// Neighborhoods (introducing nobody, withdrawing earlier introductions), and Neighborhoods
    /// it receives introduce nobody. Leaf-to-leaf traffic then takes the hub path.
    #[arg(long, env = "TRELLIS_NO_INDUCED")]
    pub no_induced: bool,

    /// Most clusters one hub's Neighborhood may introduce; a larger one is refused whole
    /// (INVALID_ARGUMENT) and changes nothing, so a misbehaving hub cannot flood this cluster
    /// with records, NetworkConfig exchanges and tunnels. Each introduction takes one of the
    /// gateway's per-peer slots: the default (three quarters of the gateway's default 256)
    /// leaves the rest to full peerings and other hubs. Raise it with `--wireguard-ports`.
    #[arg(long, env = "TRELLIS_MAX_INDUCED_PER_HUB", value_name = "N",
          default_value_t = crate::core::MAX_INDUCED_PER_HUB,
          value_parser = clap::builder::TypedValueParser::map(
              clap::value_parser!(u32).range(1..), |n| n as usize))]
    pub max_induced_per_hub: usize,

    /// Seconds a withdrawn ForeignCluster (unpeered, or no longer introduced by any hub) is kept,
    /// still listed with `Withdrawn=True` for operators to see what went, before it is deleted.
    /// Default: one day.
    #[arg(long, env = "TRELLIS_TOMBSTONE_RETENTION", value_name = "SECONDS",
          default_value_t = 86_400, value_parser = clap::value_parser!(u64).range(1..))]
    pub tombstone_retention: u64,

    /// Seconds a WatchForeignClusters stream may stay silent before it sends a BOOKMARK with
    /// the latest revision it has processed.
    #[arg(long, env = "TRELLIS_WATCH_BOOKMARK", value_name = "SECONDS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub watch_bookmark: u64,
}

impl HasCommon for Config {
    fn common(&self) -> &CommonConfig {
        &self.common
    }
}

impl Config {
    /// The addresses GetIdentity returns. The discovery address falls back to a concrete listen
    /// address (a wildcard one is useless to others).
    pub fn advertised(&self, listening: SocketAddr) -> Addresses {
        let discovery = self.advertise_discovery.clone().unwrap_or_else(|| {
            if listening.ip().is_unspecified() {
                String::new()
            } else {
                listening.to_string()
            }
        });
        Addresses {
            discovery,
            broker: self.advertise_broker.clone().unwrap_or_default(),
            forwarder: self.advertise_forwarder.clone().unwrap_or_default(),
            ipam: self.advertise_ipam.clone().unwrap_or_default(),
            endpoints: self.advertise_endpoints.clone().unwrap_or_default(),
            gateway: self.advertise_gateway.clone().unwrap_or_default(),
        }
    }

    pub fn dns_refresh(&self) -> Duration {
        Duration::from_secs(self.dns_refresh)
    }

    pub fn neighborhood_resync(&self) -> Duration {
        Duration::from_secs(self.neighborhood_resync)
    }

    pub fn neighborhood_retry_max(&self) -> Duration {
        Duration::from_secs(self.neighborhood_retry_max)
    }

    pub fn tombstone_retention(&self) -> Duration {
        Duration::from_secs(self.tombstone_retention)
    }

    pub fn watch_bookmark(&self) -> Duration {
        Duration::from_secs(self.watch_bookmark)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Result<Config, clap::Error> {
        let mut args = vec![
            "trellis-discovery",
            "--store",
            "memory://",
            "--cluster-id",
            "a",
        ];
        args.extend_from_slice(extra);
        Config::try_parse_from(args)
    }

    #[test]
    fn defaults_and_lists() {
        let c = parse(&["--dns-domains", "a.example,b.example"]).expect("parses");
        assert_eq!(c.dns_domains, ["a.example", "b.example"]);
        assert_eq!(c.dns_refresh(), Duration::from_secs(30));
        assert!(!c.mdns);
        assert_eq!(c.tombstone_retention(), Duration::from_secs(86_400));
        let listening: SocketAddr = "127.0.0.1:7101".parse().expect("addr");
        assert_eq!(c.advertised(listening).discovery, "127.0.0.1:7101");
        let wildcard: SocketAddr = "0.0.0.0:7101".parse().expect("addr");
        assert_eq!(c.advertised(wildcard).discovery, "");
    }

    #[test]
    fn rejects_malformed_advertised_addresses() {
        let err = parse(&["--advertise-broker", "http://x:1"]).expect_err("scheme");
        assert!(err.to_string().contains("URL scheme"), "{err}");
        assert!(parse(&["--dns-refresh", "0"]).is_err());
        assert!(parse(&["--tombstone-retention", "0"]).is_err());
    }
}
