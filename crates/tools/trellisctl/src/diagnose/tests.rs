use std::time::{Duration, UNIX_EPOCH};

use trellis_api::pb::gateway;

use super::findings::replica_findings;
use super::*;
use crate::cli::OutputFormat;
use crate::identity::AddressesView;
use crate::output::render;
use crate::status::{
    ForeignClusterView, GatewayView, LocalIdentityView, TunnelEndpointView, TunnelView,
};

const NOW_SECS: u64 = 10_000;

fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(NOW_SECS)
}

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

fn serving(service: Service) -> ServiceHealthView {
    ServiceHealthView {
        service,
        address: format!(
            "127.0.0.1:{}",
            7100 + Service::ALL.iter().position(|s| *s == service).unwrap_or(0) + 1
        ),
        health: "serving".into(),
        error: None,
    }
}

fn hub_fc() -> types::ForeignCluster {
    types::ForeignCluster {
        identity: ident("hub"),
        kind: types::PeeringKind::Full.into(),
        full: Some(types::FullPeering {
            networking_enabled: true,
            addresses: Some(types::ServiceAddresses {
                ipam: "127.0.0.1:8104".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        conditions: vec![condition(Condition::Peered, types::ConditionStatus::True)],
        ..Default::default()
    }
}

fn hub_te() -> types::TunnelEndpoint {
    types::TunnelEndpoint {
        remote: ident("hub"),
        kind: types::PeeringKind::Full.into(),
        remote_endpoint: "127.0.0.1:51840".into(),
        generation: 2,
        ..Default::default()
    }
}

fn hub_tunnel(handshake_secs_ago: Option<u64>, applied: i64) -> gateway::TunnelStatus {
    gateway::TunnelStatus {
        remote: ident("hub"),
        kind: types::PeeringKind::Full.into(),
        state: gateway::TunnelState::Up.into(),
        remote_endpoint: "127.0.0.1:51840".into(),
        last_handshake_time: handshake_secs_ago.map(|ago| prost_types::Timestamp {
            seconds: i64::try_from(NOW_SECS - ago).unwrap_or(0),
            nanos: 0,
        }),
        applied_generation: applied,
        ..Default::default()
    }
}

/// Our IPAM record of the hub, and the hub's of us, agreeing.
fn records() -> (ipam_pb::ClusterSubnets, ipam_pb::ClusterSubnets) {
    let ours = ipam_pb::ClusterSubnets {
        cluster_id: "hub".into(),
        remote_pod_cidr: "10.0.0.0/16".into(),
        remote_pod_cidr_nat: "10.80.0.0/16".into(),
        remote_external_cidr: "10.201.0.0/16".into(),
        remote_external_cidr_nat: "10.201.0.0/16".into(),
        local_pod_cidr_nat: "10.81.0.0/16".into(),
        local_external_cidr_nat: "10.202.0.0/16".into(),
        ..Default::default()
    };
    let theirs = ipam_pb::ClusterSubnets {
        cluster_id: "leaf-a".into(),
        remote_pod_cidr: "10.0.0.0/16".into(),
        remote_pod_cidr_nat: "10.81.0.0/16".into(),
        remote_external_cidr: "10.202.0.0/16".into(),
        remote_external_cidr_nat: "10.202.0.0/16".into(),
        local_pod_cidr_nat: "10.80.0.0/16".into(),
        local_external_cidr_nat: "10.201.0.0/16".into(),
        ..Default::default()
    };
    (ours, theirs)
}

/// A healthy leaf-a peered with the hub, with a real data plane.
fn healthy() -> Inputs {
    let (ours, theirs) = records();
    Inputs {
        own: None,
        status: StatusView {
            services: Service::ALL.iter().map(|s| serving(*s)).collect(),
            identity: Some(LocalIdentityView {
                cluster_id: "leaf-a".into(),
                cluster_name: "leaf-a".into(),
                addresses: AddressesView::default(),
                plaintext_peering: false,
            }),
            foreign_clusters: Some(vec![ForeignClusterView::from_pb(&hub_fc())]),
            tunnel_endpoints: Some(vec![TunnelEndpointView::from_pb(&hub_te())]),
            gateway: Some(GatewayView {
                mode: "userspace".into(),
                endpoint: "127.0.0.1:51841".into(),
                public_key: "k".into(),
                replica: None,
            }),
            tunnels: Some(vec![TunnelView::from_pb(&hub_tunnel(Some(30), 2), now())]),
            unavailable: vec![],
        },
        foreign_clusters: Some(vec![hub_fc()]),
        ipam: Ok(IpamState {
            pools: vec!["10.0.0.0/8".into()],
            external_cidr: "10.202.0.0/16".into(),
            clusters: vec![ours],
            external_mappings: 3,
        }),
        peers: vec![PeerReport {
            cluster_id: "hub".into(),
            services: vec![ServiceHealthView {
                address: "127.0.0.1:8104".into(),
                ..serving(Service::Ipam)
            }],
            record_of_us: Some(Ok(Some(theirs))),
        }],
        now: now(),
    }
}

fn checks(view: &DiagnoseView) -> Vec<(Check, String, Option<Service>)> {
    view.findings
        .iter()
        .map(|f| (f.check, f.cluster.clone(), f.service))
        .collect()
}

#[test]
fn a_healthy_cluster_has_no_findings_and_says_so() {
    let view = analyze(&healthy());
    assert!(view.healthy, "{:#?}", view.findings);
    assert_eq!(view.checked.peers, ["hub"]);
    assert_eq!(view.checked.tunnels, 1);
    let table = render(&view, OutputFormat::Table).expect("renders");
    assert!(table.starts_with("leaf-a is healthy\n"), "{table}");
    let json: serde_json::Value =
        serde_json::from_str(&render(&view, OutputFormat::Json).expect("json")).expect("parses");
    assert_eq!(json["healthy"], true);
    assert_eq!(json["findings"], serde_json::json!([]));
}

#[test]
fn a_down_local_service_is_named_with_its_binary_and_flag() {
    let mut inputs = healthy();
    inputs.status.services[5] = ServiceHealthView {
        health: "unreachable".into(),
        error: Some("connection refused".into()),
        ..serving(Service::Gateway)
    };
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(Check::ServiceDown, "leaf-a".into(), Some(Service::Gateway))]
    );
    let f = &view.findings[0];
    assert!(
        f.problem.contains("trellis-gateway") && f.problem.contains("connection refused"),
        "{f:?}"
    );
    assert!(f.action.contains("--gateway"), "{f:?}");
    let table = render(&view, OutputFormat::Table).expect("renders");
    assert!(
        table.contains("1 problem found") && table.contains("service_down"),
        "{table}"
    );
}

#[test]
fn a_peered_cluster_without_a_tunnel_endpoint() {
    let mut inputs = healthy();
    inputs.status.tunnel_endpoints = Some(vec![]);
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(
            Check::MissingTunnelEndpoint,
            "leaf-a".into(),
            Some(Service::Broker)
        )]
    );
    assert!(view.findings[0].problem.contains("hub"));
    // A withdrawn record is not expected to have one.
    let mut withdrawn = hub_fc();
    withdrawn.conditions.push(condition(
        Condition::Withdrawn,
        types::ConditionStatus::True,
    ));
    inputs.foreign_clusters = Some(vec![withdrawn]);
    assert!(analyze(&inputs).healthy);
}

