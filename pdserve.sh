#!/usr/bin/env bash
# pdserve developer entry point: deps | build | test | serve.
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
  prometheus python3-torch python3-numpy
)

usage() {
  cat <<USAGE
usage: ./pdserve.sh COMMAND [ARGS...]

  deps          install the Debian packages pdserve needs (idempotent; needs root)
  build         configure and build Release into build/ (build/bin/pdserve)
  test          deps + build + the CPU test suite (ctest -L cpu); non-zero on any failure
  serve [ARGS]  deps + build + run the embedded default (passes ARGS through)
  help          this text

Environment: PDSERVE_BUILD_DIR (default build/), PDSERVE_JOBS (default nproc),
PDSERVE_CUDA=AUTO|ON|OFF (default AUTO: CUDA code builds when nvcc is found).
USAGE
}

deps() {
  local missing=()
  for p in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "[deps] all ${#DEB_PACKAGES[@]} Debian packages present"
    return 0
  fi
  echo "[deps] installing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

build() {
  local cuda=${PDSERVE_CUDA:-AUTO}
  local nvcc_path=""
  [ -x /usr/local/cuda/bin/nvcc ] && nvcc_path="-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPDSERVE_CUDA="$cuda" $nvcc_path
  cmake --build "$BUILD_DIR" -j "$JOBS"
}

cmd=${1:-help}
shift || true
case "$cmd" in
  deps) deps ;;
  build) deps; build ;;
  test)
    deps
    build
    cd "$BUILD_DIR"
    ctest -L cpu --output-on-failure -j "$JOBS" "$@"
    ;;
  serve)
    deps
    build
    exec "$BUILD_DIR/bin/pdserve" up "$@"
    ;;
  help|-h|--help) usage ;;
  *) echo "unknown command: $cmd" >&2; usage >&2; exit 2 ;;
esac
