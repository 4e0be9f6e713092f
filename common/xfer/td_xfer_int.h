/*
 * td_xfer internals: the wire format (active message ids, headers, the pool description)
 * and the state every file of td_xfer shares (struct td_xfer, leases, peers, sends and
 * their operations), with the functions one file gives the others. Only td_xfer*.c
 * include it; td_xfer.h is the API. Threads: everything here runs on the loop thread.
 */
#ifndef TD_XFER_INT_H
#define TD_XFER_INT_H

#include "td_xfer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <ucp/api/ucp.h>

#include "td_hash.h"
#include "td_list.h"

enum {
    AM_DATA = 11,
    AM_READY = 12,
    AM_ACK = 13,
    AM_HELLO = 14,     /* sender -> receiver on connect; nothing else goes before its answer */
    AM_HELLO_ACK = 15,
    AM_BIND = 16,      /* put path: "I will put into this lease" */
    AM_BIND_ACK = 17,
    AM_ABORT = 18,     /* receiver -> bound writer: the lease died, stop and confirm */
    AM_ABORT_ACK = 19, /* sent after the writer's puts are flushed */
};

#define XFER_DESC_MAGIC 0x31584454u /* "TDX1" in little-endian memory order */

/* ---- wire structs (host byte order; the description's magic detects a foreign one) ---- */

typedef struct am_data_hdr {
    uint64_t lease_id;
    uint32_t layer;
    uint32_t dst_block; /* first destination block id of the run */
    uint32_t n_blocks;  /* blocks in the run */
    uint32_t first_idx; /* index of dst_block in the lease's block table */
    td_xfer_token_t token; /* the lease's: a DATA without it is refused unread */
} am_data_hdr_t;

typedef struct am_ready_hdr {
    uint64_t request_id;
    uint64_t lease_id;
    uint64_t bytes;    /* payload bytes of all DATA messages of this request */
    uint64_t checksum; /* 0 when not asked for */
    uint32_t n_tokens;
    int32_t first_token;
    uint32_t flags;    /* READY_F_CHECKSUM */
    uint32_t pad;
    td_kv_layout_t layout; /* the sender's; the receiver compares too */
    td_xfer_token_t token; /* the lease's */
} am_ready_hdr_t;

#define READY_F_CHECKSUM 1u
#define READY_F_PUT 2u /* the bytes came by RMA put (flushed before READY), not DATA */

/* ACK and every control message: HELLO/HELLO_ACK carry the peer cookie in request_id;
 * BIND carries the lease's token (zero in the others). */
typedef struct am_ack_hdr {
    uint64_t request_id;
    uint64_t lease_id;
    int32_t status; /* td_status_t */
    uint32_t pad;
    td_xfer_token_t token;
} am_ack_hdr_t;

typedef struct xfer_desc_wire {
    uint32_t magic;
    uint32_t rkey_len;
    td_kv_layout_t layout;
    uint64_t base;     /* pool address in the receiver (for RMA) */
    uint32_t n_blocks;
    uint16_t port;     /* host order */
    uint16_t pad;
    uint32_t ip;       /* IPv4, network order */
    uint32_t pad2;
    /* followed by rkey_len bytes of packed rkey */
} xfer_desc_wire_t;

/* ---- state ---------------------------------------------------------------------------- */

/* A receiver-side endpoint accepted from a sender. */
typedef struct xfer_conn {
    td_list_t link;     /* x->conns */
    td_xfer_t *x;
    ucp_ep_h ep;
    bool closing;
} xfer_conn_t;

/* LIVE: senders write it. ADOPTING: every byte is in and kv-ready checked; adoption (the
 * checksum, a device pool's copy) runs as a job over loop iterations (xfer_adopt_run); nothing
 * more is written or bound, but its deadline, cancel and its sender's loss still end it.
 * DEAD: its blocks return once nothing can write into them (xfer_lease_try_release). */
