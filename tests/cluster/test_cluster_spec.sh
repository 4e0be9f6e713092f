#!/bin/bash
# test_cluster_spec: a decode node with --spec prompt-lookup, then one with --draft-model
# (speculative decoding, docs/scheduling.md "Speculative decoding"; here stories260K drafts
# for itself), then a unified node that `tandem local --unified 1 --draft-model` started, streams the same tokens as `tandem generate` without speculation, greedy and
# seeded, for prompts that repeat themselves (so drafts are accepted: its /metrics says so,
# an acceptance ratio above 0 and tokens per sequence-step above 1). A draft model of another
# vocabulary, and --spec and --draft-model that disagree, are refused at startup with a
# message. Process handling, sanitizer logs and the final idle check:
# tests/cluster/cluster_lib.sh.
source "$(dirname "$0")/cluster_lib.sh"
cl_init

# refused before the node starts anything: exit 2 for flags that disagree, 1 for a draft
# model that does not share the model's vocabulary (a synth model of 300 tokens; 512 here)
expect_refusal() { # expect_refusal RC MESSAGE FLAGS...
    local rc=$1 msg=$2; shift 2
    timeout 60 "$CL_BIN" decode --model "$CL_M" --router 127.0.0.1:1 --node-id dx --threads 1 --log-level warn "$@" \
        >"$CL_T/refused.out" 2>"$CL_T/refused.err"
    local got=$?
    [ "$got" -eq "$rc" ] && grep -qF -- "$msg" "$CL_T/refused.err" ||
        cl_fail "decode $*: exit $got (want $rc), stderr: $(tail -c 300 "$CL_T/refused.err") (want '$msg')"
}
expect_refusal 2 "--draft-model PATH" --spec draft-model
expect_refusal 2 "--draft-model drafts for --spec draft-model, not --spec prompt-lookup" --spec prompt-lookup \
    --draft-model "$CL_M"
"$CL_BIN" model synth --out "$CL_T/synth512" >/dev/null 2>&1 || cl_fail "model synth failed"
sed 's/"vocab_size":[^,]*,/"vocab_size": 300,/' "$CL_T/synth512/config.json" >"$CL_T/v300.json"
"$CL_BIN" model synth --out "$CL_T/synth300" --config "$CL_T/v300.json" >/dev/null 2>&1 ||
    cl_fail "model synth of 300 tokens failed"
expect_refusal 1 "must share the model's vocabulary" --draft-model "$CL_T/synth300"

cl_router
cl_node prefill p0
cl_node decode d0 --spec prompt-lookup --draft-tokens 4
cl_wait_nodes 1 1
# prompts: a unit of ids, repeated (distinct second ids: no prefill prefix-cache hits)
PROMPTS=()
for k in 1 2 3; do
    unit="$((400 + k)) $((20 + 7 * k)) $((300 - k)) 77 $((150 + k)) 12"
    PROMPTS+=("1 $unit $unit $unit")
done
SAMPLING=("" "--temperature 0.3 --seed 5" "--temperature 0.5 --seed 9 --top-p 0.9 --repetition-penalty 1.05")
n=0
# generations_equal WHAT: every prompt under every sampling through the cluster equals local generate
generations_equal() {
    local sp p got want
    for sp in "${SAMPLING[@]}"; do
        for p in "${PROMPTS[@]}"; do
            # shellcheck disable=SC2086
            got=$(timeout 60 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$p" --max-tokens 60 --print-ids $sp \
                  2>"$CL_T/gen.err")
            # shellcheck disable=SC2086
            want=$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$p" --max-tokens 60 --print-ids --threads 1 $sp \
                   2>/dev/null)
            [ -n "$want" ] && [ "$want" = "$got" ] ||
                cl_fail "$1, '$sp', prompt '$p': want '$want' got '$got' ($(tail -1 "$CL_T/gen.err"))"
            n=$((n + 1))
        done
    done
}
# drafts_landed NODE: its /metrics (tandem_decode_spec_*, or tandem_unified_spec_* on a unified node) shows accepted drafts, an acceptance ratio and more than
# one token per sequence-step; says them
drafts_landed() {
    local acc ratio tps m="tandem_${CL_ROLE[$1]}_spec"
    acc=$(cl_metric "$1" "${m}_accepted_tokens_total")
    ratio=$(cl_metric "$1" "${m}_acceptance_ratio")
    tps=$(cl_metric "$1" "${m}_tokens_per_step")
    awk -v a="$acc" 'BEGIN { exit !(a > 0) }' || cl_fail "no draft accepted on $1 (${m}_accepted_tokens_total $acc)"
    awk -v r="$ratio" 'BEGIN { exit !(r > 0 && r <= 1) }' || cl_fail "$1: ${m}_acceptance_ratio $ratio"
    awk -v t="$tps" 'BEGIN { exit !(t > 1) }' || cl_fail "$1: ${m}_tokens_per_step $tps is not above 1"
    echo "$1: $acc drafts accepted, acceptance $ratio, $tps tokens per step"
}
generations_equal "prompt lookup on the decode node"
pl=$(drafts_landed d0)

# the same through a decode node drafting with a draft model: d0 leaves (drained, SIGTERM)
# and d1 takes its place
cl_kill d0 TERM
cl_wait_line "$CL_T/$CL_ROUTER.err" "decode node d0 lost" 30 || cl_fail "the router did not see d0 go"
nodes_lines=$(grep -c '^nodes: ' "$CL_T/$CL_ROUTER.out")
cl_node decode d1 --draft-model "$CL_M" --draft-tokens 4
for ((i = 0; i < 300; i++)); do
    [ "$(grep -c '^nodes: ' "$CL_T/$CL_ROUTER.out")" -gt "$nodes_lines" ] && break
    sleep 0.1
done
cl_wait_nodes 1 1 # the line d1's registration printed
grep -q "^decode d1: draft model $CL_M " "$CL_T/d1.err" || cl_fail "d1 did not say which draft model it loaded"
generations_equal "a draft model on the decode node"
dm=$(drafts_landed d1)

# tandem local passes --draft-model and --draft-tokens on to its unified node (a new cluster:
# the first one stops here, with its idle check)
cl_stop
cl_local 0 0 --unified 1 --draft-model "$CL_M" --draft-tokens 4 --threads 1
generations_equal "a draft model on tandem local's unified node"
un=$(drafts_landed unified0)
cl_end "$n generations through speculating nodes equal local generate ($pl; $dm; $un)"
