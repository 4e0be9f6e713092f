#!/bin/bash
# test_cluster_vocab: a model whose vocabulary (512 ids) is larger than its tokenizer's (the
# byte tokenizer, 258 ids) and whose length is short (256), on a decode node with a small
# pool (8 blocks of 16 = 128 positions). The router checks prompt ids against the MODEL's
# vocabulary, which the nodes register: ids 300..511 are served (generated ids >= 258 come
# with empty text, and the router warns once for the request), id 512 is refused naming its
# position, id and the vocabulary. A request no decode pool can hold is refused at
# admission naming the numbers (with max_tokens capped by the model's length as the decode
# node caps it), while one that fills the pool exactly (prompt 100 + 29 new tokens: 128
# positions, the last token never stored) is served. A node of the same model name with
# another vocabulary is refused registration, naming both sizes.
# Process handling, sanitizer logs and clean shutdown: tests/cluster/cluster_lib.sh.
source "$(dirname "$0")/cluster_lib.sh"
CL_M=$CL_BIN # cl_init checks that the model file exists; the model is written below, into its temp dir
cl_init

synth() { # synth DIR VOCAB: the tiny preset's shape, VOCAB ids, 256 positions
    printf '{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":64,"intermediate_size":176,
"num_hidden_layers":4,"num_attention_heads":8,"num_key_value_heads":4,"head_dim":8,"vocab_size":%d,
"max_position_embeddings":256,"rms_norm_eps":1e-5,"rope_theta":10000.0,"tie_word_embeddings":false,
"bos_token_id":256,"eos_token_id":257}\n' "$2" >"$CL_T/cfg$2.json"
    "$CL_BIN" model synth --config "$CL_T/cfg$2.json" --out "$1" >/dev/null 2>&1 || { cl_fail "model synth $2"; exit 1; }
}
synth "$CL_T/m512" 512
synth "$CL_T/m1024" 1024
CL_M=$CL_T/m512

cl_router --tokenizer "$CL_M"
cl_node prefill p0 --kv-blocks 64
cl_node decode d0 --kv-blocks 8
cl_wait_nodes 1 1

# stream REQUEST_ID MAX_TOKENS "IDS" [TEMPERATURE SEED]: tests/cluster/cluster_stream.py's lines in $CL_T/REQUEST_ID
stream() {
    local rid=$1; shift
    "$CL_PY" "$CL_SRC/tests/cluster/cluster_stream.py" "$CL_GW" "$rid" "$@" >"$CL_T/$rid" 2>&1
}

