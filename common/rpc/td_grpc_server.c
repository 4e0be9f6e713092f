/*
 * td_grpc_server: the gRPC server of td_grpc.h.
 *
 * One nghttp2 server session per TCP connection, fed from uv reads (mem_recv) and pumped
 * to the socket once per loop iteration from a uv_prepare hook (and after write
 * completions), so handler sends made in any callback are batched into few writes.
 * A connection's first bytes are checked against the HTTP/2 preface so an HTTP/1.1
 * request gets a plain "505" answer and garbage gets the connection closed, alone.
 *
 * A call (one stream) gathers its request in a buffer bounded by max_message_bytes,
 * is dispatched when the client half-closes, and answers through a bounded send queue
 * read by an nghttp2 data provider (deferred while empty, resumed by a send or the
 * finish; trailers are submitted from the provider once the queue drains). A call is
 * freed when its stream is gone and its handler has finished; its timer handle is the
 * last handle closed. Every nghttp2 callback looks the call up by stream id, so nothing
 * dangles after a stream closes.
 */
#include "td_grpc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_grpc_wire.h"
#include "td_list.h"
#include "td_log.h"
#include "td_rpc_tcp.h"
#include "td_util.h"

#define PREFACE "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#define PREFACE_LEN 24
#define READ_BUF_BYTES (64 * 1024)

typedef struct srv_conn srv_conn_t;

/* Why the server closed a connection itself (the `reason` label). */
#define CONN_CLOSE_MAP(X)                                                        \
    X(CONN_CLOSE_HANDSHAKE, "handshake_timeout") /* no preface + SETTINGS in time */ \
    X(CONN_CLOSE_REQUEST, "request_timeout")     /* a request not complete in time */ \
    X(CONN_CLOSE_IDLE, "idle_timeout")           /* no call for idle_timeout_ms */    \
    X(CONN_CLOSE_EVICTED, "evicted")             /* made room for a new connection */ \
    X(CONN_CLOSE_REFUSED, "refused")             /* at the limit, nothing evictable */

typedef enum conn_close_reason {
#define CONN_CLOSE_ENUM(e, name) e,
    CONN_CLOSE_MAP(CONN_CLOSE_ENUM)
#undef CONN_CLOSE_ENUM
    CONN_CLOSE_N
} conn_close_reason_t;

static const char *const conn_close_names[CONN_CLOSE_N] = {
#define CONN_CLOSE_NAME(e, name) name,
    CONN_CLOSE_MAP(CONN_CLOSE_NAME)
#undef CONN_CLOSE_NAME
};

typedef struct method {
    struct method *next;
    char *path;
    const ProtobufCMessageDescriptor *desc;
    td_grpc_handler_cb cb;
    void *data;
} method_t;

struct td_grpc_server {
    uv_loop_t *loop;
    td_grpc_server_config_t cfg;
    uv_tcp_t listener;
    uv_prepare_t pump;
    uv_idle_t kick;                /* keeps the loop from blocking while output is left */
    uv_timer_t dl_timer;           /* one timer for the deadlines in the list below */
    uv_timer_t sweep;              /* connection deadlines (handshake, request, idle) */
    uint64_t dl_armed;             /* the deadline it is set for; 0 = not set */
    td_list_t deadlines;           /* calls with a deadline, soonest first (dl_link) */
    uint16_t port;
    method_t *methods;
    td_list_t conns;               /* newest first (srv_conn_t.link) */
    td_list_t spare;               /* ended calls kept for reuse (TD_GRPC_SPARE_CALLS), by link */
    int n_spare;
    uint32_t n_conns;
    uint32_t n_calls;              /* calls not yet freed */
    int open_handles;              /* listener, pump, kick, dl_timer, sweep, connections' tcp */
    bool closing;
    void (*close_cb)(void *data);
    void *close_data;
    td_metric_family_t *handled;   /* tandem_grpc_server_handled_total{method,code} */
    td_metric_t *closed_by[CONN_CLOSE_N]; /* tandem_grpc_server_connections_closed_total{reason} */
};

