#!/bin/bash
# test_cluster_tools: tool calling on the OpenAI API through the cluster (docs/openai.md
# "Tools"). A random-weight Qwen3-shaped model with Qwen3's real tokenizer and chat template
# (`tandem model synth`; the template's <tool_call> is the hermes format) behind `tandem
# local` 1 prefill + 1 decode:
# - tool_choice "required" and a named function, at temperature 1 over several seeds,
#   streamed and not: always tool_calls (finish_reason "tool_calls"), each with an id, type
#   "function", the tool's name, and arguments that parse and validate against the tool's
#   parameters schema (tests/support/json_schema_check.py, written apart from the compiler);
#   streamed, the deltas carry the name first, then the arguments in pieces as they are
#   written (joined, the same calls), and no content;
# - tool_choice "none": never tool_calls;
# - n = 3 with tool_choice "required", streamed and not: every choice's calls validate, the
#   call ids are distinct over the request, and the seeded streamed answer equals the whole one;
# - a parameters schema with an unsupported keyword (multipleOf) is a 400 naming the tool's
#   parameters and the keyword; a named function that is not a tool is a 400;
# - the gRPC gateway: tools_json with tool_choice "required" (single_tool_call) and a name,
#   over a conversation with an earlier call and its result: one call in tool_calls whose
#   arguments validate, no content, FINISH_REASON_TOOL_CALLS; tools_json that is not JSON, a
#   multipleOf schema and an unknown tool_choice are INVALID_ARGUMENT;
# - OpenAI's older form: `functions` with function_call {"name"} over a conversation with an
#   earlier function_call and its function result, streamed and not: message.function_call
#   {name, arguments} that validates, content null, finish_reason "function_call", no
#   tool_calls; streamed, delta.function_call with the name first, then the arguments in
#   pieces, equal to the whole answer for the same seed; functions beside tools is a 400;
# - the gRPC gateway's n = 3 with tool_choice "required": each choice_index's call equals the
#   HTTP door's n = 3 choice for the same seed, the ids distinct;
# - with the `openai` package (scripts/openai-venv), the official client reads the calls (and
#   a function_call).
source "$(dirname "$0")/cluster_lib.sh"
cl_init
QWEN="$(dirname "$CL_M")/../tokenizers/qwen3"
[ -f "$QWEN/tokenizer.json" ] || { echo "SKIP: $QWEN/tokenizer.json absent"; exit 77; }
CL_M="$CL_T/qwen3-tiny"
cat >"$CL_T/config.json" <<'EOF'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 151936, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": true,
 "bos_token_id": 151643, "eos_token_id": 151645}
EOF
"$CL_BIN" model synth --config "$CL_T/config.json" --tokenizer "$QWEN" --seed 3 --out "$CL_M" >/dev/null ||
    { cl_fail "tandem model synth failed"; cl_end; }
cl_local 1 1 --threads 1
OA=$(sed -n 's/^openai: //p' "$CL_T/local.out")
[ -n "$OA" ] || { cl_fail "no openai line"; cl_end; }

"$CL_PY" - "$OA" "$CL_SRC/tests/support/json_schema_check.py" "$CL_T" "$CL_GW" "$CL_SRC" <<'PY' || CL_FAIL=1
import json, subprocess, sys, urllib.request, urllib.error
oa, check, tmp, gw = sys.argv[1:5]
sys.path.insert(0, sys.argv[5] + "/tests/cluster")
import grpc
from cluster_wire import channel, fields, generate_stub, pb_bytes, pb_f32, pb_varint
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "unit"], "additionalProperties": False}
VOLUME = {"type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 10},
                                           "mute": {"type": "boolean"}},
          "required": ["level"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_volume", "description": "Set the volume",
                                           "parameters": VOLUME}}]
SCHEMA = {"get_weather": WEATHER, "set_volume": VOLUME}
fails = []
pieces = [0]  # non-empty streamed argument deltas seen

