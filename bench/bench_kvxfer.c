/*
 * bench_kvxfer: `tandem bench kvxfer [--json] [--transport tcp|sm] [--rma auto|put|am]
 * [--iters N] [--window N] [--inflight N] [--tokens N] [--rounds R] [--checksum]` (--inflight:
 * the sender's max_inflight_ops, default td_xfer's; --tokens: one transfer size instead of
 * the five; --rounds: rounds per size, default 3; --checksum: block checksums on, as the
 * nodes send).
 *
 * Two processes on loopback (a forked receiver, this process the sender) move the KV of
 * one request of 16..4096 tokens of a Llama-3-8B-shaped layout (32 layers, 8 KV heads,
 * head dim 128, bf16, block 16: 64 KiB per block and layer) through td_xfer, layer by
 * layer, and time begin -> receiver's verdict (hello excluded: the connection is warm;
 * bind, puts or AMs, flush, kv-ready and its ack included). The receiver's pool is
 * allocated by td_xfer (a shared-memory segment under sm), as a decode node does.
 *
 * Per size, latency first: `iters` transfers one at a time (p50, p99; bytes / p50 is the
 * serial figure). Then R rounds; each round takes, back to back, our bandwidth (`iters`
 * batches of `window` transfers in flight), ucx_perftest (Debian's ucx-utils) on the same
 * transport with the primitive td_xfer used moving the whole transfer as one message (the
 * same working set as ours: the comparator), the same primitive at one operation's size
 * (one layer's run of blocks, a cache-hot buffer), ucp_am_bw at that size (only when put
 * was used) and the one-core copy ceiling. This VM's figures of either side swing 2-10x
 * run to run, so one perftest sample beside our aggregate says little; a round's samples
 * share the machine's state, so each ratio is taken within a round (ours_r / perftest_r)
 * and a row reports the median over rounds of every figure and of every ratio, and the
 * range of the main ratio. Rows: transport, primitive, tokens, bytes, window, rounds,
 * gbytes_per_s, perftest_gbytes_per_s, ratio, ratio_min, ratio_max, op_bytes,
 * perftest_op_gbytes_per_s, ratio_op, perftest_am_op_gbytes_per_s, copy_gbytes_per_s,
 * ratio_copy, serial_gbytes_per_s, p50_us, p99_us (docs/bench.md).
 */
#include "td_bench.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "td_kv.h"
#include "td_opts.h"
#include "td_stats.h"
#include "td_util.h"
#include "td_xfer.h"
#include "td_xfer_testkit.h"

#define KVX_MAX_TOKENS 4096
#define KVX_MAX_BLOCKS (KVX_MAX_TOKENS / 16)
#define KVX_RX_BLOCKS (2 * KVX_MAX_BLOCKS) /* receiver pool: two of the largest transfers */
#define KVX_MAX_WINDOW 16

static const td_kv_layout_t KVX_LAYOUT = {.model_fingerprint = 0x11a3a8b,
                                          .dtype = TD_BF16,
                                          .block_size = 16,
                                          .n_layers = 32,
                                          .n_kv_heads = 8,
                                          .head_dim = 128,
                                          .version = TD_KV_LAYOUT_VERSION};

typedef struct kvx_lease_req {
    uint64_t request_id;
    int32_t n_blocks;
} kvx_lease_req_t;

typedef struct kvx_lease {
    uint64_t lease_id;
    td_xfer_token_t token;
    int32_t blocks[KVX_MAX_BLOCKS];
} kvx_lease_t;

/* ---- receiver process: leases on request (pipe), adopts and frees ------------------------ */

typedef struct kvx_rx {
    td_xfer_t *x;
    td_kv_cache_t *kv;
    int rfd, wfd;
    uv_poll_t pipe_poll;
    bool stop;
} kvx_rx_t;

static void kvx_rx_ready(void *arg, const td_xfer_ready_t *r)
{
    kvx_rx_t *rx = arg;
    td_kv_unref_blocks_for(rx->kv, TD_KV_HOLDER_LANDED, r->blocks, r->n_blocks);
}

