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

/// Sets an IPv4 sysctl of this network namespace (`/proc/sys/net/ipv4/<path>`) unless it
/// already has `value`: a gateway whose node has them preset (docs: "Node sysctls") needs no
/// write, so it runs without `privileged` while `/proc/sys` is read-only in its container.
pub async fn sysctl(path: &str, value: &str) -> anyhow::Result<()> {
    ensure_sysctl(
        std::path::Path::new("/proc/sys/net"),
        path,
        value,
        "read-only in an unprivileged container: set it on the node beforehand (the gateway's \
         init container does)",
    )
    .await
}

/// Sets `ipv4/<path>` under `root` (a `/proc/sys/net`) to `value` unless it already is; a
/// failed write names the file and adds `hint` (how to provide it instead).
pub async fn ensure_sysctl(
    root: &std::path::Path,
    path: &str,
    value: &str,
    hint: &str,
) -> anyhow::Result<()> {
    let file = root.join("ipv4").join(path);
    let current = tokio::fs::read_to_string(&file).await;
    if current.as_deref().map(str::trim).ok() == Some(value) {
        return Ok(());
    }
    tokio::fs::write(&file, value)
        .await
        .map_err(|e| anyhow::anyhow!("writing {value} to {}: {e} ({hint})", file.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysctl tree under a temporary directory, with `ipv4/ip_forward` and
    /// `ipv4/conf/all/rp_filter`.
    fn tree(name: &str, forward: &str, rp_filter: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("trellis-sysctl-{name}-{}", std::process::id()));
        let conf = dir.join("ipv4/conf/all");
        std::fs::create_dir_all(&conf).expect("dirs");
        std::fs::write(dir.join("ipv4/ip_forward"), forward).expect("write");
        std::fs::write(conf.join("rp_filter"), rp_filter).expect("write");
        dir
    }

    #[tokio::test]
    async fn preset_sysctls_are_not_written() {
        let dir = tree("preset", "1\n", "0\n");
        // Directories and files without write permission for anyone: only a write would fail
        // for a non-root user, and as root a write would drop the newline.
        for path in ["ipv4/ip_forward", "ipv4/conf/all/rp_filter"] {
            let file = dir.join(path);
            let mut perms = std::fs::metadata(&file).expect("meta").permissions();
            perms.set_readonly(true);
            std::fs::set_permissions(&file, perms).expect("chmod");
        }
        ensure_sysctl(&dir, "ip_forward", "1", "hint")
            .await
            .expect("already 1: nothing to write");
        ensure_sysctl(&dir, "conf/all/rp_filter", "0", "hint")
            .await
            .expect("already 0: nothing to write");
        assert_eq!(
            std::fs::read_to_string(dir.join("ipv4/ip_forward")).expect("read"),
            "1\n",
            "untouched"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_differing_sysctl_is_written_and_a_failed_write_says_what_to_set() {
        let dir = tree("differs", "0\n", "1\n");
        ensure_sysctl(&dir, "ip_forward", "1", "hint")
            .await
            .expect("written");
        assert_eq!(
            std::fs::read_to_string(dir.join("ipv4/ip_forward"))
                .expect("read")
                .trim(),
            "1"
        );
        let err = ensure_sysctl(&dir, "conf/gone/rp_filter", "0", "set it on the node")
            .await
            .expect_err("no such sysctl");
        let text = format!("{err:#}");
        assert!(
            text.contains("conf/gone/rp_filter") && text.contains("set it on the node"),
            "{text}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