# 1. ids past the tokenizer, inside the model: served (in four prompts, the pool is small);
#    ids without text come with empty text, and each request is warned about once
n_ids=0 n_no_text=0
for k in 0 1 2 3; do
    rid=hi$k
    stream $rid 24 "1 $(seq $((300 + 53 * k)) $((352 + 53 * k)) | tr '\n' ' ')" 1.0 $((7 + k))
    tail -1 "$CL_T/$rid" | grep -qx OK || cl_fail "ids $((300 + 53 * k))..$((352 + 53 * k)) were not served: $(tail -2 "$CL_T/$rid")"
    n_req=0
    while IFS='|' read -r ids text; do
        ids=${ids#MSG }
        all_high=1
        for id in ${ids//,/ }; do
            n_ids=$((n_ids + 1))
            [ "$id" -ge 512 ] && cl_fail "generated id $id is outside the model's vocabulary"
            if [ "$id" -ge 258 ]; then n_req=$((n_req + 1)); else all_high=0; fi
        done
        if [ -n "$ids" ] && [ $all_high = 1 ] && [ "$text" != "''" ]; then
            cl_fail "ids $ids have no text in the tokenizer but came with $text"
        fi
    done < <(grep '^MSG ' "$CL_T/$rid")
    n_no_text=$((n_no_text + n_req))
    [ $n_req -gt 0 ] || continue
    # the warning is written when the request ends, just after its last message
    cl_wait_line "$CL_T/router.err" "request $rid: " 5
    w=$(grep -c "request $rid: .* generated ids have no text" "$CL_T/router.err")
    [ "$w" = 1 ] || cl_fail "want one warning for request $rid, got $w: $(grep "request $rid" "$CL_T/router.err" | head -3)"
    grep -q "request $rid: $n_req generated ids have no text in the router's tokenizer (258 ids)" "$CL_T/router.err" ||
        cl_fail "the warning does not count $n_req ids: $(grep "request $rid" "$CL_T/router.err")"
done
[ "$n_ids" -ge 4 ] || cl_fail "only $n_ids ids generated"
[ "$n_no_text" -ge 1 ] || cl_fail "no generated id >= 258 among $n_ids (seeded sampling should give some)"
echo "ids 300..511 served: $n_ids generated, $n_no_text without text, one warning per request"

# 2. id 512: refused naming position, id and the model's vocabulary
stream bad 4 "1 300 512"
grep -qF "ERROR INVALID_ARGUMENT prompt_ids[2] = 512 is outside the vocabulary of model default (512 ids)" "$CL_T/bad" ||
    cl_fail "id 512: $(cat "$CL_T/bad")"

# 3. too large for the decode pool: refused at admission with the numbers
p100=$(seq 1 100 | tr '\n' ' ')
stream large 100 "$p100"
grep -qF "ERROR INVALID_ARGUMENT prompt 100 + max_tokens 100 = 200 tokens need 13 KV blocks of 16; the largest decode pool of model default holds 8 blocks (128 tokens)" "$CL_T/large" ||
    cl_fail "too large: $(cat "$CL_T/large")"
stream capped 1000 "$p100"
grep -qF "prompt 100 + max_tokens 1000 (capped at 156 by the model's length 256) = 256 tokens need 16 KV blocks of 16" "$CL_T/capped" ||
    cl_fail "too large (capped): $(cat "$CL_T/capped")"
stream long 1 "$(seq 1 256 | tr '\n' ' ')"
grep -qF "ERROR INVALID_ARGUMENT the prompt has 256 tokens; model default takes at most 255" "$CL_T/long" ||
    cl_fail "prompt as long as the model: $(cat "$CL_T/long")"

# 4. exactly the pool: 100 + 29 = 129 tokens, 128 positions in 8 blocks: served
stream fits 29 "$p100" 1.0 3
tail -1 "$CL_T/fits" | grep -qx OK || cl_fail "a request that fits the pool exactly was not served: $(tail -2 "$CL_T/fits")"
n=$(grep '^MSG ' "$CL_T/fits" | cut -d'|' -f1 | sed 's/^MSG //' | tr ',' '\n' | grep -c .)
echo "a request of 128 KV positions on a pool of 128: $n tokens"

# 5. the same model name with another vocabulary: refused, both sizes named
cl_spawn p1 "$CL_BIN" prefill --model "$CL_T/m1024" --router "$CL_CTL" --node-id p1 --threads 1 --kv-blocks 16 \
    --log-level warn
cl_wait_line "$CL_T/router.err" "registration of node p1 refused" 30 || cl_fail "p1 (1024 ids) was not refused"
grep -q "node p1 serves model default with a vocabulary of 1024 ids, live node .* serves it with 512" "$CL_T/router.err" ||
    cl_fail "the refusal does not name both sizes: $(grep 'p1' "$CL_T/router.err")"
cl_wait_line "$CL_T/p1.err" "the router refused its registration" 10 || cl_fail "p1 does not say it was refused"
sleep 1
r=$(grep -c "registration of node p1 refused" "$CL_T/router.err")
[ "$r" = 1 ] || cl_fail "the refusal was logged $r times, not once"
cl_kill p1 TERM

cl_end "a 512-id model behind a 258-id tokenizer: ids checked against the model, a too-large request refused with its numbers, an exact fit served"
