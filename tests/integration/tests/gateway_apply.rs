//! A change to one peer's tunnel reconfigures only that peer in the gateway's namespace (issue
//! 17, "gateway apply cost"): with hundreds of peers, a gateway that re-applied every peer's
//! device and routes on each TunnelEndpoint change ran about five `ip` processes per peer per
//! change, and during an induced storm every leaf's gateway did so for each of its n-1 new peers.
//!
//! Hub `h` with leaves `a`, `b`, `c` in namespaces (real gateways, userspace tunnels). The hub
//! unpeers `c`, so `a` loses its induced tunnel to `c`; then `c` peers again, and `a` rebuilds it. `a`'s gateway counts, per tunnel, how
//! often it configured it (`trellis_gateway_tunnel_configurations_total`, scraped and parsed with
//! the Prometheus parser): the counts of `h` and `b`, whose tunnels did not change, must not
//! move, checked once `c`'s new tunnel is counted (every pass before it has been applied). The periodic repair pass (which re-applies everything on purpose) is pushed out of the
//! window with a long `--resync-interval`; a full pass (here the one at start) still restores a
//! route deleted underneath the gateway.
//!
//! Skipped (with a `SKIPPED:` line) when not root, without `ip`/`nft` or Python's
//! prometheus_client; CI runs as root with them and fails instead.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use trellis_api::pb::types::PeeringKind;
use trellis_integration::peering::unpeer;
use trellis_integration::prom::{parse, parser_python, scrape_in};
use trellis_netlab::netns::exec;
use trellis_netlab::{Fabric, FabricOptions, Service};

// Sorted by ID (`Fabric::wait_mesh` compares in cluster order with the broker's sorted list).
const A: usize = 0;
const C: usize = 2;
const H: usize = 3;
const LIMIT: Duration = Duration::from_secs(120);
const GATEWAY_METRICS: u16 = 9106;

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft"])
}

/// `(remote cluster ID, interface)` of every tunnel `i`'s gateway reports.
async fn interfaces(fabric: &Fabric, i: usize) -> Vec<(String, String)> {
    let tunnels = fabric.clusters[i]
        .gateway_tunnels()
        .await
        .expect("ListTunnels");
    let mut out: Vec<(String, String)> = tunnels
        .into_iter()
        .filter_map(|t| Some((t.remote?.cluster_id, t.interface_name)))
        .collect();
    out.sort();
    out
}

/// The routes of `interface` in namespace `ns`, one per line.
fn routes(ns: &str, interface: &str) -> Vec<String> {
    let out = exec(ns, "ip", &["-o", "-4", "route", "show", "dev", interface]).expect("ip route");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Per peer, how often the gateway in `gw_ns` configured its tunnel.
fn configurations(python: &Path, gw_ns: &str) -> BTreeMap<String, f64> {
    let addr = SocketAddr::from(([127, 0, 0, 1], GATEWAY_METRICS));
    parse(python, &scrape_in(gw_ns, addr))
        .into_iter()
        .filter(|s| s.name == "trellis_gateway_tunnel_configurations_total")
        .filter_map(|s| Some((s.labels.get("peer")?.clone(), s.value)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_to_one_peer_reconfigures_that_peer_only() {
    if !can_run("gateway_apply") {
        return;
    }
    let Some(python) = parser_python() else {
        return;
    };
    let mut options = FabricOptions::three_clusters();
    options.names = ["a", "b", "c", "h"].map(str::to_owned).to_vec();
    options.hub = H;
    options.extra_args = vec![(
        Service::Gateway,
        vec![
            "--resync-interval".into(),
            "600".into(),
            "--metrics-listen".into(),
            format!("0.0.0.0:{GATEWAY_METRICS}"),
        ],
    )];
    let mut fabric = Fabric::up(options).await.expect("the fabric comes up");
    fabric.wait_mesh(LIMIT).await.expect("the mesh converges");
    let gw_ns = fabric.topology.sites[A].gw_ns.clone();
    // Every tunnel of `a` configured, and nothing changing any more: the same counts twice.
    let started = Instant::now();
    let mut last = BTreeMap::new();
    let before = loop {
        let seen = configurations(&python, &gw_ns);
        if seen.len() == 3 && seen.values().all(|n| *n >= 1.0) && seen == last {
            break seen;
        }
        assert!(
            started.elapsed() < LIMIT,
            "a's tunnel configurations: {seen:?}"
        );
        last = seen;
        tokio::time::sleep(Duration::from_secs(2)).await;
    };

    unpeer(&fabric.clusters[H], "c").await;
    fabric
        .wait_tunnel_endpoints(
            A,
            &[("b", PeeringKind::Induced), ("h", PeeringKind::Full)],
            LIMIT,
        )
        .await
        .expect("a forgets c");
    let started = Instant::now();
    while interfaces(&fabric, A).await.len() != 2 {
        assert!(started.elapsed() < LIMIT, "a's gateway keeps c's tunnel");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let gone = configurations(&python, &gw_ns);
    assert!(
        !gone.contains_key("c"),
        "c's tunnel is still counted: {gone:?}"
    );
    // The control: c peers with the hub again, and `a`'s gateway configures c's tunnel anew.
    // The passes that follow c's removal (the hub's mappings, a status) come before that, so
    // once c is counted again they have all been applied.
    fabric.peer(C, H).await.expect("c peers with the hub again");
    let started = Instant::now();
    let after = loop {
        let seen = configurations(&python, &gw_ns);
        if seen.get("c").is_some_and(|n| *n >= 1.0) {
            break seen;
        }
        assert!(
            started.elapsed() < LIMIT,
            "a's gateway did not configure c's tunnel again: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for peer in ["h", "b"] {
        assert_eq!(
            after.get(peer),
            before.get(peer),
            "{peer}'s unchanged tunnel was configured again when only c's went and came back \
             (before {before:?}, after {after:?})"
        );
    }

    // Passes apply what changed, so what repairs a change made underneath the gateway is a
    // full pass: the periodic one (600 s here) or the one at start.
    let h_interface = interfaces(&fabric, A)
        .await
        .into_iter()
        .find(|(peer, _)| peer == "h")
        .map(|(_, i)| i)
        .expect("a's tunnel to h");
    let deleted = routes(&gw_ns, &h_interface)
        .first()
        .and_then(|r| r.split_whitespace().next().map(str::to_owned))
        .expect("a route into h's tunnel");
    let out = exec(
        &gw_ns,
        "ip",
        &["route", "del", &deleted, "dev", &h_interface],
    )
    .expect("ip route del");
    assert!(out.status.success(), "deleting {deleted}: {out:?}");
    fabric.clusters[A]
        .restart(Service::Gateway)
        .await
        .expect("a's gateway restarts");
    let started = Instant::now();
    loop {
        let interface = interfaces(&fabric, A)
            .await
            .into_iter()
            .find(|(peer, _)| peer == "h")
            .map(|(_, i)| i);
        if let Some(interface) = interface
            && routes(&gw_ns, &interface)
                .iter()
                .any(|r| r.starts_with(&deleted))
        {
            break;
        }
        assert!(
            started.elapsed() < LIMIT,
            "the restarted gateway did not restore {deleted} into h's tunnel"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
