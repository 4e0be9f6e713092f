/*
 * test_http: td_http's server on libhttp-parser, over real sockets. A server runs on its
 * own loop thread with a handler of test routes (echo, async, hang, stream); the test
 * thread is the client, parsing answers with http_parser too. Checked: bodies by
 * Content-Length and chunked, 100-continue, 413/414/417/431/400/501, many requests on one
 * keep-alive connection, pipelined requests answered in order, HTTP/1.0 and Connection:
 * close, a stream to a slow reader held to the write-queue bound, on_abort exactly once on
 * a client disconnect (mid-stream and while handled) and on the server's close, a slowloris
 * closed at the request deadline, an idle connection at the idle one, an answer nobody
 * reads at the write one, 1,000 idle connections at a cap of 100 with a new client served,
 * and refusal when every connection is busy; a request refused on its head (401) before its
 * 8 MiB body is sent, the connection closed after it while one without a body stays open;
 * the budget of bodies in flight across connections (503 past it, given back after); the
 * body deadline (408) well before the request deadline. Every loop closes with no handle
 * open.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <http_parser.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "td_http.h"
#include "td_test_loop.h"
#include "td_test_net.h"
#include "td_util.h"

/* ---- the server side --------------------------------------------------------------- */

typedef struct srv {
    td_test_http_t h;
    td_metrics_t *reg;
    /* what the handlers saw, read by the test thread */
    _Atomic int aborts, streams_done, busy_seen, handled, refused;
    _Atomic size_t max_queued;
} srv_t;

/* A stream: `left` chunks of `size` bytes, written as fast as the queue takes them. */
typedef struct stream {
    srv_t *s;
    td_http_req_t *req;
    long left;                   /* < 0: forever */
    size_t size;
    uv_timer_t timer;            /* /async's answer */
    char *body;                  /* /async: a copy of the body (td_http frees its own when the
                                  * handler returns) */
    size_t body_len;
    char buf[16384];
} stream_t;

static void stream_free(uv_handle_t *h)
{
    stream_t *st = h->data;
    free(st->body);
    free(st);
}

static void on_abort(td_http_req_t *req, void *data)
{
    stream_t *st = data;
    atomic_fetch_add(&st->s->aborts, 1);
    uv_close((uv_handle_t *)&st->timer, stream_free);
}

static void stream_pump(td_http_req_t *req, void *data)
{
    stream_t *st = data;
    srv_t *s = st->s;
    while (st->left != 0) {
        td_status_t rc = td_http_stream_write(req, st->buf, st->size);
        size_t q = td_http_req_queued_bytes(req);
        if (q > atomic_load(&s->max_queued))
            atomic_store(&s->max_queued, q);
        if (rc == TD_ERR_BUSY) {
            atomic_fetch_add(&s->busy_seen, 1);
            return; /* on_writable calls again */
        }
        cr_assert_eq(rc, TD_OK);
        if (st->left > 0)
            st->left--;
    }
    td_http_stream_end(req);
    atomic_fetch_add(&s->streams_done, 1);
    uv_close((uv_handle_t *)&st->timer, stream_free);
}

static void on_async_timer(uv_timer_t *t)
{
    stream_t *st = t->data;
    td_http_respond(st->req, 200, NULL, st->body, st->body_len);
    uv_close((uv_handle_t *)&st->timer, stream_free);
}

static long query_num(const char *q, const char *key, long def)
{
    const char *p = strstr(q, key);
    return p ? strtol(p + strlen(key), NULL, 10) : def;
}

static void handler(void *data, td_http_req_t *req)
{
    srv_t *s = data;
    atomic_fetch_add(&s->handled, 1);
    const char *path = td_http_req_path(req);
    size_t len;
    const char *body = td_http_req_body(req, &len);
    if (strcmp(path, "/echo") == 0 || strcmp(path, "/locked") == 0) { /* the body back, X-Seq as a header */
        const char *seq = td_http_req_header(req, "x-seq");
        if (seq)
            cr_assert_eq(td_http_resp_header(req, "X-Seq", seq), TD_OK);
        td_http_respond(req, 200, "application/octet-stream", body, len);
        return;
    }
    if (strcmp(path, "/info") == 0) { /* method, query and a header, as text */
        char out[512];
        cr_assert_eq(td_http_resp_header(req, "Bad", "a\r\nInjected: yes"), TD_ERR_INVALID);
        cr_assert_eq(td_http_resp_header(req, "Bad Name", "a"), TD_ERR_INVALID);
        const char *h = td_http_req_header(req, "X-Test");
        int n = snprintf(out, sizeof out, "%s|%s|%s|%zu", td_http_req_method(req), td_http_req_query(req),
                         h ? h : "(none)", len);
        td_http_respond(req, 200, NULL, out, (size_t)n);
        return;
    }
    stream_t *st = calloc(1, sizeof *st);
    cr_assert(st);
    st->s = s;
    st->req = req;
    uv_timer_init(&s->h.l.loop, &st->timer);
    st->timer.data = st;
    td_http_req_set_data(req, st);
    td_http_req_on_abort(req, on_abort);
    if (strcmp(path, "/async") == 0) { /* the body back, from a later loop callback */
        st->body = malloc(len + 1);
        cr_assert(st->body);
        memcpy(st->body, body, len);
        st->body_len = len;
        uv_timer_start(&st->timer, on_async_timer, (uint64_t)query_num(td_http_req_query(req), "ms=", 0), 0);
        return;
    }
    if (strcmp(path, "/hang") == 0)
        return; /* never answered: only on_abort ends it */
    if (strcmp(path, "/stream") == 0) {
        const char *q = td_http_req_query(req);
        st->left = query_num(q, "n=", 1);
        st->size = (size_t)query_num(q, "size=", 16);
        cr_assert_leq(st->size, sizeof st->buf);
        memset(st->buf, 'x', st->size);
        td_http_req_on_writable(req, stream_pump);
        cr_assert_eq(td_http_stream_begin(req, 200, "text/event-stream"), TD_OK);
        cr_assert_eq(td_http_stream_begin(req, 200, NULL), TD_ERR_INVALID, "a stream begins once");
        stream_pump(req, st);
        return;
    }
    td_http_respond(req, 404, NULL, "not found\n", 10);
    uv_close((uv_handle_t *)&st->timer, stream_free);
}

