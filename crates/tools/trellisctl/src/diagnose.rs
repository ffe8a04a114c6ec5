//! `trellisctl diagnose`: checks one cluster and its peers and says what is wrong, in words a
//! platform engineer acts on.
//!
//! It reads what `status` reads (service health, ForeignClusters, TunnelEndpoints, the gateway's
//! tunnels) plus the local IPAM (pools, remote records, external-CIDR mappings), then, for every
//! peer with a TunnelEndpoint or a live ForeignCluster, asks the peer's advertised services for
//! their health and the peer's IPAM for its record of us. The checks themselves
//! ([`analyze`]) are pure functions of what was read, so each has a unit test; the integration
//! tests run the command against real clusters with a fault injected.
//!
//! Every finding names the cluster and service it concerns, what is wrong, and what to do. The
//! exit code is 0 only when there is no finding at all.
//!
//! This file keeps the views, what the parts share (a finding's construction, which peers are
//! live and where they listen), the command and its table form; the rest is cut by what it
//! does (unit tests in `tests`):
//!
//! - `checks`: [`analyze`], every check in one pass over what was read;
//! - `findings`: the checks with reasoning of their own (gateway replicas, certificate expiry,
//!   pool usage, NAT views compared across a peering);
//! - `fetch`: what `status` does not read: the local IPAM, the raw ForeignClusters, and each
//!   peer's services and record of us.

mod checks;
mod fetch;
mod findings;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use trellis_api::pb::ipam as ipam_pb;
use trellis_api::pb::types;
use trellis_api::peers::{Condition, is_withdrawn};

pub use self::checks::analyze;
use self::fetch::{ipam_state, peer_report, raw_foreign_clusters};
use crate::cli::Globals;
use crate::output::Report;
use crate::service::Service;
use crate::status::{self, ServiceHealthView, StatusView};
use crate::table::{Table, section};

/// A tunnel whose last handshake is older than this is reported (WireGuard re-handshakes
/// every two minutes while traffic flows, and keepalives keep an idle tunnel handshaking).
pub const HANDSHAKE_STALE: Duration = Duration::from_secs(180);

/// A pool (or the external CIDR) at least this full is reported.
pub const NEARLY_FULL: f64 = 0.9;

/// A certificate expiring within this is reported.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(30 * 24 * 3600);

/// The result of `diagnose`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiagnoseView {
    /// The diagnosed cluster, when its discovery service answered.
    pub cluster_id: Option<String>,
    /// True only when there is no finding.
    pub healthy: bool,
    /// What is wrong, most severe first.
    pub findings: Vec<Finding>,
    /// What was looked at (for the reader to know what "healthy" covers).
    pub checked: Checked,
}

/// How much was looked at.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Checked {
    pub services: usize,
    pub foreign_clusters: usize,
    pub tunnel_endpoints: usize,
    pub tunnels: usize,
    /// Peers whose services and IPAM were asked.
    pub peers: Vec<String>,
    pub pools: usize,
    pub certificates: usize,
}

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Something is broken now.
    Error,
    /// Something will break, or may be breaking.
    Warning,
}

/// Which check found it; stable names for scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// A local service is unreachable or its health is not SERVING.
    ServiceDown,
    /// A peer's advertised service is unreachable or not SERVING.
    PeerServiceDown,
    /// A peered ForeignCluster without a TunnelEndpoint.
    MissingTunnelEndpoint,
    /// A TunnelEndpoint the gateway has not built, or built at an older generation.
    TunnelNotApplied,
    /// A tunnel without a WireGuard handshake for more than three minutes.
    HandshakeStale,
    /// Our NAT views of a peer and the peer's views of us disagree.
    NatViewMismatch,
    /// A remap pool, or the external CIDR, is nearly full.
    PoolNearlyExhausted,
    /// A certificate expires soon, or has expired.
    CertificateExpiry,
    /// A gateway replica that could not take over at once: not warm, silent, or without an
    /// active (ADR 0023).
    GatewayReplica,
    /// An induced tunnel relayed through its hub because no direct path works (ADR 0025).
    TunnelRelayed,
    /// A certificate of this cluster's own (`--tls-dir`) not renewed in time, or still of the
    /// CA before a move, or a move to a new CA not announced to every peer (ADR 0026, 0027).
    OwnCertificate,
    /// The cluster serves and calls other clusters without mutual TLS.
    PlaintextPeering,
    /// A check could not run (e.g. a section could not be read).
    NotChecked,
}

