//! `trellis-lab up --dataplane netns --nodes N`, run as the real binary as a user would: three
//! clusters on one pod CIDR, two nodes each, real packets. The lab waits until every pod answers
//! every pod of the other clusters and prints the matrix; its topology file lists nodes, pods
//! and every pair; `trellis-lab check` against the running lab passes, and fails naming the pod
//! once that pod is cut off; Ctrl-C removes every namespace the lab made. A lab killed with
//! SIGKILL takes every process it started along, and the next `trellis-lab up` removes the
//! namespaces it left and says so.
//!
//! Skipped (with a `SKIPPED:` line) when not root; CI runs as root and fails instead. Heavy
//! (24 processes): one at a time in the `netns` test group.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use trellis_integration::bin_path;
use trellis_integration::lab::{RunningLab, str_of};
use trellis_testkit::require_tool;

fn can_run(test: &str) -> bool {
    trellis_netlab::netns::can_run(test, &["ip", "nft", "ping"])
}

fn netns_list() -> BTreeSet<String> {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    // An empty list from a failed `ip` would pass every "is gone" check.
    assert!(out.status.success(), "ip netns list failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

fn check(path: &Path) -> (bool, String) {
    let out = Command::new(bin_path("trellis-lab").expect("trellis-lab is built"))
        .args(["check", "--timeout", "3", "--topology-file"])
        .arg(path)
        .output()
        .expect("trellis-lab check runs");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn the_namespace_lab_with_nodes_reaches_every_pod_checks_the_matrix_and_leaves_nothing_behind() {
    let test = "the_namespace_lab_with_nodes_reaches_every_pod_checks_the_matrix_and_leaves_nothing_behind";
    if !can_run(test) {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("topology.json");
    let before = netns_list();
    let started = Instant::now();
    let (lab, printed) = RunningLab::start(
        &[
            "--dataplane".as_ref(),
            "netns".as_ref(),
            "--clusters".as_ref(),
            "3".as_ref(),
            "--nodes".as_ref(),
            "2".as_ref(),
            "--gateways".as_ref(),
            "2".as_ref(),
            "--store".as_ref(),
            "etcd".as_ref(),
            "--same-pod-cidr".as_ref(),
            "--timeout".as_ref(),
            "180".as_ref(),
            "--topology-file".as_ref(),
            path.as_os_str(),
        ],
        Duration::from_secs(240),
    );
    eprintln!(
        "measured: 3 clusters x 2 nodes up, every pod pair answering, in {} ms",
        started.elapsed().as_millis()
    );
    // 3 clusters x 2 pods: each pod reaches the 4 pods of the other two clusters.
    assert!(printed.contains("all 24 pod pairs answered"), "{printed}");
    let matrix_row = printed
        .lines()
        .find(|l| l.starts_with("leaf-1 ") && l.contains("4/4"))
        .unwrap_or_else(|| panic!("no matrix row for leaf-1:\n{printed}"));
    assert_eq!(
        matrix_row.split_whitespace().collect::<Vec<_>>(),
        ["leaf-1", "4/4", "-", "4/4"],
        "{printed}"
    );

    let topology: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("topology file"))
            .expect("json");
    let clusters = topology["clusters"].as_array().expect("clusters");
    assert_eq!(clusters.len(), 3);
    let mut made = BTreeSet::new();
    let mut pods_of = std::collections::BTreeMap::new();
    for c in clusters {
        let nodes = c["nodes"].as_array().expect("nodes");
        let pods = c["pods"].as_array().expect("pods");
        assert_eq!((nodes.len(), pods.len()), (2, 2), "{c}");
        assert_eq!(
            nodes.iter().filter(|n| n["gateway"] == true).count(),
            1,
            "{c}"
        );
        assert_eq!(str_of(&nodes[0], "netns"), str_of(c, "gateway_netns"));
        assert_eq!(str_of(&pods[0], "netns"), str_of(c, "pod_netns"));
        assert_eq!(str_of(&pods[0], "ip"), str_of(c, "pod_ip"));
        for n in nodes.iter().chain(pods) {
            made.insert(str_of(n, "netns").to_owned());
        }
        pods_of.insert(
            str_of(c, "id").to_owned(),
            pods.iter()
                .map(|p| {
                    (
                        str_of(p, "name").to_owned(),
                        str_of(p, "netns").to_owned(),
                        str_of(p, "ip").to_owned(),
                    )
                })
                .collect::<Vec<_>>(),
        );
    }
    assert!(made.iter().all(|ns| before.iter().all(|b| b != ns)));
    let reach = topology["reach"].as_array().expect("reach");
    assert_eq!(reach.len(), 24, "{reach:?}");
    for r in reach {
        let (from, to) = (str_of(r, "from"), str_of(r, "to"));
        assert_ne!(from, to);
        assert!(
            pods_of[from]
                .iter()
                .any(|(_, ns, _)| ns == str_of(r, "from_pod")),
            "{r}"
        );
        let (_, _, real) = pods_of[to]
            .iter()
            .find(|(name, _, _)| name == str_of(r, "to_pod"))
            .unwrap_or_else(|| panic!("{r}"));
        // Every cluster has 10.0.0.0/16: a remote pod is never reached at its own address.
        assert_ne!(str_of(r, "address"), real, "{r}");
    }

    // `check` against the running lab: all pass; `failover` kills leaf-1's active gateway
    // and another replica takes over, after which every pair answers again; then one pod loses
    // its link and the check fails, naming it.
    let (ok, text) = check(&path);
    assert!(ok, "{text}");
    assert!(text.contains("all 24 pod pairs answered"), "{text}");
    for c in clusters {
        let gateways = c["gateways"].as_array().expect("gateways");
        assert_eq!(gateways.len(), 2, "{c}");
        assert_eq!(
            gateways
                .iter()
                .filter(|g| g["active_at_start"] == true)
                .count(),
            1,
            "{c}"
        );
    }
    let failover = Command::new(bin_path("trellis-lab").expect("built"))
        .args(["failover", "leaf-1", "--topology-file"])
        .arg(&path)
        .output()
        .expect("trellis-lab failover runs");
    let said = String::from_utf8_lossy(&failover.stdout).into_owned();
    assert!(
        failover.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&failover.stderr)
    );
    assert!(
        said.contains("leaf-1: killed the active gateway replica on n0"),
        "{said}"
    );
    assert!(
        said.contains("leaf-1: the replica on n1 took over after"),
        "{said}"
    );
    eprintln!("measured: {}", said.trim().replace('\n', "; "));
    let (ok, text) = check(&path);
    assert!(ok, "not every pair answered after the failover:\n{text}");
    let (_, cut_ns, _) = pods_of["leaf-2"][1].clone();
    let down = Command::new("ip")
        .args(["-n", &cut_ns, "link", "set", "eth0", "down"])
        .status()
        .expect("ip runs");
    assert!(down.success());
    let (ok, text) = check(&path);
    assert!(!ok, "the check passed with a pod cut off:\n{text}");
    // 4 pods of the other clusters cannot reach it, and it reaches none of their 4.
    assert!(text.contains("8 of 24 pod pairs did not answer"), "{text}");
    assert!(
        text.contains(&format!("FAIL leaf-2 pod in {cut_ns} ->")),
        "{text}"
    );
    assert!(text.contains("-> leaf-2 pod-1 at"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == ["leaf-1", "4/4", "-", "2/4", "FAIL"]),
        "{text}"
    );

    // Ctrl-C: the lab stops and every namespace it made is gone.
    let status = lab.interrupt();
    assert!(status.success(), "{status}");
    let after = netns_list();
    let run_prefix = str_of(&clusters[0], "gateway_netns")
        .split('-')
        .next()
        .expect("prefix")
        .to_owned();
    let left: Vec<&String> = after
        .iter()
        .filter(|ns| made.contains(*ns) || ns.starts_with(&format!("{run_prefix}-")))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Every process descending from `pid` (from `/proc`), itself excluded.
fn descendants(pid: u32) -> BTreeSet<u32> {
    let mut parent_of = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Some(parent) = std::fs::read_to_string(entry.path().join("stat"))
            .ok()
            .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.to_owned()))
            .and_then(|rest| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
        {
            parent_of.insert(child, parent);
        }
    }
    let mut found = BTreeSet::from([pid]);
    loop {
        let more: Vec<u32> = parent_of
            .iter()
            .filter(|(child, parent)| found.contains(parent) && !found.contains(child))
            .map(|(child, _)| *child)
            .collect();
        if more.is_empty() {
            break;
        }
        found.extend(more);
    }
    found.remove(&pid);
    found
}

/// Whether `pid` still runs (a zombie waiting for its reaper does not).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next())
        })
        .is_some_and(|state| state != 'Z' && state != 'X')
}

