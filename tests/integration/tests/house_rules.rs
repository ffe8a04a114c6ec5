//! The layout rules of the workspace (docs/adr/0001-service-and-crate-layout.md), checked on
//! the tree itself so that drift fails a test instead of waiting for a review:
//!
//! - the folders show the floors: foundation crates directly in `crates/`, test support in
//!   `crates/testing/`, the services in `services/`, tools in `crates/tools/`; nothing on a
//!   lower floor depends on a higher one (a foundation or test-support crate never on a
//!   service or a tool, a service never on another service except to start it in its tests);
//! - no production source file, the benchmarks' included, is over [`MAX_LINES`] lines;
//! - a service core names no other service's gRPC surface (its generated clients, requests
//!   and responses): only the modules at a service's edge ([`EDGE_MODULES`]) do, so retries
//!   and metrics attach at one seam. The shared resource model (`trellis.types.v1`: cluster
//!   identities, ForeignClusters, NetworkConfigs, TunnelEndpoints, conditions) is what the
//!   services store and exchange unchanged, and cores may hold it (ADR 0001);
//! - docs/mcs-conformance.md names one test per MCS conformance spec, and every test of the
//!   conformance modules is one of them.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Longest production source file, in lines.
const MAX_LINES: usize = 800;

/// The modules of a service that may name generated gRPC types: its server side, its
/// conversions and its ports to other services.
const EDGE_MODULES: &[&str] = &["lib.rs", "main.rs", "grpc", "convert", "remote"];

/// The generated packages that are a service's RPC surface (everything but `types`).
const RPC_PACKAGES: &[&str] = &[
    "discovery",
    "endpoints",
    "gateway",
    "ipam",
    "peering",
    "route",
    "trellis",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root")
}

/// A workspace floor, from the folder a package's manifest sits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Floor {
    Foundation,
    TestSupport,
    Service,
    Tool,
    /// The multi-process tests and the benchmarks: above everything.
    Top,
}

fn floor_of(relative: &Path) -> Option<Floor> {
    let parts: Vec<&str> = relative
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .collect();
    Some(match parts.as_slice() {
        ["crates", "testing", _] => Floor::TestSupport,
        ["crates", "tools", _] => Floor::Tool,
        ["crates", _] => Floor::Foundation,
        ["services", _] => Floor::Service,
        ["tests", ..] | ["bench", ..] => Floor::Top,
        _ => return None,
    })
}

/// A dependency on another workspace package, and whether only tests use it.
#[derive(Debug)]
struct Dep {
    name: String,
    dev: bool,
}

/// Every workspace package: name → (manifest directory relative to the root, the workspace
/// packages it depends on).
fn packages(root: &Path) -> BTreeMap<String, (PathBuf, Vec<Dep>)> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--offline",
            "--format-version",
            "1",
        ])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let mut all = BTreeMap::new();
    for package in meta["packages"].as_array().expect("packages") {
        let name = package["name"].as_str().expect("name").to_owned();
        let manifest = PathBuf::from(package["manifest_path"].as_str().expect("manifest"));
        let dir = manifest
            .parent()
            .expect("a manifest's folder")
            .strip_prefix(root)
            .expect("inside the workspace")
            .to_path_buf();
        let deps = package["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .filter(|d| d["path"].is_string())
            .map(|d| Dep {
                name: d["name"].as_str().expect("dependency name").to_owned(),
                dev: d["kind"].as_str() == Some("dev"),
            })
            .collect();
        all.insert(name, (dir, deps));
    }
    all
}

