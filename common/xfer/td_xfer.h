/*
 * td_xfer: the KV-cache data plane. A prefill node pushes each layer's K/V of a request
 * into blocks a decode node reserved for it, over UCX (TCP, shared memory, RDMA where
 * present), and finally tells it "kv-ready"; the decode node adopts the blocks only then
 * and only if the reservation (lease) is still live. docs/xfer.md has the protocol, the
 * choice of UCX primitive per transport, the failure model and the metric names.
 *
 * One td_xfer_t per node: a UCX context + worker (+ listener on a receiver), progressed
 * from the node's libuv loop (worker efd + uv_poll + uv_prepare). Every function here,
 * and every callback it makes, runs on that loop's thread; compute threads hand their
 * layers over with uv_async_send first. Callbacks are never made from inside a td_xfer
 * call: they come from the loop.
 *
 * Receiver (decode node): td_xfer_register_pool() once, td_xfer_describe() gives the
 * bytes the control plane publishes (listener address, pool base, packed rkey, layout);
 * td_xfer_lease_create() reserves blocks for one request under a deadline.
 *
 * Sender (prefill node): td_xfer_connect() with a receiver's description (layouts are
 * compared here: a mismatch is refused naming the field), then per request
 * td_xfer_send_begin(), td_xfer_send_layer() for each layer as soon as it is computed,
 * td_xfer_send_finish(); the done callback reports the receiver's verdict.
 *
 * Leases: ids are 64-bit, increasing, never reused, so a late message for a dead lease
 * can never touch blocks re-leased to someone else: every data message names its lease,
 * and the receiver places bytes only into blocks of that live lease. A lease id is not a
 * secret (ids count up): every lease also has a random 128-bit token, handed to its sender
 * over the authenticated control plane, that BIND, DATA and READY must carry, and the
 * first endpoint that presents it owns the lease; a message with a wrong token or from
 * another endpoint is dropped and counted (stats rejected_*), never fatal to the lease
 * (docs/security.md, "The KV data plane"). Puts cannot be
 * refused once issued, so a sender binds to a lease before its first put, and a dead
 * lease with a bound writer keeps its blocks (quarantine) until that writer confirms it
 * stopped (abort-ack after a flush), its endpoint is lost, or quarantine_ms passes.
 */
#ifndef TD_XFER_H
#define TD_XFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "td_kv.h"
#include "td_kv_layout.h"
#include "td_status.h"

typedef struct td_xfer td_xfer_t;

/* A lease's token: 128 bits from getrandom(2), made by td_xfer_lease_create. Whoever
 * holds it may write the lease (until another endpoint presented it first); the control
 * plane carries it from the decode node (Admit) through the router to the prefill node
 * (Prefill), both calls signed with the cluster secret. Compared in constant time. */
#define TD_XFER_TOKEN_BYTES 16
typedef struct td_xfer_token {
    uint8_t b[TD_XFER_TOKEN_BYTES];
} td_xfer_token_t;
typedef struct td_xfer_peer td_xfer_peer_t;
typedef struct td_xfer_send td_xfer_send_t;

/* Where KV bytes live. A sender's device (CUDA) memory is staged through a pinned host
 * ring with asynchronous device-to-host copies (td_xfer_config_t.d2h, the backend's copy
 * engine), each operation posted when its copy is done; a receiver's device pool through a
 * host landing area that senders write, copied into the device pool with the caller's
 * copy_h2d after kv-ready, a piece per budget over loop iterations (td_xfer_pool_t).
 * docs/xfer.md, "Memory types". */
typedef enum td_xfer_mem {
    TD_XFER_MEM_HOST = 0,
    TD_XFER_MEM_CUDA = 1,
} td_xfer_mem_t;

/* Which UCX primitive carries KV bytes to a peer (docs/xfer.md). AUTO: RMA put where it is
 * native and reaches the receiver's pool (a mapped shared-memory segment, or an RDMA
 * transport), active-message rendezvous otherwise (TCP, where UCX emulates RMA over AM). */
typedef enum td_xfer_rma {
    TD_XFER_RMA_AUTO = 0,
    TD_XFER_RMA_PUT = 1, /* always put (emulated over AM on TCP: slow; for tests) */
    TD_XFER_RMA_AM = 2,  /* always AM rendezvous */
} td_xfer_rma_t;

