/*
 * td_http: the HTTP/1.1 server behind td_http.h, on libhttp-parser (td_http_impl.h says how
 * it is built). This file: a connection's lifetime (its lists, its one timer and the
 * deadline it carries, the gentle close), accepting under the connection cap, the server's
 * creation and close, and the request's accessors. Reading is td_http_read.c, writing
 * td_http_write.c.
 */
#include "td_http.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "td_http_impl.h"
#include "td_list.h"
#include "td_log.h"
#include "td_rpc_tcp.h"
#include "td_util.h"

static const char *const close_names[CLOSE_N] = {"request_timeout", "idle_timeout", "write_timeout",
                                                 "evicted", "refused", "body_timeout"};

td_http_config_t td_http_config_default(void)
{
    return (td_http_config_t){
        .name = "http",
        .host = "127.0.0.1",
        .port = 0,
        .max_request_bytes = 8192,
        .max_body_bytes = 64 * 1024,
        .max_write_queue_bytes = 256 * 1024,
        .max_connections = 64,
        .idle_timeout_ms = 30000,
        .request_timeout_ms = 10000,
        .body_timeout_ms = 10000,
        .metrics_name = "tandem_http_server_connections_closed_total",
    };
}

const char *td_http_status_text(int status)
{
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 422: return "Unprocessable Entity";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return "Status";
    }
}

/* ---- lifetime ------------------------------------------------------------------------ */

static void server_maybe_done(td_http_server_t *srv)
{
    if (!srv->closing || srv->pending_closes > 0)
        return;
    void (*cb)(void *) = srv->close_cb;
    void *data = srv->close_data;
    while (srv->free_blocks) {
        out_block_t *b = srv->free_blocks;
        srv->free_blocks = b->next;
        free(b);
    }
    free(srv);
    if (cb)
        cb(data);
}

void td_http_req_free_body(td_http_req_t *req)
{
    td_rpc_budget_give(req->conn->srv->cfg.body_budget, req->charged);
    req->charged = 0;
    free(req->body);
    req->body = NULL;
    req->body_len = req->body_cap = 0;
}

void td_http_req_free(td_http_req_t *req)
{
    td_http_req_free_body(req);
    free(req->extra);
    free(req);
}

static void conn_handle_closed(uv_handle_t *h)
{
    http_conn_t *c = h->data;
    if (--c->open_handles > 0)
        return;
    /* every write has been called back (libuv cancels them before this) */
    td_http_req_t *req = c->req;
    c->req = NULL;
    if (req) {
        bool handled = req->state == REQ_HANDLED || req->state == REQ_STREAMING;
        req->state = REQ_ABORTED;
        if (handled && req->on_abort)
            req->on_abort(req, req->data);
        td_http_req_free(req);
    }
    td_http_server_t *srv = c->srv;
    td_http_conn_free_blocks(c);
    free(c->in);
    free(c);
    srv->pending_closes--;
    server_maybe_done(srv);
}

static void conn_unlist(http_conn_t *c)
{
    if (!c->list)
        return;
    td_list_remove(&c->link);
    c->list = NULL;
    c->srv->n_conns--;
}

void td_http_conn_close(http_conn_t *c, int why)
{
    if (c->closing)
        return;
    c->closing = true;
    td_http_server_t *srv = c->srv;
    if (why < CLOSE_N) {
        td_debug("%s connection: closed, %s", srv->cfg.name, close_names[why]);
        if (srv->closed_by[why])
            td_metric_inc(srv->closed_by[why]);
    }
    conn_unlist(c);
    if (c->dirty) {
        td_list_remove(&c->dirty_link);
        c->dirty = false;
    }
    srv->pending_closes++;
    uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
    uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
}

void td_http_conn_relist(http_conn_t *c)
{
    if (c->closing)
        return;
    bool busy = (c->req && c->req->state != REQ_READING) || c->queued > 0 || c->answered;
    td_list_t *want = busy ? &c->srv->busy : c->served ? &c->srv->idle : &c->srv->fresh;
    if (c->list == want)
        return;
    td_list_remove(&c->link);
    td_list_push_back(want, &c->link);
    c->list = want;
}

