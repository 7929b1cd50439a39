#!/usr/bin/env bash
# Prepares (here) and runs (on a lent GPU machine) pdserve's GPU checks.
# `scripts/gpu-check.sh --help` prints the first-run playbook.
#
#   scripts/gpu-check.sh build        # here: build the GPU binaries with CUDA ON and
#                                     #   pack them, with every non-system library they
#                                     #   load, into .gpu-check/bundle.tar.xz
#   scripts/gpu-check.sh run [--bench]  # there: probe the device, then run each binary
#   scripts/gpu-check.sh list         # the binaries run checks, cheapest first
#
# The bundle needs only the CUDA driver and CUDA's own cuBLAS/NCCL on the GPU
# machine (its image has CUDA 13 in /usr/local/cuda and nvidia-* wheels): those
# libraries are hundreds of MB and would not fit the 64 MiB the device tool
# carries. Everything else (OpenBLAS, ICU, Abseil, ...) travels, xz-compressed.
#
# BUILD_DIR picks the build tree (default build-gpu, configured here with CUDA ON;
# BUILD_DIR=build reuses the main tree, built under /tmp/pdserve-build.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.gpu-check
BUILD_DIR=${BUILD_DIR:-build-gpu}

# Every ctest target labelled gpu, cheapest first, with its expected wall
# time on one H200 in seconds (an estimate from what each does: nothing has
# run on a GPU yet; replace with measured times after the first run).
# tests/gpu_check/test_gpu_check.py fails when a gpu-labelled target of any
# CMakeLists.txt is missing here, or one here is not a gpu-labelled target.
#   kernels_cuda_test       every CUDA kernel vs its CPU reference (prefill vs
#                           float64 over chunks, prefix hits, head_dim 64/128,
#                           8k contexts, peaked scores) + kernel benchmarks
#   mla_moe_cuda_test       MLA decode over paged latent blocks, grouped-expert
#                           MoE, vs float64 CPU references
#   kv_tier_gpu_test        the pinned-host KV tier over device KV blocks
#   nccl_transport_gpu_test the NCCL KV transport (two-GPU cases skip on one)
#   cuda_ipc_gpu_test       cuda_ipc: a pattern per (layer, block) checked span by
#                           span; a P/D pair on one GPU with fp32/int8/fp8 KV
#   engine_cuda_test        CUDA backend vs CPU backend (tokens, logits, fp8 and
#                           int8 KV), layer hooks, GPU sampler vs the engine's;
#                           --bench: the 1B-shape prefill/decode benchmark
#   worker_gpu_test         GPU prefill + decode workers over grpc vs colocated,
#                           fp32, int8 and fp8 KV
#   worker_gpu_bench_test   (--bench only) TTFT/ITL, colocated vs P/D pairs
# The benchmarks share a random Llama-3.2-1B-shaped bf16 model written once
# to /tmp/pdserve-bench-llama3.2-1b (2.5 GB; PDSERVE_BENCH_MODEL_DIR overrides).
TESTS=(kernels_cuda_test mla_moe_cuda_test kv_tier_gpu_test nccl_transport_gpu_test
       cuda_ipc_gpu_test engine_cuda_test worker_gpu_test worker_gpu_bench_test)
declare -A EXPECTED_S=(
  [kernels_cuda_test]=60 [mla_moe_cuda_test]=15 [kv_tier_gpu_test]=10
  [nccl_transport_gpu_test]=15 [cuda_ipc_gpu_test]=45 [engine_cuda_test]=60
  [worker_gpu_test]=120 [worker_gpu_bench_test]=150)
# Binaries that are benchmarks only: run with --bench.
BENCH_ONLY=(worker_gpu_bench_test)