#[test]
fn a_lab_killed_with_sigkill_takes_its_processes_along_and_the_next_up_removes_its_namespaces() {
    let test = "a_lab_killed_with_sigkill_takes_its_processes_along_and_the_next_up_removes_its_namespaces";
    if !can_run(test) {
        return;
    }
    let args = [
        "--dataplane",
        "netns",
        "--clusters",
        "2",
        "--store",
        "etcd",
        "--timeout",
        "180",
    ];
    let before = netns_list();
    let (lab, _) = RunningLab::start(&args, Duration::from_secs(240));
    let made: BTreeSet<String> = netns_list().difference(&before).cloned().collect();
    let children = descendants(lab.child.id());
    // 2 clusters of 6 services, and an etcd per service.
    assert!(
        children.len() >= 24 && !made.is_empty(),
        "{children:?} {made:?}"
    );
    let run = made
        .iter()
        .find_map(|ns| ns.strip_prefix("tl")?.split('-').next())
        .expect("the run's namespaces are named tl<run>-...")
        .to_owned();
    let killed = Command::new("kill")
        .args(["-KILL", &lab.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let started = Instant::now();
    loop {
        let alive: Vec<u32> = children.iter().copied().filter(|p| running(*p)).collect();
        if alive.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{} of the lab's {} processes outlived its SIGKILL: {alive:?}",
            alive.len(),
            children.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "measured: all {} processes of the lab gone {} ms after its SIGKILL",
        children.len(),
        started.elapsed().as_millis()
    );
    drop(lab);
    // Nothing could remove the namespaces; the next lab does, and says so.
    assert!(made.is_subset(&netns_list()), "{made:?}");
    let (next, printed) = RunningLab::start(&args, Duration::from_secs(240));
    let left = netns_list();
    assert!(
        made.iter().all(|ns| !left.contains(ns)),
        "{:?} left after the next lab came up:\n{printed}",
        made.intersection(&left).collect::<Vec<_>>()
    );
    let said = printed
        .lines()
        .find(|l| l.contains(&format!("removed the leftovers of lab run {run} ")))
        .unwrap_or_else(|| panic!("the next lab did not say it removed them:\n{printed}"));
    assert!(
        said.contains(&format!("{} namespaces", made.len())),
        "{said} ({} made)",
        made.len()
    );
    assert!(next.interrupt().success());
    assert!(
        netns_list().is_subset(&before),
        "the second lab left namespaces behind"
    );
}

#[test]
fn without_root_the_namespace_lab_refuses_clearly_and_creates_nothing() {
    let test = "without_root_the_namespace_lab_refuses_clearly_and_creates_nothing";
    if !can_run(test) || require_tool("setpriv").is_none() {
        return;
    }
    // A copy nobody may execute (the target dir lives under root's home).
    let dir = tempfile::tempdir().expect("tempdir");
    let lab = dir.path().join("trellis-lab");
    std::fs::copy(bin_path("trellis-lab").expect("trellis-lab is built"), &lab).expect("copy");
    for (path, mode) in [(dir.path(), 0o755), (lab.as_path(), 0o755)] {
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
            .expect("chmod");
    }
    let before = netns_list();
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&lab)
        .args(["up", "--dataplane", "netns", "--until-converged"])
        .output()
        .expect("setpriv runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--dataplane netns needs root"),
        "unclear refusal: {stderr}"
    );
    assert_eq!(netns_list(), before);
}

