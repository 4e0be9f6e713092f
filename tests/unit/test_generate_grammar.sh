#!/usr/bin/env bash
# Structured output in `tandem generate` (docs/grammar.md), on the real binary: the flags'
# refusals (exit 2, naming the flag and what is unsupported) before any model loads; with
# SmolLM2 (TANDEM_TEST_GGUF) the outputs conform: JSON under --json-schema parses and
# validates against the schema (a validator in Python below, written apart from the
# compiler) at temperature 1 over several seeds, greedy and with speculative decoding
# (the same output token for token), --json-object gives an object, --regex a full match,
# --choice one of the strings, --grammar the GBNF's language.
set -u
bin=${TANDEM_BIN:?TANDEM_BIN must point to the tandem binary}
py=/usr/bin/python3
val="$(dirname "$0")/../support/json_schema_check.py" # SCHEMA.json OUTPUT: validates
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
expect_says() { # expect_says MESSAGE FLAGS...: generate with FLAGS exits 2 saying MESSAGE
    local want=$1; shift
    "$bin" generate "$@" >"$tmp/out" 2>"$tmp/err"
    local rc=$?
    if [ "$rc" -ne 2 ]; then bad "$*: exit $rc, want 2: $(head -c 300 "$tmp/err")"; return; fi
    grep -qF -- "$want" "$tmp/err" && ok || bad "$*: '$(head -c 300 "$tmp/err")' does not say '$want'"
}

echo '{"type":"object","properties":{"a":{"type":"number","multipleOf":3}}}' >"$tmp/unsup.json"
echo '{"type":' >"$tmp/broken.json"
printf 'root ::= root "a" | "b"\n' >"$tmp/leftrec.gbnf"
expect_says '--json-schema: json schema $.properties.a.multipleOf: keyword "multipleOf" is not supported' \
    --model /nonexistent --prompt x --json-schema "$tmp/unsup.json"
expect_says 'not valid JSON' --model /nonexistent --prompt x --json-schema "$tmp/broken.json"
expect_says '--json-schema: ' --model /nonexistent --prompt x --json-schema "$tmp/missing.json"
expect_says 'left-recursive' --model /nonexistent --prompt x --grammar "$tmp/leftrec.gbnf"
expect_says 'backreferences are not supported' --model /nonexistent --prompt x --regex '(a)\1'
expect_says 'give at most one of' --model /nonexistent --prompt x --regex a --choice a,b
# with --server the flag is checked here too, before any connection (then sent as is)
expect_says '--json-schema: json schema $.properties.a.multipleOf' --server 127.0.0.1:1 --prompt x \
    --json-schema "$tmp/unsup.json"

gguf=${TANDEM_TEST_GGUF:-}
if [ -z "$gguf" ] || [ ! -f "$gguf" ]; then
    echo "skipped: TANDEM_TEST_GGUF unset or missing (scripts/fetch-model): SmolLM2 structured-output checks"
    echo "passed $pass, failed $fail"
    [ "$fail" -eq 0 ] || exit 1
    exit 77
fi

gen() { "$bin" generate --model "$gguf" --threads 1 "$@" 2>"$tmp/err"; }

# a schema whose every string and array is bounded, so a conforming output always fits
cat >"$tmp/person.json" <<'JSON'
{"type":"object","properties":{
  "name":{"type":"string","minLength":1,"maxLength":12},
  "age":{"type":"integer","minimum":0,"maximum":120},
  "city":{"enum":["Paris","Tokyo","Lima"]},
  "email":{"type":["string","null"],"format":"email"},
  "born":{"type":"string","format":"date"},
  "tags":{"type":"array","items":{"type":"string","maxLength":8},"maxItems":3},
  "score":{"type":"number","minimum":0}},
 "required":["name","age","city"],"additionalProperties":false}
JSON

# temperature 1, several seeds: every output validates
for seed in 1 2 3 4 5 6; do
    gen --chat --prompt "Describe a person as JSON." --json-schema "$tmp/person.json" --temperature 1 --seed $seed \
        --max-tokens 300 >"$tmp/p$seed.txt" || { bad "seed $seed: exit $?: $(head -c 300 "$tmp/err")"; continue; }
    $py "$val" "$tmp/person.json" "$tmp/p$seed.txt" && ok || bad "seed $seed does not validate"
done
# greedy, and greedy with prompt-lookup speculation: valid, and the same output
gen --chat --prompt "Describe a person as JSON." --json-schema "$tmp/person.json" --max-tokens 300 >"$tmp/g.txt" &&
    $py "$val" "$tmp/person.json" "$tmp/g.txt" && ok || bad "greedy does not validate"
gen --chat --prompt "Describe a person as JSON." --json-schema "$tmp/person.json" --max-tokens 300 --spec prompt-lookup \
    >"$tmp/gs.txt" && cmp -s "$tmp/g.txt" "$tmp/gs.txt" && ok || bad "--spec prompt-lookup changed the output"
# any JSON object
gen --chat --prompt "What is the capital of France? Answer in JSON." --json-object --max-tokens 150 >"$tmp/o.txt" &&
    $py -c 'import json,sys; assert isinstance(json.load(open(sys.argv[1])), dict)' "$tmp/o.txt" && ok ||
    bad "--json-object: '$(head -c 300 "$tmp/o.txt")'"
# a regex, matched whole, at temperature 1
for seed in 1 2 3; do
    gen --prompt "Call me at" --regex '\(\d{3}\) \d{3}-\d{4}( ext\. \d{1,4})?' --temperature 1 --seed $seed \
        --max-tokens 40 >"$tmp/r.txt" &&
        $py -c 'import re,sys; assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}( ext\. \d{1,4})?", open(sys.argv[1]).read())' \
            "$tmp/r.txt" && ok || bad "--regex seed $seed: '$(head -c 200 "$tmp/r.txt")'"
done
# a choice
out=$(gen --chat --prompt "Is the sky blue?" --choice "yes,no,it depends" --temperature 1 --seed 9 --max-tokens 10)
case "$out" in yes | no | "it depends") ok ;; *) bad "--choice gave '$out'" ;; esac
# a GBNF grammar
printf 'root ::= answer "." \nanswer ::= "The answer is " [0-9]{1,3}\n' >"$tmp/a.gbnf"
out=$(gen --prompt "What is 6 times 7?" --grammar "$tmp/a.gbnf" --max-tokens 20)
[[ "$out" =~ ^The\ answer\ is\ [0-9]{1,3}\.$ ]] && ok || bad "--grammar gave '$out'"

echo "passed $pass, failed $fail"
[ "$fail" -eq 0 ]
