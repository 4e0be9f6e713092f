#!/bin/bash
# test_generate_server: `tandem generate --server HOST:PORT` against a real `tandem local`
# cluster (1 prefill + 1 decode) prints exactly what `tandem generate --model` prints on this
# machine: the same ids with --print-ids on stories260K (greedy prompts of 1 to 120 tokens,
# seeded temperature/top-k/top-p sampling, a repetition penalty, a stop id), and the same
# text on a synthetic model with a tokenizer (plain, and cut by a --stop string). Errors:
# a refused port and a server that accepts but never answers fail quickly with a clear
# message; INVALID_ARGUMENT, NOT_FOUND, UNIMPLEMENTED (a node's port), UNAVAILABLE (a router
# without nodes) and DEADLINE_EXCEEDED (--timeout) come back as messages; SIGINT cancels;
# local-only and malformed flags are usage errors (exit 2).
# Skips without stories260K. Every process it starts is stopped on exit.
set -u
MODELS="${TANDEM_TEST_MODELS:-$(dirname "$0")/../../../shared/models}"
M="$MODELS/stories260K/stories260K.bin"
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
if [ ! -f "$M" ]; then echo "SKIP: $M absent (set TANDEM_TEST_MODELS)"; exit 77; fi
T=$(mktemp -d)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    rm -rf "$T"
}
trap cleanup EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }

# start_cluster NAME MODEL: tandem local in the background; sets G (gateway) and LPID.
start_cluster() {
    "$BIN" local --model "$2" --prefill 1 --decode 1 >"$T/$1.out" 2>"$T/$1.err" &
    LPID=$!
    PIDS+=("$LPID")
    for _ in $(seq 150); do grep -q '^metrics: ' "$T/$1.out" && break; sleep 0.1; done
    G=$(sed -n 's/^gateway: //p' "$T/$1.out")
    if [ -z "$G" ]; then echo "FAIL: cluster $1 did not start within 15 s"; cat "$T/$1.err"; exit 1; fi
}

# same_ids PROMPT_IDS ARGS...: server ids equal local ids
same_ids() {
    local ids="$1"; shift
    local want got
    want=$("$BIN" generate --model "$M" --prompt-ids "$ids" --print-ids --threads 1 "$@" 2>"$T/lerr") ||
        { bad "local generate failed for '$ids' $*: $(cat "$T/lerr")"; return; }
    got=$("$BIN" generate --server "$G" --prompt-ids "$ids" --print-ids "$@" 2>"$T/serr") ||
        { bad "generate --server failed for '$ids' $*: $(cat "$T/serr")"; return; }
    [ -n "$want" ] || { bad "local generate printed no ids for '$ids' $*"; return; }
    [ "$want" == "$got" ] || bad "prompt '$ids' $*: local '$want', server '$got'"
    grep -q '^server: request [^ ]*, finish ' "$T/serr" || bad "no server timings on stderr: $(cat "$T/serr")"
    grep -q 'time to first token' "$T/serr" || bad "no client timings on stderr: $(cat "$T/serr")"
}

# expect_fail RC PATTERN CMD...: CMD exits RC within 5 s and its stderr matches PATTERN
expect_fail() {
    local want_rc="$1" pat="$2"; shift 2
    local t0 rc
    t0=$(date +%s%N)
    timeout 10 "$@" >"$T/fout" 2>"$T/ferr"; rc=$?
    local ms=$((($(date +%s%N) - t0) / 1000000))
    [ "$rc" -eq "$want_rc" ] || bad "'$*' exited $rc, expected $want_rc: $(cat "$T/ferr")"
    grep -q -- "$pat" "$T/ferr" || bad "'$*': stderr lacks '$pat': $(cat "$T/ferr")"
    [ "$ms" -lt 5000 ] || bad "'$*' took $ms ms to fail"
}

