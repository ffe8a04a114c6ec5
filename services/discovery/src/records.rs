//! What the discovery service keeps in its store, and where. Key layout (below the store's own
//! prefix):
//!
//! | key | value |
//! |---|---|
//! | `identity` | [`LocalIdentity`]: this cluster's identity, fixed by the first start |
//! | `clusters/<cluster_id>` | [`ForeignClusterRecord`]: one known remote cluster |
//! | `tombstones/<cluster_id>` | the last [`ForeignClusterRecord`] of a deleted cluster, written by the deleting transaction (same revision), so a watch can report a deletion with the record's last content |
//! | `inbox/<sender_id>` | [`Inbox`]: the generation of the last Neighborhood applied from a hub |
//! | `outbox/<peer_id>` | [`Outbox`]: digest and generation of the Neighborhood a full peer last acknowledged from us |
//!
//! Everything a restarted process needs is here: the Neighborhood sender recomputes what each
//! peer should hold from `clusters/` and compares it with `outbox/`.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use trellis_api::peers;
use trellis_api::{ClusterId, ClusterIdentity};

pub const IDENTITY_KEY: &str = "identity";
pub const CLUSTERS_PREFIX: &str = "clusters/";
pub const TOMBSTONES_PREFIX: &str = "tombstones/";
pub const INBOX_PREFIX: &str = "inbox/";
pub const OUTBOX_PREFIX: &str = "outbox/";

/// Store key of a ForeignCluster.
pub fn cluster_key(id: &ClusterId) -> String {
    format!("{CLUSTERS_PREFIX}{id}")
}

/// Store key of a deleted ForeignCluster's last content.
pub fn tombstone_key(id: &str) -> String {
    format!("{TOMBSTONES_PREFIX}{id}")
}

/// Store key of what we hold from a hub.
pub fn inbox_key(sender: &ClusterId) -> String {
    format!("{INBOX_PREFIX}{sender}")
}

/// Store key of what a peer acknowledged from us.
pub fn outbox_key(peer: &ClusterId) -> String {
    format!("{OUTBOX_PREFIX}{peer}")
}

/// The local identity as first configured; later starts must agree with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalIdentity {
    pub identity: ClusterIdentity,
}

/// The parts of a record the neighborhood sender looks at before the rest: whose it is and
/// its kinds. Decoding only these skips an induced peer's peering and certificate, most of
/// what a hub's or a leaf's records hold.
#[derive(Debug, Deserialize)]
pub struct RecordHead {
    pub identity: HeadIdentity,
    pub kind: Kind,
    #[serde(default)]
    pub previous_kind: Option<Kind>,
}

/// A record's identity, by ID alone (see [`RecordHead`]).
#[derive(Debug, Deserialize)]
pub struct HeadIdentity {
    pub id: ClusterId,
}

impl RecordHead {
    /// Whether the record is or was a full peer's: the neighborhood sender's concern.
    pub fn full_now_or_before(&self) -> bool {
        self.kind == Kind::Full || self.previous_kind == Some(Kind::Full)
    }
}

/// Full or induced (types.proto `PeeringKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    Full,
    Induced,
}

/// How a record was first learned (types.proto `DiscoverySource`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Source {
    Manual,
    DnsSrv,
    Mdns,
    Neighborhood,
    Peering,
}

/// A discovery mechanism that currently finds a cluster. Manual discovery lasts until the
/// record is removed; DNS-SRV and mDNS until their announcement disappears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Mechanism {
    Manual,
    DnsSrv,
    Mdns,
}

impl Mechanism {
    /// The record source a first finding by this mechanism gives.
    pub fn source(self) -> Source {
        match self {
            Self::Manual => Source::Manual,
            Self::DnsSrv => Source::DnsSrv,
            Self::Mdns => Source::Mdns,
        }
    }
}

pub use trellis_api::model::Addresses;

/// The full-peering part of a record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FullPeering {
    pub outgoing: bool,
    pub incoming: bool,
    pub networking: bool,
    pub addresses: Addresses,
    /// The peer's pinned CA certificate (PEM), empty without TLS (ADR 0014).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ca_certificate: String,
}

/// The induced-peering part of a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InducedPeering {
    pub origin: ClusterIdentity,
    pub addresses: Addresses,
    pub generation: i64,
    #[serde(default)]
    pub alternative_origins: Vec<ClusterIdentity>,
}

/// Tri-state condition status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Status {
    True,
    False,
    Unknown,
}

/// One condition of a record; at most one per type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    /// A [`peers::Condition`]'s wire string; a string, so that a record a newer version wrote
    /// with a condition this one does not know still decodes.
    pub kind: String,
    pub status: Status,
    pub reason: String,
    pub message: String,
    /// When `status` last changed, in nanoseconds since the epoch.
    pub last_transition: i64,
}

/// One known remote cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForeignClusterRecord {
    pub identity: ClusterIdentity,
    pub kind: Kind,
    #[serde(default)]
    pub full: Option<FullPeering>,
    #[serde(default)]
    pub induced: Option<InducedPeering>,
    #[serde(default)]
    pub conditions: Vec<Condition>,
    pub source: Source,
    #[serde(default)]
    pub discovery_address: String,
    /// The mechanisms that find the cluster right now (internal; not on the wire).
    #[serde(default)]
    pub found_by: BTreeSet<Mechanism>,
    /// The kind before the write that produced this version (internal): lets a filtered watch
    /// tell an INDUCED -> FULL change from a plain modification without keeping history.
    #[serde(default)]
    pub previous_kind: Option<Kind>,
    pub create_time: i64,
    pub update_time: i64,
}

