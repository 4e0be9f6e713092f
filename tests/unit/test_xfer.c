/*
 * test_xfer: the KV data plane between two real processes on loopback, over TCP and over
 * shared memory, and its failure cases: a receiver SIGKILLed mid-transfer, a sender
 * SIGKILLed mid-transfer, kv-ready (and late data) after the lease expired, a layout
 * mismatch at connect.
 *
 * Each test forks before any UCX initialisation; the helper process never calls
 * Criterion (it reports through a pipe and its exit status). Both sides derive the same
 * request plan and KV bytes from a seed, so the receiver checks every adopted block
 * byte for byte on its own.
 */
#include <criterion/criterion.h>
#include <pthread.h>

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <sys/mount.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "td_node_copier.h"
#include "td_backend.h"
#include "td_kv.h"
#include "td_util.h"
#include "td_xfer.h"
#include "td_xfer_testkit.h"

#define MAX_REQ 64

static const td_kv_layout_t LAYOUT = {.model_fingerprint = 0x7e57u,
                                      .dtype = TD_F16,
                                      .block_size = 16,
                                      .n_layers = 4,
                                      .n_kv_heads = 2,
                                      .head_dim = 8,
                                      .version = TD_KV_LAYOUT_VERSION};

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The KV bytes of block `idx` of request `req` in `layer` (K and V, whole block). */
static void fill_block(void *dst, size_t n, uint64_t seed, uint64_t req, uint32_t layer, uint32_t idx)
{
    uint64_t s = seed * 1000003u ^ req * 7919u ^ ((uint64_t)layer << 40) ^ ((uint64_t)idx << 20);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t w = splitmix(&s);
        memcpy((char *)dst + i, &w, TD_MIN(8, n - i));
    }
}

/* Mixed lengths 1..4096 tokens: the edges explicitly, then log-uniform. */
static uint32_t plan_tokens(uint64_t seed, int i)
{
    static const uint32_t edges[] = {1, 4096, 16, 17, 15, 32, 33, 4095};
    if (i < (int)TD_ARRAY_LEN(edges))
        return edges[i];
    uint64_t s = seed ^ (uint64_t)i << 32;
    uint32_t bits = 1 + (uint32_t)(splitmix(&s) % 12);
    return 1 + (uint32_t)(splitmix(&s) % (1u << bits)) % 4096;
}

/* What the receiver tells the sender: its description and the leases. */
typedef struct lease_msg {
    uint64_t request_id;
    uint64_t lease_id;
    td_xfer_token_t token;
    uint32_t n_tokens;
    int32_t n_blocks;
    int32_t blocks[4096 / 16 + 4];
} lease_msg_t;

typedef struct offer {
    uint8_t desc[TD_XFER_DESC_MAX];
    size_t desc_len;
    int n_req;
    lease_msg_t lease[MAX_REQ];
} offer_t;

static void run_until(uv_loop_t *loop, const bool *flag, double timeout_s)
{
    double end = td_now_s() + timeout_s;
    while (!*flag && td_now_s() < end)
        uv_run(loop, UV_RUN_ONCE);
}

/* After td_xfer_destroy: its shutdown runs on the loop, which returns once x's handles
 * have closed (bounded: docs/xfer.md, "Shutdown"). */
static void close_loop(uv_loop_t *loop)
{
    uv_run(loop, UV_RUN_DEFAULT);
    uv_loop_close(loop);
}

/* ---- receiver ------------------------------------------------------------------------- */

typedef struct rx {
    uv_loop_t loop;
    td_kv_cache_t *kv;
    void *pool;
    uint32_t n_blocks;
    td_xfer_t *x;
    uint64_t seed;
    int adopted, bad;
    int want;
    bool all_in;
    bool ucx_pool; /* pool allocated by td_xfer (UCX), not ours to free */
    td_backend_t *be; /* device pool: the pool is this backend's memory, filled from td_xfer's
                         landing area with its copy_h2d */
    uint64_t copied;  /* bytes copy_h2d moved */
    uint64_t fail_copy_after; /* copy_h2d fails once it would pass this many bytes (0: never) */
    offer_t offer;
} rx_t;

/* The backend's host-to-device copy, as a decode node hands it to td_xfer. */
static td_status_t rx_copy_h2d(void *arg, void *dst, const void *src, size_t bytes)
{
    rx_t *rx = arg;
    if (rx->fail_copy_after && rx->copied + bytes > rx->fail_copy_after)
        return td_errorf(TD_ERR_IO, "test copy_h2d: the device is gone");
    rx->copied += bytes;
    return rx->be->ops->copy_h2d(rx->be, dst, src, bytes);
}

static void rx_on_ready(void *arg, const td_xfer_ready_t *r)
{
    rx_t *rx = arg;
    size_t bb = td_kv_block_bytes(&LAYOUT);
    uint8_t *want = malloc(bb);
    uint32_t n_used = TD_DIV_CEIL(r->n_tokens, LAYOUT.block_size);
    for (uint32_t layer = 0; layer < LAYOUT.n_layers; layer++)
        for (uint32_t i = 0; i < n_used; i++) {
            fill_block(want, bb, rx->seed, r->request_id, layer, i);
            const uint8_t *got = (uint8_t *)rx->pool + td_kv_block_offset(&LAYOUT, rx->n_blocks, layer,
                                                                          (uint32_t)r->blocks[i]);
            if (memcmp(got, want, bb) != 0) {
                fprintf(stderr, "receiver: request %lu layer %u block %u (id %d) differs\n",
                        (unsigned long)r->request_id, layer, i, r->blocks[i]);
                rx->bad++;
            }
        }
    free(want);
    td_kv_unref_blocks_for(rx->kv, TD_KV_HOLDER_LANDED, r->blocks, r->n_blocks);
    rx->adopted++;
    if (rx->adopted >= rx->want)
        rx->all_in = true;
}

static int rx_init_at(rx_t *rx, uint64_t seed, uint32_t n_blocks, const char *ip, uint32_t quarantine_ms,
                      uint32_t landing, const td_xfer_config_t *base);

static int rx_init(rx_t *rx, uint64_t seed, uint32_t n_blocks)
{
    return rx_init_at(rx, seed, n_blocks, "127.0.0.1", 0, 0, NULL);
}

/* landing: 0 for a host pool; else the pool is device memory (the CPU backend's) and
 * senders write a landing area of this many blocks. base: td_xfer's configuration (NULL:
 * the defaults); name, listener and quarantine_ms are set here. */
static int rx_init_at(rx_t *rx, uint64_t seed, uint32_t n_blocks, const char *ip, uint32_t quarantine_ms,
                      uint32_t landing, const td_xfer_config_t *base)
{
    memset(rx, 0, sizeof *rx);
    rx->seed = seed;
    rx->n_blocks = n_blocks;
    uv_loop_init(&rx->loop);
    td_kv_config_t kc = {.n_blocks = (int32_t)n_blocks, .block_size = (int32_t)LAYOUT.block_size};
    if (td_kv_cache_create(&kc, &rx->kv) != TD_OK)
        return 10;
    /* Over shared memory UCX allocates the pool (a mapped segment: the put path); over
     * TCP the pool is ours, registered. */
    const char *tls = getenv("UCX_TLS");
    rx->ucx_pool = !landing && tls && strstr(tls, "sm");
    td_cpu_config_t cc = {.n_threads = 1};
    if (landing) {
        if (td_backend_cpu_create(&cc, &rx->be) != TD_OK ||
            rx->be->ops->alloc(rx->be, td_kv_pool_bytes(&LAYOUT, n_blocks), &rx->pool) != TD_OK)
            return 14;
    } else if (!rx->ucx_pool) {
        rx->pool = calloc(1, td_kv_pool_bytes(&LAYOUT, n_blocks));
    }
    td_xfer_config_t cfg = base ? *base : td_xfer_config_default();
    cfg.name = "rx";
    cfg.listen_ip = ip;
    if (quarantine_ms)
        cfg.quarantine_ms = quarantine_ms;
    if ((!rx->ucx_pool && !rx->pool) || td_xfer_create(&rx->loop, &cfg, &rx->x) != TD_OK)
        return 11;
    td_xfer_pool_t pool = {.layout = LAYOUT, .base = rx->pool, .n_blocks = n_blocks, .kv = rx->kv,
                           .mem = landing ? TD_XFER_MEM_CUDA : TD_XFER_MEM_HOST, .landing_blocks = landing,
                           .copy_h2d = rx_copy_h2d, .copy_arg = rx};
    if (td_xfer_register_pool(rx->x, &pool, rx_on_ready, rx) != TD_OK)
        return 12;
    rx->pool = td_xfer_pool_base(rx->x);
    memset(rx->pool, 0, td_kv_pool_bytes(&LAYOUT, n_blocks));
    if (td_xfer_describe(rx->x, rx->offer.desc, sizeof rx->offer.desc, &rx->offer.desc_len) != TD_OK)
        return 13;
    return 0;
}

static int rx_lease(rx_t *rx, int n_req, uint32_t ttl_ms, bool fixed_small)
{
    for (int i = 0; i < n_req; i++) {
        lease_msg_t *m = &rx->offer.lease[i];
        m->request_id = 1000 + (uint64_t)i;
        m->n_tokens = fixed_small ? 40 : plan_tokens(rx->seed, i);
        m->n_blocks = (int32_t)TD_DIV_CEIL(m->n_tokens, LAYOUT.block_size) + (i % 3); /* + room to decode */
        if (td_xfer_lease_create(rx->x, m->request_id, m->n_blocks, ttl_ms, m->blocks, &m->lease_id, &m->token) != TD_OK)
            return 20;
    }
    rx->offer.n_req = n_req;
    rx->want = n_req;
    return 0;
}

static void rx_free(rx_t *rx)
{
    td_xfer_destroy(rx->x);
    close_loop(&rx->loop);
    td_kv_cache_destroy(rx->kv);
    if (rx->be) {
        rx->be->ops->free(rx->be, rx->pool);
        td_backend_destroy(rx->be);
    } else if (!rx->ucx_pool) {
        free(rx->pool);
    }
}

/* ---- sender --------------------------------------------------------------------------- */

typedef struct tx {
    uv_loop_t loop;
    td_xfer_t *x;
    td_xfer_peer_t *peer;
    uint8_t *pool;       /* [n_layers][n_blocks][block] the sender's own pool */
    uint32_t n_blocks;
    int32_t *src[MAX_REQ];
    int n_done;
    int n_want;
    td_status_t status[MAX_REQ];
    double done_at[MAX_REQ];
    bool all_done;
    td_backend_t *be;    /* device-memory source: the pool is backend memory, copied
                            through td_xfer's staging ring by the copier below */
    td_xfer_copier_t backend_copier; /* td_node_copier(be), as a node hands it over */
    td_xfer_copier_t copier;         /* what td_xfer gets: backend_copier, counting */
    uint64_t staged;     /* bytes the copier was asked to move */
    size_t pinned;       /* bytes the copier holds pinned (the ring, once allocated) */
    int pins;            /* pin calls */
    /* deferred: copies are done later by a thread of the test, as a GPU's copy engine
       does them: the bytes land only then, and the wake comes from that thread */
    bool deferred;
    pthread_t engine;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct tx_copy { void *dst; const void *src; size_t n; td_xfer_wake_cb wake; void *wake_arg; } jobs[512];
    uint64_t started, finished; /* tickets: started - finished jobs wait in jobs[] */
    bool stop;
    uint64_t copy_ns;    /* how long one deferred copy takes (0: 200 us); under mu */
    bool unpinned_while_copying; /* the ring was unpinned (so freed) under a running copy */
} tx_t;

/* ---- the sender's device-to-host copier ------------------------------------------------- */

