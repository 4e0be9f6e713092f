/*
 * td_grpc: real gRPC (HTTP/2 h2c prior knowledge via nghttp2, on a libuv loop), server and
 * client, unary and server streaming, protobuf-c messages.
 *
 * Wire: the 5-byte length prefix ([u8 compressed=0][u32 BE length][message]),
 * content-type application/grpc, grpc-status / grpc-message (percent-encoded) trailers,
 * grpc-timeout deadlines, cancellation by RST_STREAM, HTTP/2 flow control both ways.
 * Compression is not supported (a compressed message → UNIMPLEMENTED). Every received
 * message is checked against max_message_bytes before anything is allocated for it and is
 * unpacked under a bounded ProtobufCAllocator, so a hostile peer costs one connection,
 * never the process. docs/wire.md has the details.
 *
 * libuv style: handles (td_grpc_server_t, td_grpc_channel_t) live until their close
 * callback; requests (calls) end with exactly one completion; the caller owns what it
 * passes in (messages are packed before the function returns); a function that returns
 * an error never calls its callback. Everything runs on the loop's thread; another thread
 * hands work to the loop with uv_async_send. Writes are batched and flushed once per loop
 * iteration (a uv_prepare hook), so many small messages cost few syscalls.
 *
 * Server call lifetime: the handler receives a td_grpc_call_t with the request; it may
 * answer at once or later from any loop callback, and must end the call exactly once with
 * td_grpc_call_finish (or td_grpc_call_reply). If the stream goes away first (client
 * RST_STREAM, deadline, connection loss, server close), the cancel callback runs once;
 * sends then return TD_ERR_CANCELLED, and the handler still calls td_grpc_call_finish,
 * which frees the call. The request message is valid only during the handler call
 * (protobuf stays at the edge: convert it into your own structs there).
 */
#ifndef TD_GRPC_H
#define TD_GRPC_H

#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_metrics.h"
#include "td_rpc_budget.h"
#include "td_status.h"

/* gRPC status codes (grpc/doc/statuscodes.md). */
#define TD_GRPC_CODE_MAP(X)        \
    X(OK, 0)                       \
    X(CANCELLED, 1)                \
    X(UNKNOWN, 2)                  \
    X(INVALID_ARGUMENT, 3)         \
    X(DEADLINE_EXCEEDED, 4)        \
    X(NOT_FOUND, 5)                \
    X(ALREADY_EXISTS, 6)           \
    X(PERMISSION_DENIED, 7)        \
    X(RESOURCE_EXHAUSTED, 8)       \
    X(FAILED_PRECONDITION, 9)      \
    X(ABORTED, 10)                 \
    X(OUT_OF_RANGE, 11)            \
    X(UNIMPLEMENTED, 12)           \
    X(INTERNAL, 13)                \
    X(UNAVAILABLE, 14)             \
    X(DATA_LOSS, 15)               \
    X(UNAUTHENTICATED, 16)

typedef enum td_grpc_code {
#define TD_GRPC_CODE_ENUM(name, code) TD_GRPC_##name = code,
    TD_GRPC_CODE_MAP(TD_GRPC_CODE_ENUM)
#undef TD_GRPC_CODE_ENUM
} td_grpc_code_t;

/* "DEADLINE_EXCEEDED" etc.; "UNKNOWN" for codes outside the table. Never NULL. */
const char *td_grpc_code_name(td_grpc_code_t code);

/* The gRPC code a handler should end with for a tandem status (TD_ERR_EXHAUSTED →
 * RESOURCE_EXHAUSTED, TD_ERR_TIMEOUT → DEADLINE_EXCEEDED, TD_ERR_INVALID → INVALID_ARGUMENT,
 * TD_ERR_UNAVAILABLE → UNAVAILABLE, ...). */
td_grpc_code_t td_grpc_code_from_status(td_status_t st);

/* ---- server ------------------------------------------------------------------------- */

typedef struct td_grpc_server td_grpc_server_t;
typedef struct td_grpc_call td_grpc_call_t;

/* One metadata entry (an HTTP/2 header): lowercase name, printable ASCII value. */
typedef struct td_grpc_header {
    const char *name;
    const char *value;
} td_grpc_header_t;

