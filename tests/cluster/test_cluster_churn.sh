#!/bin/bash
# test_cluster_churn: a router (heartbeat timeout 1000 ms, leases 3000 ms) with 2 prefill and
# 2 decode nodes started one by one; 6 client threads stream greedy generations back to back
# while, every ~1.5 s, one node is SIGKILLed and started again under the same id (p0, d1, p1,
# d0, ...; one node of each role always stays up). Every stream must end OK and equal `tandem
# generate`, or UNAVAILABLE (tokens so far a prefix of it); at least half must succeed (a
# stream whose decode node dies moves to the other: docs/cluster.md "Migration"). Then
# the router has nothing in flight and no more open fds than before (+8), every decode node's
# used KV blocks return to 0, all processes live and no sanitizer report came. Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_router --heartbeat-ms 100 --heartbeat-timeout-ms 1000 --lease-ms 3000
cl_node prefill p0
cl_node prefill p1
cl_node decode d0
cl_node decode d1
cl_wait_nodes 2 2
"$CL_PY" - >"$CL_T/prompts" <<'PY'
import random
r = random.Random(99)
for n in [1, 3, 17, 40, 90, 150, 200, 260]:
    print(" ".join(str(r.randrange(512)) for _ in range(n)))
PY
while read -r p; do echo "$p|$(cl_ref 96 "$p")"; done <"$CL_T/prompts" >"$CL_T/refs"
fds0=$(ls "/proc/${CL_PID[router]}/fd" | wc -l)
"$CL_PY" "$CL_TOOL" churn "$CL_GW" "$CL_T/refs" 96 40 6 "$CL_T/stop" >"$CL_T/churn.log" &
CH=$!
CL_BG+=($CH)
declare -A GEN=([p0]=0 [p1]=0 [d0]=0 [d1]=0) # restarts so far, for unique process names
declare -A CUR=([p0]=p0 [p1]=p1 [d0]=d0 [d1]=d1)
for victim in p0 d1 p1 d0 p0 d1; do
    sleep 1.5
    name=${CUR[$victim]}
    echo "churn: SIGKILL $victim (pid ${CL_PID[$name]})"
    cl_kill "$name" KILL
    sleep 0.3
    GEN[$victim]=$((GEN[$victim] + 1))
    CUR[$victim]=$victim.${GEN[$victim]}
    case $victim in p*) role=prefill ;; *) role=decode ;; esac
    CL_NAME=${CUR[$victim]} cl_node $role "$victim"
done
sleep 1
touch "$CL_T/stop"
wait $CH || CL_FAIL=1
cut -c1-400 "$CL_T/churn.log"
echo "router: $(cl_metric router tandem_router_migrations_total) streams moved mid-stream, $(cl_metric router tandem_router_retries_total) requests retried before a token"
cl_wait_nodes 2 2
"$CL_PY" "$CL_TOOL" ping "$CL_GW" || cl_fail "no request served after the churn"
fds1=$(ls "/proc/${CL_PID[router]}/fd" | wc -l)
echo "router open fds: $fds0 before, $fds1 after"
[ "$fds1" -le $((fds0 + 8)) ] || cl_fail "the router holds $((fds1 - fds0)) more fds after the churn (channels of dead nodes kept?)"
for v in d0 d1; do cl_blocks_back "${CUR[$v]}" 0 "the churn" 10; done
for v in p0 p1 d0 d1; do _cl_dead "${CL_PID[${CUR[$v]}]}" && cl_fail "${CUR[$v]} died"; done
cl_end "streams through node deaths and restarts ended exact or UNAVAILABLE; blocks back, nothing in flight"
