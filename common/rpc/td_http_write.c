/*
 * td_http_write: a connection's output. Answers, stream chunks and the server's own error
 * answers are copied into the connection's chain of output blocks and written once per
 * loop iteration; when an answer's last byte is written the connection goes on to its next
 * request (or closes). The answering API of td_http.h: td_http_resp_header,
 * td_http_respond and the stream.
 */
#include "td_http.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_http_impl.h"
#include "td_list.h"
#include "td_log.h"
#include "td_util.h"

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

void td_http_conn_free_blocks(http_conn_t *c)
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

char *td_http_conn_reserve(http_conn_t *c, size_t len)
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

void td_http_conn_commit(http_conn_t *c, size_t used)
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
        td_http_conn_free_blocks(c);
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

/* The current answer is written: the connection waits for its next request (or closes). */
static void conn_answer_written(http_conn_t *c)
{
    c->answered = false;
    c->served = true;
    c->since = uv_now(c->srv->loop);
    if (c->eof) {
        td_http_conn_close(c, CLOSE_NONE);
        return;
    }
    if (c->discard && !c->srv->closing) {
        td_http_conn_linger(c);
        return;
    }
    if (c->close_after || c->srv->closing) {
        td_http_conn_close(c, CLOSE_NONE);
        return;
    }
    td_http_conn_relist(c);
    td_http_conn_arm_timer(c);
    td_http_conn_resume(c);
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
    td_http_conn_relist(c);
    td_http_conn_arm_timer(c);
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
            td_http_conn_close(c, CLOSE_NONE);
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
                td_http_conn_close(c, CLOSE_NONE);
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
        td_http_conn_close(c, CLOSE_NONE);
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

void td_http_conn_fail(http_conn_t *c, int status, const char *msg)
{
    if (c->closing)
        return;
    if (c->req) { /* never handed to the handler: errors come only while reading */
        TD_ASSERT(c->req->state == REQ_READING);
        td_http_req_free(c->req);
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
    char *out = td_http_conn_reserve(c, HEAD_BYTES + blen);
    if (!out) {
        td_http_conn_close(c, CLOSE_NONE);
        return;
    }
    size_t n = format_head(out, status, ctype, (long long)blen, false, "", 0);
    memcpy(out + n, body, blen);
    td_http_conn_commit(c, n + blen);
    c->answered = true;
    c->close_after = true;
    td_http_conn_relist(c);
    td_http_conn_arm_timer(c);
    td_http_conn_read_start(c); /* had it stopped for a full input buffer */
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
    td_http_req_free(req);
    c->answered = true;
}

/* After the handler's last piece of an answer was queued. */
static void conn_answer_queued(http_conn_t *c)
{
    if (c->closing)
        return;
    if (c->queued == 0) { /* nothing to wait for: only the close (see td_http_stream_begin) */
        TD_ASSERT(c->close_after);
        td_http_conn_close(c, CLOSE_NONE);
        return;
    }
    td_http_conn_relist(c);
    td_http_conn_arm_timer(c);
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
    char *out = td_http_conn_reserve(c, HEAD_BYTES + req->extra_len + blen);
    if (!out) {
        td_warn("%s connection: out of memory for a %zu-byte answer, closing", c->srv->cfg.name, len);
        td_http_conn_close(c, CLOSE_NONE);
        req_finish(req);
        return;
    }
    bool keep = req->keep_alive && !c->srv->closing;
    size_t n = format_head(out, status, content_type, (long long)len, keep, req->extra ? req->extra : "",
                           req->extra_len);
    if (blen)
        memcpy(out + n, body, blen);
    td_http_conn_commit(c, n + blen);
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
    char *out = td_http_conn_reserve(c, HEAD_BYTES + req->extra_len);
    if (!out)
        return td_errorf(TD_ERR_NOMEM, "http: out of memory");
    /* HTTP/1.0 has no chunks: the body runs to the close; a HEAD's stream (no body, so
     * no last chunk) ends with one too */
    bool keep = req->keep_alive && !req->http10 && !req->head_method && !c->srv->closing;
    td_http_conn_commit(c, format_head(out, status, content_type, req->http10 ? -2 : -1, keep,
                               req->extra ? req->extra : "", req->extra_len));
    c->close_after = !keep;
    req->state = REQ_STREAMING;
    td_http_conn_arm_timer(c);
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
    char *out = td_http_conn_reserve(c, len + 32);
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
    td_http_conn_commit(c, n);
    if (was_empty)
        td_http_conn_arm_timer(c); /* the write deadline starts */
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
        char *out = td_http_conn_reserve(c, 5);
        if (!out) {
            td_http_conn_close(c, CLOSE_NONE);
            return;
        }
        memcpy(out, "0\r\n\r\n", 5);
        td_http_conn_commit(c, 5);
    }
    conn_answer_queued(c);
}
