#!/usr/bin/env bash
# pdserve's two fronts on one cluster, in one run: the same `bench serve`
# workload through the gRPC router port and through the OpenAI HTTP front
# (router --http-port, which calls the same Generate in-process). Rounds
# alternate gRPC / HTTP with fresh prompts each (prefix caching off), so both
# see the same machine load. Prints one JSON line per round and the ratios
# HTTP / gRPC of the medians over rounds.
# usage: bench/experiments/openai_vs_grpc.sh [BUILD_DIR] [ROUNDS] [PRESET]
# (PRESET small by default; tiny makes TTFT a few ms, so the front's own cost
# is a visible share of it.)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
B=${1:-$ROOT/build}/bin/pdserve
ROUNDS=${2:-4}
PRESET=${3:-small}
WORK=$(mktemp -d)
MODEL=$WORK/$PRESET
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
"$B" model init --preset "$PRESET" --out "$MODEL" 2>/dev/null

# start NAME ARGS... -> sets ADDR and HTTP from its "listening on" line (in
# this shell, not a subshell, so PIDS keeps the child for cleanup).
start() {
  local name=$1; shift
  local log=$WORK/$name.log line
  "$B" "$@" > "$log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 300); do
    if grep -q "listening on" "$log"; then
      line=$(sed -n 's/.*listening on \([^ ]*\) metrics [0-9]*\( http \([0-9]*\)\)\{0,1\}.*/\1 \3/p' "$log" | head -1)
      read -r ADDR HTTP <<< "$line"
      return
    fi
    sleep 0.1
  done
  echo "$name did not start:" >&2; cat "$log" >&2; exit 1
}
ENGINE=(--model "$MODEL" --insecure --port 0 --metrics-port 0 --kv-cache-memory 512MiB --enable-prefix-caching=false)
start prefill worker --role prefill "${ENGINE[@]}"; PRE=$ADDR
start decode worker --role decode "${ENGINE[@]}"; DEC=$ADDR
HTTP_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
start router router --model "$MODEL" --insecure --port 0 --metrics-port 0 \
  --http-port "$HTTP_PORT" --served-model-name "$PRESET" --prefill-workers "$PRE" --decode-workers "$DEC"
ROUTER=$ADDR
sleep 1.5
LOAD=(--workload synthetic --num-requests 24 --concurrency 2 --input-len 256 --output-len 32)
for r in $(seq 1 "$ROUNDS"); do
  seed=$((100 + 2 * r))
  g=$("$B" bench serve --router "$ROUTER" "${LOAD[@]}" --seed "$seed" --json)
  h=$("$B" bench serve --openai-url "http://127.0.0.1:$HTTP/v1" --model "$PRESET" "${LOAD[@]}" --seed "$((seed + 1))" --json)
  echo "{\"round\": $r, \"grpc\": $g, \"http\": $h}"
done | tee "$WORK/rounds.jsonl"
python3 - "$WORK/rounds.jsonl" <<'PY'
import json, statistics, sys
rounds = [json.loads(l) for l in open(sys.argv[1])]
def med(front, key, q):
    return statistics.median(r[front][key][q] for r in rounds)
out = {"rounds": len(rounds)}
for key in ("ttft_s", "itl_s", "e2e_s"):
    for q in ("p50", "p99"):
        g, h = med("grpc", key, q), med("http", key, q)
        out[f"{key}_{q}"] = {"grpc_ms": round(1e3 * g, 2), "http_ms": round(1e3 * h, 2),
                             "http_over_grpc": round(h / g, 3) if g else None}
out["failed"] = sum(r[f]["failed"] for r in rounds for f in ("grpc", "http"))
print(json.dumps(out, indent=1))
PY
