//! What the broker keeps in its store, and where (below the store's prefix):
//!
//! | key | value |
//! |---|---|
//! | `token` | [`TokenRecord`]: the peering token (and the previous one during a grace period) |
//! | `nc/out/<remote>` | [`OutgoingNc`]: the NetworkConfig we send to a remote, with its decision |
//! | `nc/in/<remote>` | [`IncomingNc`]: the NetworkConfig a remote sent us, with our decision |
//! | `tunnels/<remote>` | [`TunnelEndpoint`]: the merge of both, the gateway's input |
//! | `tunnel-tombstones/<remote>` | the last content of a deleted TunnelEndpoint (for watches) |
//! | `notify/<remote>` | [`PendingNotify`]: an unpeering not yet acknowledged by the remote |
//! | `peering/<remote>` | the [`PeeringId`] of the current full peering with the remote |
//! | `join-tokens/<id>` | [`JoinTokenRecord`](crate::join_tokens::JoinTokenRecord): a join token's secret hash and expiry |

use serde::{Deserialize, Serialize};
use trellis_api::model::{NatView, NetworkSpec, TunnelEndpoint};
use trellis_api::{ClusterId, ClusterIdentity};

use crate::peering_id::PeeringId;

pub const TOKEN_KEY: &str = "token";
pub const OUT_PREFIX: &str = "nc/out/";
pub const IN_PREFIX: &str = "nc/in/";
pub const TUNNELS_PREFIX: &str = "tunnels/";
pub const TOMBSTONES_PREFIX: &str = "tunnel-tombstones/";
pub const NOTIFY_PREFIX: &str = "notify/";
pub const PEERING_PREFIX: &str = "peering/";
pub const JOIN_TOKENS_PREFIX: &str = "join-tokens/";

/// Store key of the ID of the current full peering with `remote`.
pub fn peering_key(remote: &ClusterId) -> String {
    format!("{PEERING_PREFIX}{remote}")
}

pub fn out_key(remote: &ClusterId) -> String {
    format!("{OUT_PREFIX}{remote}")
}
pub fn in_key(remote: &ClusterId) -> String {
    format!("{IN_PREFIX}{remote}")
}
pub fn tunnel_key(remote: &ClusterId) -> String {
    format!("{TUNNELS_PREFIX}{remote}")
}
pub fn tombstone_key(remote: &ClusterId) -> String {
    format!("{TOMBSTONES_PREFIX}{remote}")
}
pub fn notify_key(remote: &ClusterId) -> String {
    format!("{NOTIFY_PREFIX}{remote}")
}

/// The peering token. The previous one stays valid until `previous_expires_nanos`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub current: String,
    pub created_nanos: i64,
    #[serde(default)]
    pub previous: Option<String>,
    #[serde(default)]
    pub previous_expires_nanos: i64,
}

/// A receiver's decision on a NetworkConfig.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// How the receiver addresses the sender, for the spec at `observed_generation`.
    Processed {
        view: NatView,
        observed_generation: i64,
    },
    /// The receiver refused the spec at `observed_generation` for good (the spec itself is
    /// unusable); only a new spec (a higher generation) is decided again.
    Rejected {
        message: String,
        observed_generation: i64,
    },
    /// The receiver could not decide yet for a reason that may pass (no free range to remap
    /// into, ADR 0010): the sender re-submits with backoff and the receiver decides again.
    Pending {
        message: String,
        observed_generation: i64,
    },
}

impl Decision {
    /// The generation this decision answers.
    pub fn observed_generation(&self) -> i64 {
        match self {
            Self::Processed {
                observed_generation,
                ..
            }
            | Self::Rejected {
                observed_generation,
                ..
            }
            | Self::Pending {
                observed_generation,
                ..
            } => *observed_generation,
        }
    }

    /// The NAT view, when processed.
    pub fn view(&self) -> Option<NatView> {
        match self {
            Self::Processed { view, .. } => Some(*view),
            Self::Rejected { .. } | Self::Pending { .. } => None,
        }
    }
}

/// Our NetworkConfig towards a remote: what we sent and what the remote decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutgoingNc {
    pub remote: ClusterIdentity,
    /// The hub relaying it (induced peers only).
    pub via: Option<ClusterIdentity>,
    /// The hub's forwarder address, to withdraw through it later.
    #[serde(default)]
    pub forwarder: Option<String>,
    pub spec: NetworkSpec,
    pub generation: i64,
    /// The remote's decision, once known.
    pub decision: Option<Decision>,
    /// The generation of the remote's own NetworkConfig towards us when it made `decision`
    /// (0: it had none, or it did not say). Its NetworkConfig at this generation comes from
    /// the incarnation that holds ours, so receiving it does not make us send ours again.
    #[serde(default)]
    pub receiver_generation: i64,
    /// W3C traceparent of the exchange, so every pass and process that works on it adds to
    /// one trace (absent when tracing is off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

impl OutgoingNc {
    /// The decision for the current generation, if any.
    pub fn current_decision(&self) -> Option<&Decision> {
        self.decision
            .as_ref()
            .filter(|d| d.observed_generation() == self.generation)
    }
}

/// A remote's NetworkConfig towards us and our decision on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingNc {
    pub remote: ClusterIdentity,
    pub via: Option<ClusterIdentity>,
    pub spec: NetworkSpec,
    pub generation: i64,
    pub decision: Decision,
}

/// An unpeering the remote has not acknowledged yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingNotify {
    pub remote: ClusterIdentity,
    pub broker: String,
    pub reason: String,
    /// The remote's CA (PEM), kept to reach it over mutual TLS after it was unpinned.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub ca_certificate: String,
    /// The peering this notice ends; `None` for peerings made before peering IDs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peering_id: Option<PeeringId>,
}

/// A stored TunnelEndpoint.
pub type TunnelRecord = TunnelEndpoint;

/// The NetworkConfig name both ends agree on; the rule is trellis-api's, shared with the
/// forwarder that relays NetworkConfigs between induced peers.
pub use trellis_api::peers::network_config_name as nc_name;

pub use trellis_store::record::{decode, encode, now_nanos};