/// `--nat`: the lab puts each leaf behind the router kind the flag names (in turn), every pod
/// still reaches every remote pod (`easy`-`hard` directly, `hard`-`hard` through the hub's
/// relay), and nothing is left behind, routers included.
#[test]
fn the_namespace_lab_behind_nat_routers_reaches_every_pod_and_leaves_nothing_behind() {
    let test = "the_namespace_lab_behind_nat_routers_reaches_every_pod_and_leaves_nothing_behind";
    if !can_run(test) {
        return;
    }
    let before = netns_list();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("topology.json");
    let started = Instant::now();
    let (lab, printed) = RunningLab::start(
        &[
            "--dataplane".as_ref(),
            "netns".as_ref(),
            "--clusters".as_ref(),
            "5".as_ref(),
            "--nat".as_ref(),
            "easy,hard".as_ref(),
            "--same-pod-cidr".as_ref(),
            "--timeout".as_ref(),
            "120".as_ref(),
            "--topology-file".as_ref(),
            path.as_os_str(),
        ],
        Duration::from_secs(180),
    );
    eprintln!(
        "measured: a hub and 4 leaves behind easy/hard/easy/hard routers, every pod pair answering, in {} ms",
        started.elapsed().as_millis()
    );
    // 5 clusters x 1 pod: each pod reaches the 4 others.
    assert!(printed.contains("all 20 pod pairs answered"), "{printed}");
    let during = netns_list();
    let routers: Vec<&String> = during
        .difference(&before)
        .filter(|ns| ns.ends_with("-nat"))
        .collect();
    assert_eq!(routers.len(), 4, "one router per leaf: {routers:?}");
    let topology: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("topology file"))
            .expect("json");
    let kinds: Vec<&str> = topology["clusters"]
        .as_array()
        .expect("clusters")
        .iter()
        .map(|c| c["nat"]["kind"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(
        kinds,
        ["none", "easy", "hard", "easy", "hard"],
        "{topology}"
    );
    assert!(lab.interrupt().success(), "the lab stops cleanly on Ctrl-C");
    let after = netns_list();
    assert!(
        after.difference(&before).next().is_none(),
        "left behind: {:?}",
        after.difference(&before).collect::<Vec<_>>()
    );
}
