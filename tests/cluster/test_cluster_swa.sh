#!/bin/bash
# test_cluster_swa: sliding-window attention end to end. A Mistral-shaped random model with a
# 40-token window (`tandem model synth --config tiny-swa`) served by a 1 prefill + 1 decode
# cluster (`tandem local`): greedy answers to prompts shorter and longer than the window, run
# 90 tokens past it, must equal `tandem generate` on this machine; the decode node must give
# blocks behind the window back to its pool as it goes (tandem_decode_kv_blocks_window_
# released_total), and the second round of the same prompts (prefix-cache hits on the
# prefill node, with blocks the window has left) must answer the same again. Every KV byte
# sent is received. Then a unified node (prefill and decode in one engine and one pool,
# releasing as it decodes) answers the same prompts the same way. cl_stop/cl_end check nothing is left held (no running sequence,
# lease or used block once idle). Skips without python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
CL_M="$CL_T/tiny-swa"
"$CL_BIN" model synth --config tiny-swa --out "$CL_M" --seed 3 2>"$CL_T/synth.err" ||
    { cl_fail "model synth --config tiny-swa: $(cat "$CL_T/synth.err")"; cl_end "unreachable"; }
grep -qE '"sliding_window":[[:space:]]*40' "$CL_M/config.json" || cl_fail "tiny-swa's config.json has no sliding_window 40"
cl_local 1 1
long=$(seq -s ' ' 300 372)      # 73 tokens: the window ends inside the prompt
longer=$(seq -s ' ' 100 3 400)  # 101 tokens
PROMPTS=("256 1 2 3" "256 $long" "256 $longer" "256 9 8 7 6 5 4 3 2 1 0 11 12 13 14 15 16 17 18 19 20")
for round in 1 2; do
    cl_concurrent_equal 90 "${PROMPTS[@]}"
done
cl_kv_bytes_equal
released=$(cl_metric decode0 tandem_decode_kv_blocks_window_released_total)
echo "decode0 blocks released behind the window: $released"
[ "${released%.*}" -gt 0 ] 2>/dev/null || cl_fail "the decode node released no block behind the window ('$released')"
hits=$(cl_metric prefill0 tandem_prefill_cached_tokens_total)
echo "prefill0 prompt tokens from its prefix cache: $hits"
[ "${hits%.*}" -gt 0 ] 2>/dev/null || cl_fail "the second round hit no cached prefix on the prefill node ('$hits')"
cl_stop
CL_NAMES=() CL_PID=()

echo "== unified"
cl_local 0 0 --unified 1 --threads 1
cl_concurrent_equal 90 "${PROMPTS[@]}"
released=$(cl_metric unified0 tandem_unified_kv_blocks_window_released_total)
echo "unified0 blocks released behind the window: $released"
[ "${released%.*}" -gt 0 ] 2>/dev/null || cl_fail "the unified node released no block behind the window ('$released')"
cl_end "${#PROMPTS[@]} x 3 sliding-window generations (prefill + decode, unified) equal local generate"
