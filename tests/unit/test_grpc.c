/*
 * test_grpc: td_grpc client ↔ server on 127.0.0.1 (ephemeral ports), the server on its own
 * thread and loop (grpc_test_service.h), the client on the test's loop; plus raw sockets
 * speaking garbage, truncated HTTP/2 and HTTP/1.1 at the server. Every test ends with
 * both loops closed cleanly (uv_loop_close == 0), so a leaked handle fails.
 */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "control.pb-c.h"
#include "grpc_test_service.h"
#include "health.pb-c.h"
#include "tandem.pb-c.h"
#include "td_test_net.h"
#include "td_grpc_wire.h"
#include "td_util.h"

typedef struct result {
    int done;
    td_grpc_code_t code;
    char message[256];
    int n_messages;
    uint32_t last_token;
    bool in_order;
    size_t last_text_len;
    int finish_reason;
} result_t;

typedef struct client {
    uv_loop_t loop;
    td_grpc_channel_t *ch;
    test_server_t ts;
} client_t;

static void on_msg(td_grpc_client_call_t *call, const ProtobufCMessage *msg, void *data)
{
    result_t *r = data;
    const Tandem__V1__GenerateResponse *g = (const Tandem__V1__GenerateResponse *)msg;
    if (g->n_token_ids == 1) {
        if (r->n_messages > 0 && g->token_ids[0] != r->last_token + 1)
            r->in_order = false;
        r->last_token = g->token_ids[0];
    }
    r->last_text_len = strlen(g->text);
    r->finish_reason = g->finish_reason;
    r->n_messages++;
}

static void on_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    result_t *r = data;
    r->done++;
    r->code = code;
    snprintf(r->message, sizeof r->message, "%s", message);
}

/* Starts the test server (scfg NULL: the default config) and a channel to it (client_max:
 * the channel's message limit, 0 = default). */
static void client_start(client_t *c, const td_grpc_server_config_t *scfg, size_t client_max)
{
    signal(SIGPIPE, SIG_IGN);
    td_grpc_server_config_t defaults = td_grpc_server_config_default();
    uint16_t port = ts_start(&c->ts, scfg ? scfg : &defaults);
    cr_assert_neq(port, 0, "server did not start");
    cr_assert_eq(uv_loop_init(&c->loop), 0);
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    if (client_max)
        cc.max_message_bytes = client_max;
    cr_assert_eq(td_grpc_channel_create(&c->loop, "127.0.0.1", port, &cc, &c->ch), TD_OK);
}

static void client_stop(client_t *c)
{
    td_grpc_channel_close(c->ch, NULL, NULL);
    uv_run(&c->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&c->loop), 0, "client loop has handles left");
    cr_assert_eq(ts_stop(&c->ts), 0, "server loop has handles left");
}

/* Runs the loop until r->done (with a safety bound in loop iterations of 10 ms). */
static void run_until_done(client_t *c, result_t *r)
{
    for (int i = 0; i < 1000 && !r->done; i++)
        uv_run(&c->loop, UV_RUN_ONCE);
    cr_assert(r->done, "call did not finish");
}

static td_grpc_client_call_t *generate(client_t *c, const char *prompt, uint32_t max_tokens, uint32_t timeout_ms,
                                       result_t *r)
{
    Tandem__V1__GenerateRequest req = TANDEM__V1__GENERATE_REQUEST__INIT;
    req.prompt = (char *)prompt;
    req.max_tokens = max_tokens;
    req.request_id = "req-1";
    memset(r, 0, sizeof *r);
    r->in_order = true;
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__generate_response__descriptor,
                             .on_message = on_msg, .on_done = on_done, .data = r, .timeout_ms = timeout_ms};
    td_grpc_client_call_t *call = NULL;
    cr_assert_eq(td_grpc_channel_call(c->ch, "/tandem.v1.Generation/Generate", &req.base, &o, &call), TD_OK);
    return call;
}

/* Runs one Generate to its end and asserts that it ended with `want`. */
static void generate_to_end(client_t *c, const char *prompt, uint32_t max_tokens, uint32_t timeout_ms,
                            td_grpc_code_t want, result_t *r)
{
    generate(c, prompt, max_tokens, timeout_ms, r);
    run_until_done(c, r);
    cr_assert_eq(r->code, want, "%s %s", td_grpc_code_name(r->code), r->message);
}

static void list_models_ok(client_t *c)
{
    Tandem__V1__ListModelsRequest req = TANDEM__V1__LIST_MODELS_REQUEST__INIT;
    result_t r = {0};
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__list_models_response__descriptor,
                             .on_done = on_done, .data = &r, .timeout_ms = 5000};
    cr_assert_eq(td_grpc_channel_call(c->ch, "/tandem.v1.Generation/ListModels", &req.base, &o, NULL), TD_OK);
    run_until_done(c, &r);
    cr_assert_eq(r.code, TD_GRPC_OK, "ListModels: %s %s", td_grpc_code_name(r.code), r.message);
}

Test(grpc, unary_and_health, .timeout = 20)
{
    client_t c;
    client_start(&c, NULL, 0);
    list_models_ok(&c);
    Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    result_t r = {0};
    td_grpc_call_opts_t o = {.response_desc = &grpc__health__v1__health_check_response__descriptor,
                             .on_done = on_done, .data = &r};
    cr_assert_eq(td_grpc_channel_call(c.ch, "/grpc.health.v1.Health/Check", &hreq.base, &o, NULL), TD_OK);
    run_until_done(&c, &r);
    cr_assert_eq(r.code, TD_GRPC_OK);
    hreq.service = "nope";
    memset(&r, 0, sizeof r);
    cr_assert_eq(td_grpc_channel_call(c.ch, "/grpc.health.v1.Health/Check", &hreq.base, &o, NULL), TD_OK);
    run_until_done(&c, &r);
    cr_assert_eq(r.code, TD_GRPC_NOT_FOUND);
    cr_assert_str_eq(r.message, "unknown service");
    client_stop(&c);
}

