//! Conversions between the stored records and the generated proto messages, both ways. Parsing
//! untrusted messages validates every field and names it on error (the field path as in the
//! request, e.g. `neighborhood.neighbors[2].addresses.broker`).

use trellis_api::pb::types as pb;
use trellis_error::{Error, Result};

use crate::records::{
    Condition, ForeignClusterRecord, FullPeering, InducedPeering, Kind, Neighbor, Source, Status,
};
pub use trellis_api::convert::{
    addresses_from_pb, addresses_to_pb, identity_from_pb, identity_to_pb, timestamp,
};

pub fn kind_to_pb(kind: Kind) -> pb::PeeringKind {
    match kind {
        Kind::Full => pb::PeeringKind::Full,
        Kind::Induced => pb::PeeringKind::Induced,
    }
}

/// A kind filter: UNSPECIFIED means "any".
pub fn kind_filter(field: &str, value: i32) -> Result<Option<Kind>> {
    match pb::PeeringKind::try_from(value) {
        Ok(pb::PeeringKind::Unspecified) => Ok(None),
        Ok(pb::PeeringKind::Full) => Ok(Some(Kind::Full)),
        Ok(pb::PeeringKind::Induced) => Ok(Some(Kind::Induced)),
        Err(_) => Err(Error::invalid(
            field,
            format!("{value} is not a PeeringKind"),
        )),
    }
}

fn source_to_pb(source: Source) -> pb::DiscoverySource {
    match source {
        Source::Manual => pb::DiscoverySource::Manual,
        Source::DnsSrv => pb::DiscoverySource::DnsSrv,
        Source::Mdns => pb::DiscoverySource::Mdns,
        Source::Neighborhood => pb::DiscoverySource::Neighborhood,
        Source::Peering => pb::DiscoverySource::Peering,
    }
}

fn condition_to_pb(c: &Condition) -> pb::Condition {
    let status = match c.status {
        Status::True => pb::ConditionStatus::True,
        Status::False => pb::ConditionStatus::False,
        Status::Unknown => pb::ConditionStatus::Unknown,
    };
    pb::Condition {
        r#type: c.kind.clone(),
        status: status.into(),
        reason: c.reason.clone(),
        message: c.message.clone(),
        last_transition_time: Some(timestamp(c.last_transition)),
    }
}

fn full_to_pb(f: &FullPeering) -> pb::FullPeering {
    pb::FullPeering {
        outgoing_peering_enabled: f.outgoing,
        incoming_peering_enabled: f.incoming,
        networking_enabled: f.networking,
        addresses: Some(addresses_to_pb(&f.addresses)),
        ca_certificate: f.ca_certificate.clone(),
    }
}

fn induced_to_pb(i: &InducedPeering) -> pb::InducedPeering {
    pb::InducedPeering {
        origin: Some(identity_to_pb(&i.origin)),
        addresses: Some(addresses_to_pb(&i.addresses)),
        neighborhood_generation: i.generation,
        alternative_origins: i.alternative_origins.iter().map(identity_to_pb).collect(),
    }
}

/// A stored record as the API shows it, with the revision of its last change.
pub fn foreign_cluster_to_pb(record: &ForeignClusterRecord, revision: i64) -> pb::ForeignCluster {
    pb::ForeignCluster {
        identity: Some(identity_to_pb(&record.identity)),
        kind: kind_to_pb(record.kind).into(),
        full: record
            .full
            .as_ref()
            .filter(|_| record.kind == Kind::Full)
            .map(full_to_pb),
        induced: record
            .induced
            .as_ref()
            .filter(|_| record.kind == Kind::Induced)
            .map(induced_to_pb),
        conditions: record.conditions.iter().map(condition_to_pb).collect(),
        discovery_source: source_to_pb(record.source).into(),
        discovery_address: record.discovery_address.clone(),
        create_time: Some(timestamp(record.create_time)),
        update_time: Some(timestamp(record.update_time)),
        revision,
    }
}

pub fn neighbor_to_pb(n: &Neighbor) -> pb::Neighbor {
    pb::Neighbor {
        identity: Some(identity_to_pb(&n.identity)),
        addresses: Some(addresses_to_pb(&n.addresses)),
    }
}

/// Parses the neighbours of a Neighborhood, naming `neighborhood.neighbors[i]...` on error.
pub fn neighbors_from_pb(neighbors: &[pb::Neighbor]) -> Result<Vec<Neighbor>> {
    neighbors
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let field = format!("neighborhood.neighbors[{i}]");
            Ok(Neighbor {
                identity: identity_from_pb(&format!("{field}.identity"), n.identity.as_ref())?,
                addresses: addresses_from_pb(&format!("{field}.addresses"), n.addresses.as_ref())?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_split_nanoseconds() {
        let t = timestamp(1_700_000_000_123_456_789);
        assert_eq!(t.seconds, 1_700_000_000);
        assert_eq!(t.nanos, 123_456_789);
    }

    #[test]
    fn malformed_neighbor_addresses_name_the_field() {
        let bad = pb::Neighbor {
            identity: Some(pb::ClusterIdentity {
                cluster_id: "c".into(),
                cluster_name: String::new(),
            }),
            addresses: Some(pb::ServiceAddresses {
                broker: "not an address".into(),
                ..Default::default()
            }),
        };
        match neighbors_from_pb(&[bad]) {
            Err(Error::InvalidArgument { field, .. }) => {
                assert_eq!(field, "neighborhood.neighbors[0].addresses.broker");
            }
            other => panic!("{other:?}"),
        }
    }
}
