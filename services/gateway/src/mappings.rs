//! The gateway's second input: the local IPAM's external-CIDR endpoint mappings (hub path:
//! hub-path traffic is DNAT'ed at the hub from its external CIDR to the real destination), in
//! the gateway's terms; [`crate::remote::ipam`] polls them.

use std::collections::BTreeSet;
use std::net::IpAddr;

use trellis_api::ClusterId;

/// One third-cluster endpoint reachable through our external CIDR.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct HubMapping {
    /// The address allocated in our (real) external CIDR.
    pub external_ip: IpAddr,
    /// The endpoint as we address it (in our view of its cluster's pod CIDR): the DNAT target.
    pub destination: IpAddr,
    /// The clusters the external address was handed to: only traffic from their tunnels is
    /// DNAT'ed.
    pub clusters: BTreeSet<ClusterId>,
}

/// The mappings, ordered.
pub type Mappings = Vec<HubMapping>;
