//! The reconciler: makes the store match what discovery says we are peered with. For every
//! remote we must exchange NetworkConfigs with, it keeps our NetworkConfig current (local IPAM
//! subnets and the gateway's endpoint and key for that remote), delivers it until the remote
//! decides (directly to a full peer's broker, or through the hub's forwarder for an induced
//! peer), and writes the TunnelEndpoint once both directions are decided. Everything held for
//! a remote that is no longer wanted is torn down. Runs on every wake-up (handlers, discovery
//! changes) and periodically; every step is idempotent, so a restart simply runs it again.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use tracing::Instrument as _;
use trellis_api::ClusterId;
use trellis_api::convert::identity_to_pb;
use trellis_api::model::{NatView, NetworkSpec, TunnelEndpoint};
use trellis_api::pb::discovery::WatchForeignClustersRequest;
use trellis_api::pb::gateway::GetGatewayInfoRequest;
use trellis_api::pb::ipam::{FreeSubnetsPerClusterRequest, GetLocalSubnetsRequest};
use trellis_api::pb::peering::{RelayRequest, RelayWithdrawalRequest, SubmitNetworkConfigRequest};
use trellis_api::pb::types as pb;
use trellis_error::{Error, Result};
use trellis_runtime::Shutdown;
use trellis_runtime::propagation::{resumed_span, traceparent_of};
use trellis_store::{Compare, Op, Txn};

use crate::core::Broker;
use crate::records::{
    Decision, IN_PREFIX, IncomingNc, NOTIFY_PREFIX, OUT_PREFIX, OutgoingNc, PendingNotify,
    TUNNELS_PREFIX, TunnelRecord, decode, encode, in_key, nc_name, out_key, tombstone_key,
    tunnel_key,
};
use trellis_api::peers::{Remote, Route};