usage() {
  cat <<'HELP'
scripts/gpu-check.sh build | run [--bench] | list | --help

FIRST-RUN PLAYBOOK (one H200, 15 minutes of device time for all tries,
a machine start costs 1-2 minutes; plan two tries).

Here, before asking for a device:
  1. scripts/gpu-check.sh build        (30-60 min on 2 cores; ccache helps)
     It must end "bundle ready"; a WARNING that a binary did not build means
     the run will report it MISSING (a FAIL): fix that first.
  2. Nothing else to prepare: the bundle is .gpu-check/ (under 60 MiB).

Try 1 (about 7 minutes of device time with the start; the binaries sum to ~5.5):
  run(command="bash scripts/gpu-check.sh run", carry=[".gpu-check"], timeout_s=480)
  It prints, in this order:
    - the driver and runtime versions and each device (gpu_probe). If it
      says NO DEVICE the check stops there and FAILS: driver older than the
      runtime -> rebuild with the machine's CUDA; no device -> the container
      has none (call give_back, report it, do not retry); probe kernel
      launch failed (no kernel image) -> CMAKE_CUDA_ARCHITECTURES lacks 90.
    - per binary, cheapest first (expected wall time on one H200, an
      estimate until measured):
        kernels_cuda_test        ~60 s   kernels vs CPU/float64 references
        mla_moe_cuda_test        ~15 s
        kv_tier_gpu_test         ~10 s
        nccl_transport_gpu_test  ~15 s
        cuda_ipc_gpu_test        ~45 s   starts worker processes
        engine_cuda_test         ~60 s
        worker_gpu_test          ~120 s  starts worker processes (6 KV cases)
        worker_gpu_bench_test    ~150 s  --bench only
      "RESULT name: PASS|FAIL ran N, skipped S, failed F (T s)" and the
      name and reason of every skipped test. Each binary is killed after
      3x its expected time (at least 60 s), so one hang costs minutes, not
      the try.
    - "GPU CHECK: PASS" only when every binary ran at least one test, not
      all of a binary's tests skipped, none failed, none crashed or timed
      out, and a device was visible. Anything else is "GPU CHECK: FAIL".
  The logs of every binary come back under $OUT (<binary>.log).
  Then give_back unless try 2 follows at once.

When one fails:
  - FAILED tests: read its log's first failure (file:line and values). A
    kernel-vs-reference mismatch names the case (chunk, head_dim, context,
    dtype) and the worst element; fix here, rebuild only that binary's
    targets, rebuild the bundle.
  - crashed (no gtest summary) or timed out: the log's tail; an illegal
    address usually means an index or a launch bound; rerun that binary
    alone under compute-sanitizer in try 2 (it works on Firecracker
    machines):
      GPU_CHECK_ONLY=kernels_cuda_test GPU_CHECK_WRAP=compute-sanitizer \
        bash scripts/gpu-check.sh run
  - all skipped / ran 0: the skip reasons are printed; usually the device
    or the pdserve binary (PDSERVE_BIN) is not visible to that binary.
  - MISSING: it did not build here; see the build output.

Try 2 (what is left, about 6 minutes): only what failed, after the fix,
  and the benchmarks if time allows:
  run(command="GPU_CHECK_ONLY='engine_cuda_test worker_gpu_test' bash scripts/gpu-check.sh run",
      carry=[".gpu-check"], timeout_s=420)
  run(command="bash scripts/gpu-check.sh run --bench", carry=[".gpu-check"], timeout_s=540)
  (--bench adds worker_gpu_bench_test, ~150 s, and the benchmark tests of
  kernels_cuda_test and engine_cuda_test, which write a 2.5 GB model once.)

Environment: GPU_CHECK_ONLY="a b" runs only those binaries;
GPU_CHECK_WRAP="cmd" prefixes each binary (e.g. compute-sanitizer);
GPU_CHECK_BIN_DIR=dir runs binaries from dir/bin instead of the bundle
(tests use it with fake binaries); GPU_CHECK_TIMEOUT_SCALE=k scales the
per-binary time limits.
HELP
}

build_targets() {
  if [ "$BUILD_DIR" != build ]; then
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPDSERVE_CUDA=ON \
          -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > /dev/null
  fi
  local built=()
  for t in "${TESTS[@]}"; do
    # One target at a time, so that a target another change breaks does not
    # hold back the others; a missing one is reported at run time.
    if flock /tmp/pdserve-build.lock cmake --build "$BUILD_DIR" --target "$t" -j "${JOBS:-$(nproc)}"; then
      built+=("$t")
    else
      echo "WARNING: $t did not build; it is left out of the bundle" >&2
    fi
  done
  BUILT=("${built[@]}")
  # The serving GPU tests start real worker processes: the bundle carries the
  # pdserve binary too, and run() points them at it with PDSERVE_BIN.
  HELPER_BINS=()
  if flock /tmp/pdserve-build.lock cmake --build "$BUILD_DIR" --target pdserve -j "${JOBS:-$(nproc)}"; then
    HELPER_BINS+=(pdserve)
  else
    echo "WARNING: pdserve did not build; the GPU serving tests will fail" >&2
  fi
  # The device probe run() starts with; without it run() fails at once.
  if flock /tmp/pdserve-build.lock cmake --build "$BUILD_DIR" --target gpu_probe -j "${JOBS:-$(nproc)}"; then
    HELPER_BINS+=(gpu_probe)
  else
    echo "WARNING: gpu_probe did not build; run will fail" >&2
  fi
}

