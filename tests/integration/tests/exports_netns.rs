//! A Service exported with `trellisctl export` is used from the other clusters with real
//! packets (issue 16): `trellis-lab up --dataplane netns` (the real binary, three clusters of
//! two nodes on one pod CIDR), an HTTP server in a pod of leaf-1 on its non-gateway node,
//! exported through leaf-1's endpoints service. A pod of leaf-2 fetches a 1 MiB file at the
//! address leaf-2's import lists, which lies in leaf-2's induced view of leaf-1 (the direct
//! tunnel, not the hub: the hub's gateway namespace sees almost none of those bytes), and a pod
//! of the hub fetches it at the hub's import. The leaf-2 pod also resolves
//! `web.shop.svc.clusterset.local` with `dig` at its cluster's DNS (the topology's
//! `services.dns`) to that address. `trellisctl unexport` then removes both imports, and the
//! name.
//!
//! trellisctl runs in each cluster's gateway namespace, where an operator on the gateway node
//! reaches the services. Skipped (with a `SKIPPED:` line) when not root or without
//! `ip`/`nft`/`ping`/`python3`; CI runs as root and fails instead. Heavy: one at a time.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use trellis_integration::lab::{Killed, RunningLab, str_of, trellisctl};

const PORT: u16 = 8080;
const BLOB: usize = 1 << 20;
const LIMIT: Duration = Duration::from_secs(60);

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft", "ping", "python3"])
}

