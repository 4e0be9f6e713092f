#!/bin/bash
# test_openai: the router's OpenAI-compatible HTTP API (docs/openai.md) against `tandem local`
# serving SmolLM2-135M-Instruct ($TANDEM_TEST_GGUF), spoken to by the official `openai` Python
# client (a venv of its own, scripts/openai-venv) and by curl:
# - greedy chat and completions, whole and streamed (with include_usage), equal `tandem
#   generate`'s text for the same conversation or prompt; shapes checked by the client
#   (tests/cluster/openai_client.py); log-probabilities (chat's, completions' with echo);
# - SSE framing as sent on the wire (curl): text/event-stream, "data: {json}" events each
#   followed by a blank line, a usage chunk, "data: [DONE]" last;
# - bad requests: malformed JSON, wrong types (the parameter named), n > 16, an unknown model,
#   a body over the limit (413), unknown path (404) and method (405); /health and /v1/models;
#   /metrics not on the API port (404, saying where) unless --http-metrics;
#   a router with no nodes: /health and generations 503;
# - a client that disconnects mid-stream cancels its request: counted cancelled, the decode
#   node's KV blocks back to where they were.
# Skips without the GGUF or without the openai client (offline). Lighter under the sanitizers.
source "$(dirname "$0")/cluster_lib.sh"
cl_need_gguf
if ! OA_PY=$("$CL_SRC/scripts/openai-venv" 2>/tmp/openai-venv.$$); then
    echo "SKIP: no openai Python client: $(tail -1 /tmp/openai-venv.$$)"
    rm -f /tmp/openai-venv.$$
    exit 77
fi
rm -f /tmp/openai-venv.$$
cl_init_gguf
MAXTOK=12
SAN=0
[ "${TD_SANITIZE:-OFF}" = ON ] && MAXTOK=3 SAN=1 # the model runs ~20x slower under the sanitizers
cl_local 1 1 --threads 1 --kv-mem 128
OA=$(sed -n 's/^openai: //p' "$CL_T/local.out")
[ -n "$OA" ] || { cl_fail "no 'openai:' line in tandem local's output"; cl_dump; cl_end; }
CLIENT="$CL_SRC/tests/cluster/openai_client.py"

n=0
same() { # WHAT WANT GOT
    if [ -n "$2" ] && [ "$2" = "$3" ]; then
        n=$((n + 1))
    else
        cl_fail "$1: want '$2' got '$3'"
    fi
}
Q="What is the capital of France?"
P="The three primary colors are"
want_chat=$("$CL_BIN" generate --model "$CL_M" --chat --prompt "$Q" --max-tokens $MAXTOK --threads 1 2>/dev/null)
want_text=$("$CL_BIN" generate --model "$CL_M" --prompt "$P" --max-tokens $MAXTOK --threads 1 2>/dev/null)
modes="stream whole"
[ $SAN = 1 ] && modes=stream
for mode in $modes; do
    same "chat ($mode)" "$want_chat" "$("$OA_PY" "$CLIENT" "$OA" text chat $mode $MAXTOK "$Q" 2>"$CL_T/oa.err")"
    [ -s "$CL_T/oa.err" ] && cl_fail "chat ($mode): $(cat "$CL_T/oa.err")"
    same "completions ($mode)" "$want_text" "$("$OA_PY" "$CLIENT" "$OA" text completions $mode $MAXTOK "$P" 2>"$CL_T/oa.err")"
    [ -s "$CL_T/oa.err" ] && cl_fail "completions ($mode): $(cat "$CL_T/oa.err")"
done

# SSE framing on the wire
curl -sS -N -D "$CL_T/sse.h" "$OA/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"messages\":[{\"role\":\"user\",\"content\":\"$Q\"}],\"max_tokens\":3,\"temperature\":0,\"stream\":true,
         \"stream_options\":{\"include_usage\":true}}" >"$CL_T/sse" || cl_fail "curl stream"
grep -qi '^content-type: text/event-stream' "$CL_T/sse.h" || cl_fail "SSE content type: $(cat "$CL_T/sse.h")"
"$CL_PY" - "$CL_T/sse" <<'EOF' || cl_fail "SSE framing: $(head -c 600 "$CL_T/sse")"
import json, sys
raw = open(sys.argv[1], "rb").read().decode()
assert raw.endswith("data: [DONE]\n\n"), "does not end with data: [DONE]"
events = raw.split("\n\n")
assert events[-1] == "", "bytes after the last event"
events = events[:-1]
assert all(e.startswith("data: ") and "\n" not in e for e in events), "an event is not one data line"
chunks = [json.loads(e[6:]) for e in events[:-1]]
assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3, chunks[-1]
assert chunks[-2]["choices"][0]["finish_reason"] == "length", chunks[-2]
assert all(c["usage"] is None for c in chunks[:-1])
print("sse: %d chunks, usage, [DONE]" % len(chunks))
EOF

