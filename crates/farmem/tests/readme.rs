//! The README's FarVec and FarRegion examples are `examples/readme.rs`'s, which `cargo
//! test` compiles: this fails when the README shows anything else, so the examples a
//! reader copies always build against the crate as it is.

/// The lines between `// README: NAME` and `// README: end` in the example.
fn example_block(example: &str, name: &str) -> Vec<String> {
    let begin = format!("// README: {name}");
    example
        .lines()
        .skip_while(|l| l.trim() != begin)
        .skip(1)
        .take_while(|l| l.trim() != "// README: end")
        .map(|l| l.trim().to_string())
        .collect()
}

/// Every ```rust block of the README, each as its trimmed lines.
fn readme_blocks(readme: &str) -> Vec<Vec<String>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<String>> = None;
    for line in readme.lines() {
        match (&mut current, line.trim()) {
            (None, "```rust") => current = Some(Vec::new()),
            (Some(_), "```") => blocks.extend(current.take()),
            (Some(block), l) => block.push(l.to_string()),
            (None, _) => {}
        }
    }
    blocks
}

/// Code with runs of spaces squeezed and blank lines dropped, so aligning comments
/// differently is no difference.
fn squeezed(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty())
        .collect()
}

#[test]
fn the_readme_far_memory_examples_are_the_compiled_ones() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/../../README.md")).expect("README.md");
    let example =
        std::fs::read_to_string(format!("{root}/examples/readme.rs")).expect("examples/readme.rs");
    let blocks: Vec<Vec<String>> = readme_blocks(&readme).iter().map(|b| squeezed(b)).collect();
    for name in ["farvec", "farregion"] {
        let want = squeezed(&example_block(&example, name));
        assert!(want.len() >= 5, "the example has no {name} block");
        assert!(
            blocks.contains(&want),
            "README.md has no ```rust block equal to examples/readme.rs's {name} block:\n{}",
            want.join("\n")
        );
    }
}
