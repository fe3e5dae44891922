# Shared by the measurement scripts: loopback ports for the peer tools they start.
# Callers set $script_name (for messages) before using these.

# A loopback port nobody listens on, picked at random in 20000–39999.
free_port() {
  local p
  for _ in $(seq 1 50); do
    p=$((20000 + RANDOM % 20000))
    if ! ss -ltnH "sport = :$p" | grep -q .; then echo "$p"; return; fi
  done
  echo "${script_name:-script}: no free port found" >&2; exit 1
}

# Waits (at most 10 s) until something listens on TCP port $1.
wait_listening() {
  for _ in $(seq 1 200); do
    ss -ltnH "sport = :$1" | grep -q . && return 0
    sleep 0.05
  done
  echo "${script_name:-script}: nothing listens on port $1 after 10 s" >&2; exit 1
}