/* The head check (td_http_head_cb): /locked wants "X-Key: ok", as a front door wants an
 * API key; a refusal is answered before any of the body is read. */
static void head(void *data, td_http_req_t *req)
{
    srv_t *s = data;
    const char *key = td_http_req_header(req, "x-key");
    if (strcmp(td_http_req_path(req), "/locked") == 0 && (!key || strcmp(key, "ok") != 0)) {
        atomic_fetch_add(&s->refused, 1);
        cr_assert_eq(td_http_resp_header(req, "WWW-Authenticate", "Bearer"), TD_OK);
        td_http_respond(req, 401, NULL, "no key\n", 7);
    }
}

static srv_t *srv_start(const td_http_config_t *cfg)
{
    signal(SIGPIPE, SIG_IGN);
    srv_t *s = calloc(1, sizeof *s);
    cr_assert(s);
    cr_assert_eq(td_metrics_create(&s->reg), TD_OK);
    td_http_config_t c = *cfg;
    c.handler = handler;
    c.on_head = head;
    c.handler_data = s;
    c.metrics = s->reg;
    td_test_http_start(&s->h, &c);
    return s;
}

static void srv_stop(srv_t *s)
{
    int loop_close_rc = td_test_http_stop(&s->h);
    cr_assert_eq(loop_close_rc, 0, "the server left handles open");
    td_metrics_destroy(s->reg);
    free(s);
}

/* The server's count of connections it closed for `reason` (the registry is read here,
 * between the loop's updates: a counter is atomic). */
static double closed(srv_t *s, const char *reason)
{
    char *text, key[128];
    size_t len;
    cr_assert_eq(td_metrics_render(s->reg, &text, &len), TD_OK);
    snprintf(key, sizeof key, "tandem_http_server_connections_closed_total{reason=\"%s\"} ", reason);
    const char *p = strstr(text, key);
    cr_assert(p, "no %s", key);
    double v = strtod(p + strlen(key), NULL);
    free(text);
    return v;
}

/* Waits up to 5 s for *v to reach want. */
static bool wait_for(_Atomic int *v, int want)
{
    for (int i = 0; i < 500 && atomic_load(v) < want; i++)
        usleep(10000);
    return atomic_load(v) >= want;
}

/* ---- the client side --------------------------------------------------------------- */

typedef struct client {
    int fd;
    http_parser p;
    char in[65536];
    size_t off, len;             /* unparsed bytes in[off..+len) */
    bool done, eof;
    int status;
    char *body;
    size_t body_len, body_cap;
    size_t max_body;             /* 0 = keep all; else count past it without keeping */
    char field[64];
    bool field_is_seq, field_is_conn;
    char seq[32], conn[32];
} client_t;

static int c_on_begin(http_parser *p)
{
    client_t *c = p->data;
    c->body_len = 0;
    c->seq[0] = c->conn[0] = '\0';
    return 0;
}

static int c_on_field(http_parser *p, const char *at, size_t len)
{
    client_t *c = p->data;
    c->field_is_seq = len == 5 && strncasecmp(at, "x-seq", 5) == 0;
    c->field_is_conn = len == 10 && strncasecmp(at, "connection", 10) == 0;
    return 0;
}

static int c_on_value(http_parser *p, const char *at, size_t len)
{
    client_t *c = p->data;
    char *dst = c->field_is_seq ? c->seq : c->field_is_conn ? c->conn : NULL;
    if (dst && len < 32) {
        memcpy(dst, at, len);
        dst[len] = '\0';
    }
    return 0;
}

static int c_on_body(http_parser *p, const char *at, size_t len)
{
    client_t *c = p->data;
    if (c->max_body && c->body_len + len > c->max_body) {
        c->body_len += len;
        return 0;
    }
    if (c->body_len + len + 1 > c->body_cap) {
        c->body_cap = (c->body_len + len + 1) * 2;
        c->body = realloc(c->body, c->body_cap);
        cr_assert(c->body);
    }
    memcpy(c->body + c->body_len, at, len);
    c->body_len += len;
    c->body[c->body_len] = '\0';
    return 0;
}

