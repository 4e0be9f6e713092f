#!/bin/bash
# test_cluster_stall: deadlines and cancels while a node is stalled under the request. A
# router (heartbeat timeout 5000 ms, longer than any stall here, so no node is dropped), 1
# prefill and 1 decode node started one by one; a node is frozen with SIGSTOP and continued
# with SIGCONT after the call ended:
#   prefill frozen before the request: a 500 ms client deadline → DEADLINE_EXCEEDED (the
#     decode node's lease holds blocks meanwhile); the router's own grpc-timeout (curl, no
#     client deadline) → grpc-status 4; a client cancel 500 ms in → CANCELLED;
#   decode frozen after 8 tokens: a 1 s deadline → DEADLINE_EXCEEDED; a cancel 300 ms in →
#     CANCELLED (the Release waits in the socket until the node continues).
# Afterwards the decode node's used KV blocks return to the count before, no sequence runs,
# every process is alive, the router counted the deadlines and cancels, and 8 concurrent
# requests equal `tandem generate` (stale prefills of the continued node did not corrupt the
# KV). Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_router --heartbeat-ms 100 --heartbeat-timeout-ms 5000
cl_node prefill p0
cl_node decode d0
cl_wait_nodes 1 1
base=$(cl_metric d0 tandem_decode_kv_blocks_used)
dl0=$(cl_metric router tandem_router_requests_total outcome=deadline 2>/dev/null || echo 0)
ca0=$(cl_metric router tandem_router_requests_total outcome=cancelled 2>/dev/null || echo 0)
un0=$(cl_metric router tandem_router_requests_total outcome=unavailable 2>/dev/null || echo 0)
P=${CL_PID[p0]} D=${CL_PID[d0]}

echo "== prefill frozen: client deadline"
cl_py stall "$CL_GW" "$P" -1 deadline 0.5 16 "${CL_MURL[d0]}"
held=$(sed -n 's/^stalled kv blocks used: //p' "$CL_T/py.log")
[ "${held:-0}" -gt "$base" ] || echo "note: the decode node held no blocks for the waiting request (${held:-?})"
echo "== prefill frozen: the router's grpc-timeout"
if command -v curl >/dev/null && curl -V | grep -q HTTP2; then
    kill -STOP "$P"
    "$CL_PY" "$CL_TOOL" rawdeadline "$CL_GW" 16 500 0 || CL_FAIL=1
    kill -CONT "$P"
else
    echo "SKIP (server-side grpc-timeout part): no curl with HTTP/2"
fi
echo "== prefill frozen: client cancel"
"$CL_PY" "$CL_TOOL" stall "$CL_GW" "$P" -1 cancel 0.5 16 || CL_FAIL=1
echo "== decode frozen after 8 tokens: client deadline"
cl_py stall "$CL_GW" "$D" 8 deadline 1.0 480
echo "== decode frozen after 8 tokens: client cancel"
"$CL_PY" "$CL_TOOL" stall "$CL_GW" "$D" 8 cancel 0.3 480 || CL_FAIL=1

cl_blocks_back d0 "$base" "the stalls"
for n in router p0 d0; do _cl_dead "${CL_PID[$n]}" && cl_fail "$n died"; done
dl1=$(cl_metric router tandem_router_requests_total outcome=deadline 2>/dev/null || echo 0)
ca1=$(cl_metric router tandem_router_requests_total outcome=cancelled 2>/dev/null || echo 0)
un1=$(cl_metric router tandem_router_requests_total outcome=unavailable 2>/dev/null || echo 0)
echo "router outcomes: deadline $dl0 -> $dl1, cancelled $ca0 -> $ca1, unavailable $un0 -> $un1"
n=$((${dl1%.*} + ${ca1%.*} - ${dl0%.*} - ${ca0%.*}))
[ "${un1%.*}" -eq "${un0%.*}" ] || cl_fail "the router ended $((${un1%.*} - ${un0%.*})) of the stalled requests UNAVAILABLE"
[ $n -eq 5 ] || cl_fail "the router counted $n deadline+cancelled outcomes, not 5"
for k in $(seq 8); do p="1 $((90 + k)) $((k * 7))"; echo "$p|$(cl_ref 48 "$p")"; done >"$CL_T/refs"
"$CL_PY" "$CL_TOOL" run "$CL_GW" 48 "$CL_T/refs" || CL_FAIL=1
cl_end "deadlines and cancels under a frozen prefill or decode node end right, blocks come back, the cluster serves exactly"
