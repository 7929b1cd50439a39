#!/usr/bin/env bash
# pdserve with compact weights (--weight-dtype bf16|fp16|int8) against the
# float64 PyTorch reference whose matrices are rounded the same way
# (llama_ref.round_weights): what remains is fp32 vs float64 arithmetic, so
# the tolerance is the fp32 one (rtol 1e-4, identical argmax). A second check
# bounds the rounding itself against the unrounded reference.
# usage: run_weight_dtype_check.sh PDSERVE PYTHON WORKDIR WEIGHT_DTYPE RTOL_VS_FP32
set -euo pipefail
pdserve=$1 python=$2 work=$3 wdtype=$4 rtol_fp32=$5
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
"$pdserve" model init --preset tiny --out "$work" --seed 11 --dtype fp32
tokens=256,72,101,108,108,111,44,32,119,111,114,108,100,33,0,255,128,200,13,10,9,65,66,67,68,69,70,71,72,73,74,75,76,77,78,79,80,81,82,257
"$python" "$here/compare_logits.py" --pdserve "$pdserve" --model "$work" --tokens "$tokens" \
  --all-positions --rtol 1e-4 --weight-dtype "$wdtype"
# The same pdserve run against the unrounded fp32 reference: only the
# relative error is bounded (near-ties may flip the argmax).
"$python" "$here/compare_logits.py" --pdserve "$pdserve" --model "$work" --tokens "$tokens" \
  --all-positions --rtol "$rtol_fp32" --weight-dtype "$wdtype" --reference-weight-dtype fp32 \
  --allow-argmax-mismatch