struct srv_conn {
    td_list_t link;                /* in srv->conns until closed */
    td_grpc_server_t *srv;
    uv_tcp_t tcp;
    nghttp2_session *ses;
    td_list_t calls;               /* calls whose stream is open, newest first (link) */
    size_t preface_seen;           /* bytes of the client preface matched so far */
    uint64_t since;                /* uv_now at accept, handshake, and each call's start and
                                    * end: the idle / handshake clock, never moved by bytes */
    bool handshaken;               /* preface and the client's first SETTINGS received */
    bool served;                   /* a call was dispatched on it once */
    conn_close_reason_t doom;      /* the sweep's verdict (CONN_CLOSE_N: none) */
    int writes_in_flight;
    bool closing;                  /* close once writes drain */
    bool closed;                   /* uv_close called */
    bool reading;
    uint8_t rbuf[READ_BUF_BYTES];
};

struct td_grpc_call {
    td_list_t link;                /* in conn->calls while the stream is open, then maybe in
                                    * srv->spare */
    td_grpc_server_t *srv;
    srv_conn_t *conn;              /* NULL once the stream is gone */
    int32_t stream_id;
    uv_timer_t timer;              /* its close frees the call; started only for a deadline
                                    * far out of order in the server's list */
    td_list_t dl_link;             /* in srv->deadlines, unless own_timer keeps its deadline */
    bool own_timer;
    bool stall_reset;              /* reset for request_timeout_ms */
    uint64_t begun;                /* uv_now at its HEADERS: the request_timeout_ms clock */
    const method_t *method;
    char path[256];
    size_t header_bytes;
    bool post, grpc_ctype, other_ctype, bad_encoding, bad_timeout, path_too_long;
    uint64_t timeout_ms, deadline;
    td_grpc_buf_t req;             /* request bytes as received */
    char *meta;                    /* the request's headers but pseudo-headers, each
                                    * "name\0value\0" (bounded by max_header_list_bytes) */
    size_t meta_len, meta_cap;
    td_grpc_buf_t out;             /* framed responses not yet taken by nghttp2 */
    size_t out_msg_left;           /* bytes of out's first message still to take once nghttp2
                                    * took part of it (0: out starts at a message) */
    bool responded;                /* response HEADERS submitted */
    bool ended;                    /* trailers decided (finish, error reply or deadline) */
    bool trailers_sent;            /* submitted to nghttp2 */
    bool dispatched, finished, cancelled, freeing, want_writable;
    td_grpc_code_t code;
    char *message;                 /* percent-encoded grpc-message, or NULL */
    char code_str[12];
    td_grpc_cancel_cb on_cancel;
    td_grpc_writable_cb on_writable;
    void *data;
};

/* The call whose link / dl_link is the node n; the connection whose link is n. */
#define CALL_OF(n) TD_CONTAINER_OF(n, td_grpc_call_t, link)
#define DL_CALL(n) TD_CONTAINER_OF(n, td_grpc_call_t, dl_link)
#define CONN_OF(n) TD_CONTAINER_OF(n, srv_conn_t, link)

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
    };
}

/* ---- server teardown bookkeeping ------------------------------------------------------ */

static void server_maybe_free(td_grpc_server_t *srv)
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
    server_maybe_free(srv);
}

/* ---- calls ---------------------------------------------------------------------------- */

static void call_timer_closed(uv_handle_t *h)
{
    td_grpc_call_t *call = h->data;
    td_grpc_server_t *srv = call->srv;
    free(call->message);
    if (srv->n_spare < TD_GRPC_SPARE_CALLS && !srv->closing) {
        td_grpc_buf_t req = call->req, out = call->out;
        char *meta = call->meta; /* kept, like the buffers: no allocation per call */
        size_t meta_cap = call->meta_cap;
        td_grpc_buf_recycle(&req);
        td_grpc_buf_recycle(&out);
        memset(call, 0, sizeof *call);
        call->req = req;
        call->out = out;
        call->meta = meta;
        call->meta_cap = meta_cap;
        td_list_push_front(&srv->spare, &call->link);
        srv->n_spare++;
    } else {
        td_grpc_buf_free(&call->req);
        td_grpc_buf_free(&call->out);
        free(call->meta);
        free(call);
    }
    srv->n_calls--;
    server_maybe_free(srv);
}

static void call_maybe_free(td_grpc_call_t *call)
{
    if (call->freeing || call->conn || (call->dispatched && !call->finished))
        return;
    call->freeing = true;
    uv_close((uv_handle_t *)&call->timer, call_timer_closed);
}

