//! What the gateway keeps in its store, and where. Key layout (below the store's own prefix):
//!
//! | key | value |
//! |---|---|
//! | `key` | [`KeyRecord`]: the WireGuard private key, written once (secret) |
//! | `ports/peers/<cluster_id>` | [`PortRecord`]: the UDP port of that peer's interface |
//! | `ports/used/<port>` | the cluster ID holding the port (uniqueness) |
//! | `ports/freed/<port>` | [`FreedRecord`]: a port whose tunnel went away, until it is taken again |
//! | `replicas/active` | [`ActiveRecord`]: the active replica and its epoch (the fence, ADR 0023) |
//! | `replicas/members/<replica>` | [`MemberRecord`]: a replica and where its heartbeats go |
//! | `replicas/endpoints` | [`RoamedRecord`]: where the active last heard each roamed peer |
//!
//! A port is taken by one transaction that writes both port keys only if both are absent, so
//! two replicas (or two concurrent GetGatewayInfo calls) can never hand out one port twice.

use serde::{Deserialize, Serialize};
use trellis_api::ClusterId;

pub const KEY_KEY: &str = "key";
pub const PEERS_PREFIX: &str = "ports/peers/";
pub const USED_PREFIX: &str = "ports/used/";
pub const FREED_PREFIX: &str = "ports/freed/";
pub const ACTIVE_KEY: &str = "replicas/active";
pub const MEMBERS_PREFIX: &str = "replicas/members/";
pub const ROAMED_KEY: &str = "replicas/endpoints";

/// The peers the active hears from somewhere else than their published endpoint (a peer whose
/// cluster failed over to its standby), written by the active when that changes: a standby
/// that takes over initiates to them there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoamedRecord {
    pub epoch: u64,
    /// Base64 public key of the peer, and where it is.
    pub endpoints: std::collections::BTreeMap<String, std::net::SocketAddr>,
}

/// Store key of a replica's membership.
pub fn member_key(replica: &str) -> String {
    format!("{MEMBERS_PREFIX}{replica}")
}

/// Which replica is the cluster's active gateway. Written only by a transaction that compares
/// the revision the writer read, each time with the next epoch: two replicas can never both
/// claim one epoch, and every takeover is a new one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveRecord {
    pub replica: String,
    pub epoch: u64,
    /// Its node, for the route agents.
    pub node_name: String,
    pub node_ip: Option<std::net::IpAddr>,
    /// Its `--endpoint-address`: what GetGatewayInfo publishes to peers that join later.
    pub endpoint_host: String,
    /// The gateway's public key as the active held it: a replica with another key never
    /// takes over.
    pub public_key: String,
    pub since_nanos: i64,
}

/// One gateway replica, written by itself at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub replica: String,
    pub node_name: String,
    /// Where its heartbeats are received (UDP).
    pub heartbeat: std::net::SocketAddr,
    pub public_key: String,
    pub started_nanos: i64,
}

/// Store key of a peer's port record.
pub fn peer_key(id: &ClusterId) -> String {
    format!("{PEERS_PREFIX}{id}")
}

/// Store key of a port's reservation.
pub fn used_key(port: u16) -> String {
    format!("{USED_PREFIX}{port}")
}

/// Store key of a freed port's marker.
pub fn freed_key(port: u16) -> String {
    format!("{FREED_PREFIX}{port}")
}

/// A port released with its peer's tunnel. Its number is the peer's connection mark and
/// routing table, so connections the kernel still tracks under that mark would follow the
/// next holder's tunnel: the port is handed out again only once they are flushed and the
/// quarantine (`--port-quarantine`) has passed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreedRecord {
    /// The peer that held it (for operators).
    pub peer: String,
    pub freed_nanos: i64,
    /// The connections marked with the port's mark were deleted from conntrack.
    pub flushed: bool,
}

/// The gateway's key pair, as stored: only the private half (the public one is derived).
/// Deliberately not `Debug`-printable with its content.
#[derive(Clone, Serialize, Deserialize)]
pub struct KeyRecord {
    /// Standard base64 of the 32-byte Curve25519 private key.
    pub private_key: String,
}

impl std::fmt::Debug for KeyRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyRecord { private_key: <redacted> }")
    }
}

/// The UDP port allocated to one remote peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortRecord {
    pub port: u16,
    /// Set once a TunnelEndpoint for the peer was applied: the port is then released when that
    /// TunnelEndpoint goes away. A port handed out by GetGatewayInfo before any tunnel exists
    /// (the broker is still exchanging NetworkConfigs) stays reserved while it is asked for.
    #[serde(default)]
    pub tunnel: bool,
    /// When GetGatewayInfo last asked for this port (refreshed at most every quarter of the
    /// grace period). A port without a tunnel that nobody asked for during the grace period
    /// (`--unused-port-grace`) goes back to the range; 0 (a record from before this field) means
    /// the grace period starts at the next check.
    #[serde(default)]
    pub requested_nanos: i64,
}

pub use trellis_store::record::{decode, encode, now_nanos};