typedef enum lease_state { LEASE_LIVE, LEASE_ADOPTING, LEASE_DEAD } lease_state_t;

typedef struct xfer_lease {
    td_list_t link;      /* x->leases */
    uint64_t id;
    uint64_t request_id;
    uint64_t deadline_ns;
    lease_state_t state;
    td_xfer_token_t token; /* what BIND, DATA and READY for it must carry */
    xfer_conn_t *owner;  /* the first endpoint that presented the token: the only one whose
                            messages for this lease are taken from then on */
    uint64_t bytes;      /* payload bytes placed so far */
    uint32_t inflight;   /* rendezvous receives writing into the blocks */
    xfer_conn_t *writer; /* endpoint of the last DATA (fenced on death) */
    xfer_conn_t *put_writer; /* bound for puts: the blocks stay out of the pool after
                                death until it confirms the abort or is gone */
    uint64_t quarantine_ns;  /* deadline of that wait */
    bool ready_pending;  /* READY arrived before all bytes */
    am_ready_hdr_t ready;
    ucp_ep_h ready_ep;
    td_list_t adopt_link;    /* x->adopting while ADOPTING, oldest first */
    uint32_t adopt_layer;    /* the job's cursor: next (layer, index in the lease) to */
    uint32_t adopt_idx;      /* verify and copy, layer by layer */
    uint64_t adopt_sum;      /* checksum of the blocks verified so far */
    int32_t n_blocks;
    int32_t *dev;        /* device pool: [n_blocks] the pool blocks (after `blocks`); NULL on host */
    int32_t blocks[];    /* [n_blocks] what senders write: pool blocks, or landing blocks */
} xfer_lease_t;

typedef struct recv_op {
    td_xfer_t *x;
    xfer_lease_t *lease;
    size_t len;
} recv_op_t;

/* An endpoint to close once we are out of UCX callbacks. */
typedef struct ep_close {
    td_list_t link;
    ucp_ep_h ep;
} ep_close_t;

/* A ready transfer waiting for the loop to hand it to the user. */
typedef struct ready_event {
    td_list_t link;
    td_xfer_ready_t r;
    int32_t blocks[];
} ready_event_t;

struct td_xfer_peer {
    td_list_t link;    /* x->peers */
    td_xfer_t *x;
    ucp_ep_h ep;
    bool alive;
    bool hello_done;   /* the endpoint is wired up: data may go */
    bool use_put;      /* decided at hello: RMA put, else AM rendezvous */
    uint64_t cookie;   /* names this peer in HELLO/HELLO_ACK */
    uint64_t base;     /* the receiver's pool address */
    void *rkey_buf;    /* packed rkey from the description */
    size_t rkey_len;
    ucp_rkey_h rkey;   /* unpacked on ep at hello; destroyed with x */
    void *mapped;      /* the receiver's pool mapped here (shared memory, ucp_rkey_ptr):
                          puts are our own stores into it; NULL otherwise */
    uint32_t ip;       /* network order */
    uint16_t port;
    td_kv_layout_t layout;
    uint32_t n_blocks; /* the receiver's pool */
    td_list_t sends;   /* td_xfer_send_t.peer_link */
};

/* A piece of the staging ring held by one posted operation; pieces return in the order
 * they were taken (a FIFO: the ring's tail passes only pieces that are done). */
typedef struct stage_piece {
    td_list_t link;    /* x->stage_pieces */
    size_t span;       /* bytes taken from the ring, incl. padding skipped at its end */
    bool done;
} stage_piece_t;

typedef struct send_op {
    td_list_t link;    /* x->queue while waiting */
    td_xfer_send_t *s;
    am_data_hdr_t hdr; /* lives until the send completes (no COPY_HEADER in 1.13) */
    const void *src;   /* host bytes; for a device source, in the staging ring once copied */
    size_t len;
    stage_piece_t *piece; /* device source: its piece of the staging ring, from the start
                             of its copy until UCX no longer reads it */
    uint8_t *staged;      /* ... and where in the ring the bytes go */
    uint64_t ticket;      /* device source, in x->copying: its copy (td_xfer_copier_t) */
} send_op_t;

