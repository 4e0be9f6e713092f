#!/bin/bash
# test_cluster: a real 1 prefill + 1 decode cluster (`tandem local`) on 127.0.0.1 serving
# stories260K; 8 concurrent greedy requests through a stock grpcio client must produce the
# same ids as `tandem generate --print-ids` on this machine, and `tandem local` must stop
# cleanly (exit 0) on SIGTERM with no sanitizer report from any of its processes
# (tests/cluster/cluster_lib.sh). Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_local 1 1
PROMPTS=("1" "1 403 407" "1 200 300 400" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21" "1 100" "1 250 251" "1 42" "1 480 2 3")
cl_concurrent_equal 24 "${PROMPTS[@]}"
cl_kv_bytes_equal
cl_end "${#PROMPTS[@]} concurrent cluster generations equal local generate"
