#!/bin/bash
# test_cluster: a real 1 prefill + 1 decode cluster (`tandem local`) on 127.0.0.1 serving
# stories260K; 8 concurrent greedy requests through a stock grpcio client must produce the
# same ids as `tandem generate --print-ids` on this machine. Skips without the model or
# python3-grpcio.
set -u
M="${TANDEM_TEST_MODELS:-$(dirname "$0")/../../shared/models}/stories260K/stories260K.bin"
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
SRC="${TD_SOURCE_DIR:-$(dirname "$0")/..}"
if [ ! -f "$M" ]; then echo "SKIP: $M absent (set TANDEM_TEST_MODELS)"; exit 0; fi
if ! /usr/bin/python3 -c 'import grpc' 2>/dev/null; then echo "SKIP: /usr/bin/python3 lacks grpc"; exit 0; fi
T=$(mktemp -d)
"$BIN" local --model "$M" --prefill 1 --decode 1 >"$T/out" 2>"$T/err" &
LPID=$!
trap 'kill -TERM $LPID 2>/dev/null; wait $LPID 2>/dev/null; rm -rf "$T"' EXIT
for _ in $(seq 100); do grep -q '^metrics: ' "$T/out" && break; sleep 0.2; done
G=$(sed -n 's/^gateway: //p' "$T/out")
[ -n "$G" ] || { echo "FAIL: cluster did not start"; cat "$T/err"; exit 1; }
PROMPTS=("1" "1 403 407" "1 200 300 400" "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21" "1 100" "1 250 251" "1 42" "1 480 2 3")
/usr/bin/python3 "$SRC/tests/cluster_client.py" "$G" 24 "${PROMPTS[@]}" >"$T/got" || { echo "FAIL: client"; exit 1; }
fail=0
for i in "${!PROMPTS[@]}"; do
    want=$("$BIN" generate --model "$M" --prompt-ids "${PROMPTS[$i]}" --max-tokens 24 --print-ids --threads 1 2>/dev/null)
    got=$(sed -n "$((i + 1))p" "$T/got")
    if [ "$want" != "$got" ]; then echo "FAIL: prompt '${PROMPTS[$i]}': want '$want' got '$got'"; fail=1; fi
done
# clean shutdown on SIGTERM
kill -TERM $LPID; wait $LPID; rc=$?
[ $rc -eq 0 ] || { echo "FAIL: tandem local exited $rc on SIGTERM"; fail=1; }
trap 'rm -rf "$T"' EXIT
[ $fail -eq 0 ] && echo "PASS: ${#PROMPTS[@]} concurrent cluster generations equal local generate"
exit $fail
