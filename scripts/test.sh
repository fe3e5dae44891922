#!/usr/bin/env bash
# The whole test suite, from a fresh clone: install what the tests need, check formatting
# and lints, then run every test. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
