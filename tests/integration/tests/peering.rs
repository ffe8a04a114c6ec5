//! Full peering through the brokers, in process with memory stores: the token handshake, the
//! NetworkConfig exchange with remapping of identical pod CIDRs, TunnelEndpoints on both ends
//! with consistent NAT views, unpeering, and refused input.

use std::time::Duration;

use tonic::Code;
use trellis_api::pb::ipam::ListClusterSubnetsRequest;
use trellis_api::pb::peering::*;
use trellis_api::pb::types::{self as types};
use trellis_api::peers::UNPEERED_REASON;
use trellis_integration::cluster::InProcessCluster;
use trellis_integration::peering::unpeer;
use trellis_integration::peering::{
    Peerable, answered_tunnel_to, eventually, no_tunnel_to, peer_with_token, token, tunnel_to,
    tunnels,
};

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_peering_remaps_identical_pod_cidrs_and_both_ends_agree() {
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let b = InProcessCluster::start("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts");

    let answer = peer_with_token(&a, &b, token(&b).await)
        .await
        .expect("peers");
    assert_eq!(
        answer.identity.map(|i| i.cluster_id).as_deref(),
        Some("hub-b")
    );

    let a_to_b = eventually("A's tunnel to B", LIMIT, || tunnel_to(&a, "hub-b")).await;
    let b_to_a = eventually("B's tunnel to A", LIMIT, || tunnel_to(&b, "leaf-a")).await;
    assert_eq!(a_to_b.kind, types::PeeringKind::Full as i32);
    // Identical real CIDRs: each side remaps the other.
    assert_eq!(a_to_b.remote_pod_cidr, "10.0.0.0/16");
    assert_ne!(a_to_b.remote_pod_cidr_nat, "10.0.0.0/16");
    assert_ne!(b_to_a.remote_pod_cidr_nat, "10.0.0.0/16");
    // How B addresses A (B's decision) is what A learned as its local NAT for B, and back.
    assert_eq!(a_to_b.local_pod_cidr_nat, b_to_a.remote_pod_cidr_nat);
    assert_eq!(
        a_to_b.local_external_cidr_nat,
        b_to_a.remote_external_cidr_nat
    );
    assert_eq!(b_to_a.local_pod_cidr_nat, a_to_b.remote_pod_cidr_nat);
    assert_eq!(
        b_to_a.local_external_cidr_nat,
        a_to_b.remote_external_cidr_nat
    );
    // Each end tunnels to the other's gateway with the other's key.
    assert!(!a_to_b.remote_public_key.is_empty());
    assert_ne!(a_to_b.remote_public_key, b_to_a.remote_public_key);

    // The IPAMs hold the same views.
    let a_ipam = a
        .ipam()
        .await
        .expect("ipam")
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists")
        .into_inner();
    let record = a_ipam
        .clusters
        .iter()
        .find(|c| c.cluster_id == "hub-b")
        .expect("A's IPAM knows B");
    assert_eq!(record.remote_pod_cidr_nat, a_to_b.remote_pod_cidr_nat);
    assert_eq!(record.local_pod_cidr_nat, a_to_b.local_pod_cidr_nat);

    // Peering again is idempotent: same tunnel, same views.
    peer_with_token(&a, &b, token(&b).await)
        .await
        .expect("peers again");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = tunnel_to(&a, "hub-b").await.expect("still there");
    assert_eq!(again.remote_pod_cidr_nat, a_to_b.remote_pod_cidr_nat);
    assert_eq!(again.generation, a_to_b.generation);

    // Unpeering removes the tunnels and the IPAM mappings on both sides.
    let unpeered = unpeer(&a, "hub-b").await;
    assert!(unpeered.unpeered);
    eventually("A's tunnels gone", LIMIT, || async {
        tunnels(&a).await.expect("lists").is_empty().then_some(())
    })
    .await;
    eventually("B's tunnels gone", LIMIT, || async {
        tunnels(&b).await.expect("lists").is_empty().then_some(())
    })
    .await;
    eventually("B's IPAM mapping of A freed", LIMIT, || async {
        let listed = b
            .ipam()
            .await
            .ok()?
            .list_cluster_subnets(ListClusterSubnetsRequest {})
            .await
            .ok()?
            .into_inner();
        listed.clusters.is_empty().then_some(())
    })
    .await;
    let again = unpeer(&a, "hub-b").await;
    assert!(!again.unpeered);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_permission_denied_and_stores_nothing_on_either_side() {
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let b = InProcessCluster::start("hub-b", "10.1.0.0/16", "10.202.0.0/16")
        .await
        .expect("b starts");
    let err = peer_with_token(&a, &b, "not-the-token-of-b-at-all".into())
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    nothing_stored(&[&a, &b]).await;
    // A rotated token: the old one keeps working only during the grace period.
    let old = token(&b).await;
    b.broker()
        .await
        .expect("broker")
        .rotate_token(RotateTokenRequest { grace_period: None })
        .await
        .expect("rotates");
    let err = peer_with_token(&a, &b, old)
        .await
        .expect_err("old token refused");
    assert_eq!(err.code(), Code::PermissionDenied);
    peer_with_token(&a, &b, token(&b).await)
        .await
        .expect("new token accepted");
    a.stop().await;
    b.stop().await;
}

/// Neither cluster knows a foreign cluster or holds a NetworkConfig.
async fn nothing_stored(clusters: &[&InProcessCluster]) {
    for cluster in clusters {
        let listed = cluster
            .discovery()
            .await
            .expect("discovery")
            .list_foreign_clusters(trellis_api::pb::discovery::ListForeignClustersRequest {
                kind: 0,
            })
            .await
            .expect("lists")
            .into_inner();
        assert!(
            listed.foreign_clusters.is_empty(),
            "{}: {:?}",
            cluster.id,
            listed.foreign_clusters
        );
        let ncs = cluster
            .broker()
            .await
            .expect("broker")
            .list_network_configs(ListNetworkConfigsRequest::default())
            .await
            .expect("lists");
        assert!(ncs.into_inner().network_configs.is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_tokens_expire_and_are_revoked_and_a_refused_one_stores_nothing() {
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let b = InProcessCluster::start("hub-b", "10.1.0.0/16", "10.202.0.0/16")
        .await
        .expect("b starts");
    let mut broker = b.broker().await.expect("broker");
    let create = |ttl_secs: i64, description: &str| CreateJoinTokenRequest {
        ttl: Some(prost_types::Duration {
            seconds: ttl_secs,
            nanos: 0,
        }),
        description: description.into(),
    };

    // Expired: refused, and the message says so.
    let short = broker
        .create_join_token(create(1, "expires at once"))
        .await
        .expect("created")
        .into_inner();
    let short_id = short.join_token.as_ref().expect("metadata").id.clone();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let err = peer_with_token(&a, &b, short.token.clone())
        .await
        .expect_err("an expired join token is refused");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(
        err.message().contains(&short_id) && err.message().contains("expired at"),
        "{err:?}"
    );

    // Revoked: refused from then on.
    let revoked = broker
        .create_join_token(create(3600, "revoked"))
        .await
        .expect("created")
        .into_inner();
    let revoked_id = revoked.join_token.as_ref().expect("metadata").id.clone();
    let answer = broker
        .revoke_join_token(RevokeJoinTokenRequest {
            id: revoked_id.clone(),
        })
        .await
        .expect("revokes")
        .into_inner();
    assert!(answer.revoked);
    let err = peer_with_token(&a, &b, revoked.token)
        .await
        .expect_err("a revoked join token is refused");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("revoked"), "{err:?}");
    nothing_stored(&[&a, &b]).await;

    // The list shows the expired one (kept to say it expired), not the revoked one; no secret.
    let listed = broker
        .list_join_tokens(ListJoinTokensRequest {})
        .await
        .expect("lists")
        .into_inner();
    let ids: Vec<&str> = listed.join_tokens.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, vec![short_id.as_str()]);
    assert_eq!(listed.join_tokens[0].description, "expires at once");

    // Bad requests name the field and create nothing.
    for (request, field) in [
        (create(0, ""), "ttl"),
        (create(400 * 86_400, ""), "ttl"),
        (create(60, &"x".repeat(300)), "description"),
    ] {
        let err = broker
            .create_join_token(request)
            .await
            .expect_err("refused");
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(field), "{err:?}");
    }
    let err = broker
        .revoke_join_token(RevokeJoinTokenRequest {
            id: "NOT-AN-ID".into(),
        })
        .await
        .expect_err("refused");
    assert!(err.message().contains("id"), "{err:?}");
    let still = broker
        .list_join_tokens(ListJoinTokensRequest {})
        .await
        .expect("lists")
        .into_inner();
    assert_eq!(still.join_tokens.len(), 1);

    // A live join token peers.
    let live = broker
        .create_join_token(create(3600, "leaf-a"))
        .await
        .expect("created")
        .into_inner();
    peer_with_token(&a, &b, live.token)
        .await
        .expect("a live join token is accepted");
    eventually("A's tunnel to B", LIMIT, || tunnel_to(&a, "hub-b")).await;
    a.stop().await;
    b.stop().await;
}

fn network_config(origin: &str, destination: &str, pod: &str) -> types::NetworkConfig {
    types::NetworkConfig {
        name: format!("{origin}--{destination}"),
        origin: Some(types::ClusterIdentity {
            cluster_id: origin.into(),
            cluster_name: origin.into(),
        }),
        destination: Some(types::ClusterIdentity {
            cluster_id: destination.into(),
            cluster_name: destination.into(),
        }),
        via: None,
        spec: Some(types::NetworkConfigSpec {
            pod_cidr: pod.into(),
            external_cidr: "10.209.0.0/16".into(),
            endpoint: "127.0.0.1:51999".into(),
            public_key: "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=".into(),
            stateless_wire: false,
        }),
        status: None,
        generation: 1,
        update_time: None,
        held_generation: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_network_configs_are_refused_with_clear_errors_and_store_nothing() {
    let b = InProcessCluster::start("hub-b", "10.1.0.0/16", "10.202.0.0/16")
        .await
        .expect("b starts");
    let mut broker = b.broker().await.expect("broker");
    let submit = |nc: types::NetworkConfig| SubmitNetworkConfigRequest {
        network_config: Some(nc),
    };

    let err = broker
        .submit_network_config(submit(network_config("stranger", "hub-b", "10.0.0.0/16")))
        .await
        .expect_err("not a peer");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    let err = broker
        .submit_network_config(submit(network_config("stranger", "hub-b", "10.0.0.1/16")))
        .await
        .expect_err("bad cidr");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("network_config.spec.pod_cidr"),
        "{err:?}"
    );
    let err = broker
        .submit_network_config(submit(network_config(
            "stranger",
            "someone-else",
            "10.0.0.0/16",
        )))
        .await
        .expect_err("not for us");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("network_config.destination"),
        "{err:?}"
    );
    let mut renamed = network_config("stranger", "hub-b", "10.0.0.0/16");
    renamed.name = "other--hub-b".into();
    let err = broker
        .submit_network_config(submit(renamed))
        .await
        .expect_err("name mismatch");
    assert!(err.message().contains("network_config.name"), "{err:?}");
    let mut relayed = network_config("stranger", "hub-b", "10.0.0.0/16");
    relayed.via = Some(types::ClusterIdentity {
        cluster_id: "not-a-peer-hub".into(),
        cluster_name: String::new(),
    });
    let err = broker
        .submit_network_config(submit(relayed))
        .await
        .expect_err("unknown hub");
    // Refused for now, not for good: a hub may relay before our side of its peering is
    // recorded, and its forwarder must retry rather than give the relay up (nothing is stored
    // either way, checked below).
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("not-a-peer-hub"), "{err:?}");
    // The same through the batch RPC: each item gets the error its own call would have.
    let batch = broker
        .submit_network_config_batch(SubmitNetworkConfigBatchRequest {
            requests: vec![
                submit(network_config("stranger", "hub-b", "10.0.0.0/16")),
                submit(network_config("stranger", "hub-b", "10.0.0.1/16")),
                submit(network_config("stranger", "someone-else", "10.0.0.0/16")),
            ],
        })
        .await
        .expect("a batch of bad items is answered item by item")
        .into_inner()
        .results;
    let errors: Vec<(i32, String)> = batch
        .into_iter()
        .map(|r| match r.result {
            Some(submit_network_config_result::Result::Error(e)) => (e.code, e.message),
            other => panic!("expected an error, got {other:?}"),
        })
        .collect();
    assert_eq!(errors.len(), 3);
    assert_eq!(errors[0].0, Code::PermissionDenied as i32, "{errors:?}");
    assert_eq!(errors[1].0, Code::InvalidArgument as i32, "{errors:?}");
    assert!(
        errors[1].1.contains("network_config.spec.pod_cidr"),
        "{errors:?}"
    );
    assert!(
        errors[2].1.contains("network_config.destination"),
        "{errors:?}"
    );
    let err = broker
        .submit_network_config_batch(SubmitNetworkConfigBatchRequest {
            requests: vec![
                submit(network_config("stranger", "hub-b", "10.0.0.0/16"));
                trellis_runtime::batch::MAX_ITEMS + 1
            ],
        })
        .await
        .expect_err("too many items");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("requests"), "{err:?}");
    let err = broker
        .handshake(HandshakeRequest {
            token: String::new(),
            identity: None,
            addresses: None,
            ca_certificate: String::new(),
            peering_id: String::new(),
        })
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::PermissionDenied);
    let stranger = Some(types::ClusterIdentity {
        cluster_id: "stranger".into(),
        cluster_name: "stranger".into(),
    });
    let err = broker
        .handshake(HandshakeRequest {
            token: "a-token".into(),
            identity: stranger.clone(),
            addresses: Some(types::ServiceAddresses {
                broker: "127.0.0.1:9".into(),
                ..Default::default()
            }),
            ca_certificate: String::new(),
            peering_id: "Not-Hex".into(),
        })
        .await
        .expect_err("bad peering ID");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("peering_id"), "{err:?}");
    let err = broker
        .notify_unpeer(NotifyUnpeerRequest {
            identity: stranger,
            reason: UNPEERED_REASON.into(),
            peering_id: "z".repeat(80),
        })
        .await
        .expect_err("bad peering ID");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("peering_id"), "{err:?}");

    let ncs = broker
        .list_network_configs(ListNetworkConfigsRequest::default())
        .await
        .expect("lists")
        .into_inner();
    assert!(ncs.network_configs.is_empty(), "{:?}", ncs.network_configs);
    let ipam = b
        .ipam()
        .await
        .expect("ipam")
        .list_cluster_subnets(ListClusterSubnetsRequest {})
        .await
        .expect("lists")
        .into_inner();
    assert!(ipam.clusters.is_empty());
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaves_of_a_hub_build_an_induced_peering_with_consistent_nat_views() {
    // All three clusters use the same pod and external CIDRs.
    let b = InProcessCluster::start("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let c = InProcessCluster::start("leaf-c", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("c starts");
    peer_with_token(&a, &b, token(&b).await)
        .await
        .expect("a peers with b");
    peer_with_token(&c, &b, token(&b).await)
        .await
        .expect("c peers with b");

    let a_to_c = eventually("A's induced tunnel to C", LIMIT, || tunnel_to(&a, "leaf-c")).await;
    let c_to_a = eventually("C's induced tunnel to A", LIMIT, || tunnel_to(&c, "leaf-a")).await;
    for t in [&a_to_c, &c_to_a] {
        assert_eq!(t.kind, types::PeeringKind::Induced as i32, "{t:?}");
        assert_eq!(t.via.as_ref().map(|v| v.cluster_id.as_str()), Some("hub-b"));
    }
    // A's view of C is C's local NAT for A, and back.
    assert_eq!(a_to_c.remote_pod_cidr_nat, c_to_a.local_pod_cidr_nat);
    assert_eq!(c_to_a.remote_pod_cidr_nat, a_to_c.local_pod_cidr_nat);
    assert_eq!(
        a_to_c.remote_external_cidr_nat,
        c_to_a.local_external_cidr_nat
    );
    assert_ne!(
        a_to_c.remote_pod_cidr_nat, "10.0.0.0/16",
        "identical CIDRs must be remapped"
    );
    // The tunnel goes to C's gateway directly, not to the hub's.
    let b_to_c = eventually("B's tunnel to C", LIMIT, || tunnel_to(&b, "leaf-c")).await;
    assert_eq!(
        a_to_c.remote_public_key, b_to_c.remote_public_key,
        "A tunnels to C's own key"
    );
    // The hub holds full tunnels for both leaves and no relay once the exchange completed.
    eventually("B's tunnel to A", LIMIT, || tunnel_to(&b, "leaf-a")).await;
    let relays = eventually("the hub's relays to drain", LIMIT, || async {
        let mut f = trellis_api::pb::peering::forwarder_client::ForwarderClient::connect(format!(
            "http://{}",
            b.services.forwarder
        ))
        .await
        .ok()?;
        let relays = f
            .list_relays(ListRelaysRequest::default())
            .await
            .ok()?
            .into_inner()
            .relays;
        relays.is_empty().then_some(relays)
    })
    .await;
    assert!(relays.is_empty());

    // B unpeers C: the induced peering between A and C is withdrawn on both leaves.
    unpeer(&b, "leaf-c").await;
    eventually("A's tunnel to C withdrawn", LIMIT, || async {
        no_tunnel_to(&a, "leaf-c").await
    })
    .await;
    eventually("C's tunnel to A withdrawn", LIMIT, || async {
        no_tunnel_to(&c, "leaf-a").await
    })
    .await;
    assert!(
        tunnel_to(&a, "hub-b").await.is_some(),
        "A keeps its full peering with B"
    );
    for cluster in [a, b, c] {
        cluster.stop().await;
    }
}

/// Induced ForeignClusters a cluster's discovery holds, withdrawn or not.
async fn induced_clusters(cluster: &InProcessCluster) -> Vec<String> {
    use trellis_api::pb::discovery::ListForeignClustersRequest;
    cluster
        .discovery()
        .await
        .expect("connects")
        .list_foreign_clusters(ListForeignClustersRequest::default())
        .await
        .expect("lists")
        .into_inner()
        .foreign_clusters
        .into_iter()
        .filter(|fc| fc.kind == types::PeeringKind::Induced as i32)
        .filter_map(|fc| fc.identity.map(|i| i.cluster_id))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_without_induced_peering_introduces_nobody_and_leaves_stay_apart() {
    let b = InProcessCluster::start_without_induced("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let c = InProcessCluster::start("leaf-c", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("c starts");
    peer_with_token(&a, &b, token(&b).await)
        .await
        .expect("a peers with b");
    peer_with_token(&c, &b, token(&b).await)
        .await
        .expect("c peers with b");
    for (leaf, name) in [(&a, "A"), (&c, "C")] {
        eventually(&format!("{name}'s full tunnel to the hub"), LIMIT, || {
            tunnel_to(leaf, "hub-b")
        })
        .await;
    }
    eventually("B's full tunnels to both leaves", LIMIT, || async {
        (tunnels(&b).await.expect("lists").len() == 2).then_some(())
    })
    .await;
    // The hub still sends (empty) Neighborhoods at once on every change and on each resync
    // (5 s here); with induced peering on, leaves learn of each other well within that.
    tokio::time::sleep(Duration::from_secs(6)).await;
    for (leaf, name) in [(&a, "A"), (&c, "C")] {
        assert!(
            induced_clusters(leaf).await.is_empty(),
            "{name} must not learn of the other leaf"
        );
        let remotes: Vec<_> = tunnels(leaf)
            .await
            .expect("lists")
            .into_iter()
            .filter_map(|t| t.remote.map(|r| r.cluster_id))
            .collect();
        assert_eq!(remotes, ["hub-b"], "{name} tunnels only to the hub");
    }
    for cluster in [a, b, c] {
        cluster.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_forwarder_refuses_bad_relays_and_stores_nothing() {
    let b = InProcessCluster::start("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start("leaf-a", "10.1.0.0/16", "10.202.0.0/16")
        .await
        .expect("a starts");
    peer_with_token(&a, &b, token(&b).await)
        .await
        .expect("a peers with b");
    let mut forwarder = trellis_api::pb::peering::forwarder_client::ForwarderClient::connect(
        format!("http://{}", b.services.forwarder),
    )
    .await
    .expect("forwarder");
    let relayed = |origin: &str, destination: &str, via: &str, pod: &str| {
        let mut nc = network_config(origin, destination, pod);
        nc.via = Some(types::ClusterIdentity {
            cluster_id: via.into(),
            cluster_name: String::new(),
        });
        RelayRequest {
            network_config: Some(nc),
        }
    };

    // The destination is not a peer of the hub.
    let err = forwarder
        .relay(relayed("leaf-a", "stranger", "hub-b", "10.1.0.0/16"))
        .await
        .expect_err("unknown destination");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("stranger"), "{err:?}");
    // The origin is not a peer of the hub.
    let err = forwarder
        .relay(relayed("stranger", "leaf-a", "hub-b", "10.1.0.0/16"))
        .await
        .expect_err("unknown origin");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    // Relayed through another hub.
    let err = forwarder
        .relay(relayed("leaf-a", "leaf-c", "other-hub", "10.1.0.0/16"))
        .await
        .expect_err("not via us");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("network_config.via"), "{err:?}");
    // Malformed CIDR, and a relay to itself.
    let err = forwarder
        .relay(relayed("leaf-a", "leaf-c", "hub-b", "10.1.0.0/33"))
        .await
        .expect_err("bad cidr");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("network_config.spec.pod_cidr"),
        "{err:?}"
    );
    let err = forwarder
        .relay(relayed("leaf-a", "leaf-a", "hub-b", "10.1.0.0/16"))
        .await
        .expect_err("to itself");
    assert_eq!(err.code(), Code::InvalidArgument);
    // The same through the batch RPC: each item gets the error its own call would have.
    let batch = forwarder
        .relay_batch(RelayBatchRequest {
            requests: vec![
                relayed("leaf-a", "stranger", "hub-b", "10.1.0.0/16"),
                relayed("leaf-a", "leaf-c", "other-hub", "10.1.0.0/16"),
                relayed("leaf-a", "leaf-c", "hub-b", "10.1.0.0/33"),
            ],
        })
        .await
        .expect("a batch of bad items is answered item by item")
        .into_inner()
        .results;
    let errors: Vec<(i32, String)> = batch
        .into_iter()
        .map(|r| match r.result {
            Some(relay_result::Result::Error(e)) => (e.code, e.message),
            other => panic!("expected an error, got {other:?}"),
        })
        .collect();
    assert_eq!(errors.len(), 3);
    assert_eq!(errors[0].0, Code::PermissionDenied as i32, "{errors:?}");
    assert!(errors[0].1.contains("stranger"), "{errors:?}");
    assert!(errors[1].1.contains("network_config.via"), "{errors:?}");
    assert!(
        errors[2].1.contains("network_config.spec.pod_cidr"),
        "{errors:?}"
    );
    let err = forwarder
        .relay_batch(RelayBatchRequest {
            requests: vec![
                relayed("leaf-a", "stranger", "hub-b", "10.1.0.0/16");
                trellis_runtime::batch::MAX_ITEMS + 1
            ],
        })
        .await
        .expect_err("too many items");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("requests"), "{err:?}");
    // A status report naming the hub itself as an end.
    let err = forwarder
        .relay_status(RelayStatusRequest {
            network_config: Some(types::NetworkConfigRef {
                name: "leaf-a--hub-b".into(),
                origin: Some(types::ClusterIdentity {
                    cluster_id: "leaf-a".into(),
                    cluster_name: String::new(),
                }),
                destination: Some(types::ClusterIdentity {
                    cluster_id: "hub-b".into(),
                    cluster_name: String::new(),
                }),
                via: Some(types::ClusterIdentity {
                    cluster_id: "hub-b".into(),
                    cluster_name: String::new(),
                }),
            }),
            status: None,
        })
        .await
        .expect_err("the hub cannot be an end");
    assert_eq!(err.code(), Code::InvalidArgument);

    let relays = forwarder
        .list_relays(ListRelaysRequest::default())
        .await
        .expect("lists")
        .into_inner()
        .relays;
    assert!(relays.is_empty(), "{relays:?}");
    a.stop().await;
    b.stop().await;
}

/// Issue 15 item 1, the lab repro: one `WithdrawNetworkConfig` to leaf-2 for `leaf-1--leaf-2`
/// via the hub (plaintext, so the claim is taken) removes leaf-2's tunnel to leaf-1. The
/// exchange must heal by itself: both leaves end with tunnels to each other again, with
/// matching NAT views, within a few resyncs (2 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_withdrawn_network_config_heals_on_both_sides() {
    let hub = InProcessCluster::start("hub", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("starts");
    let one = InProcessCluster::start("leaf-1", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("starts");
    let two = InProcessCluster::start("leaf-2", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("starts");
    trellis_integration::peering::peer(&one, &hub).await;
    trellis_integration::peering::peer(&two, &hub).await;
    eventually("leaf-1's tunnel to leaf-2", LIMIT, || {
        tunnel_to(&one, "leaf-2")
    })
    .await;
    eventually("leaf-2's tunnel to leaf-1", LIMIT, || {
        tunnel_to(&two, "leaf-1")
    })
    .await;

    let id = |c: &str| types::ClusterIdentity {
        cluster_id: c.into(),
        cluster_name: c.into(),
    };
    let removed = two
        .broker()
        .await
        .expect("connects")
        .withdraw_network_config(WithdrawNetworkConfigRequest {
            network_config: Some(types::NetworkConfigRef {
                name: "leaf-1--leaf-2".into(),
                origin: Some(id("leaf-1")),
                destination: Some(id("leaf-2")),
                via: Some(id("hub")),
            }),
            reason: "Repro".into(),
        })
        .await
        .expect("plaintext takes the claim")
        .into_inner()
        .removed;
    assert!(removed);

    let healed = Duration::from_secs(40);
    eventually("leaf-2's tunnel to leaf-1 back", healed, || {
        tunnel_to(&two, "leaf-1")
    })
    .await;
    // Views consistent: what each side calls itself is what the other calls it. Wait for the
    // re-sent exchange to settle on both ends.
    eventually("matching views", healed, || async {
        let a = tunnel_to(&one, "leaf-2").await?;
        let b = tunnel_to(&two, "leaf-1").await?;
        (a.local_pod_cidr_nat == b.remote_pod_cidr_nat
            && b.local_pod_cidr_nat == a.remote_pod_cidr_nat)
            .then_some(())
    })
    .await;
}

/// A NetworkConfig of a new generation makes the receiver send its own again (the remote may
/// have lost it), except when it comes from the incarnation that decided on the receiver's
/// (the `receiver_generation` that remote put in its status) or says it holds the receiver's
/// current one (`held_generation`) (ADR 0012). Driven by hand through
/// leaf-1's broker, as the hub relaying for leaf-2: first a status naming generation X, then
/// leaf-2's NetworkConfig at X (kept), then at X + 1 (re-sent, and decided by the real leaf-2),
/// then at X + 2 saying it holds leaf-1's current generation (kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_config_from_the_incarnation_that_decided_on_ours_does_not_make_us_resend() {
    let start = |id: &'static str| InProcessCluster::start(id, "10.0.0.0/16", "10.201.0.0/16");
    let (hub, one, two) = (
        start("hub").await.expect("starts"),
        start("leaf-1").await.expect("starts"),
        start("leaf-2").await.expect("starts"),
    );
    trellis_integration::peering::peer(&one, &hub).await;
    trellis_integration::peering::peer(&two, &hub).await;
    eventually("leaf-1's tunnel to leaf-2", LIMIT, || {
        tunnel_to(&one, "leaf-2")
    })
    .await;

    let id = |c: &str| types::ClusterIdentity {
        cluster_id: c.into(),
        cluster_name: c.into(),
    };
    let broker = one.broker().await.expect("connects");
    // leaf-1's NetworkConfig towards leaf-2 (origin leaf-1) and the one it received.
    let ncs = |origin: &'static str| {
        let mut broker = broker.clone();
        async move {
            broker
                .list_network_configs(ListNetworkConfigsRequest {
                    cluster_id: "leaf-2".into(),
                })
                .await
                .expect("lists")
                .into_inner()
                .network_configs
                .into_iter()
                .find(|nc| nc.origin.as_ref().is_some_and(|o| o.cluster_id == origin))
                .expect("held")
        }
    };
    let ours = ncs("leaf-1").await;
    let theirs = ncs("leaf-2").await;
    let decided = ours.status.clone().expect("leaf-2 decided on ours");
    assert_eq!(decided.state, types::NetworkConfigState::Processed as i32);

    // leaf-2's decision again, now naming generation X as its own.
    let x = theirs.generation + 1000;
    let applied = broker
        .clone()
        .report_network_config_status(ReportNetworkConfigStatusRequest {
            network_config: Some(types::NetworkConfigRef {
                name: "leaf-1--leaf-2".into(),
                origin: Some(id("leaf-1")),
                destination: Some(id("leaf-2")),
                via: Some(id("hub")),
            }),
            status: Some(types::NetworkConfigStatus {
                receiver_generation: x,
                ..decided.clone()
            }),
        })
        .await
        .expect("plaintext takes the claim")
        .into_inner()
        .applied;
    assert!(applied);
    assert_eq!(
        ncs("leaf-1").await.status.map(|s| s.receiver_generation),
        Some(x)
    );

    let submit = |generation: i64, held_generation: i64| {
        let mut broker = broker.clone();
        let nc = types::NetworkConfig {
            generation,
            held_generation,
            status: None,
            ..theirs.clone()
        };
        async move {
            broker
                .submit_network_config(SubmitNetworkConfigRequest {
                    network_config: Some(nc),
                })
                .await
                .expect("accepted")
                .into_inner()
        }
    };
    let answer = submit(x, 0).await;
    assert!(answer.accepted);
    assert_eq!(
        answer.status.map(|s| s.receiver_generation),
        Some(ours.generation),
        "the answer names leaf-1's own generation towards leaf-2"
    );
    assert_eq!(
        ncs("leaf-1").await.status.map(|s| s.state),
        Some(types::NetworkConfigState::Processed as i32),
        "the incarnation that decided on ours holds it: nothing to re-send"
    );

    assert_eq!(
        ncs("leaf-1").await.status.map(|s| s.receiver_generation),
        Some(x),
        "the decision stands"
    );

    // A later incarnation may have lost ours: leaf-1 sends it again, and the real leaf-2
    // answers with its own generation.
    assert!(submit(x + 1, 0).await.accepted);
    eventually(
        "leaf-1's network config re-sent and decided again",
        LIMIT,
        || async {
            (ncs("leaf-1").await.status.map(|s| s.receiver_generation) == Some(theirs.generation))
                .then_some(())
        },
    )
    .await;

    // A new incarnation that says it holds leaf-1's current generation (`held_generation`)
    // does not need it again either.
    assert!(submit(x + 2, ours.generation).await.accepted);
    assert_eq!(
        ncs("leaf-1").await.status.map(|s| s.receiver_generation),
        Some(theirs.generation),
        "the decision stands"
    );
}

/// Two hubs introduce the same pair of leaves (issue 15, item 4). The introductions come in at
/// different times, but both ends relay through the hub with the smallest ID, so they agree:
/// first introduced by `hub-2` alone, the pair moves to `hub-1` once that hub introduces it
/// too, and ends with one induced tunnel via `hub-1` on both sides and consistent views.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hubs_introducing_a_pair_agree_on_one_relay_and_the_tunnel_follows() {
    let start = |id: &'static str| InProcessCluster::start(id, "10.0.0.0/16", "10.201.0.0/16");
    let (h1, h2, a, c) = (
        start("hub-1").await.expect("starts"),
        start("hub-2").await.expect("starts"),
        start("leaf-a").await.expect("starts"),
        start("leaf-c").await.expect("starts"),
    );
    let via = |t: &types::TunnelEndpoint| t.via.as_ref().map(|v| v.cluster_id.clone());
    trellis_integration::peering::peer(&a, &h2).await;
    trellis_integration::peering::peer(&c, &h2).await;
    for (leaf, other) in [(&a, "leaf-c"), (&c, "leaf-a")] {
        eventually("an induced tunnel via hub-2", LIMIT, || async {
            let t = tunnel_to(leaf, other).await?;
            (via(&t).as_deref() == Some("hub-2")).then_some(())
        })
        .await;
    }
    trellis_integration::peering::peer(&c, &h1).await;
    trellis_integration::peering::peer(&a, &h1).await;
    let healed = Duration::from_secs(60);
    eventually(
        "both ends relay via hub-1 with matching views",
        healed,
        || async {
            let ac = tunnel_to(&a, "leaf-c").await?;
            let ca = tunnel_to(&c, "leaf-a").await?;
            (via(&ac).as_deref() == Some("hub-1")
                && via(&ca).as_deref() == Some("hub-1")
                && ac.kind == types::PeeringKind::Induced as i32
                && ac.local_pod_cidr_nat == ca.remote_pod_cidr_nat
                && ca.local_pod_cidr_nat == ac.remote_pod_cidr_nat)
                .then_some(())
        },
    )
    .await;
    for cluster in [h1, h2, a, c] {
        cluster.stop().await;
    }
}

/// A peer's ranges are routed into its tunnel, so they must lie in the ranges peers may use
/// (`--allowed-remote-cidrs`, by default private and shared address space): a full peer that
/// advertises a public range, loopback or half the address space is refused, naming the field,
/// and what it had before stays (issue 15, item 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_advertising_ranges_outside_the_allowed_space_is_refused_and_changes_nothing() {
    let b = InProcessCluster::start("hub-b", "10.1.0.0/16", "10.202.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    trellis_integration::peering::peer(&a, &b).await;
    let before = eventually("b's tunnel to a", LIMIT, || tunnel_to(&b, "leaf-a")).await;
    let mut broker = b.broker().await.expect("broker");
    for (pod, external, field) in [
        (
            "8.8.8.0/24",
            "10.209.0.0/16",
            "network_config.spec.pod_cidr",
        ),
        (
            "127.0.0.0/8",
            "10.209.0.0/16",
            "network_config.spec.pod_cidr",
        ),
        (
            "0.0.0.0/1",
            "192.168.0.0/16",
            "network_config.spec.pod_cidr",
        ),
        (
            "10.0.0.0/16",
            "1.1.1.0/24",
            "network_config.spec.external_cidr",
        ),
    ] {
        let mut nc = network_config("leaf-a", "hub-b", pod);
        nc.generation = i64::MAX / 2;
        if let Some(spec) = nc.spec.as_mut() {
            spec.external_cidr = external.into();
        }
        let err = broker
            .submit_network_config(SubmitNetworkConfigRequest {
                network_config: Some(nc),
            })
            .await
            .expect_err(pod);
        assert_eq!(err.code(), Code::InvalidArgument, "{pod}: {err:?}");
        assert!(err.message().contains(field), "{pod}: {err:?}");
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = tunnel_to(&b, "leaf-a").await.expect("the tunnel stays");
    assert_eq!(after.remote_pod_cidr, before.remote_pod_cidr);
    assert_eq!(after.remote_pod_cidr_nat, before.remote_pod_cidr_nat);
    for cluster in [a, b] {
        cluster.stop().await;
    }
}

/// A cluster whose broker cannot be reached (nothing listens at its address): what a broker
/// that is down or wedged looks like to a test.
struct Unreachable;

impl Peerable for Unreachable {
    fn cluster_id(&self) -> &str {
        "leaf-gone"
    }

    fn peering_broker(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], 9))
    }

    async fn broker_client(
        &self,
    ) -> anyhow::Result<broker_client::BrokerClient<tonic::transport::Channel>> {
        Ok(
            broker_client::BrokerClient::connect(format!("http://{}", self.peering_broker()))
                .await?,
        )
    }
}

