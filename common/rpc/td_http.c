/*
 * td_http: the HTTP/1.1 server behind td_http.h, on libhttp-parser.
 *
 * A connection is a TCP handle, one timer and an http_parser. Bytes read go straight
 * through the parser (from one read buffer the server shares) whose callbacks copy the
 * request's line and headers into the request's bounded head buffer and its body into a
 * buffer that grows to max_body_bytes. When a message is complete the parser is paused
 * and the handler called; bytes that arrive meanwhile wait unparsed in the connection's
 * input buffer (READ_BYTES; reading stops while it is full) and are parsed once the answer
 * has been given and less than half max_write_queue_bytes waits to be written (conn_flush),
 * so pipelined requests are answered in order, one at a time, and a client that reads no
 * answers makes us queue at most about that much.
 *
 * Answers are copied into the connection's output blocks and written once per loop
 * iteration (see "writing"); `queued` counts the bytes not yet written. The connection is
 * in one of three lists, which make eviction O(1):
 * `fresh` (never answered a request, nothing handled or queued), `idle` (answered one,
 * nothing handled or queued; in the order they became idle) and `busy`. The one timer
 * carries whichever deadline is nearest (conn_arm_timer). A connection's memory is freed
 * when both handles have closed; a handled request still unanswered then gets on_abort.
 */
#include "td_http.h"

#include <http_parser.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "td_list.h"
#include "td_log.h"
#include "td_rpc_tcp.h"
#include "td_util.h"

enum {
    READ_BYTES = 64 * 1024,   /* the shared read buffer, and a connection's input bound */
    IN_MIN_BYTES = 4096,       /* a connection's input buffer at first (it doubles as needed) */
    EXTRA_HEADER_BYTES = 4096, /* td_http_resp_header's bound */
    HEAD_BYTES = 512,          /* status line + the server's headers */
    ERROR_BODY_BYTES = 1024,   /* an error answer the server decides (cfg.error_body) */
    LINGER_MS = 2000,          /* see http_conn.lingering */
    BLOCK_BYTES = 16 * 1024,   /* an output block (a bigger piece gets a block its size) */
    FREE_BLOCKS = 64,          /* output blocks the server keeps for reuse */
};

typedef struct http_conn http_conn_t;
typedef struct out_block out_block_t;

/* A piece of a connection's output (see "writing"). */
struct out_block {
    out_block_t *next;
    size_t cap, off, len;        /* data[off..len) unwritten */
    char data[];
};


/* Why the server closed a connection itself (the `reason` label). */
enum { CLOSE_REQUEST, CLOSE_IDLE, CLOSE_WRITE, CLOSE_EVICTED, CLOSE_REFUSED, CLOSE_N, /* counted */
       CLOSE_LINGER = CLOSE_N, CLOSE_NONE };
static const char *const close_names[CLOSE_N] = {"request_timeout", "idle_timeout", "write_timeout",
                                                 "evicted", "refused"};

struct td_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    td_http_config_t cfg;
    http_parser_settings settings;
    uint16_t port;
    td_list_t fresh, idle, busy; /* connections by state, oldest first (http_conn_t.link) */
    uint32_t n_conns;
    bool closing;
    bool refusing;               /* the last connection was refused (warned once) */
    int pending_closes;          /* listener + connections still closing */
    void (*close_cb)(void *data);
    void *close_data;
    td_metric_t *closed_by[CLOSE_N];
    uv_idle_t flush;             /* writes the dirty connections' output, once per iteration */
    td_list_t dirty;             /* connections with output to write (http_conn_t.dirty_link) */
    out_block_t *free_blocks;    /* BLOCK_BYTES blocks for reuse, n_free_blocks of them */
    size_t n_free_blocks;
    char rbuf[READ_BYTES];       /* what on_alloc hands a connection with no input waiting */
};

/* A request's life: its bytes arriving, handled (the handler has it), streaming, gone to
 * on_abort. Answered requests are freed at once (their bytes are copies in the writes). */
typedef enum req_state { REQ_READING, REQ_HANDLED, REQ_STREAMING, REQ_ABORTED } req_state_t;

struct td_http_req {
    http_conn_t *conn;
    req_state_t state;
    bool complete;               /* the whole message is in (the parser paused on it) */
    bool keep_alive, http10, head_method;
    const char *method;
    const char *path, *query;    /* into head */
    enum { LAST_URL, LAST_FIELD, LAST_VALUE } last;
    bool headers_done;
    uint32_t n_headers;
    size_t url_len;
    size_t head_len;             /* bytes used of head[max_request_bytes] */
    char *body;                  /* [body_cap], body_len used */
    size_t body_len, body_cap;
    char *extra;                 /* response headers added, "Name: value\r\n"... */
    size_t extra_len;
    void *data;
    td_http_req_cb on_abort, on_writable;
    bool want_writable;
    char head[];                 /* url\0 then name\0value\0 per header */
};

