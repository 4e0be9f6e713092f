/*
 * bench_kernels: `tandem bench kernels [--json] [--device N] [--iters N]`.
 *
 * Measures, in one process on one GPU, the two ceilings and then our kernels against them:
 *   copy     device-to-device copy of 1 GiB: bytes read + written per second (the
 *            bandwidth ceiling);
 *   gemm     cuBLAS bf16 GEMM 8192^3 with fp32 accumulation through the backend's matmul
 *            (the compute ceiling), TFLOP/s;
 *   prefill  our prefill attention, 1 sequence of 4096 tokens, 32 heads (MHA), head_dim 128,
 *            causal, bf16; TFLOP/s counted as 2*2*N^2*d*heads/2;
 *   decode   our decode attention, batch 64, context 4096, 32 query / 8 KV heads, head_dim
 *            128, bf16 cache in shuffled blocks of 16; bytes of KV read per second and that
 *            as a fraction of the copy bandwidth.
 * Everything goes through the backend interface (td_backend.h), so what is timed is what
 * the engine runs. Each figure is the median over 5 rounds of `iters` back-to-back launches
 * (synchronised before and after each round), after warm-up. Inputs are random, never zero.
 * bench/sdpa_ref.py times PyTorch's SDPA on the same shapes for the comparison.
 *
 * Without a CUDA device (or built without CUDA) it says so and exits 1.
 *
 * On the CPU: `--cpu` times the backend's quantized matmuls of one forward pass of a model
 * shape; `--packed` times td_cpu_pack's kernels alone, one type and row count at a time, as
 * the matmul calls them (the figures docs/kernels.md quotes for the packed tiles).
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/td_cpu_isa.h"
#include "cpu/td_cpu_pack.h"
#include "td_backend.h"
#include "td_bench.h"
#include "td_cli.h"
#include "td_quant.h"
#include "td_stats.h"
#include "td_util.h"

typedef struct bench_kernels_result {
    double copy_gbps;        /* read + write GB/s */
    double gemm_tflops;
    double prefill_tflops;
    double prefill_ms;
    double decode_gbps;      /* KV bytes read per second */
    double decode_ms;
    double decode_frac;      /* decode_gbps / copy_gbps */
} bench_kernels_result_t;

typedef struct bench_kernels_copy {
    void *src, *dst;
    size_t bytes;
} bench_kernels_copy_t;

/* what a timed round runs */
typedef td_status_t (*bench_kernels_fn)(td_backend_t *be, void *arg);

/* median seconds per call over 5 rounds of `iters` calls, after 2 warm-up calls */
static td_status_t bench_kernels_time(td_backend_t *be, bench_kernels_fn fn, void *arg, int iters,
                                      double *sec_p)
{
    double t[5];
    td_status_t st;
    for (int i = 0; i < 2; i++)
        if ((st = fn(be, arg)) != TD_OK)
            return st;
    if ((st = be->ops->sync(be)) != TD_OK)
        return st;
    for (int r = 0; r < 5; r++) {
        double t0 = td_now_s();
        for (int i = 0; i < iters; i++)
            if ((st = fn(be, arg)) != TD_OK)
                return st;
        if ((st = be->ops->sync(be)) != TD_OK)
            return st;
        t[r] = (td_now_s() - t0) / iters;
    }
    td_stats_sort(t, 5);
    *sec_p = td_stats_median(t, 5);
    return TD_OK;
}

/* fills n bytes of device memory with random `dtype` values in [-1, 1], never zero */
static td_status_t bench_kernels_fill(td_backend_t *be, void *dst, size_t bytes, td_dtype_t dtype)
{
    size_t chunk = TD_MIN(bytes, (size_t)64 << 20);
    size_t elt = td_dtype_size(dtype);
    float *f = malloc(chunk / elt * sizeof(float));
    void *h = malloc(chunk);
    if (!h || !f) {
        free(f), free(h);
        return td_errorf(TD_ERR_NOMEM, "bench kernels: cannot allocate %zu host bytes", 3 * chunk);
    }
    uint64_t s = 0x2545F4914F6CDD1Dull;
    for (size_t i = 0; i < chunk / elt; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        float u = (float)((s >> 40) & 0xFFFF) / 65536.0f;
        f[i] = (s & 1 ? 1.0f : -1.0f) * (0.05f + 0.95f * u);
    }
    td_dtype_convert(h, dtype, f, TD_F32, chunk / elt);
    free(f);
    td_status_t st = TD_OK;
    for (size_t off = 0; off < bytes && st == TD_OK; off += chunk)
        st = be->ops->copy_h2d(be, (char *)dst + off, h, TD_MIN(chunk, bytes - off));
    if (st == TD_OK)
        st = be->ops->sync(be);
    free(h);
    return st;
}

/* ---- copy ------------------------------------------------------------------------------------ */

static td_status_t bench_kernels_copy_run(td_backend_t *be, void *arg)
{
    bench_kernels_copy_t *c = arg;
    return be->ops->copy_d2d(be, c->dst, c->src, c->bytes);
}

