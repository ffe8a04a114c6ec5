//! The port to the local discovery service, which owns the peerings: the addresses we
//! advertise, the ForeignClusters (listed, read one by one, or answered from a copy its watch
//! keeps current), and recording a peering's start and end. The watch's events reach the
//! reconciler as [`ForeignClusterEvent`]s.

use trellis_api::convert::{addresses_from_pb, addresses_to_pb, identity_to_pb};
use trellis_api::model::Addresses;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::{
    GetForeignClusterRequest, GetIdentityRequest, ListForeignClustersRequest, UpdatePeeringRequest,
    WatchForeignClustersResponse,
};
use trellis_api::pb::types::{ForeignCluster, WatchEventType};
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;
use trellis_runtime::client::TracedChannel;
use trellis_runtime::foreign_clusters::{self, ForeignClusters};
use trellis_runtime::tls::PinnedCa;

/// What a change to one ForeignCluster is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Added,
    Modified,
    Deleted,
    /// The snapshot at the start of a watch is complete.
    Bookmark,
    /// A kind this version does not know: whoever reads the records must look at them all.
    Unknown,
}

/// One change of the local ForeignClusters, as discovery's watch delivers it. The record is
/// borrowed from the watch's message: a hub's every new Neighborhood rewrites each induced
/// record it lists, and copying each record out of each event would cost for nothing.
#[derive(Debug, Clone, Copy)]
pub struct ForeignClusterEvent<'a> {
    pub kind: EventKind,
    /// Absent on a bookmark; a deletion may carry only the ID.
    pub cluster: Option<&'a ForeignCluster>,
}

impl ForeignClusterEvent<'_> {
    /// The record's cluster ID as discovery spells it, when the event carries one.
    pub fn cluster_id(&self) -> Option<&str> {
        self.cluster
            .and_then(|fc| fc.identity.as_ref())
            .map(|identity| identity.cluster_id.as_str())
    }
}

fn event_of(wire: &WatchForeignClustersResponse) -> ForeignClusterEvent<'_> {
    let kind = match WatchEventType::try_from(wire.r#type) {
        Ok(WatchEventType::Added) => EventKind::Added,
        Ok(WatchEventType::Modified) => EventKind::Modified,
        Ok(WatchEventType::Deleted) => EventKind::Deleted,
        Ok(WatchEventType::Bookmark) => EventKind::Bookmark,
        _ => EventKind::Unknown,
    };
    ForeignClusterEvent {
        kind,
        cluster: wire.foreign_cluster.as_ref(),
    }
}

/// What [`Discovery::follow`] reports, after the copy has taken it in.
#[derive(Debug, Clone, Copy)]
pub enum Followed<'a> {
    /// A new stream starts: its snapshot follows (as added records, then a bookmark).
    Restarted,
    Event(ForeignClusterEvent<'a>),
}

/// The local discovery service.
#[derive(Debug)]
pub struct Discovery {
    channel: TracedChannel,
    /// Discovery's records as its watch last delivered them (kept by [`Self::follow`], which
    /// the reconciler runs): what each received NetworkConfig is checked against first.
    copy: ForeignClusters,
}

impl Discovery {
    pub(super) fn new(channel: TracedChannel) -> Self {
        Self {
            channel,
            copy: ForeignClusters::new(),
        }
    }

    /// The channel, for the cluster-facing listener's trust sync.
    pub fn channel(&self) -> TracedChannel {
        self.channel.clone()
    }

    fn client(&self) -> DiscoveryClient<TracedChannel> {
        DiscoveryClient::new(self.channel.clone())
    }

    /// The addresses this cluster advertises.
    pub async fn advertised(&self) -> Result<Addresses> {
        let answer = self
            .client()
            .get_identity(GetIdentityRequest {})
            .await
            .map_err(|status| {
                Error::from(status).context("asking the local discovery service for our addresses")
            })?
            .into_inner();
        addresses_from_pb("addresses", answer.addresses.as_ref())
    }

    /// Every ForeignCluster, of either kind.
    pub async fn foreign_clusters(&self) -> Result<Vec<ForeignCluster>> {
        let listing = self
            .client()
            .list_foreign_clusters(ListForeignClustersRequest { kind: 0 })
            .await
            .map_err(|status| Error::from(status).context("listing foreign clusters"))?
            .into_inner();
        Ok(listing.foreign_clusters)
    }

