//! Views of the messages several commands print: a cluster identity and the service addresses a
//! cluster advertises.

use serde::Serialize;
use trellis_api::pb::types;

/// A cluster's ID and name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IdentityView {
    pub cluster_id: String,
    pub cluster_name: String,
}

impl IdentityView {
    /// From the proto; `None` when unset or without an ID.
    pub fn from_pb(identity: Option<&types::ClusterIdentity>) -> Option<Self> {
        identity.filter(|i| !i.cluster_id.is_empty()).map(|i| Self {
            cluster_id: i.cluster_id.clone(),
            cluster_name: i.cluster_name.clone(),
        })
    }

    /// "hub" or "hub (Hub cluster)" when the name differs from the ID.
    pub fn text(&self) -> String {
        if self.cluster_name.is_empty() || self.cluster_name == self.cluster_id {
            self.cluster_id.clone()
        } else {
            format!("{} ({})", self.cluster_id, self.cluster_name)
        }
    }
}

/// The ID of an optional identity, or "" (printed as `-`).
pub fn id_or_empty(identity: Option<&IdentityView>) -> String {
    identity.map(|i| i.cluster_id.clone()).unwrap_or_default()
}

/// Advertised service addresses; empty strings are services not advertised.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AddressesView {
    pub discovery: String,
    pub broker: String,
    pub forwarder: String,
    pub ipam: String,
    pub endpoints: String,
    pub gateway: String,
}

impl AddressesView {
    pub fn from_pb(addresses: Option<&types::ServiceAddresses>) -> Self {
        addresses.map_or_else(Self::default, |a| Self {
            discovery: a.discovery.clone(),
            broker: a.broker.clone(),
            forwarder: a.forwarder.clone(),
            ipam: a.ipam.clone(),
            endpoints: a.endpoints.clone(),
            gateway: a.gateway.clone(),
        })
    }

    /// (label, address) pairs for a key-value block.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        vec![
            ("discovery", self.discovery.clone()),
            ("broker", self.broker.clone()),
            ("forwarder", self.forwarder.clone()),
            ("ipam", self.ipam.clone()),
            ("endpoints", self.endpoints.clone()),
            ("gateway", self.gateway.clone()),
        ]
    }
}
