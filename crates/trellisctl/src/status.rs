//! `trellisctl status`: one picture of the local cluster, from several services at once.
//!
//! First every service is connected to and asked `grpc.health.v1.Health/Check` (concurrently,
//! so dead services cost one `--timeout`, not six). Then the discovery service gives the
//! identity and ForeignClusters, the broker its TunnelEndpoints, the gateway its info and
//! tunnels. A section whose service cannot be reached or fails is left `null` in JSON (and
//! listed in `unavailable`) and says why in the table: partial answers are the normal case
//! while a cluster starts or when, as in the lab, some services are not deployed. The command
//! only fails when no service answers at all.

use std::time::SystemTime;

use serde::Serialize;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::{GetIdentityRequest, ListForeignClustersRequest};
use trellis_api::pb::gateway::gateway_client::GatewayClient;
use trellis_api::pb::gateway::{
    GetGatewayInfoRequest, GetReplicaStatusRequest, ListTunnelsRequest, WireguardMode,
};
use trellis_api::pb::peering::ListTunnelEndpointsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::{gateway, types};
use trellis_api::peers::Condition;
use trellis_runtime::client::TracedChannel;

use crate::cli::Globals;
use crate::error::CtlError;
use crate::identity::{AddressesView, IdentityView, id_or_empty};
use crate::names;
use crate::output::Report;
use crate::service::{Service, Target};
use crate::table::{Table, fields, section};
use crate::units::{age_seconds, ago, bytes, millis, millis_text, rfc3339};

/// Everything `status` shows. `null` sections could not be read (see `unavailable`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatusView {
    /// Health of each of the six services.
    pub services: Vec<ServiceHealthView>,
    /// This cluster (discovery GetIdentity).
    pub identity: Option<LocalIdentityView>,
    /// Known remote clusters (discovery ListForeignClusters), ordered by ID.
    pub foreign_clusters: Option<Vec<ForeignClusterView>>,
    /// What the gateway is asked to build (broker ListTunnelEndpoints), ordered by remote ID.
    pub tunnel_endpoints: Option<Vec<TunnelEndpointView>>,
    /// The gateway's WireGuard identity (gateway GetGatewayInfo).
    pub gateway: Option<GatewayView>,
    /// What the gateway built, with health (gateway ListTunnels), ordered by remote ID.
    pub tunnels: Option<Vec<TunnelView>>,
    /// One entry per section that could not be read, with the reason.
    pub unavailable: Vec<ProblemView>,
}

/// Health of one service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServiceHealthView {
    pub service: Service,
    pub address: String,
    /// `serving`, `not_serving`, `unknown`, `unreachable` or `error` (the health call failed).
    pub health: String,
    /// Why, when not serving.
    pub error: Option<String>,
}

/// This cluster's identity and advertised addresses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LocalIdentityView {
    pub cluster_id: String,
    pub cluster_name: String,
    pub addresses: AddressesView,
}

/// One condition of a ForeignCluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConditionView {
    #[serde(rename = "type")]
    pub kind: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    pub reason: String,
    pub message: String,
    pub last_transition_time: Option<String>,
}

/// One ForeignCluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ForeignClusterView {
    pub cluster_id: String,
    pub cluster_name: String,
    /// `full` or `induced`.
    pub kind: String,
    /// For induced records: the hub whose Neighborhood introduced it.
    pub origin: Option<IdentityView>,
    /// `manual`, `dns_srv`, `mdns`, `neighborhood` or `peering`.
    pub discovery_source: String,
    /// Condition `Peered` is True (a full peering through our broker).
    pub peered: bool,
    /// For full records: whether networking with it is enabled.
    pub networking_enabled: Option<bool>,
    pub conditions: Vec<ConditionView>,
    pub update_time: Option<String>,
}

