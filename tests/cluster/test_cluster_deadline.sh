#!/bin/bash
# test_cluster_deadline: on a 1+1 `tandem local` cluster, generations of 480 tokens with a
# deadline far shorter than they take end DEADLINE_EXCEEDED: 8 grpcio streams with a 5 ms
# client deadline (stories260K ends its stories after about 220 tokens, and a whole such
# generation once came back within 20 ms), and one h2c request (curl) carrying
# `grpc-timeout: 5m` with no deadline
# of its own, so the status is the router's (grpc-status 4) while 4 other long streams keep the
# decode node busy. Afterwards the decode node's used KV blocks return to the count before
# (its /metrics, within 10 s), the router counted a deadline, and the next request is served.
# Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
MAXTOK=480
cl_local 1 1
[ -n "${CL_MURL[decode0]:-}" ] || { cl_fail "no decode0 metrics URL in tandem local's output"; cl_end; }
base=$(cl_metric decode0 tandem_decode_kv_blocks_used) || { cl_fail "cannot read decode0's /metrics"; cl_end; }
dl0=$(cl_metric router tandem_router_requests_total outcome=deadline 2>/dev/null || echo 0)
cl_py deadline "$CL_GW" 8 $MAXTOK 0.005
if command -v curl >/dev/null && curl -V | grep -q HTTP2; then
    "$CL_PY" "$CL_TOOL" rawdeadline "$CL_GW" $MAXTOK 5 4 || CL_FAIL=1
    dl1=$(cl_metric router tandem_router_requests_total outcome=deadline 2>/dev/null || echo 0)
    echo "router deadline outcomes: $dl0 -> $dl1"
    [ "${dl1%.*}" -gt "${dl0%.*}" ] || cl_fail "the router counted no deadline outcome for the grpc-timeout request"
else
    echo "SKIP (server-side grpc-timeout part): no curl with HTTP/2"
fi
cl_blocks_back decode0 "$base" "the deadlines"
want=$(cl_ref 16 "1 2 3")
echo "1 2 3|$want" >"$CL_T/refs"
"$CL_PY" "$CL_TOOL" run "$CL_GW" 16 "$CL_T/refs" || CL_FAIL=1
cl_end "deadlines end DEADLINE_EXCEEDED (client and server side), KV blocks back to $base, next request served"
