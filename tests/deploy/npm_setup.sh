#!/usr/bin/env bash
# Installs the pinned npm packages of tests/deploy/package.json (Kubernetes
# schemas for validate_k8s.mjs) into NODE_DIR in the build tree, never into
# the source tree. Re-runs `npm ci` only when package-lock.json changes.
#   npm_setup.sh SOURCE_DIR NODE_DIR
set -euo pipefail
src=$1
dir=$2
here="$src/tests/deploy"
command -v npm >/dev/null || { echo "FAIL: npm not found (Node.js is needed for the schema validation)"; exit 1; }
mkdir -p "$dir"
stamp="$dir/node_modules/.pdserve-lock"
if [ -f "$stamp" ] && cmp -s "$stamp" "$here/package-lock.json"; then
  echo "npm packages up to date in $dir"
  exit 0
fi
cp "$here/package.json" "$here/package-lock.json" "$dir/"
cd "$dir"
# kubernetes-models declares node >= 22 but runs on Node 20 (tested here);
# engine-strict=false keeps npm from refusing it.
npm ci --no-audit --no-fund --ignore-scripts --engine-strict=false --loglevel=error \
  --fetch-timeout=60000 --fetch-retries=3
cp "$here/package-lock.json" "$stamp"
echo "installed $(ls node_modules | wc -l) npm packages into $dir"