/// One TunnelEndpoint, with both NAT views.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TunnelEndpointView {
    pub remote: Option<IdentityView>,
    /// `full` or `induced`.
    pub kind: String,
    /// For induced: the hub the NetworkConfigs went through (not a data-plane hop).
    pub via: Option<IdentityView>,
    pub remote_endpoint: String,
    pub remote_public_key: String,
    pub local_pod_cidr: String,
    pub local_pod_cidr_nat: String,
    pub local_external_cidr: String,
    pub local_external_cidr_nat: String,
    pub remote_pod_cidr: String,
    pub remote_pod_cidr_nat: String,
    pub remote_external_cidr: String,
    pub remote_external_cidr_nat: String,
    pub generation: i64,
}

/// The gateway's WireGuard identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GatewayView {
    /// `kernel`, `userspace` or `none` (no data plane: tunnel states come from the desired
    /// state only).
    pub mode: String,
    pub endpoint: String,
    pub public_key: String,
    /// Its part in the election of the cluster's active gateway (GetReplicaStatus); `None`
    /// when the gateway does not answer it (an older one).
    pub replica: Option<ReplicaView>,
}

/// One gateway replica's view of the election (ADR 0023).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaView {
    pub replica: String,
    pub active: bool,
    pub epoch: u64,
    pub active_replica: String,
    pub warm: bool,
    /// The other replicas it hears: name, milliseconds since the last heartbeat, active, warm.
    pub peers: Vec<ReplicaPeerView>,
}

/// Another replica as one replica hears it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaPeerView {
    pub replica: String,
    pub since_heartbeat_ms: u64,
    pub active: bool,
    pub warm: bool,
}

impl ReplicaView {
    fn from_pb(r: &gateway::GetReplicaStatusResponse) -> Self {
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

    /// One line: who this replica is, and who is active.
    fn describe(&self) -> String {
        let role = if self.active {
            format!("active, epoch {}", self.epoch)
        } else if self.active_replica.is_empty() {
            "standby, no active known".to_owned()
        } else {
            format!(
                "standby{}, active: {} (epoch {})",
                if self.warm { "" } else { ", NOT warm" },
                self.active_replica,
                self.epoch
            )
        };
        let peers: Vec<String> = self
            .peers
            .iter()
            .map(|p| {
                format!(
                    "{} {}{} heard {} ms ago",
                    p.replica,
                    if p.active { "active" } else { "standby" },
                    if p.warm { "" } else { " NOT warm" },
                    p.since_heartbeat_ms
                )
            })
            .collect();
        if peers.is_empty() {
            format!("{} ({role})", self.replica)
        } else {
            format!("{} ({role}); {}", self.replica, peers.join("; "))
        }
    }
}

/// One tunnel as the gateway reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TunnelView {
    pub remote: Option<IdentityView>,
    pub kind: String,
    /// `configuring`, `connecting`, `up`, `down`, `error` or `removing`.
    pub state: String,
    pub message: String,
    pub interface_name: String,
    pub remote_endpoint: String,
    pub listen_port: u32,
    pub routed_cidrs: Vec<String>,
    pub last_handshake_time: Option<String>,
    /// Seconds between the last handshake and when `status` ran.
    pub last_handshake_age_seconds: Option<u64>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    /// Round-trip time of the last successful probe through the tunnel.
    pub latency_ms: Option<f64>,
    pub applied_generation: i64,
}

/// A section that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProblemView {
    pub service: Service,
    pub address: String,
    /// Which data was missed, e.g. `foreign_clusters`.
    pub section: String,
    pub error: String,
}

impl StatusView {
    /// True when not a single service could be reached.
    pub fn nothing_answered(&self) -> bool {
        self.services.iter().all(|s| s.health == "unreachable")
    }

    /// Drops withdrawn ForeignClusters (condition `Withdrawn` True): tombstones kept for a
    /// while after unpeering, which `status` shows only with `--all`.
    pub fn hide_withdrawn(&mut self) {
        if let Some(fcs) = &mut self.foreign_clusters {
            fcs.retain(|fc| {
                !fc.conditions
                    .iter()
                    .any(|c| c.kind == Condition::Withdrawn.as_str() && c.status == "True")
            });
        }
    }

    fn problem(&self, section: &str) -> Option<&ProblemView> {
        self.unavailable.iter().find(|p| p.section == section)
    }
}

