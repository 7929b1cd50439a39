#!/bin/bash
# Live TTFT with the KV file tier off and on (bench/RESULTS.md, "KV tier"):
# one colocated `small` worker whose pool (12 MiB = 96 blocks = 1,536 tokens)
# is too small for 6 interleaved conversations of 6 turns (192 new tokens a
# turn, 8 output tokens), a router in front, `bench serve` closed loop at
# concurrency 1. Round-robin turns evict each conversation's prefix from the
# pool before its next turn; with the tier it comes back from disk.
#   bench/experiments/kv_tier_multiturn.sh [OUT_DIR]   (MODES="off on")
set -u
BIN=${BIN:-build/bin/pdserve}
OUT=${1:-/tmp/kv_tier_multiturn}
mkdir -p "$OUT"
M=$OUT/small
[ -d "$M" ] || $BIN model init --preset small --out "$M" >/dev/null
python3 - "$OUT/trace.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for turn in range(6):
        for conv in range(6):
            f.write(json.dumps({"arrival_s": 0, "prompt_tokens": 192 * (turn + 1),
                                "max_tokens": 8, "prefix_group": f"conv{conv}"}) + "\n")
PY
for mode in ${MODES:-off on}; do
  rm -rf "$OUT/tier"; mkdir -p "$OUT/tier"
  extra=""
  [ "$mode" = on ] && extra="--kv-offload-dir $OUT/tier --kv-offload-bytes 1GiB"
  $BIN worker --insecure --role both --model "$M" --port 0 --metrics-port 19481 \
    --kv-cache-memory 12MiB --threads 2 $extra >"$OUT/worker_$mode.log" 2>&1 &
  WP=$!
  for _ in $(seq 300); do grep -q listening "$OUT/worker_$mode.log" && break; sleep 0.2; done
  ADDR=$(grep -o 'listening on [0-9.:]*' "$OUT/worker_$mode.log" | awk '{print $3}')
  $BIN router --insecure --model "$M" --port 50581 --metrics-port 19482 \
    --both-workers "$ADDR" >"$OUT/router_$mode.log" 2>&1 &
  RP=$!
  sleep 2
  $BIN bench serve --router 127.0.0.1:50581 --trace "$OUT/trace.jsonl" \
    --concurrency 1 --json >"$OUT/bench_$mode.json"
  curl -s localhost:19481/metrics | grep -E '^pdserve_(kv_tier|prefix_cache)' >"$OUT/metrics_$mode.txt"
  kill $RP $WP; wait $RP $WP 2>/dev/null
  echo "== tier $mode"
  python3 -c "import json; print(json.load(open('$OUT/bench_$mode.json'))['ttft_s'])"
  cat "$OUT/metrics_$mode.txt"
  sleep 2
done
