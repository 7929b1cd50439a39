#!/usr/bin/env bash
# Runs one libFuzzer target for SECONDS over a copy of its seed corpus and
# fails on any crash, sanitizer report, leak or timeout. New inputs go to
# WORK_DIR/corpus (never the source tree); a crashing input is kept as
# WORK_DIR/crash-* and printed as a reproduction command.
# usage: run_fuzz.sh FUZZER SEED_CORPUS_DIR WORK_DIR SECONDS
set -uo pipefail
fuzzer=$1 seeds=$2 work=$3 seconds=${4:-10}
name=$(basename "$fuzzer")
mkdir -p "$work/corpus"
cp -n "$seeds"/* "$work/corpus/" 2>/dev/null || true
log="$work/fuzz.log"
start=$(date +%s.%N)
# -timeout: one input taking over 10 s counts as a hang; -rss_limit_mb bounds
# what one input may allocate; -use_value_profile helps past multi-byte checks.
"$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -use_value_profile=1 \
  -print_final_stats=1 -artifact_prefix="$work/" "$work/corpus" "$seeds" >"$log" 2>&1
rc=$?
end=$(date +%s.%N)
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
files=$(ls "$work/corpus" | wc -l)
secs=$(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}')
rate=$(awk -v r="${runs:-0}" -v s="$secs" 'BEGIN{printf "%.0f", (s>0 ? r/s : 0)}')
if [ $rc -ne 0 ]; then
  echo "FAIL $name: exit $rc after ${secs}s; log: $log"
  grep -m1 -A30 -E 'ERROR: (AddressSanitizer|libFuzzer|LeakSanitizer)|runtime error:' "$log" || tail -40 "$log"
  for a in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
    [ -e "$a" ] && echo "reproduce: $fuzzer $a"
  done
  exit 1
fi
printf 'ok   %-18s %6ss %10s execs %8s execs/s  cov %-6s corpus %s\n' "$name" "$secs" "${runs:-?}" "$rate" "${cov:-?}" "$files"
