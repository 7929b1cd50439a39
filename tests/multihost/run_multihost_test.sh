#!/usr/bin/env bash
# Multi-host serving: router, prefill and decode worker each in its own
# network namespace with its own address on a private /24, joined by a Linux
# bridge, and the client in a fourth. Nothing can reach anything over
# loopback, so a worker that advertises 127.0.0.1, a registration that records
# the wrong peer or a KV transfer aimed at localhost fails the request.
#
# Checks, for a greedy and a seeded sampled request, that
# `pdserve generate --router` equals `pdserve generate --model` (token ids,
# text, finish reason), that the request really ran on the prefill and decode
# workers by their namespace addresses, and that the KV went over the bridge
# (prefill sent bytes, decode received them). Twice: workers that register
# themselves with --router, and a second router given static worker lists.
#
# Usage: run_multihost_test.sh PDSERVE_BIN WORK_DIR
# Needs root (ip netns, veth, bridge). Without that it FAILS: CI runs as root,
# and a silent skip would hide a loopback assumption.
set -euo pipefail

BIN=$(readlink -f "$1")
WORK=$2
S=$$                        # unique suffix: parallel runs do not clash
NET=10.77.0                 # the bridge carries no address, so parallel runs
                            # with the same /24 on their own bridges are fine
BR=pdbr$S
declare -A NS=([router]=pdr$S [prefill]=pdp$S [decode]=pdd$S [client]=pdc$S)
declare -A IP=([router]=$NET.2 [prefill]=$NET.3 [decode]=$NET.4 [client]=$NET.5)
PIDS=()

