#!/usr/bin/env bash
# Start (or stop) the Redis servers the tests use: a standalone server and a 3-node Redis Cluster on loopback ports.
#   eval "$(bash scripts/redis_servers.sh start DIR)"   # exports KVTIER_TEST_REDIS_URL, KVTIER_TEST_REDIS_CLUSTER_URL
#   bash scripts/redis_servers.sh stop DIR
# Ports are free ones picked at start (a cluster node's bus port, +10000, must be free too); DIR keeps them for stop.
set -euo pipefail
action=${1:-start}
dir=${2:-${TMPDIR:-/tmp}/kvtier-redis}
server=$(command -v redis-server || command -v valkey-server)
cli=$(command -v redis-cli || command -v valkey-cli)

if [[ $action == stop ]]; then
  for p in $(cat "$dir/ports" 2>/dev/null); do "$cli" -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
  exit 0
fi

read -r port c0 c1 c2 < <(python3 - <<'PY'
import random, socket
def free(bus):
    while True:
        port = random.randrange(20000, 55000)
        try:
            for p in (port, port + 10000) if bus else (port,):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            pass
ports = [free(False)]
while len(ports) < 4:
    p = free(True)
    if p not in ports:
        ports.append(p)
print(*ports)
PY
)
mkdir -p "$dir"
echo "$port $c0 $c1 $c2" > "$dir/ports"
start() {  # port, extra args...
  local p=$1; shift
  mkdir -p "$dir/$p"
  "$server" --port "$p" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes --dir "$dir/$p" \
    --logfile "$dir/$p/server.log" --pidfile "$dir/$p/server.pid" "$@"
}
start "$port"
for p in $c0 $c1 $c2; do
  start "$p" --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000
done
for p in $port $c0 $c1 $c2; do
  for _ in $(seq 100); do "$cli" -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
done
"$cli" --cluster create 127.0.0.1:$c0 127.0.0.1:$c1 127.0.0.1:$c2 --cluster-yes >"$dir/cluster-create.log"
for _ in $(seq 300); do   # every node must agree before the tests use it
  ok=0
  for p in $c0 $c1 $c2; do
    "$cli" -p "$p" cluster info | grep -q 'cluster_state:ok' && ok=$((ok + 1))
  done
  [[ $ok == 3 ]] && break; sleep 0.1
done
echo "export KVTIER_TEST_REDIS_URL=redis://127.0.0.1:$port/0"
echo "export KVTIER_TEST_REDIS_CLUSTER_URL=redis+cluster://127.0.0.1:$c0"
