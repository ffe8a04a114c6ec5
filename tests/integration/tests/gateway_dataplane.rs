//! The data plane with real packets and the **real control plane** (issue 6), as root, in
//! network namespaces this test creates and always removes ([`trellis_netlab`]).
//!
//! Three clusters, hub B and leaves A and C, **all with pod CIDR 10.0.0.0/16 and external CIDR
//! 10.201.0.0/16**, each a gateway namespace plus a pod namespace (pod 10.0.0.10), the gateway
//! namespaces joined by a bridge playing the internet (192.0.2.0/24). In each gateway namespace
//! run the six real binaries (discovery, broker, forwarder, IPAM, gateway with userspace
//! WireGuard, endpoints), listening on the cluster's bridge address, so peering, NetworkConfigs,
//! Neighborhoods and remote IPAM calls cross the bridge too. **Every service has its own etcd**
//! (the production shape): 18 etcds on the host, each reached from its namespace through a TCP
//! forwarder on the namespace's loopback.
//!
//! A and C peer with B through the brokers with B's token; induced peering then builds A↔C
//! (or, with `--no-induced` on B, does not). B's endpoints service reflects C's pod to A
//! (`ReflectEndpointSlice`, delivered to A's endpoints service) and A's pod pings and opens a
//! TCP connection to the address A received.
//!
//! Skipped (with a `SKIPPED:` line) when not root or without `ip`/`nft`/`ping`/`nc`/`etcd`;
//! CI runs as root and fails instead. The tests are heavy (up to 36 processes each): nextest runs
//! them one at a time (`.config/nextest.toml`, test group `netns`).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ipnet::Ipv4Net;
use trellis_api::pb::endpoints::{
    ListReflectedSlicesRequest, TranslationPath, UnreflectEndpointSliceRequest,
};
use trellis_api::pb::gateway::TunnelState;
use trellis_api::pb::ipam::ListEndpointMappingsRequest;
use trellis_api::pb::types::{ClusterIdentity, PeeringKind};
use trellis_gateway::names::{BUCKET_PRIORITY, RULE_BUCKETS};
use trellis_integration::prom::{Sample, parse, parser_python, scrape_in};
use trellis_netlab::netns::{exec, ip};
use trellis_netlab::topology::host;
use trellis_netlab::{Fabric, FabricOptions, Service};

const NAMES: [&str; 3] = ["a", "b", "c"];
const A: usize = 0;
const B: usize = 1;
const C: usize = 2;
const LIMIT: Duration = Duration::from_secs(60);
/// The gateways' `--metrics-listen` port (each in its own namespace).
const GATEWAY_METRICS: u16 = 9106;
/// The gateways' busy-polling window: wide, so that a debug build's reply on a loaded machine
/// still comes back within it.
const BUSY_POLL_US: u64 = 5_000;
/// The endpoints services' default metrics port (free in each cluster's namespace).
const ENDPOINTS_METRICS: u16 = 9105;

/// Whether the test can run here; prints `SKIPPED:` otherwise (and fails in CI).
fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft", "ping", "nc", "etcd"])
}

/// The three clusters ([`Fabric`]: clusters drop before their namespaces), with the probes
/// only these tests need.
struct Lab {
    fabric: Fabric,
}

impl std::ops::Deref for Lab {
    type Target = Fabric;
    fn deref(&self) -> &Fabric {
        &self.fabric
    }
}

impl Lab {
    /// Builds the topology, starts the three clusters (B with `--no-induced` when asked) and
    /// peers A and C with B.
    async fn up(hub_no_induced: bool) -> Self {
        Self::up_with(hub_no_induced, &[]).await
    }

    /// [`Lab::up`], the gateways of the clusters in `stateless` offering the stateless wire
    /// convention (the default), the others with `--no-stateless-wire` (ADR 0034).
    async fn up_with(hub_no_induced: bool, stateless: &[usize]) -> Self {
        let mut options = FabricOptions::three_clusters();
        options.hub_no_induced = hub_no_induced;
        // Hub-path mappings show up in the gateway within a second.
        // Metrics on every address of the gateway's namespace (the test scrapes 127.0.0.1 there).
        // The engines busy-poll with a wide window and no budget (ADR 0032), so that every
        // reply of the pings below can come back within the window; the other data-plane
        // tests keep the default, no polling.
        options.extra_args = vec![(
            Service::Gateway,
            vec![
                "--mappings-interval".into(),
                "1".into(),
                "--metrics-listen".into(),
                format!("0.0.0.0:{GATEWAY_METRICS}"),
                "--busy-poll-us".into(),
                BUSY_POLL_US.to_string(),
                "--busy-poll-budget-percent".into(),
                "100".into(),
            ],
        )];
        options.cluster_args = [A, B, C]
            .into_iter()
            .filter(|i| !stateless.contains(i))
            .map(|i| (i, Service::Gateway, vec!["--no-stateless-wire".into()]))
            .collect();
        let started = Instant::now();
        let fabric = Fabric::up(options).await.expect("fabric up");
        eprintln!(
            "measured: 18 etcds and 18 services serving and A, C peered with B {} ms after the start",
            started.elapsed().as_millis()
        );
        Self { fabric }
    }