/// An absence check must not pass because the broker cannot be asked: `tunnel_to` (for waiting
/// until a tunnel appears) reads an unreachable broker as "no tunnel", which is how the old
/// absence checks passed on a dead broker; the checks now use answers only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absence_check_fails_when_the_broker_cannot_be_asked() {
    assert!(
        tunnel_to(&Unreachable, "hub").await.is_none(),
        "the old check: passes on an unreachable broker"
    );
    assert_eq!(
        no_tunnel_to(&Unreachable, "hub").await,
        None,
        "absence is not proven without an answer"
    );
    let err = answered_tunnel_to(&Unreachable, "hub")
        .await
        .expect_err("an unreachable broker is an error");
    assert!(format!("{err:#}").contains("transport error"), "{err:#}");
}

/// The NetworkConfig `origin` → `destination` that `holder`'s broker lists.
async fn listed_nc(
    holder: &InProcessCluster,
    origin: &str,
    destination: &str,
) -> types::NetworkConfig {
    holder
        .broker()
        .await
        .expect("broker")
        .list_network_configs(ListNetworkConfigsRequest::default())
        .await
        .expect("lists")
        .into_inner()
        .network_configs
        .into_iter()
        .find(|nc| nc.name == format!("{origin}--{destination}"))
        .unwrap_or_else(|| panic!("{} holds {origin}--{destination}", holder.id))
}

