#!/bin/bash
# test_cluster_cancel: on a 1+1 `tandem local` cluster, long generations (480 tokens) are
# cancelled by the client: 8 at their first message (the KV may still be on its way to the
# decode node) and 8 once they have 8 tokens (the decode node is generating them; its used KV
# blocks are read then and must be above the idle count). Each stream ends CANCELLED, the
# router counts 16 cancelled requests, the decode node stops early (fewer tokens decoded than
# asked), and its used KV blocks (tandem_decode_kv_blocks_used on its /metrics) and running
# sequences return to the counts before the requests within 10 s. Skips without the model or
# python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
N=8 MAXTOK=480
cl_local 1 1
[ -n "${CL_MURL[decode0]:-}" ] || { cl_fail "no decode0 metrics URL in tandem local's output"; cl_end; }
D=${CL_MURL[decode0]}
base=$(cl_metric decode0 tandem_decode_kv_blocks_used) || { cl_fail "cannot read decode0's /metrics"; cl_end; }
tok0=$(cl_metric decode0 tandem_decode_tokens_total)
can0=$(cl_metric router tandem_router_requests_total outcome=cancelled 2>/dev/null || echo 0)

blocks_back() { # $1: which cancels
    cl_blocks_back decode0 "$base" "$1"
    "$CL_PY" "$CL_TOOL" waitmetric "$D" tandem_decode_running_sequences == 0 10 >/dev/null ||
        cl_fail "decode0 still runs sequences after $1"
}

echo "== cancel at the first message"
"$CL_PY" "$CL_TOOL" cancel "$CL_GW" $N $MAXTOK 0 || CL_FAIL=1
blocks_back "the cancels at the first message"
sleep 0.5 # a sequence adopted after its cancel would show up now
blocks_back "the cancels at the first message (0.5 s later)"

echo "== cancel after 8 tokens"
"$CL_PY" "$CL_TOOL" cancel "$CL_GW" $N $MAXTOK 8 "$D" | tee "$CL_T/cancel.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || CL_FAIL=1
peak=$(sed -n 's/^in-flight kv blocks used: //p' "$CL_T/cancel.log")
[ "${peak:-0}" -gt "$base" ] || cl_fail "no KV blocks in use while the streams ran (${peak:-none}): the check below would prove nothing"
blocks_back "the cancels after 8 tokens"

tok1=$(cl_metric decode0 tandem_decode_tokens_total)
can1=$(cl_metric router tandem_router_requests_total outcome=cancelled 2>/dev/null || echo 0)
echo "decode0 decoded $((${tok1%.*} - ${tok0%.*})) tokens for $((2 * N)) cancelled requests of $MAXTOK; router cancelled: $can0 -> $can1"
[ $((${tok1%.*} - ${tok0%.*})) -lt $((N * MAXTOK)) ] || cl_fail "the decode node generated every token: the cancels did not stop it"
[ $((${can1%.*} - ${can0%.*})) -eq $((2 * N)) ] || cl_fail "the router counted $((${can1%.*} - ${can0%.*})) cancelled requests, not $((2 * N))"
# the cluster still serves
want=$(cl_ref 16 "1 2 3")
echo "1 2 3|$want" >"$CL_T/refs"
"$CL_PY" "$CL_TOOL" run "$CL_GW" 16 "$CL_T/refs" || CL_FAIL=1
cl_end "$((2 * N)) cancelled streams: CANCELLED, decode stopped early, KV blocks back to $base, next request served"