Test(grpc, server_streaming, .timeout = 20)
{
    client_t c;
    client_start(&c, NULL, 0);
    result_t r;
    generate_to_end(&c, "hello", 5000, 10000, TD_GRPC_OK, &r);
    cr_assert_eq(r.n_messages, 5000);
    cr_assert(r.in_order);
    cr_assert_eq(r.last_token, 1000 + 4999);
    cr_assert_eq(r.finish_reason, TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    /* several concurrent streams on one connection */
    result_t rs[8];
    for (int i = 0; i < 8; i++)
        generate(&c, "hi", 100 + (uint32_t)i, 0, &rs[i]);
    for (int i = 0; i < 8; i++) {
        run_until_done(&c, &rs[i]);
        cr_assert_eq(rs[i].code, TD_GRPC_OK);
        cr_assert_eq(rs[i].n_messages, 100 + i);
    }
    client_stop(&c);
}

Test(grpc, message_size_limits, .timeout = 20)
{
    client_t c;
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    cfg.max_message_bytes = 64 * 1024;
    client_start(&c, &cfg, 1 << 20);
    size_t near = 64 * 1024 - 64; /* prompt + field overhead stays under the limit */
    char *big = malloc(80 * 1024);
    memcpy(big, "echo:", 5);
    memset(big + 5, 'a', near - 5);
    big[near] = '\0';
    result_t r;
    generate_to_end(&c, big, 0, 5000, TD_GRPC_OK, &r);
    cr_assert_eq(r.last_text_len, near);
    memset(big + 5, 'a', 70 * 1024);
    big[70 * 1024 + 5] = '\0';
    generate_to_end(&c, big, 0, 5000, TD_GRPC_RESOURCE_EXHAUSTED, &r);
    free(big);
    list_models_ok(&c); /* the connection is still fine */
    client_stop(&c);
}

Test(grpc, client_limit_refuses_large_request, .timeout = 20)
{
    client_t c;
    client_start(&c, NULL, 1024);
    Tandem__V1__GenerateRequest req = TANDEM__V1__GENERATE_REQUEST__INIT;
    char big[2048];
    memset(big, 'b', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    req.prompt = big;
    result_t r = {0};
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__generate_response__descriptor, .on_done = on_done,
                             .data = &r};
    cr_assert_eq(td_grpc_channel_call(c.ch, "/tandem.v1.Generation/Generate", &req.base, &o, NULL), TD_ERR_RANGE);
    cr_assert_eq(r.done, 0, "a failed start must not call back");
    client_stop(&c);
}

Test(grpc, deadline_exceeded, .timeout = 20)
{
    client_t c;
    client_start(&c, NULL, 0);
    result_t r;
    generate_to_end(&c, "slow", 1, 150, TD_GRPC_DEADLINE_EXCEEDED, &r);
    for (int i = 0; i < 200 && atomic_load(&c.ts.cancels) == 0; i++)
        usleep(10000);
    cr_assert_eq(atomic_load(&c.ts.cancels), 1, "the handler was not told");
    cr_assert_eq(atomic_load(&c.ts.cancel_reason), TD_ERR_TIMEOUT);
    list_models_ok(&c);
    client_stop(&c);
}

static void cancel_later(uv_timer_t *t)
{
    td_grpc_client_call_cancel(t->data);
}

Test(grpc, client_cancel_reaches_handler, .timeout = 20)
{
    client_t c;
    client_start(&c, NULL, 0);
    result_t r;
    td_grpc_client_call_t *call = generate(&c, "slow", 1, 0, &r);
    uv_timer_t t;
    uv_timer_init(&c.loop, &t);
    t.data = call;
    uv_timer_start(&t, cancel_later, 100, 0);
    run_until_done(&c, &r);
    uv_close((uv_handle_t *)&t, NULL);
    cr_assert_eq(r.code, TD_GRPC_CANCELLED);
    for (int i = 0; i < 300 && atomic_load(&c.ts.cancels) == 0; i++) {
        uv_run(&c.loop, UV_RUN_NOWAIT); /* let the RST_STREAM go out */
        usleep(10000);
    }
    cr_assert_eq(atomic_load(&c.ts.cancels), 1, "the handler did not see the cancel");
    cr_assert_eq(atomic_load(&c.ts.cancel_reason), TD_ERR_CANCELLED);
    list_models_ok(&c);
    client_stop(&c);
}

Test(grpc, unknown_method_and_invalid_protobuf, .timeout = 20)
{
    client_t c;
    client_start(&c, NULL, 0);
    result_t r = {0};
    Tandem__V1__ListModelsRequest req = TANDEM__V1__LIST_MODELS_REQUEST__INIT;
    td_grpc_call_opts_t o = {.on_done = on_done, .data = &r};
    cr_assert_eq(td_grpc_channel_call(c.ch, "/tandem.v1.Generation/Nope", &req.base, &o, NULL), TD_OK);
    run_until_done(&c, &r);
    cr_assert_eq(r.code, TD_GRPC_UNIMPLEMENTED);
    cr_assert(strstr(r.message, "/tandem.v1.Generation/Nope"), "message: %s", r.message);
    /* a truncated varint tag: not a GenerateRequest */
    memset(&r, 0, sizeof r);
    o.raw_request = "\xff\xff\xff";
    o.raw_request_len = 3;
    cr_assert_eq(td_grpc_channel_call(c.ch, "/tandem.v1.Generation/Generate", NULL, &o, NULL), TD_OK);
    run_until_done(&c, &r);
    cr_assert_eq(r.code, TD_GRPC_INTERNAL, "%s %s", td_grpc_code_name(r.code), r.message);
    list_models_ok(&c);
    client_stop(&c);
}

typedef struct bp_ctx {
    client_t *c;
    td_grpc_client_call_t *call;
    result_t *r;
    int checked;
    int seen_while_paused;
    size_t max_queued_while_paused;
} bp_ctx_t;

static void bp_check(uv_timer_t *t)
{
    bp_ctx_t *b = t->data;
    b->checked = 1;
    b->seen_while_paused = b->r->n_messages;
    b->max_queued_while_paused = atomic_load(&b->c->ts.bp_max_queued);
    td_grpc_client_call_pause(b->call, false);
}

Test(grpc, back_pressure_slow_reader, .timeout = 30)
{
    client_t c;
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    cfg.send_queue_bytes = 16 * 1024;
    client_start(&c, &cfg, 0);
    result_t r;
    td_grpc_client_call_t *call = generate(&c, "backpressure", 0, 0, &r);
    td_grpc_client_call_pause(call, true);
    bp_ctx_t b = {.c = &c, .call = call, .r = &r};
    uv_timer_t t;
    uv_timer_init(&c.loop, &t);
    t.data = &b;
    uv_timer_start(&t, bp_check, 500, 0);
    run_until_done(&c, &r);
    uv_close((uv_handle_t *)&t, NULL);
    cr_assert(b.checked);
    cr_assert_eq(r.code, TD_GRPC_OK, "%s %s", td_grpc_code_name(r.code), r.message);
    cr_assert_eq(r.n_messages, BP_MESSAGES);
    cr_assert(r.in_order);
    cr_assert_eq(b.seen_while_paused, 0, "messages were delivered while paused");
    cr_assert_gt(atomic_load(&c.ts.bp_busy), 0, "the producer was never held back");
    /* window (1 MiB) + queue bound + one message: far below 10k messages * ~110 bytes */
    cr_assert_leq(b.max_queued_while_paused, cfg.send_queue_bytes + 256);
    client_stop(&c);
}

/* ---- raw sockets at the gRPC port --------------------------------------------------- */

/* Reads until EOF; returns the bytes read (into buf, NUL-terminated) or -1 on timeout. */
/* Reads until the server closes: an end of stream, or a reset (a server that closes a
 * socket with bytes it has not read, e.g. a trickled preface's, sends RST, not FIN);
 * -1 for any other error (a receive timeout: the connection was kept). */
static ssize_t read_to_eof(int fd, char *buf, size_t cap)
{
    size_t len = 0;
    for (;;) {
        ssize_t n = recv(fd, buf + len, cap - 1 - len, 0);
        if (n == 0 || (n < 0 && errno == ECONNRESET))
            break;
        if (n < 0)
            return -1;
        len += (size_t)n;
        if (len + 1 >= cap)
            len = 0; /* keep reading, only the end matters */
    }
    buf[len] = '\0';
    return (ssize_t)len;
}

Test(grpc, bad_connections_do_not_hurt_others, .timeout = 30)
{
    client_t c;
    client_start(&c, NULL, 0);
    list_models_ok(&c);
    char buf[4096];

    /* garbage bytes: the connection is closed */
    int fd = td_test_connect(c.ts.port);
    send(fd, "\x17\x03\x01garbage garbage garbage garbage", 34, 0);
    cr_assert_geq(read_to_eof(fd, buf, sizeof buf), 0, "server kept a garbage connection open");
    close(fd);
    list_models_ok(&c);

    /* an HTTP/1.1 request: a plain 505 answer, then close */
    fd = td_test_connect(c.ts.port);
    const char *h1 = "GET /tandem.v1.Generation/ListModels HTTP/1.1\r\nHost: x\r\n\r\n";
    send(fd, h1, strlen(h1), 0);
    cr_assert_gt(read_to_eof(fd, buf, sizeof buf), 0);
    cr_assert(strncmp(buf, "HTTP/1.1 505", 12) == 0, "got: %s", buf);
    close(fd);
    list_models_ok(&c);

    /* a truncated HTTP/2 frame (SETTINGS header announcing 12 bytes, 3 sent), then EOF */
    fd = td_test_connect(c.ts.port);
    static const char trunc[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                                "\x00\x00\x0c\x04\x00\x00\x00\x00\x00"
                                "\x00\x03\x00";
    send(fd, trunc, sizeof trunc - 1, 0);
    shutdown(fd, SHUT_WR);
    cr_assert_geq(read_to_eof(fd, buf, sizeof buf), 0, "server did not close the truncated connection");
    close(fd);

    /* a frame that violates HTTP/2 (DATA on stream 0): GOAWAY and close */
    fd = td_test_connect(c.ts.port);
    static const char bad[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                              "\x00\x00\x00\x04\x00\x00\x00\x00\x00"
                              "\x00\x00\x04\x00\x01\x00\x00\x00\x00"
                              "abcd";
    send(fd, bad, sizeof bad - 1, 0);
    cr_assert_geq(read_to_eof(fd, buf, sizeof buf), 0, "server did not close after a protocol error");
    close(fd);

    list_models_ok(&c);
    client_stop(&c);
}

/* ---- a reader that never opens its stream window ---------------------------------- */

/* A raw nghttp2 client session over a blocking socket, so the test controls flow control:
 * SETTINGS_INITIAL_WINDOW_SIZE 0 and no WINDOW_UPDATE ever. */
typedef struct stalled {
    td_grpc_buf_t req;          /* the framed request */
    int32_t stream_id;
    bool closed, trailers;
    uint32_t close_error;
    char grpc_status[8];
    size_t data_bytes;
} stalled_t;

static int st_on_header(nghttp2_session *ses, const nghttp2_frame *frame, const uint8_t *name, size_t namelen,
                        const uint8_t *value, size_t valuelen, uint8_t flags, void *user)
{
    stalled_t *s = user;
    if (namelen == 11 && memcmp(name, "grpc-status", 11) == 0 && valuelen < sizeof s->grpc_status) {
        memcpy(s->grpc_status, value, valuelen);
        s->grpc_status[valuelen] = '\0';
    }
    return 0;
}

static int st_on_frame_recv(nghttp2_session *ses, const nghttp2_frame *frame, void *user)
{
    stalled_t *s = user;
    if (frame->hd.type == NGHTTP2_HEADERS && frame->hd.stream_id == s->stream_id &&
        (frame->hd.flags & NGHTTP2_FLAG_END_STREAM))
        s->trailers = true;
    return 0;
}

static int st_on_data(nghttp2_session *ses, uint8_t flags, int32_t stream_id, const uint8_t *data, size_t len,
                      void *user)
{
    ((stalled_t *)user)->data_bytes += len;
    return 0;
}

static int st_on_close(nghttp2_session *ses, int32_t stream_id, uint32_t error_code, void *user)
{
    stalled_t *s = user;
    s->closed = true;
    s->close_error = error_code;
    return 0;
}

static ssize_t st_read_req(nghttp2_session *ses, int32_t stream_id, uint8_t *buf, size_t length, uint32_t *flags,
                           nghttp2_data_source *src, void *user)
{
    stalled_t *s = user;
    size_t n = TD_MIN(length, td_grpc_buf_size(&s->req));
    memcpy(buf, s->req.data + s->req.off, n);
    td_grpc_buf_consume(&s->req, n);
    if (!td_grpc_buf_size(&s->req))
        *flags |= NGHTTP2_DATA_FLAG_EOF;
    return (ssize_t)n;
}

typedef struct stats_call {
    int done;
    td_grpc_code_t code;
    char text[64];
} stats_call_t;

static void stats_msg(td_grpc_client_call_t *call, const ProtobufCMessage *msg, void *data)
{
    stats_call_t *sc = data;
    snprintf(sc->text, sizeof sc->text, "%s", ((const Tandem__V1__GenerateResponse *)msg)->text);
}

static void stats_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    stats_call_t *sc = data;
    sc->done++;
    sc->code = code;
}

/* The router ends a client that stopped reading RESOURCE_EXHAUSTED with responses queued
 * that the closed window will never take: the client must still get that status at once
 * (trailers, no DATA), and the server must free the stream and its queue, not keep them
 * until the connection closes. */
Test(grpc, error_end_reaches_a_reader_with_a_closed_window, .timeout = 30)
{
    client_t c;
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    cfg.send_queue_bytes = 16 * 1024;
    client_start(&c, &cfg, 0);

    stalled_t s = {0};
    Tandem__V1__GenerateRequest req = TANDEM__V1__GENERATE_REQUEST__INIT;
    req.prompt = "overflow";
    cr_assert_eq(td_grpc_buf_put_message(&s.req, &req.base, 1 << 20), TD_OK);
    nghttp2_session_callbacks *cbs;
    cr_assert_eq(nghttp2_session_callbacks_new(&cbs), 0);
    nghttp2_session_callbacks_set_on_header_callback(cbs, st_on_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, st_on_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, st_on_data);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, st_on_close);
    nghttp2_option *opt;
    cr_assert_eq(nghttp2_option_new(&opt), 0);
    nghttp2_option_set_no_auto_window_update(opt, 1);
    nghttp2_session *ses;
    cr_assert_eq(nghttp2_session_client_new2(&ses, cbs, &s, opt), 0);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cbs);
    nghttp2_settings_entry iv[] = {{NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, 0}};
    cr_assert_eq(nghttp2_submit_settings(ses, NGHTTP2_FLAG_NONE, iv, 1), 0);
    char authority[32];
    snprintf(authority, sizeof authority, "127.0.0.1:%u", c.ts.port);
    nghttp2_nv nv[] = {td_grpc_nv(":method", "POST"), td_grpc_nv(":scheme", "http"),
                       td_grpc_nv(":path", "/tandem.v1.Generation/Generate"), td_grpc_nv(":authority", authority),
                       td_grpc_nv("content-type", "application/grpc"), td_grpc_nv("te", "trailers")};
    nghttp2_data_provider prd = {.read_callback = st_read_req};
    s.stream_id = nghttp2_submit_request(ses, NULL, nv, TD_ARRAY_LEN(nv), &prd, NULL);
    cr_assert_gt(s.stream_id, 0);

    int fd = td_test_connect(c.ts.port); /* recv times out after 5 s: the stream did not end */
    while (!s.closed) {
        const uint8_t *out;
        ssize_t n;
        while ((n = nghttp2_session_mem_send(ses, &out)) > 0)
            cr_assert_eq(send(fd, out, (size_t)n, 0), n);
        cr_assert_geq(n, 0);
        uint8_t buf[16384];
        ssize_t got = recv(fd, buf, sizeof buf, 0);
        cr_assert_gt(got, 0, "the stream of a reader with a closed window did not end (%zd DATA bytes came)",
                     s.data_bytes);
        cr_assert_eq(nghttp2_session_mem_recv(ses, buf, (size_t)got), got);
    }
    cr_assert_gt(atomic_load(&c.ts.ov_queued), 0, "the server queued nothing, so nothing was tested");
    cr_assert_eq(s.data_bytes, 0, "DATA went into a closed window");
    cr_assert(s.trailers, "the stream ended without trailers (reset %u)", s.close_error);
    cr_assert_eq(s.close_error, NGHTTP2_NO_ERROR);
    cr_assert_str_eq(s.grpc_status, "8", "grpc-status %s, not RESOURCE_EXHAUSTED", s.grpc_status);

    /* on the server, only the stats call itself is left: the stalled call and its queue are gone
     * while its connection stays open */
    stats_call_t sc = {0};
    Tandem__V1__GenerateRequest sreq = TANDEM__V1__GENERATE_REQUEST__INIT;
    sreq.prompt = "stats";
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__generate_response__descriptor,
                             .on_message = stats_msg, .on_done = stats_done, .data = &sc, .timeout_ms = 5000};
    cr_assert_eq(td_grpc_channel_call(c.ch, "/tandem.v1.Generation/Generate", &sreq.base, &o, NULL), TD_OK);
    for (int i = 0; i < 1000 && !sc.done; i++)
        uv_run(&c.loop, UV_RUN_ONCE);
    cr_assert_eq(sc.code, TD_GRPC_OK, "stats call: %s", td_grpc_code_name(sc.code));
    cr_assert_str_eq(sc.text, "calls 1 queued 0", "server: %s", sc.text);
    nghttp2_session_del(ses);
    close(fd);
    td_grpc_buf_free(&s.req);
    client_stop(&c);
}

