/*
 * td_cpu_backend: the CPU backend's context, memory, step metadata and the row-wise ops
 * (embed, rmsnorm, rope fused with the KV write, swiglu, gather_rows, moe_combine, copy_blocks). Matmul
 * and attention
 * live in td_cpu_matmul.c and td_cpu_attn.c.
 *
 * One set of threads: the backend's own td_pool_t does all the parallel work and OpenBLAS
 * is pinned to one thread (it is only ever called from inside pool tasks on slices).
 * Activations are f32; weights f32/f16/bf16 or block-quantized (the types td_cpu_quant
 * has dots for; embed dequantizes a row with td_quant's reference); the KV pool
 * f32/f16/bf16.
 */
#include "td_cpu.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "td_cpu_bgemm.h"
#include "td_cpu_pack.h"
#include "td_log.h"
#include "td_quant.h"

/* ---- memory --------------------------------------------------------------------- */

static td_status_t cpu_alloc(td_backend_t *be, size_t bytes, void **ptr_p)
{
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded < bytes)
        return td_errorf(TD_ERR_NOMEM, "cpu backend: allocation of %zu bytes overflows", bytes);
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p)
        return td_errorf(TD_ERR_NOMEM, "cpu backend: out of memory allocating %zu bytes", bytes);
    *ptr_p = p;
    return TD_OK;
}

static void cpu_free(td_backend_t *be, void *ptr)
{
    free(ptr);
}

/* Weights a decode step streams whole: in 2 MiB pages where the kernel gives them
 * (transparent huge pages in "madvise" mode, the common default, only for ranges that ask):
 * a 4 KiB page stops the hardware prefetcher at every page and costs a TLB miss per 64
 * lines. The cost: each matrix is rounded up to a whole huge page and its partly used last
 * one is resident in full (1B Q4_0: 1.63 GB maximum RSS against 1.52 GB, for decode 37.2
 * against 35.2 tokens/s at avx512vnni; advising only the whole pages kept the memory and
 * lost the speed). One arena for all packed weights would waste one tail, not one a matrix.
 * Freed by cpu_free (aligned_alloc). */
static td_status_t cpu_alloc_weights(size_t bytes, void **ptr_p)
{
    const size_t huge = (size_t)2 << 20;
    if (bytes < huge)
        return cpu_alloc(NULL, bytes, ptr_p);
    size_t rounded = (bytes + huge - 1) & ~(huge - 1);
    void *p = aligned_alloc(huge, rounded);
    if (!p)
        return td_errorf(TD_ERR_NOMEM, "cpu backend: out of memory allocating %zu bytes of weights", bytes);
    (void)madvise(p, rounded, MADV_HUGEPAGE); /* advice: without it the pages are 4 KiB */
    *ptr_p = p;
    return TD_OK;
}

static td_status_t cpu_copy(td_backend_t *be, void *dst, const void *src, size_t bytes)
{
    if (bytes)
        memmove(dst, src, bytes);
    return TD_OK;
}

/* Device memory is host memory: the copy is done before we return (no wake owed). */
static td_status_t cpu_copy_d2h_start(td_backend_t *be, void *dst, const void *src, size_t bytes,
                                      void (*wake)(void *wake_arg), void *wake_arg, uint64_t *ticket_p)
{
    *ticket_p = 0;
    return cpu_copy(be, dst, src, bytes);
}

static td_status_t cpu_copy_poll(td_backend_t *be, uint64_t ticket)
{
    return TD_OK;
}

static void cpu_copy_quiesce(td_backend_t *be)
{
}

static td_status_t cpu_host_pin(td_backend_t *be, void *p, size_t bytes)
{
    return TD_OK;
}

static void cpu_host_unpin(td_backend_t *be, void *p)
{
}

static td_status_t cpu_sync(td_backend_t *be)
{
    return TD_OK;
}

