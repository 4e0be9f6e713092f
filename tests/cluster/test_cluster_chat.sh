#!/bin/bash
# test_cluster_chat: a real model served by a cluster, spoken to through its chat template.
# `tandem local` serves SmolLM2-135M-Instruct (Q4_1 GGUF: weights, tokenizer and ChatML
# template all from the one file; $TANDEM_TEST_GGUF, which scripts/test fetches) as 1 prefill
# + 1 decode. A conversation sent as GenerateRequest.messages (`tandem generate --server
# --chat`, with and without --system) is rendered and encoded by the router and must give
# the greedy ids `tandem generate --model FILE --chat` gives on this machine; a text prompt
# the router encodes from the GGUF vocabulary likewise. A request with both messages and a
# prompt is refused with a message. Skips without the GGUF (offline) or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init_gguf
MAXTOK=12
[ "${TD_SANITIZE:-OFF}" = ON ] && MAXTOK=3 # the model runs ~20x slower under the sanitizers
cl_local 1 1 --threads 1 --kv-mem 128

n=0
check() { # WHAT ARGS...: the cluster's ids equal the local run's
    local what=$1 want got
    shift
    want=$("$CL_BIN" generate --model "$CL_M" "$@" --max-tokens $MAXTOK --print-ids --threads 1 2>"$CL_T/want.err")
    got=$(timeout 120 "$CL_BIN" generate --server "$CL_GW" "$@" --max-tokens $MAXTOK --print-ids --timeout 100 \
          2>"$CL_T/got.err")
    if [ -n "$want" ] && [ "$want" = "$got" ]; then
        n=$((n + 1))
    else
        cl_fail "$what: want '$want' ($(tail -1 "$CL_T/want.err")) got '$got' ($(tail -1 "$CL_T/got.err"))"
    fi
}
check "chat" --chat --prompt "What is the capital of France?"
if [ "${TD_SANITIZE:-OFF}" != ON ]; then
    check "chat with a system message" --chat --system "You are a pirate." --prompt "Say hello."
    check "text prompt" --prompt "The three primary colors are"
fi

# messages and a prompt together: INVALID_ARGUMENT naming both
"$CL_PY" - "$CL_GW" "$CL_SRC" >"$CL_T/both.out" 2>&1 <<'EOF'
import sys
sys.path.insert(0, sys.argv[2] + "/tests/cluster")
import grpc
import cluster_wire as w
ch = w.channel(sys.argv[1])
# GenerateRequest: prompt (1), max_tokens (3), messages (10: ChatMessage role 1, content 2)
req = w.pb_bytes(1, "hi") + w.pb_varint(3, 2) + w.pb_bytes(10, w.pb_bytes(1, "user") + w.pb_bytes(2, "hello"))
try:
    for _ in w.generate_stub(ch)(req, timeout=20):
        pass
    print("accepted")
except grpc.RpcError as e:
    print(e.code().name, e.details())
EOF
grep -q "INVALID_ARGUMENT.*not both" "$CL_T/both.out" ||
    cl_fail "messages with a prompt: want INVALID_ARGUMENT (not both): $(cat "$CL_T/both.out")"
cl_end "$n chat/text generations through the router equal tandem generate on SmolLM2; messages + prompt refused"