#[test]
fn a_tunnel_endpoint_the_gateway_has_not_applied() {
    let mut inputs = healthy();
    inputs.status.tunnels = Some(vec![TunnelView::from_pb(&hub_tunnel(Some(30), 1), now())]);
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(
            Check::TunnelNotApplied,
            "leaf-a".into(),
            Some(Service::Gateway)
        )]
    );
    assert!(
        view.findings[0].problem.contains("generation 1"),
        "{:?}",
        view.findings
    );
    inputs.status.tunnels = Some(vec![]);
    assert_eq!(checks(&analyze(&inputs))[0].0, Check::TunnelNotApplied);
}

#[test]
fn a_handshake_older_than_three_minutes_but_not_without_a_data_plane() {
    let mut inputs = healthy();
    inputs.status.tunnels = Some(vec![TunnelView::from_pb(&hub_tunnel(Some(181), 2), now())]);
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(
            Check::HandshakeStale,
            "leaf-a".into(),
            Some(Service::Gateway)
        )]
    );
    assert!(
        view.findings[0].problem.contains("3m"),
        "{:?}",
        view.findings
    );
    inputs.status.tunnels = Some(vec![TunnelView::from_pb(&hub_tunnel(Some(179), 2), now())]);
    assert!(analyze(&inputs).healthy);
    inputs.status.tunnels = Some(vec![TunnelView::from_pb(&hub_tunnel(None, 2), now())]);
    assert_eq!(checks(&analyze(&inputs))[0].0, Check::HandshakeStale);
    if let Some(g) = &mut inputs.status.gateway {
        g.mode = "none".into();
    }
    assert!(
        analyze(&inputs).healthy,
        "no data plane: no handshakes expected"
    );
}