Test(grpc, wire_helpers)
{
    uint64_t ms;
    cr_assert(td_grpc_parse_timeout("100m", 4, &ms) && ms == 100);
    cr_assert(td_grpc_parse_timeout("2S", 2, &ms) && ms == 2000);
    cr_assert(td_grpc_parse_timeout("1500u", 5, &ms) && ms == 2);
    cr_assert(td_grpc_parse_timeout("1n", 2, &ms) && ms == 1);
    cr_assert(td_grpc_parse_timeout("1H", 2, &ms) && ms == 3600000);
    cr_assert(td_grpc_parse_timeout("99999999H", 9, &ms) && ms == TD_GRPC_MAX_TIMEOUT_MS, "%llu",
              (unsigned long long)ms); /* 3.6e14 ms would overflow a deadline in ns */
    cr_assert(td_grpc_parse_timeout("99999M", 6, &ms) && ms == 5999940000ULL); /* under the clamp: as sent */
    cr_assert(!td_grpc_parse_timeout("123456789m", 10, &ms));
    cr_assert(!td_grpc_parse_timeout("12x", 3, &ms));
    cr_assert(!td_grpc_parse_timeout("m", 1, &ms));
    char *e = td_grpc_percent_encode("50% done\nnext");
    cr_assert_str_eq(e, "50%25 done%0Anext");
    char *d = td_grpc_percent_decode((const uint8_t *)e, strlen(e));
    cr_assert_str_eq(d, "50% done\nnext");
    free(e);
    free(d);
    d = td_grpc_percent_decode((const uint8_t *)"bad%zz%4", 8);
    cr_assert_str_eq(d, "bad%zz%4");
    free(d);
    cr_assert_str_eq(td_grpc_code_name(TD_GRPC_DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
    cr_assert_eq(td_grpc_code_from_status(TD_ERR_EXHAUSTED), TD_GRPC_RESOURCE_EXHAUSTED);
}

/* A client that cancels many calls (a router relaying its clients' cancels, or racing the
 * end of calls) keeps its connection: nghttp2's own rapid-reset guard (1000 resets, then
 * 33/s) would answer GOAWAY and every later call on the channel would fail. */
enum { CANCEL_N = 1500 };

/* Starts the test server (resets allowed per second: max_resets_per_s) and CANCEL_N "slow"
 * calls on one channel, and waits until the server runs them all. */
static void start_slow_calls(client_t *c, uint32_t max_resets_per_s, result_t *r, td_grpc_client_call_t **calls)
{
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    cfg.max_concurrent_streams = CANCEL_N;
    cfg.max_resets_per_s = max_resets_per_s;
    client_start(c, &cfg, 0);
    for (int i = 0; i < CANCEL_N; i++)
        calls[i] = generate(c, "slow", 1, 0, &r[i]);
    for (int i = 0; i < 3000 && atomic_load(&c->ts.handled) < CANCEL_N; i++) {
        uv_run(&c->loop, UV_RUN_NOWAIT);
        usleep(1000);
    }
    cr_assert_eq(atomic_load(&c->ts.handled), CANCEL_N, "the server did not get every call");
}

Test(grpc, many_cancels_keep_the_connection, .timeout = 60)
{
    enum { N = CANCEL_N };
    client_t c;
    static result_t r[N];
    static td_grpc_client_call_t *calls[N];
    start_slow_calls(&c, td_grpc_server_config_default().max_resets_per_s, r, calls);
    for (int i = 0; i < N; i++)
        td_grpc_client_call_cancel(calls[i]);
    for (int i = 0; i < N; i++)
        cr_assert_eq(r[i].code, TD_GRPC_CANCELLED);
    for (int i = 0; i < 3000 && atomic_load(&c.ts.cancels) < N; i++) {
        uv_run(&c.loop, UV_RUN_NOWAIT); /* let the RST_STREAMs go out */
        usleep(1000);
    }
    cr_assert_eq(atomic_load(&c.ts.cancels), N, "the handler saw %d of %d cancels", atomic_load(&c.ts.cancels), N);
    cr_assert(td_grpc_channel_is_usable(c.ch), "the server sent GOAWAY after %d cancels", N);
    list_models_ok(&c);
    client_stop(&c);
}

/* The public gateway's setting (max_resets_per_s 0: nghttp2's guard, 1000 resets then 33/s):
 * a client flooding RST_STREAMs gets GOAWAY, and the server goes on serving a new client
 * (issue 35: the gateway had the control servers' allowance of 100,000/s). */
Test(grpc, rapid_reset_flood_gets_goaway_with_nghttp2s_guard, .timeout = 60)
{
    enum { N = CANCEL_N };
    client_t c;
    static result_t r[N];
    static td_grpc_client_call_t *calls[N];
    start_slow_calls(&c, 0, r, calls);
    for (int i = 0; i < N; i++)
        td_grpc_client_call_cancel(calls[i]);
    for (int i = 0; i < 3000 && td_grpc_channel_is_usable(c.ch); i++) {
        uv_run(&c.loop, UV_RUN_NOWAIT); /* the RST_STREAMs go out; GOAWAY comes back */
        usleep(1000);
    }
    cr_assert(!td_grpc_channel_is_usable(c.ch), "%d resets at once and no GOAWAY", N);
    td_grpc_channel_close(c.ch, NULL, NULL); /* a well-behaved client is still served */
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    cr_assert_eq(td_grpc_channel_create(&c.loop, "127.0.0.1", c.ts.port, &cc, &c.ch), TD_OK);
    list_models_ok(&c);
    client_stop(&c);
}

/* Unpacking goes through one arena per message and stays bounded: empty sub-messages cost
 * 2 wire bytes each but ~24x that unpacked, so a big enough run of them is refused, while
 * the same message with few entries unpacks whole and frees cleanly. */
Test(grpc, unpack_arena_is_bounded)
{
    enum { BIG = 100000 };
    uint8_t *wire = malloc(2 * BIG);
    cr_assert_not_null(wire);
    for (int i = 0; i < BIG; i++) {
        wire[2 * i] = (3 << 3) | 2; /* StepBatch.seqs, length-delimited */
        wire[2 * i + 1] = 0;        /* an empty SeqStep */
    }
    bool over = true;
    ProtobufCMessage *m = td_grpc_unpack(&tandem__control__v1__step_batch__descriptor, wire, 2 * 1000, &over);
    cr_assert_not_null(m, "1000 entries must unpack");
    cr_assert_eq(((Tandem__Control__V1__StepBatch *)m)->n_seqs, 1000);
    td_grpc_free_unpacked(m);
    cr_assert_not(over);
    cr_assert_null(td_grpc_unpack(&tandem__control__v1__step_batch__descriptor, wire, 2 * BIG, &over),
                   "100000 empty entries exceed 16 bytes per wire byte");
    cr_assert(over, "the bound refused it, and says so");
    wire[0] = 0xff; /* a field number with no end: malformed, not over the bound */
    cr_assert_null(td_grpc_unpack(&tandem__control__v1__step_batch__descriptor, wire, 1, &over));
    cr_assert_not(over);
    free(wire);
}

/* grpc-timeout values have at most 8 digits: large millisecond counts move to a coarser
 * unit, rounded up, and parse back to no less than what was asked. */
Test(grpc, timeout_header_format)
{
    static const struct {
        uint32_t ms;
        const char *want;
    } cases[] = {{1, "1m"},           {10000, "10000m"},      {99999999, "99999999m"},
                 {100000000, "100000S"}, {100000001, "100001S"}, {UINT32_MAX, "4294968S"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[TD_GRPC_TIMEOUT_CHARS];
        td_grpc_format_timeout(cases[i].ms, buf);
        cr_assert_str_eq(buf, cases[i].want, "%u ms", cases[i].ms);
        uint64_t back;
        cr_assert(td_grpc_parse_timeout(buf, strlen(buf), &back), "%s does not parse", buf);
        cr_assert_geq(back, cases[i].ms);
    }
    char d[12];
    cr_assert_eq(td_grpc_format_u32(0, d), 1);
    cr_assert_str_eq(d, "0");
    cr_assert_eq(td_grpc_format_u32(UINT32_MAX, d), 10);
    cr_assert_str_eq(d, "4294967295");
}

/* Client deadlines share one timer per channel: calls given out of deadline order, to a
 * peer that accepts the TCP connection but never speaks, end DEADLINE_EXCEEDED in deadline
 * order; a call without a deadline waits until the channel closes (CANCELLED). */
typedef struct dl_rec {
    int *order;
    int *n_done;
    int id;
    td_grpc_code_t code;
    bool done;
} dl_rec_t;

static void dl_on_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    dl_rec_t *r = data;
    r->code = code;
    r->done = true;
    r->order[(*r->n_done)++] = r->id;
}

Test(grpc, client_deadlines_in_order, .timeout = 20)
{
    signal(SIGPIPE, SIG_IGN);
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(lfd, 4), 0);
    socklen_t alen = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &alen);
    uv_loop_t loop;
    cr_assert_eq(uv_loop_init(&loop), 0);
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    td_grpc_channel_t *ch;
    cr_assert_eq(td_grpc_channel_create(&loop, "127.0.0.1", ntohs(a.sin_port), &cc, &ch), TD_OK);
    int order[4], n_done = 0;
    static const uint32_t timeouts[4] = {300, 100, 0, 200};
    dl_rec_t rec[4];
    Tandem__V1__ListModelsRequest req = TANDEM__V1__LIST_MODELS_REQUEST__INIT;
    for (int i = 0; i < 4; i++) {
        rec[i] = (dl_rec_t){.order = order, .n_done = &n_done, .id = i};
        td_grpc_call_opts_t o = {.response_desc = &tandem__v1__list_models_response__descriptor,
                                 .on_done = dl_on_done, .data = &rec[i], .timeout_ms = timeouts[i]};
        cr_assert_eq(td_grpc_channel_call(ch, "/tandem.v1.Generation/ListModels", &req.base, &o, NULL), TD_OK);
    }
    uint64_t t0 = uv_now(&loop);
    while (n_done < 3 && uv_now(&loop) - t0 < 5000)
        uv_run(&loop, UV_RUN_ONCE);
    cr_assert_eq(n_done, 3, "%d calls ended", n_done);
    cr_assert_eq(order[0], 1);
    cr_assert_eq(order[1], 3);
    cr_assert_eq(order[2], 0);
    cr_assert_geq(uv_now(&loop) - t0, 300);
    for (int i = 0; i < 4; i++)
        if (i != 2)
            cr_assert_eq(rec[i].code, TD_GRPC_DEADLINE_EXCEEDED, "call %d: %s", i, td_grpc_code_name(rec[i].code));
    cr_assert(!rec[2].done, "the call without a deadline ended");
    td_grpc_channel_close(ch, NULL, NULL);
    cr_assert(rec[2].done);
    cr_assert_eq(rec[2].code, TD_GRPC_CANCELLED);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0, "client loop has handles left");
    close(lfd);
}