/* A deadline. A connection with nothing handled or queued (idle, or a request still
 * arriving: a slowloris) is shut gently (td_http_conn_linger), so the client reads an end rather
 * than a reset caused by bytes it sent meanwhile; the rest close at once (a handled
 * request is aborted now, bytes nobody reads are dropped). */
static void on_timer(uv_timer_t *t)
{
    http_conn_t *c = t->data;
    int why = c->timer_reason;
    bool handled = c->req && c->req->state != REQ_READING;
    if (why == CLOSE_LINGER || handled || c->queued > 0 || c->answered || c->lingering) {
        td_http_conn_close(c, why);
        return;
    }
    if (why == CLOSE_BODY) { /* told why, then closed: a client that is merely slow learns it */
        if (c->srv->closed_by[why])
            td_metric_inc(c->srv->closed_by[why]);
        char msg[160];
        snprintf(msg, sizeof msg, "request not received whole within %u ms of its first byte (the server's body "
                 "timeout): send it faster or in smaller pieces", c->srv->cfg.body_timeout_ms);
        td_http_conn_fail(c, 408, msg);
        return;
    }
    td_debug("%s connection: closed, %s", c->srv->cfg.name, close_names[why]);
    if (c->srv->closed_by[why])
        td_metric_inc(c->srv->closed_by[why]);
    if (c->req) {
        td_http_req_free(c->req);
        c->req = NULL;
    }
    c->discard = true;
    c->in_off = c->in_len = 0;
    td_http_conn_read_start(c);
    td_http_conn_linger(c);
}

/* Arms the timer for the nearest deadline that applies: the request's (its first byte +
 * request_timeout_ms, until it is answered or its stream begun), the idle one (no request
 * begun, nothing queued: since + idle_timeout_ms) and the write one (bytes queued: the last
 * write progress + request_timeout_ms). None (a stream with nothing queued): stopped. */
void td_http_conn_arm_timer(http_conn_t *c)
{
    if (c->closing || c->lingering)
        return;
    const td_http_config_t *cfg = &c->srv->cfg;
    uint64_t deadline = UINT64_MAX;
    int why = CLOSE_NONE;
    if (c->req && c->req->state == REQ_READING && cfg->body_timeout_ms < cfg->request_timeout_ms) {
        deadline = c->req_start + cfg->body_timeout_ms;
        why = CLOSE_BODY;
    } else if (c->req && (c->req->state == REQ_READING || c->req->state == REQ_HANDLED)) {
        deadline = c->req_start + cfg->request_timeout_ms;
        why = CLOSE_REQUEST;
    } else if (!c->req && c->queued == 0 && !c->answered) {
        deadline = c->since + cfg->idle_timeout_ms;
        why = CLOSE_IDLE;
    }
    if (c->queued > 0 && c->write_progress + cfg->request_timeout_ms < deadline) {
        deadline = c->write_progress + cfg->request_timeout_ms;
        why = CLOSE_WRITE;
    }
    if (why == CLOSE_NONE) {
        uv_timer_stop(&c->timer);
        return;
    }
    uint64_t now = uv_now(c->srv->loop);
    c->timer_reason = why;
    uv_timer_start(&c->timer, on_timer, deadline > now ? deadline - now : 0, 0);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    http_conn_t *c = req->data;
    if (status < 0)
        td_http_conn_close(c, CLOSE_NONE);
}

void td_http_conn_linger(http_conn_t *c)
{
    c->lingering = true;
    c->shutdown.data = c;
    if (uv_shutdown(&c->shutdown, (uv_stream_t *)&c->tcp, on_shutdown) < 0) {
        td_http_conn_close(c, CLOSE_NONE);
        return;
    }
    c->timer_reason = CLOSE_LINGER;
    uv_timer_start(&c->timer, on_timer, LINGER_MS, 0);
}

/* ---- accepting ----------------------------------------------------------------------- */

/* The connection to close to make room: the oldest never answered one, else the one idle
 * longest; NULL when every connection is busy. */