# log-probabilities: chat's, and completions' with echo (the prompt's too, as harnesses use)
"$OA_PY" "$CLIENT" "$OA" logprobs $MAXTOK "$P" >"$CL_T/lp" 2>&1 || cl_fail "logprobs: $(cat "$CL_T/lp")"

# errors through the client (each names its parameter), then by hand
"$OA_PY" "$CLIENT" "$OA" errors >"$CL_T/errors" 2>&1 || cl_fail "errors: $(cat "$CL_T/errors")"
status() { # WANT_STATUS WANT_BODY_REGEX CURL_ARGS...
    local want=$1 re=$2 got
    shift 2
    got=$(curl -sS -o "$CL_T/body" -w '%{http_code}' "$@")
    if [ "$got" != "$want" ] || ! grep -qE "$re" "$CL_T/body"; then
        cl_fail "curl $*: status $got, body $(head -c 300 "$CL_T/body"); want $want and /$re/"
    fi
}
status 400 '"error":\{"message":"the body is not valid JSON' "$OA/completions" -d '{"prompt": "x",'
status 400 '"param":"temperature"' "$OA/completions" -d '{"prompt":"x","temperature":"hot"}'
status 400 '"param":"prompt"' "$OA/completions" -d '{"prompt":["a","b"]}'
status 400 '"param":"n"' "$OA/completions" -d '{"prompt":"x","n":17}'
head -c 9000000 /dev/zero | tr '\0' a >"$CL_T/huge"
status 413 '"error":\{"message":"request body too large"' "$OA/completions" --data-binary @"$CL_T/huge"
status 404 '"code":"not_found"' "$OA/embeddings" -d '{}'
status 405 '"code":"method_not_allowed"' "$OA/chat/completions"
status 200 '"status":"ok"' "${OA%/v1}/health"
status 200 '"object":"list".*"object":"model"' "$OA/models"
# /metrics is not on the API port (it answers without a key): the metrics port serves it
status 404 'served on the metrics port' "${OA%/v1}/metrics"
status 200 'tandem_router_requests_total' "${CL_MURL[router]}"

# a client gone mid-stream: its request is cancelled and its KV blocks come back
base=$(cl_metric decode0 tandem_decode_kv_blocks_used) || cl_fail "cannot read decode0's /metrics"
cancelled() { cl_metric router tandem_router_requests_total outcome=cancelled 2>/dev/null || echo 0; }
c0=$(cancelled)
"$OA_PY" "$CLIENT" "$OA" disconnect 400 "Tell me a very long story about a dragon." >"$CL_T/disc" 2>&1 ||
    cl_fail "disconnect: $(cat "$CL_T/disc")"
for ((i = 0; i < 100; i++)); do
    c=$(cancelled)
    [ "${c%.*}" -gt "${c0%.*}" ] && break
    sleep 0.1
done
[ "${c%.*}" -gt "${c0%.*}" ] || cl_fail "the disconnect was not counted cancelled ($c0 before, $c after)"
cl_blocks_back decode0 "$base" "a client disconnected mid-stream"

# a router without nodes: /health 503, a generation 503 (no pair up), and the openai: line
# of a router started with --http-port, and /metrics on the API port when asked (--http-metrics)
CL_ROUTER=bare cl_router --http-port 0 --tokenizer "$CL_M" --http-metrics
BARE=$(sed -n 's/^openai: //p' "$CL_T/bare.out")
[ -n "$BARE" ] || cl_fail "no 'openai:' line in the router's output: $(cat "$CL_T/bare.out")"
status 200 'tandem_router_requests_total' "${BARE%/v1}/metrics"
status 503 '"status":"unavailable"' "${BARE%/v1}/health"
status 503 '"type":"service_unavailable"' "$BARE/completions" -d '{"prompt":"Hi","max_tokens":2}'

cl_end "$n OpenAI client generations equal tandem generate's on SmolLM2; logprobs; SSE framing; errors; disconnect cancels"
