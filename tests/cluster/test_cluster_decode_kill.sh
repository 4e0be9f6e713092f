#!/bin/bash
# test_cluster_decode_kill: a router (heartbeat timeout 1000 ms) that moves no stream
# (--max-migrations 0: the moves are test_cluster_migrate's), 1 prefill and 2 decode
# nodes started one by one. 8 long streams (480 tokens) run across both decode nodes; once
# each has a token, one decode node is SIGKILLed: its streams must end UNAVAILABLE within
# the heartbeat bound (1000 ms + 1000 ms slack) saying they were not moved, the other
# streams must finish equal to
# `tandem generate`, and new requests must succeed on the surviving decode node. Then a
# third decode node joins and is frozen (SIGSTOP: no connection reset, only silence): its
# streams must end UNAVAILABLE within the heartbeat bound (1000 ms + 1500 ms slack) too. Last,
# a fourth decode node is frozen before 8 requests come and SIGKILLed 300 ms later, while
# their Admit waits on it: the router must retry them on the survivor (all equal `tandem
# generate`), and the survivor's used KV blocks return to their count before the test.
# Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
HB=1000 MAXTOK=480
cl_cluster 2 --heartbeat-ms 100 --heartbeat-timeout-ms $HB --max-migrations 0
d1base=$(cl_metric d1 tandem_decode_kv_blocks_used)
cl_refs long $MAXTOK 40
cl_refs short 32 60 77

echo "== SIGKILL d0 mid-stream"
CL_KILLED[d0]=1
"$CL_PY" "$CL_TOOL" nodekill "$CL_GW" "${CL_PID[d0]}" KILL $((HB + 1000)) "$CL_T/long" $MAXTOK || CL_FAIL=1
a0=$(cl_metric d1 tandem_decode_admits_total)
"$CL_PY" "$CL_TOOL" run "$CL_GW" 32 "$CL_T/short" || CL_FAIL=1
a1=$(cl_metric d1 tandem_decode_admits_total)
echo "d1 admits: $a0 -> $a1"
[ $((${a1%.*} - ${a0%.*})) -ge 8 ] || cl_fail "the 8 new requests did not all go to d1 (admits $a0 -> $a1)"

echo "== SIGSTOP d2 mid-stream (only heartbeats can tell)"
cl_node decode d2
cl_wait_nodes 1 2
CL_KILLED[d2]=1
"$CL_PY" "$CL_TOOL" nodekill "$CL_GW" "${CL_PID[d2]}" STOP $((HB + 1500)) "$CL_T/long" $MAXTOK || CL_FAIL=1
cl_kill d2 KILL
"$CL_PY" "$CL_TOOL" run "$CL_GW" 32 "$CL_T/short" || CL_FAIL=1

echo "== d3 frozen before the requests come, killed while their Admit waits on it"
cl_node decode d3
cl_wait_nodes 1 2
r0=$(cl_metric router tandem_router_retries_total)
CL_KILLED[d3]=1
"$CL_PY" "$CL_TOOL" stopkill "$CL_GW" "${CL_PID[d3]}" 300 "$CL_T/short" 32 || CL_FAIL=1
r1=$(cl_metric router tandem_router_retries_total)
echo "router retries: $r0 -> $r1"
[ "${r1%.*}" -gt "${r0%.*}" ] || cl_fail "the router retried nothing: no request was waiting on the killed decode node"
cl_blocks_back d1 "$d1base" "the kills"
cl_end "a killed and a frozen decode node: their streams ended UNAVAILABLE within the heartbeat bound, the rest equal tandem generate; requests waiting on a killed node retried; new requests served"
