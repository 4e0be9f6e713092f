/*
 * td_grpc_server: the gRPC server of td_grpc.h: its connections and the server itself.
 *
 * One nghttp2 server session per TCP connection, fed from uv reads (mem_recv) and pumped
 * to the socket once per loop iteration from a uv_prepare hook (and after write
 * completions), so handler sends made in any callback are batched into few writes.
 * A connection's first bytes are checked against the HTTP/2 preface so an HTTP/1.1
 * request gets a plain "505" answer and garbage gets the connection closed, alone.
 *
 * The calls, each one stream, are td_grpc_server_call.c; what both files share is
 * td_grpc_server_impl.h.
 */
#include "td_grpc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_grpc_server_impl.h"
#include "td_grpc_wire.h"
#include "td_list.h"
#include "td_log.h"
#include "td_rpc_tcp.h"
#include "td_util.h"

#define PREFACE "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#define PREFACE_LEN 24

static const char *const conn_close_names[CONN_CLOSE_N] = {
#define CONN_CLOSE_NAME(e, name) name,
    CONN_CLOSE_MAP(CONN_CLOSE_NAME)
#undef CONN_CLOSE_NAME
};

td_grpc_server_config_t td_grpc_server_config_default(void)
{
    return (td_grpc_server_config_t){
        .host = "127.0.0.1",
        .port = 0,
        .max_message_bytes = 4u << 20,
        .max_concurrent_streams = 100,
        .max_header_list_bytes = 16u << 10,
        .initial_window_bytes = 1u << 20,
        .send_queue_bytes = 256u << 10,
        .max_connections = 1024,
        .handshake_timeout_ms = 10000,
        .request_timeout_ms = 30000,
        .idle_timeout_ms = 0,
        .max_resets_per_s = 100000,
        .max_unpacking = 16,
    };
}

/* ---- server teardown bookkeeping ------------------------------------------------------ */

void td_grpc_server_maybe_free(td_grpc_server_t *srv)
{
    if (!srv->closing || srv->open_handles > 0 || srv->n_calls > 0)
        return;
    void (*cb)(void *) = srv->close_cb;
    void *data = srv->close_data;
    TD_LIST_FOREACH_SAFE(n, &srv->spare) {
        td_grpc_call_t *c = CALL_OF(n);
        td_grpc_buf_free(&c->req);
        td_grpc_buf_free(&c->out);
        free(c->meta);
        free(c);
    }
    for (method_t *m = srv->methods, *next; m; m = next) {
        next = m->next;
        free(m->path);
        free(m);
    }
    free(srv);
    if (cb)
        cb(data);
}

static void server_handle_closed(uv_handle_t *h)
{
    td_grpc_server_t *srv = h->data;
    srv->open_handles--;
    td_grpc_server_maybe_free(srv);
}

/* ---- connections ---------------------------------------------------------------------- */

static void conn_tcp_closed(uv_handle_t *h)
{
    srv_conn_t *c = h->data;
    td_grpc_server_t *srv = c->srv;
    free(c);
    srv->open_handles--;
    td_grpc_server_maybe_free(srv);
}

/* Closes now: every call on it is cancelled. */
static void conn_close_now(srv_conn_t *c, td_status_t why)
{
    if (c->closed)
        return;
    c->closed = true;
    td_grpc_server_t *srv = c->srv;
    while (!td_list_empty(&c->calls)) {
        td_grpc_call_t *call = CALL_OF(td_list_first(&c->calls));
        if (c->ses)
            nghttp2_session_set_stream_user_data(c->ses, call->stream_id, NULL);
        td_grpc_call_detach(call, why);
    }
    nghttp2_session_del(c->ses);
    c->ses = NULL;
    td_list_remove(&c->link);
    srv->n_conns--;
    uv_close((uv_handle_t *)&c->tcp, conn_tcp_closed);
}

/* Closes once what is queued for the socket is written (a GOAWAY, an HTTP/1.1 answer). */
static void conn_close_soon(srv_conn_t *c)
{
    c->closing = true;
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
    }
    if (c->writes_in_flight == 0)
        conn_close_now(c, TD_ERR_CANCELLED);
}