td_status_t bench_copy_bandwidth(td_backend_t *be, size_t bytes, int iters, double *bytes_per_s)
{
    bench_kernels_copy_t c = {NULL, NULL, bytes};
    double sec = 0;
    td_status_t st;
    if ((st = be->ops->alloc(be, c.bytes, &c.src)) != TD_OK)
        return st;
    if ((st = be->ops->alloc(be, c.bytes, &c.dst)) == TD_OK &&
        (st = bench_kernels_fill(be, c.src, c.bytes, TD_BF16)) == TD_OK &&
        (st = bench_kernels_time(be, bench_kernels_copy_run, &c, iters, &sec)) == TD_OK)
        *bytes_per_s = 2.0 * (double)c.bytes / sec;
    be->ops->free(be, c.dst);
    be->ops->free(be, c.src);
    return st;
}

/* ---- gemm ------------------------------------------------------------------------------------ */

static td_status_t bench_kernels_gemm_run(td_backend_t *be, void *arg)
{
    return be->ops->matmul(be, arg);
}

td_status_t bench_matmul_flops(td_backend_t *be, int32_t m, int32_t n, int32_t k, td_dtype_t w_dtype,
                               int iters, double *flops_p)
{
    size_t act = td_dtype_size(be->act_dtype);
    void *x = NULL, *w = NULL, *y = NULL;
    double sec = 0;
    td_status_t st;
    if ((st = be->ops->alloc(be, (size_t)m * k * act, &x)) != TD_OK)
        return st;
    td_matmul_params_t mp = {.m = m, .n = n, .k = k, .x = x, .w_dtype = w_dtype};
    if ((st = be->ops->alloc(be, (size_t)n * k * td_dtype_size(w_dtype), &w)) == TD_OK &&
        (st = be->ops->alloc(be, (size_t)m * n * act, &y)) == TD_OK &&
        (st = bench_kernels_fill(be, x, (size_t)m * k * act, be->act_dtype)) == TD_OK &&
        (st = bench_kernels_fill(be, w, (size_t)n * k * td_dtype_size(w_dtype), w_dtype)) == TD_OK) {
        mp.w = w;
        mp.y = y;
        if ((st = bench_kernels_time(be, bench_kernels_gemm_run, &mp, iters, &sec)) == TD_OK)
            *flops_p = 2.0 * m * (double)n * k / sec;
    }
    be->ops->free(be, y);
    be->ops->free(be, w);
    be->ops->free(be, x);
    return st;
}

/* ---- attention ----------------------------------------------------------------------------- */

typedef struct bench_kernels_attn {
    td_attn_params_t p;
    bool decode;
} bench_kernels_attn_t;

static td_status_t bench_kernels_attn_run(td_backend_t *be, void *arg)
{
    bench_kernels_attn_t *a = arg;
    return a->decode ? be->ops->attn_decode(be, &a->p) : be->ops->attn_prefill(be, &a->p);
}

/* step metadata for n_seqs sequences of ctx tokens with q_len new rows each, blocks
   shuffled across the pool; arrays freed by bench_kernels_step_free */
typedef struct bench_kernels_step {
    td_step_meta_t m;
    int32_t *buf;
} bench_kernels_step_t;

static td_status_t bench_kernels_step_make(bench_kernels_step_t *s, int32_t n_seqs, int32_t q_len,
                                           int32_t ctx, int32_t bs)
{
    int32_t nb = TD_DIV_CEIL(ctx, bs), n_tok = n_seqs * q_len, n_blocks = n_seqs * nb;
    size_t n = 3 * (size_t)n_tok + 2 * (size_t)n_seqs + 1 + (size_t)n_blocks;
    s->buf = malloc(n * sizeof(int32_t));
    if (!s->buf)
        return td_errorf(TD_ERR_NOMEM, "bench kernels: cannot allocate step metadata");
    int32_t *tokens = s->buf, *pos = tokens + n_tok, *slots = pos + n_tok;
    int32_t *seq_start = slots + n_tok, *seq_len = seq_start + n_seqs + 1, *bt = seq_len + n_seqs;
    for (int32_t i = 0; i < n_blocks; i++)
        bt[i] = i;
    uint64_t r = 88172645463325252ull;
    for (int32_t i = n_blocks - 1; i > 0; i--) {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        int32_t j = (int32_t)(r % (uint64_t)(i + 1)), t = bt[i];
        bt[i] = bt[j];
        bt[j] = t;
    }
    for (int32_t s_i = 0; s_i < n_seqs; s_i++) {
        seq_start[s_i] = s_i * q_len;
        seq_len[s_i] = ctx;
        for (int32_t k = 0; k < q_len; k++) {
            int32_t row = s_i * q_len + k, p = ctx - q_len + k;
            tokens[row] = 1;
            pos[row] = p;
            slots[row] = bt[s_i * nb + p / bs] * bs + p % bs;
        }
    }
    seq_start[n_seqs] = n_tok;
    s->m = (td_step_meta_t){.n_tokens = n_tok, .n_seqs = n_seqs, .tokens = tokens,
                            .positions = pos, .slots = slots, .seq_start = seq_start,
                            .seq_len = seq_len, .block_tables = bt, .max_blocks = nb,
                            .max_q_len = q_len, .max_seq_len = ctx};
    return TD_OK;
}

