/*
 * td_grpc_server_call: a gRPC server call, one HTTP/2 stream, from its HEADERS to its
 * trailers.
 *
 * A call (one stream) gathers its request in a buffer bounded by max_message_bytes,
 * is dispatched when the client half-closes, and answers through a bounded send queue
 * read by an nghttp2 data provider (deferred while empty, resumed by a send or the
 * finish; trailers are submitted from the provider once the queue drains). A call is
 * freed when its stream is gone and its handler has finished; its timer handle is the
 * last handle closed. Every nghttp2 callback looks the call up by stream id, so nothing
 * dangles after a stream closes.
 *
 * Here also the call API of td_grpc.h, the one deadline timer over every call, and the
 * nghttp2 callbacks that begin, gather, check and dispatch calls.
 */
#include "td_grpc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_grpc_server_impl.h"
#include "td_grpc_wire.h"
#include "td_list.h"
#include "td_log.h"

/* ---- calls ---------------------------------------------------------------------------- */

/* Frees the request bytes and gives them back to the body budget. */
static void req_release(td_grpc_call_t *call)
{
    td_grpc_buf_free(&call->req);
    td_rpc_budget_give(call->srv->cfg.body_budget, call->charged);
    call->charged = 0;
}

static void call_timer_closed(uv_handle_t *h)
{
    td_grpc_call_t *call = h->data;
    td_grpc_server_t *srv = call->srv;
    free(call->message);
    td_rpc_budget_give(srv->cfg.body_budget, call->charged);
    call->charged = 0;
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
    td_grpc_server_maybe_free(srv);
}

