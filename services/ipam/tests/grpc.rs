//! The gRPC boundary of `trellis-ipam`, served in-process on loopback with a memory store:
//! bad input is refused with a status naming the field and changes nothing; health and
//! reflection are served next to the IPAM.

use clap::Parser;
use tonic::Code;
use tonic::transport::Channel;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::*;
use trellis_ipam::Config;
use trellis_runtime::Shutdown;

struct Server {
    client: IpamClient<Channel>,
    channel: Channel,
    shutdown: Shutdown,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

async fn serve() -> Server {
    let config = Config::try_parse_from([
        "trellis-ipam",
        "--listen",
        "127.0.0.1:0",
        "--store",
        "memory://",
        "--insecure-plaintext-peering",
        "--cluster-id",
        "hub",
        "--pod-cidr",
        "10.0.0.0/16",
        "--external-cidr",
        "10.201.0.0/16",
    ])
    .expect("config parses");
    let shutdown = Shutdown::new();
    let started = trellis_ipam::start(config, shutdown.clone())
        .await
        .expect("starts");
    let channel = Channel::from_shared(format!("http://{}", started.addr))
        .expect("uri")
        .connect()
        .await
        .expect("connects");
    Server {
        client: IpamClient::new(channel.clone()),
        channel,
        shutdown,
        task: started.task,
    }
}

fn expect_code<T: std::fmt::Debug>(result: Result<T, tonic::Status>, code: Code, needle: &str) {
    match result {
        Err(status) => {
            assert_eq!(status.code(), code, "{status:?}");
            assert!(
                status.message().contains(needle),
                "{:?} does not mention {needle:?}",
                status.message()
            );
        }
        Ok(ok) => panic!("expected {code:?}, got {ok:?}"),
    }
}

fn subnets(id: &str, pod: &str, ext: &str) -> GetSubnetsPerClusterRequest {
    GetSubnetsPerClusterRequest {
        cluster_id: id.into(),
        cluster_name: String::new(),
        pod_cidr: pod.into(),
        external_cidr: ext.into(),
    }
}

async fn state(
    client: &mut IpamClient<Channel>,
) -> (ListClusterSubnetsResponse, ListEndpointMappingsResponse) {
    let clusters = client
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists")
        .into_inner();
    let endpoints = client
        .list_endpoint_mappings(ListEndpointMappingsRequest {})
        .await
        .expect("lists")
        .into_inner();
    (clusters, endpoints)
}

#[tokio::test]
async fn bad_input_is_invalid_argument_naming_the_field_and_changes_nothing() {
    let mut s = serve().await;
    let c = &mut s.client;
    c.get_subnets_per_cluster(subnets("a", "10.0.0.0/16", "10.201.0.0/16"))
        .await
        .expect("valid call");
    c.set_local_nat(SetLocalNatRequest {
        cluster_id: "a".into(),
        cluster_name: String::new(),
        pod_cidr: "10.80.0.0/16".into(),
        external_cidr: "10.81.0.0/16".into(),
    })
    .await
    .expect("valid call");
    let before = state(c).await;

    let long_id = "x".repeat(10_000);
    expect_code(
        c.get_subnets_per_cluster(subnets("b", "10.0.0.0/33", "10.201.0.0/16"))
            .await,
        Code::InvalidArgument,
        "pod_cidr",
    );
    expect_code(
        c.get_subnets_per_cluster(subnets("b", "10.0.0.7/16", "10.201.0.0/16"))
            .await,
        Code::InvalidArgument,
        "host bits",
    );
    expect_code(
        c.get_subnets_per_cluster(subnets("b", "fd00::/64", "10.201.0.0/16"))
            .await,
        Code::InvalidArgument,
        "IPv6 but this cluster is configured for IPv4",
    );
    expect_code(
        c.get_subnets_per_cluster(subnets("b", "10.0.0.0/16", ""))
            .await,
        Code::InvalidArgument,
        "external_cidr",
    );
    expect_code(
        c.get_subnets_per_cluster(subnets("", "10.0.0.0/16", "10.201.0.0/16"))
            .await,
        Code::InvalidArgument,
        "cluster_id",
    );
    expect_code(
        c.get_subnets_per_cluster(subnets("a/b", "10.0.0.0/16", "10.201.0.0/16"))
            .await,
        Code::InvalidArgument,
        "cluster_id",
    );
    expect_code(
        c.get_subnets_per_cluster(subnets(&long_id, "10.0.0.0/16", "10.201.0.0/16"))
            .await,
        Code::InvalidArgument,
        "at most 128",
    );
    expect_code(
        c.get_subnets_per_cluster(subnets("b", "10.0.0.0/16", "10.0.0.0/24"))
            .await,
        Code::InvalidArgument,
        "overlaps pod_cidr",
    );
    expect_code(
        c.set_local_nat(SetLocalNatRequest {
            cluster_id: "b".into(),
            cluster_name: String::new(),
            pod_cidr: "10.80.0.0/24".into(),
            external_cidr: "10.81.0.0/16".into(),
        })
        .await,
        Code::InvalidArgument,
        "prefix length",
    );
    expect_code(
        c.map_endpoint_ip(MapEndpointIpRequest {
            cluster_id: "a".into(),
            ip: "10.0.0.300".into(),
            induced: false,
        })
        .await,
        Code::InvalidArgument,
        "ip",
    );
    expect_code(
        c.map_endpoint_ip(MapEndpointIpRequest {
            cluster_id: "a".into(),
            ip: "fd00::1".into(),
            induced: false,
        })
        .await,
        Code::InvalidArgument,
        "IPv6",
    );
    expect_code(
        c.map_endpoint_ip(MapEndpointIpRequest {
            cluster_id: "nobody".into(),
            ip: "10.0.0.1".into(),
            induced: false,
        })
        .await,
        Code::NotFound,
        "nobody",
    );
    expect_code(
        c.get_home_pod_ip(GetHomePodIpRequest {
            cluster_id: "nobody".into(),
            ip: "10.0.0.1".into(),
        })
        .await,
        Code::NotFound,
        "nobody",
    );
    expect_code(
        c.get_cluster_identity(GetClusterIdentityRequest {
            ip: "not-an-ip".into(),
        })
        .await,
        Code::InvalidArgument,
        "ip",
    );
    expect_code(
        c.does_cluster_mapping_exist(DoesClusterMappingExistRequest {
            cluster_id: String::new(),
        })
        .await,
        Code::InvalidArgument,
        "cluster_id",
    );
    expect_code(
        c.free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
            cluster_id: "a b".into(),
        })
        .await,
        Code::InvalidArgument,
        "cluster_id",
    );
    expect_code(
        c.unmap_endpoint_ip(UnmapEndpointIpRequest {
            cluster_id: "a".into(),
            ip: String::new(),
        })
        .await,
        Code::InvalidArgument,
        "ip",
    );

    // A request larger than the service accepts is refused by the transport, before any
    // handler runs (tonic reports OUT_OF_RANGE for that).
    let huge = "9".repeat(trellis_ipam::MAX_REQUEST_BYTES + 1);
    let status = c
        .get_cluster_identity(GetClusterIdentityRequest { ip: huge })
        .await
        .expect_err("too large");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    assert!(status.message().contains("too large"), "{status:?}");

    assert_eq!(
        state(c).await,
        before,
        "a refused request changed the state"
    );
    s.shutdown.cancel();
}