#[test]
fn a_relayed_tunnel_is_explained_as_a_warning() {
    let mut inputs = healthy();
    let mut relayed = hub_tunnel(Some(30), 2);
    relayed.path = trellis_api::pb::gateway::TunnelPath::Relayed.into();
    inputs.status.tunnels = Some(vec![TunnelView::from_pb(&relayed, now())]);
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(
            Check::TunnelRelayed,
            "leaf-a".into(),
            Some(Service::Gateway)
        )]
    );
    assert_eq!(view.findings[0].severity, Severity::Warning);
    assert!(
        view.findings[0].action.contains("endpoint-dependent"),
        "{:?}",
        view.findings
    );
    relayed.path = trellis_api::pb::gateway::TunnelPath::Direct.into();
    inputs.status.tunnels = Some(vec![TunnelView::from_pb(&relayed, now())]);
    assert!(analyze(&inputs).healthy);
}

#[test]
fn plaintext_peering_is_a_warning_that_says_how_to_turn_tls_on() {
    let mut inputs = healthy();
    if let Some(identity) = inputs.status.identity.as_mut() {
        identity.plaintext_peering = true;
    }
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(
            Check::PlaintextPeering,
            "leaf-a".into(),
            Some(Service::Discovery)
        )]
    );
    assert_eq!(view.findings[0].severity, Severity::Warning);
    assert!(
        view.findings[0].action.contains("--tls-dir"),
        "{:?}",
        view.findings
    );
}

#[test]
fn nat_views_that_disagree_name_who_decided_what() {
    let mut inputs = healthy();
    if let Some(Ok(Some(theirs))) = &mut inputs.peers[0].record_of_us {
        theirs.remote_pod_cidr_nat = "10.99.0.0/16".into();
    }
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(Check::NatViewMismatch, "hub".into(), Some(Service::Ipam))]
    );
    let problem = &view.findings[0].problem;
    assert!(
        problem.contains("hub addresses leaf-a's pod CIDR as 10.99.0.0/16")
            && problem.contains("leaf-a believes it is 10.81.0.0/16"),
        "{problem}"
    );
    // The peer has no record of us at all: it may have unpeered us without the notice
    // arriving, and the way out is named.
    inputs.peers[0].record_of_us = Some(Ok(None));
    let view = analyze(&inputs);
    assert_eq!(checks(&view)[0].0, Check::NatViewMismatch);
    assert!(
        view.findings[0]
            .action
            .contains("`trellisctl unpeer hub` here and peering again"),
        "{:?}",
        view.findings[0]
    );
}

#[test]
fn a_down_peer_service_is_named_and_its_views_not_compared() {
    let mut inputs = healthy();
    inputs.peers[0].services[0].health = "unreachable".into();
    inputs.peers[0].services[0].error = Some("connection refused".into());
    inputs.peers[0].record_of_us = Some(Err("connection refused".into()));
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(Check::PeerServiceDown, "hub".into(), Some(Service::Ipam))]
    );
    assert!(
        view.findings[0].problem.contains("trellis-ipam"),
        "{:?}",
        view.findings
    );
}