static void kvx_rx_on_pipe(uv_poll_t *h, int status, int events)
{
    kvx_rx_t *rx = h->data;
    kvx_lease_req_t q;
    kvx_lease_t l = {0};
    if (!td_xfer_testkit_read_all(rx->rfd, &q, sizeof q) ||
        td_xfer_lease_create(rx->x, q.request_id, q.n_blocks, 60000, l.blocks, &l.lease_id, &l.token) != TD_OK) {
        rx->stop = true;
        uv_poll_stop(h);
        return;
    }
    td_xfer_testkit_write_all(rx->wfd, &l, sizeof l);
}

static int kvx_receiver(int rfd, int wfd)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    kvx_rx_t rx = {.rfd = rfd, .wfd = wfd};
    uint32_t n_blocks = KVX_RX_BLOCKS + 8;
    td_kv_config_t kc = {.n_blocks = (int32_t)n_blocks, .block_size = 16};
    td_xfer_config_t cfg = td_xfer_config_default();
    cfg.name = "kvx-rx";
    if (td_kv_cache_create(&kc, &rx.kv) != TD_OK || td_xfer_create(&loop, &cfg, &rx.x) != TD_OK)
        return 2;
    td_xfer_pool_t p = {.layout = KVX_LAYOUT, .base = NULL, .n_blocks = n_blocks, .kv = rx.kv};
    uint8_t desc[TD_XFER_DESC_MAX];
    size_t len;
    if (td_xfer_register_pool(rx.x, &p, kvx_rx_ready, &rx) != TD_OK ||
        td_xfer_describe(rx.x, desc, sizeof desc, &len) != TD_OK)
        return 3;
    memset(td_xfer_pool_base(rx.x), 0, td_kv_pool_bytes(&KVX_LAYOUT, n_blocks)); /* first touch, untimed */
    td_xfer_testkit_write_all(wfd, &len, sizeof len);
    td_xfer_testkit_write_all(wfd, desc, len);
    uv_poll_init(&loop, &rx.pipe_poll, rfd);
    rx.pipe_poll.data = &rx;
    uv_poll_start(&rx.pipe_poll, UV_READABLE, kvx_rx_on_pipe);
    while (!rx.stop)
        uv_run(&loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&rx.pipe_poll, NULL);
    td_xfer_destroy(rx.x);
    uv_run(&loop, UV_RUN_DEFAULT); /* td_xfer's shutdown runs on the loop until its handles close */
    uv_loop_close(&loop);
    td_kv_cache_destroy(rx.kv);
    return 0;
}

/* ---- ucx_perftest ------------------------------------------------------------------------ */

