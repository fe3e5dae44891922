#!/usr/bin/env bash
# Installs what Camelot's tests and benchmarks need on a Debian machine: the real
# programs the tests start (Redis, memcached, etcd), the peers benchmarks compare
# against (iperf3, sockperf, fio, sysbench, redis-benchmark) and Chromium for the report
# test. Safe to run again: installs only what is missing.
set -euo pipefail

packages=(
  redis-server redis-tools memcached etcd-server etcd-client
  iperf3 sockperf fio sysbench chromium
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust (https://rustup.rs) and run again" >&2
  exit 1
fi
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt >/dev/null 2>&1 || true
echo "setup: ok"