/// The addresses `cluster` imported for Service `name` (its reflected slices of it).
fn imported(cluster: &Value, name: &str) -> Vec<String> {
    let out = trellisctl(cluster, &["endpoints", "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).expect("json");
    listed["reflected_slices"]
        .as_array()
        .expect("reflected_slices")
        .iter()
        .filter(|r| r["slice"]["service_name"] == name)
        .flat_map(|r| {
            r["slice"]["endpoints"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|e| e["addresses"].as_array().cloned().unwrap_or_default())
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect()
}

/// Waits for `cluster`'s import of `name` to list exactly one address.
fn wait_import(cluster: &Value, name: &str) -> (String, Duration) {
    let started = Instant::now();
    loop {
        let addresses = imported(cluster, name);
        if let [one] = addresses.as_slice() {
            return (one.clone(), started.elapsed());
        }
        assert!(
            started.elapsed() < LIMIT,
            "{} never imported {name} with one address: {addresses:?}",
            str_of(cluster, "id")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Bytes received on every interface of namespace `ns`.
fn rx_bytes(ns: &str) -> u64 {
    let out = Command::new("ip")
        .args(["-n", ns, "-j", "-s", "link", "show"])
        .output()
        .expect("ip runs");
    let links: Value = serde_json::from_slice(&out.stdout).expect("json");
    links
        .as_array()
        .expect("links")
        .iter()
        .filter_map(|l| l["stats64"]["rx"]["bytes"].as_u64())
        .sum()
}

/// Fetches `http://address:PORT/blob` from pod namespace `ns`; the number of bytes read.
fn fetch(ns: &str, address: &str) -> Result<usize, String> {
    let script = format!(
        "import urllib.request\nprint(len(urllib.request.urlopen('http://{address}:{PORT}/blob', \
         timeout=10).read()))"
    );
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "python3", "-c", &script])
        .output()
        .expect("python3 runs");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|e| format!("{e}"))
}

/// Whether `address` lies in `cidr` (IPv4).
/// `web.shop.svc.clusterset.local` A asked with `dig` from network namespace `ns` at `dns`
/// (`host:port`): the response code and the addresses.
fn resolve(ns: &str, dns: &str) -> (String, Vec<String>) {
    let dig = trellis_testkit::require_tool("dig").expect("dig (scripts/setup.sh installs it)");
    let server = dns.parse().expect("host:port");
    let answer = trellis_integration::dns::dig(
        &dig,
        Some(ns),
        server,
        "web.shop.svc.clusterset.local",
        "A",
        trellis_integration::dns::Over::Udp,
    );
    (answer.status, answer.answers)
}

fn contains(cidr: &str, address: &str) -> bool {
    let net: ipnet::Ipv4Net = cidr.parse().expect("cidr");
    net.contains(&address.parse::<std::net::Ipv4Addr>().expect("address"))
}

#[test]
fn an_exported_http_service_is_fetched_by_the_induced_leaf_directly_and_by_the_hub() {
    let test = "an_exported_http_service_is_fetched_by_the_induced_leaf_directly_and_by_the_hub";
    if !can_run(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("topology.json");
    let (lab, _) = RunningLab::start(
        &[
            "--dataplane".as_ref(),
            "netns".as_ref(),
            "--clusters".as_ref(),
            "3".as_ref(),
            "--nodes".as_ref(),
            "2".as_ref(),
            "--same-pod-cidr".as_ref(),
            "--timeout".as_ref(),
            "180".as_ref(),
            "--topology-file".as_ref(),
            path.as_os_str(),
        ],
        Duration::from_secs(240),
    );
    let topology: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("topology file"))
            .expect("json");
    let clusters = topology["clusters"].as_array().expect("clusters");
    let by_id = |id: &str| {
        clusters
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("no cluster {id} in {topology}"))
    };
    let (hub, leaf1, leaf2) = (by_id("hub"), by_id("leaf-1"), by_id("leaf-2"));

    // The server: leaf-1's pod on its second node (not the gateway's).
    let server_pod = &leaf1["pods"][1];
    let www = tempfile::tempdir().expect("www");
    let blob: Vec<u8> = (0..BLOB).map(|i| (i % 251) as u8).collect();
    std::fs::write(www.path().join("blob"), &blob).expect("blob");
    let _server = Killed(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                str_of(server_pod, "netns"),
                "python3",
                "-m",
            ])
            .args([
                "http.server",
                &PORT.to_string(),
                "--bind",
                str_of(server_pod, "ip"),
            ])
            .arg("--directory")
            .arg(www.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("http server starts"),
    );

    let exported = trellisctl(
        leaf1,
        &[
            "export",
            "web",
            "--namespace",
            "shop",
            "--port",
            &PORT.to_string(),
            "--endpoint",
            str_of(server_pod, "ip"),
        ],
    );
    assert!(
        exported.status.success(),
        "{}",
        String::from_utf8_lossy(&exported.stderr)
    );

    // leaf-2 imports it at an address of its induced (direct) view of leaf-1.
    let (at_leaf2, waited) = wait_import(leaf2, "web");
    eprintln!(
        "measured: leaf-2 imported web after {} ms",
        waited.as_millis()
    );
    let induced = leaf2["tunnels"]
        .as_array()
        .expect("tunnels")
        .iter()
        .find(|t| t["remote"] == "leaf-1")
        .expect("leaf-2's tunnel to leaf-1");
    assert_eq!(str_of(induced, "kind"), "induced", "{induced}");
    assert!(
        contains(str_of(induced, "remote_pod_cidr_nat"), &at_leaf2),
        "leaf-2's import {at_leaf2} is not in its direct view of leaf-1 {induced}"
    );
    let (at_hub, _) = wait_import(hub, "web");

    // A pod of leaf-2 on its second node fetches it, around the hub.
    let client2 = str_of(&leaf2["pods"][1], "netns");
    // The pod resolves the name at its cluster's DNS (the topology's services.dns).
    let dns = str_of(&leaf2["services"], "dns");
    assert_eq!(
        resolve(client2, dns),
        ("NOERROR".to_owned(), vec![at_leaf2.clone()]),
        "web.shop.svc.clusterset.local from a pod of leaf-2"
    );
    let hub_ns = str_of(hub, "gateway_netns");
    let before = rx_bytes(hub_ns);
    let started = Instant::now();
    let got = loop {
        match fetch(client2, &at_leaf2) {
            Ok(n) => break n,
            Err(err) if started.elapsed() > LIMIT => panic!("leaf-2 cannot fetch: {err}"),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    let through_hub = rx_bytes(hub_ns) - before;
    eprintln!(
        "measured: 1 MiB from leaf-1 to leaf-2, hub gateway namespace received {through_hub} bytes"
    );
    assert_eq!(got, BLOB);
    assert!(
        through_hub < (BLOB / 4) as u64,
        "the hub's gateway namespace received {through_hub} bytes of a {BLOB}-byte transfer \
         between its leaves: not the direct path"
    );

    // A pod of the hub fetches it at the hub's import.
    let hub_client = str_of(&hub["pods"][1], "netns");
    assert_eq!(fetch(hub_client, &at_hub).expect("the hub fetches"), BLOB);

    // Unexported: both imports go.
    let unexported = trellisctl(leaf1, &["unexport", "web", "--namespace", "shop"]);
    assert!(
        unexported.status.success(),
        "{}",
        String::from_utf8_lossy(&unexported.stderr)
    );
    let started = Instant::now();
    while !(imported(leaf2, "web").is_empty() && imported(hub, "web").is_empty()) {
        assert!(
            started.elapsed() < LIMIT,
            "the imports outlived the unexport"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "measured: both imports gone {} ms after unexport",
        started.elapsed().as_millis()
    );
    // The name went with the import (within the DNS rebuild and the 5 s TTL at most).
    let started = Instant::now();
    while resolve(client2, dns).0 != "NXDOMAIN" {
        assert!(started.elapsed() < LIMIT, "the name outlived the unexport");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(lab.interrupt().success());
}
