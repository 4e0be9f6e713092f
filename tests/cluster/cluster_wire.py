"""cluster_wire: the protobuf, gRPC and HTTP bits the cluster test clients share
(cluster_faults.py, cluster_client.py, the tests' inline clients): varints, GenerateRequest
bytes built from proto/tandem.proto's field numbers, the token ids of a GenerateResponse, raw
control-API fields, a grpcio stub of Generate that passes bytes through (no generated stubs
needed), and a JSON POST. Imported, not run.
"""
import struct
import urllib.error
import urllib.request

import grpc

GENERATE = "/tandem.v1.Generation/Generate"


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(buf, i):
    v = s = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << s
        s += 7
        if not b & 0x80:
            return v, i


def pb_varint(field, v):
    return varint(field << 3) + varint(v)


def pb_bytes(field, b):
    if isinstance(b, str):
        b = b.encode()
    return varint(field << 3 | 2) + varint(len(b)) + b


def pb_f32(field, v):
    """A float field (wire type 5): NaN and the infinities go through as their bits."""
    return varint(field << 3 | 5) + struct.pack("<f", v)


def pb_packed(field, vals):
    return pb_bytes(field, b"".join(varint(v) for v in vals))


def request(ids, max_tokens):
    """A GenerateRequest: prompt_ids (field 2, packed) and max_tokens (field 3)."""
    return pb_packed(2, ids) + pb_varint(3, max_tokens)


def raw_fields(msg):
    """(field number, wire type, value) of each field of one message: an int for a varint,
    bytes for a length-delimited or fixed-width field."""
    i = 0
    while i < len(msg):
        key, i = read_varint(msg, i)
        field, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(msg, i)
        elif wt == 2:
            ln, i = read_varint(msg, i)
            v, i = msg[i:i + ln], i + ln
        elif wt in (1, 5):
            n = 8 if wt == 1 else 4
            v, i = msg[i:i + n], i + n
        else:
            raise ValueError("bad wire type %d" % wt)
        yield field, wt, v


def fields(msg):
    """(field number, value) of each field of one message: an int for a varint, bytes for a
    length-delimited field; fixed-width fields are skipped."""
    return ((f, v) for f, wt, v in raw_fields(msg) if wt in (0, 2))


def parse_ids(msg):
    """token_ids (field 1, packed or not) of one GenerateResponse."""
    ids = []
    for field, v in fields(msg):
        if field != 1:
            continue
        if isinstance(v, int):
            ids.append(v)
            continue
        j = 0
        while j < len(v):
            x, j = read_varint(v, j)
            ids.append(x)
    return ids


def parse_text(msg):
    """text (field 2) of one GenerateResponse, "" when absent."""
    return next((v.decode("utf-8", "replace") for f, v in fields(msg) if f == 2 and isinstance(v, bytes)), "")


def channel(target):
    return grpc.insecure_channel(target)


def generate_stub(ch):
    return ch.unary_stream(GENERATE, request_serializer=lambda b: b, response_deserializer=lambda b: b)


def post_json(url, body, timeout=120):
    """POSTs the JSON text body to url: the answer's text, or None after printing
    "HTTP <status> <error body>" (what the tests' clients print for a refusal)."""
    req = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()
    except urllib.error.HTTPError as e:
        print("HTTP %d %s" % (e.code, e.read().decode()))
        return None
