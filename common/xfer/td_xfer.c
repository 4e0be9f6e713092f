/*
 * td_xfer: KV-cache transfer over UCX (see td_xfer.h for the API, docs/xfer.md for the
 * protocol and the choice of primitive).
 *
 * Wire: three active messages on one endpoint per (sender, receiver) pair.
 *   DATA  header am_data_hdr, payload = K/V bytes of n_blocks contiguous destination
 *         blocks of one layer. Large payloads go by UCX rendezvous: the receiver's handler
 *         checks the lease and then ucp_am_recv_data_nbx()s straight into the registered
 *         pool, so the bytes land zero-copy where they belong, and a message for a dead
 *         lease is refused before a byte is written (the fence).
 *   READY header am_ready_hdr (kv-ready), no payload, sent after every DATA completed.
 *   ACK   header am_ack_hdr, receiver -> sender: the verdict on READY.
 * Why AM and not ucp_put: over TCP, UCX 1.13 emulates RMA with AM at ~0.65 GB/s while AM
 * rendezvous runs at the wire's ~4 GB/s; on shared memory rendezvous uses CMA/mapped
 * copies. And an RMA put into a block cannot be fenced once its lease died.
 *
 * Progress: drain() = ucp_worker_progress until idle, then the deferred work (posting
 * queued operations, user callbacks), then ucp_worker_arm; run from uv_poll on the
 * worker's efd and from a uv_prepare just before the loop sleeps. UCX callbacks only
 * record facts; nothing calls back into UCX progress or into the user from inside them.
 * Work per loop iteration is bounded (PROGRESS_MAX progress calls, loop_budget_bytes of
 * our own copies and checksums, a receiver's adoption included: xfer_adopt_run); what is left
 * goes next iteration, which an active idle handle makes come without sleeping. Shutdown
 * (td_xfer_destroy, xfer_close_step) is driven the same way: no function here waits.
 *
 * Files (each opens with what it owns; td_xfer_int.h holds the structs they share):
 *   td_xfer.c        the UCX context, worker and listener, the wire helpers every side uses
 *                    (control messages, header unpacking, the block checksum), endpoint
 *                    closes, configuration, and the lifecycle: td_xfer_create, shutdown
 *   td_xfer_loop.c   progress on the libuv loop: drain, the deferred work, the per-iteration
 *                    budget, the deadline tick
 *   td_xfer_pool.c   the receiver's registered pool and its description
 *   td_xfer_lease.c  leases: creation, cancel, death and the return of their blocks
 *   td_xfer_adopt.c  adoption, the resumable per-iteration job after kv-ready
 *   td_xfer_recv.c   the receiving side: accepted endpoints and the receiver's AM handlers
 *   td_xfer_peer.c   the sender's peers: connect, hello, the choice of put or AM, peer loss
 *   td_xfer_send.c   the sending side: sends, their operations, READY, verdicts, aborts
 *   td_xfer_stage.c  the staging ring device-memory sources are copied through
 */
#include "td_xfer_int.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_util.h"

const double td_xfer_hist_le_s[TD_XFER_HIST_BUCKETS] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                                        0.01,   0.025,   0.05,   0.1,   1.0,    1e300};

td_status_t xfer_ucx_err(ucs_status_t st, const char *what)
{
    return td_errorf(TD_ERR_UCX, "ucx %s: %s", what, ucs_status_string(st));
}

/* Order-independent checksum of one block: 64-bit multiply-xor over 8-byte words, keyed
 * by (layer, index in the request) so swapped blocks do not cancel out. */
