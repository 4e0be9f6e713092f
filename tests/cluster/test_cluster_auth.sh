#!/bin/bash
# test_cluster_auth: API keys on the gRPC front door and the cluster secret on the control
# plane (docs/security.md), with a router, prefill p0 and decode d0 sharing a secret:
# - `tandem generate --server` with TANDEM_API_KEY right (answer equal to `tandem generate`),
#   wrong and absent (UNAUTHENTICATED, nothing admitted); the same on the OpenAI HTTP API
#   with curl (200; 401 in OpenAI's error shape with WWW-Authenticate; /health open);
#   tandem_auth_api_key_total by outcome;
# - the keys file rotated by SIGHUP (the new key in, the old one out), and a bad file on
#   SIGHUP keeps the keys in force, saying why;
# - a rogue decode node without the secret and one with a wrong secret: refused at
#   registration (the router logs why, the node says the router refused it), never counted
#   as nodes and never sent a request; a node registering under d0's id with another
#   secret is refused while d0 keeps serving;
# - a process without the secret calling RegisterNode, Heartbeat, Admit, Release, Prefill and
#   Steps directly: UNAUTHENTICATED every time; tandem_auth_cluster_total counts them;
# - the router SIGKILLed and started again with the same secret: p0 and d0 register again
#   and serve, the rogue nodes are refused again;
# - `tandem local` writes its cluster's own secret (mode 0600) and serves with it.
# Skips without the model, Llama 3's tokenizer.json or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
# the HTTP API answers in text: the router needs a tokenizer (any: the prompts are ids)
TOK="$(dirname "$CL_M")/../tokenizers/llama3/tokenizer.json"
[ -f "$TOK" ] || { echo "SKIP: $TOK absent (set TANDEM_TEST_MODELS)"; exit 77; }
KEY1=key-one-0123456789abcdef0123456789abcdef
KEY2=key-two-fedcba9876543210fedcba9876543210
printf '# front door keys\n%s\n' "$KEY1" >"$CL_T/keys"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CL_T/secret"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$CL_T/other"
chmod 600 "$CL_T/keys" "$CL_T/secret" "$CL_T/other"

# gen NAME KEY IDS: `tandem generate --server` with TANDEM_API_KEY=KEY (empty: unset);
# output in $CL_T/NAME.gen, its exit status returned
gen() {
    local name=$1 key=$2 ids=$3
    if [ -n "$key" ]; then
        TANDEM_API_KEY=$key "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$ids" --max-tokens 16 --print-ids \
            >"$CL_T/$name.gen" 2>"$CL_T/$name.gen.err"
    else
        env -u TANDEM_API_KEY "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$ids" --max-tokens 16 --print-ids \
            >"$CL_T/$name.gen" 2>"$CL_T/$name.gen.err"
    fi
}

echo "== tandem local: a secret of its own (0600), keys on its front door"
printf '%s\n' "$KEY1" >"$CL_T/local.keys"
chmod 600 "$CL_T/local.keys"
TMPDIR="$CL_T" cl_local 1 1 --api-keys-file "$CL_T/local.keys"
sf=$(ls "$CL_T"/tandem-local-*/cluster.secret 2>/dev/null | head -1)
[ -n "$sf" ] && [ "$(stat -c %a "$sf")" = 600 ] || cl_fail "tandem local wrote no 0600 cluster secret: '$sf'"
want=$(cl_ref 16 "1 200 300")
gen local_right "$KEY1" "1 200 300" || cl_fail "tandem local: the right key failed: $(cat "$CL_T/local_right.gen.err")"
[ "$(cat "$CL_T/local_right.gen")" = "$want" ] || cl_fail "tandem local: want '$want' got '$(cat "$CL_T/local_right.gen")'"
gen local_absent "" "1 200 300" && cl_fail "tandem local served a request without a key"

echo "== a router, p0 and d0 sharing a secret"
# a control port below the ephemeral range: while the router is down, its nodes' reconnects
# could otherwise be given it as their own port and connect to themselves, holding it
PORT=$("$CL_PY" - <<'EOF'
import random, socket
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for port in random.sample(range(max(1024, lo - 8000), lo), 200):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        print(port)
        break
    except OSError:
        pass
    finally:
        s.close()
EOF
)
cl_router --control-port "$PORT" --heartbeat-ms 100 --heartbeat-timeout-ms 1000 --cluster-secret-file "$CL_T/secret" \
    --api-keys-file "$CL_T/keys" --http-port 0 --tokenizer "$TOK"