// ---- conversions from the protos ----

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

// ---- fetching ----

type Connected = Result<TracedChannel, CtlError>;

/// Connects to `target` and asks its health; also returns the channel for further calls.
pub(crate) async fn probe(target: Target, globals: &Globals) -> (ServiceHealthView, Connected) {
    let mut view = ServiceHealthView {
        service: target.service,
        address: target.address.clone(),
        health: "unreachable".into(),
        error: None,
    };
    let channel = match globals.connect(&target).await {
        Ok(channel) => channel,
        Err(err) => {
            view.error = Some(match &err {
                CtlError::Unreachable {
                    service, reason, ..
                } => format!(
                    "{reason} (is {} running? set {})",
                    service.binary(),
                    service.flag()
                ),
                other => other.to_string(),
            });
            return (view, Err(err));
        }
    };
    let answer = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: target.service.grpc_name().into(),
        })
        .await;
    match answer {
        Ok(reply) => {
            let status = reply.into_inner().status;
            view.health = match ServingStatus::try_from(status) {
                Ok(ServingStatus::Serving) => "serving",
                Ok(ServingStatus::NotServing) => "not_serving",
                _ => "unknown",
            }
            .into();
        }
        Err(status) => {
            view.health = "error".into();
            view.error = Some(CtlError::rpc(&target, "Health/Check", &status).to_string());
        }
    }
    (view, Ok(channel))
}

struct Sections {
    identity: Result<LocalIdentityView, CtlError>,
    foreign_clusters: Result<Vec<ForeignClusterView>, CtlError>,
    tunnel_endpoints: Result<Vec<TunnelEndpointView>, CtlError>,
    gateway: Result<GatewayView, CtlError>,
    tunnels: Result<Vec<TunnelView>, CtlError>,
}

async fn identity(target: &Target, channel: Connected) -> Result<LocalIdentityView, CtlError> {
    let reply = DiscoveryClient::new(channel?)
        .get_identity(GetIdentityRequest {})
        .await
        .map_err(|s| CtlError::rpc(target, "GetIdentity", &s))?
        .into_inner();
    let id = reply.identity.unwrap_or_default();
    Ok(LocalIdentityView {
        cluster_id: id.cluster_id,
        cluster_name: id.cluster_name,
        addresses: AddressesView::from_pb(reply.addresses.as_ref()),
    })
}

async fn foreign_clusters(
    target: &Target,
    channel: Connected,
) -> Result<Vec<ForeignClusterView>, CtlError> {
    let reply = DiscoveryClient::new(channel?)
        .list_foreign_clusters(ListForeignClustersRequest::default())
        .await
        .map_err(|s| CtlError::rpc(target, "ListForeignClusters", &s))?
        .into_inner();
    Ok(reply
        .foreign_clusters
        .iter()
        .map(ForeignClusterView::from_pb)
        .collect())
}

async fn tunnel_endpoints(
    target: &Target,
    channel: Connected,
) -> Result<Vec<TunnelEndpointView>, CtlError> {
    let reply = BrokerClient::new(channel?)
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await
        .map_err(|s| CtlError::rpc(target, "ListTunnelEndpoints", &s))?
        .into_inner();
    Ok(reply
        .tunnel_endpoints
        .iter()
        .map(TunnelEndpointView::from_pb)
        .collect())
}

async fn gateway_info(target: &Target, channel: Connected) -> Result<GatewayView, CtlError> {
    let mut client = GatewayClient::new(channel?);
    let reply = client
        .get_gateway_info(GetGatewayInfoRequest::default())
        .await
        .map_err(|s| CtlError::rpc(target, "GetGatewayInfo", &s))?
        .into_inner();
    let replica = client
        .get_replica_status(GetReplicaStatusRequest {})
        .await
        .ok()
        .map(|r| ReplicaView::from_pb(&r.into_inner()));
    Ok(GatewayView {
        mode: names::wireguard_mode(reply.mode),
        endpoint: reply.endpoint,
        public_key: reply.public_key,
        replica,
    })
}