uint64_t xfer_block_checksum(const void *p, size_t n, uint32_t layer, uint32_t idx)
{
    const uint8_t *b = p;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (((uint64_t)layer << 32) | idx);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    for (; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    h ^= h >> 32;
    return h * 0xff51afd7ed558ccdull;
}

static void close_ep_done_cb(void *request, ucs_status_t status, void *user_data)
{
    td_xfer_t *x = user_data;
    x->closes_inflight--;
    ucp_request_free(request);
}

/* Force-closes an endpoint from outside UCX callbacks: outstanding operations on it end
 * with errors through their callbacks. Without a worker-progress loop (never recurse
 * into progress); the close request frees itself. */
static void close_ep_now(td_xfer_t *x, ucp_ep_h ep)
{
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                                               UCP_OP_ATTR_FIELD_USER_DATA,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE,
                               .cb.send = close_ep_done_cb,
                               .user_data = x};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &prm);
    /* NULL: closed; error: gone already; request: frees itself in the callback */
    if (r && !UCS_PTR_IS_ERR(r))
        x->closes_inflight++;
}

/* Callable anywhere, including inside UCX callbacks: the close happens in drain(). */
void xfer_close_ep_force(td_xfer_t *x, ucp_ep_h ep)
{
    ep_close_t *c = malloc(sizeof *c);
    if (!c) {
        close_ep_now(x, ep); /* last resort */
        return;
    }
    c->ep = ep;
    td_list_push_back(&x->closing, &c->link);
}

void xfer_close_pending_eps(td_xfer_t *x)
{
    while (!td_list_empty(&x->closing)) {
        ep_close_t *c = TD_CONTAINER_OF(x->closing.next, ep_close_t, link);
        td_list_remove(&c->link);
        close_ep_now(x, c->ep);
        free(c);
    }
}

/* The reply endpoint a message came on (NULL when UCX gives none). */
ucp_ep_h xfer_am_reply_ep(const ucp_am_recv_param_t *param)
{
    return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
}

/* Every handler's first step: the header must be exactly one `size`-byte header of its
 * kind (and, for messages only a receiver takes, a pool must be registered); it is copied
 * out (UCX gives no alignment). A malformed message is counted and ignored. */
bool xfer_am_unpack(td_xfer_t *x, const void *header, size_t header_length, void *h, size_t size,
                    bool need_pool)
{
    if (header_length != size || (need_pool && !x->have_pool)) {
        x->stats.fail_protocol++;
        return false;
    }
    memcpy(h, header, size);
    return true;
}

/* ---- acks ------------------------------------------------------------------------------- */

typedef struct ack_op {
    am_ack_hdr_t hdr;
} ack_op_t;

static void ack_sent_cb(void *request, ucs_status_t status, void *user_data)
{
    free(user_data);
    ucp_request_free(request);
}

/* Sends a header-only control message (REPLY: the far side learns our endpoint). A lost
 * one is bounded by the deadlines of whoever waits for it. */
static void send_ctl_hdr(td_xfer_t *x, ucp_ep_h ep, unsigned id, const am_ack_hdr_t *hdr)
{
    if (!ep)
        return;
    ack_op_t *a = malloc(sizeof *a);
    if (!a)
        return; /* the sender's deadline ends its wait */
    a->hdr = *hdr;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .cb.send = ack_sent_cb,
                               .user_data = a,
                               .flags = UCP_AM_SEND_FLAG_REPLY};
    ucs_status_ptr_t r = ucp_am_send_nbx(ep, id, &a->hdr, sizeof a->hdr, NULL, 0, &prm);
    if (r == NULL || UCS_PTR_IS_ERR(r))
        free(a);
}

void xfer_send_ctl(td_xfer_t *x, ucp_ep_h ep, unsigned id, uint64_t a_, uint64_t b, td_status_t st)
{
    send_ctl_hdr(x, ep, id, &(am_ack_hdr_t){.request_id = a_, .lease_id = b, .status = st});
}

void xfer_send_bind(td_xfer_t *x, ucp_ep_h ep, uint64_t request_id, uint64_t lease_id,
                    const td_xfer_token_t *token)
{
    send_ctl_hdr(x, ep, AM_BIND, &(am_ack_hdr_t){.request_id = request_id, .lease_id = lease_id, .token = *token});
}

