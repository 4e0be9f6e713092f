#!/bin/bash
# test_cluster_choices: OpenAI's n and logit_bias through the cluster (docs/openai.md "Several
# choices (n)", "Logit bias"), SmolLM2 ($TANDEM_TEST_GGUF) behind `tandem local` 1 prefill + 1
# decode, on /v1/completions:
# - n=3 greedy: three choices, indexes 0..2, each equal to `tandem generate`'s text; usage
#   counts every choice's tokens; the prefill node computed the prompt once (its computed
#   tokens stay below twice the prompt, the rest came from its prefix cache);
# - n=3 seeded at temperature 1: the same three choices on a second run, not all alike;
# - streamed n=3: every index's chunks join to the greedy text, each has its finish_reason,
#   and the usage chunk counts all three;
# - logit_bias +100 on one token forces it, -100 on the greedy first token changes the output,
#   both equal to `tandem generate --logit-bias`; an id past the vocabulary and n=17 are 400s;
# - a client leaving a streamed n=3 mid-stream ends all three (nothing left on the nodes);
# - n=3 under guided_choice at temperature 1: every choice conforms;
# - the gRPC gateway's SamplingParams.logit_bias_ids / logit_bias force a token as `tandem
#   generate --logit-bias` does; lists of two lengths, an id past the vocabulary: INVALID_ARGUMENT;
# - the gRPC gateway's n: a streamed seeded n=3 gives the HTTP door's three choices (by
#   choice_index), each with its finish_reason, the usage on the last message; n=17 refused.
source "$(dirname "$0")/cluster_lib.sh"
cl_init_gguf
P="The history of the city of Paris begins with a small settlement of Celtic fishermen on an island in the river Seine, where the Romans later built a town they called Lutetia, and"
MAXTOK=10
want=$("$CL_BIN" generate --model "$CL_M" --prompt "$P" --max-tokens $MAXTOK --threads 1 2>"$CL_T/gen.err") ||
    { cl_fail "tandem generate: $(tail -2 "$CL_T/gen.err")"; cl_end; }
want_ids=$("$CL_BIN" generate --model "$CL_M" --prompt "$P" --max-tokens $MAXTOK --threads 1 --print-ids 2>/dev/null)
G=${want_ids%% *} # the greedy first token
X=1234            # a token biased to be forced
forced=$("$CL_BIN" generate --model "$CL_M" --prompt "$P" --max-tokens 4 --threads 1 --logit-bias $X=100 --print-ids 2>/dev/null)
[ "$forced" = "$X $X $X $X" ] || cl_fail "tandem generate --logit-bias $X=100 gave ids '$forced'"
forced_text=$("$CL_BIN" generate --model "$CL_M" --prompt "$P" --max-tokens 4 --threads 1 --logit-bias $X=100 2>/dev/null)
banned=$("$CL_BIN" generate --model "$CL_M" --prompt "$P" --max-tokens $MAXTOK --threads 1 --logit-bias "$G=-100" 2>/dev/null)
[ "$banned" != "$want" ] || cl_fail "tandem generate --logit-bias $G=-100 did not change '$want'"

cl_local 1 1 --threads 1 --kv-mem 128
OA=$(sed -n 's/^openai: //p' "$CL_T/local.out")
PF=$(for k in "${!CL_ROLE[@]}"; do [ "${CL_ROLE[$k]}" = prefill ] && echo "$k"; done)