td_status_t td_cpu_reserve(td_cpu_t *cpu, size_t per_thread, size_t shared)
{
    per_thread = (per_thread + 63) & ~(size_t)63;
    if (per_thread > cpu->scratch_stride) {
        size_t total;
        if (!td_mul_size(per_thread, (size_t)cpu->n_threads, &total))
            return td_errorf(TD_ERR_NOMEM, "cpu backend: scratch of %zu bytes per thread overflows",
                             per_thread);
        unsigned char *p = aligned_alloc(64, total);
        if (!p)
            return td_errorf(TD_ERR_NOMEM, "cpu backend: out of memory for %zu bytes of scratch",
                             total);
        free(cpu->scratch);
        cpu->scratch = p;
        cpu->scratch_stride = per_thread;
    }
    shared = (shared + 63) & ~(size_t)63;
    if (shared > cpu->shared_bytes) {
        unsigned char *p = aligned_alloc(64, shared);
        if (!p)
            return td_errorf(TD_ERR_NOMEM, "cpu backend: out of memory for %zu bytes of scratch",
                             shared);
        free(cpu->shared);
        cpu->shared = p;
        cpu->shared_bytes = shared;
    }
    return TD_OK;
}

static td_status_t cpu_set_step(td_backend_t *be, const td_step_meta_t *meta)
{
    td_cpu_t *cpu = td_cpu_of(be);
    cpu->meta = *meta;
    cpu->have_step = true;
    cpu->rope_freq = NULL; /* new positions */
    return TD_OK;
}

/* Tasks for `rows` independent rows of `row_cost` elements: enough for balance, few enough
   that a task does ~16k elements of work. */
static int row_tasks(const td_cpu_t *cpu, int rows, size_t row_cost)
{
    size_t per = row_cost ? (16384 + row_cost - 1) / row_cost : (size_t)rows;
    if (per < 1)
        per = 1;
    size_t tasks = ((size_t)rows + per - 1) / per;
    size_t cap = (size_t)cpu->n_threads * 8;
    if (tasks > cap)
        tasks = cap;
    if (tasks > (size_t)rows)
        tasks = (size_t)rows;
    return (int)tasks;
}

/* Row range [r0, r1) of task `task` of `n_tasks` over `rows` rows. */
static void task_rows(int task, int n_tasks, int rows, int *r0, int *r1)
{
    *r0 = (int)((int64_t)rows * task / n_tasks);
    *r1 = (int)((int64_t)rows * (task + 1) / n_tasks);
}

/* ---- embed ------------------------------------------------------------------------ */

typedef struct embed_job {
    float *x;
    const unsigned char *table;
    td_dtype_t dtype;
    int32_t dim;
    const int32_t *tokens;
    void (*dequantize)(const void *src, float *dst, size_t n); /* block tables, else NULL */
    int rows, n_tasks;
} embed_job_t;

static void embed_task(void *arg, int task, int thread)
{
    embed_job_t *j = arg;
    int r0, r1;
    task_rows(task, j->n_tasks, j->rows, &r0, &r1);
    size_t row_bytes = td_dtype_bytes(j->dtype, (size_t)j->dim);
    for (int r = r0; r < r1; r++) {
        float *x = j->x + (size_t)r * j->dim;
        const unsigned char *row = j->table + (size_t)j->tokens[r] * row_bytes;
        if (j->dequantize)
            j->dequantize(row, x, (size_t)j->dim);
        else
            td_cpu_to_f32(x, row, j->dtype, (size_t)j->dim);
    }
}

static td_status_t cpu_embed(td_backend_t *be, void *x, const void *table, td_dtype_t table_dtype,
                             int32_t dim)
{
    td_cpu_t *cpu = td_cpu_of(be);
    TD_ASSERT(cpu->have_step);
    embed_job_t j = {.x = x, .table = table, .dtype = table_dtype, .dim = dim,
                     .tokens = cpu->meta.tokens, .rows = cpu->meta.n_tokens};
    if (td_dtype_is_block(table_dtype))
        j.dequantize = td_ggml_type(td_dtype_to_ggml(table_dtype))->dequantize;
    j.n_tasks = row_tasks(cpu, j.rows, (size_t)dim);
    td_pool_run(cpu->pool, j.n_tasks, embed_task, &j);
    return TD_OK;
}

/* ---- rmsnorm ---------------------------------------------------------------------- */

