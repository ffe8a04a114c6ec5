//! The forwarder's port to the brokers at a relay's two ends, in the forwarder's terms: a
//! relay's NetworkConfig submitted to its destination, the destination's status reported to
//! its origin, a withdrawal told to the destination. The requests are built here, naming this
//! hub as the one they come `via`.
//!
//! Channels are cached per (address, cluster) and bounded by the delivery timeouts; with
//! mutual TLS (ADR 0014) each verifies the broker against the pinned CA of the cluster it is
//! expected to be. Submissions to one broker are batched (ADR 0012), so a hub relaying for
//! many leaves sends one `SubmitNetworkConfigBatch` where it would send many calls.

use std::collections::HashMap;
use std::sync::Mutex;

use trellis_api::convert::identity_to_pb;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{
    ReportNetworkConfigStatusRequest, SubmitNetworkConfigRequest, SubmitNetworkConfigResponse,
    WithdrawNetworkConfigRequest,
};
use trellis_api::pb::types as pb;
use trellis_api::peers::network_config_name;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};
use trellis_runtime::batch::{self, Batchers, Submitter};
use trellis_runtime::client::{Timeouts, TracedChannel};
use trellis_runtime::metrics::Metrics;
use trellis_runtime::tls::{PeerTls, cluster_channel};

use crate::records::{RelayRecord, RelayedStatus};

/// The brokers of the clusters this hub relays between.
#[derive(Debug)]
pub(crate) struct Brokers {
    /// This hub: what every NetworkConfig it passes on names as `via`.
    via: ClusterIdentity,
    /// Mutual TLS towards other clusters; plaintext when absent.
    tls: Option<PeerTls>,
    timeouts: Timeouts,
    /// The forwarder's registry: the channels' calls count there (`grpc_client_*`).
    metrics: Metrics,
    /// Channels by (address, cluster).
    channels: Mutex<HashMap<(String, String), TracedChannel>>,
    submitters: Batchers<SubmitNetworkConfigRequest, SubmitNetworkConfigResponse>,
}

impl Brokers {
    pub(crate) fn new(
        via: ClusterIdentity,
        tls: Option<PeerTls>,
        timeouts: Timeouts,
        metrics: &Metrics,
    ) -> Self {
        Self {
            via,
            tls,
            timeouts,
            metrics: metrics.clone(),
            channels: Mutex::new(HashMap::new()),
            submitters: Batchers::default(),
        }
    }

    /// Submits `relay`'s NetworkConfig to the destination's broker at `broker`, batched with
    /// the other deliveries to it. Returns the status the destination answered with, if any.
    pub(crate) async fn submit(
        &self,
        broker: &str,
        relay: &RelayRecord,
    ) -> Result<Option<pb::NetworkConfigStatus>> {
        let answer = self
            .submitter(broker, &relay.destination.id)?
            .call(SubmitNetworkConfigRequest {
                network_config: Some(pb::NetworkConfig {
                    name: network_config_name(&relay.origin.id, &relay.destination.id),
                    origin: Some(identity_to_pb(&relay.origin)),
                    destination: Some(identity_to_pb(&relay.destination)),
                    via: Some(identity_to_pb(&self.via)),
                    spec: Some(relay.spec.to_proto()),
                    status: None,
                    generation: relay.generation,
                    update_time: None,
                    held_generation: relay.held_generation,
                }),
            })
            .await
            .map_err(Error::from)?;
        Ok(answer.status)
    }

    /// Reports the destination's `status` of the NetworkConfig (origin → destination) to the
    /// origin's broker at `broker`.
    pub(crate) async fn report_status(
        &self,
        broker: &str,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        status: &RelayedStatus,
    ) -> Result<()> {
        self.client(broker, &origin.id)?
            .report_network_config_status(ReportNetworkConfigStatusRequest {
                network_config: Some(self.reference(origin, destination)),
                status: Some(status.to_pb()),
            })
            .await
            .map_err(Error::from)?;
        Ok(())
    }

    /// Tells the destination's broker at `broker` that the origin withdrew its NetworkConfig.
    pub(crate) async fn withdraw(
        &self,
        broker: &str,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
        reason: &str,
    ) -> Result<()> {
        self.client(broker, &destination.id)?
            .withdraw_network_config(WithdrawNetworkConfigRequest {
                network_config: Some(self.reference(origin, destination)),
                reason: reason.to_owned(),
            })
            .await
            .map_err(Error::from)?;
        Ok(())
    }

    fn reference(
        &self,
        origin: &ClusterIdentity,
        destination: &ClusterIdentity,
    ) -> pb::NetworkConfigRef {
        pb::NetworkConfigRef {
            name: network_config_name(&origin.id, &destination.id),
            origin: Some(identity_to_pb(origin)),
            destination: Some(identity_to_pb(destination)),
            via: Some(identity_to_pb(&self.via)),
        }
    }

    /// Cluster `expected`'s broker at `address` (over mutual TLS when on: the server must
    /// chain to `expected`'s pinned CA).
    fn client(&self, address: &str, expected: &ClusterId) -> Result<BrokerClient<TracedChannel>> {
        Ok(BrokerClient::new(self.channel(address, expected)?))
    }

    /// [`Self::client`]'s `SubmitNetworkConfig`, batched with our other deliveries to it.
    fn submitter(&self, address: &str, expected: &ClusterId) -> Result<Submitter> {
        self.submitters
            .get_or_make((address.to_owned(), expected.to_string()), || {
                Ok(batch::submitter(self.channel(address, expected)?))
            })
    }

    fn channel(&self, address: &str, expected: &ClusterId) -> Result<TracedChannel> {
        let key = (address.to_owned(), expected.to_string());
        if let Ok(cache) = self.channels.lock()
            && let Some(found) = cache.get(&key)
        {
            return Ok(found.clone());
        }
        let created = cluster_channel(
            self.tls.as_ref(),
            "broker",
            address,
            expected.as_str(),
            self.timeouts,
            &self.metrics,
        )?;
        if let Ok(mut cache) = self.channels.lock() {
            cache.insert(key, created.clone());
        }
        Ok(created)
    }
}
