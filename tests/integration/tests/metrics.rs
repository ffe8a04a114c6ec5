//! Prometheus metrics (issue 19): every service of the default 3-cluster lab (the real
//! `trellis-lab` binary) serves `/metrics` in both exposition formats, chosen by `Accept`:
//! each scrape is parsed by the Python `prometheus_client` parser for the content type it
//! came with (scripts/parse-metrics.py), the text format also passes `promtool check metrics`,
//! and both carry the same counters, typed as counters. The gRPC server metrics carry
//! service, method and code labels, the broker's `trellis_tunnel_endpoints` equals what its
//! ListTunnelEndpoints returns, and discovery's ForeignCluster gauges (by kind, by condition)
//! equal what its ListForeignClusters returns, and the forwarder's relays by state what its
//! ListRelays returns, and the IPAM's pool and external-address gauges what its
//! GetLocalSubnets, ListClusterSubnets and ListEndpointMappings return. Every service times its
//! store operations (`trellis_store_operation_seconds`), and every broker counts its
//! cluster-facing SubmitNetworkConfig calls on the client side (`grpc_client_handled_total`).

use std::collections::BTreeMap;
use std::time::Duration;

use trellis_api::pb::discovery::ListForeignClustersRequest;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{
    GetLocalSubnetsRequest, ListClusterSubnetsRequest, ListEndpointMappingsRequest,
};
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{ListRelaysRequest, ListTunnelEndpointsRequest, RelayState};
use trellis_api::pb::types::{ConditionStatus, PeeringKind};
use trellis_integration::lab::RunningLab;
use trellis_integration::prom::{
    Sample, parse, parse_openmetrics, parser_python, promtool_check, scrape, scrape_accepting,
};

