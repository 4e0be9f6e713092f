#!/usr/bin/env bash
# bench/grammar_vs.sh: what structured output costs in tandem, beside xgrammar's masks and
# llama-server's constrained decoding, on the same grammars, vocabularies and GGUF
# (docs/grammar.md "How fast" shows its figures; the peers are references, never
# dependencies). Steps, each one command so that a caller can hold a benchmark lock per step:
#   bench/grammar_vs.sh tandem MODEL NAME  tandem bench grammar --model MODEL --dump OUT/NAME:
#                                          mask time, compile, end-to-end tokens/s at batch 1
#                                          and 32 with and without each grammar
#   bench/grammar_vs.sh xgrammar NAME      xgrammar's compile and mask time on OUT/NAME's dump
#   bench/grammar_vs.sh llama GGUF NAME    llama-server on GGUF with OUT/NAME/schema-*.json
#   bench/grammar_vs.sh synth DIR          a random-weight model with Qwen3's 151,936-token
#                                          vocabulary (tandem model synth), SmolLM2's size class
#   bench/grammar_vs.sh report             the tables, from OUT's JSON
# Environment: OUT (default $TMPDIR/tandem-grammar-vs), TANDEM_BIN (build/tandem), THREADS (2),
# XGR_PY (a python with xgrammar: /work/venv-xg/bin/python), LLAMA_SERVER
# (/work/peers/lc-native/bin/llama-server), QWEN_TOKENIZER (../shared/models/tokenizers/qwen3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-${TMPDIR:-/tmp}/tandem-grammar-vs}
BIN=${TANDEM_BIN:-$here/../build/tandem}
THREADS=${THREADS:-2}
XGR_PY=${XGR_PY:-/work/venv-xg/bin/python}
LLAMA_SERVER=${LLAMA_SERVER:-/work/peers/lc-native/bin/llama-server}
QWEN_TOKENIZER=${QWEN_TOKENIZER:-$here/../../shared/models/tokenizers/qwen3}
mkdir -p "$OUT"
case "${1:-}" in
tandem)
    mkdir -p "$OUT/$3"
    "$BIN" bench grammar --model "$2" --threads "$THREADS" --dump "$OUT/$3" --reps "${REPS:-3}" --json >"$OUT/$3/tandem.json"
    ;;
xgrammar)
    "$XGR_PY" "$here/grammar_xgr.py" "$OUT/$2" --tokens 2000 >"$OUT/$2/xgrammar.jsonl"
    ;;
llama)
    : >"$OUT/$3/llama-server.jsonl"
    for s in "$OUT/$3"/schema-*.json; do
        name=$(basename "$s" .json)
        python3 "$here/grammar_llama_server.py" --server "$LLAMA_SERVER" --model "$2" --schema "$s" \
            --threads "$THREADS" --reps "${REPS:-3}" | sed "s/^{/{\"name\": \"$name\", /" >>"$OUT/$3/llama-server.jsonl"
    done
    ;;
synth)
    cat >"$OUT/qwen3-vocab-config.json" <<'JSON'
{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":384,"intermediate_size":1024,
 "num_hidden_layers":6,"num_attention_heads":6,"num_key_value_heads":2,"head_dim":64,"vocab_size":151936,
 "max_position_embeddings":4096,"rms_norm_eps":1e-06,"rope_theta":1000000,"tie_word_embeddings":true,
 "hidden_act":"silu","attention_bias":false,"bos_token_id":151643,"eos_token_id":151645,"torch_dtype":"bfloat16"}
JSON
    "$BIN" model synth --out "$2" --config "$OUT/qwen3-vocab-config.json" --arch qwen3 --tokenizer "$QWEN_TOKENIZER"
    ;;
report)
    python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for d in sorted(glob.glob(os.path.join(out, "*/tandem.json"))):
    name = os.path.basename(os.path.dirname(d))
    t = json.load(open(d))
    xp = os.path.join(os.path.dirname(d), "xgrammar.jsonl")
    xg = {j["name"]: j for j in map(json.loads, open(xp))} if os.path.exists(xp) else {}
    print("## %s: vocabulary %d, %s, %d threads, temperature %g" % (name, t["vocab"], t.get("model", ""), t.get("threads", 0), t.get("temperature", 0)))
    print("| grammar | tandem compile ms | xgrammar compile ms | tandem cold µs/token | tandem warm µs/token | xgrammar cold µs/token | xgrammar warm µs/token |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for g in t["grammars"]:
        x = xg.get(g["name"], {})
        print("| %s | %.2f | %s | %.1f | %.1f | %s | %s |" % (g["name"], g["compile_ms"], x.get("compile_ms", "-"),
              g["cold_us_per_token"], g["warm_us_per_token"], x.get("cold_us_per_token", "-"), x.get("warm_us_per_token", "-")))
    print()
    print("| grammar | batch | unconstrained tok/s | fresh schema tok/s (x) | repeated schema tok/s (x) | mask µs/token fresh, repeated |")
    print("| --- | --- | --- | --- | --- | --- |")
    for g in t["grammars"]:
        for e in g.get("e2e", []):
            print("| %s | %d | %.1f | %.1f (%.3f) | %.1f (%.3f) | %.1f, %.1f |" % (g["name"], e["batch"], e["free_tps"], e["cold_tps"],
                  e["cold_ratio"], e["warm_tps"], e["warm_ratio"], e["cold_mask_us_per_token"], e["warm_mask_us_per_token"]))
    lp = os.path.join(os.path.dirname(d), "llama-server.jsonl")
    if os.path.exists(lp):
        print()
        print("| llama-server | batch | unconstrained tok/s | json_schema tok/s (x) |")
        print("| --- | --- | --- | --- |")
        for l in map(json.loads, open(lp)):
            print("| %s | %d | %.1f | %.1f (%.3f) |" % (l["name"], l["batch"], l["free_tps"], l["schema_tps"], l["ratio"]))
    print()
PY
    ;;
*)
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
