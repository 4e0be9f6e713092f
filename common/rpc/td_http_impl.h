/*
 * td_http_impl: the inside of the HTTP server, shared by the files that make up td_http
 * (td_http.c: connections' lifetime and deadlines, accepting, the server, the request's
 * accessors; td_http_read.c: reading and parsing requests; td_http_write.c: the output
 * blocks, flushing, answers and streams). Not for use outside the module.
 *
 * A connection is a TCP handle, one timer and an http_parser. Bytes read go straight
 * through the parser (from one read buffer the server shares) whose callbacks copy the
 * request's line and headers into the request's bounded head buffer and its body into a
 * buffer that grows to max_body_bytes. When a message is complete the parser is paused
 * and the handler called; bytes that arrive meanwhile wait unparsed in the connection's
 * input buffer (READ_BYTES; reading stops while it is full) and are parsed once the answer
 * has been given and less than half max_write_queue_bytes waits to be written (td_http_write.c),
 * so pipelined requests are answered in order, one at a time, and a client that reads no
 * answers makes us queue at most about that much.
 *
 * Answers are copied into the connection's output blocks and written once per loop
 * iteration (td_http_write.c); `queued` counts the bytes not yet written. The connection is
 * in one of three lists, which make eviction O(1):
 * `fresh` (never answered a request, nothing handled or queued), `idle` (answered one,
 * nothing handled or queued; in the order they became idle) and `busy`. The one timer
 * carries whichever deadline is nearest (td_http_conn_arm_timer). A connection's memory is freed
 * when both handles have closed; a handled request still unanswered then gets on_abort.
 */
#ifndef TD_HTTP_IMPL_H
#define TD_HTTP_IMPL_H

#include <http_parser.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_http.h"
#include "td_list.h"

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

/* A piece of a connection's output (td_http_write.c). */
struct out_block {
    out_block_t *next;
    size_t cap, off, len;        /* data[off..len) unwritten */
    char data[];
};

/* Why the server closed a connection itself (the `reason` label). */
enum { CLOSE_REQUEST, CLOSE_IDLE, CLOSE_WRITE, CLOSE_EVICTED, CLOSE_REFUSED, CLOSE_BODY, CLOSE_N, /* counted */
       CLOSE_LINGER = CLOSE_N, CLOSE_NONE };

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
    size_t declared;             /* Content-Length (0: none or chunked) */
    size_t charged;              /* bytes taken from cfg.body_budget, given back with body */
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
    uint64_t budget_refused;     /* cfg.body_budget->refused before this parse: a 503 says why */
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

/* ---- td_http.c: lifetime --------------------------------------------------------------- */

/* Frees a request's body and gives its bytes back to the body budget (repeatable). */
void td_http_req_free_body(td_http_req_t *req);

/* Frees a request that no handler holds any more (never handed over, or done with). */
void td_http_req_free(td_http_req_t *req);

/* Starts closing c (a no-op once it is closing); `why` (CLOSE_*) below CLOSE_N is logged and
 * counted. A handled request still unanswered gets on_abort when both handles have closed. */
void td_http_conn_close(http_conn_t *c, int why);

/* Moves c to the list its state says: busy while a request is handled or bytes are
 * queued, else fresh or idle (to the back: the newest). */
void td_http_conn_relist(http_conn_t *c);

/* Arms c's timer for the nearest deadline that applies, or stops it when none does. */
void td_http_conn_arm_timer(http_conn_t *c);

/* Shuts our side and waits, dropping what comes, for the client's close: at most LINGER_MS. */
void td_http_conn_linger(http_conn_t *c);

/* ---- td_http_read.c: reading and parsing ------------------------------------------------ */

/* Fills s with the parser callbacks that copy a request into its bounds. */
void td_http_settings_init(http_parser_settings *s);

/* Starts reading c unless it is closing, half-closed or its input buffer is full. */
void td_http_conn_read_start(http_conn_t *c);

/* Parses the input that waited while the previous request was handled, then reads on. */
void td_http_conn_resume(http_conn_t *c);

/* ---- td_http_write.c: output ------------------------------------------------------------ */

/* Gives c's output blocks back (to the server's spares, or free). */
void td_http_conn_free_blocks(http_conn_t *c);

/* Room for `len` bytes at the end of c's output (a new block when the last has too little);
 * td_http_conn_commit says how many were used. NULL when out of memory. */
char *td_http_conn_reserve(http_conn_t *c, size_t len);
void td_http_conn_commit(http_conn_t *c, size_t used);

/* Answers with an error the server decided (garbage, a bound passed): the connection
 * parses no more, and closes once it is written and the client has closed its side (see
 * http_conn.lingering). */
void td_http_conn_fail(http_conn_t *c, int status, const char *msg);

#endif
