//! Peering with mutual TLS between clusters (ADR 0014), in process: the handshake pins each
//! other's CAs, the induced mesh forms through the hub's forwarder over mutual TLS, and a peer
//! presenting its own valid certificate while claiming another cluster is refused with nothing
//! stored; so are a cluster nobody peered with, callers without a certificate, and
//! intra-cluster methods on the peer listener. The second test covers the other cluster-facing
//! services: Neighborhoods (discovery), the remote IPAM queries of the induced path, and
//! reflected slices (endpoints).

use std::time::Duration;

use ipnet::IpNet;
use tonic::Code;
use trellis_api::pb::discovery::discovery_client::DiscoveryClient;
use trellis_api::pb::discovery::{
    AddForeignClusterRequest, GetForeignClusterRequest, ListForeignClustersRequest,
    PublishNeighborhoodRequest,
};
use trellis_api::pb::endpoints::endpoint_mapper_client::EndpointMapperClient;
use trellis_api::pb::endpoints::{
    ApplyReflectedSliceRequest, DeleteReflectedSliceRequest, ListReflectedSlicesRequest,
    ReflectEndpointSliceRequest, ReflectedSlice, TranslationPath, UnreflectEndpointSliceRequest,
};
use trellis_api::pb::ipam::ipam_client::IpamClient;
use trellis_api::pb::ipam::{
    DoesClusterMappingExistRequest, EndpointMapping, ListEndpointMappingsRequest,
    MapEndpointIpRequest,
};
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::*;
use trellis_api::pb::types::{self as types};
use trellis_api::peers::Condition;
use trellis_integration::cluster::{InProcessCluster, Options};
use trellis_integration::peering::unpeer;
use trellis_integration::peering::{
    answered_tunnel_to, eventually, host_at, peer, pod_view, tunnel_to, web_slice,
};
use trellis_runtime::client::{Timeouts, TracedChannel};
use trellis_runtime::metrics::Metrics;
use trellis_runtime::tls::{PeerTls, handshake_channel, peer_channel};

const LIMIT: Duration = Duration::from_secs(40);

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
        &Metrics::new(),
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
            stateless_wire: false,
        }),
        status: None,
        generation,
        update_time: None,
        held_generation: 0,
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
            || shown.contains("broken pipe")
            // The refusal closed the connection before the request went out.
            || shown.contains("connection was not ready"),
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
    eventually("A's tunnel to the hub", LIMIT, || tunnel_to(&a, "hub")).await;
    let a_to_c = eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || tunnel_to(&c, "leaf-a")).await;
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
            peering_id: String::new(),
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
        &Metrics::new(),
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
            ca_cert_hash: String::new(),
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
    eventually("D's tunnel to the hub", LIMIT, || tunnel_to(&d, "hub")).await;
}

fn identity(id: &str) -> Option<types::ClusterIdentity> {
    Some(types::ClusterIdentity {
        cluster_id: id.into(),
        cluster_name: id.into(),
    })
}

/// A Neighborhood `sender → recipient` introducing a made-up cluster "leaf-z", with a generation
/// above anything a real sender used: applied, it would leave an induced record of leaf-z.
fn forged_neighborhood(sender: &str, recipient: &str) -> PublishNeighborhoodRequest {
    PublishNeighborhoodRequest {
        neighborhood: Some(types::Neighborhood {
            sender: identity(sender),
            recipient: identity(recipient),
            neighbors: vec![types::Neighbor {
                identity: identity("leaf-z"),
                addresses: Some(types::ServiceAddresses {
                    discovery: "127.0.0.1:1".into(),
                    broker: "127.0.0.1:2".into(),
                    ..Default::default()
                }),
            }],
            generation: 1 << 40,
            create_time: None,
        }),
    }
}

fn apply(source: &str, address: &str) -> ApplyReflectedSliceRequest {
    ApplyReflectedSliceRequest {
        source: identity(source),
        slice: Some(web_slice(address.into())),
        generation: 1 << 40,
    }
}

fn delete(source: &str) -> DeleteReflectedSliceRequest {
    DeleteReflectedSliceRequest {
        source: identity(source),
        namespace: "shop".into(),
        name: "web-1".into(),
    }
}

fn induced_map(target: &str, ip: &str) -> MapEndpointIpRequest {
    MapEndpointIpRequest {
        cluster_id: target.into(),
        ip: ip.into(),
        induced: true,
    }
}

/// The cluster IDs `cluster`'s discovery knows.
async fn known(cluster: &InProcessCluster) -> Vec<String> {
    cluster
        .discovery()
        .await
        .expect("connects")
        .list_foreign_clusters(ListForeignClustersRequest { kind: 0 })
        .await
        .expect("lists")
        .into_inner()
        .foreign_clusters
        .into_iter()
        .filter_map(|fc| fc.identity.map(|i| i.cluster_id))
        .collect()
}

async fn endpoint_mappings(cluster: &InProcessCluster) -> Vec<EndpointMapping> {
    cluster
        .ipam()
        .await
        .expect("connects")
        .list_endpoint_mappings(ListEndpointMappingsRequest {})
        .await
        .expect("lists")
        .into_inner()
        .mappings
}