static void *tx_copy_engine(void *arg)
{
    tx_t *tx = arg;
    pthread_mutex_lock(&tx->mu);
    for (;;) {
        while (!tx->stop && tx->finished == tx->started)
            pthread_cond_wait(&tx->cv, &tx->mu);
        if (tx->finished == tx->started)
            break;
        struct tx_copy j = tx->jobs[tx->finished % TD_ARRAY_LEN(tx->jobs)];
        uint64_t ns = tx->copy_ns ? tx->copy_ns : 200000;
        pthread_mutex_unlock(&tx->mu);
        nanosleep(&(struct timespec){.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)},
                  NULL); /* the copy takes a while */
        tx->be->ops->copy_d2h(tx->be, j.dst, j.src, j.n);
        pthread_mutex_lock(&tx->mu);
        tx->finished++;
        j.wake(j.wake_arg); /* under the lock: quiesce waits for it */
    }
    pthread_mutex_unlock(&tx->mu);
    return NULL;
}

static td_status_t tx_copy_start(void *arg, void *dst, const void *src, size_t bytes, td_xfer_wake_cb wake,
                                 void *wake_arg, uint64_t *ticket_p)
{
    tx_t *tx = arg;
    tx->staged += bytes;
    if (!tx->deferred)
        return tx->backend_copier.start(tx->backend_copier.arg, dst, src, bytes, wake, wake_arg, ticket_p);
    pthread_mutex_lock(&tx->mu);
    cr_assert_lt(tx->started - tx->finished, TD_ARRAY_LEN(tx->jobs), "more copies in flight than max_inflight_ops");
    tx->jobs[tx->started % TD_ARRAY_LEN(tx->jobs)] = (struct tx_copy){dst, src, bytes, wake, wake_arg};
    *ticket_p = tx->started++;
    pthread_cond_signal(&tx->cv);
    pthread_mutex_unlock(&tx->mu);
    return TD_OK;
}

static td_status_t tx_copy_poll(void *arg, uint64_t ticket)
{
    tx_t *tx = arg;
    if (!tx->deferred)
        return tx->backend_copier.poll(tx->backend_copier.arg, ticket);
    pthread_mutex_lock(&tx->mu);
    bool done = ticket < tx->finished;
    pthread_mutex_unlock(&tx->mu);
    return done ? TD_OK : TD_ERR_BUSY;
}

static void tx_copy_quiesce(void *arg)
{
    tx_t *tx = arg;
    if (!tx->deferred) {
        tx->backend_copier.quiesce(tx->backend_copier.arg);
        return;
    }
    pthread_mutex_lock(&tx->mu); /* a wake in progress holds it */
    pthread_mutex_unlock(&tx->mu);
}

static td_status_t tx_copy_pin(void *arg, void *host, size_t bytes)
{
    tx_t *tx = arg;
    tx->pins++;
    tx->pinned += bytes;
    return tx->backend_copier.pin(tx->backend_copier.arg, host, bytes);
}

static void tx_copy_unpin(void *arg, void *host)
{
    tx_t *tx = arg;
    if (tx->deferred) {
        pthread_mutex_lock(&tx->mu);
        tx->unpinned_while_copying |= tx->started != tx->finished;
        pthread_mutex_unlock(&tx->mu);
    }
    tx->pinned = 0;
    tx->backend_copier.unpin(tx->backend_copier.arg, host);
}

static void tx_on_done(void *arg, uint64_t request_id, td_status_t st)
{
    tx_t *tx = arg;
    int i = (int)(request_id % 1000);
    tx->status[i] = st;
    tx->done_at[i] = td_now_s();
    if (++tx->n_done >= tx->n_want)
        tx->all_done = true;
}

/* staging: 0 for a host source; else the source is device memory and td_xfer stages it
 * through a ring of this many bytes, with copies done at once (the CPU backend's) or, when
 * deferred, later by a thread (then nothing but the copier's wake brings the loop round:
 * the deadline tick is set beyond the test's bound). */
static int tx_init_mem(tx_t *tx, td_xfer_rma_t rma, size_t staging, bool deferred, size_t max_op_bytes,
                       size_t loop_budget)
{
    memset(tx, 0, sizeof *tx);
    uv_loop_init(&tx->loop);
    td_cpu_config_t cc = {.n_threads = 1};
    if (staging && td_backend_cpu_create(&cc, &tx->be) != TD_OK)
        return 32;
    td_xfer_config_t cfg = td_xfer_config_default();
    if (staging) {
        tx->backend_copier = td_node_copier(tx->be);
        tx->copier = (td_xfer_copier_t){.start = tx_copy_start, .poll = tx_copy_poll,
                                        .quiesce = tx_copy_quiesce, .pin = tx_copy_pin,
                                        .unpin = tx_copy_unpin, .arg = tx};
        cfg.staging_bytes = staging;
        cfg.d2h = &tx->copier;
    }
    if (deferred) {
        tx->deferred = true;
        pthread_mutex_init(&tx->mu, NULL);
        pthread_cond_init(&tx->cv, NULL);
        if (pthread_create(&tx->engine, NULL, tx_copy_engine, tx))
            return 33;
        cfg.tick_ms = 120000;
    }
    cfg.name = "tx";
    cfg.rma = rma;
    cfg.listen_ip = NULL;
    cfg.max_inflight_ops = 16;
    cfg.send_timeout_ms = 20000;
    cfg.put_nt_min = 2048; /* over shared memory: one-block runs by memcpy, longer ones by
                              non-temporal stores; the receiver checks every byte of both */
    if (max_op_bytes)
        cfg.max_op_bytes = max_op_bytes;
    if (loop_budget)
        cfg.loop_budget_bytes = loop_budget;
    return td_xfer_create(&tx->loop, &cfg, &tx->x) == TD_OK ? 0 : 30;
}

static int tx_init_rma(tx_t *tx, td_xfer_rma_t rma)
{
    return tx_init_mem(tx, rma, 0, false, 0, 0);
}

static int tx_init(tx_t *tx)
{
    return tx_init_rma(tx, TD_XFER_RMA_AUTO);
}

/* Lays out every request's source blocks (contiguous, with one swap in odd requests so
 * runs split) and fills them with the request's KV bytes. */
static int tx_fill(tx_t *tx, const offer_t *o, uint64_t seed)
{
    size_t bb = td_kv_block_bytes(&LAYOUT);
    uint32_t total = 0;
    for (int r = 0; r < o->n_req; r++)
        total += TD_DIV_CEIL(o->lease[r].n_tokens, LAYOUT.block_size);
    tx->n_blocks = total;
    void *pool = NULL;
    if (tx->be ? tx->be->ops->alloc(tx->be, td_kv_pool_bytes(&LAYOUT, total), &pool) != TD_OK
               : !(pool = malloc(td_kv_pool_bytes(&LAYOUT, total))))
        return 31;
    tx->pool = pool; /* the CPU backend's device memory is host memory: filled in place */
    uint32_t next = 0;
    for (int r = 0; r < o->n_req; r++) {
        uint32_t n = TD_DIV_CEIL(o->lease[r].n_tokens, LAYOUT.block_size);
        tx->src[r] = malloc(n * sizeof(int32_t));
        for (uint32_t i = 0; i < n; i++)
            tx->src[r][i] = (int32_t)(next + i);
        if ((r & 1) && n >= 4) {
            int32_t t = tx->src[r][n / 2];
            tx->src[r][n / 2] = tx->src[r][n / 2 + 1];
            tx->src[r][n / 2 + 1] = t;
        }
        next += n;
        for (uint32_t layer = 0; layer < LAYOUT.n_layers; layer++)
            for (uint32_t i = 0; i < n; i++)
                fill_block(tx->pool + td_kv_block_offset(&LAYOUT, total, layer, (uint32_t)tx->src[r][i]), bb, seed,
                           o->lease[r].request_id, layer, i);
    }
    return 0;
}

static const void *tx_layer(tx_t *tx, uint32_t layer)
{
    return tx->pool + td_kv_block_offset(&LAYOUT, tx->n_blocks, layer, 0);
}

static td_status_t tx_begin(tx_t *tx, const lease_msg_t *m, int r, td_xfer_send_t **s_p)
{
    td_xfer_send_params_t p = {.request_id = m->request_id,
                               .lease_id = m->lease_id,
                               .token = m->token,
                               .dst_blocks = m->blocks,
                               .n_dst_blocks = m->n_blocks,
                               .n_tokens = m->n_tokens,
                               .checksum = (r % 2) == 0,
                               .mem = tx->be ? TD_XFER_MEM_CUDA : TD_XFER_MEM_HOST,
                               .done = tx_on_done,
                               .arg = tx};
    return td_xfer_send_begin(tx->x, tx->peer, &p, s_p);
}

static void tx_free(tx_t *tx)
{
    td_xfer_destroy(tx->x);
    if (tx->deferred) {
        pthread_mutex_lock(&tx->mu);
        tx->stop = true;
        pthread_cond_signal(&tx->cv);
        pthread_mutex_unlock(&tx->mu);
        pthread_join(tx->engine, NULL);
    }
    close_loop(&tx->loop);
    for (int r = 0; r < MAX_REQ; r++)
        free(tx->src[r]);
    if (tx->be) {
        if (tx->pool)
            tx->be->ops->free(tx->be, tx->pool);
        td_backend_destroy(tx->be);
    } else {
        free(tx->pool);
    }
}

/* ---- two processes, many requests ----------------------------------------------------- */

typedef struct rx_report {
    int adopted, bad;
    int32_t free_after;
    uint64_t copied;
    td_xfer_stats_t stats;
} rx_report_t;

/* How a two-process run is set up beyond transport, primitive, seed and request count. */
typedef struct run_opts {
    const char *rx_ns, *tx_ns; /* network namespaces to enter, NULL: stay */
    const char *rx_ip;         /* the receiver's listener (default 127.0.0.1) */
    size_t staging;            /* sender: device-memory source through a ring this big, 0: host */
    bool deferred;             /* ... copied later by a thread, as a GPU's copy engine */
    uint32_t rx_landing;       /* receiver: device pool with a landing area this big, 0: host */
    size_t max_op_bytes;       /* sender: td_xfer_config_t.max_op_bytes, 0: default */
    size_t loop_budget;        /* sender: loop_budget_bytes, 0: default; set: the bytes sent per
                                  loop iteration are measured and checked against it */
} run_opts_t;

/* Counts, at every loop iteration (uv_check), the bytes the sender moved since the last. */
typedef struct turn_meter {
    uv_check_t h;
    td_xfer_t *x;
    uint64_t last;      /* bytes_sent at the previous iteration */
    uint64_t max_turn;  /* most bytes moved in one iteration */
    int moving_turns;   /* iterations that moved bytes */
} turn_meter_t;

static void turn_meter_cb(uv_check_t *h)
{
    turn_meter_t *m = h->data;
    td_xfer_stats_t st;
    td_xfer_get_stats(m->x, &st);
    uint64_t d = st.bytes_sent - m->last;
    m->last = st.bytes_sent;
    m->moving_turns += d > 0;
    m->max_turn = TD_MAX(m->max_turn, d);
}

