/*
 * td_grpc_client: the gRPC channel (client) of td_grpc.h.
 *
 * A channel is one TCP connection with one nghttp2 client session, created at once so
 * calls can be submitted while connecting; output is pumped from a uv_prepare hook once
 * connected. Window updates are manual (NO_AUTO_WINDOW_UPDATE): received DATA is
 * acknowledged with nghttp2_session_consume only when delivered, so a paused call holds
 * its server back by the stream window. A call's request is framed into a buffer read by
 * a data provider; responses are reassembled per call, checked against
 * max_message_bytes from their prefix, unpacked under a bounded allocator and handed to
 * on_message. The end (trailers, reset, deadline, cancel, connection loss) reaches
 * on_done exactly once; the call is then freed (or kept for reuse) when its timer handle
 * has closed. Deadlines share one timer per channel (a list in deadline order).
 */
#include "td_grpc.h"

#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_grpc_wire.h"
#include "td_list.h"
#include "td_log.h"
#include "td_rpc_tcp.h"
#include "td_util.h"

#define READ_BUF_BYTES (64 * 1024)

struct td_grpc_client_call {
    td_list_t link;               /* in ch->calls until it ends, then maybe in ch->spare */
    td_grpc_channel_t *ch;
    int32_t stream_id;
    uv_timer_t timer;             /* never started: its close callback frees the call */
    uint64_t deadline;            /* uv_now() ms; 0 = none */
    td_list_t dl_link;            /* in ch->deadlines while it has a deadline to keep */
    td_grpc_call_opts_t opts;
    td_grpc_buf_t req;            /* framed request not yet taken by nghttp2 */
    td_grpc_buf_t resp;           /* response bytes not yet delivered */
    size_t unconsumed;            /* delivered-to-us bytes not yet acknowledged */
    int http_status;
    int grpc_status;              /* -1 until trailers carry one */
    char *grpc_message;
    bool paused, delivering, done, freeing;
    bool ended;                   /* the stream closed; done waits for buffered data */
    uint32_t reset_code;
    td_grpc_code_t local_code;    /* a failure decided here, or -1 */
    char local_msg[160];
};

/* The call whose link / dl_link is the node n. */
#define CALL_OF(n) TD_CONTAINER_OF(n, td_grpc_client_call_t, link)
#define DL_CALL(n) TD_CONTAINER_OF(n, td_grpc_client_call_t, dl_link)

typedef enum ch_state { CH_CONNECTING, CH_READY, CH_FAILED } ch_state_t;

struct td_grpc_channel {
    uv_loop_t *loop;
    td_grpc_channel_config_t cfg;
    uv_tcp_t tcp;
    uv_connect_t connect_req;
    uv_prepare_t pump;
    uv_timer_t dl_timer;          /* one timer for every call's deadline */
    uint64_t dl_armed;            /* the deadline it is set for; 0 = not set */
    td_list_t deadlines;          /* calls with a deadline, soonest first (dl_link) */
    nghttp2_session *ses;
    ch_state_t state;
    char authority[300];
    td_list_t calls;              /* calls not yet ended, newest first (link) */
    td_list_t spare;              /* ended calls kept for reuse (TD_GRPC_SPARE_CALLS), by link */
    int n_spare;
    int writes_in_flight;
    int open_handles;
    int in_recv;                  /* nesting depth of mem_recv */
    bool reading, closing, tcp_closed, goaway;
    void (*close_cb)(void *data);
    void *close_data;
    uint8_t rbuf[READ_BUF_BYTES];
};

td_grpc_channel_config_t td_grpc_channel_config_default(void)
{
    return (td_grpc_channel_config_t){
        .max_message_bytes = 4u << 20,
        .initial_window_bytes = 1u << 20,
        .max_header_list_bytes = 16u << 10,
    };
}

/* ---- teardown ------------------------------------------------------------------------- */

static void channel_maybe_free(td_grpc_channel_t *ch)
{
    if (!ch->closing || ch->open_handles > 0 || ch->in_recv)
        return;
    void (*cb)(void *) = ch->close_cb;
    void *data = ch->close_data;
    nghttp2_session_del(ch->ses);
    if (ch->cfg.sign_free)
        ch->cfg.sign_free(ch->cfg.sign_data);
    TD_LIST_FOREACH_SAFE(n, &ch->spare) {
        td_grpc_client_call_t *c = CALL_OF(n);
        td_grpc_buf_free(&c->req);
        td_grpc_buf_free(&c->resp);
        free(c);
    }
    free(ch);
    if (cb)
        cb(data);
}