#[tokio::test]
async fn answers_carry_the_design_field_names() {
    let mut s = serve().await;
    let c = &mut s.client;
    let view = c
        .get_subnets_per_cluster(subnets("a", "10.0.0.0/16", "10.201.0.0/16"))
        .await
        .expect("maps")
        .into_inner();
    assert_eq!(view.pod_cidr_nat.split('/').nth(1), Some("16"));
    assert_ne!(view.pod_cidr_nat, "10.0.0.0/16");
    let local = c
        .get_local_subnets(GetLocalSubnetsRequest {})
        .await
        .expect("answers")
        .into_inner();
    assert_eq!(local.pod_cidr, "10.0.0.0/16");
    assert_eq!(
        local.pools,
        ["10.0.0.0/8", "192.168.0.0/16", "172.16.0.0/12"]
    );
    let none = c
        .get_cluster_identity(GetClusterIdentityRequest {
            ip: "172.31.0.1".into(),
        })
        .await
        .expect("answers")
        .into_inner();
    assert_eq!(
        (none.cluster_id.as_str(), none.cluster_name.as_str()),
        ("", "")
    );
    s.shutdown.cancel();
}

#[tokio::test]
async fn health_reports_serving_and_the_server_stops_on_shutdown() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
    let s = serve().await;
    let mut health = HealthClient::new(s.channel.clone());
    let status = health
        .check(HealthCheckRequest {
            service: "trellis.ipam.v1.Ipam".into(),
        })
        .await
        .expect("health answers")
        .into_inner()
        .status;
    assert_eq!(status, ServingStatus::Serving as i32);
    s.shutdown.cancel();
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(15), s.task).await;
    assert!(
        matches!(stopped, Ok(Ok(Ok(())))),
        "server did not stop cleanly: {stopped:?}"
    );
}

#[tokio::test]
async fn reflection_lists_the_ipam_and_health_services() {
    use tokio_stream::StreamExt as _;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let s = serve().await;
    let mut client = ServerReflectionClient::new(s.channel.clone());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection answers")
        .into_inner();
    let Some(Ok(response)) = responses.next().await else {
        panic!("no reflection response")
    };
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection response")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for wanted in [
        "trellis.ipam.v1.Ipam",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(
            names.iter().any(|n| n == wanted),
            "{wanted} missing from {names:?}"
        );
    }
    s.shutdown.cancel();
}