def post(body):
    req = urllib.request.Request(oa + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

def ask(extra, stream):
    """(content, tool_calls, finish_reason) as a client assembles them."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
            "temperature": 1, "max_tokens": 160, "stream": stream}
    body.update(extra)
    status, raw = post(body)
    if status != 200:
        raise RuntimeError("HTTP %d %s" % (status, raw))
    if not stream:
        c = json.loads(raw)["choices"][0]
        return c["message"].get("content"), c["message"].get("tool_calls"), c["finish_reason"]
    content, calls, fin, names_first = "", {}, None, True
    for ev in raw.split("\n\n"):
        if not ev.startswith("data: ") or ev == "data: [DONE]":
            continue
        for ch in json.loads(ev[6:])["choices"]:
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                k = tc["index"]
                if k not in calls:  # a call's first delta: id, type, name
                    if not (tc.get("id") and tc.get("type") == "function" and tc["function"].get("name")):
                        names_first = False
                    calls[k] = {"id": tc.get("id"), "type": tc.get("type"),
                                "function": {"name": tc["function"].get("name"), "arguments": ""}}
                calls[k]["function"]["arguments"] += tc["function"].get("arguments") or ""
                pieces[0] += bool(tc["function"].get("arguments"))
            fin = ch.get("finish_reason") or fin
    if not names_first:
        fails.append("a streamed call's first delta lacks id, type or name")
    return content, [calls[k] for k in sorted(calls)] or None, fin

def ask_n(extra, stream, n):
    """[(content, tool_calls, finish_reason)] of each of n choices, as a client assembles them."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
            "temperature": 1, "max_tokens": 160, "stream": stream, "n": n}
    body.update(extra)
    status, raw = post(body)
    if status != 200:
        raise RuntimeError("HTTP %d %s" % (status, raw))
    if not stream:
        cs = sorted(json.loads(raw)["choices"], key=lambda c: c["index"])
        return [(c["message"].get("content"), c["message"].get("tool_calls"), c["finish_reason"]) for c in cs]
    out = [["", {}, None] for _ in range(n)]
    for ev in raw.split("\n\n"):
        if not ev.startswith("data: ") or ev == "data: [DONE]":
            continue
        for ch in json.loads(ev[6:])["choices"]:
            o = out[ch["index"]]
            o[0] += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or []:
                c = o[1].setdefault(tc["index"], {"id": tc.get("id"), "type": tc.get("type"),
                                                  "function": {"name": tc["function"].get("name"), "arguments": ""}})
                c["function"]["arguments"] += tc["function"].get("arguments") or ""
            o[2] = ch.get("finish_reason") or o[2]
    return [(o[0], [o[1][k] for k in sorted(o[1])] or None, o[2]) for o in out]

def check_calls(what, content, calls, fin, want_name=None):
    if fin != "tool_calls" or not calls:
        fails.append("%s: finish %s, calls %r, content %r" % (what, fin, calls, content))
        return
    if content:
        fails.append("%s: content %r beside the calls" % (what, content))
    for c in calls:
        name = c["function"]["name"]
        if not c["id"] or c["type"] != "function" or name not in SCHEMA or (want_name and name != want_name):
            fails.append("%s: bad call %r" % (what, c))
            continue
        open(tmp + "/schema.json", "w").write(json.dumps(SCHEMA[name]))
        open(tmp + "/args.txt", "w").write(c["function"]["arguments"])
        r = subprocess.run([sys.executable, check, tmp + "/schema.json", tmp + "/args.txt"],
                           capture_output=True, text=True)
        if r.returncode:
            fails.append("%s: arguments do not validate: %s" % (what, r.stdout.strip()))

n_calls = 0
for seed in range(4):
    for stream in (False, True):
        what = "required seed %d stream %s" % (seed, stream)
        out = ask({"tool_choice": "required", "parallel_tool_calls": False, "seed": seed}, stream)
        check_calls(what, *out)
        n_calls += len(out[1] or [])
        named = {"tool_choice": {"type": "function", "function": {"name": "set_volume"}}, "seed": 100 + seed}
        check_calls("named " + what, *ask(named, stream), want_name="set_volume")
        content, calls, fin = ask({"tool_choice": "none", "seed": seed, "max_tokens": 24}, stream)
        if calls or fin == "tool_calls" or not isinstance(content, str):
            fails.append("none seed %d: %r %r %r" % (seed, content, calls, fin))

# n = 3 with tools: each choice's output parsed on its own (its calls valid, ids unique over
# the request), streamed and not; seeded, the same three answers again
for stream in (False, True):
    got = ask_n({"tool_choice": "required", "parallel_tool_calls": False, "seed": 7}, stream, 3)
    ids = []
    for i, (content, calls, fin) in enumerate(got):
        check_calls("n=3 choice %d stream %s" % (i, stream), content, calls, fin)
        ids += [c["id"] for c in calls or []]
    if len(ids) != 3 or len(set(ids)) != 3:
        fails.append("n=3 stream %s: call ids %r not one a choice, all distinct" % (stream, ids))
    if stream:
        strip = lambda g: [[(c["function"]["name"], c["function"]["arguments"]) for c in cl or []] for _, cl, _ in g]
        if strip(got) != strip(whole):
            fails.append("n=3: streamed calls %r differ from the whole answer's %r" % (strip(got), strip(whole)))
    whole = got