#[test]
fn a_nearly_full_pool_and_external_cidr() {
    let mut inputs = healthy();
    if let Ok(ipam) = &mut inputs.ipam {
        ipam.pools = vec!["10.80.0.0/15".into()];
        // 10.80.0.0/16 is ours of the hub; one more /16 fills the /15.
        let mut other = ipam.clusters[0].clone();
        other.cluster_id = "leaf-c".into();
        other.remote_pod_cidr_nat = "10.81.0.0/16".into();
        ipam.clusters.push(other);
        ipam.external_cidr = "10.202.0.0/29".into();
        ipam.external_mappings = 6;
    }
    let view = analyze(&inputs);
    let found: Vec<Check> = view.findings.iter().map(|f| f.check).collect();
    assert_eq!(
        found,
        [Check::PoolNearlyExhausted, Check::PoolNearlyExhausted],
        "{:#?}",
        view.findings
    );
    assert!(
        view.findings
            .iter()
            .any(|f| f.problem.contains("10.80.0.0/15 is 100% used"))
    );
    assert!(
        view.findings
            .iter()
            .any(|f| f.problem.contains("10.202.0.0/29 is 100% used"))
    );
}

#[test]
fn a_pinned_ca_close_to_expiry() {
    let ca = trellis_runtime::tls::ClusterCa::generate("hub").expect("ca");
    let mut inputs = healthy();
    let mut fc = hub_fc();
    if let Some(full) = &mut fc.full {
        full.ca_certificate = ca.cert_pem().to_owned();
    }
    inputs.foreign_clusters = Some(vec![fc]);
    // Ten years ahead: fine today.
    inputs.now = SystemTime::now();
    assert!(analyze(&inputs).healthy);
    assert_eq!(analyze(&inputs).checked.certificates, 1);
    // Ten days before it expires, and after.
    let expiry = trellis_runtime::tls::pem_not_after(ca.cert_pem()).expect("parses");
    inputs.now = expiry - Duration::from_secs(10 * 86_400);
    let view = analyze(&inputs);
    assert_eq!(checks(&view)[0].0, Check::CertificateExpiry);
    assert_eq!(view.findings[0].severity, Severity::Warning);
    inputs.now = expiry + Duration::from_secs(1);
    assert_eq!(analyze(&inputs).findings[0].severity, Severity::Error);
}

#[test]
fn a_tampered_learned_view_on_the_peer_names_our_decision() {
    let mut inputs = healthy();
    if let Some(Ok(Some(theirs))) = &mut inputs.peers[0].record_of_us {
        theirs.local_pod_cidr_nat = "10.98.0.0/16".into();
    }
    let view = analyze(&inputs);
    assert_eq!(
        checks(&view),
        [(Check::NatViewMismatch, "hub".into(), Some(Service::Ipam))]
    );
    let problem = &view.findings[0].problem;
    assert!(
        problem.contains("leaf-a addresses hub's pod CIDR as 10.80.0.0/16")
            && problem.contains("hub believes it is 10.98.0.0/16"),
        "{problem}"
    );
}

