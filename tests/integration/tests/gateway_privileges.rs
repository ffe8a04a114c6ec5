//! The gateway without `privileged` (issue 20, least privilege): in a network namespace whose
//! `/proc/sys` is mounted read-only — what an unprivileged container sees — the gateway's
//! userspace data plane starts when the node sysctls are preset (it only reads them, as after
//! the kustomize init container), and refuses to start, naming the sysctl and what to do, when
//! one differs: the control showing that the read-only mount really stops writes. Needs root
//! (skipped loudly elsewhere, and required in CI).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use trellis_integration::bin_path;
use trellis_netlab::netns::{Namespaces, exec};
use trellis_testkit::{in_ci, require_tool};

const LIMIT: Duration = Duration::from_secs(30);

fn can_run() -> bool {
    if !trellis_netlab::netns::is_root() {
        assert!(
            !in_ci(),
            "gateway_privileges needs root, and CI runs as root"
        );
        eprintln!("SKIPPED: gateway_privileges: needs root (network and mount namespaces)");
        return false;
    }
    ["ip", "unshare", "mount"]
        .iter()
        .all(|tool| require_tool(tool).is_some())
}

/// Starts the gateway in `ns`, in a mount namespace of its own where `/proc/sys` is read-only.
fn gateway_with_read_only_proc_sys(ns: &str, log: &Path) -> Child {
    let binary = bin_path("trellis-gateway").expect("trellis-gateway is built");
    let log_file = std::fs::File::create(log).expect("log file");
    Command::new("ip")
        .args(["netns", "exec", ns, "unshare", "--mount", "sh", "-c"])
        .arg(r#"mount -o bind,ro /proc/sys /proc/sys && exec "$0" "$@""#)
        .arg(binary)
        .args([
            "--listen",
            "127.0.0.1:7106",
            "--metrics-listen",
            "off",
            "--store",
            "memory://",
            "--cluster-id",
            "hub",
            "--dataplane",
            "userspace",
            "--endpoint-address",
            "127.0.0.1",
            "--interface-prefix",
            "tpriv",
        ])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().expect("log"))
        .stderr(log_file)
        .spawn()
        .expect("starts the gateway")
}

/// Waits until the gateway serves (`Ok`) or exits (`Err` with its log).
fn outcome(mut child: Child, log: &Path) -> Result<(), String> {
    let deadline = Instant::now() + LIMIT;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(status) = child.try_wait().expect("waits") {
            return Err(format!("exited with {status}:\n{text}"));
        }
        if text.contains("serving gRPC") {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("neither serving nor exited after {LIMIT:?}:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn sysctl(ns: &str, setting: &str) {
    let out = exec(ns, "sysctl", &["-w", setting]).expect("runs sysctl");
    assert!(out.status.success(), "sysctl -w {setting}: {out:?}");
}

#[test]
fn with_preset_sysctls_the_gateway_starts_on_a_read_only_proc_sys() {
    if !can_run() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut namespaces = Namespaces::default();
    let (preset, fresh) = (
        format!("tpriv-set-{}", std::process::id()),
        format!("tpriv-new-{}", std::process::id()),
    );
    namespaces.add(&preset).expect("namespace");
    namespaces.add(&fresh).expect("namespace");
    for setting in [
        "net.ipv4.ip_forward=1",
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
    ] {
        sysctl(&preset, setting);
    }
    // A new namespace does not forward: the gateway would have to write ip_forward.
    sysctl(&fresh, "net.ipv4.ip_forward=0");

    let log = dir.path().join("preset.log");
    outcome(gateway_with_read_only_proc_sys(&preset, &log), &log)
        .expect("the gateway starts without writing a sysctl");

    let log = dir.path().join("fresh.log");
    let err = outcome(gateway_with_read_only_proc_sys(&fresh, &log), &log)
        .expect_err("a sysctl to write on a read-only /proc/sys stops the start");
    assert!(
        err.contains("ip_forward") && err.contains("set it on the node"),
        "names the sysctl and the fix: {err}"
    );
}
