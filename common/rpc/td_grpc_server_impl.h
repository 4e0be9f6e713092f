/*
 * td_grpc_server_impl: the inside of the gRPC server, shared by the files that make up
 * td_grpc_server (td_grpc_server.c: connections, their deadlines and eviction, the server;
 * td_grpc_server_call.c: calls, their deadlines, sending and the nghttp2 stream callbacks).
 * Not for use outside common/rpc/td_grpc_server*.c.
 */
#ifndef TD_GRPC_SERVER_IMPL_H
#define TD_GRPC_SERVER_IMPL_H

#include <nghttp2/nghttp2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_grpc.h"
#include "td_grpc_wire.h"
#include "td_list.h"
#include "td_metrics.h"
#include "td_util.h"

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
    uint32_t n_unpacking;          /* calls' requests on the thread pool (max_unpacking) */
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
    size_t charged;                /* bytes taken from cfg.body_budget for req */
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
    bool unpacking;                /* its request is being unpacked on the thread pool: the
                                    * call is not freed until that ends */
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

/* Frees the server once it is closing and its last handle and call are gone; its close
 * callback runs then (td_grpc_server.c). */
void td_grpc_server_maybe_free(td_grpc_server_t *srv);

/* The method registered for path, or NULL (td_grpc_server.c). */
const method_t *td_grpc_server_find_method(const td_grpc_server_t *srv, const char *path);

/* Sets a connection's nghttp2 session callbacks: calls begun, gathered, dispatched and
 * closed (td_grpc_server_call.c). The session's user data is the srv_conn_t. */
void td_grpc_server_set_callbacks(nghttp2_session_callbacks *cbs);

/* The stream is gone (closed, reset, connection lost): detaches the call from its
 * connection and tells the handler (on_cancel, with why) if it still runs
 * (td_grpc_server_call.c). */
void td_grpc_call_detach(td_grpc_call_t *call, td_status_t why);

#endif
