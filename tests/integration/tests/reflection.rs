//! Each port lists by reflection exactly what it serves (its services, health and reflection),
//! not every service the binary carries descriptors for, and a method it does not serve is
//! answered `UNIMPLEMENTED` with a message naming what the port serves (issue 34). grpcurl,
//! the tool users call the APIs with, does the asking. Skipped loudly without grpcurl (CI has
//! it: `make setup` installs it).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Command;

use trellis_integration::cluster::InProcessCluster;
use trellis_testkit::require_tool;

/// Listed on every port beside its own services.
const ALWAYS: [&str; 3] = [
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

fn grpcurl(tool: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(tool)
        .args(args)
        .output()
        .expect("grpcurl runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_port_lists_what_it_serves_and_names_it_to_a_caller_at_the_wrong_port() {
    let Some(tool) = require_tool("grpcurl") else {
        return;
    };
    let cluster = InProcessCluster::start_with_endpoints("solo", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("cluster starts");
    let s = &cluster.services;
    let ports: [(&str, SocketAddr, &[&str]); 6] = [
        ("ipam", s.ipam, &["trellis.ipam.v1.Ipam"]),
        ("gateway", s.gateway, &["trellis.gateway.v1.Gateway"]),
        (
            "discovery",
            s.discovery,
            &["trellis.discovery.v1.Discovery"],
        ),
        ("forwarder", s.forwarder, &["trellis.peering.v1.Forwarder"]),
        ("broker", s.broker, &["trellis.peering.v1.Broker"]),
        (
            "endpoints",
            s.endpoints,
            &["trellis.endpoints.v1.EndpointMapper"],
        ),
    ];
    for (name, addr, served) in ports {
        let out = grpcurl(&tool, &["-plaintext", &addr.to_string(), "list"]);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let listed: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        let expected: BTreeSet<String> = served
            .iter()
            .chain(ALWAYS.iter())
            .map(|s| (*s).to_owned())
            .collect();
        // The served service must be listed: the port's own set, nothing of the others.
        assert!(
            served.iter().all(|s| listed.contains(*s)),
            "{name} does not list its own service: {listed:?}"
        );
        assert_eq!(listed, expected, "{name} lists another port's services");
    }

    // A caller at the wrong port: the gateway's method asked of the IPAM.
    let out = grpcurl(
        &tool,
        &[
            "-plaintext",
            "-d",
            "{}",
            &s.ipam.to_string(),
            "trellis.gateway.v1.Gateway/ListTunnels",
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "answered: {stderr}");
    assert!(
        stderr.contains("Unimplemented") && stderr.contains("trellis.ipam.v1.Ipam"),
        "the error does not say which service this port is: {stderr}"
    );
}