/* "auto", "put" or "am" -> *rma_p. Errors: TD_ERR_INVALID naming the value. */
td_status_t td_xfer_rma_parse(const char *s, td_xfer_rma_t *rma_p);

/* Called from any thread when an asynchronous copy has finished (td_xfer's is a
 * uv_async_send that makes the loop poll its copies). */
typedef void (*td_xfer_wake_cb)(void *wake_arg);

/*
 * Asynchronous device-to-host copies: how a sender's device-memory source reaches the
 * staging ring (a backend's copy engine: td_node_copier wraps td_backend's
 * copy_d2h_start / copy_poll / host_pin / host_unpin). Every function is called on the
 * loop thread.
 *   start: queues a copy of `bytes` from device src to host dst and returns at once,
 *          naming it *ticket_p; copies finish in the order they were started. Once it has
 *          finished (poll says so), wake(wake_arg) is called from any thread; a copy that
 *          finished before start returned need not wake (td_xfer polls after starting).
 *   poll:  TD_OK: the copy is done and its bytes are in dst; TD_ERR_BUSY: still running;
 *          any other status: it failed (td_last_error says why). Never blocks.
 *   quiesce (may be NULL: wakes never outlive poll's TD_OK): returns once no wake of a
 *          finished copy is still to come (shutdown calls it, on the loop, before its wake handle
 *          goes).
 *   pin, unpin (may be NULL): page-lock td_xfer's staging ring once, when it is
 *          allocated, so that copies go straight into it; unpin before it is freed.
 */
typedef struct td_xfer_copier {
    td_status_t (*start)(void *arg, void *dst, const void *src, size_t bytes, td_xfer_wake_cb wake,
                         void *wake_arg, uint64_t *ticket_p);
    td_status_t (*poll)(void *arg, uint64_t ticket);
    void (*quiesce)(void *arg);
    td_status_t (*pin)(void *arg, void *host, size_t bytes);
    void (*unpin)(void *arg, void *host);
    void *arg;
} td_xfer_copier_t;

typedef struct td_xfer_config {
    const char *name;          /* UCX context name, for logs ("decode0") */
    const char *listen_ip;     /* IPv4 address to accept senders on; NULL: send only */
    uint16_t listen_port;      /* 0: any free port (td_xfer_describe tells which) */
    uint32_t max_inflight_ops; /* data operations posted to UCX at once, whole node */
    uint32_t send_timeout_ms;  /* bound from send_begin to the receiver's verdict */
    uint32_t tick_ms;          /* period of the deadline scan (leases, sends) */
    td_xfer_rma_t rma;         /* sender: primitive per peer */
    uint32_t quarantine_ms;    /* receiver: bound on holding a dead lease's blocks while
                                  its put writer has not confirmed the abort */
    size_t put_nt_min;         /* sender, shared memory: puts of this many bytes and more
                                  are copied with non-temporal stores (docs/xfer.md) */
    size_t staging_bytes;      /* sender: host ring that device-memory sources are copied
                                  through (allocated and pinned at the first such send);
                                  one operation moves at most half of it */
    const td_xfer_copier_t *d2h; /* sender: copies device-memory sources into the ring
                                  (not owned, outlives x); NULL: such sends are refused */
    const char *advertise_ip;  /* receiver: IPv4 address td_xfer_describe publishes for the
                                  listener (senders connect to it); NULL: listen_ip. Set it
                                  when listen_ip is a wildcard (0.0.0.0) */
    size_t max_op_bytes;       /* sender: one data operation carries at most this many bytes
                                  (longer runs of blocks are split; one block at least);
                                  receiver: one piece of an adoption (checksum, copy_h2d) is
                                  at most this long; so no single copy or checksum on the loop
                                  is longer */
    size_t loop_budget_bytes;  /* bytes of synchronous work (shared-memory copies, checksums,
                                  a device pool's copies into the pool) the loop thread does
                                  per loop iteration; what is left waits for the next
                                  iteration, which comes without sleeping (docs/xfer.md,
                                  "Bounded work per loop iteration") */
} td_xfer_config_t;

/* Defaults: listen on 127.0.0.1 port 0, 64 ops in flight, 30 s send bound, 10 ms tick,
 * rma auto, 10 s quarantine, non-temporal copies from 16 KiB, 64 MiB staging ring, no d2h,
 * operations of 4 MiB at most, 8 MiB of synchronous work per loop iteration (about 0.5 ms
 * of copying at this VM's 10-20 GB/s). */