/* ---- connection deadlines and eviction ----------------------------------------------
 * A connection's clocks are absolute times set by events (accept, handshake, a call's
 * HEADERS, start and end), never by received bytes, so a client trickling a byte at a time
 * gains nothing. One sweep timer per server checks them, like redis's cron. */

/* A dispatched call is on it (a handler runs, or its answer is still going out): such a
 * connection is never evicted nor closed as idle. */
static bool conn_productive(const srv_conn_t *c)
{
    TD_LIST_FOREACH(n, &c->calls)
        if (CALL_OF(n)->dispatched)
            return true;
    return false;
}

static void conn_drop(srv_conn_t *c, conn_close_reason_t why)
{
    td_debug("grpc connection: closed, %s", conn_close_names[why]);
    if (c->srv->closed_by[why])
        td_metric_inc(c->srv->closed_by[why]);
    conn_close_now(c, TD_ERR_CANCELLED);
}

/* The connection to close to make room: not productive; first one still in its handshake,
 * then one that never ran a call, then the one idle longest; oldest first in each. */
static srv_conn_t *conn_pick_victim(td_grpc_server_t *srv, const srv_conn_t *except)
{
    srv_conn_t *best = NULL;
    int best_tier = 3;
    TD_LIST_FOREACH(n, &srv->conns) {
        srv_conn_t *c = CONN_OF(n);
        if (c == except || c->closed || c->closing || conn_productive(c))
            continue;
        int tier = !c->handshaken ? 0 : !c->served ? 1 : 2;
        if (tier < best_tier || (tier == best_tier && c->since < best->since)) {
            best = c;
            best_tier = tier;
        }
    }
    return best;
}

/* Which deadline the connection is past, if any (CONN_CLOSE_N: none). Resets a stalled
 * stream on a productive connection instead of closing it. No callback runs here. */
static conn_close_reason_t conn_overdue(srv_conn_t *c, uint64_t now)
{
    const td_grpc_server_config_t *cfg = &c->srv->cfg;
    if (!c->handshaken)
        return now - c->since >= cfg->handshake_timeout_ms ? CONN_CLOSE_HANDSHAKE : CONN_CLOSE_N;
    bool productive = conn_productive(c), stalled = false;
    TD_LIST_FOREACH(n, &c->calls) {
        td_grpc_call_t *call = CALL_OF(n);
        if (call->dispatched || call->stall_reset || now - call->begun < cfg->request_timeout_ms)
            continue;
        stalled = true;
        call->stall_reset = true;
        if (productive)
            nghttp2_submit_rst_stream(c->ses, NGHTTP2_FLAG_NONE, call->stream_id, NGHTTP2_CANCEL);
    }
    if (productive)
        return CONN_CLOSE_N;
    if (stalled)
        return CONN_CLOSE_REQUEST;
    if (cfg->idle_timeout_ms && now - c->since >= cfg->idle_timeout_ms)
        return CONN_CLOSE_IDLE;
    return CONN_CLOSE_N;
}

static void on_sweep(uv_timer_t *t)
{
    td_grpc_server_t *srv = t->data;
    uint64_t now = uv_now(srv->loop);
    bool any = false;
    TD_LIST_FOREACH(n, &srv->conns) {
        srv_conn_t *c = CONN_OF(n);
        c->doom = c->closed || c->closing ? CONN_CLOSE_N : conn_overdue(c, now);
        any |= c->doom != CONN_CLOSE_N;
    }
    /* closing runs cancel callbacks that may touch other connections: rescan after each */
    for (td_list_t *n = any ? td_list_first(&srv->conns) : NULL; n && !srv->closing;) {
        srv_conn_t *c = CONN_OF(n);
        if (c->doom != CONN_CLOSE_N && !c->closed) {
            conn_close_reason_t why = c->doom;
            c->doom = CONN_CLOSE_N;
            conn_drop(c, why);
            n = td_list_first(&srv->conns);
        } else {
            n = td_list_next(&srv->conns, n);
        }
    }
}

