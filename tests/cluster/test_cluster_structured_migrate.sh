#!/bin/bash
# test_cluster_structured_migrate: a constrained stream survives its decode node's death
# (docs/cluster.md "Migration", docs/grammar.md). A router (heartbeat timeout 1000 ms, the
# OpenAI API on), 1 prefill and 2 decode nodes on SmolLM2 ($TANDEM_TEST_GGUF). A streamed
# completion under vLLM's guided_regex, greedy and then seeded at temperature 1, is run
# untouched, then again with its decode node SIGKILLed after $AFTER tokens: the moved stream
# (the new decode node rebuilds the grammar state from the replayed tokens) must give the same
# text, token logprobs and usage as the untouched one, plus usage.migrations 1; and its token
# count is that of `tandem generate --regex` (cluster_faults.py migratehttp).
source "$(dirname "$0")/cluster_lib.sh"
cl_init_gguf
MAXTOK=100 AFTER=30
RE='Animals: ([a-z]{2,8}, ){100}'
IDS="19161 253 986 1398 282 2355 42" # "Write a long list of animals:" in SmolLM2's tokenizer
EXTRA="{\"guided_regex\": \"$RE\"}"
echo "$IDS|$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$IDS" --max-tokens $MAXTOK --print-ids --threads 1 \
    --regex "$RE" 2>/dev/null)" >"$CL_T/greedy"
echo "$IDS|$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$IDS" --max-tokens $MAXTOK --print-ids --threads 1 \
    --regex "$RE" --temperature 1 --seed 5 --repetition-penalty 1.1 --frequency-penalty 0.2 2>/dev/null)" >"$CL_T/seeded"
for f in greedy seeded; do
    n=$(cut -d'|' -f2 "$CL_T/$f" | wc -w)
    [ "$n" -gt $((AFTER + 20)) ] || cl_fail "the $f reference has $n tokens: too short to kill mid-stream"
done
cl_cluster 2 --heartbeat-ms 100 --heartbeat-timeout-ms 1000 --max-migrations 2 --http-port 0 --tokenizer "$CL_M"
OPENAI=$(sed -n 's/^openai: //p' "$CL_T/router.out")

k=2
for sampling in greedy 1,5,1.1,0.2; do
    f=greedy
    [ "$sampling" = greedy ] || f=seeded
    echo "== $f stream under guided_regex, its decode node SIGKILLed after $AFTER tokens"
    "$CL_PY" "$CL_TOOL" migratehttp "$OPENAI" $MAXTOK "$CL_T/$f" "$sampling" $AFTER "$(cl_live_decodes)" "$EXTRA" \
        >"$CL_T/mig.log" 2>&1 || CL_FAIL=1
    cat "$CL_T/mig.log"
    for name in $(sed -n 's/^killed //p' "$CL_T/mig.log"); do CL_KILLED[$name]=1; done
    cl_node decode "d$k"
    cl_wait_nodes 1 2
    k=$((k + 1))
done
cl_end "constrained streams whose decode node was killed mid-stream moved and ended as untouched ones (greedy and seeded)"
