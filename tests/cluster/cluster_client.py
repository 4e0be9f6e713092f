"""cluster_client: a stock grpcio client of tandem.v1.Generation/Generate for the cluster tests.

usage: cluster_client.py HOST:PORT MAX_TOKENS "ids" ["ids" ...]
Sends every prompt concurrently (one thread each) and prints, per prompt in order, the
generated ids on one line (or 'ERROR <code> <details>'). Messages are built by hand from the
field numbers of proto/tandem.proto (cluster_wire.py), so no generated stubs are needed.
"""
import sys
import threading

import grpc

from cluster_wire import channel, generate_stub, parse_ids, request


def main():
    target, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    call = generate_stub(channel(target))
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
