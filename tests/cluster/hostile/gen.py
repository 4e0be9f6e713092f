#!/usr/bin/python3
"""gen.py: writes the hostile-input corpus of tests/cluster/test_hostile_corpus.sh (issue 21).

    gen.py OUT_DIR --base MODEL_DIR [--gguf FILE.gguf] [--seed N]

MODEL_DIR is a synthetic model written by `tandem model synth --out MODEL_DIR` (the tiny
preset: config.json, model.safetensors, tokenizer.json, tokenizer_config.json). The corpus
is deterministic for a given base model and seed, and has three groups:

  OUT_DIR/model/NNN-<name>/   a copy of the base model with one file mutated (the others are
                              symlinks to the base): config.json fields missing, of the wrong
                              type, negative, zero, huge, NaN/Infinity literals; safetensors
                              headers and data truncated or garbled, tensors of the wrong
                              shape or dtype, missing or extra; tokenizer.json and
                              tokenizer_config.json empty, with a BOM, truncated, of the wrong
                              types, with gaps in the vocabulary.
  OUT_DIR/model/NNN-gguf-<name>.gguf  with --gguf (a `tandem model synth --format gguf` file):
                              the file with one field mutated: every header count, string and
                              array length, value type, tensor dimension, type and offset,
                              alignment, hyperparameters that disagree with the tensors, and
                              the tokenizer's metadata; the file cut at many points.
  OUT_DIR/model.jsonl         one line per model case: {"name", "dir", "expect"}, expect
                              "error" where no answer can be right (a config that disagrees
                              with the tensors, a broken file), "generate-error" for a broken
                              tokenizer (`model info` does not read it), "any" where a clear
                              error and a loaded model are both right (a missing field with a
                              default); optional "message" (an error of generate that may name
                              no file) and "says" (what the error must contain).
  OUT_DIR/flags.jsonl         `tandem generate` argument lists with a bad value for every
                              numeric flag (NaN, inf, negative, huge, empty, garbage), bad
                              strings for the others, unknown, ambiguous and valueless flags:
                              {"name", "args" (after `generate`; MODEL stands for the base
                              model), "flag"}: each must exit 2 naming the flag.
  OUT_DIR/net.jsonl           raw payloads: {"name", "target" (gateway, control, metrics),
                              "hex"}: HTTP/2 prefaces cut short, bad frames, oversized lengths,
                              HPACK garbage, gRPC frames with broken framing or a body that is
                              not a GenerateRequest; HTTP requests with bad request lines, huge
                              headers, binary; and {"name", "target": "grpc", "method",
                              "hex"}: message bodies sent through a stock gRPC client, which
                              must end with a status (an error for those that cannot parse).

Only the standard library; run with /usr/bin/python3.
"""
import json
import os
import random
import struct
import sys

# ---------------------------------------------------------------------------- helpers


def write(path, data):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


class ModelCases:
    """Each case is a directory: the mutated file written, the other files linked to the base."""

    FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

    def __init__(self, out, base):
        self.out, self.base, self.rows = out, os.path.abspath(base), []
        os.makedirs(os.path.join(out, "model"), exist_ok=True)

    def add(self, name, expect, files, message=None, says=None):
        """files: {file name: bytes, or None to leave the file out}; message: a pattern an error
        of `tandem generate` may match instead of naming a file (a failure at run time); says:
        what every error of the case must contain (where a vaguer message was once given)."""
        d = os.path.join(self.out, "model", "%03d-%s" % (len(self.rows), name))
        os.makedirs(d)
        for f in self.FILES:
            if f in files:
                if files[f] is not None:
                    write(os.path.join(d, f), files[f])
            elif os.path.exists(os.path.join(self.base, f)):
                os.symlink(os.path.join(self.base, f), os.path.join(d, f))
        row = {"name": name, "dir": d, "expect": expect}
        if message:
            row["message"] = message
        if says:
            row["says"] = says
        self.rows.append(row)


    def add_file(self, name, expect, data, says=None):
        """A one-file model (GGUF): the case's "dir" is the file itself."""
        path = os.path.join(self.out, "model", "%03d-%s.gguf" % (len(self.rows), name))
        write(path, data)
        row = {"name": name, "dir": path, "expect": expect}
        if says:
            row["says"] = says
        self.rows.append(row)


def json_text(obj):
    # allow_nan: Python writes the NaN/Infinity literals that JSON does not allow
    return json.dumps(obj, indent=1, allow_nan=True)


# ---------------------------------------------------------------------------- group 1

# what a mutated config.json field should give: "error" where the value cannot describe the
# tensors on disk, "any" where a default or a lenient reading is also right
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")
INT_VALUES = [("neg", -1), ("zero", 0), ("int32max", 2147483647), ("e39", 1e39), ("nan", float("nan")),
              ("inf", float("inf")), ("string", "64"), ("frac", 1.5), ("null", None), ("bigint", 10 ** 30)]


