//! `trellis-lab`, the README's main command, run as the real binary: the default 3-cluster
//! lab (what `make demo` starts) answers the README's grpcurl commands exactly as printed and
//! stops cleanly on Ctrl-C; `--clusters 10 --same-pod-cidr` converges to 9·8 induced tunnels
//! among the leaves; `--no-induced` keeps the leaves apart; the mesh forms over mutual TLS
//! with no certificate prepared, unless `--insecure-plaintext-peering` asks for plaintext;
//! `--store etcd` runs on real etcd.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use trellis_integration::bin_path;
use trellis_integration::command::succeeds;
use trellis_integration::lab::RunningLab;
use trellis_testkit::{require_tool, workspace_root};

fn lab(args: &[&str]) -> Command {
    let mut cmd = Command::new(bin_path("trellis-lab").expect("trellis-lab is built"));
    cmd.arg("up").args(args);
    cmd
}

/// Runs a lab with `--until-converged` and returns its stdout; panics with the output when
/// it fails.
fn until_converged(args: &[&str]) -> String {
    let out = lab(args)
        .args(["--until-converged", "--base-port", "0", "--timeout", "240"])
        .output()
        .expect("trellis-lab runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "trellis-lab {args:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn topology(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("topology file")).expect("json")
}

/// (holder, remote) of every tunnel of `kind` in a topology file.
fn tunnels(topology: &serde_json::Value, kind: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for c in topology["clusters"].as_array().expect("clusters") {
        for t in c["tunnels"].as_array().expect("tunnels") {
            if t["kind"] == kind {
                found.push((
                    c["id"].as_str().expect("id").to_owned(),
                    t["remote"].as_str().expect("remote").to_owned(),
                ));
            }
        }
    }
    found
}

fn temp_file(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join(name);
    (dir, path)
}

#[test]
fn ten_clusters_with_the_same_pod_cidr_converge_to_nine_times_eight_induced_tunnels() {
    let (_dir, path) = temp_file("topology.json");
    let stdout = until_converged(&[
        "--clusters",
        "10",
        "--same-pod-cidr",
        "--topology-file",
        path.to_str().expect("utf-8 path"),
    ]);
    assert!(
        stdout.contains("tunnels: full 18/18, induced 72/72"),
        "{stdout}"
    );
    assert!(stdout.contains("converged in"), "{stdout}");
    let t = topology(&path);
    assert_eq!(t["converged"], true);
    let induced = tunnels(&t, "induced");
    assert_eq!(induced.len(), 9 * 8, "{induced:?}");
    assert!(
        induced
            .iter()
            .all(|(a, c)| a.starts_with("leaf-") && c.starts_with("leaf-") && a != c)
    );
    // Every leaf sees every other leaf at a distinct remapped /16 (none keeps 10.0.0.0/16).
    for c in t["clusters"].as_array().expect("clusters").iter().skip(1) {
        let views: std::collections::BTreeSet<&str> = c["tunnels"]
            .as_array()
            .expect("tunnels")
            .iter()
            .map(|t| t["remote_pod_cidr_nat"].as_str().expect("nat"))
            .collect();
        assert_eq!(views.len(), 9, "{c}");
        assert!(!views.contains("10.0.0.0/16"), "{c}");
    }
}

#[test]
fn without_induced_peering_leaves_only_peer_with_the_hub() {
    let (_dir, path) = temp_file("topology.json");
    let stdout = until_converged(&[
        "--clusters",
        "4",
        "--no-induced",
        "--insecure-plaintext-peering",
        "--topology-file",
        path.to_str().expect("utf-8 path"),
    ]);
    assert!(
        stdout.contains("induced peering off, PLAINTEXT between clusters"),
        "{stdout}"
    );
    let t = topology(&path);
    assert_eq!(tunnels(&t, "full").len(), 2 * 3);
    assert!(tunnels(&t, "induced").is_empty());
    // Plaintext: the clusters reach each other on the only listeners there are.
    for c in t["clusters"].as_array().expect("clusters") {
        assert!(c.get("peer_services").is_none(), "{c}");
    }
}

#[test]
fn by_default_the_mesh_forms_over_mutual_tls_with_no_certificate_prepared() {
    let (_dir, path) = temp_file("topology.json");
    let stdout = until_converged(&[
        "--clusters",
        "3",
        "--same-pod-cidr",
        "--topology-file",
        path.to_str().expect("utf-8 path"),
    ]);
    assert!(stdout.contains("mutual TLS between clusters"), "{stdout}");
    assert!(stdout.contains("induced 2/2"), "{stdout}");
    let t = topology(&path);
    assert_eq!(t["converged"], true);
    assert_eq!(tunnels(&t, "induced").len(), 2);
    // Every cluster-facing service has a peer listener, apart from its plaintext one.
    for c in t["clusters"].as_array().expect("clusters") {
        for service in ["discovery", "broker", "forwarder", "ipam", "endpoints"] {
            let peer = c["peer_services"][service].as_str().expect("peer listener");
            assert_ne!(
                peer,
                c["services"][service].as_str().expect("listener"),
                "{c}"
            );
        }
        assert!(c["peer_services"].get("gateway").is_none(), "{c}");
    }
}

#[test]
fn the_lab_runs_on_real_etcd() {
    if require_tool("etcd").is_none() {
        return;
    }
    let stdout = until_converged(&["--clusters", "3", "--store", "etcd"]);
    assert!(stdout.contains("with etcd stores"), "{stdout}");
    assert!(
        stdout.contains("tunnels: full 4/4, induced 2/2"),
        "{stdout}"
    );
}

/// The grpcurl block of the README's lab section.
fn readme_commands() -> String {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).expect("README.md");
    let start = readme
        .find("<!-- lab-grpcurl -->")
        .expect("README marks the lab's grpcurl block with <!-- lab-grpcurl -->");
    let block = &readme[start..];
    let open = block.find("```sh\n").expect("code block") + "```sh\n".len();
    let close = block[open..].find("```").expect("code block end");
    block[open..open + close].to_owned()
}

#[test]
fn make_demo_lab_answers_the_readme_grpcurl_commands_as_printed_and_stops_on_ctrl_c() {
    let Some(grpcurl) = require_tool("grpcurl") else {
        return;
    };
    // `make demo` runs `trellis-lab up --same-pod-cidr` on the default ports.
    let (lab, printed) = RunningLab::start(&["--same-pod-cidr"], Duration::from_secs(120));
    let commands = readme_commands();
    assert!(
        printed.contains(&commands),
        "the README's grpcurl block differs from what the lab prints.\nREADME:\n{commands}\nlab:\n{printed}"
    );
    let path = format!(
        "{}:{}",
        grpcurl.parent().expect("dir").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut outputs = Vec::new();
    for command in commands.lines().filter(|l| l.starts_with("grpcurl ")) {
        let out = succeeds(
            Command::new("bash")
                .args(["-c", command])
                .env("PATH", &path),
            &format!("`{command}`"),
        );
        outputs.push((command, String::from_utf8_lossy(&out.stdout).into_owned()));
    }
    let output_of = |rpc: &str| {
        &outputs
            .iter()
            .find(|(c, _)| c.contains(rpc))
            .unwrap_or_else(|| panic!("the README calls {rpc}"))
            .1
    };
    assert!(output_of(" list").contains("trellis.ipam.v1.Ipam"));
    assert!(output_of("ListForeignClusters").contains("leaf-2"));
    let tunnels = output_of("ListTunnelEndpoints");
    assert!(tunnels.contains("PEERING_KIND_INDUCED"), "{tunnels}");
    let mapped: serde_json::Value =
        serde_json::from_str(output_of("MapEndpointIp")).expect("json answer");
    let ip = mapped["ip"].as_str().expect("ip");
    assert!(
        ip.ends_with(".0.10") && !ip.starts_with("10.0."),
        "leaf-2 reaches leaf-1's pod through its remap of leaf-1's identical CIDR: {ip}"
    );

    // The export and the name, as printed: leaf-2's DNS answers the address MapEndpointIp gave.
    if require_tool("dig").is_some() {
        let trellisctl = bin_path("trellisctl").expect("trellisctl built");
        let path = format!("{}:{path}", trellisctl.parent().expect("dir").display());
        let line = |prefix: &str| {
            commands
                .lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("the README runs {prefix}"))
                .to_owned()
        };
        succeeds(
            Command::new("bash")
                .args(["-c", &line("trellisctl ")])
                .env("PATH", &path),
            "the README's trellisctl export",
        );
        let dig = line("dig ");
        // Normally at once. On a loaded machine the hub may reflect the export before leaf-1's
        // IPAM trusts the hub's certificate: it then translates through its own external CIDR
        // (the hub path, a working address) until the export reconciler's next resend (60 s)
        // replaces it with the direct one.
        let started = std::time::Instant::now();
        loop {
            let out = Command::new("bash")
                .args(["-c", &dig])
                .output()
                .expect("dig runs");
            let answer = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if answer == ip {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(90),
                "`{dig}` answered {answer:?}, not the exported pod {ip}"
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    // Ctrl-C stops everything and frees the ports.
    let status = lab.interrupt();
    assert!(status.success(), "{status}");
    for port in [7101, 7106, 7121, 7126] {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port} still taken after the lab stopped"
        );
    }
}
