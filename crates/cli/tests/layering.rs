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

/// Every path a `use`-style tree names, from just after its prefix (`crate::`, `super::`):
/// `a::b::{c, d::{e, f}}` → `a::b::c`, `a::b::d::e`, `a::b::d::f`; a path that is not a
/// group ends at the first character that cannot be part of it.
fn expand_tree(text: &str) -> Vec<Vec<String>> {
    fn tree(chars: &[char], at: &mut usize) -> Vec<Vec<String>> {
        let mut segments = Vec::new();
        loop {
            let start = *at;
            while *at < chars.len() && (chars[*at].is_alphanumeric() || chars[*at] == '_') {
                *at += 1;
            }
            if *at > start {
                segments.push(chars[start..*at].iter().collect::<String>());
            }
            if chars[*at..].starts_with(&[':', ':']) {
                *at += 2;
                continue;
            }
            while *at < chars.len() && chars[*at].is_whitespace() {
                *at += 1;
            }
            if chars.get(*at) != Some(&'{') {
                return vec![segments];
            }
            *at += 1;
            let mut out = Vec::new();
            loop {
                while *at < chars.len() && (chars[*at].is_whitespace() || chars[*at] == ',') {
                    *at += 1;
                }
                if *at >= chars.len() || chars[*at] == '}' {
                    *at += 1;
                    return out;
                }
                let before = *at;
                for item in tree(chars, at) {
                    let mut path = segments.clone();
                    path.extend(item);
                    out.push(path);
                }
                // `x as y`, or anything unparsed: skip to the next item.
                while *at < chars.len() && chars[*at] != ',' && chars[*at] != '}' {
                    *at += 1;
                }
                if *at == before {
                    *at += 1;
                }
            }
        }
    }
    let chars: Vec<char> = text.chars().take(4096).collect();
    tree(&chars, &mut 0)
}

/// The code of a source file that is not a test (everything before `#[cfg(test)]`),
/// without `//` comments.
fn code_of(text: &str) -> String {
    without_comments(text.split("#[cfg(test)]").next().unwrap_or(""))
}