/// One thing that is wrong.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Finding {
    pub severity: Severity,
    pub check: Check,
    /// The cluster concerned: the diagnosed one, or a peer.
    pub cluster: String,
    /// The service concerned, when one is.
    pub service: Option<Service>,
    /// What is wrong.
    pub problem: String,
    /// What to do about it.
    pub action: String,
}

/// One peer's answers.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerReport {
    pub cluster_id: String,
    /// Health of each service the peer advertises.
    pub services: Vec<ServiceHealthView>,
    /// The peer IPAM's record of us; `Err` says why it could not be read; `None` when it was
    /// not asked: the peer serves other clusters over mutual TLS, where its records are not
    /// served (they are intra-cluster), so its NAT views cannot be compared from here.
    pub record_of_us: Option<Result<Option<ipam_pb::ClusterSubnets>, String>>,
}

/// What the local IPAM answered.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct IpamState {
    pub pools: Vec<String>,
    pub external_cidr: String,
    pub clusters: Vec<ipam_pb::ClusterSubnets>,
    pub external_mappings: usize,
}

/// Everything the checks look at.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub status: StatusView,
    /// With `--tls-dir`: the certificates Trellis made for this cluster there.
    pub own: Option<Result<OwnCertificates, String>>,
    /// Raw ForeignClusters (for addresses and pinned CA certificates); `None` if unreadable.
    pub foreign_clusters: Option<Vec<types::ForeignCluster>>,
    pub ipam: Result<IpamState, String>,
    pub peers: Vec<PeerReport>,
    pub now: SystemTime,
}

/// What `--tls-dir` holds: the cluster's CA and each service's certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnCertificates {
    pub dir: String,
    /// The CA's validity end.
    pub ca_not_after: SystemTime,
    /// Each service with a certificate there, by name.
    pub services: Vec<OwnCertificate>,
    /// A move to a new CA not yet announced to every peer (`certs rotate-ca` left its marker).
    pub move_unannounced: bool,
}

/// One service's certificate in `--tls-dir`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnCertificate {
    pub service: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// Whether it chains to the CA in the directory (false: issued by the CA before a move).
    pub of_current_ca: bool,
}

fn finding(
    severity: Severity,
    check: Check,
    cluster: &str,
    service: Option<Service>,
    problem: String,
    action: String,
) -> Finding {
    Finding {
        severity,
        check,
        cluster: cluster.to_owned(),
        service,
        problem,
        action,
    }
}

/// The peers that should have a tunnel: full peers (Peered=True, networking on) and induced
/// peers not withdrawn.
fn live_peers(fcs: &[types::ForeignCluster]) -> Vec<&types::ForeignCluster> {
    fcs.iter()
        .filter(|fc| !is_withdrawn(fc))
        .filter(|fc| {
            if fc.kind == types::PeeringKind::Induced as i32 {
                true
            } else {
                Condition::Peered.is_true(fc)
                    && fc.full.as_ref().is_none_or(|f| f.networking_enabled)
            }
        })
        .collect()
}

fn fc_id(fc: &types::ForeignCluster) -> String {
    fc.identity
        .as_ref()
        .map(|i| i.cluster_id.clone())
        .unwrap_or_default()
}

/// The addresses a peer advertises, by service.
pub fn advertised(fc: &types::ForeignCluster) -> Vec<(Service, String)> {
    let addresses = fc
        .full
        .as_ref()
        .and_then(|f| f.addresses.as_ref())
        .or_else(|| fc.induced.as_ref().and_then(|i| i.addresses.as_ref()));
    let Some(a) = addresses else {
        return Vec::new();
    };
    [
        (Service::Discovery, &a.discovery),
        (Service::Broker, &a.broker),
        (Service::Forwarder, &a.forwarder),
        (Service::Ipam, &a.ipam),
        (Service::Endpoints, &a.endpoints),
    ]
    .into_iter()
    .filter(|(_, addr)| !addr.is_empty())
    .map(|(s, addr)| (s, addr.clone()))
    .collect()
}

