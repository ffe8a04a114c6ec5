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

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use ipnet::IpNet;
use serde::Serialize;
use trellis_api::pb::discovery::ListForeignClustersRequest;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{
    self as ipam_pb, GetLocalSubnetsRequest, ListClusterSubnetsRequest, ListEndpointMappingsRequest,
};
use trellis_api::pb::types;
use trellis_api::peers::{Condition, is_withdrawn};

use crate::certificate;
use crate::cli::Globals;
use crate::error::CtlError;
use crate::output::Report;
use crate::service::{Service, Target};
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
    /// The peer IPAM's record of us; `Err` says why it could not be read.
    pub record_of_us: Result<Option<ipam_pb::ClusterSubnets>, String>,
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
    /// Raw ForeignClusters (for addresses and pinned CA certificates); `None` if unreadable.
    pub foreign_clusters: Option<Vec<types::ForeignCluster>>,
    pub ipam: Result<IpamState, String>,
    pub peers: Vec<PeerReport>,
    pub now: SystemTime,
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

fn health_problem(s: &ServiceHealthView) -> Option<String> {
    let why = s.error.as_deref().unwrap_or("");
    match s.health.as_str() {
        "serving" => None,
        "unreachable" => Some(format!(
            "{} ({}) at {} is unreachable: {why}",
            s.service.label(),
            s.service.binary(),
            s.address
        )),
        "not_serving" => Some(format!(
            "{} ({}) at {} reports NOT_SERVING (shutting down or not ready)",
            s.service.label(),
            s.service.binary(),
            s.address
        )),
        other => Some(format!(
            "{} ({}) at {} answered its health check with {other}{}",
            s.service.label(),
            s.service.binary(),
            s.address,
            if why.is_empty() {
                String::new()
            } else {
                format!(": {why}")
            }
        )),
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

/// Runs every check on `inputs`.
pub fn analyze(inputs: &Inputs) -> DiagnoseView {
    let status = &inputs.status;
    let local = status
        .identity
        .as_ref()
        .map_or_else(|| "local".to_owned(), |i| i.cluster_id.clone());
    let mut out = Vec::new();
    let mut checked = Checked {
        services: status.services.len(),
        ..Checked::default()
    };

    // Local services.
    for s in &status.services {
        if let Some(problem) = health_problem(s) {
            out.push(finding(
                Severity::Error,
                Check::ServiceDown,
                &local,
                Some(s.service),
                problem,
                format!(
                    "start or restart {} (check its logs); if it runs elsewhere, point {} at it",
                    s.service.binary(),
                    s.service.flag()
                ),
            ));
        }
    }

    // Gateway replicas (ADR 0023): every one must be able to take over at once.
    if let Some(replica) = status.gateway.as_ref().and_then(|g| g.replica.as_ref()) {
        out.extend(replica_findings(&local, replica));
    }

    // Peered ForeignClusters without a TunnelEndpoint.
    let fcs = inputs.foreign_clusters.as_deref().unwrap_or_default();
    checked.foreign_clusters = fcs.len();
    let tes = status.tunnel_endpoints.as_deref();
    if let Some(tes) = tes {
        checked.tunnel_endpoints = tes.len();
        let with_te: BTreeSet<&str> = tes
            .iter()
            .filter_map(|t| t.remote.as_ref().map(|r| r.cluster_id.as_str()))
            .collect();
        for fc in live_peers(fcs) {
            let id = fc_id(fc);
            if !with_te.contains(id.as_str()) {
                let induced = fc.kind == types::PeeringKind::Induced as i32;
                out.push(finding(
                    Severity::Error,
                    Check::MissingTunnelEndpoint,
                    &local,
                    Some(Service::Broker),
                    format!(
                        "{} {id} has no TunnelEndpoint: the NetworkConfig exchange with it has \
                         not completed, so no tunnel is built",
                        if induced { "induced peer" } else { "peer" }
                    ),
                    format!(
                        "check the broker's logs for {id}, and that {id}'s broker{} is reachable \
                         and serving",
                        if induced {
                            " and the hub's forwarder"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
    }

    // TunnelEndpoints the gateway has not applied, and stale handshakes.
    let no_dataplane = status.gateway.as_ref().is_some_and(|g| g.mode == "none");
    if let (Some(tes), Some(tunnels)) = (tes, status.tunnels.as_deref()) {
        checked.tunnels = tunnels.len();
        let by_remote: BTreeMap<&str, &status::TunnelView> = tunnels
            .iter()
            .filter_map(|t| t.remote.as_ref().map(|r| (r.cluster_id.as_str(), t)))
            .collect();
        for te in tes {
            let Some(remote) = te.remote.as_ref().map(|r| r.cluster_id.as_str()) else {
                continue;
            };
            match by_remote.get(remote) {
                None => out.push(finding(
                    Severity::Error,
                    Check::TunnelNotApplied,
                    &local,
                    Some(Service::Gateway),
                    format!(
                        "the gateway has no tunnel for {remote}'s TunnelEndpoint (generation {})",
                        te.generation
                    ),
                    "check that the gateway follows the broker (its --broker flag) and its logs"
                        .into(),
                )),
                Some(t) if t.applied_generation < te.generation => out.push(finding(
                    Severity::Error,
                    Check::TunnelNotApplied,
                    &local,
                    Some(Service::Gateway),
                    format!(
                        "the tunnel to {remote} is at generation {} but its TunnelEndpoint is at \
                         {}: the gateway has not applied the latest change{}",
                        t.applied_generation,
                        te.generation,
                        if t.message.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", t.message)
                        }
                    ),
                    "check the gateway's logs; it retries on its own, a restart re-applies \
                     everything"
                        .into(),
                )),
                Some(t) if !no_dataplane => {
                    let stale = match t.last_handshake_age_seconds {
                        None => Some("has never completed a WireGuard handshake".to_owned()),
                        Some(age) if age > HANDSHAKE_STALE.as_secs() => Some(format!(
                            "has had no WireGuard handshake for {}",
                            crate::units::ago(Some(age)).trim_end_matches(" ago")
                        )),
                        Some(_) => None,
                    };
                    if let Some(stale) = stale {
                        out.push(finding(
                            Severity::Error,
                            Check::HandshakeStale,
                            &local,
                            Some(Service::Gateway),
                            format!(
                                "the tunnel to {remote} (endpoint {}) {stale}",
                                t.remote_endpoint
                            ),
                            format!(
                                "check that UDP reaches {} from this gateway and back \
                                 (firewalls, NAT), and that {remote}'s gateway is running",
                                t.remote_endpoint
                            ),
                        ));
                    }
                }
                Some(_) => {}
            }
        }
    }

    // The local IPAM: pools and external CIDR.
    let ipam = match &inputs.ipam {
        Ok(ipam) => Some(ipam),
        Err(why) => {
            // An unreachable IPAM is already a ServiceDown finding.
            if status
                .services
                .iter()
                .any(|s| s.service == Service::Ipam && s.health == "serving")
            {
                out.push(finding(
                    Severity::Error,
                    Check::NotChecked,
                    &local,
                    Some(Service::Ipam),
                    format!("cannot read the IPAM's pools and records: {why}"),
                    "check the IPAM's logs and its store".into(),
                ));
            }
            None
        }
    };
    if let Some(ipam) = ipam {
        checked.pools = ipam.pools.len();
        out.extend(pool_findings(&local, ipam));
    }

    // Peers: their services, and their NAT views against ours.
    for peer in &inputs.peers {
        checked.peers.push(peer.cluster_id.clone());
        for s in &peer.services {
            if let Some(problem) = health_problem(s) {
                out.push(finding(
                    Severity::Error,
                    Check::PeerServiceDown,
                    &peer.cluster_id,
                    Some(s.service),
                    format!("peer {}: {problem}", peer.cluster_id),
                    format!(
                        "ask the operators of {} to restart {}, or check the network path from \
                         this cluster to {}",
                        peer.cluster_id,
                        s.service.binary(),
                        s.address
                    ),
                ));
            }
        }
        let ours = ipam.and_then(|i| i.clusters.iter().find(|c| c.cluster_id == peer.cluster_id));
        match (&peer.record_of_us, ours) {
            (Ok(theirs), Some(ours)) => {
                out.extend(nat_findings(
                    &local,
                    &peer.cluster_id,
                    ours,
                    theirs.as_ref(),
                ));
            }
            (Err(why), _) => {
                let ipam_down = peer
                    .services
                    .iter()
                    .any(|s| s.service == Service::Ipam && s.health != "serving");
                if !ipam_down {
                    out.push(finding(
                        Severity::Warning,
                        Check::NotChecked,
                        &peer.cluster_id,
                        Some(Service::Ipam),
                        format!(
                            "cannot compare NAT views with {}: its IPAM did not answer \
                             ListClusterSubnets: {why}",
                            peer.cluster_id
                        ),
                        "run `trellisctl diagnose` in that cluster too".into(),
                    ));
                }
            }
            (Ok(_), None) => {}
        }
    }

    // Pinned peer CA certificates.
    for fc in fcs {
        let Some(pem) = fc.full.as_ref().map(|f| f.ca_certificate.as_str()) else {
            continue;
        };
        if pem.trim().is_empty() || is_withdrawn(fc) {
            continue;
        }
        checked.certificates += 1;
        let id = fc_id(fc);
        match certificate::not_after(pem) {
            Ok(not_after) => {
                if let Some(f) = expiry_finding(&local, &id, not_after, inputs.now) {
                    out.push(f);
                }
            }
            Err(why) => out.push(finding(
                Severity::Warning,
                Check::CertificateExpiry,
                &local,
                Some(Service::Discovery),
                format!("the CA certificate pinned for {id} cannot be read: {why}"),
                format!("peer with {id} again so its CA is pinned afresh"),
            )),
        }
    }

    out.sort();
    out.dedup();
    DiagnoseView {
        cluster_id: status.identity.as_ref().map(|i| i.cluster_id.clone()),
        healthy: out.is_empty(),
        findings: out,
        checked,
    }
}

/// A heartbeat older than this means the replica could not be followed or take over.
const REPLICA_SILENT_MS: u64 = 1_000;

/// What keeps a failover from being immediate, as seen from the replica that answered.
fn replica_findings(local: &str, replica: &crate::status::ReplicaView) -> Vec<Finding> {
    let mut out = Vec::new();
    let gateway = Some(Service::Gateway);
    if !replica.active && replica.active_replica.is_empty() {
        out.push(finding(
            Severity::Error,
            Check::GatewayReplica,
            local,
            gateway,
            format!(
                "gateway replica {} knows no active replica: no tunnel carries traffic",
                replica.replica
            ),
            "check that the gateway reaches its store (an active is elected there) and the \
             replica's log"
                .into(),
        ));
    }
    if !replica.warm {
        out.push(finding(
            Severity::Warning,
            Check::GatewayReplica,
            local,
            gateway,
            format!(
                "gateway replica {} is not warm: its data plane does not hold every desired \
                 tunnel, so a takeover by it would leave some peers unreachable",
                replica.replica
            ),
            "see its ListTunnels for the tunnels in error, and its log".into(),
        ));
    }
    for peer in &replica.peers {
        if peer.since_heartbeat_ms > REPLICA_SILENT_MS {
            out.push(finding(
                Severity::Warning,
                Check::GatewayReplica,
                local,
                gateway,
                format!(
                    "gateway replica {} has not heard replica {} for {} ms",
                    replica.replica, peer.replica, peer.since_heartbeat_ms
                ),
                "if that replica is gone, nothing to do; else open the heartbeat port \
                 (TRELLIS_HEARTBEAT_LISTEN, UDP 7116 in the manifests) between the gateway nodes"
                    .into(),
            ));
        } else if !peer.warm {
            out.push(finding(
                Severity::Warning,
                Check::GatewayReplica,
                local,
                gateway,
                format!(
                    "gateway replica {} is not warm (as replica {} hears it): a takeover by it \
                     would leave some peers unreachable",
                    peer.replica, replica.replica
                ),
                "see that replica's ListTunnels and log".into(),
            ));
        }
    }
    out
}

fn expiry_finding(
    local: &str,
    peer: &str,
    not_after: SystemTime,
    now: SystemTime,
) -> Option<Finding> {
    let when = crate::units::rfc3339(Some(&prost_types::Timestamp::from(not_after)))
        .unwrap_or_else(|| "an unreadable date".into());
    match not_after.duration_since(now) {
        Err(_) => Some(finding(
            Severity::Error,
            Check::CertificateExpiry,
            local,
            Some(Service::Discovery),
            format!(
                "the CA certificate of peer {peer} expired on {when}: its services can no longer be verified"
            ),
            format!("have {peer} renew its CA, then unpeer and peer again so the new CA is pinned"),
        )),
        Ok(left) if left < EXPIRY_WARNING => Some(finding(
            Severity::Warning,
            Check::CertificateExpiry,
            local,
            Some(Service::Discovery),
            format!(
                "the CA certificate of peer {peer} expires on {when}, in {} days",
                left.as_secs() / 86_400
            ),
            format!("have {peer} renew its CA before then, and peer again so the new CA is pinned"),
        )),
        Ok(_) => None,
    }
}

/// Addresses of `net` (as a float: IPv6 ranges overflow integers).
fn size(net: IpNet) -> f64 {
    2f64.powi(i32::from(net.max_prefix_len() - net.prefix_len()))
}

/// Addresses `a` and `b` share (nets either nest or are disjoint).
fn shared(a: IpNet, b: IpNet) -> f64 {
    if b.contains(&a) {
        size(a)
    } else if a.contains(&b) {
        size(b)
    } else {
        0.0
    }
}

fn pool_findings(local: &str, ipam: &IpamState) -> Vec<Finding> {
    let mut out = Vec::new();
    let ranges: Vec<IpNet> = ipam
        .clusters
        .iter()
        .flat_map(|c| [&c.remote_pod_cidr_nat, &c.remote_external_cidr_nat])
        .filter_map(|s| s.parse().ok())
        .collect();
    for pool in ipam.pools.iter().filter_map(|p| p.parse::<IpNet>().ok()) {
        let used = ranges.iter().fold(0.0, |n, r| n + shared(*r, pool));
        let ratio = used / size(pool);
        if ratio >= NEARLY_FULL {
            out.push(finding(
                Severity::Warning,
                Check::PoolNearlyExhausted,
                local,
                Some(Service::Ipam),
                format!(
                    "remap pool {pool} is {:.0}% used: the next peer whose CIDRs conflict may \
                     find no free range",
                    ratio * 100.0
                ),
                "add a pool to the IPAM (--pool) or unpeer clusters no longer needed".into(),
            ));
        }
    }
    if let Ok(external) = ipam.external_cidr.parse::<IpNet>() {
        // Network and broadcast addresses are never handed out in IPv4.
        let usable = match external {
            IpNet::V4(_) if external.prefix_len() < 31 => size(external) - 2.0,
            _ => size(external),
        };
        let ratio = ipam.external_mappings as f64 / usable.max(1.0);
        if ratio >= NEARLY_FULL {
            out.push(finding(
                Severity::Warning,
                Check::PoolNearlyExhausted,
                local,
                Some(Service::Ipam),
                format!(
                    "the external CIDR {external} is {:.0}% used by {} hub-path endpoint \
                     mappings: new endpoints of third clusters will not be reflected",
                    ratio * 100.0,
                    ipam.external_mappings
                ),
                "give the IPAM a larger --external-cidr, or reduce what is reflected through \
                 this cluster"
                    .into(),
            ));
        }
    }
    out
}

/// Our record of `peer` against the peer's record of us: each side's decision must be what
/// the other side learned.
fn nat_findings(
    local: &str,
    peer: &str,
    ours: &ipam_pb::ClusterSubnets,
    theirs: Option<&ipam_pb::ClusterSubnets>,
) -> Vec<Finding> {
    let Some(theirs) = theirs else {
        return vec![finding(
            Severity::Error,
            Check::NatViewMismatch,
            peer,
            Some(Service::Ipam),
            format!("peer {peer}'s IPAM has no record of {local}, while {local} has one of {peer}"),
            format!(
                "check {peer}'s broker logs for {local}; unpeering and peering again rebuilds \
                 both records"
            ),
        )];
    };
    let pairs = [
        (
            "pod CIDR",
            &ours.local_pod_cidr_nat,
            &theirs.remote_pod_cidr_nat,
            local,
            peer,
        ),
        (
            "external CIDR",
            &ours.local_external_cidr_nat,
            &theirs.remote_external_cidr_nat,
            local,
            peer,
        ),
        (
            "pod CIDR",
            &theirs.local_pod_cidr_nat,
            &ours.remote_pod_cidr_nat,
            peer,
            local,
        ),
        (
            "external CIDR",
            &theirs.local_external_cidr_nat,
            &ours.remote_external_cidr_nat,
            peer,
            local,
        ),
    ];
    // (what, what the other side learned, what the decider decided, whose range, who decides)
    let mut out = Vec::new();
    for (what, learned, decided, subject, decider) in pairs {
        // Empty: that half of the exchange has not completed yet (reported elsewhere).
        if learned.is_empty() || decided.is_empty() || learned == decided {
            continue;
        }
        let holder = if decider == peer { local } else { peer };
        out.push(finding(
            Severity::Error,
            Check::NatViewMismatch,
            peer,
            Some(Service::Ipam),
            format!(
                "NAT views disagree: {decider} addresses {subject}'s {what} as {decided}, but \
                 {holder} believes it is {learned}; traffic between the two clusters will be \
                 translated wrongly"
            ),
            format!(
                "restart {decider}'s broker so it sends its NetworkConfig status again; if the \
                 views still differ, unpeer and peer {local} and {peer} again"
            ),
        ));
    }
    out
}

// ---- fetching ----

async fn ipam_state(globals: &Globals) -> Result<IpamState, String> {
    let target = globals.target(Service::Ipam);
    let channel = globals.connect(&target).await.map_err(|e| e.to_string())?;
    let mut client = IpamClient::new(channel);
    let target = &target;
    let rpc =
        |name: &'static str| move |s: tonic::Status| CtlError::rpc(target, name, &s).to_string();
    let local = client
        .get_local_subnets(GetLocalSubnetsRequest {})
        .await
        .map_err(rpc("GetLocalSubnets"))?
        .into_inner();
    let clusters = client
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .map_err(rpc("ListClusterSubnets"))?
        .into_inner()
        .clusters;
    let mappings = client
        .list_endpoint_mappings(ListEndpointMappingsRequest {})
        .await
        .map_err(rpc("ListEndpointMappings"))?
        .into_inner()
        .mappings;
    Ok(IpamState {
        pools: local.pools,
        external_cidr: local.external_cidr,
        clusters,
        external_mappings: mappings.len(),
    })
}

async fn raw_foreign_clusters(globals: &Globals) -> Option<Vec<types::ForeignCluster>> {
    let channel = globals
        .connect(&globals.target(Service::Discovery))
        .await
        .ok()?;
    DiscoveryClient::new(channel)
        .list_foreign_clusters(ListForeignClustersRequest::default())
        .await
        .ok()
        .map(|r| r.into_inner().foreign_clusters)
}

async fn peer_report(
    globals: &Globals,
    local_id: Option<String>,
    fc: types::ForeignCluster,
) -> PeerReport {
    let cluster_id = fc_id(&fc);
    let probes = advertised(&fc)
        .into_iter()
        .map(|(service, address)| status::probe(Target { service, address }, globals));
    let probed = futures::future::join_all(probes).await;
    let mut record_of_us = Err("the peer advertises no IPAM".to_owned());
    let mut services = Vec::new();
    for (view, channel) in probed {
        if view.service == Service::Ipam {
            record_of_us = match channel {
                Err(e) => Err(e.to_string()),
                Ok(channel) => IpamClient::new(channel)
                    .list_cluster_subnets(ListClusterSubnetsRequest {})
                    .await
                    .map(|r| {
                        r.into_inner()
                            .clusters
                            .into_iter()
                            .find(|c| Some(&c.cluster_id) == local_id.as_ref())
                    })
                    .map_err(|s| format!("{}: {}", crate::error::code_name(s.code()), s.message())),
            };
        }
        services.push(view);
    }
    PeerReport {
        cluster_id,
        services,
        record_of_us,
    }
}

/// Runs `diagnose`.
pub async fn run(globals: &Globals, now: SystemTime) -> DiagnoseView {
    let (status, foreign_clusters, ipam) = tokio::join!(
        Box::pin(status::run(globals, now)),
        raw_foreign_clusters(globals),
        ipam_state(globals),
    );
    let local_id = status.identity.as_ref().map(|i| i.cluster_id.clone());
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
    let reports = futures::future::join_all(
        peers
            .into_values()
            .map(|fc| peer_report(globals, local_id.clone(), fc)),
    )
    .await;
    analyze(&Inputs {
        status,
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
        Check::NotChecked => "not_checked",
    }
}

#[cfg(test)]
mod tests;