typedef struct rmsnorm_job {
    float *out, *x, *residual;
    const float *w; /* [dim] f32 (converted once when the weight is not f32) */
    int32_t rows, dim;
    float eps;
    int n_tasks;
    float (*dot)(const float *a, const float *b, int n); /* the sum of squares */
} rmsnorm_job_t;

static void rmsnorm_task(void *arg, int task, int thread)
{
    rmsnorm_job_t *j = arg;
    int r0, r1;
    task_rows(task, j->n_tasks, j->rows, &r0, &r1);
    int d = j->dim;
    for (int r = r0; r < r1; r++) {
        float *x = j->x + (size_t)r * d;
        float *o = j->out + (size_t)r * d;
        const float *src = x;
        if (j->residual) {
            float *res = j->residual + (size_t)r * d;
            for (int i = 0; i < d; i++)
                res[i] += x[i];
            src = res;
        }
        float ss = j->dot(src, src, d);
        float inv = (float)(1.0 / sqrt((double)ss / d + (double)j->eps));
        const float *w = j->w;
        for (int i = 0; i < d; i++)
            o[i] = src[i] * inv * w[i];
    }
}

static td_status_t cpu_rmsnorm(td_backend_t *be, void *out, void *x, void *residual, const void *w,
                               td_dtype_t w_dtype, int32_t rows, int32_t dim, float eps)
{
    td_cpu_t *cpu = td_cpu_of(be);
    rmsnorm_job_t j = {.out = out, .x = x, .residual = residual, .w = w, .rows = rows,
                       .dim = dim, .eps = eps, .dot = cpu->k.row->dot};
    if (w_dtype != TD_F32) {
        td_status_t st = td_cpu_reserve(cpu, 0, (size_t)dim * sizeof(float));
        if (st != TD_OK)
            return st;
        td_cpu_to_f32((float *)cpu->shared, w, w_dtype, (size_t)dim);
        j.w = (const float *)cpu->shared;
    }
    j.n_tasks = row_tasks(cpu, rows, (size_t)dim * 2);
    td_pool_run(cpu->pool, j.n_tasks, rmsnorm_task, &j);
    return TD_OK;
}

/* ---- rope + KV write ------------------------------------------------------------------------- */

typedef struct rope_job {
    float *q, *k;
    const float *v;
    int32_t n_heads, n_kv_heads, head_dim;
    const float *inv_freq; /* NULL: no rotation */
    float *angles;         /* NULL: each row's cos and sin computed here; else [rows][hd]: */
    bool fill;             /* written here (the step's first rotation), else read */
    td_rope_style_t style;
    const int32_t *positions, *slots;
    unsigned char *layer;
    const td_kv_layout_t *layout;
    int rows, n_tasks;
} rope_job_t;

static void rope_heads(float *x, int n_heads, int hd, const float *cs, const float *sn,
                       td_rope_style_t style)
{
    int half = hd / 2;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * hd;
        if (style == TD_ROPE_PAIRS) {
            for (int i = 0; i < half; i++) {
                float a = v[2 * i], b = v[2 * i + 1];
                v[2 * i] = a * cs[i] - b * sn[i];
                v[2 * i + 1] = a * sn[i] + b * cs[i];
            }
        } else {
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * cs[i] - b * sn[i];
                v[i + half] = a * sn[i] + b * cs[i];
            }
        }
    }
}

/* Rows r0..r1 of one task: rotate the row's q and k (unless inv_freq is NULL), then write
   its k and v to the row's slot; the row is still in cache when it is written. */
