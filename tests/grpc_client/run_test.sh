#!/usr/bin/env bash
# End-to-end check that a generic gRPC client (Node, @grpc/grpc-js +
# grpc-js-reflection-client, no .proto files) can discover pdserve.v1.Router
# through server reflection and stream a generation, and that the tokens it
# gets equal `pdserve generate --model` run in-process.
#
# usage: run_test.sh PDSERVE_BIN WORKDIR
#   WORKDIR/node       pinned npm deps (npm ci from package-lock.json; reused
#                      while the lock file is unchanged)
#   WORKDIR/run        model, logs and outputs of this run (recreated each time)
set -euo pipefail

if [[ $# -ne 2 ]]; then
  echo "usage: $0 PDSERVE_BIN WORKDIR" >&2
  exit 2
fi
PDSERVE_BIN=$1
WORKDIR=$2
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROMPT='pdserve über gRPC: hello, world'
MAX_TOKENS=12

log() { echo "grpc_reflection_client: $*" >&2; }
fail() { log "FAIL: $*"; exit 1; }

[[ -x $PDSERVE_BIN ]] || fail "pdserve binary not found or not executable: $PDSERVE_BIN"
command -v node >/dev/null || fail "node is not on PATH"
command -v npm >/dev/null || fail "npm is not on PATH"
NODE_MAJOR=$(node -p 'process.versions.node.split(".")[0]')
(( NODE_MAJOR >= 18 )) || fail "node $(node --version) is too old; need >= 18 (tested with 20)"

mkdir -p "$WORKDIR"
WORKDIR=$(cd "$WORKDIR" && pwd)
NODE_DIR=$WORKDIR/node
RUN=$WORKDIR/run

# ------------------------------------------------------------ npm deps
LOCK_SUM=$(sha256sum "$HERE/package-lock.json" "$HERE/package.json" | sha256sum | cut -d' ' -f1)
STAMP=$NODE_DIR/node_modules/.pdserve-lock-sha256
if [[ -f $STAMP && $(cat "$STAMP") == "$LOCK_SUM" ]]; then
  log "npm deps up to date in $NODE_DIR"
else
  log "installing pinned npm deps into $NODE_DIR"
  rm -rf "$NODE_DIR"
  mkdir -p "$NODE_DIR"
  cp "$HERE/package.json" "$HERE/package-lock.json" "$NODE_DIR/"
  # --ignore-scripts: the only install script in the tree is protobufjs's
  # optional version check, which the client does not need.
  if ! timeout 150 npm ci --prefix "$NODE_DIR" --ignore-scripts --no-audit --no-fund \
        --loglevel=error --fetch-retries=2 --fetch-timeout=30000 >"$WORKDIR/npm.log" 2>&1; then
    tail -n 30 "$WORKDIR/npm.log" >&2 || true
    fail "npm ci failed or timed out (is the npm registry reachable?); full log: $WORKDIR/npm.log"
  fi
  echo "$LOCK_SUM" >"$STAMP"
fi
export NODE_PATH=$NODE_DIR/node_modules

# ------------------------------------------------------------ servers
rm -rf "$RUN"
mkdir -p "$RUN"
PIDS=()
cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [[ $rc -ne 0 ]]; then
    for f in "$RUN"/*.out "$RUN"/*.err; do
      [[ -s $f ]] || continue
      echo "----- $f (last 20 lines)" >&2
      tail -n 20 "$f" >&2
    done
  fi
  exit "$rc"
}
trap cleanup EXIT

"$PDSERVE_BIN" model init --preset tiny --out "$RUN/model" >"$RUN/model_init.out" 2>"$RUN/model_init.err" \
  || fail "model init failed"

# start NAME ARGS...: runs pdserve ARGS in the background (not in a subshell,
# so that cleanup sees its pid) and sets STARTED_ADDR from its
# "listening on ADDR metrics PORT" line.
start() {
  local name=$1
  shift
  "$PDSERVE_BIN" "$@" >"$RUN/$name.out" 2>"$RUN/$name.err" &
  local pid=$!
  PIDS+=("$pid")
  local addr=''
  for _ in $(seq 300); do
    addr=$(grep -o 'listening on [^ ]* metrics [0-9]*' "$RUN/$name.out" 2>/dev/null | head -n1 | awk '{print $3}') || true
    [[ -n $addr ]] && break
    kill -0 "$pid" 2>/dev/null || fail "$name exited before listening"
    sleep 0.1
  done
  [[ -n $addr ]] || fail "$name did not print 'listening on ADDR metrics PORT' within 30 s"
  STARTED_ADDR=$addr
}

start worker worker --role both --model "$RUN/model" --port 0 --metrics-port 0 --insecure
WORKER=$STARTED_ADDR
log "worker listening on $WORKER"
start router router --model "$RUN/model" --port 0 --metrics-port 0 --both-workers "$WORKER" --insecure
ROUTER=$STARTED_ADDR
log "router listening on $ROUTER"

# ------------------------------------------------------------ the client
# It waits (up to 30 s) for Health SERVING and a worker up, then generates.
if ! node "$HERE/reflection_client.mjs" --addr "$ROUTER" --prompt "$PROMPT" --max-tokens "$MAX_TOKENS" \
      --ignore-eos --check-invalid-argument --wait-ready-ms 30000 --timeout-ms 90000 \
      >"$RUN/client.json" 2>"$RUN/client.err"; then
  cat "$RUN/client.err" >&2
  fail "reflection client failed"
fi
cat "$RUN/client.err" >&2
log "client: $(cat "$RUN/client.json")"

"$PDSERVE_BIN" generate --model "$RUN/model" --prompt "$PROMPT" --max-tokens "$MAX_TOKENS" --ignore-eos --json \
  >"$RUN/local.json" 2>"$RUN/local.err" || fail "pdserve generate --model failed"
log "local:  $(cat "$RUN/local.json")"

node - "$RUN/client.json" "$RUN/local.json" "$MAX_TOKENS" <<'EOF'
const fs = require('fs');
const [clientFile, localFile, maxTokens] = process.argv.slice(2);
const client = JSON.parse(fs.readFileSync(clientFile, 'utf8'));
const local = JSON.parse(fs.readFileSync(localFile, 'utf8'));
const problems = [];
for (const s of ['pdserve.v1.Router', 'grpc.health.v1.Health']) {
  if (!client.services.includes(s)) problems.push(`reflection did not list ${s}`);
}
if (client.health.status !== 'SERVING') problems.push(`health ${client.health.status}`);
if (!client.invalid_argument_check || client.invalid_argument_check.code !== 3) {
  problems.push('max_tokens 0 did not return INVALID_ARGUMENT (3)');
}
const a = JSON.stringify(client.token_ids), b = JSON.stringify(local.token_ids);
if (a !== b) problems.push(`token_ids differ: client ${a} vs generate --model ${b}`);
if (client.token_ids.length !== Number(maxTokens)) problems.push(`expected ${maxTokens} tokens, got ${client.token_ids.length}`);
if (client.finish_reason !== local.finish_reason) {
  problems.push(`finish_reason differs: ${client.finish_reason} vs ${local.finish_reason}`);
}
if (client.usage.prompt_tokens !== local.usage.prompt_tokens) {
  problems.push(`usage.prompt_tokens differs: ${client.usage.prompt_tokens} vs ${local.usage.prompt_tokens}`);
}
if (problems.length) {
  for (const p of problems) console.error(`grpc_reflection_client: FAIL: ${p}`);
  process.exit(1);
}
console.error(`grpc_reflection_client: ${client.token_ids.length} token ids match over ` +
              `${client.stream_messages} streamed messages (reflection ${client.reflection_api}, ` +
              `health descriptor: ${client.health.descriptor})`);
EOF
log "PASS"