/* ---- idle, slow and half-open connections ------------------------------------------ */

static const char preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/* The counter tandem_grpc_server_connections_closed_total{reason=...} as rendered. */
static double closed_count(td_metrics_t *reg, const char *reason)
{
    char *text, key[128];
    size_t len;
    cr_assert_eq(td_metrics_render(reg, &text, &len), TD_OK);
    snprintf(key, sizeof key, "tandem_grpc_server_connections_closed_total{reason=\"%s\"} ", reason);
    const char *p = strstr(text, key);
    double v = p ? strtod(p + strlen(key), NULL) : -1;
    free(text);
    return v;
}

/* Half a preface, then nothing; and the whole preface one byte per 100 ms (2.4 s): both
 * are closed at the handshake deadline (300 ms here), which bytes do not extend, while a
 * normal client is served. */
Test(grpc, unfinished_handshake_is_closed_at_its_deadline, .timeout = 30)
{
    td_metrics_t *reg;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    cfg.handshake_timeout_ms = 300;
    cfg.metrics = reg;
    client_t c;
    client_start(&c, &cfg, 0);
    list_models_ok(&c); /* the channel connects as its loop runs: before the deadline */
    char buf[256];

    int fd = td_test_connect(c.ts.port);
    send(fd, "PRI * HTTP/2", 12, MSG_NOSIGNAL);
    cr_assert_geq(read_to_eof(fd, buf, sizeof buf), 0, "half a preface kept its connection past the deadline");
    close(fd);

    td_test_trickle_t t = {0};
    td_test_trickle_start(&t, c.ts.port, 1, preface);
    cr_assert_geq(read_to_eof(t.fds[0], buf, sizeof buf), 0, "a trickled preface kept its connection");
    td_test_trickle_stop(&t);

    list_models_ok(&c);
    cr_assert_geq(closed_count(reg, "handshake_timeout"), 2);
    client_stop(&c);
    td_metrics_destroy(reg);
}

