//! `trellis-ipam` as real processes on real etcd: grpcurl against it, restart after SIGKILL,
//! and three replicas allocating concurrently on one etcd.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::process::Command;

use ipnet::IpNet;
use tonic::transport::Channel;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::*;
use trellis_integration::command::grpcurl;
use trellis_integration::{ServiceProcess, free_addr, ipam_args, join_all};
use trellis_testkit::{Etcd, require_tool};

const IPAM: &str = "trellis.ipam.v1.Ipam";

/// A peer whose pod and external CIDRs equal ours: it must be remapped.
fn same_cidrs_as_ours(cluster_id: impl Into<String>) -> GetSubnetsPerClusterRequest {
    GetSubnetsPerClusterRequest {
        cluster_id: cluster_id.into(),
        cluster_name: String::new(),
        pod_cidr: "10.0.0.0/16".into(),
        external_cidr: "10.201.0.0/16".into(),
    }
}

async fn start_ipam(etcd: &Etcd, cluster: &str) -> ServiceProcess {
    let addr = free_addr();
    ServiceProcess::start(
        "trellis-ipam",
        ipam_args(&addr.to_string(), &etcd.url("ipam"), cluster, &[]),
        addr,
        IPAM,
    )
    .await
    .expect("trellis-ipam starts")
}