void xfer_send_ack(td_xfer_t *x, ucp_ep_h ep, uint64_t request_id, uint64_t lease_id, td_status_t st)
{
    xfer_send_ctl(x, ep, AM_ACK, request_id, lease_id, st);
}

/* ---- lifetime --------------------------------------------------------------------------- */

uint64_t td_xfer_request_key(const char *request_id)
{
    /* Not TD_FNV1A64_INIT: this start value (the standard basis less its last digit) is
     * what nodes have always computed, so the keys stay the same. */
    return td_fnv1a64(1469598103934665603ull, request_id, strlen(request_id));
}

td_xfer_config_t td_xfer_config_default(void)
{
    return (td_xfer_config_t){.name = "tandem",
                              .listen_ip = "127.0.0.1",
                              .listen_port = 0,
                              .max_inflight_ops = 64,
                              .send_timeout_ms = 30000,
                              .tick_ms = 10,
                              .rma = TD_XFER_RMA_AUTO,
                              .quarantine_ms = 10000,
                              .put_nt_min = (size_t)16 << 10,
                              .staging_bytes = (size_t)64 << 20,
                              .max_op_bytes = (size_t)4 << 20,
                              .loop_budget_bytes = (size_t)8 << 20};
}

td_status_t td_xfer_rma_parse(const char *s, td_xfer_rma_t *rma_p)
{
    if (!strcmp(s, "auto"))
        *rma_p = TD_XFER_RMA_AUTO;
    else if (!strcmp(s, "put"))
        *rma_p = TD_XFER_RMA_PUT;
    else if (!strcmp(s, "am"))
        *rma_p = TD_XFER_RMA_AM;
    else
        return td_errorf(TD_ERR_INVALID, "xfer rma: '%s' is not auto, put or am", s);
    return TD_OK;
}

static void on_handle_closed(uv_handle_t *h)
{
    td_xfer_t *x = h->data;
    if (--x->open_handles == 0)
        free(x);
}

static td_status_t set_am_handler(td_xfer_t *x, unsigned id, ucp_am_recv_callback_t cb)
{
    ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = id,
                                 .cb = cb,
                                 .flags = UCP_AM_FLAG_WHOLE_MSG,
                                 .arg = x};
    ucs_status_t st = ucp_worker_set_am_recv_handler(x->worker, &hp);
    return st == UCS_OK ? TD_OK : xfer_ucx_err(st, "set am handler");
}

