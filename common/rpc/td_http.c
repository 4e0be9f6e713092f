/*
 * td_http: the HTTP/1.1 server behind td_http.h.
 *
 * Each connection owns a TCP handle, an idle timer and a fixed request buffer of
 * max_request_bytes. Complete requests (headers ended by CRLFCRLF, plus Content-Length
 * bytes) are parsed in place, answered with one uv_write of headers + body, and consumed;
 * reading pauses while a response is in flight so a client cannot make us queue
 * unbounded responses. The connection's memory is freed when both handles have closed.
 */
#include "td_http.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "td_list.h"
#include "td_log.h"
#include "td_rpc_tcp.h"
#include "td_util.h"

typedef struct http_conn http_conn_t;

/* Why the server closed a connection itself (the `reason` label). */
enum { CLOSE_REQUEST, CLOSE_IDLE, CLOSE_EVICTED, CLOSE_REFUSED, CLOSE_N };
static const char *const close_names[CLOSE_N] = {"request_timeout", "idle_timeout", "evicted", "refused"};

struct td_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    td_http_config_t cfg;
    uint16_t port;
    td_list_t conns;            /* live connections, newest first (http_conn_t.link) */
    uint32_t n_conns;
    bool closing;
    int pending_closes;         /* listener + connections still closing (any connection closed
                                 * before the server was is still in flight when it closes) */
    void (*close_cb)(void *data);
    void *close_data;
    td_metric_t *closed_by[CLOSE_N]; /* tandem_http_server_connections_closed_total{reason} */
};

struct http_conn {
    td_list_t link;             /* in srv->conns until it starts closing */
    td_http_server_t *srv;
    uv_tcp_t tcp;
    uv_timer_t idle;            /* one-shot: idle_timeout_ms, or request_timeout_ms once a
                                 * request's first byte came; never restarted by bytes */
    uv_write_t wreq;
    char *buf;                  /* [cfg.max_request_bytes] */
    size_t len;
    char *out;                  /* the response in flight */
    bool writing, close_after_write, closing;
    bool in_request;            /* a request's first byte came, its answer is not written */
    bool served;                /* answered a request once */
    uint64_t since;             /* uv_now at accept or the last answer written */
    int open_handles;
};

td_http_config_t td_http_config_default(void)
{
    return (td_http_config_t){
        .host = "127.0.0.1",
        .port = 0,
        .max_request_bytes = 8192,
        .max_connections = 64,
        .idle_timeout_ms = 30000,
        .request_timeout_ms = 10000,
    };
}

static void server_maybe_done(td_http_server_t *srv)
{
    if (!srv->closing || srv->pending_closes > 0)
        return;
    void (*cb)(void *) = srv->close_cb;
    void *data = srv->close_data;
    free(srv);
    if (cb)
        cb(data);
}

static void conn_handle_closed(uv_handle_t *h)
{
    http_conn_t *c = h->data;
    if (--c->open_handles > 0)
        return;
    td_http_server_t *srv = c->srv;
    free(c->buf);
    free(c->out);
    free(c);
    srv->pending_closes--;
    server_maybe_done(srv);
}

static void conn_close(http_conn_t *c)
{
    if (c->closing)
        return;
    c->closing = true;
    td_http_server_t *srv = c->srv;
    td_list_remove(&c->link);
    srv->n_conns--;
    srv->pending_closes++;
    uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
    uv_close((uv_handle_t *)&c->idle, conn_handle_closed);
}

static void count_close(td_http_server_t *srv, int why)
{
    if (srv->closed_by[why])
        td_metric_inc(srv->closed_by[why]);
}

static void on_idle(uv_timer_t *t)
{
    http_conn_t *c = t->data;
    td_debug("http connection: closed, %s", close_names[c->in_request ? CLOSE_REQUEST : CLOSE_IDLE]);
    count_close(c->srv, c->in_request ? CLOSE_REQUEST : CLOSE_IDLE);
    conn_close(c);
}

/* Starts the request clock if bytes of a request are waiting and it is not running. */
static void conn_request_begun(http_conn_t *c)
{
    if (c->in_request || c->len == 0)
        return;
    c->in_request = true;
    uv_timer_start(&c->idle, on_idle, c->srv->cfg.request_timeout_ms, 0);
}

static void conn_process(http_conn_t *c);