async fn reflected(cluster: &InProcessCluster) -> Vec<ReflectedSlice> {
    cluster
        .endpoints()
        .await
        .expect("connects")
        .list_reflected_slices(ListReflectedSlicesRequest::default())
        .await
        .expect("lists")
        .into_inner()
        .reflected_slices
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn neighborhoods_ipam_queries_and_reflected_slices_take_a_peer_speaking_for_itself() {
    // Same pod CIDR everywhere: every view is a remap, so a wrong path gives a wrong address.
    let hub = start("hub").await;
    let a = start("leaf-a").await;
    let c = start("leaf-c").await;
    peer(&a, &hub).await;
    peer(&c, &hub).await;
    let hub_tls = hub.tls.as_ref().expect("tls");
    let a_tls = a.tls.as_ref().expect("tls");
    let c_tls = c.tls.as_ref().expect("tls");

    // The hub's Neighborhoods now travel over mutual TLS, and the induced mesh still forms.
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || tunnel_to(&c, "leaf-a")).await;
    eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    eventually("the hub's tunnel to C", LIMIT, || tunnel_to(&hub, "leaf-c")).await;
    assert_eq!(c_to_a.kind, types::PeeringKind::Induced as i32);

    // The hub reflects a slice whose endpoint runs in A (home IP 10.0.0.7) to C and delivers
    // it: its endpoints service asked A's IPAM over mutual TLS (DoesClusterMappingExist,
    // MapEndpointIp induced) and pushed the slice to C's endpoints service over mutual TLS.
    let hub_view_a = pod_view(&hub, "leaf-a").await;
    let c_view_a: IpNet = c_to_a.remote_pod_cidr_nat.parse().expect("cidr");
    let direct = host_at(c_view_a, 7);
    let request = ReflectEndpointSliceRequest {
        target: identity("leaf-c"),
        slice: Some(web_slice(host_at(hub_view_a, 7))),
        deliver: true,
    };
    let answer = eventually("an induced translation, delivered", LIMIT, || {
        let request = request.clone();
        let hub = &hub;
        async move {
            let answer = hub
                .endpoints()
                .await
                .ok()?
                .reflect_endpoint_slice(request)
                .await
                .ok()?
                .into_inner();
            (answer.translations.first()?.path == TranslationPath::Induced as i32).then_some(answer)
        }
    })
    .await;
    assert!(answer.delivered);
    assert_eq!(answer.translations[0].translated_address, direct);
    let at_c = reflected(&c).await;
    assert_eq!(at_c.len(), 1, "{at_c:?}");
    assert_eq!(
        at_c[0].source.as_ref().map(|s| s.cluster_id.as_str()),
        Some("hub")
    );
    let held = at_c[0].slice.as_ref().expect("slice");
    assert_eq!(held.endpoints[0].addresses, [direct.as_str()]);

    // ---- a fourth cluster with a valid certificate from its own CA, peered with nobody ----
    let d = start("leaf-d").await;
    let as_d = d
        .tls
        .as_ref()
        .expect("tls")
        .client("endpoints", &[&hub, &a, &c])
        .expect("client");
    // Discovery's first contact works over TLS without a client certificate: D finds the hub
    // at its peer listener (GetIdentity is the one anonymous discovery method).
    let found = d
        .discovery()
        .await
        .expect("connects")
        .add_foreign_cluster(AddForeignClusterRequest {
            discovery_address: hub_tls.discovery.to_string(),
            expected_cluster_id: "hub".into(),
        })
        .await
        .expect("GetIdentity over TLS")
        .into_inner()
        .foreign_cluster
        .and_then(|fc| fc.identity)
        .expect("identity");
    assert_eq!(found.cluster_id, "hub");
    let (a_known, a_mappings) = (known(&a).await, endpoint_mappings(&a).await);
    let err = DiscoveryClient::new(channel(&as_d, a_tls.discovery, "leaf-a"))
        .publish_neighborhood(forged_neighborhood("leaf-d", "leaf-a"))
        .await
        .expect_err("not peered");
    refused_by_tls(&err);
    let err = DiscoveryClient::new(channel(&as_d, a_tls.discovery, "leaf-a"))
        .publish_neighborhood(forged_neighborhood("hub", "leaf-a"))
        .await
        .expect_err("not peered, claiming the hub");
    refused_by_tls(&err);
    let mut d_to_a_ipam = IpamClient::new(channel(&as_d, a_tls.ipam, "leaf-a"));
    let err = d_to_a_ipam
        .does_cluster_mapping_exist(DoesClusterMappingExistRequest {
            cluster_id: "leaf-c".into(),
        })
        .await
        .expect_err("not peered");
    refused_by_tls(&err);
    let err = d_to_a_ipam
        .map_endpoint_ip(induced_map("leaf-c", "10.0.0.7"))
        .await
        .expect_err("not peered");
    refused_by_tls(&err);
    let mut d_to_c_endpoints = EndpointMapperClient::new(channel(&as_d, c_tls.endpoints, "leaf-c"));
    let err = d_to_c_endpoints
        .apply_reflected_slice(apply("leaf-d", "10.0.0.66"))
        .await
        .expect_err("not peered");
    refused_by_tls(&err);
    let err = d_to_c_endpoints
        .delete_reflected_slice(delete("hub"))
        .await
        .expect_err("not peered");
    refused_by_tls(&err);
    // Nothing of it was stored.
    assert_eq!(known(&a).await, a_known);
    assert!(!a_known.iter().any(|id| id == "leaf-z" || id == "leaf-d"));
    assert_eq!(endpoint_mappings(&a).await, a_mappings);
    assert_eq!(reflected(&c).await, at_c);

    // The same queries from a full peer (the hub, with its certificate) are answered: the
    // refusals above were about who asked.
    let as_hub = hub_tls.client("endpoints", &[&a, &c]).expect("client");
    let mut hub_to_a_ipam = IpamClient::new(channel(&as_hub, a_tls.ipam, "leaf-a"));
    let exists = hub_to_a_ipam
        .does_cluster_mapping_exist(DoesClusterMappingExistRequest {
            cluster_id: "leaf-c".into(),
        })
        .await
        .expect("a full peer may ask")
        .into_inner()
        .exists;
    assert!(exists);
    let mapped = hub_to_a_ipam
        .map_endpoint_ip(induced_map("leaf-c", "10.0.0.7"))
        .await
        .expect("a full peer may ask")
        .into_inner();
    assert_eq!(mapped.ip, direct);
    // ...but only for induced mappings: a non-induced one would allocate from A's external
    // CIDR, which only A's own endpoints service decides.
    let err = hub_to_a_ipam
        .map_endpoint_ip(MapEndpointIpRequest {
            induced: false,
            ..induced_map("leaf-c", "10.0.0.7")
        })
        .await
        .expect_err("non-induced from a peer");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert_eq!(endpoint_mappings(&a).await, a_mappings);
    // Intra-cluster callers keep the plaintext listener, non-induced mappings included.
    let c_view_hub: IpNet = tunnel_to(&c, "hub")
        .await
        .expect("C's tunnel to the hub")
        .remote_pod_cidr_nat
        .parse()
        .expect("cidr");
    let local = hub
        .ipam()
        .await
        .expect("connects")
        .map_endpoint_ip(MapEndpointIpRequest {
            induced: false,
            ..induced_map("leaf-c", "10.0.0.9")
        })
        .await
        .expect("a local caller")
        .into_inner();
    assert_eq!(local.ip, host_at(c_view_hub, 9));

    // ---- a full peer (A) presenting its own certificate while claiming another cluster ----
    let as_a = a_tls.client("endpoints", &[&hub, &c]).expect("client");
    let hub_known = known(&hub).await;
    let err = DiscoveryClient::new(channel(&as_a, hub_tls.discovery, "hub"))
        .publish_neighborhood(forged_neighborhood("leaf-c", "hub"))
        .await
        .expect_err("a Neighborhood as another sender");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("leaf-a"), "{err:?}");
    let mut a_to_hub_endpoints =
        EndpointMapperClient::new(channel(&as_a, hub_tls.endpoints, "hub"));
    let err = a_to_hub_endpoints
        .apply_reflected_slice(apply("leaf-c", "10.0.0.66"))
        .await
        .expect_err("a slice as another source");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("leaf-a"), "{err:?}");
    let err = a_to_hub_endpoints
        .delete_reflected_slice(delete("leaf-c"))
        .await
        .expect_err("a deletion as another source");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // Induced peers never call each other directly: C has not pinned A's CA.
    let err = EndpointMapperClient::new(channel(&as_a, c_tls.endpoints, "leaf-c"))
        .apply_reflected_slice(apply("leaf-a", "10.0.0.66"))
        .await
        .expect_err("A is no full peer of C");
    refused_by_tls(&err);
    // With TLS on, the plaintext listeners take no Neighborhood and no slice at all.
    let err = hub
        .discovery()
        .await
        .expect("connects")
        .publish_neighborhood(forged_neighborhood("leaf-c", "hub"))
        .await
        .expect_err("plaintext");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = hub
        .endpoints()
        .await
        .expect("connects")
        .apply_reflected_slice(apply("leaf-c", "10.0.0.66"))
        .await
        .expect_err("plaintext");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert_eq!(known(&hub).await, hub_known);
    assert!(!hub_known.iter().any(|id| id == "leaf-z"));
    assert!(reflected(&hub).await.is_empty());
    assert_eq!(reflected(&c).await, at_c);

    // The honest path still works: the hub withdraws the slice from C over mutual TLS.
    let done = hub
        .endpoints()
        .await
        .expect("connects")
        .unreflect_endpoint_slice(UnreflectEndpointSliceRequest {
            target: identity("leaf-c"),
            namespace: "shop".into(),
            name: "web-1".into(),
            deliver: true,
        })
        .await
        .expect("unreflects")
        .into_inner();
    assert!(done.delivered);
    assert!(reflected(&c).await.is_empty());
}

