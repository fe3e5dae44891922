#!/usr/bin/env bash
# The whole test suite, from a fresh clone: install what the tests need, check formatting
# and lints, run every test, then every fuzz target for 20 s (scripts/fuzz.sh: libFuzzer
# when cargo-fuzz is installed, else the stable corpus runner). CI runs exactly this
# (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
./scripts/fuzz.sh 20