/* times one attention op; fills *ms_p with milliseconds per call */
static td_status_t bench_kernels_attn(td_backend_t *be, bool decode, int32_t n_seqs, int32_t q_len,
                                      int32_t ctx, int32_t n_heads, int32_t n_kv, int32_t hd,
                                      int iters, double *ms_p)
{
    const int32_t bs = 16;
    td_kv_layout_t ly = {.model_fingerprint = 1, .dtype = TD_BF16, .block_size = bs, .n_layers = 1,
                         .n_kv_heads = (uint32_t)n_kv, .head_dim = (uint32_t)hd,
                         .version = TD_KV_LAYOUT_VERSION};
    bench_kernels_step_t s = {0};
    void *pool = NULL, *q = NULL, *out = NULL;
    td_status_t st = bench_kernels_step_make(&s, n_seqs, q_len, ctx, bs);
    if (st != TD_OK)
        return st;
    int32_t n_blocks = n_seqs * TD_DIV_CEIL(ctx, bs);
    size_t pool_bytes = td_kv_pool_bytes(&ly, (uint32_t)n_blocks);
    size_t q_bytes = (size_t)n_seqs * q_len * n_heads * hd * 2;
    if ((st = be->ops->alloc(be, pool_bytes, &pool)) != TD_OK)
        goto out_step;
    if ((st = be->ops->alloc(be, q_bytes, &q)) != TD_OK)
        goto out_pool;
    if ((st = be->ops->alloc(be, q_bytes, &out)) != TD_OK)
        goto out_q;
    if ((st = bench_kernels_fill(be, pool, pool_bytes, TD_BF16)) != TD_OK ||
        (st = bench_kernels_fill(be, q, q_bytes, TD_BF16)) != TD_OK ||
        (st = be->ops->set_step(be, &s.m)) != TD_OK)
        goto out_out;
    bench_kernels_attn_t a = {
        .p = {.q = q, .out = out, .kv_layer = pool, .layout = &ly, .n_blocks = n_blocks,
              .n_heads = n_heads, .scale = 1.0f / sqrtf((float)hd), .partition_tokens = 0},
        .decode = decode};
    double sec = 0;
    if ((st = bench_kernels_time(be, bench_kernels_attn_run, &a, iters, &sec)) == TD_OK)
        *ms_p = sec * 1e3;
out_out:
    be->ops->free(be, out);
out_q:
    be->ops->free(be, q);
out_pool:
    be->ops->free(be, pool);
out_step:
    free(s.buf);
    return st;
}

static td_status_t bench_kernels_measure(td_backend_t *be, int iters, bench_kernels_result_t *r)
{
    td_status_t st;
    double v = 0;

    /* copy: 1 GiB; gemm: bf16 8192^3 */
    if ((st = bench_copy_bandwidth(be, (size_t)1 << 30, iters, &v)) != TD_OK)
        return st;
    r->copy_gbps = v / 1e9;
    if ((st = bench_matmul_flops(be, 8192, 8192, 8192, TD_BF16, TD_MAX(iters / 2, 1), &v)) != TD_OK)
        return st;
    r->gemm_tflops = v / 1e12;

    /* prefill attention: 4096 tokens, 32 heads, hd 128, causal */
    const double n = 4096, d = 128, heads = 32;
    if ((st = bench_kernels_attn(be, false, 1, 4096, 4096, 32, 32, 128, iters, &r->prefill_ms)) != TD_OK)
        return st;
    r->prefill_tflops = 2.0 * 2.0 * n * n * d * heads / 2.0 / (r->prefill_ms * 1e-3) / 1e12;

    /* decode attention: batch 64, ctx 4096, 32 q / 8 kv heads, hd 128 */
    if ((st = bench_kernels_attn(be, true, 64, 1, 4096, 32, 8, 128, iters, &r->decode_ms)) != TD_OK)
        return st;
    double kv_bytes = 64.0 * 4096 * 8 * 128 * 2 /* K and V */ * 2 /* bf16 */;
    r->decode_gbps = kv_bytes / (r->decode_ms * 1e-3) / 1e9;
    r->decode_frac = r->decode_gbps / r->copy_gbps;
    return TD_OK;
}

/* ---- CPU: block-quantized matmuls of a whole model ------------------------------------ */

/* The matmuls of one forward pass of a model shape: per layer q, k, v, o, gate, up, down. */
typedef struct bench_kernels_shape {
    const char *name;
    int32_t dim, hidden, kv_dim, n_layers, vocab;
} bench_kernels_shape_t;

static const bench_kernels_shape_t bench_kernels_shapes[] = {
    {"smollm2-135m", 576, 1536, 192, 30, 49152},
    {"llama-3.2-1b", 2048, 8192, 512, 16, 128256},
};

typedef struct bench_kernels_qmat {
    td_matmul_params_t p;
    void *w;
} bench_kernels_qmat_t;

typedef struct bench_kernels_qmodel {
    bench_kernels_qmat_t *mats; /* [n_layers * 7 + 1]: each layer's q, k, v, o, gate, up,
                                   down, then the LM head */
    int n_mats;
    float *x, *y;
} bench_kernels_qmodel_t;