td_status_t td_xfer_create(uv_loop_t *loop, const td_xfer_config_t *cfg, td_xfer_t **x_p)
{
    td_status_t ret = TD_OK;
    ucs_status_t st;
    if (cfg->max_inflight_ops == 0 || cfg->send_timeout_ms == 0 || cfg->tick_ms == 0 || cfg->quarantine_ms == 0 ||
        cfg->max_op_bytes == 0 || cfg->loop_budget_bytes == 0)
        return td_errorf(TD_ERR_INVALID, "xfer config: max_inflight_ops, send_timeout_ms, tick_ms, quarantine_ms, "
                         "max_op_bytes and loop_budget_bytes must be > 0");
    if (cfg->d2h && (!cfg->d2h->start || !cfg->d2h->poll || !cfg->d2h->pin != !cfg->d2h->unpin))
        return td_errorf(TD_ERR_INVALID, "xfer config: a d2h copier needs start and poll, and pin with unpin or "
                         "neither");
    td_xfer_t *x = calloc(1, sizeof *x);
    if (!x)
        return td_errorf(TD_ERR_NOMEM, "xfer: out of memory");
    x->loop = loop;
    x->cfg = *cfg;
    snprintf(x->name, sizeof x->name, "%s", cfg->name ? cfg->name : "tandem");
    x->cfg.name = x->name;
    td_list_init(&x->leases);
    td_list_init(&x->conns);
    td_list_init(&x->adopting);
    td_list_init(&x->ready_list);
    td_list_init(&x->peers);
    td_list_init(&x->queue);
    td_list_init(&x->stage_pieces);
    td_list_init(&x->copying);
    td_list_init(&x->done_list);
    td_list_init(&x->closing);
    td_list_init(&x->aborts);
    if (td_hash_init(&x->lease_ids, 0) != TD_OK) {
        ret = td_errorf(TD_ERR_NOMEM, "xfer: out of memory");
        goto err_free;
    }

    ucp_config_t *ucfg;
    st = ucp_config_read(NULL, NULL, &ucfg);
    if (st != UCS_OK) {
        ret = xfer_ucx_err(st, "read config");
        goto err_lease_ids;
    }
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
                      .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                      .name = x->name};
    st = ucp_init(&p, ucfg, &x->ctx);
    ucp_config_release(ucfg);
    if (st != UCS_OK) {
        ret = xfer_ucx_err(st, "init");
        goto err_lease_ids;
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    st = ucp_worker_create(x->ctx, &wp, &x->worker);
    if (st != UCS_OK) {
        ret = xfer_ucx_err(st, "create worker");
        goto err_ctx;
    }
    if ((ret = set_am_handler(x, AM_DATA, xfer_am_data_cb)) != TD_OK ||
        (ret = set_am_handler(x, AM_READY, xfer_am_ready_cb)) != TD_OK ||
        (ret = set_am_handler(x, AM_ACK, xfer_am_ack_cb)) != TD_OK ||
        (ret = set_am_handler(x, AM_HELLO, xfer_am_hello_cb)) != TD_OK ||
        (ret = set_am_handler(x, AM_HELLO_ACK, xfer_am_hello_ack_cb)) != TD_OK ||
        (ret = set_am_handler(x, AM_BIND, xfer_am_bind_cb)) != TD_OK ||
        (ret = set_am_handler(x, AM_BIND_ACK, xfer_am_bind_ack_cb)) != TD_OK ||
        (ret = set_am_handler(x, AM_ABORT, xfer_am_abort_cb)) != TD_OK ||
        (ret = set_am_handler(x, AM_ABORT_ACK, xfer_am_abort_ack_cb)) != TD_OK)
        goto err_worker;
    if (cfg->listen_ip) {
        struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(cfg->listen_port)};
        if (inet_pton(AF_INET, cfg->listen_ip, &sin.sin_addr) != 1) {
            ret = td_errorf(TD_ERR_INVALID, "xfer: listen address %s is not an IPv4 address", cfg->listen_ip);
            goto err_worker;
        }
        ucp_listener_params_t lp = {.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                                                  UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
                                    .sockaddr = {(struct sockaddr *)&sin, sizeof sin},
                                    .conn_handler = {xfer_conn_cb, x}};
        st = ucp_listener_create(x->worker, &lp, &x->listener);
        if (st != UCS_OK) {
            ret = td_errorf(TD_ERR_UCX, "xfer: listen on %s:%u: %s", cfg->listen_ip, cfg->listen_port,
                            ucs_status_string(st));
            goto err_worker;
        }
        ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
        st = ucp_listener_query(x->listener, &la);
        if (st != UCS_OK) {
            ret = xfer_ucx_err(st, "query listener");
            goto err_listener;
        }
        x->listen_ip = sin.sin_addr.s_addr;
        if (cfg->advertise_ip && inet_pton(AF_INET, cfg->advertise_ip, &x->listen_ip) != 1) {
            ret = td_errorf(TD_ERR_INVALID, "xfer: advertise address %s is not an IPv4 address", cfg->advertise_ip);
            goto err_listener;
        }
        x->listen_port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    }
    st = ucp_worker_get_efd(x->worker, &x->efd);
    if (st != UCS_OK) {
        ret = xfer_ucx_err(st, "worker efd");
        goto err_listener;
    }
    uv_poll_init(loop, &x->poll, x->efd);
    uv_prepare_init(loop, &x->prepare);
    uv_timer_init(loop, &x->timer);
    uv_idle_init(loop, &x->idle);
    uv_async_init(loop, &x->copy_wake, xfer_on_copy_wake);
    x->poll.data = x->prepare.data = x->timer.data = x->idle.data = x->copy_wake.data = x;
    x->open_handles = 5;
    uv_poll_start(&x->poll, UV_READABLE, xfer_on_poll);
    uv_prepare_start(&x->prepare, xfer_on_prepare);
    uv_timer_start(&x->timer, xfer_on_tick, cfg->tick_ms, cfg->tick_ms);
    *x_p = x;
    return TD_OK;

