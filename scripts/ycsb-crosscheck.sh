#!/usr/bin/env bash
# The YCSB comparison with stock tools only: the real YCSB client (Java, its unmodified
# Redis binding) against redis-server and against `camelot server --resp-listen`, each a
# separate process on loopback, started the same way, in alternating order, with every
# server's CPU seconds read from /proc/PID/stat around each phase. Nothing of Camelot's
# own harness is involved, so a reader can check `camelot bench ycsb`'s ratios with it.
#
# YCSB's Redis binding is not on Maven Central; build it once from YCSB's sources:
#   git clone https://github.com/brianfrankcooper/YCSB && cd YCSB
#   mvn -pl site.ycsb:redis-binding -am package -DskipTests -Dcheckstyle.skip
#   tar xzf redis/target/ycsb-redis-binding-*.tar.gz -C /some/dir
# then:
#   scripts/ycsb-crosscheck.sh /some/dir/ycsb-redis-binding-0.18.0-SNAPSHOT [rounds]
#
# Settings (environment): RECORDS (50000), OPERATIONS (200000), THREADS (16),
# WORKLOADS ("a b c"), CAMELOT (target/release/camelot).
set -euo pipefail
cd "$(dirname "$0")/.."

ycsb_home=${1:?usage: $0 YCSB_REDIS_BINDING_DIR [rounds]}
rounds=${2:-3}
records=${RECORDS:-50000}
operations=${OPERATIONS:-200000}
threads=${THREADS:-16}
workloads=${WORKLOADS:-a b c}
camelot=${CAMELOT:-target/release/camelot}

[ -x "$camelot" ] || { echo "no $camelot: cargo build --release -p camelot" >&2; exit 1; }
[ -d "$ycsb_home/lib" ] || { echo "no YCSB at $ycsb_home (see the top of this script)" >&2; exit 1; }
command -v redis-server >/dev/null || { echo "redis-server missing: scripts/setup.sh" >&2; exit 1; }

scratch=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$scratch"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# utime+stime of a process, in seconds (USER_HZ = 100), counted from the last ')'.
cpu_seconds() {
  awk '{ sub(/.*\) /, ""); printf "%.2f\n", ($12 + $13) / 100 }' "/proc/$1/stat"
}

wait_port() {
  for _ in $(seq 1 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.05
  done
  echo "nothing listens on $1" >&2
  return 1
}

# start NAME: starts the named server, sets $port and $pid.
start() {
  port=$(free_port)
  case "$1" in
    redis)
      redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --daemonize no --dir "$scratch" >"$scratch/$1.log" 2>&1 &
      ;;
    camelot)
      "$camelot" server --listen "127.0.0.1:$(free_port)" --resp-listen "127.0.0.1:$port" \
        --threads 1 --resp-threads 1 --memory 4G >"$scratch/$1.log" 2>&1 &
      ;;
    camelot-parity)
      "$camelot" server --listen "127.0.0.1:$(free_port)" --resp-listen "127.0.0.1:$port" \
        --threads 1 --resp-threads 1 --resp-poll-us 0 --memory 4G >"$scratch/$1.log" 2>&1 &
      ;;
  esac
  pid=$!
  pids+=("$pid")
  wait_port "$port"
}

ycsb() {
  local phase=$1 workload=$2 port=$3
  java -cp "$ycsb_home/lib/*" site.ycsb.Client "$phase" -db site.ycsb.db.RedisClient \
    -P "$ycsb_home/workloads/workload$workload" \
    -p redis.host=127.0.0.1 -p redis.port="$port" \
    -p recordcount="$records" -p operationcount="$operations" \
    -threads "$threads" -s 2>"$scratch/ycsb.err"
}

throughput() { awk -F', ' '/^\[OVERALL\], Throughput/ { printf "%.0f", $3 }'; }
p99() { awk -F', ' -v op="$1" '$1 == "[" op "]" && $2 == "99thPercentileLatency(us)" { print $3 }'; }

servers=(redis camelot camelot-parity)
echo "# YCSB $(basename "$ycsb_home"), $threads threads, $records records, $operations ops; $(nproc) cores, $(uname -r)"
echo "# $(redis-server --version | head -1)"
echo "round | workload | server | load ops/s | run ops/s | read p99 µs | server CPU s (run) | run ops per server CPU-s"
for round in $(seq 1 "$rounds"); do
  # Alternate who goes first, so a neighbour's burst does not always hit the same server.
  if ((round % 2)); then order=("${servers[@]}"); else order=(camelot-parity camelot redis); fi
  for w in $workloads; do
    for s in "${order[@]}"; do
      start "$s"
      load=$(ycsb -load "$w" "$port" | throughput)
      before=$(cpu_seconds "$pid")
      out=$(ycsb -t "$w" "$port")
      after=$(cpu_seconds "$pid")
      run=$(echo "$out" | throughput)
      read_p99=$(echo "$out" | p99 READ)
      cpu=$(awk -v a="$after" -v b="$before" 'BEGIN { printf "%.2f", a - b }')
      per_cpu=$(awk -v o="$operations" -v c="$cpu" 'BEGIN { if (c > 0) printf "%.0f", o / c; else print "-" }')
      echo "$round | $w | $s | $load | $run | ${read_p99:--} | $cpu | $per_cpu"
      kill -9 "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    done
  done
done