/* wfd: the offer, then the report; rfd: the sender's "done" (a byte, or EOF). */
static void receiver_process(int wfd, int rfd, uint64_t seed, int n_req, const run_opts_t *ro)
{
    rx_t rx;
    int rc = rx_init_at(&rx, seed, 256 * 64 + 256, ro->rx_ip ? ro->rx_ip : "127.0.0.1", 0, ro->rx_landing, NULL);
    if (!rc)
        rc = rx_lease(&rx, n_req, 60000, false);
    if (rc)
        _exit(rc);
    td_xfer_testkit_write_all(wfd, &rx.offer, sizeof rx.offer);
    run_until(&rx.loop, &rx.all_in, 60);
    /* Serve until the sender has its verdicts: torn down at once, the endpoint's reset could
     * reach the sender's progress before the ACKs in its queue, failing adopted requests
     * as peer lost (about 1 run in 20 under load). */
    fcntl(rfd, F_SETFL, O_NONBLOCK);
    char c;
    bool never = false;
    double until = td_now_s() + 60;
    while (read(rfd, &c, 1) < 0 && errno == EAGAIN && td_now_s() < until)
        run_until(&rx.loop, &never, 0.01);
    rx_report_t rep = {.adopted = rx.adopted, .bad = rx.bad, .free_after = td_kv_available(rx.kv),
                       .copied = rx.copied};
    td_xfer_get_stats(rx.x, &rep.stats);
    rx_free(&rx);
    td_xfer_testkit_write_all(wfd, &rep, sizeof rep);
    _exit(0);
}

static bool enter_netns(const char *name);

static void many_requests_in(const char *tls, td_xfer_rma_t rma, uint64_t seed, int n_req, const run_opts_t *ro)
{
    const char *rx_ns = ro->rx_ns, *tx_ns = ro->tx_ns;
    size_t staging = ro->staging;
    td_xfer_testkit_env(tls);
    if (rx_ns)
        setenv("UCX_NET_DEVICES", "tdx0", 1); /* the veth end, named alike in both namespaces */
    int fds[2], back[2];
    cr_assert_eq(pipe(fds), 0);
    cr_assert_eq(pipe(back), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        close(fds[0]);
        close(back[1]);
        if (rx_ns && !enter_netns(rx_ns))
            _exit(40);
        receiver_process(fds[1], back[0], seed, n_req, ro);
    }
    close(fds[1]);
    close(back[0]);
    if (tx_ns)
        cr_assert(enter_netns(tx_ns), "cannot enter netns %s", tx_ns);
    static offer_t o;
    cr_assert(td_xfer_testkit_read_all(fds[0], &o, sizeof o), "receiver failed to start");
    tx_t tx;
    cr_assert_eq(tx_init_mem(&tx, rma, staging, ro->deferred, ro->max_op_bytes, ro->loop_budget), 0);
    cr_assert_eq(tx_fill(&tx, &o, seed), 0);
    tx.n_want = o.n_req;
    cr_assert_eq(td_xfer_connect(tx.x, o.desc, o.desc_len, &LAYOUT, &tx.peer), TD_OK, "%s", td_last_error());
    turn_meter_t meter = {.x = tx.x};
    if (ro->loop_budget) {
        uv_check_init(&tx.loop, &meter.h);
        meter.h.data = &meter;
        uv_check_start(&meter.h, turn_meter_cb);
    }
    /* Layer-major like a prefill batch: layer l of every request, then layer l+1. */
    td_xfer_send_t *s[MAX_REQ];
    for (int r = 0; r < o.n_req; r++)
        cr_assert_eq(tx_begin(&tx, &o.lease[r], r, &s[r]), TD_OK);
    for (uint32_t layer = 0; layer < LAYOUT.n_layers; layer++) {
        for (int r = 0; r < o.n_req; r++)
            cr_assert_eq(td_xfer_send_layer(s[r], layer, tx_layer(&tx, layer), tx.src[r]), TD_OK);
        uv_run(&tx.loop, UV_RUN_NOWAIT); /* the layer goes out while the next is "computed" */
    }
    for (int r = 0; r < o.n_req; r++)
        td_xfer_send_finish(s[r], 42 + r);
    run_until(&tx.loop, &tx.all_done, 60);
    td_xfer_testkit_write_all(back[1], "d", 1); /* the receiver may go */
    close(back[1]);
    cr_assert(tx.all_done, "only %d of %d requests finished", tx.n_done, tx.n_want);
    for (int r = 0; r < o.n_req; r++)
        cr_expect_eq(tx.status[r], TD_OK, "request %d (%u tokens): %s", r, o.lease[r].n_tokens,
                     td_strerror(tx.status[r]));
    td_xfer_stats_t st;
    td_xfer_get_stats(tx.x, &st);
    rx_report_t rep;
    cr_assert(td_xfer_testkit_read_all(fds[0], &rep, sizeof rep), "receiver died");
    int status;
    waitpid(pid, &status, 0);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    cr_expect_eq(rep.adopted, o.n_req);
    cr_expect_eq(rep.bad, 0, "%d blocks differ", rep.bad);
    cr_expect_eq(st.bytes_sent, rep.stats.bytes_received);
    cr_expect_eq(st.transfers_ok, (uint64_t)o.n_req);
    /* The primitive: put where forced or where the pool is mapped (sm), else AM. */
    bool want_put = rma == TD_XFER_RMA_PUT || (rma == TD_XFER_RMA_AUTO && strstr(tls, "sm"));
    cr_expect(want_put ? st.ops_put > 0 && st.ops_am == 0 : st.ops_am > 0 && st.ops_put == 0,
              "%s rma %d: %lu puts, %lu active messages", tls, (int)rma, (unsigned long)st.ops_put,
              (unsigned long)st.ops_am);
    cr_expect_eq(rep.stats.leases_adopted, (uint64_t)o.n_req);
    cr_expect_eq(rep.stats.leases_live, 0);
    cr_expect_eq(rep.free_after, 256 * 64 + 256, "blocks not returned: %d free", rep.free_after);
    if (ro->rx_landing) {
        cr_expect_eq(rep.stats.landing_free, ro->rx_landing, "landing blocks not returned: %u free",
                     rep.stats.landing_free);
        cr_expect_eq(rep.copied, rep.stats.bytes_received, "every landed byte is copied into the pool once: "
                     "%lu copied, %lu received", (unsigned long)rep.copied, (unsigned long)rep.stats.bytes_received);
        cr_expect_eq(rep.stats.bytes_copied_h2d, rep.copied);
    }
    if (ro->loop_budget) {
        /* A loop iteration (check to check) spans at most two budget windows (prepare to
         * prepare); one operation is at most max_op_bytes <= the budget. Unbounded, one
         * callback would copy a whole queued layer. */
        uv_close((uv_handle_t *)&meter.h, NULL);
        cr_expect_leq(meter.max_turn, 2 * ro->loop_budget, "%lu bytes moved in one loop iteration, budget %zu",
                      (unsigned long)meter.max_turn, ro->loop_budget);
        cr_expect_geq((uint64_t)meter.moving_turns, st.bytes_sent / (2 * ro->loop_budget),
                      "%lu bytes in %d loop iterations", (unsigned long)st.bytes_sent, meter.moving_turns);
        cr_expect_geq(st.ops_put + st.ops_am, st.bytes_sent / ro->max_op_bytes, "operations of %zu bytes at most: "
                      "%lu operations for %lu bytes", ro->max_op_bytes, (unsigned long)(st.ops_put + st.ops_am),
                      (unsigned long)st.bytes_sent);
    }
    if (staging) {
        cr_expect_eq(tx.staged, st.bytes_sent, "every byte goes through the staging ring: %lu staged, %lu sent",
                     (unsigned long)tx.staged, (unsigned long)st.bytes_sent);
        cr_expect_eq(tx.pins, 1, "the ring is pinned once, when allocated: %d pins", tx.pins);
        cr_expect_geq(tx.pinned, staging);
    }
    tx_free(&tx);
    if (staging)
        cr_expect_eq(tx.pinned, 0, "the ring is unpinned before it is freed");
    close(fds[0]);
}

static void many_requests(const char *tls, td_xfer_rma_t rma, uint64_t seed, int n_req)
{
    many_requests_in(tls, rma, seed, n_req, &(run_opts_t){0});
}

/* A device-memory source (the CPU backend's "device" memory, read with its copy_d2h)
 * through a staging ring much smaller than the requests, so operations wait for ring
 * space and the ring wraps: the receiver checks every byte and the checksums (computed
 * from the staged bytes). Over tcp a 1 MiB ring (runs up to 512 KiB: rendezvous, UCX
 * reads the ring after posting, so a piece reused too early would corrupt data); over
 * shared memory 16 KiB (the puts are copies into the mapping, done when posted). */
Test(xfer, device_source_staged_tcp, .timeout = 120)
{
    many_requests_in("tcp", TD_XFER_RMA_AUTO, 21, 16, &(run_opts_t){.staging = (size_t)1 << 20});
}

Test(xfer, device_source_staged_shm_put, .timeout = 120)
{
    many_requests_in("sm,tcp", TD_XFER_RMA_AUTO, 22, 16, &(run_opts_t){.staging = (size_t)16 << 10});
}

/* Copies that finish later, on another thread (a GPU's copy engine): an operation goes to
 * UCX only once its copy is done (posted earlier, it would carry the ring's stale bytes:
 * the receiver checks every byte and the checksums), a piece of the ring is not reused
 * while its copy runs, and the copier's wake alone brings the loop round (the deadline
 * tick is off). Over tcp the ring also waits for rendezvous reads; over shm for copies. */
Test(xfer, device_source_async_copies_tcp, .timeout = 120)
{
    many_requests_in("tcp", TD_XFER_RMA_AUTO, 23, 16,
                     &(run_opts_t){.staging = (size_t)1 << 20, .deferred = true});
}

Test(xfer, device_source_async_copies_shm_put, .timeout = 120)
{
    many_requests_in("sm,tcp", TD_XFER_RMA_AUTO, 24, 16,
                     &(run_opts_t){.staging = (size_t)256 << 10, .deferred = true});
}

Test(xfer, loopback_tcp_64_requests, .timeout = 120)
{
    many_requests("tcp", TD_XFER_RMA_AUTO, 1, 64);
}

Test(xfer, loopback_shm_64_requests_put, .timeout = 120)
{
    many_requests("sm,tcp", TD_XFER_RMA_AUTO, 2, 64);
}

Test(xfer, loopback_shm_64_requests_am, .timeout = 120)
{
    many_requests("sm,tcp", TD_XFER_RMA_AM, 12, 64);
}

Test(xfer, loopback_tcp_forced_put_16_requests, .timeout = 120)
{
    many_requests("tcp", TD_XFER_RMA_PUT, 13, 16);
}

Test(xfer, loopback_tcp_one_request, .timeout = 60)
{
    many_requests("tcp", TD_XFER_RMA_AUTO, 3, 1);
}

/* ---- bounded work per loop iteration --------------------------------------------------- */

/* Over shared memory a put is our own copy, complete when posted: unbounded, one loop
 * callback would copy every queued operation (a whole layer of a long prompt, 128 MiB for
 * an 8B model at 32k tokens). With operations of 4 blocks and a budget of 16 blocks per
 * iteration, the 4096-token request (256 blocks a layer) is spread over many iterations,
 * none moving more than the budget allows, and every byte and checksum still arrives (the
 * receiver checks them). Counted, not timed. */
Test(xfer, shm_put_work_spread_over_loop_iterations, .timeout = 120)
{
    size_t bb = td_kv_block_bytes(&LAYOUT);
    many_requests_in("sm,tcp", TD_XFER_RMA_AUTO, 25, 4,
                     &(run_opts_t){.max_op_bytes = 4 * bb, .loop_budget = 16 * bb});
}

/* The same from a device-memory source: the copies land in the ring at once (the CPU
 * backend's), and their checksums and puts wait for the iteration's budget in order. */
Test(xfer, device_source_shm_put_work_spread_over_loop_iterations, .timeout = 120)
{
    size_t bb = td_kv_block_bytes(&LAYOUT);
    many_requests_in("sm,tcp", TD_XFER_RMA_AUTO, 26, 4,
                     &(run_opts_t){.staging = (size_t)256 << 10, .max_op_bytes = 4 * bb, .loop_budget = 16 * bb});
}

/* ---- shutdown never blocks the loop ---------------------------------------------------- */