# streamed, the arguments come in pieces as they are written (many deltas a call), not whole
if pieces[0] < 2 * n_calls:  # n_calls counts the whole answers too: 4+ deltas a streamed call
    fails.append("%d argument deltas over %d forced calls: arguments not streamed" % (pieces[0], n_calls))

# refusals: an unsupported keyword in a forced tool's parameters, a function that is not a tool
bad = json.loads(json.dumps(TOOLS))
bad[1]["function"]["parameters"]["properties"]["level"]["multipleOf"] = 2
status, raw = post({"messages": [{"role": "user", "content": "hi"}], "tools": bad, "tool_choice": "required"})
err = json.loads(raw).get("error", {}) if raw.startswith("{") else {}
if status != 400 or err.get("param") != "tools[1].function.parameters" or "multipleOf" not in err.get("message", ""):
    fails.append("multipleOf: %d %s" % (status, raw))
status, raw = post({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                    "tool_choice": {"type": "function", "function": {"name": "nope"}}})
if status != 400 or "tool_choice.function.name" not in raw:
    fails.append("unknown function: %d %s" % (status, raw))

# the gRPC gateway: GenerateRequest.messages (10; ChatMessage tool_calls_json 3, tool_call_id 4,
# name 5), tools_json (14), tool_choice (15), single_tool_call (16); GenerateResponse.text (2),
# finish_reason (3; FINISH_REASON_TOOL_CALLS 4), tool_calls (9: index 1, id 2, name 3,
# arguments_json 4). The conversation has an earlier call and its result, so they render.
def msg(role, content, calls="", call_id="", name=""):
    b = pb_bytes(1, role) + pb_bytes(2, content)
    return pb_bytes(10, b + (pb_bytes(3, calls) if calls else b"") + (pb_bytes(4, call_id) if call_id else b"") +
                    (pb_bytes(5, name) if name else b""))