#[test]
fn no_crate_depends_on_a_higher_floor_and_every_crate_sits_on_one() {
    let root = root();
    let packages = packages(&root);
    assert!(packages.len() > 10, "found the workspace: {packages:?}");
    let mut wrong = Vec::new();
    for (name, (dir, deps)) in &packages {
        let Some(floor) = floor_of(dir) else {
            wrong.push(format!("{name} ({}) sits on no floor", dir.display()));
            continue;
        };
        for Dep { name: dep, dev } in deps {
            let Some((dep_dir, _)) = packages.get(dep) else {
                continue;
            };
            let Some(dep_floor) = floor_of(dep_dir) else {
                continue;
            };
            // Foundation and test support sit below the services; a service uses no other
            // service or tool, except that its tests may start the services it calls.
            let allowed = match floor {
                Floor::Foundation => {
                    dep_floor == Floor::Foundation || (*dev && dep_floor == Floor::TestSupport)
                }
                Floor::TestSupport => dep_floor <= Floor::TestSupport,
                Floor::Service => {
                    dep_floor <= Floor::TestSupport || (*dev && dep_floor == Floor::Service)
                }
                Floor::Tool | Floor::Top => true,
            };
            if !allowed {
                wrong.push(format!(
                    "{name} ({floor:?}, {}) depends on {dep} ({dep_floor:?})",
                    dir.display()
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "layering:\n{}", wrong.join("\n"));
}

/// Every `*.rs` file below `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The production sources of the foundation crates, services and tools, and the benchmarks'
/// (their results and the report read from them are published, so they are kept to the same
/// measure): their `src/`, without test modules kept in files of their own.
fn production_sources(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for (_, (dir, _)) in packages(root) {
        let benchmarks = dir.starts_with("bench");
        if !benchmarks
            && !matches!(
                floor_of(&dir),
                Some(Floor::Foundation | Floor::Service | Floor::Tool)
            )
        {
            continue;
        }
        rust_files(&root.join(&dir).join("src"), &mut files);
    }
    files.retain(|f| {
        f.file_name().is_some_and(|n| n != "tests.rs")
            && !f.components().any(|c| c.as_os_str() == "tests")
    });
    files.sort();
    files
}

#[test]
fn no_production_source_file_is_over_the_limit() {
    let root = root();
    let files = production_sources(&root);
    assert!(
        files
            .iter()
            .any(|f| f.ends_with("services/broker/src/lib.rs")),
        "found the services' sources"
    );
    assert!(
        files.iter().any(|f| f.ends_with("bench/src/lib.rs")),
        "found the benchmarks' sources"
    );
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = fs::read_to_string(f).expect("readable").lines().count();
            (lines > MAX_LINES)
                .then(|| format!("{}: {lines}", f.strip_prefix(&root).unwrap_or(f).display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines: cut these along their seams:\n{}",
        long.join("\n")
    );
}

#[test]
fn service_cores_name_no_generated_grpc_type() {
    let root = root();
    let mut files = Vec::new();
    rust_files(&root.join("services"), &mut files);
    let mut offending = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&root).expect("inside").to_path_buf();
        let text = relative.to_string_lossy().into_owned();
        let Some(in_src) = text.split_once("/src/").map(|(_, rest)| rest.to_owned()) else {
            continue; // tests and benches may use anything
        };
        let first = in_src.split('/').next().unwrap_or_default();
        let module = first.strip_suffix(".rs").unwrap_or(first);
        if EDGE_MODULES.contains(&first) || EDGE_MODULES.contains(&module) {
            continue;
        }
        let source = fs::read_to_string(file).expect("readable");
        if names_rpc_package(&source) {
            offending.push(text);
        }
    }
    assert!(
        offending.is_empty(),
        "service cores naming another service's generated gRPC types (call other services \
         through a port in remote, convert in grpc or convert):\n{}",
        offending.join("\n")
    );
}

/// Whether production code in `source` names a generated RPC package: `pb::ipam::…`,
/// `pb::{ipam, …}`, or an alias such as `use trellis_api::pb::endpoints as pb`. Comments are
/// left out, and so is test code: the inline `#[cfg(test)] mod … {` tail, and the one item
/// after any other `#[cfg(test)]` (a `mod tests;` among the declarations hides nothing below
/// it).
fn names_rpc_package(source: &str) -> bool {
    let mut production = Vec::new();
    let mut lines = source.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]" {
            let next = lines.next().unwrap_or_default().trim();
            if next.starts_with("mod ") && next.ends_with('{') {
                break;
            }
            continue;
        }
        production.push(line);
    }
    production
        .into_iter()
        .filter(|l| !l.trim_start().starts_with("//"))
        .any(|line| {
            line.match_indices("pb::").any(|(at, _)| {
                let rest = &line[at + "pb::".len()..];
                let names: Vec<&str> = match rest.strip_prefix('{') {
                    Some(group) => group
                        .split(['}', ','])
                        .map(|n| n.trim().split("::").next().unwrap_or_default())
                        .collect(),
                    None => vec![
                        rest.split(|c: char| !c.is_alphanumeric() && c != '_')
                            .next()
                            .unwrap_or_default(),
                    ],
                };
                names.iter().any(|n| RPC_PACKAGES.contains(n))
            })
        })
}