static http_conn_t *pick_victim(td_http_server_t *srv)
{
    if (!td_list_empty(&srv->fresh))
        return TD_CONTAINER_OF(td_list_first(&srv->fresh), http_conn_t, link);
    if (!td_list_empty(&srv->idle))
        return TD_CONTAINER_OF(td_list_first(&srv->idle), http_conn_t, link);
    return NULL;
}

static void on_connection(uv_stream_t *listener, int status)
{
    td_http_server_t *srv = listener->data;
    if (status < 0 || srv->closing)
        return;
    http_conn_t *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->srv = srv;
    uv_tcp_init(srv->loop, &c->tcp);
    uv_timer_init(srv->loop, &c->timer);
    c->tcp.data = c;
    c->timer.data = c;
    c->open_handles = 2;
    td_list_init(&c->link);
    if (uv_accept(listener, (uv_stream_t *)&c->tcp) < 0) {
        td_http_conn_close(c, CLOSE_NONE);
        return;
    }
    if (srv->n_conns >= srv->cfg.max_connections) {
        http_conn_t *victim = pick_victim(srv);
        if (!victim) {
            if (!srv->refusing) /* once per run of refusals: a flood must not flood the log */
                td_warn("%s server: connection limit %u reached and every connection is busy, refusing "
                        "connections (counted by %s)", srv->cfg.name, srv->cfg.max_connections, srv->cfg.metrics_name);
            srv->refusing = true;
            td_http_conn_close(c, CLOSE_REFUSED);
            return;
        }
        td_http_conn_close(victim, CLOSE_EVICTED);
    }
    srv->refusing = false;
    td_list_push_back(&srv->fresh, &c->link);
    c->list = &srv->fresh;
    srv->n_conns++;
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    c->since = uv_now(srv->loop);
    uv_tcp_nodelay(&c->tcp, 1);
    td_http_conn_arm_timer(c);
    td_http_conn_read_start(c);
}

/* ---- the server ---------------------------------------------------------------------- */

/* The listener's or the flush handle's close. */
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
    td_http_config_t def = td_http_config_default();
    const char *name = cfg->name ? cfg->name : def.name;
    if (!cfg->handler)
        return td_errorf(TD_ERR_INVALID, "%s: no handler given", name);
    if (cfg->max_request_bytes < 64 || cfg->max_write_queue_bytes < 64)
        return td_errorf(TD_ERR_INVALID, "%s: max_request_bytes %zu and max_write_queue_bytes %zu must be at least 64",
                         name, cfg->max_request_bytes, cfg->max_write_queue_bytes);
    if (!cfg->host || !td_rpc_tcp_addr(cfg->host, cfg->port, &addr))
        return td_errorf(TD_ERR_INVALID, "%s: host \"%s\" is not an IPv4 or IPv6 address", name,
                         cfg->host ? cfg->host : "(null)");
    td_http_server_t *srv = calloc(1, sizeof *srv);
    if (!srv)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", name);
    srv->loop = loop;
    srv->cfg = *cfg;
    srv->cfg.name = name;
    if (!srv->cfg.metrics_name)
        srv->cfg.metrics_name = def.metrics_name;
    if (!srv->cfg.max_connections)
        srv->cfg.max_connections = def.max_connections;
    if (!srv->cfg.idle_timeout_ms)
        srv->cfg.idle_timeout_ms = def.idle_timeout_ms;
    if (!srv->cfg.request_timeout_ms)
        srv->cfg.request_timeout_ms = def.request_timeout_ms;
    if (!srv->cfg.body_timeout_ms)
        srv->cfg.body_timeout_ms = def.body_timeout_ms;
    if (srv->cfg.body_timeout_ms > srv->cfg.request_timeout_ms)
        srv->cfg.body_timeout_ms = srv->cfg.request_timeout_ms;
    td_list_init(&srv->fresh);
    td_list_init(&srv->idle);
    td_list_init(&srv->busy);
    td_http_settings_init(&srv->settings);
    if (cfg->metrics) {
        td_status_t st = td_metrics_counter_each(cfg->metrics, srv->cfg.metrics_name,
                                                 "Connections the HTTP server closed itself, by reason: "
                                                 "request_timeout, idle_timeout, write_timeout (queued bytes "
                                                 "unread), evicted (room for a new one), refused, "
                                                 "body_timeout (a request not read whole in time: 408).",
                                                 "reason", close_names, CLOSE_N, srv->closed_by);
        if (st != TD_OK) {
            free(srv);
            return st;
        }
    }
    td_list_init(&srv->dirty);
    uv_idle_init(loop, &srv->flush);
    srv->flush.data = srv;
    uv_tcp_init(loop, &srv->listener);
    srv->listener.data = srv;
    td_status_t st = td_rpc_tcp_listen(&srv->listener, name, cfg->host, cfg->port, on_connection, &srv->port);
    if (st != TD_OK)
        goto err_listener;
    *srv_p = srv;
    return TD_OK;

