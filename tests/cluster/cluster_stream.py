"""cluster_stream: one Generate call through a stock grpcio client, every message shown.

usage: cluster_stream.py HOST:PORT REQUEST_ID MAX_TOKENS "ids" [TEMPERATURE SEED]
Prints one line per GenerateResponse, 'MSG <ids, comma-separated>|<text as a Python
repr>', then 'OK' when the stream ends with status OK, or 'ERROR <code> <details>'.
The request is built by hand from proto/tandem.proto's field numbers (cluster_wire.py).
"""
import struct
import sys

import grpc

from cluster_wire import channel, generate_stub, parse_ids, parse_text, pb_bytes, pb_varint, request


def main():
    target, rid, max_tokens, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    req = request([int(x) for x in ids.split()], max_tokens) + pb_bytes(7, rid)
    if len(sys.argv) > 6:  # SamplingParams: temperature (1, float) and seed (6)
        sp = bytes([1 << 3 | 5]) + struct.pack("<f", float(sys.argv[5])) + pb_varint(6, int(sys.argv[6]))
        req += pb_bytes(4, sp)
    try:
        for m in generate_stub(channel(target))(req, timeout=60):
            print("MSG %s|%r" % (",".join(map(str, parse_ids(m))), parse_text(m)))
        print("OK")
    except grpc.RpcError as e:
        print("ERROR %s %s" % (e.code().name, e.details()))


main()
