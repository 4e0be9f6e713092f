#!/bin/bash
# test_cluster_logprobs: log-probabilities and OpenAI's penalties end to end on a real model.
# `tandem local` serves SmolLM2-135M-Instruct ($TANDEM_TEST_GGUF) as 1 prefill + 1 decode.
#   - greedy with --logprobs 5 --prompt-logprobs through the cluster: the same ids as
#     `tandem generate --model FILE` with the same flags, and every logprob line (the prompt's
#     from the prefill node, token 0's from the prefill node, the rest from the decode node's
#     steps) within 2e-3 of the local one, alternatives' values too;
#   - greedy with presence and frequency penalties: the same ids as the local run (the
#     penalties travel gateway -> router -> both nodes), and different from the unpenalized;
#   - the prompt's logprobs summed over the scored half of a chunk give the perplexity that
#     `tandem perplexity --ctx C --chunks 1` prints for the same text (its llama.cpp method),
#     C = 128 so the prefill node computes them in two 64-row steps (32, one step, under the
#     sanitizers); with the prompt in the
#     prefix cache (two plain requests first, the second served from it), a prompt-logprobs
#     request still computes every position (0 cached tokens) and gives the same, twice;
#   - --logprobs 21 is refused naming top_logprobs (the CLI runs the gateway's td_gen_params check).
# Skips without the GGUF (offline) or python3-grpcio.
source "$(dirname "$0")/cluster_lib.sh"
cl_init_gguf
MAXTOK=8 PENTOK=16 RUNS="1 2"
if [ "${TD_SANITIZE:-OFF}" = ON ]; then # the model runs ~20x slower under the sanitizers
    MAXTOK=3 PENTOK=6 RUNS=1
fi
cl_local 1 1 --threads 1 --kv-mem 128

# compare_lp WANT GOT: same token ids, the same number of lines, logprobs within 2e-3 (the
# cluster computes the prompt in other chunks than the local run: float sums differ a little)
compare_lp() {
    "$CL_PY" - "$1" "$2" <<'EOF'
import sys
def load(p):
    rows = []
    for line in open(p):
        f = line.split()
        if f and f[0] == "logprob":
            rows.append((f[1], int(f[2]), int(f[3]), float(f[4]), sorted((float(t.split(":")[1]) for t in f[5:]), reverse=True)))
    return rows
w, g = load(sys.argv[1]), load(sys.argv[2])
if not w or len(w) != len(g):
    sys.exit(f"{len(w)} logprob lines locally, {len(g)} through the cluster")
for a, b in zip(w, g):
    if a[:3] != b[:3] or abs(a[3] - b[3]) > 2e-3 or len(a[4]) != len(b[4]) or any(abs(x - y) > 2e-3 for x, y in zip(a[4], b[4])):
        sys.exit(f"local {a} cluster {b}")
print(len(w))
EOF
}

n=0
PROMPT="The capital of France is"
"$CL_BIN" generate --model "$CL_M" --prompt "$PROMPT" --max-tokens $MAXTOK --print-ids --threads 1 \
    --logprobs 5 --prompt-logprobs >"$CL_T/want.lp" 2>"$CL_T/want.err" || cl_fail "local generate: $(tail -1 "$CL_T/want.err")"
timeout 120 "$CL_BIN" generate --server "$CL_GW" --prompt "$PROMPT" --max-tokens $MAXTOK --print-ids --timeout 100 \
    --logprobs 5 --prompt-logprobs >"$CL_T/got.lp" 2>"$CL_T/got.err" || cl_fail "cluster generate: $(tail -1 "$CL_T/got.err")"
[ "$(head -1 "$CL_T/want.lp")" = "$(head -1 "$CL_T/got.lp")" ] ||
    cl_fail "ids: local '$(head -1 "$CL_T/want.lp")' cluster '$(head -1 "$CL_T/got.lp")'"
grep -q '^logprob gen ' "$CL_T/got.lp" && grep -q '^logprob prompt 1 ' "$CL_T/got.lp" ||
    cl_fail "the cluster printed no generated or prompt logprobs: $(cat "$CL_T/got.lp")"
if lines=$(compare_lp "$CL_T/want.lp" "$CL_T/got.lp"); then
    n=$((n + lines))
else
    cl_fail "logprobs differ: $lines"
fi

# presence and frequency penalties: equal to the local run, and they change the output
PEN=(--presence-penalty 1.5 --frequency-penalty 1.0)
PPROMPT="Repeat the word hello ten times: hello hello"
plain=$("$CL_BIN" generate --model "$CL_M" --prompt "$PPROMPT" --max-tokens $PENTOK --print-ids --threads 1 2>/dev/null)
want=$("$CL_BIN" generate --model "$CL_M" --prompt "$PPROMPT" --max-tokens $PENTOK --print-ids --threads 1 "${PEN[@]}" 2>/dev/null)
got=$(timeout 120 "$CL_BIN" generate --server "$CL_GW" --prompt "$PPROMPT" --max-tokens $PENTOK --print-ids --timeout 100 \
      "${PEN[@]}" 2>"$CL_T/pen.err")
[ -n "$want" ] && [ "$want" = "$got" ] || cl_fail "penalties: local '$want' cluster '$got' ($(tail -1 "$CL_T/pen.err"))"
[ "$want" != "$plain" ] || cl_fail "penalties changed nothing ('$plain'): the check shows nothing"
n=$((n + 1))

