//! Command-line flags of `trellis-ipam` (each also `TRELLIS_<FLAG>`).

use clap::Parser;
use ipnet::IpNet;
use trellis_runtime::CommonConfig;
use trellis_runtime::config::address_arg;
use trellis_runtime::config::{HasCommon, PeerTlsConfig};

use crate::subnets::{DEFAULT_POOLS, LocalRanges, LocalSubnets};

fn cidr_arg(value: &str) -> Result<IpNet, String> {
    trellis_api::wire::cidr("value", value).map_err(|e| match e {
        trellis_error::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    })
}

/// The IPAM of one Trellis cluster: keeps this cluster's subnets, remaps remote clusters'
/// CIDRs on conflict, and translates endpoint IPs reflected to other clusters.
#[derive(Debug, Clone, Parser)]
#[command(name = "trellis-ipam", version, about, long_about = None)]
pub struct Config {
    #[command(flatten)]
    pub common: CommonConfig,

    /// Mutual TLS for the queries of other clusters' endpoints services
    /// (`DoesClusterMappingExist`, `MapEndpointIp` induced; ADR 0014). Needs --discovery.
    #[command(flatten)]
    pub tls: PeerTlsConfig,

    /// Address of this cluster's discovery service ("host:port"): with --peer-listen, who the
    /// full peers allowed to query this IPAM are (their pinned CAs).
    #[arg(long, env = "TRELLIS_DISCOVERY", value_name = "HOST:PORT", value_parser = address_arg)]
    pub discovery: Option<String>,

    /// This cluster's pod CIDR (e.g. 10.0.0.0/16). Sets the address family every request must
    /// use; cannot change once the store holds mappings.
    #[arg(long, env = "TRELLIS_POD_CIDR", value_name = "CIDR", value_parser = cidr_arg)]
    pub pod_cidr: IpNet,

    /// This cluster's service CIDR, kept out of every remap. Optional.
    #[arg(long, env = "TRELLIS_SERVICE_CIDR", value_name = "CIDR", value_parser = cidr_arg)]
    pub service_cidr: Option<IpNet>,

    /// This cluster's external CIDR: addresses handed out for third-cluster endpoints reached
    /// through this cluster (the hub path). Must not overlap the pod or service CIDR.
    #[arg(long, env = "TRELLIS_EXTERNAL_CIDR", value_name = "CIDR", value_parser = cidr_arg)]
    pub external_cidr: IpNet,

    /// Comma-separated pools remaps are drawn from, in order of preference.
    #[arg(
        long,
        env = "TRELLIS_POOLS",
        value_name = "CIDR,...",
        value_delimiter = ',',
        value_parser = cidr_arg,
        default_values = DEFAULT_POOLS
    )]
    pub pools: Vec<IpNet>,

    /// Comma-separated ranges never handed out by a remap (node network, load balancers, ...).
    #[arg(long, env = "TRELLIS_RESERVED", value_name = "CIDR,...", value_delimiter = ',', value_parser = cidr_arg)]
    pub reserved: Vec<IpNet>,

    /// Seconds the ranges a freed (unpeered) cluster was addressed by stay out of other
    /// clusters' mappings, while any other range is free: our pods' flows towards the freed
    /// cluster would otherwise enter the tunnel of the next cluster given its range. The
    /// cluster itself may have them back. 0 reuses a freed range at once.
    #[arg(
        long,
        env = "TRELLIS_RANGE_QUARANTINE",
        value_name = "SECONDS",
        default_value_t = crate::subnets::DEFAULT_QUARANTINE.as_secs()
    )]
    pub range_quarantine: u64,
}

impl HasCommon for Config {
    fn common(&self) -> &CommonConfig {
        &self.common
    }
}

impl Config {
    /// The validated local subnets.
    pub fn local_subnets(&self) -> trellis_error::Result<LocalSubnets> {
        LocalSubnets::new(
            LocalRanges {
                pod_cidr: self.pod_cidr,
                service_cidr: self.service_cidr,
                external_cidr: self.external_cidr,
            },
            self.pools.clone(),
            self.reserved.clone(),
        )
        .map(|s| s.with_quarantine(std::time::Duration::from_secs(self.range_quarantine)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lists_and_defaults() {
        let c = Config::try_parse_from([
            "trellis-ipam",
            "--store",
            "memory://",
            "--cluster-id",
            "a",
            "--pod-cidr",
            "10.0.0.0/16",
            "--external-cidr",
            "10.201.0.0/16",
            "--reserved",
            "10.250.0.0/16,10.251.0.0/16",
        ])
        .expect("parses");
        assert_eq!(c.pools.len(), 3);
        assert_eq!(c.reserved.len(), 2);
        let local = c.local_subnets().expect("valid");
        assert_eq!(local.quarantine, crate::subnets::DEFAULT_QUARANTINE);
    }

    #[test]
    fn rejects_host_bits_with_a_hint() {
        let err = Config::try_parse_from([
            "trellis-ipam",
            "--store",
            "memory://",
            "--cluster-id",
            "a",
            "--pod-cidr",
            "10.0.0.5/16",
            "--external-cidr",
            "10.201.0.0/16",
        ])
        .expect_err("host bits");
        assert!(
            err.to_string().contains("the network is 10.0.0.0/16"),
            "{err}"
        );
    }
}