struct http_conn {
    td_list_t link;              /* in srv->fresh, idle or busy until it starts closing */
    td_list_t *list;             /* which one; NULL once closing (or never listed) */
    td_http_server_t *srv;
    uv_tcp_t tcp;
    uv_timer_t timer;            /* the nearest deadline, see conn_arm_timer */
    http_parser parser;
    td_http_req_t *req;          /* being read or handled; NULL between requests */
    char *in;                    /* [in_cap <= READ_BYTES] input waiting while paused:
                                  * in[in_off..+in_len); freed when empty */
    size_t in_cap;
    size_t in_off, in_len;
    out_block_t *out_head, *out_tail; /* output not yet written, `queued` bytes of it */
    size_t queued;
    size_t inflight;             /* of those, the bytes of the uv_write in flight (wreq) */
    uv_write_t wreq;
    bool writing;                /* wreq is in flight */
    bool dirty;                  /* in srv->dirty */
    td_list_t dirty_link;
    uint64_t since;              /* accept or the last answer written: the idle deadline's base */
    uint64_t req_start;          /* the current request's first byte */
    uint64_t write_progress;     /* the last write callback, or the first write queued */
    int timer_reason;            /* CLOSE_* of the deadline the timer carries */
    int err_status;              /* an answer the parser callbacks chose (413, 414, 431, ...) */
    bool answered;               /* the current request is answered, its bytes still queued */
    bool close_after;            /* close once the queue is empty */
    bool served;                 /* answered a request once */
    bool reading;
    bool eof;                    /* the client half-closed after its answer was given */
    bool discard;                /* an error answer is going: what arrives is read and dropped */
    bool lingering;              /* it was written and our side shut: waiting for the client's
                                  * close, at most LINGER_MS, so it reads the answer before a reset */
    uv_shutdown_t shutdown;
    bool closing;
    int open_handles;
};

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

static void conn_free_blocks(http_conn_t *c);

static void req_free(td_http_req_t *req)
{
    free(req->body);
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
        req_free(req);
    }
    td_http_server_t *srv = c->srv;
    conn_free_blocks(c);
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

static void conn_close(http_conn_t *c, int why)
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

/* Moves c to the list its state says: busy while a request is handled or bytes are
 * queued, else fresh or idle (to the back: the newest). */
static void conn_relist(http_conn_t *c)
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

static void conn_linger(http_conn_t *c);
static void conn_read_start(http_conn_t *c);

/* A deadline. A connection with nothing handled or queued (idle, or a request still
 * arriving: a slowloris) is shut gently (conn_linger), so the client reads an end rather
 * than a reset caused by bytes it sent meanwhile; the rest close at once (a handled
 * request is aborted now, bytes nobody reads are dropped). */
static void on_timer(uv_timer_t *t)
{
    http_conn_t *c = t->data;
    int why = c->timer_reason;
    bool handled = c->req && c->req->state != REQ_READING;
    if (why == CLOSE_LINGER || handled || c->queued > 0 || c->answered || c->lingering) {
        conn_close(c, why);
        return;
    }
    td_debug("%s connection: closed, %s", c->srv->cfg.name, close_names[why]);
    if (c->srv->closed_by[why])
        td_metric_inc(c->srv->closed_by[why]);
    if (c->req) {
        req_free(c->req);
        c->req = NULL;
    }
    c->discard = true;
    c->in_off = c->in_len = 0;
    conn_read_start(c);
    conn_linger(c);
}

/* Arms the timer for the nearest deadline that applies: the request's (its first byte +
 * request_timeout_ms, until it is answered or its stream begun), the idle one (no request
 * begun, nothing queued: since + idle_timeout_ms) and the write one (bytes queued: the last
 * write progress + request_timeout_ms). None (a stream with nothing queued): stopped. */
