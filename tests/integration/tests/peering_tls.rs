//! Peering with mutual TLS between clusters (ADR 0014), in process: the handshake pins each
//! other's CAs, the induced mesh forms through the hub's forwarder over mutual TLS, and a peer
//! presenting its own valid certificate while claiming another cluster is refused with nothing
//! stored; so are a cluster nobody peered with, callers without a certificate, and
//! intra-cluster methods on the peer listener.

use std::time::{Duration, Instant};

use tonic::Code;
use trellis_api::pb::discovery::GetForeignClusterRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::*;
use trellis_api::pb::types::{self as types, TunnelEndpoint};
use trellis_integration::cluster::InProcessCluster;
use trellis_runtime::client::{Timeouts, TracedChannel};
use trellis_runtime::tls::{PeerTls, handshake_channel, peer_channel};

const LIMIT: Duration = Duration::from_secs(40);

async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn tunnel_to(cluster: &InProcessCluster, remote: &str) -> Option<TunnelEndpoint> {
    cluster
        .broker()
        .await
        .ok()?
        .list_tunnel_endpoints(ListTunnelEndpointsRequest::default())
        .await
        .ok()?
        .into_inner()
        .tunnel_endpoints
        .into_iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == remote))
}

async fn peer(from: &InProcessCluster, to: &InProcessCluster) {
    let token = to
        .broker()
        .await
        .expect("connects")
        .get_token(GetTokenRequest {})
        .await
        .expect("token")
        .into_inner()
        .token;
    from.broker()
        .await
        .expect("connects")
        .peer(PeerRequest {
            broker_address: to.peering_broker().to_string(),
            token,
            expected_cluster_id: to.id.clone(),
        })
        .await
        .expect("peers over TLS");
}

