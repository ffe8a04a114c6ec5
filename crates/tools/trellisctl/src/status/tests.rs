use std::time::{Duration, UNIX_EPOCH};

use trellis_api::pb::{gateway, types};

use super::*;
use crate::cli::OutputFormat;
use crate::output::{Report, render};

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
            ca_certificate: HUB_CA.with(|ca| ca.cert_pem().to_owned()),
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
        stateless_wire: true,
        generation: 3,
        ..Default::default()
    };
    let tunnel = gateway::TunnelStatus {
        remote: ident("leaf-c"),
        kind: types::PeeringKind::Induced.into(),
        state: gateway::TunnelState::Up.into(),
        path: gateway::TunnelPath::Relayed.into(),
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
            plaintext_peering: false,
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

thread_local! {
    /// The hub's CA, pinned in the sample's full peering.
    static HUB_CA: trellis_runtime::tls::ClusterCa =
        trellis_runtime::tls::ClusterCa::generate("hub").expect("a CA");
}

#[test]
fn table_shows_kinds_origins_nat_views_and_tunnel_health() {
    let text = sample().table();
    let pinned = HUB_CA.with(trellis_runtime::tls::ClusterCa::fingerprint);
    let hub_row = format!(
        "hub      hub     full     -       peering       yes     {}  Peered=True",
        &pinned[..16]
    );
    for expected in [
        "endpoints  127.0.0.1:7105  unreachable  connection refused",
        "cluster id    leaf-a",
        "peering       mutual TLS",
        &hub_row,
        "leaf-c   leaf-c  induced  hub     neighborhood  no      -                 InducedPeering=True",
        "10.0.0.0/16 -> 10.80.0.0/16",
        "10.201.0.0/16 (as is)",
        "10.81.0.0/16 / 10.202.0.0/16",
        "leaf-c  induced  up     relayed  12s ago         2.0 KiB  10 B  1.50 ms",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    // Under the stateless wire convention the sender translates.
    assert!(
        text.lines()
            .any(|l| l.starts_with("leaf-c  induced  hub") && l.contains(" sender ")),
        "{text}"
    );
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
        serde_json::from_str(&render(&view, OutputFormat::Json).expect("renders")).expect("json");
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
    assert_eq!(tunnel["path"], "relayed");
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
        text.contains("n1 (standby, NOT warm, active: n0 (epoch 4)); n0 active heard 40 ms ago"),
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
