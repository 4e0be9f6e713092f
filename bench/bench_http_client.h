/*
 * bench_http_client: the load generators' HTTP/1.1 client (`bench router --http`,
 * `bench serve --openai`). One keep-alive connection (libuv TCP, libhttp-parser) carries one
 * request at a time: the caller sends the request's bytes, gets each Server-Sent Event of a
 * 200 answer as it is read, then the answer's end. HTTP has no multiplexing, so a load
 * generator opens one of these per request it keeps in flight.
 *
 * libuv style: the loop's thread only; the connection lives until its on_close; a request
 * ends with exactly one on_done (the answer's end, or the connection lost with it in flight,
 * status 0). on_done runs after the parser has returned, so it may send the next request on
 * the same connection. Errors of the peer are statuses passed to on_done, never aborts.
 */
#ifndef TD_BENCH_HTTP_CLIENT_H
#define TD_BENCH_HTTP_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_status.h"

typedef struct bench_http_conn bench_http_conn_t;

typedef struct bench_http_ops {
    /* One SSE event of a 200 answer: its lines without the blank line that ends it,
     * NUL-terminated (an event past 64 KiB is cut there); now: td_now_ns() of the read that
     * completed it (events of one read share it). May be NULL. */
    void (*on_event)(bench_http_conn_t *c, const char *event, size_t len, uint64_t now);
    /* The request ended: status is the answer's (its body's first 64 KiB in body when it is
     * not 200), or 0 when the connection was lost first (body: why). keep_alive false: the
     * connection closes after this returns; true: it is idle and may take the next request
     * from here. Required. */
    void (*on_done)(bench_http_conn_t *c, unsigned status, const char *body, size_t len, bool keep_alive);
    /* The connection is gone (after the on_done of a request in flight); the handle is freed
     * when this returns. May be NULL. */
    void (*on_close)(bench_http_conn_t *c);
} bench_http_ops_t;

/* Starts connecting to addr; the connection is usable at once (a request sent before the
 * connection is up waits for it). Errors: TD_ERR_NOMEM, TD_ERR_IO (uv_tcp_connect refused
 * it at once), with nothing to close. */
td_status_t bench_http_conn_open(uv_loop_t *loop, const struct sockaddr *addr, const bench_http_ops_t *ops, void *data,
                                 bench_http_conn_t **c_p);

/* Sends a request: `len` bytes at `req`, borrowed until its on_done (the caller keeps them).
 * The connection must be idle (no request in flight). A failure to write ends the request
 * through on_done (status 0) and closes the connection. */
void bench_http_conn_send(bench_http_conn_t *c, const char *req, size_t len);

/* Closes the connection: the request in flight, if any, ends with on_done (status 0, "closed"),
 * then on_close runs from the loop. Idempotent. NULL is a no-op. */
void bench_http_conn_close(bench_http_conn_t *c);

void *bench_http_conn_data(const bench_http_conn_t *c);
bool bench_http_conn_busy(const bench_http_conn_t *c);  /* a request in flight */

#endif /* TD_BENCH_HTTP_CLIENT_H */
