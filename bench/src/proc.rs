//! What the benchmarks read about processes from /proc: CPU time (utime + stime) and peak
//! resident memory (VmHWM) of a service process, found by the address it listens on, and
//! raising the open-file limit (a mesh of hundreds of in-process clusters holds thousands of
//! sockets).

use std::net::SocketAddr;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

/// CPU time and memory of one process, read at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ProcUsage {
    /// User plus system CPU time since the process started, in seconds.
    pub cpu_seconds: f64,
    /// Peak resident set size (VmHWM), in KiB.
    pub peak_rss_kib: u64,
    /// Resident set size now (VmRSS), in KiB.
    pub rss_kib: u64,
}

/// Clock ticks per second of `/proc/<pid>/stat` times (USER_HZ, 100 on every Linux ABI
/// we run on; asked from getconf so that an exotic kernel is still read right).
fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|t| *t > 0.0)
        .unwrap_or(100.0)
}

/// utime + stime of `/proc/<pid>/stat` content, in ticks. The command name (field 2) may hold
/// spaces and parentheses, so fields are counted after its closing parenthesis.
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After the name: state is field 3, utime field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// A `Vm…:` line of `/proc/<pid>/status`, in KiB.
pub fn parse_status_kib(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
}

/// Reads the CPU time and memory of `pid`.
pub fn usage(pid: u32) -> anyhow::Result<ProcUsage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let ticks = parse_stat_ticks(&stat).context("unexpected /proc/<pid>/stat format")?;
    Ok(ProcUsage {
        cpu_seconds: ticks as f64 / clock_ticks(),
        peak_rss_kib: parse_status_kib(&status, "VmHWM").context("no VmHWM in status")?,
        rss_kib: parse_status_kib(&status, "VmRSS").context("no VmRSS in status")?,
    })
}

/// Resets this process's peak RSS (VmHWM) to its current RSS, so that the next reading is the
/// peak of what ran since (Linux 4.0 and later: `5` to `/proc/self/clear_refs`).
pub fn reset_peak_rss() -> anyhow::Result<()> {
    reset_peak_rss_of("self")
}

/// [`reset_peak_rss`] for process `pid` (`self`, or a number: a process of the same user).
pub fn reset_peak_rss_of(pid: &str) -> anyhow::Result<()> {
    let path = format!("/proc/{pid}/clear_refs");
    std::fs::write(&path, "5").with_context(|| format!("writing {path}"))
}

/// The process whose command line holds `--listen <addr>`: the service processes are started
/// by `trellis_integration`, which does not hand out their ids, and every one listens on its
/// own port.
pub fn pid_listening_on(addr: SocketAddr) -> anyhow::Result<u32> {
    let want = addr.to_string();
    for entry in std::fs::read_dir("/proc").context("listing /proc")? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args
            .windows(2)
            .any(|w| w[0] == b"--listen" && w[1] == want.as_bytes())
        {
            return Ok(pid);
        }
    }
    anyhow::bail!("no process listens on {addr} (by its --listen flag)")
}

/// Raises the soft open-file limit to the hard one; returns the new soft limit.
pub fn raise_nofile_limit() -> anyhow::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).context("getrlimit(NOFILE)")?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).context("setrlimit(NOFILE)")?;
    }
    Ok(hard.max(soft))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_stat_and_status() {
        let stat = "42 (trellis (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0 1 2 3";
        assert_eq!(parse_stat_ticks(stat), Some(300));
        let status = "Name:\ttrellis-ipam\nVmHWM:\t   12345 kB\nVmRSS:\t  1000 kB\n";
        assert_eq!(parse_status_kib(status, "VmHWM"), Some(12345));
        assert_eq!(parse_status_kib(status, "VmRSS"), Some(1000));
        assert_eq!(parse_status_kib(status, "VmPeak"), None);
        assert_eq!(parse_stat_ticks("garbage"), None);
    }

    #[test]
    fn reads_this_process() {
        let me = usage(std::process::id()).expect("own /proc entry");
        assert!(me.peak_rss_kib >= me.rss_kib);
    }

    #[test]
    fn the_peak_is_reset_to_the_current_rss() {
        // Measured on a child: this test binary links mimalloc (through trellis-runtime), which
        // keeps freed memory a while, so its own RSS would not drop. Python's 64 MiB buffer is
        // a mapping of its own, returned to the system when deleted; the peak keeps it until
        // reset.
        use std::io::{BufRead as _, BufReader};
        use std::process::{Command, Stdio};
        let mut child = Command::new("python3")
            .args([
                "-c",
                "import sys, time\nb = bytearray(64 << 20)\nb[::4096] = b'\\x01' * (16 << 10)\ndel b\nprint('ready', flush=True)\ntime.sleep(30)",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the child says it is ready");
        assert_eq!(line.trim(), "ready");
        let pid = child.id();
        let before = usage(pid).expect("the child's /proc entry");
        let after = reset_peak_rss_of(&pid.to_string()).and_then(|()| usage(pid));
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            before.peak_rss_kib >= before.rss_kib + (32 << 10),
            "{before:?}"
        );
        let after = after.expect("reset and read again");
        assert!(
            after.peak_rss_kib + (32 << 10) <= before.peak_rss_kib,
            "{after:?}"
        );
    }
}
