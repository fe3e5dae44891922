#!/usr/bin/env bash
# Issue 3's 1 MB target in one command: YCSB workload A on Camelot with 1 MB records
# (10 × 100,000 B), 4 threads, between two iperf3 loopback streams, and the ratio of
# Camelot's record bytes/s to the mean of the two streams (target ≥ 0.6).
# Usage: scripts/ycsb-1mb-vs-iperf3.sh [ROUNDS] [CAMELOT_BINARY]
#   ROUNDS (default 3) repeats stream / YCSB / stream; the last row is the median ratio.
#   CAMELOT_BINARY defaults to ./target/release/camelot (built if missing).
# On the shared machine, wrap it: flock /tmp/camelot-bench.lock scripts/ycsb-1mb-vs-iperf3.sh
set -euo pipefail

cd "$(dirname "$0")/.."
rounds=${1:-3}
bin=${2:-./target/release/camelot}
for tool in iperf3 jq ss; do
  command -v "$tool" >/dev/null || { echo "ycsb-1mb: $tool missing; run scripts/setup.sh" >&2; exit 1; }
done
[ -x "$bin" ] || cargo build --release -q -p camelot
out=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$out"
}
trap cleanup EXIT

script_name=ycsb-1mb
# shellcheck source=lib/ports.sh
source scripts/lib/ports.sh

# One 5 s iperf3 loopback stream (default 128 KiB writes); prints bytes/s.
stream() {
  local port
  port=$(free_port)
  iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 & pids+=($!)
  wait_listening "$port"
  iperf3 -c 127.0.0.1 -p "$port" -t 5 -J | jq '.end.sum_received.bits_per_second / 8'
}

echo "| round | iperf3 before GB/s | Camelot ops/s | Camelot GB/s | iperf3 after GB/s | ratio to the mean stream |"
echo "|---|---|---|---|---|---|"
ratios=()
for r in $(seq 1 "$rounds"); do
  before=$(stream)
  "$bin" bench ycsb --workload a --compare camelot --spawn --records 1000 --operations 4000 \
    --threads 4 --fields 10 --field-bytes 100000 --out "$out/r$r" >/dev/null 2> >(grep -v "^ycsb: workload" >&2)
  ops=$(jq '.series[] | select(.label=="camelot") | .points[0].ops_per_sec' "$out/r$r/ycsb.json")
  bytes=$(jq '.series[] | select(.label=="camelot") | .points[0].bytes_per_sec' "$out/r$r/ycsb.json")
  after=$(stream)
  ratio=$(jq -n "$bytes / (($before + $after) / 2)")
  ratios+=("$ratio")
  printf "| %d | %.2f | %.0f | %.2f | %.2f | %.2f |\n" "$r" "$(jq -n "$before/1e9")" "$ops" \
    "$(jq -n "$bytes/1e9")" "$(jq -n "$after/1e9")" "$ratio"
done
median=$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}')
printf "| median | | | | | **%.2f** (target ≥ 0.60) |\n" "$median"
