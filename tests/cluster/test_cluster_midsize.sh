#!/bin/bash
# test_cluster_midsize: a model of the size people run, not a toy. `tandem model synth`
# writes a 254M-parameter Llama in f16 (hidden 1024, 16 layers, 16 heads / 8 KV heads,
# vocab 32000: 509 MB) at test time; `tandem local` serves it with default flags as 1
# prefill + 1 decode, then as 2 + 2 with a decode pool of more than 2 GB per node. Each
# time 16 concurrent greedy requests with prompts of 1 to 256 ids drawn from the whole
# vocabulary must produce the ids of `tandem generate` on the same model, and every
# process's event-loop lag p99 must stay under 50 ms (issue 12: the first transfer once
# made the prefill node fault in the decode node's whole pool on its loop, 2.4 s, and the
# router dropped it for missed heartbeats), and 1+1 must be ready within 6 s (issue 34: the
# decode pool is made resident in the background, not before the node registers). In the sanitizer build (TD_SANITIZE=ON) the
# same runs on a narrower model and shorter prompts, to keep the instrumented CPU kernels
# within minutes. Skips without python3-grpcio (and stories260K, which cl_init checks).
source "$(dirname "$0")/cluster_lib.sh"
cl_init
if [ "${TD_SANITIZE:-OFF}" = ON ]; then
    # a pool over 2 GB of this model's small blocks needs long sequences to fill it: a node
    # never takes more than kv-seqs sequences of the model's length can use
    HIDDEN=256 INTER=704 LAYERS=4 HEADS=4 KVHEADS=2 MAXLEN=128 MAXPOS=16384
else
    HIDDEN=1024 INTER=2816 LAYERS=16 HEADS=16 KVHEADS=8 MAXLEN=256 MAXPOS=2048
fi
MAXTOK=8
LAG_BOUND_S=0.05
# issue 34: ready within 6 s on 2 cores (x4 instrumented). Before, the decode node made its
# whole default pool resident first (64 sequences x 2048 tokens: 8 GiB), 10-15 s here.
READY_BUDGET_S=6
[ "${TD_SANITIZE:-OFF}" = ON ] && READY_BUDGET_S=24
CL_M="$CL_T/midsize"
cat >"$CL_T/config.json" <<EOF
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": $HIDDEN,
 "intermediate_size": $INTER, "num_hidden_layers": $LAYERS, "num_attention_heads": $HEADS,
 "num_key_value_heads": $KVHEADS, "vocab_size": 32000, "max_position_embeddings": $MAXPOS,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
 "bos_token_id": 256, "eos_token_id": 257}
EOF
"$CL_BIN" model synth --arch llama --config "$CL_T/config.json" --dtype f16 --seed 12 --out "$CL_M" ||
    { cl_fail "tandem model synth failed"; cl_end; }

# 16 prompts: lengths 1, MAXLEN and 14 between, ids from the whole vocabulary (the router's
# tokenizer has 258 ids; the model's 32000 are what count)
"$CL_PY" - "$MAXLEN" >"$CL_T/prompts" <<'PY'
import random, sys
maxlen = int(sys.argv[1])
r = random.Random(20261124)
lens = [1, maxlen] + sorted(r.randint(2, maxlen - 1) for _ in range(14))
for n in lens:
    print(" ".join(str(r.randrange(32000)) for _ in range(n)))
PY
cl_refs_of $MAXTOK

# cl_looplag SHAPE: every process of the running cluster keeps its loop-lag p99 under the bound
cl_looplag() {
    local args=() name
    for name in "${!CL_MURL[@]}"; do args+=("$name=${CL_MURL[$name]}"); done
    "$CL_PY" "$CL_TOOL" looplag $LAG_BOUND_S "${args[@]}" | sed "s/^/[$1] /" | tee "$CL_T/lag.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || cl_fail "[$1] a process's event loop lagged (above)"
}

for shape in "1 1" "2 2"; do
    set -- $shape
    if [ "$1" = 1 ]; then
        t0=$(date +%s%N)
        cl_local 1 1 # every default: the pool sizes and threads tandem local chooses
        ms=$((($(date +%s%N) - t0) / 1000000))
        echo "[1+1] tandem local ready (gateway printed) after $ms ms (budget ${READY_BUDGET_S} s)"
        [ "$ms" -le $((READY_BUDGET_S * 1000)) ] ||
            cl_fail "[1+1] tandem local on the ${LAYERS}-layer model was ready after $ms ms, over ${READY_BUDGET_S} s"
    else
        # MiB per node: a decode pool of more than 2 GB (--kv-seqs: by default a decode node
        # takes only 4 sequences of the model's length)
        cl_local 2 2 --kv-mem 2200 --kv-seqs 64
    fi
    grep -E 'kv pool|threads' "$CL_T/local.err" | sed "s/^/[$1+$2] /" | head -8
    "$CL_PY" "$CL_TOOL" run "$CL_GW" $MAXTOK "$CL_T/refs" | sed "s/^/[$1+$2] /" | tee "$CL_T/run.log"
    grep -q '^\[.*\] FAIL' "$CL_T/run.log" && CL_FAIL=1
    cl_looplag "$1+$2"
    if [ "$1" = 2 ]; then
        for n in decode0 decode1; do
            [ -n "${CL_MURL[$n]:-}" ] || { cl_fail "no metrics URL for $n in tandem local's output"; continue; }
            # the pool warms in the background after start-up (decode_warm.c): wait until every
            # block its startup line names is usable
            total=$(sed -n "s/^decode $n: kv pool \([0-9]*\) blocks.*/\1/p" "$CL_T/local.err")
            for _ in $(seq 120); do
                used=$(cl_metric "$n" tandem_decode_kv_blocks_used) free=$(cl_metric "$n" tandem_decode_kv_blocks_free)
                [ "$((${used%.*} + ${free%.*}))" = "$total" ] && break
                sleep 0.5
            done
            bytes=$("$CL_PY" -c "import json; c = json.load(open('$CL_M/config.json')); \
print(int(($used + $free) * 16 * c['num_hidden_layers'] * 2 * c['num_key_value_heads'] * \
(c['hidden_size'] // c['num_attention_heads']) * 4))")
            echo "[2+2] $n: kv pool $((used + free)) blocks, $((bytes >> 20)) MiB"
            [ "$bytes" -gt $((2 << 30)) ] || cl_fail "$n's pool is $bytes bytes, not more than 2 GB"
        done
    fi
    cl_stop
done
cl_end "16 concurrent requests (prompts 1..$MAXLEN ids of 32000) on a ${LAYERS}-layer, hidden-$HIDDEN model, 1+1 with defaults and 2+2 with pools over 2 GB, equal tandem generate; loop lag p99 under ${LAG_BOUND_S}s everywhere"