# the prompt's logprobs against `tandem perplexity`: one chunk of C tokens, its second half scored
C=128
# every scored row is a full lm_head row: the unoptimized sanitizer build takes seconds for
# 128 of them, past the lease; 32 still checks the sum (one prefill step)
[ "${TD_SANITIZE:-OFF}" = ON ] && C=32
cat >"$CL_T/para.txt" <<'EOF'
The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips after
decades of salt wind. Every evening the keeper climbed the spiral stairs, one hundred and twelve
of them, to light the lamp that warned the fishing boats away from the rocks below. He had done
this for thirty years, through storms that shook the glass and calm nights when the sea lay flat
as a mirror. The village depended on him, though few people ever thought about it. Children
sometimes came up the path to ask him questions about ships and whales, and he always answered
with patience, pointing out the distant shapes on the horizon and naming each vessel by its sails.
EOF
cat "$CL_T/para.txt" "$CL_T/para.txt" >"$CL_T/text.txt" # two chunks' worth, as perplexity wants
ppl=$("$CL_BIN" perplexity --model "$CL_M" --file "$CL_T/text.txt" --ctx $C --chunks 1 --threads 1 2>"$CL_T/ppl.err" |
      sed -n 's/^Final estimate: PPL = \([0-9.]*\).*/\1/p')
[ -n "$ppl" ] || cl_fail "tandem perplexity printed no estimate: $(tail -2 "$CL_T/ppl.err")"
ids=$("$CL_BIN" tokenize --tokenizer "$CL_M" --add-special --no-parse-special <"$CL_T/text.txt" | tr ' ' '\n' | head -$C | tr '\n' ' ')
for warm in $RUNS; do
    timeout 120 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$ids" --max-tokens 1 --print-ids --timeout 100 \
        >/dev/null 2>"$CL_T/warm.err" || cl_fail "warm-up: $(tail -1 "$CL_T/warm.err")"
done
# the prefill node's count of prompt tokens served from its cache (usage.cached_tokens is the
# decode node's when its step entry for token 0 beats the Prefill stream)
cached_before=$(cl_metric prefill0 tandem_prefill_cached_tokens_total | cut -d. -f1)
[ "$RUNS" = 1 ] || [ "$cached_before" -gt 0 ] ||
    cl_fail "the repeated plain prompt was not served from the prefill node's prefix cache: the check below shows nothing"
for run in $RUNS; do
timeout 120 "$CL_BIN" generate --server "$CL_GW" --prompt-ids "$ids" --max-tokens 1 --print-ids --timeout 100 \
    --logprobs 0 --prompt-logprobs >"$CL_T/ppl.lp" 2>"$CL_T/ppl.gen.err" || cl_fail "cluster prompt logprobs: $(tail -1 "$CL_T/ppl.gen.err")"
cached=$(cl_metric prefill0 tandem_prefill_cached_tokens_total | cut -d. -f1)
[ "$cached" = "$cached_before" ] || cl_fail "run $run: prompt logprobs used $((cached - cached_before)) cached tokens"
grep -q ' 0 cached prompt tokens' "$CL_T/ppl.gen.err" ||
    cl_fail "run $run: usage says $(grep -o '[0-9]* cached prompt tokens' "$CL_T/ppl.gen.err")"
if [ -n "$ppl" ]; then
    # perplexity scores positions C/2+1 .. C-1 (predicted by C/2 .. C-2)
    if msg=$("$CL_PY" - "$CL_T/ppl.lp" "$C" "$ppl" <<'EOF'
import math, sys
c, want = int(sys.argv[2]), float(sys.argv[3])
lp = {int(f[2]): float(f[4]) for f in (l.split() for l in open(sys.argv[1])) if f and f[0] == "logprob" and f[1] == "prompt"}
if len(lp) != c:
    sys.exit(f"{len(lp)} prompt logprobs for {c} prompt ids")
scored = [lp[i] for i in range(c // 2 + 1, c)]
got = math.exp(-sum(scored) / len(scored))
if abs(got - want) > 1e-3 * want + 1e-4:
    sys.exit(f"prompt logprobs give PPL {got:.4f}, tandem perplexity {want:.4f}")
print(f"PPL {got:.4f} = {want:.4f}")
EOF
    ); then
        n=$((n + 1))
    else
        cl_fail "run $run: $msg"
    fi
fi
done

# too many alternatives: refused by name
if timeout 60 "$CL_BIN" generate --server "$CL_GW" --prompt "$PROMPT" --max-tokens 2 --logprobs 21 --timeout 30 \
    >/dev/null 2>"$CL_T/bad.err"; then
    cl_fail "--logprobs 21 was not refused"
fi
grep -q 'top_logprobs 21' "$CL_T/bad.err" || cl_fail "--logprobs 21: $(cat "$CL_T/bad.err")"
# prompt logprobs past 4096 prompt tokens: refused by the gateway (ids) and after encoding (text)
long_ids=$(yes 28 | head -4097 | tr '\n' ' ')
long_text=$(yes hello | head -4200 | tr '\n' ' ')
for what in ids text; do
    if [ $what = ids ]; then arg=(--prompt-ids "$long_ids"); else arg=(--prompt "$long_text"); fi
    if timeout 60 "$CL_BIN" generate --server "$CL_GW" "${arg[@]}" --max-tokens 1 --logprobs 0 --prompt-logprobs \
        --timeout 30 >/dev/null 2>"$CL_T/long.err"; then
        cl_fail "prompt logprobs of a $what prompt past 4096 tokens were not refused"
    fi
    grep -q 'INVALID_ARGUMENT: prompt_logprobs asked for a prompt of 4[0-9]* .*at most 4096' "$CL_T/long.err" ||
        cl_fail "long $what prompt: $(cat "$CL_T/long.err")"
done
cl_end "$n logprob lines and checks through the cluster equal the local engine's"
