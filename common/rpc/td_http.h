/*
 * td_http: the HTTP/1.1 server on a libuv loop: GET /metrics on every process, and the
 * router's OpenAI-compatible front door.
 *
 * Parsing is Debian's libhttp-parser (2.9, nodejs/http-parser: `libhttp-parser-dev`), a
 * callback parser that takes whatever bytes arrived and keeps its state in a 32-byte
 * struct, so it runs inside our own libuv read callbacks with no threads, sockets or loop
 * of its own. libmicrohttpd, the other maintained choice, owns the sockets: its own threads,
 * or an fd-set loop we would have to drive beside libuv and bridge back to it. What the
 * parser does not do is ours, here: the bounds, the deadlines, the connection cap, writing
 * responses and streams.
 *
 * A request: its line and headers are copied into a bound of max_request_bytes (431 past
 * it), its body (Content-Length or chunked) into a buffer that grows as bytes arrive up to
 * max_body_bytes (413 as soon as the declared length or the bytes so far pass it, before
 * buffering more; the connection closes after). Garbage gets 400, an unknown Expect 417,
 * CONNECT and upgrades 501; each of those closes the connection. `Expect: 100-continue`
 * is answered with 100 Continue once the head is accepted (413 instead when the declared
 * body is over the bound, so the client never sends it).
 *
 * A server may decide a request on its head alone (on_head: an API key, a route), before
 * any of its body is read or buffered; a request it answers there has its body dropped
 * unread and its connection closed. Bodies buffered across all connections count against
 * an optional budget the servers of a loop share (body_budget: 503 past it).
 *
 * The handler is called once the whole request is in, and may answer then or later, from
 * any callback on the loop: td_http_respond (a whole answer with Content-Length), or a
 * stream (td_http_stream_begin / _write / _end: chunked transfer encoding; SSE is
 * content_type "text/event-stream"). One request per connection is handled at a time:
 * pipelined requests wait, unparsed, in a bounded input buffer (reading pauses when it is
 * full) and are answered in order. Keep-alive is HTTP/1.1's default; HTTP/1.0 or
 * "Connection: close" closes after the answer (an HTTP/1.0 stream is sent unchunked and
 * ended by the close).
 *
 * Writing: answers and chunks are copied into the connection's output and written once per
 * loop iteration (one system call for all of a connection's pieces of that iteration), so a
 * td_http_* call never writes to the socket itself. Backpressure: bytes not yet written
 * count against the connection's max_write_queue_bytes; td_http_stream_write refuses
 * (TD_ERR_BUSY, nothing queued) past it, and the request's on_writable callback runs once
 * the queue has drained to half the bound.
 *
 * Abort: when the connection goes before a handled request is answered (the client closed,
 * half-closed or reset it, a write failed, a deadline passed, the server closes), the request's
 * on_abort runs exactly once, from a loop callback (never from inside a td_http_* call the
 * handler made), and the request is freed when it returns. A handler that answers later
 * than its own call must set on_abort before it returns; calls on a request whose connection
 * is closing (before on_abort has run) fail with TD_ERR_CLOSED or do nothing.
 *
 * Deadlines are absolute, never restarted by received bytes, so a client trickling a byte
 * at a time gains nothing: a connection waiting for a request is closed idle_timeout_ms
 * after its accept or its last answer; a request must be read whole within body_timeout_ms
 * of its first byte (408, then the close) and answered (td_http_respond or
 * td_http_stream_begin) within request_timeout_ms of it; bytes queued for a
 * client that reads none of them for request_timeout_ms close the connection (a stream
 * otherwise lives as long as its handler keeps it: the caller's deadlines bound it). A
 * connection closed with nothing handled or queued (idle, slowloris, an error answer) is
 * shut gently: FIN, then what the client still sends is dropped until it closes, at most
 * 2 s, so it reads the end (or the 413) rather than a reset.
 *
 * Connection cap: at max_connections the oldest connection with no request being handled
 * and nothing being written is closed to make room (one that never completed a request
 * first, then the one idle longest), in O(1); a new one is refused only if every connection
 * is busy. Work on the loop is parsing what arrived, copying it into the bounds and
 * constant work per event; nothing scans connections or buffers.
 *
 * Loop thread only. A server: created with td_http_server_create, closed asynchronously
 * with td_http_server_close, whose callback runs once every connection is gone.
 */