# ask BODY_JSON: POSTs a completion; prints a JSON summary: {"texts": [by index], "finish":
# [by index], "usage": ..., "indexes": [as they came]} (streamed when the body says so), or
# "HTTP status body"
ask() {
    PYTHONPATH="$CL_SRC/tests/cluster" "$CL_PY" - "$OA/completions" "$1" <<'PY'
import json, sys
from cluster_wire import post_json
url, body = sys.argv[1], sys.argv[2]
raw = post_json(url, body)
if raw is None:
    sys.exit(0)
texts, fin, idx, usage = {}, {}, [], None
if json.loads(body).get("stream"):
    for ev in raw.split("\n\n"):
        if not ev.startswith("data: ") or ev == "data: [DONE]":
            continue
        c = json.loads(ev[6:])
        usage = c.get("usage") or usage
        for ch in c["choices"]:
            i = ch["index"]
            idx.append(i)
            texts[i] = texts.get(i, "") + ch["text"]
            if ch.get("finish_reason"):
                fin[i] = ch["finish_reason"]
else:
    c = json.loads(raw)
    usage = c["usage"]
    for ch in c["choices"]:
        idx.append(ch["index"])
        texts[ch["index"]], fin[ch["index"]] = ch["text"], ch["finish_reason"]
n = max(texts) + 1 if texts else 0
print(json.dumps({"texts": [texts.get(i) for i in range(n)], "finish": [fin.get(i) for i in range(n)],
                  "usage": usage, "indexes": idx}))
PY
}
body() { # body EXTRA_JSON: a completion body for $P with EXTRA_JSON's members
    "$CL_PY" -c 'import json,sys; b={"prompt":sys.argv[1],"max_tokens":int(sys.argv[2]),"temperature":0}; b.update(json.loads("{"+sys.argv[3]+"}")); print(json.dumps(b))' \
        "$P" "${MAXTOK_REQ:-$MAXTOK}" "$1"
}
# jq-less reads of ask's summary: field EXPR (a Python expression over d)
field() { "$CL_PY" -c 'import json,sys; d=json.loads(sys.argv[1]); print(eval(sys.argv[2]))' "$1" "$2"; }

tok0=$(cl_metric "$PF" tandem_prefill_tokens_total)
cached0=$(cl_metric "$PF" tandem_prefill_cached_tokens_total)
r=$(ask "$(body '"n":3')")
echo "n=3 greedy: $r"
[ "$(field "$r" 'd["indexes"]')" = "[0, 1, 2]" ] || cl_fail "n=3: indexes $(field "$r" 'd["indexes"]')"
for i in 0 1 2; do
    [ "$(field "$r" "d['texts'][$i]")" = "$want" ] || cl_fail "n=3 greedy: choice $i '$(field "$r" "d['texts'][$i]")' differs from tandem generate's '$want'"
done
np=$(field "$r" 'd["usage"]["prompt_tokens"]')
[ "$(field "$r" 'd["usage"]["completion_tokens"]')" = $((3 * MAXTOK)) ] || cl_fail "n=3: usage $(field "$r" 'd["usage"]')"
tok=$(($(cl_metric "$PF" tandem_prefill_tokens_total) - tok0))
cached=$(($(cl_metric "$PF" tandem_prefill_cached_tokens_total) - cached0))
echo "prompt $np tokens; the prefill node computed $tok and took $cached from its prefix cache for 3 choices"
[ "$tok" -lt $((2 * np)) ] && [ "$cached" -ge 32 ] ||
    cl_fail "n=3: the prefill node computed $tok tokens ($cached cached) for a $np-token prompt: not once"

s1=$(ask "$(body '"n":3,"temperature":1,"seed":42')")
s2=$(ask "$(body '"n":3,"temperature":1,"seed":42')")
echo "n=3 seeded: $s1"
[ "$(field "$s1" 'd["texts"]')" = "$(field "$s2" 'd["texts"]')" ] || cl_fail "n=3 seed 42 is not reproducible: $s1 / $s2"
[ "$(field "$s1" 'len(set(d["texts"]))')" -gt 1 ] || cl_fail "n=3 seed 42 at temperature 1: three equal choices"

r=$(ask "$(body '"n":3,"stream":true,"stream_options":{"include_usage":true}')")
for i in 0 1 2; do
    [ "$(field "$r" "d['texts'][$i]")" = "$want" ] || cl_fail "n=3 streamed: choice $i '$(field "$r" "d['texts'][$i]")'"
    [ "$(field "$r" "d['finish'][$i]")" = length ] || cl_fail "n=3 streamed: choice $i finish '$(field "$r" "d['finish'][$i]")'"
done
[ "$(field "$r" 'd["usage"]["completion_tokens"]')" = $((3 * MAXTOK)) ] || cl_fail "n=3 streamed: usage $(field "$r" 'd["usage"]')"