static void on_write(uv_write_t *req, int status)
{
    http_conn_t *c = req->data;
    free(c->out);
    c->out = NULL;
    c->writing = false;
    if (c->closing)
        return;
    if (status < 0 || c->close_after_write) {
        conn_close(c);
        return;
    }
    c->in_request = false;
    c->served = true;
    c->since = uv_now(c->srv->loop);
    uv_timer_start(&c->idle, on_idle, c->srv->cfg.idle_timeout_ms, 0);
    conn_request_begun(c); /* a pipelined request may already be buffered */
    conn_process(c);
}

static const char *reason_phrase(int status)
{
    switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
    }
}

/* Queues one response; takes ownership of body. */
static void conn_reply(http_conn_t *c, int status, const char *ctype, char *body, size_t body_len,
                       bool keep_alive)
{
    char head[512];
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
                     "Connection: %s\r\n\r\n",
                     status, reason_phrase(status), ctype ? ctype : "text/plain; charset=utf-8",
                     body_len, keep_alive ? "keep-alive" : "close");
    if (n < 0 || (size_t)n >= sizeof head) /* only an absurd content type gets here */
        n = snprintf(head, sizeof head, "HTTP/1.1 500 %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                     reason_phrase(500)),
        body_len = 0, keep_alive = false;
    char *out = malloc((size_t)n + body_len);
    if (!out) {
        free(body);
        conn_close(c);
        return;
    }
    memcpy(out, head, (size_t)n);
    if (body_len)
        memcpy(out + n, body, body_len);
    free(body);
    c->out = out;
    c->writing = true;
    c->close_after_write = !keep_alive;
    c->wreq.data = c;
    uv_buf_t b = uv_buf_init(out, (unsigned)((size_t)n + body_len));
    int rc = uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &b, 1, on_write);
    if (rc < 0) {
        free(out);
        c->out = NULL;
        c->writing = false;
        conn_close(c);
    }
}

static void conn_error(http_conn_t *c, int status, const char *msg)
{
    char *body = strdup(msg);
    conn_reply(c, status, NULL, body, body ? strlen(body) : 0, false);
}

/* Finds header `name` (case-insensitive) in the CRLF-separated block [p, end). */
static const char *find_header(const char *p, const char *end, const char *name, size_t *vlen)
{
    size_t nl = strlen(name);
    while (p < end) {
        const char *eol = memchr(p, '\r', (size_t)(end - p));
        if (!eol)
            eol = end;
        if ((size_t)(eol - p) > nl && p[nl] == ':' && strncasecmp(p, name, nl) == 0) {
            const char *v = p + nl + 1;
            while (v < eol && (*v == ' ' || *v == '\t'))
                v++;
            *vlen = (size_t)(eol - v);
            return v;
        }
        p = eol + 2;
    }
    return NULL;
}

/* Handles every complete request in the buffer, one at a time (the next waits for the
 * previous response's write). */
