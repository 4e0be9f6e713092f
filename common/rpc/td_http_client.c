/*
 * td_http_client: a keep-alive HTTP/1.1 connection, one request at a time, SSE events handed
 * out as they are read or the whole body kept; and the blocking GET built on it (contract in
 * td_http_client.h).
 */
#include "td_http_client.h"

#include <http_parser.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_util.h"

#define HC_MAX_EVENT (64u << 10) /* an SSE event, or the body of an error answer, kept */

struct td_http_client {
    uv_tcp_t tcp;
    uv_connect_t connect;
    uv_write_t write;
    http_parser parser;
    const td_http_client_ops_t *ops;
    void *data;
    bool connected, closing, busy;
    bool complete, keep_alive; /* the answer ended: on_done once the parser has returned */
    const char *req;          /* the request waiting for the connection, or NULL */
    size_t req_len;
    char *ev;                 /* [HC_MAX_EVENT] the event (or error body) being read */
    size_t ev_len;
    size_t keep_max;          /* td_http_client_keep_body: a 200 body kept whole, up to this; 0: SSE */
    char *body;               /* [body_cap] that body */
    size_t body_len, body_cap;
    bool body_over;           /* it passed keep_max */
    char rbuf[64 << 10];
};

static void hc_on_close(uv_handle_t *h)
{
    td_http_client_t *c = h->data;
    if (c->ops->on_close)
        c->ops->on_close(c);
    free(c->ev);
    free(c->body);
    free(c);
}

static void hc_free(uv_handle_t *h)
{
    td_http_client_t *c = h->data;
    free(c->ev);
    free(c);
}

/* Ends the request in flight (status 0, why) and closes the connection. */
static void hc_lose(td_http_client_t *c, const char *why)
{
    if (c->closing)
        return;
    c->closing = true;
    if (c->busy) {
        c->busy = false;
        c->ops->on_done(c, 0, why, strlen(why), false);
    }
    uv_close((uv_handle_t *)&c->tcp, hc_on_close);
}

void td_http_client_close(td_http_client_t *c)
{
    if (c)
        hc_lose(c, "connection closed by the client");
}

void *td_http_client_data(const td_http_client_t *c)
{
    return c->data;
}

bool td_http_client_busy(const td_http_client_t *c)
{
    return c->busy;
}