static uint64_t sweep_interval_ms(const td_grpc_server_config_t *cfg)
{
    uint32_t shortest = TD_MIN(cfg->handshake_timeout_ms, cfg->request_timeout_ms);
    if (cfg->idle_timeout_ms)
        shortest = TD_MIN(shortest, cfg->idle_timeout_ms);
    return TD_MAX(10u, TD_MIN(1000u, shortest / 4));
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    srv_conn_t *c = h->data;
    *buf = uv_buf_init((char *)c->rbuf, sizeof c->rbuf);
}

static void conn_pump(srv_conn_t *c);

static void on_write(uv_write_t *req, int status)
{
    srv_conn_t *c = req->data;
    td_grpc_write_done(req);
    if (c->closed)
        return;
    if (status < 0) {
        conn_close_now(c, TD_ERR_CANCELLED);
        return;
    }
    if (c->closing) {
        if (c->writes_in_flight == 0)
            conn_close_now(c, TD_ERR_CANCELLED);
        return;
    }
    conn_pump(c);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

static void on_kick(uv_idle_t *h)
{
    uv_idle_stop(h); /* the prepare hook pumps again before this turn's poll */
}

/* Writes nghttp2's output, delivers writable notifications, applies read back-pressure. */
static void conn_pump(srv_conn_t *c)
{
    /* Our SETTINGS wait for the client preface, so an HTTP/1.1 client sees a clean 505. */
    if (c->closed || c->closing || c->preface_seen < PREFACE_LEN)
        return;
    for (int round = 0; round < 4; round++) {
        int rc = td_grpc_pump(c->ses, (uv_stream_t *)&c->tcp, c, on_write, &c->writes_in_flight);
        if (rc < 0) {
            td_debug("grpc connection: write failed: %s", rc > -1000 ? uv_strerror(rc) : nghttp2_strerror(rc));
            conn_close_now(c, TD_ERR_CANCELLED);
            return;
        }
        bool notified = false;
        TD_LIST_FOREACH_SAFE(n, &c->calls) {
            td_grpc_call_t *call = CALL_OF(n);
            if (call->want_writable && !call->ended &&
                td_grpc_buf_size(&call->out) < c->srv->cfg.send_queue_bytes / 2) {
                call->want_writable = false;
                notified = true;
                if (call->on_writable)
                    call->on_writable(call, call->data);
                if (c->closed)
                    return;
            }
        }
        if (!notified)
            break;
        if (round == 3) {
            /* writers refilled their queues every round: let other work run, but pump again
             * on the next turn without waiting for I/O (writes done at once by
             * td_grpc_pump leave no write callback to wake the loop) */
            if (!c->srv->closing)
                uv_idle_start(&c->srv->kick, on_kick);
        }
    }
    if (!nghttp2_session_want_read(c->ses) && !nghttp2_session_want_write(c->ses)) {
        conn_close_soon(c);
        return;
    }
    bool congested = uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) >= TD_GRPC_WRITE_HIGH;
    if (congested && c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
    } else if (!congested && !c->reading) {
        if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) == 0)
            c->reading = true;
    }
}

static const char http1_reply[] =
    "HTTP/1.1 505 HTTP Version Not Supported\r\n"
    "Content-Type: text/plain\r\nContent-Length: 62\r\nConnection: close\r\n\r\n"
    "this port speaks gRPC: HTTP/2 with prior knowledge (h2c) only\n";

typedef struct plain_write {
    uv_write_t req;
    srv_conn_t *conn;
} plain_write_t;

static void on_plain_write(uv_write_t *req, int status)
{
    plain_write_t *w = (plain_write_t *)req;
    srv_conn_t *c = w->conn;
    free(w);
    c->writes_in_flight--;
    if (!c->closed && c->writes_in_flight == 0)
        conn_close_now(c, TD_ERR_CANCELLED);
}

