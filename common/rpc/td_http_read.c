/*
 * td_http_read: a connection's input. Bytes read go straight through libhttp-parser (from
 * the one read buffer the server shares), whose callbacks copy a request's line and headers
 * into its bounded head and its body into a buffer that grows to max_body_bytes; a whole
 * request pauses the parser and goes to the handler, and what arrives meanwhile waits in the
 * connection's own input buffer (td_http_impl.h).
 */
#include "td_http.h"

#include <http_parser.h>
#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "td_http_impl.h"
#include "td_log.h"
#include "td_util.h"

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
    td_http_conn_arm_timer(c);
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

/* Gives the request to cfg.on_head (state HANDLED while it runs, so that it may answer).
 * true: not answered, reading goes on. false: answered; with a body to come the connection
 * reads no more (discard: what arrives is dropped, then the gentle close), without one
 * on_message_complete pauses the parser until the answer is written, as after a handled
 * request. */
static bool head_decide(http_conn_t *c, bool has_body)
{
    td_http_req_t *req = c->req;
    bool keep = req->keep_alive;
    if (has_body)
        req->keep_alive = false; /* answered now, the body is never read: the connection ends */
    req->state = REQ_HANDLED;
    c->srv->cfg.on_head(c->srv->cfg.handler_data, req);
    if (c->req == req) { /* not answered (td_http_respond frees req) */
        req->state = REQ_READING;
        req->keep_alive = keep;
        return true;
    }
    if (has_body) {
        c->discard = true;
        c->in_off = c->in_len = 0;
    } /* else on_message_complete, next, pauses the parser */
    return false;
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
    if (cfg->on_head && !head_decide(c, chunked || declared > 0))
        return c->discard ? -1 : 0; /* answered: a body is dropped unread (conn_parse) */
    /* bodies in flight across all connections: a declared one is taken whole now, so a
     * client is refused before it sends it; a chunked one as it grows (on_body) */
    if (declared && !td_rpc_budget_take(cfg->body_budget, (size_t)declared)) {
        c->err_status = 503;
        return -1;
    }
    req->declared = req->charged = (size_t)declared;
    const char *expect = td_http_req_header(req, "expect");
    if (expect) {
        if (strcasecmp(expect, "100-continue") != 0 || req->http10) {
            c->err_status = 417;
            return -1;
        }
        if (chunked || declared > 0) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            char *out = td_http_conn_reserve(c, sizeof cont - 1);
            if (!out) {
                c->err_status = 503;
                return -1;
            }
            memcpy(out, cont, sizeof cont - 1);
            td_http_conn_commit(c, sizeof cont - 1);
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
        if (req->declared && cap > req->declared)
            cap = req->declared; /* the parser stops a body at its Content-Length */
        if (cap > req->charged) { /* a chunked body: taken as it grows */
            if (!td_rpc_budget_take(c->srv->cfg.body_budget, cap - req->charged)) {
                c->err_status = 503;
                return -1;
            }
            req->charged = cap;
        }
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
    if (!c->req) { /* answered on its head, no body (head_decide): the next request waits
                    * until that answer is written */
        http_parser_pause(p, 1);
        return 0;
    }
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
    case 503: return c->srv->cfg.body_budget && c->srv->cfg.body_budget->refused != c->budget_refused
                  ? "the server holds too many request bodies at once (its budget for bodies in flight): "
                    "retry shortly"
                  : "out of memory";
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
    c->budget_refused = srv->cfg.body_budget ? srv->cfg.body_budget->refused : 0;
    size_t n = http_parser_execute(&c->parser, &srv->settings, data, len);
    if (c->closing || (c->discard && !c->req))
        return len; /* closing, or answered on its head with its body dropped (head_decide) */
    enum http_errno e = HTTP_PARSER_ERRNO(&c->parser);
    if (e == HPE_PAUSED && !c->req)
        return n; /* answered on its head, no body: the rest waits for that answer */
    if (e == HPE_PAUSED && c->req && c->req->complete) {
        td_http_req_t *req = c->req;
        req->state = REQ_HANDLED;
        if (!req->body) {
            req->body = malloc(1);
            if (!req->body) {
                td_http_conn_fail(c, 503, "out of memory");
                return len;
            }
        }
        req->body[req->body_len] = '\0';
        td_http_conn_relist(c);
        td_http_conn_arm_timer(c);
        srv->cfg.handler(srv->cfg.handler_data, req); /* may answer, and free req */
        if (c->req == req)
            td_http_req_free_body(req); /* the handler copied what it keeps: a long stream
                                         * holds no body against the budget */
        return n;
    }
    if (e != HPE_OK) {
        int status = c->err_status ? c->err_status : e == HPE_HEADER_OVERFLOW ? 431 : 400;
        td_http_conn_fail(c, status, parse_error_text(c, e));
        return len;
    }
    return n;
}

void td_http_settings_init(http_parser_settings *s)
{
    http_parser_settings_init(s);
    s->on_message_begin = on_message_begin;
    s->on_url = on_url;
    s->on_header_field = on_header_field;
    s->on_header_value = on_header_value;
    s->on_headers_complete = on_headers_complete;
    s->on_body = on_body;
    s->on_message_complete = on_message_complete;
}

/* ---- reading ------------------------------------------------------------------------- */

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

static bool conn_paused(const http_conn_t *c)
{
    return HTTP_PARSER_ERRNO(&c->parser) == HPE_PAUSED;
}

void td_http_conn_read_start(http_conn_t *c)
{
    if (c->reading || c->closing || c->eof || c->in_len >= READ_BYTES)
        return;
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) {
        td_http_conn_close(c, CLOSE_NONE);
        return;
    }
    c->reading = true;
}

void td_http_conn_resume(http_conn_t *c)
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
    td_http_conn_read_start(c);
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
            td_http_conn_close(c, CLOSE_NONE);
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
                    td_http_conn_close(c, CLOSE_NONE);
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
