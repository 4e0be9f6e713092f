#!/bin/bash
# test_cluster_moe: a mixture of experts through the cluster. `tandem local` serves a synthetic
# Mixtral (tiny-mixtral, written here by `tandem model synth`) as 1 prefill + 1 decode node;
# 12 concurrent greedy requests (the decode node batches them: each step's rows are routed to
# the experts together and grouped by expert) each equal `tandem generate` of the same prompt
# alone, token for token (the engine's invariance rule, docs/correctness.md), and every KV
# byte the prefill node sent was received. Then one request with --logprobs: the same ids and
# log-probabilities as the local run. Process handling, sanitizer logs and clean shutdown:
# tests/cluster/cluster_lib.sh.
source "$(dirname "$0")/cluster_lib.sh"
cl_init
CL_M="$CL_T/tiny-mixtral"
"$CL_BIN" model synth --config tiny-mixtral --dtype f32 --seed 5 --out "$CL_M" >/dev/null 2>"$CL_T/synth.err" ||
    { cl_fail "synth: $(cat "$CL_T/synth.err")"; cl_end; }
MAXTOK=24
[ "${TD_SANITIZE:-OFF}" = ON ] && MAXTOK=8
cl_local 1 1 --threads 1 --kv-mem 64

prompts=()
for k in $(seq 12); do
    p="256"
    for j in $(seq $((k * 3))); do p="$p $(((k * 37 + j * 11) % 250 + 3))"; done
    prompts+=("$p")
done
cl_concurrent_equal "$MAXTOK" "${prompts[@]}"

"$CL_BIN" generate --server "$CL_GW" --prompt-ids "${prompts[4]}" --max-tokens 6 --print-ids --logprobs 2 \
    --timeout 30 >"$CL_T/lp.server" 2>"$CL_T/lp.err" || cl_fail "generate --server --logprobs: $(tail -2 "$CL_T/lp.err")"
"$CL_BIN" generate --model "$CL_M" --prompt-ids "${prompts[4]}" --max-tokens 6 --print-ids --logprobs 2 --threads 1 \
    >"$CL_T/lp.local" 2>/dev/null
# the cluster prefills the prompt in one step as the local run does: the same lines
diff <(grep -E '^(logprob|[0-9])' "$CL_T/lp.local") <(grep -E '^(logprob|[0-9])' "$CL_T/lp.server") >"$CL_T/lp.diff" ||
    cl_fail "logprobs through the cluster differ from local: $(head -6 "$CL_T/lp.diff")"
cl_kv_bytes_equal
cl_end "12 concurrent mixture-of-experts generations through the cluster equal tandem generate; logprobs equal"
