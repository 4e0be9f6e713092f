#!/usr/bin/env bash
# `tandem tokenize --tokenizer FILE.gguf` against llama.cpp's llama-tokenize ids in
# tests/fixtures/tokenizer/gguf (make_gguf_fixtures.py): seven rows (newlines, numbers,
# contractions, CJK, emoji, ChatML and Llama-3 special tokens) of every committed
# vocab-only file, special tokens parsed (the default) and not (--no-parse-special);
# test_tok_gguf checks all rows;
# --add-special adds BOS exactly where llama-tokenize does; byte-level ids decode back to
# the text. With TANDEM_TEST_GGUF naming SmolLM2-135M-Instruct.Q4_1.gguf, the real file's
# rows too (skipped, saying so, without it).
set -u
SRC=${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
BIN=${TANDEM_BIN:?TANDEM_BIN must name the tandem binary}
FIX=$SRC/tests/fixtures/tokenizer/gguf
PY=$(command -v python3 || echo /usr/bin/python3)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0

ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*" >&2; }

# rows JSONL: writes $tmp/N.text (exact bytes), $tmp/N.ids and $tmp/N.plain (one line each)
rows() {
    "$PY" - "$1" "$tmp" <<'PYEOF'
import json, sys
for i, line in enumerate(open(sys.argv[1], encoding="utf-8").read().splitlines()):
    r = json.loads(line)
    d = sys.argv[2] + "/" + str(i)
    open(d + ".text", "wb").write(bytes.fromhex(r["hex"]))
    open(d + ".ids", "w").write(" ".join(map(str, r["ids"])) + "\n")
    open(d + ".plain", "w").write(" ".join(map(str, r["ids_plain"])) + "\n")
print(i + 1)
PYEOF
}

# the rows run through the CLI (test_tok_gguf runs all of them in one process): newlines,
# numbers, contractions, CJK, emoji, ChatML and Llama-3 specials; under the sanitizers, where
# each process start costs ~0.3 s, three of them
ROWS="7 10 15 19 24 26 29"
[ "${TD_SANITIZE:-OFF}" = ON ] && ROWS="7 26 38"

check() { # name gguf-path decode(0/1)
    local name=$1 path=$2 dec=$3 i
    rm -f "$tmp"/*.text "$tmp"/*.ids "$tmp"/*.plain
    rows "$FIX/$name.jsonl" > /dev/null || { bad "$name: cannot read $FIX/$name.jsonl"; return; }
    for i in $ROWS; do
        if "$BIN" tokenize --tokenizer "$path" < "$tmp/$i.text" > "$tmp/out" && cmp -s "$tmp/out" "$tmp/$i.ids"; then ok
        else bad "$name row $i: want $(head -c 200 "$tmp/$i.ids") got $(head -c 200 "$tmp/out")"; fi
        if "$BIN" tokenize --tokenizer "$path" --no-parse-special < "$tmp/$i.text" > "$tmp/out" &&
            cmp -s "$tmp/out" "$tmp/$i.plain"; then ok
        else bad "$name row $i --no-parse-special: want $(head -c 200 "$tmp/$i.plain") got $(head -c 200 "$tmp/out")"; fi
        if [ "$dec" = 1 ]; then
            if "$BIN" tokenize --tokenizer "$path" --decode < "$tmp/$i.plain" > "$tmp/out" && cmp -s "$tmp/out" "$tmp/$i.text"; then ok
            else bad "$name row $i: decode differs from the text"; fi
        fi
    done
}

for name in smollm llama3 qwen2 gpt2 default; do check "$name" "$FIX/$name.gguf" 1; done
check llama-spm "$FIX/llama-spm.gguf" 0

# --add-special: BOS where llama-tokenize adds it (the file's add_bos_token / llama.cpp's default)
for name in smollm llama3 qwen2 llama-spm; do
    want=$(grep -q true "$FIX/$name.meta.json" && echo yes || echo no)
    a=$(printf 'Hi' | "$BIN" tokenize --tokenizer "$FIX/$name.gguf")
    b=$(printf 'Hi' | "$BIN" tokenize --tokenizer "$FIX/$name.gguf" --add-special)
    got=no
    [ "$(echo "$b" | wc -w)" -eq $(($(echo "$a" | wc -w) + 1)) ] && got=yes
    [ "$got" = "$want" ] && ok || bad "$name --add-special: BOS added $got, llama-tokenize: $want"
done

# a pre-tokenizer we do not have is refused, naming it
"$PY" - "$FIX/smollm.gguf" "$tmp/bad.gguf" <<'PYEOF'
import sys
d = bytearray(open(sys.argv[1], "rb").read())
k = d.index(b"tokenizer.ggml.pre")
v = d.index(b"smollm", k)
d[v:v + 6] = b"smolxx"
open(sys.argv[2], "wb").write(d)
PYEOF
printf 'x' | "$BIN" tokenize --tokenizer "$tmp/bad.gguf" > /dev/null 2> "$tmp/err"
[ $? -eq 1 ] && grep -q '"smolxx" is not supported' "$tmp/err" && ok || bad "unknown pre: $(cat "$tmp/err")"

real=${TANDEM_TEST_GGUF:-}
if [ -n "$real" ] && [ -r "$real" ]; then check smollm2-real "$real" 1
else echo "skip: the real SmolLM2 rows: TANDEM_TEST_GGUF does not name a file (scripts/fetch-model prints its path)"; fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