build() {
  # .git is a file in a worktree: ask git where its exclude file is.
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx "/$BUNDLE/" "$exclude" 2>/dev/null || echo "/$BUNDLE/" >> "$exclude"
  build_targets
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib"
  for t in "${BUILT[@]}" "${HELPER_BINS[@]}"; do
    cp "$BUILD_DIR/bin/$t" "$stage/bin/"
    # Every shared library except the C runtime, the CUDA driver, and CUDA's
    # big libraries (taken from the GPU machine, see above).
    ldd "$BUILD_DIR/bin/$t" | awk '/=> \// {print $3}' | while read -r lib; do
      case "$(basename "$lib")" in
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*) ;;
        libnccl.so*|libcublas.so*|libcublasLt.so*) ;;
        *) cp -nL "$lib" "$stage/lib/" ;;
      esac
    done
  done
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE"
  tar -C "$stage" -cf - bin lib | xz -T2 -6 > "$BUNDLE/bundle.tar.xz"
  printf '%s\n' "${BUILT[@]}" > "$BUNDLE/tests.txt"
  rm -rf "$stage"
  du -sh "$BUNDLE"
  if [ "$(du -sm "$BUNDLE" | cut -f1)" -gt 60 ]; then
    echo "bundle is over the 64 MiB the device tool carries" >&2
    exit 1
  fi
  echo "bundle ready: run it on the GPU machine with carry=[\"$BUNDLE\"] and command 'bash scripts/gpu-check.sh run'"
}

# Reads a gtest log and prints "ran skipped failed" (ran -1 when the binary
# printed no final summary: it crashed, hung or is not a gtest binary).
gtest_counts() {
  local log=$1 ran skipped failed
  ran=$(sed -nE 's/^\[==========\] ([0-9]+) tests? from .* ran\..*/\1/p' "$log" | tail -1)
  skipped=$(sed -nE 's/^\[  SKIPPED \] ([0-9]+) tests?, listed below:.*/\1/p' "$log" | tail -1)
  failed=$(sed -nE 's/^\[  FAILED  \] ([0-9]+) tests?, listed below:.*/\1/p' "$log" | tail -1)
  echo "${ran:--1} ${skipped:-0} ${failed:-0}"
}

# Runs one binary and prints its RESULT line; returns 1 on FAIL.
run_one() {
  local dir=$1 t=$2 logdir=$3
  local bin="$dir/bin/$t" log="$logdir/$t.log"
  echo "=== $t"
  if [ ! -x "$bin" ]; then
    echo "RESULT $t: FAIL MISSING (did not build; see scripts/gpu-check.sh build output)"
    return 1
  fi
  local expected=${EXPECTED_S[$t]:-60}
  local limit=$(( expected * 3 * ${GPU_CHECK_TIMEOUT_SCALE:-1} ))
  [ "$limit" -lt 60 ] && limit=60
  local started=$SECONDS rc=0
  # shellcheck disable=SC2086  # GPU_CHECK_WRAP is a command line
  timeout --kill-after=10 "$limit" ${GPU_CHECK_WRAP:-} "$bin" --gtest_color=no > "$log" 2>&1 || rc=$?
  local took=$((SECONDS - started))
  local ran skipped failed
  read -r ran skipped failed < <(gtest_counts "$log")
  grep -E '^BENCH' "$log" || true
  # Every skip with its reason: gtest prints "file:line: Skipped" and the
  # reason on the next line, then "[  SKIPPED ] Suite.Test".
  grep -E -A1 ': Skipped$' "$log" | grep -vE ': Skipped$|^--$' | sort | uniq -c | \
    sed 's/^/  skip reason: /' || true
  grep -E '^\[  SKIPPED \] [A-Za-z_0-9]+\.' "$log" | sed 's/^/  /' || true
  local verdict=PASS why=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    verdict=FAIL why=" TIMED OUT after ${limit} s"
  elif [ "$ran" -lt 0 ]; then
    verdict=FAIL why=" CRASHED (exit $rc, no gtest summary)"
  elif [ "$failed" -gt 0 ]; then
    verdict=FAIL why=""
  elif [ "$rc" -ne 0 ]; then
    verdict=FAIL why=" (exit $rc)"
  elif [ "$ran" -eq 0 ]; then
    verdict=FAIL why=" RAN NO TESTS"
  elif [ "$skipped" -ge "$ran" ]; then
    verdict=FAIL why=" EVERY TEST SKIPPED"
  elif grep -qE '^no CUDA device|NO DEVICE' "$log"; then
    verdict=FAIL why=" A TEST SAW NO DEVICE"
  fi
  echo "RESULT $t: $verdict ran $((ran < 0 ? 0 : ran)), skipped $skipped, failed $failed ($took s; expected ~$expected s)$why"
  if [ "$verdict" = FAIL ]; then
    grep -E 'Failure|error:|Error|\[  FAILED  \]' "$log" | head -40 || true
    echo "--- last lines of $t.log"
    tail -30 "$log"
    return 1
  fi
  return 0
}