struct td_xfer_send {
    td_list_t peer_link;
    td_list_t done_link;   /* x->done_list when the verdict is in */
    td_xfer_t *x;
    td_xfer_peer_t *peer;
    td_xfer_send_params_t p;
    int32_t *dst_blocks;
    int32_t n_used;        /* blocks carrying tokens */
    uint64_t start_ns, deadline_ns;
    uint32_t layers_sent;
    uint8_t *layer_seen;   /* [n_layers] */
    uint32_t ops_out;      /* queued + posted DATA operations */
    uint64_t bytes;        /* DATA payload queued */
    uint64_t checksum;
    td_status_t status;    /* first failure, or the receiver's verdict */
    enum { MODE_UNDECIDED, MODE_AM, MODE_PUT } mode;
    bool bound;            /* put path: the receiver accepted our BIND */
    bool flush_inflight, flushed; /* put path: ep flush before READY */
    bool finished;         /* send_finish called */
    bool ready_posted, ready_inflight, verdict, done_queued;
    am_ready_hdr_t ready;
};

struct td_xfer {
    uv_loop_t *loop;
    td_xfer_config_t cfg;
    char name[64];
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_listener_h listener;
    uint32_t listen_ip; /* network order: the published address (cfg.advertise_ip, else the listener's) */
    uint16_t listen_port;
    int efd;
    uv_poll_t poll;
    uv_prepare_t prepare;
    uv_timer_t timer;
    uv_idle_t idle;     /* keeps the loop from sleeping after callbacks made in prepare, or
                           while work waits for the next iteration's budget */
    uint64_t delivered; /* user callbacks made */
    int open_handles;
    bool destroying;
    /* Shutdown after td_xfer_destroy, driven by the loop's callbacks (xfer_close_step). */
    enum { CLOSE_FLUSH, CLOSE_EPS, CLOSE_COPIES, CLOSE_DONE } close_phase;
    uint64_t close_deadline_ns; /* of the current phase */
    /* Bounded synchronous work per loop iteration (xfer_budget_fits). */
    uint64_t turn;         /* loop iterations (counted in xfer_on_prepare) */
    uint64_t budget_turn;  /* the iteration budget_used belongs to */
    size_t budget_used;    /* synchronous bytes done in it */
    bool budget_hit;       /* work waits for the next iteration */

    /* receiver */
    bool have_pool;
    td_xfer_pool_t pool;
    ucp_mem_h memh;
    void *rkey_buf;
    size_t rkey_len;
    td_xfer_ready_cb on_ready;
    void *ready_arg;
    /* device pool: pool.base/n_blocks describe the host landing area senders write;
       the device pool is dev_base/dev_n_blocks; landing_stack holds the free landing ids */
    void *dev_base;
    uint32_t dev_n_blocks;
    int32_t *landing_stack;
    uint64_t next_lease_id;
    td_list_t leases;      /* every lease, oldest first (the deadline scan) */
    td_hash_t lease_ids;   /* lease id -> xfer_lease_t * (xfer_lease_find) */
    td_list_t conns;
    td_list_t adopting;    /* xfer_lease_t in state ADOPTING, adopted in this order */
    td_list_t ready_list;
    uint64_t reject_log_ns[3]; /* when a rejection of each reason was last logged */