OA=$(sed -n 's/^openai: //p' "$CL_T/router.out")
[ -n "$OA" ] || cl_fail "the router printed no openai: line"
cl_node prefill p0 --cluster-secret-file "$CL_T/secret"
cl_node decode d0 --cluster-secret-file "$CL_T/secret"
cl_wait_nodes 1 1
PC=$(sed -n 's/^prefill p0: control \([^ ]*\) .*/\1/p' "$CL_T/p0.out")
DC=$(sed -n 's/^decode d0: control \([^ ]*\) .*/\1/p' "$CL_T/d0.out")

echo "== API keys on the gRPC front door"
gen right "$KEY1" "1 200 300" || cl_fail "the right key failed: $(cat "$CL_T/right.gen.err")"
[ "$(cat "$CL_T/right.gen")" = "$want" ] || cl_fail "right key: want '$want' got '$(cat "$CL_T/right.gen")'"
gen wrong "${KEY1}x" "1 200 300" && cl_fail "a wrong key was served"
grep -q UNAUTHENTICATED "$CL_T/wrong.gen.err" || cl_fail "wrong key: no UNAUTHENTICATED: $(cat "$CL_T/wrong.gen.err")"
gen absent "" "1 200 300" && cl_fail "a request without a key was served"
grep -q "API key is required" "$CL_T/absent.gen.err" || cl_fail "no key: $(cat "$CL_T/absent.gen.err")"
for o in ok:1 wrong:1 missing:1; do
    v=$(cl_metric router tandem_auth_api_key_total "outcome=${o%%:*}")
    [ "${v%.*}" = "${o##*:}" ] || cl_fail "tandem_auth_api_key_total{outcome=${o%%:*}} is $v, want ${o##*:}"
done
[ "$(cl_metric d0 tandem_decode_admits_total | cut -d. -f1)" = 1 ] || cl_fail "refused requests reached d0"
echo "== API keys on the OpenAI HTTP API"
# http NAME AUTH-HEADER-OR-EMPTY METHOD PATH [BODY]: prints the status; body in $CL_T/NAME.http
http() {
    local name=$1 auth=$2 method=$3 path=$4 body=${5:-}
    local args=(-s -o "$CL_T/$name.http" -D "$CL_T/$name.hdr" -w '%{http_code}' -X "$method" "$OA$path")
    [ -n "$auth" ] && args+=(-H "Authorization: $auth")
    [ -n "$body" ] && args+=(-H 'Content-Type: application/json' -d "$body")
    curl "${args[@]}"
}
body='{"model":"default","prompt":[1,200,300],"max_tokens":16,"temperature":0}'
[ "$(http h_right "Bearer $KEY1" POST /completions "$body")" = 200 ] ||
    cl_fail "HTTP with the right key: $(cat "$CL_T/h_right.http")"
"$CL_PY" - "$CL_T/h_right.http" "$want" <<'EOF' || cl_fail "HTTP completion differs from tandem generate"
import json, sys
r = json.load(open(sys.argv[1]))
want = len(sys.argv[2].split())
n = r["usage"]["completion_tokens"]
print("http completion: %d tokens (want %d), finish_reason %s" % (n, want, r["choices"][0]["finish_reason"]))
sys.exit(0 if n == want else 1)
EOF
for row in "h_wrong|Bearer ${KEY1}x|the API key is not valid" "h_basic|Basic $KEY1|the API key is not valid" \
    "h_absent||no API key"; do
    IFS='|' read -r name auth says <<<"$row"
    code=$(http "$name" "$auth" POST /completions "$body")
    [ "$code" = 401 ] || cl_fail "HTTP $name: status $code, want 401"
    grep -q '"code": *"invalid_api_key"' "$CL_T/$name.http" && grep -q "$says" "$CL_T/$name.http" ||
        cl_fail "HTTP $name: not OpenAI's 401 error: $(cat "$CL_T/$name.http")"
    grep -qi '^WWW-Authenticate: Bearer' "$CL_T/$name.hdr" || cl_fail "HTTP $name: no WWW-Authenticate"