    async fn wait_tunnel_endpoints(&self, i: usize, expected: &[(&str, PeeringKind)]) {
        self.fabric
            .wait_tunnel_endpoints(i, expected, LIMIT)
            .await
            .expect("tunnel endpoints");
    }

    async fn view(&self, viewer: usize, remote: usize, external: bool) -> Ipv4Net {
        self.fabric
            .view(viewer, remote, external)
            .await
            .expect("ipam view")
    }

    /// B's endpoints service reflects C's pod to A; the path and the address A received.
    async fn reflect_c_pod_to_a(&self) -> (TranslationPath, Ipv4Addr) {
        self.fabric
            .reflect_pod(B, C, A)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()))
    }

    fn ping(&self, from: usize, to: Ipv4Addr, args: &[&str]) -> std::process::Output {
        self.fabric.ping(from, to, args).expect("ping runs")
    }

    async fn wait_ping(&self, from: usize, to: Ipv4Addr, bound: Duration) -> Duration {
        self.fabric
            .wait_ping(from, to, bound)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    fn pod_ns(&self, i: usize) -> &str {
        &self.topology.sites[i].pod_ns
    }

    fn gw_ns(&self, i: usize) -> &str {
        &self.topology.sites[i].gw_ns
    }

    /// A TCP connection from `from`'s pod to `address` reaching `to`'s pod: returns the source
    /// address the server saw.
    async fn tcp(&self, from: usize, to: usize, address: Ipv4Addr) -> String {
        let pod_ip = self.topology.sites[to].pod_ip.to_string();
        let mut server = Command::new("ip")
            .args(["netns", "exec", self.pod_ns(to), "nc", "-n", "-v", "-l"])
            .args([pod_ip.as_str(), "5000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("nc server");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let client = exec(
            self.pod_ns(from),
            "sh",
            &[
                "-c",
                &format!(
                    "echo hello-from-{} | nc -N -w 5 {address} 5000",
                    NAMES[from]
                ),
            ],
        )
        .expect("nc client");
        let deadline = Instant::now() + Duration::from_secs(10);
        while server.try_wait().expect("wait").is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = server.kill();
        let out = server.wait_with_output().expect("server output");
        let got = String::from_utf8_lossy(&out.stdout).into_owned();
        let seen = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(
            got.contains(&format!("hello-from-{}", NAMES[from])),
            "{}'s pod received {got:?} (client: {:?})",
            NAMES[to],
            String::from_utf8_lossy(&client.stderr)
        );
        // openbsd nc: "Connection received on 10.81.0.10 43512"
        seen.lines()
            .filter(|l| l.contains("received"))
            .flat_map(str::split_whitespace)
            .find_map(|w| w.parse::<Ipv4Addr>().ok().map(|a| a.to_string()))
            .unwrap_or(seen)
    }

    /// `nft list ruleset` in gateway `i`'s namespace.
    fn ruleset(&self, i: usize) -> String {
        let out = exec(self.gw_ns(i), "nft", &["list", "ruleset"]).expect("nft");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// (entries of the `ct mark set` map in our nft table, our ip rules, our interfaces) of
    /// gateway `i`.
    fn dataplane_counts(&self, i: usize) -> (usize, usize, usize) {
        let ns = self.gw_ns(i);
        let ruleset = self.ruleset(i);
        // One map, one `"interface" : mark` entry per peer (nft may wrap it over lines).
        let marks = ruleset
            .split("ct mark set iifname map {")
            .nth(1)
            .and_then(|rest| rest.split('}').next())
            .map_or(0, |entries| entries.matches(" : ").count());
        // Peer rules: the `lookup` rules in the gateway's buckets (ADR 0033).
        let rules = ip(&["-n", ns, "-4", "rule", "show"])
            .expect("rules")
            .lines()
            .filter(|l| {
                l.contains(" lookup ")
                    && l.split(':')
                        .next()
                        .and_then(|p| p.trim().parse::<u32>().ok())
                        .is_some_and(|pref| {
                            (BUCKET_PRIORITY..BUCKET_PRIORITY + RULE_BUCKETS).contains(&pref)
                        })
            })
            .count();
        let links = ip(&["-n", ns, "-o", "link", "show"])
            .expect("links")
            .lines()
            .filter(|l| {
                l.split(':')
                    .nth(1)
                    .is_some_and(|n| n.trim().starts_with("tg"))
            })
            .count();
        (marks, rules, links)
    }

    /// Waits until gateway `i` holds exactly `expected` (nft marks, ip rules, interfaces); a
    /// duplicate never settles there and fails with the counts seen.
    async fn wait_counts(&self, i: usize, expected: (usize, usize, usize), what: &str) {
        let counted = trellis_testkit::within(what, Duration::from_secs(20), || async {
            let seen = self.dataplane_counts(i);
            if seen == expected {
                Ok(())
            } else {
                Err(format!("still {seen:?}, expected {expected:?}"))
            }
        })
        .await;
        if let Err(timed_out) = counted {
            panic!("{timed_out}\n{}", self.ruleset(i));
        }
    }

    async fn wait_ruleset(&self, i: usize, what: &str, check: impl Fn(&str) -> bool) {
        trellis_testkit::eventually(what, Duration::from_secs(20), || async {
            let rules = self.ruleset(i);
            if check(&rules) {
                Ok(())
            } else {
                Err(format!("\n{rules}"))
            }
        })
        .await;
    }
}

/// The samples of `name` scraped from the service listening on `port` in namespace `ns`.
fn metric_in(python: &Path, ns: &str, port: u16, name: &str) -> Vec<Sample> {
    let text = scrape_in(ns, SocketAddr::from(([127, 0, 0, 1], port)));
    parse(python, &text)
        .into_iter()
        .filter(|s| s.name == name)
        .collect()
}

/// The metrics of the tunnel to `peer` of the gateway in `gw_ns`, parsed by the Prometheus parser: sample name
/// (the state series as `trellis_gateway_tunnel_state{state=...}`) to value.
fn tunnel_counters(python: &Path, gw_ns: &str, peer: &str) -> BTreeMap<String, f64> {
    let addr = SocketAddr::from(([127, 0, 0, 1], GATEWAY_METRICS));
    let samples = parse(python, &scrape_in(gw_ns, addr));
    let mut out = BTreeMap::new();
    for s in samples
        .iter()
        .filter(|s| s.name.starts_with("trellis_gateway_tunnel_") && s.has("peer", peer))
    {
        let key = match s.labels.get("state") {
            Some(state) => format!("{}{{state={state}}}", s.name),
            None => s.name.clone(),
        };
        out.insert(key, s.value);
    }
    for name in [
        "trellis_gateway_tunnel_tx_bytes_total",
        "trellis_gateway_tunnel_rx_bytes_total",
        "trellis_gateway_tunnel_tx_packets_total",
        "trellis_gateway_tunnel_rx_packets_total",
        "trellis_gateway_tunnel_handshake_age_seconds",
        "trellis_gateway_tunnel_state{state=up}",
    ] {
        assert!(
            out.contains_key(name),
            "no {name} for peer {peer}: {samples:?}"
        );
    }
    out
}

/// The gateway's engine-wide counters `trellis_gateway_received_while_polling_total` and
/// `trellis_gateway_busy_poll_seconds_total`, in that order.
fn polling_counters(python: &Path, gw_ns: &str) -> (f64, f64) {
    let addr = SocketAddr::from(([127, 0, 0, 1], GATEWAY_METRICS));
    let samples = parse(python, &scrape_in(gw_ns, addr));
    let value = |name: &str| {
        samples
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} in {samples:?}"))
            .value
    };
    (
        value("trellis_gateway_received_while_polling_total"),
        value("trellis_gateway_busy_poll_seconds_total"),
    )
}

fn loss_free(out: &std::process::Output) -> bool {
    out.status.success() && String::from_utf8_lossy(&out.stdout).contains(" 0% packet loss")
}

fn in_net(address: &str, net: Ipv4Net) -> bool {
    address.parse::<Ipv4Addr>().is_ok_and(|a| net.contains(&a))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaf_to_leaf_is_direct_with_the_real_control_plane_and_survives_the_hub() {
    if !can_run("leaf_to_leaf_is_direct_with_the_real_control_plane_and_survives_the_hub") {
        return;
    }
    let started = Instant::now();
    let mut fabric = Lab::up(false).await;
    fabric
        .wait_tunnel_endpoints(A, &[("b", PeeringKind::Full), ("c", PeeringKind::Induced)])
        .await;
    fabric
        .wait_tunnel_endpoints(C, &[("a", PeeringKind::Induced), ("b", PeeringKind::Full)])
        .await;

    // B reflects C's pod to A: the induced path, in A's own view of C's pod CIDR.
    let (path, address) = fabric.reflect_c_pod_to_a().await;
    assert_eq!(path, TranslationPath::Induced);
    // A's endpoints service counts what it lists as imported, by source; B counts the export.
    if let Some(python) = parser_python() {
        let listed = fabric.fabric.clusters[A]
            .endpoints()
            .expect("client")
            .list_reflected_slices(ListReflectedSlicesRequest::default())
            .await
            .expect("list")
            .into_inner()
            .reflected_slices;
        assert_eq!(listed.len(), 1, "{listed:?}");
        let imported = metric_in(
            &python,
            fabric.gw_ns(A),
            ENDPOINTS_METRICS,
            "trellis_endpoints_imported_slices",
        );
        assert_eq!(imported.len(), 1, "{imported:?}");
        let source = listed[0].source.as_ref().expect("source");
        assert!(
            imported[0].has("source", &source.cluster_id),
            "{imported:?} {listed:?}"
        );
        assert_eq!(imported[0].value, 1.0, "{imported:?}");
        let exported = metric_in(
            &python,
            fabric.gw_ns(B),
            ENDPOINTS_METRICS,
            "trellis_endpoints_exported_slices",
        );
        assert_eq!(exported.len(), 1, "{exported:?}");
        assert!(exported[0].has("target", "a"), "{exported:?}");
        assert_eq!(exported[0].value, 1.0, "{exported:?}");
    }
    let a_view_c = fabric.view(A, C, false).await;
    assert_eq!(address, host(a_view_c, 10));
    let first = fabric.wait_ping(A, address, LIMIT).await;
    eprintln!(
        "measured: A's pod reached C's pod at {address} {} ms after the reflection ({} ms after the start)",
        first.as_millis(),
        started.elapsed().as_millis()
    );

    // TCP: C's pod sees A's pod in C's view of A (SNAT on C's ingress).
    let c_view_a = fabric.view(C, A, false).await;
    let seen = fabric.tcp(A, C, address).await;
    assert_eq!(seen, host(c_view_a, 10).to_string(), "C's pod saw {seen}");

    // A<->C does not cross B: B's uplink receives next to nothing while 100 KB flow.
    let python = parser_python();
    let a_gw_ns = fabric.gw_ns(A).to_owned();
    let tunnel_metrics = |python: &Path| tunnel_counters(python, &a_gw_ns, "c");
    let metrics_before = python.as_deref().map(tunnel_metrics);
    let polled_before = python
        .as_deref()
        .map(|python| polling_counters(python, &a_gw_ns));
    let before = fabric.topology.uplink_counters(B).expect("counters");
    let out = fabric.ping(
        A,
        address,
        &["-c", "50", "-i", "0.02", "-s", "1000", "-W", "1"],
    );
    assert!(loss_free(&out), "{}", String::from_utf8_lossy(&out.stdout));
    let after = fabric.topology.uplink_counters(B).expect("counters");
    let through_b = after.rx_bytes - before.rx_bytes;
    eprintln!(
        "measured: B's uplink received {through_b} bytes while A and C exchanged 100 x 1028-byte ICMP packets"
    );
    // Control-plane chatter (resyncs, keepalives) stays far below the 100 KB of the pings.
    assert!(through_b < 20_000, "{through_b} bytes reached B");

    // A's gateway metrics for its tunnel to C grew by at least the 50 pings and their replies
    // (WireGuard counts the encrypted size, larger than the 1028-byte ICMP packets).
    if let (Some(python), Some(before)) = (python.as_deref(), metrics_before) {
        let after = tunnel_metrics(python);
        eprintln!("measured: A's tunnel to C, metrics before {before:?}, after {after:?}");
        for (name, at_least) in [
            ("trellis_gateway_tunnel_tx_bytes_total", 50.0 * 1028.0),
            ("trellis_gateway_tunnel_rx_bytes_total", 50.0 * 1028.0),
            ("trellis_gateway_tunnel_tx_packets_total", 50.0),
            ("trellis_gateway_tunnel_rx_packets_total", 50.0),
        ] {
            let grew = after[name] - before[name];
            assert!(
                grew >= at_least,
                "{name} grew by {grew}, want >= {at_least}"
            );
        }
        assert_eq!(after["trellis_gateway_tunnel_state{state=up}"], 1.0);
        assert!(after["trellis_gateway_tunnel_handshake_age_seconds"] < 180.0);
        // A's sending thread polls after each request, and C's reply mostly comes back within
        // the window: it is received there, without waking A's receiving thread.
        let (caught_before, seconds_before) = polled_before.expect("scraped before");
        let (caught, seconds) = polling_counters(python, &a_gw_ns);
        let (caught, seconds) = (caught - caught_before, seconds - seconds_before);
        eprintln!(
            "measured: A's sending thread received {caught} of 50 replies while it polled; \
             A's threads polled {seconds:.3} s"
        );
        assert!(caught >= 10.0, "{caught} replies received while polling");
        // Each of the 50 pings opens a 5 ms window at least once: the cost is counted.
        assert!(
            seconds >= 0.1,
            "A's threads polled {seconds} s around 50 pings with a 5 ms window"
        );
    }

    // Status: A's tunnel to C is up with the traffic counted.
    let tunnels = fabric.fabric.clusters[A]
        .gateway_tunnels()
        .await
        .expect("list");
    assert_eq!(tunnels.len(), 2, "{tunnels:?}");
    let to_c = tunnels
        .iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == "c"))
        .expect("tunnel to c");
    assert_eq!(to_c.state, TunnelState::Up as i32, "{to_c:?}");
    assert!(to_c.rx_bytes > 50_000 && to_c.tx_bytes > 50_000, "{to_c:?}");

    // Gateway restart mid-traffic: SIGKILL A's gateway while A pings C (interfaces die with the
    // process, rules and the nft table stay); the restarted gateway (key and ports from its
    // etcd, TunnelEndpoints from the broker) rebuilds the tunnels without duplicating a rule.
    fabric.wait_counts(A, (2, 2, 2), "both peers set up").await;
    let rules_before = fabric.ruleset(A);
    let pinging = {
        let ns = fabric.pod_ns(A).to_owned();
        let target = address.to_string();
        std::thread::spawn(move || {
            exec(
                &ns,
                "ping",
                &["-n", "-c", "150", "-i", "0.1", "-W", "1", &target],
            )
            .expect("ping runs")
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let gateway = fabric.fabric.clusters[A]
        .process_mut(Service::Gateway)
        .expect("gateway");
    gateway.kill9();
    let killed = Instant::now();
    gateway.spawn().expect("restart");
    let back = fabric.wait_ping(A, address, Duration::from_secs(30)).await;
    let back = killed.elapsed().max(back);
    eprintln!(
        "measured: A->C answered again {} ms after A's gateway was SIGKILLed and restarted",
        back.as_millis()
    );
    assert!(back < Duration::from_secs(10), "tunnel back after {back:?}");
    fabric.fabric.clusters[A]
        .process_mut(Service::Gateway)
        .expect("gateway")
        .wait_serving()
        .await
        .expect("serving");
    fabric
        .wait_counts(A, (2, 2, 2), "no duplicates after a restart")
        .await;
    assert_eq!(
        fabric.ruleset(A).lines().count(),
        rules_before.lines().count(),
        "same ruleset after the restart:\n{rules_before}\n---\n{}",
        fabric.ruleset(A)
    );
    let out = pinging.join().expect("ping thread");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!(
        "measured: during the restart: {}",
        text.lines()
            .find(|l| l.contains("packet loss"))
            .unwrap_or("?")
    );

    // The hub goes away entirely: every B process (six services, six etcds) stops and B's
    // uplink is cut. A<->C keeps working without loss for 10 s, longer than the leaves'
    // Neighborhood resync (5 s) and broker resync (2 s).
    let stopped = fabric.fabric.clusters[B].stop_all().await.expect("b stops");
    assert!(!fabric.fabric.clusters[B].any_running());
    eprintln!(
        "measured: every B process stopped within {} ms",
        stopped.as_millis()
    );
    fabric.topology.set_uplink(B, false).expect("cut b");
    let out = fabric.ping(A, address, &["-c", "100", "-i", "0.1", "-W", "1"]);
    assert!(
        loss_free(&out),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        fabric.logs()
    );
    let seen = fabric.tcp(A, C, address).await;
    assert_eq!(seen, host(c_view_a, 10).to_string());
    // The leaves still hold their induced TunnelEndpoints.
    assert!(
        fabric
            .tunnel_endpoints(A)
            .await
            .contains(&("c".to_owned(), PeeringKind::Induced))
    );
    eprintln!("measured: whole test {} ms", started.elapsed().as_millis());
    drop(fabric);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_induced_peering_leaf_traffic_takes_the_hub_path_dnated_at_the_hub() {
    if !can_run("without_induced_peering_leaf_traffic_takes_the_hub_path_dnated_at_the_hub") {
        return;
    }
    let started = Instant::now();
    let mut fabric = Lab::up(true).await;
    fabric
        .wait_tunnel_endpoints(B, &[("a", PeeringKind::Full), ("c", PeeringKind::Full)])
        .await;
    fabric
        .wait_tunnel_endpoints(A, &[("b", PeeringKind::Full)])
        .await;
    fabric
        .wait_tunnel_endpoints(C, &[("b", PeeringKind::Full)])
        .await;

    // B reflects C's pod to A through B's external CIDR, in A's view of it.
    let (path, address) = fabric.reflect_c_pod_to_a().await;
    assert_eq!(path, TranslationPath::HubExternal);
    let a_view_b_external = fabric.view(A, B, true).await;
    assert!(
        a_view_b_external.contains(&address),
        "{address} in A's view of B's external CIDR {a_view_b_external}"
    );
    let mappings = fabric.fabric.clusters[B]
        .ipam()
        .expect("client")
        .list_endpoint_mappings(ListEndpointMappingsRequest {})
        .await
        .expect("mappings")
        .into_inner()
        .mappings;
    assert_eq!(mappings.len(), 1, "{mappings:?}");
    let hub_rule = format!("{address} : {}", mappings[0].ip);
    fabric
        .wait_ruleset(B, "B's gateway installs the hub-path DNAT", |r| {
            r.contains(&hub_rule)
        })
        .await;

    eprintln!(
        "B's nftables table with the hub path:\n{}",
        String::from_utf8_lossy(
            &exec(fabric.gw_ns(B), "nft", &["list", "table", "ip", "trellis"])
                .expect("nft")
                .stdout
        )
    );
    let first = fabric.wait_ping(A, address, LIMIT).await;
    eprintln!(
        "measured: A's pod reached C's pod through B at {address} {} ms after the reflection ({} ms after the start)",
        first.as_millis(),
        started.elapsed().as_millis()
    );
    // C's pod sees the hub: the mapping's external address, in C's view of B's external CIDR.
    let c_view_b_external = fabric.view(C, B, true).await;
    let seen = fabric.tcp(A, C, address).await;
    assert!(
        in_net(&seen, c_view_b_external),
        "C's pod saw {seen}, expected an address in {c_view_b_external}"
    );

    // The packets cross B: each of the 50 requests (from A) and 50 replies (from C), 1028
    // bytes plus WireGuard's overhead, enters B's uplink once and leaves it once.
    let before = fabric.topology.uplink_counters(B).expect("counters");
    let out = fabric.ping(
        A,
        address,
        &["-c", "50", "-i", "0.02", "-s", "1000", "-W", "1"],
    );
    assert!(loss_free(&out), "{}", String::from_utf8_lossy(&out.stdout));
    let after = fabric.topology.uplink_counters(B).expect("counters");
    let (rx, tx) = (
        after.rx_bytes - before.rx_bytes,
        after.tx_bytes - before.tx_bytes,
    );
    eprintln!(
        "measured: B's uplink received {rx} and sent {tx} bytes while A pinged C 50 x 1028 bytes through the hub"
    );
    assert!(rx > 100 * 1028 && tx > 100 * 1028, "rx {rx}, tx {tx}");

    // Restart of B's gateway (SIGKILL): the hub path comes back, nothing is duplicated.
    let rules_before = fabric.ruleset(B);
    fabric.fabric.clusters[B]
        .restart(Service::Gateway)
        .await
        .expect("b's gateway restarts");
    let back = fabric.wait_ping(A, address, Duration::from_secs(30)).await;
    eprintln!(
        "measured: hub path answered again {} ms after B's gateway served again",
        back.as_millis()
    );
    fabric
        .wait_counts(B, (2, 2, 2), "no duplicates after a restart")
        .await;
    fabric
        .wait_ruleset(B, "the same ruleset after the restart", |r| {
            r.lines().count() == rules_before.lines().count()
        })
        .await;
    assert_eq!(fabric.ruleset(B).matches(&hub_rule).count(), 1);

    // Unreflecting releases the mapping; B's gateway removes its DNAT and SNAT.
    fabric.fabric.clusters[B]
        .endpoints()
        .expect("client")
        .unreflect_endpoint_slice(UnreflectEndpointSliceRequest {
            target: Some(ClusterIdentity {
                cluster_id: "a".into(),
                cluster_name: String::new(),
            }),
            namespace: "shop".into(),
            name: "web".into(),
            deliver: true,
        })
        .await
        .expect("unreflect");
    fabric
        .wait_ruleset(B, "the hub-path rules go with the mapping", |r| {
            !r.contains(&hub_rule)
        })
        .await;
    let rules = fabric.ruleset(B);
    assert!(!rules.contains("ct status dnat"), "{rules}");
    assert!(
        !fabric
            .ping(A, address, &["-c", "1", "-W", "1"])
            .status
            .success(),
        "nothing answers at {address} anymore"
    );
    eprintln!("measured: whole test {} ms", started.elapsed().as_millis());
    drop(fabric);
}

/// ADR 0032's stateless wire convention, every gateway started with `--stateless-wire`: each
/// engine translates what it sends into the receiver's terms, so the kernels track, zone, mark
/// and translate nothing of the leaves' traffic, and the pods see each other exactly as under
/// the old convention: A's pod reaches C's pod (induced) and B's, each side sees the other in
/// its own view, whichever side opened the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_stateless_wire_pods_see_each_other_as_before_and_the_kernels_translate_nothing() {
    if !can_run(
        "with_the_stateless_wire_pods_see_each_other_as_before_and_the_kernels_translate_nothing",
    ) {
        return;
    }
    let fabric = Lab::up_with(false, &[A, B, C]).await;
    fabric
        .wait_tunnel_endpoints(A, &[("b", PeeringKind::Full), ("c", PeeringKind::Induced)])
        .await;
    fabric
        .wait_tunnel_endpoints(C, &[("a", PeeringKind::Induced), ("b", PeeringKind::Full)])
        .await;
    let (path, address) = fabric.reflect_c_pod_to_a().await;
    assert_eq!(path, TranslationPath::Induced);
    assert_eq!(address, host(fabric.view(A, C, false).await, 10));
    fabric.wait_ping(A, address, LIMIT).await;
    let seen = fabric.tcp(A, C, address).await;
    assert_eq!(seen, host(fabric.view(C, A, false).await, 10).to_string());
    // The other way round, and with the hub.
    let a_at_c = host(fabric.view(C, A, false).await, 10);
    fabric.wait_ping(C, a_at_c, LIMIT).await;
    let seen = fabric.tcp(C, A, a_at_c).await;
    assert_eq!(seen, host(fabric.view(A, C, false).await, 10).to_string());
    let b_at_a = host(fabric.view(A, B, false).await, 10);
    fabric.wait_ping(A, b_at_a, LIMIT).await;
    let seen = fabric.tcp(A, B, b_at_a).await;
    assert_eq!(seen, host(fabric.view(B, A, false).await, 10).to_string());
    let out = fabric.ping(
        A,
        address,
        &["-c", "20", "-i", "0.02", "-s", "3000", "-W", "1"],
    );
    assert!(loss_free(&out), "{}", String::from_utf8_lossy(&out.stdout));

    for i in [A, B, C] {
        let rules = fabric.ruleset(i);
        assert!(rules.contains("notrack"), "{rules}");
        for kernel_side in ["ct zone set iifname", "dnat ip prefix", "snat ip prefix"] {
            assert!(!rules.contains(kernel_side), "{kernel_side}:\n{rules}");
        }
        // No marks and no policy rules: replies find a tunnel by their destination.
        assert_eq!(fabric.dataplane_counts(i), (0, 0, 2), "{}", NAMES[i]);
    }
    drop(fabric);
}

/// The hub path under the stateless wire convention: A sends to B's mapping at B's real
/// external address (its engine translated it), B's kernel tracks that connection only, for its
/// DNAT to C's pod, and C's pod sees the hub's mapping address in its own view, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_stateless_wire_the_hub_path_is_tracked_at_the_hub_only() {
    if !can_run("with_the_stateless_wire_the_hub_path_is_tracked_at_the_hub_only") {
        return;
    }
    let fabric = Lab::up_with(true, &[A, B, C]).await;
    fabric
        .wait_tunnel_endpoints(B, &[("a", PeeringKind::Full), ("c", PeeringKind::Full)])
        .await;
    fabric
        .wait_tunnel_endpoints(A, &[("b", PeeringKind::Full)])
        .await;
    let (path, address) = fabric.reflect_c_pod_to_a().await;
    assert_eq!(path, TranslationPath::HubExternal);
    let a_view_b_external = fabric.view(A, B, true).await;
    let external: Ipv4Net = "10.201.0.0/16".parse().expect("net");
    let real = trellis_gateway::dataplane::rebase(
        address.into(),
        a_view_b_external.into(),
        external.into(),
    )
    .expect("in A's view of B's external CIDR");
    fabric
        .wait_ruleset(B, "B's hub-path DNAT, keyed by its real address", |r| {
            r.contains(&format!("{real} : "))
        })
        .await;
    fabric.wait_ping(A, address, LIMIT).await;
    let c_view_b_external = fabric.view(C, B, true).await;
    let seen = fabric.tcp(A, C, address).await;
    assert!(
        in_net(&seen, c_view_b_external),
        "C's pod saw {seen}, expected an address in {c_view_b_external}"
    );
    let out = fabric.ping(
        A,
        address,
        &["-c", "20", "-i", "0.02", "-s", "1000", "-W", "1"],
    );
    assert!(loss_free(&out), "{}", String::from_utf8_lossy(&out.stdout));
    drop(fabric);
}

/// The stateless wire convention is negotiated per tunnel (ADR 0034): A and the hub B offer
/// it, C does not. A and B use it between them; B and C keep the kernels' double NAT, and so
/// does the hub path between A and C, which crosses both kinds of tunnel at B. Every pod sees
/// every other in its own view, as under one convention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stateless_wire_is_used_only_between_gateways_that_both_offer_it() {
    if !can_run("the_stateless_wire_is_used_only_between_gateways_that_both_offer_it") {
        return;
    }
    let fabric = Lab::up_with(true, &[A, B]).await;
    fabric
        .wait_tunnel_endpoints(B, &[("a", PeeringKind::Full), ("c", PeeringKind::Full)])
        .await;
    for leaf in [A, C] {
        fabric
            .wait_tunnel_endpoints(leaf, &[("b", PeeringKind::Full)])
            .await;
    }
    for (i, j, expected) in [(A, B, true), (B, A, true), (B, C, false), (C, B, false)] {
        let te = trellis_integration::peering::answered_tunnel_to(
            &fabric.clusters[i],
            &fabric.clusters[j].id,
        )
        .await
        .expect("ListTunnelEndpoints")
        .expect("a tunnel endpoint");
        assert_eq!(
            te.stateless_wire, expected,
            "{}'s tunnel to {}",
            NAMES[i], NAMES[j]
        );
    }
    // Direct traffic, each pod seen in the receiver's view of its cluster.
    for (from, to) in [(A, B), (B, A), (B, C), (C, B)] {
        let address = host(fabric.view(from, to, false).await, 10);
        fabric.wait_ping(from, address, LIMIT).await;
        let seen = fabric.tcp(from, to, address).await;
        assert_eq!(
            seen,
            host(fabric.view(to, from, false).await, 10).to_string(),
            "{} to {}",
            NAMES[from],
            NAMES[to]
        );
    }
    // The hub path, both ways: each leaf's pod sees the hub's mapping in its view of B.
    for (from, to) in [(A, C), (C, A)] {
        let (path, address) = fabric
            .reflect_pod(B, to, from)
            .await
            .unwrap_or_else(|e| panic!("{e:#}\n{}", fabric.logs()));
        assert_eq!(path, TranslationPath::HubExternal);
        fabric.wait_ping(from, address, LIMIT).await;
        let seen = fabric.tcp(from, to, address).await;
        let hub_view = fabric.view(to, B, true).await;
        assert!(
            in_net(&seen, hub_view),
            "{}'s pod saw {seen}, expected an address in {hub_view}",
            NAMES[to]
        );
    }
    // A's kernel translates nothing; C's does all of its own; B's both.
    let (a, b, c) = (fabric.ruleset(A), fabric.ruleset(B), fabric.ruleset(C));
    assert!(
        a.contains("notrack") && !a.contains("ct zone set iifname"),
        "{a}"
    );
    assert!(
        !c.contains("notrack") && c.contains("ct zone set iifname"),
        "{c}"
    );
    assert!(
        b.contains("notrack") && b.contains("ct zone set iifname"),
        "{b}"
    );
    assert_eq!(fabric.dataplane_counts(A), (0, 0, 1), "a");
    assert_eq!(fabric.dataplane_counts(B).0, 1, "b marks C's tunnel only");
    drop(fabric);
}

/// Gateways that advertise DNS names instead of IPs (`--endpoint-address gw-<id>.trellis.test`,
/// resolvable only through each gateway namespace's own hosts file): the name travels unresolved
/// in the NetworkConfigs and TunnelEndpoints, each remote gateway resolves it when it configures
/// the tunnel, and pods reach each other exactly as with IP endpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_endpoints_given_as_dns_names_are_resolved_by_the_remote_gateways() {
    if !can_run("gateway_endpoints_given_as_dns_names_are_resolved_by_the_remote_gateways") {
        return;
    }
    let mut options = FabricOptions::three_clusters();
    options.store = trellis_netlab::StoreKind::Memory;
    options.endpoint_names = true;
    let fabric = Lab {
        fabric: Fabric::up(options).await.expect("fabric up"),
    };
    fabric
        .wait_tunnel_endpoints(A, &[("b", PeeringKind::Full), ("c", PeeringKind::Induced)])
        .await;
    fabric
        .wait_tunnel_endpoints(C, &[("a", PeeringKind::Induced), ("b", PeeringKind::Full)])
        .await;
    // The names, not addresses, are what the brokers agreed on.
    for (i, j) in [(A, B), (A, C), (C, A), (B, A)] {
        let published = fabric.published_endpoint(i, j).await.expect("endpoint");
        let name = trellis_netlab::fabric::endpoint_name(&fabric.clusters[j].id);
        assert!(
            published.starts_with(&format!("{name}:")),
            "{} sees {}'s endpoint as {published}",
            fabric.clusters[i].id,
            fabric.clusters[j].id
        );
    }

    // Real packets over the induced tunnel A<->C, whose endpoints were names on both ends.
    let (path, address) = fabric.reflect_c_pod_to_a().await;
    assert_eq!(path, TranslationPath::Induced);
    let first = fabric.wait_ping(A, address, LIMIT).await;
    eprintln!(
        "measured: A's pod reached C's pod at {address} through name-addressed gateways {} ms after the reflection",
        first.as_millis()
    );
    let c_view_a = fabric.view(C, A, false).await;
    let seen = fabric.tcp(A, C, address).await;
    assert_eq!(seen, host(c_view_a, 10).to_string(), "C's pod saw {seen}");

    // A's gateway sends to C's bridge address: the name resolved to it.
    let tunnels = fabric.clusters[A].gateway_tunnels().await.expect("list");
    let to_c = tunnels
        .iter()
        .find(|t| t.remote.as_ref().is_some_and(|r| r.cluster_id == "c"))
        .expect("tunnel to c");
    assert_eq!(to_c.state, TunnelState::Up as i32, "{to_c:?}");
    let c_ip = fabric.topology.sites[C].uplink_ip.to_string();
    assert!(
        to_c.remote_endpoint.starts_with(&format!("{c_ip}:")),
        "A sends to {} for C (bridge address {c_ip})",
        to_c.remote_endpoint
    );
}

