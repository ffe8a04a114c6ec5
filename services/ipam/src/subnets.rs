//! This cluster's own ranges and the pools remaps are drawn from, validated once at start.

use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use trellis_api::net::{Family, overlaps};
use trellis_error::{Error, Result};

/// How long a range freed with a cluster is kept from other clusters by default (ADR 0005).
pub const DEFAULT_QUARANTINE: Duration = Duration::from_secs(600);

/// The default remapping pools (the RFC 1918 ranges).
pub const DEFAULT_POOLS: [&str; 3] = ["10.0.0.0/8", "192.168.0.0/16", "172.16.0.0/12"];

/// The part of the local configuration that must never change under existing mappings; it is
/// persisted and checked by every replica at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalRanges {
    pub pod_cidr: IpNet,
    pub service_cidr: Option<IpNet>,
    pub external_cidr: IpNet,
}

/// Everything the allocator needs to know about this cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalSubnets {
    pub ranges: LocalRanges,
    /// Where remaps come from, in order of preference.
    pub pools: Vec<IpNet>,
    /// Ranges never handed out (node network, load balancers, ...).
    pub reserved: Vec<IpNet>,
    /// How long the ranges we addressed a freed cluster by stay out of other clusters'
    /// mappings (while any other range is free): flows our pods opened towards the freed
    /// cluster carry no mark of it and follow the route of the range, into whichever tunnel
    /// holds it next. [`DEFAULT_QUARANTINE`] unless set with [`Self::with_quarantine`].
    pub quarantine: Duration,
}

impl LocalSubnets {
    /// Validates a configuration: one address family throughout, local ranges pairwise
    /// disjoint. Errors name the flag.
    pub fn new(ranges: LocalRanges, pools: Vec<IpNet>, reserved: Vec<IpNet>) -> Result<Self> {
        let family = Family::of_net(ranges.pod_cidr);
        let mut named: Vec<(&str, IpNet)> = vec![
            ("--pod-cidr", ranges.pod_cidr),
            ("--external-cidr", ranges.external_cidr),
        ];
        if let Some(svc) = ranges.service_cidr {
            named.push(("--service-cidr", svc));
        }
        for (flag, net) in named
            .iter()
            .copied()
            .chain(pools.iter().map(|p| ("--pools", *p)))
            .chain(reserved.iter().map(|r| ("--reserved", *r)))
        {
            if Family::of_net(net) != family {
                return Err(Error::invalid(
                    flag,
                    format!(
                        "{net} is {} but --pod-cidr is {family}",
                        Family::of_net(net)
                    ),
                ));
            }
        }
        for (i, (a_flag, a)) in named.iter().enumerate() {
            for (b_flag, b) in &named[i + 1..] {
                if overlaps(*a, *b) {
                    return Err(Error::invalid(
                        *b_flag,
                        format!("{b} overlaps {a_flag} {a}"),
                    ));
                }
            }
        }
        if pools.is_empty() {
            return Err(Error::invalid("--pools", "at least one pool is required"));
        }
        Ok(Self {
            ranges,
            pools,
            reserved,
            quarantine: DEFAULT_QUARANTINE,
        })
    }

    /// The same, with freed ranges quarantined for `quarantine` (zero: reused at once).
    pub fn with_quarantine(mut self, quarantine: Duration) -> Self {
        self.quarantine = quarantine;
        self
    }

    /// The address family of this cluster.
    pub fn family(&self) -> Family {
        Family::of_net(self.ranges.pod_cidr)
    }

    /// Ranges no remote mapping may overlap: our own and the reserved ones.
    pub fn blocked(&self) -> Vec<IpNet> {
        let mut out = vec![self.ranges.pod_cidr, self.ranges.external_cidr];
        out.extend(self.ranges.service_cidr);
        out.extend(self.reserved.iter().copied());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().expect("test network")
    }

    fn ranges(pod: &str, ext: &str) -> LocalRanges {
        LocalRanges {
            pod_cidr: net(pod),
            service_cidr: Some(net("10.96.0.0/12")),
            external_cidr: net(ext),
        }
    }

    #[test]
    fn rejects_overlapping_local_ranges_naming_the_flag() {
        let err = LocalSubnets::new(
            ranges("10.0.0.0/16", "10.0.128.0/17"),
            vec![net("10.0.0.0/8")],
            vec![],
        )
        .expect_err("overlap");
        assert!(
            matches!(&err, Error::InvalidArgument { field, .. } if field == "--external-cidr"),
            "{err}"
        );
    }

    #[test]
    fn rejects_mixed_families() {
        let err = LocalSubnets::new(
            ranges("10.0.0.0/16", "10.201.0.0/16"),
            vec![net("fd00::/8")],
            vec![],
        )
        .expect_err("family");
        assert!(
            err.to_string().contains("IPv6 but --pod-cidr is IPv4"),
            "{err}"
        );
    }

    #[test]
    fn blocked_lists_every_local_range() {
        let s = LocalSubnets::new(
            ranges("10.0.0.0/16", "10.201.0.0/16"),
            vec![net("10.0.0.0/8")],
            vec![net("10.250.0.0/16")],
        )
        .expect("valid");
        assert_eq!(s.blocked().len(), 4);
    }
}