static void frozen_receiver_process(int wfd, uint64_t seed)
{
    rx_t rx;
    int rc = rx_init(&rx, seed, 1024);
    if (!rc)
        rc = rx_lease(&rx, 1, 60000, true);
    if (rc)
        _exit(rc);
    td_xfer_testkit_write_all(wfd, &rx.offer, sizeof rx.offer);
    bool never = false;
    run_until(&rx.loop, &never, 60); /* until the test freezes (SIGSTOP) and kills it */
    _exit(0);
}

typedef struct ticker {
    uv_timer_t h;
    int fires;
} ticker_t;

static void ticker_cb(uv_timer_t *h)
{
    ((ticker_t *)h->data)->fires++;
}

typedef struct handle_count {
    const uv_handle_t *except;
    int n;
} handle_count_t;

static void count_handle(uv_handle_t *h, void *arg)
{
    handle_count_t *c = arg;
    c->n += h != c->except;
}

/* Handles of the loop other than `except`, closing ones included (until their close
 * callback ran). */
static int handles_besides(uv_loop_t *loop, const uv_handle_t *except)
{
    handle_count_t c = {.except = except};
    uv_walk(loop, count_handle, &c);
    return c.n;
}

/* td_xfer_destroy with the receiver frozen (SIGSTOP: invisible to UCX) and device-to-host
 * copies of 250 ms still running into the staging ring: it returns at once with the
 * finished send's callback made (TD_ERR_CLOSED), and the rest of the shutdown (force
 * close, waiting for the copies, freeing) runs on the loop while another handle of the
 * loop, a 5 ms timer, keeps firing; the ring is not unpinned (freed) under a running copy;
 * every handle of td_xfer closes within the shutdown's bounds (1 + 5 + 2 s). A destroy
 * that waited for the copies would block the loop for 750 ms: the timer would not fire
 * during the close at all. Counted, not timed. */
Test(xfer, destroy_returns_at_once_and_the_loop_keeps_turning, .timeout = 60)
{
    td_xfer_testkit_env("tcp");
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        close(fds[0]);
        frozen_receiver_process(fds[1], 31);
    }
    close(fds[1]);
    static offer_t o;
    cr_assert(td_xfer_testkit_read_all(fds[0], &o, sizeof o), "receiver failed to start");
    tx_t tx;
    cr_assert_eq(tx_init_mem(&tx, TD_XFER_RMA_AUTO, (size_t)1 << 20, true, 0, 0), 0);
    cr_assert_eq(tx_fill(&tx, &o, 31), 0);
    tx.n_want = 1;
    cr_assert_eq(td_xfer_connect(tx.x, o.desc, o.desc_len, &LAYOUT, &tx.peer), TD_OK, "%s", td_last_error());
    td_xfer_send_t *s;
    cr_assert_eq(tx_begin(&tx, &o.lease[0], 0, &s), TD_OK);
    cr_assert_eq(td_xfer_send_layer(s, 0, tx_layer(&tx, 0), tx.src[0]), TD_OK);
    size_t layer0 = TD_DIV_CEIL(o.lease[0].n_tokens, LAYOUT.block_size) * td_kv_block_bytes(&LAYOUT);
    td_xfer_stats_t st;
    double until = td_now_s() + 20;
    do { /* the peer is wired up and layer 0 is through */
        uv_run(&tx.loop, UV_RUN_NOWAIT);
        td_xfer_get_stats(tx.x, &st);
    } while (st.bytes_sent < layer0 && td_now_s() < until);
    cr_assert_geq(st.bytes_sent, layer0, "layer 0 did not go out");
    cr_assert_eq(kill(pid, SIGSTOP), 0);
    pthread_mutex_lock(&tx.mu);
    tx.copy_ns = 250000000;
    pthread_mutex_unlock(&tx.mu);
    for (uint32_t layer = 1; layer < LAYOUT.n_layers; layer++)
        cr_assert_eq(td_xfer_send_layer(s, layer, tx_layer(&tx, layer), tx.src[0]), TD_OK);
    td_xfer_send_finish(s, 5);
    bool copying = false;
    until = td_now_s() + 10;
    while (!copying && td_now_s() < until) {
        uv_run(&tx.loop, UV_RUN_NOWAIT);
        pthread_mutex_lock(&tx.mu);
        copying = tx.started - tx.finished >= LAYOUT.n_layers - 1;
        pthread_mutex_unlock(&tx.mu);
    }
    cr_assert(copying, "the copies of layers 1-3 did not start");

    td_xfer_destroy(tx.x);
    tx.x = NULL;
    cr_expect_eq(tx.n_done, 1, "a finished send gets its done callback from td_xfer_destroy");
    cr_expect_eq(tx.status[0], TD_ERR_CLOSED, "verdict %s", td_strerror(tx.status[0]));
    ticker_t t = {.fires = 0};
    uv_timer_init(&tx.loop, &t.h);
    t.h.data = &t;
    uv_timer_start(&t.h, ticker_cb, 5, 5);
    double t0 = td_now_s();
    while (handles_besides(&tx.loop, (uv_handle_t *)&t.h) > 0 && td_now_s() < t0 + 20)
        uv_run(&tx.loop, UV_RUN_ONCE);
    double took = td_now_s() - t0;
    cr_assert_eq(handles_besides(&tx.loop, (uv_handle_t *)&t.h), 0, "td_xfer's handles still open after %.1f s",
                 took);
    cr_expect_lt(took, 1 + 5 + 2 + 2, "the close took %.1f s", took);
    cr_expect_geq(t.fires, 20, "the timer fired %d times in the %.2f s the close took", t.fires, took);
    cr_expect_eq(tx.n_done, 1, "no callback after td_xfer_destroy");
    pthread_mutex_lock(&tx.mu);
    bool all_copied = tx.started == tx.finished;
    pthread_mutex_unlock(&tx.mu);
    cr_expect(all_copied, "td_xfer closed before its copies ended");
    cr_expect(!tx.unpinned_while_copying, "the staging ring was unpinned under a running copy");
    cr_expect_eq(tx.pinned, 0, "the ring is unpinned once the copies ended");
    uv_close((uv_handle_t *)&t.h, NULL);
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    tx_free(&tx);
    close(fds[0]);
}

/* ---- device pool: the landing area --------------------------------------------------- */

/* A receiver whose pool is device memory (the CPU backend's, filled with its copy_h2d):
 * senders write the landing area, kv-ready copies the used blocks into the lease's pool
 * blocks, and the ready callback checks every byte there. Landing blocks all come back. */
Test(xfer, device_pool_through_landing_tcp, .timeout = 120)
{
    many_requests_in("tcp", TD_XFER_RMA_AUTO, 23, 32, &(run_opts_t){.rx_landing = 256 * 64 + 256});
}

/* Both ends in device memory, over shared memory: the sender stages through its ring and
 * puts into the mapped landing area. */
Test(xfer, device_to_device_pool_shm_put, .timeout = 120)
{
    many_requests_in("sm,tcp", TD_XFER_RMA_AUTO, 24, 16,
                     &(run_opts_t){.staging = (size_t)16 << 10, .rx_landing = 256 * 64 + 256});
}

/* Leases on a device pool hold landing and pool blocks: a full landing area refuses
 * (EXHAUSTED, nothing taken), cancel and expiry return both kinds exactly once. */
Test(xfer, device_pool_leases_hold_and_return_landing_blocks, .timeout = 60)
{
    td_xfer_testkit_env("tcp");
    rx_t rx;
    cr_assert_eq(rx_init_at(&rx, 1, 64, "127.0.0.1", 0, 8, NULL), 0);
    td_xfer_stats_t st;
    td_xfer_get_stats(rx.x, &st);
    cr_assert_eq(st.landing_free, 8);
    cr_expect_eq(td_xfer_pool_base(rx.x), rx.pool, "the pool base is the device pool's");
    int32_t b1[8], b2[8];
    uint64_t l1, l2;
    td_xfer_token_t tok;
    cr_assert_eq(td_xfer_lease_create(rx.x, 1, 6, 60000, b1, &l1, &tok), TD_OK);
    for (int i = 0; i < 6; i++)
        cr_expect(b1[i] >= 0 && b1[i] < 8, "senders get landing block ids: %d", b1[i]);
    cr_expect_eq(td_kv_available(rx.kv), 58);
    cr_expect_eq(td_xfer_lease_create(rx.x, 2, 4, 60000, b2, &l2, &tok), TD_ERR_EXHAUSTED, "landing area full");
    cr_expect_eq(td_kv_available(rx.kv), 58, "a refused lease takes no pool blocks");
    cr_expect_eq(td_xfer_lease_create(rx.x, 2, 65, 60000, b2, &l2, &tok), TD_ERR_INVALID);
    cr_assert_eq(td_xfer_lease_cancel(rx.x, l1), TD_OK);
    td_xfer_get_stats(rx.x, &st);
    cr_expect_eq(st.landing_free, 8);
    cr_expect_eq(td_kv_available(rx.kv), 64);
    cr_expect_eq(td_xfer_lease_cancel(rx.x, l1), TD_ERR_STALE, "a lease ends once");
    cr_assert_eq(td_xfer_lease_create(rx.x, 3, 8, 1, b2, &l2, &tok), TD_OK);
    double end = td_now_s() + 5;
    do {
        uv_run(&rx.loop, UV_RUN_NOWAIT);
        td_xfer_get_stats(rx.x, &st);
    } while (st.leases_expired == 0 && td_now_s() < end);
    cr_expect_eq(st.leases_expired, 1);
    cr_expect_eq(st.landing_free, 8);
    cr_expect_eq(td_kv_available(rx.kv), 64);
    rx_free(&rx);
}

Test(xfer, device_pool_needs_base_copy_and_landing)
{
    td_xfer_testkit_env("tcp");
    uv_loop_t loop;
    uv_loop_init(&loop);
    td_xfer_config_t cfg = td_xfer_config_default();
    td_xfer_t *x;
    cr_assert_eq(td_xfer_create(&loop, &cfg, &x), TD_OK);
    static char dev[4096];
    td_xfer_pool_t p = {.layout = LAYOUT, .base = dev, .n_blocks = 1, .mem = TD_XFER_MEM_CUDA, .landing_blocks = 1};
    cr_expect_eq(td_xfer_register_pool(x, &p, NULL, NULL), TD_ERR_INVALID, "no copy_h2d");
    cr_expect(strstr(td_last_error(), "copy_h2d") != NULL, "message: %s", td_last_error());
    p.copy_h2d = rx_copy_h2d;
    p.landing_blocks = 0;
    cr_expect_eq(td_xfer_register_pool(x, &p, NULL, NULL), TD_ERR_INVALID, "no landing area");
    p.landing_blocks = 1;
    p.base = NULL;
    cr_expect_eq(td_xfer_register_pool(x, &p, NULL, NULL), TD_ERR_INVALID, "no device base");
    cr_expect_eq(td_xfer_pool_base(x), NULL, "nothing registered");
    td_xfer_destroy(x);
    close_loop(&loop);
}

/* ---- adoption is bounded per loop iteration too (receiver) ----------------------------- */

/* What a sending process reports: each request's verdict. */
typedef struct tx_report {
    td_status_t status[MAX_REQ];
} tx_report_t;

/* Sends every request of the offer it reads (request 0 with a checksum, 1 without:
 * tx_begin), waits for the verdicts and writes them back before it exits. */
