//! One induced peering is one trace (issue 7): hub B and leaves A and C run as real processes,
//! each exporting spans over OTLP to an in-process receiver standing in for Jaeger. The
//! exchange of A's NetworkConfig with C goes A's broker → B's forwarder → C's broker → C's
//! IPAM, and the answer back to A's IPAM; the spans of that exchange must share one trace
//! id and come from broker, forwarder and IPAM processes of all three clusters, each span
//! carrying its process's `service.name` and `trellis.cluster.id`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use trellis_integration::otlp::{OtlpReceiver, ReceivedSpan};
use trellis_integration::peering::peer;
use trellis_integration::processes::{Options, ProcessCluster};

const LIMIT: Duration = Duration::from_secs(60);

async fn has_tunnel(cluster: &ProcessCluster, remote: &str) -> bool {
    trellis_integration::peering::tunnel_to(cluster, remote)
        .await
        .is_some()
}

/// (service.name, trellis.cluster.id) of a span's process.
fn origin(span: &ReceivedSpan) -> (String, String) {
    let get = |k: &str| span.resource.get(k).cloned().unwrap_or_default();
    (get("service.name"), get("trellis.cluster.id"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spans_of_one_induced_peering_share_a_trace_across_three_clusters() {
    let receiver = OtlpReceiver::start().await.expect("receiver starts");
    let options = Options {
        otlp_endpoint: Some(receiver.endpoint()),
        ..Options::default()
    };
    let start = |id: &'static str| {
        let options = options.clone();
        async move { ProcessCluster::start_with(id, "10.0.0.0/16", "10.201.0.0/16", options).await }
    };
    let Some(b) = start("hub-b").await.expect("b starts") else {
        return;
    };
    let a = start("leaf-a").await.expect("a starts").expect("etcd");
    let c = start("leaf-c").await.expect("c starts").expect("etcd");
    peer(&a, &b).await;
    peer(&c, &b).await;
    let formed = trellis_testkit::within("the induced peering", LIMIT, || async {
        (has_tunnel(&a, "leaf-c").await && has_tunnel(&c, "leaf-a").await).then_some(())
    })
    .await;
    if let Err(timed_out) = formed {
        panic!("{timed_out}:\n{}", a.logs(20));
    }

    // The relay's spans identify the exchange; wait until the whole trace has arrived.
    let wanted: BTreeSet<(String, String)> = [
        ("trellis-broker", "leaf-a"),
        ("trellis-forwarder", "hub-b"),
        ("trellis-broker", "leaf-c"),
        ("trellis-ipam", "leaf-c"),
        ("trellis-ipam", "leaf-a"),
    ]
    .iter()
    .map(|(s, c)| ((*s).to_owned(), (*c).to_owned()))
    .collect();
    let deadline = Instant::now() + LIMIT;
    let (trace, origins) = loop {
        let spans = receiver.spans();
        let mut by_trace: BTreeMap<&str, BTreeSet<(String, String)>> = BTreeMap::new();
        for span in &spans {
            by_trace
                .entry(span.trace_id.as_str())
                .or_default()
                .insert(origin(span));
        }
        // The trace of A's NetworkConfig to C: it passes B's forwarder and reaches C's broker.
        let found = by_trace
            .iter()
            .filter(|(_, o)| o.is_superset(&wanted))
            .map(|(t, o)| ((*t).to_owned(), o.clone()))
            .next();
        if let Some(found) = found {
            break found;
        }
        if Instant::now() >= deadline {
            let relayed: Vec<_> = by_trace
                .values()
                .filter(|o| o.iter().any(|(s, _)| s == "trellis-forwarder"))
                .collect();
            panic!(
                "no trace spans {wanted:?}; traces through the forwarder span: {relayed:#?}\n\
                 ({} spans received)",
                spans.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let clusters: BTreeSet<&str> = origins.iter().map(|(_, c)| c.as_str()).collect();
    assert_eq!(
        clusters,
        BTreeSet::from(["hub-b", "leaf-a", "leaf-c"]),
        "trace {trace}"
    );
    // The hub relays, it does not re-originate: its spans in this trace are the forwarder's
    // (and its discovery's, answering the forwarder) only.
    for (service, cluster) in &origins {
        if cluster == "hub-b" {
            assert!(
                ["trellis-forwarder", "trellis-discovery"].contains(&service.as_str()),
                "{service} of the hub in trace {trace}"
            );
        }
    }
}
