//! The checks with reasoning of their own, each a pure function returning its findings:
//! gateway replicas that could not take over at once, certificates close to expiry (the peers'
//! pinned CAs, and this cluster's own with `--tls-dir`), remap pools and the external CIDR
//! nearly full, and NAT views that disagree across a peering.

use std::time::SystemTime;

use ipnet::IpNet;
use trellis_api::pb::ipam as ipam_pb;

use super::{
    Check, EXPIRY_WARNING, Finding, IpamState, NEARLY_FULL, OwnCertificates, Severity, finding,
};
use crate::service::Service;

/// A heartbeat older than this means the replica could not be followed or take over.
const REPLICA_SILENT_MS: u64 = 1_000;

/// What keeps a failover from being immediate, as seen from the replica that answered.
pub(super) fn replica_findings(local: &str, replica: &crate::status::ReplicaView) -> Vec<Finding> {
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

pub(super) fn expiry_finding(
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

pub(super) fn pool_findings(local: &str, ipam: &IpamState) -> Vec<Finding> {
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
pub(super) fn nat_findings(
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
                "{peer} may have ended the peering without its unpeering notice reaching \
                 {local}, or lost its records: check {peer}'s broker logs for {local}; for a \
                 full peer, `trellisctl unpeer {peer}` here and peering again rebuilds both \
                 records"
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

/// This cluster's own certificates (`--tls-dir`): the CA near its end, a service certificate
/// whose renewal is overdue (less than a quarter of its lifetime left: renewal happens at a
/// third) or that is still of the CA before a move, and a move not announced to every peer.
pub(super) fn own_findings(local: &str, own: &OwnCertificates, now: SystemTime) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(f) = own_ca_finding(local, own, now) {
        out.push(f);
    }
    for cert in &own.services {
        let binary = format!("trellis-{}", cert.service);
        let lifetime = cert
            .not_after
            .duration_since(cert.not_before)
            .unwrap_or_default();
        match cert.not_after.duration_since(now) {
            Err(_) => out.push(finding(
                Severity::Error,
                Check::OwnCertificate,
                local,
                None,
                format!(
                    "the certificate of {binary} in {} has expired: peers refuse its calls",
                    own.dir
                ),
                format!(
                    "check that {binary} runs with --tls-dir {} and can write there; a restart \
                     issues a new certificate",
                    own.dir
                ),
            )),
            Ok(left) if left < lifetime / 4 => out.push(finding(
                Severity::Warning,
                Check::OwnCertificate,
                local,
                None,
                format!(
                    "the certificate of {binary} in {} has {} of its {} left and was not renewed \
                     (renewal happens when a third is left)",
                    own.dir,
                    crate::units::duration(left),
                    crate::units::duration(lifetime)
                ),
                format!(
                    "check {binary}'s log for renewal errors and that it runs with --tls-dir {}",
                    own.dir
                ),
            )),
            Ok(_) => {}
        }
        if !cert.of_current_ca {
            out.push(finding(
                Severity::Warning,
                Check::OwnCertificate,
                local,
                None,
                format!(
                    "the certificate of {binary} in {} is not of the cluster's CA there (it is \
                     of the CA before a move, or of another): {binary} has not renewed since",
                    own.dir
                ),
                format!(
                    "check that {binary} runs with --tls-dir {}; it renews within --tls-reload \
                     seconds of a move",
                    own.dir
                ),
            ));
        }
    }
    if own.move_unannounced {
        out.push(finding(
            Severity::Warning,
            Check::OwnCertificate,
            local,
            Some(Service::Broker),
            "the move to the cluster's new CA has not reached every peer yet (they verify its \
             certificates through the cross certificate meanwhile)"
                .to_owned(),
            format!(
                "run `trellisctl certs rotate-ca --tls-dir {}` again: it goes on with this move",
                own.dir
            ),
        ));
    }
    out
}

fn own_ca_finding(local: &str, own: &OwnCertificates, now: SystemTime) -> Option<Finding> {
    let when = crate::units::rfc3339(Some(&prost_types::Timestamp::from(own.ca_not_after)))
        .unwrap_or_else(|| "an unreadable date".into());
    let action = format!(
        "move the cluster to a new CA while peered: `trellisctl certs rotate-ca --tls-dir {}`",
        own.dir
    );
    match own.ca_not_after.duration_since(now) {
        Err(_) => Some(finding(
            Severity::Error,
            Check::CertificateExpiry,
            local,
            None,
            format!("this cluster's CA in {} expired on {when}", own.dir),
            action,
        )),
        Ok(left) if left < EXPIRY_WARNING => Some(finding(
            Severity::Warning,
            Check::CertificateExpiry,
            local,
            None,
            format!(
                "this cluster's CA in {} expires on {when}, in {} days",
                own.dir,
                left.as_secs() / 86_400
            ),
            action,
        )),
        Ok(_) => None,
    }
}
