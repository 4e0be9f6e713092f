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
cl_concurrent_equal 40 "${PROMPTS[@]}"
cl_kv_bytes_equal
landing=$(cl_metric decode0 tandem_kvxfer_landing_blocks_free)
echo "decode0 landing blocks free: $landing"
# 512 / 4 landing blocks (the default), all back: a host pool would report none
[ "${landing%.*}" = 128 ] || cl_fail "decode landing blocks free: '$landing', want 128 (the device path not taken?)"
cl_end "${#PROMPTS[@]} concurrent generations through staged device memory equal local generate"