static int c_on_complete(http_parser *p)
{
    client_t *c = p->data;
    c->done = true;
    c->status = (int)p->status_code;
    http_parser_pause(p, 1);
    return 0;
}

static const http_parser_settings c_settings = {
    .on_message_begin = c_on_begin,
    .on_header_field = c_on_field,
    .on_header_value = c_on_value,
    .on_body = c_on_body,
    .on_message_complete = c_on_complete,
};

static client_t *client_new(uint16_t port)
{
    client_t *c = calloc(1, sizeof *c);
    cr_assert(c);
    c->fd = td_test_connect(port);
    http_parser_init(&c->p, HTTP_RESPONSE);
    c->p.data = c;
    return c;
}

static void client_free(client_t *c)
{
    if (c->fd >= 0)
        close(c->fd);
    free(c->body);
    free(c);
}

static void client_send(client_t *c, const char *data, size_t len)
{
    cr_assert_eq(send(c->fd, data, len, MSG_NOSIGNAL), (ssize_t)len, "send failed");
}

static void client_sends(client_t *c, const char *s)
{
    client_send(c, s, strlen(s));
}

/* Reads one response; its status (0 when the connection ended first). */
static int client_read(client_t *c)
{
    c->done = false;
    http_parser_pause(&c->p, 0);
    for (;;) {
        if (c->len > 0) {
            size_t n = http_parser_execute(&c->p, &c_settings, c->in + c->off, c->len);
            c->off += n;
            c->len -= n;
            if (c->done)
                return c->status;
            cr_assert_eq(HTTP_PARSER_ERRNO(&c->p), HPE_OK, "bad response: %s",
                         http_errno_description(HTTP_PARSER_ERRNO(&c->p)));
        }
        if (c->eof)
            return 0;
        c->off = 0;
        ssize_t n = recv(c->fd, c->in, sizeof c->in, 0);
        if (n <= 0) {
            c->eof = true;
            http_parser_execute(&c->p, &c_settings, NULL, 0); /* a body the close ends */
            return c->done ? c->status : 0;
        }
        c->len = (size_t)n;
    }
}

/* True when the server has closed the connection (EOF or reset) within the read timeout. */
static bool client_closed(client_t *c)
{
    char b[4096];
    for (;;) {
        ssize_t n = recv(c->fd, b, sizeof b, 0);
        if (n == 0 || (n < 0 && errno == ECONNRESET))
            return true;
        if (n < 0)
            return false; /* the 5 s read timeout */
    }
}

/* One request on a fresh connection: its status; the body in c->body. */
static int request(srv_t *s, const char *raw, client_t **c_p)
{
    client_t *c = client_new(s->h.port);
    client_sends(c, raw);
    int st = client_read(c);
    *c_p = c;
    return st;
}

/* ---- tests --------------------------------------------------------------------------- */

Test(http, bodies_by_length_and_chunked, .timeout = 30)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 1024,
                                             .max_body_bytes = 4096, .max_write_queue_bytes = 65536});
    client_t *c = client_new(s->h.port);
    client_sends(c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello world");
    cr_assert_eq(client_read(c), 200);
    cr_assert_str_eq(c->body, "hello world");

    /* chunked, with an extension and a trailer, cut across sends */
    const char *chunked = "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                          "5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n";
    for (size_t i = 0; i < strlen(chunked); i += 7)
        client_send(c, chunked + i, strlen(chunked) - i < 7 ? strlen(chunked) - i : 7);
    cr_assert_eq(client_read(c), 200);
    cr_assert_str_eq(c->body, "hello world");

    /* a body of exactly the bound, and one with NUL bytes */
    static char big[4096 + 128];
    int n = snprintf(big, sizeof big, "POST /echo HTTP/1.1\r\nContent-Length: 4096\r\n\r\n");
    memset(big + n, 'b', 4096);
    client_send(c, big, (size_t)n + 4096);
    cr_assert_eq(client_read(c), 200);
    cr_assert_eq(c->body_len, 4096);
    client_send(c, "POST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\na\0b", 45);
    cr_assert_eq(client_read(c), 200);
    cr_assert_eq(c->body_len, 3);
    cr_assert(memcmp(c->body, "a\0b", 3) == 0);

    /* method, query and headers as the handler sees them */
    client_sends(c, "DELETE /info?a=1&b=2 HTTP/1.1\r\nx-test:   spaced value  \r\n\r\n");
    cr_assert_eq(client_read(c), 200);
    cr_assert_str_eq(c->body, "DELETE|a=1&b=2|spaced value|0");
    client_sends(c, "GET /info HTTP/1.1\r\n\r\n");
    cr_assert_eq(client_read(c), 200);
    cr_assert_str_eq(c->body, "GET||(none)|0");

    /* Expect: 100-continue: 100 first, then the answer once the body came */
    client_sends(c, "POST /echo HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n");
    cr_assert_eq(client_read(c), 100);
    client_sends(c, "ok");
    cr_assert_eq(client_read(c), 200);
    cr_assert_str_eq(c->body, "ok");
    client_free(c);
    srv_stop(s);
}

