//! The NetworkConfig exchange with one remote: our NetworkConfig kept current (the local
//! subnets and the gateway's endpoint and key for that remote, a new generation whenever they
//! change), delivered until the remote decides (submitted to a full peer's broker or relayed
//! through the hub's forwarder), and then the TunnelEndpoint ([`super::tunnel`]).

use std::collections::BTreeSet;
use std::time::Duration;

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

/// The gateway's key and address, the same for every remote: a NetworkConfig that still
/// carries them needs no per-remote question (the port the gateway gave that remote stays
/// its own until the remote is torn down) as long as the port stays reserved.
pub(super) struct GatewayBasics {
    public_key: String,
    /// The host of the gateway's endpoint (an IP or a DNS name; the port is per remote).
    endpoint_host: Option<trellis_api::model::EndpointHost>,
    /// How often to ask again for the port of a remote whose exchange is still under way: the
    /// gateway releases a port without a tunnel nobody asked for during its grace period and
    /// renews the reservation only when it is a quarter of that old (ADR 0007), so asking every
    /// quarter keeps at least half of it in hand. A gateway that does not say its grace period
    /// is asked once per resync, as ADR 0007 has it.
    reask: Duration,
    /// Whether the gateway translates what it sends (the stateless wire convention, offered
    /// to every remote alike).
    stateless_wire: bool,
}

impl GatewayBasics {
    /// Whether `spec` still carries the gateway's key, host and offer.
    fn carried_by(&self, spec: &NetworkSpec) -> bool {
        spec.public_key.to_string() == self.public_key
            && self.endpoint_host.as_ref() == Some(spec.endpoint.host())
            && spec.stateless_wire == self.stateless_wire
    }
}

/// The gateway's key and host: read now for a periodic pass (`fresh`), otherwise as read within
/// the last second.
pub(super) async fn gateway_basics(broker: &Broker, fresh: bool) -> Result<GatewayBasics> {
    let info = broker
        .ports()
        .gateway()
        .general(fresh)
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
        reask: reask_period(info.unused_port_grace, broker.resync()),
        stateless_wire: info.stateless_wire,
    })
}

/// [`GatewayBasics::reask`] from the gateway's grace period, if it says one.
fn reask_period(unused_port_grace: Option<Duration>, resync: Duration) -> Duration {
    unused_port_grace.map_or(resync, |grace| grace / 4)
}

/// What kind of pass runs [`ensure_all`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PassKind {
    /// The periodic resync over a whole lane: settled exchanges are taken on trust.
    Periodic,
    /// A pass over remotes something happened to: each gets the whole look.
    Woken,
}

/// Runs [`ensure`] for `remotes`, [`CONCURRENCY`] at a time; returns those that failed.
pub(super) async fn ensure_all(
    broker: &Broker,
    remotes: Vec<&Remote>,
    kind: PassKind,
) -> Result<BTreeSet<ClusterId>> {
    let mut failed = BTreeSet::new();
    if remotes.is_empty() {
        return Ok(failed);
    }
    let basics = gateway_basics(broker, kind == PassKind::Periodic).await?;
    let subnets = broker.ports().ipam().local_subnets().await?;
    let pass = Pass {
        pod: &subnets.pod_cidr,
        external: &subnets.external_cidr,
        basics: &basics,
        kind,
    };
    // Each future is made when a slot frees. Made up front, every pass over 254 remotes held
    // 254 of them: 176 MiB of the 255-cluster in-process lab's peak heap (issue 17).
    let mut waiting = remotes.into_iter();
    let mut running = futures::stream::FuturesUnordered::new();
    for remote in waiting.by_ref().take(CONCURRENCY) {
        running.push(ensure_one(broker, remote, &pass));
    }
    while let Some(result) = running.next().await {
        if let Err(id) = result {
            failed.insert(id);
        }
        if let Some(remote) = waiting.next() {
            running.push(ensure_one(broker, remote, &pass));
        }
    }
    Ok(failed)
}