static void channel_handle_closed(uv_handle_t *h)
{
    td_grpc_channel_t *ch = h->data;
    ch->open_handles--;
    channel_maybe_free(ch);
}

static void call_timer_closed(uv_handle_t *h)
{
    td_grpc_client_call_t *call = h->data;
    td_grpc_channel_t *ch = call->ch;
    free(call->grpc_message);
    if (ch->n_spare < TD_GRPC_SPARE_CALLS && !ch->closing) {
        td_grpc_buf_t req = call->req, resp = call->resp;
        td_grpc_buf_recycle(&req);
        td_grpc_buf_recycle(&resp);
        memset(call, 0, sizeof *call);
        call->req = req;
        call->resp = resp;
        td_list_push_front(&ch->spare, &call->link);
        ch->n_spare++;
    } else {
        td_grpc_buf_free(&call->req);
        td_grpc_buf_free(&call->resp);
        free(call);
    }
    ch->open_handles--;
    channel_maybe_free(ch);
}

/* Acknowledges received bytes to flow control. */
static void call_consume(td_grpc_client_call_t *call)
{
    td_grpc_channel_t *ch = call->ch;
    if (!call->unconsumed || !ch->ses)
        return;
    if (call->stream_id <= 0 ||
        nghttp2_session_consume(ch->ses, call->stream_id, call->unconsumed) != 0)
        nghttp2_session_consume_connection(ch->ses, call->unconsumed);
    call->unconsumed = 0;
}

/* ---- deadlines: one timer per channel, calls in deadline order ------------------------
 * A timer per call cost a heap insert and removal per call (uv_timer_start/stop were ~5%
 * of a loaded router); calls of a channel mostly share a timeout, so the list is kept in
 * order by inserting from its tail, and the timer is re-armed only when it fires or an
 * earlier deadline arrives. */

static void on_dl_timer(uv_timer_t *t);

static void dl_arm(td_grpc_channel_t *ch)
{
    td_list_t *first = td_list_first(&ch->deadlines);
    if (!first || ch->closing)
        return;
    uint64_t d = DL_CALL(first)->deadline;
    if (ch->dl_armed && ch->dl_armed <= d)
        return; /* fires first; re-arms then */
    uint64_t now = uv_now(ch->loop);
    uv_timer_start(&ch->dl_timer, on_dl_timer, d > now ? d - now : 0, 0);
    ch->dl_armed = d;
}

static void dl_insert(td_grpc_channel_t *ch, td_grpc_client_call_t *call)
{
    td_list_t *p = ch->deadlines.prev; /* the list's head once every deadline is later */
    while (p != &ch->deadlines && DL_CALL(p)->deadline > call->deadline)
        p = p->prev;
    td_list_insert_after(p, &call->dl_link);
    dl_arm(ch);
}

static void call_abort(td_grpc_client_call_t *call, td_grpc_code_t code, const char *msg, uint32_t h2_error);

static void on_dl_timer(uv_timer_t *t)
{
    td_grpc_channel_t *ch = t->data;
    ch->dl_armed = 0;
    uint64_t now = uv_now(ch->loop);
    td_list_t *n;
    while (!ch->closing && (n = td_list_first(&ch->deadlines)) && DL_CALL(n)->deadline <= now) {
        td_grpc_client_call_t *call = DL_CALL(n);
        td_list_remove(&call->dl_link);
        call_abort(call, TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded", NGHTTP2_CANCEL);
    }
    dl_arm(ch);
}

/* Ends the call: on_done once, then unlink and free. */
static void call_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *msg)
{
    if (call->done)
        return;
    call->done = true;
    td_grpc_channel_t *ch = call->ch;
    td_list_remove(&call->dl_link);
    call_consume(call);
    if (call->stream_id > 0 && ch->ses)
        nghttp2_session_set_stream_user_data(ch->ses, call->stream_id, NULL);
    td_list_remove(&call->link);
    call->opts.on_done(call, code, msg ? msg : "", call->opts.data);
    call->freeing = true;
    uv_close((uv_handle_t *)&call->timer, call_timer_closed);
}

