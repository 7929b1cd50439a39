#!/usr/bin/env bash
# A model variant written by the reference's own generator (so pdserve's
# loader is tested on files it did not write), compared position by position.
# usage: run_variant_check.sh PDSERVE PYTHON WORKDIR [make_test_model.py flags...]
set -euo pipefail
pdserve=$1 python=$2 work=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
"$python" "$here/make_test_model.py" "$work" "$@"
"$python" "$here/compare_logits.py" --pdserve "$pdserve" --model "$work" \
  --tokens 1,5,9,2,7,30,31,4,4,4,8,16,23,42,3,11,19,27,6,0,12,13 --all-positions --rtol 1e-4
