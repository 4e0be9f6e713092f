#!/bin/bash
# test_cluster_scale: `tandem local` clusters of 1 prefill + 1 decode and of 2 + 2 on
# 127.0.0.1 serving stories260K; 32 concurrent greedy requests with prompts of 1 to 400
# random ids (fixed seed) must each produce the ids of `tandem generate --print-ids
# --threads 1` (computed once per run). On 2+2, every node must have served requests (its
# /metrics). Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
MAXTOK=32 # 400 + 32 stays within stories260K's 512 positions
# 32 prompts, lengths 1 and 400 and 30 drawn from 1..400, ids drawn from the vocab (512)
"$CL_PY" - >"$CL_T/prompts" <<'PY'
import random
r = random.Random(20261122)
lens = [1, 400] + [r.randint(1, 400) for _ in range(30)]
for n in lens:
    print(" ".join(str(r.randrange(512)) for _ in range(n)))
PY
cl_refs_of $MAXTOK

for shape in "1 1" "2 2"; do
    set -- $shape
    cl_local "$1" "$2"
    "$CL_PY" "$CL_TOOL" run "$CL_GW" $MAXTOK "$CL_T/refs" | sed "s/^/[$1+$2] /" | tee "$CL_T/run.log"
    grep -q '^\[.*\] FAIL' "$CL_T/run.log" && CL_FAIL=1
    if [ "$1" = 2 ]; then
        for n in prefill0 prefill1 decode0 decode1; do
            [ -n "${CL_MURL[$n]:-}" ] || { cl_fail "no metrics URL for $n in tandem local's output"; continue; }
            case $n in prefill*) m=tandem_prefill_requests_total ;; *) m=tandem_decode_admits_total ;; esac
            v=$(cl_metric "$n" $m) || { cl_fail "cannot read $m of $n"; continue; }
            echo "[2+2] $n: $m = $v"
            [ "${v%.*}" -gt 0 ] || cl_fail "$n served no request on the 2+2 cluster ($m = $v)"
        done
    fi
    cl_stop
done
cl_end "32 concurrent requests (prompts 1..400 tokens) on 1+1 and 2+2 clusters equal tandem generate; every 2+2 node served"