/// Issue 32: a peer announcing another peer's WireGuard key (or the receiver's own) is refused
/// with an error naming the conflict, and nothing changes: the gateway's engine refuses a key
/// it already holds, so accepting it would knock out whichever tunnel it adds second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_announcing_another_peers_wireguard_key_is_refused_and_changes_nothing() {
    let b = InProcessCluster::start("hub-b", "10.1.0.0/16", "10.202.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    let c = InProcessCluster::start("leaf-c", "10.2.0.0/16", "10.203.0.0/16")
        .await
        .expect("c starts");
    trellis_integration::peering::peer(&a, &b).await;
    trellis_integration::peering::peer(&c, &b).await;
    let b_to_a = eventually("b's tunnel to a", LIMIT, || tunnel_to(&b, "leaf-a")).await;
    let b_to_c = eventually("b's tunnel to c", LIMIT, || tunnel_to(&b, "leaf-c")).await;
    let a_to_b = eventually("a's tunnel to b", LIMIT, || tunnel_to(&a, "hub-b")).await;
    assert_ne!(b_to_a.remote_public_key, b_to_c.remote_public_key);
    let held = listed_nc(&b, "leaf-c", "hub-b").await;

    let mut broker = b.broker().await.expect("broker");
    for (key, code, says) in [
        (&b_to_a.remote_public_key, Code::AlreadyExists, "leaf-a"),
        (
            &a_to_b.remote_public_key,
            Code::InvalidArgument,
            "hub-b's own gateway",
        ),
    ] {
        let mut forged = held.clone();
        forged.status = None;
        forged.generation = held.generation + 1;
        if let Some(spec) = forged.spec.as_mut() {
            spec.public_key.clone_from(key);
        }
        let err = broker
            .submit_network_config(SubmitNetworkConfigRequest {
                network_config: Some(forged),
            })
            .await
            .expect_err(says);
        assert_eq!(err.code(), code, "{says}: {err:?}");
        assert!(err.message().contains("public_key"), "{err:?}");
        assert!(err.message().contains(says), "{err:?}");
    }

    // Nothing was stored: the hub holds C's NetworkConfig as it was, and both tunnels stay.
    let after = listed_nc(&b, "leaf-c", "hub-b").await;
    assert_eq!(after.generation, held.generation);
    assert_eq!(after.spec, held.spec);
    let tunnels = tunnels(&b).await.expect("the hub's broker answers");
    for (remote, key) in [
        ("leaf-a", &b_to_a.remote_public_key),
        ("leaf-c", &b_to_c.remote_public_key),
    ] {
        let tunnel = tunnels
            .iter()
            .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == remote))
            .unwrap_or_else(|| panic!("the hub's tunnel to {remote}"));
        assert_eq!(&tunnel.remote_public_key, key, "{remote}'s key");
    }
    for cluster in [a, b, c] {
        cluster.stop().await;
    }
}

