#!/bin/bash
# test_cluster_staged: the nodes' device-memory paths without a GPU. `tandem local --device
# cpu:staged` runs the CPU backend with its memory treated as a device's: the engines upload
# their weights, the prefill node stages KV through its pinned ring with the backend's
# asynchronous copies, and the decode node's pool takes transfers through a host landing
# area copied in at kv-ready (docs/cluster.md "Decode node"). 8 concurrent greedy requests
# must equal `tandem generate`, every KV byte sent must be received, and every landing block
# must be free again at the end. Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_local 1 1 --device cpu:staged --kv-blocks 512
PROMPTS=("1" "1 403 407" "1 200 300 400" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21" "1 100" "1 250 251" "1 42" "1 480 2 3")
"$CL_PY" "$CL_SRC/tests/cluster_client.py" "$CL_GW" 40 "${PROMPTS[@]}" >"$CL_T/got" || cl_fail "client"
for i in "${!PROMPTS[@]}"; do
    want=$(cl_ref 40 "${PROMPTS[$i]}")
    got=$(sed -n "$((i + 1))p" "$CL_T/got")
    [ "$want" = "$got" ] || cl_fail "prompt '${PROMPTS[$i]}': want '$want' got '$got'"
done
sent=0 recv=0 landing=
for name in "${!CL_ROLE[@]}"; do
    case ${CL_ROLE[$name]} in
    prefill) sent=$(cl_metric "$name" tandem_kvxfer_sent_bytes_total) ;;
    decode) recv=$(cl_metric "$name" tandem_kvxfer_received_bytes_total)
            landing=$(cl_metric "$name" tandem_kvxfer_landing_blocks_free) ;;
    esac
done
echo "kv bytes: prefill sent $sent, decode received $recv; landing blocks free $landing"
[ "$sent" != 0 ] && [ "$sent" = "$recv" ] || cl_fail "KV bytes sent ($sent) and received ($recv) differ or are zero"
# 512 / 4 landing blocks (the default), all back: a host pool would report none
[ "${landing%.*}" = 128 ] || cl_fail "decode landing blocks free: '$landing', want 128 (the device path not taken?)"
cl_end "${#PROMPTS[@]} concurrent generations through staged device memory equal local generate"