/// First contact pinned by the hub's CA hash (the join command's `--ca-cert-hash`): a wrong hash
/// (here, the hash of a CA a man in the middle would hold) is refused during the TLS handshake,
/// so the token never leaves and neither side stores anything; the hash `GetToken` reports,
/// which `trellisctl token --join` prints, peers; a malformed one is INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_first_contact_refuses_a_wrong_ca_and_the_join_hash_peers() {
    let hub = start("hub").await;
    let leaf = start("leaf").await;
    let impostor = start("hub2").await;
    let token = hub
        .broker()
        .await
        .expect("connects")
        .get_token(GetTokenRequest {})
        .await
        .expect("token")
        .into_inner();
    assert!(token.ca_cert_hash.starts_with("sha256:"), "{token:?}");
    assert_eq!(token.advertised_broker, hub.peering_broker().to_string());
    let wrong = impostor
        .broker()
        .await
        .expect("connects")
        .get_token(GetTokenRequest {})
        .await
        .expect("token")
        .into_inner()
        .ca_cert_hash;
    let request = |hash: &str| PeerRequest {
        broker_address: hub.peering_broker().to_string(),
        token: token.token.clone(),
        expected_cluster_id: "hub".into(),
        ca_cert_hash: hash.into(),
    };
    let mut broker = leaf.broker().await.expect("connects");

    let err = broker.peer(request(&wrong)).await.expect_err("wrong CA");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("pinned"), "{}", err.message());
    assert!(known(&leaf).await.is_empty(), "nothing stored on the leaf");
    assert!(known(&hub).await.is_empty(), "nothing stored on the hub");

    let err = broker
        .peer(request("sha256:xyz"))
        .await
        .expect_err("malformed");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("ca_cert_hash"), "{}", err.message());

    let answer = broker
        .peer(request(&token.ca_cert_hash))
        .await
        .expect("the join hash peers")
        .into_inner();
    assert_eq!(
        answer.identity.map(|i| i.cluster_id).as_deref(),
        Some("hub")
    );
    assert_eq!(known(&leaf).await, ["hub"]);
    assert_eq!(known(&hub).await, ["leaf"]);
}