Test(http, limits_and_garbage_get_their_status_and_close, .timeout = 30)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 1024,
                                             .max_body_bytes = 4096, .max_write_queue_bytes = 65536});
    client_t *c;
    /* a declared body over the bound: 413 before any of it is sent */
    cr_assert_eq(request(s, "POST /echo HTTP/1.1\r\nContent-Length: 4097\r\n\r\n", &c), 413);
    cr_assert(client_closed(c));
    client_free(c);
    /* ... while the client goes on sending it: the 413 still arrives, not a reset */
    c = client_new(s->h.port);
    client_sends(c, "POST /echo HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n");
    static char junk[256 * 1024];
    memset(junk, 'j', sizeof junk);
    client_send(c, junk, sizeof junk);
    cr_assert_eq(client_read(c), 413);
    cr_assert(client_closed(c));
    client_free(c);
    /* ... and with 100-continue: 413, never 100 */
    cr_assert_eq(request(s, "POST /echo HTTP/1.1\r\nContent-Length: 99999\r\nExpect: 100-continue\r\n\r\n", &c), 413);
    client_free(c);
    /* a chunked body that grows past it */
    c = client_new(s->h.port);
    client_sends(c, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
    static char chunk[1100];
    memset(chunk, 'c', sizeof chunk);
    memcpy(chunk, "400\r\n", 5);
    memcpy(chunk + 5 + 1024, "\r\n", 2);
    for (int i = 0; i < 4; i++)
        client_send(c, chunk, 5 + 1024 + 2);
    client_send(c, chunk, 5 + 1024 + 2);
    cr_assert_eq(client_read(c), 413);
    cr_assert(client_closed(c));
    client_free(c);
    /* headers over max_request_bytes: 431; a target over it: 414 */
    static char big[4096];
    int n = snprintf(big, sizeof big, "GET /info HTTP/1.1\r\nX-Big: ");
    memset(big + n, 'h', 2000);
    strcpy(big + n + 2000, "\r\n\r\n");
    cr_assert_eq(request(s, big, &c), 431);
    client_free(c);
    n = snprintf(big, sizeof big, "GET /");
    memset(big + n, 'u', 2000);
    strcpy(big + n + 2000, " HTTP/1.1\r\n\r\n");
    cr_assert_eq(request(s, big, &c), 414);
    client_free(c);
    /* garbage, an unknown Expect, upgrades, HTTP/2's preface, two lengths */
    const struct { const char *raw; int status; } bad[] = {
        {"\x01\x02 garbage\r\n\r\n", 400},
        {"GET /info HTTP/1.1\r\nExpect: tea\r\n\r\n", 417},
        {"CONNECT 127.0.0.1:22 HTTP/1.1\r\n\r\n", 501},
        {"GET /info HTTP/1.1\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n", 501},
        {"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400},
        {"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\nabc", 400},
        {"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
        {"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n", 400},
        {"GET /info HTTP/1.1\r\nHost x\r\n\r\n", 400},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(bad); i++) {
        int st = request(s, bad[i].raw, &c);
        cr_expect_eq(st, bad[i].status, "case %zu: %d, not %d", i, st, bad[i].status);
        cr_expect(client_closed(c), "case %zu left open", i);
        client_free(c);
    }
    /* still serving */
    cr_assert_eq(request(s, "GET /info HTTP/1.1\r\n\r\n", &c), 200);
    client_free(c);
    cr_assert_eq(atomic_load(&s->handled), 1, "no bad request reached the handler");
    srv_stop(s);
}

Test(http, keep_alive_serves_many_requests_and_close_closes, .timeout = 60)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 1024,
                                             .max_body_bytes = 4096, .max_write_queue_bytes = 65536});
    client_t *c = client_new(s->h.port);
    for (int i = 0; i < 2000; i++) {
        char req[128], want[16];
        snprintf(want, sizeof want, "%d", i);
        snprintf(req, sizeof req, "POST /%s HTTP/1.1\r\nContent-Length: %zu\r\n\r\n%s", i % 2 ? "echo" : "async",
                 strlen(want), want);
        client_sends(c, req);
        cr_assert_eq(client_read(c), 200, "request %d", i);
        cr_assert_str_eq(c->body, want);
        cr_assert_str_eq(c->conn, "keep-alive");
    }
    client_sends(c, "GET /info HTTP/1.1\r\nConnection: close\r\n\r\n");
    cr_assert_eq(client_read(c), 200);
    cr_assert_str_eq(c->conn, "close");
    cr_assert(client_closed(c));
    client_free(c);

    cr_assert_eq(request(s, "GET /info HTTP/1.0\r\n\r\n", &c), 200);
    cr_assert_str_eq(c->conn, "close");
    cr_assert(client_closed(c));
    client_free(c);
    /* a client that half-closes after its request (printf ... | nc) still reads the answer */
    c = client_new(s->h.port);
    client_sends(c, "GET /info HTTP/1.1\r\n\r\n");
    shutdown(c->fd, SHUT_WR);
    cr_assert_eq(client_read(c), 200, "a half-closed client lost its answer");
    cr_assert(client_closed(c));
    client_free(c);
    /* an HTTP/1.0 stream has no chunks: the close ends it */
    cr_assert_eq(request(s, "GET /stream?n=3&size=5 HTTP/1.0\r\n\r\n", &c), 200);
    cr_assert_eq(c->body_len, 15);
    client_free(c);
    /* and HTTP/1.0 asking for keep-alive gets it */
    c = client_new(s->h.port);
    for (int i = 0; i < 3; i++) {
        client_sends(c, "GET /info HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
        cr_assert_eq(client_read(c), 200);
        cr_assert_str_eq(c->conn, "keep-alive");
    }
    client_free(c);
    srv_stop(s);
}