    /* sender */
    td_list_t peers;
    td_list_t queue;       /* send_op_t not yet posted */
    uint32_t ops_posted;
    td_list_t done_list;   /* sends whose done callback is due */
    td_list_t closing;     /* ep_close_t: endpoints to force-close */
    uint32_t closes_inflight;
    td_list_t aborts;      /* abort_job_t: ABORTs to confirm once our puts are flushed */
    uint64_t acts;         /* deferred actions taken (drain goes round while it grows) */
    uint64_t next_cookie;
    uint8_t *stage;        /* [cfg.staging_bytes] host ring device sources are copied through */
    size_t stage_head;     /* next byte to hand out */
    size_t stage_tail;     /* oldest byte still held */
    size_t stage_used;     /* bytes held (head == tail: empty when 0, full otherwise) */
    td_list_t stage_pieces;   /* stage_piece_t, oldest first */
    bool stage_pinned;     /* the ring is page-locked by cfg.d2h->pin */
    td_list_t copying;     /* send_op_t whose device-to-host copy runs, oldest first */
    uv_async_t copy_wake;  /* a copier's wake: poll the copies now */

    td_xfer_stats_t stats;
};

/* The receiver asks us to stop writing into a dead lease: drop the request's queued
 * puts now, confirm once its posted ones are done and the endpoint is flushed. */
typedef struct abort_job {
    td_list_t link;   /* x->aborts */
    td_xfer_peer_t *peer;
    uint64_t request_id, lease_id;
    bool flush_posted, flushed, failed;
} abort_job_t;

/* ---- what each file gives the others ----------------------------------------------
 * All on the loop thread. Those with a longer contract have it where they are defined. The
 * AM handlers (xfer_am_*_cb) and the listener's xfer_conn_cb are set by td_xfer_create;
 * UCX calls them from worker progress inside drain: they record facts and never call back
 * into UCX progress or into the user. */

/* td_xfer.c */
/* A UCX status as a logged TD_ERR_UCX naming `what`. */
td_status_t xfer_ucx_err(ucs_status_t st, const char *what);
uint64_t xfer_block_checksum(const void *p, size_t n, uint32_t layer, uint32_t idx);
void xfer_close_ep_force(td_xfer_t *x, ucp_ep_h ep);
/* Force-closes the endpoints xfer_close_ep_force queued (outside UCX callbacks only). */
void xfer_close_pending_eps(td_xfer_t *x);
ucp_ep_h xfer_am_reply_ep(const ucp_am_recv_param_t *param);
bool xfer_am_unpack(td_xfer_t *x, const void *header, size_t header_length, void *h, size_t size,
                    bool need_pool);
void xfer_send_ctl(td_xfer_t *x, ucp_ep_h ep, unsigned id, uint64_t a_, uint64_t b, td_status_t st);
/* BIND: a control message carrying the lease's token. */
void xfer_send_bind(td_xfer_t *x, ucp_ep_h ep, uint64_t request_id, uint64_t lease_id,
                    const td_xfer_token_t *token);
/* The verdict on a kv-ready (AM_ACK) to the sender at ep; ep NULL: nothing is sent. */
void xfer_send_ack(td_xfer_t *x, ucp_ep_h ep, uint64_t request_id, uint64_t lease_id, td_status_t st);
void xfer_close_step(td_xfer_t *x);

/* td_xfer_lease.c */
/* The lease with this id (live, adopting or dead), or NULL. */
xfer_lease_t *xfer_lease_find(td_xfer_t *x, uint64_t id);
/* Forgets l and frees it; its blocks are no longer its own (returned or handed on). */
void xfer_lease_remove(td_xfer_t *x, xfer_lease_t *l);
void xfer_landing_give(td_xfer_t *x, xfer_lease_t *l);
void xfer_lease_release(td_xfer_t *x, xfer_lease_t *l);
bool xfer_lease_try_release(td_xfer_t *x, xfer_lease_t *l);
void xfer_lease_fail(td_xfer_t *x, xfer_lease_t *l, td_status_t verdict);
void xfer_lease_kill(td_xfer_t *x, xfer_lease_t *l);

/* td_xfer_adopt.c */
/* A live lease whose bytes are all in and whose kv-ready passed becomes an adoption job. */
void xfer_adopt_start(td_xfer_t *x, xfer_lease_t *l);
void xfer_adopt_run(td_xfer_t *x);

