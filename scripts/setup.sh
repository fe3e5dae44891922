#!/usr/bin/env bash
# Installs what Camelot's tests, benchmarks and scripts call on a Debian machine: the real
# programs the tests start (Redis, memcached, etcd), the peers benchmarks compare against
# (iperf3, sockperf, fio, sysbench, redis-benchmark), Chromium for the report test, a C
# compiler for the rvm.h example, the stock NBD clients the block-volume export is tested
# with (nbdinfo, nbdcopy from libnbd-bin), and the tools the scripts use (jq, ss from iproute2,
# kill from procps, python3), and redis-py for the stock-client test of the Redis port:
# Debian's python3-redis (4.3.4, which sends neither HELLO nor CLIENT SETINFO) and, in
# .venv/redis-py, redis-py 8.1.0 from PyPI (which sends HELLO 3 and CLIENT SETINFO on
# connect, as a new user's client does). Safe to run again: it asks apt only when
# something is missing, and then runs `apt-get update` once; pip only when the venv is
# missing or holds another redis-py.
#
#   scripts/setup.sh             install what is missing
#   scripts/setup.sh --check     list what is missing and exit 1 if anything is; no apt
#   scripts/setup.sh --optional  also try the optional tools (perf for profiling,
#                                qemu-img for block-volume work); one that apt does not
#                                have is reported, not fatal
set -euo pipefail

# protobuf-compiler and libprotobuf-dev: the etcd-client crate, in crates/cluster, compiles
# etcd's .proto files when it is built and needs protoc and the well-known types.
packages=(
  redis-server redis-tools memcached etcd-server etcd-client
  iperf3 sockperf fio sysbench chromium
  gcc libc6-dev libnbd-bin
  protobuf-compiler libprotobuf-dev
  jq iproute2 procps coreutils python3 python3-redis python3-venv
)
optional=(linux-perf qemu-utils)

mode="install"
case "${1:-}" in
  "") ;;
  --check) mode="check" ;;
  --optional) packages+=("${optional[@]}"); mode="optional" ;;
  *) echo "usage: $0 [--check|--optional]" >&2; exit 2 ;;
esac

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

# redis-py as a new user gets it (crates/cli/tests/redis_py.rs runs it against the port).
REDIS_PY_VERSION="8.1.0"
redis_py_venv="$(cd "$(dirname "$0")/.." && pwd)/.venv/redis-py"
redis_py_ok() {
  "$redis_py_venv/bin/python" -c "import redis, sys; sys.exit(redis.__version__ != '$REDIS_PY_VERSION')" 2>/dev/null
}

missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
done

if [ "$mode" = check ]; then
  redis_py_ok || missing+=("redis-py==$REDIS_PY_VERSION (in $redis_py_venv)")
  if ((${#missing[@]})); then
    echo "setup: missing ${missing[*]}"
    exit 1
  fi
  echo "setup: nothing missing"
  exit 0
fi

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  required=()
  for p in "${missing[@]}"; do
    if [[ " ${optional[*]} " == *" $p "* ]]; then
      $SUDO apt-get install -y -qq --no-install-recommends "$p" >/dev/null ||
        echo "setup: optional $p could not be installed; skipped" >&2
    else
      required+=("$p")
    fi
  done
  if ((${#required[@]})); then
    $SUDO apt-get install -y -qq --no-install-recommends "${required[@]}" >/dev/null
  fi
fi

if ! redis_py_ok; then
  echo "setup: installing redis-py $REDIS_PY_VERSION into $redis_py_venv"
  /usr/bin/python3 -m venv --clear "$redis_py_venv"
  "$redis_py_venv/bin/pip" install -q --disable-pip-version-check "redis==$REDIS_PY_VERSION"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found; install Rust (https://rustup.rs) and run again" >&2
  exit 1
fi
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt >/dev/null 2>&1 || true
echo "setup: ok"
