#!/bin/bash
# test_cluster_control_garbage: hostile and broken calls on the control APIs of a router, a
# prefill and a decode node started one by one (cluster_faults.py controlgarbage): bodies that
# do not parse, registrations without fields or of a node nobody serves, heartbeats of unknown
# nodes, Admits with ids outside the vocabulary or mismatched counts, Releases of unknown
# leases, Prefills with no tokens, tokens outside the vocabulary or past the model's length,
# absurd block ids and junk transfer descriptions. Each must end with a status (the impossible
# ones with an error) and no process may die; then a lease whose KV never comes (300 ms) must
# give its blocks back (tandem_decode_kv_blocks_used), the cluster must serve 8 requests equal
# to `tandem generate`, and garbage on every /metrics port must close only that connection.
# Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_router --heartbeat-ms 100 --heartbeat-timeout-ms 1000
cl_node prefill p0
cl_node decode d0
cl_wait_nodes 1 1
PC=$(sed -n 's/^prefill p0: control \([^ ]*\) .*/\1/p' "$CL_T/p0.out")
DC=$(sed -n 's/^decode d0: control \([^ ]*\) .*/\1/p' "$CL_T/d0.out")
base=$(cl_metric d0 tandem_decode_kv_blocks_used)
"$CL_PY" "$CL_TOOL" controlgarbage "$CL_CTL" "$DC" "$PC" 512 512 || CL_FAIL=1
for n in router p0 d0; do _cl_dead "${CL_PID[$n]}" && cl_fail "$n died"; done
[ $CL_FAIL -eq 0 ] || cl_end

echo "== garbage on the /metrics ports"
for n in router p0 d0; do
    "$CL_PY" "$CL_TOOL" httpgarbage "${CL_MURL[$n]}" | sed "s/^/$n: /" | tee "$CL_T/http.log"
    grep -q "^$n: FAIL" "$CL_T/http.log" && CL_FAIL=1
    _cl_dead "${CL_PID[$n]}" && cl_fail "$n died of garbage on its /metrics port"
done

echo "== leases whose KV never came (300 ms) give their blocks back"
if v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[d0]}" tandem_decode_kv_blocks_used == "$base" 5); then
    echo "d0 kv blocks used: $base before, $v after the leases expired"
    stale=0
else
    stale=1
fi
for k in $(seq 8); do p="1 $((120 + k))"; echo "$p|$(cl_ref 24 "$p")"; done >"$CL_T/refs"
"$CL_PY" "$CL_TOOL" run "$CL_GW" 24 "$CL_T/refs" || CL_FAIL=1
if [ $stale -eq 1 ]; then
    if v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[d0]}" tandem_decode_kv_blocks_used == "$base" 5); then
        cl_known_fail "tandem_decode_kv_blocks_used stayed above $base after the unused leases expired, until the next decode step: the gauge is only set by the compute loop (decode/decode_main.c, td_metric_set(s->m_used) after each step), not when on_sweep/on_release free a lease's blocks; the heartbeat's free-block count (load_free) is stale the same way"
    else
        cl_fail "d0's used KV blocks did not return to $base even after more requests: $v (leaked lease blocks)"
    fi
fi
cl_end "control-API garbage and hostile calls answered with statuses, no process died, blocks back, the cluster serves exactly"
