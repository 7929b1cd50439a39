#!/usr/bin/env bash
# Prepares (here) and runs (on a lent GPU machine) pdserve's GPU checks.
#
#   scripts/gpu-check.sh build   # here: build the GPU test binaries with CUDA ON and bundle
#                                #   them with every non-system library they load into .gpu-check/
#   scripts/gpu-check.sh run     # there: run each binary once; print PASS/FAIL and figures
#
# The bundle needs only the CUDA driver on the GPU machine. Run it with the
# device tool:  run(command="bash scripts/gpu-check.sh run", carry=[".gpu-check"], timeout_s=300)
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.gpu-check
TESTS=(kernels_cuda_test nccl_transport_gpu_test)

build() {
  grep -qx "/$BUNDLE/" .git/info/exclude 2>/dev/null || echo "/$BUNDLE/" >> .git/info/exclude
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPDSERVE_CUDA=ON \
        -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > /dev/null
  ninja -C build-gpu -j "$(nproc)" "${TESTS[@]}"
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
  for t in "${TESTS[@]}"; do
    cp "build-gpu/bin/$t" "$BUNDLE/bin/"
    # Every shared library except the C runtime and the CUDA driver (the GPU
    # machine has its own driver matching its kernel module).
    ldd "build-gpu/bin/$t" | awk '/=> \// {print $3}' | while read -r lib; do
      case "$(basename "$lib")" in
        # libnccl (200+ MB) is taken from the GPU machine's own NCCL (its
        # Python image ships nvidia-nccl-cu13), keeping the bundle small.
        libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*|libnccl.so*) ;;
        *) cp -nL "$lib" "$BUNDLE/lib/" ;;
      esac
    done
  done
  du -sh "$BUNDLE"
  if [ "$(du -sm "$BUNDLE" | cut -f1)" -gt 60 ]; then
    echo "bundle is over the 64 MiB the device tool carries" >&2
    exit 1
  fi
  echo "bundle ready: run it on the GPU machine with carry=[\"$BUNDLE\"] and command 'bash scripts/gpu-check.sh run'"
}

run() {
  local nccl_dir
  nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
  export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib:${nccl_dir}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  local failed=0
  for t in "${TESTS[@]}"; do
    echo "=== $t"
    if "$BUNDLE/bin/$t" --gtest_color=no 2>&1 | tee "/tmp/$t.log" | grep -E '^\[  (PASSED|FAILED|SKIPPED) |GB/s|bandwidth'; then :; fi
    if grep -q '^\[  FAILED  \]' "/tmp/$t.log" || ! grep -q '^\[  PASSED  \]' "/tmp/$t.log"; then
      echo "RESULT $t: FAIL"; failed=1
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
