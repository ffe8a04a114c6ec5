//! Conversions of the messages every service shares (identities, advertised addresses,
//! timestamps) between domain values and protos. Parsing validates and names the field path
//! (e.g. `neighborhood.sender.cluster_id`).

use prost_types::Timestamp;
use trellis_error::Result;

use crate::address;
use crate::ident::ClusterIdentity;
use crate::model::Addresses;
use crate::pb::types as pb;

/// A timestamp from nanoseconds since the epoch.
pub fn timestamp(nanos: i64) -> Timestamp {
    Timestamp {
        seconds: nanos.div_euclid(1_000_000_000),
        nanos: i32::try_from(nanos.rem_euclid(1_000_000_000)).unwrap_or(0),
    }
}

pub fn identity_to_pb(identity: &ClusterIdentity) -> pb::ClusterIdentity {
    pb::ClusterIdentity {
        cluster_id: identity.id.to_string(),
        cluster_name: identity.name.clone(),
    }
}

/// A NetworkConfig's `generation` (at least 1) and `held_generation` (not negative), as every
/// receiver checks them (fields under `network_config`).
pub fn generations_from_pb(nc: &pb::NetworkConfig) -> Result<(i64, i64)> {
    if nc.generation < 1 {
        return Err(trellis_error::Error::invalid(
            "network_config.generation",
            "must be at least 1",
        ));
    }
    if nc.held_generation < 0 {
        return Err(trellis_error::Error::invalid(
            "network_config.held_generation",
            "must not be negative",
        ));
    }
    Ok((nc.generation, nc.held_generation))
}

/// Parses an identity at `field` (e.g. `neighborhood.sender`); absent counts as empty.
pub fn identity_from_pb(
    field: &str,
    value: Option<&pb::ClusterIdentity>,
) -> Result<ClusterIdentity> {
    let empty = pb::ClusterIdentity::default();
    let value = value.unwrap_or(&empty);
    ClusterIdentity::parse(
        "cluster_id",
        &value.cluster_id,
        "cluster_name",
        &value.cluster_name,
    )
    .map_err(|e| e.under(field))
}

pub fn addresses_to_pb(a: &Addresses) -> pb::ServiceAddresses {
    pb::ServiceAddresses {
        discovery: a.discovery.clone(),
        broker: a.broker.clone(),
        forwarder: a.forwarder.clone(),
        ipam: a.ipam.clone(),
        endpoints: a.endpoints.clone(),
        gateway: a.gateway.clone(),
    }
}

/// Parses advertised addresses at `field`; every non-empty one must be "host:port".
pub fn addresses_from_pb(field: &str, value: Option<&pb::ServiceAddresses>) -> Result<Addresses> {
    let empty = pb::ServiceAddresses::default();
    let a = value.unwrap_or(&empty);
    let check = |name: &str, v: &str| address::optional(&format!("{field}.{name}"), v);
    Ok(Addresses {
        discovery: check("discovery", &a.discovery)?,
        broker: check("broker", &a.broker)?,
        forwarder: check("forwarder", &a.forwarder)?,
        ipam: check("ipam", &a.ipam)?,
        endpoints: check("endpoints", &a.endpoints)?,
        gateway: check("gateway", &a.gateway)?,
    })
}
