#!/bin/bash
# test_cluster_structured: structured output through the cluster (docs/openai.md, docs/grammar.md),
# SmolLM2 ($TANDEM_TEST_GGUF) behind `tandem local`, first 1 prefill + 1 decode, then one
# unified node. On the OpenAI API (curl):
# - response_format json_schema: the output parses and validates (tests/support/
#   json_schema_check.py, written apart from the compiler), finish_reason "stop", and greedy it
#   equals `tandem generate --json-schema` on the same conversation, whole and streamed (the
#   prefill node samples token 0 under the grammar, the decode node the rest);
# - vLLM's guided_regex and guided_choice, llama.cpp's json_schema: the outputs conform;
# - max_tokens still ends a constrained stream (finish_reason "length");
# - an unsupported schema keyword is a 400 naming the field and the keyword; two constraints
#   are a 400;
# - the gRPC gateway's GenerateRequest.grammar (a JSON Schema by prompt ids): the same ids as
#   `tandem generate --json-schema --prompt-ids`; an unsupported keyword INVALID_ARGUMENT;
#   `tandem generate --server` sends its --json-schema (the same ids again) and --choice.
source "$(dirname "$0")/cluster_lib.sh"
cl_init_gguf
VAL="$CL_SRC/tests/support/json_schema_check.py"
cat >"$CL_T/person.json" <<'JSON'
{"type":"object","properties":{
  "name":{"type":"string","minLength":1,"maxLength":12},
  "age":{"type":"integer","minimum":0,"maximum":120},
  "city":{"enum":["Paris","Tokyo","Lima"]}},
 "required":["name","age","city"],"additionalProperties":false}
JSON
Q="Describe a person as JSON."
MAXTOK=80
want=$("$CL_BIN" generate --model "$CL_M" --chat --prompt "$Q" --json-schema "$CL_T/person.json" \
    --max-tokens $MAXTOK --threads 1 2>"$CL_T/gen.err") || { cl_fail "tandem generate: $(tail -2 "$CL_T/gen.err")"; cl_end; }

# ask OA BODY_JSON: POSTs a chat completion; prints the content, then finish_reason on a line
# of its own (streamed when the body says so: the deltas joined); HTTP errors print the status
# and the error object
ask() {
    PYTHONPATH="$CL_SRC/tests/cluster" "$CL_PY" - "$1/chat/completions" "$2" <<'PY'
import json, sys
from cluster_wire import post_json
url, body = sys.argv[1], sys.argv[2]
raw = post_json(url, body)
if raw is None:
    sys.exit(0)
if json.loads(body).get("stream"):
    text, fin = "", None
    for ev in raw.split("\n\n"):
        if not ev.startswith("data: ") or ev == "data: [DONE]":
            continue
        c = json.loads(ev[6:])
        for ch in c["choices"]:
            text += ch["delta"].get("content") or ""
            fin = ch.get("finish_reason") or fin
else:
    c = json.loads(raw)["choices"][0]
    text, fin = c["message"]["content"], c["finish_reason"]
sys.stdout.write(text + "\n" + str(fin) + "\n")
PY
}
body() { # body EXTRA_JSON [STREAM]: a greedy chat body for $Q with EXTRA_JSON's members
    printf '{"messages":[{"role":"user","content":"%s"}],"temperature":0,"max_tokens":%d,"stream":%s,%s}' \
        "$Q" "${MAXTOK_REQ:-$MAXTOK}" "${2:-false}" "$1"
}
content() { sed '$d' "$1"; }
finish() { tail -1 "$1"; }

IDS="19161 253 986 1398 282 2355 42"
want_ids=$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$IDS" --json-schema "$CL_T/person.json" --print-ids \
    --max-tokens $MAXTOK --threads 1 2>/dev/null)
# grpc_gen KIND SOURCE: the ids a gateway Generate of $IDS under Grammar{KIND, SOURCE} gives,
# or the status code and details
grpc_gen() {
    "$CL_PY" - "$CL_GW" "$IDS" $MAXTOK "$1" "$2" <<'PY'
import sys, grpc
import os; sys.path.insert(0, os.environ["CL_SRC"] + "/tests/cluster")
from cluster_wire import channel, generate_stub, parse_ids, pb_bytes, pb_varint, request
gw, ids, maxtok, kind, src = sys.argv[1], [int(x) for x in sys.argv[2].split()], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
body = request(ids, maxtok) + pb_bytes(13, pb_varint(1, kind) + pb_bytes(2, src))
got = []
try:
    for m in generate_stub(channel(gw))(body, timeout=120):
        got += parse_ids(m)
    print(" ".join(map(str, got)))
except grpc.RpcError as e:
    print(e.code().name, e.details())
PY
}

