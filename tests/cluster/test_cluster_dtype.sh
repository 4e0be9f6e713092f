#!/bin/bash
# test_cluster_dtype: nodes with --dtype. A bf16 prefill node whose only decode node is f32
# cannot be paired (the KV layouts differ): the request fails with the reason, and nothing
# is held. Once a bf16 decode node joins, greedy generations through the cluster (bf16
# weights and KV cache, KV moved as bf16 over UCX) equal `tandem generate --dtype bf16`, and
# the f32 decode node got none of them. Bad --dtype / --device values are refused at start
# (exit 2, the value named); --device cuda on a machine without a GPU fails with the reason.
# Process handling, sanitizer logs and clean shutdown: tests/cluster/cluster_lib.sh.
source "$(dirname "$0")/cluster_lib.sh"
cl_init

for bad in "--dtype int4" "--device gpu0"; do
    # shellcheck disable=SC2086
    "$CL_BIN" decode --model "$CL_M" $bad >"$CL_T/bad.out" 2>&1
    rc=$?
    [ $rc -eq 2 ] && grep -q "'${bad#* }'" "$CL_T/bad.out" ||
        cl_fail "decode $bad: rc $rc, want 2 naming the value: $(head -c 300 "$CL_T/bad.out")"
done
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    timeout 60 "$CL_BIN" prefill --model "$CL_M" --device cuda --router 127.0.0.1:1 >"$CL_T/cuda.out" 2>&1
    rc=$?
    [ $rc -eq 1 ] && grep -q "no usable CUDA device\|built without CUDA" "$CL_T/cuda.out" ||
        cl_fail "prefill --device cuda without a GPU: rc $rc, want 1 with the reason: $(head -c 300 "$CL_T/cuda.out")"
fi

cl_router
cl_node prefill p0 --dtype bf16
cl_node decode f32 --dtype f32
cl_wait_nodes 1 1
timeout 30 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "1 403 407" --max-tokens 8 --print-ids \
    --timeout 10 >"$CL_T/mis.out" 2>&1 &&
    cl_fail "a bf16 prefill node was paired with an f32 decode node: $(cat "$CL_T/mis.out")"
grep -q "layout mismatch: dtype" "$CL_T/mis.out" || cl_fail "the error does not name the dtype difference: $(cat "$CL_T/mis.out")"

cl_node decode d0 --dtype bf16
cl_wait_nodes 1 2
n=0
for p in "1 403 407" "1 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21" "1 300"; do
    got=$(timeout 60 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$p" --max-tokens 40 --print-ids \
          2>"$CL_T/gen.err")
    want=$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$p" --max-tokens 40 --print-ids --threads 1 \
           --dtype bf16 2>/dev/null)
    [ -n "$want" ] && [ "$want" = "$got" ] || cl_fail "prompt '$p': want '$want' got '$got' ($(tail -1 "$CL_T/gen.err"))"
    n=$((n + 1))
done
a=$(cl_metric f32 tandem_decode_admits_total)
[ "${a%.*}" = 0 ] || cl_fail "the f32 decode node admitted $a requests"
cl_end "$n bf16 cluster generations equal generate --dtype bf16; a mismatched pair refused"
