#!/bin/bash
# test_cluster_slow_reader: a client that asks for 480 tokens and never reads (a raw h2c
# connection whose stream flow-control window stays 0) must not hold the cluster: the router
# (--max-backlog-tokens 32, --send-queue-bytes 64) sends no DATA into the closed window, ends
# the stream within 5 s with trailers the client gets (HEADERS are not flow-controlled;
# outcome slow_client on the router's /metrics), the decode node's used KV
# blocks return to the count before, and other clients are served meanwhile and after. Skips
# without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_router --max-backlog-tokens 32 --send-queue-bytes 64
cl_node prefill p0
cl_node decode d0
cl_wait_nodes 1 1
base=$(cl_metric d0 tandem_decode_kv_blocks_used)
sc0=$(cl_metric router tandem_router_requests_total outcome=slow_client 2>/dev/null || echo 0)
for k in $(seq 4); do p="1 $((200 + k))"; echo "$p|$(cl_ref 64 "$p")"; done >"$CL_T/refs"
"$CL_PY" "$CL_TOOL" slowreader "$CL_GW" 480 5 &
SR=$!
CL_BG+=($SR)
"$CL_PY" "$CL_TOOL" run "$CL_GW" 64 "$CL_T/refs" || cl_fail "requests beside the slow reader"
wait $SR; src=$?
sc1=$(cl_metric router tandem_router_requests_total outcome=slow_client 2>/dev/null || echo 0)
echo "router slow_client outcomes: $sc0 -> $sc1"
[ $((${sc1%.*} - ${sc0%.*})) -eq 1 ] || cl_fail "the router counted $((${sc1%.*} - ${sc0%.*})) slow_client outcomes, not 1"
[ $src -eq 0 ] || CL_FAIL=1
cl_blocks_back d0 "$base" "the slow reader's stream ended"
"$CL_PY" "$CL_TOOL" run "$CL_GW" 64 "$CL_T/refs" || CL_FAIL=1
cl_end "a client that never reads was cut off by the backlog bound with no DATA past its window; others served"