static bool looks_like_http1(const uint8_t *p, size_t n)
{
    size_t i = 0;
    while (i < n && p[i] >= 'A' && p[i] <= 'Z')
        i++;
    return i > 0 && i < n && p[i] == ' ';
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    srv_conn_t *c = s->data;
    if (c->closed)
        return;
    if (nread < 0) {
        conn_close_now(c, TD_ERR_CANCELLED);
        return;
    }
    if (nread == 0 || c->closing)
        return;
    const uint8_t *p = (const uint8_t *)buf->base;
    size_t n = (size_t)nread;
    if (c->preface_seen < PREFACE_LEN) {
        size_t k = TD_MIN(n, PREFACE_LEN - c->preface_seen);
        if (memcmp(p, &PREFACE[c->preface_seen], k) != 0) {
            if (c->preface_seen == 0 && looks_like_http1(p, n)) {
                td_debug("grpc connection: HTTP/1.x request refused");
                plain_write_t *w = malloc(sizeof *w);
                uv_buf_t b = uv_buf_init((char *)http1_reply, sizeof http1_reply - 1);
                c->closing = true;
                uv_read_stop(s);
                c->reading = false;
                if (w) {
                    w->conn = c;
                    if (uv_write(&w->req, s, &b, 1, on_plain_write) == 0) {
                        c->writes_in_flight++;
                        return;
                    }
                    free(w);
                }
            } else {
                td_debug("grpc connection: not an HTTP/2 preface, closing");
            }
            conn_close_now(c, TD_ERR_CANCELLED);
            return;
        }
        c->preface_seen += k;
    }
    ssize_t rc = nghttp2_session_mem_recv(c->ses, p, n);
    if (rc < 0) {
        td_debug("grpc connection: %s, closing", nghttp2_strerror((int)rc));
        conn_close_now(c, TD_ERR_CANCELLED);
        return;
    }
    /* output is pumped from the prepare hook before the loop blocks again */
}

static void on_pump(uv_prepare_t *h)
{
    td_grpc_server_t *srv = h->data;
    TD_LIST_FOREACH_SAFE(n, &srv->conns) {
        if (srv->closing)
            break; /* a callback closed the server: every connection is unlinked */
        conn_pump(CONN_OF(n));
    }
}

static void on_connection(uv_stream_t *listener, int status)
{
    td_grpc_server_t *srv = listener->data;
    if (status < 0 || srv->closing)
        return;
    srv_conn_t *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->srv = srv;
    c->since = uv_now(srv->loop);
    c->doom = CONN_CLOSE_N;
    td_list_init(&c->calls);
    uv_tcp_init(srv->loop, &c->tcp);
    c->tcp.data = c;
    srv->open_handles++;
    td_list_push_front(&srv->conns, &c->link);
    srv->n_conns++;
    if (uv_accept(listener, (uv_stream_t *)&c->tcp) < 0)
        goto err_conn;
    if (srv->n_conns > srv->cfg.max_connections) {
        srv_conn_t *victim = conn_pick_victim(srv, c);
        if (!victim) {
            td_warn("grpc server: connection limit %u reached and every connection has a call running, "
                    "refusing a connection", srv->cfg.max_connections);
            if (srv->closed_by[CONN_CLOSE_REFUSED])
                td_metric_inc(srv->closed_by[CONN_CLOSE_REFUSED]);
            goto err_conn;
        }
        conn_drop(victim, CONN_CLOSE_EVICTED);
    }
    uv_tcp_nodelay(&c->tcp, 1);

    nghttp2_session_callbacks *cbs;
    nghttp2_option *opt;
    if (nghttp2_session_callbacks_new(&cbs) != 0)
        goto err_conn;
    td_grpc_server_set_callbacks(cbs);
    if (nghttp2_option_new(&opt) != 0) {
        nghttp2_session_callbacks_del(cbs);
        goto err_conn;
    }
    nghttp2_option_set_max_deflate_dynamic_table_size(opt, 4096);
    if (srv->cfg.max_resets_per_s)
        nghttp2_option_set_stream_reset_rate_limit(opt, srv->cfg.max_resets_per_s, srv->cfg.max_resets_per_s);
    int rc = nghttp2_session_server_new2(&c->ses, cbs, c, opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cbs);
    if (rc != 0)
        goto err_conn;
    nghttp2_settings_entry iv[] = {
        {NGHTTP2_SETTINGS_MAX_CONCURRENT_STREAMS, srv->cfg.max_concurrent_streams},
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, srv->cfg.initial_window_bytes},
        {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, srv->cfg.max_header_list_bytes},
        {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
        {NGHTTP2_SETTINGS_NO_RFC7540_PRIORITIES, 1}, /* no dependency tree to keep per stream */
    };
    if (nghttp2_submit_settings(c->ses, NGHTTP2_FLAG_NONE, iv, TD_ARRAY_LEN(iv)) != 0 ||
        nghttp2_session_set_local_window_size(c->ses, NGHTTP2_FLAG_NONE, 0,
                                              (int32_t)srv->cfg.initial_window_bytes) != 0)
        goto err_conn;
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0)
        goto err_conn;
    c->reading = true;
    return;

