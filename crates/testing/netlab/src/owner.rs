//! Which lab run owns which namespaces, and the leftovers of runs that died.
//!
//! Every namespace of a run is named `tl<run>-...` (six hex digits, [`crate::run_id`]). Before
//! making any, a run creates `/run/trellis-netlab/<run>.lock` and holds an exclusive lock on
//! it for as long as it lives; the kernel drops the lock when the process dies, however it
//! dies. So namespaces whose run's lock can be taken (or has no file) belong to a run that is
//! gone: a lab or test killed with SIGKILL, which could not remove them. [`leftovers`] finds
//! them and [`Leftover::remove`] kills what still runs inside and deletes them.

use std::collections::BTreeMap;
use std::fs::{File, TryLockError};
use std::path::PathBuf;

use anyhow::Context as _;

use crate::netns::ip;

/// Where the runs' lock files live.
const DIR: &str = "/run/trellis-netlab";

/// A living run's claim on its name; released (and its file removed) on drop.
#[derive(Debug)]
pub struct Claim {
    path: PathBuf,
    _file: File,
}

/// Claims `run` for this process before any of its namespaces exists.
pub fn claim(run: &str) -> anyhow::Result<Claim> {
    std::fs::create_dir_all(DIR).with_context(|| format!("creating {DIR}"))?;
    let path = PathBuf::from(DIR).join(format!("{run}.lock"));
    let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    file.try_lock()
        .map_err(|e| anyhow::anyhow!("locking {}: {e}", path.display()))?;
    Ok(Claim { path, _file: file })
}

impl Drop for Claim {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The namespaces of one run that is no longer running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub run: String,
    pub namespaces: Vec<String>,
}

/// What [`Leftover::remove`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    pub namespaces: usize,
    pub processes: usize,
}

/// The run of namespace `name`, if it is named like ours.
fn run_of(name: &str) -> Option<&str> {
    let run = name.strip_prefix("tl")?.split('-').next()?;
    (run.len() == 6 && run.bytes().all(|b| b.is_ascii_hexdigit()) && name.len() > run.len() + 3)
        .then_some(run)
}

/// Whether a process holds `run`'s lock (a run that is still running).
fn alive(run: &str) -> bool {
    let path = PathBuf::from(DIR).join(format!("{run}.lock"));
    let Ok(file) = File::open(&path) else {
        return false;
    };
    match file.try_lock_shared() {
        Ok(()) => false,
        Err(TryLockError::WouldBlock) => true,
        // Cannot tell: leave it alone.
        Err(TryLockError::Error(_)) => true,
    }
}

/// The runs with namespaces and no living owner.
pub fn leftovers() -> anyhow::Result<Vec<Leftover>> {
    let listed = ip(&["netns", "list"])?;
    let mut runs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for name in listed.lines().filter_map(|l| l.split_whitespace().next()) {
        if let Some(run) = run_of(name) {
            runs.entry(run.to_owned())
                .or_default()
                .push(name.to_owned());
        }
    }
    Ok(runs
        .into_iter()
        .filter(|(run, _)| !alive(run))
        .map(|(run, namespaces)| Leftover { run, namespaces })
        .collect())
}

impl Leftover {
    /// Kills every process still running in the namespaces and deletes them (and the run's
    /// lock file, if any).
    pub fn remove(&self) -> anyhow::Result<Removed> {
        let mut removed = Removed::default();
        for ns in &self.namespaces {
            let pids = ip(&["netns", "pids", ns]).unwrap_or_default();
            for pid in pids
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                if nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                )
                .is_ok()
                {
                    removed.processes += 1;
                }
            }
            ip(&["netns", "del", ns]).with_context(|| format!("deleting namespace {ns}"))?;
            removed.namespaces += 1;
        }
        let _ = std::fs::remove_file(PathBuf::from(DIR).join(format!("{}.lock", self.run)));
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_of_our_runs_count() {
        assert_eq!(run_of("tl80ebb6-c-gw"), Some("80ebb6"));
        assert_eq!(run_of("tl80ebb6-inet"), Some("80ebb6"));
        for other in [
            "tl80ebb6",
            "tl80ebb-c-gw",
            "tlzzzzzz-a",
            "cni-1234",
            "tl80ebb6x-a",
        ] {
            assert_eq!(run_of(other), None, "{other}");
        }
    }
}
