#!/usr/bin/env bash
# `tandem generate --chat` and `tandem chat` on the real binary, with a synthetic model whose
# tokenizer_config.json gets a chat template: the prompt is the template rendered as jinja2
# renders it (Python's, the reference td_chat_template is checked against) and encoded with
# the template's special tokens as their ids, BOS added only when the template does not
# write it; chat replies equal generate --chat's, a later turn reuses the earlier turns' KV
# (the prefix cache's count on stderr), /reset and /exit; clear errors without a template.
set -u
bin=${TANDEM_BIN:?TANDEM_BIN must point to the tandem binary}
source "$(dirname "$0")/cli_lib.sh" # pass/fail counters, $dir, $out, $err, expect_rc, says

expect_rc 0 "chat --help" "$bin" chat --help
expect_rc 2 "chat without --model" "$bin" chat
says "give --model PATH" "chat without --model"
expect_rc 2 "chat bad temperature" "$bin" chat --model x --temperature -1
says "--temperature: temperature -1 is out of range" "chat bad temperature"
expect_rc 2 "chat --spec draft-model without a draft model" "$bin" chat --model x --spec draft-model
says "--draft-model PATH" "chat --spec draft-model without a draft model"
expect_rc 2 "--system without --chat" "$bin" generate --model x --prompt hi --system s
says "--system needs --chat" "--system without --chat"
expect_rc 2 "--chat without --prompt" "$bin" generate --model x --prompt-ids 1 --chat
expect_rc 2 "bad --quant" "$bin" generate --model x --prompt hi --quant q5_1

if ! "$bin" model synth --arch llama --config tiny --seed 3 --dtype f32 --out "$dir/m" >/dev/null 2>&1; then
    bad "model synth failed"
    echo "$pass passed, $fail failed, $skip skipped"
    exit 1
fi
m=$dir/m
# no template yet: a clear error, exit 1
expect_rc 1 "generate --chat without a template" "$bin" generate --model "$m" --chat --prompt hi --max-tokens 2
says "has no chat template" "generate --chat without a template"
printf 'hi\n' >"$dir/in"
"$bin" chat --model "$m" <"$dir/in" >"$out" 2>"$err"
[ $? -eq 1 ] && ok || bad "chat without a template: not exit 1"
says "has no chat template" "chat without a template"

# with_template TEMPLATE: writes it into the model's tokenizer_config.json
with_template() {
    /usr/bin/python3 - "$m/tokenizer_config.json" "$1" <<'PY'
import json, sys
path, tmpl = sys.argv[1], sys.argv[2]
cfg = json.load(open(path))
cfg['chat_template'] = tmpl
json.dump(cfg, open(path, 'w'))
PY
}
# render SYSTEM USER: the template rendered by jinja2 as Hugging Face does
render() {
    /usr/bin/python3 - "$m/tokenizer_config.json" "$1" "$2" <<'PY'
import json, sys, jinja2
cfg = json.load(open(sys.argv[1]))
msgs = ([{'role': 'system', 'content': sys.argv[2]}] if sys.argv[2] else []) + [{'role': 'user', 'content': sys.argv[3]}]
env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
sys.stdout.write(env.from_string(cfg['chat_template']).render(messages=msgs, bos_token='<s>', eos_token='</s>',
                                                               add_generation_prompt=True))
PY
}
if ! /usr/bin/python3 -c "import jinja2" 2>/dev/null; then
    echo "skipped: /usr/bin/python3 has no jinja2: chat prompt checks"
    skip=$((skip + 1))
    echo "$pass passed, $fail failed, $skip skipped"
    [ "$fail" -eq 0 ] && exit 77
    exit 1
fi

# 1. a template that writes BOS itself (Llama 2 / Mistral style): no second BOS
with_template "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
text=$(render "Be brief." "Hi there")
"$bin" generate --model "$m" --chat --system "Be brief." --prompt "Hi there" --max-tokens 6 --log-level debug \
    >"$out" 2>"$err"
grep -qxF "tandem: debug: chat prompt: $text" "$err" && ok || bad "rendered prompt: want '$text': $(grep 'chat prompt' "$err")"
ids=$(printf '%s' "$text" | "$bin" tokenize --tokenizer "$m")
case "$ids" in "256 "*) ok ;; *) bad "the rendered <s> is not encoded as the BOS id 256: '$ids'" ;; esac
want=$("$bin" generate --model "$m" --prompt-ids "$ids" --max-tokens 12 --print-ids 2>/dev/null)
got=$("$bin" generate --model "$m" --chat --system "Be brief." --prompt "Hi there" --max-tokens 12 --print-ids 2>/dev/null)
[ -n "$got" ] && [ "$got" = "$want" ] && ok || bad "BOS-writing template: --chat ids '$got', from the rendered ids '$want'"

# 2. a ChatML template without BOS: the model's BOS is prepended
with_template "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
ids=$(render "" "What is 2+2?" | "$bin" tokenize --tokenizer "$m")
want=$("$bin" generate --model "$m" --prompt-ids "256 $ids" --max-tokens 12 --print-ids 2>/dev/null)
got=$("$bin" generate --model "$m" --chat --prompt "What is 2+2?" --max-tokens 12 --print-ids 2>/dev/null)
[ -n "$got" ] && [ "$got" = "$want" ] && ok || bad "ChatML template: --chat ids '$got', BOS + rendered ids '$want'"
# the list form of chat_template: its "default" entry
/usr/bin/python3 - "$m/tokenizer_config.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg['chat_template'] = [{'name': 'tool_use', 'template': 'x'}, {'name': 'default', 'template': cfg['chat_template']}]
json.dump(cfg, open(sys.argv[1], 'w'))
PY
got2=$("$bin" generate --model "$m" --chat --prompt "What is 2+2?" --max-tokens 12 --print-ids 2>/dev/null)
[ "$got2" = "$got" ] && ok || bad "list-form chat_template: '$got2', string form '$got'"