err_listener:
    if (x->listener)
        ucp_listener_destroy(x->listener);
err_worker:
    ucp_worker_destroy(x->worker);
err_ctx:
    ucp_cleanup(x->ctx);
err_lease_ids:
    td_hash_free(&x->lease_ids);
err_free:
    free(x);
    return ret;
}

void td_xfer_get_stats(const td_xfer_t *x, td_xfer_stats_t *stats)
{
    *stats = x->stats;
}

/* ---- shutdown: started by td_xfer_destroy, run by the loop ------------------------------ */

/* Bounds of the shutdown phases (td_xfer.h, td_xfer_destroy), and the period of the timer
 * that watches them (the deadline tick, shortened: a test or node may run it rarely). */
#define CLOSE_FLUSH_NS 1000000000ull  /* sender endpoints: verdicts on their way */
#define CLOSE_EPS_NS 5000000000ull    /* force closes: a few progress calls normally */
#define CLOSE_COPIES_NS 2000000000ull /* device-to-host copies writing into the ring */
#define CLOSE_TICK_MS 10u

/* The last step: nothing of UCX is in flight any more, or its bound passed. The order is
 * what makes it safe: the poll handle stops watching the worker's fd before the worker
 * closes it; rkeys go before the worker they were unpacked on; the worker goes before
 * anything the callbacks of its outstanding requests touch (ops, sends, leases, x), which
 * destroying it may still call; only then do leases return their blocks (nothing can
 * write into them) and the ring go (unless a copy still writes there: then the ring and x
 * are leaked, and the wake handle is left open but unreferenced, so the loop can end).
 * The unmap of a pool UCX allocated hands its pages back to the kernel: the one step
 * proportional to the pool, once per process, at its end (docs/xfer.md). */