/* Fails the call locally and resets its stream. */
static void call_abort(td_grpc_client_call_t *call, td_grpc_code_t code, const char *msg, uint32_t h2_error)
{
    td_grpc_channel_t *ch = call->ch;
    if (call->done)
        return;
    if (call->stream_id > 0 && ch->ses && !call->ended)
        nghttp2_submit_rst_stream(ch->ses, NGHTTP2_FLAG_NONE, call->stream_id, h2_error);
    call_done(call, code, msg);
}

/* The stream has closed and everything buffered was delivered: report its status. */
static void call_finish_from_stream(td_grpc_client_call_t *call)
{
    char buf[160];
    if (call->grpc_status < 0 && call->reset_code) { /* a reset may cut a message: it is the news */
        td_grpc_code_t code = call->reset_code == NGHTTP2_REFUSED_STREAM ? TD_GRPC_UNAVAILABLE
                              : call->reset_code == NGHTTP2_CANCEL         ? TD_GRPC_CANCELLED
                                                                           : TD_GRPC_INTERNAL;
        snprintf(buf, sizeof buf, "stream reset by the server (%s)", nghttp2_http2_strerror(call->reset_code));
        call_done(call, code, buf);
    } else if (td_grpc_buf_size(&call->resp)) {
        call_done(call, TD_GRPC_INTERNAL, "stream ended inside a message (truncated)");
    } else if (call->grpc_status >= 0) {
        call_done(call, (td_grpc_code_t)call->grpc_status, call->grpc_message);
    } else if (call->http_status && call->http_status != 200) {
        snprintf(buf, sizeof buf, "HTTP status %d without grpc-status", call->http_status);
        call_done(call, td_grpc_code_from_http(call->http_status), buf);
    } else {
        call_done(call, TD_GRPC_INTERNAL, "response ended without grpc-status");
    }
}

/* Delivers whole messages from the reassembly buffer unless paused. */
static void call_deliver(td_grpc_client_call_t *call)
{
    if (call->delivering || call->done)
        return;
    call->delivering = true;
    td_grpc_channel_t *ch = call->ch;
    while (!call->paused && !call->done) {
        uint8_t compressed;
        uint32_t len;
        if (!td_grpc_peek_prefix(&call->resp, &compressed, &len))
            break;
        if (compressed) {
            call_abort(call, TD_GRPC_INTERNAL, "compressed response (compression is not supported)", NGHTTP2_CANCEL);
            break;
        }
        if (len > ch->cfg.max_message_bytes) {
            char msg[128];
            snprintf(msg, sizeof msg, "response message of %u bytes exceeds the limit of %zu bytes", len,
                     ch->cfg.max_message_bytes);
            call_abort(call, TD_GRPC_RESOURCE_EXHAUSTED, msg, NGHTTP2_CANCEL);
            break;
        }
        if (td_grpc_buf_size(&call->resp) - TD_GRPC_PREFIX_BYTES < len)
            break;
        const uint8_t *p = call->resp.data + call->resp.off + TD_GRPC_PREFIX_BYTES;
        if (call->opts.on_message) {
            ProtobufCMessage *m = td_grpc_unpack(call->opts.response_desc, p, len, NULL);
            td_grpc_buf_consume(&call->resp, TD_GRPC_PREFIX_BYTES + len);
            if (!m) {
                call_abort(call, TD_GRPC_INTERNAL, "response does not parse", NGHTTP2_CANCEL);
                break;
            }
            call->opts.on_message(call, m, call->opts.data);
            td_grpc_free_unpacked(m);
        } else {
            td_grpc_buf_consume(&call->resp, TD_GRPC_PREFIX_BYTES + len);
        }
    }
    if (!call->done && !call->paused) {
        call_consume(call);
        if (call->ended)
            call_finish_from_stream(call);
    }
    call->delivering = false;
}

/* ---- nghttp2 callbacks ---------------------------------------------------------------- */

static ssize_t req_read_cb(nghttp2_session *ses, int32_t stream_id, uint8_t *buf, size_t length,
                           uint32_t *flags, nghttp2_data_source *src, void *user)
{
    td_grpc_client_call_t *call = nghttp2_session_get_stream_user_data(ses, stream_id);
    if (!call)
        return NGHTTP2_ERR_TEMPORAL_CALLBACK_FAILURE;
    size_t n = TD_MIN(td_grpc_buf_size(&call->req), length);
    memcpy(buf, call->req.data + call->req.off, n);
    td_grpc_buf_consume(&call->req, n);
    if (td_grpc_buf_size(&call->req) == 0) {
        *flags |= NGHTTP2_DATA_FLAG_EOF;
        td_grpc_buf_free(&call->req);
    }
    return (ssize_t)n;
}