static void rope_task(void *arg, int task, int thread)
{
    rope_job_t *j = arg;
    int r0, r1;
    task_rows(task, j->n_tasks, j->rows, &r0, &r1);
    int hd = j->head_dim, half = hd / 2;
    float cs[512], sn[512]; /* head_dim <= 1024 (td_kv_layout_validate) */
    const td_kv_layout_t *l = j->layout;
    td_dtype_t t = (td_dtype_t)l->dtype;
    size_t row = (size_t)j->n_kv_heads * hd;
    size_t row_bytes = td_kv_bytes(l->dtype, row); /* one token's K (or V): whole Q8_0 blocks */
    for (int r = r0; r < r1; r++) {
        float *k = j->k + (size_t)r * row;
        if (j->inv_freq) {
            float *c_r = j->angles ? j->angles + (size_t)r * hd : cs, *s_r = j->angles ? c_r + half : sn;
            if (!j->angles || j->fill) {
                /* the angle in double: at position 32k a float product is off by ~1e-3 rad */
                double pos = (double)j->positions[r];
                for (int i = 0; i < half; i++) {
                    double s, c;
                    sincos(pos * (double)j->inv_freq[i], &s, &c);
                    c_r[i] = (float)c;
                    s_r[i] = (float)s;
                }
            }
            if (j->q)
                rope_heads(j->q + (size_t)r * j->n_heads * hd, j->n_heads, hd, c_r, s_r, j->style);
            rope_heads(k, j->n_kv_heads, hd, c_r, s_r, j->style);
        }
        int32_t slot = j->slots[r];
        if (slot < 0) /* a padding row with no cache slot */
            continue;
        size_t b = (size_t)slot / l->block_size, off = (size_t)slot % l->block_size;
        size_t k_at = (b * 2 + 0) * l->block_size + off; /* in token rows */
        size_t v_at = (b * 2 + 1) * l->block_size + off;
        td_cpu_from_f32(j->layer + k_at * row_bytes, t, k, row);
        td_cpu_from_f32(j->layer + v_at * row_bytes, t, j->v + (size_t)r * row, row);
    }
}

static td_status_t cpu_rope_kv_write(td_backend_t *be, const td_rope_kv_params_t *p)
{
    td_cpu_t *cpu = td_cpu_of(be);
    TD_ASSERT(cpu->have_step);
    const td_kv_layout_t *l = p->layout;
    int32_t hd = (int32_t)l->head_dim, nkv = (int32_t)l->n_kv_heads;
    TD_ASSERT(hd % 2 == 0 && hd <= 1024);
    rope_job_t j = {.q = p->q, .k = p->k, .v = p->v, .n_heads = p->n_heads, .n_kv_heads = nkv,
                    .head_dim = hd, .inv_freq = p->inv_freq, .style = p->style,
                    .positions = cpu->meta.positions, .slots = cpu->meta.slots,
                    .layer = p->kv_layer, .layout = l, .rows = cpu->meta.n_tokens};
    if (p->inv_freq) { /* the step's angles: computed once, by its first layer (sincos in double
                          was 1.5% of a SmolLM2 prefill, every layer's the same) */
        size_t need = (size_t)j.rows * (size_t)hd;
        j.fill = cpu->rope_freq != p->inv_freq || cpu->rope_hd != hd;
        if (j.fill && need > cpu->rope_cap) {
            float *t = malloc(need * sizeof(float));
            if (t) { /* else every row computes its own, as without a table */
                free(cpu->rope);
                cpu->rope = t;
                cpu->rope_cap = need;
            }
        }
        if (need <= cpu->rope_cap) {
            j.angles = cpu->rope;
            cpu->rope_freq = p->inv_freq;
            cpu->rope_hd = hd;
        } else {
            cpu->rope_freq = NULL;
        }
    }
    j.n_tasks = row_tasks(cpu, j.rows, (size_t)(p->n_heads + 3 * nkv) * hd * 2 + (size_t)hd * 20);
    td_pool_run(cpu->pool, j.n_tasks, rope_task, &j);
    return TD_OK;
}

/* ---- swiglu ----------------------------------------------------------------------- */

typedef struct swiglu_job {
    float *out;
    const float *gate, *up;
    size_t n;
    int n_tasks;
    void (*fn)(float *out, const float *gate, const float *up, size_t i0, size_t i1);
} swiglu_job_t;

/* silu(g) * u = g / (1 + e^-g) * u; g is clamped at -88 first (NaN passes): below it silu
 * is under 6e-37 in size, and -inf would otherwise give -inf / 1.65e38 = -inf instead of
 * silu's limit 0. The 8-lane form and the scalar one give the same bits (td_cpu_exp). */
