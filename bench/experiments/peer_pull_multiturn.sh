#!/bin/bash
# Live TTFT with peer pull off and on (bench/RESULTS.md, "Peer pull"): two
# `small` prefill workers whose pools (POOL, default 12 MiB = 96 blocks =
# 1,536 tokens each) are too small for the conversations of `bench serve
# --workload multiturn` (N requests = N / 6 conversations of 6 turns,
# interleaved round-robin; turn 0 is INPUT_LEN tokens, each follow-up reuses
# 0.75-0.95 of its prompt), and one decode worker with a larger pool (64 MiB =
# 512 blocks) that keeps every conversation. Between two turns of a
# conversation the others evict its prefix from the prefill pools; the decode
# worker still holds it. Off: the prefill worker recomputes the prefix. On
# (router --peer-pull): it pulls the prefix from the decode worker's pool.
# `bench serve` closed loop at concurrency 1, router policy cache_aware.
#   bench/experiments/peer_pull_multiturn.sh [OUT_DIR]
#   env: BIN (use a private copy), RUNS=2, MODES="off on", N=36,
#        INPUT_LEN=448, OUTPUT_LEN=8, SEED=1, POOL=12MiB, THREADS=1 (kernel
#        threads per worker; see kv_tier_multiturn.sh)
# Prints one table row per (run, mode), ratios against the same run's off.
set -u
BIN=${BIN:-build/bin/pdserve}
OUT=${1:-/tmp/peer_pull_multiturn}
RUNS=${RUNS:-2}
MODES=${MODES:-off on}
N=${N:-36}
INPUT_LEN=${INPUT_LEN:-448}
OUTPUT_LEN=${OUTPUT_LEN:-8}
SEED=${SEED:-1}
POOL=${POOL:-12MiB}
THREADS=${THREADS:-1}
mkdir -p "$OUT"
M=$OUT/small
[ -d "$M" ] || $BIN model init --preset small --out "$M" >/dev/null
start() {  # name role pool metrics_port
  $BIN worker --insecure --role "$2" --model "$M" --port 0 --metrics-port "$4" \
    --kv-cache-memory "$3" --threads "$THREADS" >"$OUT/$1.log" 2>&1 &
  echo $!
}
addr() {
  for _ in $(seq 300); do grep -q listening "$OUT/$1.log" && break; sleep 0.2; done
  grep -o 'listening on [0-9.:]*' "$OUT/$1.log" | awk '{print $3}'
}
for run in $(seq "$RUNS"); do
  for mode in $MODES; do
    tag=${mode}_$run
    P0=$(start p0_$tag prefill "$POOL" 19491)
    P1=$(start p1_$tag prefill "$POOL" 19492)
    D0=$(start d0_$tag decode 64MiB 19493)
    A0=$(addr p0_$tag); A1=$(addr p1_$tag); AD=$(addr d0_$tag)
    extra=""
    [ "$mode" = on ] && extra="--peer-pull"
    $BIN router --insecure --model "$M" --port 50591 --metrics-port 19494 \
      --prefill-workers "$A0,$A1" --decode-workers "$AD" $extra \
      >"$OUT/router_$tag.log" 2>&1 &
    RP=$!
    for _ in $(seq 50); do
      [ "$(curl -s localhost:19494/metrics | grep -c '^pdserve_workers{.*state="up".*} [1-9]')" -ge 2 ] && break
      sleep 0.2
    done
    cut -d' ' -f1 /proc/loadavg >"$OUT/load_$tag.txt"
    $BIN bench serve --router 127.0.0.1:50591 --workload multiturn \
      --num-requests "$N" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --seed "$SEED" --concurrency 1 --json >"$OUT/bench_$tag.json"
    cut -d' ' -f1 /proc/loadavg >>"$OUT/load_$tag.txt"
    for port in 19491 19492 19493; do
      curl -s localhost:$port/metrics | grep -E '^pdserve_(kv_peer_pull|prefix_cache_hit)' | sed "s/^/$port /"
    done >"$OUT/metrics_$tag.txt"
    kill $RP $P0 $P1 $D0; wait $RP $P0 $P1 $D0 2>/dev/null
    echo "== run $run, peer pull $mode (load $(tr '\n' ' ' <"$OUT/load_$tag.txt"))" >&2
    sleep 2
  done
done
python3 - "$OUT" "$RUNS" "$MODES" <<'PY'
import json, re, sys
out, runs, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def metric(tag, name, ports=("19491", "19492"), label=""):
    total = 0.0
    for line in open(f"{out}/metrics_{tag}.txt"):
        port, rest = line.split(" ", 1)
        if port in ports and re.match(name + r"(\{|\s)", rest) and label in rest:
            total += float(rest.split()[-1])
    return total
print("| run | peer pull | load (start-end) | TTFT p50 | p90 | p99 | mean | p50 vs off "
      "| p99 vs off | pulls | prefill-worker prefix hits | ok |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for run in range(1, runs + 1):
    # Off of the same run, whichever order MODES ran in.
    off = (json.load(open(f"{out}/bench_off_{run}.json"))["ttft_s"]
           if "off" in modes else None)
    for mode in modes:
        tag = f"{mode}_{run}"
        b = json.load(open(f"{out}/bench_{tag}.json"))
        t = b["ttft_s"]
        load = "-".join(open(f"{out}/load_{tag}.txt").read().split())
        vs = (f"{off['p50'] / t['p50']:.2f}x | {off['p99'] / t['p99']:.2f}x"
              if off and mode != "off" else " | ")
        pulls = int(metric(tag, "pdserve_kv_peer_pull_total", label='outcome="pulled"'))
        hits = int(metric(tag, "pdserve_prefix_cache_hit_tokens_total"))
        print(f"| {run} | {mode} | {load} | {t['p50']:.3f} s | {t['p90']:.3f} s | "
              f"{t['p99']:.3f} s | {t['mean']:.3f} s | {vs} | {pulls} | "
              f"{hits:,} tokens | {b['succeeded']}/{b['requests']} |")
PY