static void call_maybe_free(td_grpc_call_t *call)
{
    if (call->freeing || call->conn || call->unpacking || (call->dispatched && !call->finished))
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

void td_grpc_call_detach(td_grpc_call_t *call, td_status_t why)
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

td_status_t td_grpc_call_send_last(td_grpc_call_t *call, const ProtobufCMessage *msg)
{
    return call_send(call, msg, true);
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
    if (call->path_too_long || !(call->method = td_grpc_server_find_method(srv, call->path))) {
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
    if (srv->cfg.authenticate_head) { /* before a byte of the request is kept */
        char why[256] = "";
        td_grpc_code_t code = srv->cfg.authenticate_head(call, srv->cfg.auth_data, why, sizeof why);
        if (code != TD_GRPC_OK) {
            call_fail(call, code, why);
            return;
        }
    }
    if (call->timeout_ms) {
        call->deadline = uv_now(srv->loop) + call->timeout_ms;
        dl_insert(srv, call);
    }
}

/* A request unpacked (NULL: it did not parse, or over the unpack bound) goes to its
 * handler, which may keep the call; the message is freed when the handler returns. */
static void call_run(td_grpc_call_t *call, ProtobufCMessage *req, bool over)
{
    if (!req) {
        char msg[256];
        if (over)
            snprintf(msg, sizeof msg, "request unpacks as %s to more than 16 bytes a wire byte (too many tiny "
                     "fields or sub-messages): send fewer", call->method->desc->name);
        else
            snprintf(msg, sizeof msg, "request does not parse as %s", call->method->desc->name);
        call_fail(call, over ? TD_GRPC_RESOURCE_EXHAUSTED : TD_GRPC_INTERNAL, msg);
        return;
    }
    call->dispatched = true;
    call->conn->served = true;
    call->conn->since = uv_now(call->srv->loop);
    call->method->cb(call, req, call->method->data);
    td_grpc_free_unpacked(req);
}

/* ---- long requests, unpacked on the thread pool (cfg.unpack_off_loop_bytes) ------------ */

/* The job owns the request's bytes and their charge to the body budget (moved from the
 * call, so nothing the loop does to the call meanwhile touches them) and the result. The
 * call is kept (call->unpacking) until the job is back; a call whose stream went or that
 * ended meanwhile (its deadline) only frees the message then. protobuf-c and the arena
 * touch nothing but the job, so the unpack is safe on another thread. */
typedef struct unpack_job {
    uv_work_t work;                        /* first: the job is its work request */
    td_grpc_call_t *call;
    const ProtobufCMessageDescriptor *desc;
    td_grpc_buf_t bytes;                   /* the request with its 5-byte prefix */
    size_t charged;                        /* its bytes of cfg.body_budget */
    ProtobufCMessage *msg;
    bool over;
} unpack_job_t;

static void unpack_work(uv_work_t *w)
{
    unpack_job_t *j = (unpack_job_t *)w;
    const uint8_t *p = j->bytes.data + j->bytes.off + TD_GRPC_PREFIX_BYTES;
    j->msg = td_grpc_unpack(j->desc, p, td_grpc_buf_size(&j->bytes) - TD_GRPC_PREFIX_BYTES, &j->over);
}

static void unpack_done(uv_work_t *w, int status)
{
    (void)status; /* never cancelled: uv_cancel is not used */
    unpack_job_t *j = (unpack_job_t *)w;
    td_grpc_call_t *call = j->call;
    td_grpc_server_t *srv = call->srv;
    srv->n_unpacking--;
    call->unpacking = false;
    td_grpc_buf_free(&j->bytes);
    td_rpc_budget_give(srv->cfg.body_budget, j->charged);
    ProtobufCMessage *msg = j->msg;
    bool over = j->over;
    free(j);
    if (!call->conn || call->ended || srv->closing) {
        td_grpc_free_unpacked(msg);
        call_maybe_free(call);
        return;
    }
    call_run(call, msg, over);
}

/* Moves call's request to the pool; the call is refused RESOURCE_EXHAUSTED past
 * max_unpacking or when the pool cannot take it. */
static void unpack_start(td_grpc_call_t *call)
{
    td_grpc_server_t *srv = call->srv;
    unpack_job_t *j = NULL;
    if (srv->n_unpacking >= srv->cfg.max_unpacking || !(j = calloc(1, sizeof *j))) {
        char msg[160];
        snprintf(msg, sizeof msg, "the server is unpacking %u long requests (its bound): retry shortly",
                 srv->n_unpacking);
        req_release(call);
        call_fail(call, TD_GRPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    *j = (unpack_job_t){.call = call, .desc = call->method->desc, .bytes = call->req, .charged = call->charged};
    if (uv_queue_work(srv->loop, &j->work, unpack_work, unpack_done) != 0) {
        free(j);
        req_release(call);
        call_fail(call, TD_GRPC_RESOURCE_EXHAUSTED, "the server cannot queue the request's unpacking: retry shortly");
        return;
    }
    memset(&call->req, 0, sizeof call->req);
    call->charged = 0;
    call->unpacking = true;
    srv->n_unpacking++;
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
            req_release(call);
            call_fail(call, code, why);
            return;
        }
    }
    if (call->srv->cfg.unpack_off_loop_bytes && len > call->srv->cfg.unpack_off_loop_bytes) {
        unpack_start(call);
        return;
    }
    bool over;
    ProtobufCMessage *req = td_grpc_unpack(call->method->desc, bytes, len, &over);
    req_release(call);
    call_run(call, req, over);
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
        td_rpc_budget_t *budget = call->srv->cfg.body_budget;
        if (compressed) {
            call_fail(call, TD_GRPC_UNIMPLEMENTED, "message compression is not supported");
            req_release(call);
        } else if (mlen > call->srv->cfg.max_message_bytes) {
            char msg[128];
            snprintf(msg, sizeof msg, "request message of %u bytes exceeds the limit of %zu bytes", mlen,
                     call->srv->cfg.max_message_bytes);
            call_fail(call, TD_GRPC_RESOURCE_EXHAUSTED, msg);
            req_release(call);
        } else if (td_grpc_buf_size(&call->req) > (size_t)mlen + TD_GRPC_PREFIX_BYTES + TD_GRPC_PREFIX_BYTES) {
            call_fail(call, TD_GRPC_UNIMPLEMENTED, "more than one request message (client streaming is not supported)");
            req_release(call);
        } else if (!call->charged && !td_rpc_budget_take(budget, (size_t)mlen + TD_GRPC_PREFIX_BYTES)) {
            char msg[200];
            snprintf(msg, sizeof msg, "the server holds %zu bytes of requests (its bound for request bodies in "
                     "flight is %zu): retry shortly", budget->used, budget->limit);
            call_fail(call, TD_GRPC_RESOURCE_EXHAUSTED, msg);
            req_release(call);
        } else if (!call->charged) {
            call->charged = (size_t)mlen + TD_GRPC_PREFIX_BYTES;
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
    td_grpc_call_detach(call, TD_ERR_CANCELLED);
    return 0;
}

void td_grpc_server_set_callbacks(nghttp2_session_callbacks *cbs)
{
    nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, on_begin_headers);
    nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
}