async fn tunnels(
    target: &Target,
    channel: Connected,
    now: SystemTime,
) -> Result<Vec<TunnelView>, CtlError> {
    let reply = GatewayClient::new(channel?)
        .list_tunnels(ListTunnelsRequest {})
        .await
        .map_err(|s| CtlError::rpc(target, "ListTunnels", &s))?
        .into_inner();
    Ok(reply
        .tunnels
        .iter()
        .map(|t| TunnelView::from_pb(t, now))
        .collect())
}

/// Runs `status`. Never fails as a whole: see [`StatusView::nothing_answered`].
pub async fn run(globals: &Globals, now: SystemTime) -> StatusView {
    let [d, b, f, i, e, g] = Service::ALL.map(|s| globals.target(s));
    let (pd, pb, pf, pi, pe, pg) = tokio::join!(
        probe(d.clone(), globals),
        probe(b.clone(), globals),
        probe(f, globals),
        probe(i, globals),
        probe(e, globals),
        probe(g.clone(), globals),
    );
    let sections = {
        let (identity, foreign_clusters, tunnel_endpoints, gateway, tunnels) = tokio::join!(
            identity(&d, pd.1.clone()),
            foreign_clusters(&d, pd.1),
            tunnel_endpoints(&b, pb.1),
            gateway_info(&g, pg.1.clone()),
            tunnels(&g, pg.1, now),
        );
        Sections {
            identity,
            foreign_clusters,
            tunnel_endpoints,
            gateway,
            tunnels,
        }
    };
    let mut unavailable = Vec::new();
    let mut keep = |target: &Target, section: &str, result_err: Option<CtlError>| {
        if let Some(err) = result_err {
            unavailable.push(ProblemView {
                service: target.service,
                address: target.address.clone(),
                section: section.into(),
                error: err.to_string(),
            });
        }
    };
    keep(&d, "identity", sections.identity.as_ref().err().cloned());
    keep(
        &d,
        "foreign_clusters",
        sections.foreign_clusters.as_ref().err().cloned(),
    );
    keep(
        &b,
        "tunnel_endpoints",
        sections.tunnel_endpoints.as_ref().err().cloned(),
    );
    keep(&g, "gateway", sections.gateway.as_ref().err().cloned());
    keep(&g, "tunnels", sections.tunnels.as_ref().err().cloned());
    StatusView {
        services: vec![pd.0, pb.0, pf.0, pi.0, pe.0, pg.0],
        identity: sections.identity.ok(),
        foreign_clusters: sections.foreign_clusters.ok(),
        tunnel_endpoints: sections.tunnel_endpoints.ok(),
        gateway: sections.gateway.ok(),
        tunnels: sections.tunnels.ok(),
        unavailable,
    }
}

// ---- the table form ----

fn real_to_view(real: &str, view: &str) -> String {
    if real.is_empty() && view.is_empty() {
        String::new()
    } else if real == view {
        format!("{real} (as is)")
    } else {
        format!("{real} -> {view}")
    }
}

impl StatusView {
    fn body<T>(&self, section: &str, rows: Option<&T>, render: impl Fn(&T) -> String) -> String {
        match (rows, self.problem(section)) {
            (Some(rows), _) => render(rows),
            (None, Some(problem)) => format!("  unavailable: {}\n", problem.error),
            (None, None) => "  unavailable\n".into(),
        }
    }

    fn services_table(&self) -> String {
        let mut t = Table::new(&["SERVICE", "ADDRESS", "HEALTH", "DETAIL"]);
        for s in &self.services {
            t.row([
                s.service.name().to_owned(),
                s.address.clone(),
                s.health.clone(),
                s.error.clone().unwrap_or_default(),
            ]);
        }
        t.render()
    }