static void count_handled(td_grpc_call_t *call)
{
    td_grpc_server_t *srv = call->srv;
    td_metric_t *m;
    if (!srv->handled)
        return;
    const char *values[2] = {call->method ? call->method->path : "unknown", td_grpc_code_name(call->code)};
    if (td_metric_family_get(srv->handled, values, &m) == TD_OK)
        td_metric_inc(m);
}

static void dl_remove(td_grpc_call_t *call);

/* The stream is gone (closed, reset, connection lost): detach, tell the handler. */
static void call_detach(td_grpc_call_t *call, td_status_t why)
{
    srv_conn_t *c = call->conn;
    if (!c)
        return;
    td_list_remove(&call->link);
    call->conn = NULL;
    if (call->dispatched)
        c->since = uv_now(c->srv->loop); /* idle counts from the end of the last call */
    dl_remove(call);
    if (!call->ended) {
        call->ended = true;
        call->code = TD_GRPC_CANCELLED;
        count_handled(call);
    }
    if (call->dispatched && !call->finished && !call->cancelled) {
        call->cancelled = true;
        if (call->on_cancel)
            call->on_cancel(call, why, call->data);
    }
    call_maybe_free(call);
}

/* nghttp2 took n bytes of out: consumes them, keeping track of where messages start. */
static void out_take(td_grpc_call_t *call, size_t n)
{
    while (n) {
        if (!call->out_msg_left) {
            uint8_t compressed;
            uint32_t len;
            bool whole = td_grpc_peek_prefix(&call->out, &compressed, &len);
            TD_ASSERT(whole); /* out holds whole messages */
            call->out_msg_left = TD_GRPC_PREFIX_BYTES + (size_t)len;
        }
        size_t k = TD_MIN(n, call->out_msg_left);
        td_grpc_buf_consume(&call->out, k);
        call->out_msg_left -= k;
        n -= k;
    }
}

/* Drops the queued messages nghttp2 has not begun; the rest of one it began stays (a cut
 * message would read as a broken stream). Frees the buffer once nothing is left. */
static void out_drop_unstarted(td_grpc_call_t *call)
{
    call->out.len = call->out.off + call->out_msg_left;
    if (!call->out_msg_left)
        td_grpc_buf_free(&call->out);
}

static ssize_t data_read_cb(nghttp2_session *ses, int32_t stream_id, uint8_t *buf, size_t length,
                            uint32_t *flags, nghttp2_data_source *src, void *user);

static void call_submit_trailers(td_grpc_call_t *call)
{
    nghttp2_nv nv[2];
    size_t n = 0;
    td_grpc_format_u32((uint32_t)call->code, call->code_str);
    nv[n++] = td_grpc_nv("grpc-status", call->code_str);
    if (call->message && call->message[0])
        nv[n++] = td_grpc_nv("grpc-message", call->message);
    call->trailers_sent = true;
    nghttp2_submit_trailer(call->conn->ses, call->stream_id, nv, n);
}

/* Submits response HEADERS with a data provider (a normal response). */
static int call_respond(td_grpc_call_t *call)
{
    nghttp2_nv nv[2] = {td_grpc_nv(":status", "200"), td_grpc_nv("content-type", "application/grpc")};
    nghttp2_data_provider prd = {.source.ptr = NULL, .read_callback = data_read_cb};
    call->responded = true;
    return nghttp2_submit_response(call->conn->ses, call->stream_id, nv, 2, &prd);
}

/*
 * Decides the call's status. Before any response: a trailers-only response (HEADERS with
 * END_STREAM), `http_status` normally 200. After: the data provider sends what is queued,
 * then the trailers — unless the status is an error and the queue is more than the peer's
 * flow-control window takes now. nghttp2 asks the data provider only while that window is
 * open, so a client that never opens it (a stalled reader, the router's slow_client) would
 * never get the status and the stream would hold its queue until the connection closed.
 * Such a call drops the messages not yet begun and submits the trailers at once (HEADERS
 * are not flow-controlled); if part of a message already went and the rest does not fit
 * the window, the stream is reset instead (CANCEL), as a cut message cannot be ended.
 */
