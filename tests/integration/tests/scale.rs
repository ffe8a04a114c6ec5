//! The induced mesh at scale, in process with memory stores: one hub and 20 leaves, all with
//! the same pod and external CIDRs, converge to 20·19 induced TunnelEndpoints; the hub
//! unpeering one leaf removes that leaf's 19 induced peerings on the others.

use std::time::{Duration, Instant};

use trellis_api::pb::peering::forwarder_client::ForwarderClient;
use trellis_api::pb::peering::{
    GetTokenRequest, ListNetworkConfigsRequest, ListRelaysRequest, ListTunnelEndpointsRequest,
    PeerRequest,
};
use trellis_api::pb::types::PeeringKind;
use trellis_integration::cluster::InProcessCluster;
use trellis_integration::join_all;
use trellis_integration::peering::unpeer;

const LEAVES: usize = 20;
const LIMIT: Duration = Duration::from_secs(120);

async fn induced_remotes(cluster: &InProcessCluster) -> Vec<String> {
    let Ok(mut broker) = cluster.broker().await else {
        return Vec::new();
    };
    let Ok(listed) = broker
        .list_tunnel_endpoints(ListTunnelEndpointsRequest {
            cluster_id: String::new(),
            kind: PeeringKind::Induced as i32,
        })
        .await
    else {
        return Vec::new();
    };
    listed
        .into_inner()
        .tunnel_endpoints
        .into_iter()
        .filter_map(|t| t.remote.map(|r| r.cluster_id))
        .collect()
}

async fn total_induced(leaves: &[InProcessCluster]) -> usize {
    let mut total = 0;
    for leaf in leaves {
        total += induced_remotes(leaf).await.len();
    }
    total
}

/// What each leaf still misses, and what the hub still relays: the report of a timeout.
async fn diagnose(hub: &InProcessCluster, leaves: &[InProcessCluster]) -> String {
    let mut report = String::new();
    for leaf in leaves {
        let have = induced_remotes(leaf).await;
        let missing: Vec<String> = leaves
            .iter()
            .filter(|other| other.id != leaf.id && !have.contains(&other.id))
            .map(|other| other.id.clone())
            .collect();
        if !missing.is_empty() {
            report.push_str(&format!("{} misses {missing:?}\n", leaf.id));
            if let Ok(mut broker) = leaf.broker().await
                && let Ok(ncs) = broker
                    .list_network_configs(ListNetworkConfigsRequest {
                        cluster_id: missing[0].clone(),
                    })
                    .await
            {
                for nc in ncs.into_inner().network_configs {
                    report.push_str(&format!(
                        "  {} generation {} via {:?} status {:?}\n",
                        nc.name,
                        nc.generation,
                        nc.via.map(|v| v.cluster_id),
                        nc.status
                            .map(|s| (s.state, s.observed_generation, s.message))
                    ));
                }
            }
        }
    }
    if let Ok(mut forwarder) =
        ForwarderClient::connect(format!("http://{}", hub.services.forwarder)).await
        && let Ok(relays) = forwarder.list_relays(ListRelaysRequest::default()).await
    {
        for r in relays.into_inner().relays {
            report.push_str(&format!(
                "relay {:?} state {} attempts {} last error {:?}\n",
                r.network_config.map(|n| n.name),
                r.state,
                r.attempts,
                r.last_error
            ));
        }
    }
    report
}

/// Polls `done` until it holds; on timeout fails with a diagnosis of every cluster.
async fn wait_until<F, Fut>(
    hub: &InProcessCluster,
    leaves: &[InProcessCluster],
    what: &str,
    mut done: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    if let Err(timed_out) = trellis_testkit::within(what, LIMIT, || {
        let done = done();
        async move { done.await.then_some(()) }
    })
    .await
    {
        panic!("{timed_out}:\n{}", diagnose(hub, leaves).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_and_twenty_leaves_converge_to_the_full_induced_mesh() {
    let hub = InProcessCluster::start("hub", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("hub starts");
    let mut leaves = Vec::new();
    for n in 0..LEAVES {
        leaves.push(
            InProcessCluster::start(&format!("leaf-{n:02}"), "10.0.0.0/16", "10.201.0.0/16")
                .await
                .expect("leaf starts"),
        );
    }
    let token = hub
        .broker()
        .await
        .expect("hub broker")
        .get_token(GetTokenRequest {})
        .await
        .expect("token")
        .into_inner()
        .token;

    let started = Instant::now();
    let mut peerings = Vec::new();
    for leaf in &leaves {
        let mut broker = leaf.broker().await.expect("leaf broker");
        let request = PeerRequest {
            broker_address: hub.services.broker.to_string(),
            token: token.clone(),
            expected_cluster_id: "hub".into(),
            ca_cert_hash: String::new(),
        };
        peerings.push(tokio::spawn(async move {
            broker.peer(request).await.map(|_| ())
        }));
    }
    for peered in join_all(peerings).await {
        peered.expect("a leaf peers with the hub");
    }
    let expected = LEAVES * (LEAVES - 1);
    wait_until(&hub, &leaves, "the full induced mesh", || async {
        total_induced(&leaves).await == expected
    })
    .await;
    eprintln!(
        "scale: 1 hub + {LEAVES} leaves reached {expected} induced tunnel endpoints in {:?}",
        started.elapsed()
    );

    // Every leaf knows every other leaf, and nothing else, as induced.
    for (n, leaf) in leaves.iter().enumerate() {
        let mut remotes = induced_remotes(leaf).await;
        remotes.sort();
        let wanted: Vec<String> = (0..LEAVES)
            .filter(|m| *m != n)
            .map(|m| format!("leaf-{m:02}"))
            .collect();
        assert_eq!(remotes, wanted, "{}", leaf.id);
    }

    // The hub unpeers leaf-00: its 19 induced peerings go away on the others.
    unpeer(&hub, "leaf-00").await;
    wait_until(
        &hub,
        &leaves,
        "leaf-00's induced peerings withdrawn",
        || async {
            for leaf in &leaves[1..] {
                if induced_remotes(leaf).await.iter().any(|r| r == "leaf-00") {
                    return false;
                }
            }
            induced_remotes(&leaves[0]).await.is_empty()
        },
    )
    .await;
    assert_eq!(total_induced(&leaves).await, (LEAVES - 1) * (LEAVES - 2));

    hub.stop().await;
    for leaf in leaves {
        leaf.stop().await;
    }
}
