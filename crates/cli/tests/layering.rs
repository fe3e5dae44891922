//! The layering ARCHITECTURE.md promises, checked on the sources so it cannot drift:
//! crates depend on each other one way, the results and test kits on no Camelot crate,
//! no crate's tests on the bench crate, and inside every crate no two modules import each
//! other, directly or around a longer circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `[dependencies]` and `[dev-dependencies]` names starting with `camelot-`, per crate dir.
fn camelot_deps(crate_dir: &Path) -> (BTreeSet<String>, BTreeSet<String>) {
    let text = std::fs::read_to_string(crate_dir.join("Cargo.toml")).expect("Cargo.toml");
    let (mut deps, mut dev) = (BTreeSet::new(), BTreeSet::new());
    let mut section = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            section = line.to_string();
            continue;
        }
        let Some(name) = line.split(['.', ' ', '=']).next() else {
            continue;
        };
        if !name.starts_with("camelot-") {
            continue;
        }
        match section.as_str() {
            "[dependencies]" => deps.insert(name.to_string()),
            "[dev-dependencies]" => dev.insert(name.to_string()),
            _ => false,
        };
    }
    (deps, dev)
}

fn crate_dirs() -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(workspace().join("crates")).expect("crates/") {
        let dir = entry.expect("entry").path();
        let text = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap_or_default();
        let name = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("name = \""))
            .and_then(|rest| rest.strip_suffix('"'))
            .map(String::from);
        if let Some(name) = name {
            out.push((name, dir));
        }
    }
    out.sort();
    out
}

/// Whether `graph` has a cycle; returns one if so.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(c) = visit(node, graph, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

#[test]
fn crates_depend_one_way_and_test_kits_stand_alone() {
    let crates = crate_dirs();
    assert!(crates.len() >= 9, "{crates:?}");
    let mut graph = BTreeMap::new();
    for (name, dir) in &crates {
        let (deps, dev) = camelot_deps(dir);
        if name == "camelot-results" || name == "camelot-testkit" {
            assert!(
                deps.is_empty(),
                "{name} must depend on no Camelot crate: {deps:?}"
            );
        }
        if name == "camelot-client" {
            assert!(
                !deps.contains("camelot-server"),
                "the client never depends on the server"
            );
        }
        assert!(
            !dev.contains("camelot-bench") || name == "camelot",
            "{name}'s tests pull in every benchmark; use camelot-testkit"
        );
        graph.insert(name.clone(), deps);
    }
    assert_eq!(find_cycle(&graph), None);
}

/// The module a source file is, as a path under the crate root (`hw::net`, `ycsb`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts
        .last()
        .is_some_and(|p| p == "mod" || p == "lib" || p == "main")
    {
        parts.pop();
    }
    parts.join("::")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read_dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "bin") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Module → modules it names through `crate::…` outside its tests, resolved to the
/// longest module path that exists.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(src, f)).collect();
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let text = std::fs::read_to_string(file).expect("source");
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        let mut targets = BTreeSet::new();
        for (at, _) in code.match_indices("crate::") {
            let path: String = code[at + "crate::".len()..]
                .chars()
                .take_while(|c| {
                    c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_' || *c == ':'
                })
                .collect();
            let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            let target = (1..=segments.len())
                .rev()
                .map(|n| segments[..n].join("::"))
                .find(|m| modules.contains(m));
            if let Some(target) = target {
                // A parent module declaring or re-exporting its child is not an import.
                let is_self_or_ancestor =
                    module == target || module.starts_with(&format!("{target}::"));
                let is_child = target.starts_with(&format!("{module}::")) || module.is_empty();
                if !is_self_or_ancestor && !is_child {
                    targets.insert(target);
                }
            }
        }
        graph.insert(module, targets);
    }
    graph
}

#[test]
fn no_two_modules_of_a_crate_import_each_other() {
    let circles: Vec<(String, Vec<String>)> = crate_dirs()
        .into_iter()
        .filter_map(|(name, dir)| Some((name, find_cycle(&module_graph(&dir.join("src")))?)))
        .collect();
    assert!(circles.is_empty(), "import circles: {circles:?}");
}

#[test]
fn the_cycle_finder_finds_a_circle() {
    // The checker itself must be able to fail: a → b → c → a is found, a → b → c is not.
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    g.insert("a".into(), BTreeSet::from(["b".to_string()]));
    g.insert("b".into(), BTreeSet::from(["c".to_string()]));
    g.insert("c".into(), BTreeSet::new());
    assert_eq!(find_cycle(&g), None);
    g.insert("c".into(), BTreeSet::from(["a".to_string()]));
    assert_eq!(
        find_cycle(&g),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}
