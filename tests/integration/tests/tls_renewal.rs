//! Certificates Trellis issues and renews for itself (`--tls-dir`), in process: the hub's
//! services get certificates valid for 3 seconds from the CA in their shared directory and
//! renew them as they go, while a peered leaf calls the hub's broker over mutual TLS 100 times
//! a second, opening a new connection (a new TLS handshake, which checks the certificate the
//! hub presents now) every 20 calls. No call may fail and no service may stop; the certificate
//! must have been renewed several times (an expired one would fail the next handshake).

use std::time::{Duration, Instant};

use trellis_api::pb::peering::GetObservedEndpointsRequest;
use trellis_api::pb::peering::broker_client::BrokerClient;
use trellis_api::pb::types;
use trellis_integration::cluster::{InProcessCluster, Options};
use trellis_integration::peering::{eventually, peer, tunnel_to};
use trellis_runtime::client::Timeouts;
use trellis_runtime::metrics::Metrics;
use trellis_runtime::tls::peer_channel;

const LIFETIME_SECS: u64 = 3;
const RUN: Duration = Duration::from_secs(10);
const EVERY: Duration = Duration::from_millis(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_of_seconds_renew_under_100_calls_a_second_without_a_failed_call() {
    let options = Options {
        tls: true,
        endpoints: true,
        managed_cert_lifetime: Some(LIFETIME_SECS),
        ..Options::default()
    };
    let hub = InProcessCluster::start_with("hub", "10.0.0.0/16", "10.201.0.0/16", options)
        .await
        .expect("the hub starts");
    let leaf = InProcessCluster::start_tls("leaf-a", "10.0.0.0/16", "10.201.0.0/16")
        .await
        .expect("the leaf starts");
    peer(&leaf, &hub).await;
    eventually(
        "the leaf's tunnel to the hub",
        Duration::from_secs(40),
        || tunnel_to(&leaf, "hub"),
    )
    .await;

    let hub_tls = hub.tls.as_ref().expect("tls");
    let as_leaf = leaf
        .tls
        .as_ref()
        .expect("tls")
        .client("broker", &[&hub])
        .expect("a client of the leaf");
    let connect = || {
        BrokerClient::new(
            peer_channel(
                &as_leaf,
                "test",
                &hub_tls.broker.to_string(),
                Some("hub"),
                Timeouts::default(),
                &Metrics::new(),
            )
            .expect("channel"),
        )
    };
    let request = || GetObservedEndpointsRequest {
        requester: Some(types::ClusterIdentity {
            cluster_id: "leaf-a".into(),
            cluster_name: "leaf-a".into(),
        }),
        cluster_ids: vec!["leaf-a".into()],
    };
    let cert = hub_tls.managed_dir().join("broker").join("cert.pem");
    let mut seen = vec![std::fs::read_to_string(&cert).expect("the broker's certificate")];
    let (mut calls, mut failed) = (0u32, Vec::new());
    let mut broker = connect();
    let started = Instant::now();
    let mut next = Instant::now();
    while started.elapsed() < RUN {
        if calls % 20 == 0 {
            broker = connect();
        }
        if let Err(status) = broker.get_observed_endpoints(request()).await {
            failed.push(format!(
                "{:.1} s: {status:?}",
                started.elapsed().as_secs_f64()
            ));
        }
        calls += 1;
        if let Ok(now) = std::fs::read_to_string(&cert)
            && seen.last() != Some(&now)
        {
            seen.push(now);
        }
        next += EVERY;
        tokio::time::sleep_until(next.into()).await;
    }
    let renewals = seen.len() - 1;
    eprintln!(
        "measured: {calls} calls in {:.1} s, {} failed, the hub's broker certificate renewed {renewals} times",
        started.elapsed().as_secs_f64(),
        failed.len()
    );
    assert!(calls >= 900, "only {calls} calls");
    assert!(failed.is_empty(), "failed calls: {failed:#?}");
    assert!(
        renewals >= 3,
        "a {LIFETIME_SECS} s certificate was renewed only {renewals} times in {RUN:?}"
    );
    // Nothing restarted: the hub's services still answer, over the plaintext listener too.
    hub.discovery()
        .await
        .expect("the hub's discovery answers")
        .list_foreign_clusters(trellis_api::pb::discovery::ListForeignClustersRequest::default())
        .await
        .expect("lists");
    leaf.stop().await;
    hub.stop().await;
}
