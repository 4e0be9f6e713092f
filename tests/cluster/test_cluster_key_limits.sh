#!/bin/bash
# test_cluster_key_limits: a key's rate and priority cap (issue 35, docs/security.md
# "Tenants"). Keys: A (no flags), R (rate=1), B (priority=-5). A router with --max-active 1,
# its HTTP API, p0 and d0.
# - rate: R's first request is served; its next, at once, is refused before its body is
#   read: HTTP 429 with Retry-After and a message naming the limit, gRPC RESOURCE_EXHAUSTED
#   (one bucket for both doors); after the wait it is served again; A, without a rate, is
#   served five times in a row.
# - priority: while A's long stream holds the one active slot, B asks priority 10 and then A
#   asks 0: B's is capped at -5, so A's request starts first (uncapped, B's 10 would go first,
#   and at equal priorities B came first).
# Skips without stories260K, Llama 3's tokenizer.json or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
TOK="$(dirname "$CL_M")/../tokenizers/llama3/tokenizer.json" # the HTTP API answers in text: any tokenizer
[ -f "$TOK" ] || { echo "SKIP: $TOK absent (set TANDEM_TEST_MODELS)"; exit 77; }
KA=key-limits-a-0123456789abcdef0123456789abcdef
KR=key-limits-r-0123456789abcdef0123456789abcdef
KB=key-limits-b-0123456789abcdef0123456789abcdef
printf '%s\n%s rate=1\n%s priority=-5\n' "$KA" "$KR" "$KB" >"$CL_T/keys"
chmod 600 "$CL_T/keys"
cl_router --api-keys-file "$CL_T/keys" --http-port 0 --max-active 1 --tokenizer "$TOK"
OA=$(sed -n 's/^openai: //p' "$CL_T/router.out")
[ -n "$OA" ] || cl_fail "the router printed no openai: line"
cl_node prefill p0
cl_node decode d0
cl_wait_nodes 1 1

PYTHONPATH="$CL_SRC/tests/cluster" "$CL_PY" - "$OA" "$CL_GW" "$KA" "$KR" "$KB" <<'EOF' || cl_fail "the key limits failed (above)"
import grpc, json, sys, threading, time, urllib.error, urllib.request
oa, gw, ka, kr, kb = sys.argv[1:6]

from cluster_wire import varint

def gen_req(ids, max_tokens, priority=None):
    body = b"".join(varint(x) for x in ids)
    r = varint(2 << 3 | 2) + varint(len(body)) + body + varint(3 << 3) + varint(max_tokens)
    if priority is not None:  # Priority{value} (field 9); int32 as a 64-bit varint when negative
        p = varint(1 << 3) + varint(priority & 0xFFFFFFFFFFFFFFFF)
        r += varint(9 << 3 | 2) + varint(len(p)) + p
    return r

def http(key, max_tokens=4):
    body = json.dumps({"model": "default", "prompt": [1, 200, 300], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(oa + "/completions", data=body, headers={"Authorization": "Bearer " + key,
                                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {}, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()

ch = grpc.insecure_channel(gw)
gen = ch.unary_stream("/tandem.v1.Generation/Generate", request_serializer=None, response_deserializer=None)
rc = 0
def fail(msg):
    global rc
    print("FAIL: " + msg)
    rc = 1

# rate
st, _, _ = http(kr)
if st != 200:
    fail("R's first request: HTTP %d" % st)
st, hdr, text = http(kr)
print("R at once: HTTP %d Retry-After %s: %s" % (st, hdr.get("Retry-After"), text[:160]))
if st != 429 or not hdr.get("Retry-After") or "rate limit (1 requests a second)" not in text:
    fail("R's second request was not refused 429 with Retry-After and the limit named")
try:
    for _ in gen(gen_req([1, 200], 2), metadata=(("authorization", "Bearer " + kr),), timeout=30):
        pass
    fail("R's gRPC request right after was served")
except grpc.RpcError as e:
    print("R over gRPC at once: %s %s" % (e.code().name, e.details()))
    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "rate limit" not in (e.details() or ""):
        fail("R's gRPC request was not refused RESOURCE_EXHAUSTED naming the limit")
time.sleep(1.1)
st, _, _ = http(kr)
if st != 200:
    fail("R after its wait: HTTP %d" % st)
for i in range(5):
    st, _, text = http(ka)
    if st != 200:
        fail("A (no rate) request %d: HTTP %d %s" % (i, st, text[:120]))

# priority cap
first = {}
lock = threading.Lock()
def start(name, key, max_tokens, priority=None):  # the call goes out now; read on a thread
    call = gen(gen_req([1, 300 + len(name)], max_tokens, priority), metadata=(("authorization", "Bearer " + key),),
               timeout=60)
    def read():
        try:
            for _ in call:
                with lock:
                    first.setdefault(name, time.monotonic())
        except grpc.RpcError as e:
            fail("%s: %s %s" % (name, e.code().name, e.details()))
    t = threading.Thread(target=read)
    t.start()
    return t
ts = [start("A1", ka, 480)]
while "A1" not in first:
    time.sleep(0.001)
ts.append(start("B", kb, 8, 10))  # B first: at equal priorities it would go first
time.sleep(0.005)
ts.append(start("A2", ka, 8, 0))
for t in ts:
    t.join()
order = sorted(first, key=first.get)
print("first tokens in order: %s" % " ".join(order))
if order != ["A1", "A2", "B"]:
    fail("B's priority 10 was not capped at -5: A2 (priority 0, sent after) should start before B")
sys.exit(rc)
EOF
cl_metric router tandem_auth_api_key_rate_limited_total | grep -qx '2' ||
    cl_fail "tandem_auth_api_key_rate_limited_total is $(cl_metric router tandem_auth_api_key_rate_limited_total), want 2"
cl_end "a key's rate=1 refused its second request on both doors (429 with Retry-After / RESOURCE_EXHAUSTED) and served it after the wait; a key's priority=-5 capped its request's 10"
