#!/usr/bin/env bash
# Start N jaxdp nodes on this machine (loopback), one process each, together one `--mesh dp=8` model world
# of 8 CPU devices. Usage: serve/local-cluster.sh N [--ipv6] [more jaxdp.serve flags]
set -euo pipefail
N=${1:?usage: serve/local-cluster.sh N [--ipv6] [jaxdp.serve flags]}
shift
HOST=127.0.0.1
if [[ "${1:-}" == "--ipv6" ]]; then HOST="[::1]"; shift; fi
case $N in 1|2|4|8) ;; *) echo "error: N must divide 8 (1, 2, 4 or 8)" >&2; exit 2;; esac
DIST_PORT=${DIST_PORT:-29500}
HTTP_PORT=${PORT:-30000}
export XLA_FLAGS="--xla_force_host_platform_device_count=$((8 / N))"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' INT TERM EXIT
for ((k = N - 1; k >= 0; k--)); do
  python -m jaxdp.serve --mesh dp=8 --nnodes "$N" --node-rank "$k" --dist-init-addr "$HOST:$DIST_PORT" \
    --port $((HTTP_PORT + k)) "$@" &
  pids+=($!)
done
until curl -sf "http://127.0.0.1:$HTTP_PORT/health" >/dev/null; do
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || { echo "error: a node exited; see its output" >&2; exit 1; }; done
  sleep 1
done
echo "ready: http://127.0.0.1:$HTTP_PORT (node 0); Ctrl-C stops every node"
wait -n
