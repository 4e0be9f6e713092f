#!/bin/bash
# test_cluster_prefill_kill: a router, 2 prefill and 1 decode nodes started one by one. One
# prefill node is frozen (SIGSTOP) just before 16 requests (prompts of 300 ids) arrive, so
# the router sends it some; 300 ms later it is SIGKILLed while they wait there. Every request
# must then be retried on the other prefill node and equal `tandem generate` (UNAVAILABLE is
# allowed only for a stream that already had tokens); the router must count retries, the
# decode node's used KV blocks must return to their count before, and new requests succeed. Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
MAXTOK=16
cl_router --heartbeat-ms 100 --heartbeat-timeout-ms 3000
cl_node prefill p0
cl_node prefill p1
cl_node decode d0
cl_wait_nodes 2 1
dbase=$(cl_metric d0 tandem_decode_kv_blocks_used)
"$CL_PY" - >"$CL_T/prompts" <<'PY'
import random
r = random.Random(7)
for k in range(16):
    print(" ".join(str(r.randrange(512)) for _ in range(300)))
PY
while read -r p; do echo "$p|$(cl_ref $MAXTOK "$p")"; done <"$CL_T/prompts" >"$CL_T/refs"
r0=$(cl_metric router tandem_router_retries_total)
CL_KILLED[p0]=1
"$CL_PY" "$CL_TOOL" stopkill "$CL_GW" "${CL_PID[p0]}" 300 "$CL_T/refs" $MAXTOK || CL_FAIL=1
r1=$(cl_metric router tandem_router_retries_total)
echo "router retries: $r0 -> $r1"
[ "${r1%.*}" -gt "${r0%.*}" ] || cl_fail "the router retried nothing: no request was waiting on the killed prefill node"
cl_blocks_back d0 "$dbase" "the prefill node's death (leases of its failed prefills)"
head -4 "$CL_T/refs" >"$CL_T/refs4"
"$CL_PY" "$CL_TOOL" run "$CL_GW" $MAXTOK "$CL_T/refs4" || CL_FAIL=1
cl_end "a prefill node killed with requests on it: they were retried on the other and equal tandem generate; new requests served"
