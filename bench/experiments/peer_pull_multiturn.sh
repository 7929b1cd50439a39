#!/bin/bash
# Live TTFT with peer pull off and on (bench/RESULTS.md, "Peer pull"): two
# `small` prefill workers whose pools (12 MiB = 96 blocks = 1,536 tokens each)
# are too small for 6 interleaved conversations of 6 turns (192 new tokens a
# turn, 8 output tokens), and one decode worker with a larger pool (64 MiB =
# 512 blocks) that keeps every conversation. Between two turns of a
# conversation the other five evict its prefix from the prefill pools; the
# decode worker still holds it. Off: the prefill worker recomputes the prefix.
# On (router --peer-pull): it pulls the prefix from the decode worker's pool.
# `bench serve` closed loop at concurrency 1, router policy cache_aware.
#   bench/experiments/peer_pull_multiturn.sh [OUT_DIR]   (MODES="off on")
set -u
BIN=${BIN:-build/bin/pdserve}
OUT=${1:-/tmp/peer_pull_multiturn}
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
start() {  # name role pool metrics_port
  $BIN worker --insecure --role "$2" --model "$M" --port 0 --metrics-port "$4" \
    --kv-cache-memory "$3" --threads 2 >"$OUT/$1.log" 2>&1 &
  echo $!
}
addr() {
  for _ in $(seq 300); do grep -q listening "$OUT/$1.log" && break; sleep 0.2; done
  grep -o 'listening on [0-9.:]*' "$OUT/$1.log" | awk '{print $3}'
}
for mode in ${MODES:-off on}; do
  P0=$(start p0_$mode prefill 12MiB 19491)
  P1=$(start p1_$mode prefill 12MiB 19492)
  D0=$(start d0_$mode decode 64MiB 19493)
  A0=$(addr p0_$mode); A1=$(addr p1_$mode); AD=$(addr d0_$mode)
  extra=""
  [ "$mode" = on ] && extra="--peer-pull"
  $BIN router --insecure --model "$M" --port 50591 --metrics-port 19494 \
    --prefill-workers "$A0,$A1" --decode-workers "$AD" $extra \
    >"$OUT/router_$mode.log" 2>&1 &
  RP=$!
  sleep 3
  $BIN bench serve --router 127.0.0.1:50591 --trace "$OUT/trace.jsonl" \
    --concurrency 1 --json >"$OUT/bench_$mode.json"
  for port in 19491 19492 19493; do
    curl -s localhost:$port/metrics | grep -E '^pdserve_(kv_peer_pull|prefix_cache_hit)' | sed "s/^/$port /"
  done >"$OUT/metrics_$mode.txt"
  kill $RP $P0 $P1 $D0; wait $RP $P0 $P1 $D0 2>/dev/null
  echo "== peer pull $mode (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  python3 -c "import json; print(json.load(open('$OUT/bench_$mode.json'))['ttft_s'])"
  cat "$OUT/metrics_$mode.txt"
  sleep 2
done