#ifndef TD_HTTP_H
#define TD_HTTP_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_metrics.h"
#include "td_rpc_budget.h"
#include "td_status.h"

typedef struct td_http_server td_http_server_t;
typedef struct td_http_req td_http_req_t; /* one request; valid until answered or aborted */

/* Handles one request whose head and body are in, on the loop thread. It answers now or
 * later (td_http_respond, or a stream); answering later, it sets on_abort first. The body
 * is freed when the handler returns (copy what is kept): a streamed answer never holds it. */
typedef void (*td_http_handler_cb)(void *data, td_http_req_t *req);

/* Decides a request on its head alone, when its headers are complete and before a byte of
 * its body is read (an API key, a route): it answers with td_http_respond, or returns
 * without answering and the body is read and the handler called. A request answered here
 * with a body still to come never has it read: the answer says "Connection: close", what
 * the client still sends is dropped, and the connection closes once the answer is out (at
 * most 2 s later), so an unauthenticated 8 MiB body costs no memory and little reading.
 * Without a body, the connection stays open as after any answer. */
typedef void (*td_http_head_cb)(void *data, td_http_req_t *req);

/* A request's callbacks: `data` is what td_http_req_set_data stored (NULL by default). */
typedef void (*td_http_req_cb)(td_http_req_t *req, void *data);

typedef struct td_http_config {
    const char *name;            /* in logs and bind errors; default "http" */
    const char *host;            /* "127.0.0.1" */
    uint16_t port;               /* 0 = ephemeral, see td_http_server_port */
    size_t max_request_bytes;    /* request line + headers (431 past it); default 8 KiB */
    size_t max_body_bytes;       /* a request's body, after dechunking (413 past it);
                                  * default 64 KiB */
    size_t max_write_queue_bytes; /* a connection's bytes queued to the socket before
                                  * td_http_stream_write says TD_ERR_BUSY; default 256 KiB */
    uint32_t max_connections;    /* see "Connection cap" above; default 64 */
    uint32_t idle_timeout_ms;    /* accept or last answer -> next request's first byte;
                                  * default 30000 */
    uint32_t request_timeout_ms; /* a request's first byte -> answered, absolute; also how
                                  * long queued bytes may sit unread; default 10000 */
    uint32_t body_timeout_ms;    /* a request's first byte -> its whole message (head and
                                  * body) in, absolute: 408 and the connection closes; much
                                  * shorter than request_timeout_ms, so a client trickling a
                                  * body holds its buffer briefly; default 10000 (never above
                                  * request_timeout_ms) */
    td_rpc_budget_t *body_budget; /* optional, shared with other servers of the loop: the
                                  * bytes of request bodies held across all connections
                                  * (a declared Content-Length is taken when the head is
                                  * accepted, a chunked body as it grows); past it 503 and
                                  * the connection closes. NULL: only max_body_bytes each */
    td_metrics_t *metrics;       /* optional: counts connections closed, by reason */
    const char *metrics_name;    /* that counter's name (two servers on one registry share
                                  * it unless named apart); default
                                  * tandem_http_server_connections_closed_total,
                                  * label reason: request_timeout, idle_timeout,
                                  * write_timeout, evicted, refused */
    td_http_handler_cb handler;
    void *handler_data;
    td_http_head_cb on_head;     /* optional, called with handler_data (above) */
    /* Optional: the body of an error answer the server decides itself (400 for garbage,
     * 413, 414, 417, 431, 501, 505), so that an API answers those in its own error shape:
     * writes at most cap bytes into out and returns their count (0 = the plain-text
     * default), setting *content_type to a static string. Called with handler_data. */
    size_t (*error_body)(void *data, int status, const char *message, char *out, size_t cap,
                         const char **content_type);
} td_http_config_t;

/* Defaults for every field but handler/handler_data. */
td_http_config_t td_http_config_default(void);

/*
 * Binds and listens. Errors (callback never called, nothing left open once the loop runs
 * the pending closes): TD_ERR_INVALID (bad host, no handler, a bound below 64 bytes),
 * TD_ERR_IO (bind/listen failed, with the libuv message), TD_ERR_NOMEM, or the metrics
 * registry's error (a counter of that name exists).
 */
td_status_t td_http_server_create(uv_loop_t *loop, const td_http_config_t *cfg,
                                  td_http_server_t **srv_p);

/* The bound port (the ephemeral one when cfg.port was 0). */
uint16_t td_http_server_port(const td_http_server_t *srv);

