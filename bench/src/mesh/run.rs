//! One run of one size, and how it is isolated: each run is a process of its own (the binary
//! again, with `--one-run`), which hands its [`Outcome`] back as JSON.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use clap::ValueEnum as _;
use serde::{Deserialize, Serialize};

use super::hub::Hub;
use super::leaves::Leaves;
use super::measure::measure;
use crate::proc::{reset_peak_rss, usage};
use crate::results::{HubProcess, HubStores, MeshRun, Mode};

/// What the hub holds after convergence.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Held {
    pub tunnels: usize,
    pub ncs: usize,
    pub relays: usize,
    pub ipam: usize,
    pub stores: Option<HubStores>,
    pub processes: Option<Vec<HubProcess>>,
    pub etcd_keys: Option<BTreeMap<String, usize>>,
}

/// The outcome of one run.
#[derive(Debug, Serialize, Deserialize)]
pub struct Outcome {
    pub run: MeshRun,
    pub held: Option<Held>,
}

/// One run: the setup time and, when it converged, the hub's holdings.
pub async fn run(mode: Mode, leaves: usize, timeout: Duration) -> anyhow::Result<Option<Outcome>> {
    // A failed reset only makes the peak include this process's start.
    if let Err(err) = reset_peak_rss() {
        eprintln!("mesh-bench: the peak RSS is not reset between runs: {err:#}");
    }
    let before = usage(std::process::id())?;
    let Some(hub) = Hub::start(mode).await? else {
        return Ok(None);
    };
    let Some(clusters) = Leaves::start(mode, leaves).await? else {
        return Ok(None);
    };
    let result = measure(&hub, &clusters, leaves, timeout).await;
    let after = usage(std::process::id())?;
    hub.stop().await;
    clusters.stop().await;
    let mut outcome = result?;
    outcome.run.process_peak_rss_kib = Some(after.peak_rss_kib);
    outcome.run.process_cpu_seconds = Some(after.cpu_seconds - before.cpu_seconds);
    Ok(Some(outcome))
}

/// What a binary does with `--one-run N --out FILE` ([`run_alone`] asks for it): one run,
/// its outcome written to `out`.
pub async fn one_run_to(
    mode: Mode,
    leaves: usize,
    timeout: Duration,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let outcome = Box::pin(run(mode, leaves, timeout)).await?;
    std::fs::write(out, serde_json::to_vec(&outcome)?)
        .with_context(|| format!("writing {}", out.display()))
}

/// One run in a process of its own: this binary with `--one-run`. In one process, a run's
/// peak RSS included what the allocator kept of the runs before it (the 254-leaf runs read
/// 2.6 GB where one run alone peaks at 1.4 GB), and a run's CPU what their tasks still did.
pub async fn run_alone(mode: Mode, leaves: usize, timeout: u64) -> anyhow::Result<Option<Outcome>> {
    let exe = std::env::current_exe().context("finding this binary")?;
    let out = std::env::temp_dir().join(format!(
        "mesh-bench-{}-{leaves}-{}.json",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let mode_flag = mode
        .to_possible_value()
        .context("every mode has a flag value")?;
    let status = tokio::process::Command::new(&exe)
        .arg("--mode")
        .arg(mode_flag.get_name())
        .arg("--timeout")
        .arg(timeout.to_string())
        .arg("--one-run")
        .arg(leaves.to_string())
        .arg("--out")
        .arg(&out)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .status()
        .await
        .with_context(|| format!("starting {}", exe.display()))?;
    let written = std::fs::read(&out);
    let _ = std::fs::remove_file(&out);
    anyhow::ensure!(status.success(), "the run's process ended with {status}");
    let written = written.with_context(|| format!("reading {}", out.display()))?;
    serde_json::from_slice(&written).context("reading the run's outcome")
}

/// `ProcessCluster` finds the service binaries next to a *test* binary
/// (`target/<profile>/deps/…`, one level below them). Cargo keeps this binary there too, as a
/// hard link of the same file: re-executing that link makes the lookup work without copying
/// the cluster launcher.
pub fn reexec_from_deps() -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    use std::os::unix::process::CommandExt as _;
    if trellis_integration::bin_path("trellis-ipam").is_ok() {
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let inode = std::fs::metadata(&exe)?.ino();
    let deps = exe
        .parent()
        .context("the executable has no directory")?
        .join("deps");
    let twin = std::fs::read_dir(&deps)
        .with_context(|| format!("listing {}", deps.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.ino() == inode && m.is_file()))
        .with_context(|| {
            format!(
                "--mode hub-etcd and etcd-processes need the service binaries next to {} (build them with \
                 `cargo build --release --bins`) and this binary's hard link in it",
                deps.display()
            )
        })?;
    let err = std::process::Command::new(twin)
        .args(std::env::args_os().skip(1))
        .exec();
    Err(err).context("re-executing from target/<profile>/deps")
}