err_listener:
    srv->closing = true;
    srv->pending_closes = 2;
    uv_close((uv_handle_t *)&srv->flush, on_listener_closed);
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
    srv->pending_closes += 2;
    uv_close((uv_handle_t *)&srv->flush, on_listener_closed);
    uv_close((uv_handle_t *)&srv->listener, on_listener_closed);
    td_list_t *lists[] = {&srv->fresh, &srv->idle, &srv->busy};
    for (size_t i = 0; i < TD_ARRAY_LEN(lists); i++)
        while (!td_list_empty(lists[i]))
            td_http_conn_close(TD_CONTAINER_OF(td_list_first(lists[i]), http_conn_t, link), CLOSE_NONE);
}

/* ---- requests ------------------------------------------------------------------------ */

const char *td_http_req_method(const td_http_req_t *req)
{
    return req->method;
}

const char *td_http_req_path(const td_http_req_t *req)
{
    return req->path;
}

const char *td_http_req_query(const td_http_req_t *req)
{
    return req->query;
}

const char *td_http_req_header(const td_http_req_t *req, const char *name)
{
    const char *p = req->head + req->url_len + 1;
    for (uint32_t i = 0; i < req->n_headers; i++) {
        const char *value = p + strlen(p) + 1;
        if (strcasecmp(p, name) == 0)
            return value;
        p = value + strlen(value) + 1;
    }
    return NULL;
}

const char *td_http_req_body(const td_http_req_t *req, size_t *len_p)
{
    *len_p = req->body_len;
    return req->body;
}

char *td_http_req_take_body(td_http_req_t *req, size_t *len_p, size_t *charged_p)
{
    char *body = req->body;
    *len_p = body ? req->body_len : 0;
    *charged_p = body ? req->charged : 0;
    if (body) {
        req->charged = 0;
        req->body = NULL;
        req->body_len = req->body_cap = 0;
    }
    return body;
}

void td_http_req_set_data(td_http_req_t *req, void *data)
{
    req->data = data;
}

void *td_http_req_data(const td_http_req_t *req)
{
    return req->data;
}

void td_http_req_on_abort(td_http_req_t *req, td_http_req_cb cb)
{
    req->on_abort = cb;
}

void td_http_req_on_writable(td_http_req_t *req, td_http_req_cb cb)
{
    req->on_writable = cb;
}

size_t td_http_req_queued_bytes(const td_http_req_t *req)
{
    return req->conn->queued;
}

void td_http_metrics_handler(void *data, td_http_req_t *req)
{
    static const char not_found[] = "not found\n", only_get[] = "only GET\n";
    if (strcmp(td_http_req_path(req), "/metrics") != 0) {
        td_http_respond(req, 404, NULL, not_found, sizeof not_found - 1);
        return;
    }
    const char *method = td_http_req_method(req);
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        td_http_resp_header(req, "Allow", "GET, HEAD");
        td_http_respond(req, 405, NULL, only_get, sizeof only_get - 1);
        return;
    }
    char *text;
    size_t len;
    if (td_metrics_render(data, &text, &len) != TD_OK) {
        td_http_respond(req, 500, NULL, "", 0);
        return;
    }
    td_http_respond(req, 200, TD_METRICS_CONTENT_TYPE, text, len);
    free(text);
}