start_cluster stories "$M"
LONG=$(seq -s ' ' 300 419)   # 120 ids
same_ids "1" --max-tokens 40
same_ids "1 403 407" --max-tokens 24
same_ids "5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21" --max-tokens 16
same_ids "1 $LONG" --max-tokens 20
same_ids "1 403 407" --max-tokens 32 --temperature 0.8 --seed 7
same_ids "1 200 300" --max-tokens 32 --temperature 1.0 --top-k 40 --seed 42
same_ids "1" --max-tokens 32 --temperature 0.9 --top-p 0.9 --min-p 0.05 --seed 3
same_ids "1 403 407" --max-tokens 32 --repetition-penalty 1.3
same_ids "1 403 407" --max-tokens 32 --stop-id 466
"$BIN" generate --server "$G" --prompt-ids "1 2" --max-tokens 4 --request-id client-req-7 >/dev/null 2>"$T/rid"
grep -q '^server: request client-req-7, finish length' "$T/rid" || bad "--request-id: $(cat "$T/rid")"
# the server's own errors, named
expect_fail 1 'INVALID_ARGUMENT' "$BIN" generate --server "$G" --prompt "no tokenizer on this router"
expect_fail 1 'NOT_FOUND' "$BIN" generate --server "$G" --prompt-ids "1" --model-name nope
NODE=$(sed -n 's/^decode decode0: control \([^ ]*\) .*/\1/p' "$T/stories.err")
if [ -n "$NODE" ]; then
    expect_fail 1 'UNIMPLEMENTED' "$BIN" generate --server "$NODE" --prompt-ids "1"
else
    bad "no decode node control address in tandem local's stderr"
fi
same_ids "1 42" --max-tokens 8   # the cluster still serves after those
kill -TERM "$LPID"; wait "$LPID"; rc=$?
[ $rc -eq 0 ] || bad "tandem local exited $rc on SIGTERM"

# text: a synthetic model with its byte-level tokenizer (random weights, so noise, but
# every id of its 258-token vocabulary has text)
sed 's/"vocab_size":[^,]*/"vocab_size": 258/' >"$T/cfg.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
 "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 8,
 "num_key_value_heads": 4, "vocab_size": 258, "max_position_embeddings": 512,
 "rms_norm_eps": 1e-05, "rope_theta": 10000, "tie_word_embeddings": false,
 "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "bfloat16"}
EOF
"$BIN" model synth --config "$T/cfg.json" --seed 3 --out "$T/m258" >/dev/null 2>&1 || { bad "model synth failed"; exit 1; }
start_cluster synth "$T/m258"
# text_case NAME ARGS...: server text equals local text
text_case() {
    local name="$1"; shift
    "$BIN" generate --model "$T/m258" --prompt "Once upon a time" --max-tokens 32 --threads 1 "$@" \
        >"$T/$name.want" 2>/dev/null || bad "local text generate failed ($name)"
    "$BIN" generate --server "$G" --prompt "Once upon a time" --max-tokens 32 "$@" \
        >"$T/$name.got" 2>"$T/$name.serr" || bad "server text generate failed ($name): $(cat "$T/$name.serr")"
    [ -s "$T/$name.want" ] || bad "local generate printed no text ($name)"
    cmp -s "$T/$name.want" "$T/$name.got" ||
        bad "text differs ($name): local '$(cat "$T/$name.want")' server '$(cat "$T/$name.got")'"
}
text_case plain
# a stop string: the last ASCII character of the plain text, so the stopped text is shorter
STOP=$(LC_ALL=C grep -o '[A-Za-z0-9<>]' "$T/plain.want" | tail -1)
if [ -n "$STOP" ]; then
    text_case stopped --stop "$STOP"
    grep -q 'finish stop' "$T/stopped.serr" || bad "--stop '$STOP' did not stop: $(cat "$T/stopped.serr")"
    [ "$(wc -c <"$T/stopped.got")" -lt "$(wc -c <"$T/plain.got")" ] || bad "--stop '$STOP' did not shorten the text"
else
    bad "the synthetic model's text has no ASCII character to stop at: $(cat "$T/plain.want")"