/* Stops listening and closes every connection (handled requests get on_abort) and frees
 * the server; `cb` (may be NULL) runs on the loop when all handles are closed. NULL srv is
 * a no-op. */
void td_http_server_close(td_http_server_t *srv, void (*cb)(void *data), void *data);

/* ---- a request: what came ----------------------------------------------------------- */

/* "GET", "POST", ... */
const char *td_http_req_method(const td_http_req_t *req);
/* The target up to '?' as sent (not percent-decoded); an absolute URI stays whole. */
const char *td_http_req_path(const td_http_req_t *req);
/* After '?' ("" when none). */
const char *td_http_req_query(const td_http_req_t *req);
/* The first header named `name` (case-insensitive), leading and trailing blanks dropped;
 * NULL when absent. */
const char *td_http_req_header(const td_http_req_t *req, const char *name);
/* The body (dechunked) and its length; "" and 0 when none (and in on_head). Valid until the
 * handler returns. */
const char *td_http_req_body(const td_http_req_t *req, size_t *len_p);
/* Takes the body away from the request, for a handler that reads it after it returns (on
 * another thread): the malloc'ed buffer (the caller frees it; NULL when there is none) and
 * its length, and in *charged_p the bytes it holds of cfg.body_budget, which the caller
 * gives back (td_rpc_budget_give, on the loop thread) when it frees the buffer, so the
 * bound of bodies in flight still counts it. The request has no body afterwards. */
char *td_http_req_take_body(td_http_req_t *req, size_t *len_p, size_t *charged_p);

/* The handler's pointer for the callbacks below. */
void td_http_req_set_data(td_http_req_t *req, void *data);
void *td_http_req_data(const td_http_req_t *req);
/* Called once if the connection goes before the request is answered (see "Abort"); the
 * handler must not use req after it returns. */
void td_http_req_on_abort(td_http_req_t *req, td_http_req_cb cb);
/* Called after td_http_stream_write said TD_ERR_BUSY, once the queue is at half the bound. */
void td_http_req_on_writable(td_http_req_t *req, td_http_req_cb cb);
/* Bytes of this connection queued to the socket, not yet written. */
size_t td_http_req_queued_bytes(const td_http_req_t *req);

/* ---- a request: the answer ---------------------------------------------------------- */

/* Adds a response header (before td_http_respond or td_http_stream_begin), both copied.
 * TD_ERR_INVALID for a name or value with CR, LF or NUL (or a name with ':' or blanks),
 * TD_ERR_RANGE past 4 KiB of added headers, TD_ERR_CLOSED once answered. Content-Type,
 * Content-Length, Transfer-Encoding and Connection are the server's. */
td_status_t td_http_resp_header(td_http_req_t *req, const char *name, const char *value);

/* Answers with `status` and a copy of body[0..len) (Content-Length); content_type NULL =
 * "text/plain; charset=utf-8". The handler is done with req when it returns (whatever the
 * connection's state: a closing connection drops the answer and on_abort is not called). */
void td_http_respond(td_http_req_t *req, int status, const char *content_type, const char *body,
                     size_t len);

/* Starts a streamed answer (chunked; content_type NULL as above). TD_ERR_CLOSED when the
 * connection is closing (on_abort follows), TD_ERR_INVALID when already answered. */
td_status_t td_http_stream_begin(td_http_req_t *req, int status, const char *content_type);

/* Queues a copy of data[0..len) as one chunk (len 0 does nothing). TD_ERR_BUSY when the
 * connection already has max_write_queue_bytes queued: nothing queued, on_writable follows;
 * TD_ERR_CLOSED when the connection is closing (on_abort follows); TD_ERR_INVALID when no
 * stream was begun. A write of more than the bound is taken while the queue is empty. */
td_status_t td_http_stream_write(td_http_req_t *req, const char *data, size_t len);

/* Ends the stream (the last chunk); the handler is done with req when it returns. */
void td_http_stream_end(td_http_req_t *req);

/* The reason phrase of an HTTP status ("Not Found"; "Status" for one it does not know). */
const char *td_http_status_text(int status);

/* A handler serving `GET /metrics` (and HEAD) from the td_metrics_t* passed as data: 200
 * with the rendering, 405 for other methods on /metrics, 404 elsewhere, 500 when rendering
 * fails. Answers at once. */
void td_http_metrics_handler(void *data, td_http_req_t *req);

#endif /* TD_HTTP_H */
