#!/bin/bash
# Live TTFT with the KV tier off and on (bench/RESULTS.md, "KV tier"): one
# colocated `small` worker whose pool (12 MiB = 96 blocks = 1,536 tokens) is
# too small for 6 interleaved conversations of 6 turns (8 output tokens), a
# router in front, `bench serve` closed loop at concurrency 1. Round-robin
# turns evict each conversation's prefix from the pool before its next turn;
# with a tier it comes back from disk (on) or host memory (mem).
#   SHAPE=even:    every turn adds 192 tokens (192 .. 1,152)
#   SHAPE=mooncake: a 448-token first turn, then 96 new tokens a turn (448 ..
#     928): follow-up turns reuse 82-90% of their prompt, around the median
#     of the Mooncake conversation trace's follow-up turns (0.85; 829 new of
#     9,874 tokens), scaled down for a 2-core CPU.
#   bench/experiments/kv_tier_multiturn.sh [OUT_DIR]   (MODES="off on mem")
set -u
BIN=${BIN:-build/bin/pdserve}
OUT=${1:-/tmp/kv_tier_multiturn}
SHAPE=${SHAPE:-even}
mkdir -p "$OUT"
M=$OUT/small
[ -d "$M" ] || $BIN model init --preset small --out "$M" >/dev/null
python3 - "$OUT/trace_$SHAPE.jsonl" "$SHAPE" <<'PY'
import json, sys
first, step = (192, 192) if sys.argv[2] == "even" else (448, 96)
with open(sys.argv[1], "w") as f:
    for turn in range(6):
        for conv in range(6):
            f.write(json.dumps({"arrival_s": 0, "prompt_tokens": first + step * turn,
                                "max_tokens": 8, "prefix_group": f"conv{conv}"}) + "\n")
PY
for mode in ${MODES:-off on}; do
  rm -rf "$OUT/tier"; mkdir -p "$OUT/tier"
  extra=""
  [ "$mode" = on ] && extra="--kv-offload-dir $OUT/tier --kv-offload-bytes 1GiB"
  [ "$mode" = mem ] && extra="--kv-offload-memory 1GiB"
  $BIN worker --insecure --role both --model "$M" --port 0 --metrics-port 19481 \
    --kv-cache-memory 12MiB --threads 2 $extra >"$OUT/worker_$mode.log" 2>&1 &
  WP=$!
  for _ in $(seq 300); do grep -q listening "$OUT/worker_$mode.log" && break; sleep 0.2; done
  ADDR=$(grep -o 'listening on [0-9.:]*' "$OUT/worker_$mode.log" | awk '{print $3}')
  $BIN router --insecure --model "$M" --port 50581 --metrics-port 19482 \
    --both-workers "$ADDR" >"$OUT/router_$mode.log" 2>&1 &
  RP=$!
  # Until the router has polled the worker (a loaded machine is slow).
  for _ in $(seq 50); do
    curl -s localhost:19482/metrics | grep -q '^pdserve_workers{.*state="up".*} [1-9]' && break
    sleep 0.2
  done
  $BIN bench serve --router 127.0.0.1:50581 --trace "$OUT/trace_$SHAPE.jsonl" \
    --concurrency 1 --json >"$OUT/bench_${SHAPE}_$mode.json"
  curl -s localhost:19481/metrics | grep -E '^pdserve_(kv_tier|prefix_cache)' >"$OUT/metrics_${SHAPE}_$mode.txt"
  kill $RP $WP; wait $RP $WP 2>/dev/null
  echo "== $SHAPE tier $mode (load $(cut -d' ' -f1-3 /proc/loadavg))"
  python3 -c "import json; print(json.load(open('$OUT/bench_${SHAPE}_$mode.json'))['ttft_s'])"
  cat "$OUT/metrics_${SHAPE}_$mode.txt"
  sleep 2
done
