//! The views from the protos the services answer with: names for enum values, RFC 3339 for
//! timestamps, ages and milliseconds relative to when `status` ran.

use std::time::SystemTime;

use trellis_api::pb::{gateway, types};
use trellis_api::peers::Condition;

use super::{
    ConditionView, ForeignClusterView, ReplicaPeerView, ReplicaView, TunnelEndpointView, TunnelView,
};
use crate::identity::IdentityView;
use crate::names;
use crate::units::{age_seconds, millis, rfc3339};

impl ReplicaView {
    pub(super) fn from_pb(r: &gateway::GetReplicaStatusResponse) -> Self {
        Self {
            replica: r.replica.clone(),
            active: r.active,
            epoch: r.epoch,
            active_replica: r.active_replica.clone(),
            warm: r.warm,
            peers: r
                .peers
                .iter()
                .map(|p| ReplicaPeerView {
                    replica: p.replica.clone(),
                    since_heartbeat_ms: p
                        .since_heartbeat
                        .and_then(|d| std::time::Duration::try_from(d).ok())
                        .map_or(u64::MAX, |d| {
                            u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
                        }),
                    active: p.active,
                    warm: p.warm,
                })
                .collect(),
        }
    }
}

impl ForeignClusterView {
    pub fn from_pb(fc: &types::ForeignCluster) -> Self {
        let identity = fc.identity.clone().unwrap_or_default();
        let conditions: Vec<ConditionView> = fc
            .conditions
            .iter()
            .map(|c| ConditionView {
                kind: c.r#type.clone(),
                status: names::condition_status(c.status),
                reason: c.reason.clone(),
                message: c.message.clone(),
                last_transition_time: rfc3339(c.last_transition_time.as_ref()),
            })
            .collect();
        let peered = conditions
            .iter()
            .any(|c| c.kind == Condition::Peered.as_str() && c.status == "True");
        let pinned_ca_sha256 = fc
            .full
            .as_ref()
            .filter(|f| !f.ca_certificate.is_empty())
            .map(|f| {
                trellis_runtime::tls::PinnedCa::from_pem(&identity.cluster_id, &f.ca_certificate)
                    .map_or_else(
                        |e| format!("unreadable: {e}"),
                        |ca| ca.fingerprint().to_owned(),
                    )
            });
        Self {
            cluster_id: identity.cluster_id,
            cluster_name: identity.cluster_name,
            kind: names::kind(fc.kind),
            origin: fc
                .induced
                .as_ref()
                .and_then(|i| IdentityView::from_pb(i.origin.as_ref())),
            discovery_source: names::discovery_source(fc.discovery_source),
            peered,
            networking_enabled: fc.full.as_ref().map(|f| f.networking_enabled),
            pinned_ca_sha256,
            conditions,
            update_time: rfc3339(fc.update_time.as_ref()),
        }
    }
}

impl TunnelEndpointView {
    pub fn from_pb(te: &types::TunnelEndpoint) -> Self {
        Self {
            remote: IdentityView::from_pb(te.remote.as_ref()),
            kind: names::kind(te.kind),
            via: IdentityView::from_pb(te.via.as_ref()),
            remote_endpoint: te.remote_endpoint.clone(),
            remote_public_key: te.remote_public_key.clone(),
            local_pod_cidr: te.local_pod_cidr.clone(),
            local_pod_cidr_nat: te.local_pod_cidr_nat.clone(),
            local_external_cidr: te.local_external_cidr.clone(),
            local_external_cidr_nat: te.local_external_cidr_nat.clone(),
            remote_pod_cidr: te.remote_pod_cidr.clone(),
            remote_pod_cidr_nat: te.remote_pod_cidr_nat.clone(),
            remote_external_cidr: te.remote_external_cidr.clone(),
            remote_external_cidr_nat: te.remote_external_cidr_nat.clone(),
            stateless_wire: te.stateless_wire,
            generation: te.generation,
        }
    }
}

impl TunnelView {
    pub fn from_pb(t: &gateway::TunnelStatus, now: SystemTime) -> Self {
        Self {
            remote: IdentityView::from_pb(t.remote.as_ref()),
            kind: names::kind(t.kind),
            state: names::tunnel_state(t.state),
            message: t.message.clone(),
            interface_name: t.interface_name.clone(),
            remote_endpoint: t.remote_endpoint.clone(),
            path: match gateway::TunnelPath::try_from(t.path) {
                Ok(gateway::TunnelPath::Direct) => "direct".to_owned(),
                Ok(gateway::TunnelPath::Relayed) => "relayed".to_owned(),
                _ => String::new(),
            },
            listen_port: t.listen_port,
            routed_cidrs: t.routed_cidrs.clone(),
            last_handshake_time: rfc3339(t.last_handshake_time.as_ref()),
            last_handshake_age_seconds: age_seconds(t.last_handshake_time.as_ref(), now),
            rx_bytes: t.rx_bytes,
            tx_bytes: t.tx_bytes,
            latency_ms: millis(t.probe_rtt.as_ref()),
            applied_generation: t.applied_generation,
        }
    }
}
