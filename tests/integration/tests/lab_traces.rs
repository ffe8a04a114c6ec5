//! Traces from the lab (issue 19): the default 3-cluster `trellis-lab` (the real binary, every
//! service in one process) with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an in-process OTLP
//! receiver standing in for Jaeger. Each in-process service exports through a tracer of its
//! own, so one trace — the induced exchange between the two leaves, relayed by the hub's
//! forwarder — carries spans from broker, forwarder and IPAM of all three clusters, each with
//! its own `service.name`, `trellis.cluster.id` and `trellis.cluster.name`, exactly as the
//! separate processes do (tests/traces.rs). Needs `cargo build --bins` first.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use trellis_integration::lab::RunningLab;
use trellis_integration::otlp::{OtlpReceiver, ReceivedSpan};

const LIMIT: Duration = Duration::from_secs(120);

/// (service.name, trellis.cluster.id) of a span's emitter.
fn origin(span: &ReceivedSpan) -> (String, String) {
    let get = |k: &str| span.resource.get(k).cloned().unwrap_or_default();
    (get("service.name"), get("trellis.cluster.id"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lab_trace_spans_broker_forwarder_and_ipam_of_three_clusters() {
    let receiver = OtlpReceiver::start().await.expect("receiver starts");
    let endpoint = receiver.endpoint();
    let (lab, _) = tokio::task::spawn_blocking(move || {
        RunningLab::start_with_env(
            &["--base-port", "0"],
            // Short batches, so spans arrive while the test still waits for them.
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ],
            Duration::from_secs(240),
        )
    })
    .await
    .expect("the lab starts");

    // The exchange of leaf-1's NetworkConfig with leaf-2: leaf-1's broker → the hub's
    // forwarder → leaf-2's broker and IPAM, the decision back to leaf-1's IPAM (or the reverse
    // direction, whichever trace arrives first).
    let wanted = |a: &str, c: &str| -> BTreeSet<(String, String)> {
        [
            ("trellis-broker", a),
            ("trellis-forwarder", "hub"),
            ("trellis-broker", c),
            ("trellis-ipam", c),
            ("trellis-ipam", a),
        ]
        .iter()
        .map(|(s, c)| ((*s).to_owned(), (*c).to_owned()))
        .collect()
    };
    let deadline = Instant::now() + LIMIT;
    let (trace, spans) = loop {
        let spans = receiver.spans();
        let mut by_trace: BTreeMap<&str, Vec<&ReceivedSpan>> = BTreeMap::new();
        for span in &spans {
            by_trace
                .entry(span.trace_id.as_str())
                .or_default()
                .push(span);
        }
        let found = by_trace.iter().find(|(_, members)| {
            let origins: BTreeSet<_> = members.iter().map(|s| origin(s)).collect();
            origins.is_superset(&wanted("leaf-1", "leaf-2"))
                || origins.is_superset(&wanted("leaf-2", "leaf-1"))
        });
        if let Some((trace, members)) = found {
            break (
                (*trace).to_owned(),
                members.iter().map(|s| (*s).clone()).collect::<Vec<_>>(),
            );
        }
        if Instant::now() >= deadline {
            let emitters: BTreeSet<_> = spans.iter().map(origin).collect();
            panic!(
                "no trace spans broker, forwarder and IPAM of three clusters; {} spans from \
                 {emitters:?}",
                spans.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    // Every span of the trace names its service and cluster, and no span is the lab's own
    // catch-all identity.
    let clusters: BTreeSet<String> = spans.iter().map(|s| origin(s).1).collect();
    assert_eq!(
        clusters,
        BTreeSet::from(["hub".to_owned(), "leaf-1".to_owned(), "leaf-2".to_owned()]),
        "trace {trace}"
    );
    for span in &spans {
        let (service, cluster) = origin(span);
        assert!(
            service.starts_with("trellis-") && service != "trellis-lab",
            "span {} of trace {trace} has service.name {service:?}",
            span.name
        );
        assert_eq!(
            span.resource
                .get("trellis.cluster.name")
                .map(String::as_str),
            Some(cluster.as_str()),
            "span {} of trace {trace}",
            span.name
        );
    }
    // The hub relays, it does not originate: its spans in this trace are its forwarder's (and
    // its discovery's, answering the forwarder).
    for span in &spans {
        let (service, cluster) = origin(span);
        if cluster == "hub" {
            assert!(
                ["trellis-forwarder", "trellis-discovery"].contains(&service.as_str()),
                "{service} of the hub in trace {trace}"
            );
        }
    }
    let status = tokio::task::spawn_blocking(move || lab.interrupt())
        .await
        .expect("joins");
    assert!(status.success(), "the lab exits cleanly: {status}");
}
