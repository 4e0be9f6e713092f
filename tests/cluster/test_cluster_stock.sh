#!/bin/bash
# test_cluster_stock: a stock gRPC client (Debian's python3-grpcio, messages from the
# .proto via protoc) streams a generation from the router of a real `tandem local` cluster
# (1 prefill + 1 decode): a text prompt, greedy; its ids equal `tandem generate --model`'s
# ids, its concatenated text equals `tandem generate`'s text, and the last message carries
# finish_reason, usage and timings (tests/cluster/cluster_stock_client.py checks the stream's
# shape). The model is synthetic (random weights, a 258-token byte-level vocabulary, so
# every id has text), written here by `tandem model synth`: no shared data needed.
# Skips without python3-grpcio/python3-protobuf or protoc.
set -u
BIN="${TANDEM_BIN:?TANDEM_BIN must point at the tandem binary}"
SRC="${TD_SOURCE_DIR:-$(dirname "$0")/../..}"
if ! /usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null; then
    echo "SKIP: /usr/bin/python3 lacks grpc/protobuf (python3-grpcio python3-protobuf)"; exit 77
fi
if ! command -v protoc >/dev/null; then echo "SKIP: protoc not found (protobuf-compiler)"; exit 77; fi
T=$(mktemp -d)
LPID=
cleanup() {
    [ -n "$LPID" ] && { kill -TERM "$LPID" 2>/dev/null; wait "$LPID" 2>/dev/null; }
    rm -rf "$T"
}
trap cleanup EXIT
cat >"$T/cfg.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
 "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 8,
 "num_key_value_heads": 4, "vocab_size": 258, "max_position_embeddings": 512,
 "rms_norm_eps": 1e-05, "rope_theta": 10000, "tie_word_embeddings": false,
 "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "bfloat16"}
EOF
M="$T/m258"
"$BIN" model synth --config "$T/cfg.json" --seed 5 --out "$M" >/dev/null 2>&1 || { echo "FAIL: model synth"; exit 1; }
"$BIN" local --model "$M" --prefill 1 --decode 1 >"$T/out" 2>"$T/err" &
LPID=$!
for _ in $(seq 150); do grep -q '^metrics: ' "$T/out" && break; sleep 0.1; done
G=$(sed -n 's/^gateway: //p' "$T/out")
[ -n "$G" ] || { echo "FAIL: cluster did not start within 15 s"; cat "$T/err"; exit 1; }

fail=0
PROMPT="Once upon a time, in a land far away"
got=$(/usr/bin/python3 "$SRC/tests/cluster/cluster_stock_client.py" "$SRC/proto" "$G" "$PROMPT" 40 "$T/text.got" 2>"$T/perr")
prc=$?
if [ $prc -eq 77 ]; then echo "$got"; exit 77; fi
[ $prc -eq 0 ] || { echo "FAIL: stock client exited $prc: $(cat "$T/perr")"; exit 1; }
want=$("$BIN" generate --model "$M" --prompt "$PROMPT" --max-tokens 40 --print-ids --threads 1 2>/dev/null)
"$BIN" generate --model "$M" --prompt "$PROMPT" --max-tokens 40 --threads 1 >"$T/text.want" 2>/dev/null
[ -n "$want" ] || { echo "FAIL: local generate printed no ids"; fail=1; }
[ "$want" == "$got" ] || { echo "FAIL: ids: local '$want', stock client '$got'"; fail=1; }
[ -s "$T/text.got" ] || { echo "FAIL: the stream carried no text"; fail=1; }
cmp -s "$T/text.want" "$T/text.got" ||
    { echo "FAIL: text: local '$(cat "$T/text.want")', stock client '$(cat "$T/text.got")'"; fail=1; }

kill -TERM "$LPID"; wait "$LPID"; rc=$?
LPID=
[ $rc -eq 0 ] || { echo "FAIL: tandem local exited $rc on SIGTERM"; fail=1; }
[ $fail -eq 0 ] && echo "PASS: a stock grpcio client (protoc messages) streamed a text generation equal to local generate ($(cat "$T/perr"))"
exit $fail