static void call_end(td_grpc_call_t *call, td_grpc_code_t code, const char *msg, const char *http_status)
{
    if (call->ended)
        return;
    call->ended = true;
    call->code = code;
    free(call->message);
    call->message = msg && *msg ? td_grpc_percent_encode(msg) : NULL;
    count_handled(call);
    if (!call->conn)
        return;
    if (!call->responded) {
        nghttp2_nv nv[4];
        size_t n = 0;
        td_grpc_format_u32((uint32_t)code, call->code_str);
        nv[n++] = td_grpc_nv(":status", http_status);
        nv[n++] = td_grpc_nv("content-type", "application/grpc");
        nv[n++] = td_grpc_nv("grpc-status", call->code_str);
        if (call->message)
            nv[n++] = td_grpc_nv("grpc-message", call->message);
        call->responded = true;
        call->trailers_sent = true;
        nghttp2_submit_response(call->conn->ses, call->stream_id, nv, n, NULL);
        return;
    }
    nghttp2_session *ses = call->conn->ses;
    size_t queued = td_grpc_buf_size(&call->out);
    if (code != TD_GRPC_OK && queued) {
        int32_t win = nghttp2_session_get_stream_remote_window_size(ses, call->stream_id);
        if (win < 0 || queued > (size_t)win) {
            out_drop_unstarted(call);
            queued = td_grpc_buf_size(&call->out);
            if (!queued) {
                call_submit_trailers(call);
                return;
            }
            if (win < 0 || queued > (size_t)win) {
                td_grpc_buf_free(&call->out);
                call->out_msg_left = 0;
                call->trailers_sent = true; /* none will go */
                nghttp2_submit_rst_stream(ses, NGHTTP2_FLAG_NONE, call->stream_id, NGHTTP2_CANCEL);
                return;
            }
        }
    }
    nghttp2_session_resume_data(ses, call->stream_id);
}

/* An error decided by the server before or instead of the handler. */
static void call_fail(td_grpc_call_t *call, td_grpc_code_t code, const char *msg)
{
    td_debug("grpc call %s stream %d: %s: %s", call->path, call->stream_id, td_grpc_code_name(code), msg);
    call_end(call, code, msg, "200");
}

static ssize_t data_read_cb(nghttp2_session *ses, int32_t stream_id, uint8_t *buf, size_t length,
                            uint32_t *flags, nghttp2_data_source *src, void *user)
{
    td_grpc_call_t *call = nghttp2_session_get_stream_user_data(ses, stream_id);
    if (!call)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    size_t avail = td_grpc_buf_size(&call->out);
    size_t n = TD_MIN(avail, length);
    if (n) {
        memcpy(buf, call->out.data + call->out.off, n);
        out_take(call, n);
    }
    if (n == avail && call->ended) {
        *flags |= NGHTTP2_DATA_FLAG_EOF | NGHTTP2_DATA_FLAG_NO_END_STREAM;
        if (!call->trailers_sent)
            call_submit_trailers(call);
        return (ssize_t)n;
    }
    if (n == 0)
        return NGHTTP2_ERR_DEFERRED;
    return (ssize_t)n;
}

/* ---- public call API ------------------------------------------------------------------ */

const char *td_grpc_call_method(const td_grpc_call_t *call)
{
    return call->path;
}

const char *td_grpc_call_header(const td_grpc_call_t *call, const char *name)
{
    for (size_t off = 0; off < call->meta_len;) {
        const char *n = call->meta + off;
        const char *v = n + strlen(n) + 1;
        if (strcmp(n, name) == 0)
            return v;
        off = (size_t)(v - call->meta) + strlen(v) + 1;
    }
    return NULL;
}

td_status_t td_grpc_call_peer(const td_grpc_call_t *call, struct sockaddr_storage *addr_p)
{
    struct sockaddr_storage a;
    int len = (int)sizeof a;
    if (!call->conn || uv_tcp_getpeername(&call->conn->tcp, (struct sockaddr *)&a, &len) != 0)
        return td_errorf_quiet(TD_ERR_CLOSED, "grpc: the call's connection is gone");
    *addr_p = a;
    return TD_OK;
}

uint64_t td_grpc_call_deadline(const td_grpc_call_t *call)
{
    return call->deadline;
}

void td_grpc_call_set_data(td_grpc_call_t *call, void *call_data)
{
    call->data = call_data;
}

void *td_grpc_call_data(const td_grpc_call_t *call)
{
    return call->data;
}