Test(http, pipelined_requests_are_answered_in_order, .timeout = 30)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 1024,
                                             .max_body_bytes = 4096, .max_write_queue_bytes = 65536});
    enum { N = 300 }; /* about 30 KB: more than one read */
    static char all[N * 128];
    size_t len = 0;
    for (int i = 0; i < N; i++)
        len += (size_t)sprintf(all + len, "POST /%s HTTP/1.1\r\nX-Seq: %d\r\nContent-Length: %d\r\n\r\n%*d",
                               i % 3 == 0 ? "async" : "echo", i, 6, 6, i);
    client_t *c = client_new(s->h.port);
    client_send(c, all, len);
    for (int i = 0; i < N; i++) {
        char want[16];
        snprintf(want, sizeof want, "%6d", i);
        cr_assert_eq(client_read(c), 200, "answer %d", i);
        cr_assert_str_eq(c->body, want, "answer %d out of order", i);
        if (i % 3)
            cr_assert_eq(atoi(c->seq), i);
    }
    /* a pipelined garbage request after good ones: the good ones answered, then 400 */
    client_sends(c, "GET /info HTTP/1.1\r\n\r\nGET /info HTTP/1.1\r\n\r\nBAD\x01\r\n\r\n");
    cr_assert_eq(client_read(c), 200);
    cr_assert_eq(client_read(c), 200);
    cr_assert_eq(client_read(c), 400);
    cr_assert(client_closed(c));
    client_free(c);
    srv_stop(s);
}

/* 32 MiB streamed in 16 KiB chunks under a 64 KiB write-queue bound to a client that
 * reads nothing for half a second, then everything: the handler is told BUSY, the queue
 * never passes the bound by more than a chunk, and every byte arrives in order. */
Test(http, stream_to_a_slow_reader_is_held_to_the_bound, .timeout = 60)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 1024,
                                             .max_body_bytes = 4096, .max_write_queue_bytes = 65536});
    client_t *c = client_new(s->h.port);
    client_sends(c, "GET /stream?n=2048&size=16384 HTTP/1.1\r\n\r\n");
    usleep(500000);
    cr_assert_gt(atomic_load(&s->busy_seen), 0, "the slow reader never filled the queue");
    cr_assert_eq(atomic_load(&s->streams_done), 0);
    c->max_body = 1; /* count, do not keep */
    cr_assert_eq(client_read(c), 200);
    cr_assert_eq(c->body_len, (size_t)2048 * 16384);
    cr_assert_eq(atomic_load(&s->streams_done), 1);
    cr_assert_leq(atomic_load(&s->max_queued), 65536 + 16384 + 64);
    /* and the connection serves on */
    c->max_body = 0;
    client_sends(c, "GET /info HTTP/1.1\r\n\r\n");
    cr_assert_eq(client_read(c), 200);
    client_free(c);
    srv_stop(s);
}

/* A client that goes mid-stream, or while its request is handled, aborts it once; the
 * server's close aborts the ones still going. */
Test(http, disconnect_aborts_once, .timeout = 30)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 1024,
                                             .max_body_bytes = 4096, .max_write_queue_bytes = 65536});
    client_t *c = client_new(s->h.port);
    client_sends(c, "GET /stream?n=-1&size=1000 HTTP/1.1\r\n\r\n");
    char b[8192];
    cr_assert_gt(recv(c->fd, b, sizeof b, 0), 0);
    client_free(c);
    cr_assert(wait_for(&s->aborts, 1), "no abort after the client went mid-stream");

    c = client_new(s->h.port);
    client_sends(c, "GET /hang HTTP/1.1\r\n\r\n");
    cr_assert(wait_for(&s->handled, 2));
    client_free(c);
    cr_assert(wait_for(&s->aborts, 2), "no abort after a handled request's client went");

    client_t *left = client_new(s->h.port), *left2 = client_new(s->h.port);
    client_sends(left, "GET /hang HTTP/1.1\r\n\r\n");
    client_sends(left2, "GET /stream?n=-1&size=1000 HTTP/1.1\r\n\r\n");
    cr_assert(wait_for(&s->handled, 4));
    usleep(100000);
    cr_assert_eq(atomic_load(&s->aborts), 2, "aborted twice, or too early");
    int loop_close_rc = td_test_http_stop(&s->h);
    cr_assert_eq(atomic_load(&s->aborts), 4, "the server's close aborts what it still handles");
    cr_assert_eq(loop_close_rc, 0, "the server left handles open");
    td_metrics_destroy(s->reg);
    free(s);
    client_free(left);
    client_free(left2);
}

/* Deadlines: a request head or body trickled a byte per 100 ms is closed at the request
 * deadline (500 ms after its first byte), a silent connection at the idle one (300 ms), an
 * answer the client never reads at the write one. */