impl ForeignClusterRecord {
    /// A new record stamped now.
    pub fn new(identity: ClusterIdentity, kind: Kind, source: Source) -> Self {
        let now = now_nanos();
        Self {
            identity,
            kind,
            full: None,
            induced: None,
            conditions: Vec::new(),
            source,
            discovery_address: String::new(),
            found_by: BTreeSet::new(),
            previous_kind: None,
            create_time: now,
            update_time: now,
        }
    }

    /// The condition of type `kind`, if present.
    pub fn condition(&self, kind: peers::Condition) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.kind == kind.as_str())
    }

    /// Whether condition `kind` is present and true.
    pub fn is(&self, kind: peers::Condition) -> bool {
        self.condition(kind)
            .is_some_and(|c| c.status == Status::True)
    }

    /// Sets a condition; the transition time moves only when the status changes.
    pub fn set_condition(
        &mut self,
        kind: peers::Condition,
        status: Status,
        reason: &str,
        message: &str,
    ) {
        let now = now_nanos();
        match self.conditions.iter_mut().find(|c| c.kind == kind.as_str()) {
            Some(c) => {
                if c.status != status {
                    c.last_transition = now;
                }
                c.status = status;
                c.reason = reason.to_owned();
                c.message = message.to_owned();
            }
            None => self.conditions.push(Condition {
                kind: kind.as_str().to_owned(),
                status,
                reason: reason.to_owned(),
                message: message.to_owned(),
                last_transition: now,
            }),
        }
    }

    /// A full peer with networking enabled: listed in our Neighborhoods, and allowed to send us
    /// its own.
    pub fn is_networked_full_peer(&self) -> bool {
        self.kind == Kind::Full
            && self.is(peers::Condition::Peered)
            && self.full.as_ref().is_some_and(|f| f.networking)
    }

    /// The address of the cluster's discovery service, as it advertised it, else as found.
    pub fn discovery_endpoint(&self) -> &str {
        self.full
            .as_ref()
            .map(|f| f.addresses.discovery.as_str())
            .filter(|a| !a.is_empty())
            .unwrap_or(&self.discovery_address)
    }

    /// Whether the record is induced by `origin` and not withdrawn.
    pub fn is_induced_by(&self, origin: &ClusterId) -> bool {
        self.kind == Kind::Induced
            && !self.is(peers::Condition::Withdrawn)
            && self
                .induced
                .as_ref()
                .is_some_and(|i| &i.origin.id == origin)
    }
}

/// What we hold from one hub.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inbox {
    pub generation: i64,
}

/// One neighbour as sent in a Neighborhood.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Neighbor {
    pub identity: ClusterIdentity,
    pub addresses: Addresses,
}

/// What a full peer last acknowledged from us.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outbox {
    /// The peer, as known when we last sent.
    pub peer: ClusterIdentity,
    /// The generation it acknowledged.
    pub generation: i64,
    /// Digest of the neighbours it acknowledged ([`Outbox::digest_of`]). Only the digest is
    /// kept: the lists themselves are every other peer with its addresses, n(n-1) entries in
    /// all, which made the hub's store grow quadratically in bytes.
    #[serde(default)]
    pub digest: String,
    /// How many neighbours it acknowledged (for operators reading the store).
    #[serde(default)]
    pub count: usize,
    /// The lowest generation the next send may use (the peer reported holding a higher one).
    #[serde(default)]
    pub floor: i64,
}

impl Outbox {
    /// A digest of a neighbour list, to tell whether the list a peer holds is the one it should.
    /// It only decides whether to send: a digest computed by another build that differs causes
    /// one idempotent re-send, and the periodic resync sends the full list regardless, so
    /// neither a change of hash function nor a collision can leave a peer with a wrong list.
    pub fn digest_of(neighbors: &[Neighbor]) -> String {
        Self::digest_of_hashes(neighbors.iter().map(Neighbor::hash64))
    }

    /// [`Outbox::digest_of`] the neighbours whose [`Neighbor::hash64`] are `hashes`, in order.
    /// A hub compares a digest for every peer on every pass, each list holding every other
    /// peer: hashing each neighbour once per pass and combining the hashes keeps that O(n)
    /// serializations, not O(n²).
    pub fn digest_of_hashes(hashes: impl IntoIterator<Item = u64>) -> String {
        use std::hash::Hasher as _;
        let mut hasher = std::hash::DefaultHasher::new();
        let mut count = 0_usize;
        for hash in hashes {
            hasher.write_u64(hash);
            count += 1;
        }
        format!("{:016x}:{count}", hasher.finish())
    }
}

impl Neighbor {
    /// A hash of this neighbour as it is sent (its JSON form), the unit [`Outbox::digest_of`]
    /// combines.
    pub fn hash64(&self) -> u64 {
        use std::hash::{Hash as _, Hasher as _};
        let mut hasher = std::hash::DefaultHasher::new();
        serde_json::to_vec(self)
            .unwrap_or_default()
            .hash(&mut hasher);
        hasher.finish()
    }
}

pub use trellis_store::record::{decode, encode, now_nanos};
