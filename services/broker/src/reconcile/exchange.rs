//! The NetworkConfig exchange with one remote: our NetworkConfig kept current (the local
//! subnets and the gateway's endpoint and key for that remote, a new generation whenever they
//! change), delivered until the remote decides (submitted to a full peer's broker or relayed
//! through the hub's forwarder), and then the TunnelEndpoint ([`super::tunnel`]).

use std::collections::BTreeSet;

use futures::StreamExt as _;
use tracing::Instrument as _;
use trellis_api::ClusterId;
use trellis_api::convert::identity_to_pb;
use trellis_api::model::{NatView, NetworkSpec};
use trellis_api::pb::types as pb;
use trellis_api::peers::{Remote, Route};
use trellis_error::{Error, Result};
use trellis_runtime::propagation::{resumed_span, traceparent_of};
use trellis_store::{Compare, Op, Txn};

use super::tunnel::write_tunnel;
use crate::core::Broker;
use crate::records::{Decision, OutgoingNc, decode, encode, nc_name, out_key, tunnel_key};

/// Remotes worked on at the same time within one pass: deliveries wait on other clusters,
/// so one slow remote must not hold up the others.
const CONCURRENCY: usize = 16;

/// The gateway's key and address, the same for every remote: a settled exchange whose
/// NetworkConfig still carries them needs no per-remote question on a periodic pass.
pub(super) struct GatewayBasics {
    public_key: String,
    /// The host of the gateway's endpoint (an IP or a DNS name; the port is per remote).
    endpoint_host: Option<trellis_api::model::EndpointHost>,
}

pub(super) async fn gateway_basics(broker: &Broker) -> Result<GatewayBasics> {
    let info = broker
        .ports()
        .gateway()
        .info(None)
        .await
        .map_err(|e| e.context("asking the gateway for its endpoint"))?;
    if let Ok(key) = trellis_api::model::WgKey::parse("public_key", &info.public_key) {
        broker.note_own_key(key);
    }
    Ok(GatewayBasics {
        public_key: info.public_key,
        endpoint_host: trellis_api::model::Endpoint::parse("endpoint", &info.endpoint)
            .ok()
            .map(|e| e.host().clone()),
    })
}

/// Runs [`ensure`] for `remotes`, [`CONCURRENCY`] at a time; returns those that failed.
pub(super) async fn ensure_all(
    broker: &Broker,
    remotes: Vec<&Remote>,
    basics: Option<&GatewayBasics>,
) -> Result<BTreeSet<ClusterId>> {
    let mut failed = BTreeSet::new();
    if remotes.is_empty() {
        return Ok(failed);
    }
    let subnets = broker.ports().ipam().local_subnets().await?;
    let (pod, external) = (&subnets.pod_cidr, &subnets.external_cidr);
    // Each future is made when a slot frees. Made up front, every pass over 254 remotes held
    // 254 of them: 176 MiB of the 255-cluster in-process lab's peak heap (issue 17).
    let mut waiting = remotes.into_iter();
    let mut running = futures::stream::FuturesUnordered::new();
    for remote in waiting.by_ref().take(CONCURRENCY) {
        running.push(ensure_one(broker, remote, pod, external, basics));
    }
    while let Some(result) = running.next().await {
        if let Err(id) = result {
            failed.insert(id);
        }
        if let Some(remote) = waiting.next() {
            running.push(ensure_one(broker, remote, pod, external, basics));
        }
    }
    Ok(failed)
}

/// [`ensure`], its failure logged and reduced to the remote's ID.
async fn ensure_one(
    broker: &Broker,
    remote: &Remote,
    pod: &str,
    external: &str,
    basics: Option<&GatewayBasics>,
) -> std::result::Result<(), ClusterId> {
    ensure(broker, remote, pod, external, basics)
        .await
        .map_err(|err| {
            tracing::warn!(remote.id = %remote.identity.id, error = %err, "network config exchange incomplete");
            remote.identity.id.clone()
        })
}

