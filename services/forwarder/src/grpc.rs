//! The `trellis.peering.v1.Forwarder` gRPC handlers: validate into domain values (errors name
//! the field), call [`Forwarder`], map back.

use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument as _;

use tonic::{Request, Response, Status};
use trellis_api::convert::{generations_from_pb, identity_from_pb, identity_to_pb, timestamp};
use trellis_api::model::NetworkSpec;
use trellis_api::pb::peering::forwarder_server::Forwarder as ForwarderApi;
use trellis_api::pb::peering::{self as pb, RelayState};
use trellis_api::pb::types;
use trellis_api::peers::network_config_name;
use trellis_api::{ClusterId, ClusterIdentity};
use trellis_error::{Error, Result};

use trellis_runtime::peer::{Authz, PeerMethods};
use trellis_runtime::tls::PeerIdentity;
use trellis_runtime::{batch, telemetry};

use crate::core::relay::OriginWait;
use crate::core::{Forwarder, Passthrough};
use crate::records::{RelayRecord, RelayedStatus, State};

/// The gRPC face of one [`Forwarder`].
#[derive(Debug, Clone)]
pub struct ForwarderService {
    core: Arc<Forwarder>,
    authz: Authz,
}

/// How long an item of a RelayBatch may take before it is answered PENDING (see
/// [`ForwarderApi::relay_batch`]): a destination that answers at all answers well within it.
const BATCH_ITEM_WAIT: Duration = Duration::from_secs(1);

/// The methods the peer listener serves (ADR 0014).
pub const PEER_METHODS: PeerMethods = PeerMethods {
    authenticated: &[
        "/trellis.peering.v1.Forwarder/Relay",
        "/trellis.peering.v1.Forwarder/RelayBatch",
        "/trellis.peering.v1.Forwarder/RelayStatus",
        "/trellis.peering.v1.Forwarder/RelayWithdrawal",
    ],
    anonymous: &[],
};

impl ForwarderService {
    /// Without mutual TLS: the origin a request claims is trusted.
    pub fn new(core: Arc<Forwarder>) -> Self {
        Self::with_authz(core, Authz::off())
    }

    /// With `authz` checking the caller's certificate against the relay's ends (ADR 0014).
    pub fn with_authz(core: Arc<Forwarder>, authz: Authz) -> Self {
        Self { core, authz }
    }

    /// The ends of a NetworkConfig reference (status reports, withdrawals) relayed by us.
    fn pair_of_ref(
        &self,
        reference: Option<&types::NetworkConfigRef>,
    ) -> Result<(ClusterIdentity, ClusterIdentity)> {
        let reference = reference.ok_or_else(|| Error::invalid("network_config", "is required"))?;
        self.pair(
            &reference.name,
            reference.origin.as_ref(),
            reference.destination.as_ref(),
            reference.via.as_ref(),
        )
    }

    /// Origin, destination and `via` of a NetworkConfig (reference) relayed by us, the
    /// request's `network_config`. Nothing is formatted unless a field is wrong: a hub checks
    /// this for every NetworkConfig it relays.
    fn pair(
        &self,
        name: &str,
        origin: Option<&types::ClusterIdentity>,
        destination: Option<&types::ClusterIdentity>,
        via: Option<&types::ClusterIdentity>,
    ) -> Result<(ClusterIdentity, ClusterIdentity)> {
        let origin = identity_from_pb("network_config.origin", origin)?;
        let destination = identity_from_pb("network_config.destination", destination)?;
        let via = identity_from_pb("network_config.via", via)?;
        let us = &self.core.identity().id;
        if via.id != *us {
            return Err(Error::invalid(
                "network_config.via.cluster_id",
                format!("is {}, not this hub ({us})", via.id),
            ));
        }
        if origin.id == destination.id {
            return Err(Error::invalid(
                "network_config.destination.cluster_id",
                "equals the origin",
            ));
        }
        if origin.id == *us || destination.id == *us {
            return Err(Error::invalid(
                "network_config.origin.cluster_id",
                "this hub cannot be an end of a relay",
            ));
        }
        let expected = network_config_name(&origin.id, &destination.id);
        if name != expected {
            return Err(Error::invalid(
                "network_config.name",
                format!("is {name:?}; expected {expected:?}"),
            ));
        }
        Ok((origin, destination))
    }

