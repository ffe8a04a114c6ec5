//! The MCS API conformance suite (kubernetes-sigs/mcs-api `conformance/`, v0.5.0), spec by
//! spec, against Trellis: one test per spec, named after it, asserting what the spec asserts
//! within the suite's budgets (ServiceImport 20 s, EndpointSlice 60 s, absence and presence
//! held 5 s). Each runs on a fresh [`Clusterset`]: two peered clusters, each with its own
//! **fake** Kubernetes API server (no controllers: the driver writes the EndpointSlice the
//! EndpointSlice controller would) and its endpoints service on a real etcd, serving
//! `clusterset.local` DNS that the DNS specs ask with Debian's `dig`. Cluster 0 exports, as in
//! the suite. `docs/mcs-conformance.md` lists every spec with its test and result; the
//! connectivity specs S23-S25 run in the netns lab (`mcs_connectivity.rs`).
//!
//! Needs etcd and dig; skips loudly without them (fails in CI).

use std::net::IpAddr;

use serde_json::{Value, json};
use trellis_integration::mcs::{
    Clusterset, HELLO, clusterset_ips, deployment, hello_export, hello_service, mcs_ports,
    stateful_set, string_map,
};

/// The suite's BeforeEach and JustBeforeEach of a single-exporter spec: cluster 0 deploys
/// `service` with one pod and exports it. Returns the clusterset and the Service as stored.
async fn exported(service: Value) -> Option<(Clusterset, Value)> {
    let set = Clusterset::start().await?;
    let stored = set.deploy(0, service, &deployment(1)).await;
    set.export(0, hello_export()).await;
    Some((set, stored))
}

fn headless(mut service: Value) -> Value {
    service["spec"]["clusterIP"] = json!("None");
    service
}

fn spec_type(import: &Value) -> &str {
    import["spec"]["type"].as_str().unwrap_or_default()
}

// service_import.go

/// S1 (Required): "A ServiceImport should only exist as long as there's at least one
/// exporting cluster".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_import_should_only_exist_as_long_as_there_is_at_least_one_exporting_cluster() {
    let Some((set, _)) = exported(hello_service()).await else {
        return;
    };
    set.await_import(0, "the import of cluster 0's export", |_| true)
        .await;
    set.deploy(1, hello_service(), &deployment(1)).await;
    set.export(1, hello_export()).await;
    set.hold_import(0, true, "both clusters export").await;
    set.unexport(0).await;
    set.hold_import(0, true, "cluster 1 still exports").await;
    set.unexport(1).await;
    set.await_no_import(0, "nobody exports").await;
}

/// S2 (Optional, ExportedLabels): "Only labels and annotations specified as exported in the
/// ServiceExport should be propagated to the ServiceImport".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_labels_and_annotations_specified_as_exported_in_the_service_export_should_be_propagated_to_the_service_import()
 {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    set.deploy(0, hello_service(), &deployment(1)).await;
    let mut export = hello_export();
    export["spec"] = json!({"exportedAnnotations": {"dummy-annotation": "true"},
                            "exportedLabels": {"dummy-label": "true"}});
    set.export(0, export).await;
    set.await_import(0, "the exported labels and annotations", |i| {
        let labels = string_map(&i["metadata"]["labels"]);
        let annotations = string_map(&i["metadata"]["annotations"]);
        labels.get("dummy-label").map(String::as_str) == Some("true")
            && annotations.get("dummy-annotation").map(String::as_str) == Some("true")
            && !labels.contains_key("dummy-svc")
            && !annotations.contains_key("dummy-svc")
    })
    .await;
}

/// S3 (Optional, ExportedLabels): "A service exported on two clusters with conflicting
/// annotations and labels should apply the conflict resolution policy and report a Conflict
/// condition on each ServiceExport".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_annotations_and_labels_should_apply_the_conflict_resolution_policy_and_report_a_conflict_condition_on_each_service_export()
 {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    set.deploy(0, hello_service(), &deployment(1)).await;
    let mut first = hello_export();
    first["spec"] = json!({"exportedAnnotations": {"dummy-annotation": "true"},
                           "exportedLabels": {"dummy-label": "true"}});
    let mut second = hello_export();
    second["spec"] = json!({"exportedAnnotations": {"dummy-annotation2": "true"},
                            "exportedLabels": {"dummy-label2": "true"}});
    set.second_exporter(first, hello_service(), second).await;
    set.await_condition(0, "Conflict", "True").await;
    set.await_condition(1, "Conflict", "True").await;
    let import = set
        .await_import(0, "the first exporter's labels", |i| {
            string_map(&i["metadata"]["labels"]).contains_key("dummy-label")
        })
        .await;
    let labels = string_map(&import["metadata"]["labels"]);
    let annotations = string_map(&import["metadata"]["annotations"]);
    assert_eq!(
        annotations.get("dummy-annotation").map(String::as_str),
        Some("true")
    );
    assert!(!labels.contains_key("dummy-label2"), "{labels:?}");
    assert!(
        !annotations.contains_key("dummy-annotation2"),
        "{annotations:?}"
    );
}