/* A request whose HEADERS came but whose END_STREAM never does, on a connection with no
 * call running: closed at the request deadline. */
Test(grpc, unfinished_request_is_closed_at_its_deadline, .timeout = 30)
{
    td_metrics_t *reg;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    cfg.request_timeout_ms = 300;
    cfg.metrics = reg;
    client_t c;
    client_start(&c, &cfg, 0);
    list_models_ok(&c);
    char buf[4096];

    /* preface, empty SETTINGS, HEADERS (stream 1, END_HEADERS, no END_STREAM) of a valid
     * ListModels call (:method POST, :scheme http, :authority, :path, content-type), then
     * never the message: nghttp2 resets a stream answered early, so the request must be
     * one we would answer */
    int fd = td_test_connect(c.ts.port);
    static const char req[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                              "\x00\x00\x00\x04\x00\x00\x00\x00\x00"
                              "\x00\x00\x3a\x01\x04\x00\x00\x00\x01"
                              "\x83\x86\x01\x01x"
                              "\x04\x20/tandem.v1.Generation/ListModels"
                              "\x0f\x10\x10" "application/grpc";
    send(fd, req, sizeof req - 1, MSG_NOSIGNAL);
    cr_assert_geq(read_to_eof(fd, buf, sizeof buf), 0, "a stalled request kept its connection past the deadline");
    close(fd);

    list_models_ok(&c);
    cr_assert_geq(closed_count(reg, "request_timeout"), 1);
    client_stop(&c);
    td_metrics_destroy(reg);
}

typedef struct hold_stream {
    result_t r;
    td_grpc_client_call_t *call;
} hold_stream_t;

/* The lock-out: 2,000 connections that sent half a preface and 200 that trickle
 * theirs, at the default limit of 1,024 and the default deadlines. The oldest unfinished
 * handshakes make room, so a client that was connected keeps its channel (and a stream
 * that runs meanwhile), a client that connects during the trickle gets in, and the
 * counters say what happened. */
Test(grpc, half_open_flood_does_not_lock_clients_out, .timeout = 120)
{
    enum { N_HALF = 2000, N_SLOW = 200 };
    if (!td_test_raise_nofile(N_HALF + N_SLOW + 1024 + 256))
        cr_skip_test("RLIMIT_NOFILE cannot be raised to %d (hard limit too low)", N_HALF + N_SLOW + 1024 + 256);
    td_metrics_t *reg;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    cfg.metrics = reg;
    client_t c;
    client_start(&c, &cfg, 0);
    list_models_ok(&c);

    /* a slow stream in flight on the connected client while the flood comes */
    result_t stream;
    generate(&c, "slow", 0, 60000, &stream);
    for (int i = 0; i < 50 && stream.n_messages == 0; i++)
        uv_run(&c.loop, UV_RUN_NOWAIT), usleep(10000);

    int *half = calloc(N_HALF, sizeof *half);
    cr_assert(half);
    td_test_half_open(c.ts.port, half, N_HALF, "PRI * HTTP/2", 12);
    td_test_trickle_t slow = {0};
    td_test_trickle_start(&slow, c.ts.port, N_SLOW, preface);
    uv_update_time(&c.loop); /* the flood blocked this thread: deadlines count from now */

    for (int i = 0; i < 20; i++)
        list_models_ok(&c);
    result_t r;
    generate_to_end(&c, "hello world", 8, 10000, TD_GRPC_OK, &r);

    /* a client arriving now */
    client_t late = {0};
    cr_assert_eq(uv_loop_init(&late.loop), 0);
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    cr_assert_eq(td_grpc_channel_create(&late.loop, "127.0.0.1", c.ts.port, &cc, &late.ch), TD_OK);
    for (int i = 0; i < 5; i++)
        list_models_ok(&late);
    td_grpc_channel_close(late.ch, NULL, NULL);
    uv_run(&late.loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&late.loop), 0);

    cr_assert_eq(stream.done, 0, "the running stream was ended: %s %s", td_grpc_code_name(stream.code),
                 stream.message);
    /* a loaded machine may take past the 10 s handshake deadline: those count there */
    cr_assert_geq(closed_count(reg, "evicted") + closed_count(reg, "handshake_timeout"), N_HALF + N_SLOW - 1024,
                  "connections were refused, not evicted");
    cr_assert_eq(closed_count(reg, "refused"), 0);

    td_test_trickle_stop(&slow);
    for (int i = 0; i < N_HALF; i++)
        close(half[i]);
    free(half);
    client_stop(&c);
    td_metrics_destroy(reg);
}