    /// One Relay request, alone or as an item of a batch: `peer` is the caller's verified
    /// identity, `rpc` the method it called (for errors).
    async fn relay_one(
        &self,
        peer: Option<&PeerIdentity>,
        rpc: &str,
        request: pb::RelayRequest,
        wait: &OriginWait,
    ) -> Result<pb::RelayResponse, Status> {
        let nc = request
            .network_config
            .ok_or_else(|| Error::invalid("network_config", "is required"))?;
        let (origin, destination) = self.pair(
            &nc.name,
            nc.origin.as_ref(),
            nc.destination.as_ref(),
            nc.via.as_ref(),
        )?;
        // Only the origin relays its own NetworkConfig.
        self.authz
            .require(peer, rpc, "network_config.origin", origin.id.as_str())?;
        let (generation, held_generation) = generations_from_pb(&nc)?;
        let spec = NetworkSpec::from_proto("network_config.spec", nc.spec.as_ref())?;
        let (state, status, _) = self
            .core
            .relay_answering(
                Passthrough {
                    origin,
                    destination,
                    spec,
                    generation,
                    held_generation,
                },
                wait,
            )
            .await?;
        let state = state_to_pb(state);
        Ok(pb::RelayResponse {
            state: state.into(),
            status: status.as_ref().map(RelayedStatus::to_pb),
        })
    }
}

fn state_to_pb(state: State) -> RelayState {
    match state {
        State::Pending => RelayState::Pending,
        State::Delivered => RelayState::Delivered,
        State::StatusPending => RelayState::StatusPending,
        State::Failed => RelayState::Failed,
        State::Withdrawing => RelayState::Withdrawing,
        State::Completed => RelayState::Completed,
    }
}

fn record_to_pb(r: &RelayRecord, hub: &ClusterIdentity) -> pb::RelayRecord {
    pb::RelayRecord {
        network_config: Some(types::NetworkConfigRef {
            name: network_config_name(&r.origin.id, &r.destination.id),
            origin: Some(identity_to_pb(&r.origin)),
            destination: Some(identity_to_pb(&r.destination)),
            via: Some(identity_to_pb(hub)),
        }),
        generation: r.generation,
        state: state_to_pb(r.state).into(),
        status: r.status.as_ref().map(RelayedStatus::to_pb),
        attempts: r.attempts,
        last_error: r.last_error.clone(),
        create_time: Some(timestamp(r.created_nanos)),
        update_time: Some(timestamp(r.updated_nanos)),
        next_attempt_time: (r.next_attempt_nanos > 0).then(|| timestamp(r.next_attempt_nanos)),
    }
}

#[tonic::async_trait]
impl ForwarderApi for ForwarderService {
    async fn relay(
        &self,
        request: Request<pb::RelayRequest>,
    ) -> Result<Response<pb::RelayResponse>, Status> {
        let peer = self.authz.peer(&request, "Relay")?;
        self.relay_one(
            peer.as_ref(),
            "Relay",
            request.into_inner(),
            &OriginWait::default(),
        )
        .await
        .map(Response::new)
    }