done
[ "$(http h_models "" GET /models)" = 401 ] || cl_fail "GET /v1/models without a key was served"
[ "$(http h_models_ok "Bearer $KEY1" GET /models)" = 200 ] || cl_fail "GET /v1/models with the key failed"
code=$(curl -s -o /dev/null -w '%{http_code}' "${OA%/v1}/health")
[ "$code" = 200 ] || cl_fail "GET /health without a key: $code, want 200 (probes carry no key)"
for o in ok:3 wrong:3 missing:3; do
    v=$(cl_metric router tandem_auth_api_key_total "outcome=${o%%:*}")
    [ "${v%.*}" = "${o##*:}" ] || cl_fail "after HTTP: tandem_auth_api_key_total{outcome=${o%%:*}} is $v, want ${o##*:}"
done
[ "$(cl_metric d0 tandem_decode_admits_total | cut -d. -f1)" = 2 ] || cl_fail "refused HTTP requests reached d0"
curl -s "${CL_MURL[router]}" | grep -q "$KEY1" && cl_fail "/metrics shows a key"
grep -q "$KEY1" "$CL_T"/router.err && cl_fail "the router logged a key"

echo "== SIGHUP rotates the keys; a bad file keeps them"
printf '%s\n' "$KEY2" >"$CL_T/keys"
kill -HUP "${CL_PID[router]}"
for i in $(seq 50); do gen rotated "$KEY2" "1 200 300" && break; sleep 0.1; done # the loop reloads soon
[ -s "$CL_T/rotated.gen" ] || cl_fail "the new key failed after SIGHUP: $(cat "$CL_T/rotated.gen.err")"
gen old "$KEY1" "1 200 300" && cl_fail "the rotated-out key is still served"
printf 'short\n' >"$CL_T/keys"
kill -HUP "${CL_PID[router]}"
cl_wait_line "$CL_T/router.err" "not reloaded .* stay in force" 5 || cl_fail "a bad keys file on SIGHUP was not reported"
grep -q "line 1: the key has 5 characters" "$CL_T/router.err" || cl_fail "the reload error does not say why"
gen kept "$KEY2" "1 200 300" || cl_fail "a bad keys file dropped the keys in force"
_cl_dead "${CL_PID[router]}" && cl_fail "SIGHUP killed the router"

echo "== rogue nodes: no secret, a wrong secret, d0's id with another secret"
CL_NAME=rogue0 cl_node decode rogue0 --kv-blocks 64
CL_NAME=rogue1 cl_node decode rogue1 --kv-blocks 64 --cluster-secret-file "$CL_T/other"
CL_NAME=twin cl_node decode d0 --kv-blocks 64 --cluster-secret-file "$CL_T/other"
cl_wait_line "$CL_T/rogue0.err" "refused its registration: .*no tandem-cluster-auth header" 10 ||
    cl_fail "rogue0 was not told why: $(tail -3 "$CL_T/rogue0.err")"
cl_wait_line "$CL_T/rogue1.err" "refused its registration: .*cluster secret differs" 10 ||
    cl_fail "rogue1 was not told why: $(tail -3 "$CL_T/rogue1.err")"
cl_wait_line "$CL_T/twin.err" "refused its registration: .*cluster secret differs" 10 ||
    cl_fail "the second d0 was not refused: $(tail -3 "$CL_T/twin.err")"
grep -q "RegisterNode from .* refused (cluster authentication): no tandem-cluster-auth header" "$CL_T/router.err" ||
    cl_fail "the router log does not say why rogue0 was refused"
grep -q "RegisterNode from .* refused (cluster authentication): the signature does not match" "$CL_T/router.err" ||
    cl_fail "the router log does not say why rogue1 was refused"
sleep 1 # a few heartbeats: still not members
line=$(grep '^nodes: ' "$CL_T/router.out" | tail -1)
[ "$line" = "nodes: 1 prefill, 1 decode" ] || cl_fail "rogue nodes counted: $line"
grep -l "registered with router" "$CL_T/rogue0.err" "$CL_T/rogue1.err" "$CL_T/twin.err" &&
    cl_fail "a rogue node registered"
cl_refs refs 16 400
for k in $(seq 8); do
    IFS='|' read -r p ref < <(sed -n "${k}p" "$CL_T/refs")
    gen "r$k" "$KEY2" "$p" || cl_fail "request $k failed: $(cat "$CL_T/r$k.gen.err")"
    [ "$(cat "$CL_T/r$k.gen")" = "$ref" ] || cl_fail "request '$p': want '$ref' got '$(cat "$CL_T/r$k.gen")'"