    fn identity_block(identity: &LocalIdentityView) -> String {
        let mut pairs = vec![
            ("cluster id", identity.cluster_id.clone()),
            ("cluster name", identity.cluster_name.clone()),
        ];
        pairs.extend(
            identity
                .addresses
                .pairs()
                .into_iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, v)| (k, format!("{v} (advertised)"))),
        );
        fields(&pairs)
    }

    fn foreign_table(rows: &[ForeignClusterView]) -> String {
        if rows.is_empty() {
            return "  (none)\n".into();
        }
        let mut t = Table::new(&[
            "CLUSTER",
            "NAME",
            "KIND",
            "ORIGIN",
            "SOURCE",
            "PEERED",
            "CONDITIONS",
        ]);
        for fc in rows {
            let conditions: Vec<String> = fc
                .conditions
                .iter()
                .map(|c| format!("{}={}", c.kind, c.status))
                .collect();
            t.row([
                fc.cluster_id.clone(),
                fc.cluster_name.clone(),
                fc.kind.clone(),
                id_or_empty(fc.origin.as_ref()),
                fc.discovery_source.clone(),
                if fc.peered { "yes" } else { "no" }.into(),
                conditions.join(","),
            ]);
        }
        t.render()
    }

    fn endpoints_table(rows: &[TunnelEndpointView]) -> String {
        if rows.is_empty() {
            return "  (none)\n".into();
        }
        let mut t = Table::new(&[
            "REMOTE",
            "KIND",
            "VIA",
            "ENDPOINT",
            "REMOTE POD (REAL -> OUR VIEW)",
            "REMOTE EXTERNAL (REAL -> OUR VIEW)",
            "THEIR VIEW OF OUR POD / EXTERNAL",
            "GEN",
        ]);
        for te in rows {
            t.row([
                id_or_empty(te.remote.as_ref()),
                te.kind.clone(),
                id_or_empty(te.via.as_ref()),
                te.remote_endpoint.clone(),
                real_to_view(&te.remote_pod_cidr, &te.remote_pod_cidr_nat),
                real_to_view(&te.remote_external_cidr, &te.remote_external_cidr_nat),
                format!("{} / {}", te.local_pod_cidr_nat, te.local_external_cidr_nat),
                te.generation.to_string(),
            ]);
        }
        t.render()
    }

    fn tunnels_table(&self, rows: &[TunnelView]) -> String {
        let mut out = String::new();
        if let Some(gw) = &self.gateway {
            out.push_str(&fields(&[
                ("wireguard mode", gw.mode.clone()),
                ("endpoint", gw.endpoint.clone()),
                ("public key", gw.public_key.clone()),
                (
                    "replica",
                    gw.replica
                        .as_ref()
                        .map_or_else(|| "unknown".to_owned(), ReplicaView::describe),
                ),
            ]));
            if gw.mode == names::wireguard_mode(WireguardMode::None as i32) {
                out.push_str(
                    "  note: no data plane (--dataplane none): states come from the desired \
                     state only, no handshakes or traffic\n",
                );
            }
        } else if let Some(problem) = self.problem("gateway") {
            out.push_str(&format!("  gateway info unavailable: {}\n", problem.error));
        }
        if rows.is_empty() {
            out.push_str("  (no tunnels)\n");
            return out;
        }
        let mut t = Table::new(&[
            "REMOTE",
            "KIND",
            "STATE",
            "LAST HANDSHAKE",
            "RX",
            "TX",
            "LATENCY",
            "INTERFACE",
            "ENDPOINT",
            "DETAIL",
        ]);
        for tun in rows {
            t.row([
                id_or_empty(tun.remote.as_ref()),
                tun.kind.clone(),
                tun.state.clone(),
                ago(tun.last_handshake_age_seconds),
                bytes(tun.rx_bytes),
                bytes(tun.tx_bytes),
                millis_text(tun.latency_ms),
                tun.interface_name.clone(),
                tun.remote_endpoint.clone(),
                tun.message.clone(),
            ]);
        }
        out.push_str(&t.render());
        out
    }
}