# 3. chat: a reply equals generate --chat's text; the second turn's prompt starts with the
# first turn's KV (cached tokens on stderr); /reset starts over (cached again: the system
# prompt's blocks); /exit ends before the last line
sys="You are a helpful assistant. Answer every question in one short sentence, please."
"$bin" generate --model "$m" --chat --system "$sys" --prompt "Hello" --max-tokens 10 >"$dir/gen" 2>/dev/null
size=$(stat -c %s "$dir/gen")
printf 'Hello\nAnd then?\n/reset\nHello\n/exit\nnever read\n' >"$dir/in"
"$bin" chat --model "$m" --system "$sys" --max-tokens 10 <"$dir/in" >"$out" 2>"$err"
[ $? -eq 0 ] && ok || bad "chat: exit status $?: $(head -c 300 "$err")"
n=$(grep -c "^prompt: " "$err")
[ "$n" -eq 3 ] && ok || bad "chat: $n turns answered, want 3 (/exit ends the chat): $(cat "$err")"
cmp -s -n "$size" "$dir/gen" "$out" && [ "$size" -gt 0 ] && ok ||
    bad "chat's first reply is not generate --chat's: $(od -c "$out" | head -3) / $(od -c "$dir/gen" | head -3)"
c1=$(grep "^prompt: " "$err" | sed -n 1p | sed 's/.*(\([0-9]*\) cached).*/\1/')
c2=$(grep "^prompt: " "$err" | sed -n 2p | sed 's/.*(\([0-9]*\) cached).*/\1/')
c3=$(grep "^prompt: " "$err" | sed -n 3p | sed 's/.*(\([0-9]*\) cached).*/\1/')
[ "$c1" = 0 ] && [ "${c2:-0}" -ge 32 ] && [ "${c3:-0}" -ge 16 ] && ok ||
    bad "cached prompt tokens per turn: '$c1' '$c2' '$c3' (want 0, >= 32, >= 16): $(cat "$err")"
grep -qF "(new conversation)" "$err" && ok || bad "/reset not acknowledged"
# the turn after /reset is the first turn again: the same reply
tail -c "$((size + 1))" "$out" | head -c "$size" >"$dir/third"
cmp -s "$dir/third" "$dir/gen" && ok || bad "the reply after /reset differs from the first"
# with a draft model (the model drafting for itself): the same replies, and drafts accepted
"$bin" chat --model "$m" --system "$sys" --max-tokens 10 --draft-model "$m" --draft-tokens 4 <"$dir/in" \
    >"$dir/spec.out" 2>"$dir/spec.err"
cmp -s "$out" "$dir/spec.out" && ok || bad "chat --draft-model: other replies: $(head -c 300 "$dir/spec.err")"
grep -qE "^speculation: .* accepted [1-9]" "$dir/spec.err" && ok ||
    bad "chat --draft-model: no draft accepted: $(grep speculation "$dir/spec.err")"

# 4. SmolLM2 (GGUF: tokenizer.chat_template, add_bos_token false, <|im_start|> is also its BOS
# id 1): the prompt is llama.cpp's (`llama-tokenize -m MODEL -f RENDERED --ids` on the text
# jinja2 renders from the file's template: the ids below), and a second chat turn starts
# from the first's KV
gguf=${TANDEM_TEST_GGUF:-}
if [ "${TD_SANITIZE:-OFF}" = ON ]; then
    # minutes under ASan on 2 cores; the release build runs them
    echo "skipped: sanitizer build: SmolLM2 chat checks (the release build runs them)"
    skip=$((skip + 1))
elif [ -z "$gguf" ] || [ ! -f "$gguf" ]; then
    echo "skipped: TANDEM_TEST_GGUF unset or missing (scripts/fetch-model): SmolLM2 chat checks"
    skip=$((skip + 1))
else
    ids="1 9690 198 2683 359 253 5356 5646 11173 3365 3511 308 34519 28 7018 411 407 19712 8182 2 198 1 4093 198"
    ids="$ids 1780 314 260 3575 282 4649 47 2 198 1 520 9531 198"
    want=$("$bin" generate --model "$gguf" --prompt-ids "$ids" --max-tokens 4 --print-ids 2>/dev/null)
    got=$("$bin" generate --model "$gguf" --chat --prompt "What is the capital of France?" --max-tokens 4 \
          --print-ids 2>/dev/null)
    [ -n "$got" ] && [ "$got" = "$want" ] && ok || bad "SmolLM2 --chat: '$got', from llama.cpp's prompt ids '$want'"
    printf 'What is the capital of France?\nAnd of Germany?\n' >"$dir/in"
    "$bin" chat --model "$gguf" --max-tokens 30 <"$dir/in" >"$out" 2>"$err"
    # the second turn's prompt starts with the first's: every whole 16-token KV block of the
    # first prompt is served from the prefix cache
    p1=$(grep "^prompt: " "$err" | sed -n 1p | sed 's/^prompt: \([0-9]*\) tokens.*/\1/')
    c2=$(grep "^prompt: " "$err" | sed -n 2p | sed 's/.*(\([0-9]*\) cached).*/\1/')
    want=$(( ${p1:-0} / 16 * 16 ))
    [ "$want" -gt 0 ] && [ "${c2:-0}" -ge "$want" ] && ok ||
        bad "SmolLM2 chat: the second turn has '$c2' cached tokens, want >= $want (the first prompt's whole blocks): $(cat "$err")"
fi

echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