fail() {
  echo "FAIL: $*" >&2
  for f in "$WORK"/*.log; do
    [[ -f $f ]] && { echo "--- $f (last 30 lines)" >&2; tail -n 30 "$f" >&2; }
  done
  exit 1
}

cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  # Anything else still inside our namespaces was started by this script.
  for ns in "${NS[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      kill -KILL "$pid" 2>/dev/null || true
    done
  done
  for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  ip link del "$BR" 2>/dev/null || true
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[[ -x $BIN ]] || fail "no pdserve binary at $1"
command -v ip >/dev/null || fail "iproute2 (ip) is not installed"
rm -rf "$WORK" && mkdir -p "$WORK"

# --- the network: one bridge, a veth pair per namespace ---------------------
if ! err=$(ip link add "$BR" type bridge 2>&1); then
  fail "cannot create a bridge (needs root / CAP_NET_ADMIN): $err"
fi
ip link set "$BR" up
for role in router prefill decode client; do
  ns=${NS[$role]}
  if ! err=$(ip netns add "$ns" 2>&1); then
    fail "cannot create network namespace $ns (needs root / CAP_SYS_ADMIN): $err"
  fi
  ip link add "pv${role:0:1}$S" type veth peer name "pe${role:0:1}$S"
  ip link set "pe${role:0:1}$S" netns "$ns"
  ip link set "pv${role:0:1}$S" master "$BR" up
  ip -n "$ns" link set "pe${role:0:1}$S" name eth0
  ip -n "$ns" addr add "${IP[$role]}/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done

in_ns() {  # in_ns ROLE CMD...
  local ns=${NS[$1]}
  shift
  ip netns exec "$ns" "$@"
}

# GET http://HOST:PORT/metrics from the client namespace.
scrape() {
  in_ns client bash -c '
    exec 3<>/dev/tcp/$0/$1 || exit 1
    printf "GET /metrics HTTP/1.0\r\nHost: $0\r\n\r\n" >&3
    timeout 5 cat <&3' "$1" "$2" 2>/dev/null || true
}

# Value of one exposition series (exact "name{labels}"), or empty.
metric() {
  awk -v s="$1" '$1 == s { print $2; exit }'
}

# Waits up to $1 seconds until `eval $2` succeeds.
wait_for() {
  local until=$((SECONDS + $1))
  while ! eval "$2"; do
    ((SECONDS < until)) || return 1
    sleep 0.2
  done
}

# --- the cluster -------------------------------------------------------------
"$BIN" model init --preset tiny --out "$WORK/model" --seed 3 >/dev/null ||
  fail "model init"
MODEL=$WORK/model
GRPC=50051
METRICS=9400

in_ns router "$BIN" router --model "$MODEL" --host 0.0.0.0 --port $GRPC \
  --metrics-port $METRICS --insecure --local-prefill-threshold=-1 \
  >"$WORK/router.log" 2>&1 &
PIDS+=($!)
wait_for 60 "scrape ${IP[router]} $METRICS | grep -q '^pdserve_'" ||
  fail "the router's /metrics on ${IP[router]}:$METRICS is not reachable" \
    "from the client namespace (if the router log shows it listening, the" \
    "host may filter bridged traffic: br_netfilter with an iptables FORWARD" \
    "DROP policy, as Docker sets up)"

for role in prefill decode; do
  in_ns $role "$BIN" $role --model "$MODEL" --host 0.0.0.0 \
    --advertise "${IP[$role]}" --port $GRPC --metrics-port $METRICS \
    --router "${IP[router]}:$GRPC" --insecure --threads 1 \
    >"$WORK/$role.log" 2>&1 &
  PIDS+=($!)
done

up_workers() {  # up_workers METRICS_PORT ROLE
  scrape "${IP[router]}" "$1" |
    metric "pdserve_workers{role=\"$2\",state=\"up\"}"
}
wait_for 60 '[[ $(up_workers $METRICS prefill) == 1 && $(up_workers $METRICS decode) == 1 ]]' ||
  fail "the workers did not register with the router over the bridge" \
    "(router sees prefill up=$(up_workers $METRICS prefill)," \
    "decode up=$(up_workers $METRICS decode))"

# A second router in the router namespace, given the workers' addresses.
STATIC_GRPC=50061
STATIC_METRICS=9410
in_ns router "$BIN" router --model "$MODEL" --host 0.0.0.0 \
  --port $STATIC_GRPC --metrics-port $STATIC_METRICS --insecure \
  --local-prefill-threshold=-1 \
  --prefill-workers "${IP[prefill]}:$GRPC" \
  --decode-workers "${IP[decode]}:$GRPC" >"$WORK/router_static.log" 2>&1 &
PIDS+=($!)
wait_for 60 '[[ $(up_workers $STATIC_METRICS prefill) == 1 && $(up_workers $STATIC_METRICS decode) == 1 ]]' ||
  fail "the router with static worker lists does not see both workers up"

# --- the requests ------------------------------------------------------------
PROMPT="System prompt: rule 1 is to be helpful and exact, rule 2 is to \
answer briefly, rule 3 is to cite nothing. Question: what is seven times six?"
compare() {  # compare NAME ROUTER_PORT GENERATE_FLAGS...
  local name=$1 port=$2
  shift 2
  local remote local_out
  remote=$(in_ns client "$BIN" generate --router "${IP[router]}:$port" \
    --json --timeout-ms 120000 --prompt "$PROMPT" "$@" 2>"$WORK/$name.err") ||
    fail "$name: generate --router ${IP[router]}:$port failed:" \
      "$(cat "$WORK/$name.err")"
  local_out=$("$BIN" generate --model "$MODEL" --threads 1 --json \
    --prompt "$PROMPT" "$@" \
    2>"$WORK/$name.local.err") ||
    fail "$name: generate --model failed: $(cat "$WORK/$name.local.err")"
  /usr/bin/python3 - "$name" "$remote" "$local_out" \
    "prefill@${IP[prefill]}:$GRPC" "decode@${IP[decode]}:$GRPC" <<'EOF' ||
import json, sys
name, remote, local, prefill, decode = sys.argv[1:]
r, l = json.loads(remote), json.loads(local)
errors = []
for key in ("token_ids", "text", "finish_reason"):
    if r[key] != l[key]:
        errors.append(f"{key}: router {r[key]!r} != local {l[key]!r}")
if r["usage"]["completion_tokens"] != len(l["token_ids"]):
    errors.append(f"completion_tokens {r['usage']['completion_tokens']}")
if r["prefill_worker"] != prefill:
    errors.append(f"prefill_worker {r['prefill_worker']!r}, want {prefill!r}")
if r["decode_worker"] != decode:
    errors.append(f"decode_worker {r['decode_worker']!r}, want {decode!r}")
if errors:
    print(f"{name}: " + "; ".join(errors), file=sys.stderr)
    sys.exit(1)
print(f"{name}: {len(r['token_ids'])} tokens equal to the local path, "
      f"prefill on {r['prefill_worker']}, decode on {r['decode_worker']}")
EOF
    fail "$name: the router's output differs from the local path"
}

compare registered_greedy $GRPC --max-tokens 24 --ignore-eos
compare registered_seeded $GRPC --max-tokens 24 --ignore-eos \
  --temperature 0.9 --top-p 0.95 --seed 77
compare static_greedy $STATIC_GRPC --max-tokens 16 --ignore-eos
compare static_seeded $STATIC_GRPC --max-tokens 16 --ignore-eos \
  --temperature 0.7 --seed 5

# The KV went from the prefill namespace to the decode namespace.
sent=$(scrape "${IP[prefill]}" $METRICS |
  metric 'pdserve_kv_transfer_bytes_total{direction="sent"}')
received=$(scrape "${IP[decode]}" $METRICS |
  metric 'pdserve_kv_transfer_bytes_total{direction="received"}')
[[ -n $sent && ${sent%.*} -gt 0 ]] || fail "prefill sent no KV bytes ($sent)"
[[ -n $received && ${received%.*} -gt 0 ]] ||
  fail "decode received no KV bytes ($received)"
echo "KV over the bridge: prefill sent $sent bytes, decode received $received"
echo "PASS"
