//! The peering view of a cluster's discovery service, shared by the broker and the forwarder:
//! which remotes to exchange NetworkConfigs with, read from the local discovery
//! service's ForeignClusters: full peers with an established peering and networking enabled,
//! and induced clusters (not withdrawn) introduced by such a full peer that advertises a
//! forwarder. An induced cluster introduced by several hubs is relayed through the one with the
//! smallest cluster ID, so both ends pick the same hub whatever order the introductions came in.

use std::collections::BTreeMap;

use crate::convert::identity_from_pb;
use crate::ident::{ClusterId, ClusterIdentity};
use crate::pb::types as pb;

/// How to reach a remote's peering plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// A full peer: its broker directly.
    Direct { broker: String },
    /// An induced peer: through the hub's forwarder.
    Relayed {
        hub: ClusterIdentity,
        forwarder: String,
    },
}

/// A remote we must have NetworkConfigs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    pub identity: ClusterIdentity,
    pub route: Route,
}

impl Remote {
    /// The hub, for an induced remote.
    pub fn via(&self) -> Option<&ClusterIdentity> {
        match &self.route {
            Route::Direct { .. } => None,
            Route::Relayed { hub, .. } => Some(hub),
        }
    }
}

/// The peering-relevant view of discovery's ForeignClusters.
#[derive(Debug, Clone, Default)]
pub struct Peers {
    /// Full peers with an established peering, by ID (networking or not), with their broker.
    pub full: BTreeMap<ClusterId, (ClusterIdentity, pb::ServiceAddresses, bool)>,
    /// Remotes to exchange NetworkConfigs with.
    pub desired: BTreeMap<ClusterId, Remote>,
    /// Induced clusters (not withdrawn) and the hubs that introduced them.
    pub induced: BTreeMap<ClusterId, Vec<ClusterId>>,
}