def grpc_gen(tools_json, choice, max_tokens=160):
    earlier = json.dumps([{"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}])
    body = (msg("user", "Weather in Oslo?") + msg("assistant", "", calls=earlier) +
            msg("tool", '{"temp": 3}', call_id="call_1", name="get_weather") + msg("user", "And the volume?") +
            pb_varint(3, max_tokens) + pb_bytes(14, tools_json) + pb_bytes(15, choice) + pb_varint(16, 1))
    text, calls, fin = "", [], 0
    for m in generate_stub(channel(gw))(body, timeout=60):
        for f, v in fields(m):
            if f == 2:
                text += v.decode()
            elif f == 3:
                fin = v
            elif f == 9:
                c = {k: (x.decode() if isinstance(x, bytes) else x) for k, x in fields(v)}
                calls.append({"id": c.get(2, ""), "type": "function",
                              "function": {"name": c.get(3, ""), "arguments": c.get(4, "")}})
    return text, calls, "tool_calls" if fin == 4 else fin

out = grpc_gen(json.dumps(TOOLS), "required")
check_calls("grpc required", *out)
if len(out[1]) != 1:
    fails.append("grpc single_tool_call: %d calls" % len(out[1]))
check_calls("grpc named", *grpc_gen(json.dumps(TOOLS), "set_volume"), want_name="set_volume")
for tj, choice, want in (("[{\"type\": \"function\",", "required", "tools_json: not JSON"),
                         (json.dumps(bad), "required", "multipleOf"),
                         (json.dumps(TOOLS), "nope", "tool_choice")):
    try:
        grpc_gen(tj, choice, 8)
        fails.append("grpc %s: not refused" % want)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.INVALID_ARGUMENT or want not in e.details():
            fails.append("grpc %s: %s %s" % (want, e.code(), e.details()))
# OpenAI's older form: functions and function_call, a conversation with an earlier
# function_call and its function result; the answer as message.function_call / delta.function_call
FUNCS = [t["function"] for t in TOOLS]
def ask_fn(stream, seed):
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None,
                          "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}},
                         {"role": "function", "name": "get_weather", "content": '{"temp": 3}'},
                         {"role": "user", "content": "And the volume?"}],
            "functions": FUNCS, "function_call": {"name": "set_volume"}, "temperature": 1, "seed": seed,
            "max_tokens": 160, "stream": stream}
    status, raw = post(body)
    if status != 200:
        raise RuntimeError("HTTP %d %s" % (status, raw))
    if not stream:
        c = json.loads(raw)["choices"][0]
        m = c["message"]
        if "tool_calls" in m or m.get("content") is not None:
            fails.append("functions: tool_calls or content beside the function_call: %r" % m)
        return m.get("function_call"), c["finish_reason"]
    fc, fin, n_args = None, None, 0
    for ev in raw.split("\n\n"):
        if not ev.startswith("data: ") or ev == "data: [DONE]":
            continue
        for ch in json.loads(ev[6:])["choices"]:
            d = ch["delta"]
            if "tool_calls" in d or d.get("content"):
                fails.append("functions stream: a delta with tool_calls or content: %r" % d)
            if "function_call" in d:
                f = d["function_call"]
                if fc is None:
                    if not f.get("name"):
                        fails.append("functions stream: the first delta has no name: %r" % d)
                    fc = {"name": f.get("name"), "arguments": ""}
                fc["arguments"] += f.get("arguments") or ""
                n_args += bool(f.get("arguments"))
            fin = ch.get("finish_reason") or fin
    if n_args < 2:
        fails.append("functions stream: %d argument deltas (not streamed)" % n_args)
    return fc, fin

legacy = []
for stream in (False, True):
    fc, fin = ask_fn(stream, 11)
    legacy.append(fc)
    if fin != "function_call" or not fc:
        fails.append("functions stream %s: finish %s, function_call %r" % (stream, fin, fc))
        continue
    check_calls("functions stream %s" % stream, None,
                [{"id": "-", "type": "function", "function": fc}], "tool_calls", want_name="set_volume")
if legacy[0] != legacy[1]:
    fails.append("functions: streamed %r differs from the whole answer's %r" % (legacy[1], legacy[0]))
status, raw = post({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "functions": FUNCS})
if status != 400 or json.loads(raw)["error"].get("param") != "functions" or "'tools'" not in raw:
    fails.append("functions beside tools: %d %s" % (status, raw))

# the gRPC gateway's n (18) with tools: choice i's call (by choice_index, 10) is the HTTP
# door's choice i for the same seed (`whole`: n=3, required, seed 7), the ids distinct
body = (pb_bytes(10, pb_bytes(1, "user") + pb_bytes(2, "What is the weather in Paris?")) + pb_varint(3, 160) +
        pb_bytes(4, pb_f32(1, 1.0) + pb_varint(6, 7)) + pb_bytes(14, json.dumps(TOOLS)) +
        pb_bytes(15, "required") + pb_varint(16, 1) + pb_varint(18, 3))
got = {}
for m in generate_stub(channel(gw))(body, timeout=60):
    f = list(fields(m))
    i = next((v for k, v in f if k == 10), 0)
    for k, v in f:
        if k == 9:
            c = {kk: (x.decode() if isinstance(x, bytes) else x) for kk, x in fields(v)}
            got.setdefault(i, []).append((c.get(2, ""), c.get(3, ""), c.get(4, "")))
ids = [c[0] for i in got for c in got[i]]
g_calls = [[(c[1], c[2]) for c in got.get(i, [])] for i in range(3)]
h_calls = [[(c["function"]["name"], c["function"]["arguments"]) for c in cl or []] for _, cl, _ in whole]
if g_calls != h_calls:
    fails.append("grpc n=3: calls %r differ from the HTTP door's %r" % (g_calls, h_calls))
if len(ids) != 3 or len(set(ids)) != 3:
    fails.append("grpc n=3: call ids %r" % ids)

for f in fails:
    print("FAIL: " + f)
print("tools: %d forced calls validated, %d failures" % (n_calls, len(fails)))
sys.exit(1 if fails else 0)
PY

VENV="${TANDEM_CACHE:-$HOME/.cache/tandem}/venv-openai/bin/python"
if [ -x "$VENV" ] && "$VENV" -c 'import openai' 2>/dev/null; then
    "$VENV" - "$OA" <<'PY' || CL_FAIL=1
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
tools = [{"type": "function", "function": {"name": "set_volume", "parameters": {
    "type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["level"], "additionalProperties": False}}}]
r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Volume up"}],
                                   tools=tools, tool_choice="required", parallel_tool_calls=False, temperature=1,
                                   seed=7, max_tokens=200)
call = r.choices[0].message.tool_calls[0]
args = json.loads(call.function.arguments)
assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "set_volume", r
assert isinstance(args["level"], int) and 0 <= args["level"] <= 10, args
print("openai client: set_volume(%s)" % call.function.arguments)
r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Volume up"}],
                                   functions=[t["function"] for t in tools], function_call={"name": "set_volume"},
                                   temperature=1, seed=7, max_tokens=200)
fc = r.choices[0].message.function_call
assert r.choices[0].finish_reason == "function_call" and fc.name == "set_volume", r
assert 0 <= json.loads(fc.arguments)["level"] <= 10, fc
print("openai client: function_call set_volume(%s)" % fc.arguments)
PY
else
    echo "note: no openai package in $VENV: the official client's check is skipped"
fi
cl_end "tools through prefill/decode: forced tool calls validate streamed and not, none gives no calls, bad schemas are 400s"
