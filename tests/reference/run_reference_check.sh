#!/usr/bin/env bash
# Writes a tiny model with pdserve and compares `pdserve model logits` with the
# independent PyTorch reference (llama_ref.py) at every position.
# usage: run_reference_check.sh PDSERVE PYTHON WORKDIR DTYPE
set -euo pipefail
pdserve=$1 python=$2 work=$3 dtype=$4
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
"$pdserve" model init --preset tiny --out "$work" --seed 11 --dtype "$dtype"
# BOS, ASCII text, high bytes and EOS; 40 positions cross two 16-token blocks.
tokens=256,72,101,108,108,111,44,32,119,111,114,108,100,33,0,255,128,200,13,10,9,65,66,67,68,69,70,71,72,73,74,75,76,77,78,79,80,81,82,257
"$python" "$here/compare_logits.py" --pdserve "$pdserve" --model "$work" --tokens "$tokens" --all-positions --rtol 1e-4