/* Overall bandwidth in GB/s of `ucx_perftest -t test -s size`, or -1 when it cannot run. */
static double kvx_perftest(const char *test, size_t size, int port)
{
    char cmd[512];
    size_t iters = TD_MAX((size_t)5, TD_MIN((size_t)2000, ((size_t)256 << 20) / size));
    snprintf(cmd, sizeof cmd,
             "(timeout 60 ucx_perftest -p %d >/dev/null 2>&1 &) ; sleep 0.3; "
             "timeout 60 ucx_perftest 127.0.0.1 -p %d -t %s -s %zu -n %zu 2>/dev/null | grep '^Final:'",
             port, port, test, size, iters);
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    char line[512];
    double mbs = -1;
    if (fgets(line, sizeof line, f)) {
        double v[8];
        if (sscanf(line, "Final: %lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5]) == 6)
            mbs = v[5]; /* overall MB/s, MB = 2^20 */
    }
    pclose(f);
    return mbs < 0 ? -1 : mbs * 1048576.0 / 1e9;
}

/* ---- the copy ceiling ------------------------------------------------------------------ */

/* GB/s of the fastest one-core copy of `bytes` from src into memory that is not in cache
 * (a destination region of at least 256 MiB, each copy to the next slot), the better of
 * libc memcpy and non-temporal stores: what a shared-memory transfer into a real pool can
 * reach. -1 when the region cannot be allocated. */
static double kvx_copy_ceiling(const uint8_t *src, size_t bytes)
{
    size_t region = TD_MAX(2 * bytes, (size_t)256 << 20);
    uint8_t *dst = malloc(region);
    if (!dst)
        return -1;
    memset(dst, 1, region); /* first touch, untimed */
    size_t reps = TD_MAX((size_t)4, ((size_t)1 << 30) / bytes);
    double best = -1;
    for (int nt = 0; nt < 2; nt++) {
        size_t off = 0;
        uint64_t t0 = td_now_ns();
        for (size_t r = 0; r < reps; r++) {
            if (off + bytes > region)
                off = 0;
            if (nt)
                td_memcpy_stream(dst + off, src, bytes);
            else
                memcpy(dst + off, src, bytes);
            off += bytes;
        }
        double gbs = (double)bytes * (double)reps / ((double)(td_now_ns() - t0) * 1e-9) / 1e9;
        best = TD_MAX(best, gbs);
    }
    free(dst);
    return best;
}

/* ---- sender ------------------------------------------------------------------------------ */

typedef struct kvx_tx {
    bool done;
    td_status_t st;
} kvx_tx_t;

static void kvx_on_done(void *arg, uint64_t request_id, td_status_t st)
{
    kvx_tx_t *t = arg;
    t->done = true;
    t->st = st;
}

typedef struct kvx_ctx {
    uv_loop_t *loop;
    td_xfer_t *x;
    td_xfer_peer_t *peer;
    int lease_wfd, lease_rfd; /* lease requests to the receiver process, leases back */
    const uint8_t *pool;      /* the sender's source pool */
    uint32_t pool_blocks;
    const int32_t *src;       /* source block ids 0..KVX_MAX_BLOCKS-1 */
    uint64_t next_request;
    bool checksum;            /* --checksum: the receiver verifies every block before adopting */
} kvx_ctx_t;

/* Moves `win` transfers of `tokens` tokens at once: leases first (untimed), then every
 * layer handed to every transfer in layer order, as a prefill batch produces them; *us is
 * first begin -> last verdict. False (and a message) on any failure. */
static bool kvx_batch(kvx_ctx_t *c, uint32_t tokens, int32_t nb, int32_t win, double *us)
{
    kvx_lease_t l[KVX_MAX_WINDOW];
    kvx_tx_t t[KVX_MAX_WINDOW] = {0};
    td_xfer_send_t *s[KVX_MAX_WINDOW];
    uint64_t rid[KVX_MAX_WINDOW];
    for (int32_t i = 0; i < win; i++) {
        kvx_lease_req_t q = {.request_id = rid[i] = ++c->next_request, .n_blocks = nb};
        if (!td_xfer_testkit_write_all(c->lease_wfd, &q, sizeof q)) {
            fprintf(stderr, "kvxfer: the receiver process is gone\n");
            return false;
        }
    }
    for (int32_t i = 0; i < win; i++)
        if (!td_xfer_testkit_read_all(c->lease_rfd, &l[i], sizeof l[i])) {
            fprintf(stderr, "kvxfer: the receiver could not lease %d blocks\n", nb);
            return false;
        }
    uint64_t t0 = td_now_ns();
    for (int32_t i = 0; i < win; i++) {
        td_xfer_send_params_t p = {.request_id = rid[i], .lease_id = l[i].lease_id, .token = l[i].token,
                                   .dst_blocks = l[i].blocks,
                                   .n_dst_blocks = nb, .n_tokens = tokens, .checksum = c->checksum,
                                   .done = kvx_on_done, .arg = &t[i]};
        if (td_xfer_send_begin(c->x, c->peer, &p, &s[i]) != TD_OK) {
            fprintf(stderr, "kvxfer: %s\n", td_last_error());
            return false;
        }
    }
    for (uint32_t layer = 0; layer < KVX_LAYOUT.n_layers; layer++)
        for (int32_t i = 0; i < win; i++)
            td_xfer_send_layer(s[i], layer, c->pool + td_kv_block_offset(&KVX_LAYOUT, c->pool_blocks, layer, 0),
                               c->src);
    for (int32_t i = 0; i < win; i++)
        td_xfer_send_finish(s[i], 0);
    for (int32_t i = 0; i < win; i++)
        while (!t[i].done)
            uv_run(c->loop, UV_RUN_ONCE);
    *us = (double)(td_now_ns() - t0) * 1e-3;
    for (int32_t i = 0; i < win; i++)
        if (t[i].st != TD_OK) {
            fprintf(stderr, "kvxfer: transfer of %u tokens failed: %s\n", tokens, td_strerror(t[i].st));
            return false;
        }
    return true;
}

/* ---- one transfer size: latency, then rounds of interleaved samples ---------------------- */

/* One row's transfer. */
typedef struct kvx_size {
    uint32_t tokens;
    int32_t nb;      /* blocks per transfer */
    size_t bytes;    /* per transfer: n_layers runs of nb blocks */
    size_t op_bytes; /* one layer's run of contiguous blocks = one td_xfer operation */
    int32_t win;     /* transfers in flight together in the bandwidth phase */
} kvx_size_t;

/* One round's samples, GB/s, and its ratios ours / x; -1 where perftest (or the copy
 * region) could not give a figure. */
typedef struct kvx_round {
    double gbs;        /* ours: windowed batches */
    double ref;        /* perftest, the primitive used, whole transfer (the comparator) */
    double op_ref;     /* perftest, the primitive used, one operation's size */
    double am;         /* perftest ucp_am_bw at op size (= op_ref when AM was used) */
    double copy;       /* one-core copy ceiling of `bytes` */
    double ratio;      /* gbs / ref */
    double ratio_op;   /* gbs / op_ref */
    double ratio_copy; /* gbs / copy */
} kvx_round_t;

#define KVX_MAX_ROUNDS 50
#define KVX_PERFTEST_PORT 13450 /* each perftest run of a bench gets its own port from here */

/* p50 and p99 in us of `iters` transfers one at a time (two warm-up transfers first). Measured
 * once per size, before the rounds, so the figures keep their meaning: one pass, `iters`
 * samples. lat holds iters doubles. False (and a message) on any failure. */
static bool kvx_latency(kvx_ctx_t *c, const kvx_size_t *z, int64_t iters, double *lat, double *p50, double *p99)
{
    for (int64_t it = -2; it < iters; it++) {
        double us;
        if (!kvx_batch(c, z->tokens, z->nb, 1, &us))
            return false;
        if (it >= 0)
            lat[it] = us;
    }
    td_stats_sort(lat, (size_t)iters);
    *p50 = lat[iters / 2];
    *p99 = lat[TD_MIN(iters - 1, (int64_t)((double)iters * 0.99))];
    return true;
}

/* Our bandwidth in GB/s: `iters` batches of `win` transfers in flight together, as a prefill
 * node has many requests' transfers going at once (perftest's bw test keeps a window of
 * messages outstanding too); bytes moved / time from first begin to last verdict, summed
 * over batches. False (and a message) on any failure. */
static bool kvx_bandwidth(kvx_ctx_t *c, const kvx_size_t *z, int64_t iters, double *gbs)
{
    double busy_us = 0;
    for (int64_t it = 0; it < iters; it++) {
        double us;
        if (!kvx_batch(c, z->tokens, z->nb, z->win, &us))
            return false;
        busy_us += us;
    }
    *gbs = (double)z->bytes * (double)z->win * (double)iters / (busy_us * 1e-6) / 1e9;
    return true;
}

static double kvx_ratio(double ours, double other)
{
    return ours > 0 && other > 0 ? ours / other : -1;
}

/* One round: every figure of the row back to back, so they share the machine's state.
 * port and the next two are this round's perftest ports. */
static bool kvx_round(kvx_ctx_t *c, const kvx_size_t *z, int64_t iters, bool put_used, int port, kvx_round_t *r)
{
    const char *test = put_used ? "ucp_put_bw" : "ucp_am_bw";
    if (!kvx_bandwidth(c, z, iters, &r->gbs))
        return false;
    r->ref = kvx_perftest(test, z->bytes, port);
    r->op_ref = kvx_perftest(test, z->op_bytes, port + 1);
    r->am = put_used ? kvx_perftest("ucp_am_bw", z->op_bytes, port + 2) : r->op_ref;
    r->copy = kvx_copy_ceiling(c->pool, z->bytes);
    r->ratio = kvx_ratio(r->gbs, r->ref);
    r->ratio_op = kvx_ratio(r->gbs, r->op_ref);
    r->ratio_copy = kvx_ratio(r->gbs, r->copy);
    return true;
}

/* Median over n rounds of the figure at byte offset `field` of kvx_round_t (offsetof), over
 * the rounds that have it (> 0); -1 when none has. *lo and *hi (when not NULL) get its
 * range. */
static double kvx_median(const kvx_round_t *r, int64_t n, size_t field, double *lo, double *hi)
{
    double v[KVX_MAX_ROUNDS];
    size_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = *(const double *)((const char *)&r[i] + field);
        if (x > 0)
            v[m++] = x;
    }
    double med = -1, min = -1, max = -1;
    if (m) {
        td_stats_sort(v, m);
        med = td_stats_median(v, m);
        min = v[0];
        max = v[m - 1];
    }
    if (lo)
        *lo = min;
    if (hi)
        *hi = max;
    return med;
}

static td_status_t parse_rma(const td_opt_t *opt, const char *value)
{
    return td_xfer_rma_parse(value, opt->ptr);
}

/* The command line of `bench kvxfer` (the top of the file says what each does). */
typedef struct kvx_opts {
    bool json;
    bool checksum;         /* transfers with block checksums (td_xfer_send_params_t.checksum) */
    const char *transport; /* tcp or sm */
    td_xfer_rma_t rma;
    int64_t iters, inflight, window, only_tokens, rounds; /* inflight, only_tokens: 0 = not given */
} kvx_opts_t;

/* Reads the command line into o; false when the command ends here, with *rc_p its exit
 * status (--help: 0; a bad option: 2). */
static bool kvx_configure(kvx_opts_t *o, int argc, char **argv, int *rc_p)
{
    *o = (kvx_opts_t){.transport = "tcp", .rma = TD_XFER_RMA_AUTO, .iters = 20, .window = 8, .rounds = 3};
    const td_opt_t opts[] = {
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &o->json, .help = "one JSON document on stdout (docs/bench.md)"},
        {.name = "transport", .type = TD_OPT_STR, .ptr = &o->transport, .arg = "T", .help = "tcp (default) or sm"},
        {.name = "rma", .type = TD_OPT_FN, .ptr = &o->rma, .parse = parse_rma, .arg = "R",
         .help = "auto (default), put or am: the primitive the sender uses"},
        {.name = "iters", .type = TD_OPT_I64, .ptr = &o->iters, .min = 1, .max = 100000, .arg = "N",
         .help = "transfers per timed round (default 20)"},
        {.name = "window", .type = TD_OPT_I64, .ptr = &o->window, .min = 1, .max = KVX_MAX_WINDOW, .arg = "N",
         .help = "transfers in flight at once (default 8)"},
        {.name = "inflight", .type = TD_OPT_I64, .ptr = &o->inflight, .min = 1, .max = 65536, .arg = "N",
         .help = "the sender's max_inflight_ops (default: td_xfer's)"},
        {.name = "tokens", .type = TD_OPT_I64, .ptr = &o->only_tokens, .min = 1, .max = KVX_MAX_TOKENS, .arg = "N",
         .help = "one sequence length instead of 16, 64, 256, 1024 and 4096"},
        {.name = "rounds", .type = TD_OPT_I64, .ptr = &o->rounds, .min = 1, .max = KVX_MAX_ROUNDS, .arg = "R",
         .help = "rounds per size; figures are their medians (default 3)"},
        {.name = "checksum", .type = TD_OPT_BOOL, .ptr = &o->checksum,
         .help = "transfers carry block checksums the receiver verifies (what the nodes do by default)"},
    };
    td_opts_t spec = {.prog = "bench kvxfer", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r_opts = {0};
    *rc_p = 2;
    if (td_opts_parse(&spec, argc, argv, &r_opts) != TD_OK)
        return false;
    if (r_opts.help) {
        printf("usage: tandem bench kvxfer [--json] [--transport tcp|sm] [--rma auto|put|am] "
               "[--iters N] [--window N] [--inflight N] [--tokens N] [--rounds R] [--checksum]\n\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        *rc_p = 0;
        return false;
    }
    return true;
}

/* The figures go to the original stdout; anything else written there (UCX prints its
 * warnings to stdout) goes to stderr, so that --json output is JSON alone. stdout stays
 * on stderr for the rest of the process: UCX warns about unused variables when the
 * library unloads at exit. Returns the figures' stream, NULL (and a message) on failure. */
static FILE *kvx_results_stream(void)
{
    fflush(stdout);
    int res_fd = dup(STDOUT_FILENO);
    FILE *res = res_fd >= 0 ? fdopen(res_fd, "w") : NULL;
    if (!res || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
        perror("kvxfer: stdout");
        return NULL;
    }
    return res;
}

/* One row: a transfer size's figures, medians over the rounds (see the top of the file). */
typedef struct kvx_row {
    kvx_size_t z;
    const char *prim;                   /* the primitive td_xfer used: "put" or "am" */
    double gbs, ref, ratio, ratio_min, ratio_max, op_ref, ratio_op, am, copy, ratio_copy;
    double serial, p50, p99;            /* latency phase: bytes / p50 in GB/s, us */
} kvx_row_t;

/* Measures the row of `tokens` tokens, the k-th size (which places its rounds' perftest
 * ports): latency, then o->rounds rounds. lat holds o->iters doubles. False (and a message)
 * on any failure. */
static bool kvx_measure_size(kvx_ctx_t *c, const kvx_opts_t *o, size_t k, uint32_t tokens, double *lat,
                             kvx_row_t *row)
{
    kvx_size_t z = {.tokens = tokens};
    size_t bb = td_kv_block_bytes(&KVX_LAYOUT);
    z.nb = (int32_t)TD_DIV_CEIL(z.tokens, KVX_LAYOUT.block_size);
    z.bytes = (size_t)KVX_LAYOUT.n_layers * (size_t)z.nb * bb;
    z.op_bytes = (size_t)z.nb * bb;
    z.win = (int32_t)TD_MIN(o->window, (int64_t)(KVX_RX_BLOCKS / z.nb));
    td_xfer_stats_t before, after;
    td_xfer_get_stats(c->x, &before);
    double p50, p99;
    if (!kvx_latency(c, &z, o->iters, lat, &p50, &p99))
        return false;
    /* The primitive is chosen per peer at hello, so the latency phase tells which one
     * every round will use, and which perftest test is the comparator. */
    td_xfer_get_stats(c->x, &after);
    bool put_used = after.ops_put > before.ops_put;
    kvx_round_t round[KVX_MAX_ROUNDS];
    int64_t rounds = o->rounds;
    for (int64_t r = 0; r < rounds; r++)
        if (!kvx_round(c, &z, o->iters, put_used, KVX_PERFTEST_PORT + 3 * (int)((int64_t)k * rounds + r),
                       &round[r]))
            return false;
    *row = (kvx_row_t){.z = z, .prim = put_used ? "put" : "am", .p50 = p50, .p99 = p99};
    row->gbs = kvx_median(round, rounds, offsetof(kvx_round_t, gbs), NULL, NULL);
    row->ref = kvx_median(round, rounds, offsetof(kvx_round_t, ref), NULL, NULL);
    row->ratio = kvx_median(round, rounds, offsetof(kvx_round_t, ratio), &row->ratio_min, &row->ratio_max);
    row->op_ref = kvx_median(round, rounds, offsetof(kvx_round_t, op_ref), NULL, NULL);
    row->ratio_op = kvx_median(round, rounds, offsetof(kvx_round_t, ratio_op), NULL, NULL);
    row->am = kvx_median(round, rounds, offsetof(kvx_round_t, am), NULL, NULL);
    row->copy = kvx_median(round, rounds, offsetof(kvx_round_t, copy), NULL, NULL);
    row->ratio_copy = kvx_median(round, rounds, offsetof(kvx_round_t, ratio_copy), NULL, NULL);
    row->serial = (double)z.bytes / (p50 * 1e-6) / 1e9;
    return true;
}

/* The row as a JSON object added to rows (--json), or a line of the table on res. */
static void kvx_print_row(const kvx_opts_t *o, const kvx_row_t *w, FILE *res, cJSON *rows)
{
    const kvx_size_t *z = &w->z;
    if (o->json) {
        cJSON *row = cJSON_CreateObject();
        cJSON_AddStringToObject(row, "transport", o->transport);
        cJSON_AddStringToObject(row, "primitive", w->prim);
        cJSON_AddNumberToObject(row, "tokens", z->tokens);
        cJSON_AddNumberToObject(row, "bytes", (double)z->bytes);
        cJSON_AddNumberToObject(row, "window", z->win);
        cJSON_AddNumberToObject(row, "rounds", (double)o->rounds);
        bench_json_number(row, "gbytes_per_s", w->gbs, 3);
        bench_json_number(row, "perftest_gbytes_per_s", w->ref, 3);
        bench_json_number(row, "ratio", w->ratio, 3);
        bench_json_number(row, "ratio_min", w->ratio_min, 3);
        bench_json_number(row, "ratio_max", w->ratio_max, 3);
        cJSON_AddNumberToObject(row, "op_bytes", (double)z->op_bytes);
        bench_json_number(row, "perftest_op_gbytes_per_s", w->op_ref, 3);
        bench_json_number(row, "ratio_op", w->ratio_op, 3);
        bench_json_number(row, "perftest_am_op_gbytes_per_s", w->am, 3);
        bench_json_number(row, "copy_gbytes_per_s", w->copy, 3);
        bench_json_number(row, "ratio_copy", w->ratio_copy, 3);
        bench_json_number(row, "serial_gbytes_per_s", w->serial, 3);
        bench_json_number(row, "p50_us", w->p50, 1);
        bench_json_number(row, "p99_us", w->p99, 1);
        if (!cJSON_AddItemToArray(rows, row))
            cJSON_Delete(row);
        return;
    }
    char spread[32] = "-"; /* no round had a perftest figure */
    if (w->ratio_min > 0)
        snprintf(spread, sizeof spread, "%.2f-%.2f", w->ratio_min, w->ratio_max);
    fprintf(res, "%-9s %-4s %7u %12zu %3d %3d %9.3f %11.3f %6.2f %11s %12zu %11.3f %6.2f %11.3f %9.3f %6.2f "
           "%9.3f %10.1f %10.1f\n",
           o->transport, w->prim, z->tokens, z->bytes, z->win, (int)o->rounds, w->gbs, w->ref, w->ratio, spread,
           z->op_bytes, w->op_ref, w->ratio_op, w->am, w->copy, w->ratio_copy, w->serial, w->p50, w->p99);
}

int bench_kvxfer(int argc, char **argv)
{
    kvx_opts_t o;
    int rc;
    if (!kvx_configure(&o, argc, argv, &rc))
        return rc;
    const char *tls = td_xfer_testkit_tls(o.transport);
    if (!tls) {
        fprintf(stderr, "kvxfer: --transport must be tcp or sm, not %s\n", o.transport);
        return 2;
    }
    td_xfer_testkit_env(tls);
    FILE *res = kvx_results_stream();
    if (!res)
        return 1;

    int to_rx[2], to_tx[2];
    pid_t pid = -1;
    if (pipe(to_rx) || pipe(to_tx) || (pid = fork()) < 0) {
        perror("kvxfer: receiver process");
        fclose(res);
        return 1;
    }
    if (pid == 0) {
        close(to_rx[1]);
        close(to_tx[0]);
        _exit(kvx_receiver(to_rx[0], to_tx[1]));
    }
    close(to_rx[0]);
    close(to_tx[1]);

    rc = 1;
    uv_loop_t loop;
    uv_loop_init(&loop);
    td_xfer_t *x = NULL;
    td_xfer_peer_t *peer;
    uint8_t desc[TD_XFER_DESC_MAX];
    size_t len;
    uint32_t src_blocks = KVX_MAX_BLOCKS;
    size_t pool_bytes = td_kv_pool_bytes(&KVX_LAYOUT, src_blocks);
    uint8_t *pool = malloc(pool_bytes);
    int32_t src[KVX_MAX_BLOCKS];
    double *lat = malloc((size_t)o.iters * sizeof *lat);
    cJSON *rows = NULL; /* --json: one object per size */
    td_xfer_config_t cfg = td_xfer_config_default();
    cfg.name = "kvx-tx";
    cfg.listen_ip = NULL;
    cfg.rma = o.rma;
    if (o.inflight)
        cfg.max_inflight_ops = (uint32_t)o.inflight;
    if (!pool || !lat || !td_xfer_testkit_read_all(to_tx[0], &len, sizeof len) || len > sizeof desc || !td_xfer_testkit_read_all(to_tx[0], desc, len))
        goto out;
    for (size_t i = 0; i < pool_bytes; i += 8)
        memcpy(pool + i, &i, 8);
    for (int32_t i = 0; i < KVX_MAX_BLOCKS; i++)
        src[i] = i;
    if (td_xfer_create(&loop, &cfg, &x) != TD_OK ||
        td_xfer_connect(x, desc, len, &KVX_LAYOUT, &peer) != TD_OK)
        goto out;
    kvx_ctx_t ctx = {.loop = &loop, .x = x, .peer = peer, .lease_wfd = to_rx[1], .lease_rfd = to_tx[0],
                     .pool = pool, .pool_blocks = src_blocks, .src = src, .checksum = o.checksum};

    static const uint32_t all_sizes[] = {16, 64, 256, 1024, 4096};
    uint32_t one_size[] = {(uint32_t)o.only_tokens};
    const uint32_t *sizes = o.only_tokens ? one_size : all_sizes;
    size_t n_sizes = o.only_tokens ? 1 : TD_ARRAY_LEN(all_sizes);
    if (o.json)
        rows = cJSON_CreateArray();
    else
        fprintf(res, "%-9s %-4s %7s %12s %3s %3s %9s %11s %6s %11s %12s %11s %6s %11s %9s %6s %9s %10s %10s\n",
               "transport", "prim", "tokens", "bytes", "win", "rnd", "GB/s", "perftest", "ratio", "spread",
               "op bytes", "op perftest", "ratio", "am_bw op", "copy", "ratio", "1-at-once", "p50 us", "p99 us");
    for (size_t k = 0; k < n_sizes; k++) {
        kvx_row_t row;
        if (!kvx_measure_size(&ctx, &o, k, sizes[k], lat, &row))
            goto out;
        kvx_print_row(&o, &row, res, rows);
        fflush(res);
    }
    if (o.json) {
        cJSON *doc = rows;
        rows = NULL; /* the print frees it */
        if (bench_json_print(res, doc) != 0)
            goto out;
    }
    rc = 0;
out:
    close(to_rx[1]); /* the receiver stops at EOF */
    int status;
    waitpid(pid, &status, 0);
    td_xfer_destroy(x);
    uv_run(&loop, UV_RUN_DEFAULT); /* td_xfer's shutdown runs on the loop until its handles close */
    uv_loop_close(&loop);
    close(to_tx[0]);
    free(pool);
    free(lat);
    cJSON_Delete(rows);
    fclose(res);
    return rc;
}