td_xfer_config_t td_xfer_config_default(void);

/* The 64-bit td_xfer request id of a cluster request id string (the FNV-1a loop, with the
 * offset basis the nodes have always used: 1469598103934665603, not FNV's 14695981039346656037;
 * kept so that nodes of different builds agree). Prefill and decode nodes both derive it from
 * the router's request id, so they name the same transfer. */
uint64_t td_xfer_request_key(const char *request_id);

/* Prometheus names in docs/xfer.md. Counters only grow; gauges are current values. */
#define TD_XFER_HIST_BUCKETS 12
extern const double td_xfer_hist_le_s[TD_XFER_HIST_BUCKETS]; /* upper bounds, last +Inf */

typedef struct td_xfer_stats {
    uint64_t bytes_sent;         /* KV payload bytes a receiver took (sender side) */
    uint64_t bytes_received;     /* KV payload bytes placed into the pool (receiver) */
    uint64_t transfers_ok;       /* sends the receiver adopted */
    uint64_t transfer_hist[TD_XFER_HIST_BUCKETS]; /* send_begin -> verdict, cumulative le */
    double transfer_seconds_sum;
    uint32_t transfers_inflight; /* gauge: sends begun and not yet done */
    uint64_t fail_peer;          /* sends failed: receiver endpoint lost */
    uint64_t fail_timeout;       /* sends failed: send_timeout_ms passed */
    uint64_t fail_stale;         /* sends refused: lease dead at the receiver */
    uint64_t fail_mismatch;      /* sends/connects refused: layout or request mismatch */
    uint64_t fail_protocol;      /* malformed or inconsistent messages (either side) */
    uint32_t leases_live;        /* gauge */
    uint64_t leases_created;
    uint64_t leases_adopted;
    uint64_t leases_expired;
    uint64_t leases_cancelled;   /* td_xfer_lease_cancel */
    uint64_t leases_sender_lost; /* released because the writing sender's endpoint died */
    uint64_t discarded_data;     /* data messages for a dead or unknown lease */
    uint64_t discarded_ready;    /* kv-ready for a dead or unknown lease */
    uint64_t ops_put;            /* sender: data operations posted as RMA puts */
    uint64_t ops_am;             /* sender: data operations posted as active messages */
    uint64_t leases_quarantined; /* died while a put writer was bound: held until its abort-ack */
    uint32_t landing_free;       /* gauge, device pool: landing blocks not held by a lease */
    uint64_t bytes_copied_h2d;   /* device pool: landed bytes copied into the pool */
    uint64_t quarantine_timeouts;/* ... released by quarantine_ms instead (the remaining risk) */
    uint64_t bytes_verified;     /* receiver: landed bytes checksummed before adoption (kv-ready
                                    with checksum: tests, benchmarks; not exported) */
    /* receiver: messages naming a live lease that were dropped without touching it */
    uint64_t rejected_token;     /* BIND, DATA or READY without the lease's token */
    uint64_t rejected_endpoint;  /* ... with it, from another endpoint than the lease's owner */
    uint64_t rejected_malformed; /* kv-ready from the owner whose contents do not check (layout,
                                    request, sizes): refused to its sender, the lease lives on */
} td_xfer_stats_t;

/*
 * Creates a node's transfer endpoint on `loop` (not owned): UCX context and worker with
 * active messages, RMA and wake-up, and a listener when cfg->listen_ip is set. Reads the
 * UCX_* environment (UCX_TLS, UCX_NET_DEVICES, ...). Errors: TD_ERR_UCX (UCX init or
 * listen failed, message says which), TD_ERR_INVALID, TD_ERR_NOMEM.
 */
td_status_t td_xfer_create(uv_loop_t *loop, const td_xfer_config_t *cfg, td_xfer_t **x_p);