Test(http, slowloris_idle_and_unread_answers_are_closed_at_their_deadlines, .timeout = 60)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 8192,
                                             .max_body_bytes = 1 << 20, .max_write_queue_bytes = 65536,
                                             .idle_timeout_ms = 300, .request_timeout_ms = 500});
    td_test_trickle_t t = {0};
    td_test_trickle_start(&t, s->h.port, 2, "GET /info HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n");
    uint64_t t0 = td_now_ns();
    char b;
    cr_assert_eq(recv(t.fds[0], &b, 1, 0), 0, "the trickled head was not closed (or was answered)");
    double took = (double)(td_now_ns() - t0) / 1e9;
    cr_assert(took > 0.35 && took < 3.0, "closed after %.2f s, the deadline is 0.5 s", took);
    td_test_trickle_stop(&t);
    cr_assert_geq(closed(s, "request_timeout"), 2);

    td_test_trickle_start(&t, s->h.port, 1, "POST /echo HTTP/1.1\r\nContent-Length: 2000\r\n\r\nbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb");
    cr_assert_eq(recv(t.fds[0], &b, 1, 0), 0, "the trickled body was not closed");
    td_test_trickle_stop(&t);

    client_t *c = client_new(s->h.port);
    cr_assert(client_closed(c), "an idle connection stayed open");
    client_free(c);
    cr_assert_geq(closed(s, "idle_timeout"), 1);

    /* 64 MiB of stream the client never reads: closed once the queue sits unread */
    c = client_new(s->h.port);
    client_sends(c, "GET /stream?n=4096&size=16384 HTTP/1.1\r\n\r\n");
    cr_assert(wait_for(&s->aborts, 1), "a stream nobody reads was not aborted");
    cr_assert_geq(closed(s, "write_timeout"), 1);
    client_free(c);
    srv_stop(s);
}

/* 1,000 connections that send nothing at a cap of 100: the oldest make room, a new client
 * is answered at once, and its keep-alive connection survives the flood after it. */
Test(http, a_thousand_idle_connections_hold_the_cap, .timeout = 120)
{
    enum { N = 1000, CAP = 100 };
    if (!td_test_raise_nofile(N + 256))
        cr_skip_test("RLIMIT_NOFILE cannot be raised to %d (hard limit too low)", N + 256);
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 1024,
                                             .max_body_bytes = 4096, .max_write_queue_bytes = 65536,
                                             .max_connections = CAP});
    client_t *keep = client_new(s->h.port);
    client_sends(keep, "GET /info HTTP/1.1\r\n\r\n");
    cr_assert_eq(client_read(keep), 200);
    int *fds = calloc(N, sizeof *fds);
    cr_assert(fds);
    td_test_half_open(s->h.port, fds, N, "", 0);
    client_t *c;
    cr_assert_eq(request(s, "GET /info HTTP/1.1\r\n\r\n", &c), 200);
    client_free(c);
    client_sends(keep, "GET /info HTTP/1.1\r\n\r\n");
    cr_assert_eq(client_read(keep), 200, "the served keep-alive connection was evicted before never-served ones");
    cr_assert_geq(closed(s, "evicted"), N + 1 - CAP);
    cr_assert_eq(closed(s, "refused"), 0);
    /* the first idle ones were closed, the last are still open */
    char b;
    cr_assert_eq(recv(fds[0], &b, 1, 0), 0);
    for (int i = 0; i < N; i++)
        close(fds[i]);
    free(fds);
    client_free(keep);
    srv_stop(s);
}

/* At the cap with every connection's request handled, a new connection is refused. */
Test(http, busy_connections_are_never_evicted, .timeout = 30)
{
    enum { CAP = 8 };
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 1024,
                                             .max_body_bytes = 4096, .max_write_queue_bytes = 65536,
                                             .max_connections = CAP});
    client_t *busy[CAP];
    for (int i = 0; i < CAP; i++) {
        busy[i] = client_new(s->h.port);
        client_sends(busy[i], "GET /hang HTTP/1.1\r\n\r\n");
    }
    cr_assert(wait_for(&s->handled, CAP));
    client_t *c = client_new(s->h.port);
    cr_assert(client_closed(c), "a connection past the cap was let in");
    client_free(c);
    cr_assert_eq(closed(s, "refused"), 1);
    cr_assert_eq(closed(s, "evicted"), 0);
    cr_assert_eq(atomic_load(&s->aborts), 0);
    for (int i = 0; i < CAP; i++)
        client_free(busy[i]);
    cr_assert(wait_for(&s->aborts, CAP));
    srv_stop(s);
}