async fn client(p: &ServiceProcess) -> IpamClient<Channel> {
    IpamClient::new(p.channel().await.expect("connects"))
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[tokio::test]
async fn grpcurl_lists_the_services_and_calls_the_ipam() {
    let Some(grpcurl_bin) = require_tool("grpcurl") else {
        return;
    };
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let ipam = start_ipam(&etcd, "hub").await;
    let addr = ipam.addr().to_string();

    let listed = grpcurl(&grpcurl_bin, &["-plaintext", &addr, "list"]);
    let services: BTreeSet<&str> = listed.lines().collect();
    assert!(services.contains(IPAM), "{listed}");
    assert!(services.contains("grpc.health.v1.Health"), "{listed}");

    // The peer uses the same pod CIDR as us: it must be remapped.
    let body = r#"{"cluster_id": "leaf-a", "cluster_name": "leaf a", "pod_cidr": "10.0.0.0/16", "external_cidr": "10.201.0.0/16"}"#;
    let got = json(&grpcurl(
        &grpcurl_bin,
        &[
            "-plaintext",
            "-d",
            body,
            &addr,
            &format!("{IPAM}/GetSubnetsPerCluster"),
        ],
    ));
    let pod_nat: IpNet = got["podCidrNat"]
        .as_str()
        .expect("podCidrNat")
        .parse()
        .expect("a CIDR");
    assert_ne!(pod_nat.to_string(), "10.0.0.0/16");
    assert_eq!(pod_nat.prefix_len(), 16);

    let body =
        r#"{"cluster_id": "leaf-a", "pod_cidr": "10.80.0.0/16", "external_cidr": "10.81.0.0/16"}"#;
    grpcurl(
        &grpcurl_bin,
        &[
            "-plaintext",
            "-d",
            body,
            &addr,
            &format!("{IPAM}/SetLocalNat"),
        ],
    );
    let body = r#"{"cluster_id": "leaf-a", "ip": "10.0.3.7"}"#;
    let got = json(&grpcurl(
        &grpcurl_bin,
        &[
            "-plaintext",
            "-d",
            body,
            &addr,
            &format!("{IPAM}/MapEndpointIp"),
        ],
    ));
    assert_eq!(got["ip"], "10.80.3.7", "{got}");
    assert_eq!(got["path"], "MAPPING_PATH_LOCAL_NAT", "{got}");

    // The cluster lookup answers from the remapped range.
    let inside = format!("{}", pod_nat.hosts().nth(9).expect("host"));
    let body = format!(r#"{{"ip": "{inside}"}}"#);
    let got = json(&grpcurl(
        &grpcurl_bin,
        &[
            "-plaintext",
            "-d",
            &body,
            &addr,
            &format!("{IPAM}/GetClusterIdentity"),
        ],
    ));
    assert_eq!(got["clusterId"], "leaf-a", "{got}");
    assert_eq!(got["clusterName"], "leaf a", "{got}");
}

#[tokio::test]
async fn mappings_survive_sigkill_and_restart_even_mid_allocation() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let mut ipam = start_ipam(&etcd, "hub").await;
    let mut c = client(&ipam).await;

    // Acknowledged mappings, while a burst of further allocations is still in flight.
    let mut acknowledged = BTreeMap::new();
    for n in 0..5 {
        let id = format!("c{n}");
        let r = c
            .get_subnets_per_cluster(same_cidrs_as_ours(id.clone()))
            .await
            .expect("maps")
            .into_inner();
        acknowledged.insert(id, (r.pod_cidr_nat, r.external_cidr_nat));
    }
    let mut burst = Vec::new();
    for n in 5..40 {
        let mut c = c.clone();
        burst.push(tokio::spawn(async move {
            c.get_subnets_per_cluster(same_cidrs_as_ours(format!("c{n}")))
                .await
                .map(|r| (format!("c{n}"), r.into_inner()))
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    ipam.kill9();
    for task in burst {
        if let Ok(Ok((id, r))) = task.await {
            acknowledged.insert(id, (r.pod_cidr_nat, r.external_cidr_nat));
        }
    }

    ipam.restart().await.expect("restarts");
    let mut c = client(&ipam).await;
    let listed = c
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists")
        .into_inner();
    let after: BTreeMap<String, (String, String)> = listed
        .clusters
        .iter()
        .map(|r| {
            (
                r.cluster_id.clone(),
                (
                    r.remote_pod_cidr_nat.clone(),
                    r.remote_external_cidr_nat.clone(),
                ),
            )
        })
        .collect();
    for (id, mapping) in &acknowledged {
        assert_eq!(
            after.get(id),
            Some(mapping),
            "acknowledged mapping of {id} lost or changed"
        );
    }
    assert_no_overlaps(&listed.clusters);

    // Allocation after the restart continues without reusing a range.
    for n in 40..45 {
        c.get_subnets_per_cluster(same_cidrs_as_ours(format!("c{n}")))
            .await
            .expect("maps after restart");
    }
    let listed = c
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists")
        .into_inner();
    assert_no_overlaps(&listed.clusters);
}

fn assert_no_overlaps(clusters: &[ClusterSubnets]) {
    let nets: Vec<(String, IpNet)> = clusters
        .iter()
        .flat_map(|r| {
            [
                (r.cluster_id.clone(), &r.remote_pod_cidr_nat),
                (r.cluster_id.clone(), &r.remote_external_cidr_nat),
            ]
        })
        .filter(|(_, n)| !n.is_empty())
        .map(|(id, n)| (id, n.parse().expect("stored CIDR")))
        .collect();
    let local: [IpNet; 2] = [
        "10.0.0.0/16".parse().expect("net"),
        "10.201.0.0/16".parse().expect("net"),
    ];
    for (i, (a_id, a)) in nets.iter().enumerate() {
        for l in &local {
            assert!(
                !trellis_api::net::overlaps(*a, *l),
                "{a_id}: {a} overlaps local {l}"
            );
        }
        for (b_id, b) in &nets[i + 1..] {
            assert!(
                !trellis_api::net::overlaps(*a, *b),
                "{a_id}: {a} overlaps {b_id}: {b}"
            );
        }
    }
}

#[tokio::test]
async fn three_replicas_on_one_etcd_never_hand_out_the_same_range_or_address() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(start_ipam(&etcd, "hub").await);
    }
    let mut clients = Vec::new();
    for r in &replicas {
        clients.push(client(r).await);
    }

    // 24 clusters, all with our own pod CIDR, requested concurrently through all replicas.
    let mut tasks = Vec::new();
    for n in 0..24 {
        let mut c = clients[n % 3].clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("c{n}");
            c.get_subnets_per_cluster(same_cidrs_as_ours(id.clone()))
                .await
                .expect("maps")
                .into_inner()
        }));
    }
    let views = join_all(tasks).await;
    let listed = clients[0]
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists")
        .into_inner();
    assert_eq!(listed.clusters.len(), 24);
    assert_no_overlaps(&listed.clusters);

    // Every cluster tells us how it sees us; then endpoints of the first 12 clusters are
    // reflected to the last 12, concurrently, through all replicas.
    for n in 0..24 {
        clients[n % 3]
            .set_local_nat(SetLocalNatRequest {
                cluster_id: format!("c{n}"),
                cluster_name: String::new(),
                pod_cidr: format!("10.{}.0.0/16", 100 + n),
                external_cidr: format!("10.{}.0.0/16", 150 + n),
            })
            .await
            .expect("sets local NAT");
    }
    let mut tasks = Vec::new();
    for n in 0..120 {
        let owner = &views[n % 12];
        let pod_nat: IpNet = owner.pod_cidr_nat.parse().expect("CIDR");
        let endpoint: IpAddr = pod_nat.hosts().nth(n / 12 + 1).expect("host");
        let target = 12 + (n * 7) % 12;
        let mut c = clients[n % 3].clone();
        tasks.push(tokio::spawn(async move {
            let r = c
                .map_endpoint_ip(MapEndpointIpRequest {
                    cluster_id: format!("c{target}"),
                    ip: endpoint.to_string(),
                    induced: false,
                })
                .await
                .expect("maps")
                .into_inner();
            (endpoint, target, r.ip)
        }));
    }
    let answers = join_all(tasks).await;
    let mappings = clients[1]
        .list_endpoint_mappings(ListEndpointMappingsRequest {})
        .await
        .expect("lists")
        .into_inner()
        .mappings;
    let distinct_endpoints: BTreeSet<IpAddr> = answers.iter().map(|(e, _, _)| *e).collect();
    assert_eq!(
        mappings.len(),
        distinct_endpoints.len(),
        "one mapping per original IP"
    );
    let externals: BTreeSet<&str> = mappings.iter().map(|m| m.external_ip.as_str()).collect();
    assert_eq!(
        externals.len(),
        mappings.len(),
        "an external address was handed out twice"
    );
    // Every answer is the shared external address, seen through the target's view of us.
    let by_ip: BTreeMap<&str, &str> = mappings
        .iter()
        .map(|m| (m.ip.as_str(), m.external_ip.as_str()))
        .collect();
    for (endpoint, target, answer) in &answers {
        let external: IpAddr = by_ip[endpoint.to_string().as_str()].parse().expect("ip");
        let view: IpNet = format!("10.{}.0.0/16", 150 + target).parse().expect("net");
        let expected =
            trellis_api::net::translate(external, "10.201.0.0/16".parse().expect("net"), view)
                .expect("inside external CIDR");
        assert_eq!(answer, &expected.to_string());
    }
}