static void verdict_sender_process(int rfd, int wfd, uint64_t seed)
{
    static offer_t o;
    if (!td_xfer_testkit_read_all(rfd, &o, sizeof o))
        _exit(2);
    tx_t tx;
    if (tx_init(&tx) || tx_fill(&tx, &o, seed) ||
        td_xfer_connect(tx.x, o.desc, o.desc_len, &LAYOUT, &tx.peer) != TD_OK)
        _exit(3);
    tx.n_want = o.n_req;
    td_xfer_send_t *s[MAX_REQ];
    for (int r = 0; r < o.n_req; r++)
        if (tx_begin(&tx, &o.lease[r], r, &s[r]) != TD_OK)
            _exit(4);
    for (uint32_t layer = 0; layer < LAYOUT.n_layers; layer++)
        for (int r = 0; r < o.n_req; r++)
            td_xfer_send_layer(s[r], layer, tx_layer(&tx, layer), tx.src[r]);
    for (int r = 0; r < o.n_req; r++)
        td_xfer_send_finish(s[r], 42 + r);
    run_until(&tx.loop, &tx.all_done, 30);
    tx_report_t rep;
    memcpy(rep.status, tx.status, sizeof rep.status);
    td_xfer_testkit_write_all(wfd, &rep, sizeof rep);
    bool done = tx.all_done;
    tx_free(&tx);
    _exit(done ? 0 : 5);
}

/* Counts, at every loop iteration (uv_check), the bytes the receiver's adoptions copied
 * into the device pool and checksummed since the last. */
typedef struct adopt_meter {
    uv_check_t h;
    rx_t *rx;
    uint64_t last;      /* copied + verified at the previous iteration */
    uint64_t max_turn;  /* most bytes in one iteration */
    int working_turns;  /* iterations that copied or verified */
} adopt_meter_t;

static uint64_t adopt_work(rx_t *rx)
{
    td_xfer_stats_t st;
    td_xfer_get_stats(rx->x, &st);
    return st.bytes_copied_h2d + st.bytes_verified;
}

static void adopt_meter_cb(uv_check_t *h)
{
    adopt_meter_t *m = h->data;
    uint64_t now = adopt_work(m->rx);
    m->working_turns += now > m->last;
    m->max_turn = TD_MAX(m->max_turn, now - m->last);
    m->last = now;
}

/* What happens while the adoptions run: nothing; the lease is cancelled; td_xfer_destroy;
 * copy_h2d fails. */
typedef enum adopt_plan { ADOPT_ALL, ADOPT_CANCEL, ADOPT_DESTROY, ADOPT_COPY_FAILS } adopt_plan_t;

#define ADOPT_POOL 1024

/* Two requests of 4096 tokens (256 blocks a layer, 1 MiB each), request 0 with a checksum,
 * adopted by a receiver whose pieces are 4 blocks and whose budget is 16 blocks a loop
 * iteration; device: a device pool (the CPU backend's), every landed byte copied with
 * copy_h2d. Unbounded, one callback would checksum and copy a whole request. */
static void adoption(bool device, adopt_plan_t plan)
{
    td_xfer_testkit_env("tcp");
    int to_tx[2], to_rx[2];
    cr_assert_eq(pipe(to_tx), 0);
    cr_assert_eq(pipe(to_rx), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        close(to_tx[1]);
        close(to_rx[0]);
        verdict_sender_process(to_tx[0], to_rx[1], 41);
    }
    close(to_tx[0]);
    close(to_rx[1]);
    size_t bb = td_kv_block_bytes(&LAYOUT);
    td_xfer_config_t cfg = td_xfer_config_default();
    cfg.max_op_bytes = 4 * bb;
    cfg.loop_budget_bytes = 16 * bb;
    rx_t rx;
    cr_assert_eq(rx_init_at(&rx, 41, ADOPT_POOL, "127.0.0.1", 0, device ? ADOPT_POOL : 0, &cfg), 0);
    if (plan == ADOPT_COPY_FAILS)
        rx.fail_copy_after = 100 * bb;
    /* A cancel ends one request, the one being adopted: a second one's data could still be
     * arriving, and a lease cancelled under a receive closes its writer's endpoint. */
    int n_req = plan == ADOPT_CANCEL ? 1 : 2;
    for (int i = 0; i < n_req; i++) {
        lease_msg_t *m = &rx.offer.lease[i];
        m->request_id = 1000 + (uint64_t)i;
        m->n_tokens = 4096;
        m->n_blocks = 4096 / 16;
        cr_assert_eq(td_xfer_lease_create(rx.x, m->request_id, m->n_blocks, 60000, m->blocks, &m->lease_id, &m->token), TD_OK);
    }
    rx.offer.n_req = n_req;
    rx.want = n_req;
    adopt_meter_t meter = {.rx = &rx};
    uv_check_init(&rx.loop, &meter.h);
    meter.h.data = &meter;
    uv_check_start(&meter.h, adopt_meter_cb);
    cr_assert(td_xfer_testkit_write_all(to_tx[1], &rx.offer, sizeof rx.offer));

    uint64_t request_bytes = (uint64_t)LAYOUT.n_layers * 256 * bb;
    uint64_t work = (device ? 2 * request_bytes : 0) + request_bytes; /* copies + request 0's checksum */
    int status = 0;
    pid_t w = 0;
    bool never = false;
    double until = td_now_s() + 30;
    if (plan == ADOPT_ALL) {
        run_until(&rx.loop, &rx.all_in, 30);
    } else {
        /* Until an adoption is under way: the first takes many iterations at this budget. */
        while (adopt_work(&rx) == 0 && td_now_s() < until)
            uv_run(&rx.loop, UV_RUN_ONCE);
        cr_assert_gt(adopt_work(&rx), 0, "no adoption started");
        cr_assert_eq(rx.adopted, 0, "an adoption ended in one go");
    }
    uint64_t copied_then = rx.copied;
    if (plan == ADOPT_CANCEL) {
        cr_expect_eq(td_xfer_lease_cancel(rx.x, rx.offer.lease[0].lease_id), TD_OK);
    } else if (plan == ADOPT_DESTROY) {
        uv_close((uv_handle_t *)&meter.h, NULL);
        td_xfer_destroy(rx.x);
        rx.x = NULL;
        uv_run(&rx.loop, UV_RUN_DEFAULT); /* the shutdown runs on the loop, bounded */
        cr_expect_eq(rx.copied, copied_then, "copied after td_xfer_destroy");
        cr_expect_eq(td_kv_available(rx.kv), ADOPT_POOL, "blocks not all back after the close: %d",
                     td_kv_available(rx.kv));
    }
    if (plan != ADOPT_DESTROY) /* the sender's TCP sends and its verdicts need our progress */
        while ((w = waitpid(pid, &status, WNOHANG)) == 0 && td_now_s() < until)
            run_until(&rx.loop, &never, 0.01);
    else
        w = waitpid(pid, &status, 0);
    cr_assert_eq(w, pid, "sender did not finish");
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "sender failed (%d)", status);
    tx_report_t rep;
    cr_assert(td_xfer_testkit_read_all(to_rx[0], &rep, sizeof rep), "no verdicts from the sender");
    td_status_t want = plan == ADOPT_ALL          ? TD_OK
                       : plan == ADOPT_CANCEL     ? TD_ERR_STALE
                       : plan == ADOPT_DESTROY    ? TD_ERR_UNAVAILABLE
                                                  : TD_ERR_IO;
    for (int i = 0; i < n_req; i++)
        cr_expect_eq(rep.status[i], want, "request %d: verdict %s, want %s", i, td_strerror(rep.status[i]),
                     td_strerror(want));
    if (plan != ADOPT_DESTROY) {
        td_xfer_stats_t st;
        td_xfer_get_stats(rx.x, &st);
        uv_close((uv_handle_t *)&meter.h, NULL);
        cr_expect_eq(st.leases_live, 0);
        cr_expect_eq(td_kv_available(rx.kv), ADOPT_POOL, "blocks not all back: %d free", td_kv_available(rx.kv));
        if (device)
            cr_expect_eq(st.landing_free, ADOPT_POOL, "landing blocks not all back: %u free", st.landing_free);
        if (plan == ADOPT_ALL) {
            cr_expect_eq(rx.adopted, 2);
            cr_expect_eq(rx.bad, 0, "%d blocks differ", rx.bad);
            cr_expect_eq(st.bytes_copied_h2d + st.bytes_verified, work, "%lu copied, %lu verified",
                         (unsigned long)st.bytes_copied_h2d, (unsigned long)st.bytes_verified);
            /* A loop iteration (check to check) spans at most two budget windows; one piece
             * (4 blocks, copied and checksummed: 8) fits the budget. */
            cr_expect_leq(meter.max_turn, 2 * cfg.loop_budget_bytes, "%lu bytes adopted in one loop iteration",
                          (unsigned long)meter.max_turn);
            cr_expect_geq((uint64_t)meter.working_turns, work / (2 * cfg.loop_budget_bytes),
                          "%lu bytes adopted in %d loop iterations", (unsigned long)work, meter.working_turns);
        } else {
            cr_expect_eq(rx.adopted, 0, "adopted after the adoption failed");
            cr_expect_eq(st.leases_adopted, 0);
            if (plan == ADOPT_CANCEL) {
                cr_expect_eq(st.leases_cancelled, 1);
                cr_expect_eq(rx.copied, copied_then, "copied after the cancel");
            } else {
                cr_expect_leq(rx.copied, rx.fail_copy_after);
            }
        }
    }
    rx_free(&rx);
    close(to_tx[1]);
    close(to_rx[0]);
}

/* A device pool: every landed byte is copied into the pool in pieces, at most the budget's
 * worth per loop iteration, over many iterations, and every byte lands right (checked in
 * the ready callback); request 0's checksum is taken under the same budget. */
Test(xfer, device_pool_adoption_spread_over_loop_iterations, .timeout = 60)
{
    adoption(true, ADOPT_ALL);
}

/* A host pool: the checksum of request 0 (1 MiB) is verified over many iterations. */
Test(xfer, checksum_verification_spread_over_loop_iterations, .timeout = 60)
{
    adoption(false, ADOPT_ALL);
}

/* Cancel during an adoption: it stops, nothing more is copied, the sender hears STALE,
 * pool and landing blocks come back once, nothing is adopted. */
Test(xfer, device_pool_cancel_mid_adoption, .timeout = 60)
{
    adoption(true, ADOPT_CANCEL);
}

/* copy_h2d fails mid-way: the request fails with the copy's error at the sender, its
 * blocks come back, nothing is adopted. */
Test(xfer, device_pool_copy_fails_mid_adoption, .timeout = 60)
{
    adoption(true, ADOPT_COPY_FAILS);
}

/* td_xfer_destroy during an adoption: it stops (no copy after), the sender hears
 * UNAVAILABLE, every block returns by the end of the close; the sanitizer build checks
 * that nothing leaks or is freed twice. */
Test(xfer, device_pool_destroy_mid_adoption, .timeout = 60)
{
    adoption(true, ADOPT_DESTROY);
}

/* ---- layout mismatch ------------------------------------------------------------------ */

Test(xfer, layout_mismatch_refused_naming_the_field, .timeout = 60)
{
    td_xfer_testkit_env("tcp");
    rx_t rx;
    cr_assert_eq(rx_init(&rx, 1, 64), 0);
    tx_t tx;
    cr_assert_eq(tx_init(&tx), 0);
    td_kv_layout_t mine = LAYOUT;
    mine.head_dim = 16;
    cr_assert_eq(td_xfer_connect(tx.x, rx.offer.desc, rx.offer.desc_len, &mine, &tx.peer), TD_ERR_MISMATCH);
    cr_expect(strstr(td_last_error(), "head_dim 16 here, 8 at peer") != NULL, "message: %s", td_last_error());
    mine = LAYOUT;
    mine.dtype = TD_BF16;
    cr_assert_eq(td_xfer_connect(tx.x, rx.offer.desc, rx.offer.desc_len, &mine, &tx.peer), TD_ERR_MISMATCH);
    cr_expect(strstr(td_last_error(), "dtype bf16 here, f16 at peer") != NULL, "message: %s", td_last_error());
    uint8_t junk[64] = {1, 2, 3};
    cr_expect_eq(td_xfer_connect(tx.x, junk, sizeof junk, &LAYOUT, &tx.peer), TD_ERR_FORMAT);
    cr_expect_eq(td_xfer_connect(tx.x, rx.offer.desc, rx.offer.desc_len, &LAYOUT, &tx.peer), TD_OK);
    td_xfer_stats_t st;
    td_xfer_get_stats(tx.x, &st);
    cr_expect_eq(st.fail_mismatch, 2);
    tx_free(&tx);
    rx_free(&rx);
}