Test(http, config_errors_are_clear)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    td_http_server_t *h = NULL;
    td_http_config_t cfg = td_http_config_default();
    cr_assert_eq(td_http_server_create(&loop, &cfg, &h), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "no handler"), "%s", td_last_error());
    cfg.handler = handler;
    cfg.host = "localhost";
    cr_assert_eq(td_http_server_create(&loop, &cfg, &h), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "\"localhost\" is not an IPv4 or IPv6 address"), "%s", td_last_error());
    cfg.host = "127.0.0.1";
    cfg.max_request_bytes = 10;
    cr_assert_eq(td_http_server_create(&loop, &cfg, &h), TD_ERR_INVALID);
    cr_assert_null(h);
    /* two servers on one registry share the counter, or count apart under two names */
    td_metrics_t *reg;
    cr_assert_eq(td_metrics_create(&reg), TD_OK);
    cfg = td_http_config_default();
    cfg.handler = handler;
    cfg.metrics = reg;
    td_http_server_t *a = NULL, *b = NULL;
    td_http_server_t *c = NULL;
    cr_assert_eq(td_http_server_create(&loop, &cfg, &a), TD_OK);
    cr_assert_eq(td_http_server_create(&loop, &cfg, &b), TD_OK);
    cfg.metrics_name = "tandem_openai_http_connections_closed_total";
    cr_assert_eq(td_http_server_create(&loop, &cfg, &c), TD_OK);
    char *text;
    size_t len;
    cr_assert_eq(td_metrics_render(reg, &text, &len), TD_OK);
    cr_assert(strstr(text, "tandem_openai_http_connections_closed_total{reason=\"evicted\"} 0"), "%s", text);
    free(text);
    td_http_server_close(a, NULL, NULL);
    td_http_server_close(b, NULL, NULL);
    td_http_server_close(c, NULL, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&loop), 0);
    td_metrics_destroy(reg);
}

/* In-process fuzzing: valid requests of every kind, mutated (bit flips, bytes inserted,
 * deleted, repeated, cut, spliced with another) by a fixed seed, each sent in random pieces on
 * its own connection and half-closed; the server must close every one (answered or not) and
 * still answer a good request after them. The sanitizer build is the real check. */
Test(http, mutated_requests_never_break_the_server, .timeout = 120)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 512,
                                             .max_body_bytes = 256, .max_write_queue_bytes = 4096,
                                             .max_connections = 16});
    static const char *const seeds[] = {
        "GET /info?a=b HTTP/1.1\r\nHost: x\r\nX-Test: y\r\n\r\n",
        "POST /echo HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
        "POST /async HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n0\r\nT: v\r\n\r\n",
        "POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok",
        "GET /stream?n=3&size=8 HTTP/1.1\r\n\r\nGET /info HTTP/1.1\r\n\r\n",
        "GET /stream?n=2&size=4 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        "HEAD /info HTTP/1.1\r\n\r\nPOST /echo HTTP/1.1\r\nContent-Length: 1\r\n\r\nz",
        "GET /hang HTTP/1.1\r\n\r\n",
    };
    uint64_t rng = 0x9e3779b97f4a7c15ull;
#define RND() (rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17, rng)
    static char buf[4096];
    for (int i = 0; i < 3000; i++) {
        const char *seed = seeds[RND() % TD_ARRAY_LEN(seeds)];
        size_t len = strlen(seed);
        memcpy(buf, seed, len);
        for (int m = 0, nm = 1 + (int)(RND() % 4); m < nm; m++) {
            size_t at = len ? RND() % len : 0;
            switch (RND() % 6) {
            case 0: buf[at] ^= (char)(1u << (RND() % 8)); break;
            case 1: /* insert a byte */
                if (len + 1 < sizeof buf) {
                    memmove(buf + at + 1, buf + at, len - at);
                    buf[at] = (char)RND();
                    len++;
                }
                break;
            case 2: /* delete a run */
                if (len) {
                    size_t n = 1 + RND() % 8;
                    n = n > len - at ? len - at : n;
                    memmove(buf + at, buf + at + n, len - at - n);
                    len -= n;
                }
                break;
            case 3: /* repeat a run */
                if (len) {
                    size_t n = 1 + RND() % 64;
                    n = n > len - at ? len - at : n;
                    for (int k = 0, times = 1 + (int)(RND() % 40); k < times && len + n < sizeof buf; k++) {
                        memmove(buf + at + n, buf + at, len - at);
                        len += n;
                    }
                }
                break;
            case 4: len = at; break; /* cut */
            default: { /* splice another seed's tail */
                const char *o = seeds[RND() % TD_ARRAY_LEN(seeds)];
                size_t ol = strlen(o), from = RND() % ol;
                if (at + ol - from < sizeof buf) {
                    memcpy(buf + at, o + from, ol - from);
                    len = at + ol - from;
                }
            }
            }
        }
        int fd = td_test_connect(s->h.port);
        for (size_t off = 0; off < len;) {
            size_t n = 1 + RND() % (len - off);
            if (send(fd, buf + off, n, MSG_NOSIGNAL) < 0)
                break;
            off += n;
        }
        shutdown(fd, SHUT_WR);
        char b[4096];
        ssize_t n;
        while ((n = recv(fd, b, sizeof b, 0)) > 0) {
        }
        cr_assert(n == 0 || errno == ECONNRESET, "case %d: the server left the connection open (%s)", i,
                  strerror(errno));
        close(fd);
    }
#undef RND
    int handled = atomic_load(&s->handled), aborts = atomic_load(&s->aborts);
    cr_log_info("fuzz: %d requests reached the handler, %d aborted", handled, aborts);
    cr_assert_gt(handled, 500, "the mutations should leave many requests whole (%d)", handled);
    cr_assert_gt(aborts, 10, "and some handled when their client went (%d)", aborts);
    client_t *c;
    cr_assert_eq(request(s, "GET /info HTTP/1.1\r\n\r\n", &c), 200);
    client_free(c);
    srv_stop(s);
}