/*
 * A server's gate (td_grpc_server_config_t.authenticate): runs once per call when its whole
 * request has arrived, before it is unpacked or the handler runs, with the request bytes
 * (without the gRPC prefix); td_grpc_call_header reads the call's metadata. TD_GRPC_OK lets
 * the call through; any other code ends it with that code and why[] (cap bytes, written by
 * the gate) as grpc-message, and the handler never sees it.
 */
typedef td_grpc_code_t (*td_grpc_auth_cb)(td_grpc_call_t *call, const void *request, size_t len, void *data,
                                          char *why, size_t cap);

/*
 * A gate on the headers alone (td_grpc_server_config_t.authenticate_head): runs once per
 * call at the end of its header block, once its method is known, before a byte of its
 * request is buffered (an API key needs no more). Same contract as td_grpc_auth_cb; a call
 * it refuses is answered at once and whatever else comes for it is dropped unbuffered (not
 * reset with NO_ERROR, RFC 9113 8.1's way to stop a sender: grpcio reads that reset as
 * INTERNAL and loses the status).
 */
typedef td_grpc_code_t (*td_grpc_head_auth_cb)(td_grpc_call_t *call, void *data, char *why, size_t cap);

typedef struct td_grpc_server_config {
    const char *host;                /* listen address, IPv4 or IPv6 literal; "127.0.0.1" */
    uint16_t port;                   /* 0 = ephemeral (td_grpc_server_port) */
    size_t max_message_bytes;        /* each direction; larger → RESOURCE_EXHAUSTED; 4 MiB */
    uint32_t max_concurrent_streams; /* SETTINGS_MAX_CONCURRENT_STREAMS per connection; 100 */
    uint32_t max_header_list_bytes;  /* SETTINGS_MAX_HEADER_LIST_SIZE, enforced; 16 KiB */
    uint32_t initial_window_bytes;   /* receive window per stream and connection; 1 MiB */
    size_t send_queue_bytes;         /* per call: a send beyond this many queued bytes
                                      * returns TD_ERR_BUSY; 256 KiB */
    uint32_t max_connections;        /* at the limit the oldest unproductive connection is
                                      * closed to make room (one that has not finished its
                                      * handshake first, then one that never ran a call, then
                                      * the longest idle); one with a call running (a
                                      * Generate stream) never is: if every connection has
                                      * one, the new one is closed; 1024 */
    uint32_t handshake_timeout_ms;   /* accept → client preface and first SETTINGS, else the
                                      * connection is closed; 10000 */
    uint32_t request_timeout_ms;     /* a stream's HEADERS → its whole request (END_STREAM),
                                      * absolute, so a trickle cannot extend it: the stream is
                                      * reset, and a connection with no call running is
                                      * closed; 30000 */
    uint32_t idle_timeout_ms;        /* no call running for this long (counted from the
                                      * handshake or the end of the last call, never from
                                      * received bytes) → closed; 0 = off, the default: the
                                      * router's channels to its nodes do not reconnect, and
                                      * idle connections make room at the limit anyway */
    td_metrics_t *metrics;           /* optional: counts tandem_grpc_server_handled_total and
                                      * tandem_grpc_server_connections_closed_total{reason} */
    uint32_t max_resets_per_s;       /* RST_STREAMs a client may send per second (and in a
                                      * burst) before its connection gets GOAWAY: nghttp2's
                                      * "rapid reset" guard, whose own default (1000 burst,
                                      * 33/s) cuts off a router relaying cancels or racing
                                      * the end of calls; 0 = nghttp2's; 100000 */
    td_grpc_auth_cb authenticate;    /* optional gate of every method (above); NULL: none */
    td_grpc_head_auth_cb authenticate_head; /* optional gate on the headers (above), before
                                      * authenticate; NULL: none */
    void *auth_data;                 /* both gates' data */
    size_t unpack_off_loop_bytes;    /* a request longer than this is unpacked on libuv's
                                      * thread pool, its handler called from the loop when
                                      * it is done (protobuf-c's unpack of a 4 MiB message of
                                      * tiny sub-messages is ~70 ms; several at once stall
                                      * a loop that carries heartbeats); 0 = every request
                                      * on the loop (the default: members' calls are small) */
    uint32_t max_unpacking;          /* requests being unpacked on the pool at once; beyond
                                      * → RESOURCE_EXHAUSTED ("retry"); 16 */
    td_rpc_budget_t *body_budget;    /* optional, shared with other servers of the loop: the
                                      * request bytes buffered across all connections; a
                                      * message is taken whole when its 5-byte prefix arrives,
                                      * and one past the budget ends RESOURCE_EXHAUSTED before
                                      * it is buffered. NULL: only max_message_bytes a call */
} td_grpc_server_config_t;

