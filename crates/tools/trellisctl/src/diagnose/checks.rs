//! [`analyze`]: every check in one pass over what was read, a pure function so that each
//! check has a unit test. Findings are sorted most severe first and deduplicated.

use std::collections::{BTreeMap, BTreeSet};

use trellis_api::pb::types;
use trellis_api::peers::is_withdrawn;

use super::findings::{
    expiry_finding, nat_findings, own_findings, pool_findings, replica_findings,
};
use super::{
    Check, Checked, DiagnoseView, HANDSHAKE_STALE, Inputs, Severity, fc_id, finding, live_peers,
};
use crate::service::Service;
use crate::status::{self, ServiceHealthView};

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

    if status
        .identity
        .as_ref()
        .is_some_and(|i| i.plaintext_peering)
    {
        out.push(finding(
            Severity::Warning,
            Check::PlaintextPeering,
            &local,
            Some(Service::Discovery),
            "other clusters are served and called in plaintext (--insecure-plaintext-peering): \
             anyone who reaches the cluster-facing ports can claim to be any peer"
                .to_owned(),
            "drop --insecure-plaintext-peering and give every cluster-facing service \
             --peer-listen with --tls-dir (certificates made and renewed for you), then peer \
             again with the CA hash `trellisctl token` prints"
                .to_owned(),
        ));
    }

    // This cluster's own certificates, with --tls-dir.
    match &inputs.own {
        None => {}
        Some(Ok(own)) => {
            checked.certificates += 1 + own.services.len();
            out.extend(own_findings(&local, own, inputs.now));
        }
        Some(Err(why)) => out.push(finding(
            Severity::Warning,
            Check::NotChecked,
            &local,
            None,
            format!("this cluster's certificates could not be checked: {why}"),
            "give --tls-dir the directory the services use (their --tls-dir)".into(),
        )),
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
                    if stale.is_none() && t.path == "relayed" {
                        out.push(finding(
                            Severity::Warning,
                            Check::TunnelRelayed,
                            &local,
                            Some(Service::Gateway),
                            format!(
                                "the tunnel to {remote} is relayed through the hub that \
                                 introduced us: no direct WireGuard path works between the \
                                 two gateways (tried {} and the hub's view of it)",
                                t.remote_endpoint
                            ),
                            "typical when both clusters sit behind NATs that give each \
                             destination its own port (endpoint-dependent mapping, as on \
                             carrier-grade NAT or some cloud NAT gateways), or a firewall drops \
                             UDP between them; traffic works but crosses the hub. For a direct \
                             path, give one side a static (one-to-one) NAT or a port forward \
                             of its WireGuard port, or a NAT with endpoint-independent mapping; \
                             the pair switches back on its own once one works"
                                .into(),
                        ));
                    }
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
            (None, _) => {}
            (Some(Ok(theirs)), Some(ours)) => {
                out.extend(nat_findings(
                    &local,
                    &peer.cluster_id,
                    ours,
                    theirs.as_ref(),
                ));
            }
            (Some(Err(why)), _) => {
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
            (Some(Ok(_)), None) => {}
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
        match trellis_runtime::tls::pem_not_after(pem) {
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
