#!/bin/bash
# test_cluster: a real 1 prefill + 1 decode cluster (`tandem local`) on 127.0.0.1 serving
# stories260K; 8 concurrent greedy requests through a stock grpcio client must produce the
# same ids as `tandem generate --print-ids` on this machine, and `tandem local` must stop
# cleanly (exit 0) on SIGTERM with no sanitizer report from any of its processes
# (tests/cluster/cluster_lib.sh). Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_local 1 1
# the last prompt's first generated token is the model's EOS: local generate prints nothing,
# and so must the cluster (the router, which has no tokenizer for stories260K, learns the EOS
# ids from the nodes' registration)
PROMPTS=("1" "1 403 407" "1 200 300 400" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21" "1 100" "1 250 251" "1 42" "1 480 2 3"
         "1 354 113 499 219 374 17 273 116 394 227 483 256 286 122 179 121 349 115 392 238 490 151 477 14 216 22")
cl_concurrent_equal 24 "${PROMPTS[@]}"
cl_kv_bytes_equal
cl_end "${#PROMPTS[@]} concurrent cluster generations equal local generate"