#[test]
fn a_standby_that_is_not_warm_or_silent_and_a_missing_active_are_findings() {
    use crate::status::{ReplicaPeerView, ReplicaView};
    let replica = ReplicaView {
        replica: "n1".into(),
        active: false,
        epoch: 0,
        active_replica: String::new(),
        warm: false,
        peers: vec![
            ReplicaPeerView {
                replica: "n0".into(),
                since_heartbeat_ms: 5_000,
                active: true,
                warm: true,
            },
            ReplicaPeerView {
                replica: "n2".into(),
                since_heartbeat_ms: 30,
                active: false,
                warm: false,
            },
        ],
    };
    let found = replica_findings("leaf-a", &replica);
    let problems: Vec<&str> = found.iter().map(|f| f.problem.as_str()).collect();
    assert_eq!(found.len(), 4, "{problems:#?}");
    assert!(found.iter().all(|f| f.check == Check::GatewayReplica));
    assert!(
        problems[0].contains("knows no active replica"),
        "{problems:#?}"
    );
    assert!(problems[1].contains("n1 is not warm"), "{problems:#?}");
    assert!(
        problems[2].contains("not heard replica n0 for 5000 ms"),
        "{problems:#?}"
    );
    assert!(problems[3].contains("n2 is not warm"), "{problems:#?}");
    let healthy = ReplicaView {
        active: true,
        epoch: 3,
        active_replica: "n1".into(),
        warm: true,
        peers: vec![ReplicaPeerView {
            replica: "n0".into(),
            since_heartbeat_ms: 40,
            active: false,
            warm: true,
        }],
        ..replica
    };
    assert!(replica_findings("leaf-a", &healthy).is_empty());
}

fn own(services: Vec<OwnCertificate>, ca_days: u64, unannounced: bool) -> OwnCertificates {
    OwnCertificates {
        dir: "/var/lib/trellis/tls".into(),
        ca_not_after: now() + Duration::from_secs(ca_days * 86_400),
        services,
        move_unannounced: unannounced,
    }
}

fn cert(
    service: &str,
    issued_hours_ago: u64,
    lifetime_hours: u64,
    current: bool,
) -> OwnCertificate {
    let not_before = now() - Duration::from_secs(issued_hours_ago * 3600);
    OwnCertificate {
        service: service.into(),
        not_before,
        not_after: not_before + Duration::from_secs(lifetime_hours * 3600),
        of_current_ca: current,
    }
}

#[test]
fn own_certificates_overdue_of_an_old_ca_or_an_unannounced_move_are_findings() {
    let mut inputs = healthy();
    // A 7-day certificate 2 days in, with a CA years away: nothing to say.
    inputs.own = Some(Ok(own(vec![cert("broker", 48, 168, true)], 3650, false)));
    let view = analyze(&inputs);
    assert!(view.healthy, "{:#?}", view.findings);
    assert_eq!(view.checked.certificates, 2, "the CA and the broker's");

    inputs.own = Some(Ok(own(
        vec![
            // 6 of 7 days gone: renewal (at a third left) is overdue.
            cert("broker", 144, 168, true),
            // Expired.
            cert("ipam", 200, 168, true),
            // Fresh, but of the CA before a move.
            cert("forwarder", 1, 168, false),
        ],
        20,
        true,
    )));
    let view = analyze(&inputs);
    let found: Vec<(Severity, Check, String)> = view
        .findings
        .iter()
        .map(|f| (f.severity, f.check, f.problem.clone()))
        .collect();
    let has = |severity: Severity, check: Check, text: &str| {
        found
            .iter()
            .any(|(s, c, p)| *s == severity && *c == check && p.contains(text))
    };
    assert!(
        has(Severity::Error, Check::OwnCertificate, "trellis-ipam"),
        "{found:#?}"
    );
    assert!(
        has(Severity::Warning, Check::OwnCertificate, "trellis-broker"),
        "{found:#?}"
    );
    assert!(
        has(
            Severity::Warning,
            Check::OwnCertificate,
            "trellis-forwarder"
        ),
        "{found:#?}"
    );
    assert!(
        has(
            Severity::Warning,
            Check::OwnCertificate,
            "not reached every peer"
        ),
        "{found:#?}"
    );
    assert!(
        has(Severity::Warning, Check::CertificateExpiry, "in 20 days"),
        "{found:#?}"
    );
    assert_eq!(found.len(), 5, "{found:#?}");
    assert!(
        view.findings.iter().any(|f| f
            .action
            .contains("certs rotate-ca --tls-dir /var/lib/trellis/tls")),
        "{:#?}",
        view.findings
    );

    inputs.own = Some(Err("cannot read /nowhere/ca/ca.pem".into()));
    let view = analyze(&inputs);
    assert_eq!(checks(&view), [(Check::NotChecked, "leaf-a".into(), None)]);
}