void td_grpc_call_on_cancel(td_grpc_call_t *call, td_grpc_cancel_cb cb)
{
    call->on_cancel = cb;
}

void td_grpc_call_on_writable(td_grpc_call_t *call, td_grpc_writable_cb cb)
{
    call->on_writable = cb;
}

bool td_grpc_call_is_cancelled(const td_grpc_call_t *call)
{
    return call->cancelled || !call->conn;
}

size_t td_grpc_call_queued_bytes(const td_grpc_call_t *call)
{
    return td_grpc_buf_size(&call->out);
}

static td_status_t call_send(td_grpc_call_t *call, const ProtobufCMessage *msg, bool force)
{
    TD_ASSERT(!call->finished);
    if (!call->conn || call->cancelled || call->ended)
        return TD_ERR_CANCELLED;
    if (!force && td_grpc_buf_size(&call->out) >= call->srv->cfg.send_queue_bytes) {
        call->want_writable = true;
        return TD_ERR_BUSY;
    }
    td_status_t st = td_grpc_buf_put_message(&call->out, msg, call->srv->cfg.max_message_bytes);
    if (st != TD_OK)
        return st;
    if (!call->responded) {
        if (call_respond(call) != 0)
            return td_errorf(TD_ERR_INTERNAL, "grpc: %s: cannot submit the response", call->path);
    } else {
        nghttp2_session_resume_data(call->conn->ses, call->stream_id);
    }
    return TD_OK;
}

td_status_t td_grpc_call_send(td_grpc_call_t *call, const ProtobufCMessage *msg)
{
    return call_send(call, msg, false);
}

void td_grpc_call_finish(td_grpc_call_t *call, td_grpc_code_t code, const char *message)
{
    TD_ASSERT(!call->finished);
    call->finished = true;
    call->want_writable = false;
    call_end(call, code, message, "200");
    call_maybe_free(call);
}

void td_grpc_call_reply(td_grpc_call_t *call, const ProtobufCMessage *msg)
{
    td_status_t st = call_send(call, msg, true);
    if (st == TD_OK || st == TD_ERR_CANCELLED)
        td_grpc_call_finish(call, TD_GRPC_OK, NULL);
    else if (st == TD_ERR_RANGE)
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "response exceeds the message size limit");
    else
        td_grpc_call_finish(call, TD_GRPC_INTERNAL, "cannot queue the response");
}

/* ---- deadline ------------------------------------------------------------------------- */

/*
 * One timer per server over a list of calls in deadline order: a timer started and
 * stopped per call was a heap insert and removal each (~5% of a loaded router). Clients
 * mostly send one timeout, so inserting from the tail is O(1); a deadline that would walk
 * further than DL_MAX_WALK entries (a client sending shrinking timeouts) gets the call's
 * own uv timer instead, so no client can make inserts quadratic.
 */
#define DL_MAX_WALK 32

static void call_deadline_hit(td_grpc_call_t *call);

static void on_dl_timer(uv_timer_t *t);

static void dl_arm(td_grpc_server_t *srv)
{
    td_list_t *first = td_list_first(&srv->deadlines);
    if (!first || srv->closing)
        return;
    uint64_t d = DL_CALL(first)->deadline;
    if (srv->dl_armed && srv->dl_armed <= d)
        return; /* fires first; re-arms then */
    uint64_t now = uv_now(srv->loop);
    uv_timer_start(&srv->dl_timer, on_dl_timer, d > now ? d - now : 0, 0);
    srv->dl_armed = d;
}

static void on_own_deadline(uv_timer_t *t)
{
    call_deadline_hit(t->data);
}

static void dl_insert(td_grpc_server_t *srv, td_grpc_call_t *call)
{
    td_list_t *p = srv->deadlines.prev; /* the list's head once every deadline is later */
    int walk = 0;
    while (p != &srv->deadlines && DL_CALL(p)->deadline > call->deadline) {
        if (++walk > DL_MAX_WALK) {
            call->own_timer = true;
            uv_timer_start(&call->timer, on_own_deadline, call->timeout_ms, 0);
            return;
        }
        p = p->prev;
    }
    td_list_insert_after(p, &call->dl_link);
    dl_arm(srv);
}

