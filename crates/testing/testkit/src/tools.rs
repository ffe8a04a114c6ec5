//! Finding the external tools tests drive, and skipping (or, in CI, failing) without them.

use std::env;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The workspace root (`crates/testing/testkit` is three levels below it), where `.tools/`
/// and `scripts/` live.
pub fn workspace_root() -> &'static Path {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.ancestors().nth(3).unwrap_or(manifest_dir)
}

/// The executable `name` from `PATH`, else from `<workspace root>/.tools/bin/`.
pub fn tool_path(name: &str) -> Option<PathBuf> {
    let path_dirs = env::var_os("PATH")
        .map(|path| env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();
    path_dirs
        .into_iter()
        .chain([workspace_root().join(".tools").join("bin")])
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

/// Whether the tests run in CI (`CI` set, non-empty, and not "false" or "0").
pub fn in_ci() -> bool {
    env::var("CI").is_ok_and(|ci| !ci.is_empty() && !ci.eq_ignore_ascii_case("false") && ci != "0")
}

/// The tool `name`, or `None` after announcing that the current test is skipped.
///
/// Call at the top of a test and `return` on `None`. Skipping says so on the process's stderr,
/// past the harness's output capture, with a line starting with `SKIPPED:` that names the test
/// (its thread) and the tool. (nextest still stores a passing test's stderr; see it with
/// `--success-output immediate`.)
///
/// # Panics
///
/// In CI (see [`in_ci`]), when the tool is missing: CI must run every test, so a missing tool
/// is a broken setup rather than a reason to skip.
pub fn require_tool(name: &str) -> Option<PathBuf> {
    if let Some(path) = tool_path(name) {
        return Some(path);
    }
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("<unnamed test>");
    assert!(
        !in_ci(),
        "required tool `{name}` is missing (test {test}); scripts/setup.sh installs it"
    );
    // Straight to the process's stderr: `eprintln!` would be captured (and hidden) by the
    // test harness for a test that passes.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: {test}: required tool `{name}` not found on PATH or in .tools/bin \
         (scripts/setup.sh installs it)"
    );
    None
}

#[cfg(unix)]
fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(path: &Path) -> bool {
    path.is_file()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(workspace_root().join("Cargo.toml"))
            .expect("workspace Cargo.toml");
        assert!(manifest.contains("[workspace]"));
    }

    #[test]
    fn finds_tools_on_path() {
        // `sh` is on every PATH the tests run with.
        let sh = tool_path("sh").expect("sh on PATH");
        assert!(sh.is_absolute() || sh.exists());
    }

    #[test]
    fn missing_tools_are_none() {
        assert_eq!(tool_path("trellis-no-such-tool"), None);
    }

    #[test]
    fn finds_tools_in_the_workspace_tools_dir() {
        let dir = workspace_root().join(".tools").join("bin");
        let Some(tool) = std::fs::read_dir(&dir)
            .ok()
            .and_then(|entries| entries.flatten().find(|entry| is_executable(&entry.path())))
        else {
            eprintln!("SKIPPED: no tools in {} to look up", dir.display());
            return;
        };
        let name = tool.file_name();
        let name = name.to_str().expect("utf-8 tool name");
        assert!(tool_path(name).is_some(), "{name} found");
    }
}