# a client that goes mid-stream, once every choice streams: all three end (cl_stop's idle
# check: no request, sequence or lease left)
"$CL_PY" - "$OA/completions" "$(MAXTOK_REQ=200 body '"n":3,"stream":true,"ignore_eos":true')" <<'PY' || cl_fail "n=3 disconnect: the choices did not all stream"
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1], sys.argv[2].encode(), {"Content-Type": "application/json"})
seen, buf = set(), b""
with urllib.request.urlopen(req, timeout=120) as r:
    while len(seen) < 3:
        line = r.readline()
        if not line:
            sys.exit(1)
        if line.startswith(b"data: {"):
            seen.update(c["index"] for c in json.loads(line[6:])["choices"])
print("n=3 stream: chunks of choices %s seen, then the client left" % sorted(seen))
PY
v=$("$CL_PY" "$CL_TOOL" waitmetric "${CL_MURL[router]}" tandem_router_active_requests == 0 10) ||
    cl_fail "n=3 disconnect: the router still has requests: $v"

r=$(MAXTOK_REQ=4 body "\"logit_bias\":{\"$X\":100}")
r=$(ask "$r")
[ "$(field "$r" 'd["texts"][0]')" = "$forced_text" ] || cl_fail "logit_bias +100: '$(field "$r" 'd["texts"][0]')', tandem generate '$forced_text'"
r=$(ask "$(body "\"logit_bias\":[[$G,-100]]")")
[ "$(field "$r" 'd["texts"][0]')" = "$banned" ] || cl_fail "logit_bias -100 on $G: '$(field "$r" 'd["texts"][0]')', tandem generate '$banned'"

# each choice under the constraint
r=$(ask "$(body '"n":3,"temperature":1,"seed":7,"guided_choice":["red","green","blue"]')")
"$CL_PY" -c 'import json,sys; d=json.loads(sys.argv[1]); assert len(d["texts"]) == 3 and all(t in ("red","green","blue") for t in d["texts"]), d' "$r" ||
    cl_fail "n=3 guided_choice: $r"

# the gRPC gateway: SamplingParams.logit_bias_ids / logit_bias (fields 9, 10 of field 4)
grpc_bias() { # grpc_bias IDS_OF_BIAS BIASES: the ids of a 4-token Generate of $IDS, or the status
    CL_SRC="$CL_SRC" "$CL_PY" - "$CL_GW" "$IDS" "$1" "$2" <<'PY'
import os, struct, sys, grpc
sys.path.insert(0, os.environ["CL_SRC"] + "/tests/cluster")
from cluster_wire import channel, generate_stub, parse_ids, pb_bytes, pb_packed, request
gw, ids, bids, bvals = sys.argv[1], [int(x) for x in sys.argv[2].split()], [int(x) for x in sys.argv[3].split()], [float(x) for x in sys.argv[4].split()]
sampling = pb_packed(9, bids) + pb_bytes(10, b"".join(struct.pack("<f", v) for v in bvals))
got = []
try:
    for m in generate_stub(channel(gw))(request(ids, 4) + pb_bytes(4, sampling), timeout=120):
        got += parse_ids(m)
    print(" ".join(map(str, got)))
except grpc.RpcError as e:
    print(e.code().name, e.details())
PY
}
IDS="19161 253 986 1398 282 2355 42"
want_g=$("$CL_BIN" generate --model "$CL_M" --prompt-ids "$IDS" --max-tokens 4 --threads 1 --logit-bias 777=100 --print-ids 2>/dev/null)
[ "$want_g" = "777 777 777 777" ] || cl_fail "tandem generate --prompt-ids --logit-bias 777=100: '$want_g'"
got=$(grpc_bias 777 100)
[ "$got" = "$want_g" ] || cl_fail "gateway logit_bias 777=+100: '$got', want '$want_g'"
got=$(grpc_bias "5 6" 1)
case "$got" in "INVALID_ARGUMENT "*"differ in length"*) ;; *) cl_fail "gateway logit_bias of two lengths: '$got'" ;; esac
got=$(grpc_bias 60000 1)
case "$got" in "INVALID_ARGUMENT "*"logit_bias token 60000 is outside the vocabulary"*) ;; *) cl_fail "gateway logit_bias 60000: '$got'" ;; esac