/*
 * Starts tearing x down and returns at once; the rest runs from the loop's own callbacks
 * and never blocks it. From here: every finished send not yet done gets its done callback
 * now (its verdict if it had one, else its first failure, else TD_ERR_CLOSED; called from
 * here, the one exception to the rule above), an unfinished one ends without a callback;
 * ready transfers not yet delivered return their blocks; new senders are rejected; no callback
 * of x comes after this returns, and x may not be used again. Then, on the loop: sender
 * endpoints are flushed (verdicts on their way, bounded 1 s), every endpoint is
 * force-closed (bounded 5 s), running device-to-host copies finish (bounded 2 s: one that
 * does not costs the staging ring and x, leaked rather than freed under it), live leases
 * return their blocks, the pool is unregistered, UCX is finalised and x's memory is
 * released from its last handle's close callback. Adoptions in progress stop at once
 * (nothing more is checksummed or copied; their senders are told TD_ERR_UNAVAILABLE; their
 * blocks return with the other dead leases'). Until then the source bytes of its
 * sends, the pool memory and block manager, and the d2h copier must stay valid: keep
 * running the loop (uv_run(UV_RUN_DEFAULT) returns once x's handles have closed) before
 * freeing them and before uv_loop_close. NULL is a no-op.
 */
void td_xfer_destroy(td_xfer_t *x);

void td_xfer_get_stats(const td_xfer_t *x, td_xfer_stats_t *stats);

/* ---- receiver ----------------------------------------------------------------------- */

/* An adopted transfer. The callee owns one reference on each of blocks[0..n_blocks), held
 * by TD_KV_HOLDER_LANDED (td_kv_seq_adopt them, or td_kv_unref_blocks_for(kv,
 * TD_KV_HOLDER_LANDED, ...) once); the arrays live for the call only.
 * The callback comes once adoption is done: kv-ready checked, every byte in, the checksum
 * (when the sender asked for one) verified and, on a device pool, every landed byte copied
 * into the pool; the sender's OK goes out at the same time. Adoption runs from the loop a
 * piece per loop iteration's budget (docs/xfer.md, "Bounded work per loop iteration"), so
 * it may come many iterations after kv-ready. */
typedef struct td_xfer_ready {
    uint64_t request_id;
    uint64_t lease_id;
    const int32_t *blocks; /* [n_blocks] the lease's blocks, in token order */
    int32_t n_blocks;
    uint32_t n_tokens;     /* tokens whose K/V were written (a prefix of the blocks) */
    int32_t first_token;   /* the token prefill sampled */
} td_xfer_ready_t;

typedef void (*td_xfer_ready_cb)(void *arg, const td_xfer_ready_t *ready);

/* Copies bytes from host to device memory and returns once they are there (a backend's
 * copy_h2d). Called on the loop thread during adoption, once per run of blocks contiguous
 * at both ends, of at most max_op_bytes, layer by layer, and no more than about
 * loop_budget_bytes per loop iteration. An error fails the request (the sender's verdict
 * is that status, the lease's blocks return); td_last_error() names the cause. */
typedef td_status_t (*td_xfer_copy_cb)(void *arg, void *dst, const void *src, size_t bytes);

typedef struct td_xfer_pool {
    td_kv_layout_t layout;
    void *base;         /* pool[n_layers][n_blocks][2][block_size][n_kv_heads][head_dim];
                           host memory, NULL: UCX allocates it (td_xfer_pool_base), as a
                           shared-memory segment when sm transports are on, so that senders
                           on this host put with a memcpy into the mapping.
                           mem CUDA: the device pool (required; not given to UCX) */
    uint32_t n_blocks;
    uint32_t resident_blocks; /* a host pool UCX allocates: blocks [0, resident_blocks) of every
                                 layer are made resident at registration, the rest by the
                                 caller (td_xfer_pool_populate) before kv hands them out
                                 (td_kv_hold); 0: the whole pool at registration */
    td_xfer_mem_t mem;
    td_kv_cache_t *kv;  /* the block manager of this pool (not owned); leases allocate here.
                           NULL: set later with td_xfer_pool_set_kv (the engine that owns it
                           is built on the memory this call allocates) */
    /* mem CUDA only: senders write a host landing area of landing_blocks blocks (UCX
       allocates it, as for a NULL host base); a lease holds landing blocks and pool blocks;
       after kv-ready the landed bytes are copied into the pool with copy_h2d, a piece per
       loop iteration's budget, and the landing blocks return once copied, before the ready
       callback. */
    uint32_t landing_blocks;
    td_xfer_copy_cb copy_h2d;
    void *copy_arg;
} td_xfer_pool_t;

