//! What the forwarder keeps in its store: only relays still in flight. Completed relays are
//! deleted, so a hub with n leaves holds at most the exchanges not yet acknowledged, not the
//! n(n-1) passthrough NetworkConfigs of the thesis' design.
//!
//! | key | value |
//! |---|---|
//! | `relays/<origin>--<destination>` | [`RelayRecord`] |

use serde::{Deserialize, Serialize};
use trellis_api::model::NetworkSpec;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};

pub const RELAYS_PREFIX: &str = "relays/";

/// Store key of the relay of (origin → destination).
pub fn relay_key(origin: &ClusterId, destination: &ClusterId) -> String {
    format!("{RELAYS_PREFIX}{origin}--{destination}")
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
}

/// One relay in flight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayRecord {
    pub origin: ClusterIdentity,
    pub destination: ClusterIdentity,
    pub spec: NetworkSpec,
    pub generation: i64,
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
}

pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| Error::Internal(format!("encoding a record: {e}")))
}

pub fn decode<T: for<'de> Deserialize<'de>>(key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes)
        .map_err(|e| Error::Internal(format!("corrupt store record {key:?}: {e}")))
}

/// Nanoseconds since the epoch.
pub fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}