static int on_header(nghttp2_session *ses, const nghttp2_frame *frame, const uint8_t *name,
                     size_t namelen, const uint8_t *value, size_t valuelen, uint8_t flags, void *user)
{
    td_grpc_client_call_t *call = nghttp2_session_get_stream_user_data(ses, frame->hd.stream_id);
    if (!call || frame->hd.type != NGHTTP2_HEADERS)
        return 0;
    if (namelen == 7 && memcmp(name, ":status", 7) == 0) {
        int s = 0;
        for (size_t i = 0; i < valuelen && i < 3; i++)
            s = s * 10 + (value[i] - '0');
        call->http_status = s;
    } else if (namelen == 11 && memcmp(name, "grpc-status", 11) == 0) {
        int s = 0;
        bool ok = valuelen > 0 && valuelen <= 3;
        for (size_t i = 0; ok && i < valuelen; i++) {
            ok = value[i] >= '0' && value[i] <= '9';
            s = s * 10 + (value[i] - '0');
        }
        call->grpc_status = ok ? s : TD_GRPC_UNKNOWN;
    } else if (namelen == 12 && memcmp(name, "grpc-message", 12) == 0) {
        free(call->grpc_message);
        call->grpc_message = td_grpc_percent_decode(value, valuelen);
    }
    return 0;
}

static int on_data_chunk(nghttp2_session *ses, uint8_t flags, int32_t stream_id, const uint8_t *data,
                         size_t len, void *user)
{
    td_grpc_channel_t *ch = user;
    td_grpc_client_call_t *call = nghttp2_session_get_stream_user_data(ses, stream_id);
    if (!call) {
        if (nghttp2_session_consume(ses, stream_id, len) != 0)
            nghttp2_session_consume_connection(ses, len);
        return 0;
    }
    call->unconsumed += len;
    /* The stream window bounds how much can arrive while paused; a message larger than
     * max_message_bytes is refused from its prefix in call_deliver. */
    if (td_grpc_buf_size(&call->resp) + len > ch->cfg.max_message_bytes + 2 * (size_t)ch->cfg.initial_window_bytes + 64) {
        call_abort(call, TD_GRPC_RESOURCE_EXHAUSTED, "response buffer over its bound", NGHTTP2_CANCEL);
        return 0;
    }
    if (!td_grpc_buf_append(&call->resp, data, len)) {
        call_abort(call, TD_GRPC_RESOURCE_EXHAUSTED, "out of memory receiving a response", NGHTTP2_CANCEL);
        return 0;
    }
    call_deliver(call);
    return 0;
}

static int on_stream_close(nghttp2_session *ses, int32_t stream_id, uint32_t error_code, void *user)
{
    td_grpc_client_call_t *call = nghttp2_session_get_stream_user_data(ses, stream_id);
    if (!call)
        return 0;
    call->ended = true;
    call->reset_code = error_code;
    call_deliver(call);
    return 0;
}

static int on_frame_recv(nghttp2_session *ses, const nghttp2_frame *frame, void *user)
{
    td_grpc_channel_t *ch = user;
    if (frame->hd.type == NGHTTP2_GOAWAY)
        ch->goaway = true;
    return 0;
}

/* ---- connection ----------------------------------------------------------------------- */

/* The connection is unusable: every call ends with UNAVAILABLE. */
static void channel_fail(td_grpc_channel_t *ch, const char *why)
{
    char msg[512];
    if (ch->state == CH_FAILED)
        return;
    ch->state = CH_FAILED;
    snprintf(msg, sizeof msg, "connection to %s: %s", ch->authority, why);
    td_debug("grpc channel: %s", msg);
    if (!ch->tcp_closed) {
        ch->tcp_closed = true;
        uv_close((uv_handle_t *)&ch->tcp, channel_handle_closed);
    }
    while (!td_list_empty(&ch->calls))
        call_done(CALL_OF(td_list_first(&ch->calls)), TD_GRPC_UNAVAILABLE, msg);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    td_grpc_channel_t *ch = h->data;
    *buf = uv_buf_init((char *)ch->rbuf, sizeof ch->rbuf);
}

static void channel_pump(td_grpc_channel_t *ch);