err_conn:
    conn_close_now(c, TD_ERR_CANCELLED);
}

/* ---- server API ----------------------------------------------------------------------- */

td_status_t td_grpc_server_create(uv_loop_t *loop, const td_grpc_server_config_t *cfg,
                                  td_grpc_server_t **srv_p)
{
    struct sockaddr_storage addr;
    if (!td_rpc_tcp_addr(cfg->host, cfg->port, &addr))
        return td_errorf(TD_ERR_INVALID, "grpc server: host \"%s\" is not an IPv4 or IPv6 address", cfg->host);
    if (cfg->max_message_bytes == 0 || cfg->max_message_bytes > UINT32_MAX ||
        cfg->max_concurrent_streams == 0 || cfg->max_header_list_bytes < 1024 ||
        cfg->initial_window_bytes < 65535 || cfg->initial_window_bytes > 0x7fffffff ||
        cfg->send_queue_bytes == 0 || cfg->max_connections == 0 || cfg->handshake_timeout_ms == 0 ||
        cfg->request_timeout_ms == 0)
        return td_errorf(TD_ERR_INVALID, "grpc server: a limit in the configuration is zero or out of range");
    td_grpc_server_t *srv = calloc(1, sizeof *srv);
    if (!srv)
        return td_errorf(TD_ERR_NOMEM, "grpc server: out of memory");
    srv->loop = loop;
    srv->cfg = *cfg;
    srv->cfg.host = NULL; /* not kept */
    td_list_init(&srv->deadlines);
    td_list_init(&srv->conns);
    td_list_init(&srv->spare);
    if (cfg->metrics) {
        const char *labels[2] = {"method", "code"};
        td_status_t st = td_metrics_register(cfg->metrics, TD_METRIC_COUNTER, "tandem_grpc_server_handled_total",
                                             "gRPC calls completed by the server, by method and status code.",
                                             labels, 2, NULL, 0, &srv->handled);
        if (st == TD_OK)
            st = td_metrics_counter_each(cfg->metrics, "tandem_grpc_server_connections_closed_total",
                                         "Connections the gRPC server closed itself, by reason: handshake_timeout, "
                                         "request_timeout, idle_timeout, evicted (room for a new one), refused.",
                                         "reason", conn_close_names, CONN_CLOSE_N, srv->closed_by);
        if (st != TD_OK) {
            free(srv);
            return st;
        }
    }
    uv_tcp_init(loop, &srv->listener);
    srv->listener.data = srv;
    uv_prepare_init(loop, &srv->pump);
    srv->pump.data = srv;
    uv_idle_init(loop, &srv->kick);
    srv->kick.data = srv;
    uv_timer_init(loop, &srv->dl_timer);
    srv->dl_timer.data = srv;
    uv_timer_init(loop, &srv->sweep);
    srv->sweep.data = srv;
    srv->open_handles = 5;
    td_status_t st = td_rpc_tcp_listen(&srv->listener, "grpc server", cfg->host, cfg->port, on_connection,
                                       &srv->port);
    if (st != TD_OK) {
        srv->closing = true;
        uv_close((uv_handle_t *)&srv->listener, server_handle_closed);
        uv_close((uv_handle_t *)&srv->pump, server_handle_closed);
        uv_close((uv_handle_t *)&srv->kick, server_handle_closed);
        uv_close((uv_handle_t *)&srv->dl_timer, server_handle_closed);
        uv_close((uv_handle_t *)&srv->sweep, server_handle_closed);
        return st;
    }
    uv_prepare_start(&srv->pump, on_pump);
    uv_unref((uv_handle_t *)&srv->pump);
    uint64_t every = sweep_interval_ms(&srv->cfg);
    uv_timer_start(&srv->sweep, on_sweep, every, every);
    uv_unref((uv_handle_t *)&srv->sweep);
    *srv_p = srv;
    return TD_OK;
}

