#!/usr/bin/env bash
# Prepares (here) and runs (on a lent GPU machine) pdserve's GPU checks.
#
#   scripts/gpu-check.sh build   # here: build the GPU test binaries with CUDA ON and pack
#                                #   them, with every non-system library they load, into
#                                #   .gpu-check/bundle.tar.xz
#   scripts/gpu-check.sh run     # there: unpack, run each binary once (kernel benchmarks
#                                #   included); print PASS/FAIL per binary and the figures
#
# The bundle needs only the CUDA driver and CUDA's own cuBLAS/NCCL on the GPU
# machine (its image has CUDA 13 in /usr/local/cuda and nvidia-* wheels): those
# libraries are hundreds of MB and would not fit the 64 MiB the device tool
# carries. Everything else (OpenBLAS, ICU, Abseil, ...) travels, xz-compressed.
# Run it with the device tool:
#   run(command="bash scripts/gpu-check.sh run", carry=[".gpu-check"], timeout_s=420)
#
# BUILD_DIR picks the build tree (default build-gpu, configured here with CUDA ON;
# BUILD_DIR=build reuses the main tree, built under /tmp/pdserve-build.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.gpu-check
BUILD_DIR=${BUILD_DIR:-build-gpu}
# kernels_cuda_test: every CUDA kernel vs its CPU reference + kernel benchmarks.
# engine_cuda_test: the CUDA backend's greedy tokens vs the CPU backend's, fp8
#   KV vs bf16 KV, the per-layer hooks (cudaEvents), the GPU sampler vs the
#   engine's (engine/cuda_sampling_test.cc), and (PDSERVE_GPU_BENCH=1) the
#   1B-shape benchmark: BENCH prefill tokens/s, decode ITL p50/p99.
# nccl_transport_gpu_test: the NCCL KV transport (kv_transfer/nccl).
# mla_moe_cuda_test: the MLA decode kernel over paged latent blocks and the
#   grouped-expert MoE path vs float64 CPU references.
# worker_gpu_test: GPU prefill + decode workers on one GPU over grpc vs colocated.
# worker_gpu_bench_test: (PDSERVE_GPU_BENCH=1) BENCH TTFT and ITL p50/p99 on the
#   1B shape, colocated vs a one-GPU P/D pair over grpc and over cuda_ipc.
# The two benchmarks share a random Llama-3.2-1B-shaped bf16 model written once
# to /tmp/pdserve-bench-llama3.2-1b (2.5 GB; PDSERVE_BENCH_MODEL_DIR overrides).
TESTS=(kernels_cuda_test engine_cuda_test nccl_transport_gpu_test worker_gpu_test cuda_ipc_gpu_test worker_gpu_bench_test mla_moe_cuda_test)

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
  if flock /tmp/pdserve-build.lock cmake --build "$BUILD_DIR" --target pdserve -j "${JOBS:-$(nproc)}"; then
    HELPER_BINS=(pdserve)
  else
    echo "WARNING: pdserve did not build; the GPU serving tests will skip" >&2
    HELPER_BINS=()
  fi
}

build() {
  grep -qx "/$BUNDLE/" .git/info/exclude 2>/dev/null || echo "/$BUNDLE/" >> .git/info/exclude
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

run() {
  local dir=/tmp/pdserve-gpu-check
  rm -rf "$dir" && mkdir -p "$dir"
  if command -v xz > /dev/null; then
    xz -dc "$BUNDLE/bundle.tar.xz" | tar -C "$dir" -xf -
  else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$BUNDLE/bundle.tar.xz" "$dir"
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
  export PDSERVE_GPU_BENCH=1
  # tests/cluster.h starts worker processes from this binary, not the build
  # tree's path compiled into the tests.
  [ -x "$dir/bin/pdserve" ] && export PDSERVE_BIN="$dir/bin/pdserve"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  local failed=0
  for t in "${TESTS[@]}"; do
    echo "=== $t"
    if [ ! -x "$dir/bin/$t" ]; then
      echo "RESULT $t: MISSING (did not build; see scripts/gpu-check.sh build output)"
      failed=1
      continue
    fi
    local started=$SECONDS
    "$dir/bin/$t" --gtest_color=no > "/tmp/$t.log" 2>&1 || true
    echo "($t took $((SECONDS - started)) s)"
    grep -E '^\[  (PASSED|FAILED|SKIPPED) |^BENCH|Failure|error' "/tmp/$t.log" | head -200 || true
    if grep -q '^\[  FAILED  \]' "/tmp/$t.log" || ! grep -q '^\[  PASSED  \]' "/tmp/$t.log"; then
      echo "RESULT $t: FAIL"; tail -40 "/tmp/$t.log"; failed=1
    else
      echo "RESULT $t: PASS ($(grep -c '^\[  SKIPPED \]' "/tmp/$t.log" || true) skipped)"
    fi
  done
  [ -n "${OUT:-}" ] && cp /tmp/*_test.log "$OUT/" 2>/dev/null || true
  exit $failed
}

case "${1:-}" in
  build) build ;;
  run) run ;;
  *) echo "usage: scripts/gpu-check.sh build|run" >&2; exit 2 ;;
esac