static inline float swiglu1(float g, float u)
{
    g = g < -88.0f ? -88.0f : g;
    return g / (1.0f + td_cpu_exp(-g)) * u;
}

static void swiglu_scalar(float *out, const float *gate, const float *up, size_t i0, size_t i1)
{
    for (size_t i = i0; i < i1; i++)
        out[i] = swiglu1(gate[i], up[i]);
}

static float dot_scalar(const float *a, const float *b, int n)
{
    return td_cpu_dot(a, b, n);
}

static const td_cpu_row_ops_t row_scalar = {.dot = dot_scalar, .swiglu = swiglu_scalar};

#if TD_CPU_X86
TD_CPU_AVX2 static void swiglu_avx2(float *out, const float *gate, const float *up, size_t i, size_t i1)
{
    const __m256 lo = _mm256_set1_ps(-88.0f), one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= i1; i += 8) {
        /* max_ps gives its second operand where one is NaN: g stays NaN */
        __m256 g = _mm256_max_ps(lo, _mm256_loadu_ps(gate + i));
        __m256 e = td_cpu_exp8(_mm256_xor_ps(g, neg));
        __m256 y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i));
        _mm256_storeu_ps(out + i, y);
    }
    for (; i < i1; i++)
        out[i] = swiglu1(gate[i], up[i]);
}

static float dot_avx2(const float *a, const float *b, int n)
{
    return td_cpu_dot_avx2(a, b, n);
}

static const td_cpu_row_ops_t row_avx2 = {.dot = dot_avx2, .swiglu = swiglu_avx2};
#endif

const td_cpu_row_ops_t *td_cpu_row_ops(td_cpu_isa_t isa)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
#if TD_CPU_X86
    if (isa >= TD_CPU_ISA_AVX2)
        return &row_avx2;
#endif
    return &row_scalar;
}

static void swiglu_task(void *arg, int task, int thread)
{
    swiglu_job_t *j = arg;
    size_t i0 = j->n * (size_t)task / (size_t)j->n_tasks;
    size_t i1 = j->n * (size_t)(task + 1) / (size_t)j->n_tasks;
    j->fn(j->out, j->gate, j->up, i0, i1);
}

static td_status_t cpu_swiglu(td_backend_t *be, void *out, const void *gate, const void *up,
                              int32_t rows, int32_t hidden)
{
    td_cpu_t *cpu = td_cpu_of(be);
    swiglu_job_t j = {.out = out, .gate = gate, .up = up, .n = (size_t)rows * hidden,
                      .fn = cpu->k.row->swiglu};
    size_t tasks = (j.n + 16383) / 16384;
    if (tasks > (size_t)cpu->n_threads * 4)
        tasks = (size_t)cpu->n_threads * 4;
    j.n_tasks = tasks ? (int)tasks : 1;
    td_pool_run(cpu->pool, j.n_tasks, swiglu_task, &j);
    return TD_OK;
}

/* ---- gather_rows, copy_blocks ------------------------------------------- */

static td_status_t cpu_gather_rows(td_backend_t *be, void *dst, const void *src,
                                   const int32_t *rows, int32_t n, int32_t dim)
{
    size_t row_bytes = (size_t)dim * sizeof(float);
    for (int32_t i = 0; i < n; i++)
        memmove((unsigned char *)dst + (size_t)i * row_bytes,
                (const unsigned char *)src + (size_t)rows[i] * row_bytes, row_bytes);
    return TD_OK;
}

/* ---- moe_combine ------------------------------------------------------------------ */

typedef struct combine_job {
    float *x;
    const float *y;
    const int32_t *slots;
    const float *weights;
    int32_t n, k, dim, n_tasks;
} combine_job_t;

