#!/bin/bash
# Live TTFT with the KV tier off, on disk and in host memory (bench/RESULTS.md,
# "KV tier"): one colocated `small` worker (fp32 KV, 8 KiB/token) whose pool
# (POOL, default 12 MiB = 96 blocks = 1,536 tokens) is too small for the
# conversations of `bench serve --workload multiturn` (N requests = N / 6
# conversations of 6 turns, interleaved round-robin; turn 0 is INPUT_LEN
# tokens, each follow-up reuses 0.75-0.95 of its prompt, median 0.85), a
# router in front, closed loop at concurrency 1, OUTPUT_LEN tokens each.
# Between two turns of a conversation the others evict its prefix from the
# pool; with a tier it comes back from disk (disk) or host memory (mem)
# instead of being recomputed (off).
#   bench/experiments/kv_tier_multiturn.sh [OUT_DIR]
#   env: BIN (use a private copy: others relink build/bin), RUNS=2,
#        MODES="off disk mem", N=36, INPUT_LEN=448, OUTPUT_LEN=8, SEED=1,
#        POOL=12MiB, THREADS=1 (kernel threads per worker: on the shared
#        2-core VM a second OpenMP thread is often descheduled, and every
#        parallel region then waits for it; that fixed cost per forward pass
#        swamps short prefills such as a tier hit's: RESULTS.md)
# Prints one table row per (run, mode), ratios against the same run's off.
set -u
BIN=${BIN:-build/bin/pdserve}
OUT=${1:-/tmp/kv_tier_multiturn}
RUNS=${RUNS:-2}
MODES=${MODES:-off disk mem}
N=${N:-36}
INPUT_LEN=${INPUT_LEN:-448}
OUTPUT_LEN=${OUTPUT_LEN:-8}
SEED=${SEED:-1}
POOL=${POOL:-12MiB}
THREADS=${THREADS:-1}
mkdir -p "$OUT"
M=$OUT/small
[ -d "$M" ] || $BIN model init --preset small --out "$M" >/dev/null
for run in $(seq "$RUNS"); do
  for mode in $MODES; do
    tag=${mode}_$run
    rm -rf "$OUT/tier"; mkdir -p "$OUT/tier"
    extra=""
    [ "$mode" = disk ] && extra="--kv-offload-dir $OUT/tier --kv-offload-bytes 1GiB"
    [ "$mode" = mem ] && extra="--kv-offload-memory 1GiB"
    $BIN worker --insecure --role both --model "$M" --port 0 --metrics-port 19481 \
      --kv-cache-memory "$POOL" --threads "$THREADS" $extra >"$OUT/worker_$tag.log" 2>&1 &
    WP=$!
    for _ in $(seq 300); do grep -q listening "$OUT/worker_$tag.log" && break; sleep 0.2; done
    ADDR=$(grep -o 'listening on [0-9.:]*' "$OUT/worker_$tag.log" | awk '{print $3}')
    $BIN router --insecure --model "$M" --port 50581 --metrics-port 19482 \
      --both-workers "$ADDR" >"$OUT/router_$tag.log" 2>&1 &
    RP=$!
    # Until the router has polled the worker (a loaded machine is slow).
    for _ in $(seq 50); do
      curl -s localhost:19482/metrics | grep -q '^pdserve_workers{.*state="up".*} [1-9]' && break
      sleep 0.2
    done
    cut -d' ' -f1 /proc/loadavg >"$OUT/load_$tag.txt"
    $BIN bench serve --router 127.0.0.1:50581 --workload multiturn \
      --num-requests "$N" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --seed "$SEED" --concurrency 1 --json >"$OUT/bench_$tag.json"
    cut -d' ' -f1 /proc/loadavg >>"$OUT/load_$tag.txt"
    curl -s localhost:19481/metrics | grep -E '^pdserve_(kv_tier|prefix_cache)' >"$OUT/metrics_$tag.txt"
    # The router's own TTFT (from its receiving the call to the first token
    # it sends): the rest of bench serve's TTFT is the client and the wire.
    curl -s localhost:19482/metrics | grep -E '^pdserve_time_to_first_token_seconds_(sum|count)' >>"$OUT/metrics_$tag.txt"
    kill $RP $WP; wait $RP $WP 2>/dev/null
    echo "== run $run, tier $mode (load $(tr '\n' ' ' <"$OUT/load_$tag.txt"))" >&2
    sleep 2
  done
done
python3 - "$OUT" "$RUNS" "$MODES" <<'PY'
import json, re, sys
out, runs, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def metric(tag, name):
    total = 0.0
    for line in open(f"{out}/metrics_{tag}.txt"):
        if re.match(name + r"(\{|\s)", line):
            total += float(line.split()[-1])
    return total
print("| run | tier | load (start-end) | TTFT p50 | p90 | p99 | mean | p50 vs off | p99 vs off "
      "| router TTFT mean | cached tokens | from the tier | tier load time | ok |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
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
        tier = int(metric(tag, "pdserve_kv_tier_hit_tokens_total"))
        load_s = metric(tag, "pdserve_kv_tier_load_seconds_total")
        n = metric(tag, "pdserve_time_to_first_token_seconds_count")
        router = metric(tag, "pdserve_time_to_first_token_seconds_sum") / max(n, 1)
        print(f"| {run} | {mode} | {load} | {t['p50']:.3f} s | {t['p90']:.3f} s | "
              f"{t['p99']:.3f} s | {t['mean']:.3f} s | {vs} | {router:.3f} s | "
              f"{b['cached_prompt_tokens']:,} of {b['prompt_tokens']:,} | {tier:,} | "
              f"{load_s:.3f} s | {b['succeeded']}/{b['requests']} |")
PY
