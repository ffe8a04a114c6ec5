//! `trellis-lab up` as a child process that keeps running: started, followed until it says it
//! runs, interrupted like Ctrl-C, and killed if a test fails before stopping it; and what the
//! tests of a running netns lab do with its topology file: read its fields, run `trellisctl`
//! where an operator would, keep helper processes only as long as the test.

use std::ffi::OsStr;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A running `trellis-lab up`; killed on drop.
#[derive(Debug)]
pub struct RunningLab {
    pub child: Child,
}

impl RunningLab {
    /// Starts `trellis-lab up <args>` and waits up to `limit` for its "press Ctrl-C" line;
    /// returns the lab and everything it printed until then. Panics with that output when the
    /// lab exits or stays silent.
    pub fn start<S: AsRef<OsStr>>(args: &[S], limit: Duration) -> (Self, String) {
        Self::start_with_env(args, &[], limit)
    }

    /// [`Self::start`] with extra environment variables (e.g. `OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub fn start_with_env<S: AsRef<OsStr>>(
        args: &[S],
        env: &[(&str, &str)],
        limit: Duration,
    ) -> (Self, String) {
        let child = Command::new(crate::bin_path("trellis-lab").expect("trellis-lab is built"))
            .arg("up")
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("trellis-lab starts");
        let mut lab = Self { child };
        let stdout = lab.child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut printed = String::new();
        let deadline = Instant::now() + limit;
        loop {
            let line = rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("the lab did not come up:\n{printed}"));
            printed.push_str(&line);
            printed.push('\n');
            if line.contains("press Ctrl-C") {
                return (lab, printed);
            }
        }
    }

    /// SIGINT, as Ctrl-C sends, then waits for the exit.
    pub fn interrupt(mut self) -> ExitStatus {
        let sent = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill -INT failed");
        self.child.wait().expect("the lab exits")
    }
}

impl Drop for RunningLab {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The string `key` of a topology file object; panics naming what is missing.
pub fn str_of<'a>(v: &'a serde_json::Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// A child process (a server in a pod namespace) killed on drop.
#[derive(Debug)]
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `trellisctl <args>` against `cluster`'s services (a topology file cluster), from its
/// gateway namespace, where an operator on the gateway node reaches them.
pub fn trellisctl(cluster: &serde_json::Value, args: &[&str]) -> std::process::Output {
    let ctl = crate::bin_path("trellisctl").expect("trellisctl is built");
    Command::new("ip")
        .args(["netns", "exec", str_of(cluster, "gateway_netns")])
        .arg(ctl)
        .args(["--endpoints", str_of(&cluster["services"], "endpoints")])
        .args(args)
        .output()
        .expect("trellisctl runs")
}