static void combine_task(void *arg, int task, int thread)
{
    combine_job_t *j = arg;
    (void)thread;
    int r0, r1;
    task_rows(task, j->n_tasks, j->n, &r0, &r1);
    float acc[256];
    for (int t = r0; t < r1; t++) {
        float *x = j->x + (size_t)t * (size_t)j->dim;
        const int32_t *slot = j->slots + (size_t)t * (size_t)j->k;
        const float *w = j->weights + (size_t)t * (size_t)j->k;
        /* per element: 0 + w0 y0 + w1 y1 + ..., then x += that; a stripe of elements at a
           time so that the inner loop runs along a row */
        for (int32_t i0 = 0; i0 < j->dim; i0 += (int32_t)TD_ARRAY_LEN(acc)) {
            int32_t n = TD_MIN(j->dim - i0, (int32_t)TD_ARRAY_LEN(acc));
            memset(acc, 0, (size_t)n * sizeof *acc);
            for (int32_t r = 0; r < j->k; r++) {
                const float *y = j->y + (size_t)slot[r] * (size_t)j->dim + i0;
                for (int32_t i = 0; i < n; i++)
                    acc[i] += w[r] * y[i];
            }
            for (int32_t i = 0; i < n; i++)
                x[i0 + i] += acc[i];
        }
    }
}

static td_status_t cpu_moe_combine(td_backend_t *be, void *x, const void *y, const int32_t *slots,
                                   const float *weights, int32_t n, int32_t k, int32_t dim)
{
    td_cpu_t *cpu = td_cpu_of(be);
    combine_job_t j = {.x = x, .y = y, .slots = slots, .weights = weights, .n = n, .k = k, .dim = dim};
    j.n_tasks = row_tasks(cpu, n, (size_t)k * (size_t)dim);
    td_pool_run(cpu->pool, j.n_tasks, combine_task, &j);
    return TD_OK;
}

static td_status_t cpu_copy_blocks(td_backend_t *be, void *pool, const td_kv_layout_t *layout,
                                   int32_t n_blocks, const int32_t *src, const int32_t *dst,
                                   int32_t n)
{
    unsigned char *base = pool;
    size_t bytes = td_kv_block_bytes(layout);
    for (uint32_t layer = 0; layer < layout->n_layers; layer++)
        for (int32_t i = 0; i < n; i++) {
            TD_ASSERT(src[i] >= 0 && src[i] < n_blocks && dst[i] >= 0 && dst[i] < n_blocks);
            memmove(base + td_kv_block_offset(layout, (uint32_t)n_blocks, layer, (uint32_t)dst[i]),
                    base + td_kv_block_offset(layout, (uint32_t)n_blocks, layer, (uint32_t)src[i]),
                    bytes);
        }
    return TD_OK;
}

/* ---- lifetime --------------------------------------------------------------------- */

static void cpu_destroy(td_backend_t *be)
{
    td_cpu_t *cpu = td_cpu_of(be);
    td_pool_destroy(cpu->pool);
    free(cpu->scratch);
    free(cpu->shared);
    free(cpu->rope);
    free(cpu);
}

/* ---- weight packing (td_cpu_pack, td_cpu_bgemm) ----------------------------------- */

/* A packer of whole row groups: rows [0, n) of w, k weights each, into dst (td_cpu_pack's and
 * td_cpu_bgemm's share this form; groups are independent, so rows [r0, r1) of whole groups
 * are a matrix of their own) */
typedef void (*pack_fn)(void *dst, const void *w, td_dtype_t type, size_t n, size_t k);

typedef struct pack_job {
    unsigned char *dst;
    const unsigned char *w;
    td_dtype_t dtype;
    int32_t n, k;
    int rows;           /* rows a group */
    size_t group_bytes; /* packed bytes a group */
    pack_fn pack;
    int groups;         /* groups per task */
} pack_job_t;

static void pack_task(void *arg, int task, int thread)
{
    pack_job_t *jb = arg;
    (void)thread;
    int r0 = task * jb->groups * jb->rows;
    int r1 = TD_MIN(jb->n, r0 + jb->groups * jb->rows);
    jb->pack(jb->dst + (size_t)(r0 / jb->rows) * jb->group_bytes,
             jb->w + (size_t)r0 * td_dtype_bytes(jb->dtype, (size_t)jb->k), jb->dtype, (size_t)(r1 - r0),
             (size_t)jb->k);
}

