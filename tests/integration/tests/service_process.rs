//! The process harness itself: ports are picked before a service binds them, so another process
//! may take one first. Starting a service on a taken port must fail with "cannot listen" (which
//! `ProcessCluster` retries on fresh ports), even when the process holding the port is the same
//! kind of service and answers its health check.
//!
//! Needs the service binaries (`cargo build --workspace --bins`, which `make test` does first).

use trellis_integration::{ServiceProcess, free_addr, ipam_args};

const IPAM: &str = "trellis.ipam.v1.Ipam";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_whose_port_was_taken_fails_to_start_even_if_the_taker_answers_health() {
    let addr = free_addr();
    let start = |cluster: &str| {
        let args = ipam_args(&addr.to_string(), "memory://", cluster, &[]);
        ServiceProcess::start("trellis-ipam", args, addr, IPAM)
    };
    let mut first = start("first").await.expect("the first IPAM starts");

    // Same binary, same port: the health check is answered SERVING by the first one.
    let err = start("second")
        .await
        .expect_err("the second IPAM cannot listen");
    let text = format!("{err:#}");
    assert!(text.contains("cannot listen"), "{text}");

    // The first one is untouched, and a restart on its own port works.
    first.restart().await.expect("restarts on its port");
}