/* A matrix [n][k] of block dtype t: random quants, f16 scales 2^-7 (finite, normal) */
static void *bench_kernels_qweights(td_dtype_t t, int32_t n, int32_t k)
{
    size_t bytes = td_dtype_bytes(t, (size_t)n * k), bb = td_dtype_block_bytes(t);
    unsigned char *w = malloc(bytes);
    if (!w)
        return NULL;
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < bytes; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        w[i] = (unsigned char)(s >> 32);
    }
    uint16_t d = td_f32_to_f16(0.0078125f);
    for (size_t b = 0; b < bytes / bb; b++) {
        unsigned char *blk = w + b * bb;
        size_t at = t == TD_Q6_K ? offsetof(td_block_q6_k_t, d) : 0;
        memcpy(blk + at, &d, 2);
        if (t == TD_Q4_1 || t == TD_Q4_K || t == TD_Q5_K) /* the min (Q4_1 m, Q4_K/Q5_K dmin) follows d */
            memcpy(blk + 2, &d, 2);
    }
    return w;
}

/* one forward's matmuls: m rows through every layer, the LM head on the last row only (as
   llama.cpp computes logits in a prompt-processing test) */
static td_status_t bench_kernels_qforward(td_backend_t *be, void *arg)
{
    bench_kernels_qmodel_t *q = arg;
    td_status_t st;
    for (int i = 0; i < q->n_mats; i++)
        if ((st = be->ops->matmul(be, &q->mats[i].p)) != TD_OK)
            return st;
    return TD_OK;
}

/* Seconds per forward of shape `sh` at m rows, layers in dtype t, the head in Q8_0; every
 * layer has its own weights, so decode streams the whole model from memory as it would. */
static td_status_t bench_kernels_qmodel_time(td_backend_t *be, const bench_kernels_shape_t *sh,
                                             td_dtype_t t, int32_t m, int iters, double *sec_p)
{
    const int32_t nk[8][2] = {{sh->dim, sh->dim},    {sh->kv_dim, sh->dim}, {sh->kv_dim, sh->dim},
                              {sh->dim, sh->dim},    {sh->hidden, sh->dim}, {sh->hidden, sh->dim},
                              {sh->dim, sh->hidden}, {sh->vocab, sh->dim}};
    bench_kernels_qmodel_t q = {.n_mats = sh->n_layers * 7 + 1};
    size_t xmax = (size_t)m * sh->hidden;
    td_status_t st = TD_OK;
    q.mats = calloc((size_t)q.n_mats, sizeof(*q.mats));
    q.x = calloc(xmax, sizeof(float));
    q.y = calloc(TD_MAX(xmax, (size_t)sh->vocab), sizeof(float));
    for (size_t i = 0; q.x && i < xmax; i++)
        q.x[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    for (int i = 0; i < q.n_mats && q.mats && q.x && q.y; i++) {
        int at = i == q.n_mats - 1 ? 7 : i % 7;
        td_dtype_t wt = at == 7 ? TD_Q8_0 : t;
        q.mats[i].w = bench_kernels_qweights(wt, nk[at][0], nk[at][1]);
        if (!q.mats[i].w) {
            st = td_errorf(TD_ERR_NOMEM, "bench kernels: cannot allocate weights");
            break;
        }
        q.mats[i].p = (td_matmul_params_t){.m = at == 7 ? 1 : m, .n = nk[at][0], .k = nk[at][1],
                                           .x = q.x, .w = q.mats[i].w, .w_dtype = wt, .y = q.y,
                                           .accumulate = at == 3 || at == 6};
    }
    if (!q.mats || !q.x || !q.y)
        st = td_errorf(TD_ERR_NOMEM, "bench kernels: cannot allocate activations");
    /* best of 7 rounds, not the median: on a shared CPU the other tenants only ever add */
    for (int r = 0; r < 8 && st == TD_OK; r++) {
        double t0 = td_now_s();
        for (int i = 0; i < iters && st == TD_OK; i++)
            st = bench_kernels_qforward(be, &q);
        double sec = (td_now_s() - t0) / iters;
        if (r == 1 || (r > 1 && sec < *sec_p)) /* round 0 warms up */
            *sec_p = sec;
    }
    for (int i = 0; q.mats && i < q.n_mats; i++)
        free(q.mats[i].w);
    free(q.mats);
    free(q.x);
    free(q.y);
    return st;
}

/* `tandem bench kernels --cpu`: tokens/s of a model's matmuls at batch-1 decode and prefill */
static int bench_kernels_cpu(const char *preset, const char *quant, int64_t threads,
                             int64_t prompt, int iters, bool json)
{
    const bench_kernels_shape_t *sh = NULL;
    for (size_t i = 0; i < TD_ARRAY_LEN(bench_kernels_shapes); i++)
        if (strcmp(preset, bench_kernels_shapes[i].name) == 0)
            sh = &bench_kernels_shapes[i];
    int t = td_dtype_parse(quant);
    if (!sh || t < 0 || !td_dtype_is_block(t)) {
        fprintf(stderr, "tandem bench kernels: --preset is smollm2-135m or llama-3.2-1b, --quant "
                        "a block type (q8_0, q4_0, q4_1, q4_k, q6_k); got %s, %s\n", preset, quant);
        return 2;
    }
    td_cpu_config_t cfg = {.n_threads = (int)threads};
    td_backend_t *be = NULL;
    if (td_backend_cpu_create(&cfg, &be) != TD_OK) {
        fprintf(stderr, "tandem bench kernels: %s\n", td_last_error());
        return 1;
    }
    if (!((be->weight_dtypes >> t) & 1u)) {
        fprintf(stderr, "tandem bench kernels: the cpu backend has no %s matmul\n", quant);
        td_backend_destroy(be);
        return 1;
    }
    double dec = 0, pp = 0;
    td_status_t st = bench_kernels_qmodel_time(be, sh, (td_dtype_t)t, 1, iters, &dec);
    if (st == TD_OK)
        st = bench_kernels_qmodel_time(be, sh, (td_dtype_t)t, (int32_t)prompt,
                                       TD_MAX(iters / 8, 1), &pp);
    td_backend_destroy(be);
    if (st != TD_OK) {
        fprintf(stderr, "tandem bench kernels: %s\n", td_last_error());
        return 1;
    }
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "bench", "kernels_cpu");
        cJSON_AddStringToObject(j, "preset", sh->name);
        cJSON_AddStringToObject(j, "quant", td_dtype_name((td_dtype_t)t));
        cJSON_AddNumberToObject(j, "threads", (double)threads);
        bench_json_number(j, "decode_matmul_ms", dec * 1e3, 3);
        bench_json_number(j, "decode_matmul_tokens_per_s", 1.0 / dec, 1);
        cJSON_AddNumberToObject(j, "prompt_tokens", (double)prompt);
        bench_json_number(j, "prefill_matmul_ms", pp * 1e3, 3);
        bench_json_number(j, "prefill_matmul_tokens_per_s", (double)prompt / pp, 1);
        return bench_json_print(stdout, j);
    }
    printf("%s %s, %d thread(s), matmuls only (layers in %s, LM head q8_0 on one row), "
           "best of 7 rounds\n",
           sh->name, td_dtype_name((td_dtype_t)t), (int)threads, td_dtype_name((td_dtype_t)t));
    printf("decode  batch 1       %9.3f ms  %8.1f tokens/s\n", dec * 1e3, 1.0 / dec);
    printf("prefill %4d tokens   %9.3f ms  %8.1f tokens/s\n", (int)prompt, pp * 1e3,
           (double)prompt / pp);
    return 0;
}

