//! The peering vocabulary has one home, `trellis_api::peers`: a condition name spelled as a
//! string literal anywhere else in the workspace (sources, tests, benches) is a second copy of
//! a wire string that can drift from the first, so this test lists every such site.
//!
//! The names come from [`Condition::ALL`], so a new condition is covered as soon as it is
//! declared.

use std::fs;
use std::path::{Path, PathBuf};

use trellis_api::peers::Condition;

/// The workspace root: this crate lives at `crates/api`.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root exists")
}

/// Every `*.rs` file under `dir`, skipping build output, hidden directories and `skip`.
fn rust_files(dir: &Path, skip: &Path, out: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_dir() {
            if name == "target" || name.starts_with('.') || path == skip {
                continue;
            }
            rust_files(&path, skip, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn condition_names_are_spelled_only_in_trellis_api() {
    let root = workspace_root();
    let home = root.join("crates/api");
    let mut files = Vec::new();
    rust_files(&root, &home, &mut files);
    files.sort();
    assert!(
        files
            .iter()
            .any(|f| f.ends_with("services/discovery/src/core.rs")),
        "the walk from {} found the services",
        root.display()
    );

    let literals: Vec<String> = Condition::ALL
        .iter()
        .map(|c| format!("\"{}\"", c.as_str()))
        .collect();
    let mut hits = Vec::new();
    for file in &files {
        let text =
            fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        for (n, line) in text.lines().enumerate() {
            for literal in literals.iter().filter(|l| line.contains(l.as_str())) {
                let shown = file.strip_prefix(&root).unwrap_or(file).display();
                hits.push(format!("{shown}:{}: {literal}", n + 1));
            }
        }
    }
    assert!(
        hits.is_empty(),
        "{} condition name(s) written as string literals outside trellis-api; use \
         trellis_api::peers::Condition (or its predicates) instead:\n{}",
        hits.len(),
        hits.join("\n")
    );
}