/* w (n x k of dtype) packed by `pack` into `bytes` of fresh weight memory, in parallel over
 * its groups of `rows` rows, `group_bytes` each */
static td_status_t pack_matrix(td_cpu_t *cpu, const void *w, td_dtype_t dtype, int32_t n, int32_t k, size_t bytes,
                               int rows, size_t group_bytes, pack_fn pack, void **packed_p)
{
    void *dst = NULL;
    td_status_t st = cpu_alloc_weights(bytes, &dst);
    if (st != TD_OK)
        return st;
    int n_groups = (n + rows - 1) / rows;
    pack_job_t jb = {.dst = dst, .w = w, .dtype = dtype, .n = n, .k = k, .rows = rows, .group_bytes = group_bytes,
                     .pack = pack, .groups = (n_groups + cpu->n_threads - 1) / cpu->n_threads};
    td_pool_run(cpu->pool, (n_groups + jb.groups - 1) / jb.groups, pack_task, &jb);
    *packed_p = dst;
    return TD_OK;
}

/* td_cpu_pack_weights' layout for the backend's rows: one-byte (cpu:q8) or two-byte */
static void pack_for_one_byte(void *dst, const void *w, td_dtype_t type, size_t n, size_t k)
{
    td_cpu_pack_weights(dst, w, type, n, k, true);
}

static void pack_for_two_bytes(void *dst, const void *w, td_dtype_t type, size_t n, size_t k)
{
    td_cpu_pack_weights(dst, w, type, n, k, false);
}

/* Contract (td_backend.h ops->weight_pack): Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and IQ4_XS matrices
 * are packed unless the backend computes exactly (f32 activations read the stored rows; its
 * weight_dtypes then lacks Q5_K and IQ4_XS, which only the packed kernels read); f32, f16
 * and bf16 ones with an even k are packed to bf16 by a cpu:q8 backend at level avx512bf16
 * (td_cpu_bgemm); others stay. */
static td_status_t cpu_weight_pack(td_backend_t *be, const void *w, td_dtype_t dtype, int32_t n,
                                   int32_t k, void **packed_p)
{
    td_cpu_t *cpu = td_cpu_of(be);
    *packed_p = NULL;
    if (td_dtype_is_float(dtype)) { /* bf16 groups (td_cpu_bgemm.h), k even */
        if (!cpu->act_one_byte || !cpu->k.bgemm || n <= 0 || k <= 0 || k % 2 != 0)
            return TD_OK;
        return pack_matrix(cpu, w, dtype, n, k, td_cpu_bgemm_pack_bytes((size_t)n, (size_t)k), TD_CPU_BGEMM_ROWS,
                           td_cpu_bgemm_group_bytes((size_t)k), td_cpu_bgemm_pack, packed_p);
    }
    if (cpu->exact || !td_cpu_pack_supports(dtype) || n <= 0 || k <= 0 || k % td_dtype_block_elems(dtype) != 0)
        return TD_OK;
    return pack_matrix(cpu, w, dtype, n, k, td_cpu_pack_bytes(dtype, (size_t)n, (size_t)k), TD_CPU_PACK_ROWS,
                       td_cpu_pack_group_bytes(dtype, (size_t)k),
                       cpu->act_one_byte ? pack_for_one_byte : pack_for_two_bytes, packed_p);
}

static const td_backend_ops_t cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_h2d = cpu_copy,
    .copy_d2h = cpu_copy,
    .copy_d2d = cpu_copy,
    .sync = cpu_sync,
    .copy_d2h_start = cpu_copy_d2h_start,
    .copy_poll = cpu_copy_poll,
    .copy_quiesce = cpu_copy_quiesce,
    .host_pin = cpu_host_pin,
    .host_unpin = cpu_host_unpin,
    .set_step = cpu_set_step,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = td_cpu_matmul,
    .matmuls = td_cpu_matmuls,
    .rope_kv_write = cpu_rope_kv_write,
    .attn_prefill = td_cpu_attn_prefill,
    .attn_decode = td_cpu_attn_decode,
    .swiglu = cpu_swiglu,
    .gather_rows = cpu_gather_rows,
    .moe_combine = cpu_moe_combine,
    .copy_blocks = cpu_copy_blocks,
    .weight_pack = cpu_weight_pack,
};