/* A Generate whose request is n_msgs chat messages of role `role` (each the same message). */
static td_grpc_client_call_t *generate_messages(client_t *c, size_t n_msgs, const char *role, uint32_t timeout_ms,
                                                result_t *r)
{
    Tandem__V1__ChatMessage m = TANDEM__V1__CHAT_MESSAGE__INIT;
    m.role = (char *)role;
    Tandem__V1__ChatMessage **ms = malloc(n_msgs * sizeof *ms);
    cr_assert_not_null(ms);
    for (size_t i = 0; i < n_msgs; i++)
        ms[i] = &m;
    Tandem__V1__GenerateRequest req = TANDEM__V1__GENERATE_REQUEST__INIT;
    req.prompt = "hi";
    req.max_tokens = 3;
    req.messages = ms;
    req.n_messages = n_msgs;
    memset(r, 0, sizeof *r);
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__generate_response__descriptor,
                             .on_message = on_msg, .on_done = on_done, .data = r, .timeout_ms = timeout_ms};
    td_grpc_client_call_t *call = NULL;
    cr_assert_eq(td_grpc_channel_call(c->ch, "/tandem.v1.Generation/Generate", &req.base, &o, &call), TD_OK);
    free(ms);
    return call;
}

/* Requests longer than unpack_off_loop_bytes are unpacked on the thread pool and reach their
 * handler as the short ones do: a long echo comes back whole, a long request of many empty
 * sub-messages is refused by the unpack's bound with a status that says so (not INTERNAL),
 * calls cancelled or timed out while their request is unpacked leave nothing behind (the
 * loops close clean: no call, timer or job left), and with no room (max_unpacking 0) a long
 * request is refused RESOURCE_EXHAUSTED while a short one is served. */