# the gRPC gateway's n (GenerateRequest.n 18, GenerateResponse.choice_index 10): a streamed
# seeded n=3 of the same prompt gives the HTTP door's three choices, each choice's last message
# its finish_reason, the call's last the usage of all (the prompt once); n=17 is refused
grpc_n() { # grpc_n N: {"texts": [by choice], "finish": [...], "usage": [prompt, completion], "order": [...]}
    CL_SRC="$CL_SRC" "$CL_PY" - "$CL_GW" "$P" "$MAXTOK" "$1" <<'PY'
import json, os, struct, sys, grpc
sys.path.insert(0, os.environ["CL_SRC"] + "/tests/cluster")
from cluster_wire import channel, fields, generate_stub, pb_bytes, pb_varint, varint
gw, prompt, maxtok, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sampling = varint(1 << 3 | 5) + struct.pack("<f", 1.0) + pb_varint(6, 42)
req = pb_bytes(1, prompt) + pb_varint(3, maxtok) + pb_bytes(4, sampling) + pb_varint(18, n)
texts, fin, order, usage, last = {}, {}, [], None, None
try:
    for m in generate_stub(channel(gw))(req, timeout=120):
        f = list(fields(m))
        i = next((v for k, v in f if k == 10), 0)
        order.append(i)
        if i in fin:
            print("choice %d: a message after its finish_reason" % i)
            sys.exit(0)
        texts[i] = texts.get(i, b"") + b"".join(v for k, v in f if k == 2)
        if any(k == 3 for k, v in f):
            fin[i] = next(v for k, v in f if k == 3)
        u = next((v for k, v in f if k == 4), None)
        last = u
        if u is not None:
            usage = dict(fields(u))
except grpc.RpcError as e:
    print(e.code().name, e.details())
    sys.exit(0)
print(json.dumps({"texts": [texts[i].decode() for i in sorted(texts)], "finish": [fin.get(i) for i in sorted(texts)],
                  "usage": [usage.get(1), usage.get(2)] if usage else None, "usage_last": last is not None,
                  "order": order}))
PY
}
r=$(grpc_n 3)
echo "gateway n=3 seeded: $r"
[ "$(field "$r" 'd["texts"]')" = "$(field "$s1" 'd["texts"]')" ] ||
    cl_fail "gateway n=3 seed 42: choices $(field "$r" 'd["texts"]') differ from the HTTP door's $(field "$s1" 'd["texts"]')"
[ "$(field "$r" '[{1: "length", 2: "stop", 3: "stop"}.get(x) for x in d["finish"]]')" = "$(field "$s1" 'd["finish"]')" ] ||
    cl_fail "gateway n=3: finish reasons $(field "$r" 'd["finish"]'), the HTTP door's $(field "$s1" 'd["finish"]')"
[ "$(field "$r" 'd["usage"]')" = "[$np, $((3 * MAXTOK))]" ] && [ "$(field "$r" 'd["usage_last"]')" = True ] ||
    cl_fail "gateway n=3: usage $(field "$r" 'd["usage"]') (want [$np, $((3 * MAXTOK))] on the last message)"
got=$(grpc_n 17)
case "$got" in "INVALID_ARGUMENT n 17 is out of range"*) ;; *) cl_fail "gateway n=17: '$got'" ;; esac

r=$(ask "$(body '"logit_bias":{"49152":5}')")
case "$r" in "HTTP 400 "*"logit_bias token 49152 is outside the vocabulary"*) ;; *) cl_fail "logit_bias past the vocabulary: $r" ;; esac
r=$(ask "$(body '"n":17')")
case "$r" in "HTTP 400 "*'"param":"n"'*) ;; *) cl_fail "n=17: $r" ;; esac
cl_end "n and logit_bias through 1P+1D: n=3 greedy equals tandem generate with the prompt computed once, seeded n=3 reproducible, streamed indexes, logit_bias forces and bans"