fi
kill -TERM "$LPID"; wait "$LPID"; rc=$?
[ $rc -eq 0 ] || bad "tandem local (synthetic) exited $rc on SIGTERM"

# a router without nodes answers UNAVAILABLE itself: reached, but it cannot serve
"$BIN" router --log-level error >"$T/bare.out" 2>"$T/bare.err" &
PIDS+=($!)
for _ in $(seq 100); do grep -q '^metrics: ' "$T/bare.out" && break; sleep 0.1; done
BARE=$(sed -n 's/^gateway: //p' "$T/bare.out")
[ -n "$BARE" ] || bad "a bare router did not start: $(cat "$T/bare.err")"
expect_fail 1 'the cluster could not serve the request (UNAVAILABLE' "$BIN" generate --server "$BARE" --prompt-ids "1"

# unreachable: a refused port, and a port that accepts but never answers
PORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
expect_fail 1 'cannot reach the server' "$BIN" generate --server "127.0.0.1:$PORT" --prompt-ids "1"
/usr/bin/python3 -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8); s.settimeout(60)
print(s.getsockname()[1], flush=True)
conns = []
while True:  # accepts, reads what the client sends (its HTTP/2 preface), never answers
    c, _ = s.accept(); c.settimeout(10); c.recv(4096); conns.append(c)
    print("read", flush=True)' >"$T/silent" &
PIDS+=($!)
for _ in $(seq 50); do [ -s "$T/silent" ] && break; sleep 0.1; done
SILENT="127.0.0.1:$(head -1 "$T/silent")"
expect_fail 1 'no answer from' "$BIN" generate --server "$SILENT" --prompt-ids "1" --connect-timeout 0.5
# --timeout bounds the whole call (the connect bound is longer here): DEADLINE_EXCEEDED
expect_fail 1 'within --timeout 0.3 s (DEADLINE_EXCEEDED' "$BIN" generate --server "$SILENT" --prompt-ids "1" \
    --timeout 0.3 --connect-timeout 30
# SIGINT while waiting: the call is cancelled and the command says so
n0=$(grep -c read "$T/silent")
"$BIN" generate --server "$SILENT" --prompt-ids "1" --connect-timeout 30 >/dev/null 2>"$T/ierr" &
GP=$!
# once the silent server read this client's preface, the client is inside its event loop
# (with its SIGINT handler: a background job of a script starts with SIGINT ignored)
for _ in $(seq 100); do [ "$(grep -c read "$T/silent")" -gt "$n0" ] && break; sleep 0.05; done
kill -INT $GP
wait $GP; rc=$?
[ $rc -eq 1 ] && grep -q 'interrupted' "$T/ierr" || bad "SIGINT: exit $rc, stderr: $(cat "$T/ierr")"

# usage errors
expect_fail 2 '--model applies to local generation only' "$BIN" generate --server "$SILENT" --model "$M" --prompt-ids "1"
expect_fail 2 '--threads applies to local generation only' "$BIN" generate --server "$SILENT" --threads 2 --prompt-ids "1"
expect_fail 2 'need --server' "$BIN" generate --model "$M" --prompt-ids "1" --timeout 5
expect_fail 2 'expected HOST:PORT' "$BIN" generate --server nocolon --prompt-ids "1"
expect_fail 2 'port' "$BIN" generate --server 127.0.0.1:70000 --prompt-ids "1"
expect_fail 2 'max-tokens 0' "$BIN" generate --server "$SILENT" --prompt-ids "1" --max-tokens 0
expect_fail 2 'prompt-ids' "$BIN" generate --server "$SILENT" --prompt-ids "1 x"
expect_fail 2 'exactly one of --prompt' "$BIN" generate --server "$SILENT"
expect_fail 2 'temperature' "$BIN" generate --server "$SILENT" --prompt-ids "1" --temperature -1

[ $fail -eq 0 ] && echo "PASS: generate --server equals generate --model (ids, sampling, text, stops); errors and flags"
exit $fail
