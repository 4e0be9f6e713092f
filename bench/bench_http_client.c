/*
 * bench_http_client: a keep-alive HTTP/1.1 connection for the load generators, one request
 * at a time, SSE events handed out as they are read (contract in bench_http_client.h).
 */
#include "bench_http_client.h"

#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_util.h"

#define BH_MAX_EVENT (64u << 10) /* an SSE event, or the body of an error answer, kept */

struct bench_http_conn {
    uv_tcp_t tcp;
    uv_connect_t connect;
    uv_write_t write;
    http_parser parser;
    const bench_http_ops_t *ops;
    void *data;
    bool connected, closing, busy;
    bool complete, keep_alive; /* the answer ended: on_done once the parser has returned */
    const char *req;          /* the request waiting for the connection, or NULL */
    size_t req_len;
    char *ev;                 /* [BH_MAX_EVENT] the event (or error body) being read */
    size_t ev_len;
    char rbuf[64 << 10];
};

static void bh_on_close(uv_handle_t *h)
{
    bench_http_conn_t *c = h->data;
    if (c->ops->on_close)
        c->ops->on_close(c);
    free(c->ev);
    free(c);
}

static void bh_free(uv_handle_t *h)
{
    bench_http_conn_t *c = h->data;
    free(c->ev);
    free(c);
}

/* Ends the request in flight (status 0, why) and closes the connection. */
static void bh_lose(bench_http_conn_t *c, const char *why)
{
    if (c->closing)
        return;
    c->closing = true;
    if (c->busy) {
        c->busy = false;
        c->ops->on_done(c, 0, why, strlen(why), false);
    }
    uv_close((uv_handle_t *)&c->tcp, bh_on_close);
}

void bench_http_conn_close(bench_http_conn_t *c)
{
    if (c)
        bh_lose(c, "connection closed by the client");
}

void *bench_http_conn_data(const bench_http_conn_t *c)
{
    return c->data;
}

bool bench_http_conn_busy(const bench_http_conn_t *c)
{
    return c->busy;
}

static int bh_on_body(http_parser *p, const char *at, size_t len)
{
    bench_http_conn_t *c = p->data;
    if (p->status_code != 200) { /* kept for on_done */
        size_t n = TD_MIN(len, BH_MAX_EVENT - 1 - c->ev_len);
        memcpy(c->ev + c->ev_len, at, n);
        c->ev_len += n;
        return 0;
    }
    /* line by line (memchr, memcpy): a byte at a time was three quarters of the load
     * generator's CPU in `bench router --http` phase c, where it, not the router, set the
     * relayed tokens/s; an event ends at an empty line */
    uint64_t now = td_now_ns();
    size_t i = 0;
    while (i < len) {
        const char *nl = memchr(at + i, '\n', len - i);
        size_t end = nl ? (size_t)(nl - at) + 1 : len;
        size_t n = TD_MIN(end - i, BH_MAX_EVENT - 1 - c->ev_len); /* an oversized event is cut */
        memcpy(c->ev + c->ev_len, at + i, n);
        c->ev_len += n;
        i = end;
        if (nl && c->ev_len >= 2 && c->ev[c->ev_len - 1] == '\n' && c->ev[c->ev_len - 2] == '\n') {
            c->ev_len -= 2;
            c->ev[c->ev_len] = '\0';
            if (c->ops->on_event)
                c->ops->on_event(c, c->ev, c->ev_len, now);
            c->ev_len = 0;
        }
    }
    return 0;
}

static int bh_on_complete(http_parser *p)
{
    bench_http_conn_t *c = p->data;
    c->complete = true;
    c->keep_alive = http_should_keep_alive(p);
    return 0;
}

static const http_parser_settings bh_settings = {.on_body = bh_on_body, .on_message_complete = bh_on_complete};

static void bh_alloc(uv_handle_t *h, size_t size, uv_buf_t *buf)
{
    bench_http_conn_t *c = h->data;
    *buf = uv_buf_init(c->rbuf, sizeof c->rbuf);
}

