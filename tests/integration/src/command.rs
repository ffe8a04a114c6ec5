//! Running the command-line tools a test drives (grpcurl, etcdctl, a documented shell line)
//! and failing the test, with the tool's stderr, when one does not succeed.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `command` to its end; panics naming `what`, with its stderr, unless it exits 0.
pub fn succeeds(command: &mut Command, what: &str) -> Output {
    let out = command
        .output()
        .unwrap_or_else(|err| panic!("{what} does not run: {err}"));
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// What `grpcurl args...` prints; panics unless it succeeds.
pub fn grpcurl(tool: &Path, args: &[&str]) -> String {
    let out = succeeds(Command::new(tool).args(args), &format!("grpcurl {args:?}"));
    String::from_utf8(out.stdout).expect("utf-8 output")
}