/// What Prometheus sends when it may have OpenMetrics.
const OPENMETRICS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,\
     application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lab_service_serves_prometheus_metrics_and_domain_gauges_match_the_list_rpcs() {
    let Some(python) = parser_python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let topology_path = dir.path().join("topology.json");
    let (_lab, _) = RunningLab::start(
        &[
            "--base-port".as_ref(),
            "0".as_ref(),
            "--topology-file".as_ref(),
            topology_path.as_os_str(),
        ],
        Duration::from_secs(240),
    );
    let topology: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&topology_path).expect("topology file"))
            .expect("json");
    let clusters = topology["clusters"].as_array().expect("clusters");
    assert_eq!(clusters.len(), 3);
    for cluster in clusters {
        let id = cluster["id"].as_str().expect("id");
        let metrics = cluster["metrics"].as_object().expect("metrics addresses");
        let names: Vec<&str> = metrics.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "broker",
                "discovery",
                "endpoints",
                "forwarder",
                "gateway",
                "ipam"
            ],
            "{id}"
        );
        for (service, addr) in metrics {
            let addr = addr.as_str().expect("addr");
            // Every scrape parses, in the format its content type names, and is complete; a
            // service no one has called yet has no gRPC samples (the encoder omits empty
            // families).
            let (content_type, openmetrics) = scrape_accepting(addr, OPENMETRICS_ACCEPT);
            assert!(
                content_type.starts_with("application/openmetrics-text"),
                "{id}/{service}: {content_type}"
            );
            assert!(
                openmetrics.ends_with("# EOF\n"),
                "{id}/{service}: truncated scrape"
            );
            let from_openmetrics = parse_openmetrics(&python, &openmetrics);
            let (content_type, text) = scrape_accepting(addr, "text/plain;version=0.0.4");
            assert!(
                content_type.starts_with("text/plain; version=0.0.4"),
                "{id}/{service}: {content_type}"
            );
            let samples = parse(&python, &text);
            promtool_check(&text);
            // The same counters, typed as counters, in both: read as the text format it says
            // it is, a counter's type and help name its samples (`_total`).
            for (format, parsed) in [("text", &samples), ("openmetrics", &from_openmetrics)] {
                let untyped: Vec<&str> = parsed
                    .iter()
                    .filter(|s| s.name.ends_with("_total") && s.kind != "counter")
                    .map(|s| s.name.as_str())
                    .collect();
                assert!(
                    untyped.is_empty(),
                    "{id}/{service} ({format}): counters without their type: {untyped:?}"
                );
            }
            let counters = |parsed: &[Sample]| -> Vec<String> {
                let mut names: Vec<String> = parsed
                    .iter()
                    .filter(|s| s.kind == "counter" && s.name.ends_with("_total"))
                    .map(|s| s.name.clone())
                    .collect();
                names.sort();
                names.dedup();
                names
            };
            assert!(
                counters(&samples)
                    .iter()
                    .any(|n| n.starts_with("trellis_store_") || n.starts_with("grpc_")),
                "{id}/{service}: no counter in {samples:?}"
            );
            assert_eq!(
                counters(&samples),
                counters(&from_openmetrics),
                "{id}/{service}: the formats disagree"
            );
            // Every lab service keeps state: its store operations are timed (the decorator
            // the runtime puts around every service's store).
            let store_ops: f64 = samples
                .iter()
                .filter(|s| s.name == "trellis_store_operation_seconds_count")
                .map(|s| s.value)
                .sum();
            assert!(
                store_ops > 0.0,
                "{id}/{service}: no store operation timed: {samples:?}"
            );
        }

        // Every cluster is in a full peering, and its broker sent its NetworkConfig to that
        // peer's broker (a cluster-facing call): counted on the client side with code OK.
        let broker_samples = parse(&python, &scrape(metrics["broker"].as_str().expect("addr")));
        let submitted = broker_samples
            .iter()
            .find(|s| {
                s.name == "grpc_client_handled_total"
                    && s.labels.get("grpc_service").map(String::as_str)
                        == Some("trellis.peering.v1.Broker")
                    && s.labels.get("grpc_method").map(String::as_str)
                        == Some("SubmitNetworkConfig")
                    && s.labels.get("grpc_code").map(String::as_str) == Some("OK")
            })
            .unwrap_or_else(|| {
                panic!("{id}: no client-side SubmitNetworkConfig OK: {broker_samples:?}")
            });
        assert!(submitted.value >= 1.0, "{submitted:?}");
        assert!(
            broker_samples
                .iter()
                .any(|s| s.name == "grpc_client_handling_seconds_count"
                    && s.labels.get("grpc_method").map(String::as_str)
                        == Some("SubmitNetworkConfig")
                    && s.value >= 1.0),
            "{id}: no client latency histogram"
        );
        // No label names a peer: the series are bounded by the API, not the mesh.
        for s in broker_samples
            .iter()
            .filter(|s| s.name.starts_with("grpc_client_"))
        {
            let keys: Vec<&str> = s.labels.keys().map(String::as_str).collect();
            assert!(
                keys.iter()
                    .all(|k| ["grpc_service", "grpc_method", "grpc_code", "le"].contains(k)),
                "{id}: unexpected label in {s:?}"
            );
        }

        // The broker answers a ListTunnelEndpoints (the lab follows the brokers with watches):
        // counted with method and code.
        let grpc = cluster["services"]["broker"].as_str().expect("broker");
        BrokerClient::connect(format!("http://{grpc}"))
            .await
            .expect("broker connects")
            .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
            .await
            .expect("lists");
        let broker_addr = metrics["broker"].as_str().expect("addr");
        let samples = parse(&python, &scrape(broker_addr));
        let handled = samples
            .iter()
            .find(|s| {
                s.name == "grpc_server_handled_total"
                    && s.labels.get("grpc_service").map(String::as_str)
                        == Some("trellis.peering.v1.Broker")
                    && s.labels.get("grpc_method").map(String::as_str)
                        == Some("ListTunnelEndpoints")
                    && s.labels.get("grpc_code").map(String::as_str) == Some("OK")
            })
            .unwrap_or_else(|| panic!("{id}: no handled ListTunnelEndpoints: {samples:?}"));
        assert!(handled.value >= 1.0, "{handled:?}");
        assert!(
            samples
                .iter()
                .any(|s| s.name == "grpc_server_handling_seconds_count"
                    && s.labels.get("grpc_method").map(String::as_str)
                        == Some("ListTunnelEndpoints")),
            "{id}: no latency histogram"
        );

        // trellis_tunnel_endpoints{kind} equals what ListTunnelEndpoints returns now.
        let grpc = cluster["services"]["broker"].as_str().expect("broker");
        let mut broker = BrokerClient::connect(format!("http://{grpc}"))
            .await
            .expect("broker connects");
        let listed = broker
            .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
            .await
            .expect("lists")
            .into_inner()
            .tunnel_endpoints;
        let samples = parse(&python, &scrape(broker_addr));
        for (kind, name) in [
            (PeeringKind::Full, "full"),
            (PeeringKind::Induced, "induced"),
        ] {
            let want = listed.iter().filter(|t| t.kind == kind as i32).count();
            let got = samples
                .iter()
                .find(|s| {
                    s.name == "trellis_tunnel_endpoints"
                        && s.labels.get("kind").map(String::as_str) == Some(name)
                })
                .unwrap_or_else(|| panic!("{id}: no trellis_tunnel_endpoints{{kind={name}}}"));
            assert_eq!(got.value, want as f64, "{id}: {name} tunnels");
        }
        assert!(
            !listed.is_empty(),
            "{id}: the lab converged without tunnels"
        );

        // Discovery: trellis_foreign_clusters{kind} and the per-condition counts equal what
        // ListForeignClusters returns now.
        let grpc = cluster["services"]["discovery"]
            .as_str()
            .expect("discovery");
        let mut discovery = DiscoveryClient::connect(format!("http://{grpc}"))
            .await
            .expect("discovery connects");
        let records = discovery
            .list_foreign_clusters(ListForeignClustersRequest::default())
            .await
            .expect("lists")
            .into_inner()
            .foreign_clusters;
        let samples = parse(
            &python,
            &scrape(metrics["discovery"].as_str().expect("addr")),
        );
        let kind_name = |kind: i32| {
            if kind == PeeringKind::Full as i32 {
                "full"
            } else {
                "induced"
            }
        };
        let mut want: BTreeMap<(String, String, String), f64> = BTreeMap::new();
        for (kind, name) in [
            (PeeringKind::Full, "full"),
            (PeeringKind::Induced, "induced"),
        ] {
            let n = records.iter().filter(|r| r.kind == kind as i32).count();
            let got = samples
                .iter()
                .find(|s| s.name == "trellis_foreign_clusters" && s.has("kind", name))
                .unwrap_or_else(|| panic!("{id}: no trellis_foreign_clusters{{kind={name}}}"));
            assert_eq!(got.value, n as f64, "{id}: {name} ForeignClusters");
        }
        for r in &records {
            for c in &r.conditions {
                let status = match ConditionStatus::try_from(c.status) {
                    Ok(ConditionStatus::True) => "True",
                    Ok(ConditionStatus::False) => "False",
                    _ => "Unknown",
                };
                *want
                    .entry((
                        kind_name(r.kind).to_owned(),
                        c.r#type.clone(),
                        status.to_owned(),
                    ))
                    .or_default() += 1.0;
            }
        }
        let got: BTreeMap<(String, String, String), f64> = samples
            .iter()
            .filter(|s| s.name == "trellis_foreign_cluster_conditions")
            .map(|s| {
                (
                    (
                        s.labels["kind"].clone(),
                        s.labels["condition"].clone(),
                        s.labels["status"].clone(),
                    ),
                    s.value,
                )
            })
            .collect();
        assert!(!want.is_empty(), "{id}: ForeignClusters without conditions");
        assert_eq!(got, want, "{id}: ForeignCluster conditions");

        // Forwarder: trellis_forwarder_relays{state} equals what ListRelays returns now.
        let grpc = cluster["services"]["forwarder"]
            .as_str()
            .expect("forwarder");
        let relays = ForwarderClient::connect(format!("http://{grpc}"))
            .await
            .expect("forwarder connects")
            .list_relays(ListRelaysRequest::default())
            .await
            .expect("lists")
            .into_inner()
            .relays;
        let samples = parse(
            &python,
            &scrape(metrics["forwarder"].as_str().expect("addr")),
        );
        for (state, name) in [
            (RelayState::Pending, "pending"),
            (RelayState::Delivered, "delivered"),
            (RelayState::StatusPending, "status_pending"),
            (RelayState::Failed, "failed"),
            (RelayState::Withdrawing, "withdrawing"),
        ] {
            let n = relays.iter().filter(|r| r.state == state as i32).count();
            let got = samples
                .iter()
                .find(|s| s.name == "trellis_forwarder_relays" && s.has("state", name))
                .unwrap_or_else(|| panic!("{id}: no trellis_forwarder_relays{{state={name}}}"));
            assert_eq!(got.value, n as f64, "{id}: {name} relays");
        }

        // IPAM: per pool, the addresses of the NAT'ed ranges inside it are used, the rest free;
        // external addresses used are the endpoint mappings.
        let grpc = cluster["services"]["ipam"].as_str().expect("ipam");
        let mut ipam = IpamClient::connect(format!("http://{grpc}"))
            .await
            .expect("ipam connects");
        let local = ipam
            .get_local_subnets(GetLocalSubnetsRequest::default())
            .await
            .expect("local subnets")
            .into_inner();
        let ranges: Vec<ipnet::IpNet> = ipam
            .list_cluster_subnets(ListClusterSubnetsRequest::default())
            .await
            .expect("cluster subnets")
            .into_inner()
            .clusters
            .iter()
            .flat_map(|c| [&c.remote_pod_cidr_nat, &c.remote_external_cidr_nat])
            .filter(|r| !r.is_empty())
            .map(|r| r.parse().expect("cidr"))
            .collect();
        let mappings = ipam
            .list_endpoint_mappings(ListEndpointMappingsRequest::default())
            .await
            .expect("mappings")
            .into_inner()
            .mappings;
        let samples = parse(&python, &scrape(metrics["ipam"].as_str().expect("addr")));
        let gauge = |name: &str, labels: &[(&str, &str)]| {
            samples
                .iter()
                .find(|s| s.name == name && labels.iter().all(|(k, v)| s.has(k, v)))
                .unwrap_or_else(|| panic!("{id}: no {name}{labels:?}"))
                .value
        };
        let addresses =
            |net: &ipnet::IpNet| 2f64.powi(i32::from(net.max_prefix_len() - net.prefix_len()));
        assert!(!local.pools.is_empty(), "{id}: no pools");
        let mut remapped = 0;
        for pool in &local.pools {
            let net: ipnet::IpNet = pool.parse().expect("pool");
            let inside: Vec<&ipnet::IpNet> = ranges.iter().filter(|r| net.contains(*r)).collect();
            let used = inside.iter().fold(0.0, |n, r| n + addresses(r));
            remapped += inside.len();
            let p = pool.as_str();
            assert_eq!(
                gauge(
                    "trellis_ipam_pool_addresses",
                    &[("pool", p), ("state", "used")]
                ),
                used,
                "{id} {pool}"
            );
            assert_eq!(
                gauge(
                    "trellis_ipam_pool_addresses",
                    &[("pool", p), ("state", "free")]
                ),
                addresses(&net) - used,
                "{id} {pool}"
            );
            assert_eq!(
                gauge("trellis_ipam_pool_ranges", &[("pool", p)]),
                inside.len() as f64,
                "{id} {pool}"
            );
        }
        // The lab's clusters share pod CIDRs: every one remaps some peer into its pools.
        assert!(remapped > 0, "{id}: no range in any pool");
        assert_eq!(
            gauge("trellis_ipam_external_addresses", &[("state", "used")]),
            mappings.len() as f64,
            "{id}: external addresses used"
        );
    }
}