checks() { # checks NAME: the whole set against the cluster now running
    local oa name=$1 schema
    oa=$(sed -n 's/^openai: //p' "$CL_T/local.out")
    [ -n "$oa" ] || { cl_fail "$name: no 'openai:' line in tandem local's output"; return; }
    schema=$(tr -d '\n' <"$CL_T/person.json")
    local rf="\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"person\",\"strict\":true,\"schema\":$schema}}"
    for mode in false true; do
        ask "$oa" "$(body "$rf" $mode)" >"$CL_T/r.out"
        content "$CL_T/r.out" >"$CL_T/r.txt"
        printf '%s' "$(cat "$CL_T/r.txt")" >"$CL_T/r.json"
        "$CL_PY" "$VAL" "$CL_T/person.json" "$CL_T/r.json" || cl_fail "$name: json_schema (stream $mode) does not validate"
        [ "$(finish "$CL_T/r.out")" = stop ] || cl_fail "$name: json_schema (stream $mode) finished '$(finish "$CL_T/r.out")'"
        echo "$name json_schema (stream $mode): $(cat "$CL_T/r.json")"
        [ "$(cat "$CL_T/r.json")" = "$want" ] ||
            cl_fail "$name: json_schema (stream $mode) '$(cat "$CL_T/r.json")' differs from tandem generate's '$want'"
    done
    # llama.cpp's field, same schema: the same output
    ask "$oa" "$(body "\"json_schema\":$schema")" >"$CL_T/r.out"
    [ "$(content "$CL_T/r.out")" = "$want" ] || cl_fail "$name: llama.cpp json_schema gave '$(content "$CL_T/r.out")'"
    # a regex and a choice, at temperature 1 (seeded), conform
    for seed in 1 2; do
        ask "$oa" "$(body "\"guided_regex\":\"[A-Z][a-z]{2,8} is [0-9]{1,2}\",\"temperature\":1,\"seed\":$seed")" >"$CL_T/r.out"
        "$CL_PY" -c 'import re,sys; t=open(sys.argv[1]).read().rsplit("\n",2)[0]; assert re.fullmatch(r"[A-Z][a-z]{2,8} is [0-9]{1,2}", t), t' \
            "$CL_T/r.out" || cl_fail "$name: guided_regex seed $seed: '$(cat "$CL_T/r.out")'"
        ask "$oa" "$(body "\"guided_choice\":[\"red\",\"green\",\"blue\"],\"temperature\":1,\"seed\":$seed")" >"$CL_T/r.out"
        case "$(content "$CL_T/r.out")" in red | green | blue) ;; *) cl_fail "$name: guided_choice gave '$(cat "$CL_T/r.out")'" ;; esac
    done
    # max_tokens still ends a constrained output
    MAXTOK_REQ=3 ask "$oa" "$(MAXTOK_REQ=3 body "\"response_format\":{\"type\":\"json_object\"}")" >"$CL_T/r.out"
    [ "$(finish "$CL_T/r.out")" = length ] || cl_fail "$name: max_tokens 3 under json_object finished '$(finish "$CL_T/r.out")'"
    # refusals
    ask "$oa" "$(body '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"integer","multipleOf":3}}}')" >"$CL_T/r.out"
    grep -q '^HTTP 400 .*"param":"response_format.json_schema.schema"' "$CL_T/r.out" && grep -q 'multipleOf' "$CL_T/r.out" ||
        cl_fail "$name: multipleOf: $(cat "$CL_T/r.out")"
    ask "$oa" "$(body '"guided_regex":"a","guided_choice":["a"]')" >"$CL_T/r.out"
    grep -q '^HTTP 400 .*conflicting_parameters' "$CL_T/r.out" || cl_fail "$name: two constraints: $(cat "$CL_T/r.out")"
    # the gRPC gateway (Grammar.Kind 4: KIND_JSON_SCHEMA)
    local got
    got=$(CL_SRC="$CL_SRC" grpc_gen 4 "$(cat "$CL_T/person.json")")
    [ -n "$want_ids" ] && [ "$got" = "$want_ids" ] || cl_fail "$name: gateway json schema: want '$want_ids' got '$got'"
    got=$(CL_SRC="$CL_SRC" grpc_gen 4 '{"type":"integer","multipleOf":3}')
    case "$got" in "INVALID_ARGUMENT grammar: "*multipleOf*) ;; *) cl_fail "$name: gateway multipleOf: '$got'" ;; esac
    # tandem generate --server: its grammar flag travels in GenerateRequest.grammar
    got=$("$CL_BIN" generate --server "$CL_GW" --prompt-ids "$IDS" --json-schema "$CL_T/person.json" --print-ids \
        --max-tokens $MAXTOK 2>"$CL_T/gs.err")
    [ -n "$want_ids" ] && [ "$(echo $got)" = "$(echo $want_ids)" ] ||
        cl_fail "$name: generate --server --json-schema: want '$want_ids' got '$got' ($(tail -1 "$CL_T/gs.err"))"
    got=$("$CL_BIN" generate --server "$CL_GW" --prompt "My favourite colour is" --choice red,green,blue \
        --temperature 1 --seed 3 --max-tokens 8 2>"$CL_T/gs.err")
    case "$(echo $got)" in red | green | blue) ;; *) cl_fail "$name: generate --server --choice gave '$got' ($(tail -1 "$CL_T/gs.err"))" ;; esac
}

echo "== 1 prefill + 1 decode"
cl_local 1 1 --threads 1 --kv-mem 128
checks "1P+1D"
cl_stop
echo "== unified"
cl_local 0 0 --unified 1 --threads 1 --kv-mem 128
checks "unified"
cl_end "structured output through prefill/decode and a unified node: json_schema equals tandem generate, regex, choice, length, refusals"