/// Issue 15 item 5: over the wire, a SetLocalNat after FreeSubnetsPerCluster is
/// FAILED_PRECONDITION naming the cluster, and leaves no record behind.
#[tokio::test]
async fn a_set_local_nat_after_a_free_is_failed_precondition_and_stores_nothing() {
    let mut s = serve().await;
    let c = &mut s.client;
    c.get_subnets_per_cluster(subnets("gone", "10.0.0.0/16", "192.168.7.0/24"))
        .await
        .expect("maps");
    let freed = c
        .free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
            cluster_id: "gone".into(),
        })
        .await
        .expect("frees")
        .into_inner();
    assert!(freed.existed);
    expect_code(
        c.set_local_nat(SetLocalNatRequest {
            cluster_id: "gone".into(),
            cluster_name: String::new(),
            pod_cidr: "10.80.0.0/16".into(),
            external_cidr: "10.81.0.0/16".into(),
        })
        .await,
        Code::FailedPrecondition,
        "cluster gone was freed",
    );
    let exists = c
        .does_cluster_mapping_exist(DoesClusterMappingExistRequest {
            cluster_id: "gone".into(),
        })
        .await
        .expect("answers")
        .into_inner();
    assert!(!exists.exists);
    assert!(state(c).await.0.clusters.is_empty());
    s.shutdown.cancel();
}

/// The batch RPCs answer each item as its unary call would, in order; one item's error (a bad
/// CIDR, a late SetLocalNat) is its own and the other items take effect; more than 256 items
/// are refused as a whole, naming `requests`, and change nothing.
#[tokio::test]
async fn batch_items_are_answered_as_their_unary_calls_each_on_its_own() {
    use get_subnets_per_cluster_result::Result as Mapped;
    use set_local_nat_result::Result as Recorded;
    let mut s = serve().await;
    let c = &mut s.client;
    let lone = c
        .get_subnets_per_cluster(subnets("lone", "10.0.0.0/16", "192.168.9.0/24"))
        .await
        .expect("maps")
        .into_inner();
    let results = c
        .get_subnets_per_cluster_batch(GetSubnetsPerClusterBatchRequest {
            requests: vec![
                subnets("a", "10.0.0.0/16", "192.168.1.0/24"),
                subnets("bad", "not-a-cidr", "192.168.2.0/24"),
                subnets("lone", "10.0.0.0/16", "192.168.9.0/24"),
            ],
        })
        .await
        .expect("a batch")
        .into_inner()
        .results;
    assert_eq!(results.len(), 3);
    let Some(Mapped::Response(a)) = &results[0].result else {
        panic!("item 0: {:?}", results[0]);
    };
    assert_ne!(
        a.pod_cidr_nat, "10.0.0.0/16",
        "the overlapping pod CIDR is remapped"
    );
    match &results[1].result {
        Some(Mapped::Error(e)) => {
            assert_eq!(e.code, Code::InvalidArgument as i32);
            assert!(e.message.contains("pod_cidr"), "{e:?}");
        }
        other => panic!("item 1: {other:?}"),
    }
    assert_eq!(
        results[2].result,
        Some(Mapped::Response(lone)),
        "idempotent like the unary call"
    );

    c.free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
        cluster_id: "lone".into(),
    })
    .await
    .expect("frees");
    let nat = |id: &str| SetLocalNatRequest {
        cluster_id: id.into(),
        cluster_name: String::new(),
        pod_cidr: "10.80.0.0/16".into(),
        external_cidr: "10.81.0.0/16".into(),
    };
    let results = c
        .set_local_nat_batch(SetLocalNatBatchRequest {
            requests: vec![nat("a"), nat("lone")],
        })
        .await
        .expect("a batch")
        .into_inner()
        .results;
    assert!(
        matches!(results[0].result, Some(Recorded::Response(_))),
        "{results:?}"
    );
    match &results[1].result {
        Some(Recorded::Error(e)) => {
            assert_eq!(e.code, Code::FailedPrecondition as i32);
            assert!(e.message.contains("lone"), "{e:?}");
        }
        other => panic!("item 1: {other:?}"),
    }
    let listed = state(c).await.0.clusters;
    let a = listed
        .iter()
        .find(|r| r.cluster_id == "a")
        .expect("a is held");
    assert_eq!(a.local_pod_cidr_nat, "10.80.0.0/16");
    assert!(listed.iter().all(|r| r.cluster_id != "lone"), "{listed:?}");

    let before = state(c).await;
    let many = (0..257)
        .map(|i| subnets(&format!("c{i}"), "10.9.0.0/16", "192.168.3.0/24"))
        .collect();
    expect_code(
        c.get_subnets_per_cluster_batch(GetSubnetsPerClusterBatchRequest { requests: many })
            .await,
        Code::InvalidArgument,
        "requests",
    );
    let many = (0..257).map(|i| nat(&format!("c{i}"))).collect();
    expect_code(
        c.set_local_nat_batch(SetLocalNatBatchRequest { requests: many })
            .await,
        Code::InvalidArgument,
        "requests",
    );
    assert_eq!(state(c).await, before, "a refused batch changed something");
    s.shutdown.cancel();
}