td_grpc_server_config_t td_grpc_server_config_default(void);

/* A method handler: `request` is the unpacked request (of the descriptor given at
 * registration), valid during this call only. `data` is the registration's data. */
typedef void (*td_grpc_handler_cb)(td_grpc_call_t *call, const ProtobufCMessage *request,
                                   void *data);

/* The stream ended before the handler finished. `why`: TD_ERR_CANCELLED (client reset
 * the stream or the connection was lost), TD_ERR_TIMEOUT (deadline; the client already
 * got DEADLINE_EXCEEDED) or TD_ERR_CLOSED (server closing). Runs at most once. */
typedef void (*td_grpc_cancel_cb)(td_grpc_call_t *call, td_status_t why, void *call_data);

/* The send queue drained below half of send_queue_bytes after a send returned BUSY. */
typedef void (*td_grpc_writable_cb)(td_grpc_call_t *call, void *call_data);

/*
 * Binds and listens on cfg->host:cfg->port. Errors (nothing to close, except that the
 * loop still has to run once to finish closing the failed listener): TD_ERR_INVALID
 * (bad address or limits), TD_ERR_IO (bind/listen failed: the libuv message, e.g.
 * "address already in use"), TD_ERR_NOMEM.
 */
td_status_t td_grpc_server_create(uv_loop_t *loop, const td_grpc_server_config_t *cfg,
                                  td_grpc_server_t **srv_p);

/* The bound port (the ephemeral one when cfg.port was 0). */
uint16_t td_grpc_server_port(const td_grpc_server_t *srv);

/*
 * Routes `path` ("/package.Service/Method", copied) to `cb`; requests are unpacked as
 * `request_desc`. Unary and server-streaming methods look the same here: one request,
 * then zero or more responses (a unary handler sends exactly one). Unknown paths get
 * UNIMPLEMENTED. Errors: TD_ERR_INVALID (path not of that shape, or already registered),
 * TD_ERR_NOMEM.
 */
td_status_t td_grpc_server_add_method(td_grpc_server_t *srv, const char *path,
                                      const ProtobufCMessageDescriptor *request_desc,
                                      td_grpc_handler_cb cb, void *data);

/* One method of a service: an entry of the table td_grpc_server_add_methods takes. */
typedef struct td_grpc_method {
    const char *path;                              /* "/package.Service/Method" */
    const ProtobufCMessageDescriptor *request_desc;
    td_grpc_handler_cb cb;
} td_grpc_method_t;

/* td_grpc_server_add_method for each of methods[0..n) with the same `data`; stops at the
 * first error (same errors). */
td_status_t td_grpc_server_add_methods(td_grpc_server_t *srv, const td_grpc_method_t *methods, size_t n,
                                       void *data);

/*
 * Stops listening, closes every connection (running each unfinished call's cancel
 * callback with TD_ERR_CLOSED) and frees the server once every call has been finished by
 * its handler and every handle has closed; then `cb` (may be NULL) runs. NULL is a no-op.
 */
void td_grpc_server_close(td_grpc_server_t *srv, void (*cb)(void *data), void *data);

/* Live connections (for tests and metrics). */
uint32_t td_grpc_server_connections(const td_grpc_server_t *srv);

/* Calls whose stream is open and the response bytes they hold queued (for tests and
 * metrics). Loop thread only. */
typedef struct td_grpc_server_stats {
    uint32_t open_calls;
    size_t queued_bytes;
} td_grpc_server_stats_t;

td_grpc_server_stats_t td_grpc_server_stats(const td_grpc_server_t *srv);

/* The full method path of the call, e.g. "/tandem.v1.Generation/Generate". */
const char *td_grpc_call_method(const td_grpc_call_t *call);

/* The address of the peer the call came from (its connection's remote end), for a handler
 * that serves only a known peer. TD_ERR_CLOSED (quiet) once the connection is gone. */
td_status_t td_grpc_call_peer(const td_grpc_call_t *call, struct sockaddr_storage *addr_p);