/*
 * Registers the receiver's whole KV pool with UCX (once; a device pool: its host landing
 * area) and sets the callback for adopted transfers. The pool memory and kv must outlive
 * x. Errors: TD_ERR_INVALID (bad layout, already registered, no listener; a device pool
 * without base, copy_h2d or landing_blocks), TD_ERR_UCX, TD_ERR_NOMEM.
 */
td_status_t td_xfer_register_pool(td_xfer_t *x, const td_xfer_pool_t *pool, td_xfer_ready_cb on_ready,
                                  void *arg);

/*
 * Makes blocks [b0, b1) of every layer of the registered host pool resident, on this thread
 * (a background one: it takes as long as the page faults do). Reads only what registration
 * fixed, so any thread may call it while the loop runs. TD_ERR_INVALID (no host pool, a bad
 * range), TD_ERR_NOMEM (the memory cannot be had).
 */
td_status_t td_xfer_pool_populate(td_xfer_t *x, uint32_t b0, uint32_t b1);

/* The registered pool's address (the one UCX allocated when pool->base was NULL; a device
 * pool's own base), or NULL before td_xfer_register_pool. Valid until td_xfer_destroy. */
void *td_xfer_pool_base(const td_xfer_t *x);

/* Sets the block manager of a pool registered with kv NULL (once; before any lease).
 * It may be shared with a compute thread: td_kv serializes its operations. Errors:
 * TD_ERR_INVALID (no pool, or one already set). */
td_status_t td_xfer_pool_set_kv(td_xfer_t *x, td_kv_cache_t *kv);

/* Largest description td_xfer_describe writes. */
#define TD_XFER_DESC_MAX 1024

/*
 * Writes what this receiver publishes about itself (listener address and port, pool base
 * and n_blocks, packed rkey, layout) into buf[0..cap); *len_p = bytes written. Opaque
 * bytes for the control plane. Errors: TD_ERR_INVALID (no pool registered),
 * TD_ERR_RANGE (cap too small).
 */
td_status_t td_xfer_describe(td_xfer_t *x, void *buf, size_t cap, size_t *len_p);

/*
 * Reserves n_blocks blocks of the pool for request_id until ttl_ms from now: writes the
 * ids senders write to (send params' dst_blocks) to blocks_out[0..n_blocks), the lease
 * id to *lease_id_p and its token (the sender's send params' token) to *token_p. The blocks return to the pool exactly once: on expiry, cancel, or
 * loss of the sender writing them; or they pass to the ready callback on adoption. The
 * lease stays live until the ready callback: expiry, cancel and the loss of its sender end
 * an adoption in progress too (the sender is told TD_ERR_STALE; nothing is adopted). A
 * device pool's lease also holds as many landing blocks (blocks_out names those; the
 * ready callback names the pool blocks the bytes were copied to); they return with it, or
 * once their bytes are copied into the pool.
 * Errors: TD_ERR_EXHAUSTED (pool or landing area full; not logged: the scheduler
 * decides), TD_ERR_INVALID, TD_ERR_NOMEM, TD_ERR_IO (getrandom failed).
 */
td_status_t td_xfer_lease_create(td_xfer_t *x, uint64_t request_id, int32_t n_blocks, uint32_t ttl_ms,
                                 int32_t *blocks_out, uint64_t *lease_id_p, td_xfer_token_t *token_p);

/* Ends a live lease now (request cancelled), an adoption in progress included (it stops;
 * its sender is told TD_ERR_STALE; no ready callback comes): its blocks return to the pool
 * once nothing can write into them any more: no receive in flight, and a sender bound for
 * puts has confirmed the abort (or its endpoint is gone, or quarantine_ms passed).
 * Errors: TD_ERR_STALE (ended already, or adopted: the ready callback has its blocks; not
 * logged). */
td_status_t td_xfer_lease_cancel(td_xfer_t *x, uint64_t lease_id);

/* ---- sender ------------------------------------------------------------------------- */

/*
 * Returns the peer for a receiver description, connecting on first use and reusing the
 * endpoint afterwards (a dead peer is replaced by a fresh connection). `mine` is the
 * layout of the sender's own KV pool; any difference with the receiver's refuses the
 * connection: TD_ERR_MISMATCH, message "kv layout mismatch: head_dim 128 here, 64 at
 * peer". Other errors: TD_ERR_FORMAT (not a description), TD_ERR_UCX, TD_ERR_NOMEM.
 * The peer belongs to x and lives until td_xfer_destroy.
 */