static int hc_on_body(http_parser *p, const char *at, size_t len)
{
    td_http_client_t *c = p->data;
    if (p->status_code != 200) { /* kept for on_done */
        size_t n = TD_MIN(len, HC_MAX_EVENT - 1 - c->ev_len);
        memcpy(c->ev + c->ev_len, at, n);
        c->ev_len += n;
        return 0;
    }
    if (c->keep_max) { /* kept whole */
        if (c->body_over || c->body_len + len > c->keep_max) {
            c->body_over = true;
            return 0;
        }
        if (c->body_len + len + 1 > c->body_cap) {
            size_t cap = TD_MAX(c->body_cap * 2, c->body_len + len + 1);
            char *b = realloc(c->body, TD_MAX(cap, (size_t)4096));
            if (!b) {
                c->body_over = true;
                return 0;
            }
            c->body = b;
            c->body_cap = TD_MAX(cap, (size_t)4096);
        }
        memcpy(c->body + c->body_len, at, len);
        c->body_len += len;
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
        size_t n = TD_MIN(end - i, HC_MAX_EVENT - 1 - c->ev_len); /* an oversized event is cut */
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

static int hc_on_complete(http_parser *p)
{
    td_http_client_t *c = p->data;
    c->complete = true;
    c->keep_alive = http_should_keep_alive(p);
    return 0;
}

static const http_parser_settings hc_settings = {.on_body = hc_on_body, .on_message_complete = hc_on_complete};

static void hc_alloc(uv_handle_t *h, size_t size, uv_buf_t *buf)
{
    td_http_client_t *c = h->data;
    *buf = uv_buf_init(c->rbuf, sizeof c->rbuf);
}

static void hc_on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *buf)
{
    td_http_client_t *c = st->data;
    if (n < 0) {
        char why[128];
        snprintf(why, sizeof why, "connection: %s", uv_strerror((int)n));
        hc_lose(c, why);
        return;
    }
    size_t used = http_parser_execute(&c->parser, &hc_settings, buf->base, (size_t)n);
    if (HTTP_PARSER_ERRNO(&c->parser) != HPE_OK || used != (size_t)n) {
        char why[160];
        snprintf(why, sizeof why, "bad HTTP answer: %s", http_errno_description(HTTP_PARSER_ERRNO(&c->parser)));
        hc_lose(c, why);
        return;
    }
    if (!c->complete || !c->busy)
        return;
    c->complete = false;
    c->busy = false;
    unsigned status = c->parser.status_code;
    c->ev[status == 200 ? 0 : c->ev_len] = '\0';
    bool keep = c->keep_alive;
    if (status == 200 && c->keep_max && c->body_over) {
        char why[96];
        snprintf(why, sizeof why, "answer over %zu bytes (or out of memory)", c->keep_max);
        c->ops->on_done(c, 0, why, strlen(why), keep);
    } else if (status == 200 && c->keep_max) {
        if (c->body)
            c->body[c->body_len] = '\0';
        c->ops->on_done(c, status, c->body ? c->body : "", c->body_len, keep);
    } else {
        c->ops->on_done(c, status, c->ev, status == 200 ? 0 : c->ev_len, keep);
    }
    if (!keep)
        hc_lose(c, "the server closed the connection");
}

static void hc_on_write(uv_write_t *w, int status)
{
    td_http_client_t *c = w->data;
    if (status < 0) {
        char why[128];
        snprintf(why, sizeof why, "send: %s", uv_strerror(status));
        hc_lose(c, why);
    }
}

static void hc_write(td_http_client_t *c)
{
    uv_buf_t b = uv_buf_init((char *)c->req, (unsigned)c->req_len);
    c->req = NULL;
    c->write.data = c;
    int rc = uv_write(&c->write, (uv_stream_t *)&c->tcp, &b, 1, hc_on_write);
    if (rc) {
        char why[128];
        snprintf(why, sizeof why, "send: %s", uv_strerror(rc));
        hc_lose(c, why);
    }
}

static void hc_on_connect(uv_connect_t *cr, int status)
{
    td_http_client_t *c = cr->data;
    if (c->closing)
        return;
    if (status < 0) {
        char why[128];
        snprintf(why, sizeof why, "connect: %s", uv_strerror(status));
        hc_lose(c, why);
        return;
    }
    c->connected = true;
    uv_tcp_nodelay(&c->tcp, 1);
    uv_read_start((uv_stream_t *)&c->tcp, hc_alloc, hc_on_read);
    if (c->req)
        hc_write(c);
}

void td_http_client_send(td_http_client_t *c, const char *req, size_t len)
{
    TD_ASSERT(!c->busy && !c->closing);
    http_parser_init(&c->parser, HTTP_RESPONSE);
    c->parser.data = c;
    c->ev_len = 0;
    c->body_len = 0;
    c->body_over = false;
    c->complete = false;
    c->busy = true;
    c->req = req;
    c->req_len = len;
    if (c->connected)
        hc_write(c);
}

td_status_t td_http_client_open(uv_loop_t *loop, const struct sockaddr *addr, const td_http_client_ops_t *ops, void *data,
                                 td_http_client_t **c_p)
{
    td_http_client_t *c = calloc(1, sizeof *c);
    if (!c || !(c->ev = malloc(HC_MAX_EVENT))) {
        free(c);
        return td_errorf(TD_ERR_NOMEM, "http client: out of memory for a connection");
    }
    c->ops = ops;
    c->data = data;
    c->tcp.data = c->connect.data = c;
    uv_tcp_init(loop, &c->tcp);
    int rc = uv_tcp_connect(&c->connect, &c->tcp, addr, hc_on_connect);
    if (rc) {
        uv_close((uv_handle_t *)&c->tcp, hc_free); /* no callback of the caller's runs */
        return td_errorf_quiet(TD_ERR_IO, "connect: %s", uv_strerror(rc));
    }
    *c_p = c;
    return TD_OK;
}

void td_http_client_keep_body(td_http_client_t *c, size_t max_bytes)
{
    c->keep_max = max_bytes;
}

/* ---- URLs and the blocking GET ------------------------------------------------------------ */

td_status_t td_http_url_parse(const char *url, const char *flag, td_http_url_t *u_p)
{
    td_http_url_t u = {.port = 80};
    const char *p = url;
    if (strncmp(p, "http://", 7))
        return td_errorf(TD_ERR_INVALID, "%s: '%s' is not http://HOST:PORT[/PATH] (https is not supported)", flag,
                         url);
    p += 7;
    size_t hl = strcspn(p, ":/");
    if (!hl || hl >= sizeof u.host)
        return td_errorf(TD_ERR_INVALID, "%s: no host in '%s'", flag, url);
    memcpy(u.host, p, hl);
    p += hl;
    if (*p == ':') {
        char *e;
        unsigned long port = strtoul(p + 1, &e, 10);
        if (e == p + 1 || port == 0 || port > 65535 || (*e && *e != '/'))
            return td_errorf(TD_ERR_INVALID, "%s: bad port in '%s'", flag, url);
        u.port = (uint16_t)port;
        p = e;
    }
    if (strlen(p) >= sizeof u.path - 5)
        return td_errorf(TD_ERR_INVALID, "%s: path too long in '%s'", flag, url);
    snprintf(u.path, sizeof u.path, "%s", p);
    *u_p = u;
    return TD_OK;
}

/* One GET in flight on its own loop: the answer, or why there is none. */
typedef struct hc_get {
    td_http_client_t *c;
    uv_timer_t deadline;
    bool done, timed_out;
    unsigned status;
    char *body;               /* malloc'd: the 200 body, or the error body / why */
    size_t len;
} hc_get_t;

static void hc_get_done(td_http_client_t *c, unsigned status, const char *body, size_t len, bool keep_alive)
{
    hc_get_t *g = td_http_client_data(c);
    g->done = true;
    g->status = status;
    if ((g->body = malloc(len + 1))) {
        memcpy(g->body, body, len);
        g->body[len] = '\0';
        g->len = len;
    }
    uv_timer_stop(&g->deadline);
    if (keep_alive)
        td_http_client_close(c);
}

static void hc_get_closed(td_http_client_t *c)
{
    hc_get_t *g = td_http_client_data(c);
    g->c = NULL;
}

static void hc_get_expire(uv_timer_t *t)
{
    hc_get_t *g = t->data;
    g->timed_out = true;
    td_http_client_close(g->c); /* on_done: status 0 */
}

static const td_http_client_ops_t hc_get_ops = {.on_done = hc_get_done, .on_close = hc_get_closed};

td_status_t td_http_client_get(const char *url, const char *flag, const char *default_path, uint32_t timeout_ms,
                               char **body_p)
{
    td_http_url_t u;
    td_status_t st = td_http_url_parse(url, flag, &u);
    if (st != TD_OK)
        return st;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char port[8], req[768];
    snprintf(port, sizeof port, "%u", u.port);
    int rc = getaddrinfo(u.host, port, &hints, &ai);
    if (rc || !ai)
        return td_errorf(TD_ERR_UNAVAILABLE, "%s: cannot resolve '%s': %s", flag, u.host, gai_strerror(rc));
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: %s:%u\r\nConnection: close\r\n\r\n",
                     u.path[0] ? u.path : default_path, u.host, u.port);
    uv_loop_t loop;
    hc_get_t g = {0};
    uv_loop_init(&loop);
    uv_timer_init(&loop, &g.deadline);
    g.deadline.data = &g;
    st = td_http_client_open(&loop, ai->ai_addr, &hc_get_ops, &g, &g.c);
    freeaddrinfo(ai);
    if (st == TD_OK) {
        td_http_client_keep_body(g.c, (size_t)64 << 20);
        td_http_client_send(g.c, req, (size_t)n);
        uv_timer_start(&g.deadline, hc_get_expire, timeout_ms, 0);
        uv_run(&loop, UV_RUN_DEFAULT); /* the deadline bounds it */
    } else {
        st = td_errorf(TD_ERR_UNAVAILABLE, "%s: cannot connect to %s:%u: %s", flag, u.host, u.port, td_last_error());
    }
    uv_close((uv_handle_t *)&g.deadline, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    if (st != TD_OK) {
        free(g.body);
        return st;
    }
    if (g.status == 200 && g.body) {
        *body_p = g.body;
        return TD_OK;
    }
    if (!g.body)
        st = td_errorf(TD_ERR_NOMEM, "%s: out of memory for the answer of %s", flag, url);
    else if (g.timed_out)
        st = td_errorf(TD_ERR_UNAVAILABLE, "%s: %s did not answer within %u ms", flag, url, timeout_ms);
    else if (g.status == 0)
        st = td_errorf(TD_ERR_UNAVAILABLE, "%s: %s: %s", flag, url, g.body);
    else
        st = td_errorf(TD_ERR_UNAVAILABLE, "%s: %s answered %u, not 200: %.200s", flag, url, g.status, g.body);
    free(g.body);
    return st;
}
