#!/bin/bash
# test_cluster_kv_q8: nodes with a Q8_0 KV cache (--kv-dtype q8_0) on SmolLM2-135M-Instruct
# ($TANDEM_TEST_GGUF; head_dim 64, two Q8_0 blocks a head row). A q8_0 prefill node whose only
# decode node keeps an f16 KV cache cannot be paired: the request fails naming the dtype, and
# the f16 node admits nothing. Once a q8_0 decode node joins, greedy generations through the
# cluster (the KV moved as Q8_0 blocks) equal `tandem generate --kv-dtype q8_0`. A bad
# --kv-dtype is refused at start (exit 2, the value named). Skips without the GGUF.
source "$(dirname "$0")/cluster_lib.sh"
cl_init_gguf
MAXTOK=12
[ "${TD_SANITIZE:-OFF}" = ON ] && MAXTOK=3 # the model runs ~20x slower under the sanitizers

"$CL_BIN" decode --model "$CL_M" --kv-dtype q4_k >"$CL_T/bad.out" 2>&1
rc=$?
[ $rc -eq 2 ] && grep -q "'q4_k'" "$CL_T/bad.out" ||
    cl_fail "decode --kv-dtype q4_k: rc $rc, want 2 naming the value: $(head -c 300 "$CL_T/bad.out")"

cl_router
cl_node prefill p0 --kv-dtype q8_0 --kv-mem 64
cl_node decode f16 --kv-dtype f16 --kv-mem 64
cl_wait_nodes 1 1
timeout 60 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "1 403 407" --max-tokens 4 --print-ids \
    --timeout 30 >"$CL_T/mis.out" 2>&1 &&
    cl_fail "a q8_0 prefill node was paired with an f16 decode node: $(cat "$CL_T/mis.out")"
grep -q "layout mismatch: dtype" "$CL_T/mis.out" || cl_fail "the error does not name the dtype difference: $(cat "$CL_T/mis.out")"

cl_node decode d0 --kv-dtype q8_0 --kv-mem 64
cl_wait_nodes 1 2
n=0
for p in "1 403 407" "1 504 3301 282 9826 30 3456 314 1345 2046 1161 30 260"; do
    got=$(timeout 120 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$p" --max-tokens $MAXTOK --print-ids \
          --timeout 100 2>"$CL_T/gen.err")
    want=$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$p" --max-tokens $MAXTOK --print-ids --threads 1 \
           --kv-dtype q8_0 2>/dev/null)
    [ -n "$want" ] && [ "$want" = "$got" ] || cl_fail "prompt '$p': want '$want' got '$got' ($(tail -1 "$CL_T/gen.err"))"
    n=$((n + 1))
done
a=$(cl_metric f16 tandem_decode_admits_total)
[ "${a%.*}" = 0 ] || cl_fail "the f16 decode node admitted $a requests"
cl_end "$n q8_0-KV cluster generations equal generate --kv-dtype q8_0; a q8_0/f16 pair refused"
