#!/usr/bin/env bash
# fio's nbd engine against `camelot volume serve-nbd`: a raid5 volume over five
# `camelot server --threads 1` processes, exported on loopback, then sequential 1 MiB and
# random 4 KiB writes and reads for 5 s each (one fio job, one connection).
# Usage: scripts/nbd-fio.sh [CAMELOT_BINARY]   (default ./target/release/camelot, built if missing)
set -euo pipefail

cd "$(dirname "$0")/.."
bin=${1:-./target/release/camelot}
for tool in fio jq ss; do
  command -v "$tool" >/dev/null || { echo "nbd-fio: $tool missing; run scripts/setup.sh" >&2; exit 1; }
done
[ -x "$bin" ] || cargo build --release -q -p camelot
out=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$out"
}
trap cleanup EXIT

script_name=nbd-fio
# shellcheck source=lib/ports.sh
source scripts/lib/ports.sh

servers=()
for _ in 1 2 3 4 5; do
  port=$(free_port)
  RUST_LOG=error "$bin" server --listen "127.0.0.1:$port" --memory 512M --threads 1 \
    >"$out/server-$port.log" 2>&1 & pids+=($!)
  wait_listening "$port"
  servers+=("127.0.0.1:$port")
done
list=$(IFS=,; echo "${servers[*]}")
RUST_LOG=error "$bin" volume create --level raid5 --servers "$list" --size 256M fiovol >/dev/null
nbd_port=$(free_port)
RUST_LOG=error "$bin" volume serve-nbd fiovol --server "${servers[0]}" \
  --listen "127.0.0.1:$nbd_port" >"$out/nbd.log" 2>&1 & pids+=($!)
wait_listening "$nbd_port"

echo "| fio job | MB/s | IOPS | errors |"
echo "|---|---|---|---|"
job() { # name rw bs iodepth
  fio --name="$1" --ioengine=nbd --uri="nbd://127.0.0.1:$nbd_port" --rw="$2" --bs="$3" \
    --iodepth="$4" --size=256m --time_based --runtime=5 --output-format=json >"$out/$1.json"
  # fio prints a connection notice before its JSON.
  sed -n '/^{/,$p' "$out/$1.json" | jq -r --arg j "$2, bs $3, iodepth $4" '.jobs[0] as $r
    | (if $r.write.io_bytes > 0 then $r.write else $r.read end) as $d
    | "| \($j) | \($d.bw_bytes / 1e6 | floor) | \($d.iops | floor) | \($r.error) |"'
}
job seqwrite write 1m 8
job seqread read 1m 8
job randwrite randwrite 4k 16
job randread randread 4k 16