td_status_t td_xfer_connect(td_xfer_t *x, const void *desc, size_t desc_len, const td_kv_layout_t *mine,
                            td_xfer_peer_t **peer_p);

/* False once the endpoint to this peer failed (sends on it fail; connect again). */
bool td_xfer_peer_alive(const td_xfer_peer_t *peer);

/* Final verdict of one send: TD_OK (receiver adopted), TD_ERR_STALE (lease dead there),
 * TD_ERR_UNAVAILABLE (peer lost), TD_ERR_TIMEOUT, TD_ERR_MISMATCH, TD_ERR_PROTOCOL,
 * TD_ERR_CLOSED (x destroyed). */
typedef void (*td_xfer_done_cb)(void *arg, uint64_t request_id, td_status_t st);


typedef struct td_xfer_send_params {
    uint64_t request_id;
    uint64_t lease_id;         /* from the receiver's td_xfer_lease_create */
    td_xfer_token_t token;     /* ... and its token: every BIND, DATA and READY carries it */
    const int32_t *dst_blocks; /* [n_dst_blocks] the lease's blocks (copied) */
    int32_t n_dst_blocks;
    uint32_t n_tokens;         /* tokens to transfer: blocks 0..ceil(n_tokens/block_size) */
    bool checksum;             /* receiver verifies a checksum of every block before adopting */
    td_xfer_mem_t mem;         /* where the source pool lives */
    td_xfer_done_cb done;
    void *arg;
} td_xfer_send_params_t;

/*
 * Starts one request's transfer to `peer`. *s_p stays valid until the done callback,
 * which comes only after td_xfer_send_finish. Errors (no callback then): TD_ERR_INVALID
 * (blocks too few for n_tokens; device memory without td_xfer_config_t.d2h, or a block larger than
 * half the staging ring), TD_ERR_UNAVAILABLE (peer dead), TD_ERR_NOMEM (incl. the
 * staging ring).
 */
td_status_t td_xfer_send_begin(td_xfer_t *x, td_xfer_peer_t *peer, const td_xfer_send_params_t *p,
                               td_xfer_send_t **s_p);

/*
 * Queues layer `layer` of the request: src_layer is that layer's slab of the sender's own
 * pool ([src_n_blocks][2][block_size][n_kv_heads][head_dim]); src_blocks[i] is the source
 * block of the request's i-th block (its block table). Runs of blocks contiguous at both
 * ends go as operations of at most max_op_bytes; at most max_inflight_ops are in flight, the
 * rest wait in order (and, on shared memory, for the loop iteration's budget). Only the
 * block table is read here: the bytes (and the checksum) are read when an operation is
 * posted. The source bytes must stay unchanged until the done callback (a callback made by
 * td_xfer_destroy: until x's handles have closed). Device-memory sources
 * are read (an asynchronous copy into the staging ring) when their operation reaches the
 * front of the queue; the operation goes to UCX when its copy is done. Errors
 * (the request is then failed; finish still delivers the verdict): TD_ERR_INVALID (layer
 * out of range or sent twice), the request's failure status if it already failed.
 */
td_status_t td_xfer_send_layer(td_xfer_send_t *s, uint32_t layer, const void *src_layer,
                               const int32_t *src_blocks);

/*
 * No more layers: once every layer's bytes reached the receiver, kv-ready {request,
 * lease, n_tokens, first_token, checksum} is sent; the receiver's answer (or a failure)
 * arrives through the done callback. A request missing layers ends with TD_ERR_INVALID.
 */
void td_xfer_send_finish(td_xfer_send_t *s, int32_t first_token);

/*
 * Gives up on a send the caller no longer wants (its request was cancelled, or its KV
 * cannot be completed), before or after td_xfer_send_finish: operations not yet posted
 * are dropped, no kv-ready goes out if it has not already, and the done callback comes
 * from the loop with `why` (TD_ERR_CANCELLED if TD_OK is given) once the operations UCX
 * already holds are back; the source bytes must stay unchanged until then. A lease the
 * receiver bound to this sender is fenced as for any dead lease (its expiry or cancel,
 * then our abort-ack). No-op once the verdict is known. Loop thread.
 */
void td_xfer_send_abort(td_xfer_send_t *s, td_status_t why);

#endif /* TD_XFER_H */