impl Report for StatusView {
    fn table(&self) -> String {
        let parts = [
            section("Services", &self.services_table()),
            section(
                "Cluster (discovery)",
                &self.body("identity", self.identity.as_ref(), Self::identity_block),
            ),
            section(
                "Foreign clusters (discovery)",
                &self.body("foreign_clusters", self.foreign_clusters.as_ref(), |r| {
                    Self::foreign_table(r)
                }),
            ),
            section(
                "Tunnel endpoints (broker)",
                &self.body("tunnel_endpoints", self.tunnel_endpoints.as_ref(), |r| {
                    Self::endpoints_table(r)
                }),
            ),
            section(
                "Tunnels (gateway)",
                &self.body("tunnels", self.tunnels.as_ref(), |r| self.tunnels_table(r)),
            ),
        ];
        parts.join("\n")
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::cli::OutputFormat;
    use crate::output::render;

    fn ident(id: &str) -> Option<types::ClusterIdentity> {
        Some(types::ClusterIdentity {
            cluster_id: id.into(),
            cluster_name: id.into(),
        })
    }

    fn condition(kind: Condition, status: types::ConditionStatus) -> types::Condition {
        types::Condition {
            r#type: kind.to_string(),
            status: status.into(),
            ..Default::default()
        }
    }

    fn sample() -> StatusView {
        let now = UNIX_EPOCH + Duration::from_secs(1_000);
        let full = types::ForeignCluster {
            identity: ident("hub"),
            kind: types::PeeringKind::Full.into(),
            full: Some(types::FullPeering {
                networking_enabled: true,
                ..Default::default()
            }),
            conditions: vec![condition(Condition::Peered, types::ConditionStatus::True)],
            discovery_source: types::DiscoverySource::Peering.into(),
            ..Default::default()
        };
        let induced = types::ForeignCluster {
            identity: ident("leaf-c"),
            kind: types::PeeringKind::Induced.into(),
            induced: Some(types::InducedPeering {
                origin: ident("hub"),
                ..Default::default()
            }),
            conditions: vec![condition(
                Condition::InducedPeering,
                types::ConditionStatus::True,
            )],
            discovery_source: types::DiscoverySource::Neighborhood.into(),
            ..Default::default()
        };
        let te = types::TunnelEndpoint {
            remote: ident("leaf-c"),
            kind: types::PeeringKind::Induced.into(),
            via: ident("hub"),
            remote_endpoint: "127.0.0.1:51841".into(),
            remote_pod_cidr: "10.0.0.0/16".into(),
            remote_pod_cidr_nat: "10.80.0.0/16".into(),
            remote_external_cidr: "10.201.0.0/16".into(),
            remote_external_cidr_nat: "10.201.0.0/16".into(),
            local_pod_cidr_nat: "10.81.0.0/16".into(),
            local_external_cidr_nat: "10.202.0.0/16".into(),
            generation: 3,
            ..Default::default()
        };
        let tunnel = gateway::TunnelStatus {
            remote: ident("leaf-c"),
            kind: types::PeeringKind::Induced.into(),
            state: gateway::TunnelState::Up.into(),
            last_handshake_time: Some(prost_types::Timestamp {
                seconds: 988,
                nanos: 0,
            }),
            rx_bytes: 2048,
            tx_bytes: 10,
            probe_rtt: Some(prost_types::Duration {
                seconds: 0,
                nanos: 1_500_000,
            }),
            interface_name: "trellis-1".into(),
            ..Default::default()
        };
        StatusView {
            services: vec![
                ServiceHealthView {
                    service: Service::Discovery,
                    address: "127.0.0.1:7101".into(),
                    health: "serving".into(),
                    error: None,
                },
                ServiceHealthView {
                    service: Service::Endpoints,
                    address: "127.0.0.1:7105".into(),
                    health: "unreachable".into(),
                    error: Some("connection refused".into()),
                },
            ],
            identity: Some(LocalIdentityView {
                cluster_id: "leaf-a".into(),
                cluster_name: "leaf-a".into(),
                addresses: AddressesView::default(),
            }),
            foreign_clusters: Some(vec![
                ForeignClusterView::from_pb(&full),
                ForeignClusterView::from_pb(&induced),
            ]),
            tunnel_endpoints: Some(vec![TunnelEndpointView::from_pb(&te)]),
            gateway: None,
            tunnels: Some(vec![TunnelView::from_pb(&tunnel, now)]),
            unavailable: vec![],
        }
    }

    #[test]
    fn table_shows_kinds_origins_nat_views_and_tunnel_health() {
        let text = sample().table();
        for expected in [
            "endpoints  127.0.0.1:7105  unreachable  connection refused",
            "cluster id    leaf-a",
            "hub      hub     full     -       peering       yes     Peered=True",
            "leaf-c   leaf-c  induced  hub     neighborhood  no      InducedPeering=True",
            "10.0.0.0/16 -> 10.80.0.0/16",
            "10.201.0.0/16 (as is)",
            "10.81.0.0/16 / 10.202.0.0/16",
            "leaf-c  induced  up     12s ago         2.0 KiB  10 B  1.50 ms",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
        }
    }

    #[test]
    fn unreadable_sections_say_why_and_are_null_in_json() {
        let mut view = sample();
        view.tunnels = None;
        view.unavailable.push(ProblemView {
            service: Service::Gateway,
            address: "127.0.0.1:7106".into(),
            section: "tunnels".into(),
            error: "cannot reach the gateway at 127.0.0.1:7106: connection refused".into(),
        });
        let text = view.table();
        assert!(
            text.contains(
                "Tunnels (gateway)\n  unavailable: cannot reach the gateway at 127.0.0.1:7106"
            ),
            "{text}"
        );
        let json: serde_json::Value =
            serde_json::from_str(&render(&view, OutputFormat::Json).expect("renders"))
                .expect("json");
        assert!(json["tunnels"].is_null());
        assert_eq!(json["unavailable"][0]["service"], "gateway");
        assert_eq!(json["unavailable"][0]["section"], "tunnels");
        assert_eq!(json["foreign_clusters"][1]["kind"], "induced");
        assert_eq!(json["foreign_clusters"][1]["origin"]["cluster_id"], "hub");
        assert_eq!(json["foreign_clusters"][0]["peered"], true);
        assert_eq!(json["foreign_clusters"][0]["networking_enabled"], true);
        assert_eq!(
            json["foreign_clusters"][0]["conditions"][0]["type"],
            Condition::Peered.as_str()
        );
        assert_eq!(json["tunnel_endpoints"][0]["via"]["cluster_id"], "hub");
        assert_eq!(
            json["tunnel_endpoints"][0]["remote_pod_cidr_nat"],
            "10.80.0.0/16"
        );
    }

    #[test]
    fn json_tunnels_carry_times_and_latency() {
        let json = serde_json::to_value(sample()).expect("json");
        let tunnel = &json["tunnels"][0];
        assert_eq!(tunnel["state"], "up");
        assert_eq!(tunnel["last_handshake_time"], "1970-01-01T00:16:28Z");
        assert_eq!(tunnel["last_handshake_age_seconds"], 12);
        assert_eq!(tunnel["latency_ms"], 1.5);
        assert_eq!(tunnel["rx_bytes"], 2048);
    }

    #[test]
    fn no_data_plane_is_explained_and_nothing_answered_is_detected() {
        let mut view = sample();
        view.gateway = Some(GatewayView {
            mode: "none".into(),
            endpoint: "127.0.0.1:51840".into(),
            public_key: "k".into(),
            replica: Some(ReplicaView {
                replica: "n1".into(),
                active: false,
                epoch: 4,
                active_replica: "n0".into(),
                warm: false,
                peers: vec![ReplicaPeerView {
                    replica: "n0".into(),
                    since_heartbeat_ms: 40,
                    active: true,
                    warm: true,
                }],
            }),
        });
        view.tunnels = Some(vec![]);
        let text = view.table();
        assert!(
            text.contains(
                "n1 (standby, NOT warm, active: n0 (epoch 4)); n0 active heard 40 ms ago"
            ),
            "{text}"
        );
        assert!(text.contains("wireguard mode  none"), "{text}");
        assert!(text.contains("note: no data plane"), "{text}");
        assert!(text.contains("(no tunnels)"), "{text}");
        assert!(!view.nothing_answered());
        for s in &mut view.services {
            s.health = "unreachable".into();
        }
        assert!(view.nothing_answered());
    }
}
