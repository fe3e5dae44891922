#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each (default 20; CAMELOT_FUZZ_SECONDS also works).
# With a nightly toolchain and cargo-fuzz: libFuzzer, coverage-guided, starting from the
# checked-in seeds in fuzz/corpus/<target>/ (what it finds goes to a scratch directory,
# so the checked-in corpus stays small). Without them — a fresh CI machine, where rustup
# may not be able to fetch nightly — the same target bodies built on stable by
# fuzz/tests/corpus.rs: every seed, then seeded mutations for the same time.
# CAMELOT_FUZZ_ENGINE=stable forces the second. Exits non-zero on the first crash.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds="${1:-${CAMELOT_FUZZ_SECONDS:-20}}"
engine="${CAMELOT_FUZZ_ENGINE:-auto}"

if [ "$engine" != stable ] && cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz: libFuzzer (cargo +nightly fuzz), ${seconds} s per target"
  cargo +nightly fuzz build
  for target in $(cargo +nightly fuzz list); do
    scratch="$(mktemp -d)"
    cargo +nightly fuzz run "$target" "$scratch" "corpus/$target" -- \
      -max_total_time="$seconds" -print_final_stats=1
    rm -rf "$scratch"
  done
else
  echo "fuzz: stable corpus runner (no cargo-fuzz), ${seconds} s per target"
  # The main workspace's target directory: its dependencies are already built there.
  CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/../target}" CAMELOT_FUZZ_SECONDS="$seconds" \
    cargo test --no-default-features --locked -- --test-threads "$(nproc)" --nocapture
fi