static void close_finish(td_xfer_t *x)
{
    x->close_phase = CLOSE_DONE;
    bool ring_busy = !td_list_empty(&x->copying);
    if (ring_busy)
        td_warn("xfer %s: device-to-host copies did not finish within %llu s; the staging ring and this td_xfer "
                "are leaked, not freed under them", x->name, CLOSE_COPIES_NS / 1000000000ull);
    else if (x->cfg.d2h && x->cfg.d2h->quiesce)
        x->cfg.d2h->quiesce(x->cfg.d2h->arg); /* no wake still to come into copy_wake */
    uv_close((uv_handle_t *)&x->poll, on_handle_closed); /* stops watching the efd now */
    TD_LIST_FOREACH(pn, &x->peers) {
        td_xfer_peer_t *peer = TD_CONTAINER_OF(pn, td_xfer_peer_t, link);
        if (peer->rkey)
            ucp_rkey_destroy(peer->rkey);
        peer->rkey = NULL;
    }
    if (x->listener) {
        ucp_listener_destroy(x->listener);
        x->listener = NULL;
    }
    ucp_worker_destroy(x->worker);
    x->worker = NULL;
    if (x->have_pool) {
        ucp_rkey_buffer_release(x->rkey_buf);
        ucp_mem_unmap(x->ctx, x->memh);
    }
    ucp_cleanup(x->ctx);
    x->ctx = NULL;
    while (!td_list_empty(&x->aborts)) {
        abort_job_t *j = TD_CONTAINER_OF(x->aborts.next, abort_job_t, link);
        td_list_remove(&j->link);
        free(j);
    }
    td_list_init(&x->done_list); /* its sends are on their peers' lists */
    while (!td_list_empty(&x->peers)) {
        td_xfer_peer_t *peer = TD_CONTAINER_OF(x->peers.next, td_xfer_peer_t, link);
        while (!td_list_empty(&peer->sends)) /* callbacks made or not owed (td_xfer_destroy) */
            xfer_send_free(TD_CONTAINER_OF(peer->sends.next, td_xfer_send_t, peer_link));
        td_list_remove(&peer->link);
        free(peer->rkey_buf);
        free(peer);
    }
    while (!td_list_empty(&x->conns)) {
        xfer_conn_t *c = TD_CONTAINER_OF(x->conns.next, xfer_conn_t, link);
        td_list_remove(&c->link);
        free(c);
    }
    while (!td_list_empty(&x->closing)) { /* their endpoints went with the worker */
        ep_close_t *c = TD_CONTAINER_OF(x->closing.next, ep_close_t, link);
        td_list_remove(&c->link);
        free(c);
    }
    TD_ASSERT(td_list_empty(&x->adopting)); /* td_xfer_destroy stopped them; none starts after */
    while (!td_list_empty(&x->leases)) {
        xfer_lease_t *l = TD_CONTAINER_OF(x->leases.next, xfer_lease_t, link);
        l->inflight = 0; /* the worker is gone: nothing writes any more */
        l->put_writer = NULL;
        xfer_lease_release(x, l);
    }
    td_hash_free(&x->lease_ids);
    while (!td_list_empty(&x->ready_list)) {
        ready_event_t *ev = TD_CONTAINER_OF(x->ready_list.next, ready_event_t, link);
        td_list_remove(&ev->link);
        td_kv_unref_blocks_for(x->pool.kv, TD_KV_HOLDER_LANDED, ev->r.blocks, ev->r.n_blocks);
        free(ev);
    }
    free(x->landing_stack);
    x->landing_stack = NULL;
    if (!ring_busy) {
        while (!td_list_empty(&x->stage_pieces)) { /* UCX is gone: nothing reads the ring */
            stage_piece_t *pc = TD_CONTAINER_OF(x->stage_pieces.next, stage_piece_t, link);
            td_list_remove(&pc->link);
            free(pc);
        }
        if (x->stage_pinned)
            x->cfg.d2h->unpin(x->cfg.d2h->arg, x->stage);
        free(x->stage);
        x->stage = NULL;
    }
    uv_close((uv_handle_t *)&x->prepare, on_handle_closed);
    uv_close((uv_handle_t *)&x->timer, on_handle_closed);
    uv_close((uv_handle_t *)&x->idle, on_handle_closed);
    if (!ring_busy)
        uv_close((uv_handle_t *)&x->copy_wake, on_handle_closed); /* the last close frees x */
    else
        uv_unref((uv_handle_t *)&x->copy_wake); /* a late wake finds CLOSE_DONE */
}

/* One step of shutdown, after a drain: each phase ends when what it waits for is back or
 * its deadline passed (the timer runs every CLOSE_TICK_MS meanwhile). Never waits. */
void xfer_close_step(td_xfer_t *x)
{
    uint64_t now = td_now_ns();
    switch (x->close_phase) {
    case CLOSE_FLUSH: /* sender endpoints flushed, receiver endpoints closing (closes_inflight) */
        if (x->closes_inflight > 0 && now < x->close_deadline_ns)
            return;
        TD_LIST_FOREACH(n, &x->conns) {
            xfer_conn_t *c = TD_CONTAINER_OF(n, xfer_conn_t, link);
            if (!c->closing) {
                c->closing = true;
                xfer_close_ep_force(x, c->ep);
            }
        }
        xfer_close_pending_eps(x);
        x->close_phase = CLOSE_EPS;
        x->close_deadline_ns = now + CLOSE_EPS_NS;
        /* fall through */
    case CLOSE_EPS: /* force closes: outstanding operations come back with errors */
        if (x->closes_inflight > 0 && now < x->close_deadline_ns)
            return;
        x->close_phase = CLOSE_COPIES;
        x->close_deadline_ns = now + CLOSE_COPIES_NS;
        /* fall through */
    case CLOSE_COPIES: /* a copy still running writes into the ring: it must end first */
        xfer_poll_copies(x); /* done ones are dropped: their peers are closed */
        if (!td_list_empty(&x->copying) && now < x->close_deadline_ns)
            return;
        close_finish(x);
        return;
    case CLOSE_DONE:
        return;
    }
}

