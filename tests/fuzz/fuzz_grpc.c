/*
 * fuzz_grpc: raw bytes into td_grpc's server (nghttp2 under it): the HTTP/2 preface and
 * frames, HPACK headers, gRPC length-prefixed messages and their protobuf, deadlines
 * (grpc-timeout), resets, flow control. Two methods are served as the router's are: a
 * unary one that replies and a server-streaming one that sends three messages then ends.
 * Seeds: tests/fuzz/corpus/grpc (what a stock grpcio client sends for a Generate call
 * and a health check, recorded by make_seeds.py).
 */
#include "fuzz_net.h"
#include "health.pb-c.h"
#include "tandem.pb-c.h"
#include "td_grpc.h"

static void health(td_grpc_call_t *call, const ProtobufCMessage *request, void *data)
{
    (void)request, (void)data;
    Grpc__Health__V1__HealthCheckResponse r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    r.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    td_grpc_call_reply(call, &r.base);
}

static void generate(td_grpc_call_t *call, const ProtobufCMessage *request, void *data)
{
    (void)data;
    const Tandem__V1__GenerateRequest *q = (const void *)request;
    for (int i = 0; i < 3; i++) {
        Tandem__V1__GenerateResponse r = TANDEM__V1__GENERATE_RESPONSE__INIT;
        r.text = q->prompt && *q->prompt ? q->prompt : "t";
        if (td_grpc_call_send(call, &r.base) != TD_OK)
            break;
    }
    td_grpc_call_finish(call, TD_GRPC_OK, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uv_loop_t loop;
    static td_grpc_server_t *srv;
    if (!srv) {
        fuzz_dir(); /* logging off */
        uv_loop_init(&loop);
        td_grpc_server_config_t cfg = td_grpc_server_config_default();
        cfg.port = 0;
        cfg.handshake_timeout_ms = 1000;
        cfg.request_timeout_ms = 1000;
        if (td_grpc_server_create(&loop, &cfg, &srv) != TD_OK ||
            td_grpc_server_add_method(srv, "/grpc.health.v1.Health/Check",
                                      &grpc__health__v1__health_check_request__descriptor, health, NULL) != TD_OK ||
            td_grpc_server_add_method(srv, "/tandem.v1.Generation/Generate",
                                      &tandem__v1__generate_request__descriptor, generate, NULL) != TD_OK)
            abort();
    }
    fuzz_net_feed(&loop, td_grpc_server_port(srv), data, size);
    return 0;
}
