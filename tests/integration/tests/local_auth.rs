//! A closed local control plane (issue 20, ADR 0020), with real service processes on real
//! etcds: with `--local-token-file`, intra-cluster methods on the plaintext listener refuse a
//! caller without the cluster's local token (UNAUTHENTICATED) and change nothing, while the
//! services' own calls to each other carry it, so two such clusters still peer and build their
//! tunnels; trellisctl authenticates with the same variable the services read. And with the
//! default flags a service's plaintext port is bound to loopback only.

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{FreeSubnetsPerClusterRequest, ListClusterSubnetsRequest};
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::{
    CreateJoinTokenRequest, GetTokenRequest, ListTunnelEndpointsRequest, PeerRequest,
    RotateTokenRequest, UnpeerRequest,
};
use trellis_integration::peering::{eventually, tunnel_to};
use trellis_integration::processes::{Options, ProcessCluster, Service};
use trellis_integration::{ServiceProcess, bin_path};
use trellis_runtime::local_auth::LocalToken;
use trellis_runtime::propagation::TraceInterceptor;

const LIMIT: Duration = Duration::from_secs(60);

type Authed = InterceptedService<Channel, TraceInterceptor>;

async fn connect(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connects")
}

/// A channel presenting `token` (or nothing with `None`).
async fn as_caller(addr: SocketAddr, token: Option<&str>) -> Authed {
    let token = token.map_or_else(LocalToken::off, |t| LocalToken::new(t).expect("valid"));
    InterceptedService::new(
        connect(addr).await,
        TraceInterceptor::with_local_token(token),
    )
}

fn token_file(dir: &Path, name: &str, token: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{token}\n")).expect("writes the token file");
    path
}

fn refused(result: Result<impl std::fmt::Debug, tonic::Status>, what: &str) {
    let err = result.expect_err(what);
    assert_eq!(err.code(), Code::Unauthenticated, "{what}: {err:?}");
    assert!(err.message().contains("local token"), "{what}: {err:?}");
}

