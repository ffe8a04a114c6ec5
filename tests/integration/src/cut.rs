//! [`Cut`]: a network cut between exactly two clusters of processes on one host, while each
//! still reaches every other cluster and the test reaches everything.
//!
//! A [`crate::gate::Gate`] cuts a whole cluster off (it sees no caller, only connections), so
//! it cannot tell the hub from another leaf. A cut here is two nftables rules in the `output`
//! hook: packets sent by a process of group ID A to a port of cluster B are dropped, and the
//! other way round. Every process of a cluster runs with its cluster's group ID
//! ([`crate::processes::Options::gid`]); the user stays root, so nothing else changes for it.
//! Only the connecting side's packets need dropping: a TCP connection whose client is silenced
//! goes nowhere. Dropped, not refused, as a real partition does: open connections hang until
//! the cut heals (TCP retransmits then resume them) or their owner gives up.
//!
//! Needs root and the `nft` tool. The rules live in a table of their own, deleted on drop.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context as _, bail};

/// One side of a cut: the group ID of a cluster's processes and the ports others reach it on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Side {
    pub gid: u32,
    pub ports: Vec<u16>,
}

/// Two clusters cut from each other until dropped.
#[derive(Debug)]
pub struct Cut {
    table: String,
    nft: std::path::PathBuf,
}

/// Distinguishes the tables of the cuts of one test process.
static NEXT: AtomicUsize = AtomicUsize::new(0);

impl Cut {
    /// Drops every packet from `a`'s processes to `b`'s ports and from `b`'s to `a`'s.
    pub fn between(a: &Side, b: &Side) -> anyhow::Result<Self> {
        let nft = trellis_testkit::tool_path("nft").context("the `nft` tool is not installed")?;
        let table = format!(
            "trellis_cut_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let ports = |side: &Side| {
            side.ports
                .iter()
                .map(u16::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let script = format!(
            "table inet {table} {{\n  chain output {{\n    type filter hook output priority 0; \
             policy accept;\n    meta skgid {} tcp dport {{ {} }} drop\n    meta skgid {} tcp \
             dport {{ {} }} drop\n  }}\n}}\n",
            a.gid,
            ports(b),
            b.gid,
            ports(a)
        );
        run(&nft, &["-f", "-"], Some(&script))?;
        Ok(Self { table, nft })
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        if let Err(err) = run(&self.nft, &["delete", "table", "inet", &self.table], None) {
            eprintln!(
                "could not heal the cut (table inet {}): {err:#}",
                self.table
            );
        }
    }
}

fn run(nft: &std::path::Path, args: &[&str], input: Option<&str>) -> anyhow::Result<()> {
    let mut child = Command::new(nft)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft")?;
    if let Some(input) = input {
        child
            .stdin
            .take()
            .context("nft's stdin")?
            .write_all(input.as_bytes())?;
    }
    drop(child.stdin.take());
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "nft {} failed ({}): {}\n{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr),
            input.unwrap_or_default()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::os::unix::process::CommandExt as _;

    use super::*;

    /// Whether a process of group `gid` opens a TCP connection to loopback `port` (a cut one
    /// hangs until `timeout` gives up on it).
    fn connects(gid: u32, port: u16) -> bool {
        Command::new("timeout")
            .args([
                "5",
                "bash",
                "-c",
                &format!("exec 3<>/dev/tcp/127.0.0.1/{port}"),
            ])
            .gid(gid)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    fn side(gid: u32) -> (TcpListener, Side) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
        let port = listener.local_addr().expect("an address").port();
        (
            listener,
            Side {
                gid,
                ports: vec![port],
            },
        )
    }

    #[test]
    fn a_cut_separates_two_clusters_and_only_them_until_dropped() {
        if !trellis_netlab::netns::is_root() {
            assert!(!trellis_testkit::in_ci(), "needs root, and CI runs as root");
            eprintln!("SKIPPED: a_cut_separates_two_clusters...: needs root (nftables)");
            return;
        }
        if trellis_testkit::require_tool("nft").is_none()
            || trellis_testkit::require_tool("bash").is_none()
        {
            return;
        }
        let (_a_listener, a) = side(47_001);
        let (_b_listener, b) = side(47_002);
        let (_c_listener, c) = side(47_003);
        assert!(connects(a.gid, b.ports[0]), "no cut yet");

        let cut = Cut::between(&a, &b).expect("cuts");
        assert!(!connects(a.gid, b.ports[0]), "a no longer reaches b");
        assert!(!connects(b.gid, a.ports[0]), "nor b a");
        assert!(connects(a.gid, c.ports[0]), "a still reaches c");
        assert!(connects(c.gid, b.ports[0]), "c still reaches b");
        assert!(connects(0, b.ports[0]), "the test still reaches b");

        drop(cut);
        assert!(connects(a.gid, b.ports[0]), "healed");
        assert!(connects(b.gid, a.ports[0]), "healed both ways");
    }
}
