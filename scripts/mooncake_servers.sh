#!/usr/bin/env bash
# Start (or stop) a Mooncake Store on loopback ports: mooncake_master (with its HTTP metadata server and admin
# endpoint) and a mooncake_client that lends the store memory (a segment that outlives the processes that write).
#   eval "$(bash scripts/mooncake_servers.sh start DIR [SEGMENT])"   # exports KVTIER_MOONCAKE_SPEC
#   bash scripts/mooncake_servers.sh stop DIR
# Needs the Mooncake wheel (pip install mooncake-transfer-engine-non-cuda) in the active Python environment.
# SEGMENT: the memory lent, e.g. "1 GB" (default): the store's bound.
set -euo pipefail
action=${1:-start}
dir=${2:-${TMPDIR:-/tmp}/kvtier-mooncake}
segment=${3:-1 GB}

if [[ $action == stop ]]; then
  for name in holder master; do
    [[ -f "$dir/$name.pid" ]] && kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
  done
  exit 0
fi

where=$(${PYTHON:-python3} -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')
master=$(command -v mooncake_master || echo "$where/mooncake_master")
client=$(command -v mooncake_client || echo "$where/mooncake_client")
read -r rpc http admin port < <(python3 - <<'PY'
import random, socket
ports = []
while len(ports) < 4:
    p = random.randrange(20000, 55000)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    except OSError:
        continue
    if p not in ports:
        ports.append(p)
print(*ports)
PY
)
mkdir -p "$dir"
wait_port() {  # port, what
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1
  done
  echo "$2 did not start on port $1 (logs in $dir)" >&2; exit 1
}
(cd "$dir" && exec "$master" --rpc_port="$rpc" --rpc_address=127.0.0.1 --enable_http_metadata_server=true \
  --http_metadata_server_port="$http" --http_metadata_server_host=127.0.0.1 --metrics_port="$admin" \
  --metrics_host=127.0.0.1 --client_ttl=5 >"$dir/master.log" 2>&1) &
echo $! > "$dir/master.pid"
wait_port "$rpc" mooncake_master; wait_port "$http" "the metadata server"; wait_port "$admin" "the admin endpoint"
(cd "$dir" && exec "$client" --master_server_address="127.0.0.1:$rpc" \
  --metadata_server="http://127.0.0.1:$http/metadata" --global_segment_size="$segment" --host=127.0.0.1 \
  --port="$port" --protocol=tcp >"$dir/holder.log" 2>&1) &
echo $! > "$dir/holder.pid"
wait_port "$port" "mooncake_client (the segment holder)"
for _ in $(seq 300); do   # the segment must be mounted before the store can take a page
  [[ -n "$(${PYTHON:-python3} -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$admin/get_all_segments', timeout=1).read().decode().strip())" 2>/dev/null)" ]] && break
  sleep 0.1
done
echo "export KVTIER_MOONCAKE_SPEC='mooncake://127.0.0.1:$rpc?metadata=http://127.0.0.1:$http/metadata&admin=http://127.0.0.1:$admin'"