/// Runs `diagnose`.
pub async fn run(
    globals: &Globals,
    tls_dir: Option<&std::path::Path>,
    now: SystemTime,
) -> DiagnoseView {
    let (status, foreign_clusters, ipam) = tokio::join!(
        Box::pin(status::run(globals, now)),
        raw_foreign_clusters(globals),
        ipam_state(globals),
    );
    let local_id = status.identity.as_ref().map(|i| i.cluster_id.clone());
    let own = tls_dir.map(|dir| match &local_id {
        Some(id) => fetch::own_certificates(dir, id),
        None => Err("the cluster's ID is unknown (its discovery service did not answer)".into()),
    });
    let mut peers: BTreeMap<String, types::ForeignCluster> = BTreeMap::new();
    if let Some(fcs) = &foreign_clusters {
        let with_te: BTreeSet<String> = status
            .tunnel_endpoints
            .iter()
            .flatten()
            .filter_map(|t| t.remote.as_ref().map(|r| r.cluster_id.clone()))
            .collect();
        for fc in fcs {
            let id = fc_id(fc);
            let live = live_peers(std::slice::from_ref(fc)).len() == 1;
            if live || with_te.contains(&id) {
                peers.insert(id, fc.clone());
            }
        }
    }
    let local_tls = status
        .identity
        .as_ref()
        .is_some_and(|i| !i.plaintext_peering);
    let reports = futures::future::join_all(
        peers
            .into_values()
            .map(|fc| peer_report(globals, local_id.clone(), local_tls, fc)),
    )
    .await;
    analyze(&Inputs {
        status,
        own,
        foreign_clusters,
        ipam,
        peers: reports,
        now,
    })
}

// ---- the table form ----

impl Report for DiagnoseView {
    fn table(&self) -> String {
        let cluster = self.cluster_id.as_deref().unwrap_or("the cluster");
        let c = &self.checked;
        let scope = format!(
            "checked {} services, {} ForeignClusters, {} TunnelEndpoints, {} tunnels, {} pools, \
             {} certificates, peers: {}\n",
            c.services,
            c.foreign_clusters,
            c.tunnel_endpoints,
            c.tunnels,
            c.pools,
            c.certificates,
            if c.peers.is_empty() {
                "none".to_owned()
            } else {
                c.peers.join(", ")
            }
        );
        if self.healthy {
            return format!("{cluster} is healthy\n{scope}");
        }
        let mut out = format!(
            "{cluster}: {} problem{} found\n{scope}\n",
            self.findings.len(),
            if self.findings.len() == 1 { "" } else { "s" }
        );
        let mut table = Table::new(&["SEVERITY", "CHECK", "CLUSTER", "SERVICE"]);
        for f in &self.findings {
            table.row([
                severity_name(f.severity).to_owned(),
                check_name(f.check).to_owned(),
                f.cluster.clone(),
                f.service.map(|s| s.name().to_owned()).unwrap_or_default(),
            ]);
        }
        out.push_str(&section("Findings", &table.render()));
        for (i, f) in self.findings.iter().enumerate() {
            out.push_str(&format!(
                "\n{}. {}\n   what to do: {}\n",
                i + 1,
                f.problem,
                f.action
            ));
        }
        out
    }
}

fn severity_name(s: Severity) -> &'static str {
    match s {
        Severity::Error => "error",
        Severity::Warning => "warning",
    }
}

/// The JSON name of a check.
pub fn check_name(c: Check) -> &'static str {
    match c {
        Check::ServiceDown => "service_down",
        Check::PeerServiceDown => "peer_service_down",
        Check::MissingTunnelEndpoint => "missing_tunnel_endpoint",
        Check::TunnelNotApplied => "tunnel_not_applied",
        Check::HandshakeStale => "handshake_stale",
        Check::NatViewMismatch => "nat_view_mismatch",
        Check::PoolNearlyExhausted => "pool_nearly_exhausted",
        Check::CertificateExpiry => "certificate_expiry",
        Check::GatewayReplica => "gateway_replica",
        Check::TunnelRelayed => "tunnel_relayed",
        Check::PlaintextPeering => "plaintext_peering",
        Check::OwnCertificate => "own_certificate",
        Check::NotChecked => "not_checked",
    }
}

#[cfg(test)]
mod tests;
