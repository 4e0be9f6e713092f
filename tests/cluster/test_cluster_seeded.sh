#!/bin/bash
# test_cluster_seeded: seeded temperature > 0 generations through a 1 prefill + 1 decode
# cluster (`tandem local`) equal `tandem generate --seed S --temperature T` in one process:
# the prefill node samples the first token with the request's seed and the decode node
# continues that random stream (td_sampler_skip; docs/cluster.md "Decode node"); a prompt
# whose prefix the prefill node had cached is compared with a local run prefilled in the
# same pieces. Process
# handling, sanitizer logs and clean shutdown: tests/cluster/cluster_lib.sh.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
cl_local 1 1
SAMPLING=("--temperature 0.8 --seed 42" "--temperature 1.0 --seed 7 --top-k 40"
          "--temperature 0.9 --seed 3 --top-p 0.9 --repetition-penalty 1.1")
PROMPTS=("1 403 407" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21")
n=0
for sp in "${SAMPLING[@]}"; do
    for p in "${PROMPTS[@]}"; do
        # shellcheck disable=SC2086
        got=$(timeout 60 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$p" --max-tokens 30 --print-ids $sp \
              2>"$CL_T/gen.err")
        # A prefix-cache hit on the prefill node (the long prompt, from the second sampling on)
        # computes the rest of the prompt as a piece of its own, and a one-row piece runs the
        # decode kernel (docs/cluster.md "Seeded sampling"): the reference then prefills in
        # the same pieces, which --prefill-chunk CACHED does while the rest fits one chunk.
        cached=$(grep -o '[0-9]* cached prompt tokens' "$CL_T/gen.err" | cut -d' ' -f1)
        chunk=()
        if [ -n "$cached" ] && [ "$cached" -gt 0 ]; then
            n_prompt=$(wc -w <<<"$p")
            [ $((n_prompt - cached)) -le "$cached" ] ||
                cl_fail "prompt '$p': $cached cached tokens leave a rest that --prefill-chunk cannot mirror"
            chunk=(--prefill-chunk "$cached")
        fi
        # shellcheck disable=SC2086
        want=$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$p" --max-tokens 30 --print-ids --threads 1 \
               "${chunk[@]}" $sp 2>/dev/null)
        [ -n "$want" ] && [ "$want" = "$got" ] ||
            cl_fail "$sp, prompt '$p' ${chunk[*]}: want '$want' got '$got' ($(tail -1 "$CL_T/gen.err"))"
        n=$((n + 1))
    done
done
cl_end "$n seeded cluster generations equal local generate --seed"