fn without_comments(text: &str) -> String {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Items the crate root re-exports (`pub use error::BenchError;`), by the name they are
/// known under at the root, mapped to the module that defines them.
fn root_reexports(root_code: &str, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (at, _) in root_code.match_indices("pub use ") {
        let rest = &root_code[at + "pub use ".len()..];
        let rest = rest.strip_prefix("crate::").unwrap_or(rest);
        let rest = rest.strip_prefix("self::").unwrap_or(rest);
        for path in expand_tree(rest) {
            let module = (1..path.len())
                .rev()
                .map(|n| path[..n].join("::"))
                .find(|m| modules.contains(m));
            if let (Some(module), Some(name)) = (module, path.last()) {
                out.insert(name.clone(), module);
            }
        }
    }
    out
}

/// Module → modules it imports outside its tests: every `crate::…` path (groups
/// expanded, root re-exports followed to the module defining the item) and every
/// `super::…` path, resolved to the longest module path that exists. A module naming
/// itself, an ancestor or a descendant does not count: parents declare and re-export
/// their children.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(src, f)).collect();
    let root_code = ["lib.rs", "main.rs"]
        .iter()
        .find_map(|r| std::fs::read_to_string(src.join(r)).ok())
        .map(|t| code_of(&t))
        .unwrap_or_default();
    let reexports = root_reexports(&root_code, &modules);
    let mut graph = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        let code = code_of(&std::fs::read_to_string(file).expect("source"));
        // `super` is this module's path less its last segment (a file `a/b.rs` or
        // `a/b/mod.rs` is module `a::b`, whose `super` is `a`).
        let own: Vec<String> = module
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let mut paths: Vec<Vec<String>> = Vec::new();
        for (at, _) in code.match_indices("crate::") {
            // `$crate::` in a macro, or `camelot_crate::`: not this crate's root.
            let before = code[..at].chars().last();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
                continue;
            }
            paths.extend(expand_tree(&code[at + "crate::".len()..]));
        }
        for (at, _) in code.match_indices("super::") {
            let before = code[..at].chars().last();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let mut rest = &code[at..];
            let mut up = 0;
            while let Some(r) = rest.strip_prefix("super::") {
                rest = r;
                up += 1;
            }
            if up > own.len() {
                continue;
            }
            for tail in expand_tree(rest) {
                let mut path = own[..own.len() - up].to_vec();
                path.extend(tail);
                paths.push(path);
            }
        }
        let mut targets = BTreeSet::new();
        for segments in paths {
            let target = (1..=segments.len())
                .rev()
                .map(|n| segments[..n].join("::"))
                .find(|m| modules.contains(m))
                .or_else(|| segments.first().and_then(|s| reexports.get(s)).cloned());
            if let Some(target) = target {
                let is_self_or_ancestor = module == target
                    || module.starts_with(&format!("{target}::"))
                    || target.is_empty();
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

#[test]
fn the_tree_expander_follows_groups_and_the_checker_follows_super_and_reexports() {
    let paths = expand_tree("a::b::{c, d::{e, f as g}, self};\nfn x() {}");
    let joined: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
    assert_eq!(
        joined,
        ["a::b::c", "a::b::d::e", "a::b::d::f", "a::b::self"]
    );
    assert_eq!(
        expand_tree("error::BenchError;")[0].join("::"),
        "error::BenchError"
    );

    // A crate whose `a` names `b` through a root re-export and `b` names `a` through
    // `super::`: a circle only these two rules can see.
    let dir = std::env::temp_dir().join(format!("camelot-layering-{}", std::process::id()));
    let src = dir.join("src");
    std::fs::create_dir_all(&src).expect("dir");
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\npub use b::Thing;\n").expect("lib");
    std::fs::write(src.join("a.rs"), "use crate::{Thing};\n").expect("a");
    std::fs::write(
        src.join("b.rs"),
        "pub struct Thing;\nfn f() { super::a::g() }\n",
    )
    .expect("b");
    let graph = module_graph(&src);
    assert_eq!(graph["a"], BTreeSet::from(["b".to_string()]));
    assert_eq!(graph["b"], BTreeSet::from(["a".to_string()]));
    assert!(find_cycle(&graph).is_some());
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// Whether `code` (comments stripped) uses `unsafe` itself: a block, fn, impl, trait or
/// extern block — not the word in a lint name or a string.
fn uses_unsafe(code: &str) -> bool {
    code.match_indices("unsafe").any(|(at, _)| {
        let before = code[..at].chars().last();
        let after = code[at + "unsafe".len()..].trim_start();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '"')
            && ["{", "fn ", "impl", "trait ", "extern "]
                .iter()
                .any(|k| after.starts_with(k))
    })
}

/// Every crate root (a package's `lib.rs` or `main.rs`, and each `src/bin/*.rs`) that
/// needs no `unsafe` and does not say `#![forbid(unsafe_code)]`, as `crate dir: root`.
fn roots_without_forbid(crate_dir: &Path) -> Vec<String> {
    let src = crate_dir.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // Tests count too: a forbid at the root would forbid unsafe in them as well.
    let package_unsafe = files.iter().any(|f| {
        uses_unsafe(&without_comments(
            &std::fs::read_to_string(f).expect("source"),
        ))
    });
    let mut missing = Vec::new();
    let mut check = |root: PathBuf, needs_unsafe: bool| {
        let Ok(text) = std::fs::read_to_string(&root) else {
            return;
        };
        if !needs_unsafe && !text.contains("#![forbid(unsafe_code)]") {
            missing.push(format!("{}: {}", crate_dir.display(), root.display()));
        }
    };
    // The library or main module tree is the package's files outside src/bin.
    check(src.join("lib.rs"), package_unsafe);
    check(src.join("main.rs"), package_unsafe);
    if let Ok(bins) = std::fs::read_dir(src.join("bin")) {
        for bin in bins.flatten() {
            let path = bin.path();
            if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("bin source");
                check(path, uses_unsafe(&without_comments(&text)));
            }
        }
    }
    missing
}

#[test]
fn every_crate_without_unsafe_forbids_it() {
    let missing: Vec<String> = crate_dirs()
        .iter()
        .flat_map(|(_, dir)| roots_without_forbid(dir))
        .collect();
    assert!(
        missing.is_empty(),
        "these crate roots need no unsafe; add #![forbid(unsafe_code)]: {missing:?}"
    );
}

#[test]
fn the_forbid_checker_sees_a_root_that_lacks_it() {
    assert!(uses_unsafe("fn f() { unsafe { g() } }"));
    assert!(uses_unsafe("unsafe impl Send for X {}"));
    assert!(!uses_unsafe(
        "#![forbid(unsafe_code)]\nlet s = \"unsafe {\";"
    ));
    let dir = std::env::temp_dir().join(format!("camelot-forbid-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("src/bin")).expect("dir");
    std::fs::write(dir.join("src/lib.rs"), "pub fn f() {}\n").expect("lib");
    std::fs::write(
        dir.join("src/bin/tool.rs"),
        "#![forbid(unsafe_code)]\nfn main() {}\n",
    )
    .expect("bin");
    assert_eq!(roots_without_forbid(&dir).len(), 1, "lib.rs lacks it");
    std::fs::write(
        dir.join("src/lib.rs"),
        "#![forbid(unsafe_code)]\npub fn f() {}\n",
    )
    .expect("lib");
    assert!(roots_without_forbid(&dir).is_empty());
    // A package with unsafe code is not asked to forbid it.
    std::fs::write(dir.join("src/lib.rs"), "pub fn f() { unsafe { g() } }\n").expect("lib");
    assert!(roots_without_forbid(&dir).is_empty());
    std::fs::remove_dir_all(&dir).expect("clean up");
}

/// Every crate's Camelot dependencies and, inside each crate, every module's imports of
/// its sibling modules, with the verdict on circles: the listing ARCHITECTURE.md's layering
/// rests on (what `cargo modules` would draw, read from the sources).
fn module_listing() -> String {
    let mut out = String::from("# Camelot crates and their modules' imports (layering.rs)\n");
    out.push_str("\n## crates → the camelot-* crates they depend on ([dependencies])\n");
    let crates = crate_dirs();
    let mut crate_graph = BTreeMap::new();
    for (name, dir) in &crates {
        let (deps, _) = camelot_deps(dir);
        out.push_str(&format!("{name} → {}\n", list(&deps)));
        crate_graph.insert(name.clone(), deps);
    }
    out.push_str(&format!(
        "crate circles: {}\n",
        find_cycle(&crate_graph).map_or("none".into(), |c| c.join(" → "))
    ));
    for (name, dir) in &crates {
        let graph = module_graph(&dir.join("src"));
        out.push_str(&format!(
            "\n## {name} (modules → the sibling modules they import)\n"
        ));
        for (module, targets) in &graph {
            let module = if module.is_empty() { "(root)" } else { module };
            out.push_str(&format!("{module} → {}\n", list(targets)));
        }
        out.push_str(&format!(
            "import circles: {}\n",
            find_cycle(&graph).map_or("none".into(), |c| c.join(" → "))
        ));
    }
    out
}

fn list(items: &BTreeSet<String>) -> String {
    if items.is_empty() {
        "—".into()
    } else {
        items.iter().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// `CAMELOT_MODULES_OUT=FILE cargo test -p camelot --test layering module_listing` writes
/// the listing to FILE.
#[test]
fn module_listing_names_every_crate_and_no_circle() {
    let listing = module_listing();
    for (name, _) in crate_dirs() {
        assert!(
            listing.contains(&format!("\n## {name} (")),
            "{name} missing"
        );
    }
    assert_eq!(
        listing.matches("circles: none").count(),
        crate_dirs().len() + 1,
        "{listing}"
    );
    if let Some(path) = std::env::var_os("CAMELOT_MODULES_OUT") {
        std::fs::write(&path, &listing).expect("write the listing");
    }
}
