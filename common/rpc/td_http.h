/*
 * td_http: a tiny HTTP/1.1 server on a libuv loop, for GET /metrics on every process.
 *
 * Requests are read into a bounded per-connection buffer (request line + headers, no
 * bodies beyond a small Content-Length), handed to one synchronous handler callback and
 * answered with Content-Length; keep-alive is honoured (HTTP/1.1 default, "Connection:
 * close" or HTTP/1.0 closes). Garbage gets 400, a request over the size bound 431, a body
 * 413. Deadlines are absolute, never restarted by received bytes, so a client trickling
 * a byte at a time gains nothing: a connection waiting for a request is closed after
 * idle_timeout_ms, a request (head, body and the answer's write) must be done within
 * request_timeout_ms of its first byte. At max_connections the oldest connection not
 * being answered is closed to make room (one that never completed a request first). A
 * bad connection is closed alone; the server keeps serving.
 *
 * Loop thread only. A handle: created with td_http_server_create, closed asynchronously
 * with td_http_server_close, whose callback runs once every connection is gone.
 */
#ifndef TD_HTTP_H
#define TD_HTTP_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_metrics.h"
#include "td_status.h"

typedef struct td_http_server td_http_server_t;

/* What a handler fills in. */
typedef struct td_http_reply {
    int status;               /* HTTP status; 0 = 404 */
    const char *content_type; /* copied at once; NULL = text/plain; charset=utf-8 */
    char *body;               /* malloc'ed, the server frees it; NULL = empty */
    size_t body_len;
} td_http_reply_t;

/* Answers one request on the loop thread. `method` and `path` (with any query) are valid
 * during the call. */
typedef void (*td_http_handler_cb)(void *data, const char *method, const char *path,
                                   td_http_reply_t *reply);

typedef struct td_http_config {
    const char *host;           /* "127.0.0.1" */
    uint16_t port;              /* 0 = ephemeral, see td_http_server_port */
    size_t max_request_bytes;   /* request line + headers (+ body); default 8 KiB */
    uint32_t max_connections;   /* at the limit the oldest connection not being answered is
                                 * closed to make room (never-served ones first); a new one
                                 * is closed only if every connection is being answered;
                                 * default 64 */
    uint32_t idle_timeout_ms;   /* accept or last answer → next request's first byte;
                                 * default 30000 */
    uint32_t request_timeout_ms; /* a request's first byte → its answer written, absolute:
                                 * a trickle cannot extend it; default 10000 */
    td_metrics_t *metrics;      /* optional: counts tandem_http_server_connections_closed_total
                                 * {reason} */
    td_http_handler_cb handler;
    void *handler_data;
} td_http_config_t;

/* Defaults for every field but handler/handler_data. */
td_http_config_t td_http_config_default(void);

/*
 * Binds and listens. Errors (callback never called, nothing left open once the loop runs
 * the pending closes): TD_ERR_INVALID (bad host, no handler), TD_ERR_IO (bind/listen
 * failed, with the libuv message), TD_ERR_NOMEM.
 */
td_status_t td_http_server_create(uv_loop_t *loop, const td_http_config_t *cfg,
                                  td_http_server_t **srv_p);

/* The bound port (the ephemeral one when cfg.port was 0). */
uint16_t td_http_server_port(const td_http_server_t *srv);

/* Stops listening, closes every connection and frees the server; `cb` (may be NULL) runs
 * on the loop when all handles are closed. NULL srv is a no-op. */
void td_http_server_close(td_http_server_t *srv, void (*cb)(void *data), void *data);

/* A handler serving `GET /metrics` from the td_metrics_t* passed as data: 200 with the
 * rendering, 405 for other methods on /metrics, 404 elsewhere, 500 when rendering fails. */
void td_http_metrics_handler(void *data, const char *method, const char *path,
                             td_http_reply_t *reply);

#endif /* TD_HTTP_H */