#[test]
fn the_rpc_package_check_sees_every_spelling() {
    assert!(names_rpc_package(
        "use trellis_api::pb::ipam::SetLocalNatRequest;"
    ));
    assert!(names_rpc_package("use trellis_api::pb::endpoints as pb;"));
    assert!(names_rpc_package(
        "use trellis_api::pb::{types, ipam::Foo};"
    ));
    assert!(names_rpc_package(
        "    x: trellis_api::pb::peering::broker_client::BrokerClient<C>,"
    ));
    assert!(!names_rpc_package(
        "use trellis_api::pb::types as pb;\nlet k = pb::PeeringKind::Full;"
    ));
    assert!(!names_rpc_package("// pb::ipam::Request in a comment"));
    assert!(!names_rpc_package(
        "fn f() {}\n#[cfg(test)]\nmod tests { use trellis_api::pb::ipam; }"
    ));
    // A test module declared among the others hides only itself.
    assert!(names_rpc_package(
        "#[cfg(test)]\nmod tests;\nuse trellis_api::pb::ipam::Foo;"
    ));
    assert!(!names_rpc_package(
        "#[cfg(test)]\nuse trellis_api::pb::ipam::Foo;\nfn f() {}"
    ));
}

/// The test functions of `file` (under tests/integration/tests): the names after `fn` on the
/// line after a `#[test]` or `#[tokio::test...]` attribute.
fn test_functions(file: &str) -> Vec<String> {
    let text = fs::read_to_string(root().join("tests/integration/tests").join(file))
        .unwrap_or_else(|e| panic!("{file}: {e}"));
    let lines: Vec<&str> = text.lines().collect();
    lines
        .windows(2)
        .filter(|w| w[0].starts_with("#[test]") || w[0].starts_with("#[tokio::test"))
        .filter_map(|w| {
            let rest = w[1].trim_start_matches("async ").strip_prefix("fn ")?;
            Some(rest.split('(').next()?.to_owned())
        })
        .collect()
}

/// docs/mcs-conformance.md lists each of the suite's 27 specs once, and names every test of
/// the conformance modules as the spec's test: a spec test added, renamed or removed fails
/// here until the table says so.
#[test]
fn the_mcs_conformance_table_names_every_spec_and_its_test() {
    let table = fs::read_to_string(root().join("docs/mcs-conformance.md")).expect("the table");
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("| S")).collect();
    let specs: Vec<String> = rows
        .iter()
        .filter_map(|r| r.split('|').nth(1).map(|c| c.trim().to_owned()))
        .collect();
    let want: Vec<String> = (1..=27).map(|n| format!("S{n}")).collect();
    assert_eq!(specs, want, "one row per spec, in order");
    let mut tests = Vec::new();
    for module in ["mcs_conformance", "mcs_connectivity"] {
        for name in test_functions(&format!("{module}.rs")) {
            tests.push(format!("`{module}::{name}`"));
        }
    }
    assert_eq!(tests.len(), 27, "one test per spec: {tests:#?}");
    for test in &tests {
        assert_eq!(
            rows.iter().filter(|r| r.contains(test.as_str())).count(),
            1,
            "{test} is not the test of exactly one spec in docs/mcs-conformance.md"
        );
    }
}
