//! The peering model (docs/architecture.md) as validated domain types: what a NetworkConfig carries
//! ([`NetworkSpec`], [`NatView`]), the gateway [`Endpoint`] and WireGuard key it advertises ([`WgKey`]), and the
//! [`TunnelEndpoint`] a broker derives from two NetworkConfigs and a gateway consumes.
//! Conversions from the protos validate and name the offending field with its path
//! (`network_config.spec.pod_cidr`).

mod addresses;
mod endpoint;
mod key;
mod network;
mod tunnel;

pub use addresses::Addresses;
pub use endpoint::{Endpoint, EndpointHost};
pub use key::WgKey;
pub use network::{NatView, NetworkSpec};
pub use tunnel::{MAX_CANDIDATES, PeeringKind, TunnelEndpoint, candidate, candidates};

/// `prefix.field`, or `field` alone at the top level.
fn path(prefix: &str, field: &str) -> String {
    if prefix.is_empty() {
        field.to_owned()
    } else {
        format!("{prefix}.{field}")
    }
}
