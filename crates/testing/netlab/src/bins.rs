//! Where the Trellis service binaries are: `$TRELLIS_BIN_DIR` when set, else next to the running
//! executable (a benchmark or `trellis-lab` in `target/<profile>/`), else one level up (a test
//! in `target/<profile>/deps/`).

use std::path::PathBuf;

use anyhow::{Context as _, bail};

/// The path of binary `name` (e.g. `trellis-gateway`).
pub fn bin_path(name: &str) -> anyhow::Result<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os("TRELLIS_BIN_DIR") {
        dirs.push(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().context("locating the running executable")?;
    if let Some(dir) = exe.parent() {
        dirs.push(dir.to_owned());
        if let Some(up) = dir.parent() {
            dirs.push(up.to_owned());
        }
    }
    for dir in &dirs {
        let path = dir.join(name);
        if path.is_file() {
            return Ok(path);
        }
    }
    bail!(
        "{name} not found in {}; build the binaries first (`cargo build --workspace --bins`, \
         with `--release` for benchmarks) or set TRELLIS_BIN_DIR",
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}