/// S4 (Required, ClusterIP): "Exporting a ClusterIP service should create a ServiceImport of
/// type ClusterSetIP in the service's namespace in each cluster. Unexporting should delete the
/// ServiceImport".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exporting_a_cluster_ip_service_should_create_a_cluster_set_ip_service_import_in_each_cluster_and_unexporting_should_delete_it()
 {
    let Some((set, _)) = exported(hello_service()).await else {
        return;
    };
    set.await_condition(0, "Valid", "True").await;
    for i in 0..2 {
        let import = set.await_import(i, "the ServiceImport", |_| true).await;
        assert_eq!(spec_type(&import), "ClusterSetIP", "{import:#}");
    }
    set.unexport(0).await;
    for i in 0..2 {
        set.await_no_import(i, "after the unexport").await;
    }
}

/// S5 (Required, ClusterIP): "The SessionAffinity for a ClusterSetIP ServiceImport should
/// match the exported service's SessionAffinity".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_affinity_for_a_cluster_set_ip_service_import_should_match_the_exported_services()
 {
    let Some((set, service)) = exported(hello_service()).await else {
        return;
    };
    set.await_import(0, "the exported service's session affinity", |i| {
        i["spec"]["sessionAffinity"] == service["spec"]["sessionAffinity"]
            && i["spec"]["sessionAffinityConfig"] == service["spec"]["sessionAffinityConfig"]
    })
    .await;
}

/// S6 (Required, ClusterIP): "The InternalTrafficPolicy for a ClusterSetIP ServiceImport
/// should match the exported service's InternalTrafficPolicy".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_internal_traffic_policy_for_a_cluster_set_ip_service_import_should_match_the_exported_services()
 {
    let mut service = hello_service();
    service["spec"]["internalTrafficPolicy"] = json!("Cluster");
    let Some((set, _)) = exported(service).await else {
        return;
    };
    set.await_import(0, "internalTrafficPolicy Cluster", |i| {
        i["spec"]["internalTrafficPolicy"] == "Cluster"
    })
    .await;
}

/// S7 (Required, ClusterIP): "The TrafficDistribution for a ClusterSetIP ServiceImport should
/// match the exported service's TrafficDistribution".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_traffic_distribution_for_a_cluster_set_ip_service_import_should_match_the_exported_services()
 {
    let mut service = hello_service();
    service["spec"]["trafficDistribution"] = json!("PreferClose");
    let Some((set, stored)) = exported(service).await else {
        return;
    };
    set.await_import(0, "the stored trafficDistribution", |i| {
        i["spec"]["trafficDistribution"] == stored["spec"]["trafficDistribution"]
    })
    .await;
}