async fn start(id: &str) -> InProcessCluster {
    InProcessCluster::start_tls(id, "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("starts")
}

fn channel(tls: &PeerTls, address: std::net::SocketAddr, expected: &str) -> TracedChannel {
    peer_channel(
        tls,
        "test",
        &address.to_string(),
        Some(expected),
        Timeouts::default(),
    )
    .expect("channel")
}

/// A NetworkConfig `origin → destination` (optionally via a hub), well formed.
fn nc(origin: &str, destination: &str, via: Option<&str>, generation: i64) -> types::NetworkConfig {
    let id = |c: &str| types::ClusterIdentity {
        cluster_id: c.into(),
        cluster_name: c.into(),
    };
    types::NetworkConfig {
        name: format!("{origin}--{destination}"),
        origin: Some(id(origin)),
        destination: Some(id(destination)),
        via: via.map(id),
        spec: Some(types::NetworkConfigSpec {
            pod_cidr: "10.99.0.0/16".into(),
            external_cidr: "10.98.0.0/16".into(),
            endpoint: "127.0.0.1:51999".into(),
            public_key: "aGVsbG8gd29ybGQgaGVsbG8gd29ybGQgaGVsbG8gd28=".into(),
        }),
        status: None,
        generation,
        update_time: None,
    }
}

/// The hub refused the client certificate during the TLS handshake: no handler ran, the call
/// fails on the transport (TLS 1.3 reports the refusal on the first read, so depending on
/// timing tonic sees the UnknownCA alert, the closed connection, or a write into it).
fn refused_by_tls(err: &tonic::Status) {
    assert!(
        matches!(
            err.code(),
            Code::Unavailable | Code::Unknown | Code::Cancelled
        ),
        "{err:?}"
    );
    let shown = format!("{err:?}");
    assert!(
        shown.contains("UnknownCA")
            || shown.contains("connection closed")
            || shown.contains("broken pipe"),
        "{shown}"
    );
}

async fn network_configs(cluster: &InProcessCluster) -> Vec<types::NetworkConfig> {
    cluster
        .broker()
        .await
        .expect("connects")
        .list_network_configs(ListNetworkConfigsRequest::default())
        .await
        .expect("lists")
        .into_inner()
        .network_configs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn induced_mesh_over_mutual_tls_and_no_cluster_speaks_for_another() {
    let hub = start("hub").await;
    let a = start("leaf-a").await;
    let c = start("leaf-c").await;
    peer(&a, &hub).await;
    peer(&c, &hub).await;

    // The handshake pinned each side's CA in its discovery service.
    let record = a
        .discovery()
        .await
        .expect("connects")
        .get_foreign_cluster(GetForeignClusterRequest {
            cluster_id: "hub".into(),
        })
        .await
        .expect("hub known")
        .into_inner()
        .foreign_cluster
        .expect("record");
    let hub_tls = hub.tls.as_ref().expect("tls");
    assert_eq!(
        record.full.expect("full").ca_certificate,
        hub_tls.ca.cert_pem()
    );

    // The full mesh forms over mutual TLS: full tunnels to the hub, induced ones between the
    // leaves (their NetworkConfigs crossed the hub's forwarder).
    eventually("A's tunnel to the hub", || tunnel_to(&a, "hub")).await;
    let a_to_c = eventually("A's induced tunnel to C", || tunnel_to(&a, "leaf-c")).await;
    let c_to_a = eventually("C's induced tunnel to A", || tunnel_to(&c, "leaf-a")).await;
    assert_eq!(a_to_c.kind, types::PeeringKind::Induced as i32);
    assert_eq!(a_to_c.local_pod_cidr_nat, c_to_a.remote_pod_cidr_nat);
    assert_eq!(c_to_a.local_pod_cidr_nat, a_to_c.remote_pod_cidr_nat);

    let before = network_configs(&hub).await;
    let a_tls = a.tls.as_ref().expect("tls");
    let as_a = a_tls.client("broker", &[&hub]).expect("client");

    // A, with its own valid certificate, submits a NetworkConfig claiming to come from C.
    let mut broker = BrokerClient::new(channel(&as_a, hub_tls.broker, "hub"));
    let err = broker
        .submit_network_config(SubmitNetworkConfigRequest {
            network_config: Some(nc("leaf-c", "hub", None, 99)),
        })
        .await
        .expect_err("impersonation");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("leaf-a"), "{err:?}");
    // ...or as relayed by a hub it is not.
    let err = broker
        .submit_network_config(SubmitNetworkConfigRequest {
            network_config: Some(nc("leaf-c", "hub", Some("leaf-x"), 99)),
        })
        .await
        .expect_err("not the via hub");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // ...or tells the hub's forwarder to relay C's NetworkConfig to A.
    let mut forwarder = ForwarderClient::new(channel(&as_a, hub_tls.forwarder, "hub"));
    let err = forwarder
        .relay(RelayRequest {
            network_config: Some(nc("leaf-c", "leaf-a", Some("hub"), 99)),
        })
        .await
        .expect_err("relay as another origin");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // ...or reports a decision on C's behalf.
    let err = forwarder
        .relay_status(RelayStatusRequest {
            network_config: Some(types::NetworkConfigRef {
                name: "leaf-a--leaf-c".into(),
                origin: nc("leaf-a", "leaf-c", None, 1).origin,
                destination: nc("leaf-a", "leaf-c", None, 1).destination,
                via: nc("leaf-a", "leaf-c", Some("hub"), 1).via,
            }),
            status: Some(types::NetworkConfigStatus {
                pod_cidr_nat: "10.50.0.0/16".into(),
                external_cidr_nat: "10.51.0.0/16".into(),
                state: types::NetworkConfigState::Processed.into(),
                observed_generation: 1,
                ..Default::default()
            }),
        })
        .await
        .expect_err("status as another destination");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // ...or unpeers C from the hub.
    let err = broker
        .notify_unpeer(NotifyUnpeerRequest {
            identity: nc("leaf-c", "hub", None, 1).origin,
            reason: "Forged".into(),
        })
        .await
        .expect_err("unpeer as another");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // Intra-cluster methods are not served on the peer listener at all.
    let err = broker
        .get_token(GetTokenRequest {})
        .await
        .expect_err("intra-cluster");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // Without a client certificate only the handshake is served.
    let anonymous = handshake_channel(
        &as_a,
        "test",
        &hub_tls.broker.to_string(),
        Timeouts::default(),
    )
    .expect("channel");
    let err = BrokerClient::new(anonymous)
        .submit_network_config(SubmitNetworkConfigRequest {
            network_config: Some(nc("leaf-a", "hub", None, 99)),
        })
        .await
        .expect_err("no certificate");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // With TLS on, the plaintext listener no longer takes cluster-facing calls.
    let err = hub
        .broker()
        .await
        .expect("connects")
        .submit_network_config(SubmitNetworkConfigRequest {
            network_config: Some(nc("leaf-a", "hub", None, 99)),
        })
        .await
        .expect_err("plaintext");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // A fourth cluster nobody peered with cannot even connect.
    let d = start("leaf-d").await;
    let as_d = d
        .tls
        .as_ref()
        .expect("tls")
        .client("broker", &[&hub])
        .expect("client");
    let err = BrokerClient::new(channel(&as_d, hub_tls.broker, "hub"))
        .submit_network_config(SubmitNetworkConfigRequest {
            network_config: Some(nc("leaf-d", "hub", None, 1)),
        })
        .await
        .expect_err("not peered");
    refused_by_tls(&err);
    let err = ForwarderClient::new(channel(&as_d, hub_tls.forwarder, "hub"))
        .relay(RelayRequest {
            network_config: Some(nc("leaf-d", "leaf-a", Some("hub"), 1)),
        })
        .await
        .expect_err("not peered");
    refused_by_tls(&err);

    // Nothing of the above was stored.
    assert_eq!(network_configs(&hub).await, before);

    // The honest path still works: A re-submits its own NetworkConfig (idempotent).
    let own = network_configs(&a)
        .await
        .into_iter()
        .find(|n| {
            n.origin.as_ref().is_some_and(|o| o.cluster_id == "leaf-a")
                && n.destination
                    .as_ref()
                    .is_some_and(|d| d.cluster_id == "hub")
        })
        .expect("A's NC to the hub");
    let answer = broker
        .submit_network_config(SubmitNetworkConfigRequest {
            network_config: Some(types::NetworkConfig {
                status: None,
                ..own
            }),
        })
        .await
        .expect("A speaks for itself")
        .into_inner();
    assert!(answer.accepted);

    // Rotating the hub's token touches no existing peering: pinned CAs, tunnels and mutual-TLS
    // calls stay; only new handshakes need the new token.
    let old_token = hub
        .broker()
        .await
        .expect("connects")
        .get_token(GetTokenRequest {})
        .await
        .expect("token")
        .into_inner()
        .token;
    hub.broker()
        .await
        .expect("connects")
        .rotate_token(RotateTokenRequest { grace_period: None })
        .await
        .expect("rotates");
    let err = d
        .broker()
        .await
        .expect("connects")
        .peer(PeerRequest {
            broker_address: hub.peering_broker().to_string(),
            token: old_token,
            expected_cluster_id: String::new(),
        })
        .await
        .expect_err("old token");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let again = broker
        .submit_network_config(SubmitNetworkConfigRequest {
            network_config: Some(types::NetworkConfig {
                status: None,
                ..network_configs(&a)
                    .await
                    .into_iter()
                    .find(|n| {
                        n.destination
                            .as_ref()
                            .is_some_and(|d| d.cluster_id == "hub")
                    })
                    .expect("A's NC to the hub")
            }),
        })
        .await
        .expect("still peered after the rotation")
        .into_inner();
    assert!(again.accepted);
    for (from, to) in [
        (&a, "hub"),
        (&a, "leaf-c"),
        (&c, "leaf-a"),
        (&hub, "leaf-a"),
    ] {
        assert!(
            tunnel_to(from, to).await.is_some(),
            "{} lost its tunnel to {to} after the token rotation",
            from.id
        );
    }
    // The new token peers the fourth cluster (over TLS), which is then accepted by the hub.
    peer(&d, &hub).await;
    eventually("D's tunnel to the hub", || tunnel_to(&d, "hub")).await;
}
