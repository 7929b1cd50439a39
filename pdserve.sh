#!/usr/bin/env bash
# pdserve developer entry point: deps | build | test | serve | fuzz | soak.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
BUILD_DIR=${PDSERVE_BUILD_DIR:-$ROOT/build}
JOBS=${PDSERVE_JOBS:-$(nproc)}

# Exactly the Debian packages pdserve builds, tests and runs with.
DEB_PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev libcivetweb-dev libxxhash-dev libpcre2-dev libicu-dev
  prometheus-cpp-dev nlohmann-json3-dev libcpp-httplib-dev
  prometheus python3-torch python3-numpy python3-jsonschema openssl
)
# Only for the fuzz targets (tests/fuzz): clang and its libFuzzer runtime.
FUZZ_DEB_PACKAGES=(clang libclang-rt-14-dev)
FUZZ_BUILD_DIR=$ROOT/build-fuzz

usage() {
  cat <<USAGE
usage: ./pdserve.sh COMMAND [ARGS...]

  deps          install the Debian packages pdserve needs (idempotent; needs root)
  build         configure and build Release into build/ (build/bin/pdserve)
  layering      check include/link layering against tests/layering/rules.txt
  test          layering + deps + build + the CPU test suite (ctest -L cpu, including a 2-minute
                fault soak), then every fuzz target for a few seconds (built meanwhile at
                nice 19 on idle CPU); non-zero on any failure
  serve [ARGS]  deps + build + run the embedded default (passes ARGS through)
  fuzz-build    only build the fuzz preset (what test builds in the background)
  fuzz [SECONDS]
                build the fuzz preset (clang, ASan/UBSan, build-fuzz/) and run every
                libFuzzer target for SECONDS each (default 30); non-zero on any crash
  soak [MINUTES] [FLAGS]
                build, then random load against router + 2 prefill + 2 decode while
                workers are killed, stalled and restarted (default 2 minutes)
  help          this text

Environment: PDSERVE_BUILD_DIR (default build/), PDSERVE_JOBS (default nproc),
PDSERVE_CUDA=AUTO|ON|OFF (default AUTO: CUDA code builds when nvcc is found),
PDSERVE_TEST_FUZZ=0 (test skips the fuzz targets), PDSERVE_FUZZ_CI_SECONDS (default 5).
USAGE
}

deps() {
  local missing=()
  local packages=("${DEB_PACKAGES[@]}" "$@")
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "[deps] all ${#packages[@]} Debian packages present"
    return 0
  fi
  echo "[deps] installing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# After a failed ctest run: the last lines each failed test printed, again at
# the end of the log (--output-on-failure prints them where they fail, which
# a log's tail does not show among hundreds of tests).
failed_test_tails() {
  local log="$BUILD_DIR/Testing/Temporary/LastTest.log"
  [ -f "$log" ] || return 0
  echo "[test] output of the failed tests (last 40 lines each):"
  awk '
    /^[0-9]+\/[0-9]+ Test: / { name = $0; sub(/^[0-9]+\/[0-9]+ Test: /, "", name); n = 0; out = 0; next }
    /^Output:$/ { out = 1; next }
    out && /^<end of output>$/ { out = 0; next }
    out { if ($0 !~ /^-+$/ || n > 0) lines[n++] = $0; next }
    /^Test Failed\.$/ {
      print "==== " name
      for (i = (n > 40 ? n - 40 : 0); i < n; i++) print lines[i]
    }
  ' "$log"
}

build() {
  local cuda=${PDSERVE_CUDA:-AUTO}
  local nvcc_path=""
  [ -x /usr/local/cuda/bin/nvcc ] && nvcc_path="-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPDSERVE_CUDA="$cuda" $nvcc_path
  cmake --build "$BUILD_DIR" -j "$JOBS"
}

# Configures and builds the `fuzz` CMake preset (only tests/fuzz and the
# parsers it reaches).
fuzz_build() {
  cmake --preset fuzz >/dev/null
  cmake --build "$FUZZ_BUILD_DIR" -j "$JOBS"
}

# Runs each fuzz target for $1 seconds over its corpus.
fuzz_run() {
  local seconds=${1:-30}
  local failed=0 t targets
  targets=$(sed -n 's/^set(PDSERVE_FUZZ_TARGETS \(.*\))$/\1/p' "$ROOT/tests/fuzz/CMakeLists.txt")
  if [ -z "$targets" ]; then
    echo "pdserve.sh fuzz: no PDSERVE_FUZZ_TARGETS line found in tests/fuzz/CMakeLists.txt" >&2
    return 1
  fi
  for t in $targets; do
    "$ROOT/tests/fuzz/run_fuzz.sh" "$FUZZ_BUILD_DIR/bin/$t" "$ROOT/tests/fuzz/corpus/$t" \
      "$FUZZ_BUILD_DIR/work/$t" "$seconds" || failed=1
  done
  return $failed
}

fuzz() {
  fuzz_build
  fuzz_run "$@"
}

cmd=${1:-help}
shift || true
case "$cmd" in
  deps) deps ;;
  build) deps; build ;;
  layering) python3 "$ROOT/tests/layering/check_layering.py" "$ROOT" ;;
  test)
    # Fails fast, before the long build, on an include that crosses a rule.
    python3 "$ROOT/tests/layering/check_layering.py" "$ROOT"
    deps
    fuzz_pid=""
    if [ "${PDSERVE_TEST_FUZZ:-1}" != 0 ]; then
      deps "${FUZZ_DEB_PACKAGES[@]}"
      # The fuzz build runs beside the main build and the tests at the lowest
      # priority, on whatever CPU they leave idle (link steps, serial tests).
      # Its own process group (set -m), so that an early exit stops all of it.
      mkdir -p "$FUZZ_BUILD_DIR"
      set -m
      nice -n 19 "$ROOT/pdserve.sh" fuzz-build > "$FUZZ_BUILD_DIR/build.log" 2>&1 &
      fuzz_pid=$!
      set +m
      trap 'kill -- "-$fuzz_pid" 2>/dev/null || true' EXIT
      echo "[test] fuzz targets building in the background (log: $FUZZ_BUILD_DIR/build.log)"
    fi
    build
    if ! (cd "$BUILD_DIR" && ctest -L cpu --output-on-failure -j "$JOBS" "$@"); then
      failed_test_tails
      exit 8
    fi
    if [ -n "$fuzz_pid" ]; then
      echo "[test] waiting for the fuzz build"
      if ! wait "$fuzz_pid"; then
        tail -50 "$FUZZ_BUILD_DIR/build.log"
        echo "[test] the fuzz build failed (log: $FUZZ_BUILD_DIR/build.log)" >&2
        exit 1
      fi
      trap - EXIT
      fuzz_run "${PDSERVE_FUZZ_CI_SECONDS:-5}"
    fi
    ;;
  fuzz-build) fuzz_build ;;
  fuzz)
    deps "${FUZZ_DEB_PACKAGES[@]}"
    fuzz "$@"
    ;;
  soak)
    deps
    build
    minutes=${1:-2}
    shift || true
    exec "$BUILD_DIR/bin/pdserve_soak" --pdserve="$BUILD_DIR/bin/pdserve" --minutes="$minutes" "$@"
    ;;
  serve)
    deps
    build
    exec "$BUILD_DIR/bin/pdserve" up "$@"
    ;;
  help|-h|--help) usage ;;
  *) echo "unknown command: $cmd" >&2; usage >&2; exit 2 ;;
esac