/// The man in the middle the pin is for, asserted on the remote side: an impostor answering at
/// the address a leaf was told, claiming the hub's ID and accepting the hub's very token (a
/// token learnt once is reusable). A leaf holding the join command's hash is refused before the
/// token leaves, and the impostor, which would have accepted it, has no handshake on record;
/// the control: an unpinned leaf hands the impostor the token and gets peered with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_man_in_the_middle_at_first_contact_never_receives_the_token_from_a_pinned_leaf() {
    let hub = start("hub").await;
    let token = hub
        .broker()
        .await
        .expect("connects")
        .get_token(GetTokenRequest {})
        .await
        .expect("token")
        .into_inner();
    let impostor = InProcessCluster::start_with(
        "hub",
        "10.0.0.0/16",
        "10.201.0.0/16",
        Options {
            tls: true,
            endpoints: true,
            broker_flags: vec!["--token".into(), token.token.clone()],
            ..Options::default()
        },
    )
    .await
    .expect("impostor starts");
    let pinned = start("leaf-a").await;
    let unpinned = start("leaf-c").await;
    let request = |hash: &str| PeerRequest {
        broker_address: impostor.peering_broker().to_string(),
        token: token.token.clone(),
        expected_cluster_id: "hub".into(),
        ca_cert_hash: hash.into(),
    };

    let err = pinned
        .broker()
        .await
        .expect("connects")
        .peer(request(&token.ca_cert_hash))
        .await
        .expect_err("the impostor's CA is not the pinned one");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(
        known(&impostor).await.is_empty(),
        "the impostor got no handshake"
    );
    assert!(
        known(&pinned).await.is_empty(),
        "nothing stored on the leaf"
    );

    unpinned
        .broker()
        .await
        .expect("connects")
        .peer(request(""))
        .await
        .expect("an unpinned first contact trusts whoever answers");
    assert_eq!(
        known(&impostor).await,
        ["leaf-c"],
        "the impostor used the token"
    );
    assert!(known(&pinned).await.is_empty());
    assert!(
        known(&hub).await.is_empty(),
        "the real hub was never involved"
    );
}