Test(grpc, long_requests_unpack_off_the_loop, .timeout = 60)
{
    client_t c;
    td_grpc_server_config_t cfg = td_grpc_server_config_default();
    cfg.unpack_off_loop_bytes = 1024;
    client_start(&c, &cfg, 0);
    size_t n = 256 * 1024;
    char *big = malloc(n + 1);
    cr_assert_not_null(big);
    memcpy(big, "echo:", 5);
    memset(big + 5, 'e', n - 5);
    big[n] = '\0';
    result_t r;
    generate_to_end(&c, big, 0, 10000, TD_GRPC_OK, &r);
    cr_assert_eq(r.last_text_len, n, "the echo came back whole from a request unpacked off the loop");
    generate_messages(&c, 1 << 20, "", 10000, &r); /* 2 MiB of empty messages: ~24x unpacked */
    run_until_done(&c, &r);
    cr_assert_eq(r.code, TD_GRPC_RESOURCE_EXHAUSTED, "%s %s", td_grpc_code_name(r.code), r.message);
    cr_assert(strstr(r.message, "16 bytes a wire byte"), "%s", r.message);
    /* cancels and deadlines racing the unpack: 8 of each, the server keeps serving */
    result_t rs[16];
    for (int i = 0; i < 16; i++) {
        td_grpc_client_call_t *call = generate_messages(&c, 200000, "user", i < 8 ? 0 : 1 + (uint32_t)i % 3, &rs[i]);
        for (int k = 0; k < i % 4; k++)
            uv_run(&c.loop, UV_RUN_NOWAIT);
        if (i < 8)
            td_grpc_client_call_cancel(call);
    }
    for (int i = 0; i < 16; i++)
        run_until_done(&c, &rs[i]);
    list_models_ok(&c);
    generate_to_end(&c, big, 0, 10000, TD_GRPC_OK, &r);
    client_stop(&c);

    cfg.max_unpacking = 0;
    client_start(&c, &cfg, 0);
    generate_to_end(&c, big, 0, 10000, TD_GRPC_RESOURCE_EXHAUSTED, &r);
    cr_assert(strstr(r.message, "retry"), "%s", r.message);
    generate_to_end(&c, "hello", 3, 10000, TD_GRPC_OK, &r);
    client_stop(&c);
    free(big);
}