/* td_xfer_recv.c */
void xfer_conn_cb(ucp_conn_request_h req, void *arg);
ucs_status_t xfer_am_data_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                             const ucp_am_recv_param_t *param);
ucs_status_t xfer_am_ready_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                              const ucp_am_recv_param_t *param);
ucs_status_t xfer_am_hello_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                              const ucp_am_recv_param_t *param);
ucs_status_t xfer_am_bind_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                             const ucp_am_recv_param_t *param);
ucs_status_t xfer_am_abort_ack_cb(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param);

/* td_xfer_peer.c */
/* The peer is lost (or x is going): its endpoint is queued for a force close, its sends
 * fail with st, its queued operations are dropped. */
void xfer_peer_fail(td_xfer_peer_t *peer, td_status_t st);
/* The live peer whose endpoint a message came on / is ep, or NULL. */
td_xfer_peer_t *xfer_peer_of_param(td_xfer_t *x, const ucp_am_recv_param_t *param);
td_xfer_peer_t *xfer_peer_of_ep(td_xfer_t *x, ucp_ep_h ep);
ucs_status_t xfer_am_hello_ack_cb(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param);

/* td_xfer_send.c */
/* Records st as s's outcome unless it already failed or has its verdict. */
void xfer_send_set_status(td_xfer_send_t *s, td_status_t st);
void xfer_send_maybe_done(td_xfer_send_t *s);
void xfer_op_checksum(send_op_t *op, const uint8_t *bytes);
size_t xfer_op_sync_bytes(const send_op_t *op);
bool xfer_op_ready(const send_op_t *op);
/* Hands op to UCX (AM, put, or a copy into a peer's mapped pool), or drops it when its
 * request failed or its peer is gone; op is the callee's either way. */
void xfer_post_op(td_xfer_t *x, send_op_t *op);
/* Sends s's kv-ready (READY): every DATA operation of s is complete (puts: flushed). */
void xfer_post_ready(td_xfer_t *x, td_xfer_send_t *s);
ucs_status_t xfer_am_ack_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param);
ucs_status_t xfer_am_bind_ack_cb(void *arg, const void *header, size_t header_length, void *data,
                                 size_t length, const ucp_am_recv_param_t *param);
ucs_status_t xfer_am_abort_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                              const ucp_am_recv_param_t *param);
/* Advances the ABORT confirmations (abort_job_t): flush once the request's puts are back,
 * then ABORT_ACK. */
void xfer_run_aborts(td_xfer_t *x);
void xfer_post_flush(td_xfer_send_t *s);
void xfer_send_count(td_xfer_t *x, const td_xfer_send_t *s);
/* Unlinks s from its peer and frees it (its done callback was made or is not owed). */
void xfer_send_free(td_xfer_send_t *s);

/* td_xfer_stage.c */
void xfer_stage_give(td_xfer_t *x, send_op_t *op);
bool xfer_copy_begin(td_xfer_t *x, send_op_t *op);
void xfer_poll_copies(td_xfer_t *x);
td_status_t xfer_stage_alloc(td_xfer_t *x);

/* td_xfer_loop.c */
bool xfer_budget_fits(td_xfer_t *x, size_t bytes);
/* Counts `bytes` of synchronous work against this iteration's budget (after budget_fits). */
void xfer_budget_charge(td_xfer_t *x, size_t bytes);
/* The handles' callbacks (td_xfer_create starts them; shutdown uses the timer and idle). */
void xfer_on_poll(uv_poll_t *h, int status, int events);
void xfer_on_copy_wake(uv_async_t *h);
void xfer_on_idle(uv_idle_t *h);
void xfer_on_prepare(uv_prepare_t *h);
void xfer_on_tick(uv_timer_t *h);

#endif /* TD_XFER_INT_H */
