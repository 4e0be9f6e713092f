/*
 * td_http_client: the one HTTP/1.1 client of the tree: the load generator's (common/loadgen:
 * `bench serve --openai`, `plan profile --openai`), `bench router --http`'s, and a blocking
 * GET (td_http_client_get) for the tools that read a node's /metrics (`tandem plan`).
 * One keep-alive connection (libuv TCP, libhttp-parser, as the server td_http) carries one
 * request at a time: the caller sends the request's bytes, gets each Server-Sent Event of a
 * 200 answer as it is read (or, with td_http_client_keep_body, the whole body), then the
 * answer's end. HTTP has no multiplexing, so a load generator opens one of these per request
 * it keeps in flight.
 *
 * libuv style: the loop's thread only; the connection lives until its on_close; a request
 * ends with exactly one on_done (the answer's end, or the connection lost with it in flight,
 * status 0). on_done runs after the parser has returned, so it may send the next request on
 * the same connection. Errors of the peer are statuses passed to on_done, never aborts.
 * Deadlines are the caller's (a timer that closes the connection ends the request).
 */
#ifndef TD_HTTP_CLIENT_H
#define TD_HTTP_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_status.h"

/* An http://HOST[:PORT][/PATH] URL, split. */
typedef struct td_http_url {
    char host[256];
    uint16_t port;            /* 80 when the URL has none */
    char path[256];           /* from the first '/', or "" when the URL has none */
} td_http_url_t;

/*
 * Splits `url` into *u_p. TD_ERR_INVALID naming `flag` (the option it came from) and the URL
 * when it is not http:// (https is not supported), has no host, a bad port or a path over 250
 * bytes.
 */
td_status_t td_http_url_parse(const char *url, const char *flag, td_http_url_t *u_p);

/*
 * GET `url` on a connection of its own and a loop of its own (blocking the calling thread, at
 * most timeout_ms from the start), `default_path` when the URL has none. A 200 answer's body,
 * NUL-terminated, is the caller's in *body_p (at most 64 MiB). Errors naming `flag` and the
 * URL: TD_ERR_INVALID (not a URL), TD_ERR_UNAVAILABLE (not resolved, refused, lost, no answer
 * in time, or an answer other than 200: its status and first bytes), TD_ERR_NOMEM.
 */
td_status_t td_http_client_get(const char *url, const char *flag, const char *default_path, uint32_t timeout_ms,
                               char **body_p);

typedef struct td_http_client td_http_client_t;

typedef struct td_http_client_ops {
    /* One SSE event of a 200 answer: its lines without the blank line that ends it,
     * NUL-terminated (an event past 64 KiB is cut there); now: td_now_ns() of the read that
     * completed it (events of one read share it). May be NULL. */
    void (*on_event)(td_http_client_t *c, const char *event, size_t len, uint64_t now);
    /* The request ended: status is the answer's (its body's first 64 KiB in body when it is
     * not 200), or 0 when the connection was lost first (body: why). keep_alive false: the
     * connection closes after this returns; true: it is idle and may take the next request
     * from here. Required. */
    void (*on_done)(td_http_client_t *c, unsigned status, const char *body, size_t len, bool keep_alive);
    /* The connection is gone (after the on_done of a request in flight); the handle is freed
     * when this returns. May be NULL. */
    void (*on_close)(td_http_client_t *c);
} td_http_client_ops_t;

/* Starts connecting to addr; the connection is usable at once (a request sent before the
 * connection is up waits for it). Errors: TD_ERR_NOMEM, TD_ERR_IO (uv_tcp_connect refused
 * it at once), with nothing to close. */
td_status_t td_http_client_open(uv_loop_t *loop, const struct sockaddr *addr, const td_http_client_ops_t *ops, void *data,
                                 td_http_client_t **c_p);

/* From the next request on, a 200 answer's body is kept whole (at most max_bytes: past that the
 * request ends with status 0, "answer over N bytes") and handed to on_done, not read as SSE
 * events. */
void td_http_client_keep_body(td_http_client_t *c, size_t max_bytes);

/* Sends a request: `len` bytes at `req`, borrowed until its on_done (the caller keeps them).
 * The connection must be idle (no request in flight). A failure to write ends the request
 * through on_done (status 0) and closes the connection. */
void td_http_client_send(td_http_client_t *c, const char *req, size_t len);

/* Closes the connection: the request in flight, if any, ends with on_done (status 0, "closed"),
 * then on_close runs from the loop. Idempotent. NULL is a no-op. */
void td_http_client_close(td_http_client_t *c);

void *td_http_client_data(const td_http_client_t *c);
bool td_http_client_busy(const td_http_client_t *c);  /* a request in flight */

#endif /* TD_HTTP_CLIENT_H */