static void conn_process(http_conn_t *c)
{
    td_http_server_t *srv = c->srv;
    if (c->writing || c->closing || c->len == 0)
        return;
    char *hdr_end = NULL;
    for (size_t i = 0; i + 3 < c->len; i++)
        if (memcmp(c->buf + i, "\r\n\r\n", 4) == 0) {
            hdr_end = c->buf + i;
            break;
        }
    if (!hdr_end) {
        if (c->len >= srv->cfg.max_request_bytes)
            conn_error(c, 431, "request too large\n");
        return;
    }
    /* request line: METHOD SP TARGET SP HTTP/1.x */
    char *line_end = memchr(c->buf, '\r', (size_t)(hdr_end - c->buf) + 1);
    char *sp1 = memchr(c->buf, ' ', (size_t)(line_end - c->buf));
    char *sp2 = sp1 ? memchr(sp1 + 1, ' ', (size_t)(line_end - sp1 - 1)) : NULL;
    if (!sp1 || !sp2 || sp1 == c->buf || sp2 == sp1 + 1 || line_end - sp2 - 1 != 8 ||
        memcmp(sp2 + 1, "HTTP/1.", 7) != 0 || (sp2[8] != '0' && sp2[8] != '1')) {
        conn_error(c, 400, "bad request line\n");
        return;
    }
    for (char *p = c->buf; p < sp1; p++)
        if (!isupper((unsigned char)*p)) {
            conn_error(c, 400, "bad method\n");
            return;
        }
    for (char *p = sp1 + 1; p < sp2; p++)
        if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f) {
            conn_error(c, 400, "bad request target\n");
            return;
        }
    bool http10 = sp2[8] == '0';
    const char *hdrs = line_end + 2, *hend = hdr_end + 2;
    size_t vlen = 0;
    const char *conn_hdr = find_header(hdrs, hend, "Connection", &vlen);
    bool keep_alive = !http10;
    if (conn_hdr && vlen == 5 && strncasecmp(conn_hdr, "close", 5) == 0)
        keep_alive = false;
    if (conn_hdr && vlen == 10 && strncasecmp(conn_hdr, "keep-alive", 10) == 0)
        keep_alive = true;
    size_t body_len = 0;
    const char *cl = find_header(hdrs, hend, "Content-Length", &vlen);
    if (cl) {
        char num[24];
        int64_t v;
        if (vlen == 0 || vlen >= sizeof num) {
            conn_error(c, 400, "bad content-length\n");
            return;
        }
        memcpy(num, cl, vlen);
        num[vlen] = '\0';
        if (td_parse_i64(num, 0, (int64_t)srv->cfg.max_request_bytes, "content-length", &v) != TD_OK) {
            conn_error(c, 413, "body too large\n");
            return;
        }
        body_len = (size_t)v;
    }
    if (find_header(hdrs, hend, "Transfer-Encoding", &vlen)) {
        conn_error(c, 400, "chunked bodies are not supported\n");
        return;
    }
    size_t req_len = (size_t)(hdr_end + 4 - c->buf) + body_len;
    if (req_len > srv->cfg.max_request_bytes) {
        conn_error(c, 413, "body too large\n");
        return;
    }
    if (c->len < req_len)
        return; /* body still arriving */

    *sp1 = '\0';
    *sp2 = '\0';
    td_http_reply_t reply = {0};
    srv->cfg.handler(srv->cfg.handler_data, c->buf, sp1 + 1, &reply);
    memmove(c->buf, c->buf + req_len, c->len - req_len);
    c->len -= req_len;
    if (reply.status == 0) {
        free(reply.body);
        reply = (td_http_reply_t){.status = 404, .body = strdup("not found\n")};
        reply.body_len = reply.body ? strlen(reply.body) : 0;
    }
    conn_reply(c, reply.status, reply.content_type, reply.body, reply.body_len, keep_alive);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    http_conn_t *c = h->data;
    size_t room = c->srv->cfg.max_request_bytes - c->len;
    *buf = uv_buf_init(c->buf + c->len, (unsigned)room);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    http_conn_t *c = s->data;
    if (nread < 0) {
        conn_close(c);
        return;
    }
    if (nread == 0 || c->closing)
        return;
    c->len += (size_t)nread;
    conn_request_begun(c);
    if (c->writing && c->len >= c->srv->cfg.max_request_bytes) {
        uv_read_stop(s); /* resumes never: a client that floods while we answer is dropped */
        conn_close(c);
        return;
    }
    conn_process(c);
}

/* The connection to close to make room: not being answered; one that never completed a
 * request first, then the one idle longest; oldest first in each. */
static http_conn_t *pick_victim(td_http_server_t *srv, const http_conn_t *except)
{
    http_conn_t *best = NULL;
    TD_LIST_FOREACH(n, &srv->conns) {
        http_conn_t *c = TD_CONTAINER_OF(n, http_conn_t, link);
        if (c == except || c->closing || c->writing)
            continue;
        if (!best || (!c->served && best->served) ||
            (c->served == best->served && c->since < best->since))
            best = c;
    }
    return best;
}

static void on_connection(uv_stream_t *listener, int status)
{
    td_http_server_t *srv = listener->data;
    if (status < 0 || srv->closing)
        return;
    http_conn_t *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->buf = malloc(srv->cfg.max_request_bytes);
    if (!c->buf) {
        free(c);
        return;
    }
    c->srv = srv;
    uv_tcp_init(srv->loop, &c->tcp);
    uv_timer_init(srv->loop, &c->idle);
    c->tcp.data = c;
    c->idle.data = c;
    c->open_handles = 2;
    c->since = uv_now(srv->loop);
    td_list_push_front(&srv->conns, &c->link);
    srv->n_conns++;
    if (uv_accept(listener, (uv_stream_t *)&c->tcp) < 0) {
        conn_close(c);
        return;
    }
    if (srv->n_conns > srv->cfg.max_connections) {
        http_conn_t *victim = pick_victim(srv, c);
        count_close(srv, victim ? CLOSE_EVICTED : CLOSE_REFUSED);
        if (!victim) {
            td_warn("http server: connection limit %u reached and every connection is being answered, "
                    "refusing a connection", srv->cfg.max_connections);
            conn_close(c);
            return;
        }
        conn_close(victim);
    }
    uv_tcp_nodelay(&c->tcp, 1);
    uv_timer_start(&c->idle, on_idle, srv->cfg.idle_timeout_ms, 0);
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0)
        conn_close(c);
}