static void conn_arm_timer(http_conn_t *c)
{
    if (c->closing || c->lingering)
        return;
    const td_http_config_t *cfg = &c->srv->cfg;
    uint64_t deadline = UINT64_MAX;
    int why = CLOSE_NONE;
    if (c->req && (c->req->state == REQ_READING || c->req->state == REQ_HANDLED)) {
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

/* ---- writing ------------------------------------------------------------------------- */

/* Output waits in a connection's chain of blocks until the server's idle callback (once per
 * loop iteration, before it polls, which it then does without blocking) writes each dirty
 * connection's bytes at once as far as the socket takes them (uv_try_write) and hands the
 * rest to one uv_write. An answer or a stream's chunks cost a copy into a block, not an allocation and a
 * write each; a connection's chunks of one iteration go out in one system call. */
static out_block_t *block_new(td_http_server_t *srv, size_t need)
{
    if (need <= BLOCK_BYTES && srv->free_blocks) {
        out_block_t *b = srv->free_blocks;
        srv->free_blocks = b->next;
        srv->n_free_blocks--;
        b->next = NULL;
        b->off = b->len = 0;
        return b;
    }
    size_t cap = need > BLOCK_BYTES ? need : BLOCK_BYTES;
    out_block_t *b = malloc(sizeof *b + cap);
    if (!b)
        return NULL;
    *b = (out_block_t){.cap = cap};
    return b;
}

static void block_free(td_http_server_t *srv, out_block_t *b)
{
    if (b->cap == BLOCK_BYTES && srv->n_free_blocks < FREE_BLOCKS) {
        b->next = srv->free_blocks;
        srv->free_blocks = b;
        srv->n_free_blocks++;
        return;
    }
    free(b);
}

static void conn_free_blocks(http_conn_t *c)
{
    while (c->out_head) {
        out_block_t *b = c->out_head;
        c->out_head = b->next;
        block_free(c->srv, b);
    }
    c->out_tail = NULL;
}

static void on_flush(uv_idle_t *h);

static void conn_mark_dirty(http_conn_t *c)
{
    td_http_server_t *srv = c->srv;
    if (c->dirty || c->writing || c->closing)
        return; /* a write in flight flushes the rest from its callback */
    c->dirty = true;
    td_list_push_back(&srv->dirty, &c->dirty_link);
    if (!uv_is_active((uv_handle_t *)&srv->flush))
        uv_idle_start(&srv->flush, on_flush);
}

/* Room for `len` bytes at the end of c's output (a new block when the last has too little);
 * conn_commit says how many were used. NULL when out of memory. */
static char *conn_reserve(http_conn_t *c, size_t len)
{
    out_block_t *t = c->out_tail;
    if (t && t->cap - t->len >= len)
        return t->data + t->len;
    out_block_t *b = block_new(c->srv, len);
    if (!b)
        return NULL;
    if (t)
        t->next = b;
    else
        c->out_head = b;
    c->out_tail = b;
    return b->data;
}

static void conn_commit(http_conn_t *c, size_t used)
{
    if (c->queued == 0)
        c->write_progress = uv_now(c->srv->loop);
    c->out_tail->len += used;
    c->queued += used;
    conn_mark_dirty(c);
}

/* Drops the first n written bytes; the blocks go back when nothing is left. */
static void conn_consume(http_conn_t *c, size_t n)
{
    c->queued -= n;
    c->write_progress = uv_now(c->srv->loop);
    while (n > 0) {
        out_block_t *b = c->out_head;
        size_t take = b->len - b->off < n ? b->len - b->off : n;
        b->off += take;
        n -= take;
        if (b->off == b->len && b != c->out_tail) {
            c->out_head = b->next;
            block_free(c->srv, b);
        }
    }
    if (c->queued == 0)
        conn_free_blocks(c);
}

/* The unwritten bytes as up to `max` buffers; their total. */
static size_t conn_iov(http_conn_t *c, uv_buf_t *iov, unsigned max, unsigned *n_p)
{
    unsigned n = 0;
    size_t total = 0;
    for (out_block_t *b = c->out_head; b && n < max; b = b->next)
        if (b->len > b->off) {
            iov[n++] = uv_buf_init(b->data + b->off, (unsigned)(b->len - b->off));
            total += b->len - b->off;
        }
    *n_p = n;
    return total;
}

static void conn_resume(http_conn_t *c);

static void on_shutdown(uv_shutdown_t *req, int status)
{
    http_conn_t *c = req->data;
    if (status < 0)
        conn_close(c, CLOSE_NONE);
}

/* Shuts our side and waits, dropping what comes, for the client's close: at most LINGER_MS. */
static void conn_linger(http_conn_t *c)
{
    c->lingering = true;
    c->shutdown.data = c;
    if (uv_shutdown(&c->shutdown, (uv_stream_t *)&c->tcp, on_shutdown) < 0) {
        conn_close(c, CLOSE_NONE);
        return;
    }
    c->timer_reason = CLOSE_LINGER;
    uv_timer_start(&c->timer, on_timer, LINGER_MS, 0);
}

/* The current answer is written: the connection waits for its next request (or closes). */
static void conn_answer_written(http_conn_t *c)
{
    c->answered = false;
    c->served = true;
    c->since = uv_now(c->srv->loop);
    if (c->eof) {
        conn_close(c, CLOSE_NONE);
        return;
    }
    if (c->discard && !c->srv->closing) {
        conn_linger(c);
        return;
    }
    if (c->close_after || c->srv->closing) {
        conn_close(c, CLOSE_NONE);
        return;
    }
    conn_relist(c);
    conn_arm_timer(c);
    conn_resume(c);
}

/* After bytes were written: the handler's on_writable, the answer's end, the deadlines.
 * Runs from loop callbacks only (flush, write), never inside a td_http_* call. */
static void conn_progress(http_conn_t *c)
{
    if (c->closing)
        return;
    td_http_req_t *req = c->req;
    if (req && req->want_writable && c->queued <= c->srv->cfg.max_write_queue_bytes / 2) {
        req->want_writable = false;
        if (req->on_writable)
            req->on_writable(req, req->data); /* may end the stream and free req */
        if (c->closing)
            return;
    }
    if (c->queued == 0 && c->answered && !c->writing) {
        conn_answer_written(c);
        return;
    }
    conn_relist(c);
    conn_arm_timer(c);
}

static void on_write(uv_write_t *w, int status);

/* Writes what c has queued: at once as far as the socket takes it, the rest by uv_write. */
static void conn_flush(http_conn_t *c)
{
    if (c->closing || c->writing)
        return;
    /* pipelined requests behind an answer given: handled now, so that their answers go out
     * in this write (each still after the one before it) */
    while (c->answered && c->in_len > 0 && !c->close_after && !c->discard && !c->eof && !c->closing &&
           c->queued < c->srv->cfg.max_write_queue_bytes / 2)
        conn_answer_written(c);
    if (c->closing)
        return;
    uv_buf_t iov[16];
    unsigned n;
    if (conn_iov(c, iov, 16, &n) > 0) {
        int w = uv_try_write((uv_stream_t *)&c->tcp, iov, n);
        if (w < 0 && w != UV_EAGAIN) {
            td_debug("%s connection: write failed: %s", c->srv->cfg.name, uv_strerror(w));
            conn_close(c, CLOSE_NONE);
            return;
        }
        if (w > 0)
            conn_consume(c, (size_t)w);
        size_t rest = conn_iov(c, iov, 16, &n);
        if (rest > 0) {
            c->wreq.data = c;
            int rc = uv_write(&c->wreq, (uv_stream_t *)&c->tcp, iov, n, on_write);
            if (rc < 0) {
                td_debug("%s connection: write failed: %s", c->srv->cfg.name, uv_strerror(rc));
                conn_close(c, CLOSE_NONE);
                return;
            }
            c->writing = true;
            c->inflight = rest;
        }
    }
    conn_progress(c);
}

static void on_write(uv_write_t *w, int status)
{
    http_conn_t *c = w->data;
    c->writing = false;
    if (c->closing)
        return;
    if (status < 0) {
        td_debug("%s connection: write failed: %s", c->srv->cfg.name, uv_strerror(status));
        conn_close(c, CLOSE_NONE);
        return;
    }
    conn_consume(c, c->inflight);
    c->inflight = 0;
    conn_flush(c);
}

/* Flushes the connections dirty now; those that get output while it runs (a handler that
 * writes from on_writable, the next pipelined answer) wait for the next loop iteration, so
 * a stream to a fast reader cannot keep the loop from reading and accepting. */
static void on_flush(uv_idle_t *h)
{
    td_http_server_t *srv = h->data;
    td_list_t now;
    td_list_init(&now);
    while (!td_list_empty(&srv->dirty)) {
        td_list_t *n = td_list_first(&srv->dirty);
        td_list_remove(n);
        td_list_push_back(&now, n);
    }
    while (!td_list_empty(&now)) {
        http_conn_t *c = TD_CONTAINER_OF(td_list_first(&now), http_conn_t, dirty_link);
        td_list_remove(&c->dirty_link);
        c->dirty = false;
        conn_flush(c);
    }
    if (td_list_empty(&srv->dirty))
        uv_idle_stop(h);
}

/* Formats a response head into out[HEAD_BYTES + extra]; returns its length. `length` is
 * the Content-Length, or -1 for a chunked body, -2 for one the close ends. */
static size_t format_head(char *out, int status, const char *ctype, long long length, bool keep_alive,
                          const char *extra, size_t extra_len)
{
    int n = snprintf(out, HEAD_BYTES, "HTTP/1.1 %d %s\r\nContent-Type: %.200s\r\n", status,
                     td_http_status_text(status), ctype ? ctype : "text/plain; charset=utf-8");
    if (length >= 0)
        n += snprintf(out + n, HEAD_BYTES - (size_t)n, "Content-Length: %lld\r\n", length);
    else if (length == -1)
        n += snprintf(out + n, HEAD_BYTES - (size_t)n, "Transfer-Encoding: chunked\r\n");
    n += snprintf(out + n, HEAD_BYTES - (size_t)n, "Connection: %s\r\n", keep_alive ? "keep-alive" : "close");
    memcpy(out + n, extra, extra_len);
    memcpy(out + n + extra_len, "\r\n", 2);
    return (size_t)n + extra_len + 2;
}

/* Answers with an error the server decided (garbage, a bound passed): the connection
 * parses no more, and closes once it is written and the client has closed its side (see
 * http_conn.lingering). */
static void conn_fail(http_conn_t *c, int status, const char *msg)
{
    if (c->closing)
        return;
    if (c->req) { /* never handed to the handler: errors come only while reading */
        TD_ASSERT(c->req->state == REQ_READING);
        req_free(c->req);
        c->req = NULL;
    }
    td_debug("%s connection: %d, %s", c->srv->cfg.name, status, msg);
    c->discard = true;
    c->in_off = c->in_len = 0;
    const td_http_config_t *cfg = &c->srv->cfg;
    char body[ERROR_BODY_BYTES];
    const char *ctype = NULL;
    size_t blen = cfg->error_body ? cfg->error_body(cfg->handler_data, status, msg, body, sizeof body, &ctype) : 0;
    if (blen == 0 || blen > sizeof body) {
        blen = (size_t)snprintf(body, sizeof body, "%s\n", msg);
        blen = blen < sizeof body ? blen : sizeof body - 1;
        ctype = NULL;
    }
    char *out = conn_reserve(c, HEAD_BYTES + blen);
    if (!out) {
        conn_close(c, CLOSE_NONE);
        return;
    }
    size_t n = format_head(out, status, ctype, (long long)blen, false, "", 0);
    memcpy(out + n, body, blen);
    conn_commit(c, n + blen);
    c->answered = true;
    c->close_after = true;
    conn_relist(c);
    conn_arm_timer(c);
    conn_read_start(c); /* had it stopped for a full input buffer */
}

/* ---- parsing ------------------------------------------------------------------------- */

static int on_message_begin(http_parser *p)
{
    http_conn_t *c = p->data;
    size_t cap = c->srv->cfg.max_request_bytes;
    td_http_req_t *req = calloc(1, sizeof *req + cap + 1);
    if (!req) {
        c->err_status = 503;
        return -1;
    }
    req->conn = c;
    req->state = REQ_READING;
    req->last = LAST_URL;
    c->req = req;
    c->req_start = uv_now(c->srv->loop);
    conn_arm_timer(c);
    return 0;
}

/* Appends to the head buffer; false (431, or 414 for the URL) past max_request_bytes. */
static bool head_append(http_conn_t *c, const char *at, size_t len, bool nul)
{
    td_http_req_t *req = c->req;
    size_t cap = c->srv->cfg.max_request_bytes;
    if (len + nul > cap - req->head_len) {
        c->err_status = req->last == LAST_URL && !nul ? 414 : 431;
        return false;
    }
    memcpy(req->head + req->head_len, at, len);
    req->head_len += len;
    if (nul)
        req->head[req->head_len++] = '\0';
    return true;
}

static int on_url(http_parser *p, const char *at, size_t len)
{
    http_conn_t *c = p->data;
    if (!head_append(c, at, len, false))
        return -1;
    c->req->url_len += len;
    return 0;
}

/* Ends the URL or value being written: a NUL, trailing blanks of a value dropped. */
static bool head_end_item(http_conn_t *c)
{
    td_http_req_t *req = c->req;
    if (req->last == LAST_VALUE)
        while (req->head_len > 0 && (req->head[req->head_len - 1] == ' ' || req->head[req->head_len - 1] == '\t'))
            req->head_len--;
    return head_append(c, "", 0, true);
}

static int on_header_field(http_parser *p, const char *at, size_t len)
{
    http_conn_t *c = p->data;
    td_http_req_t *req = c->req;
    if (req->headers_done) { /* a chunked body's trailer: counted against the bound, dropped */
        if (len > c->srv->cfg.max_request_bytes - req->head_len) {
            c->err_status = 431;
            return -1;
        }
        req->head_len += len;
        return 0;
    }
    if (req->last != LAST_FIELD) {
        if (!head_end_item(c))
            return -1;
        req->n_headers++;
        req->last = LAST_FIELD;
    }
    return head_append(c, at, len, false) ? 0 : -1;
}

static int on_header_value(http_parser *p, const char *at, size_t len)
{
    http_conn_t *c = p->data;
    td_http_req_t *req = c->req;
    if (req->headers_done)
        return on_header_field(p, at, len);
    if (req->last != LAST_VALUE) {
        if (!head_end_item(c))
            return -1;
        req->last = LAST_VALUE;
    }
    return head_append(c, at, len, false) ? 0 : -1;
}

static int on_headers_complete(http_parser *p)
{
    http_conn_t *c = p->data;
    td_http_req_t *req = c->req;
    const td_http_config_t *cfg = &c->srv->cfg;
    if (req->last == LAST_FIELD) { /* a name with no value cannot get here; be safe */
        c->err_status = 400;
        return -1;
    }
    if (!head_end_item(c))
        return -1;
    req->headers_done = true;
    req->method = http_method_str((enum http_method)p->method);
    char *q = memchr(req->head, '?', req->url_len);
    req->path = req->head;
    req->query = "";
    if (q) {
        *q = '\0';
        req->query = q + 1;
    }
    req->http10 = p->http_major == 1 && p->http_minor == 0;
    req->keep_alive = http_should_keep_alive(p) && p->http_major == 1;
    req->head_method = p->method == HTTP_HEAD;
    if (p->upgrade || p->method == HTTP_CONNECT) {
        c->err_status = 501;
        return -1;
    }
    if (p->http_major != 1) {
        c->err_status = 505;
        return -1;
    }
    bool chunked = p->flags & F_CHUNKED;
    uint64_t declared = chunked || p->content_length == ULLONG_MAX ? 0 : p->content_length;
    if (declared > cfg->max_body_bytes) {
        c->err_status = 413;
        return -1;
    }
    const char *expect = td_http_req_header(req, "expect");
    if (expect) {
        if (strcasecmp(expect, "100-continue") != 0 || req->http10) {
            c->err_status = 417;
            return -1;
        }
        if (chunked || declared > 0) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            char *out = conn_reserve(c, sizeof cont - 1);
            if (!out) {
                c->err_status = 503;
                return -1;
            }
            memcpy(out, cont, sizeof cont - 1);
            conn_commit(c, sizeof cont - 1);
        }
    }
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t len)
{
    http_conn_t *c = p->data;
    td_http_req_t *req = c->req;
    size_t max = c->srv->cfg.max_body_bytes;
    if (len > max - req->body_len) {
        c->err_status = 413;
        return -1;
    }
    if (req->body_len + len > req->body_cap) {
        size_t cap = req->body_cap ? req->body_cap : 1024;
        while (cap < req->body_len + len)
            cap *= 2;
        if (cap > max)
            cap = max;
        char *b = realloc(req->body, cap + 1); /* +1: td_http_req_body's "" when empty */
        if (!b) {
            c->err_status = 503;
            return -1;
        }
        req->body = b;
        req->body_cap = cap;
    }
    memcpy(req->body + req->body_len, at, len);
    req->body_len += len;
    return 0;
}

static int on_message_complete(http_parser *p)
{
    http_conn_t *c = p->data;
    c->req->complete = true;
    http_parser_pause(p, 1); /* the rest waits until this request is answered */
    return 0;
}

static const char *parse_error_text(http_conn_t *c, enum http_errno e)
{
    switch (c->err_status) {
    case 413: return "request body too large";
    case 414: return "request target too long";
    case 431: return "request headers too large";
    case 417: return "only Expect: 100-continue is understood (HTTP/1.1)";
    case 501: return "CONNECT and protocol upgrades are not supported";
    case 505: return "only HTTP/1.x is served";
    case 503: return "out of memory";
    default: break;
    }
    if (e == HPE_HEADER_OVERFLOW)
        return "request headers too large";
    return http_errno_description(e);
}

/* Feeds data[0..len) to the parser; a complete request goes to the handler. Returns the
 * bytes consumed (fewer than len when a request completed first: the rest waits). */
static size_t conn_parse(http_conn_t *c, const char *data, size_t len)
{
    td_http_server_t *srv = c->srv;
    size_t n = http_parser_execute(&c->parser, &srv->settings, data, len);
    if (c->closing)
        return len;
    enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
    if (e == HPE_PAUSED && c->req && c->req->complete) {
        td_http_req_t *req = c->req;
        req->state = REQ_HANDLED;
        if (!req->body) {
            req->body = malloc(1);
            if (!req->body) {
                conn_fail(c, 503, "out of memory");
                return len;
            }
        }
        req->body[req->body_len] = '\0';
        conn_relist(c);
        conn_arm_timer(c);
        srv->cfg.handler(srv->cfg.handler_data, req); /* may answer, and free req */
        return n;
    }
    if (e != HPE_OK) {
        int status = c->err_status ? c->err_status : e == HPE_HEADER_OVERFLOW ? 431 : 400;
        conn_fail(c, status, parse_error_text(c, e));
        return len;
    }
    return n;
}

/* ---- reading ------------------------------------------------------------------------- */

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

static bool conn_paused(const http_conn_t *c)
{
    return HTTP_PARSER_ERRNO(&c->parser) == HPE_PAUSED;
}

static void conn_read_start(http_conn_t *c)
{
    if (c->reading || c->closing || c->eof || c->in_len >= READ_BYTES)
        return;
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) {
        conn_close(c, CLOSE_NONE);
        return;
    }
    c->reading = true;
}

