//! Running `ip` and `nft` (bounded in time, stderr kept for the error) and writing sysctls of
//! the current network namespace. Shelling out to iproute2 and nftables keeps the rules in the
//! syntax operators read and debug with, and those tools are on every gateway host anyway.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

/// A command that takes longer is stuck (netlink answers in milliseconds).
const TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `program args...` with `stdin` fed in, returning stdout; an error names the command and
/// carries its stderr.
pub async fn run(program: &str, args: &[&str], stdin: Option<&str>) -> anyhow::Result<String> {
    let shown = format!("{program} {}", args.join(" "));
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot run {shown}: {e}"))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).await?;
        drop(pipe);
    }
    let output = tokio::time::timeout(TIMEOUT, child.wait_with_output())
        .await
        .map_err(|_| anyhow::anyhow!("{shown} did not finish within {TIMEOUT:?}"))??;
    if !output.status.success() {
        anyhow::bail!(
            "{shown} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `ip args...`.
pub async fn ip(args: &[&str]) -> anyhow::Result<String> {
    run("ip", args, None).await
}

/// Writes an IPv4 sysctl of this network namespace (`/proc/sys/net/ipv4/<path>`).
pub async fn sysctl(path: &str, value: &str) -> anyhow::Result<()> {
    let file = format!("/proc/sys/net/ipv4/{path}");
    tokio::fs::write(&file, value)
        .await
        .map_err(|e| anyhow::anyhow!("writing {file}: {e}"))
}