async fn peering_token(broker: SocketAddr, local: &str) -> String {
    BrokerClient::new(as_caller(broker, Some(local)).await)
        .get_token(GetTokenRequest {})
        .await
        .expect("an authenticated caller reads the token")
        .into_inner()
        .token
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_local_token_intra_cluster_calls_are_refused_and_change_nothing() {
    const HUB_LOCAL: &str = "hub-local-token-0123456789";
    const LEAF_LOCAL: &str = "leaf-local-token-9876543210";
    let dir = tempfile::tempdir().expect("tempdir");
    let options = |file: std::path::PathBuf| Options {
        local_token_file: Some(file),
        ..Options::default()
    };
    let Some(hub) = ProcessCluster::start_with(
        "hub",
        "10.0.0.0/16",
        "10.201.0.0/16",
        options(token_file(dir.path(), "hub", HUB_LOCAL)),
    )
    .await
    .expect("the hub starts") else {
        return;
    };
    let leaf = ProcessCluster::start_with(
        "leaf-a",
        "10.0.0.0/16",
        "10.202.0.0/16",
        options(token_file(dir.path(), "leaf", LEAF_LOCAL)),
    )
    .await
    .expect("the leaf starts")
    .expect("etcd is there (the hub started)");
    let (hub_broker, leaf_broker) = (hub.addr(Service::Broker), leaf.addr(Service::Broker));

    // GetToken and RotateToken: refused without the token and with another cluster's.
    let before = peering_token(hub_broker, HUB_LOCAL).await;
    for presented in [None, Some(LEAF_LOCAL)] {
        let mut broker = BrokerClient::new(as_caller(hub_broker, presented).await);
        refused(
            broker.get_token(GetTokenRequest {}).await,
            "GetToken without the hub's local token",
        );
        refused(
            broker
                .rotate_token(RotateTokenRequest { grace_period: None })
                .await,
            "RotateToken without the hub's local token",
        );
        refused(
            broker
                .create_join_token(CreateJoinTokenRequest::default())
                .await,
            "CreateJoinToken without the hub's local token",
        );
    }
    assert_eq!(
        peering_token(hub_broker, HUB_LOCAL).await,
        before,
        "the refused rotation changed nothing"
    );

    // The services' own calls carry their local token: the leaf peers (Peer is called with
    // the leaf's token; the handshake is cluster-facing) and both sides build the tunnel,
    // which takes discovery, IPAM and gateway calls on both sides.
    let peer = PeerRequest {
        broker_address: hub_broker.to_string(),
        token: before,
        expected_cluster_id: "hub".into(),
        ca_cert_hash: String::new(),
    };
    refused(
        BrokerClient::new(as_caller(leaf_broker, None).await)
            .peer(peer.clone())
            .await,
        "Peer without the leaf's local token",
    );
    BrokerClient::new(as_caller(leaf_broker, Some(LEAF_LOCAL)).await)
        .peer(peer)
        .await
        .expect("peers with the local token");
    let authed = |cluster: &ProcessCluster, token: &'static str| {
        let addr = cluster.addr(Service::Broker);
        async move {
            BrokerClient::new(as_caller(addr, Some(token)).await)
                .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
                .await
                .map(|r| r.into_inner().tunnel_endpoints)
                .unwrap_or_default()
        }
    };
    eventually("tunnels on both sides", LIMIT, || async {
        let leaf_side = authed(&leaf, LEAF_LOCAL).await;
        let hub_side = authed(&hub, HUB_LOCAL).await;
        let to = |tunnels: &[trellis_api::pb::types::TunnelEndpoint], id: &str| {
            tunnels
                .iter()
                .any(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == id))
        };
        (to(&leaf_side, "hub") && to(&hub_side, "leaf-a")).then_some(())
    })
    .await;
    // The test's own helpers, which present no token, cannot even list the tunnels.
    assert!(tunnel_to(&leaf, "hub").await.is_none());

    // Unpeer and FreeSubnetsPerCluster without the token: refused, the peering and the IPAM
    // mapping stay.
    refused(
        BrokerClient::new(as_caller(leaf_broker, None).await)
            .unpeer(UnpeerRequest {
                cluster_id: "hub".into(),
            })
            .await,
        "Unpeer without the local token",
    );
    let leaf_ipam = leaf.addr(Service::Ipam);
    refused(
        IpamClient::new(as_caller(leaf_ipam, None).await)
            .free_subnets_per_cluster(FreeSubnetsPerClusterRequest {
                cluster_id: "hub".into(),
            })
            .await,
        "FreeSubnetsPerCluster without the local token",
    );
    let mapped = IpamClient::new(as_caller(leaf_ipam, Some(LEAF_LOCAL)).await)
        .list_cluster_subnets(ListClusterSubnetsRequest::default())
        .await
        .expect("lists with the token")
        .into_inner();
    assert!(
        format!("{mapped:?}").contains("\"hub\""),
        "the hub's mapping is still there: {mapped:?}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        authed(&leaf, LEAF_LOCAL)
            .await
            .iter()
            .any(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == "hub")),
        "still peered after the refused Unpeer"
    );

    // trellisctl reads the services' variable; without it the broker refuses it.
    let ctl = |file: Option<&Path>| {
        let mut command = Command::new(bin_path("trellisctl").expect("trellisctl is built"));
        command
            .args(["--broker", &hub_broker.to_string(), "token"])
            .env_remove("TRELLIS_LOCAL_TOKEN_FILE");
        if let Some(file) = file {
            command.env("TRELLIS_LOCAL_TOKEN_FILE", file);
        }
        command.output().expect("runs trellisctl")
    };
    let with = ctl(Some(&dir.path().join("hub")));
    assert!(with.status.success(), "{with:?}");
    assert_eq!(
        String::from_utf8_lossy(&with.stdout).trim(),
        peering_token(hub_broker, HUB_LOCAL).await
    );
    let without = ctl(None);
    assert!(!without.status.success(), "{without:?}");
    assert!(
        String::from_utf8_lossy(&without.stderr).contains("local token"),
        "{without:?}"
    );
}

/// An address of this host that is not loopback (the source address of a route out), if any.
fn non_loopback_address() -> Option<IpAddr> {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    // No packet is sent: connecting a UDP socket only picks the route and source address.
    socket.connect("192.0.2.1:9").ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

/// With the default flags (no `--listen`, no `--pod-ip`) a service's plaintext port answers on
/// 127.0.0.1 and is closed on the host's other addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_the_plaintext_port_is_bound_to_loopback_only() {
    let Some(outside) = non_loopback_address() else {
        eprintln!("SKIPPED: this host has no non-loopback address to probe");
        assert!(
            std::env::var_os("CI").is_none(),
            "CI hosts have a non-loopback address"
        );
        return;
    };
    // The IPAM's default port: this test needs it free (another process holding it fails
    // the start, named, rather than passing by accident).
    let default = SocketAddr::from(([127, 0, 0, 1], 7104));
    let ipam = ServiceProcess::start_with_env(
        "trellis-ipam",
        [
            "--store",
            "memory://",
            "--insecure-plaintext-peering",
            "--cluster-id",
            "hub",
            "--pod-cidr",
            "10.0.0.0/16",
            "--external-cidr",
            "10.201.0.0/16",
            "--metrics-listen",
            "off",
        ]
        .map(str::to_owned)
        .to_vec(),
        Vec::new(),
        default,
        "trellis.ipam.v1.Ipam",
    )
    .await
    .expect("serves on 127.0.0.1:7104 with the default flags");
    assert_eq!(ipam.addr(), default);
    let refused = tokio::net::TcpStream::connect(SocketAddr::new(outside, 7104))
        .await
        .expect_err("the plaintext port is closed on a non-loopback address");
    assert_eq!(
        refused.kind(),
        std::io::ErrorKind::ConnectionRefused,
        "{refused}"
    );
}
