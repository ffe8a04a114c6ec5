//! The merge rules and the readiness marks of the import side.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::json;

use super::*;
use crate::model::{
    AddressType, Conditions, Endpoint, ExportedService, Port, Protocol, ServiceType,
};
use trellis_api::ClusterIdentity;

fn record(source: &str, origin: &str, port: i32) -> ReflectedRecord {
    ReflectedRecord {
        source: ClusterIdentity {
            id: ClusterId::parse("s", source).expect("id"),
            name: String::new(),
        },
        slice: Slice {
            namespace: "shop".into(),
            name: format!("web.{origin}"),
            service_name: "web".into(),
            address_type: AddressType::IPv4,
            endpoints: vec![Endpoint {
                addresses: vec!["10.1.0.7".into()],
                conditions: Conditions::default(),
                hostname: None,
                node_name: None,
                zone: None,
            }],
            ports: vec![Port {
                name: Some("http".into()),
                port: Some(port),
                protocol: Protocol::Tcp,
                app_protocol: None,
            }],
            labels: BTreeMap::from([(ORIGIN_LABEL.to_owned(), origin.to_owned())]),
            service: None,
        },
        generation: 1,
        object_name: None,
        update_time_nanos: 0,
    }
}

fn port(name: &str, number: i32) -> Port {
    Port {
        name: Some(name.into()),
        port: Some(number),
        protocol: Protocol::Tcp,
        app_protocol: None,
    }
}

/// `origin`'s export of shop/web, begun at `at`, with Service ports `ports`.
fn exported(origin: &str, at: i64, ports: Vec<Port>) -> ReflectedRecord {
    let mut r = record("b", origin, 80);
    r.slice.ports = ports.clone();
    r.slice.service = Some(ExportedService {
        ports,
        exported_at_nanos: at,
        ..ExportedService::default()
    });
    r
}

fn web(imports: &BTreeMap<(String, String), Import>) -> &Import {
    &imports[&("shop".to_owned(), "web".to_owned())]
}

#[test]
fn exports_of_one_service_merge_and_port_conflicts_are_named() {
    let agree = merge(&[record("b", "a", 80), record("b", "c", 80)]);
    let import = web(&agree);
    assert_eq!(import.clusters, vec!["a", "c"]);
    assert!(import.conflicts.is_empty());
    assert_eq!(import.condition()["status"], "False");
    let disagree = merge(&[record("b", "a", 80), record("b", "c", 8080)]);
    let import = web(&disagree);
    assert_eq!(
        import.service.ports,
        vec![port("http", 80)],
        "without export times, the first cluster by ID wins"
    );
    assert_eq!(import.conflicts.keys().collect::<Vec<_>>(), vec!["c"]);
    assert_eq!(import.condition()["status"], "True");
    assert_eq!(import.condition()["reason"], "PortConflict");
}

#[test]
fn ports_are_the_union_and_the_first_exporter_wins_a_name() {
    // z exported first although its ID sorts last.
    let imports = merge(&[
        exported("a", 20, vec![port("tcp", 43), port("stcp", 142)]),
        exported("z", 10, vec![port("tcp", 42), port("udp", 42)]),
    ]);
    let import = web(&imports);
    assert_eq!(import.first, "z");
    assert_eq!(
        import.service.ports,
        vec![port("stcp", 142), port("tcp", 42), port("udp", 42)]
    );
    assert_eq!(import.condition()["reason"], "PortConflict");
    // a's endpoints leave the port it serves at another number, keep the others.
    let a = exported("a", 20, vec![port("tcp", 43), port("stcp", 142)]);
    let served: Vec<_> = import
        .slice_for(&a)
        .ports
        .into_iter()
        .map(|p| p.name)
        .collect();
    assert_eq!(served, vec![Some("stcp".to_owned())]);
    let z = exported("z", 10, vec![port("tcp", 42), port("udp", 42)]);
    assert_eq!(import.slice_for(&z).ports.len(), 2);
}

#[test]
fn type_affinity_and_labels_follow_the_first_exporter() {
    let mut first = exported("c", 10, vec![port("tcp", 42)]);
    let mut second = exported("a", 20, vec![port("tcp", 42)]);
    if let (Some(f), Some(s)) = (first.slice.service.as_mut(), second.slice.service.as_mut()) {
        f.session_affinity = Some("ClientIP".into());
        f.exported_labels.insert("tier".into(), "web".into());
        s.service_type = ServiceType::Headless;
        s.exported_labels.insert("tier".into(), "db".into());
    }
    let imports = merge(&[second, first]);
    let import = web(&imports);
    assert!(!import.is_headless());
    assert_eq!(import.service.session_affinity.as_deref(), Some("ClientIP"));
    assert_eq!(import.service.exported_labels["tier"], "web");
    let kinds: Vec<_> = import.conflicts["a"].iter().copied().collect();
    assert_eq!(
        kinds,
        vec![
            ConflictKind::Type,
            ConflictKind::SessionAffinity,
            ConflictKind::Labels
        ]
    );
    assert_eq!(import.condition()["reason"], "TypeConflict");
    let spec = import.spec(&["10.96.0.9".to_owned()]);
    assert_eq!(spec["type"], "ClusterSetIP");
    assert_eq!(spec["ipFamilies"], json!(["IPv4"]));
    assert_eq!(spec["sessionAffinity"], "ClientIP");
}

#[test]
fn unreachable_addresses_are_marked_not_ready() {
    let a = ClusterId::parse("c", "a").expect("id");
    let reach = Reachability {
        ranges: vec![("10.1.0.0/16".parse().expect("net"), a.clone())],
        reachable: BTreeSet::new(),
    };
    let r = record("b", "a", 80);
    assert_eq!(
        reach.mark(&r.slice).endpoints[0].conditions.ready,
        Some(false)
    );
    let reach = Reachability {
        reachable: BTreeSet::from([a]),
        ..reach
    };
    assert_eq!(reach.mark(&r.slice).endpoints[0].conditions.ready, None);
}