void td_xfer_destroy(td_xfer_t *x)
{
    if (!x)
        return;
    TD_ASSERT(!x->destroying);
    x->destroying = true;
    x->cfg.max_inflight_ops = 0; /* run_deferred posts nothing more */
    x->on_ready = NULL;          /* adoptions not yet delivered return their blocks */
    /* Adoptions in progress stop: their senders are told UNAVAILABLE (the flush below
     * delivers it), their blocks return as any dead lease's. Nothing is copied any more. */
    while (!td_list_empty(&x->adopting))
        xfer_lease_fail(x, TD_CONTAINER_OF(x->adopting.next, xfer_lease_t, adopt_link), TD_ERR_UNAVAILABLE);
    /* No new senders: xfer_conn_cb rejects them from now on. The listener itself goes in
     * close_finish, after the loop has progressed the worker for a while: destroying it here,
     * while UCX's async thread may still be handling a connection request (one nobody
     * progressed yet), crashed UCX 1.13 in ucp_cm_server_conn_request_cb (test_decode_sched
     * under ASan, about 1 run in 3). */
    /* Fail every send; endpoints to receivers are queued for a force close (xfer_peer_fail). */
    TD_LIST_FOREACH(pn, &x->peers)
        xfer_peer_fail(TD_CONTAINER_OF(pn, td_xfer_peer_t, link), TD_ERR_CLOSED);
    /* The done callbacks owed, now: none comes after this returns. A send whose operations
     * UCX still holds is freed from the loop once they are back (or with the worker). */
    TD_LIST_FOREACH(pn, &x->peers) {
        td_xfer_peer_t *peer = TD_CONTAINER_OF(pn, td_xfer_peer_t, link);
        TD_LIST_FOREACH(m, &peer->sends) {
            td_xfer_send_t *s = TD_CONTAINER_OF(m, td_xfer_send_t, peer_link);
            xfer_send_set_status(s, TD_ERR_CLOSED);
            s->verdict = true;
            bool owed = s->finished && s->p.done;
            td_xfer_done_cb cb = s->p.done;
            s->p.done = NULL;
            s->finished = true;
            xfer_send_maybe_done(s);
            if (owed) {
                xfer_send_count(x, s);
                x->delivered++;
                cb(s->p.arg, s->p.request_id, s->status);
            }
        }
    }
    /* Verdicts (ACKs) still on their way to senders are delivered before the endpoints
     * go: flush each sender endpoint, bounded by CLOSE_FLUSH_NS (xfer_close_step). */
    TD_LIST_FOREACH(n, &x->conns) {
        xfer_conn_t *c = TD_CONTAINER_OF(n, xfer_conn_t, link);
        if (c->closing)
            continue;
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                                   .cb.send = close_ep_done_cb,
                                   .user_data = x};
        ucs_status_ptr_t r = ucp_ep_flush_nbx(c->ep, &prm);
        if (r && !UCS_PTR_IS_ERR(r))
            x->closes_inflight++;
    }
    x->close_phase = CLOSE_FLUSH;
    x->close_deadline_ns = td_now_ns() + CLOSE_FLUSH_NS;
    uint32_t tick = TD_MIN(x->cfg.tick_ms, CLOSE_TICK_MS);
    uv_timer_start(&x->timer, xfer_on_tick, tick, tick);
    uv_idle_start(&x->idle, xfer_on_idle); /* the loop comes round at once, not at the next event */
}