    async fn relay_batch(
        &self,
        request: Request<pb::RelayBatchRequest>,
    ) -> Result<Response<pb::RelayBatchResponse>, Status> {
        const RPC: &str = "RelayBatch";
        let peer = self.authz.peer(&request, RPC)?;
        let requests = request.into_inner().requests;
        batch::check_len(requests.len())?;
        let results = batch::serve(requests, |item| {
            let this = self.clone();
            let peer = peer.clone();
            async move {
                // Each item is answered on its own, so that one whose destination is slow
                // does not hold the whole batch (every other relay of the origin) back: past
                // BATCH_ITEM_WAIT it is answered PENDING, as an accepted relay whose status
                // follows through ReportNetworkConfigStatus, and its attempt goes on as a task
                // of its own. Only then: a task per item costs a hub more than the item.
                let wait = Arc::new(OriginWait::default());
                let waiting = wait.clone();
                let core = self.core.clone();
                let mut item = Box::pin(
                    async move { this.relay_one(peer.as_ref(), RPC, item, &waiting).await }
                        .in_current_span(),
                );
                match tokio::time::timeout(BATCH_ITEM_WAIT, &mut item).await {
                    Ok(answered) => answered,
                    Err(_) => match core.stop_waiting(&wait).await? {
                        true => {
                            telemetry::spawn(item);
                            Ok(pb::RelayResponse {
                                state: RelayState::Pending.into(),
                                status: None,
                            })
                        }
                        // The attempt has the status and answers in a moment.
                        false => item.await,
                    },
                }
            }
        })
        .await;
        Ok(Response::new(pb::RelayBatchResponse {
            results: batch::relay_results(results),
        }))
    }

    async fn relay_status(
        &self,
        request: Request<pb::RelayStatusRequest>,
    ) -> Result<Response<pb::RelayStatusResponse>, Status> {
        const RPC: &str = "RelayStatus";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let (origin, destination) = self.pair_of_ref(req.network_config.as_ref())?;
        // Only the destination reports its decision.
        self.authz.require(
            peer.as_ref(),
            RPC,
            "network_config.destination",
            destination.id.as_str(),
        )?;
        let status = req
            .status
            .ok_or_else(|| Error::invalid("status", "is required"))?;
        match types::NetworkConfigState::try_from(status.state) {
            Ok(types::NetworkConfigState::Processed) => {
                // Only the shape can be checked here: the spec's sizes are the origin's.
                for (field, value) in [
                    ("status.pod_cidr_nat", &status.pod_cidr_nat),
                    ("status.external_cidr_nat", &status.external_cidr_nat),
                ] {
                    trellis_api::wire::cidr(field, value)?;
                }
            }
            Ok(types::NetworkConfigState::Rejected) => {}
            _ => {
                return Err(Error::invalid("status.state", "must be PROCESSED or REJECTED").into());
            }
        }
        if status.receiver_generation < 0 {
            return Err(
                Error::invalid("status.receiver_generation", "must not be negative").into(),
            );
        }
        let state = self
            .core
            .relay_status(&origin, &destination, RelayedStatus::from_pb(status))
            .await?;
        let state = state_to_pb(state);
        Ok(Response::new(pb::RelayStatusResponse {
            state: state.into(),
        }))
    }

    async fn relay_withdrawal(
        &self,
        request: Request<pb::RelayWithdrawalRequest>,
    ) -> Result<Response<pb::RelayWithdrawalResponse>, Status> {
        const RPC: &str = "RelayWithdrawal";
        let peer = self.authz.peer(&request, RPC)?;
        let req = request.into_inner();
        let (origin, destination) = self.pair_of_ref(req.network_config.as_ref())?;
        self.authz.require(
            peer.as_ref(),
            RPC,
            "network_config.origin",
            origin.id.as_str(),
        )?;
        let state = self
            .core
            .relay_withdrawal(&origin, &destination, req.reason)
            .await?;
        Ok(Response::new(pb::RelayWithdrawalResponse {
            state: state_to_pb(state).into(),
        }))
    }

    async fn list_relays(
        &self,
        request: Request<pb::ListRelaysRequest>,
    ) -> Result<Response<pb::ListRelaysResponse>, Status> {
        let req = request.into_inner();
        let cluster = (!req.cluster_id.is_empty())
            .then(|| ClusterId::parse("cluster_id", &req.cluster_id))
            .transpose()?;
        let wanted = RelayState::try_from(req.state)
            .map_err(|_| Error::invalid("state", "is not a known relay state"))?;
        let hub = self.core.identity().clone();
        let relays = self
            .core
            .list(cluster.as_ref())
            .await?
            .iter()
            .filter(|r| wanted == RelayState::Unspecified || state_to_pb(r.state) == wanted)
            .map(|r| record_to_pb(r, &hub))
            .collect();
        Ok(Response::new(pb::ListRelaysResponse { relays }))
    }
}