/// Shortest and longest wait before retrying after a failed delivery.
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// Runs until `shutdown`.
pub async fn run(broker: Arc<Broker>, resync: Duration, shutdown: Shutdown) {
    tokio::spawn(follow_discovery(broker.clone(), shutdown.clone()));
    let mut retry = RETRY_MIN;
    loop {
        let wait = match pass(&broker).await {
            Ok(true) => {
                retry = RETRY_MIN;
                resync
            }
            Ok(false) => {
                let wait = retry;
                retry = (retry * 2).min(RETRY_MAX);
                wait
            }
            Err(err) => {
                tracing::warn!(error = %err, "reconciliation failed; retrying");
                let wait = retry;
                retry = (retry * 2).min(RETRY_MAX);
                wait
            }
        };
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = broker.wake.notified() => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Wakes the reconciler on every change of the local ForeignClusters. The stream is only a
/// trigger: each pass re-reads the full listing, so a missed event costs at most a resync.
async fn follow_discovery(broker: Arc<Broker>, shutdown: Shutdown) {
    let mut backoff = RETRY_MIN;
    loop {
        let stream = broker
            .clients()
            .discovery()
            .watch_foreign_clusters(WatchForeignClustersRequest {
                start_revision: 0,
                kind: 0,
            })
            .await;
        match stream {
            Ok(stream) => {
                backoff = RETRY_MIN;
                let mut stream = stream.into_inner();
                loop {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        event = stream.next() => match event {
                            Some(Ok(_)) => broker.wake(),
                            Some(Err(status)) => {
                                tracing::debug!(error = %status, "foreign cluster watch ended");
                                break;
                            }
                            None => break,
                        },
                    }
                }
            }
            Err(status) => tracing::debug!(error = %status, "cannot watch foreign clusters yet"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// The remotes we hold any state for (NetworkConfigs or a TunnelEndpoint).
async fn held(broker: &Broker) -> Result<BTreeSet<ClusterId>> {
    let mut held = BTreeSet::new();
    for prefix in [OUT_PREFIX, IN_PREFIX, TUNNELS_PREFIX] {
        for kv in broker.store().list(prefix).await?.kvs {
            if let Some(id) = kv
                .key
                .strip_prefix(prefix)
                .and_then(|id| ClusterId::parse("key", id).ok())
            {
                held.insert(id);
            }
        }
    }
    Ok(held)
}

/// One reconciliation. `Ok(false)` when something must be retried soon.
pub async fn pass(broker: &Broker) -> Result<bool> {
    // What we hold is read before who we peer with: a NetworkConfig received meanwhile was
    // checked against a newer discovery listing than ours and must not look unwanted.
    let held = held(broker).await?;
    let peers = broker.peers().await?;
    let mut settled = true;

    for kv in broker.store().list(NOTIFY_PREFIX).await?.kvs {
        let pending: PendingNotify = decode(&kv.key, &kv.value)?;
        settled &= broker.deliver_notify(&pending).await;
    }

    if !peers.desired.is_empty() {
        let subnets = broker
            .clients()
            .ipam()
            .get_local_subnets(GetLocalSubnetsRequest {})
            .await
            .map_err(|s| Error::from(s).context("reading the local subnets"))?
            .into_inner();
        for remote in peers.desired.values() {
            if let Err(err) =
                ensure(broker, remote, &subnets.pod_cidr, &subnets.external_cidr).await
            {
                tracing::warn!(remote.id = %remote.identity.id, error = %err, "network config exchange incomplete");
                settled = false;
            }
        }
    }

    let unwanted: Vec<&ClusterId> = held
        .iter()
        .filter(|id| !peers.desired.contains_key(*id))
        .collect();
    if !unwanted.is_empty() {
        // Tearing down is not undone by a later pass (the remote does not re-send what we
        // already decided on), so confirm with a fresh listing first.
        let fresh = broker.peers().await?;
        for id in unwanted
            .into_iter()
            .filter(|id| !fresh.desired.contains_key(*id))
        {
            if let Err(err) = teardown(broker, id, "PeeringGone").await {
                tracing::warn!(remote.id = %id, error = %err, "teardown incomplete");
                settled = false;
            }
        }
    }
    Ok(settled)
}

/// Our spec for `remote`: the local CIDRs and the gateway's endpoint and key for that peer.
async fn local_spec(
    broker: &Broker,
    remote: &ClusterId,
    pod: &str,
    external: &str,
) -> Result<NetworkSpec> {
    let info = broker
        .clients()
        .gateway()
        .get_gateway_info(GetGatewayInfoRequest {
            cluster_id: remote.to_string(),
        })
        .await
        .map_err(|s| Error::from(s).context("asking the gateway for its endpoint"))?
        .into_inner();
    let wire = pb::NetworkConfigSpec {
        pod_cidr: pod.to_owned(),
        external_cidr: external.to_owned(),
        endpoint: info.endpoint,
        public_key: info.public_key,
    };
    NetworkSpec::from_proto("local", Some(&wire)).map_err(|e| {
        Error::Internal(format!(
            "the local IPAM or gateway answered unusable parameters: {e}"
        ))
    })
}

/// The decision in a status, when the receiver has made one.
pub fn decision_from_status(
    spec: &NetworkSpec,
    status: Option<&pb::NetworkConfigStatus>,
) -> Result<Option<Decision>> {
    let Some(status) = status else {
        return Ok(None);
    };
    match pb::NetworkConfigState::try_from(status.state) {
        Ok(pb::NetworkConfigState::Processed) => Ok(Some(Decision::Processed {
            view: NatView::for_spec("status", spec, status)?,
            observed_generation: status.observed_generation,
        })),
        Ok(pb::NetworkConfigState::Rejected) => Ok(Some(Decision::Rejected {
            message: status.message.clone(),
            observed_generation: status.observed_generation,
        })),
        _ => Ok(None),
    }
}

/// Keeps the exchange with `remote` going. While it is unfinished (no decision on our
/// NetworkConfig, or no TunnelEndpoint yet) the work runs in the exchange's trace, resumed
/// from the stored traceparent, so one peering setup is one trace across passes, processes
/// and clusters; settled exchanges add nothing to it on later resyncs.
async fn ensure(broker: &Broker, remote: &Remote, pod: &str, external: &str) -> Result<()> {
    let id = &remote.identity.id;
    let key = out_key(id);
    let existing = match broker.store().get(&key).await? {
        Some(kv) => Some((decode::<OutgoingNc>(&key, &kv.value)?, kv.mod_revision)),
        None => None,
    };
    let unfinished = match &existing {
        Some((out, _)) => {
            out.current_decision().is_none() || broker.store().get(&tunnel_key(id)).await?.is_none()
        }
        None => true,
    };
    let span = if unfinished {
        let stored = existing.as_ref().and_then(|(o, _)| o.trace.as_deref());
        let root = resumed_span("network config exchange", stored);
        tracing::info_span!(parent: &root, "exchange", remote.id = %id, remote.via = ?remote.via().map(|v| v.id.as_str()))
    } else {
        tracing::Span::none()
    };
    exchange(broker, remote, pod, external, existing)
        .instrument(span)
        .await
}

async fn exchange(
    broker: &Broker,
    remote: &Remote,
    pod: &str,
    external: &str,
    existing: Option<(OutgoingNc, i64)>,
) -> Result<()> {
    let id = &remote.identity.id;
    let key = out_key(id);
    let spec = local_spec(broker, id, pod, external).await?;
    let forwarder = match &remote.route {
        Route::Direct { .. } => None,
        Route::Relayed { forwarder, .. } => Some(forwarder.clone()),
    };
    let via = remote.via().cloned();
    let out = match existing {
        Some((out, _)) if out.spec == spec && out.via == via && out.forwarder == forwarder => out,
        previous => {
            let generation = previous.as_ref().map_or(0, |(o, _)| o.generation) + 1;
            let trace = previous
                .as_ref()
                .and_then(|(o, _)| o.trace.clone())
                .or_else(|| traceparent_of(&tracing::Span::current()));
            let out = OutgoingNc {
                trace,
                remote: remote.identity.clone(),
                via,
                forwarder,
                spec,
                generation,
                decision: None,
            };
            let revision = previous.map_or(0, |(_, r)| r);
            let committed = broker
                .store()
                .txn(Txn {
                    compares: vec![Compare::ModRevision {
                        key: key.clone(),
                        revision,
                    }],
                    success: vec![Op::Put {
                        key: key.clone(),
                        value: encode(&out)?,
                        lease: None,
                    }],
                    failure: vec![],
                })
                .await?;
            if !committed.succeeded {
                return Err(Error::Aborted(
                    "our network config changed concurrently".into(),
                ));
            }
            out
        }
    };

    if out.current_decision().is_none() {
        deliver(broker, remote, &out).await?;
    }
    write_tunnel(broker, id).await
}

async fn deliver(broker: &Broker, remote: &Remote, out: &OutgoingNc) -> Result<()> {
    let id = &remote.identity.id;
    let nc = pb::NetworkConfig {
        name: nc_name(&broker.identity().id, id),
        origin: Some(identity_to_pb(broker.identity())),
        destination: Some(identity_to_pb(&remote.identity)),
        via: out.via.as_ref().map(identity_to_pb),
        spec: Some(out.spec.to_proto()),
        status: None,
        generation: out.generation,
        update_time: None,
    };
    let status = match &remote.route {
        Route::Direct { broker: address } => {
            broker
                .clients()
                .broker(address, id)?
                .submit_network_config(SubmitNetworkConfigRequest {
                    network_config: Some(nc),
                })
                .await
                .map_err(|s| {
                    Error::from(s).context(format!("submitting our network config to {id}"))
                })?
                .into_inner()
                .status
        }
        Route::Relayed { forwarder, hub } => {
            broker
                .clients()
                .forwarder(forwarder, &hub.id)?
                .relay(RelayRequest {
                    network_config: Some(nc),
                })
                .await
                .map_err(|s| {
                    Error::from(s).context(format!(
                        "relaying our network config to {id} through {}",
                        hub.id
                    ))
                })?
                .into_inner()
                .status
        }
    };
    if let Some(decision) = decision_from_status(&out.spec, status.as_ref())? {
        broker.decided(id, decision).await?;
    }
    Ok(())
}

/// Writes (or updates) the TunnelEndpoint once both directions are decided for the same route.
async fn write_tunnel(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let (Some(out_kv), Some(in_kv)) = (
        store.get(&out_key(id)).await?,
        store.get(&in_key(id)).await?,
    ) else {
        return Ok(());
    };
    let out: OutgoingNc = decode(&out_key(id), &out_kv.value)?;
    let incoming: IncomingNc = decode(&in_key(id), &in_kv.value)?;
    let (Some(theirs_of_us), Some(ours_of_them)) = (
        out.current_decision().and_then(Decision::view),
        incoming.decision.view(),
    ) else {
        return Ok(());
    };
    if incoming.via != out.via {
        // The two directions travelled different routes (a hub change in flight); wait until
        // both NetworkConfigs agree.
        return Ok(());
    }
    let key = tunnel_key(id);
    let existing = match store.get(&key).await? {
        Some(kv) => Some((decode::<TunnelRecord>(&key, &kv.value)?, kv.mod_revision)),
        None => None,
    };
    let generation = existing.as_ref().map_or(0, |(t, _)| t.generation) + 1;
    let tunnel = TunnelEndpoint::merge(
        incoming.remote.clone(),
        out.via.clone(),
        (&out.spec, theirs_of_us),
        (&incoming.spec, ours_of_them),
        generation,
    );
    if let Some((current, _)) = &existing
        && (TunnelEndpoint {
            generation: current.generation,
            ..tunnel.clone()
        }) == *current
    {
        return Ok(());
    }
    let committed = store
        .txn(Txn {
            compares: vec![Compare::ModRevision {
                key: key.clone(),
                revision: existing.map_or(0, |(_, r)| r),
            }],
            success: vec![Op::Put {
                key,
                value: encode(&tunnel)?,
                lease: None,
            }],
            failure: vec![],
        })
        .await?;
    if committed.succeeded {
        tracing::info!(
            remote.id = %id,
            kind = ?tunnel.kind,
            remote_pod_cidr_nat = %tunnel.remote_nat.pod_cidr_nat,
            local_pod_cidr_nat = %tunnel.local_nat.pod_cidr_nat,
            generation,
            "tunnel endpoint ready"
        );
    }
    Ok(())
}

/// Removes everything held for `id`: withdraws our induced NetworkConfig through its hub (best
/// effort: the hub may be the reason it is gone), deletes both NetworkConfigs and the
/// TunnelEndpoint (leaving a tombstone for watchers), and frees the IPAM mapping.
pub async fn teardown(broker: &Broker, id: &ClusterId, reason: &str) -> Result<()> {
    let store = broker.store();
    if let Some(kv) = store.get(&out_key(id)).await? {
        let out: OutgoingNc = decode(&out_key(id), &kv.value)?;
        if let (Some(hub), Some(forwarder)) = (&out.via, &out.forwarder) {
            let request = RelayWithdrawalRequest {
                network_config: Some(pb::NetworkConfigRef {
                    name: nc_name(&broker.identity().id, id),
                    origin: Some(identity_to_pb(broker.identity())),
                    destination: Some(identity_to_pb(&out.remote)),
                    via: Some(identity_to_pb(hub)),
                }),
                reason: reason.to_owned(),
            };
            if let Err(err) = async {
                broker
                    .clients()
                    .forwarder(forwarder, &hub.id)?
                    .relay_withdrawal(request)
                    .await
                    .map_err(Error::from)
            }
            .await
            {
                tracing::info!(remote.id = %id, hub.id = %hub.id, error = %err, "could not withdraw through the hub; the remote withdraws on its own");
            }
        }
    }
    remove_state(broker, id).await?;
    broker
        .clients()
        .ipam()
        .free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
            cluster_id: id.to_string(),
        })
        .await
        .map_err(|s| Error::from(s).context("freeing the remote's IPAM mapping"))?;
    tracing::info!(remote.id = %id, reason, "tore down the network configs and tunnel");
    Ok(())
}

/// Deletes both NetworkConfigs and the TunnelEndpoint of `id` in one transaction.
pub async fn remove_state(broker: &Broker, id: &ClusterId) -> Result<()> {
    let store = broker.store();
    let mut ops = vec![
        Op::Delete { key: out_key(id) },
        Op::Delete { key: in_key(id) },
    ];
    if let Some(kv) = store.get(&tunnel_key(id)).await? {
        ops.push(Op::Delete {
            key: tunnel_key(id),
        });
        ops.push(Op::Put {
            key: tombstone_key(id),
            value: kv.value,
            lease: None,
        });
    }
    store
        .txn(Txn {
            compares: vec![],
            success: ops,
            failure: vec![],
        })
        .await?;
    Ok(())
}

/// The remote withdrew its NetworkConfig towards us: forget it and the tunnel built on it.
pub async fn withdrawn(broker: &Broker, id: &ClusterId) -> Result<bool> {
    let store = broker.store();
    let existed = store.get(&in_key(id)).await?.is_some();
    let mut ops = vec![Op::Delete { key: in_key(id) }];
    if let Some(kv) = store.get(&tunnel_key(id)).await? {
        ops.push(Op::Delete {
            key: tunnel_key(id),
        });
        ops.push(Op::Put {
            key: tombstone_key(id),
            value: kv.value,
            lease: None,
        });
    }
    store
        .txn(Txn {
            compares: vec![],
            success: ops,
            failure: vec![],
        })
        .await?;
    broker.wake();
    Ok(existed)
}
