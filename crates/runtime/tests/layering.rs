//! The top-level modules of a crate form layers: no module reaches, through `crate::` paths, a
//! module that reaches back to it. A cycle makes each module only understandable together with
//! the others in it, and it is how a small "one more import" grows into a knot; this test names
//! the cycle as soon as one appears.
//!
//! The graph is read from the sources, not from the compiler: the module tree is followed from
//! `lib.rs` through `mod name;` declarations, comments and literals are blanked out, and items
//! under `#[cfg(test)]` are left out (tests may use anything). A `crate::Name` re-exported at the
//! root counts as a use of the module it comes from. The same holds for the submodules of the
//! runtime's `tls` folder, through `super::` paths. The runtime's test also checks `trellisctl`,
//! whose crate has no test dependencies of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module name to the other top-level modules its (non-test) code names.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// `text` with comments removed and the contents of string and character literals blanked, so
/// that braces and `crate::` inside them are not read as code.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            // Block comments nest in Rust.
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r'
            && matches!(next, Some('"' | '#'))
            && !chars[..i]
                .last()
                .is_some_and(|p| p.is_alphanumeric() || *p == '_')
        {
            // A raw string: r"..." or r#"..."# (any number of #).
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                match chars.get(j) {
                    None => break,
                    Some('"') if (1..=hashes).all(|k| chars.get(j + k) == Some(&'#')) => {
                        j += 1 + hashes;
                        break;
                    }
                    _ => j += 1,
                }
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{7f}'), or else a lifetime or label ('a).
            let end = if next == Some('\\') {
                (i + 3..chars.len()).find(|&j| chars[j] == '\'')
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(end) => {
                    out.push_str("' '");
                    i = end + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `code` without the items that follow a `#[cfg(test)]`: up to the end of their braces, or to
/// the `;` of a declaration such as `mod tests;`.
fn without_tests(code: &str) -> String {
    const MARK: &str = "#[cfg(test)]";
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find(MARK) {
        out.push_str(&rest[..at]);
        let item = &rest[at + MARK.len()..];
        let mut depth = 0usize;
        let mut end = item.len();
        for (k, c) in item.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The identifier at the start of `text`.
fn ident(text: &str) -> &str {
    let end = text.find(|c: char| !is_ident(c)).unwrap_or(text.len());
    &text[..end]
}

/// The names declared by `mod name;` (files of their own) in `code`.
fn file_modules(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices("mod") {
        if code[..at].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let after = &code[at + 3..];
        let trimmed = after.trim_start();
        if trimmed.len() == after.len() {
            continue;
        }
        let name = ident(trimmed);
        if !name.is_empty() && trimmed[name.len()..].trim_start().starts_with(';') {
            found.push(name.to_owned());
        }
    }
    found
}

/// The first path segment after every `prefix` (`crate::`) in `code`; `crate::{a, b::c}` gives
/// `a` and `b`.
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        if code[..at].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let after = &code[at + prefix.len()..];
        match after.strip_prefix('{') {
            Some(group) => {
                let mut depth = 0usize;
                let mut start = true;
                for (k, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => start = true,
                        c if c.is_whitespace() => {}
                        _ if start && depth == 0 => {
                            start = false;
                            found.push(ident(&group[k..]).to_owned());
                        }
                        _ => {}
                    }
                }
            }
            None => found.push(ident(after).to_owned()),
        }
    }
    found.retain(|name| !name.is_empty());
    found
}

/// The file of module `name`, declared in the file `parent`.
fn module_file(parent: &Path, name: &str) -> PathBuf {
    let stem = parent.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let dir = parent.parent().unwrap_or(Path::new(""));
    let dir = if matches!(stem, "lib" | "main" | "mod") {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    let flat = dir.join(format!("{name}.rs"));
    if flat.exists() {
        return flat;
    }
    dir.join(name).join("mod.rs")
}

fn read_code(path: &Path) -> String {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    without_tests(&code_only(&text))
}

/// The non-test code of the file `path` and of every file module below it.
fn module_code(path: &Path) -> String {
    let code = read_code(path);
    let mut all = code.clone();
    for child in file_modules(&code) {
        all.push_str(&module_code(&module_file(path, &child)));
    }
    all
}

/// Which module declared in the file `root` uses which of the others, through paths that start
/// with `prefix`: `crate::` from a crate's `lib.rs`, `super::` from a folder module's `mod.rs`.
fn module_graph(root_file: &Path, prefix: &str) -> Graph {
    let root = read_code(root_file);
    let modules: BTreeSet<String> = file_modules(&root).into_iter().collect();
    // `pub use module::{A, B};` in the root: `crate::A` is a use of `module`.
    let mut reexported: BTreeMap<String, String> = BTreeMap::new();
    for statement in root.split(';') {
        let Some(path) = statement.trim().strip_prefix("pub use ") else {
            continue;
        };
        let from = ident(path.trim());
        if !modules.contains(from) {
            continue;
        }
        let names = path.rsplit_once("::").map_or("", |(_, names)| names);
        for name in names.split(|c: char| !is_ident(c)) {
            if !name.is_empty() && name != "self" {
                reexported.insert(name.to_owned(), from.to_owned());
            }
        }
    }
    let mut graph = Graph::new();
    for module in &modules {
        let uses = paths_after(&module_code(&module_file(root_file, module)), prefix)
            .into_iter()
            .filter_map(|name| {
                if modules.contains(&name) {
                    Some(name)
                } else {
                    reexported.get(&name).cloned()
                }
            })
            .filter(|used| used != module)
            .collect();
        graph.insert(module.clone(), uses);
    }
    graph
}

/// A cycle of `graph` as the modules along it, the first one repeated at the end.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit<'a>(
        graph: &'a Graph,
        module: &'a str,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| *m == module) {
            let mut cycle: Vec<String> = path[at..].iter().map(|m| (*m).to_owned()).collect();
            cycle.push(module.to_owned());
            return Some(cycle);
        }
        if !done.insert(module) {
            return None;
        }
        path.push(module);
        for used in graph.get(module).into_iter().flatten() {
            if let Some(cycle) = visit(graph, used, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|module| visit(graph, module, &mut Vec::new(), &mut done))
}

/// Fails naming the cycle when the modules declared in `root_file` form one (see
/// [`module_graph`]).
fn assert_layered(root_file: &Path, prefix: &str) -> Graph {
    let graph = module_graph(root_file, prefix);
    assert!(
        graph.len() > 1,
        "found no modules in {}",
        root_file.display()
    );
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "the modules of {} form a cycle: {}",
            root_file.display(),
            cycle.join(" -> ")
        );
    }
    graph
}

