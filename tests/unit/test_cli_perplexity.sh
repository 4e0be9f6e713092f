#!/usr/bin/env bash
# `tandem perplexity` on the real binary: on stories260K (with a byte-level tokenizer.bin made
# here: stories260K's own 512-piece tokenizer is not shipped, and its first 259 ids are the
# same <unk>, <s>, </s> and 256 byte pieces) the figure equals llama-perplexity's method
# computed independently in float64 numpy (tests/ref/llama2c_ref.py perplexity) to 1e-4
# relative, the running estimates are printed per chunk, --batch does not change the result,
# --chunks limits the chunks; clear errors for bad input. On SmolLM2 (TANDEM_TEST_GGUF) the
# output format only: the figures against llama-perplexity are in docs/chat.md.
set -u
bin=${TANDEM_BIN:?TANDEM_BIN must point to the tandem binary}
src=${TD_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
models=${TANDEM_TEST_MODELS:-$src/../shared/models}
model=$models/stories260K/stories260K.bin
source "$(dirname "$0")/cli_lib.sh" # pass/fail counters, $dir, $out, $err, expect_rc, says

expect_rc 0 "perplexity --help" "$bin" perplexity --help
expect_rc 2 "no --file" "$bin" perplexity --model x
says "give --model PATH and --file TEXT" "no --file"
expect_rc 2 "odd --ctx" "$bin" perplexity --model x --file y --ctx 127
says "--ctx 127 is odd" "odd --ctx"
expect_rc 2 "bad --chunks" "$bin" perplexity --model x --file y --chunks 0

cat >"$dir/story.txt" <<'EOF'
Once upon a time, there was a little girl named Lily. She loved to play outside in the sun. One day, she saw a big red ball in the park. She wanted to play with it, but it was too high up in the tree. Lily asked her mom for help. Her mom said, "Let's ask the tall man to get the ball." The man was kind and got the ball for Lily. Lily was very happy and said, "Thank you!" They played with the ball all day long.
Once upon a time, there was a little boy named Tim. Tim had a big dog named Max. Max was a good dog and liked to run. One day, Tim and Max went to the park. They saw a cat in a tree. Max barked at the cat. The cat was scared and ran away. Tim and Max played in the park until it was time to go home.
EOF
if [ ! -f "$model" ]; then
    echo "skipped: $model not found (set TANDEM_TEST_MODELS): stories260K perplexity"
    skip=$((skip + 1))
else
    /usr/bin/python3 - "$dir/tok.bin" <<'PY'
import struct, sys
pieces = [b'<unk>', b'<s>', b'</s>'] + [b'<0x%02X>' % b for b in range(256)]
pieces += [b'<unused%d>' % i for i in range(512 - len(pieces))]
with open(sys.argv[1], 'wb') as f:
    f.write(struct.pack('<i', max(map(len, pieces))))
    for p in pieces:
        f.write(struct.pack('<fi', 0.0, len(p)) + p)
PY
    tok=$dir/tok.bin
    expect_rc 0 "stories260K perplexity" "$bin" perplexity --model "$model" --tokenizer "$tok" --file "$dir/story.txt" --ctx 128
    cp "$out" "$dir/full"
    # one running estimate per chunk: a token per byte, the dummy-prefix space and BOS
    n_tok=$(($(wc -c <"$dir/story.txt") + 2))
    n_chunk=$((n_tok / 128))
    want_est=$(for k in $(seq "$n_chunk"); do printf '\\[%d\\][0-9.]+,' "$k"; done)
    grep -qE "^$want_est\$" "$dir/full" && [ "$n_chunk" -ge 4 ] && ok ||
        bad "running estimates of $n_chunk chunks: $(cat "$dir/full")"
    got=$(sed -n 's/^Final estimate: PPL = \([0-9.]*\) +\/- \([0-9.]*\)$/\1 \2/p' "$dir/full")
    [ -n "$got" ] && ok || bad "no 'Final estimate: PPL = X +/- Y' line: $(cat "$dir/full")"
    last=$(sed -n "s/.*\\[$n_chunk\\]\\([0-9.]*\\),\$/\\1/p" "$dir/full")
    [ "$last" = "${got% *}" ] && ok || bad "the last running estimate '$last' is not the final '${got% *}'"
    # progress on stderr (not a terminal): one line per chunk, its estimate as stdout's
    [ "$(grep -cE "^perplexity: chunk [0-9]+/$n_chunk, \[[0-9]+\][0-9.]+, [0-9.]+ s/chunk, ETA [0-9]+ s$" "$err")" -eq "$n_chunk" ] &&
        grep -qF "chunk $n_chunk/$n_chunk, [$n_chunk]$last," "$err" && ok ||
        bad "want $n_chunk progress lines on stderr ending at [$n_chunk]$last: $(cat "$err")"
    if /usr/bin/python3 -c "import numpy" 2>/dev/null; then
        { printf '1 '; "$bin" tokenize --tokenizer "$tok" <"$dir/story.txt"; } >"$dir/ids"
        want=$(/usr/bin/python3 "$src/tests/ref/llama2c_ref.py" "$model" perplexity "$dir/ids" 128 |
               sed -n 's/^PPL = \([0-9.]*\) +\/- \([0-9.]*\)$/\1 \2/p')
        /usr/bin/python3 - "$got" "$want" <<'PY' && ok || bad "PPL '$got' (tandem) vs '$want' (numpy float64 reference)"
import sys
g, w = [list(map(float, a.split())) for a in sys.argv[1:3]]
sys.exit(0 if abs(g[0] - w[0]) <= 1e-4 * w[0] and abs(g[1] - w[1]) <= 1e-3 * w[1] else 1)
PY
    else
        echo "skipped: /usr/bin/python3 has no numpy: reference comparison"
        skip=$((skip + 1))
    fi
    # batches of 48 tokens (not dividing the chunk): the same figures
    "$bin" perplexity --model "$model" --tokenizer "$tok" --file "$dir/story.txt" --ctx 128 --batch 48 >"$out" 2>"$err"
    b=$(sed -n 's/^Final estimate: PPL = \([0-9.]*\) .*/\1/p' "$out")
    [ -n "$b" ] && [ "$b" = "${got% *}" ] && ok || bad "--batch 48 gives '$b', --batch 128 '${got% *}'"
    # --chunks 2: the second running estimate of the full run
    "$bin" perplexity --model "$model" --tokenizer "$tok" --file "$dir/story.txt" --ctx 128 --chunks 2 >"$out" 2>"$err"
    c=$(sed -n 's/^Final estimate: PPL = \([0-9.]*\) .*/\1/p' "$out")
    c2=$(sed -n 's/.*\[2\]\([0-9.]*\),.*/\1/p' "$dir/full")
    [ -n "$c" ] && [ "$c" = "$c2" ] && ok || bad "--chunks 2 gives '$c', the full run's [2] '$c2'"
    expect_rc 1 "file shorter than two chunks" "$bin" perplexity --model "$model" --tokenizer "$tok" \
        --file "$dir/story.txt" --ctx 400
    says "tokenizes to $n_tok tokens; a context of 400 needs at least 800" "file shorter than two chunks"
    expect_rc 1 "--ctx past the model's length" "$bin" perplexity --model "$model" --tokenizer "$tok" \
        --file "$dir/story.txt" --ctx 1024
    says "--ctx 1024 is more than the model's length 512" "--ctx past the model's length"
    expect_rc 1 "missing file" "$bin" perplexity --model "$model" --tokenizer "$tok" --file "$dir/none.txt"
    says "$dir/none.txt" "missing file"
    expect_rc 1 "no tokenizer" "$bin" perplexity --model "$model" --file "$dir/story.txt"
    says "has no tokenizer beside it" "no tokenizer"
fi

gguf=${TANDEM_TEST_GGUF:-}
if [ "${TD_SANITIZE:-OFF}" = ON ]; then
    # minutes under ASan on 2 cores; the release build runs them
    echo "skipped: sanitizer build: SmolLM2 perplexity checks (the release build runs them)"
    skip=$((skip + 1))
elif [ -z "$gguf" ] || [ ! -f "$gguf" ]; then
    echo "skipped: TANDEM_TEST_GGUF unset or missing (scripts/fetch-model): SmolLM2 perplexity format"
    skip=$((skip + 1))
else
    "$bin" perplexity --model "$gguf" --file "$dir/story.txt" --ctx 64 --chunks 2 >"$out" 2>"$err"
    grep -qE '^Final estimate: PPL = [0-9]+\.[0-9]{4} \+/- [0-9]+\.[0-9]{5}$' "$out" && ok ||
        bad "SmolLM2: $(cat "$out" "$err" | head -c 400)"
fi

echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