/* ---- a rogue peer (docs/security.md, "The KV data plane") ------------------------------ */

/* What one send ended with. */
typedef struct verdict {
    bool done;
    td_status_t st;
} verdict_t;

static void verdict_cb(void *arg, uint64_t request_id, td_status_t st)
{
    verdict_t *v = arg;
    v->done = true;
    v->st = st;
}

/* A sender on the receiver's own loop (one process: the rogue and the honest sender are
 * two more td_xfer endpoints beside the receiver). */
static td_xfer_t *peer_x_create(uv_loop_t *loop, const char *name, const rx_t *rx, td_xfer_peer_t **peer_p)
{
    td_xfer_config_t cfg = td_xfer_config_default();
    cfg.name = name;
    cfg.listen_ip = NULL;
    cfg.send_timeout_ms = 10000;
    td_xfer_t *x;
    cr_assert_eq(td_xfer_create(loop, &cfg, &x), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_xfer_connect(x, rx->offer.desc, rx->offer.desc_len, &LAYOUT, peer_p), TD_OK, "%s",
                 td_last_error());
    return x;
}

/* Starts a send of m (the lease id and token it names are the caller's choice) from slab
 * ([n_layers][n_used][block]: layer l's blocks at l * n_used), the first `layers` layers. */
static td_xfer_send_t *send_some(td_xfer_t *x, td_xfer_peer_t *peer, const lease_msg_t *m, uint64_t lease_id,
                                 const td_xfer_token_t *token, const uint8_t *slab, uint32_t layers, verdict_t *v)
{
    static const int32_t src_blocks[] = {0, 1, 2, 3, 4, 5, 6, 7};
    uint32_t n_used = TD_DIV_CEIL(m->n_tokens, LAYOUT.block_size);
    cr_assert_leq(n_used, TD_ARRAY_LEN(src_blocks));
    td_xfer_send_params_t p = {.request_id = m->request_id, .lease_id = lease_id, .token = *token,
                               .dst_blocks = m->blocks, .n_dst_blocks = m->n_blocks, .n_tokens = m->n_tokens,
                               .checksum = true, .mem = TD_XFER_MEM_HOST, .done = verdict_cb, .arg = v};
    td_xfer_send_t *s;
    *v = (verdict_t){0};
    cr_assert_eq(td_xfer_send_begin(x, peer, &p, &s), TD_OK, "%s", td_last_error());
    size_t slab_layer = (size_t)n_used * td_kv_block_bytes(&LAYOUT);
    for (uint32_t l = 0; l < layers; l++)
        cr_assert_eq(td_xfer_send_layer(s, l, slab + l * slab_layer, src_blocks), TD_OK);
    return s;
}

static void send_rest(td_xfer_send_t *s, const lease_msg_t *m, const uint8_t *slab, uint32_t from)
{
    static const int32_t src_blocks[] = {0, 1, 2, 3, 4, 5, 6, 7};
    size_t slab_layer = (size_t)TD_DIV_CEIL(m->n_tokens, LAYOUT.block_size) * td_kv_block_bytes(&LAYOUT);
    for (uint32_t l = from; l < LAYOUT.n_layers; l++)
        cr_assert_eq(td_xfer_send_layer(s, l, slab + l * slab_layer, src_blocks), TD_OK);
    td_xfer_send_finish(s, 7);
}

static void run_until_verdicts(uv_loop_t *loop, verdict_t *v, int n, double timeout_s)
{
    double end = td_now_s() + timeout_s;
    for (;;) {
        int done = 0;
        for (int i = 0; i < n; i++)
            done += v[i].done;
        if (done == n || td_now_s() > end)
            break;
        uv_run(loop, UV_RUN_ONCE);
    }
    for (int i = 0; i < n; i++)
        cr_assert(v[i].done, "send %d has no verdict", i);
}

/* Two live leases, an honest sender and a rogue one. The rogue sends BIND (put path) or
 * DATA (AM path) and READY with junk for both leases without their tokens, for guessed
 * lease ids, and, once the honest sender owns lease A, with A's real token from its own
 * endpoint. Every one of those is dropped and counted, none touches a lease's blocks or
 * ends a lease; the honest sender's transfers are then adopted byte for byte. */
static void rogue_peer(const char *tls)
{
    td_xfer_testkit_env(tls);
    rx_t rx;
    cr_assert_eq(rx_init(&rx, 5, 256), 0);
    cr_assert_eq(rx_lease(&rx, 2, 60000, true), 0);
    lease_msg_t *a = &rx.offer.lease[0], *b = &rx.offer.lease[1];
    td_xfer_peer_t *gp, *rp;
    td_xfer_t *good = peer_x_create(&rx.loop, "good", &rx, &gp);
    td_xfer_t *rogue = peer_x_create(&rx.loop, "rogue", &rx, &rp);

    size_t bb = td_kv_block_bytes(&LAYOUT);
    uint32_t n_used = TD_DIV_CEIL(a->n_tokens, LAYOUT.block_size);
    size_t slab_bytes = (size_t)LAYOUT.n_layers * n_used * bb;
    uint8_t *junk = malloc((size_t)LAYOUT.n_layers * 8 * bb), *ka = malloc(slab_bytes), *kb = malloc(slab_bytes);
    memset(junk, 0xee, (size_t)LAYOUT.n_layers * 8 * bb);
    for (uint32_t l = 0; l < LAYOUT.n_layers; l++)
        for (uint32_t i = 0; i < n_used; i++) {
            fill_block(ka + ((size_t)l * n_used + i) * bb, bb, rx.seed, a->request_id, l, i);
            fill_block(kb + ((size_t)l * n_used + i) * bb, bb, rx.seed, b->request_id, l, i);
        }

    /* 1. No token (zeros), a guessed one, and guessed lease ids around the real ones. */
    td_xfer_token_t zero = {{0}}, guess;
    for (size_t i = 0; i < sizeof guess.b; i++)
        guess.b[i] = (uint8_t)(0x5a + i);
    verdict_t rv[6];
    send_rest(send_some(rogue, rp, a, a->lease_id, &zero, junk, 0, &rv[0]), a, junk, 0);
    send_rest(send_some(rogue, rp, b, b->lease_id, &guess, junk, 0, &rv[1]), b, junk, 0);
    lease_msg_t m2 = *b; /* a malformed kv-ready for A: more tokens than A's blocks hold */
    m2.n_tokens = (uint32_t)b->n_blocks * LAYOUT.block_size;
    cr_assert_gt(m2.n_tokens, (uint32_t)a->n_blocks * LAYOUT.block_size);
    send_rest(send_some(rogue, rp, &m2, a->lease_id, &zero, junk, 0, &rv[2]), &m2, junk, 0);
    for (int k = 0; k < 3; k++) /* lease ids count up from 1: the next ones and 0 */
        send_rest(send_some(rogue, rp, a, k == 2 ? 0 : b->lease_id + 1 + (uint64_t)k, &zero, junk, 0, &rv[3 + k]),
                  a, junk, 0);
    run_until_verdicts(&rx.loop, rv, 6, 20);
    for (int i = 0; i < 6; i++)
        cr_expect_neq(rv[i].st, TD_OK, "rogue send %d was adopted", i);
    td_xfer_stats_t st;
    td_xfer_get_stats(rx.x, &st);
    cr_expect_eq(rx.adopted, 0);
    cr_expect_eq(st.leases_live, 2, "a rogue message ended a live lease");
    cr_expect_eq(st.leases_expired + st.leases_cancelled + st.leases_sender_lost, 0);
    cr_expect_gt(st.rejected_token, 0, "rejections are counted");
    cr_expect_eq(st.bytes_received, 0, "a rogue byte reached the pool");
    for (uint32_t l = 0; l < LAYOUT.n_layers; l++)
        for (int r = 0; r < 2; r++)
            for (int32_t i = 0; i < rx.offer.lease[r].n_blocks; i++) {
                const uint8_t *p = (uint8_t *)rx.pool + td_kv_block_offset(&LAYOUT, rx.n_blocks, l,
                                                                           (uint32_t)rx.offer.lease[r].blocks[i]);
                for (size_t k = 0; k < bb; k++)
                    if (p[k])
                        cr_assert_fail("a rogue byte reached lease %d block %d layer %u", r, i, l);
            }
    uint64_t rejected_token = st.rejected_token;

    /* 2. The honest sender takes lease A (its first layer lands, or its bind is accepted);
     * then the rogue, holding A's real token, sends from its own endpoint. */
    verdict_t gv[2];
    td_xfer_send_t *ga = send_some(good, gp, a, a->lease_id, &a->token, ka, 1, &gv[0]);
    double end = td_now_s() + 10;
    td_xfer_stats_t gs;
    do {
        uv_run(&rx.loop, UV_RUN_ONCE);
        td_xfer_get_stats(rx.x, &st);
        td_xfer_get_stats(good, &gs);
    } while (st.bytes_received == 0 && gs.ops_put == 0 && td_now_s() < end);
    cr_assert(st.bytes_received > 0 || gs.ops_put > 0, "the honest sender never started");
    send_rest(send_some(rogue, rp, a, a->lease_id, &a->token, junk, 0, &rv[0]), a, junk, 0);
    run_until_verdicts(&rx.loop, rv, 1, 20);
    cr_expect_neq(rv[0].st, TD_OK, "a second endpoint wrote a lease with its token");
    td_xfer_get_stats(rx.x, &st);
    cr_expect_gt(st.rejected_endpoint, 0, "the other endpoint's messages are counted");
    cr_expect_eq(st.leases_live, 2);

    /* 3. The honest transfers complete, every byte theirs. */
    send_rest(ga, a, ka, 1);
    send_rest(send_some(good, gp, b, b->lease_id, &b->token, kb, 0, &gv[1]), b, kb, 0);
    run_until_verdicts(&rx.loop, gv, 2, 20);
    cr_expect_eq(gv[0].st, TD_OK, "lease A: %s", td_strerror(gv[0].st));
    cr_expect_eq(gv[1].st, TD_OK, "lease B: %s", td_strerror(gv[1].st));
    run_until(&rx.loop, &rx.all_in, 10);
    cr_expect_eq(rx.adopted, 2);
    cr_expect_eq(rx.bad, 0, "an adopted block differs from what the honest sender sent");
    td_xfer_get_stats(rx.x, &st);
    cr_expect_eq(st.leases_live, 0);
    cr_expect_eq(st.leases_adopted, 2);
    cr_expect_geq(st.rejected_token, rejected_token);
    cr_expect_eq(td_kv_available(rx.kv), 256, "every block back after the ready callbacks");
    free(junk);
    free(ka);
    free(kb);
    td_xfer_destroy(good);
    td_xfer_destroy(rogue);
    rx_free(&rx);
}

Test(xfer, rogue_peer_without_token_or_from_another_endpoint_rejected_tcp, .timeout = 60)
{
    rogue_peer("tcp");
}

Test(xfer, rogue_peer_without_token_or_from_another_endpoint_rejected_shm_put, .timeout = 60)
{
    rogue_peer("sm,tcp");
}

/* ---- receiver killed mid-transfer ----------------------------------------------------- */