static void on_write(uv_write_t *req, int status)
{
    td_grpc_channel_t *ch = req->data;
    td_grpc_write_done(req);
    if (status < 0 && ch->state != CH_FAILED && !ch->closing)
        channel_fail(ch, uv_strerror(status));
}

static void channel_pump(td_grpc_channel_t *ch)
{
    if (ch->state != CH_READY || ch->closing)
        return;
    int rc = td_grpc_pump(ch->ses, (uv_stream_t *)&ch->tcp, ch, on_write, &ch->writes_in_flight);
    if (rc < 0) {
        channel_fail(ch, rc > -1000 ? uv_strerror(rc) : nghttp2_strerror(rc));
        return;
    }
    if (!nghttp2_session_want_read(ch->ses) && !nghttp2_session_want_write(ch->ses)) {
        channel_fail(ch, "session ended");
        return;
    }
    bool congested = uv_stream_get_write_queue_size((uv_stream_t *)&ch->tcp) >= TD_GRPC_WRITE_HIGH;
    if (congested && ch->reading) {
        uv_read_stop((uv_stream_t *)&ch->tcp);
        ch->reading = false;
    } else if (!congested && !ch->reading) {
        if (uv_read_start((uv_stream_t *)&ch->tcp, on_alloc, on_read) == 0)
            ch->reading = true;
    }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    td_grpc_channel_t *ch = s->data;
    if (ch->state != CH_READY || ch->closing)
        return;
    if (nread < 0) {
        channel_fail(ch, nread == UV_EOF ? "closed by the server" : uv_strerror((int)nread));
        return;
    }
    if (nread == 0)
        return;
    ch->in_recv++;
    ssize_t rc = nghttp2_session_mem_recv(ch->ses, (const uint8_t *)buf->base, (size_t)nread);
    ch->in_recv--;
    if (ch->closing) {
        channel_maybe_free(ch);
        return;
    }
    if (rc < 0)
        channel_fail(ch, nghttp2_strerror((int)rc));
}

static void on_connect(uv_connect_t *req, int status)
{
    td_grpc_channel_t *ch = req->data;
    if (ch->closing || ch->state == CH_FAILED)
        return;
    if (status < 0) {
        channel_fail(ch, uv_strerror(status));
        return;
    }
    ch->state = CH_READY;
    uv_tcp_nodelay(&ch->tcp, 1);
    channel_pump(ch);
}

static void on_pump(uv_prepare_t *h)
{
    channel_pump(h->data);
}

/* ---- public API ----------------------------------------------------------------------- */