/// Issue 15 item 8: a full peer speaks for a NetworkConfig only as the hub that relays it. A
/// third full peer of A (M) naming itself as `via` can neither withdraw A's induced NC from C
/// nor A's direct NC from the hub, nor report a decision on A's NC towards C; A's tunnels stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_peer_cannot_withdraw_or_decide_for_a_network_config_it_does_not_relay() {
    let hub = start("hub").await;
    let a = start("leaf-a").await;
    let c = start("leaf-c").await;
    let m = start("leaf-m").await;
    peer(&a, &hub).await;
    peer(&c, &hub).await;
    peer(&m, &a).await;
    let to_c = eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    eventually("A's tunnel to the hub", LIMIT, || tunnel_to(&a, "hub")).await;
    let to_m = eventually("A's tunnel to M", LIMIT, || tunnel_to(&a, "leaf-m")).await;

    let a_tls = a.tls.as_ref().expect("tls");
    let as_m = m
        .tls
        .as_ref()
        .expect("tls")
        .client("broker", &[&a])
        .expect("client");
    let mut broker = BrokerClient::new(channel(&as_m, a_tls.broker, "leaf-a"));
    let reference = |origin: &str, destination: &str, via: Option<&str>| {
        let nc = nc(origin, destination, via, 1);
        types::NetworkConfigRef {
            name: nc.name,
            origin: nc.origin,
            destination: nc.destination,
            via: nc.via,
        }
    };
    // C's induced NC to A is relayed by the hub, not by M.
    let err = broker
        .withdraw_network_config(WithdrawNetworkConfigRequest {
            network_config: Some(reference("leaf-c", "leaf-a", Some("leaf-m"))),
            reason: "Forged".into(),
        })
        .await
        .expect_err("M is not the hub of C's NC");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // The hub's NC to A is direct: it takes no `via` at all.
    let err = broker
        .withdraw_network_config(WithdrawNetworkConfigRequest {
            network_config: Some(reference("hub", "leaf-a", Some("leaf-m"))),
            reason: "Forged".into(),
        })
        .await
        .expect_err("a direct NC takes no via");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // Nor may M decide on A's NC towards C.
    let err = broker
        .report_network_config_status(ReportNetworkConfigStatusRequest {
            network_config: Some(reference("leaf-a", "leaf-c", Some("leaf-m"))),
            status: Some(types::NetworkConfigStatus {
                pod_cidr_nat: "10.50.0.0/16".into(),
                external_cidr_nat: "10.51.0.0/16".into(),
                state: types::NetworkConfigState::Processed.into(),
                observed_generation: 1,
                ..Default::default()
            }),
        })
        .await
        .expect_err("M is not the hub of A's NC");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // The control: M's withdrawal of its own NC to A is taken, and the exchange heals (A's
    // next pass sends its NC again, M answers): A's tunnel to M comes back newer. Every forged
    // call above came before, so a forged withdrawal that got through would show by now.
    let removed = broker
        .withdraw_network_config(WithdrawNetworkConfigRequest {
            network_config: Some(reference("leaf-m", "leaf-a", None)),
            reason: "Control".into(),
        })
        .await
        .expect("M withdraws its own NC")
        .into_inner()
        .removed;
    assert!(removed, "A held M's NC");
    eventually(
        "A's tunnel to M rebuilt after M's own withdrawal",
        LIMIT,
        || async {
            tunnel_to(&a, "leaf-m")
                .await
                .filter(|t| t.revision > to_m.revision)
        },
    )
    .await;
    // Nothing else changed: A keeps its tunnels to C (as it was) and to the hub.
    let still = answered_tunnel_to(&a, "leaf-c")
        .await
        .expect("A's broker answers")
        .expect("A lost its tunnel to C");
    assert_eq!(still.remote_pod_cidr_nat, to_c.remote_pod_cidr_nat);
    assert_eq!(still.remote_public_key, to_c.remote_public_key);
    assert!(
        tunnel_to(&a, "hub").await.is_some(),
        "A lost its tunnel to the hub"
    );
}

/// Issue 15 item 9: a holder of the hub's token cannot re-handshake as an already peered
/// cluster with another CA (identity takeover); A's pinned CA and its calls stay. After the
/// operator unpeers A, the hub admits the new CA again (the explicit re-admission).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_ca_for_a_peered_identity_is_refused_until_the_operator_unpeers_it() {
    let hub = start("hub").await;
    let a = start("leaf-a").await;
    let c = start("leaf-c").await;
    peer(&a, &hub).await;
    peer(&c, &hub).await;
    eventually("A's tunnel to the hub", LIMIT, || tunnel_to(&a, "hub")).await;

    let token = hub
        .broker()
        .await
        .expect("connects")
        .get_token(GetTokenRequest {})
        .await
        .expect("token")
        .into_inner()
        .token;
    let hub_tls = hub.tls.as_ref().expect("tls");
    let c_tls = c.tls.as_ref().expect("tls");
    let as_c = c_tls.client("broker", &[&hub]).expect("client");
    let anonymous = handshake_channel(
        &as_c,
        "test",
        &hub_tls.broker.to_string(),
        Timeouts::default(),
        &Metrics::new(),
    )
    .expect("channel");
    let forged = trellis_runtime::tls::ClusterCa::generate("leaf-a").expect("a fresh CA");
    let takeover = HandshakeRequest {
        token: token.clone(),
        identity: identity("leaf-a"),
        addresses: Some(types::ServiceAddresses {
            discovery: "127.0.0.1:9".into(),
            broker: "127.0.0.1:9".into(),
            forwarder: "127.0.0.1:9".into(),
            ipam: "127.0.0.1:9".into(),
            endpoints: "127.0.0.1:9".into(),
            ..Default::default()
        }),
        ca_certificate: forged.cert_pem().to_owned(),
        peering_id: String::new(),
    };
    let err = BrokerClient::new(anonymous.clone())
        .handshake(takeover.clone())
        .await
        .expect_err("a new CA for a peered identity");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    // The hub still pins A's real CA and takes A's calls.
    let record = hub
        .discovery()
        .await
        .expect("connects")
        .get_foreign_cluster(GetForeignClusterRequest {
            cluster_id: "leaf-a".into(),
        })
        .await
        .expect("A known")
        .into_inner()
        .foreign_cluster
        .expect("record");
    let a_tls = a.tls.as_ref().expect("tls");
    assert_eq!(
        record.full.expect("full").ca_certificate,
        a_tls.ca.cert_pem()
    );
    let own = network_configs(&a)
        .await
        .into_iter()
        .find(|n| {
            n.destination
                .as_ref()
                .is_some_and(|d| d.cluster_id == "hub")
        })
        .expect("A's NC to the hub");
    let as_a = a_tls.client("broker", &[&hub]).expect("client");
    let answer = BrokerClient::new(channel(&as_a, hub_tls.broker, "hub"))
        .submit_network_config(SubmitNetworkConfigRequest {
            network_config: Some(types::NetworkConfig {
                status: None,
                ..own
            }),
        })
        .await
        .expect("A is still A")
        .into_inner();
    assert!(answer.accepted);

    // The operator's explicit re-admission: unpeer A, then the new CA is accepted.
    let unpeered = unpeer(&hub, "leaf-a").await;
    assert!(unpeered.unpeered);
    BrokerClient::new(anonymous)
        .handshake(takeover)
        .await
        .expect("re-admitted with the new CA after an unpeer");
}