def config_cases(mc, cfg, rnd):
    for field in SHAPE_FIELDS + ("max_position_embeddings", "bos_token_id", "eos_token_id"):
        # head_dim is derived from hidden_size / heads, vocab_size from the embedding when absent
        mc.add("config-%s-missing" % field,
               "error" if field in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads") else "any",
               {"config.json": json_text({k: v for k, v in cfg.items() if k != field})})
        # negative, zero, NaN, a string and 10^30 for every field, 2 more drawn by the seed
        core = [tv for tv in INT_VALUES if tv[0] in ("neg", "zero", "nan", "string", "bigint")]
        for tag, v in core + rnd.sample([tv for tv in INT_VALUES if tv not in core], 2):
            c = dict(cfg)
            c[field] = v
            if field in SHAPE_FIELDS:
                expect = "any" if tag in ("string", "null") else "error"
            elif field == "max_position_embeddings":
                expect = "any" if tag in ("string", "null", "int32max") else "error"
            else:
                expect = "any"  # a token id that is not in the vocabulary: no BOS/EOS, or refused
            mc.add("config-%s-%s" % (field, tag), expect, {"config.json": json_text(c)})
    for tag, v in [("half", cfg["num_hidden_layers"] - 1), ("more", cfg["num_hidden_layers"] + 1)]:
        c = dict(cfg)
        c["num_hidden_layers"] = v
        mc.add("config-num_hidden_layers-%s" % tag, "error", {"config.json": json_text(c)})
    c = dict(cfg)
    c["hidden_size"] = cfg["hidden_size"] // 2
    mc.add("config-hidden_size-half", "error", {"config.json": json_text(c)})
    c = dict(cfg)
    c["vocab_size"] = cfg["vocab_size"] * 2
    mc.add("config-vocab_size-double", "error", {"config.json": json_text(c)})
    for field in ("rms_norm_eps", "rope_theta"):
        mc.add("config-%s-missing" % field, "any", {"config.json": json_text({k: v for k, v in cfg.items() if k != field})})
        for tag, v in [("neg", -1), ("zero", 0), ("e39", 1e39), ("nan", float("nan")), ("inf", float("inf")),
                       ("ninf", float("-inf")), ("string", "x"), ("list", [1])]:
            c = dict(cfg)
            c[field] = v
            expect = "error" if field == "rope_theta" and tag not in ("string",) else "any"
            mc.add("config-%s-%s" % (field, tag), expect, {"config.json": json_text(c)})
    for field in ("model_type", "architectures", "torch_dtype", "hidden_act", "tie_word_embeddings",
                  "attention_bias", "rope_scaling"):
        mc.add("config-%s-missing" % field, "any", {"config.json": json_text({k: v for k, v in cfg.items() if k != field})})
        for tag, v in [("int", 7), ("bogus", "bogus"), ("list", []), ("object", {"type": "bogus", "factor": -1})]:
            c = dict(cfg)
            c[field] = v
            mc.add("config-%s-%s" % (field, tag), "any", {"config.json": json_text(c)})
    text = json_text(cfg).encode()
    whole = [
        ("empty", b""), ("space", b"   \n"), ("open-brace", b"{"), ("list", b"[]"), ("null", b"null"),
        ("number", b"42"), ("bom", b"\xef\xbb\xbf" + text), ("truncated", text[:len(text) // 2]),
        ("binary", bytes(range(256)) * 4), ("nested", b"[" * 100000 + b"]" * 100000),
        ("nested-object", b'{"a":' * 5000 + b"1" + b"}" * 5000), ("not-utf8", text.replace(b"llama", b"ll\xffma")),
        ("long-number", text.replace(b'"hidden_size": %d' % cfg["hidden_size"], b'"hidden_size": 1' + b"0" * 5000)),
        ("nul-inside", text[:40] + b"\x00" + text[40:]),
    ]
    for tag, data in whole:
        # bom: skipped; not-utf8: the bytes land in model_type, which architectures overrides
        # binary, nul-inside: a NUL once ended the text early ("empty file: expected a JSON object")
        mc.add("config-file-%s" % tag, "any" if tag in ("bom", "not-utf8") else "error", {"config.json": data},
               says="NUL byte" if tag in ("binary", "nul-inside") else None)
    dup = text.replace(b"{", b'{"num_hidden_layers": 99,', 1)
    mc.add("config-file-duplicate-key", "any", {"config.json": dup})
    mc.add("config-file-absent", "error", {"config.json": None})


def st_pack(header, data, pad=True):
    h = json.dumps(header, allow_nan=True).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors_cases(mc, st, rnd):
    n = struct.unpack("<Q", st[:8])[0]
    header = json.loads(st[8:8 + n])
    data = st[8 + n:]
    names = [k for k in header if k != "__metadata__"]
    layer = [k for k in names if ".layers.1." in k]
    emb = "model.embed_tokens.weight"
    raw = [
        ("empty", b""), ("four-bytes", st[:4]), ("header-only-length", st[:8]),
        ("zero-length-header", struct.pack("<Q", 0) + data),
        ("header-length-huge", struct.pack("<Q", 1 << 62) + st[8:]),
        ("header-length-2g", struct.pack("<Q", (1 << 31) + 5) + st[8:]),
        ("header-length-past-end", struct.pack("<Q", len(st)) + st[8:]),
        ("header-length-short", struct.pack("<Q", n // 2) + st[8:]),
        ("header-cut", st[:8 + n // 2]), ("data-cut-half", st[:8 + n + len(data) // 2]),
        ("data-cut-last-byte", st[:-1]), ("data-absent", st[:8 + n]),
        ("header-garbage", st[:8] + bytes(rnd.randrange(256) for _ in range(n)) + data),
        ("header-list", st_pack([], data)), ("header-null", st_pack(None, data)),
        ("header-not-utf8", st[:8] + st[8:8 + n].replace(b"model.", b"mod\xffl.", 1) + data),
        ("zeros", bytes(len(st))),
    ]
    for tag, blob in raw:
        mc.add("st-%s" % tag, "error", {"model.safetensors": blob})

    def mutate(tag, expect, fn, pad=True, message=None):
        h = json.loads(json.dumps(header))
        d = fn(h)
        mc.add("st-%s" % tag, expect, {"model.safetensors": st_pack(h, d if isinstance(d, bytes) else data, pad)},
               message)

    def set_(key, field, value):
        def fn(h):
            h[key][field] = value
        return fn

    t = next(k for k in layer if len(header[k]["shape"]) == 2 and len(set(header[k]["shape"])) == 2)  # not square
    size = header[t]["data_offsets"][1] - header[t]["data_offsets"][0]
    shape = header[t]["shape"]
    mutate("shape-transposed", "error", set_(t, "shape", shape[::-1]))
    mutate("shape-half", "error", set_(t, "shape", [shape[0] // 2, shape[1]]))
    mutate("shape-3d", "error", set_(t, "shape", [1] + shape))
    mutate("shape-1d", "error", set_(t, "shape", [shape[0] * shape[1]]))
    mutate("shape-negative", "error", set_(t, "shape", [-shape[0], shape[1]]))
    mutate("shape-huge", "error", set_(t, "shape", [1 << 62, 4]))
    mutate("shape-overflow", "error", set_(t, "shape", [1 << 32, 1 << 32]))
    mutate("shape-string", "error", set_(t, "shape", ["64", shape[1]]))
    mutate("shape-nan", "error", set_(t, "shape", [float("nan"), shape[1]]))
    mutate("shape-missing", "error", lambda h: h[t].pop("shape"))
    mutate("shape-embed-vocab-half", "error", set_(emb, "shape", [header[emb]["shape"][0] // 2, header[emb]["shape"][1]]))
    for dt in ("F32", "F64", "I8", "U8", "BOOL", "F8_E4M3", "bogus", ""):
        mutate("dtype-%s" % (dt or "empty"), "error", set_(t, "dtype", dt))
    mutate("dtype-number", "error", set_(t, "dtype", 16))
    mutate("dtype-missing", "error", lambda h: h[t].pop("dtype"))
    a, b = header[t]["data_offsets"]
    mutate("offsets-reversed", "error", set_(t, "data_offsets", [b, a]))
    mutate("offsets-past-end", "error", set_(t, "data_offsets", [len(data) - size // 2, len(data) - size // 2 + size]))
    mutate("offsets-huge", "error", set_(t, "data_offsets", [(1 << 64) - 8, (1 << 64) - 8 + size]))
    mutate("offsets-negative", "error", set_(t, "data_offsets", [-size, 0]))
    mutate("offsets-short", "error", set_(t, "data_offsets", [a, a + size // 2]))
    mutate("offsets-one", "error", set_(t, "data_offsets", [a]))
    mutate("offsets-float", "error", set_(t, "data_offsets", [a + 0.5, b + 0.5]))
    mutate("offsets-missing", "error", lambda h: h[t].pop("data_offsets"))
    mutate("tensor-not-object", "error", lambda h: h.__setitem__(t, [1, 2, 3]))
    mutate("tensor-missing", "error", lambda h: h.pop(t))
    mutate("layer-missing", "error", lambda h: [h.pop(k) for k in layer])
    mutate("extra-layer", "error", lambda h: [h.__setitem__(k.replace(".layers.1.", ".layers.%d." % len(names)), h[k])
                                              for k in layer])
    mutate("extra-unknown-tensor", "any", lambda h: h.__setitem__("model.bogus.weight", dict(h[t])))
    mutate("aliased-offsets", "any", lambda h: [h[k].__setitem__("data_offsets", list(h[t]["data_offsets"]))
                                                for k in layer if h[k]["shape"] == shape])
    mutate("metadata-not-object", "any", lambda h: h.__setitem__("__metadata__", 7))
    mutate("metadata-huge", "any", lambda h: h.__setitem__("__metadata__", {"x": "y" * 1000000}))
    # every weight NaN or Inf (bf16 0x7fc0 / 0x7f80): defined behaviour in the kernels (no load-time
    # scan of every weight, docs/kernels.md), so the sampler finds no finite logit
    mutate("weights-nan", "any", lambda h: b"\xc0\x7f" * (len(data) // 2), message="finite")
    mutate("weights-inf", "any", lambda h: b"\x80\x7f" * (len(data) // 2), message="finite")
    mutate("weights-random", "any", lambda h: bytes(rnd.randrange(256) for _ in range(len(data))),
           message="finite")
    mutate("header-unpadded", "any", lambda h: None, pad=False)
    mc.add("st-absent", "error", {"model.safetensors": None})


def tokenizer_cases(mc, tok_text, tcfg_text):
    tok = json.loads(tok_text)
    raw = tok_text.encode()
    whole = [("empty", b""), ("bom", b"\xef\xbb\xbf" + raw), ("truncated", raw[:len(raw) // 2]),
             ("list", b"[]"), ("null", b"null"), ("binary", bytes(range(256)) * 8),
             ("llama2c-header", struct.pack("<i", 64) + b"\x00" * 64), ("nested", b"[" * 100000),
             ("not-utf8", raw.replace(b"ByteLevel", b"Byte\xffLevel", 1))]
    for tag, data in whole:
        mc.add("tok-file-%s" % tag, "any" if tag == "bom" else "generate-error", {"tokenizer.json": data})

    def mutate(tag, expect, fn):
        t = json.loads(tok_text)
        fn(t)
        # `model info` shows the tokenizer's path without reading it: only generate must refuse
        mc.add("tok-%s" % tag, "generate-error" if expect == "error" else expect, {"tokenizer.json": json_text(t)})

    vocab = tok["model"]["vocab"]
    first = sorted(vocab, key=vocab.get)
    mutate("model-missing", "error", lambda t: t.pop("model"))
    mutate("model-type-wordpiece", "error", lambda t: t["model"].__setitem__("type", "WordPiece"))
    mutate("model-type-number", "any", lambda t: t["model"].__setitem__("type", 7))
    mutate("vocab-list", "error", lambda t: t["model"].__setitem__("vocab", list(vocab)))
    mutate("vocab-empty", "error", lambda t: t["model"].__setitem__("vocab", {}))
    mutate("vocab-gap", "error", lambda t: t["model"]["vocab"].pop(first[100]))
    mutate("vocab-duplicate-id", "error", lambda t: t["model"]["vocab"].__setitem__(first[100], 101))
    mutate("vocab-negative-id", "error", lambda t: t["model"]["vocab"].__setitem__(first[100], -1))
    mutate("vocab-huge-id", "error", lambda t: t["model"]["vocab"].__setitem__(first[100], 1 << 40))
    mutate("vocab-nan-id", "error", lambda t: t["model"]["vocab"].__setitem__(first[100], float("nan")))
    mutate("vocab-string-id", "error", lambda t: t["model"]["vocab"].__setitem__(first[100], "100"))
    mutate("vocab-empty-token", "any", lambda t: t["model"]["vocab"].__setitem__("", len(vocab)))
    mutate("vocab-past-config", "error", lambda t: t["model"]["vocab"].__setitem__("zz", 100000))
    mutate("merges-unknown", "error", lambda t: t["model"].__setitem__("merges", ["%s zz" % first[1]]))
    mutate("merges-number", "error", lambda t: t["model"].__setitem__("merges", 5))
    mutate("merges-bad-entry", "error", lambda t: t["model"].__setitem__("merges", [5, None]))
    mutate("merges-one-word", "error", lambda t: t["model"].__setitem__("merges", [first[1]]))
    mutate("added-id-huge", "error", lambda t: t["added_tokens"][0].__setitem__("id", 99999))
    mutate("added-id-negative", "error", lambda t: t["added_tokens"][0].__setitem__("id", -5))
    mutate("added-content-empty", "any", lambda t: t["added_tokens"][0].__setitem__("content", ""))
    mutate("added-not-list", "error", lambda t: t.__setitem__("added_tokens", {"id": 1}))
    mutate("added-content-number", "error", lambda t: t["added_tokens"][0].__setitem__("content", 5))
    mutate("pretok-bogus", "any", lambda t: t.__setitem__("pre_tokenizer", {"type": "Bogus"}))
    mutate("pretok-number", "any", lambda t: t.__setitem__("pre_tokenizer", 5))
    mutate("decoder-bogus", "any", lambda t: t.__setitem__("decoder", {"type": "Bogus"}))
    mutate("normalizer-bogus", "any", lambda t: t.__setitem__("normalizer", {"type": "Bogus"}))
    mc.add("tok-absent", "any", {"tokenizer.json": None})
    tcfg = json.loads(tcfg_text)
    for tag, fn in [("bos-unknown", lambda c: c.__setitem__("bos_token", "<zz>")),
                    ("bos-number", lambda c: c.__setitem__("bos_token", 5)),
                    ("add-bos-string", lambda c: c.__setitem__("add_bos_token", "yes")),
                    ("added-decoder-bad-id", lambda c: c.__setitem__("added_tokens_decoder", {"x": {"content": 1}}))]:
        c = json.loads(tcfg_text)
        fn(c)
        mc.add("tokcfg-%s" % tag, "any", {"tokenizer_config.json": json_text(c)})
    for tag, data in [("empty", b""), ("truncated", tcfg_text.encode()[:30]), ("list", b"[]")]:
        mc.add("tokcfg-file-%s" % tag, "any", {"tokenizer_config.json": data})
    del tcfg


# ---------------------------------------------------------------------------- group 2

INT_FLAGS = ["--max-tokens", "--top-k", "--seed", "--stop-id", "--threads", "--kv-mem", "--prefill-chunk"]
FLOAT_FLAGS = ["--temperature", "--top-p", "--min-p", "--repetition-penalty", "--timeout", "--connect-timeout"]
BAD_ANY = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "1e39", "-1e39", "99999999999999999999", "", "12abc",
           "--", " ", "1 2", "\xff\xfe"]
BAD_INT = ["1.5", "1e3", "9223372036854775808", "-9223372036854775809", "2147483648"]
BAD_FLOAT = ["1e-50", "3.4e39", "1,5"]


def flag_cases(rnd):
    rows = []
    base = ["--model", "MODEL", "--prompt-ids", "1 2", "--max-tokens", "2"]
    for flag in INT_FLAGS + FLOAT_FLAGS:
        # every flag gets NaN, infinity, a negative, a huge value, an empty string and garbage,
        # and 4 more of the list drawn by the seed (each process costs ~0.1 s to start in the
        # release build, which links the CUDA libraries)
        core = ["nan", "inf", "-1", "99999999999999999999", "", "12abc"]
        rest = [v for v in BAD_ANY + (BAD_INT if flag in INT_FLAGS else BAD_FLOAT) if v not in core]
        for v in core + rnd.sample(rest, 4):
            if flag in ("--seed",) and v in ("2147483648",):
                continue  # in range
            rows.append({"name": "%s=%r" % (flag, v), "args": base + [flag, v], "flag": flag[2:]})
    # "1,2" is two ids (commas separate ids too)
    for v in ["", " ", "1 x2", "-1", "99999999999999999999", "1;2", "nan", "1.5", "\xff", "0x10", "1" * 40]:
        rows.append({"name": "--prompt-ids=%r" % v, "args": ["--model", "MODEL", "--prompt-ids", v], "flag": "prompt-ids"})
    for flag, vals in [("--device", ["gpu", "", "cuda:-1", "cuda:x", "cuda:99999999999999999999", "cpu:bogus"]),
                       ("--dtype", ["int8", "", "F32 "]), ("--log-level", ["loud", ""]),
                       ("--server", ["nohost", ":", "127.0.0.1:0", "127.0.0.1:99999", "127.0.0.1:-1", "[::1"])]:
        for v in vals:
            args = ["--prompt-ids", "1 2", "--max-tokens", "2", flag, v]
            if flag != "--server":
                args = ["--model", "MODEL"] + args
            rows.append({"name": "%s=%r" % (flag, v), "args": args, "flag": flag[2:]})
    for flag in ["--bogus", "--max_tokens", "--t", "--top", "-x", "--model-", "--print-ids=1", "---max-tokens"]:
        rows.append({"name": "unknown %s" % flag, "args": base + [flag, "3"], "flag": flag.lstrip("-").split("=")[0]})
    for flag in ["--max-tokens", "--temperature", "--seed", "--stop-id"]:
        rows.append({"name": "%s without a value" % flag, "args": base + [flag], "flag": flag[2:]})
    return rows


# ---------------------------------------------------------------------------- group 3

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GENERATE = "/tandem.v1.Generation/Generate"


def frame(ftype, flags, stream, payload=b"", length=None):
    n = len(payload) if length is None else length
    return n.to_bytes(3, "big") + bytes([ftype, flags]) + (stream & 0xFFFFFFFF).to_bytes(4, "big") + payload


def hlit(name, value):
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def grpc_headers(path=GENERATE):
    return (hlit(":method", "POST") + hlit(":scheme", "http") + hlit(":path", path) + hlit(":authority", "x") +
            hlit("content-type", "application/grpc") + hlit("te", "trailers"))


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def pb_varint(field, v):
    return varint(field << 3) + varint(v)


def pb_bytes(field, b):
    return varint(field << 3 | 2) + varint(len(b)) + b


def good_request():
    # max_tokens first, so a cut keeps it and loses the prompt (an empty prompt: INVALID_ARGUMENT)
    return pb_varint(3, 4) + pb_bytes(2, b"".join(varint(v) for v in (1, 2, 3)))


def grpc_msg(body, compressed=0, length=None):
    return bytes([compressed]) + (len(body) if length is None else length).to_bytes(4, "big") + body


def h2_payloads(rnd):
    settings = frame(4, 0, 0)
    ack = frame(4, 1, 0)
    start = PREFACE + settings + ack
    hdr = grpc_headers()
    body = grpc_msg(good_request())
    cases = []
    for k in (0, 1, 3, 8, 16, 23):
        cases.append(("preface cut at %d" % k, PREFACE[:k]))
    cases += [
        ("preface wrong case", PREFACE.lower()),
        ("preface then nothing", PREFACE),
        ("preface then random", PREFACE + bytes(rnd.randrange(256) for _ in range(512))),
        ("random 64k", bytes(rnd.randrange(256) for _ in range(65536))),
        ("zeros", bytes(4096)),
        ("frame header cut", start + frame(1, 4, 1, hdr)[:5]),
        ("frame payload cut", start + frame(1, 4, 1, hdr)[:20]),
        ("frame length 16M", start + frame(0, 0, 1, b"x" * 16, length=0xFFFFFF)),
        ("frame length over max frame size", start + frame(0, 0, 1, b"x" * 20000)),
        ("settings length 5", PREFACE + frame(4, 0, 0, b"\x00" * 5)),
        ("settings on stream 1", PREFACE + frame(4, 0, 1, b"")),
        ("settings ack with payload", start + frame(4, 1, 0, b"\x00" * 6)),
        ("settings initial window 2^31", PREFACE + frame(4, 0, 0, b"\x00\x04\x80\x00\x00\x00")),
        ("settings max frame size 1", PREFACE + frame(4, 0, 0, b"\x00\x05\x00\x00\x00\x01")),
        ("settings enable push 2", PREFACE + frame(4, 0, 0, b"\x00\x02\x00\x00\x00\x02")),
        ("settings header table 4G", PREFACE + frame(4, 0, 0, b"\x00\x01\xff\xff\xff\xff")),
        ("settings 10000 entries", PREFACE + frame(4, 0, 0, b"\x00\x03\x00\x00\x00\x64" * 2700)),
        ("ping length 7", start + frame(6, 0, 0, b"\x00" * 7)),
        ("ping on stream 1", start + frame(6, 0, 1, b"\x00" * 8)),
        ("ping flood", start + frame(6, 0, 0, b"\x00" * 8) * 2000),
        ("window update zero", start + frame(8, 0, 0, b"\x00\x00\x00\x00")),
        ("window update overflow", start + frame(8, 0, 0, b"\x7f\xff\xff\xff") * 2),
        ("window update length 3", start + frame(8, 0, 0, b"\x00\x00\x01")),
        ("rst on stream 0", start + frame(3, 0, 0, b"\x00\x00\x00\x08")),
        ("rst on idle stream", start + frame(3, 0, 5, b"\x00\x00\x00\x08")),
        ("goaway garbage", start + frame(7, 0, 0, b"\xff" * 3)),
        ("priority on itself", start + frame(2, 0, 1, b"\x00\x00\x00\x01\x10")),
        ("continuation alone", start + frame(9, 4, 1, hdr)),
        ("headers on stream 0", start + frame(1, 5, 0, hdr)),
        ("headers on even stream", start + frame(1, 5, 2, hdr)),
        ("headers without end-headers then data", start + frame(1, 0, 1, hdr) + frame(0, 1, 1, body)),
        ("data on idle stream", start + frame(0, 1, 1, body)),
        ("data on stream 0", start + frame(0, 1, 0, body)),
        ("unknown frame type", start + frame(0xEE, 0xFF, 1, b"abc")),
        ("padded headers pad past end", start + frame(1, 0x0C, 1, b"\xff" + hdr)),
        ("hpack index 0", start + frame(1, 5, 1, b"\x80")),
        ("hpack index past table", start + frame(1, 5, 1, b"\xff\xff\xff\xff\x0f")),
        ("hpack integer overflow", start + frame(1, 5, 1, b"\x7f" + b"\xff" * 10 + b"\x01")),
        ("hpack table size update 4G", start + frame(1, 5, 1, b"\x3f\xe1\xff\xff\xff\x0f" + hdr)),
        ("hpack literal length past end", start + frame(1, 5, 1, b"\x00\x7f\xff\x10abc")),
        ("hpack bad huffman", start + frame(1, 5, 1, b"\x00\x85\xff\xff\xff\xff\xff\x81\x00")),
        ("headers 1 MB value in continuations",
         start + frame(1, 0, 1, hdr) + b"".join(frame(9, 0, 1, hlit("x-a", "b" * 100) * 100) for _ in range(100)) +
         frame(9, 4, 1, b"")),
        ("headers missing :path", start + frame(1, 5, 1, hlit(":method", "POST") + hlit(":scheme", "http"))),
        ("headers uppercase name", start + frame(1, 5, 1, hdr + hlit("X-Bad", "1"))),
        ("headers with NUL value", start + frame(1, 5, 1, hdr + hlit("x-bad", "a\x00b"))),
        ("grpc-timeout garbage", start + frame(1, 4, 1, hdr + hlit("grpc-timeout", "99999999999H")) +
         frame(0, 1, 1, body)),
        ("grpc-timeout negative", start + frame(1, 4, 1, hdr + hlit("grpc-timeout", "-1S")) + frame(0, 1, 1, body)),
        ("unknown path", start + frame(1, 4, 1, grpc_headers("/x.Y/Z")) + frame(0, 1, 1, body)),
        ("path without service", start + frame(1, 4, 1, grpc_headers("/")) + frame(0, 1, 1, body)),
        ("grpc length 4G", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, grpc_msg(b"\x18\x04", length=0xFFFFFFFF))),
        ("grpc length 16M no data", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, grpc_msg(b"", length=1 << 24))),
        ("grpc compressed flag", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, grpc_msg(good_request(), 1))),
        ("grpc flag 7", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, grpc_msg(good_request(), 7))),
        ("grpc prefix cut", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, b"\x00\x00\x00")),
        ("grpc message cut", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, body[:-2])),
        ("grpc two messages", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, body + body)),
        ("grpc 1000 empty messages", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, grpc_msg(b"") * 1000)),
        ("data after end stream", start + frame(1, 4, 1, hdr) + frame(0, 1, 1, body) + frame(0, 1, 1, body)),
        ("100 streams opened at once",
         start + b"".join(frame(1, 4, 2 * k + 1, hdr) for k in range(100))),
        ("stream ids going down", start + frame(1, 4, 5, hdr) + frame(1, 4, 3, hdr)),
    ]
    for what, bad in [("bad varint", b"\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"),
                      ("length past the end", b"\x12\x40\x01\x02"), ("group wire type", b"\x0b\x0c"),
                      ("field 0", b"\x00\x01"), ("random", bytes(rnd.randrange(256) for _ in range(200)))]:
        cases.append(("raw grpc call with protobuf %s" % what,
                      start + frame(1, 4, 1, hdr) + frame(0, 1, 1, grpc_msg(bad))))
    return cases


def http_payloads(rnd):
    return [
        ("empty request line", b"\r\n\r\n"),
        ("request line only spaces", b"     \r\n\r\n"),
        ("no version", b"GET /metrics\r\n\r\n"),
        ("HTTP/9.9", b"GET /metrics HTTP/9.9\r\n\r\n"),
        ("HTTP/0.9 style", b"GET /metrics\n"),
        ("bad method", b"BREW /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("method 10k", b"G" * 10000 + b" /metrics HTTP/1.1\r\n\r\n"),
        ("path 100k", b"GET /" + b"a" * 100000 + b" HTTP/1.1\r\n\r\n"),
        ("path unknown", b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("path traversal", b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("percent garbage", b"GET /%ff%00%zz HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("header 1 MB", b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"),
        ("10000 headers", b"GET /metrics HTTP/1.1\r\n" + b"X-A: b\r\n" * 10000 + b"\r\n"),
        ("header without colon", b"GET /metrics HTTP/1.1\r\nHost x\r\n\r\n"),
        ("header folded", b"GET /metrics HTTP/1.1\r\nHost: x\r\n continued\r\n\r\n"),
        ("content-length negative", b"POST /metrics HTTP/1.1\r\nContent-Length: -5\r\n\r\n"),
        ("content-length huge", b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\nabc"),
        ("content-length twice", b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabc"),
        ("chunked garbage", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n"),
        ("chunked size overflow", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n"),
        ("bare LF lines", b"GET /metrics HTTP/1.1\nHost: x\n\n"),
        ("NUL in request line", b"GET /met\x00rics HTTP/1.1\r\n\r\n"),
        ("binary 8k", bytes(rnd.randrange(256) for _ in range(8192))),
        ("binary 8k with end of head", bytes(rnd.randrange(256) for _ in range(8192)) + b"\r\n\r\n"),
        ("high bytes in header", b"GET /metrics HTTP/1.1\r\nX: \xff\xfe\x80\r\n\r\n"),
        ("HTTP/2 preface", PREFACE + frame(4, 0, 0)),
        ("TLS client hello", bytes.fromhex("160301002e0100002a0303") + bytes(32) + b"\x00\x00\x02\x00\x2f\x01\x00"),
        ("pipelined 200 requests", b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 200),
        ("request cut", b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: te"),
        ("absolute URI", b"GET http://evil/metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
        ("CONNECT", b"CONNECT 127.0.0.1:22 HTTP/1.1\r\n\r\n"),
        # bodies, chunks and the rest of what td_http's parser (libhttp-parser) takes
        ("content-length and chunked", b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"),
        ("transfer-encoding gzip", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\nabc"),
        ("transfer-encoding chunked twice", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        ("transfer-encoding xchunked", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n"),
        ("content-length with plus", b"POST /metrics HTTP/1.1\r\nContent-Length: +3\r\n\r\nabc"),
        ("content-length 1e3", b"POST /metrics HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n"),
        ("space before colon", b"POST /metrics HTTP/1.1\r\nContent-Length : 3\r\n\r\nabc"),
        ("body 2 MB declared and sent", b"POST /metrics HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n" + b"b" * 2000000),
        ("chunked 2 MB in 1 KB chunks", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"c" * 1024 * 2048 + b"\r\n"),
        ("10000 empty chunks", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0;e\r\n" * 10000),
        ("chunk extension 100k", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"x" * 100000 + b"\r\na\r\n0\r\n\r\n"),
        ("chunk size 64 digits", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0" * 63 + b"1\r\na\r\n0\r\n\r\n"),
        ("chunk without CRLF", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n"),
        ("trailers 1 MB", b"POST /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"T: " + b"t" * (1 << 20) + b"\r\n\r\n"),
        ("expect 100-continue, huge body", b"POST /metrics HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 999999999\r\n\r\n"),
        ("expect 100-continue, body", b"POST /metrics HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok"),
        ("expect teapot", b"GET /metrics HTTP/1.1\r\nExpect: teapot\r\n\r\n"),
        ("upgrade websocket", b"GET /metrics HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x85garbage"),
        ("upgrade h2c", b"GET /metrics HTTP/1.1\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"),
        ("HTTP/1.0 keep-alive pipelined", b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" * 20),
        ("pipelined bodies then garbage", b"POST /metrics HTTP/1.1\r\nContent-Length: 1\r\n\r\nx" * 50 + b"\x00\x01\x02\r\n\r\n"),
        ("HEAD pipelined", b"HEAD /metrics HTTP/1.1\r\n\r\n" * 20),
        ("leading CRLFs 100k", b"\r\n" * 50000 + b"GET /metrics HTTP/1.1\r\n\r\n"),
        ("request smuggling CL.TE", b"POST /metrics HTTP/1.1\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG"),
        ("header name with NUL", b"GET /metrics HTTP/1.1\r\nX\x00Y: z\r\n\r\n"),
        ("header value with CR", b"GET /metrics HTTP/1.1\r\nX: a\rb\r\n\r\n"),
        ("random bytes after a request", b"GET /metrics HTTP/1.1\r\n\r\n" + bytes(rnd.randrange(256) for _ in range(4096))),
    ]


def grpc_bodies(rnd):
    """Message bodies for a stock gRPC client: (name, method, body)."""
    good = good_request()
    out = []
    for what, body in [("bad varint", b"\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"),
                       ("length past the end", b"\x12\x40\x01\x02"), ("wrong wire type for prompt_ids", b"\x15\x01\x02\x03\x04"),
                       ("group wire type", b"\x0b\x0c"), ("end group", b"\x0c"), ("field 0", b"\x00\x01"),
                       ("field number 2^29", b"\xf8\xff\xff\xff\x0f\x01"), ("wire type 6", b"\x1e\x01"),
                       ("10-byte varint key", b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"),
                       ("prompt string not utf8", pb_bytes(1, b"\xff\xfe\xfd") + pb_varint(3, 2)),
                       ("packed ids cut mid varint", pb_varint(3, 2) + pb_bytes(2, b"\x01\x80")),
                       ("sampling length past end", pb_varint(3, 2) + pb_bytes(2, b"\x01") + b"\x22\x7f\x0d"),
                       ("sampling not a message", pb_varint(3, 2) + pb_bytes(2, b"\x01") + pb_bytes(4, b"\xff\xff")),
                       ("nested sampling 100 deep", pb_varint(3, 2) + pb_bytes(2, b"\x01") +
                        b"".join([b"\x22\x7f"] * 100)),
                       ("random 16", bytes(rnd.randrange(256) for _ in range(16))),
                       ("random 1k", bytes(rnd.randrange(256) for _ in range(1024)))]:
        out.append((what, GENERATE, body))
    for k in range(1, len(good)):
        out.append(("valid request cut at %d" % k, GENERATE, good[:k]))
    for k in range(12):
        b = bytearray(good)
        i = rnd.randrange(len(b))
        b[i] ^= 1 << rnd.randrange(8)
        out.append(("valid request, bit flip %d at byte %d" % (k, i), GENERATE, bytes(b)))
    for method in ("/tandem.control.v1.Registry/RegisterNode", "/tandem.control.v1.Registry/Heartbeat"):
        for what, body in [("bad varint", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"),
                           ("length past the end", b"\x0a\x40\x01\x02"), ("group wire type", b"\x0b\x0c")]:
            out.append(("%s %s" % (method.rsplit("/", 1)[1], what), method, body))
    return out


# ---------------------------------------------------------------------------- group 1: GGUF

GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes


def gguf_parse(b):
    """The byte layout of a GGUF file: {"kv": {key: (entry_start, type_at, value_at, end)},
    "tensors": [(name, start, ndims_at, ne_at, type_at, offset_at, end)], "data": offset}."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)

    def string(p):
        n = struct.unpack_from("<Q", b, p)[0]
        return b[p + 8:p + 8 + n].decode("utf-8", "replace"), p + 8 + n

    def value(t, p):
        if t in GGUF_SCALAR:
            return p + GGUF_SCALAR[t]
        if t == 8:
            return string(p)[1]
        et, n = struct.unpack_from("<IQ", b, p)
        p += 12
        for _ in range(n):
            p = value(et, p)
        return p

    kv, align = {}, 32
    for _ in range(n_kv):
        start = pos
        key, pos = string(pos)
        t = struct.unpack_from("<I", b, pos)[0]
        end = value(t, pos + 4)
        kv[key] = (start, pos, pos + 4, end)
        if key == "general.alignment":
            align = struct.unpack_from("<I", b, pos + 4)[0]
        pos = end
    tensors = []
    for _ in range(n_tensors):
        start = pos
        name, pos = string(pos)
        nd = struct.unpack_from("<I", b, pos)[0]
        ne_at = pos + 4
        type_at = ne_at + 8 * nd
        tensors.append((name, start, pos, ne_at, type_at, type_at + 4, type_at + 12))
        pos = type_at + 12
    return {"kv": kv, "tensors": tensors, "data": (pos + align - 1) // align * align}


def patch(b, at, fmt, *v):
    b = bytearray(b)
    struct.pack_into(fmt, b, at, *v)
    return bytes(b)


def gguf_cases(mc, g, rnd):
    """Mutations of a synthetic GGUF (`tandem model synth --format gguf`): every header count,
    length, type and offset the reader checks, hyperparameters that disagree with the tensors,
    and tokenizer metadata (`model info` does not read the tokenizer: generate must refuse)."""
    L = gguf_parse(g)
    kv, ts = L["kv"], L["tensors"]
    for tag, blob in [("empty", b""), ("magic-only", g[:4]), ("header-cut", g[:20]), ("zeros", bytes(len(g))),
                      ("not-gguf", b"GGUX" + g[4:])]:
        mc.add_file("gguf-%s" % tag, "error", blob)
    for frac in (0.05, 0.2, 0.4, 0.6, 0.8, 0.99):
        cut = int(len(g) * frac)
        mc.add_file("gguf-cut-%d" % int(frac * 100), "error", g[:cut])
    mc.add_file("gguf-cut-in-metadata", "error", g[:(kv["general.architecture"][3] + 3)])
    mc.add_file("gguf-cut-in-tensor-infos", "error", g[:ts[len(ts) // 2][1] + 5])
    for tag, v in [("v1", 1), ("v4", 4), ("big-endian", 0x03000000)]:
        mc.add_file("gguf-version-%s" % tag, "error", patch(g, 4, "<I", v))
    for tag, v in [("huge", 1 << 62), ("plus-one", len(ts) + 1), ("zero", 0)]:
        mc.add_file("gguf-tensor-count-%s" % tag, "error", patch(g, 8, "<Q", v))
    for tag, v in [("huge", 1 << 62), ("plus-one", len(kv) + 1)]:
        mc.add_file("gguf-kv-count-%s" % tag, "error", patch(g, 16, "<Q", v))
    first = kv["general.architecture"]
    mc.add_file("gguf-key-length-huge", "error", patch(g, first[0], "<Q", 1 << 60))
    mc.add_file("gguf-value-type-bogus", "error", patch(g, first[1], "<I", 99))
    mc.add_file("gguf-string-length-huge", "error", patch(g, first[2], "<Q", 1 << 40))
    toks = kv.get("tokenizer.ggml.tokens")
    if toks:
        mc.add_file("gguf-array-length-huge", "error", patch(g, toks[2] + 4, "<Q", 1 << 61))
        mc.add_file("gguf-array-nested", "error", patch(g, toks[2], "<I", 9))
    if "general.alignment" in kv:
        for tag, v in [("zero", 0), ("three", 3), ("huge", 1 << 30)]:
            mc.add_file("gguf-alignment-%s" % tag, "error", patch(g, kv["general.alignment"][2], "<I", v))
    # tensor infos: a 2-D weight of a layer
    name, start, nd_at, ne_at, type_at, off_at, end = next(t for t in ts if ".attn_q." in t[0])
    ne0, ne1 = struct.unpack_from("<QQ", g, ne_at)
    offset = struct.unpack_from("<Q", g, off_at)[0]
    mc.add_file("gguf-ndims-5", "error", patch(g, nd_at, "<I", 5))
    mc.add_file("gguf-ndims-huge", "error", patch(g, nd_at, "<I", 1 << 31))
    mc.add_file("gguf-ne-huge", "error", patch(g, ne_at, "<Q", 1 << 40))
    mc.add_file("gguf-ne-overflow", "error", patch(g, ne_at, "<QQ", 1 << 33, 1 << 33))
    mc.add_file("gguf-ne-zero", "error", patch(g, ne_at, "<Q", 0))
    gate = next(t for t in ts if ".ffn_gate." in t[0])  # not square
    g0, g1 = struct.unpack_from("<QQ", g, gate[3])
    mc.add_file("gguf-ne-transposed", "error", patch(g, gate[3], "<QQ", g1, g0))
    for tag, v in [("bogus", 99), ("q5_k", 13)]:
        mc.add_file("gguf-tensor-type-%s" % tag, "error", patch(g, type_at, "<I", v))
    # a smaller block type: the data still lies inside the file (the reader allows gaps
    # between tensors), so loading it is as right as refusing it
    mc.add_file("gguf-tensor-type-q4_0-smaller", "any", patch(g, type_at, "<I", 2))
    mc.add_file("gguf-offset-misaligned", "error", patch(g, off_at, "<Q", offset + 1))
    mc.add_file("gguf-offset-past-end", "error", patch(g, off_at, "<Q", len(g)))
    mc.add_file("gguf-offset-huge", "error", patch(g, off_at, "<Q", (1 << 64) - 32))
    other = next(t for t in ts if t[0] != name and ".attn_k." in t[0])
    mc.add_file("gguf-offset-overlap", "error",
                patch(g, off_at, "<Q", struct.unpack_from("<Q", g, other[5])[0]))
    # a duplicate tensor name: the name's bytes of another tensor of the same length
    same = next((t for t in ts if t[0] != name and len(t[0]) == len(name)), None)
    if same:
        b = bytearray(g)
        b[same[1] + 8:same[1] + 8 + len(name)] = name.encode()
        mc.add_file("gguf-tensor-name-duplicate", "error", bytes(b))
    # hyperparameters
    arch = "llama"
    for key, fmt, v, expect in [("block_count", "<I", 0, "error"), ("block_count", "<I", 1 << 30, "error"),
                                ("embedding_length", "<I", ne0 * 2, "error"),
                                ("attention.head_count", "<I", 0, "error"),
                                ("attention.head_count_kv", "<I", 3, "error"),
                                ("context_length", "<I", 0, "error"),
                                ("attention.layer_norm_rms_epsilon", "<f", float("nan"), "error"),
                                ("rope.freq_base", "<f", float("inf"), "error"),
                                ("feed_forward_length", "<I", 7, "error")]:
        k = "%s.%s" % (arch, key)
        if k in kv:
            mc.add_file("gguf-%s-%s" % (key.replace(".", "-"), str(v).replace(".", "")), expect,
                        patch(g, kv[k][2], fmt, v))
    if "%s.block_count" % arch in kv:
        mc.add_file("gguf-block-count-string-type", "error", patch(g, kv["%s.block_count" % arch][1], "<I", 8))
    mc.add_file("gguf-arch-unknown", "error", patch(g, kv["general.architecture"][2] + 8, "5s", b"gpt_x"))
    # the tokenizer's metadata: generate must refuse, model info need not read it
    if toks:
        mc.add_file("gguf-tok-tokens-short", "generate-error", patch(g, toks[2] + 4, "<Q",
                                                                    struct.unpack_from("<Q", g, toks[2] + 4)[0] - 1))
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if key in kv:
            mc.add_file("gguf-%s-out-of-range" % key.split(".")[-1], "error", patch(g, kv[key][2], "<I", 1 << 30))
    if "tokenizer.ggml.model" in kv:
        at = kv["tokenizer.ggml.model"][2]
        n = struct.unpack_from("<Q", g, at)[0]
        mc.add_file("gguf-tok-model-unknown", "generate-error", patch(g, at + 8, "%ds" % n, b"z" * n))
    if "tokenizer.ggml.token_type" in kv:
        mc.add_file("gguf-tok-token-type-wrong-type", "generate-error",
                    patch(g, kv["tokenizer.ggml.token_type"][2], "<I", 8))
    for _ in range(12):  # random bytes in the metadata
        b = bytearray(g)
        for _ in range(4):
            b[rnd.randrange(24, ts[0][1])] = rnd.randrange(256)
        mc.add_file("gguf-metadata-noise-%d" % _, "any", bytes(b))


# ---------------------------------------------------------------------------- main


def main(argv):
    out, base, gguf, seed = None, None, None, 21
    args = list(argv[1:])
    while args:
        a = args.pop(0)
        if a == "--base":
            base = args.pop(0)
        elif a == "--gguf":
            gguf = args.pop(0)
        elif a == "--seed":
            seed = int(args.pop(0))
        elif out is None:
            out = a
        else:
            sys.exit("usage: gen.py OUT_DIR --base MODEL_DIR [--gguf FILE.gguf] [--seed N]")
    if not out or not base:
        sys.exit("usage: gen.py OUT_DIR --base MODEL_DIR [--gguf FILE.gguf] [--seed N]")
    rnd = random.Random(seed)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(base, "model.safetensors"), "rb") as f:
        st = f.read()
    with open(os.path.join(base, "tokenizer.json")) as f:
        tok = f.read()
    with open(os.path.join(base, "tokenizer_config.json")) as f:
        tcfg = f.read()
    mc = ModelCases(out, base)
    config_cases(mc, cfg, rnd)
    safetensors_cases(mc, st, rnd)
    tokenizer_cases(mc, tok, tcfg)
    if gguf:
        with open(gguf, "rb") as f:
            gguf_cases(mc, f.read(), rnd)
    with open(os.path.join(out, "model.jsonl"), "w") as f:
        for r in mc.rows:
            f.write(json.dumps(r) + "\n")
    flags = flag_cases(rnd)
    with open(os.path.join(out, "flags.jsonl"), "w") as f:
        for r in flags:
            f.write(json.dumps(r) + "\n")
    net = []
    for what, data in h2_payloads(rnd):
        net.append({"name": what, "target": "gateway", "hex": data.hex()})
    for what, data in h2_payloads(random.Random(seed + 1))[:40]:
        net.append({"name": what, "target": "control", "hex": data.hex()})
    for what, data in http_payloads(rnd):
        net.append({"name": what, "target": "metrics", "hex": data.hex()})
    # connections the client never half-closes: the server's own deadlines must close them
    # (gRPC handshake_timeout_ms, HTTP request_timeout_ms: 10 s; docs/wire.md; HTTP's idle 30 s
    # for a connection that sends nothing is too long to wait for here)
    for target, what, data in [("gateway", "half preface, left open", PREFACE[:16]),
                               ("gateway", "preface without SETTINGS, left open", PREFACE),
                               ("gateway", "nothing sent, left open", b""),
                               ("control", "half preface, left open", PREFACE[:16]),
                               ("metrics", "request cut, left open", b"GET /metrics HTTP/1.1\r\nHost: x\r\nAcc")]:
        net.append({"name": what, "target": target, "hex": data.hex(), "left_open": True})
    for what, method, body in grpc_bodies(rnd):
        net.append({"name": what, "target": "grpc", "method": method, "hex": body.hex()})
    with open(os.path.join(out, "net.jsonl"), "w") as f:
        for r in net:
            f.write(json.dumps(r) + "\n")
    print("corpus %s: %d model cases, %d flag cases, %d network cases (seed %d)" %
          (out, len(mc.rows), len(flags), len(net), seed))


if __name__ == "__main__":
    main(sys.argv)
