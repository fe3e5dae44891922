#!/bin/bash
# Interleaved redis-benchmark -P16 of the RESP port, two camelot binaries started
# alternately on loopback, with the server's CPU ticks around each run.
# Usage: BEFORE=path/to/camelot AFTER=path/to/camelot [ROUNDS=6] [N=600000] $0
set -u
: "${BEFORE:?path of the camelot binary built before}" "${AFTER:?path of the one after}"
wait_port() { for i in $(seq 1 200); do redis-cli -p $1 ping 2>/dev/null | grep -q PONG && return 0; sleep 0.05; done; return 1; }
run_one() { # label binary
  "$2" server --listen 127.0.0.1:17171 --resp-listen 127.0.0.1:16380 --threads 1 --resp-threads 1 --resp-poll-us 0 >/dev/null 2>&1 &
  local pid=$!
  if wait_port 16380; then
    local t0=$(awk '{ sub(/.*\) /, ""); print $12 + $13 }' /proc/$pid/stat)
    echo "== $1"; redis-benchmark -p 16380 -t get,set -d 100 -c 50 -n ${N:-200000} -P 16 --csv
    local t1=$(awk '{ sub(/.*\) /, ""); print $12 + $13 }' /proc/$pid/stat)
    echo "cpu_ticks $1 $(( t1 - t0 ))"
  else echo "== $1 did not start"; fi
  kill $pid; wait $pid 2>/dev/null
}
for round in $(seq 1 ${ROUNDS:-3}); do
  run_one before "$BEFORE"
  run_one after "$AFTER"
done
