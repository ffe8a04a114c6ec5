//! What the document is generated from: the result files (the newer of a full and a quick run
//! of each benchmark) and the hand-written notes, as read from the repository.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context as _;
use serde_json::Value;

/// The benchmarks, by result file name (`<name>.json`).
pub const BENCHMARKS: [&str; 14] = [
    "ipam",
    "mesh",
    "mesh-hub-processes",
    "mesh-hub-etcd",
    "mesh-etcd",
    "endpoints",
    "exports",
    "dataplane",
    "dataplane-nodes",
    "gateway-rules",
    "failover",
    "nat",
    "tls",
    "lab",
];

/// Earlier measurements kept for the notes' "what changed" sections (full results only).
pub const HISTORY: &str = "history";

/// Mesh benchmarks also run, in the same `make bench` run, against the reference build (the
/// `main` branch, with this run's benchmark harness; see `scripts/bench.sh`): (result, the
/// reference's result, label). The document shows them side by side as ratios.
pub const REFERENCES: [(&str, &str, &str); 3] = [
    ("mesh", "mesh-main", "in process (memory)"),
    (
        "mesh-hub-processes",
        "mesh-hub-processes-main",
        "hub processes (memory)",
    ),
    (
        "mesh-hub-etcd",
        "mesh-hub-etcd-main",
        "hub processes on etcd",
    ),
];

/// One result file as read.
#[derive(Debug, Clone)]
pub enum Loaded {
    Found { path: String, value: Value },
    Missing,
    Unreadable { path: String, error: String },
}

impl Loaded {
    pub(super) fn value(&self) -> Option<&Value> {
        match self {
            Loaded::Found { value, .. } => Some(value),
            _ => None,
        }
    }
}

/// Everything the document is generated from.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// By benchmark name.
    pub results: BTreeMap<String, Loaded>,
    /// By note name (file stem in `bench/notes/`).
    pub notes: BTreeMap<String, String>,
}

fn read_json(root: &Path, rel: &str) -> Loaded {
    let path = root.join(rel);
    match std::fs::read_to_string(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Loaded::Missing,
        Err(e) => Loaded::Unreadable {
            path: rel.into(),
            error: e.to_string(),
        },
        Ok(text) => match serde_json::from_str(&text) {
            Ok(value) => Loaded::Found {
                path: rel.into(),
                value,
            },
            Err(e) => Loaded::Unreadable {
                path: rel.into(),
                error: e.to_string(),
            },
        },
    }
}

fn timestamp(loaded: &Loaded) -> Option<&str> {
    loaded.value()?.pointer("/run/timestamp")?.as_str()
}

/// The newer of a full and a quick result (RFC 3339 UTC timestamps sort as text); a full
/// result wins ties and untimestamped pairs; a readable one wins over an unreadable one.
pub fn newest(full: Loaded, quick: Loaded) -> Loaded {
    match (&full, &quick) {
        (_, Loaded::Missing) => full,
        (Loaded::Missing | Loaded::Unreadable { .. }, Loaded::Found { .. }) => quick,
        (Loaded::Missing, _) => quick,
        (Loaded::Found { .. }, Loaded::Unreadable { .. }) => full,
        (Loaded::Unreadable { .. }, Loaded::Unreadable { .. }) => full,
        (Loaded::Found { .. }, Loaded::Found { .. }) => {
            if timestamp(&quick) > timestamp(&full) {
                quick
            } else {
                full
            }
        }
    }
}

impl Inputs {
    /// Reads the results and notes under the repository root `root`.
    pub fn read(root: &Path) -> anyhow::Result<Self> {
        let mut results = BTreeMap::new();
        for name in BENCHMARKS {
            let full = read_json(root, &format!("bench/results/{name}.json"));
            let quick = read_json(root, &format!("bench/results/quick/{name}.json"));
            results.insert(name.to_owned(), newest(full, quick));
        }
        results.insert(
            HISTORY.to_owned(),
            read_json(root, &format!("bench/results/{HISTORY}.json")),
        );
        for (_, name, _) in REFERENCES {
            let full = read_json(root, &format!("bench/results/{name}.json"));
            let quick = read_json(root, &format!("bench/results/quick/{name}.json"));
            results.insert(name.to_owned(), newest(full, quick));
        }
        let mut notes = BTreeMap::new();
        let dir = root.join("bench/notes");
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "md")
                && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
            {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                notes.insert(stem.to_owned(), text);
            }
        }
        Ok(Self { results, notes })
    }
}
