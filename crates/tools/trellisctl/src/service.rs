//! The services of a Trellis cluster that `trellisctl` talks to, and where one is expected: what
//! commands, connections and error messages all name, so it sits below all of them.

use serde::Serialize;

/// One of the six services of a Trellis cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Service {
    Discovery,
    Broker,
    Forwarder,
    Ipam,
    Endpoints,
    Gateway,
}

impl Service {
    /// Every service, in port order.
    pub const ALL: [Service; 6] = [
        Service::Discovery,
        Service::Broker,
        Service::Forwarder,
        Service::Ipam,
        Service::Endpoints,
        Service::Gateway,
    ];

    /// Short name, as in the flags and JSON output.
    pub fn name(self) -> &'static str {
        match self {
            Service::Discovery => "discovery",
            Service::Broker => "broker",
            Service::Forwarder => "forwarder",
            Service::Ipam => "ipam",
            Service::Endpoints => "endpoints",
            Service::Gateway => "gateway",
        }
    }

    /// How error messages refer to it ("the broker").
    pub fn label(self) -> &'static str {
        match self {
            Service::Discovery => "the discovery service",
            Service::Broker => "the broker",
            Service::Forwarder => "the forwarder",
            Service::Ipam => "the IPAM",
            Service::Endpoints => "the endpoints service",
            Service::Gateway => "the gateway",
        }
    }

    /// The binary that serves it.
    pub fn binary(self) -> &'static str {
        match self {
            Service::Discovery => "trellis-discovery",
            Service::Broker => "trellis-broker",
            Service::Forwarder => "trellis-forwarder",
            Service::Ipam => "trellis-ipam",
            Service::Endpoints => "trellis-endpoints",
            Service::Gateway => "trellis-gateway",
        }
    }

    /// The global flag that sets its address.
    pub fn flag(self) -> &'static str {
        match self {
            Service::Discovery => "--discovery",
            Service::Broker => "--broker",
            Service::Forwarder => "--forwarder",
            Service::Ipam => "--ipam",
            Service::Endpoints => "--endpoints",
            Service::Gateway => "--gateway",
        }
    }

    /// Its fully qualified gRPC service name (what `grpc.health.v1.Health/Check` is asked about).
    pub fn grpc_name(self) -> &'static str {
        match self {
            Service::Discovery => "trellis.discovery.v1.Discovery",
            Service::Broker => "trellis.peering.v1.Broker",
            Service::Forwarder => "trellis.peering.v1.Forwarder",
            Service::Ipam => "trellis.ipam.v1.Ipam",
            Service::Endpoints => "trellis.endpoints.v1.EndpointMapper",
            Service::Gateway => "trellis.gateway.v1.Gateway",
        }
    }
}

/// A service and the address it is expected at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub service: Service,
    pub address: String,
}