/// Whether `cluster`'s discovery holds `remote` as an established full peer, and its record.
async fn full_record(cluster: &InProcessCluster, remote: &str) -> (bool, types::FullPeering) {
    let record = cluster
        .discovery()
        .await
        .expect("connects")
        .get_foreign_cluster(GetForeignClusterRequest {
            cluster_id: remote.into(),
        })
        .await
        .expect("known")
        .into_inner()
        .foreign_cluster
        .expect("record");
    let peered = record.conditions.iter().any(|c| {
        c.r#type == Condition::Peered.as_str() && c.status == types::ConditionStatus::True as i32
    });
    (peered, record.full.expect("a full peer"))
}

/// Issue 32 (the same-CA takeover): a cluster's CA certificate is public (servers send it in
/// their chain), so presenting it proves nothing. A holder of the hub's token who re-handshakes
/// as already peered A with A's own CA, without a client certificate or with its own, is
/// refused: the hub keeps A's addresses and peering ID (A's unpeering notice, which names that
/// ID, still ends the peering). A itself re-handshakes over mutual TLS with its certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_holder_presenting_a_peered_clusters_own_ca_cannot_take_over_its_identity() {
    let hub = start("hub").await;
    let a = start("leaf-a").await;
    let c = start("leaf-c").await;
    peer(&a, &hub).await;
    peer(&c, &hub).await;
    eventually("A's tunnel to the hub", LIMIT, || tunnel_to(&a, "hub")).await;
    let (peered, before) = full_record(&hub, "leaf-a").await;
    assert!(peered, "the hub holds A as a peer");
    // A itself may handshake again (a repeated `Peer`): over mutual TLS, as A.
    peer(&a, &hub).await;
    let (peered, again) = full_record(&hub, "leaf-a").await;
    assert!(peered, "A's own re-handshake keeps the peering");
    assert_eq!(again.addresses, before.addresses);

    let token = hub
        .broker()
        .await
        .expect("connects")
        .get_token(GetTokenRequest {})
        .await
        .expect("token")
        .into_inner()
        .token;
    let hub_tls = hub.tls.as_ref().expect("tls");
    let a_tls = a.tls.as_ref().expect("tls");
    let as_c = c
        .tls
        .as_ref()
        .expect("tls")
        .client("broker", &[&hub])
        .expect("client");
    let takeover = HandshakeRequest {
        token,
        identity: identity("leaf-a"),
        addresses: Some(types::ServiceAddresses {
            discovery: "127.0.0.1:9".into(),
            broker: "127.0.0.1:9".into(),
            forwarder: "127.0.0.1:9".into(),
            ipam: "127.0.0.1:9".into(),
            endpoints: "127.0.0.1:9".into(),
            ..Default::default()
        }),
        ca_certificate: a_tls.ca.cert_pem().to_owned(),
        peering_id: "0123456789abcdef0123456789abcdef".into(),
    };
    let anonymous = handshake_channel(
        &as_c,
        "test",
        &hub_tls.broker.to_string(),
        Timeouts::default(),
        &Metrics::new(),
    )
    .expect("channel");
    let err = BrokerClient::new(anonymous)
        .handshake(takeover.clone())
        .await
        .expect_err("A's public CA without A's certificate");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = BrokerClient::new(channel(&as_c, hub_tls.broker, "hub"))
        .handshake(takeover)
        .await
        .expect_err("A's public CA over mutual TLS as C");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");

    let (peered, after) = full_record(&hub, "leaf-a").await;
    assert!(peered, "the hub still holds A as a peer");
    assert_eq!(
        after.addresses, before.addresses,
        "A's addresses at the hub"
    );
    assert_eq!(after.ca_certificate, a_tls.ca.cert_pem());

    // The peering ID the hub keeps is still the one A knows: A's notice ends the peering.
    let unpeered = unpeer(&a, "hub").await;
    assert!(unpeered.unpeered);
    eventually("the hub honours A's unpeering notice", LIMIT, || async {
        (!full_record(&hub, "leaf-a").await.0).then_some(())
    })
    .await;
}

