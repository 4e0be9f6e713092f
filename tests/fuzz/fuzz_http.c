/*
 * fuzz_http: raw bytes into td_http, the router's HTTP/1.1 server (libhttp-parser under
 * it): request lines, headers, chunked and sized bodies, pipelining, keep-alive, garbage.
 * The handler answers every request (a small body, or a chunked stream for /stream, as
 * the SSE answers do), so the parser, the writer and the connection's life all run; a head
 * check refuses /locked without an Authorization header before its body, as the router's
 * key check does, and a small budget of bodies in flight refuses what does not fit.
 * Seeds: tests/fuzz/corpus/http (what the OpenAI clients and Prometheus send).
 */
#include "fuzz_net.h"
#include "td_http.h"

static void handle(void *data, td_http_req_t *req)
{
    (void)data;
    size_t n = 0;
    const char *body = td_http_req_body(req, &n);
    (void)td_http_req_header(req, "content-type");
    if (!strcmp(td_http_req_path(req), "/stream")) {
        if (td_http_stream_begin(req, 200, "text/event-stream") == TD_OK) {
            (void)td_http_stream_write(req, "data: {}\n\n", 10);
            td_http_stream_end(req);
        }
        return;
    }
    td_http_respond(req, 200, "application/json", body ? body : "", n);
}

/* Decides on the head, as the router's front door does with its API key: /locked is
 * refused before its body is read (the connection closes after it when one was declared). */
static void head(void *data, td_http_req_t *req)
{
    (void)data;
    if (!strncmp(td_http_req_path(req), "/locked", 7) && !td_http_req_header(req, "authorization")) {
        (void)td_http_resp_header(req, "WWW-Authenticate", "Bearer");
        td_http_respond(req, 401, NULL, "no key\n", 7);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uv_loop_t loop;
    static td_http_server_t *srv;
    if (!srv) {
        fuzz_dir(); /* logging off */
        uv_loop_init(&loop);
        td_http_config_t cfg = td_http_config_default();
        cfg.port = 0;
        cfg.handler = handle;
        cfg.on_head = head;
        static td_rpc_budget_t budget = {.limit = 16384}; /* the 503 path too */
        cfg.body_budget = &budget;
        cfg.max_body_bytes = 4096;
        cfg.request_timeout_ms = 1000;
        cfg.idle_timeout_ms = 1000;
        if (td_http_server_create(&loop, &cfg, &srv) != TD_OK)
            abort();
    }
    fuzz_net_feed(&loop, td_http_server_port(srv), data, size);
    return 0;
}