/* The value of request header `name` (lowercase; the first one when repeated), or NULL.
 * Valid until the call is finished. Kept: the metadata a caller sends (authorization,
 * custom entries); not kept: pseudo-headers (":path") and what td_grpc reads itself or
 * nobody needs (content-type, te, grpc-timeout, grpc-encoding, grpc-accept-encoding,
 * user-agent), so a call without metadata costs no copy. */
const char *td_grpc_call_header(const td_grpc_call_t *call, const char *name);

/* The call's deadline in uv_now() milliseconds of the server's loop, or 0 when the client
 * gave no grpc-timeout. */
uint64_t td_grpc_call_deadline(const td_grpc_call_t *call);

/* Attaches handler state, passed to the cancel and writable callbacks. */
void td_grpc_call_set_data(td_grpc_call_t *call, void *call_data);
void *td_grpc_call_data(const td_grpc_call_t *call);

void td_grpc_call_on_cancel(td_grpc_call_t *call, td_grpc_cancel_cb cb);
void td_grpc_call_on_writable(td_grpc_call_t *call, td_grpc_writable_cb cb);

/* True once the stream ended early (the cancel callback ran or is about to). */
bool td_grpc_call_is_cancelled(const td_grpc_call_t *call);

/* Bytes packed but not yet handed to HTTP/2 (bounded by send_queue_bytes + one message). */
size_t td_grpc_call_queued_bytes(const td_grpc_call_t *call);

/*
 * Packs and queues one response message. TD_OK: queued. TD_ERR_BUSY: not queued, the
 * queue is over send_queue_bytes: wait for the writable callback (registered with
 * td_grpc_call_on_writable) and send again. TD_ERR_CANCELLED: the stream is gone.
 * TD_ERR_RANGE: the message exceeds max_message_bytes. TD_ERR_NOMEM. Never after finish.
 */
td_status_t td_grpc_call_send(td_grpc_call_t *call, const ProtobufCMessage *msg);

/* As td_grpc_call_send, but queued past send_queue_bytes (never TD_ERR_BUSY): for a message
 * that closes one part of a stream and cannot wait for the writable callback (the last
 * message of one choice of several, router_gateway.c); the caller bounds how many it sends. */
td_status_t td_grpc_call_send_last(td_grpc_call_t *call, const ProtobufCMessage *msg);

/*
 * Ends the call: queued messages go out, then trailers with `code` and `message` (may be
 * NULL; percent-encoded on the wire). Exactly once per call; the call is invalid
 * afterwards. After a cancel it only releases the call.
 */
void td_grpc_call_finish(td_grpc_call_t *call, td_grpc_code_t code, const char *message);

/* Unary convenience: queues `msg` (ignoring the send queue bound) and finishes with OK;
 * if packing fails it finishes with INTERNAL instead. */
void td_grpc_call_reply(td_grpc_call_t *call, const ProtobufCMessage *msg);

/* ---- client ------------------------------------------------------------------------- */

typedef struct td_grpc_channel td_grpc_channel_t;
typedef struct td_grpc_client_call td_grpc_client_call_t;

/* Signs one request (td_grpc_channel_config_t.sign): writes the value of the channel's
 * sign_header for `method` and the packed request[0..len) (without the gRPC prefix) into
 * value[0..cap). An error fails the td_grpc_channel_call (no callback runs). */
typedef td_status_t (*td_grpc_sign_cb)(void *data, const char *method, const void *request, size_t len,
                                       char *value, size_t cap);

typedef struct td_grpc_channel_config {
    size_t max_message_bytes;        /* largest request sent / response accepted; 4 MiB */
    uint32_t initial_window_bytes;   /* receive window per stream and connection; 1 MiB */
    uint32_t max_header_list_bytes;  /* 16 KiB */
    /* optional: every call gets header sign_header: sign(sign_data, ...) (at most
     * TD_GRPC_SIGN_CHARS). The channel owns sign_data from td_grpc_channel_create on, also
     * when that fails: sign_free(sign_data) (may be NULL) runs when the channel is freed. */
    const char *sign_header;         /* a static string */
    td_grpc_sign_cb sign;
    void *sign_data;
    void (*sign_free)(void *sign_data);
} td_grpc_channel_config_t;

#define TD_GRPC_SIGN_CHARS 256
#define TD_GRPC_MAX_CALL_HEADERS 8

