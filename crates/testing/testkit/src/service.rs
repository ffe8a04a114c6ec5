//! The Trellis services, as the labs and tests that start them as processes name them.
//!
//! One enum for the network-namespace lab and the process-cluster tests, so that both agree
//! on the start order, the binaries, the default ports and the health service to wait for.

use std::fmt;

/// The flag that lets a cluster-facing service serve other clusters without mutual TLS
/// (`trellis_runtime::config::PeerTlsConfig`), for tests and labs that peer in plaintext.
pub const PLAINTEXT_PEERING: &str = "--insecure-plaintext-peering";

/// One of a cluster's services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Service {
    Ipam,
    Gateway,
    Discovery,
    Forwarder,
    Broker,
    Endpoints,
}

impl Service {
    /// Every service, in start order (callees before their callers; the gateway retries its
    /// broker watch until the broker is up).
    pub const ALL: [Service; 6] = [
        Service::Ipam,
        Service::Gateway,
        Service::Discovery,
        Service::Forwarder,
        Service::Broker,
        Service::Endpoints,
    ];

    /// Short name: `ipam`, `gateway`, ...
    pub fn name(self) -> &'static str {
        match self {
            Service::Ipam => "ipam",
            Service::Gateway => "gateway",
            Service::Discovery => "discovery",
            Service::Forwarder => "forwarder",
            Service::Broker => "broker",
            Service::Endpoints => "endpoints",
        }
    }

    /// Whether other clusters call it (all but the gateway): it starts with mutual TLS, or
    /// with [`PLAINTEXT_PEERING`] where a test or lab peers in plaintext.
    pub fn faces_other_clusters(self) -> bool {
        self != Service::Gateway
    }

    /// The binary, `trellis-<name>`.
    pub fn binary(self) -> String {
        format!("trellis-{}", self.name())
    }

    /// The default port (`trellis_runtime::config::ports`).
    pub fn port(self) -> u16 {
        match self {
            Service::Discovery => 7101,
            Service::Broker => 7102,
            Service::Forwarder => 7103,
            Service::Ipam => 7104,
            Service::Endpoints => 7105,
            Service::Gateway => 7106,
        }
    }

    /// The gRPC service whose health says the process is ready.
    pub fn grpc_service(self) -> &'static str {
        match self {
            Service::Ipam => "trellis.ipam.v1.Ipam",
            Service::Gateway => "trellis.gateway.v1.Gateway",
            Service::Discovery => "trellis.discovery.v1.Discovery",
            Service::Forwarder => "trellis.peering.v1.Forwarder",
            Service::Broker => "trellis.peering.v1.Broker",
            Service::Endpoints => "trellis.endpoints.v1.EndpointMapper",
        }
    }

    /// Its place in [`Service::ALL`], for a lab that gives every service a port of its own
    /// next to a base port.
    pub fn index(self) -> u16 {
        match self {
            Service::Ipam => 0,
            Service::Gateway => 1,
            Service::Discovery => 2,
            Service::Forwarder => 3,
            Service::Broker => 4,
            Service::Endpoints => 5,
        }
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_is_the_place_in_start_order() {
        for (place, service) in Service::ALL.iter().enumerate() {
            assert_eq!(usize::from(service.index()), place, "{service}");
        }
    }
}