/// The `lib.rs` of the workspace crate in `crates/<name>`.
/// The `lib.rs` of the crate at `relative`, from `crates/`.
fn lib_of(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("crates/")
        .join(relative)
        .join("src/lib.rs")
}

#[test]
fn the_runtime_modules_form_no_cycle() {
    let graph = assert_layered(&lib_of("runtime"), "crate::");
    // The reader still sees the uses: an edge known to exist is found.
    assert!(
        graph["server"].contains("tls") && graph["server"].contains("shutdown"),
        "server's uses not found: {:?}",
        graph["server"]
    );
}

#[test]
fn the_trellisctl_modules_form_no_cycle() {
    let graph = assert_layered(&lib_of("tools/trellisctl"), "crate::");
    assert!(
        graph["cli"].contains("connect") && graph["error"].contains("service"),
        "cli's uses not found: {:?}",
        graph["cli"]
    );
}

/// `tls/mod.rs` lists its submodules bottom up, each using only those above it: no cycle.
#[test]
fn the_tls_submodules_form_no_cycle() {
    let tls = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/tls/mod.rs");
    let graph = assert_layered(&tls, "super::");
    assert!(
        graph["channel"].contains("peer_tls") && graph["pin"].contains("verification"),
        "channel's uses not found: {:?}",
        graph["channel"]
    );
}

#[test]
fn a_cycle_is_found_and_test_code_is_not_read() {
    let code = code_only(
        "use crate::{b::X, c};\n// crate::d\nlet s = \"crate::e\";\n\
         #[cfg(test)]\nmod tests { use crate::f; }\nmod g;\nfn h<'a>(x: &'a str) -> char { '{' }\n\
         use crate::i::J;",
    );
    let code = without_tests(&code);
    assert_eq!(paths_after(&code, "crate::"), ["b", "c", "i"]);
    assert_eq!(file_modules(&code), ["g"]);
    let graph: Graph = [("a", "b"), ("b", "c"), ("c", "a")]
        .into_iter()
        .map(|(from, to)| (from.to_owned(), BTreeSet::from([to.to_owned()])))
        .collect();
    assert_eq!(find_cycle(&graph).expect("a cycle"), ["a", "b", "c", "a"]);
}