td_status_t td_grpc_channel_create(uv_loop_t *loop, const char *host, uint16_t port,
                                   const td_grpc_channel_config_t *cfg, td_grpc_channel_t **ch_p)
{
    struct sockaddr_storage addr;
    const char *ip = strcmp(host, "localhost") == 0 ? "127.0.0.1" : host;
    td_status_t st = TD_OK;
    if (!td_rpc_tcp_addr(ip, port, &addr))
        st = td_errorf(TD_ERR_INVALID, "grpc channel: \"%s\" is not an IP address (names are not resolved here)", host);
    else if (cfg->max_message_bytes == 0 || cfg->max_message_bytes > UINT32_MAX ||
             cfg->initial_window_bytes < 65535 || cfg->initial_window_bytes > 0x7fffffff ||
             cfg->max_header_list_bytes < 1024)
        st = td_errorf(TD_ERR_INVALID, "grpc channel: a limit in the configuration is zero or out of range");
    else if (!cfg->sign != !cfg->sign_header)
        st = td_errorf(TD_ERR_INVALID, "grpc channel: sign and sign_header go together");
    td_grpc_channel_t *ch = st == TD_OK ? calloc(1, sizeof *ch) : NULL;
    if (st == TD_OK && !ch)
        st = td_errorf(TD_ERR_NOMEM, "grpc channel: out of memory");
    if (st != TD_OK) {
        if (cfg->sign_free) /* owned from here on, also on failure */
            cfg->sign_free(cfg->sign_data);
        return st;
    }
    ch->loop = loop;
    ch->cfg = *cfg;
    td_list_init(&ch->deadlines);
    td_list_init(&ch->calls);
    td_list_init(&ch->spare);
    snprintf(ch->authority, sizeof ch->authority, strchr(ip, ':') ? "[%s]:%u" : "%s:%u", ip, port);

    nghttp2_session_callbacks *cbs;
    nghttp2_option *opt;
    if (nghttp2_session_callbacks_new(&cbs) != 0)
        goto err_nomem;
    nghttp2_session_callbacks_set_on_header_callback(cbs, on_header);
    nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data_chunk);
    nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_stream_close);
    nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame_recv);
    if (nghttp2_option_new(&opt) != 0) {
        nghttp2_session_callbacks_del(cbs);
        goto err_nomem;
    }
    nghttp2_option_set_no_auto_window_update(opt, 1);
    int rc = nghttp2_session_client_new2(&ch->ses, cbs, ch, opt);
    nghttp2_option_del(opt);
    nghttp2_session_callbacks_del(cbs);
    if (rc != 0)
        goto err_nomem;
    nghttp2_settings_entry iv[] = {
        {NGHTTP2_SETTINGS_ENABLE_PUSH, 0},
        {NGHTTP2_SETTINGS_INITIAL_WINDOW_SIZE, cfg->initial_window_bytes},
        {NGHTTP2_SETTINGS_MAX_HEADER_LIST_SIZE, cfg->max_header_list_bytes},
        {NGHTTP2_SETTINGS_NO_RFC7540_PRIORITIES, 1}, /* no dependency tree to keep per stream */
    };
    if (nghttp2_submit_settings(ch->ses, NGHTTP2_FLAG_NONE, iv, TD_ARRAY_LEN(iv)) != 0 ||
        nghttp2_session_set_local_window_size(ch->ses, NGHTTP2_FLAG_NONE, 0,
                                              (int32_t)cfg->initial_window_bytes) != 0)
        goto err_session;

    uv_tcp_init(loop, &ch->tcp);
    ch->tcp.data = ch;
    uv_prepare_init(loop, &ch->pump);
    ch->pump.data = ch;
    uv_timer_init(loop, &ch->dl_timer);
    ch->dl_timer.data = ch;
    ch->open_handles = 3;
    ch->connect_req.data = ch;
    uv_prepare_start(&ch->pump, on_pump);
    uv_unref((uv_handle_t *)&ch->pump);
    rc = uv_tcp_connect(&ch->connect_req, &ch->tcp, (struct sockaddr *)&addr, on_connect);
    if (rc < 0) {
        st = td_errorf(TD_ERR_IO, "grpc channel: connect to %s: %s", ch->authority, uv_strerror(rc));
        ch->closing = true;
        ch->tcp_closed = true;
        uv_close((uv_handle_t *)&ch->tcp, channel_handle_closed);
        uv_close((uv_handle_t *)&ch->pump, channel_handle_closed);
        uv_close((uv_handle_t *)&ch->dl_timer, channel_handle_closed);
        return st;
    }
    *ch_p = ch;
    return TD_OK;

err_session:
    nghttp2_session_del(ch->ses);
err_nomem:
    if (cfg->sign_free)
        cfg->sign_free(cfg->sign_data);
    free(ch);
    return td_errorf(TD_ERR_NOMEM, "grpc channel: out of memory");
}

bool td_grpc_channel_is_usable(const td_grpc_channel_t *ch)
{
    return ch->state != CH_FAILED && !ch->closing && !ch->goaway;
}

void td_grpc_channel_close(td_grpc_channel_t *ch, void (*cb)(void *data), void *data)
{
    if (!ch || ch->closing)
        return;
    while (!td_list_empty(&ch->calls))
        call_done(CALL_OF(td_list_first(&ch->calls)), TD_GRPC_CANCELLED, "channel closed");
    ch->closing = true;
    ch->close_cb = cb;
    ch->close_data = data;
    if (!ch->tcp_closed) {
        ch->tcp_closed = true;
        uv_close((uv_handle_t *)&ch->tcp, channel_handle_closed);
    }
    uv_close((uv_handle_t *)&ch->pump, channel_handle_closed);
    uv_close((uv_handle_t *)&ch->dl_timer, channel_handle_closed);
}

