#!/bin/bash
# test_cluster_control_garbage: hostile and broken calls on the control APIs of a router, a
# prefill and a decode node started one by one (cluster_faults.py controlgarbage): bodies that
# do not parse, registrations without fields or of a node nobody serves, heartbeats of unknown
# nodes, Admits with ids outside the vocabulary or mismatched counts, Releases of unknown
# leases, Prefills with no tokens, tokens outside the vocabulary or past the model's length,
# absurd block ids and junk transfer descriptions; registrations with each field wrong (role
# 99, bad layouts, no blocks, absurd vocabularies, an address without a port, ...) refused
# INVALID_ARGUMENT naming the field and value; a second subscriber to the decode node's Steps
# stream refused, and any subscriber of a node whose router is on another host; registrations under the live nodes' ids refused ALREADY_EXISTS while a
# stream runs on them, which finishes OK. Each must end with a status (the impossible
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
"$CL_PY" "$CL_TOOL" controlgarbage "$CL_CTL" "$DC" "$PC" 512 512 "$CL_GW" || CL_FAIL=1
for n in router p0 d0; do _cl_dead "${CL_PID[$n]}" && cl_fail "$n died"; done
[ $CL_FAIL -eq 0 ] || cl_end

echo "== Steps of a decode node whose router is elsewhere (192.0.2.1, never reached): refused here"
CL_CTL=192.0.2.1:7070 CL_NAME=dx cl_node decode dx --kv-blocks 64
XC=$(sed -n 's/^decode dx: control \([^ ]*\) .*/\1/p' "$CL_T/dx.out")
"$CL_PY" "$CL_TOOL" stepsforeign "$XC" || CL_FAIL=1
_cl_dead "${CL_PID[dx]}" && cl_fail "dx died"  # it stops with the others (exit 0, no sanitizer report)

echo "== garbage on the /metrics ports"
for n in router p0 d0; do
    "$CL_PY" "$CL_TOOL" httpgarbage "${CL_MURL[$n]}" | sed "s/^/$n: /" | tee "$CL_T/http.log"
    grep -q "^$n: FAIL" "$CL_T/http.log" && CL_FAIL=1
    _cl_dead "${CL_PID[$n]}" && cl_fail "$n died of garbage on its /metrics port"
done

echo "== leases whose KV never came (300 ms) give their blocks back"
cl_blocks_back d0 "$base" "its unused leases expired (300 ms + 1 s)" 5
for k in $(seq 8); do p="1 $((120 + k))"; echo "$p|$(cl_ref 24 "$p")"; done >"$CL_T/refs"
"$CL_PY" "$CL_TOOL" run "$CL_GW" 24 "$CL_T/refs" || CL_FAIL=1
cl_end "control-API garbage and hostile calls answered with statuses, no process died, blocks back, the cluster serves exactly"
