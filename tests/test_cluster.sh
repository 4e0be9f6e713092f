#!/bin/bash
# test_cluster: a real 1 prefill + 1 decode cluster (`tandem local`) on 127.0.0.1 serving
# stories260K; 8 concurrent greedy requests through a stock grpcio client must produce the
# same ids as `tandem generate --print-ids` on this machine, and `tandem local` must stop
# cleanly (exit 0) on SIGTERM with no sanitizer report from any of its processes
# (tests/cluster_lib.sh). Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_local 1 1
PROMPTS=("1" "1 403 407" "1 200 300 400" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21" "1 100" "1 250 251" "1 42" "1 480 2 3")
"$CL_PY" "$CL_SRC/tests/cluster_client.py" "$CL_GW" 24 "${PROMPTS[@]}" >"$CL_T/got" || cl_fail "client"
for i in "${!PROMPTS[@]}"; do
    want=$(cl_ref 24 "${PROMPTS[$i]}")
    got=$(sed -n "$((i + 1))p" "$CL_T/got")
    [ "$want" = "$got" ] || cl_fail "prompt '${PROMPTS[$i]}': want '$want' got '$got'"
done
# Every KV byte the prefill node sent, the decode node received (td_xfer's counters on /metrics).
sent=0 recv=0
for name in "${!CL_ROLE[@]}"; do
    case ${CL_ROLE[$name]} in
    prefill) sent=$(cl_metric "$name" tandem_kvxfer_sent_bytes_total) ;;
    decode) recv=$(cl_metric "$name" tandem_kvxfer_received_bytes_total) ;;
    esac
done
echo "kv bytes: prefill sent $sent, decode received $recv"
[ "$sent" != 0 ] && [ "$sent" = "$recv" ] || cl_fail "KV bytes sent ($sent) and received ($recv) differ or are zero"
cl_end "${#PROMPTS[@]} concurrent cluster generations equal local generate"