static void idle_receiver_process(int wfd, uint64_t seed, int n_req)
{
    rx_t rx;
    int rc = rx_init(&rx, seed, 1024);
    if (!rc)
        rc = rx_lease(&rx, n_req, 60000, true);
    if (rc)
        _exit(rc);
    td_xfer_testkit_write_all(wfd, &rx.offer, sizeof rx.offer);
    run_until(&rx.loop, &rx.all_in, 60);
    int ok = rx.bad == 0 && rx.adopted == n_req;
    rx_free(&rx);
    _exit(ok ? 0 : 1);
}

Test(xfer, receiver_killed_fails_its_requests_only, .timeout = 60)
{
    td_xfer_testkit_env("tcp");
    int fa[2], fb[2];
    cr_assert_eq(pipe(fa), 0);
    cr_assert_eq(pipe(fb), 0);
    pid_t a = fork();
    if (a == 0)
        idle_receiver_process(fa[1], 5, 4);
    pid_t b = fork();
    if (b == 0)
        idle_receiver_process(fb[1], 6, 4);
    static offer_t oa, ob;
    cr_assert(td_xfer_testkit_read_all(fa[0], &oa, sizeof oa) && td_xfer_testkit_read_all(fb[0], &ob, sizeof ob));
    tx_t ta, tb; /* two request sets, one sender node */
    cr_assert_eq(tx_init(&ta), 0);
    tb = ta;
    tb.pool = NULL;
    memset(tb.src, 0, sizeof tb.src);
    cr_assert_eq(tx_fill(&ta, &oa, 5), 0);
    cr_assert_eq(tx_fill(&tb, &ob, 6), 0);
    cr_assert_eq(td_xfer_connect(ta.x, oa.desc, oa.desc_len, &LAYOUT, &ta.peer), TD_OK);
    cr_assert_eq(td_xfer_connect(ta.x, ob.desc, ob.desc_len, &LAYOUT, &tb.peer), TD_OK);
    ta.n_want = tb.n_want = 4;
    td_xfer_send_t *sa[4], *sb[4];
    for (int r = 0; r < 4; r++) {
        cr_assert_eq(tx_begin(&ta, &oa.lease[r], r, &sa[r]), TD_OK);
        cr_assert_eq(tx_begin(&tb, &ob.lease[r], r, &sb[r]), TD_OK);
    }
    /* Two layers reach both receivers, then A dies, then the remaining layers. */
    for (uint32_t layer = 0; layer < 2; layer++)
        for (int r = 0; r < 4; r++) {
            td_xfer_send_layer(sa[r], layer, tx_layer(&ta, layer), ta.src[r]);
            td_xfer_send_layer(sb[r], layer, tx_layer(&tb, layer), tb.src[r]);
        }
    /* Until those layers are out (an event, not a sleep: under load it may take long). */
    size_t two_layers = 2 * 2 * 4 * 3 * td_kv_block_bytes(&LAYOUT); /* rx, layers, requests, blocks */
    td_xfer_stats_t st;
    double until = td_now_s() + 20;
    do {
        uv_run(&ta.loop, UV_RUN_NOWAIT);
        td_xfer_get_stats(ta.x, &st);
    } while (st.bytes_sent < two_layers && td_now_s() < until);
    cr_assert_geq(st.bytes_sent, two_layers, "layers 0-1 did not go out");
    kill(a, SIGKILL);
    double killed = td_now_s();
    for (uint32_t layer = 2; layer < LAYOUT.n_layers; layer++)
        for (int r = 0; r < 4; r++) {
            td_xfer_send_layer(sa[r], layer, tx_layer(&ta, layer), ta.src[r]);
            td_xfer_send_layer(sb[r], layer, tx_layer(&tb, layer), tb.src[r]);
        }
    for (int r = 0; r < 4; r++) {
        td_xfer_send_finish(sa[r], 1);
        td_xfer_send_finish(sb[r], 1);
    }
    double end = td_now_s() + 30;
    while (!(ta.all_done && tb.all_done) && td_now_s() < end)
        uv_run(&ta.loop, UV_RUN_ONCE);
    cr_assert(ta.all_done && tb.all_done, "A %d/4 B %d/4 done", ta.n_done, tb.n_done);
    for (int r = 0; r < 4; r++) {
        cr_expect_eq(ta.status[r], TD_ERR_UNAVAILABLE, "A request %d: %s", r, td_strerror(ta.status[r]));
        cr_expect_lt(ta.done_at[r] - killed, 5.0, "failure reported after %.1f s", ta.done_at[r] - killed);
        cr_expect_eq(tb.status[r], TD_OK, "B request %d: %s", r, td_strerror(tb.status[r]));
    }
    cr_expect(!td_xfer_peer_alive(ta.peer));
    td_xfer_get_stats(ta.x, &st);
    cr_expect_eq(st.fail_peer, 4);
    cr_expect_eq(st.transfers_ok, 4);
    cr_expect_eq(st.transfers_inflight, 0);
    int status;
    waitpid(a, &status, 0);
    waitpid(b, &status, 0);
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "receiver B verification failed");
    free(tb.pool);
    for (int r = 0; r < MAX_REQ; r++)
        free(tb.src[r]);
    tx_free(&ta);
}

/* ---- sender killed mid-transfer ------------------------------------------------------- */

static void dying_sender_process(int rfd, uint64_t seed, td_xfer_rma_t rma)
{
    static offer_t o;
    if (!td_xfer_testkit_read_all(rfd, &o, sizeof o))
        _exit(2);
    tx_t tx;
    if (tx_init_rma(&tx, rma) || tx_fill(&tx, &o, seed))
        _exit(3);
    if (td_xfer_connect(tx.x, o.desc, o.desc_len, &LAYOUT, &tx.peer) != TD_OK)
        _exit(4);
    td_xfer_send_t *s[MAX_REQ];
    for (int r = 0; r < o.n_req; r++)
        if (tx_begin(&tx, &o.lease[r], r, &s[r]) != TD_OK)
            _exit(5);
    size_t layer0 = 0;
    for (int r = 0; r < o.n_req; r++) {
        td_xfer_send_layer(s[r], 0, tx_layer(&tx, 0), tx.src[r]);
        layer0 += TD_DIV_CEIL(o.lease[r].n_tokens, LAYOUT.block_size) * td_kv_block_bytes(&LAYOUT);
    }
    td_xfer_stats_t st;
    double end = td_now_s() + 20;
    do { /* until layer 0 is out */
        uv_run(&tx.loop, UV_RUN_NOWAIT);
        td_xfer_get_stats(tx.x, &st);
    } while (st.bytes_sent < layer0 && td_now_s() < end);
    raise(SIGKILL); /* mid-transfer: layers 1.. never come, no kv-ready */
    _exit(6);
}

/* AM path: leases it was writing go on its endpoint's loss, the rest expire. Put path:
 * the leases it was bound to go on its endpoint's loss (it cannot write any more). */
static void sender_killed(const char *tls, td_xfer_rma_t rma)
{
    td_xfer_testkit_env(tls);
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[1]);
        dying_sender_process(fds[0], 7, rma);
    }
    close(fds[0]);
    rx_t rx;
    cr_assert_eq(rx_init(&rx, 7, 2048), 0);
    cr_assert_eq(rx_lease(&rx, 8, 1500, false), 0);
    cr_expect_lt(td_kv_available(rx.kv), 2048);
    cr_assert(td_xfer_testkit_write_all(fds[1], &rx.offer, sizeof rx.offer));
    int status = 0;
    bool never = false;
    pid_t w = 0;
    double until = td_now_s() + 30;
    while ((w = waitpid(pid, &status, WNOHANG)) == 0 && td_now_s() < until)
        run_until(&rx.loop, &never, 0.01); /* the sender's TCP sends need our progress */
    cr_assert_eq(w, pid, "sender did not finish");
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "sender did not die as planned (%d)", status);
    td_xfer_stats_t st;
    td_xfer_get_stats(rx.x, &st);
    if (rma != TD_XFER_RMA_PUT) /* puts are counted at kv-ready, which never comes */
        cr_expect_gt(st.bytes_received, 0, "no layer arrived before the sender died");
    double end = td_now_s() + 10;
    while (st.leases_live > 0 && td_now_s() < end) {
        uv_run(&rx.loop, UV_RUN_ONCE);
        td_xfer_get_stats(rx.x, &st);
    }
    cr_expect_eq(st.leases_live, 0);
    cr_expect_eq(st.leases_expired + st.leases_sender_lost, 8);
    cr_expect_eq(rx.adopted, 0);
    cr_expect_eq(td_kv_available(rx.kv), 2048, "blocks not all free: %d", td_kv_available(rx.kv));
    td_kv_stats_t ks;
    td_kv_get_stats(rx.kv, &ks);
    cr_expect_eq(ks.used, 0);
    if (rma == TD_XFER_RMA_PUT)
        cr_expect_eq(st.leases_sender_lost, 8, "bound leases should go with the sender's endpoint");
    rx_free(&rx);
    close(fds[1]);
}

Test(xfer, sender_killed_leases_expire_blocks_free, .timeout = 60)
{
    sender_killed("tcp", TD_XFER_RMA_AM);
}

Test(xfer, put_sender_killed_bound_leases_free, .timeout = 60)
{
    sender_killed("sm,tcp", TD_XFER_RMA_PUT);
}

/* ---- kv-ready and late data after expiry ---------------------------------------------- */

/* A lease expires after the sender wrote layers 0-1; the sender then goes on (layers 2-3,
 * kv-ready). AM path: late data and kv-ready are refused, and the blocks, already leased
 * again and marked, stay untouched. Put path: puts cannot be refused, so the blocks stay
 * out of the pool (quarantine) until the sender confirms the abort after flushing, or,
 * for a sender that never answers, until quarantine_ms; only then are they leased again. */
