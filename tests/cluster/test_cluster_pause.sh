#!/bin/bash
# test_cluster_pause: streamed requests while the prefill node, then the decode node, is paused
# (SIGSTOP, 0.2-3 s, SIGCONT) again and again: the stress under which a decode node once hit
# td_kv's double-free assertion in a lease's expiry (h37f; docs/kv-cache.md "Owners"). A
# router (heartbeat timeout 5000 ms, longer than any pause, so no node is dropped; leases
# 400 ms, so they expire under every pause), 1 prefill and 1 decode node; 8 client threads
# stream greedy generations back to back (cluster_faults.py pausechurn): each ends OK and
# equal to `tandem generate`, or with a status a stall causes after a prefix of it, none
# hangs, some succeed. Meanwhile the pauser freezes p0 for PAUSE_SECONDS (default 12) and
# then d0 as long, at random (PAUSE_MAX_TOKENS per stream, default 24). Afterwards both nodes live (an assertion would have killed the
# decode node), its used KV blocks return to the count before, the cluster is idle (no lease,
# sequence or transfer left: cl_idle) and no sanitizer report came. With TANDEM_TEST_GGUF
# (SmolLM2, scripts/fetch-model) it runs on that model, else on stories260K. Skips without
# the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
if [ -n "${TANDEM_TEST_GGUF:-}" ]; then cl_init_gguf; else cl_init; fi
SECS=${PAUSE_SECONDS:-12}
MAXT=${PAUSE_MAX_TOKENS:-24}
"$CL_PY" - >"$CL_T/prompts" <<'PY'
import random
r = random.Random(37)
for n in [2, 5, 17, 33, 48, 70, 96, 130]:
    print(" ".join(str(1 + r.randrange(500)) for _ in range(n)))
PY
cl_refs_of "$MAXT" # before the cluster: it waits for its background jobs
# PAUSE_POLICY=conditional: the decode node also prefills prompts itself (docs/scheduling.md), its
# local sequences beside its leases, the nearest main has to the decode nodes that prefilled
# for each other when the double free was seen
cl_router --heartbeat-ms 100 --heartbeat-timeout-ms 5000 --lease-ms 400 --prefill-policy "${PAUSE_POLICY:-disaggregated}"
cl_node prefill p0
cl_node decode d0
cl_wait_nodes 1 1
base=$(cl_metric d0 tandem_decode_kv_blocks_used)
"$CL_PY" "$CL_TOOL" pausechurn "$CL_GW" "$CL_T/refs" "$MAXT" $((2 * SECS + 30)) 8 "$CL_T/stop" >"$CL_T/churn.log" &
CH=$!
CL_BG+=($CH)
sleep 1
# pause NAME SECONDS: SIGSTOP/SIGCONT NAME for 0.2-3 s at a time, 0.1-1 s apart, for SECONDS
pause() {
    local name=$1 pid=${CL_PID[$1]} end=$((SECONDS + $2)) n=0 ms
    while [ $SECONDS -lt $end ]; do
        ms=$((200 + RANDOM % 2801))
        kill -STOP "$pid" || { cl_fail "$name is gone"; return; }
        sleep "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))"
        kill -CONT "$pid"
        n=$((n + 1))
        ms=$((100 + RANDOM % 901))
        sleep "$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))"
    done
    echo "pause: $name stopped $n times"
}
RANDOM=37
pause p0 "$SECS"
for n in router p0 d0; do _cl_dead "${CL_PID[$n]}" && cl_fail "$n died while p0 was paused"; done
pause d0 "$SECS"
touch "$CL_T/stop"
wait "$CH" || CL_FAIL=1
cat "$CL_T/churn.log"
for n in router p0 d0; do _cl_dead "${CL_PID[$n]}" && cl_fail "$n died"; done
grep -h 'assertion failed\|kv block .* held by' "$CL_T"/*.err && cl_fail "a process asserted"
echo "d0 leases: $(cl_metric d0 tandem_kvxfer_leases_total outcome=expired) expired, $(cl_metric d0 tandem_kvxfer_leases_total outcome=adopted) adopted, $(cl_metric d0 tandem_kvxfer_leases_total outcome=cancelled) cancelled, $(cl_metric d0 tandem_kvxfer_leases_quarantined_total) quarantined"
cl_blocks_back d0 "$base" "the pauses" 20
cl_end "streams under paused prefill and decode nodes end right, no KV block is released twice or lost"
