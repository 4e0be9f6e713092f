#!/bin/bash
# test_cluster_seeded: seeded temperature > 0 generations through a 1 prefill + 1 decode
# cluster (`tandem local`) equal `tandem generate --seed S --temperature T` in one process:
# the prefill node samples the first token with the request's seed and the decode node
# continues that random stream (td_sampler_skip). Skips without the model.
set -u
M="${TANDEM_TEST_MODELS:-$(dirname "$0")/../../shared/models}/stories260K/stories260K.bin"
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
if [ ! -f "$M" ]; then echo "SKIP: $M absent (set TANDEM_TEST_MODELS)"; exit 0; fi
T=$(mktemp -d)
"$BIN" local --model "$M" --prefill 1 --decode 1 >"$T/out" 2>"$T/err" &
LPID=$!
trap 'kill -TERM $LPID 2>/dev/null; wait $LPID 2>/dev/null; rm -rf "$T"' EXIT
for _ in $(seq 100); do grep -q '^metrics: ' "$T/out" && break; sleep 0.2; done
G=$(sed -n 's/^gateway: //p' "$T/out")
[ -n "$G" ] || { echo "FAIL: cluster did not start"; cat "$T/err"; exit 1; }
SAMPLING=("--temperature 0.8 --seed 42" "--temperature 1.0 --seed 7 --top-k 40"
          "--temperature 0.9 --seed 3 --top-p 0.9 --repetition-penalty 1.1")
PROMPTS=("1 403 407" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21")
fail=0 n=0
for sp in "${SAMPLING[@]}"; do
    for p in "${PROMPTS[@]}"; do
        # shellcheck disable=SC2086
        want=$("$BIN" generate --model "$M" --prompt-ids "$p" --max-tokens 30 --print-ids --threads 1 $sp 2>/dev/null)
        # shellcheck disable=SC2086
        got=$(timeout 60 "$BIN" generate --server "$G" --prompt-ids "$p" --max-tokens 30 --print-ids $sp 2>"$T/gen.err")
        if [ -z "$want" ] || [ "$want" != "$got" ]; then
            echo "FAIL: $sp, prompt '$p': want '$want' got '$got' ($(tail -1 "$T/gen.err"))"; fail=1
        fi
        n=$((n + 1))
    done
done
kill -TERM $LPID; wait $LPID; rc=$?
[ $rc -eq 0 ] || { echo "FAIL: tandem local exited $rc on SIGTERM"; fail=1; }
trap 'rm -rf "$T"' EXIT
[ $fail -eq 0 ] && echo "PASS: $n seeded cluster generations equal local generate --seed"
exit $fail
