#!/bin/bash
# test_cluster_bigprompt: the largest text prompt the gateway accepts (a 4 MiB message: one
# pre-token of letters, the costliest text for a byte-level BPE; 1.8 s to encode with Llama
# 3's tokenizer in the release build, 9 s under the sanitizers; Qwen 3's here, below) sent to a router holding
# that tokenizer while greedy streams run. The router encodes text prompts on libuv's thread
# pool, so its loop keeps serving: every stream ends OK with the ids of `tandem generate`,
# no node misses a heartbeat, the router's loop-lag p99 stays under 50 ms and its longest
# run of callbacks under 250 ms, and the big prompt ends with a clear error (its Qwen 3
# ids are outside stories260K's 512-token vocabulary), not UNAVAILABLE. When the router
# encoded on its loop (issue 21), the 3.9 MB prompt stalled it 1.4 s without a heartbeat:
# both nodes were dropped and the streams in flight ended UNAVAILABLE. Skips without
# stories260K, Qwen 3's tokenizer.json or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
# Qwen 3's tokenizer: its NFC normalizer can shrink text, so the router cannot bound the
# prompt's tokens by its bytes and must encode it (with Llama 3's, whose longest token is 256
# bytes, 4 MiB is at least 16,384 tokens and is refused before encoding: docs/security.md)
TOK="$(dirname "$CL_M")/../tokenizers/qwen3/tokenizer.json"
[ -f "$TOK" ] || { echo "SKIP: $TOK absent (set TANDEM_TEST_MODELS)"; exit 77; }
MAXTOK=200
BYTES=$(((4 << 20) - 64)) # the gateway's max_message_bytes less the request's framing
cl_router --tokenizer "$TOK"
cl_node prefill p0
cl_node decode d0
cl_wait_nodes 1 1
cl_refs refs $MAXTOK 10

"$CL_PY" "$CL_TOOL" bigprompt "$CL_GW" $BYTES "$CL_T/big.res" &
CL_BG+=($!)
rounds=0
while [ ! -s "$CL_T/big.res" ] && [ $rounds -lt 200 ]; do # streams for as long as it is being encoded
    "$CL_PY" "$CL_TOOL" run "$CL_GW" $MAXTOK "$CL_T/refs" >"$CL_T/run.log" 2>&1 ||
        { cl_fail "streams failed while the big prompt was encoded:"; cat "$CL_T/run.log"; break; }
    rounds=$((rounds + 1))
done
wait "${CL_BG[@]}"
echo "streams: $rounds rounds of 8 while the big prompt was encoded, all equal tandem generate"
[ "$rounds" -ge 1 ] || cl_fail "no stream ran while the big prompt was encoded"
res=$(cat "$CL_T/big.res")
echo "big prompt ($BYTES bytes): $res"
[[ $res == INVALID_ARGUMENT*vocabulary* ]] || cl_fail "the big prompt did not end with a clear INVALID_ARGUMENT: $res"
"$CL_PY" "$CL_TOOL" run "$CL_GW" $MAXTOK "$CL_T/refs" >"$CL_T/run.log" 2>&1 ||
    { cl_fail "streams failed after the big prompt:"; cat "$CL_T/run.log"; }
if grep -q 'missed heartbeats\|lost' "$CL_T/router.err"; then
    cl_fail "the router lost a node: $(grep 'missed heartbeats\|lost' "$CL_T/router.err" | head -3)"
fi
"$CL_PY" "$CL_TOOL" looplag 0.05 "router=${CL_MURL[router]}" | tee "$CL_T/lag.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || cl_fail "the router's event loop lagged"
longest=$(cl_metric router tandem_event_loop_longest_run_seconds)
"$CL_PY" -c "import sys; sys.exit(0 if float('$longest') < 0.25 else 1)" ||
    cl_fail "the router's longest run of callbacks was $longest s (the prompt was encoded on its loop?)"
cl_end "a $BYTES-byte text prompt encoded off the router's loop: streams equal tandem generate meanwhile, no node lost, loop lag p99 < 50 ms, longest run $longest s, the prompt refused with a clear error"
