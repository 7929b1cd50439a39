#!/usr/bin/env bash
# One model family end to end: `pdserve model init --preset FAMILY` writes a
# checkpoint in that family's config shape; pdserve must load it, generate
# from it, and its logits must match the independent PyTorch reference
# (llama_ref.py) at every position.
# usage: run_preset_check.sh PDSERVE PYTHON WORKDIR PRESET DTYPE
set -euo pipefail
pdserve=$1 python=$2 work=$3 preset=$4 dtype=$5
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
"$pdserve" model init --preset "$preset" --out "$work" --seed 5 --dtype "$dtype"
grep -q '"architectures"' "$work/config.json"

# Loads and generates: 12 greedy tokens (no EOS stop, so exactly 12).
out=$("$pdserve" generate --model "$work" --prompt "Hello, family $preset" \
  --max-tokens 12 --ignore-eos --json)
"$python" - "$out" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
n = r["usage"]["completion_tokens"]
assert n == 12, f"expected 12 completion tokens, got {n}: {r}"
PY

# BOS, text, high bytes, EOS; 40 positions cross block boundaries.
tokens=256,72,101,108,108,111,44,32,119,111,114,108,100,33,0,255,128,200,13,10,9,65,66,67,68,69,70,71,72,73,74,75,76,77,78,79,80,81,82,257
"$python" "$here/compare_logits.py" --pdserve "$pdserve" --model "$work" --tokens "$tokens" --all-positions --rtol 1e-4
