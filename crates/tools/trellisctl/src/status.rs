//! `trellisctl status`: one picture of the local cluster, from several services at once.
//!
//! First every service is connected to and asked `grpc.health.v1.Health/Check` (concurrently,
//! so dead services cost one `--timeout`, not six). Then the discovery service gives the
//! identity and ForeignClusters, the broker its TunnelEndpoints, the gateway its info and
//! tunnels. A section whose service cannot be reached or fails is left `null` in JSON (and
//! listed in `unavailable`) and says why in the table: partial answers are the normal case
//! while a cluster starts or when, as in the lab, some services are not deployed. The command
//! only fails when no service answers at all.
//!
//! This file keeps the views (`status --output json` is made of them) and the command itself;
//! the rest is cut by what it does:
//!
//! - `convert`: the views from the protos the services answer with;
//! - `fetch`: the health probe (shared with `diagnose`) and one call per section;
//! - `table`: the table form of the views;
//! - `tests`: their unit tests.

mod convert;
pub(crate) mod fetch;
mod table;
#[cfg(test)]
mod tests;

use std::time::SystemTime;

use serde::Serialize;
use trellis_api::peers::Condition;

use self::fetch::{foreign_clusters, gateway_info, identity, probe, tunnel_endpoints, tunnels};
use crate::cli::Globals;
use crate::error::CtlError;
use crate::identity::{AddressesView, IdentityView};
use crate::service::{Service, Target};

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
    /// Whether other clusters are served and called without mutual TLS
    /// (`--insecure-plaintext-peering`).
    pub plaintext_peering: bool,
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
    /// For full records with mutual TLS: SHA-256 fingerprint (hex) of the CA pinned for it,
    /// the one its certificates must chain to (it changes when the peer moves to a new CA).
    pub pinned_ca_sha256: Option<String>,
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
    /// Both gateways offered the stateless wire convention: each translates what it sends.
    /// Otherwise each gateway's kernel translates what it receives (the double NAT).
    pub stateless_wire: bool,
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
    /// `direct`, `relayed` (through the hub that introduced the pair), or empty before the
    /// first handshake.
    pub path: String,
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

struct Sections {
    identity: Result<LocalIdentityView, CtlError>,
    foreign_clusters: Result<Vec<ForeignClusterView>, CtlError>,
    tunnel_endpoints: Result<Vec<TunnelEndpointView>, CtlError>,
    gateway: Result<GatewayView, CtlError>,
    tunnels: Result<Vec<TunnelView>, CtlError>,
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
