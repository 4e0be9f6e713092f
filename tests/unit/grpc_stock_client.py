#!/usr/bin/python3
"""A stock gRPC client (Debian's python3-grpcio) against a tandem gRPC server.

Usage: grpc_stock_client.py PROTO_DIR HOST:PORT
Generates message classes from proto/tandem.proto and proto/health.proto with
`protoc --python_out` into a temp dir (Debian ships no grpc_tools, so no service stubs)
and calls the methods through grpc's generic channel.unary_unary / unary_stream.
Checks: ListModels (unary), Generate (server streaming, 20 tokens), Health/Check,
an unknown method (UNIMPLEMENTED) and a deadline (DEADLINE_EXCEEDED). Exit 0 = all
good; prints "SKIP: reason" and exits 77 when grpc or protoc is missing.
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
    print(f"SKIP: python3 lacks grpc/protobuf ({e})")
    sys.exit(77)

if shutil.which("protoc") is None:
    print("SKIP: protoc not found")
    sys.exit(77)


def main():
    proto_dir, target = sys.argv[1], sys.argv[2]
    out = tempfile.mkdtemp(prefix="tandem-pb2-")
    try:
        subprocess.run(["protoc", f"-I{proto_dir}", f"--python_out={out}", "tandem.proto", "health.proto"],
                       check=True, cwd=proto_dir)
        sys.path.insert(0, out)
        import tandem_pb2
        import health_pb2
    finally:
        pass

    def unary(ch, method, req_cls, resp_cls):
        return ch.unary_unary(method, request_serializer=req_cls.SerializeToString,
                              response_deserializer=resp_cls.FromString)

    with grpc.insecure_channel(target) as ch:
        lm = unary(ch, "/tandem.v1.Generation/ListModels", tandem_pb2.ListModelsRequest,
                   tandem_pb2.ListModelsResponse)(tandem_pb2.ListModelsRequest(), timeout=10)
        assert [m.name for m in lm.models] == ["stories-test"], lm

        gen = ch.unary_stream("/tandem.v1.Generation/Generate",
                              request_serializer=tandem_pb2.GenerateRequest.SerializeToString,
                              response_deserializer=tandem_pb2.GenerateResponse.FromString)
        req = tandem_pb2.GenerateRequest(prompt="Once upon a time", prompt_ids=[1, 2, 3], max_tokens=20,
                                         request_id="py-1",
                                         sampling=tandem_pb2.SamplingParams(temperature=0.0, seed=7))
        ids, text, last = [], "", None
        for r in gen(req, timeout=10):
            ids.extend(r.token_ids)
            text += r.text
            last = r
        assert ids == list(range(1000, 1020)), ids
        assert text.startswith("t0 t1 "), text
        assert last.finish_reason == tandem_pb2.FINISH_REASON_LENGTH, last
        assert last.usage.prompt_tokens == 3 and last.usage.completion_tokens == 20, last.usage
        assert last.request_id == "py-1"

        hc = unary(ch, "/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest,
                   health_pb2.HealthCheckResponse)(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert hc.status == health_pb2.HealthCheckResponse.SERVING, hc

        try:
            unary(ch, "/tandem.v1.Generation/Nope", tandem_pb2.ListModelsRequest,
                  tandem_pb2.ListModelsResponse)(tandem_pb2.ListModelsRequest(), timeout=10)
            raise AssertionError("unknown method succeeded")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e

        try:
            list(gen(tandem_pb2.GenerateRequest(prompt="slow"), timeout=0.2))
            raise AssertionError("slow call succeeded")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e

        # the connection still serves after all that
        gen_ids = [i for r in gen(tandem_pb2.GenerateRequest(max_tokens=3), timeout=10) for i in r.token_ids]
        assert gen_ids == [1000, 1001, 1002], gen_ids
    shutil.rmtree(out, ignore_errors=True)
    print("ok: ListModels, Generate stream, Health, UNIMPLEMENTED, DEADLINE_EXCEEDED")


if __name__ == "__main__":
    main()
