//! `trellisctl peer` (Broker.Peer) and `trellisctl unpeer` (Broker.Unpeer).

use serde::Serialize;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{PeerRequest, UnpeerRequest};

use crate::cli::{Globals, PeerArgs, UnpeerArgs};
use crate::error::CtlError;
use crate::identity::{AddressesView, IdentityView};
use crate::output::Report;
use crate::service::Service;
use crate::table::fields;

/// The outcome of `peer`: who the remote is and what it advertised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerView {
    /// The remote broker address that was dialled.
    pub remote_broker: String,
    /// The remote cluster, as its handshake reported it.
    pub identity: Option<IdentityView>,
    /// The service addresses the remote advertised.
    pub addresses: AddressesView,
}

impl Report for PeerView {
    fn table(&self) -> String {
        let who = self
            .identity
            .as_ref()
            .map_or_else(|| "an unnamed cluster".into(), IdentityView::text);
        let mut out = format!(
            "peered with {who} at {}; NetworkConfigs are being exchanged (see `trellisctl status`)\n",
            self.remote_broker
        );
        out.push_str("advertised addresses:\n");
        out.push_str(&fields(&self.addresses.pairs()));
        out
    }
}

/// The outcome of `unpeer`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnpeerView {
    pub cluster_id: String,
    /// False when there was no peering with it (nothing was done).
    pub unpeered: bool,
}

impl Report for UnpeerView {
    fn table(&self) -> String {
        if self.unpeered {
            format!(
                "unpeered {}; its tunnel, NetworkConfigs and IPAM mappings are being removed\n",
                self.cluster_id
            )
        } else {
            format!("{} was not peered; nothing to do\n", self.cluster_id)
        }
    }
}

/// Runs `peer`.
pub async fn peer(globals: &Globals, args: &PeerArgs) -> Result<PeerView, CtlError> {
    let target = globals.target(Service::Broker);
    let mut broker = BrokerClient::new(globals.connect(&target).await?);
    let reply = broker
        .peer(PeerRequest {
            broker_address: args.remote_broker.clone(),
            token: args.token.clone(),
            expected_cluster_id: args.expected_cluster_id.clone().unwrap_or_default(),
            ca_cert_hash: args.ca_cert_hash.clone().unwrap_or_default(),
        })
        .await
        .map_err(|s| CtlError::rpc(&target, "Peer", &s))?
        .into_inner();
    Ok(PeerView {
        remote_broker: args.remote_broker.clone(),
        identity: IdentityView::from_pb(reply.identity.as_ref()),
        addresses: AddressesView::from_pb(reply.addresses.as_ref()),
    })
}

/// Runs `unpeer`.
pub async fn unpeer(globals: &Globals, args: &UnpeerArgs) -> Result<UnpeerView, CtlError> {
    let target = globals.target(Service::Broker);
    let mut broker = BrokerClient::new(globals.connect(&target).await?);
    let reply = broker
        .unpeer(UnpeerRequest {
            cluster_id: args.cluster_id.clone(),
        })
        .await
        .map_err(|s| CtlError::rpc(&target, "Unpeer", &s))?
        .into_inner();
    Ok(UnpeerView {
        cluster_id: args.cluster_id.clone(),
        unpeered: reply.unpeered,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_table_names_the_remote_and_its_addresses() {
        let view = PeerView {
            remote_broker: "10.0.0.1:7102".into(),
            identity: Some(IdentityView {
                cluster_id: "hub".into(),
                cluster_name: "Hub".into(),
            }),
            addresses: AddressesView {
                broker: "10.0.0.1:7102".into(),
                ..AddressesView::default()
            },
        };
        let text = view.table();
        assert!(
            text.starts_with("peered with hub (Hub) at 10.0.0.1:7102;"),
            "{text}"
        );
        assert!(text.contains("  broker     10.0.0.1:7102\n"), "{text}");
        assert!(text.contains("  gateway    -\n"), "{text}");
    }

    #[test]
    fn unpeer_says_whether_anything_happened() {
        let done = UnpeerView {
            cluster_id: "a".into(),
            unpeered: true,
        };
        assert!(done.table().starts_with("unpeered a;"));
        let noop = UnpeerView {
            cluster_id: "a".into(),
            unpeered: false,
        };
        assert_eq!(noop.table(), "a was not peered; nothing to do\n");
        assert_eq!(
            serde_json::to_value(&noop).expect("json"),
            serde_json::json!({"cluster_id": "a", "unpeered": false})
        );
    }
}
