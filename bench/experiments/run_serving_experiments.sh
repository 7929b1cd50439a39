#!/usr/bin/env bash
# The disaggregation evidence on this machine, in one go (issue: load generator).
#   1. disaggregated 1 prefill + 1 decode, each pinned to its own core, vs
#      colocated 1 worker --role both on both cores; small model, mixed workload:
#      ITL p99 and goodput.
#   2. prefix cache on vs off, chat workload: TTFT p50/p99.
#   3. cache-aware routing vs round-robin with 2 prefill workers, chat: hit rate, TTFT.
# Writes bench/results/serving-*.json and the "Serving experiments" section of
# bench/RESULTS.md. usage: bench/experiments/run_serving_experiments.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
B=${1:-$ROOT/build}/bin/pdserve
OUT=$ROOT/bench/results
mkdir -p "$OUT"
WORK=$(mktemp -d)
MODEL=$WORK/small
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
"$B" model init --preset small --out "$MODEL" 2>/dev/null

# start NAME CPUS ARGS... -> prints the address; CPUS "" = unpinned
start() {
  local name=$1 cpus=$2; shift 2
  local log=$WORK/$name.log
  if [ -n "$cpus" ]; then taskset -c "$cpus" "$B" "$@" > "$log" 2>&1 & else "$B" "$@" > "$log" 2>&1 & fi
  PIDS+=($!)
  for _ in $(seq 1 300); do
    if grep -q "listening on" "$log"; then sed -n 's/.*listening on \([^ ]*\).*/\1/p' "$log" | head -1; return; fi
    sleep 0.1
  done
  echo "$name did not start:" >&2; cat "$log" >&2; exit 1
}
stop_all() { for p in "${PIDS[@]:-}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; PIDS=(); }
wait_ready() { sleep 1.5; }
bench() { local name=$1; shift; echo "[experiments] $name" >&2; "$B" bench serve "$@" --json > "$OUT/serving-$name.json"; }
ENGINE=(--model "$MODEL" --port 0 --metrics-port 0 --kv-cache-memory 512MiB)
MIXED=(--workload mixed --num-requests 24 --input-len 64 --output-len 32 --slo-ttft 2 --slo-itl 0.1 --seed 7)

# 1. disaggregated (pinned) vs colocated, mixed workload.
P=$(start prefill 0 prefill "${ENGINE[@]}" --threads 1)
D=$(start decode 1 decode "${ENGINE[@]}" --threads 1)
R=$(start router "" router --model "$MODEL" --port 0 --metrics-port 0 --prefill-workers "$P" --decode-workers "$D")
wait_ready
bench disagg-mixed --router "$R" "${MIXED[@]}" --rate 2 --goodput --max-rate 8
stop_all
W=$(start both 0,1 worker --role both "${ENGINE[@]}" --threads 2)
R=$(start router "" router --model "$MODEL" --port 0 --metrics-port 0 --both-workers "$W")
wait_ready
bench coloc-mixed --router "$R" "${MIXED[@]}" --rate 2 --goodput --max-rate 8
stop_all

# 2. prefix cache on vs off, chat workload (colocated worker, both cores).
CHAT=(--workload chat --num-requests 32 --input-len 96 --output-len 16 --concurrency 2 --seed 11)
for mode in on off; do
  flag=true; [ $mode = off ] && flag=false
  W=$(start both-$mode 0,1 worker --role both "${ENGINE[@]}" --threads 2 --enable-prefix-caching=$flag)
  R=$(start router "" router --model "$MODEL" --port 0 --metrics-port 0 --both-workers "$W")
  wait_ready
  bench prefix-$mode --router "$R" "${CHAT[@]}"
  stop_all
done

# 3. cache-aware vs round-robin routing with 2 prefill workers, chat workload.
for policy in cache_aware round_robin; do
  P1=$(start p1-$policy 0 prefill "${ENGINE[@]}" --threads 1)
  P2=$(start p2-$policy 1 prefill "${ENGINE[@]}" --threads 1)
  D=$(start d-$policy "" decode "${ENGINE[@]}" --threads 1)
  R=$(start router-$policy "" router --model "$MODEL" --port 0 --metrics-port 0 --policy $policy \
      --prefill-workers "$P1,$P2" --decode-workers "$D" --local-prefill-threshold=-1)
  wait_ready
  bench routing-$policy --router "$R" "${CHAT[@]}"
  stop_all
done

/usr/bin/python3 "$ROOT/bench/experiments/write_results.py" "$OUT" "$ROOT/bench/RESULTS.md"