    /// The ForeignCluster of `id`, if discovery has one.
    pub async fn foreign_cluster(&self, id: &ClusterId) -> Result<Option<ForeignCluster>> {
        let request = GetForeignClusterRequest {
            cluster_id: id.to_string(),
        };
        match self.client().get_foreign_cluster(request).await {
            Ok(answer) => Ok(answer.into_inner().foreign_cluster),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(Error::from(status).context("reading the foreign cluster")),
        }
    }

    /// The records of `ids` read afresh (unknown ones are absent), one lookup each.
    pub async fn read(&self, ids: &[&ClusterId]) -> Result<Vec<ForeignCluster>> {
        foreign_clusters::read(&self.channel, ids).await
    }

    /// The watch-fed copy of discovery's records.
    pub fn copy(&self) -> &ForeignClusters {
        &self.copy
    }

    /// The records of `ids` (unknown ones are absent): from the copy where it holds them,
    /// otherwise read afresh.
    pub async fn lookup(&self, ids: &[&ClusterId]) -> Result<Vec<ForeignCluster>> {
        self.copy.lookup(&self.channel, ids, |_| true).await
    }

    /// Records the peering with `remote` as started (`peered`) or ended, with the reason its
    /// condition shows and, when started, where the remote's services are and the CA pinned
    /// for it.
    pub async fn update_peering(
        &self,
        remote: &ClusterIdentity,
        addresses: Option<&Addresses>,
        peered: bool,
        reason: &str,
        ca: Option<&PinnedCa>,
    ) -> Result<()> {
        self.client()
            .update_peering(UpdatePeeringRequest {
                identity: Some(identity_to_pb(remote)),
                peered,
                addresses: addresses.map(addresses_to_pb),
                outgoing_peering_enabled: peered,
                incoming_peering_enabled: peered,
                networking_enabled: peered,
                reason: reason.to_owned(),
                message: String::new(),
                expected_revision: 0,
                ca_certificate: ca.map(|c| c.pem().to_owned()).unwrap_or_default(),
            })
            .await
            .map_err(|status| {
                Error::from(status).context("recording the peering in the local discovery service")
            })?;
        Ok(())
    }

    /// Follows discovery's watch until `shutdown`, keeping the copy current and opening the
    /// watch again whenever it breaks; `on_change` sees every change after the copy took it
    /// in, so a reader it wakes finds the change.
    pub async fn follow(&self, shutdown: Shutdown, mut on_change: impl FnMut(Followed<'_>)) {
        self.copy
            .follow(self.channel.clone(), shutdown, |followed| match followed {
                foreign_clusters::Followed::Restarted => on_change(Followed::Restarted),
                foreign_clusters::Followed::Event(event) => {
                    on_change(Followed::Event(event_of(event)));
                }
            })
            .await;
    }
}

#[cfg(test)]
impl Discovery {
    /// Syncs the copy to exactly `records`, as a watch's snapshot would: a test stages a copy
    /// that lags discovery with it.
    pub fn stage(&self, records: Vec<ForeignCluster>) {
        self.copy.restart();
        for fc in records {
            self.copy.apply(&WatchForeignClustersResponse {
                r#type: WatchEventType::Added as i32,
                foreign_cluster: Some(fc),
                revision: 1,
            });
        }
        self.copy.apply(&WatchForeignClustersResponse {
            r#type: WatchEventType::Bookmark as i32,
            foreign_cluster: None,
            revision: 1,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_message_becomes_the_event_it_names() {
        let wire = WatchForeignClustersResponse {
            r#type: WatchEventType::Deleted as i32,
            foreign_cluster: Some(ForeignCluster {
                identity: Some(trellis_api::pb::types::ClusterIdentity {
                    cluster_id: "leaf-b".into(),
                    cluster_name: String::new(),
                }),
                ..Default::default()
            }),
            revision: 7,
        };
        let event = event_of(&wire);
        assert_eq!(event.kind, EventKind::Deleted);
        assert_eq!(event.cluster_id(), Some("leaf-b"));

        let unknown = WatchForeignClustersResponse {
            r#type: 99,
            foreign_cluster: None,
            revision: 8,
        };
        let event = event_of(&unknown);
        assert_eq!(event.kind, EventKind::Unknown);
        assert!(event.cluster.is_none());
    }
}