/// What every remote of one pass shares: the local CIDRs, the gateway's basics, the kind.
struct Pass<'a> {
    pod: &'a str,
    external: &'a str,
    basics: &'a GatewayBasics,
    kind: PassKind,
}

/// [`ensure`], its failure logged and reduced to the remote's ID.
async fn ensure_one(
    broker: &Broker,
    remote: &Remote,
    pass: &Pass<'_>,
) -> std::result::Result<(), ClusterId> {
    ensure(broker, remote, pass)
        .await
        .map_err(|err| {
            tracing::warn!(remote.id = %remote.identity.id, error = %err, "network config exchange incomplete");
            remote.identity.id.clone()
        })
}

/// Our spec for `remote`: the local CIDRs and the gateway's endpoint and key for that peer.
/// Those of `current` (our NetworkConfig to it) are kept while they carry the gateway's key and
/// host and the gateway was asked for this remote lately enough to keep its port reserved
/// ([`GatewayBasics::reask`]); otherwise the gateway is asked. Asking on every
/// look made a leaf's share of an induced mesh about three calls per remote, the most frequent
/// call of the 254-leaf benchmark.
async fn local_spec(
    broker: &Broker,
    remote: &ClusterId,
    pass: &Pass<'_>,
    current: Option<&NetworkSpec>,
) -> Result<NetworkSpec> {
    let gateway = broker.ports().gateway();
    let kept = current.filter(|spec| {
        pass.basics.carried_by(spec) && gateway.asked_within(remote, pass.basics.reask)
    });
    let mut wire = match kept {
        Some(spec) => spec.to_proto(),
        None => {
            let info = gateway
                .info(Some(remote))
                .await
                .map_err(|e| e.context("asking the gateway for its endpoint"))?;
            pb::NetworkConfigSpec {
                endpoint: info.endpoint,
                public_key: info.public_key,
                ..Default::default()
            }
        }
    };
    pass.pod.clone_into(&mut wire.pod_cidr);
    pass.external.clone_into(&mut wire.external_cidr);
    wire.stateless_wire = pass.basics.stateless_wire;
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
/// On a periodic pass, a settled exchange whose NetworkConfig still carries the gateway's key
/// and address is left alone: anything that changes it for one remote (its new NetworkConfig,
/// its decision, discovery) wakes a pass for that remote.
async fn ensure(broker: &Broker, remote: &Remote, pass: &Pass<'_>) -> Result<()> {
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
    if let (false, Some((out, _)), PassKind::Periodic) = (unfinished, &existing, pass.kind) {
        let same_gateway = pass.basics.carried_by(&out.spec);
        let forwarder = match &remote.route {
            Route::Direct { .. } => None,
            Route::Relayed { forwarder, .. } => Some(forwarder.as_str()),
        };
        let same_route = out.via.as_ref() == remote.via()
            && out.forwarder.as_deref() == forwarder
            && out.spec.pod_cidr.to_string() == pass.pod
            && out.spec.external_cidr.to_string() == pass.external;
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
    exchange(broker, remote, pass, existing)
        .instrument(span)
        .await
}

async fn exchange(
    broker: &Broker,
    remote: &Remote,
    pass: &Pass<'_>,
    existing: Option<(OutgoingNc, i64)>,
) -> Result<()> {
    let id = &remote.identity.id;
    let key = out_key(id);
    let current = existing.as_ref().map(|(out, _)| &out.spec);
    let spec = local_spec(broker, id, pass, current).await?;
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
        Route::Direct { broker: address } => {
            let (status, peering_id) = broker.ports().peers().submit(address, id, nc).await?;
            if let Some(told) = &peering_id {
                broker.learn_peering_id(id, told).await?;
            }
            status
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::broker;

    const KEY: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

    fn spec(endpoint: &str) -> NetworkSpec {
        NetworkSpec::from_proto(
            "spec",
            Some(&pb::NetworkConfigSpec {
                pod_cidr: "10.0.0.0/16".into(),
                external_cidr: "10.1.0.0/16".into(),
                endpoint: endpoint.into(),
                public_key: KEY.into(),
                stateless_wire: false,
            }),
        )
        .expect("spec")
    }

    fn basics(host: &str) -> GatewayBasics {
        GatewayBasics {
            reask: Duration::from_secs(60),
            public_key: KEY.into(),
            endpoint_host: trellis_api::model::Endpoint::parse("endpoint", &format!("{host}:1"))
                .ok()
                .map(|e| e.host().clone()),
            stateless_wire: false,
        }
    }

    /// A port is asked for again within a quarter of the gateway's grace period, or once per
    /// resync when the gateway does not say it.
    #[test]
    fn ports_are_asked_for_again_within_a_quarter_of_the_grace_period() {
        let resync = Duration::from_secs(10);
        assert_eq!(
            reask_period(Some(Duration::from_secs(600)), resync),
            Duration::from_secs(150)
        );
        assert_eq!(
            reask_period(Some(Duration::from_secs(2)), resync),
            Duration::from_millis(500)
        );
        assert_eq!(reask_period(None, resync), resync);
    }

    /// Our NetworkConfig that still carries the gateway's key and host keeps its endpoint (the
    /// port the gateway gave that remote) without a question to the gateway, which here never
    /// answers, while the gateway was asked for that remote lately; the CIDRs are the pass's.
    /// Once the host moved (a gateway failover, say), or the last question is older than the
    /// re-ask period (asking keeps the port reserved), the gateway is asked.
    #[tokio::test]
    async fn a_spec_still_carrying_the_gateways_key_and_host_is_kept_without_asking() {
        let broker = broker();
        let remote = ClusterId::parse("id", "leaf-b").expect("id");
        let current = spec("192.0.2.1:51830");
        let same = basics("192.0.2.1");
        let pass = Pass {
            pod: "10.2.0.0/16",
            external: "10.3.0.0/16",
            basics: &same,
            kind: PassKind::Woken,
        };
        let never_asked = local_spec(&broker, &remote, &pass, Some(&current)).await;
        assert!(
            never_asked.is_err(),
            "kept a port never asked for: {never_asked:?}"
        );

        broker.ports().gateway().note_asked(&remote);
        let kept = local_spec(&broker, &remote, &pass, Some(&current))
            .await
            .expect("kept without the gateway");
        assert_eq!(kept.endpoint, current.endpoint);
        assert_eq!(kept.public_key, current.public_key);
        assert_eq!(kept.pod_cidr.to_string(), "10.2.0.0/16");
        assert_eq!(kept.external_cidr.to_string(), "10.3.0.0/16");

        let moved = basics("192.0.2.2");
        let moved_pass = Pass {
            basics: &moved,
            ..pass
        };
        let asked = local_spec(&broker, &remote, &moved_pass, Some(&current)).await;
        assert!(asked.is_err(), "the gateway was not asked: {asked:?}");
        // The gateway now offers the stateless wire convention: a spec without the offer is
        // not kept, and one with it keeps it.
        let offering = GatewayBasics {
            stateless_wire: true,
            ..basics("192.0.2.1")
        };
        let offering_pass = Pass {
            basics: &offering,
            ..pass
        };
        let asked = local_spec(&broker, &remote, &offering_pass, Some(&current)).await;
        assert!(asked.is_err(), "kept a spec without the offer: {asked:?}");
        let offered = NetworkSpec {
            stateless_wire: true,
            ..current.clone()
        };
        let kept = local_spec(&broker, &remote, &offering_pass, Some(&offered))
            .await
            .expect("kept without the gateway");
        assert!(kept.stateless_wire);
        let first = local_spec(&broker, &remote, &pass, None).await;
        assert!(
            first.is_err(),
            "a first spec without the gateway: {first:?}"
        );

        let mut due = basics("192.0.2.1");
        due.reask = Duration::ZERO;
        let due_pass = Pass {
            basics: &due,
            ..pass
        };
        let stale = local_spec(&broker, &remote, &due_pass, Some(&current)).await;
        assert!(
            stale.is_err(),
            "a question a resync old was not renewed: {stale:?}"
        );
    }
}