static void on_listener_closed(uv_handle_t *h)
{
    td_http_server_t *srv = h->data;
    srv->pending_closes--;
    server_maybe_done(srv);
}

td_status_t td_http_server_create(uv_loop_t *loop, const td_http_config_t *cfg,
                                  td_http_server_t **srv_p)
{
    struct sockaddr_storage addr;
    if (!cfg->handler)
        return td_errorf(TD_ERR_INVALID, "http: no handler given");
    if (cfg->max_request_bytes < 64)
        return td_errorf(TD_ERR_INVALID, "http: max_request_bytes %zu is below 64", cfg->max_request_bytes);
    if (!td_rpc_tcp_addr(cfg->host, cfg->port, &addr))
        return td_errorf(TD_ERR_INVALID, "http: host \"%s\" is not an IPv4 or IPv6 address", cfg->host);
    td_http_server_t *srv = calloc(1, sizeof *srv);
    if (!srv)
        return td_errorf(TD_ERR_NOMEM, "http: out of memory");
    srv->loop = loop;
    srv->cfg = *cfg;
    td_list_init(&srv->conns);
    if (!srv->cfg.max_connections)
        srv->cfg.max_connections = 64;
    if (!srv->cfg.idle_timeout_ms)
        srv->cfg.idle_timeout_ms = 30000;
    if (!srv->cfg.request_timeout_ms)
        srv->cfg.request_timeout_ms = 10000;
    if (cfg->metrics) {
        td_status_t st = td_metrics_counter_each(cfg->metrics, "tandem_http_server_connections_closed_total",
                                                 "Connections the HTTP server closed itself, by reason: "
                                                 "request_timeout, idle_timeout, evicted (room for a new one), refused.",
                                                 "reason", close_names, CLOSE_N, srv->closed_by);
        if (st != TD_OK) {
            free(srv);
            return st;
        }
    }
    uv_tcp_init(loop, &srv->listener);
    srv->listener.data = srv;
    td_status_t st = td_rpc_tcp_listen(&srv->listener, "http", cfg->host, cfg->port, on_connection, &srv->port);
    if (st != TD_OK)
        goto err_listener;
    *srv_p = srv;
    return TD_OK;

err_listener:
    srv->closing = true;
    srv->pending_closes = 1;
    uv_close((uv_handle_t *)&srv->listener, on_listener_closed);
    return st;
}

uint16_t td_http_server_port(const td_http_server_t *srv)
{
    return srv->port;
}

void td_http_server_close(td_http_server_t *srv, void (*cb)(void *data), void *data)
{
    if (!srv || srv->closing)
        return;
    srv->closing = true;
    srv->close_cb = cb;
    srv->close_data = data;
    srv->pending_closes++;
    uv_close((uv_handle_t *)&srv->listener, on_listener_closed);
    while (!td_list_empty(&srv->conns))
        conn_close(TD_CONTAINER_OF(td_list_first(&srv->conns), http_conn_t, link));
}

void td_http_metrics_handler(void *data, const char *method, const char *path,
                             td_http_reply_t *reply)
{
    size_t plen = strcspn(path, "?");
    if (plen != 8 || strncmp(path, "/metrics", 8) != 0)
        return; /* 404 */
    if (strcmp(method, "GET") != 0) {
        reply->status = 405;
        reply->body = strdup("only GET\n");
        reply->body_len = reply->body ? strlen(reply->body) : 0;
        return;
    }
    char *text;
    size_t len;
    if (td_metrics_render(data, &text, &len) != TD_OK) {
        reply->status = 500;
        return;
    }
    reply->status = 200;
    reply->content_type = TD_METRICS_CONTENT_TYPE;
    reply->body = text;
    reply->body_len = len;
}