td_grpc_channel_config_t td_grpc_channel_config_default(void);

/* One response message, valid during the call only. */
typedef void (*td_grpc_message_cb)(td_grpc_client_call_t *call, const ProtobufCMessage *msg,
                                   void *data);

/* The call ended: exactly once per call started with TD_OK. `message` ("" when none) is
 * valid during the call; the call handle is freed right after this returns. Local
 * failures use the gRPC codes too: a lost or refused connection → UNAVAILABLE, the
 * client-side deadline → DEADLINE_EXCEEDED, td_grpc_client_call_cancel → CANCELLED, a
 * response over max_message_bytes → RESOURCE_EXHAUSTED, one that does not parse or a
 * compressed one → INTERNAL. */
typedef void (*td_grpc_done_cb)(td_grpc_client_call_t *call, td_grpc_code_t code,
                                const char *message, void *data);

typedef struct td_grpc_call_opts {
    const ProtobufCMessageDescriptor *response_desc; /* how to unpack responses */
    td_grpc_message_cb on_message;                   /* may be NULL */
    td_grpc_done_cb on_done;                         /* required */
    void *data;
    uint32_t timeout_ms;                             /* 0 = no deadline; sent as grpc-timeout */
    /* Instead of a message: raw request bytes, sent framed as they are (proxies, tests of
     * malformed input). Used when the request message is NULL. */
    const void *raw_request;
    size_t raw_request_len;
    /* Metadata sent with the request (copied; at most TD_GRPC_MAX_CALL_HEADERS), e.g.
     * {"authorization", "Bearer KEY"}. Names lowercase, not pseudo-headers nor one the
     * channel sets itself (content-type, te, grpc-timeout...). */
    const td_grpc_header_t *headers;
    size_t n_headers;
} td_grpc_call_opts_t;

/*
 * Starts connecting to host:port (an IP literal or "localhost") and returns the channel at
 * once; calls made before the connection is up are queued. The channel does not
 * reconnect: once its connection fails every call ends with UNAVAILABLE and new calls
 * are refused; close it and create another. Errors: TD_ERR_INVALID (bad address),
 * TD_ERR_NOMEM, TD_ERR_IO.
 */
td_status_t td_grpc_channel_create(uv_loop_t *loop, const char *host, uint16_t port,
                                   const td_grpc_channel_config_t *cfg,
                                   td_grpc_channel_t **ch_p);

/* True until the connection failed or the peer sent GOAWAY. */
bool td_grpc_channel_is_usable(const td_grpc_channel_t *ch);

/*
 * Ends every unfinished call with CANCELLED ("channel closed"), closes the connection and
 * frees the channel; `cb` (may be NULL) runs when every handle has closed. NULL is a no-op.
 * Safe to call from the channel's own callbacks.
 */
void td_grpc_channel_close(td_grpc_channel_t *ch, void (*cb)(void *data), void *data);

/*
 * Starts a unary or server-streaming call of `method` ("/pkg.Service/Method") with
 * `request` (packed before returning; NULL → opts->raw_request). Responses reach
 * opts->on_message, the end opts->on_done. *call_p (may be NULL) is valid until on_done
 * returns. Errors (no callback will run): TD_ERR_INVALID (bad method or opts),
 * TD_ERR_RANGE (request over max_message_bytes), TD_ERR_UNAVAILABLE (the channel failed
 * or is closing), TD_ERR_NOMEM.
 */
td_status_t td_grpc_channel_call(td_grpc_channel_t *ch, const char *method,
                                 const ProtobufCMessage *request,
                                 const td_grpc_call_opts_t *opts, td_grpc_client_call_t **call_p);

/* Cancels the call (RST_STREAM CANCEL to the server); on_done runs with CANCELLED before
 * this returns, unless the call had already ended. */
void td_grpc_client_call_cancel(td_grpc_client_call_t *call);

/*
 * Pauses / resumes delivery. While paused, received bytes are buffered and not
 * acknowledged to HTTP/2 flow control, so the server is held back by the stream window
 * (a slow consumer back-pressures the producer). Resuming delivers what was buffered
 * (and the end, if it came meanwhile) before returning.
 */
void td_grpc_client_call_pause(td_grpc_client_call_t *call, bool paused);

#endif /* TD_GRPC_H */