/* ---- CPU: the packed kernels alone (`--packed`) ----------------------------------------- */

#define BENCH_PACKED_MAX_ROWS 8 /* --rows values */
#define BENCH_PACKED_CALL_ROWS 64 /* activation rows a kernel call, as td_cpu_matmul's pmatmul */
#define BENCH_PACKED_CALL_GROUPS 8 /* W groups a call, as pmatmul */

typedef struct bench_packed_rows {
    int n;
    int64_t m[BENCH_PACKED_MAX_ROWS];
} bench_packed_rows_t;

/* --rows N...: each a row count in 1..65536, at most BENCH_PACKED_MAX_ROWS of them */
static td_status_t bench_packed_rows_parse(const td_opt_t *opt, const char *value)
{
    bench_packed_rows_t *r = opt->ptr;
    char *end = NULL;
    long long v = strtoll(value, &end, 10);
    if (!*value || *end || v < 1 || v > 65536)
        return td_errorf(TD_ERR_INVALID, "bench kernels: --%s takes row counts in 1..65536, got '%s'",
                         opt->name, value);
    if (r->n == BENCH_PACKED_MAX_ROWS)
        return td_errorf(TD_ERR_INVALID, "bench kernels: --%s takes at most %d row counts", opt->name,
                         BENCH_PACKED_MAX_ROWS);
    r->m[r->n++] = v;
    return TD_OK;
}

typedef struct bench_packed_case {
    td_cpu_pack_fn fn;
    const void *wp;     /* the packed [n][k] matrix */
    size_t n_groups, k, stride;
    const unsigned char *a; /* [m][stride] quantized activation rows */
    size_t m;
    float *y;           /* [m][n_groups * 16] */
} bench_packed_case_t;

/* One matmul's kernel calls, as pmatmul makes them on one thread: 64 activation rows by 8
 * groups a call, the prefetch bound at the end of the matrix (one task's share) */
static void bench_packed_run(const bench_packed_case_t *c)
{
    size_t ldy = c->n_groups * TD_CPU_PACK_ROWS;
    for (size_t i0 = 0; i0 < c->m; i0 += BENCH_PACKED_CALL_ROWS) {
        size_t mm = TD_MIN((size_t)BENCH_PACKED_CALL_ROWS, c->m - i0);
        for (size_t g = 0; g < c->n_groups; g += BENCH_PACKED_CALL_GROUPS)
            c->fn(c->wp, g, TD_MIN(c->n_groups, g + BENCH_PACKED_CALL_GROUPS), c->n_groups, c->k,
                  c->a + i0 * c->stride, mm, c->y + i0 * ldy + g * TD_CPU_PACK_ROWS, ldy);
    }
}

/* Best seconds per matmul over `rounds` rounds (after one warm-up round), each round enough
 * calls to last about 10 ms: on a shared CPU the other tenants only ever add. */
