#!/bin/bash
# test_cluster_spec: a decode node with --spec prompt-lookup (speculative decoding, docs/
# scheduling.md "Speculative decoding") streams the same tokens as `tandem generate` without
# speculation, greedy and seeded, for prompts that repeat themselves (so drafts are accepted:
# its /metrics says so, tokens per sequence-step above 1). Process handling, sanitizer logs
# and the final idle check: tests/cluster/cluster_lib.sh.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
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
for sp in "${SAMPLING[@]}"; do
    for p in "${PROMPTS[@]}"; do
        # shellcheck disable=SC2086
        got=$(timeout 60 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$p" --max-tokens 60 --print-ids $sp \
              2>"$CL_T/gen.err")
        # shellcheck disable=SC2086
        want=$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$p" --max-tokens 60 --print-ids --threads 1 $sp \
               2>/dev/null)
        [ -n "$want" ] && [ "$want" = "$got" ] ||
            cl_fail "spec on the decode node, '$sp', prompt '$p': want '$want' got '$got' ($(tail -1 "$CL_T/gen.err"))"
        n=$((n + 1))
    done
done
acc=$(cl_metric d0 tandem_decode_spec_accepted_tokens_total)
tps=$(cl_metric d0 tandem_decode_spec_tokens_per_step)
awk -v a="$acc" 'BEGIN { exit !(a > 0) }' || cl_fail "no draft accepted on d0 (tandem_decode_spec_accepted_tokens_total $acc)"
awk -v t="$tps" 'BEGIN { exit !(t > 1) }' || cl_fail "tandem_decode_spec_tokens_per_step $tps is not above 1"
cl_end "$n generations through a speculating decode node equal local generate ($acc drafts accepted, $tps tokens per step)"
