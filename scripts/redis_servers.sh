#!/usr/bin/env bash
# Start (or stop) the Redis servers the tests use: a standalone server and a 3-node Redis Cluster on loopback.
#   bash scripts/redis_servers.sh start [DIR]   # prints the export lines for the test URLs
#   bash scripts/redis_servers.sh stop [DIR]
# Ports: standalone 6390, cluster 7390-7392 (override with KVTIER_REDIS_PORT / KVTIER_REDIS_CLUSTER_PORT).
set -euo pipefail
action=${1:-start}
dir=${2:-${TMPDIR:-/tmp}/kvtier-redis}
port=${KVTIER_REDIS_PORT:-6390}
cport=${KVTIER_REDIS_CLUSTER_PORT:-7390}
server=$(command -v redis-server || command -v valkey-server)
cli=$(command -v redis-cli || command -v valkey-cli)

if [[ $action == stop ]]; then
  for p in $port $cport $((cport + 1)) $((cport + 2)); do "$cli" -p "$p" shutdown nosave >/dev/null 2>&1 || true; done
  exit 0
fi

mkdir -p "$dir"
start() {  # port, extra args...
  local p=$1; shift
  mkdir -p "$dir/$p"
  "$server" --port "$p" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes --dir "$dir/$p" \
    --logfile "$dir/$p/server.log" --pidfile "$dir/$p/server.pid" "$@"
}
start "$port"
for p in $cport $((cport + 1)) $((cport + 2)); do
  rm -f "$dir/$p/nodes.conf"
  start "$p" --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000
done
for p in $port $cport $((cport + 1)) $((cport + 2)); do
  for _ in $(seq 50); do "$cli" -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
done
"$cli" --cluster create 127.0.0.1:$cport 127.0.0.1:$((cport + 1)) 127.0.0.1:$((cport + 2)) --cluster-yes >"$dir/cluster-create.log"
for _ in $(seq 100); do
  "$cli" -p "$cport" cluster info | grep -q 'cluster_state:ok' && break; sleep 0.1
done
echo "export KVTIER_TEST_REDIS_URL=redis://127.0.0.1:$port/0"
echo "export KVTIER_TEST_REDIS_CLUSTER_URL=redis+cluster://127.0.0.1:$cport"