/// Who calls the hub's cluster-facing RPCs in
/// [`every_cluster_facing_rpc_refuses_no_certificate_an_unpinned_ca_and_an_expired_certificate`].
#[derive(Debug, Clone, Copy)]
enum Caller {
    /// Leaf A's own valid certificate: the control, which reaches the handlers.
    Valid,
    /// No client certificate at all.
    Anonymous,
    /// A certificate naming leaf A from a CA the hub never pinned (someone else's CA).
    UnpinnedCa,
    /// Leaf A's pinned CA, but the certificate has expired.
    Expired,
}

/// Leaf A's identity from `ca`, valid from `not_before` to `not_after`, trusting `hub`.
fn as_leaf_a(
    ca: &trellis_runtime::tls::ClusterCa,
    hub: &InProcessCluster,
    not_before: std::time::SystemTime,
    not_after: std::time::SystemTime,
) -> PeerTls {
    let cert = ca
        .issue_with(&trellis_runtime::tls::IssueOptions {
            service: "broker".into(),
            cluster_id: "leaf-a".into(),
            not_before,
            not_after,
        })
        .expect("issues");
    let tls =
        PeerTls::new("leaf-a", ca.cert_pem(), &cert.cert_pem, cert.key_pem()).expect("an identity");
    let hub_ca = hub.tls.as_ref().expect("tls").ca.cert_pem();
    tls.trust()
        .pin(trellis_runtime::tls::PinnedCa::from_pem("hub", hub_ca).expect("pins"));
    tls
}

/// Calls `service`'s cluster-facing RPC at the hub's peer listener `at` as `caller`: the
/// control sends an empty request (refused by the handler's validation, so it proves the call
/// got through the TLS and the authorization layers); the others a well-formed request that
/// speaks for leaf A and would change the hub's state if it were taken.
async fn call_as(
    caller: Caller,
    tls: &PeerTls,
    service: &str,
    at: std::net::SocketAddr,
) -> Result<(), tonic::Status> {
    let channel = match caller {
        Caller::Anonymous => handshake_channel(
            tls,
            "test",
            &at.to_string(),
            Timeouts::default(),
            &Metrics::new(),
        )
        .expect("channel"),
        _ => channel(tls, at, "hub"),
    };
    let valid = matches!(caller, Caller::Valid);
    match service {
        "discovery" => DiscoveryClient::new(channel)
            .publish_neighborhood(if valid {
                PublishNeighborhoodRequest::default()
            } else {
                forged_neighborhood("leaf-a", "hub")
            })
            .await
            .map(drop),
        "broker" => BrokerClient::new(channel)
            .submit_network_config(SubmitNetworkConfigRequest {
                network_config: (!valid).then(|| nc("leaf-a", "hub", None, 1 << 40)),
            })
            .await
            .map(drop),
        "forwarder" => ForwarderClient::new(channel)
            .relay(RelayRequest {
                network_config: (!valid).then(|| nc("leaf-a", "leaf-c", Some("hub"), 1 << 40)),
            })
            .await
            .map(drop),
        "ipam" => IpamClient::new(channel)
            .map_endpoint_ip(if valid {
                MapEndpointIpRequest::default()
            } else {
                induced_map("leaf-a", "10.0.0.10")
            })
            .await
            .map(drop),
        "endpoints" => EndpointMapperClient::new(channel)
            .apply_reflected_slice(if valid {
                ApplyReflectedSliceRequest::default()
            } else {
                apply("leaf-a", "10.0.0.10")
            })
            .await
            .map(drop),
        other => panic!("no cluster-facing RPC chosen for {other}"),
    }
}

/// Calls `path` at `at` with an empty message as `caller`, whatever the method's types (an
/// empty message decodes as any of them).
async fn raw_call(
    caller: Caller,
    tls: &PeerTls,
    at: std::net::SocketAddr,
    path: &'static str,
) -> Result<(), tonic::Status> {
    let channel = match caller {
        Caller::Anonymous => handshake_channel(
            tls,
            "test",
            &at.to_string(),
            Timeouts::default(),
            &Metrics::new(),
        )
        .expect("channel"),
        _ => channel(tls, at, "hub"),
    };
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(()),
        http::uri::PathAndQuery::from_static(path),
        tonic_prost::ProstCodec::<(), ()>::default(),
    )
    .await
    .map(drop)
}