/// Issue 32: one hub cannot use up a leaf's finite resources (its gateway's per-peer slots, its
/// IPAM's remap ranges) and so starve the leaf's other peerings. Hub B introduces made-up
/// clusters, as many as the leaf admits up to 300 (the old cap, 4096, admitted them all; the
/// default gateway has 256 slots): the leaf starts an exchange with each, then a second hub
/// still peers with it and gets its tunnel. A Neighborhood of 300 is refused whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hub_introducing_all_it_may_leaves_room_for_the_leafs_other_peerings() {
    let b = InProcessCluster::start("hub-b", "10.1.0.0/16", "10.202.0.0/16")
        .await
        .expect("b starts");
    let d = InProcessCluster::start("hub-d", "10.3.0.0/16", "10.204.0.0/16")
        .await
        .expect("d starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    trellis_integration::peering::peer(&a, &b).await;
    eventually("a's tunnel to b", LIMIT, || tunnel_to(&a, "hub-b")).await;

    let introduce = |count: usize| {
        use trellis_api::pb::discovery::PublishNeighborhoodRequest;
        let ident = |id: String| {
            Some(types::ClusterIdentity {
                cluster_id: id.clone(),
                cluster_name: id,
            })
        };
        PublishNeighborhoodRequest {
            neighborhood: Some(types::Neighborhood {
                sender: ident("hub-b".into()),
                recipient: ident("leaf-a".into()),
                neighbors: (0..count)
                    .map(|i| types::Neighbor {
                        identity: ident(format!("made-up-{i}")),
                        addresses: Some(types::ServiceAddresses::default()),
                    })
                    .collect(),
                generation: i64::MAX / 2,
                create_time: None,
            }),
        }
    };
    let cap = trellis_discovery::core::MAX_INDUCED_PER_HUB;
    let mut discovery = a.discovery().await.expect("discovery");
    if cap < 300 {
        let err = discovery
            .publish_neighborhood(introduce(300))
            .await
            .expect_err("over the cap");
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("--max-induced-per-hub"), "{err:?}");
    }
    let count = cap.min(300);
    discovery
        .publish_neighborhood(introduce(count))
        .await
        .expect("the leaf takes the introductions");
    // The leaf works through the introductions until it has written its NetworkConfig for
    // each (a slot each; the relays through B go nowhere) or it stops making progress (no slot
    // left). What follows asserts a tunnel appears, so waiting too little cannot pass it.
    let mut broker = a.broker().await.expect("broker");
    let started = std::time::Instant::now();
    let (mut made, mut since) = (0, std::time::Instant::now());
    loop {
        let now = broker
            .list_network_configs(ListNetworkConfigsRequest::default())
            .await
            .expect("lists")
            .into_inner()
            .network_configs
            .iter()
            .filter(|nc| {
                nc.origin.as_ref().is_some_and(|o| o.cluster_id == "leaf-a")
                    && nc.via.as_ref().is_some_and(|v| v.cluster_id == "hub-b")
            })
            .count();
        if now != made {
            (made, since) = (now, std::time::Instant::now());
        }
        if made == count || (made > 0 && since.elapsed() > Duration::from_secs(3)) {
            break;
        }
        assert!(
            started.elapsed() < LIMIT,
            "the leaf made {made} of {count} exchanges"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    trellis_integration::peering::peer(&a, &d).await;
    eventually("a's tunnel to the second hub", LIMIT, || {
        tunnel_to(&a, "hub-d")
    })
    .await;
    eventually("the second hub's tunnel to a", LIMIT, || {
        tunnel_to(&d, "leaf-a")
    })
    .await;
    for cluster in [a, b, d] {
        cluster.stop().await;
    }
}

/// The limit of plaintext mode, recorded (ADR 0010, ADR 0014): nothing authenticates a
/// re-handshake, so a holder of the hub's token can handshake as a peered cluster and replace
/// the addresses the hub calls it at. What still holds: a wrong token changes nothing. With
/// mutual TLS the same re-handshake is refused
/// (`peering_tls::a_token_holder_presenting_a_peered_clusters_own_ca_cannot_take_over_its_identity`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tls_a_token_holder_can_re_handshake_as_a_peered_cluster() {
    let b = InProcessCluster::start("hub-b", "10.1.0.0/16", "10.202.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    trellis_integration::peering::peer(&a, &b).await;
    let addresses = |broker: &str| types::ServiceAddresses {
        discovery: broker.into(),
        broker: broker.into(),
        forwarder: broker.into(),
        ipam: broker.into(),
        endpoints: broker.into(),
        ..Default::default()
    };
    let claim = |token: String| HandshakeRequest {
        token,
        identity: Some(types::ClusterIdentity {
            cluster_id: "leaf-a".into(),
            cluster_name: "leaf-a".into(),
        }),
        addresses: Some(addresses("127.0.0.1:9")),
        ca_certificate: String::new(),
        peering_id: String::new(),
    };
    let held = || async {
        b.discovery()
            .await
            .expect("discovery")
            .get_foreign_cluster(trellis_api::pb::discovery::GetForeignClusterRequest {
                cluster_id: "leaf-a".into(),
            })
            .await
            .expect("A known")
            .into_inner()
            .foreign_cluster
            .and_then(|fc| fc.full)
            .and_then(|full| full.addresses)
            .expect("A's addresses")
    };
    let real = held().await;
    assert_ne!(real.broker, "127.0.0.1:9");
    let mut hub = broker_client::BrokerClient::connect(format!("http://{}", b.peering_broker()))
        .await
        .expect("connects");

    let err = hub
        .handshake(claim("not-the-token-of-hub-b".into()))
        .await
        .expect_err("a wrong token");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert_eq!(held().await, real, "a wrong token changes nothing");

    hub.handshake(claim(token(&b).await))
        .await
        .expect("plaintext cannot tell the claimant from A");
    assert_eq!(held().await, addresses("127.0.0.1:9"));
    for cluster in [a, b] {
        cluster.stop().await;
    }
}

/// `Broker.GetObservedEndpoints` at the wire boundary: malformed requests are refused naming
/// the field, a cluster that is no full peer is refused, and a full peer gets an answer (empty
/// here: without a data plane the hub's gateway sees nobody). Nothing is stored either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observed_endpoints_answer_full_peers_and_refuse_bad_requests_naming_the_field() {
    let b = InProcessCluster::start("hub-b", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("b starts");
    let a = InProcessCluster::start("leaf-a", "10.1.0.0/16", "10.201.0.0/16")
        .await
        .expect("a starts");
    peer_with_token(&a, &b, token(&b).await)
        .await
        .expect("a peers with b");
    eventually("B's tunnel to A", LIMIT, || tunnel_to(&b, "leaf-a")).await;
    let mut client = broker_client::BrokerClient::connect(format!("http://{}", b.services.broker))
        .await
        .expect("connect");
    let identity = |id: &str| {
        Some(types::ClusterIdentity {
            cluster_id: id.into(),
            cluster_name: id.into(),
        })
    };
    let ask = |requester, ids: Vec<String>| GetObservedEndpointsRequest {
        requester,
        cluster_ids: ids,
    };
    let cases = [
        (
            ask(None, vec!["leaf-a".into()]),
            Code::InvalidArgument,
            "requester",
        ),
        (
            ask(
                identity("leaf-a"),
                vec!["leaf-c".into(), "Not An ID!".into()],
            ),
            Code::InvalidArgument,
            "cluster_ids[1]",
        ),
        (
            ask(identity("leaf-a"), vec!["leaf-c".into(); 1025]),
            Code::InvalidArgument,
            "cluster_ids",
        ),
        (
            ask(identity("stranger"), vec!["leaf-a".into()]),
            Code::PermissionDenied,
            "stranger",
        ),
    ];
    for (request, code, named) in cases {
        let status = client
            .get_observed_endpoints(request)
            .await
            .expect_err("refused");
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(named), "{status:?} names {named}");
    }
    let answer = client
        .get_observed_endpoints(ask(
            identity("leaf-a"),
            vec!["hub-b".into(), "leaf-a".into()],
        ))
        .await
        .expect("a full peer is answered")
        .into_inner();
    assert!(answer.observed.is_empty(), "{answer:?}");
    for cluster in [a, b] {
        cluster.stop().await;
    }
}