/* Parses the input that waited while the previous request was handled, then reads on. */
static void conn_resume(http_conn_t *c)
{
    http_parser_pause(&c->parser, 0);
    while (c->in_len > 0 && !c->closing && !c->discard && !conn_paused(c)) {
        size_t n = conn_parse(c, c->in + c->in_off, c->in_len);
        if (c->closing)
            return;
        if (c->discard)
            break; /* an error answer is going; reading goes on, dropping */
        c->in_off += n;
        c->in_len -= n;
    }
    if (c->in_len == 0) { /* a streaming connection waits with no input buffer */
        free(c->in);
        c->in = NULL;
        c->in_cap = c->in_off = 0;
    }
    conn_read_start(c);
}

/* Bytes go through the parser from the server's buffer; while a request is handled they
 * wait in the connection's own. */
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    http_conn_t *c = h->data;
    if ((!conn_paused(c) && c->in_len == 0) || c->discard) {
        *buf = uv_buf_init(c->srv->rbuf, READ_BYTES);
        return;
    }
    if (c->in_off > 0) {
        memmove(c->in, c->in + c->in_off, c->in_len);
        c->in_off = 0;
    }
    if (c->in_len == c->in_cap) { /* below READ_BYTES: reading stops there */
        size_t cap = c->in_cap ? 2 * c->in_cap : IN_MIN_BYTES;
        char *in = realloc(c->in, cap < READ_BYTES ? cap : READ_BYTES);
        if (!in) {
            *buf = uv_buf_init(NULL, 0); /* on_read gets UV_ENOBUFS and closes */
            return;
        }
        c->in = in;
        c->in_cap = cap < READ_BYTES ? cap : READ_BYTES;
    }
    *buf = uv_buf_init(c->in + c->in_len, (unsigned)(c->in_cap - c->in_len));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    http_conn_t *c = s->data;
    if (nread < 0) {
        /* EOF or reset. A request still handled is aborted (a half-close cannot be told
         * from a close: the client is taken as gone); answers already given are written
         * first (`printf 'GET ...' | nc`), and what else came is dropped. */
        if (nread != UV_EOF || !c->answered) {
            if (nread != UV_EOF)
                td_debug("%s connection: read failed: %s", c->srv->cfg.name, uv_strerror((int)nread));
            conn_close(c, CLOSE_NONE);
            return;
        }
        uv_read_stop(s);
        c->reading = false;
        c->eof = true; /* closes once the answer is written (conn_answer_written) */
        return;
    }
    if (nread == 0 || c->closing || c->discard)
        return;
    if (buf->base == c->srv->rbuf) {
        size_t n = conn_parse(c, buf->base, (size_t)nread);
        if (n < (size_t)nread && !c->closing && !c->discard) {
            size_t rest = (size_t)nread - n, cap = rest <= IN_MIN_BYTES ? IN_MIN_BYTES : READ_BYTES;
            TD_ASSERT(c->in_len == 0); /* input waits only while paused, and it was not */
            if (c->in_cap < cap) {
                free(c->in);
                c->in_cap = 0;
                if (!(c->in = malloc(cap))) {
                    conn_close(c, CLOSE_NONE);
                    return;
                }
                c->in_cap = cap;
            }
            memcpy(c->in, buf->base + n, rest);
            c->in_off = 0;
            c->in_len = rest;
        }
    } else {
        c->in_len += (size_t)nread;
    }
    if (c->reading && c->in_len >= READ_BYTES) {
        uv_read_stop(s); /* resumed once the handled request is answered */
        c->reading = false;
    }
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
        conn_close(c, CLOSE_NONE);
        return;
    }
    if (srv->n_conns >= srv->cfg.max_connections) {
        http_conn_t *victim = pick_victim(srv);
        if (!victim) {
            if (!srv->refusing) /* once per run of refusals: a flood must not flood the log */
                td_warn("%s server: connection limit %u reached and every connection is busy, refusing "
                        "connections (counted by %s)", srv->cfg.name, srv->cfg.max_connections, srv->cfg.metrics_name);
            srv->refusing = true;
            conn_close(c, CLOSE_REFUSED);
            return;
        }
        conn_close(victim, CLOSE_EVICTED);
    }
    srv->refusing = false;
    td_list_push_back(&srv->fresh, &c->link);
    c->list = &srv->fresh;
    srv->n_conns++;
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    c->since = uv_now(srv->loop);
    uv_tcp_nodelay(&c->tcp, 1);
    conn_arm_timer(c);
    conn_read_start(c);
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
    td_list_init(&srv->fresh);
    td_list_init(&srv->idle);
    td_list_init(&srv->busy);
    http_parser_settings_init(&srv->settings);
    srv->settings.on_message_begin = on_message_begin;
    srv->settings.on_url = on_url;
    srv->settings.on_header_field = on_header_field;
    srv->settings.on_header_value = on_header_value;
    srv->settings.on_headers_complete = on_headers_complete;
    srv->settings.on_body = on_body;
    srv->settings.on_message_complete = on_message_complete;
    if (cfg->metrics) {
        td_status_t st = td_metrics_counter_each(cfg->metrics, srv->cfg.metrics_name,
                                                 "Connections the HTTP server closed itself, by reason: "
                                                 "request_timeout, idle_timeout, write_timeout (queued bytes "
                                                 "unread), evicted (room for a new one), refused.",
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
            conn_close(TD_CONTAINER_OF(td_list_first(lists[i]), http_conn_t, link), CLOSE_NONE);
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

td_status_t td_http_resp_header(td_http_req_t *req, const char *name, const char *value)
{
    if (req->state != REQ_HANDLED)
        return td_errorf_quiet(TD_ERR_CLOSED, "http: response header %s after the answer began", name);
    size_t nl = strlen(name), vl = strlen(value);
    if (nl == 0 || strcspn(name, "\r\n: \t") != nl || strcspn(value, "\r\n") != vl)
        return td_errorf_quiet(TD_ERR_INVALID, "http: response header \"%s\" has an empty name, a blank, a colon, CR or LF",
                         name);
    if (req->extra_len + nl + vl + 4 > EXTRA_HEADER_BYTES)
        return td_errorf(TD_ERR_RANGE, "http: response headers over %d bytes", EXTRA_HEADER_BYTES);
    if (!req->extra && !(req->extra = malloc(EXTRA_HEADER_BYTES)))
        return td_errorf(TD_ERR_NOMEM, "http: out of memory");
    req->extra_len += (size_t)sprintf(req->extra + req->extra_len, "%s: %s\r\n", name, value);
    return TD_OK;
}

/* The handler is done with req: it is freed; the connection goes on once its bytes are
 * written (the next request, or the close). The caller relists and rearms c after its
 * last write. */
static void req_finish(td_http_req_t *req)
{
    http_conn_t *c = req->conn;
    c->req = NULL;
    req_free(req);
    c->answered = true;
}

/* After the handler's last piece of an answer was queued. */
static void conn_answer_queued(http_conn_t *c)
{
    if (c->closing)
        return;
    if (c->queued == 0) { /* nothing to wait for: only the close (see td_http_stream_begin) */
        TD_ASSERT(c->close_after);
        conn_close(c, CLOSE_NONE);
        return;
    }
    conn_relist(c);
    conn_arm_timer(c);
}

void td_http_respond(td_http_req_t *req, int status, const char *content_type, const char *body,
                     size_t len)
{
    if (req->state == REQ_ABORTED) /* from inside on_abort: nothing to answer */
        return;
    TD_ASSERT(req->state == REQ_HANDLED);
    http_conn_t *c = req->conn;
    if (c->closing) {
        req_finish(req);
        return;
    }
    size_t blen = req->head_method ? 0 : len;
    char *out = conn_reserve(c, HEAD_BYTES + req->extra_len + blen);
    if (!out) {
        td_warn("%s connection: out of memory for a %zu-byte answer, closing", c->srv->cfg.name, len);
        conn_close(c, CLOSE_NONE);
        req_finish(req);
        return;
    }
    bool keep = req->keep_alive && !c->srv->closing;
    size_t n = format_head(out, status, content_type, (long long)len, keep, req->extra ? req->extra : "",
                           req->extra_len);
    if (blen)
        memcpy(out + n, body, blen);
    conn_commit(c, n + blen);
    c->close_after = !keep;
    req_finish(req);
    conn_answer_queued(c);
}

td_status_t td_http_stream_begin(td_http_req_t *req, int status, const char *content_type)
{
    if (req->state != REQ_HANDLED)
        return td_errorf_quiet(TD_ERR_INVALID, "http: stream begun on a request already answering");
    http_conn_t *c = req->conn;
    if (c->closing)
        return td_errorf_quiet(TD_ERR_CLOSED, "http: the client is gone");
    char *out = conn_reserve(c, HEAD_BYTES + req->extra_len);
    if (!out)
        return td_errorf(TD_ERR_NOMEM, "http: out of memory");
    /* HTTP/1.0 has no chunks: the body runs to the close; a HEAD's stream (no body, so
     * no last chunk) ends with one too */
    bool keep = req->keep_alive && !req->http10 && !req->head_method && !c->srv->closing;
    conn_commit(c, format_head(out, status, content_type, req->http10 ? -2 : -1, keep,
                               req->extra ? req->extra : "", req->extra_len));
    c->close_after = !keep;
    req->state = REQ_STREAMING;
    conn_arm_timer(c);
    return TD_OK;
}

/* A chunked body's size line ("%zx\r\n") into out, its length returned: every SSE chunk
 * writes one, and sprintf cost a tenth of the router's CPU per relayed token. */
static size_t chunk_size_line(char *out, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    int digits = 1;
    while (digits < 16 && (len >> (4 * digits)))
        digits++;
    for (int d = 0; d < digits; d++)
        out[d] = hex[(len >> (4 * (digits - 1 - d))) & 15];
    out[digits] = '\r';
    out[digits + 1] = '\n';
    return (size_t)digits + 2;
}

td_status_t td_http_stream_write(td_http_req_t *req, const char *data, size_t len)
{
    if (req->state != REQ_STREAMING)
        return td_errorf_quiet(TD_ERR_INVALID, "http: stream write without a stream begun");
    http_conn_t *c = req->conn;
    if (c->closing)
        return td_errorf_quiet(TD_ERR_CLOSED, "http: the client is gone");
    if (len == 0 || req->head_method)
        return TD_OK;
    if (c->queued > 0 && c->queued + len > c->srv->cfg.max_write_queue_bytes) {
        req->want_writable = true;
        return TD_ERR_BUSY;
    }
    char *out = conn_reserve(c, len + 32);
    if (!out)
        return td_errorf(TD_ERR_NOMEM, "http: out of memory");
    bool was_empty = c->queued == 0;
    size_t n = req->http10 ? 0 : chunk_size_line(out, len);
    memcpy(out + n, data, len);
    n += len;
    if (!req->http10) {
        memcpy(out + n, "\r\n", 2);
        n += 2;
    }
    conn_commit(c, n);
    if (was_empty)
        conn_arm_timer(c); /* the write deadline starts */
    return TD_OK;
}

void td_http_stream_end(td_http_req_t *req)
{
    if (req->state == REQ_ABORTED)
        return;
    TD_ASSERT(req->state == REQ_STREAMING);
    http_conn_t *c = req->conn;
    bool chunked = !req->http10 && !req->head_method;
    req_finish(req);
    if (c->closing)
        return;
    if (chunked) {
        char *out = conn_reserve(c, 5);
        if (!out) {
            conn_close(c, CLOSE_NONE);
            return;
        }
        memcpy(out, "0\r\n\r\n", 5);
        conn_commit(c, 5);
    }
    conn_answer_queued(c);
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
