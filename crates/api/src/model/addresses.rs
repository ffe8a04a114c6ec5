//! The gRPC addresses a cluster advertises for its services (types.proto `ServiceAddresses`).

use serde::{Deserialize, Serialize};

/// Service addresses ("host:port", empty = not advertised), as in types.proto.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Addresses {
    #[serde(default)]
    pub discovery: String,
    #[serde(default)]
    pub broker: String,
    #[serde(default)]
    pub forwarder: String,
    #[serde(default)]
    pub ipam: String,
    #[serde(default)]
    pub endpoints: String,
    #[serde(default)]
    pub gateway: String,
}
