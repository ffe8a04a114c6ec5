//! The peering vocabulary, and the peering view of a cluster's discovery service.
//!
//! The vocabulary is the one place the words of peering are spelled, so that every service,
//! `trellisctl` and the runtime read ForeignClusters alike:
//!
//! - [`Condition`]: the types of a ForeignCluster's conditions. Their strings are on the wire
//!   and in discovery's store, so they never change; `crates/api/tests/vocabulary.rs` fails
//!   when one is spelled as a string literal anywhere else in the workspace.
//! - [`PEERED_REASON`] and [`UNPEERED_REASON`]: the reasons a peering's start and end are
//!   recorded with (in the `Peered` condition, and in the unpeering notice to the remote).
//! - the predicates the services read a ForeignCluster with: [`is_full_peer`],
//!   [`is_networked_full_peer`], [`routable_broker`], [`is_introduced`], [`is_withdrawn`].
//! - [`network_config_name`]: the name both ends (and a relaying hub) give a NetworkConfig.
//!
//! The view ([`Peers`]), shared by the broker and the forwarder: which remotes to exchange
//! NetworkConfigs with, read from the local discovery service's ForeignClusters: full peers
//! with an established peering and networking enabled, and induced clusters (not withdrawn)
//! introduced by such a full peer that advertises a forwarder. An induced cluster introduced by
//! several hubs is relayed through the one with the smallest cluster ID, so both ends pick the
//! same hub whatever order the introductions came in.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::convert::identity_from_pb;
use crate::ident::{ClusterId, ClusterIdentity};
use crate::pb::types as pb;

/// Declares [`Condition`] with its wire strings and [`Condition::ALL`] from one list, so a new
/// condition cannot be left out of `ALL` (which the vocabulary test walks).
macro_rules! conditions {
    ($($(#[$doc:meta])* $variant:ident = $wire:literal,)*) => {
        /// The type of a ForeignCluster condition: `Condition.type` on the wire, a condition's
        /// `kind` in discovery's store.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Condition {
            $($(#[$doc])* $variant,)*
        }

        impl Condition {
            /// Every condition, in declaration order.
            pub const ALL: &[Condition] = &[$(Condition::$variant,)*];

            /// The string on the wire and in the store.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Condition::$variant => $wire,)*
                }
            }
        }
    };
}

conditions! {
    /// A discovery mechanism (DNS-SD, mDNS, a static list) finds the cluster.
    Discovered = "Discovered",
    /// The full peering with the cluster is established.
    Peered = "Peered",
    /// A hub's Neighborhood introduces the cluster (an induced peering).
    InducedPeering = "InducedPeering",
    /// Nothing finds, peers with or introduces the cluster any more: the record is a tombstone
    /// kept for a while.
    Withdrawn = "Withdrawn",
}

impl Condition {
    /// Whether `fc` carries this condition with status True.
    pub fn is_true(self, fc: &pb::ForeignCluster) -> bool {
        fc.conditions
            .iter()
            .any(|c| c.r#type == self.as_str() && c.status == pb::ConditionStatus::True as i32)
    }
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A condition type this version does not know (a newer peer's, or a typo).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownCondition(pub String);

impl fmt::Display for UnknownCondition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown condition type {:?}", self.0)
    }
}

impl std::error::Error for UnknownCondition {}

impl FromStr for Condition {
    type Err = UnknownCondition;

    /// Exact and case-sensitive, as on the wire.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .iter()
            .copied()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownCondition(s.to_owned()))
    }
}

impl TryFrom<&str> for Condition {
    type Error = UnknownCondition;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// The reason a peering is recorded as established with when the caller gives none: the
/// condition's own name.
pub const PEERED_REASON: &str = Condition::Peered.as_str();

/// The reason a peering is recorded as ended with, locally and in the notice to the remote.
pub const UNPEERED_REASON: &str = "Unpeered";

/// The name of the NetworkConfig `origin` sends `destination`, `<origin>--<destination>`: both
/// ends and a relaying hub derive it alike, and a receiver refuses a NetworkConfig named
/// otherwise.
pub fn network_config_name(origin: &ClusterId, destination: &ClusterId) -> String {
    format!("{origin}--{destination}")
}

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

/// Whether `fc` is an established full peer (what [`Peers::full`] holds).
pub fn is_full_peer(fc: &pb::ForeignCluster) -> bool {
    fc.kind == pb::PeeringKind::Full as i32 && Condition::Peered.is_true(fc)
}

/// Whether `fc` is an established full peer with networking enabled (with or without a broker
/// address; see [`routable_broker`] for one that has it).
pub fn is_networked_full_peer(fc: &pb::ForeignCluster) -> bool {
    is_full_peer(fc) && fc.full.as_ref().is_some_and(|full| full.networking_enabled)
}

/// Whether `fc` is an induced cluster a hub currently introduces (`InducedPeering` True).
pub fn is_introduced(fc: &pb::ForeignCluster) -> bool {
    fc.kind == pb::PeeringKind::Induced as i32 && Condition::InducedPeering.is_true(fc)
}

/// Whether `fc` is withdrawn: a tombstone of a cluster nothing finds, peers with or
/// introduces any more.
pub fn is_withdrawn(fc: &pb::ForeignCluster) -> bool {
    Condition::Withdrawn.is_true(fc)
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
            if fc.kind != pb::PeeringKind::Induced as i32 || is_withdrawn(fc) {
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
                r#type: Condition::Peered.to_string(),
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

    /// The strings are on the wire and in discovery's store: pinned here, the one place they
    /// may be spelled.
    #[test]
    fn conditions_keep_their_wire_strings_and_parse_back() {
        let wire: Vec<&str> = Condition::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            wire,
            ["Discovered", "Peered", "InducedPeering", "Withdrawn"]
        );
        for &c in Condition::ALL {
            assert_eq!(c.to_string(), c.as_str());
            assert_eq!(c.as_str().parse::<Condition>(), Ok(c));
            assert_eq!(Condition::try_from(c.as_str()), Ok(c));
        }
        assert_eq!(
            "peered".parse::<Condition>(),
            Err(UnknownCondition("peered".into()))
        );
        assert_eq!(PEERED_REASON, "Peered");
        assert_eq!(UNPEERED_REASON, "Unpeered");
    }

    #[test]
    fn network_configs_are_named_origin_dash_dash_destination() {
        let id = |s: &str| ClusterId::parse("id", s).expect("id");
        assert_eq!(network_config_name(&id("a"), &id("b")), "a--b");
    }

    #[test]
    fn the_predicates_read_kind_and_conditions() {
        let full = hub("hub-1");
        assert!(is_full_peer(&full) && is_networked_full_peer(&full));
        assert!(!is_withdrawn(&full) && !is_introduced(&full));
        let mut mute = hub("mute");
        if let Some(f) = mute.full.as_mut() {
            f.networking_enabled = false;
        }
        assert!(is_full_peer(&mute) && !is_networked_full_peer(&mute));
        let mut leaf = induced("leaf", "hub-1", &[]);
        assert!(!is_full_peer(&leaf) && !is_introduced(&leaf));
        leaf.conditions.push(pb::Condition {
            r#type: Condition::InducedPeering.to_string(),
            status: pb::ConditionStatus::True as i32,
            ..Default::default()
        });
        assert!(is_introduced(&leaf));
        leaf.conditions.push(pb::Condition {
            r#type: Condition::Withdrawn.to_string(),
            status: pb::ConditionStatus::True as i32,
            ..Default::default()
        });
        assert!(is_withdrawn(&leaf));
    }
}
