#!/bin/bash
# test_cluster_migrate: mid-stream migration (docs/cluster.md "Migration"). A router
# (heartbeat timeout 1000 ms, max-migrations 2, the OpenAI API on), 1 prefill and 2 decode
# nodes. A long greedy stream, then a long seeded one (temperature 0.9, seed, repetition and
# frequency penalties): once it has 40 tokens, the decode node serving it is SIGKILLed; the
# stream must go on on another decode node and end OK with exactly the ids `tandem generate`
# gives (no error, no duplicate, no missing token), the same logprob floats as an untouched
# run of it, and usage.migrations 1; the gap around the kill is printed. A new decode node
# replaces each killed one. The same through the OpenAI API (a streamed seeded completion of
# prompt ids: the token logprobs and usage of an untouched run, and usage.migrations 1). Then
# a greedy stream whose decode node is frozen (SIGSTOP: no connection reset, only the
# heartbeat bound tells) moves too. Last, every decode node is killed under a stream: it must
# end UNAVAILABLE saying why it cannot move. The router counts the moves in
# tandem_router_migrations_total. Skips without the model or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
MAXTOK=480 AFTER=40
# the OpenAI API needs a tokenizer: Llama 2's (stories260K's own is not here) gives its ids text
TOK="${TANDEM_TEST_MODELS:-$CL_SRC/../shared/models}/llama2-tokenizer/tokenizer.bin"
cl_cluster 2 --heartbeat-ms 100 --heartbeat-timeout-ms 1000 --max-migrations 2 --http-port 0 --tokenizer "$TOK"
OPENAI=$(sed -n 's/^openai: //p' "$CL_T/router.out")
GREEDY="1 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45" # 17 ids: a cached first block leaves one row
SEEDED="1 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60"
echo "$GREEDY|$(cl_ref $MAXTOK "$GREEDY")" >"$CL_T/greedy"
echo "$SEEDED|$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$SEEDED" --max-tokens $MAXTOK --print-ids \
    --threads 1 --temperature 0.9 --seed 4 --repetition-penalty 1.2 --frequency-penalty 0.3 2>/dev/null)" \
    >"$CL_T/seeded"
for f in greedy seeded; do
    n=$(cut -d'|' -f2 "$CL_T/$f" | wc -w)
    [ "$n" -gt $((AFTER + 40)) ] || cl_fail "the $f reference has $n tokens: too short to kill mid-stream"
done

# migrate REFS SAMPLING KILL EXPECT: cluster_faults.py migrate; marks the nodes it killed
migrate() {
    "$CL_PY" "$CL_TOOL" migrate "$CL_GW" $MAXTOK "$CL_T/$1" "$2" $AFTER "$3" "$(cl_live_decodes)" "$4" \
        >"$CL_T/mig.log" 2>&1 || CL_FAIL=1
    cat "$CL_T/mig.log"
    local name
    for name in $(sed -n 's/^killed //p' "$CL_T/mig.log"); do CL_KILLED[$name]=1; done
    for name in $(sed -n 's/^stopped //p' "$CL_T/mig.log"); do cl_kill "$name" KILL; done
}

echo "== greedy stream, its decode node SIGKILLed after $AFTER tokens"
migrate greedy greedy serving moved
cl_node decode d2
cl_wait_nodes 1 2
echo "== seeded stream with penalties, its decode node SIGKILLed after $AFTER tokens"
migrate seeded 0.9,4,1.2,0.3 serving moved
m=$(cl_metric router tandem_router_migrations_total)
gs=$(cl_metric router tandem_router_migration_seconds_sum)
echo "router migrations: $m, node lost to next token sent: $gs s in all"
[ "${m%.*}" = 2 ] || cl_fail "tandem_router_migrations_total is $m, want 2"
echo "== the OpenAI front door: a streamed seeded completion, its decode node SIGKILLed"
cl_node decode d3
cl_wait_nodes 1 2
"$CL_PY" "$CL_TOOL" migratehttp "$OPENAI" $MAXTOK "$CL_T/seeded" 0.9,4,1.2,0.3 $AFTER "$(cl_live_decodes)" \
    >"$CL_T/mig.log" 2>&1 || CL_FAIL=1
cat "$CL_T/mig.log"
for name in $(sed -n 's/^killed //p' "$CL_T/mig.log"); do CL_KILLED[$name]=1; done
echo "== greedy stream, its decode node frozen (SIGSTOP) after $AFTER tokens: moved at the heartbeat bound"
cl_node decode d4
cl_wait_nodes 1 2
migrate greedy greedy stop moved
echo "== every decode node SIGKILLed under a stream"
migrate greedy greedy all fail
cl_end "streams whose decode node was killed mid-stream moved and ended equal to tandem generate (greedy and seeded); with no decode node left, UNAVAILABLE naming why"
