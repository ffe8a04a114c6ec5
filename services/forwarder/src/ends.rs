//! What a relay needs to know of the clusters at its two ends: whether each is a full peer of
//! this hub with networking, and its broker's address. Looked up for every relay, from the
//! watch-fed copy of discovery's records without copying them (ADR 0015): building the whole
//! peering view of two records took a tenth of the forwarder's CPU at 100 leaves.

use trellis_api::ClusterId;
use trellis_api::pb::types as pb;
use trellis_api::peers::{is_full_peer, routable_broker};
use trellis_error::{Error, Result};

/// One end of a relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum End {
    /// A full peer with networking: its broker's address.
    Routable(String),
    /// A full peer without networking or without a broker address.
    Unrouted,
}

impl End {
    /// The end `fc` makes; `None` when it is not a full peer.
    pub(crate) fn of(fc: &pb::ForeignCluster) -> Option<Self> {
        match routable_broker(fc) {
            Some(broker) => Some(Self::Routable(broker.to_owned())),
            None => is_full_peer(fc).then_some(Self::Unrouted),
        }
    }
}

/// The ends looked up, by cluster ID; a cluster that is not a full peer is absent.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ends(Vec<(String, End)>);

impl Ends {
    /// What `fc` makes, as [`Ends::from_iter`] takes it.
    pub(crate) fn entry(fc: &pb::ForeignCluster) -> Option<(String, End)> {
        let id = fc.identity.as_ref()?.cluster_id.clone();
        Some((id, End::of(fc)?))
    }

    /// The broker address of `id` (the relay's `role`), or why it cannot be relayed to.
    pub(crate) fn broker_of(&self, id: &ClusterId, role: &str) -> Result<String> {
        match self.0.iter().find(|(known, _)| known == id.as_str()) {
            Some((_, End::Routable(broker))) => Ok(broker.clone()),
            Some((_, End::Unrouted)) => Err(Error::PermissionDenied(format!(
                "the {role} {id} is a full peer of this hub without networking or without a broker address"
            ))),
            None => Err(Error::PermissionDenied(format!(
                "the {role} {id} is not a full peer of this hub"
            ))),
        }
    }
}

impl FromIterator<Option<(String, End)>> for Ends {
    fn from_iter<I: IntoIterator<Item = Option<(String, End)>>>(entries: I) -> Self {
        Self(entries.into_iter().flatten().collect())
    }
}

#[cfg(test)]
mod tests {
    use trellis_api::peers::Condition;

    use super::*;

    fn record(
        id: &str,
        kind: pb::PeeringKind,
        peered: bool,
        networking: bool,
    ) -> pb::ForeignCluster {
        pb::ForeignCluster {
            identity: Some(pb::ClusterIdentity {
                cluster_id: id.to_owned(),
                cluster_name: id.to_owned(),
            }),
            kind: kind as i32,
            conditions: vec![pb::Condition {
                r#type: Condition::Peered.to_string(),
                status: if peered {
                    pb::ConditionStatus::True
                } else {
                    pb::ConditionStatus::False
                } as i32,
                ..Default::default()
            }],
            full: Some(pb::FullPeering {
                networking_enabled: networking,
                addresses: Some(pb::ServiceAddresses {
                    broker: format!("{id}:7002"),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn id(s: &str) -> ClusterId {
        ClusterId::parse("id", s).expect("valid")
    }

    /// Only a peered full peer with networking and a broker is relayed for; the refusal says
    /// which of the two it is not.
    #[test]
    fn an_end_is_routable_only_as_a_networked_full_peer() {
        let ends: Ends = [
            record("routed", pb::PeeringKind::Full, true, true),
            record("dark", pb::PeeringKind::Full, true, false),
            record("unpeered", pb::PeeringKind::Full, false, true),
            record("induced", pb::PeeringKind::Induced, true, true),
        ]
        .iter()
        .map(Ends::entry)
        .collect();
        assert_eq!(
            ends.broker_of(&id("routed"), "origin").expect("routable"),
            "routed:7002"
        );
        let dark = ends
            .broker_of(&id("dark"), "origin")
            .expect_err("no networking");
        assert!(dark.to_string().contains("without networking"), "{dark}");
        for other in ["unpeered", "induced", "unknown"] {
            let err = ends
                .broker_of(&id(other), "destination")
                .expect_err("not a full peer");
            assert!(
                err.to_string().contains("is not a full peer"),
                "{other}: {err}"
            );
        }
    }
}