/// What the hub holds that the refused calls would change.
async fn hub_state(
    hub: &InProcessCluster,
) -> (
    Vec<types::NetworkConfig>,
    Vec<String>,
    Vec<EndpointMapping>,
    Vec<ReflectedSlice>,
) {
    (
        network_configs(hub).await,
        known(hub).await,
        endpoint_mappings(hub).await,
        reflected(hub).await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cluster_facing_rpc_refuses_no_certificate_an_unpinned_ca_and_an_expired_certificate()
{
    use std::time::SystemTime;
    let hub = start("hub").await;
    let a = start("leaf-a").await;
    peer(&a, &hub).await;
    eventually("A's tunnel to the hub", LIMIT, || tunnel_to(&a, "hub")).await;
    let hub_tls = hub.tls.as_ref().expect("tls");
    let a_ca = &a.tls.as_ref().expect("tls").ca;
    let now = SystemTime::now();
    let hour = Duration::from_secs(3600);
    let valid = as_leaf_a(a_ca, &hub, now - hour, now + hour);
    let stranger = trellis_runtime::tls::ClusterCa::generate("leaf-a").expect("a CA");
    let unpinned = as_leaf_a(&stranger, &hub, now - hour, now + hour);
    // Nothing makes an expired identity (PeerTls refuses one): this one expires in a moment.
    let expires = now + Duration::from_secs(2);
    let expired = as_leaf_a(a_ca, &hub, now - hour, expires);
    while SystemTime::now() < expires + Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let before = hub_state(&hub).await;
    let services = [
        ("discovery", hub_tls.discovery),
        ("broker", hub_tls.broker),
        ("forwarder", hub_tls.forwarder),
        ("ipam", hub_tls.ipam),
        ("endpoints", hub_tls.endpoints),
    ];
    let mut table = Vec::new();
    for (service, at) in services {
        // The control: leaf A's valid certificate reaches the handler, which refuses the empty
        // request for what it is.
        let err = call_as(Caller::Valid, &valid, service, at)
            .await
            .expect_err("an empty request");
        assert_eq!(
            err.code(),
            Code::InvalidArgument,
            "{service}: a valid certificate must reach the handler: {err:?}"
        );
        for (caller, tls) in [
            (Caller::Anonymous, &valid),
            (Caller::UnpinnedCa, &unpinned),
            (Caller::Expired, &expired),
        ] {
            let err = call_as(caller, tls, service, at)
                .await
                .expect_err("refused");
            // Refused at the TLS handshake (the transport fails), or, on a listener that also
            // serves anonymous callers (the broker's handshake, discovery's identity), by the
            // authorization layer before any handler runs.
            let at_tls = matches!(
                err.code(),
                Code::Unavailable | Code::Unknown | Code::Cancelled
            );
            let by_authz = matches!(caller, Caller::Anonymous)
                && matches!(err.code(), Code::PermissionDenied | Code::Unauthenticated);
            assert!(
                at_tls || by_authz,
                "{service} as {caller:?}: not refused before the handler: {err:?}"
            );
            if matches!(caller, Caller::UnpinnedCa | Caller::Expired) {
                refused_by_tls_for(&err, caller);
            }
            table.push(format!("{service:<10} {caller:<11?} {:?}", err.code()));
        }
    }
    // Beyond one RPC per service: every cluster-facing method of every service, called with an
    // empty message by each refused caller, is refused before a handler sees it.
    let every: [(&str, std::net::SocketAddr, &[&str]); 5] = [
        (
            "discovery",
            hub_tls.discovery,
            trellis_discovery::grpc::PEER_METHODS.authenticated,
        ),
        (
            "broker",
            hub_tls.broker,
            trellis_broker::grpc::PEER_METHODS.authenticated,
        ),
        (
            "forwarder",
            hub_tls.forwarder,
            trellis_forwarder::grpc::PEER_METHODS.authenticated,
        ),
        (
            "ipam",
            hub_tls.ipam,
            trellis_ipam::grpc::PEER_METHODS.authenticated,
        ),
        (
            "endpoints",
            hub_tls.endpoints,
            trellis_endpoints::grpc::PEER_METHODS.authenticated,
        ),
    ];
    let mut methods = 0;
    for (service, at, paths) in every {
        for path in paths {
            methods += 1;
            // The control: leaf A's valid certificate gets past TLS (the handler answers).
            if let Err(err) = raw_call(Caller::Valid, &valid, at, path).await {
                assert!(
                    !matches!(
                        err.code(),
                        Code::Unavailable | Code::Unknown | Code::Cancelled
                    ),
                    "{service} {path} with a valid certificate: {err:?}"
                );
            }
            for (caller, tls) in [
                (Caller::Anonymous, &valid),
                (Caller::UnpinnedCa, &unpinned),
                (Caller::Expired, &expired),
            ] {
                let err = raw_call(caller, tls, at, path).await.expect_err("refused");
                let refused = matches!(
                    err.code(),
                    Code::Unavailable | Code::Unknown | Code::Cancelled
                ) || (matches!(caller, Caller::Anonymous)
                    && err.code() == Code::PermissionDenied);
                assert!(refused, "{service} {path} as {caller:?}: {err:?}");
            }
        }
    }
    assert!(methods >= 12, "only {methods} cluster-facing methods");
    eprintln!("refusals:\n{}", table.join("\n"));
    assert_eq!(
        hub_state(&hub).await,
        before,
        "a refused call changed the hub's state"
    );
}

/// [`refused_by_tls`], also accepting the alert each caller's certificate gets: a chain whose
/// signature does not verify against the pinned CA of the name it claims (`DecryptError`, as
/// rustls reports a bad signature), an expired one (`CertificateExpired`).
fn refused_by_tls_for(err: &tonic::Status, caller: Caller) {
    let shown = format!("{err:?}");
    let alert = match caller {
        Caller::UnpinnedCa => "DecryptError",
        Caller::Expired => "CertificateExpired",
        Caller::Valid | Caller::Anonymous => "",
    };
    if !alert.is_empty() && shown.contains(alert) {
        return;
    }
    refused_by_tls(err);
}
