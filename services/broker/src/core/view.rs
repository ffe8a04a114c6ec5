//! What the local discovery service says: the addresses we advertise and the peering view,
//! from the watch-fed copy of its records or read afresh. Discovery owns the peerings; the
//! broker asks it rather than keeping its own list, and confirms with a fresh read whatever a
//! lagging copy could get wrong.

use trellis_api::ClusterId;
use trellis_api::model::Addresses;
use trellis_api::pb::types::ForeignCluster;
use trellis_api::peers::Peers;
use trellis_error::Result;
use trellis_runtime::foreign_clusters::ForeignClusters;

use super::Broker;

impl Broker {
    /// The addresses this cluster advertises, as its discovery service knows them.
    pub async fn advertised(&self) -> Result<Addresses> {
        self.ports.discovery().advertised().await
    }

    /// The peering view of the local discovery service.
    pub async fn peers(&self) -> Result<Peers> {
        let listing = self.ports.discovery().foreign_clusters().await?;
        Ok(Peers::from_foreign_clusters(&listing))
    }

    /// The peering view for a pass: from the watch-fed copy of discovery's records when it is
    /// synced, otherwise [`Self::peers`]. The copy may lag discovery, so whatever is torn down
    /// or freed because a cluster is absent from it is confirmed with [`Self::peers`] first.
    pub async fn view(&self) -> Result<Peers> {
        let cached = self
            .foreign_clusters()
            .with_records(|records| Peers::from_foreign_clusters(records.iter().copied()));
        match cached {
            Some(peers) => Ok(peers),
            None => self.peers().await,
        }
    }

    /// The peering view of the clusters `ids` only (unknown ones are absent): one record
    /// lookup each instead of a listing, for the checks on every received NetworkConfig.
    pub async fn peers_of(&self, ids: &[&ClusterId]) -> Result<Peers> {
        Ok(Peers::from_foreign_clusters(
            &self.foreign_clusters_of(ids).await?,
        ))
    }

    /// The discovery records of `ids` (unknown ones are absent), one lookup each.
    pub async fn foreign_clusters_of(&self, ids: &[&ClusterId]) -> Result<Vec<ForeignCluster>> {
        self.ports.discovery().read(ids).await
    }

    /// The watch-fed copy of discovery's records.
    pub fn foreign_clusters(&self) -> &ForeignClusters {
        self.ports.discovery().copy()
    }

    /// `check` on the peering view of `ids` from the watch-fed copy (records it lacks are read
    /// from discovery) and, only if that refuses, on a view read from discovery: a copy that
    /// lags never makes a refusal.
    pub(super) async fn check_peers<T>(
        &self,
        ids: &[&ClusterId],
        check: impl Fn(&Peers) -> Result<T>,
    ) -> Result<T> {
        if self.foreign_clusters().synced() {
            let cached = self.ports.discovery().lookup(ids).await?;
            if let Ok(passed) = check(&Peers::from_foreign_clusters(&cached)) {
                return Ok(passed);
            }
        }
        check(&self.peers_of(ids).await?)
    }
}
