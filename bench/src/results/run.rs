//! What every result file carries besides its measurements: the run that wrote it and the
//! machine it ran on.

use serde::{Deserialize, Serialize};

/// Which suite a result belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RunKind {
    /// `make bench`: the sizes and repetitions the document is meant to report.
    Full,
    /// `make bench-quick`: smaller sizes, fewer requests and repetitions (under 5 minutes).
    Quick,
}

impl RunKind {
    /// The name the result files use.
    pub fn as_str(self) -> &'static str {
        match self {
            RunKind::Full => "full",
            RunKind::Quick => "quick",
        }
    }
}

/// What identifies one run of one benchmark binary. The writers fill every field; the options
/// are for results written before runs were labelled, which the report says so of.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RunInfo {
    pub kind: Option<RunKind>,
    /// When the run started, UTC, RFC 3339.
    pub timestamp: Option<String>,
    /// `git rev-parse HEAD` of the tree that was measured, with `+dirty` when it had
    /// uncommitted changes; `unknown` outside a git checkout.
    pub git_commit: Option<String>,
    /// The 1-minute load average when the run started (other work on the machine).
    pub load_average_1m: Option<f64>,
    pub note: String,
    /// The command line (program name and flags).
    pub command: Vec<String>,
}

/// The machine a result was measured on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Machine {
    pub cpu_model: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub kernel: String,
    pub etcd_version: String,
}

/// The part every result shares, read from any of them without knowing which benchmark wrote
/// it (the runs-and-machine section lists them all).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Header {
    pub run: Option<RunInfo>,
    pub machine: Option<Machine>,
}
