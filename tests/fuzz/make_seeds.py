#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (corpus/<harness>/) and the fixed model folder
fuzz_model_files reads (model/). Run from anywhere with Debian's python3 (grpcio,
protobuf) and a built tandem; the outputs are committed, so this runs only when a seed
should change:

    /usr/bin/python3 tests/fuzz/make_seeds.py build/tandem

Every seed is a small valid input of its parser (the fuzzer mutates from there)."""
import glob, json, os, shutil, socket, struct, subprocess, sys, tempfile, threading

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
tandem = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "build", "tandem"))
corpus = os.path.join(here, "corpus")


def put(harness, name, data):
    d = os.path.join(corpus, harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def run(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


shutil.rmtree(corpus, ignore_errors=True)
tmp = tempfile.mkdtemp()

# a 2-layer model of 260 ids (the byte tokenizer's 258 and two more): config.json,
# model.safetensors and a GGUF of it, f16 and q8_0
cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 260,
       "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
       "bos_token_id": 1, "eos_token_id": 2}
with open(os.path.join(tmp, "cfg.json"), "w") as f:
    json.dump(cfg, f)
run(tandem, "model", "synth", "--config", os.path.join(tmp, "cfg.json"), "--dtype", "f32", "--out", os.path.join(tmp, "m"))
for q in ("f16", "q8_0"):
    flag = ["--dtype", "f16"] if q == "f16" else ["--dtype", "f16", "--quant", "q8_0"]
    out = os.path.join(tmp, "m-%s.gguf" % q)
    run(tandem, "model", "synth", "--format", "gguf", "--config", os.path.join(tmp, "cfg.json"), *flag, "--out", out)
    put("gguf", "model-%s.gguf" % q, open(out, "rb").read())
model = os.path.join(here, "model")
shutil.rmtree(model, ignore_errors=True)
os.makedirs(model)
for n in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(tmp, "m", n), os.path.join(model, n))
    put("model_files", n, bytes([0 if n == "config.json" else 1]) + open(os.path.join(model, n), "rb").read())
# other shapes of config: qwen2 with sliding window fields, llama 3 rope scaling
put("model_files", "config-qwen2.json", b"\0" + json.dumps(dict(cfg, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
    use_sliding_window=False, sliding_window=4096, tie_word_embeddings=False)).encode())
put("model_files", "config-llama3.json", b"\0" + json.dumps(dict(cfg, rope_theta=500000.0, rope_scaling={
    "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
    "rope_type": "llama3"})).encode())

# mixtures of experts: Mixtral (a "llama" GGUF with expert_count) and Qwen3-MoE (qwen3moe), their
# 3-D ffn_*_exps tensors; their config.json fields (beside the dense safetensors: the experts'
# tensors are missing, and refused)
moe = {"mixtral": dict(cfg, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                       num_experts_per_tok=2, intermediate_size=32),
       "qwen3moe": dict(cfg, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)}
for name, c in moe.items():
    with open(os.path.join(tmp, name + ".json"), "w") as f:
        json.dump(c, f)
    out = os.path.join(tmp, name + ".gguf")
    run(tandem, "model", "synth", "--format", "gguf", "--config", os.path.join(tmp, name + ".json"), "--dtype", "f16",
        "--quant", "q8_0", "--out", out)
    put("gguf", "model-%s-q8_0.gguf" % name, open(out, "rb").read())
    put("model_files", "config-%s.json" % name, b"\0" + json.dumps(c).encode())

# tokenizers: the byte-level fixture's tokenizer.json (selector 0) and a llama2.c
# tokenizer.bin of 260 pieces with scores (selector 1)
put("tokenizer", "bytelevel.json", b"\0" + open(os.path.join(root, "tests/fixtures/tokenizer/bytelevel/tokenizer.json"), "rb").read())
pieces = [b"<unk>", b"<s>", b"</s>"] + [b"<0x%02X>" % i for i in range(256)] + [b" the"]
tb = struct.pack("<i", max(len(p) for p in pieces))
for i, p in enumerate(pieces):
    tb += struct.pack("<fi", -float(i), len(p)) + p
put("tokenizer", "llama2c.bin", b"\1" + tb)

# chat templates: the fixtures' (a user message after the NUL)
for p in sorted(glob.glob(os.path.join(root, "tests/fixtures/chat/*.jinja"))):
    put("chat_template", os.path.basename(p), open(p, "rb").read() + b"\0Tell me a joke.")

# OpenAI request bodies (selector 0: completions, 1: chat)
bodies = [
    (0, {"model": "m", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 1,
         "stop": ["\n", "END"], "logprobs": 2, "echo": True, "stream": True, "stream_options": {"include_usage": True}}),
    (0, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": 0.5,
         "repetition_penalty": 1.1, "top_k": 40, "min_p": 0.05, "n": 1, "user": "u", "ignore_eos": True}),
    (1, {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 3, "stream": False, "stop": "x"}),
    (1, {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "response_format": {"type": "text"}}),
    (1, {"messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "function_call": {"name": "w", "arguments": "{\"c\": \"P\"}"}},
                      {"role": "function", "name": "w", "content": "22"}],
         "functions": [{"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}],
         "function_call": {"name": "w"}, "n": 2}),
]
for i, (kind, b) in enumerate(bodies):
    put("openai", "body%d.json" % i, bytes([kind]) + json.dumps(b).encode())

# command lines and config files: FILE \0 ARG \0 ARG ... (selector: odd first byte adds --config)
put("conf", "router.conf", b"# router\nport = 7070\nmetrics-port = 9100\nhost = 0.0.0.0\nmodel-name = smol\nlog-level = info\n\0--port\0" b"7071")
put("conf", "node.conf", b"model = /models/m.gguf\nrouter = 10.0.0.1:7070\nthreads = 4\ndevice = cpu\ndtype = f16\nmax-batch = 32\n"
    b"\0--node-id\0decode0\0--max-batch=64\0--temperature\0" b"0.5\0--drain\0--label\0x\0--list\0a,b")
put("conf", "help.conf", b"\0--help")

# protobuf: a typical message of every kind, each behind its index in fuzz_protobuf's
# list (the descriptors in the order of the generated headers: control, health, tandem)
sys.path.insert(0, tmp)
run("protoc", "-I", os.path.join(root, "proto"), "--python_out", tmp, *sorted(glob.glob(os.path.join(root, "proto/*.proto"))))
names = []
for proto in ("control", "health", "tandem"):
    hdr = open(os.path.join(root, "build/proto/%s.pb-c.h" % proto)).read()
    import re
    names += re.findall(r"extern const ProtobufCMessageDescriptor ([a-z0-9_]+)__descriptor", hdr)
import importlib
mods = [importlib.import_module(m) for m in ("control_pb2", "health_pb2", "tandem_pb2")]
by_c = {}
for mod in mods:
    def walk(desc, prefix):
        for m in desc.message_types_by_name.values() if hasattr(desc, "message_types_by_name") else desc.nested_types:
            yield m
            yield from walk(m, prefix)
    for m in walk(mod.DESCRIPTOR, ""):
        c = m.full_name.replace(".", "__").lower()
        by_c[re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", m.full_name).replace(".", "__").lower()] = m
from google.protobuf import message_factory
def sample(desc, depth=0):
    cls = message_factory.GetMessageClass(desc) if hasattr(message_factory, "GetMessageClass") else \
        message_factory.MessageFactory().GetPrototype(desc)
    msg = cls()
    for f in desc.fields:
        rep = f.label == f.LABEL_REPEATED
        if f.type == f.TYPE_MESSAGE:
            if depth < 2:
                sub = sample(f.message_type, depth + 1)
                (getattr(msg, f.name).add().CopyFrom(sub) if rep else getattr(msg, f.name).CopyFrom(sub))
            continue
        v = {f.TYPE_STRING: "x", f.TYPE_BYTES: b"\x01\x02", f.TYPE_BOOL: True, f.TYPE_FLOAT: 0.5,
             f.TYPE_DOUBLE: 0.25, f.TYPE_ENUM: 1}.get(f.type, 7)
        if f.type == f.TYPE_ENUM:
            v = f.enum_type.values[-1].number
        if rep:
            getattr(msg, f.name).extend([v, v])
        else:
            setattr(msg, f.name, v)
    return msg
for i, n in enumerate(names):
    m = by_c.get(n)
    if m is not None:
        put("protobuf", "%03d-%s" % (i, n), bytes([i]) + sample(m).SerializeToString())

# HTTP/1.1: what OpenAI clients, curl and Prometheus send
body = json.dumps(bodies[2][1])
put("http", "chat.txt", "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    "Authorization: Bearer k\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
put("http", "chunked.txt", "POST /stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
put("http", "pipelined.txt", "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain\r\n\r\nGET /health HTTP/1.1\r\n\r\n"
    "GET /v1/models HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
put("http", "expect.txt", "POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}")

# gRPC: the bytes a stock grpcio client sends for a health check and a Generate call,
# recorded by a socket that sends SETTINGS and then only listens
import grpc
sys.path.insert(0, tmp)
def record(call):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = []
    def accept():
        c, _ = srv.accept()
        c.settimeout(1.0)
        # the server's SETTINGS and the ACK of the client's: a client sends its calls only
        # after the server's SETTINGS
        c.sendall(b"\0\0\0\x04\0\0\0\0\0" + b"\0\0\0\x04\x01\0\0\0\0")
        try:
            while True:
                b = c.recv(65536)
                if not b:
                    break
                got.append(b)
        except socket.timeout:
            pass
        c.close()
    t = threading.Thread(target=accept)
    t.start()
    ch = grpc.insecure_channel("127.0.0.1:%d" % port)
    try:
        call(ch)
    except grpc.RpcError:
        pass
    t.join()
    ch.close()
    srv.close()
    return b"".join(got)
health_pb2 = importlib.import_module("health_pb2")
tandem_pb2 = importlib.import_module("tandem_pb2")
put("grpc", "health.bin", record(lambda ch: ch.unary_unary("/grpc.health.v1.Health/Check",
    request_serializer=lambda m: m.SerializeToString())(health_pb2.HealthCheckRequest(service=""), timeout=1.5)))
req = tandem_pb2.GenerateRequest(prompt="Once upon a time")
put("grpc", "generate.bin", record(lambda ch: list(ch.unary_stream("/tandem.v1.Generation/Generate",
    request_serializer=lambda m: m.SerializeToString())(req, timeout=1.5, metadata=(("authorization", "Bearer k"),)))))
shutil.rmtree(tmp)
for h in sorted(os.listdir(corpus)):
    print("%-14s %d seeds" % (h, len(os.listdir(os.path.join(corpus, h)))))