static void expiry_fence(const char *tls, td_xfer_rma_t rma, uint32_t quarantine_ms)
{
    td_xfer_testkit_env(tls);
    bool put = rma == TD_XFER_RMA_PUT;
    int to_tx[2], to_rx[2];
    cr_assert_eq(pipe(to_tx), 0);
    cr_assert_eq(pipe(to_rx), 0);
    pid_t pid = fork();
    if (pid == 0) {
        /* Sender: layers 0-1, wait for "go", then layers 2-3 and kv-ready. */
        static offer_t o;
        if (!td_xfer_testkit_read_all(to_tx[0], &o, sizeof o))
            _exit(2);
        tx_t tx;
        if (tx_init_rma(&tx, rma) || tx_fill(&tx, &o, 9) ||
            td_xfer_connect(tx.x, o.desc, o.desc_len, &LAYOUT, &tx.peer) != TD_OK)
            _exit(3);
        tx.n_want = 1;
        td_xfer_send_t *s;
        if (tx_begin(&tx, &o.lease[0], 0, &s) != TD_OK)
            _exit(4);
        for (uint32_t layer = 0; layer < 2; layer++)
            td_xfer_send_layer(s, layer, tx_layer(&tx, layer), tx.src[0]);
        /* Until both layers are out (posted and complete), bounded. */
        td_xfer_stats_t ts;
        double until = td_now_s() + 10;
        do {
            uv_run(&tx.loop, UV_RUN_NOWAIT);
            td_xfer_get_stats(tx.x, &ts);
        } while (ts.bytes_sent < 2 * 7 * td_kv_block_bytes(&LAYOUT) && td_now_s() < until);
        char go;
        td_xfer_testkit_write_all(to_rx[1], "s", 1);
        if (!td_xfer_testkit_read_all(to_tx[0], &go, 1)) /* frozen: no progress at all until "go" */
            _exit(5);
        for (uint32_t layer = 2; layer < LAYOUT.n_layers; layer++)
            td_xfer_send_layer(s, layer, tx_layer(&tx, layer), tx.src[0]);
        td_xfer_send_finish(s, 7);
        run_until(&tx.loop, &tx.all_done, 20);
        td_xfer_get_stats(tx.x, &ts);
        int code = !tx.all_done ? 6 : tx.status[0] != TD_ERR_STALE ? 7 : put != (ts.ops_put > 0) ? 8 : 0;
        /* Let the abort-ack (put path) reach the receiver before our endpoint goes. */
        bool never = false;
        run_until(&tx.loop, &never, 0.2);
        tx_free(&tx);
        _exit(code);
    }
    rx_t rx;
    cr_assert_eq(rx_init_at(&rx, 9, 256, "127.0.0.1", quarantine_ms, 0, NULL), 0);
    rx.offer.n_req = 1;
    lease_msg_t *m = &rx.offer.lease[0];
    m->request_id = 1000;
    m->n_tokens = 100;
    m->n_blocks = 7;
    cr_assert_eq(td_xfer_lease_create(rx.x, m->request_id, m->n_blocks, 400, m->blocks, &m->lease_id, &m->token), TD_OK);
    cr_assert(td_xfer_testkit_write_all(to_tx[1], &rx.offer, sizeof rx.offer));
    char c;
    bool never = false;
    /* Receive the sender's first layers (progressing: TCP needs the receiver to), then
     * let the lease expire. */
    fcntl(to_rx[0], F_SETFL, O_NONBLOCK);
    double until = td_now_s() + 10;
    while (read(to_rx[0], &c, 1) != 1 && td_now_s() < until)
        uv_run(&rx.loop, UV_RUN_ONCE);
    td_xfer_stats_t st;
    double end = td_now_s() + 5;
    do {
        uv_run(&rx.loop, UV_RUN_ONCE);
        td_xfer_get_stats(rx.x, &st);
    } while (st.leases_expired == 0 && td_now_s() < end);
    cr_assert_eq(st.leases_expired, 1);
    cr_expect_eq(td_xfer_lease_cancel(rx.x, m->lease_id), TD_ERR_STALE);
    if (put) {
        /* The sender is bound and silent: its blocks must not come back. */
        cr_expect_eq(st.leases_quarantined, 1);
        cr_expect_eq(td_kv_available(rx.kv), 256 - 7, "quarantined blocks returned while the writer may write");
        if (quarantine_ms) {
            end = td_now_s() + 10;
            do {
                uv_run(&rx.loop, UV_RUN_ONCE);
                td_xfer_get_stats(rx.x, &st);
            } while (st.quarantine_timeouts == 0 && td_now_s() < end);
            cr_expect_eq(st.quarantine_timeouts, 1);
            cr_expect_eq(td_kv_available(rx.kv), 256);
            cr_assert(td_xfer_testkit_write_all(to_tx[1], "g", 1));
        } else {
            run_until(&rx.loop, &never, 0.2);
            cr_expect_eq(td_kv_available(rx.kv), 256 - 7, "quarantined blocks returned before the abort-ack");
            cr_assert(td_xfer_testkit_write_all(to_tx[1], "g", 1));
            end = td_now_s() + 10;
            while (td_kv_available(rx.kv) != 256 && td_now_s() < end)
                uv_run(&rx.loop, UV_RUN_ONCE);
            td_xfer_get_stats(rx.x, &st);
            cr_expect_eq(td_kv_available(rx.kv), 256, "the abort-ack did not return the blocks");
            cr_expect_eq(st.quarantine_timeouts, 0);
        }
    } else {
        cr_expect_eq(st.leases_live, 0);
        cr_expect_gt(st.bytes_received, 0);
    }
    /* A new lease gets the same blocks (LIFO free list) but a new id: mark them. */
    int32_t blocks2[7];
    uint64_t lease2;
    td_xfer_token_t tok;
    cr_assert_eq(td_xfer_lease_create(rx.x, 2000, 7, 30000, blocks2, &lease2, &tok), TD_OK);
    cr_expect_gt(lease2, m->lease_id);
    int same = 0;
    for (int i = 0; i < 7; i++)
        for (int j = 0; j < 7; j++)
            same += blocks2[i] == m->blocks[j];
    cr_expect_eq(same, 7, "expected the dead lease's blocks back (LIFO free list)");
    size_t bb = td_kv_block_bytes(&LAYOUT);
    for (uint32_t layer = 0; layer < LAYOUT.n_layers; layer++)
        for (int i = 0; i < 7; i++)
            memset((char *)rx.pool + td_kv_block_offset(&LAYOUT, rx.n_blocks, layer, (uint32_t)blocks2[i]), 0xab, bb);
    if (!put) {
        cr_assert(td_xfer_testkit_write_all(to_tx[1], "g", 1));
        end = td_now_s() + 10;
        do {
            uv_run(&rx.loop, UV_RUN_ONCE);
            td_xfer_get_stats(rx.x, &st);
        } while (st.discarded_ready == 0 && td_now_s() < end);
    }
    /* Until the sender has finished everything it will ever do. */
    int status = 0;
    end = td_now_s() + 20;
    pid_t w = 0;
    while ((w = waitpid(pid, &status, WNOHANG)) == 0 && td_now_s() < end)
        run_until(&rx.loop, &never, 0.01);
    cr_assert_eq(w, pid, "sender did not finish");
    run_until(&rx.loop, &never, 0.05);
    td_xfer_get_stats(rx.x, &st);
    if (!put) {
        cr_expect_eq(st.discarded_ready, 1);
        cr_expect_gt(st.discarded_data, 0);
    }
    cr_expect_eq(rx.adopted, 0);
    for (uint32_t layer = 0; layer < LAYOUT.n_layers; layer++)
        for (int i = 0; i < 7; i++) {
            const uint8_t *p = (uint8_t *)rx.pool + td_kv_block_offset(&LAYOUT, rx.n_blocks, layer, (uint32_t)blocks2[i]);
            for (size_t k = 0; k < bb; k++)
                if (p[k] != 0xab)
                    cr_assert_fail("late data for the dead lease reached block %d layer %u", blocks2[i], layer);
        }
    cr_expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "sender: expected a stale verdict (exit %d)",
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    cr_expect_eq(td_xfer_lease_cancel(rx.x, lease2), TD_OK);
    cr_expect_eq(td_kv_available(rx.kv), 256);
    rx_free(&rx);
}

Test(xfer, ready_after_expiry_discarded_and_fenced, .timeout = 60)
{
    expiry_fence("tcp", TD_XFER_RMA_AM, 0);
}

Test(xfer, put_expiry_quarantined_until_abort_ack, .timeout = 60)
{
    expiry_fence("sm,tcp", TD_XFER_RMA_PUT, 0);
}

Test(xfer, put_expiry_quarantine_bounded_for_frozen_sender, .timeout = 60)
{
    expiry_fence("sm,tcp", TD_XFER_RMA_PUT, 300);
}

/* ---- two network namespaces joined by a veth pair ------------------------------------- */

/* Joins a named netns and remounts /sys for it, as `ip netns exec` does, so UCX sees that
 * namespace's devices. */
static bool enter_netns(const char *name)
{
    char path[128];
    snprintf(path, sizeof path, "/var/run/netns/%s", name);
    int fd = open(path, O_RDONLY);
    if (fd < 0 || setns(fd, CLONE_NEWNET) != 0 || unshare(CLONE_NEWNS) != 0)
        return false;
    close(fd);
    if (mount("none", "/", NULL, MS_REC | MS_SLAVE, NULL) != 0)
        return false;
    umount2("/sys", MNT_DETACH);
    return mount("sysfs", "/sys", "sysfs", 0, NULL) == 0;
}

static char ns_a[32], ns_b[32];

static void netns_cleanup(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "ip netns del %s 2>/dev/null; ip netns del %s 2>/dev/null", ns_a, ns_b);
    if (system(cmd) != 0) {
        /* nothing to undo */
    }
}

static bool sh(const char *fmt, ...)
{
    char cmd[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return system(cmd) == 0;
}

Test(xfer, tcp_across_netns_veth, .timeout = 120, .fini = netns_cleanup)
{
    snprintf(ns_a, sizeof ns_a, "tdxa%d", (int)getpid());
    snprintf(ns_b, sizeof ns_b, "tdxb%d", (int)getpid());
    if (geteuid() != 0 || !sh("ip netns add %s 2>/dev/null", ns_a))
        cr_skip_test("needs root and `ip netns` (network namespaces) to create two namespaces");
    cr_assert(sh("ip netns add %s && ip link add %sv type veth peer name %sv && "
                 "ip link set %sv netns %s && ip link set %sv netns %s && "
                 "ip -n %s link set %sv name tdx0 && ip -n %s link set %sv name tdx0 && "
                 "ip -n %s addr add 10.77.0.1/24 dev tdx0 && ip -n %s addr add 10.77.0.2/24 dev tdx0 && "
                 "ip -n %s link set tdx0 up && ip -n %s link set tdx0 up && "
                 "ip -n %s link set lo up && ip -n %s link set lo up",
                 ns_b, ns_a, ns_b, ns_a, ns_a, ns_b, ns_b, ns_a, ns_a, ns_b, ns_b, ns_a, ns_b, ns_a, ns_b, ns_a,
                 ns_b),
              "could not set up the veth pair");
    /* Two namespaces are one host to UCX: only tcp crosses the veth (docs/xfer.md). */
    many_requests_in("tcp", TD_XFER_RMA_AUTO, 11, 16, &(run_opts_t){.rx_ns = ns_a, .tx_ns = ns_b, .rx_ip = "10.77.0.1"});
}

/* ---- configuration -------------------------------------------------------------------- */

Test(xfer, rma_parse)
{
    td_xfer_rma_t r = TD_XFER_RMA_AM;
    cr_expect_eq(td_xfer_rma_parse("auto", &r), TD_OK);
    cr_expect_eq(r, TD_XFER_RMA_AUTO);
    cr_expect_eq(td_xfer_rma_parse("put", &r), TD_OK);
    cr_expect_eq(r, TD_XFER_RMA_PUT);
    cr_expect_eq(td_xfer_rma_parse("am", &r), TD_OK);
    cr_expect_eq(r, TD_XFER_RMA_AM);
    cr_expect_eq(td_xfer_rma_parse("rdma", &r), TD_ERR_INVALID);
    cr_expect(strstr(td_last_error(), "'rdma' is not auto, put or am") != NULL, "message: %s", td_last_error());
    cr_expect_eq(r, TD_XFER_RMA_AM, "output written on error");
    td_xfer_config_t cfg = td_xfer_config_default();
    cfg.quarantine_ms = 0;
    uv_loop_t loop;
    uv_loop_init(&loop);
    td_xfer_t *x = NULL;
    cr_expect_eq(td_xfer_create(&loop, &cfg, &x), TD_ERR_INVALID);
    cr_expect_null(x);
    uv_loop_close(&loop);
}

/* A device-to-host copier must be usable: start and poll, and pin with unpin or neither;
 * anything else is refused at create, naming what is missing, and nothing is made. */
Test(xfer, d2h_copier_must_be_whole)
{
    static const td_xfer_copier_t no_poll = {.start = tx_copy_start};
    static const td_xfer_copier_t pin_no_unpin = {.start = tx_copy_start, .poll = tx_copy_poll,
                                                  .pin = tx_copy_pin};
    const td_xfer_copier_t *bad[] = {&no_poll, &pin_no_unpin};
    uv_loop_t loop;
    uv_loop_init(&loop);
    for (size_t i = 0; i < TD_ARRAY_LEN(bad); i++) {
        td_xfer_config_t cfg = td_xfer_config_default();
        cfg.d2h = bad[i];
        td_xfer_t *x = NULL;
        cr_expect_eq(td_xfer_create(&loop, &cfg, &x), TD_ERR_INVALID, "copier %zu", i);
        cr_expect_null(x);
        cr_expect(strstr(td_last_error(), "needs start and poll") != NULL, "message: %s", td_last_error());
    }
    uv_loop_close(&loop);
}
