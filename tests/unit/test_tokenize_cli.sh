#!/usr/bin/env bash
# `tandem tokenize` against the reference fixtures of tests/fixtures/tokenizer: a few rows
# per tokenizer, encode (stdin bytes -> ids line) and --decode (ids -> exact text), plus
# the exit codes of bad usage (2) and bad input (1). Tokenizers under ../shared/models are
# skipped, saying so, when that folder is absent; the byte-level fixture always runs.
set -u
SRC=${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BIN=${TANDEM_BIN:?TANDEM_BIN must name the tandem binary}
MODELS=${TANDEM_TEST_MODELS:-$SRC/../shared/models}
FIX=$SRC/tests/fixtures/tokenizer
PY=$(command -v python3 || echo /usr/bin/python3)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0

ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }

# row NAME KIND INDEX: writes $tmp/text (exact bytes) and $tmp/ids (one line)
row() {
    "$PY" - "$FIX/$1.$2.jsonl" "$3" "$tmp" <<'PYEOF'
import json, sys
rows = open(sys.argv[1], encoding="utf-8").read().splitlines()
r = json.loads(rows[int(sys.argv[2]) % len(rows)])
open(sys.argv[3] + "/text", "wb").write(bytes.fromhex(r["hex"]))
open(sys.argv[3] + "/ids", "w").write(" ".join(map(str, r["ids"])) + "\n")
PYEOF
}

check() { # name tokenizer-path
    local name=$1 path=$2 i
    for i in 0 3 8 16 28 36 50 53 -31 -1; do
        row "$name" encode "$i"
        if "$BIN" tokenize --tokenizer "$path" < "$tmp/text" > "$tmp/out" && cmp -s "$tmp/out" "$tmp/ids"; then ok
        else bad "$name encode row $i: want $(head -c 200 "$tmp/ids") got $(head -c 200 "$tmp/out")"; fi
        row "$name" decode "$i"
        if "$BIN" tokenize --tokenizer "$path" --decode < "$tmp/ids" > "$tmp/out" && cmp -s "$tmp/out" "$tmp/text"; then ok
        else bad "$name decode row $i"; fi
    done
}

check bytelevel "$FIX/bytelevel"
for spec in llama2:llama2-tokenizer/tokenizer.bin mistral:tokenizers/mistral llama3:tokenizers/llama3 qwen3:tokenizers/qwen3; do
    name=${spec%%:*} rel=${spec#*:}
    if [ -e "$MODELS/$rel" ]; then check "$name" "$MODELS/$rel"
    else echo "skip: $name: $MODELS/$rel is absent (set TANDEM_TEST_MODELS)"; fi
done

# exit codes: usage 2, runtime 1
"$BIN" tokenize < /dev/null 2> /dev/null; [ $? -eq 2 ] && ok || bad "no --tokenizer should exit 2"
"$BIN" tokenize --tokenizer "$FIX/bytelevel" --bogus < /dev/null 2> /dev/null; [ $? -eq 2 ] && ok || bad "unknown flag should exit 2"
"$BIN" tokenize --help > "$tmp/out"; [ $? -eq 0 ] && grep -q -- --decode "$tmp/out" && ok || bad "--help"
"$BIN" tokenize --tokenizer "$tmp/nope.json" < /dev/null 2> /dev/null; [ $? -eq 1 ] && ok || bad "missing tokenizer should exit 1"
echo "12 x 7" | "$BIN" tokenize --tokenizer "$FIX/bytelevel" --decode > /dev/null 2>&1; [ $? -eq 1 ] && ok || bad "bad id should exit 1"
echo "258" | "$BIN" tokenize --tokenizer "$FIX/bytelevel" --decode > /dev/null 2>&1; [ $? -eq 1 ] && ok || bad "out-of-range id should exit 1"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