#[tokio::test]
async fn sigterm_stops_the_service_cleanly() {
    let Some(etcd) = Etcd::start_or_skip() else {
        return;
    };
    let mut ipam = start_ipam(&etcd, "hub").await;
    let status = ipam.terminate().await.expect("terminates");
    assert!(
        status.success(),
        "exit status {status}:\n{}",
        ipam.log_tail(20)
    );
    assert!(
        ipam.log_tail(20).contains("shutting down"),
        "{}",
        ipam.log_tail(20)
    );
}

#[test]
fn help_explains_every_flag_and_its_environment_variable() {
    let bin = trellis_integration::bin_path("trellis-ipam").expect("built");
    let out = Command::new(bin).arg("--help").output().expect("runs");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).expect("utf-8");
    for (flag, env) in [
        ("--listen", "TRELLIS_LISTEN"),
        ("--store", "TRELLIS_STORE"),
        ("--cluster-id", "TRELLIS_CLUSTER_ID"),
        ("--cluster-name", "TRELLIS_CLUSTER_NAME"),
        ("--log-format", "TRELLIS_LOG_FORMAT"),
        ("--shutdown-grace", "TRELLIS_SHUTDOWN_GRACE"),
        ("--pod-cidr", "TRELLIS_POD_CIDR"),
        ("--service-cidr", "TRELLIS_SERVICE_CIDR"),
        ("--external-cidr", "TRELLIS_EXTERNAL_CIDR"),
        ("--pools", "TRELLIS_POOLS"),
        ("--reserved", "TRELLIS_RESERVED"),
        ("--range-quarantine", "TRELLIS_RANGE_QUARANTINE"),
    ] {
        assert!(
            help.contains(flag),
            "--help does not mention {flag}:\n{help}"
        );
        assert!(help.contains(env), "--help does not mention {env}:\n{help}");
    }
}

