#!/usr/bin/python3
"""cluster_stock_client: a stock gRPC client (Debian's python3-grpcio) with message classes
generated from proto/tandem.proto by `protoc --python_out` streams a generation from a
tandem router (used by tests/cluster/test_cluster_stock.sh).

usage: cluster_stock_client.py PROTO_DIR HOST:PORT PROMPT MAX_TOKENS TEXT_OUT
Sends GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, greedy, request_id="stock-1"),
prints the streamed ids on one line to stdout and writes the concatenated text (UTF-8) to
TEXT_OUT. Checks the stream's shape on the way: request_id on the first and last message,
finish_reason, usage and timings on the last message only, usage.completion_tokens equal to
the ids received, timings non-negative with total >= first token > 0. Also calls
ListModels and grpc.health.v1.Health/Check. Exit 0 = good, 1 = a check failed (the reason
on stderr), 77 = grpc/protobuf/protoc missing ("SKIP: ..." on stdout).
"""
import os
import shutil
import subprocess
import sys
import tempfile

try:
    import grpc
    import google.protobuf  # noqa: F401
except ImportError as e:
    print(f"SKIP: /usr/bin/python3 lacks grpc/protobuf ({e})")
    sys.exit(77)
if shutil.which("protoc") is None:
    print("SKIP: protoc not found (install protobuf-compiler)")
    sys.exit(77)


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    proto_dir, target, prompt, max_tokens, text_out = sys.argv[1:6]
    with tempfile.TemporaryDirectory(prefix="tandem-pb2-") as out:
        subprocess.run(["protoc", f"-I{proto_dir}", f"--python_out={out}", "tandem.proto", "health.proto"],
                       check=True)
        sys.path.insert(0, out)
        import health_pb2
        import tandem_pb2

    pb = tandem_pb2
    with grpc.insecure_channel(target) as ch:
        health = ch.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                response_deserializer=health_pb2.HealthCheckResponse.FromString)
        h = health(health_pb2.HealthCheckRequest(), timeout=10)
        if h.status != health_pb2.HealthCheckResponse.SERVING:
            fail(f"health status {h.status}, expected SERVING")
        lm = ch.unary_unary("/tandem.v1.Generation/ListModels",
                            request_serializer=pb.ListModelsRequest.SerializeToString,
                            response_deserializer=pb.ListModelsResponse.FromString)(pb.ListModelsRequest(),
                                                                                    timeout=10)
        if len(lm.models) != 1:
            fail(f"ListModels: {lm}")

        gen = ch.unary_stream("/tandem.v1.Generation/Generate",
                              request_serializer=pb.GenerateRequest.SerializeToString,
                              response_deserializer=pb.GenerateResponse.FromString)
        req = pb.GenerateRequest(prompt=prompt, max_tokens=int(max_tokens), request_id="stock-1",
                                 sampling=pb.SamplingParams(temperature=0.0))
        msgs = list(gen(req, timeout=30))

    if not msgs:
        fail("the stream had no message")
    ids = [i for m in msgs for i in m.token_ids]
    text = "".join(m.text for m in msgs)
    first, last = msgs[0], msgs[-1]
    if first.request_id != "stock-1" or last.request_id != "stock-1":
        fail(f"request_id: first '{first.request_id}', last '{last.request_id}', expected 'stock-1'")
    for m in msgs[:-1]:
        if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED or m.HasField("usage") or m.HasField("timings"):
            fail(f"a message before the last carries finish/usage/timings: {m}")
    if last.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        fail("the last message has no finish_reason")
    if not last.HasField("usage") or not last.HasField("timings"):
        fail(f"the last message lacks usage or timings: {last}")
    if last.usage.completion_tokens != len(ids) or last.usage.prompt_tokens == 0:
        fail(f"usage {last.usage} but {len(ids)} ids received")
    t = last.timings
    vals = [t.queue_s, t.prefill_s, t.transfer_s, t.first_token_s, t.per_token_s, t.total_s]
    if any(v < 0 for v in vals) or t.first_token_s <= 0 or t.total_s < t.first_token_s:
        fail(f"timings out of order: {t}")
    with open(text_out, "w", encoding="utf-8") as f:
        f.write(text)
    print(" ".join(map(str, ids)))
    print(f"messages {len(msgs)} finish {pb.FinishReason.Name(last.finish_reason)} "
          f"prompt_tokens {last.usage.prompt_tokens} first_token_s {t.first_token_s:.6f}", file=sys.stderr)


main()