/*
 * Contract (td_backend.h): creates the CPU backend with its own pool of cfg->n_threads
 * threads (<= 0: all online CPUs; cfg may be NULL). Sets OpenBLAS to one thread for the
 * whole process, since this backend calls it only from inside its own pool. Fills the
 * kernel table once for the ISA level cfg->isa or TANDEM_CPU_ISA names, else the best this
 * CPU runs. Errors: TD_ERR_INVALID (that level unknown or not run here), TD_ERR_NOMEM,
 * TD_ERR_INTERNAL (threads). *be_p is written only on success.
 */
td_status_t td_backend_cpu_create(const td_cpu_config_t *cfg, td_backend_t **be_p)
{
    td_status_t st;
    int n = cfg ? cfg->n_threads : 0;
    if (n <= 0)
        n = td_cpu_count();
    td_cpu_isa_t isa;
    st = td_cpu_isa_choose(cfg ? cfg->isa : NULL, &isa);
    if (st != TD_OK)
        return st;
    td_cpu_t *cpu = calloc(1, sizeof(*cpu));
    if (!cpu)
        return td_errorf(TD_ERR_NOMEM, "cpu backend: out of memory");
    cpu->base.ops = &cpu_ops;
    cpu->base.act_dtype = TD_F32;
    cpu->exact = cfg && cfg->exact;
    cpu->act_one_byte = cfg && cfg->act_one_byte;
    cpu->base.weight_dtypes = (1u << TD_F32) | (1u << TD_F16) | (1u << TD_BF16) |
                              (1u << TD_Q8_0) | (1u << TD_Q4_0) | (1u << TD_Q4_1) |
                              (1u << TD_Q4_K) | (1u << TD_Q6_K);
    /* read only packed (cpu_weight_pack always packs them): an exact backend, which packs
     * nothing, has them dequantized at load */
    if (!cpu->exact)
        cpu->base.weight_dtypes |= (1u << TD_Q5_K) | (1u << TD_IQ4_XS);
    cpu->base.kv_dtypes = (1u << TD_F32) | (1u << TD_F16) | (1u << TD_BF16) | (1u << TD_Q8_0);
    cpu->base.host_memory = !(cfg && cfg->device_memory);
    td_cpu_kernels_fill(isa, &cpu->k);
    cpu->n_threads = n;
    st = td_pool_create(n, &cpu->pool);
    if (st != TD_OK)
        goto err_cpu;
    openblas_set_num_threads(1);
    td_debug("cpu backend threads %d, kernels %s%s", n, td_cpu_isa_name(isa),
             cpu->base.host_memory ? "" : ", memory treated as a device's");
    *be_p = &cpu->base;
    return TD_OK;

err_cpu:
    free(cpu);
    return st;
}

void td_cpu_kernels_fill(td_cpu_isa_t isa, td_cpu_kernels_t *k)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
    *k = (td_cpu_kernels_t){.isa = isa, .fmatmul = td_cpu_fmatmul_of(isa),
                            .bgemm = td_cpu_bgemm_of(isa), .pack = td_cpu_pack_ops(isa),
                            .quant = td_cpu_quant_ops(isa), .qf32 = td_cpu_qf32_ops(isa),
                            .attn = td_cpu_attn_ops(isa), .row = td_cpu_row_ops(isa)};
}

const char *td_backend_cpu_isa(const td_backend_t *be)
{
    return be && be->ops == &cpu_ops ? td_cpu_isa_name(((const td_cpu_t *)be)->k.isa) : NULL;
}

td_status_t td_backend_cpu_isa_choose(const char *want, const char **isa_p, const char **best_p)
{
    td_cpu_isa_t isa;
    td_status_t st = td_cpu_isa_choose(want, &isa);
    if (st != TD_OK)
        return st;
    *isa_p = td_cpu_isa_name(isa);
    *best_p = td_cpu_isa_name(td_cpu_isa_best());
    return TD_OK;
}