static double bench_packed_time(const bench_packed_case_t *c, int rounds)
{
    double t0 = td_now_s();
    bench_packed_run(c);
    double once = td_now_s() - t0;
    int calls = (int)TD_MIN(100000.0, TD_MAX(1.0, 0.01 / TD_MAX(once, 1e-7)));
    double best = INFINITY;
    for (int r = 0; r <= rounds; r++) {
        t0 = td_now_s();
        for (int i = 0; i < calls; i++)
            bench_packed_run(c);
        double sec = (td_now_s() - t0) / calls;
        if (r > 0 && sec < best) /* round 0 warms up */
            best = sec;
    }
    return best;
}

typedef struct bench_packed_opts {
    const char *quant; /* one type, or NULL: every packed type */
    int64_t k, n, act_bytes, rounds;
    bench_packed_rows_t rows;
    bool json;
} bench_packed_opts_t;

/*
 * `tandem bench kernels --packed`: td_cpu_pack's kernels of the table the CPU backend runs
 * (TANDEM_CPU_ISA honoured), one thread, on a packed n x k matrix of random blocks that the
 * backend's own weight_pack made (2 MiB pages, as the engine's weights) against m activation
 * rows its act_row quantized (one or two bytes): ms per matmul, GMAC/s, and for m = 1 GB/s
 * of packed weights read. Exit 2 on bad options, 1 when the backend cannot be made.
 */
static int bench_kernels_packed(const bench_packed_opts_t *o)
{
    static const td_dtype_t all[] = {TD_Q8_0, TD_Q4_0, TD_Q4_1, TD_Q4_K, TD_Q5_K, TD_Q6_K, TD_IQ4_XS};
    td_dtype_t types[TD_ARRAY_LEN(all)];
    size_t n_types = 0;
    if (o->quant) {
        int t = td_dtype_parse(o->quant);
        if (t < 0 || !td_cpu_pack_supports((td_dtype_t)t)) {
            fprintf(stderr, "tandem bench kernels: --quant with --packed is one of q8_0, q4_0, q4_1, q4_k, "
                            "q5_k, q6_k, iq4_xs; got %s\n", o->quant);
            return 2;
        }
        types[n_types++] = (td_dtype_t)t;
    } else {
        for (size_t i = 0; i < TD_ARRAY_LEN(all); i++)
            types[n_types++] = all[i];
    }
    if (o->k % 256 != 0) {
        fprintf(stderr, "tandem bench kernels: --k must be a multiple of 256 (a K-quant super-block), "
                        "got %lld\n", (long long)o->k);
        return 2;
    }
    bench_packed_rows_t rows = o->rows;
    if (rows.n == 0)
        rows = (bench_packed_rows_t){3, {1, 8, 64}};
    int64_t m_max = 0;
    for (int i = 0; i < rows.n; i++)
        m_max = TD_MAX(m_max, rows.m[i]);

    td_cpu_isa_t isa;
    td_backend_t *bes[2] = {NULL, NULL}; /* [one]: the backend of two-byte rows, of one-byte rows; each
                                             packs the weights in its mode's layout (td_cpu_pack.h) */
    if (td_cpu_isa_choose(NULL, &isa) != TD_OK) {
        fprintf(stderr, "tandem bench kernels: %s\n", td_last_error());
        return 1;
    }
    for (int one = 0; one < 2; one++) {
        td_cpu_config_t cfg = {.n_threads = 1, .act_one_byte = one}; /* isa NULL: TANDEM_CPU_ISA, else the best */
        if (td_backend_cpu_create(&cfg, &bes[one]) != TD_OK) {
            fprintf(stderr, "tandem bench kernels: %s\n", td_last_error());
            td_backend_destroy(bes[0]);
            return 1;
        }
    }
    const td_cpu_pack_ops_t *ops = td_cpu_pack_ops(isa);
    size_t k = (size_t)o->k, n = (size_t)o->n, stride = td_cpu_pack_act_stride(k);
    size_t n_groups = (n + TD_CPU_PACK_ROWS - 1) / TD_CPU_PACK_ROWS;
    float *x = malloc((size_t)m_max * k * sizeof(float));
    unsigned char *a = aligned_alloc(64, (size_t)m_max * stride);
    float *y = malloc((size_t)m_max * n_groups * TD_CPU_PACK_ROWS * sizeof(float));
    cJSON *j = o->json ? cJSON_CreateObject() : NULL, *results = NULL;
    int rc = 0;
    if (!x || !a || !y) {
        fprintf(stderr, "tandem bench kernels: cannot allocate %lld activation rows of %zu\n", (long long)m_max, k);
        rc = 1;
        goto out;
    }
    uint64_t s = 0x2545F4914F6CDD1Dull;
    for (size_t i = 0; i < (size_t)m_max * k; i++) { /* in [-1, 1], never zero */
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x[i] = (s & 1 ? 1.0f : -1.0f) * (0.05f + 0.95f * (float)((s >> 40) & 0xFFFF) / 65536.0f);
    }
    if (j) {
        cJSON_AddStringToObject(j, "bench", "kernels_packed");
        cJSON_AddStringToObject(j, "cpu_isa", td_cpu_isa_name(isa));
        cJSON_AddStringToObject(j, "table", ops->name);
        cJSON_AddNumberToObject(j, "threads", 1);
        cJSON_AddNumberToObject(j, "k", (double)k);
        cJSON_AddNumberToObject(j, "n", (double)n);
        cJSON_AddNumberToObject(j, "rounds", (double)o->rounds);
        results = cJSON_AddArrayToObject(j, "results");
    } else {
        printf("packed kernels, cpu_isa %s (table %s), 1 thread, n %zu x k %zu, best of %d rounds\n",
               td_cpu_isa_name(isa), ops->name, n, k, (int)o->rounds);
        printf("%-7s %5s %6s %10s %9s %8s\n", "type", "bytes", "m", "ms", "GMAC/s", "GB/s");
    }
    for (size_t ti = 0; ti < n_types && rc == 0; ti++) {
        td_dtype_t t = types[ti];
        void *w = bench_kernels_qweights(t, (int32_t)n, (int32_t)k);
        if (!w) {
            fprintf(stderr, "tandem bench kernels: out of memory for %zu x %zu %s weights\n", n, k, td_dtype_name(t));
            rc = 1;
            break;
        }
        double gb = (double)td_cpu_pack_bytes(t, n, k) / 1e9;
        for (int bytes = 2; bytes >= 1 && rc == 0; bytes--) {
            if (o->act_bytes != 0 && o->act_bytes != bytes)
                continue;
            bool one = bytes == 1;
            td_backend_t *be = bes[one];
            void *wp = NULL;
            if (be->ops->weight_pack(be, w, t, (int32_t)n, (int32_t)k, &wp) != TD_OK || !wp) {
                fprintf(stderr, "tandem bench kernels: cannot pack %zu x %zu %s weights: %s\n", n, k,
                        td_dtype_name(t), td_last_error());
                rc = 1;
                break;
            }
            for (int64_t i = 0; i < m_max; i++)
                td_cpu_pack_act_row(ops, x + (size_t)i * k, a + (size_t)i * stride, t, k, one);
            for (int ri = 0; ri < rows.n; ri++) {
                bench_packed_case_t c = {.fn = td_cpu_pack_fn_of(ops, t, one), .wp = wp, .n_groups = n_groups,
                                         .k = k, .stride = stride, .a = a, .m = (size_t)rows.m[ri], .y = y};
                double sec = bench_packed_time(&c, (int)o->rounds);
                double gmacs = (double)c.m * (double)n * (double)k / sec / 1e9;
                if (j) {
                    cJSON *r = cJSON_CreateObject();
                    cJSON_AddStringToObject(r, "type", td_dtype_name(t));
                    cJSON_AddNumberToObject(r, "act_bytes", bytes);
                    cJSON_AddNumberToObject(r, "m", (double)c.m);
                    bench_json_number(r, "ms", sec * 1e3, 4);
                    bench_json_number(r, "gmac_per_s", gmacs, 2);
                    if (c.m == 1)
                        bench_json_number(r, "weight_gbps", gb / sec, 2);
                    cJSON_AddItemToArray(results, r);
                } else if (c.m == 1) {
                    printf("%-7s %5d %6zu %10.4f %9.2f %8.2f\n", td_dtype_name(t), bytes, c.m, sec * 1e3, gmacs, gb / sec);
                } else {
                    printf("%-7s %5d %6zu %10.4f %9.2f %8s\n", td_dtype_name(t), bytes, c.m, sec * 1e3, gmacs, "");
                }
            }
            be->ops->free(be, wp);
        }
        free(w);
    }
out:
    free(y);
    free(a);
    free(x);
    td_backend_destroy(bes[0]);
    td_backend_destroy(bes[1]);
    if (j) {
        if (rc != 0) {
            cJSON_Delete(j);
            return rc;
        }
        return bench_json_print(stdout, j);
    }
    return rc;
}