static void bh_on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf)
{
    bench_http_conn_t *c = st->data;
    if (n < 0) {
        char why[128];
        snprintf(why, sizeof why, "connection: %s", uv_strerror((int)n));
        bh_lose(c, why);
        return;
    }
    size_t used = http_parser_execute(&c->parser, &bh_settings, buf->base, (size_t)n);
    if (HTTP_PARSER_ERRNO(&c->parser) != HPE_OK || used != (size_t)n) {
        char why[160];
        snprintf(why, sizeof why, "bad HTTP answer: %s", http_errno_description(HTTP_PARSER_ERRNO(&c->parser)));
        bh_lose(c, why);
        return;
    }
    if (!c->complete || !c->busy)
        return;
    c->complete = false;
    c->busy = false;
    unsigned status = c->parser.status_code;
    c->ev[status == 200 ? 0 : c->ev_len] = '\0';
    bool keep = c->keep_alive;
    c->ops->on_done(c, status, c->ev, status == 200 ? 0 : c->ev_len, keep);
    if (!keep)
        bh_lose(c, "the server closed the connection");
}

static void bh_on_write(uv_write_t *w, int status)
{
    bench_http_conn_t *c = w->data;
    if (status < 0) {
        char why[128];
        snprintf(why, sizeof why, "send: %s", uv_strerror(status));
        bh_lose(c, why);
    }
}

static void bh_write(bench_http_conn_t *c)
{
    uv_buf_t b = uv_buf_init((char *)c->req, (unsigned)c->req_len);
    c->req = NULL;
    c->write.data = c;
    int rc = uv_write(&c->write, (uv_stream_t *)&c->tcp, &b, 1, bh_on_write);
    if (rc) {
        char why[128];
        snprintf(why, sizeof why, "send: %s", uv_strerror(rc));
        bh_lose(c, why);
    }
}

static void bh_on_connect(uv_connect_t *cr, int status)
{
    bench_http_conn_t *c = cr->data;
    if (c->closing)
        return;
    if (status < 0) {
        char why[128];
        snprintf(why, sizeof why, "connect: %s", uv_strerror(status));
        bh_lose(c, why);
        return;
    }
    c->connected = true;
    uv_tcp_nodelay(&c->tcp, 1);
    uv_read_start((uv_stream_t *)&c->tcp, bh_alloc, bh_on_read);
    if (c->req)
        bh_write(c);
}

void bench_http_conn_send(bench_http_conn_t *c, const char *req, size_t len)
{
    TD_ASSERT(!c->busy && !c->closing);
    http_parser_init(&c->parser, HTTP_RESPONSE);
    c->parser.data = c;
    c->ev_len = 0;
    c->complete = false;
    c->busy = true;
    c->req = req;
    c->req_len = len;
    if (c->connected)
        bh_write(c);
}

td_status_t bench_http_conn_open(uv_loop_t *loop, const struct sockaddr *addr, const bench_http_ops_t *ops, void *data,
                                 bench_http_conn_t **c_p)
{
    bench_http_conn_t *c = calloc(1, sizeof *c);
    if (!c || !(c->ev = malloc(BH_MAX_EVENT))) {
        free(c);
        return td_errorf(TD_ERR_NOMEM, "bench: out of memory for an HTTP connection");
    }
    c->ops = ops;
    c->data = data;
    c->tcp.data = c->connect.data = c;
    uv_tcp_init(loop, &c->tcp);
    int rc = uv_tcp_connect(&c->connect, &c->tcp, addr, bh_on_connect);
    if (rc) {
        uv_close((uv_handle_t *)&c->tcp, bh_free); /* no callback of the caller's runs */
        return td_errorf_quiet(TD_ERR_IO, "connect: %s", uv_strerror(rc));
    }
    *c_p = c;
    return TD_OK;
}