td_status_t td_grpc_channel_call(td_grpc_channel_t *ch, const char *method,
                                 const ProtobufCMessage *request,
                                 const td_grpc_call_opts_t *opts, td_grpc_client_call_t **call_p)
{
    if (!method || method[0] != '/' || strlen(method) >= 256 || !opts || !opts->on_done ||
        (opts->on_message && !opts->response_desc) || (!request && !opts->raw_request && opts->raw_request_len) ||
        opts->n_headers > TD_GRPC_MAX_CALL_HEADERS || (opts->n_headers && !opts->headers))
        return td_errorf(TD_ERR_INVALID, "grpc call: bad method or options");
    for (size_t i = 0; i < opts->n_headers; i++)
        if (!opts->headers[i].name || !opts->headers[i].value || !opts->headers[i].name[0] ||
            opts->headers[i].name[0] == ':')
            return td_errorf(TD_ERR_INVALID, "grpc call: header %zu has no name or value, or is a pseudo-header", i);
    if (!td_grpc_channel_is_usable(ch))
        return td_errorf_quiet(TD_ERR_UNAVAILABLE, "grpc call %s: the channel to %s is not usable", method,
                               ch->authority);
    td_grpc_client_call_t *call; /* a spare one is zeroed but for its empty buffers */
    if (!td_list_empty(&ch->spare)) {
        call = CALL_OF(td_list_first(&ch->spare));
        td_list_remove(&call->link);
        ch->n_spare--;
    } else if (!(call = calloc(1, sizeof *call))) {
        return td_errorf(TD_ERR_NOMEM, "grpc call: out of memory");
    }
    td_list_init(&call->dl_link);
    call->ch = ch;
    call->opts = *opts;
    call->grpc_status = -1;
    td_status_t st = request ? td_grpc_buf_put_message(&call->req, request, ch->cfg.max_message_bytes)
                             : td_grpc_buf_put_raw(&call->req, opts->raw_request, opts->raw_request_len,
                                                   ch->cfg.max_message_bytes);
    if (st != TD_OK)
        goto err_call;

    char timeout[TD_GRPC_TIMEOUT_CHARS];
    char sig[TD_GRPC_SIGN_CHARS];
    nghttp2_nv nv[9 + TD_GRPC_MAX_CALL_HEADERS];
    size_t n = 0;
    if (ch->cfg.sign) {
        const uint8_t *bytes = call->req.data + call->req.off + TD_GRPC_PREFIX_BYTES;
        size_t len = td_grpc_buf_size(&call->req) - TD_GRPC_PREFIX_BYTES;
        if ((st = ch->cfg.sign(ch->cfg.sign_data, method, bytes, len, sig, sizeof sig)) != TD_OK)
            goto err_call;
    }
    nv[n++] = td_grpc_nv(":method", "POST");
    nv[n++] = td_grpc_nv(":scheme", "http");
    nv[n++] = td_grpc_nv(":path", method);
    nv[n++] = td_grpc_nv(":authority", ch->authority);
    nv[n++] = td_grpc_nv("content-type", "application/grpc");
    nv[n++] = td_grpc_nv("te", "trailers");
    nv[n++] = td_grpc_nv("user-agent", "tandem-grpc/0.1");
    if (opts->timeout_ms) {
        td_grpc_format_timeout(opts->timeout_ms, timeout);
        nv[n++] = td_grpc_nv("grpc-timeout", timeout);
    }
    if (ch->cfg.sign)
        nv[n++] = td_grpc_nv(ch->cfg.sign_header, sig);
    for (size_t i = 0; i < opts->n_headers; i++)
        nv[n++] = td_grpc_nv(opts->headers[i].name, opts->headers[i].value);
    nghttp2_data_provider prd = {.source.ptr = NULL, .read_callback = req_read_cb};
    int32_t sid = nghttp2_submit_request(ch->ses, NULL, nv, n, &prd, call);
    if (sid < 0) {
        st = td_errorf_quiet(TD_ERR_UNAVAILABLE, "grpc call %s: %s", method, nghttp2_strerror(sid));
        goto err_call;
    }
    call->stream_id = sid;
    uv_timer_init(ch->loop, &call->timer);
    call->timer.data = call;
    ch->open_handles++;
    td_list_push_front(&ch->calls, &call->link);
    if (opts->timeout_ms) {
        call->deadline = uv_now(ch->loop) + opts->timeout_ms;
        dl_insert(ch, call);
    }
    if (call_p)
        *call_p = call;
    return TD_OK;

err_call:
    td_grpc_buf_free(&call->req);
    free(call);
    return st;
}

void td_grpc_client_call_cancel(td_grpc_client_call_t *call)
{
    call_abort(call, TD_GRPC_CANCELLED, "cancelled by the client", NGHTTP2_CANCEL);
}

void td_grpc_client_call_pause(td_grpc_client_call_t *call, bool paused)
{
    if (call->done)
        return;
    call->paused = paused;
    if (!paused)
        call_deliver(call);
}
