#!/bin/bash
# test_cluster_router_restart: a router on a fixed control port, 1 prefill and 1 decode node.
# 8 long streams run; once each has a token the router is SIGKILLed: every stream must end
# UNAVAILABLE at once (within 2 s), the decode node must end or finish their sequences (none
# left within 10 s) and keep running. A new router on the same control port must see both
# nodes register again (they notice the failed heartbeats) within 15 s and serve 8 requests
# equal to `tandem generate`. The dead router's leases expire (--lease-ms 2000): the decode
# node's used KV blocks must be back to the count before. Skips without the
# model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
PORT=$("$CL_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cl_cluster 1 --control-port "$PORT" --heartbeat-ms 100 --heartbeat-timeout-ms 1000 --lease-ms 2000
base=$(cl_metric d0 tandem_decode_kv_blocks_used)
cl_refs long 480 140
cl_refs short 24 160 9

echo "== SIGKILL the router mid-stream"
CL_KILLED[router]=1
"$CL_PY" "$CL_TOOL" nodekill "$CL_GW" "${CL_PID[router]}" KILL 2000 "$CL_T/long" 480 || CL_FAIL=1
v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[d0]}" tandem_decode_running_sequences == 0 10) ||
    cl_fail "d0 still runs sequences of the dead router: $v"
for n in p0 d0; do _cl_dead "${CL_PID[$n]}" && cl_fail "$n died with the router"; done

echo "== a new router on the same control port"
CL_ROUTER=router2
cl_router --control-port "$PORT" --heartbeat-ms 100 --heartbeat-timeout-ms 1000
CL_WAIT_NODES_S=15 cl_wait_nodes 1 1
"$CL_PY" "$CL_TOOL" run "$CL_GW" 24 "$CL_T/short" || CL_FAIL=1
# leases whose KV had not landed when the router died have expired by now (2 s + 1 s grace)
cl_blocks_back d0 "$base" "the router's death and its leases' expiry"
cl_end "the router's death ended its streams UNAVAILABLE, the nodes freed them, re-registered with a new router, which serves exactly"
