#!/usr/bin/env bash
# `pdserve up` on one host: 1 prefill + 1 decode worker against one colocated
# worker, alternating, REPS rounds; prints one line per run with the 1-minute
# load, output tokens/s and ITL p50/p99 from `pdserve bench serve --json`.
# usage: bench/experiments/up_disagg_vs_coloc.sh [PDSERVE_BIN] [MODEL_DIR] [REPS]
#   extra binaries to compare (e.g. an older build) in $OTHER_BINS, each run
#   disaggregated in the same rounds; $NUM_REQUESTS (24) and $CONCURRENCY (4)
#   size the closed-loop `mixed` workload; $UP_ARGS adds arguments to every
#   run's `pdserve up` command line (e.g. "--weight-dtype int8"), so that
#   both setups use them; $SPLIT_UP_ARGS adds arguments to the 1P+1D runs'
#   `pdserve up` command line, and with '|' between sets (e.g. "|--threads
#   1") runs 1P+1D once per set in every round.
set -euo pipefail
B=${1:-build/bin/pdserve}
WORK=$(mktemp -d)
MODEL=${2:-$WORK/small}
REPS=${3:-3}
PY=/usr/bin/python3
UP_PID=
cleanup() { [ -n "$UP_PID" ] && kill "$UP_PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
[ -f "$MODEL/config.json" ] || "$B" model init --preset small --out "$MODEL" > /dev/null 2>&1
WORKLOAD=(--workload mixed --num-requests "${NUM_REQUESTS:-24}" --input-len 64 --output-len 32
  --concurrency "${CONCURRENCY:-4}" --seed 7)

run() {  # run NAME BIN PREFILL_WORKERS [ARGS...]
  local name=$1 bin=$2 prefill=$3 log=$WORK/up.log
  shift 3
  # shellcheck disable=SC2086  # UP_ARGS is a list of words
  "$bin" up --model "$MODEL" --prefill "$prefill" --decode 1 --port 0 --metrics-port 0 \
    --http-port 0 --kv-cache-memory 512MiB ${UP_ARGS:-} "$@" > "$log" 2>&1 &
  UP_PID=$!
  local addr=
  for _ in $(seq 1 600); do
    addr=$(sed -n 's/^  router *grpc \([^ ]*\).*/\1/p' "$log" | head -1)
    [ -n "$addr" ] && break
    sleep 0.1
  done
  [ -n "$addr" ] || { echo "up did not start:" >&2; cat "$log" >&2; exit 1; }
  local load
  load=$(cut -d' ' -f1 /proc/loadavg)
  "$bin" bench serve --router "$addr" "${WORKLOAD[@]}" --json 2> "$WORK/bench.err" | $PY -c '
import json, sys
r = json.load(sys.stdin)
print("%s load=%s out_tok/s=%.2f itl_p50_ms=%.1f itl_p99_ms=%.1f ttft_p50_ms=%.0f failed=%d" % (
    sys.argv[1], sys.argv[2], r["output_tokens_per_s"], 1e3 * r["itl_s"]["p50"],
    1e3 * r["itl_s"]["p99"], 1e3 * r["ttft_s"]["p50"], r["failed"]))' "$name" "$load"
  kill "$UP_PID"
  wait "$UP_PID" 2> /dev/null || true
  UP_PID=
}

for rep in $(seq 1 "$REPS"); do
  run "round $rep colocated" "$B" 0
  IFS='|' read -r -a split_sets <<< "${SPLIT_UP_ARGS:-}"
  [ ${#split_sets[@]} -eq 0 ] && split_sets=("")
  for args in "${split_sets[@]}"; do
    # shellcheck disable=SC2086
    run "round $rep 1P+1D${args:+ ($args)}" "$B" 1 $args
    # shellcheck disable=SC2086
    for other in ${OTHER_BINS:-}; do run "round $rep 1P+1D${args:+ ($args)} ($other)" "$other" 1 $args; done
  done
done