/* A request refused on its head is answered before its body is sent: the client declares
 * 8 MiB, sends none of it and reads 401 "Connection: close"; the handler never sees it and
 * the connection ends. Refused without a body, the connection stays open for the next one;
 * with the key, the same request is read and answered. */
Test(http, refused_on_its_head_before_the_body, .timeout = 30)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 8192,
                                             .max_body_bytes = 8 << 20, .max_write_queue_bytes = 65536});
    client_t *c = client_new(s->h.port);
    uint64_t t0 = td_now_ns();
    client_sends(c, "POST /locked HTTP/1.1\r\nContent-Length: 8388608\r\n\r\n");
    cr_assert_eq(client_read(c), 401, "the refusal must come before the body");
    double took = (double)(td_now_ns() - t0) / 1e9;
    cr_assert(took < 1.0, "refused after %.2f s", took);
    cr_assert_str_eq(c->conn, "close");
    cr_assert_str_eq(c->body, "no key\n");
    cr_assert(client_closed(c), "the connection of a refused body stayed open");
    client_free(c);

    c = client_new(s->h.port); /* no body: keep-alive, the next request served */
    client_sends(c, "GET /locked HTTP/1.1\r\n\r\nPOST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi");
    cr_assert_eq(client_read(c), 401);
    cr_assert_str_eq(c->conn, "keep-alive");
    cr_assert_eq(client_read(c), 200);
    cr_assert_str_eq(c->body, "hi");
    client_sends(c, "POST /locked HTTP/1.1\r\nX-Key: ok\r\nContent-Length: 5\r\n\r\nhello");
    cr_assert_eq(client_read(c), 200);
    cr_assert_str_eq(c->body, "hello");
    client_free(c);
    cr_assert_eq(atomic_load(&s->refused), 2);
    cr_assert_eq(atomic_load(&s->handled), 2, "a refused request reached the handler");
    srv_stop(s);
}

/* One budget of bodies in flight over every connection: a declared body that does not fit
 * is refused (503) on its head, a chunked one as it grows past it; what a finished request
 * held is given back. */
Test(http, bodies_in_flight_share_one_budget, .timeout = 30)
{
    td_rpc_budget_t budget = {.limit = 100000};
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 8192,
                                             .max_body_bytes = 1 << 20, .max_write_queue_bytes = 1 << 20,
                                             .body_budget = &budget});
    static char big[80000];
    memset(big, 'b', sizeof big);
    client_t *a = client_new(s->h.port);
    client_sends(a, "POST /echo HTTP/1.1\r\nContent-Length: 80000\r\n\r\n");
    client_send(a, big, 10); /* 80,000 bytes taken, 10 sent */
    usleep(100000);
    client_t *b = client_new(s->h.port);
    client_sends(b, "POST /echo HTTP/1.1\r\nContent-Length: 30000\r\n\r\n");
    cr_assert_eq(client_read(b), 503, "a body past the budget must be refused on its head");
    cr_assert(strstr(b->body, "bodies"), "503 says why: %s", b->body);
    client_free(b);
    b = client_new(s->h.port);
    client_sends(b, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n7530\r\n");
    client_send(b, big, 30000);
    cr_assert_eq(client_read(b), 503, "a chunked body growing past the budget must be refused");
    client_free(b);
    client_send(a, big + 10, sizeof big - 10);
    a->max_body = 1;
    cr_assert_eq(client_read(a), 200);
    cr_assert_eq(a->body_len, sizeof big);
    client_free(a);
    b = client_new(s->h.port); /* given back: the same body now fits */
    client_sends(b, "POST /echo HTTP/1.1\r\nContent-Length: 30000\r\n\r\n");
    client_send(b, big, 30000);
    b->max_body = 1;
    cr_assert_eq(client_read(b), 200);
    client_free(b);
    srv_stop(s);
    cr_assert_eq(budget.used, 0, "%zu bytes never given back", budget.used);
    cr_assert_eq(budget.refused, 2);
}

/* A body trickled slower than the body deadline gets 408 at that deadline, long before the
 * request deadline, and the connection closes. */
Test(http, a_slow_body_gets_408_at_the_body_deadline, .timeout = 30)
{
    srv_t *s = srv_start(&(td_http_config_t){.host = "127.0.0.1", .max_request_bytes = 8192,
                                             .max_body_bytes = 1 << 20, .max_write_queue_bytes = 65536,
                                             .request_timeout_ms = 20000, .body_timeout_ms = 300});
    client_t *c = client_new(s->h.port);
    uint64_t t0 = td_now_ns();
    client_sends(c, "POST /echo HTTP/1.1\r\nContent-Length: 100\r\n\r\n0123456789");
    cr_assert_eq(client_read(c), 408);
    double took = (double)(td_now_ns() - t0) / 1e9;
    cr_assert(took > 0.25 && took < 3.0, "408 after %.2f s, the body deadline is 0.3 s", took);
    cr_assert_str_eq(c->conn, "close");
    cr_assert(client_closed(c));
    client_free(c);
    cr_assert_eq(closed(s, "body_timeout"), 1);
    cr_assert_eq(atomic_load(&s->handled), 0);
    srv_stop(s);
}