td_grpc_server_stats_t td_grpc_server_stats(const td_grpc_server_t *srv)
{
    td_grpc_server_stats_t st = {0};
    TD_LIST_FOREACH(cn, &srv->conns) {
        TD_LIST_FOREACH(n, &CONN_OF(cn)->calls) {
            st.open_calls++;
            st.queued_bytes += td_grpc_buf_size(&CALL_OF(n)->out);
        }
    }
    return st;
}

uint16_t td_grpc_server_port(const td_grpc_server_t *srv)
{
    return srv->port;
}

uint32_t td_grpc_server_connections(const td_grpc_server_t *srv)
{
    return srv->n_conns;
}

const method_t *td_grpc_server_find_method(const td_grpc_server_t *srv, const char *path)
{
    for (const method_t *m = srv->methods; m; m = m->next)
        if (strcmp(m->path, path) == 0)
            return m;
    return NULL;
}

td_status_t td_grpc_server_add_method(td_grpc_server_t *srv, const char *path,
                                      const ProtobufCMessageDescriptor *request_desc,
                                      td_grpc_handler_cb cb, void *data)
{
    const char *slash2 = path && path[0] == '/' ? strchr(path + 1, '/') : NULL;
    if (!slash2 || slash2 == path + 1 || !slash2[1] || strchr(slash2 + 1, '/') || strlen(path) >= 256 ||
        !request_desc || !cb)
        return td_errorf(TD_ERR_INVALID, "grpc server: method path \"%s\" is not /package.Service/Method",
                         path ? path : "(null)");
    if (td_grpc_server_find_method(srv, path))
        return td_errorf(TD_ERR_INVALID, "grpc server: method %s registered twice", path);
    method_t *m = calloc(1, sizeof *m);
    if (!m || !(m->path = strdup(path))) {
        free(m);
        return td_errorf(TD_ERR_NOMEM, "grpc server: out of memory");
    }
    m->desc = request_desc;
    m->cb = cb;
    m->data = data;
    m->next = srv->methods;
    srv->methods = m;
    return TD_OK;
}

td_status_t td_grpc_server_add_methods(td_grpc_server_t *srv, const td_grpc_method_t *methods, size_t n,
                                       void *data)
{
    for (size_t i = 0; i < n; i++) {
        td_status_t st = td_grpc_server_add_method(srv, methods[i].path, methods[i].request_desc, methods[i].cb, data);
        if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

void td_grpc_server_close(td_grpc_server_t *srv, void (*cb)(void *data), void *data)
{
    if (!srv || srv->closing)
        return;
    srv->closing = true;
    srv->close_cb = cb;
    srv->close_data = data;
    uv_close((uv_handle_t *)&srv->listener, server_handle_closed);
    uv_close((uv_handle_t *)&srv->pump, server_handle_closed);
    uv_close((uv_handle_t *)&srv->kick, server_handle_closed);
    uv_close((uv_handle_t *)&srv->dl_timer, server_handle_closed);
    uv_close((uv_handle_t *)&srv->sweep, server_handle_closed);
    while (!td_list_empty(&srv->conns))
        conn_close_now(CONN_OF(td_list_first(&srv->conns)), TD_ERR_CLOSED);
}