/// S8 (Required, ClusterIP): "An IP should be allocated for a ClusterSetIP ServiceImport for
/// each IP family".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ip_should_be_allocated_for_a_cluster_set_ip_service_import_for_each_ip_family() {
    let Some((set, _)) = exported(hello_service()).await else {
        return;
    };
    let import = set
        .await_import(0, "clusterset IPs", |i| {
            i["spec"]["ips"]
                .as_array()
                .is_some_and(|ips| !ips.is_empty())
        })
        .await;
    let ips = import["spec"]["ips"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let families = import["spec"]["ipFamilies"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(ips.len(), families.len(), "{import:#}");
    for (ip, family) in ips.iter().zip(&families) {
        let ip: IpAddr = ip.as_str().unwrap_or_default().parse().expect("an IP");
        assert_eq!(
            family.as_str(),
            Some(if ip.is_ipv4() { "IPv4" } else { "IPv6" }),
            "{import:#}"
        );
    }
}

/// S9 (Required, ClusterIP): "The ports for a ClusterSetIP ServiceImport should match those of
/// the exported service".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ports_for_a_cluster_set_ip_service_import_should_match_those_of_the_exported_service()
{
    let Some((set, service)) = exported(hello_service()).await else {
        return;
    };
    let want = mcs_ports(&service["spec"]["ports"]);
    set.await_import(0, "the exported service's ports", |i| {
        mcs_ports(&i["spec"]["ports"]) == want
    })
    .await;
}

/// S10 (Required, ClusterIP): "A ClusterIP service exported on two clusters should expose the
/// union of the constituent service ports and raise a conflict".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_ip_service_exported_on_two_clusters_should_expose_the_union_of_the_constituent_service_ports_and_raise_a_conflict()
 {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    set.deploy(0, hello_service(), &deployment(1)).await;
    let mut second = hello_service();
    second["spec"]["ports"] = json!([{"name": "tcp", "port": 42, "protocol": "TCP"},
                                     {"name": "stcp", "port": 142, "protocol": "SCTP"}]);
    set.second_exporter(hello_export(), second, hello_export())
        .await;
    set.await_condition(0, "Conflict", "True").await;
    set.await_condition(1, "Conflict", "True").await;
    let want = vec![
        ("stcp".to_owned(), "SCTP".to_owned(), 142, None),
        ("tcp".to_owned(), "TCP".to_owned(), 42, None),
        ("udp".to_owned(), "UDP".to_owned(), 42, None),
    ];
    set.await_import(0, "the union of the ports", |i| {
        mcs_ports(&i["spec"]["ports"]) == want
    })
    .await;
}

/// S11 (Required, ClusterIP): "A ClusterIP service exported on two clusters with conflicting
/// ports should apply the conflict resolution policy and report a Conflict condition on each
/// ServiceExport".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_ports_should_apply_the_conflict_resolution_policy_and_report_a_conflict_condition_on_each_service_export()
 {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    let first = set.deploy(0, hello_service(), &deployment(1)).await;
    let mut second = hello_service();
    second["spec"]["ports"] = json!([{"name": "tcp", "port": 43, "protocol": "TCP"}]);
    set.second_exporter(hello_export(), second, hello_export())
        .await;
    set.await_condition(0, "Conflict", "True").await;
    set.await_condition(1, "Conflict", "True").await;
    let want = mcs_ports(&first["spec"]["ports"]);
    set.await_import(0, "the first exporter's ports", |i| {
        mcs_ports(&i["spec"]["ports"]) == want
    })
    .await;
}

/// S12 (Required, Headless): "Exporting a headless service should create a ServiceImport of
/// type Headless in the service's namespace in each cluster. Unexporting should delete the
/// ServiceImport".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exporting_a_headless_service_should_create_a_headless_service_import_in_each_cluster_and_unexporting_should_delete_it()
 {
    let Some((set, _)) = exported(headless(hello_service())).await else {
        return;
    };
    for i in 0..2 {
        let import = set.await_import(i, "the ServiceImport", |_| true).await;
        assert_eq!(spec_type(&import), "Headless", "{import:#}");
    }
    set.unexport(0).await;
    for i in 0..2 {
        set.await_no_import(i, "after the unexport").await;
    }
}

/// S13 (Required, Headless): "No clusterset IP should be allocated for a Headless
/// ServiceImport".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_clusterset_ip_should_be_allocated_for_a_headless_service_import() {
    let Some((set, _)) = exported(headless(hello_service())).await else {
        return;
    };
    set.await_import(0, "the ServiceImport", |_| true).await;
    let start = std::time::Instant::now();
    while start.elapsed() < trellis_integration::mcs::HOLD {
        let import = set.import(0).expect("still there");
        assert!(
            import["spec"]["ips"]
                .as_array()
                .is_none_or(std::vec::Vec::is_empty),
            "{import:#}"
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// S14 (Required, ExternalName): "Exporting an ExternalName service should set ServiceExport
/// Valid condition to False".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exporting_an_external_name_service_should_set_service_export_valid_condition_to_false() {
    let mut service = hello_service();
    service["spec"] = json!({"type": "ExternalName", "externalName": "example.com",
                             "ports": service["spec"]["ports"]});
    let Some((set, _)) = exported(service).await else {
        return;
    };
    set.await_condition(0, "Valid", "False").await;
    set.hold_import(0, false, "an ExternalName service is not imported")
        .await;
}

/// S15 (Required): "A service exported on two clusters with conflicting headlessness should
/// apply the conflict resolution policy and report a Conflict condition on the
/// ServiceExport".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_headlessness_should_apply_the_conflict_resolution_policy_and_report_a_conflict_condition_on_the_service_export()
 {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    set.deploy(0, hello_service(), &deployment(1)).await;
    set.second_exporter(hello_export(), headless(hello_service()), hello_export())
        .await;
    set.await_condition(0, "Conflict", "True").await;
    set.await_condition(1, "Conflict", "True").await;
    for i in 0..2 {
        let import = set.await_import(i, "the ServiceImport", |_| true).await;
        assert_eq!(
            spec_type(&import),
            "ClusterSetIP",
            "the first exporter wins: {import:#}"
        );
    }
}

// endpoint_slice.go

/// S16 (Optional, EndpointSlice): "Exporting a service should create an MCS EndpointSlice in
/// the service's namespace in each cluster with the required MCS labels. Unexporting should
/// delete the EndpointSlice."
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exporting_a_service_should_create_an_mcs_endpoint_slice_in_each_cluster_with_the_required_mcs_labels_and_unexporting_should_delete_it()
 {
    let Some((set, _)) = exported(hello_service()).await else {
        return;
    };
    let mut names = Vec::new();
    for i in 0..2 {
        set.await_import(i, "ipFamilies", |i| {
            i["spec"]["ipFamilies"]
                .as_array()
                .is_some_and(|f| f.contains(&json!("IPv4")))
        })
        .await;
        let slices = set.await_mcs_slices(i, |_| true).await;
        for slice in &slices {
            let labels = string_map(&slice["metadata"]["labels"]);
            assert_eq!(
                labels
                    .get("multicluster.kubernetes.io/service-name")
                    .map(String::as_str),
                Some(HELLO)
            );
            let managed_by = labels.get("endpointslice.kubernetes.io/managed-by");
            assert!(
                managed_by.is_some_and(|m| m != "endpointslice-controller.k8s.io"),
                "{labels:?}"
            );
            names.push((i, slice["metadata"]["name"].clone()));
        }
    }
    set.unexport(0).await;
    for (i, name) in names {
        let start = std::time::Instant::now();
        while set
            .mcs_slices(i)
            .iter()
            .any(|s| s["metadata"]["name"] == name)
        {
            assert!(
                start.elapsed() < trellis_integration::mcs::IMPORT_BUDGET,
                "{name} still in cluster-{i}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

// clusterip_service_dns.go

/// S17 (Optional, DNS, ClusterIP): "A DNS lookup of the <service>.<ns>.svc.clusterset.local
/// domain for a ClusterIP service should resolve to the clusterset IP".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_lookup_of_the_clusterset_local_domain_for_a_cluster_ip_service_should_resolve_to_the_clusterset_ip()
 {
    let Some((set, _)) = exported(hello_service()).await else {
        return;
    };
    for i in 0..2 {
        let import = set
            .await_import(i, "clusterset IPs", |i| {
                i["spec"]["ips"]
                    .as_array()
                    .is_some_and(|ips| !ips.is_empty())
            })
            .await;
        let ips = clusterset_ips(&import);
        set.await_answers(i, &set.fqdn(), "A", &ips).await;
    }
}

/// S18 (Optional, DNS, ClusterIP): "A DNS SRV query of the <service>.<ns>.svc.clusterset.local
/// domain for a ClusterIP service should return valid SRV records".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_srv_query_of_the_clusterset_local_domain_for_a_cluster_ip_service_should_return_valid_srv_records()
 {
    let Some((set, _)) = exported(hello_service()).await else {
        return;
    };
    for i in 0..2 {
        // Exactly one record: port 42 (the first port; tcp/42 and udp/42 are one record),
        // the Service's own name as target.
        let want = vec![format!("0 100 42 {}", set.fqdn())];
        set.await_answers(i, &set.fqdn(), "SRV", &want).await;
    }
}

/// S19 (Optional, DNS, ClusterIP): "DNS lookups of the <service>.<ns>.svc.cluster.local domain
/// for a ClusterIP service should only resolve local services". `cluster.local` is the
/// cluster's own DNS (CoreDNS), which cannot run here: what Trellis owes the spec is to leave
/// that zone alone, so the cluster's DNS answers it with the local Service only. Trellis'
/// server refuses it, never answering a clusterset address for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_lookups_of_the_cluster_local_domain_for_a_cluster_ip_service_should_only_resolve_local_services()
 {
    let Some((set, _)) = exported(hello_service()).await else {
        return;
    };
    let import = set
        .await_import(0, "clusterset IPs", |i| i["spec"]["ips"].is_array())
        .await;
    // The zone is served (the clusterset name answers) before the other zone is asked.
    let ips = clusterset_ips(&import);
    set.await_answers(0, &set.fqdn(), "A", &ips).await;
    let local = format!("{HELLO}.{}.svc.cluster.local.", set.namespace);
    let answer = set.dig(0, &local, "A").await;
    assert_eq!(answer.status, "REFUSED", "{answer:?}");
    assert!(answer.answers.is_empty(), "{answer:?}");
}

// headless_service_dns.go

/// S20 (Optional, DNS, Headless): "A DNS query of the <service>.<ns>.svc.clusterset.local
/// domain for a headless service should return the ready endpoint addresses of all the backing
/// pods".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_query_of_the_clusterset_local_domain_for_a_headless_service_should_return_the_ready_endpoint_addresses_of_all_the_backing_pods()
 {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    let pods = deployment(2);
    set.deploy(0, headless(hello_service()), &pods).await;
    set.export(0, hello_export()).await;
    let want: Vec<String> = pods.iter().map(|p| set.pod_ip(0, p)).collect();
    for i in 0..2 {
        set.await_import(i, "ipFamilies", |i| i["spec"]["ipFamilies"].is_array())
            .await;
        set.await_answers(i, &set.fqdn(), "A", &want).await;
    }
}

/// S21 (Optional, DNS, Headless, EndpointSlice): "A DNS query of the
/// <hostname>.<clusterid>.<service>.<ns>.svc.clusterset.local domain for a headless
/// StatefulSet service should return the requested pod's endpoint address".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_query_of_the_hostname_clusterid_domain_for_a_headless_stateful_set_service_should_return_the_requested_pods_endpoint_address()
 {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    set.deploy(0, headless(hello_service()), &stateful_set(2))
        .await;
    set.export(0, hello_export()).await;
    for i in 0..2 {
        set.await_import(i, "ipFamilies", |i| i["spec"]["ipFamilies"].is_array())
            .await;
        let slices = set
            .await_mcs_slices(i, |s| {
                let endpoints = s["endpoints"].as_array().cloned().unwrap_or_default();
                endpoints.len() == 2
                    && endpoints.iter().all(|e| {
                        e["conditions"]["ready"].as_bool().unwrap_or(true)
                            && e["hostname"].as_str().is_some_and(|h| !h.is_empty())
                    })
            })
            .await;
        for slice in slices {
            let cluster = slice["metadata"]["labels"]["multicluster.kubernetes.io/source-cluster"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            for endpoint in slice["endpoints"].as_array().into_iter().flatten() {
                let host = endpoint["hostname"].as_str().unwrap_or_default();
                let name = format!("{host}.{cluster}.{}", set.fqdn());
                let want: Vec<String> = endpoint["addresses"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|a| a.as_str().map(str::to_owned))
                    .collect();
                set.await_answers(i, &name, "A", &want).await;
            }
        }
    }
}

/// S22 (Optional, DNS, Headless): "A DNS SRV query of the <service>.<ns>.svc.clusterset.local
/// domain for a headless service should return valid SRV records".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_srv_query_of_the_clusterset_local_domain_for_a_headless_service_should_return_valid_srv_records()
 {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    let pods = deployment(2);
    set.deploy(0, headless(hello_service()), &pods).await;
    set.export(0, hello_export()).await;
    // Deployment pods have no hostname: the suite expects a target starting with the address
    // written with dashes, port 42, one record per endpoint.
    let hosts: Vec<String> = pods
        .iter()
        .map(|p| set.pod_ip(0, p).replace(['.', ':'], "-"))
        .collect();
    for i in 0..2 {
        let start = std::time::Instant::now();
        loop {
            let answer = set.dig(i, &set.fqdn(), "SRV").await;
            let records: Vec<(String, String)> = answer
                .answers
                .iter()
                .filter_map(|a| {
                    let fields: Vec<&str> = a.split_whitespace().collect();
                    (fields.len() == 4).then(|| (fields[2].to_owned(), fields[3].to_owned()))
                })
                .collect();
            let fits = records.len() == hosts.len()
                && hosts.iter().all(|h| {
                    records
                        .iter()
                        .any(|(port, target)| port == "42" && target.starts_with(h.as_str()))
                });
            if fits {
                break;
            }
            assert!(
                start.elapsed() < trellis_integration::mcs::IMPORT_BUDGET,
                "cluster-{i}: want one SRV record on port 42 per endpoint {hosts:?}, got {answer:?}"
            );
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    }
}

// connectivity.go: S23-S25 send packets by name in the netns lab (mcs_connectivity.rs). S26
// and S27 route one port of a clusterset IP to some exporters only, which is kube-proxy's
// work on the derived Service and the MCS EndpointSlices (no kube-proxy can run here): what
// Trellis owes them is checked here, on every cluster: the import's ports, and each
// exporter's slices carrying exactly the ports that exporter serves as the import says, so
// kube-proxy (matching Service and EndpointSlice ports by name) sends a port only there.

/// `(name, port)` pairs.
fn named(ports: &[(&str, i64)]) -> Vec<(String, i64)> {
    ports.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect()
}

/// The two-cluster driver with cluster 1's Service ports `second`, then, in each cluster: the
/// ServiceImport's ports are `import_ports` and each exporter's MCS EndpointSlices carry
/// `slice_ports` (by source cluster), within the suite's budgets.
async fn strict_ports(
    second: Value,
    import_ports: &[(&str, &str, i64)],
    slice_ports: &[(&str, &[(&str, i64)])],
) {
    let Some(set) = Clusterset::start().await else {
        return;
    };
    set.deploy(0, hello_service(), &deployment(1)).await;
    let mut service = hello_service();
    service["spec"]["ports"] = second;
    set.second_exporter(hello_export(), service, hello_export())
        .await;
    let want_ports: Vec<_> = import_ports
        .iter()
        .map(|(n, p, port)| ((*n).to_owned(), (*p).to_owned(), *port, None))
        .collect();
    let want: std::collections::BTreeMap<String, Vec<(String, i64)>> = slice_ports
        .iter()
        .map(|(cluster, ports)| ((*cluster).to_owned(), named(ports)))
        .collect();
    for i in 0..2 {
        set.await_import(i, "the import's ports", |imp| {
            mcs_ports(&imp["spec"]["ports"]) == want_ports
        })
        .await;
        let start = std::time::Instant::now();
        while set.slice_ports(i) != want {
            assert!(
                start.elapsed() < trellis_integration::mcs::SLICE_BUDGET,
                "cluster-{i}: slice ports {:?}, want {want:?}",
                set.slice_ports(i)
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

/// S26 (Optional, Connectivity, ClusterIP, StrictPortConflict): "Connectivity to exported
/// services with same port name but different port numbers on each cluster should only route
/// traffic to the cluster that exposes the port" (routing part: see above). Port tcp (42)
/// reaches cluster 0's pods only: cluster 1's slice serves none of the import's ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exported_services_with_same_port_name_but_different_port_numbers_should_only_route_traffic_to_the_cluster_that_exposes_the_port()
 {
    strict_ports(
        json!([{"name": "tcp", "port": 4242, "targetPort": 42, "protocol": "TCP"}]),
        &[("tcp", "TCP", 42), ("udp", "UDP", 42)],
        &[
            ("cluster-0", &[("tcp", 42), ("udp", 42)]),
            ("cluster-1", &[]),
        ],
    )
    .await;
}

/// S27 (Optional, Connectivity, ClusterIP, StrictPortConflict): "Connectivity to exported
/// services with different port name on each cluster should route traffic to each port only to
/// the cluster that exposes it" (routing part: see above). 42 (tcp) reaches cluster 0's pods,
/// 4242 (tcp2) cluster 1's, at their port 42.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exported_services_with_different_port_name_on_each_cluster_should_route_traffic_to_each_port_only_to_the_cluster_that_exposes_it()
 {
    strict_ports(
        json!([{"name": "tcp2", "port": 4242, "targetPort": 42, "protocol": "TCP"}]),
        &[
            ("tcp", "TCP", 42),
            ("tcp2", "TCP", 4242),
            ("udp", "UDP", 42),
        ],
        &[
            ("cluster-0", &[("tcp", 42), ("udp", 42)]),
            ("cluster-1", &[("tcp2", 42)]),
        ],
    )
    .await;
}