#[test]
fn bad_configuration_exits_with_a_message_naming_the_problem() {
    let bin = trellis_integration::bin_path("trellis-ipam").expect("built");
    let run = |extra: &[&str]| {
        let out = Command::new(&bin)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--insecure-plaintext-peering",
                "--cluster-id",
                "hub",
                "--pod-cidr",
                "10.0.0.0/16",
            ])
            .args(extra)
            .output()
            .expect("runs");
        assert!(!out.status.success(), "started despite {extra:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--store", "memory://", "--external-cidr", "10.0.128.0/17"]);
    assert!(
        err.contains("--external-cidr") && err.contains("overlaps"),
        "{err}"
    );
    let err = run(&["--store", "redis://x", "--external-cidr", "10.201.0.0/16"]);
    assert!(err.contains("redis"), "{err}");
    let closed = format!("etcd://127.0.0.1:{}/ipam", trellis_testkit::free_port());
    let started = std::time::Instant::now();
    let err = run(&["--store", &closed, "--external-cidr", "10.201.0.0/16"]);
    assert!(err.contains("opening store"), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn spans_reach_an_otlp_collector_with_resource_attributes_and_the_callers_trace() {
    use trellis_integration::otlp::OtlpReceiver;
    let receiver = OtlpReceiver::start().await.expect("receiver starts");
    let addr = free_addr();
    let args = [
        "--listen",
        &addr.to_string(),
        "--store",
        "memory://",
        "--insecure-plaintext-peering",
        "--cluster-id",
        "hub-1",
        "--cluster-name",
        "hub",
        "--pod-cidr",
        "10.0.0.0/16",
        "--external-cidr",
        "10.201.0.0/16",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let env = vec![
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(),
            receiver.endpoint(),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "100".to_owned()),
    ];
    let mut ipam = ServiceProcess::start_with_env("trellis-ipam", args, env, addr, IPAM)
        .await
        .expect("starts");

    // A caller in trace 4bf9...; the server must continue it.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut request = tonic::Request::new(same_cidrs_as_ours("leaf"));
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-00f067aa0ba902b7-01")
            .parse()
            .expect("ascii"),
    );
    client(&ipam)
        .await
        .get_subnets_per_cluster(request)
        .await
        .expect("maps");
    // SIGTERM flushes the batch exporter.
    let status = ipam.terminate().await.expect("terminates");
    assert!(status.success(), "{}", ipam.log_tail(20));

    let spans = receiver.spans();
    let ours: Vec<_> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
    assert!(
        ours.iter()
            .any(|s| s.name == "trellis.ipam.v1.Ipam/GetSubnetsPerCluster"
                && s.parent_span_id == "00f067aa0ba902b7"),
        "no server span continuing the caller's trace among {spans:#?}\nservice log:\n{}",
        ipam.log_tail(30)
    );
    assert!(
        ours.iter().any(|s| s.name == "subnets_for"),
        "no domain span in the trace: {ours:#?}"
    );
    for span in &ours {
        assert_eq!(
            span.resource.get("service.name").map(String::as_str),
            Some("trellis-ipam")
        );
        assert_eq!(
            span.resource.get("trellis.cluster.id").map(String::as_str),
            Some("hub-1")
        );
        assert_eq!(
            span.resource
                .get("trellis.cluster.name")
                .map(String::as_str),
            Some("hub")
        );
    }
}
