//! What the forwarder keeps in its store: only relays still in flight. Completed relays are
//! deleted, so a hub with n leaves holds at most the exchanges not yet acknowledged, not the
//! n(n-1) passthrough NetworkConfigs of a design without a forwarder.
//!
//! | key | value |
//! |---|---|
//! | `relays/<origin>/<destination>` | [`RelayRecord`] |
//!
//! Cluster IDs are `[A-Za-z0-9._-]` ([`ClusterId`]), so `/` cannot occur in one and the key
//! names exactly one pair. Earlier versions used `relays/<origin>--<destination>`, which IDs
//! containing `--` made ambiguous (`("a--b", "c")` and `("a", "b--c")` shared a record); such
//! keys are moved on start ([`crate::migrate`]).

use serde::{Deserialize, Serialize};
use trellis_api::model::NetworkSpec;
use trellis_api::pb::types as pb;
use trellis_api::{ClusterId, ClusterIdentity};

pub const RELAYS_PREFIX: &str = "relays/";

/// Store key of the relay of (origin → destination).
pub fn relay_key(origin: &ClusterId, destination: &ClusterId) -> String {
    format!("{RELAYS_PREFIX}{origin}/{destination}")
}

/// Whether `key` (under [`RELAYS_PREFIX`]) is in the old `relays/<origin>--<destination>`
/// layout: one segment, where the current layout has two.
pub fn is_old_layout(key: &str) -> bool {
    key.strip_prefix(RELAYS_PREFIX)
        .is_some_and(|rest| !rest.contains('/'))
}

/// Where a relay stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum State {
    /// The NetworkConfig must still reach the destination.
    Pending,
    /// The destination accepted it; its status will come through RelayStatus.
    Delivered,
    /// The destination's status must still reach the origin.
    StatusPending,
    /// The destination refused it for good; kept for operators until superseded.
    Failed,
    /// The withdrawal must still reach the destination.
    Withdrawing,
    /// Acknowledged by the other end; never stored (the record is deleted).
    Completed,
}

/// The destination's status, relayed as received (validated on arrival).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayedStatus {
    pub pod_cidr_nat: String,
    pub external_cidr_nat: String,
    /// `NetworkConfigState` as its wire number.
    pub state: i32,
    pub observed_generation: i64,
    pub message: String,
    /// The destination's own NetworkConfig generation towards the origin when it decided
    /// (0: none, or relayed by an earlier version).
    #[serde(default)]
    pub receiver_generation: i64,
}

impl RelayedStatus {
    /// The status as received on the wire.
    pub fn from_pb(status: pb::NetworkConfigStatus) -> Self {
        Self {
            pod_cidr_nat: status.pod_cidr_nat,
            external_cidr_nat: status.external_cidr_nat,
            state: status.state,
            observed_generation: status.observed_generation,
            message: status.message,
            receiver_generation: status.receiver_generation,
        }
    }

    /// The status as it is passed on.
    pub fn to_pb(&self) -> pb::NetworkConfigStatus {
        pb::NetworkConfigStatus {
            pod_cidr_nat: self.pod_cidr_nat.clone(),
            external_cidr_nat: self.external_cidr_nat.clone(),
            state: self.state,
            observed_generation: self.observed_generation,
            message: self.message.clone(),
            update_time: None,
            receiver_generation: self.receiver_generation,
        }
    }
}

/// One relay in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayRecord {
    pub origin: ClusterIdentity,
    pub destination: ClusterIdentity,
    pub spec: NetworkSpec,
    pub generation: i64,
    /// The generation of the destination's NetworkConfig the origin held when it sent this
    /// one (0: none, or relayed by an earlier version).
    #[serde(default)]
    pub held_generation: i64,
    pub state: State,
    pub status: Option<RelayedStatus>,
    /// Why the origin withdrew (state Withdrawing).
    #[serde(default)]
    pub reason: String,
    pub attempts: u32,
    pub last_error: String,
    pub created_nanos: i64,
    pub updated_nanos: i64,
    /// When the next delivery attempt is due (0 = now).
    pub next_attempt_nanos: i64,
    /// W3C traceparent of the origin's request, so retries stay in the peering's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

pub use trellis_store::record::{decode, encode, now_nanos};
