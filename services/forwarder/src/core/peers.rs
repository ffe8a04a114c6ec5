//! The clusters at a relay's two ends, as discovery knows them: what every attempt needs
//! before it can call anyone. Relays are authorized here too, since a relay is allowed exactly
//! when both ends are routable full peers.

use trellis_api::ClusterId;
use trellis_api::peers::is_routable_full_peer;
use trellis_error::Result;
use trellis_runtime::foreign_clusters;

use super::Forwarder;
use crate::ends::Ends;

impl Forwarder {
    /// The ends `ids` of a relay (clusters that are not full peers are absent). A record from
    /// the watch-fed copy is used when it lets the cluster be relayed for; any other is read
    /// from discovery, so a stale copy never refuses a relay.
    pub(super) async fn peers(&self, ids: &[&ClusterId]) -> Result<Ends> {
        Ok(self
            .foreign_clusters
            .lookup_with(&self.discovery, ids, is_routable_full_peer, Ends::entry)
            .await?
            .into_iter()
            .collect())
    }

    /// [`Self::peers`] read from discovery: for withdrawals, which must know whether the
    /// destination is gone.
    pub(super) async fn fresh_peers(&self, ids: &[&ClusterId]) -> Result<Ends> {
        Ok(foreign_clusters::read(&self.discovery, ids)
            .await?
            .iter()
            .map(Ends::entry)
            .collect())
    }

    /// Both ends must be full peers of this hub with networking: exactly the clusters this
    /// hub advertises to each other in its Neighborhoods.
    pub(super) async fn authorize(
        &self,
        origin: &ClusterId,
        destination: &ClusterId,
    ) -> Result<Ends> {
        let peers = self.peers(&[origin, destination]).await?;
        peers.broker_of(origin, "origin")?;
        peers.broker_of(destination, "destination")?;
        Ok(peers)
    }
}