run() {
  local bench=0
  [ "${1:-}" = --bench ] && bench=1
  local dir
  if [ -n "${GPU_CHECK_BIN_DIR:-}" ]; then
    dir=$GPU_CHECK_BIN_DIR
  else
    dir=/tmp/pdserve-gpu-check
    rm -rf "$dir" && mkdir -p "$dir"
    if command -v xz > /dev/null; then
      xz -dc "$BUNDLE/bundle.tar.xz" | tar -C "$dir" -xf -
    else
      python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$BUNDLE/bundle.tar.xz" "$dir"
    fi
  fi
  # CUDA's cuBLAS and NCCL: the toolkit's, else the nvidia-* Python wheels'.
  local extra
  extra=$(python3 - <<'PY' 2>/dev/null || true
import importlib, os
dirs = []
for mod in ("nvidia.cublas", "nvidia.nccl", "nvidia.cu13", "nvidia.cuda_runtime"):
    try:
        m = importlib.import_module(mod)
        for p in m.__path__:
            for sub in ("lib", "lib64"):
                if os.path.isdir(os.path.join(p, sub)):
                    dirs.append(os.path.join(p, sub))
    except Exception:
        pass
print(":".join(dirs))
PY
)
  export LD_LIBRARY_PATH="$dir/lib:/usr/local/cuda/lib64:${extra}:${LD_LIBRARY_PATH:-}"
  if [ "$bench" = 1 ]; then export PDSERVE_GPU_BENCH=1; else unset PDSERVE_GPU_BENCH; fi
  # tests/cluster.h starts worker processes from this binary, not the build
  # tree's path compiled into the tests.
  [ -x "$dir/bin/pdserve" ] && export PDSERVE_BIN="$dir/bin/pdserve"
  local logdir=${OUT:-/tmp/pdserve-gpu-check-logs}
  mkdir -p "$logdir"

  # Versions and devices first; without a device nothing else runs.
  echo "=== device"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
  else
    echo "nvidia-smi: not found"
  fi
  if [ ! -x "$dir/bin/gpu_probe" ]; then
    echo "RESULT gpu_probe: FAIL MISSING"
    echo "GPU CHECK: FAIL (no device probe in the bundle; nothing ran)"
    return 1
  fi
  if ! "$dir/bin/gpu_probe" 2>&1 | tee "$logdir/gpu_probe.log"; then
    echo "RESULT gpu_probe: FAIL"
    echo "GPU CHECK: FAIL (no usable device; nothing ran)"
    return 1
  fi
  echo "RESULT gpu_probe: PASS"

  local selected=("${TESTS[@]}")
  # shellcheck disable=SC2206  # a space-separated list
  [ -n "${GPU_CHECK_ONLY:-}" ] && selected=(${GPU_CHECK_ONLY})
  local failed=() passed=0
  for t in "${selected[@]}"; do
    if [ "$bench" = 0 ] && [ -z "${GPU_CHECK_ONLY:-}" ] && \
       [[ " ${BENCH_ONLY[*]} " == *" $t "* ]]; then
      echo "=== $t: benchmark only, run with --bench"
      continue
    fi
    if run_one "$dir" "$t" "$logdir"; then
      passed=$((passed + 1))
    else
      failed+=("$t")
    fi
  done
  if [ "$passed" -eq 0 ] && [ "${#failed[@]}" -eq 0 ]; then
    echo "GPU CHECK: FAIL (no binary selected)"
    return 1
  fi
  if [ "${#failed[@]}" -gt 0 ]; then
    echo "GPU CHECK: FAIL (${#failed[@]} failed: ${failed[*]}; $passed passed)"
    return 1
  fi
  echo "GPU CHECK: PASS ($passed binaries)"
}

case "${1:-}" in
  build) build ;;
  run) shift; run "$@" ;;
  list) printf '%s\n' "${TESTS[@]}" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