int bench_kernels(int argc, char **argv)
{
    bool json = false, cpu = false, packed = false;
    int64_t device = 0, iters = 20, threads = 1, prompt = 512;
    const char *preset = "smollm2-135m", *quant = NULL;
    bench_packed_opts_t po = {.k = 2048, .n = 2048, .act_bytes = 0, .rounds = 7};
    const td_opt_t opts[] = {
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &json, .help = "one JSON document on stdout (docs/bench.md)"},
        {.name = "device", .type = TD_OPT_I64, .ptr = &device, .min = 0, .max = 63, .arg = "N",
         .help = "CUDA device (default 0)"},
        {.name = "iters", .type = TD_OPT_I64, .ptr = &iters, .min = 1, .max = 100000, .arg = "N",
         .help = "calls per timed round (default 20; prefill with --cpu: a 1/8 of it)"},
        {.name = "cpu", .type = TD_OPT_BOOL, .ptr = &cpu,
         .help = "the CPU backend's block-quantized matmuls instead (below)"},
        {.name = "packed", .type = TD_OPT_BOOL, .ptr = &packed,
         .help = "the CPU's packed quantized kernels alone, one thread (below)"},
        {.name = "preset", .type = TD_OPT_STR, .ptr = &preset, .arg = "NAME",
         .help = "with --cpu: smollm2-135m (default) or llama-3.2-1b"},
        {.name = "quant", .type = TD_OPT_STR, .ptr = &quant, .arg = "TYPE",
         .help = "with --cpu: layer weights q8_0, q4_0 (default), q4_1, q4_k or q6_k;\n"
                 "with --packed: one of q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, iq4_xs (default: each)"},
        {.name = "threads", .type = TD_OPT_I64, .ptr = &threads, .min = 1, .max = 1024, .arg = "N",
         .help = "with --cpu: pool threads (default 1)"},
        {.name = "prompt-tokens", .type = TD_OPT_I64, .ptr = &prompt, .min = 1, .max = 65536,
         .arg = "N", .help = "with --cpu: prefill rows (default 512)"},
        {.name = "k", .type = TD_OPT_I64, .ptr = &po.k, .min = 256, .max = 1 << 20, .arg = "N",
         .help = "with --packed: weights a row, a multiple of 256 (default 2048)"},
        {.name = "n", .type = TD_OPT_I64, .ptr = &po.n, .min = 1, .max = 1 << 22, .arg = "N",
         .help = "with --packed: weight rows (default 2048; 65536 streams a 1B-wide matrix from memory)"},
        {.name = "rows", .type = TD_OPT_FN, .ptr = &po.rows, .parse = bench_packed_rows_parse, .multi = true,
         .arg = "M...", .help = "with --packed: activation row counts (default 1 8 64)"},
        {.name = "act-bytes", .type = TD_OPT_I64, .ptr = &po.act_bytes, .min = 0, .max = 2, .arg = "B",
         .help = "with --packed: 1 (--device cpu:q8's rows), 2 (the default device's), 0 both (default)"},
        {.name = "rounds", .type = TD_OPT_I64, .ptr = &po.rounds, .min = 1, .max = 1000, .arg = "N",
         .help = "with --packed: timed rounds of ~10 ms, the best reported (default 7)"},
    };
    td_opts_t spec = {.prog = "bench kernels", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r_opts = {0};
    if (td_opts_parse(&spec, argc, argv, &r_opts) != TD_OK)
        return 2;
    if (r_opts.help) {
        printf("usage: tandem bench kernels [--json] [--device N] [--iters N]\n"
               "       tandem bench kernels --cpu [--preset NAME] [--quant TYPE] [--threads N]\n"
               "       tandem bench kernels --packed [--quant TYPE] [--k N] [--n N] [--rows M...]\n"
               "                            [--act-bytes B] [--rounds N]\n"
               "  D2D copy and cuBLAS bf16 GEMM ceilings, then our prefill attention\n"
               "  (4k tokens, hd 128, causal, bf16) and decode attention (batch 64, ctx 4k,\n"
               "  32 q / 8 kv heads) on one CUDA device.\n"
               "  --cpu: the CPU backend's quantized matmuls of one forward pass of a model\n"
               "  shape, batch-1 decode and a 512-token prefill, as tokens/s (compare with\n"
               "  llama-bench -p 512 -n 128, which times the whole model).\n"
               "  --packed: each packed type's kernel of the table the CPU backend runs\n"
               "  (TANDEM_CPU_ISA honoured), one thread, an n x k matrix of random blocks\n"
               "  against m quantized activation rows: ms, GMAC/s, GB/s of weights at m = 1.\n\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return 0;
    }
    if (packed) {
        po.quant = quant;
        po.json = json;
        return bench_kernels_packed(&po);
    }
    if (!quant)
        quant = "q4_0";
    if (cpu)
        return bench_kernels_cpu(preset, quant, threads, prompt, (int)iters, json);
    td_backend_t *be = NULL;
    td_cuda_config_t cfg = {(int32_t)device, TD_BF16};
    td_status_t st = td_backend_cuda_create(&cfg, &be);
    if (st != TD_OK) {
        fprintf(stderr, "tandem bench kernels: needs a CUDA device: %s\n", td_last_error());
        return 1;
    }
    bench_kernels_result_t r = {0};
    st = bench_kernels_measure(be, (int)iters, &r);
    td_backend_destroy(be);
    if (st != TD_OK) {
        fprintf(stderr, "tandem bench kernels: %s\n", td_last_error());
        return 1;
    }
    if (json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "bench", "kernels");
        bench_json_number(j, "copy_gbps", r.copy_gbps, 1);
        bench_json_number(j, "gemm_bf16_tflops", r.gemm_tflops, 1);
        bench_json_number(j, "prefill_attn_ms", r.prefill_ms, 3);
        bench_json_number(j, "prefill_attn_tflops", r.prefill_tflops, 1);
        bench_json_number(j, "decode_attn_ms", r.decode_ms, 3);
        bench_json_number(j, "decode_attn_gbps", r.decode_gbps, 1);
        bench_json_number(j, "decode_attn_frac_of_copy", r.decode_frac, 3);
        return bench_json_print(stdout, j);
    } else {
        printf("copy d2d 1 GiB              %8.1f GB/s (read + write)\n", r.copy_gbps);
        printf("cuBLAS bf16 gemm 8192^3     %8.1f TFLOP/s\n", r.gemm_tflops);
        printf("prefill attn 4k hd128 causal %7.3f ms  %6.1f TFLOP/s\n", r.prefill_ms,
               r.prefill_tflops);
        printf("decode attn b64 ctx4k 32/8  %8.3f ms  %6.1f GB/s  %.2f of copy\n", r.decode_ms,
               r.decode_gbps, r.decode_frac);
    }
    return 0;
}
