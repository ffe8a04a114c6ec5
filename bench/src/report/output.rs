//! The generated files: where they go, writing them, and comparing them with the committed ones.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

/// The generated files, relative to the repository root.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    pub files: Vec<(PathBuf, String)>,
}

pub const DOC: &str = "docs/benchmarks.md";
pub const PLOT_DIR: &str = "docs/bench";

impl Output {
    /// Writes every file under `root`.
    pub fn write(&self, root: &Path) -> anyhow::Result<()> {
        for (rel, content) in &self.files {
            let path = root.join(rel);
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            std::fs::write(&path, content)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    /// The files under `root` that differ from the generated ones (missing ones included).
    pub fn differences(&self, root: &Path) -> Vec<PathBuf> {
        self.files
            .iter()
            .filter(|(rel, content)| {
                std::fs::read_to_string(root.join(rel)).ok().as_deref() != Some(content.as_str())
            })
            .map(|(rel, _)| rel.clone())
            .collect()
    }
}