/// Our spec for `remote`: the local CIDRs and the gateway's endpoint and key for that peer.
async fn local_spec(
    broker: &Broker,
    remote: &ClusterId,
    pod: &str,
    external: &str,
) -> Result<NetworkSpec> {
    let info = broker
        .ports()
        .gateway()
        .info(Some(remote))
        .await
        .map_err(|e| e.context("asking the gateway for its endpoint"))?;
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
///
/// With `basics` (a periodic pass), a settled exchange whose NetworkConfig still carries the
/// gateway's key and address is left alone: anything that changes it for one remote (its new
/// NetworkConfig, its decision, discovery) wakes a pass for that remote.
async fn ensure(
    broker: &Broker,
    remote: &Remote,
    pod: &str,
    external: &str,
    basics: Option<&GatewayBasics>,
) -> Result<()> {
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
    if let (false, Some((out, _)), Some(basics)) = (unfinished, &existing, basics) {
        let same_gateway = out.spec.public_key.to_string() == basics.public_key
            && basics.endpoint_host.as_ref() == Some(out.spec.endpoint.host());
        let forwarder = match &remote.route {
            Route::Direct { .. } => None,
            Route::Relayed { forwarder, .. } => Some(forwarder.as_str()),
        };
        let same_route = out.via.as_ref() == remote.via()
            && out.forwarder.as_deref() == forwarder
            && out.spec.pod_cidr.to_string() == pod
            && out.spec.external_cidr.to_string() == external;
        if same_gateway && same_route {
            return Ok(());
        }
    }
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
            let generation = next_generation(previous.as_ref().map(|(o, _)| o.generation));
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
                receiver_generation: 0,
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

/// The generation of a new version of our NC: above the previous one and at least the wall
/// clock in milliseconds. A new incarnation (after a teardown, a withdrawal or a rebuilt store,
/// where the previous generation is gone) is thus above every generation a receiver or a hub's
/// forwarder still holds from an earlier one, as long as the clock does not step back by more
/// than the time between the two incarnations (ADR 0012).
pub fn next_generation(previous: Option<i64>) -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2));
    previous.map_or(1, |p| p.saturating_add(1)).max(now)
}

async fn deliver(broker: &Broker, remote: &Remote, out: &OutgoingNc) -> Result<()> {
    let id = &remote.identity.id;
    // Tells the remote we hold its NC, so that ours does not make it send its own again.
    let held_generation = broker.incoming(id).await?.map_or(0, |i| i.generation);
    let nc = pb::NetworkConfig {
        name: nc_name(&broker.identity().id, id),
        origin: Some(identity_to_pb(broker.identity())),
        destination: Some(identity_to_pb(&remote.identity)),
        via: out.via.as_ref().map(identity_to_pb),
        spec: Some(out.spec.to_proto()),
        status: None,
        generation: out.generation,
        update_time: None,
        held_generation,
    };
    let status = match &remote.route {
        Route::Direct { broker: address } => broker.ports().peers().submit(address, id, nc).await?,
        Route::Relayed { forwarder, hub } => {
            broker
                .ports()
                .peers()
                .relay(forwarder, &hub.id, id, nc)
                .await?
        }
    };
    if let Some(decision) = decision_from_status(&out.spec, status.as_ref())? {
        let receiver_generation = status.as_ref().map_or(0, |s| s.receiver_generation);
        broker.decided(id, decision, receiver_generation).await?;
    } else if let Some(waiting) = status
        .as_ref()
        .filter(|s| s.state == pb::NetworkConfigState::Pending as i32 && !s.message.is_empty())
    {
        // The remote cannot decide yet (no free range): an unfinished exchange, retried with
        // this remote's backoff until it decides.
        return Err(Error::Unavailable(format!(
            "{id} has not decided on our network config yet: {}",
            waiting.message
        )));
    }
    Ok(())
}