fn condition_true(fc: &pb::ForeignCluster, kind: &str) -> bool {
    fc.conditions
        .iter()
        .any(|c| c.r#type == kind && c.status == pb::ConditionStatus::True as i32)
}

/// Whether `fc` is an established full peer (what [`Peers::full`] holds).
pub fn is_full_peer(fc: &pb::ForeignCluster) -> bool {
    fc.kind == pb::PeeringKind::Full as i32 && condition_true(fc, "Peered")
}

/// The broker address of `fc` if it is an established full peer with networking and a broker
/// address: a cluster [`Peers::desired`] routes to directly, and one a hub relays for.
pub fn routable_broker(fc: &pb::ForeignCluster) -> Option<&str> {
    if !is_full_peer(fc) {
        return None;
    }
    let full = fc.full.as_ref().filter(|full| full.networking_enabled)?;
    full.addresses
        .as_ref()
        .map(|a| a.broker.as_str())
        .filter(|broker| !broker.is_empty())
}

/// Whether `fc` is an established full peer with networking and a broker address (see
/// [`routable_broker`]).
pub fn is_routable_full_peer(fc: &pb::ForeignCluster) -> bool {
    routable_broker(fc).is_some()
}

impl Peers {
    /// Interprets a listing (any collection of records, walked twice).
    pub fn from_foreign_clusters<'a, I>(list: I) -> Self
    where
        I: IntoIterator<Item = &'a pb::ForeignCluster> + Clone,
    {
        let mut peers = Self::default();
        for fc in list.clone() {
            // Malformed records are skipped: they come from our own discovery service, and one
            // bad record must not stop every peering.
            let Ok(identity) = identity_from_pb("identity", fc.identity.as_ref()) else {
                continue;
            };
            if is_full_peer(fc) {
                let full = fc.full.clone().unwrap_or_default();
                let addresses = full.addresses.unwrap_or_default();
                peers.full.insert(
                    identity.id.clone(),
                    (identity, addresses, full.networking_enabled),
                );
            }
        }
        for (identity, addresses, networking) in peers.full.values() {
            if *networking && !addresses.broker.is_empty() {
                peers.desired.insert(
                    identity.id.clone(),
                    Remote {
                        identity: identity.clone(),
                        route: Route::Direct {
                            broker: addresses.broker.clone(),
                        },
                    },
                );
            }
        }
        for fc in list {
            if fc.kind != pb::PeeringKind::Induced as i32 || condition_true(fc, "Withdrawn") {
                continue;
            }
            let Ok(identity) = identity_from_pb("identity", fc.identity.as_ref()) else {
                continue;
            };
            let induced = fc.induced.clone().unwrap_or_default();
            let hubs: Vec<ClusterIdentity> = induced
                .origin
                .iter()
                .chain(induced.alternative_origins.iter())
                .filter_map(|o| identity_from_pb("origin", Some(o)).ok())
                .collect();
            peers.induced.insert(
                identity.id.clone(),
                hubs.iter().map(|h| h.id.clone()).collect(),
            );
            // Both ends must relay through the same hub, or neither writes a tunnel; the order
            // in which the hubs' Neighborhoods arrived differs between the two ends, the set of
            // hubs that introduced them (once both know it) does not: take the smallest ID.
            let usable = hubs
                .into_iter()
                .filter_map(|hub| {
                    let (hub_identity, addresses, networking) = peers.full.get(&hub.id)?;
                    (*networking && !addresses.forwarder.is_empty())
                        .then(|| (hub_identity.clone(), addresses.forwarder.clone()))
                })
                .min_by(|a, b| a.0.id.cmp(&b.0.id));
            if let Some((hub, forwarder)) = usable {
                peers.desired.entry(identity.id.clone()).or_insert(Remote {
                    identity,
                    route: Route::Relayed { hub, forwarder },
                });
            }
        }
        peers
    }

    /// Whether `id` is an established full peer.
    pub fn is_full_peer(&self, id: &ClusterId) -> bool {
        self.full.contains_key(id)
    }

    /// Whether `hub` introduced `id` (and `id` is not withdrawn).
    pub fn introduced_by(&self, id: &ClusterId, hub: &ClusterId) -> bool {
        self.induced.get(id).is_some_and(|hubs| hubs.contains(hub))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(id: &str) -> pb::ClusterIdentity {
        pb::ClusterIdentity {
            cluster_id: id.into(),
            cluster_name: id.into(),
        }
    }

    fn hub(id: &str) -> pb::ForeignCluster {
        pb::ForeignCluster {
            identity: Some(identity(id)),
            kind: pb::PeeringKind::Full as i32,
            full: Some(pb::FullPeering {
                networking_enabled: true,
                addresses: Some(pb::ServiceAddresses {
                    broker: format!("{id}:7102"),
                    forwarder: format!("{id}:7103"),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            conditions: vec![pb::Condition {
                r#type: "Peered".into(),
                status: pb::ConditionStatus::True as i32,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn induced(id: &str, origin: &str, alternatives: &[&str]) -> pb::ForeignCluster {
        pb::ForeignCluster {
            identity: Some(identity(id)),
            kind: pb::PeeringKind::Induced as i32,
            induced: Some(pb::InducedPeering {
                origin: Some(identity(origin)),
                alternative_origins: alternatives.iter().map(|a| identity(a)).collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn relay_hub(peers: &Peers, id: &str) -> Option<String> {
        let id = ClusterId::parse("id", id).expect("id");
        peers.desired.get(&id)?.via().map(|h| h.id.to_string())
    }

    /// Leaf A heard of C from hub-2 first, C heard of A from hub-1 first: both must still relay
    /// through the same hub, or neither ever writes the tunnel (issue 15, item 4).
    #[test]
    fn both_ends_relay_through_the_same_hub_whatever_order_the_introductions_came_in() {
        let at_a = Peers::from_foreign_clusters(&[
            hub("hub-2"),
            hub("hub-1"),
            induced("leaf-c", "hub-2", &["hub-1"]),
        ]);
        let at_c = Peers::from_foreign_clusters(&[
            hub("hub-1"),
            hub("hub-2"),
            induced("leaf-a", "hub-1", &["hub-2"]),
        ]);
        assert_eq!(relay_hub(&at_a, "leaf-c").as_deref(), Some("hub-1"));
        assert_eq!(relay_hub(&at_c, "leaf-a").as_deref(), Some("hub-1"));
    }

    /// A hub that cannot relay (no forwarder, or networking off) is passed over.
    #[test]
    fn a_hub_that_cannot_relay_is_not_chosen() {
        let mut mute = hub("hub-1");
        if let Some(full) = mute.full.as_mut() {
            full.networking_enabled = false;
        }
        let peers = Peers::from_foreign_clusters(&[
            mute,
            hub("hub-2"),
            induced("leaf-c", "hub-1", &["hub-2"]),
        ]);
        assert_eq!(relay_hub(&peers, "leaf-c").as_deref(), Some("hub-2"));
        let alone = Peers::from_foreign_clusters(&[induced("leaf-c", "hub-1", &[])]);
        assert_eq!(relay_hub(&alone, "leaf-c"), None);
    }

    /// The predicate a cached record is trusted by agrees with what a listing routes directly.
    #[test]
    fn a_routable_full_peer_is_exactly_a_directly_routed_one() {
        let mut mute = hub("mute");
        if let Some(full) = mute.full.as_mut() {
            full.networking_enabled = false;
        }
        let mut brokerless = hub("brokerless");
        if let Some(addresses) = brokerless.full.as_mut().and_then(|f| f.addresses.as_mut()) {
            addresses.broker.clear();
        }
        let mut unpeered = hub("unpeered");
        unpeered.conditions.clear();
        let records = [
            hub("ok"),
            mute,
            brokerless,
            unpeered,
            induced("leaf", "ok", &[]),
        ];
        let peers = Peers::from_foreign_clusters(&records);
        for fc in &records {
            let id =
                ClusterId::parse("id", &fc.identity.as_ref().expect("id").cluster_id).expect("id");
            let direct = matches!(
                peers.desired.get(&id).map(|r| &r.route),
                Some(Route::Direct { .. })
            );
            assert_eq!(is_routable_full_peer(fc), direct, "{id}");
        }
        assert!(is_routable_full_peer(&records[0]));
    }
}