done
for n in rogue0 rogue1 twin; do
    v=$(cl_metric "$n" tandem_decode_admits_total)
    [ "${v%.*}" = 0 ] || cl_fail "$n was sent $v requests"
done
v=$(cl_metric d0 tandem_decode_admits_total)
[ "${v%.*}" -ge 10 ] || cl_fail "d0 served $v requests, want at least 10"

echo "== a process without the secret calls the control APIs directly"
"$CL_PY" - "$CL_CTL" "$DC" "$PC" <<'EOF' || cl_fail "an unsigned control call was not refused"
import sys, grpc
ctl, dc, pc = sys.argv[1:4]
calls = [(ctl, "/tandem.control.v1.Registry/RegisterNode", False),
         (ctl, "/tandem.control.v1.Registry/Heartbeat", False),
         (dc, "/tandem.control.v1.DecodeNode/Admit", False),
         (dc, "/tandem.control.v1.DecodeNode/Release", False),
         (dc, "/tandem.control.v1.DecodeNode/Steps", True),
         (pc, "/tandem.control.v1.PrefillNode/Prefill", True)]
bad = 0
for addr, method, stream in calls:
    for md in [None, [("tandem-cluster-auth", "v1 0123456789abcdef 1 0 " + "0" * 64)]]:
        ch = grpc.insecure_channel(addr)
        try:
            if stream:
                list(ch.unary_stream(method)(b"", timeout=5, metadata=md))
            else:
                ch.unary_unary(method)(b"", timeout=5, metadata=md)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        ch.close()
        ok = code == grpc.StatusCode.UNAUTHENTICATED
        bad += not ok
        print("%-45s %-9s %s" % (method, "forged" if md else "unsigned", "refused" if ok else "NOT REFUSED: %s" % code))
sys.exit(1 if bad else 0)
EOF
for n in router p0 d0; do
    v=$(cl_metric "$n" tandem_auth_cluster_total "outcome=ok")
    [ "${v%.*}" -gt 0 ] || cl_fail "$n counted no signed call"
done
v=$(cl_metric router tandem_auth_cluster_total "outcome=missing")
[ "${v%.*}" -gt 0 ] || cl_fail "the router counted no unsigned call"
v=$(cl_metric d0 tandem_auth_cluster_total "outcome=wrong")
[ "${v%.*}" -ge 3 ] || cl_fail "d0 counted $v forged calls, want at least 3"
for n in router p0 d0; do _cl_dead "${CL_PID[$n]}" && cl_fail "$n died"; done
[ $CL_FAIL -eq 0 ] || cl_end

echo "== a new router with the same secret: the members sign on with no session to restore"
CL_KILLED[router]=1
kill -KILL "${CL_PID[router]}"
# its port is free once the process has wholly exited (a sanitizer build's exit takes a while)
for i in $(seq 300); do ss -tln | grep -q "127.0.0.1:$PORT " || break; sleep 0.1; done
printf '%s\n' "$KEY2" >"$CL_T/keys"
CL_ROUTER=router2
cl_router --control-port "$PORT" --heartbeat-ms 100 --heartbeat-timeout-ms 1000 --cluster-secret-file "$CL_T/secret" \
    --api-keys-file "$CL_T/keys"
CL_WAIT_NODES_S=15 cl_wait_nodes 1 1
gen again "$KEY2" "1 200 300" || cl_fail "the new router did not serve: $(cat "$CL_T/again.gen.err")"
[ "$(cat "$CL_T/again.gen")" = "$want" ] || cl_fail "new router: want '$want' got '$(cat "$CL_T/again.gen")'"
cl_wait_line "$CL_T/router2.err" "RegisterNode from .* refused" 5 || cl_fail "the rogue nodes were not refused by the new router"
line=$(grep '^nodes: ' "$CL_T/router2.out" | tail -1)
[ "$line" = "nodes: 1 prefill, 1 decode" ] || cl_fail "the new router counts rogue nodes: $line"
cl_end "API keys right/wrong/absent on the gRPC and HTTP front doors, SIGHUP rotation, rogue and twin nodes refused, unsigned and forged control calls refused, a restarted router takes the members back"
