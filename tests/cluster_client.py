"""cluster_client: a stock grpcio client of tandem.v1.Generation/Generate for the cluster tests.

usage: cluster_client.py HOST:PORT MAX_TOKENS "ids" ["ids" ...]
Sends every prompt concurrently (one thread each) and prints, per prompt in order, the
generated ids on one line (or 'ERROR <code> <details>'). Messages are built by hand from the
field numbers of proto/tandem.proto, so no generated stubs are needed.
"""
import sys
import threading

import grpc


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


def request(ids, max_tokens):
    packed = b"".join(varint(i) for i in ids)
    return (b"\x12" + varint(len(packed)) + packed) + b"\x18" + varint(max_tokens)


def parse_ids(msg):
    ids, i = [], 0
    while i < len(msg):
        key = msg[i]; i += 1
        field, wt = key >> 3, key & 7
        if wt == 0:
            v = 0; s = 0
            while True:
                b = msg[i]; i += 1; v |= (b & 0x7F) << s; s += 7
                if not b & 0x80:
                    break
            if field == 1:
                ids.append(v)
        elif wt == 2:
            ln = 0; s = 0
            while True:
                b = msg[i]; i += 1; ln |= (b & 0x7F) << s; s += 7
                if not b & 0x80:
                    break
            if field == 1:
                j = i
                while j < i + ln:
                    v = 0; s = 0
                    while True:
                        b = msg[j]; j += 1; v |= (b & 0x7F) << s; s += 7
                        if not b & 0x80:
                            break
                    ids.append(v)
            i += ln
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
    return ids


def main():
    target, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    ch = grpc.insecure_channel(target)
    call = ch.unary_stream("/tandem.v1.Generation/Generate", request_serializer=lambda b: b,
                           response_deserializer=lambda b: b)
    results = [None] * len(prompts)

    def run(k):
        ids = [int(x) for x in prompts[k].split()]
        out = []
        try:
            for m in call(request(ids, max_tokens), timeout=120):
                out += parse_ids(m)
            results[k] = " ".join(map(str, out))
        except grpc.RpcError as e:
            results[k] = "ERROR %s %s" % (e.code().name, e.details())

    ts = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for r in results:
        print(r)


main()
