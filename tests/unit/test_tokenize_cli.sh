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

# rows NAME ROW...: the fixture's encode and decode rows (indices modulo the file's length)
# as $tmp/KIND.ROW.text and $tmp/KIND.ROW.ids, one python start for them all
rows() {
    local name=$1
    shift
    "$PY" - "$FIX/$name" "$tmp" "$@" <<'PYEOF'
import json, sys
base, tmp, picks = sys.argv[1], sys.argv[2], sys.argv[3:]
for kind in ("encode", "decode"):
    rows = open(f"{base}.{kind}.jsonl", encoding="utf-8").read().splitlines()
    for i in picks:
        r = json.loads(rows[int(i) % len(rows)])
        open(f"{tmp}/{kind}.{i}.text", "wb").write(bytes.fromhex(r["hex"]))
        open(f"{tmp}/{kind}.{i}.ids", "w").write(" ".join(map(str, r["ids"])) + "\n")
PYEOF
}

# check NAME TOKENIZER-PATH ROW...: each row through `tandem tokenize` and back. The full
# fixtures run in-process in test_tokenizer; here each row is a process that loads the
# tokenizer (0.3 s for the 9 MB tokenizer.json files), so the big ones take fewer rows.
check() {
    local name=$1 path=$2 i
    shift 2
    rows "$name" "$@"
    for i in "$@"; do
        if "$BIN" tokenize --tokenizer "$path" < "$tmp/encode.$i.text" > "$tmp/out" && cmp -s "$tmp/out" "$tmp/encode.$i.ids"; then ok
        else bad "$name encode row $i: want $(head -c 200 "$tmp/encode.$i.ids") got $(head -c 200 "$tmp/out")"; fi
        if "$BIN" tokenize --tokenizer "$path" --decode < "$tmp/decode.$i.ids" > "$tmp/out" && cmp -s "$tmp/out" "$tmp/decode.$i.text"; then ok
        else bad "$name decode row $i"; fi
    done
}

ALL_ROWS="0 3 8 16 28 36 50 53 -31 -1"
FEW_ROWS="3 28 53 -1"
# the sanitizer build (-O0 ASan: 1.5 s a process for qwen3's tokenizer.json) runs two rows
# of each big tokenizer (special tokens; mixed scripts and emoji): what this test adds to
# test_tokenizer, which runs every row in-process in both builds, is the command's I/O path
[ "${TD_SANITIZE:-OFF}" = ON ] && FEW_ROWS="53 -1"
check bytelevel "$FIX/bytelevel" $ALL_ROWS
for spec in llama2:llama2-tokenizer/tokenizer.bin:ALL mistral:tokenizers/mistral:FEW llama3:tokenizers/llama3:FEW \
            qwen3:tokenizers/qwen3:FEW; do
    IFS=: read -r name rel n <<<"$spec"
    picks=ALL_ROWS
    [ "$n" = FEW ] && picks=FEW_ROWS
    if [ -e "$MODELS/$rel" ]; then check "$name" "$MODELS/$rel" ${!picks}
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