static void dl_remove(td_grpc_call_t *call)
{
    if (call->own_timer) {
        uv_timer_stop(&call->timer);
        call->own_timer = false;
    }
    td_list_remove(&call->dl_link);
}

static void on_dl_timer(uv_timer_t *t)
{
    td_grpc_server_t *srv = t->data;
    srv->dl_armed = 0;
    uint64_t now = uv_now(srv->loop);
    td_list_t *n;
    while (!srv->closing && (n = td_list_first(&srv->deadlines)) && DL_CALL(n)->deadline <= now) {
        td_grpc_call_t *call = DL_CALL(n);
        dl_remove(call);
        call_deadline_hit(call);
    }
    dl_arm(srv);
}

static void call_deadline_hit(td_grpc_call_t *call)
{
    if (!call->conn || call->ended)
        return;
    out_drop_unstarted(call); /* drop unsent responses */
    call_end(call, TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded", "200");
    if (call->dispatched && !call->finished && !call->cancelled) {
        call->cancelled = true;
        if (call->on_cancel)
            call->on_cancel(call, TD_ERR_TIMEOUT, call->data);
    }
}

/* ---- nghttp2 callbacks ---------------------------------------------------------------- */

static int on_begin_headers(nghttp2_session *ses, const nghttp2_frame *frame, void *user)
{
    srv_conn_t *c = user;
    if (frame->hd.type != NGHTTP2_HEADERS || frame->headers.cat != NGHTTP2_HCAT_REQUEST)
        return 0;
    td_grpc_call_t *call; /* a spare one is zeroed but for its empty buffers */
    if (!td_list_empty(&c->srv->spare)) {
        call = CALL_OF(td_list_first(&c->srv->spare));
        td_list_remove(&call->link);
        c->srv->n_spare--;
    } else if (!(call = calloc(1, sizeof *call))) {
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    }
    td_list_init(&call->dl_link);
    call->srv = c->srv;
    call->conn = c;
    call->stream_id = frame->hd.stream_id;
    call->begun = uv_now(c->srv->loop);
    uv_timer_init(c->srv->loop, &call->timer);
    call->timer.data = call;
    c->srv->n_calls++;
    td_list_push_front(&c->calls, &call->link);
    nghttp2_session_set_stream_user_data(ses, frame->hd.stream_id, call);
    return 0;
}

static bool name_is(const uint8_t *name, size_t len, const char *lit)
{
    size_t n = strlen(lit);
    return len == n && memcmp(name, lit, n) == 0;
}

/* Keeps a request header for td_grpc_call_header. false: out of memory. */
static bool meta_add(td_grpc_call_t *call, const uint8_t *name, size_t namelen, const uint8_t *value, size_t valuelen)
{
    size_t need = call->meta_len + namelen + valuelen + 2;
    if (need > call->meta_cap) {
        size_t cap = TD_MAX(need, call->meta_cap ? call->meta_cap * 2 : 256);
        char *m = realloc(call->meta, cap);
        if (!m)
            return false;
        call->meta = m;
        call->meta_cap = cap;
    }
    memcpy(call->meta + call->meta_len, name, namelen);
    call->meta[call->meta_len + namelen] = '\0';
    memcpy(call->meta + call->meta_len + namelen + 1, value, valuelen);
    call->meta[call->meta_len + namelen + 1 + valuelen] = '\0';
    call->meta_len = need;
    return true;
}

static int on_header(nghttp2_session *ses, const nghttp2_frame *frame, const uint8_t *name,
                     size_t namelen, const uint8_t *value, size_t valuelen, uint8_t flags, void *user)
{
    srv_conn_t *c = user;
    td_grpc_call_t *call = nghttp2_session_get_stream_user_data(ses, frame->hd.stream_id);
    if (!call || frame->hd.type != NGHTTP2_HEADERS)
        return 0;
    call->header_bytes += namelen + valuelen + 32;
    if (call->header_bytes > c->srv->cfg.max_header_list_bytes)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* resets this stream only */
    if (frame->headers.cat != NGHTTP2_HCAT_REQUEST)
        return 0; /* request trailers: ignored */
    if (name_is(name, namelen, ":method")) {
        call->post = valuelen == 4 && memcmp(value, "POST", 4) == 0;
    } else if (name_is(name, namelen, ":path")) {
        if (valuelen >= sizeof call->path) {
            call->path_too_long = true;
        } else {
            memcpy(call->path, value, valuelen);
            call->path[valuelen] = '\0';
        }
    } else if (name_is(name, namelen, "content-type")) {
        bool grpc = valuelen >= 16 && memcmp(value, "application/grpc", 16) == 0 &&
                    (valuelen == 16 || value[16] == '+' || value[16] == ';');
        call->grpc_ctype = grpc;
        call->other_ctype = !grpc;
    } else if (name_is(name, namelen, "grpc-encoding")) {
        call->bad_encoding = !(valuelen == 8 && memcmp(value, "identity", 8) == 0);
    } else if (name_is(name, namelen, "grpc-timeout")) {
        if (!td_grpc_parse_timeout((const char *)value, valuelen, &call->timeout_ms))
            call->bad_timeout = true;
    } else if (namelen && name[0] != ':' && !name_is(name, namelen, "te") && !name_is(name, namelen, "user-agent") &&
               !name_is(name, namelen, "grpc-accept-encoding") && !meta_add(call, name, namelen, value, valuelen)) {
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE; /* out of memory: this stream only */
    }
    return 0;
}

static const method_t *find_method(const td_grpc_server_t *srv, const char *path)
{
    for (const method_t *m = srv->methods; m; m = m->next)
        if (strcmp(m->path, path) == 0)
            return m;
    return NULL;
}

/* Request headers complete: check them, start the deadline. */
static void call_headers_done(td_grpc_call_t *call)
{
    td_grpc_server_t *srv = call->srv;
    if (!call->grpc_ctype) {
        call_end(call, TD_GRPC_INTERNAL, "content-type must be application/grpc", "415");
        return;
    }
    if (!call->post) {
        call_end(call, TD_GRPC_INTERNAL, "gRPC requires POST", "405");
        return;
    }
    if (call->path_too_long || !(call->method = find_method(srv, call->path))) {
        char msg[320];
        snprintf(msg, sizeof msg, "unknown method %s", call->path_too_long ? "(path too long)" : call->path);
        call_fail(call, TD_GRPC_UNIMPLEMENTED, msg);
        return;
    }
    if (call->bad_encoding) {
        call_fail(call, TD_GRPC_UNIMPLEMENTED, "message compression is not supported");
        return;
    }
    if (call->bad_timeout) {
        call_fail(call, TD_GRPC_INTERNAL, "malformed grpc-timeout");
        return;
    }
    if (call->timeout_ms) {
        call->deadline = uv_now(srv->loop) + call->timeout_ms;
        dl_insert(srv, call);
    }
}

/* The client half-closed: exactly one whole message must be there. */
static void call_dispatch(td_grpc_call_t *call)
{
    uint8_t compressed;
    uint32_t len;
    if (call->ended)
        return;
    if (!td_grpc_peek_prefix(&call->req, &compressed, &len)) {
        call_fail(call, td_grpc_buf_size(&call->req) ? TD_GRPC_INTERNAL : TD_GRPC_UNIMPLEMENTED,
                  td_grpc_buf_size(&call->req) ? "truncated message prefix" : "no request message");
        return;
    }
    size_t have = td_grpc_buf_size(&call->req) - TD_GRPC_PREFIX_BYTES;
    if (have < len) {
        call_fail(call, TD_GRPC_INTERNAL, "truncated request message");
        return;
    }
    if (have > len) {
        call_fail(call, TD_GRPC_UNIMPLEMENTED, "more than one request message (client streaming is not supported)");
        return;
    }
    const uint8_t *bytes = call->req.data + call->req.off + TD_GRPC_PREFIX_BYTES;
    if (call->srv->cfg.authenticate) {
        char why[256] = "";
        td_grpc_code_t code = call->srv->cfg.authenticate(call, bytes, len, call->srv->cfg.auth_data, why, sizeof why);
        if (code != TD_GRPC_OK) {
            td_grpc_buf_free(&call->req);
            call_fail(call, code, why);
            return;
        }
    }
    ProtobufCMessage *req = td_grpc_unpack(call->method->desc, bytes, len);
    td_grpc_buf_free(&call->req);
    if (!req) {
        char msg[256];
        snprintf(msg, sizeof msg, "request does not parse as %s", call->method->desc->name);
        call_fail(call, TD_GRPC_INTERNAL, msg);
        return;
    }
    call->dispatched = true;
    call->conn->served = true;
    call->conn->since = uv_now(call->srv->loop);
    call->method->cb(call, req, call->method->data);
    td_grpc_free_unpacked(req);
}

static int on_frame_recv(nghttp2_session *ses, const nghttp2_frame *frame, void *user)
{
    srv_conn_t *c = user;
    if (!c->handshaken && frame->hd.type == NGHTTP2_SETTINGS && !(frame->hd.flags & NGHTTP2_FLAG_ACK)) {
        c->handshaken = true; /* nghttp2 refuses any other first frame */
        c->since = uv_now(c->srv->loop);
    }
    td_grpc_call_t *call = nghttp2_session_get_stream_user_data(ses, frame->hd.stream_id);
    if (!call)
        return 0;
    if (frame->hd.type == NGHTTP2_HEADERS && frame->headers.cat == NGHTTP2_HCAT_REQUEST)
        call_headers_done(call);
    if ((frame->hd.type == NGHTTP2_HEADERS || frame->hd.type == NGHTTP2_DATA) &&
        (frame->hd.flags & NGHTTP2_FLAG_END_STREAM))
        call_dispatch(call);
    return 0;
}

static int on_data_chunk(nghttp2_session *ses, uint8_t flags, int32_t stream_id, const uint8_t *data,
                         size_t len, void *user)
{
    td_grpc_call_t *call = nghttp2_session_get_stream_user_data(ses, stream_id);
    if (!call || call->ended)
        return 0; /* already answered: discard the rest of the request */
    if (!td_grpc_buf_append(&call->req, data, len)) {
        call_fail(call, TD_GRPC_RESOURCE_EXHAUSTED, "out of memory receiving the request");
        return 0;
    }
    uint8_t compressed;
    uint32_t mlen;
    if (td_grpc_peek_prefix(&call->req, &compressed, &mlen)) {
        if (compressed) {
            call_fail(call, TD_GRPC_UNIMPLEMENTED, "message compression is not supported");
            td_grpc_buf_free(&call->req);
        } else if (mlen > call->srv->cfg.max_message_bytes) {
            char msg[128];
            snprintf(msg, sizeof msg, "request message of %u bytes exceeds the limit of %zu bytes", mlen,
                     call->srv->cfg.max_message_bytes);
            call_fail(call, TD_GRPC_RESOURCE_EXHAUSTED, msg);
            td_grpc_buf_free(&call->req);
        } else if (td_grpc_buf_size(&call->req) > (size_t)mlen + TD_GRPC_PREFIX_BYTES + TD_GRPC_PREFIX_BYTES) {
            call_fail(call, TD_GRPC_UNIMPLEMENTED, "more than one request message (client streaming is not supported)");
            td_grpc_buf_free(&call->req);
        }
    }
    return 0;
}

static int on_stream_close(nghttp2_session *ses, int32_t stream_id, uint32_t error_code, void *user)
{
    td_grpc_call_t *call = nghttp2_session_get_stream_user_data(ses, stream_id);
    if (!call)
        return 0;
    nghttp2_session_set_stream_user_data(ses, stream_id, NULL);
    call_detach(call, TD_ERR_CANCELLED);
    return 0;
}

/* ---- connections ---------------------------------------------------------------------- */

static void conn_tcp_closed(uv_handle_t *h)
{
    srv_conn_t *c = h->data;
    td_grpc_server_t *srv = c->srv;
    free(c);
    srv->open_handles--;
    server_maybe_free(srv);
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
        call_detach(call, why);
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
        if (memcmp(p, PREFACE + c->preface_seen, k) != 0) {
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
    nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
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

td_status_t td_grpc_server_add_method(td_grpc_server_t *srv, const char *path,
                                      const ProtobufCMessageDescriptor *request_desc,
                                      td_grpc_handler_cb cb, void *data)
{
    const char *slash2 = path && path[0] == '/' ? strchr(path + 1, '/') : NULL;
    if (!slash2 || slash2 == path + 1 || !slash2[1] || strchr(slash2 + 1, '/') || strlen(path) >= 256 ||
        !request_desc || !cb)
        return td_errorf(TD_ERR_INVALID, "grpc server: method path \"%s\" is not /package.Service/Method",
                         path ? path : "(null)");
    if (find_method(srv, path))
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