/// `--underlay-mtu 1400` on every gateway: each tunnel device gets 1320 (1400 − 80), and a pod's
/// packets that do not fit are refused with "fragmentation needed" at the gateway instead of
/// being black-holed after encapsulation: 1320 bytes with DF cross, 1321 do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnel_devices_take_their_mtu_from_the_underlay() {
    if !can_run("tunnel_devices_take_their_mtu_from_the_underlay") {
        return;
    }
    let mut options = FabricOptions::three_clusters();
    options.store = trellis_netlab::StoreKind::Memory;
    options.extra_args = vec![(
        Service::Gateway,
        vec!["--underlay-mtu".into(), "1400".into()],
    )];
    let fabric = Lab {
        fabric: Fabric::up(options).await.expect("fabric up"),
    };
    fabric
        .wait_tunnel_endpoints(A, &[("b", PeeringKind::Full), ("c", PeeringKind::Induced)])
        .await;
    let (_, address) = fabric.reflect_c_pod_to_a().await;
    fabric.wait_ping(A, address, LIMIT).await;

    let links = ip(&["-n", fabric.gw_ns(A), "-j", "link", "show"]).expect("ip link");
    let links: serde_json::Value = serde_json::from_str(&links).expect("json");
    let tunnels: Vec<(String, u64)> = links
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| Some((l["ifname"].as_str()?.to_owned(), l["mtu"].as_u64()?)))
        .filter(|(name, _)| name.starts_with("tg"))
        .collect();
    assert_eq!(tunnels.len(), 2, "A's tunnel devices: {tunnels:?}");
    for (name, mtu) in &tunnels {
        assert_eq!(*mtu, 1320, "{name}");
    }

    // ICMP payload + 28 bytes of headers: 1292 → 1320 bytes, 1293 → 1321.
    let fits = fabric.ping(
        A,
        address,
        &["-c", "3", "-W", "2", "-M", "do", "-s", "1292"],
    );
    assert!(
        fits.status.success(),
        "1320-byte packets: {}",
        String::from_utf8_lossy(&fits.stdout)
    );
    let too_big = fabric.ping(
        A,
        address,
        &["-c", "3", "-W", "2", "-M", "do", "-s", "1293"],
    );
    let said = String::from_utf8_lossy(&too_big.stdout);
    assert!(
        !too_big.status.success(),
        "1321-byte packets crossed: {said}"
    );
    assert!(
        said.contains("mtu = 1320"),
        "no fragmentation-needed answer: {said}"
    );
}
