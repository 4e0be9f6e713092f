/*
 * td_cpu_attn: attention of a step's rows against one layer of the paged KV cache.
 *
 * Shapes (td_backend.h, td_kv_layout.h):
 *   q, out   [n_tokens][n_heads][head_dim]            f32
 *   kv_layer [n_blocks][2 (K, V)][block_size][n_kv_heads][head_dim]   layout->dtype (a float type
 *            or Q8_0, whose blocks run along head_dim)
 * Query head h reads KV head h / G, G = n_heads / n_kv_heads (the GQA group).
 * A sequence's new rows are its last q_len positions: row i sits at seq_len - q_len + i.
 *
 * Prefill (FlashAttention-style). One task per (sequence, KV head, query tile of TQ
 * tokens); the G heads of the group are stacked into one TQ*G-row query tile (pre-scaled)
 * so each K/V element loaded serves all of them. KV is walked in tiles of TK tokens (whole
 * blocks through the block table), gathered into a contiguous f32 tile (converting f16/bf16/Q8_0),
 * S = Q K^T (tile_scores), online softmax (running max m, running sum l, accumulator O
 * rescaled by exp(m_old - m_new)), O += P V (tile_accumulate), each output summed one fixed
 * way whatever the tile's row count (split invariance). KV tiles entirely above the causal
 * diagonal are never read; there is never an N x N matrix. A sliding window (p->window = W)
 * masks keys at <= pos - W as well; tiles wholly below a task's first row's window are
 * skipped and the keys below it never gathered (their blocks may have been released).
 * Tasks are ordered last query tile first (the longest) so the dynamic hand-out balances
 * the causal triangle.
 *
 * Decode (FlashDecoding split-KV). One new row per sequence. The context is cut into
 * partitions of P tokens (P a multiple of block_size); one task per (sequence, partition)
 * computes, for each KV head in turn and the G query heads of its group, the partial max,
 * sum and unnormalised output over its partition, reading each K/V element once. A second pass
 * merges a sequence's partitions by log-sum-exp. P comes from the caller or from
 * decode_partition(): a constant 256 tokens, the same for every batch (batch invariance).
 * With a sliding window only the last W keys are split into partitions (at the same
 * multiples of P), so decode reads O(W) keys however long the sequence.
 *
 * All scratch comes from the backend context (grow-only): no allocation in steady state.
 */
#include "td_cpu.h"

#include <math.h>

/* ---- shared helpers ------------------------------------------------------------- */

typedef struct kv_view {
    const unsigned char *layer;
    td_dtype_t dtype;
    size_t head_bytes; /* one token's row of one KV head: hd elements (Q8_0: whole blocks) */
    int bs, n_kv, hd;
    size_t row; /* row = n_kv * hd: stride in elements between tokens of a block (f32 reads) */
} kv_view_t;

static kv_view_t kv_view_of(const td_attn_params_t *p)
{
    const td_kv_layout_t *l = p->layout;
    kv_view_t v = {.layer = p->kv_layer, .dtype = (td_dtype_t)l->dtype,
                   .head_bytes = td_kv_bytes(l->dtype, l->head_dim), .bs = (int)l->block_size,
                   .n_kv = (int)l->n_kv_heads, .hd = (int)l->head_dim};
    v.row = (size_t)v.n_kv * v.hd;
    return v;
}

/* Address of row `off` of K (kv = 0) or V (kv = 1) of block b, KV head h. */
static inline const unsigned char *kv_at(const kv_view_t *v, int32_t b, int kv, int off, int h)
{
    size_t rows = (((size_t)b * 2 + kv) * v->bs + (size_t)off) * v->n_kv + (size_t)h; /* in head rows */
    return v->layer + rows * v->head_bytes;
}

/* Copies tokens [t0, t1) of KV head h of one sequence into dst[t1 - t0][hd] as f32. */
static void gather_kv(const td_cpu_attn_ops_t *ops, const kv_view_t *v, const int32_t *table, int kv,
                      int h, int t0, int t1, float *dst)
{
    const int hd = v->hd;
    for (int t = t0; t < t1; t++) {
        const unsigned char *src = kv_at(v, table[t / v->bs], kv, t % v->bs, h);
        float *d = dst + (size_t)(t - t0) * hd;
        if (v->dtype == TD_F32) { /* an inline loop: memcpy calls of 128-512 bytes cost more */
            const float *f = (const float *)src;
            for (int e = 0; e < hd; e++)
                d[e] = f[e];
        } else {
            ops->to_f32(d, src, v->dtype, (size_t)hd);
        }
    }
}

/* ---- prefill ---------------------------------------------------------------------- */

typedef struct prefill_task {
    int32_t seq, kvh, q0, q1; /* new rows [q0, q1) of sequence seq, relative to its start */
} prefill_task_t;

typedef struct prefill_job {
    const td_attn_params_t *p;
    td_cpu_t *cpu;
    const td_step_meta_t *meta;
    kv_view_t kv;
    int G, TQ, TK;
    const prefill_task_t *tasks;
} prefill_job_t;

/*
 * The two products of a prefill tile, each output summed one fixed way whatever the tile's
 * row count (sgemm's sums depend on it), so a row's attention does not depend on which
 * rows share its tile: a prompt prefilled whole, in chunks or after a cached prefix gives
 * the same floats (split invariance, docs/kernels.md "Batch invariance").
 *   tile_scores:     S[r][c] = Q[r] . K[c], 8 FMA lanes over d in order, then one hsum.
 *   tile_accumulate: O[r][d] += S[r][c] * V[c][d] for c in order.
 */
static void tile_scores(const float *Q, const float *K, float *S, int rows, int cnt, int hd, int ld_s, float *tmp)
{
    (void)tmp;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cnt; c++)
            S[(size_t)r * ld_s + c] = td_cpu_dot(Q + (size_t)r * hd, K + (size_t)c * hd, hd);
}

static void tile_accumulate(float *O, const float *S, const float *V, int rows, int cnt, int hd, int ld_s)
{
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cnt; c++)
            td_cpu_axpy(O + (size_t)r * hd, S[(size_t)r * ld_s + c], V + (size_t)c * hd, hd);
}

#if TD_CPU_X86
/* R query rows by C keys (R <= 3, C <= 4: 12 ymm sums beside the 3 Q vectors and one K):
 * S[r][c] = Q[r] . K[c], each one tile_scores sum (8 FMA lanes over d in order, td_cpu_hsum8,
 * the tail in order), each Q and K vector loaded once for the block */
TD_CPU_AVX2_INLINE void scores_block_avx2(const float *Q, const float *K, float *S, int hd, int ld_s, int R, int C)
{
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= hd; d += 8) {
        __m256 q[3];
        for (int r = 0; r < R; r++) {
            q[r] = _mm256_loadu_ps(Q + (size_t)r * hd + d);
            AVX2_KEEP(q[r]);
        }
        for (int c = 0; c < C; c++) {
            __m256 k = _mm256_loadu_ps(K + (size_t)c * hd + d);
            for (int r = 0; r < R; r++)
                acc[r][c] = _mm256_fmadd_ps(q[r], k, acc[r][c]);
        }
    }
    if (C == 4 && d == hd) { /* four hsum8s at once: lane c is (h0 + h2) + (h1 + h3) of acc c, as td_cpu_hsum8 adds */
        for (int r = 0; r < R; r++) {
            __m128 h[4];
            for (int c = 0; c < 4; c++)
                h[c] = _mm_add_ps(_mm256_castps256_ps128(acc[r][c]), _mm256_extractf128_ps(acc[r][c], 1));
            __m128 t0 = _mm_unpacklo_ps(h[0], h[1]), t1 = _mm_unpacklo_ps(h[2], h[3]);
            __m128 t2 = _mm_unpackhi_ps(h[0], h[1]), t3 = _mm_unpackhi_ps(h[2], h[3]);
            __m128 s02 = _mm_add_ps(_mm_movelh_ps(t0, t1), _mm_movelh_ps(t2, t3));
            __m128 s13 = _mm_add_ps(_mm_movehl_ps(t1, t0), _mm_movehl_ps(t3, t2));
            _mm_storeu_ps(S + (size_t)r * ld_s, _mm_add_ps(s02, s13));
        }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float sum = td_cpu_hsum8(acc[r][c]);
            for (int e = d; e < hd; e++)
                sum += Q[(size_t)r * hd + e] * K[(size_t)c * hd + e];
            S[(size_t)r * ld_s + c] = sum;
        }
}

#define SCORES_C(R, C) scores_block_avx2(q, K + (size_t)c * hd, s + c, hd, ld_s, R, C)
#define SCORES_R(R)                                    \
    do {                                               \
        int c = 0;                                     \
        for (; c + 4 <= cnt; c += 4)                   \
            SCORES_C(R, 4);                            \
        switch (cnt - c) {                             \
        case 3: SCORES_C(R, 3); break;                 \
        case 2: SCORES_C(R, 2); break;                 \
        case 1: SCORES_C(R, 1); break;                 \
        default: break;                                \
        }                                              \
    } while (0)

/* tile_scores by blocks of 3 rows by 4 keys: 7 loads for 12 FMAs, where a score at a time
 * loaded a Q and a K vector for each FMA */
TD_CPU_AVX2 static void tile_scores_avx2(const float *Q, const float *K, float *S, int rows, int cnt, int hd,
                                         int ld_s, float *tmp)
{
    (void)tmp;
    for (int r = 0; r < rows; r += 3) {
        const float *q = Q + (size_t)r * hd;
        float *s = S + (size_t)r * ld_s;
        switch (TD_MIN(3, rows - r)) {
        case 3: SCORES_R(3); break;
        case 2: SCORES_R(2); break;
        default: SCORES_R(1); break;
        }
    }
}
#undef SCORES_R
#undef SCORES_C

/* R rows (<= 3) by 32 outputs from d (12 ymm sums): O[r][d..] += S[r][c] * V[c][d..], one
 * FMA chain an output over c in order, each V vector loaded once for the R rows */
TD_CPU_AVX2_INLINE void accumulate_block_avx2(float *O, const float *S, const float *V, int cnt, int hd, int ld_s,
                                              int R, int d)
{
    __m256 acc[3][4];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < 4; w++)
            acc[r][w] = _mm256_loadu_ps(O + (size_t)r * hd + d + 8 * w);
    for (int c = 0; c < cnt; c++) {
        __m256 v[4];
        for (int w = 0; w < 4; w++)
            v[w] = _mm256_loadu_ps(V + (size_t)c * hd + d + 8 * w);
        for (int r = 0; r < R; r++) {
            __m256 sv = _mm256_set1_ps(S[(size_t)r * ld_s + c]);
            for (int w = 0; w < 4; w++)
                acc[r][w] = _mm256_fmadd_ps(sv, v[w], acc[r][w]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int w = 0; w < 4; w++)
            _mm256_storeu_ps(O + (size_t)r * hd + d + 8 * w, acc[r][w]);
}

/* tile_accumulate by blocks of 3 rows by 32 outputs; the outputs past the last multiple of
 * 32 a row at a time (8 wide, then scalar), the same chains */
TD_CPU_AVX2 static void tile_accumulate_avx2(float *O, const float *S, const float *V, int rows, int cnt,
                                             int hd, int ld_s)
{
    const int d32 = hd / 32 * 32;
    for (int r = 0; r < rows; r += 3) {
        const int R = TD_MIN(3, rows - r);
        for (int d = 0; d < d32; d += 32)
            switch (R) {
            case 3: accumulate_block_avx2(O + (size_t)r * hd, S + (size_t)r * ld_s, V, cnt, hd, ld_s, 3, d); break;
            case 2: accumulate_block_avx2(O + (size_t)r * hd, S + (size_t)r * ld_s, V, cnt, hd, ld_s, 2, d); break;
            default: accumulate_block_avx2(O + (size_t)r * hd, S + (size_t)r * ld_s, V, cnt, hd, ld_s, 1, d); break;
            }
    }
    for (int r = 0; r < rows && d32 < hd; r++) {
        float *o = O + (size_t)r * hd;
        const float *sr = S + (size_t)r * ld_s;
        int d = d32;
        for (; d + 8 <= hd; d += 8) {
            __m256 a = _mm256_loadu_ps(o + d);
            for (int c = 0; c < cnt; c++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(sr[c]), _mm256_loadu_ps(V + (size_t)c * hd + d), a);
            _mm256_storeu_ps(o + d, a);
        }
        for (; d < hd; d++) {
            float a = o[d];
            for (int c = 0; c < cnt; c++)
                a += sr[c] * V[(size_t)c * hd + d];
            o[d] = a;
        }
    }
}
#endif

static void prefill_task(void *arg, int task, int thread)
{
    const prefill_job_t *j = arg;
    const td_attn_params_t *p = j->p;
    const td_step_meta_t *meta = j->meta;
    const kv_view_t *kv = &j->kv;
    const prefill_task_t *tk = &j->tasks[task];
    const td_cpu_attn_ops_t *ops = j->cpu->k.attn;
    const int hd = kv->hd, G = j->G, TK = j->TK;
    const int s = tk->seq, h0 = tk->kvh * G;
    const int q_len = meta->seq_start[s + 1] - meta->seq_start[s];
    const int seq_len = meta->seq_len[s];
    const int ctx0 = seq_len - q_len; /* absolute position of new row 0 */
    const int32_t *table = meta->block_tables + (size_t)s * meta->max_blocks;
    const int nq = tk->q1 - tk->q0, rows = nq * G;

    /* scratch: Q[rows][hd] O[rows][hd] S[rows][TK] m[rows] l[rows] K[TK][hd] V[TK][hd] KT[hd][TK16] */
    float *Q = td_cpu_thread_scratch(j->cpu, thread);
    float *O = Q + (size_t)j->TQ * G * hd;
    float *S = O + (size_t)j->TQ * G * hd;
    float *M = S + (size_t)j->TQ * G * TK;
    float *L = M + (size_t)j->TQ * G;
    float *Kt = L + (size_t)j->TQ * G;
    float *Vt = Kt + (size_t)TK * hd;
    float *KT = Vt + (size_t)TK * hd; /* [hd][TK rounded up to 16]: K transposed, for AVX-512 */

    const float *q = p->q;
    for (int i = 0; i < nq; i++) {
        size_t tok = (size_t)meta->seq_start[s] + tk->q0 + i;
        for (int g = 0; g < G; g++) {
            const float *src = q + (tok * p->n_heads + h0 + g) * hd;
            float *dst = Q + ((size_t)i * G + g) * hd;
            for (int d = 0; d < hd; d++)
                dst[d] = src[d] * p->scale;
        }
    }
    memset(O, 0, (size_t)rows * hd * sizeof(float));
    for (int r = 0; r < rows; r++) {
        M[r] = -INFINITY;
        L[r] = 0.0f;
    }

    const int last_pos = ctx0 + tk->q1 - 1; /* keys beyond it are masked for every row */
    const int W = p->window;
    /* keys below the first row's window are masked for every row (and may be released) */
    const int lo_task = W > 0 ? TD_MAX(0, ctx0 + tk->q0 - W + 1) : 0;
    /* tiles stay at multiples of TK whatever lo_task is: a row's sums then do not depend on
       which rows share its task (split invariance) */
    for (int kv0 = lo_task / TK * TK; kv0 <= last_pos; kv0 += TK) {
        const int cnt = TD_MIN(TK, TD_MIN(seq_len, last_pos + 1) - kv0);
        const int g0 = TD_MAX(kv0, lo_task) - kv0; /* first key of the tile to read */
        if (g0 > 0) { /* masked keys: zeros, so that 0 * V adds nothing */
            memset(Kt, 0, (size_t)g0 * hd * sizeof(float));
            memset(Vt, 0, (size_t)g0 * hd * sizeof(float));
        }
        gather_kv(ops, kv, table, 0, tk->kvh, kv0 + g0, kv0 + cnt, Kt + (size_t)g0 * hd);
        gather_kv(ops, kv, table, 1, tk->kvh, kv0 + g0, kv0 + cnt, Vt + (size_t)g0 * hd);
        ops->tile_scores(Q, Kt, S, rows, cnt, hd, TK, KT);
        for (int r = 0; r < rows; r++) {
            float *sr = S + (size_t)r * TK;
            const int pos = ctx0 + tk->q0 + r / G;
            const int vis = TD_MIN(cnt, pos - kv0 + 1); /* causal: keys at <= pos */
            const int lo = W > 0 ? TD_MAX(0, pos - W + 1 - kv0) : 0; /* window: keys > pos - W */
            if (vis <= lo) {
                memset(sr, 0, (size_t)cnt * sizeof(float));
                continue;
            }
            const float mx = ops->max(sr + lo, vis - lo);
            const float m_new = mx > M[r] ? mx : M[r];
            const float sum = ops->exp_sum(sr + lo, m_new, vis - lo);
            for (int c = 0; c < lo; c++)
                sr[c] = 0.0f;
            for (int c = vis; c < cnt; c++)
                sr[c] = 0.0f;
            if (m_new != M[r]) {
                const float alpha = expf(M[r] - m_new); /* 0 on the first tile */
                L[r] *= alpha;
                td_cpu_scale(O + (size_t)r * hd, alpha, hd);
                M[r] = m_new;
            }
            L[r] += sum;
        }
        ops->tile_accumulate(O, S, Vt, rows, cnt, hd, TK);
    }

    float *out = p->out;
    for (int i = 0; i < nq; i++) {
        size_t tok = (size_t)meta->seq_start[s] + tk->q0 + i;
        for (int g = 0; g < G; g++) {
            const int r = i * G + g;
            const float inv = 1.0f / L[r];
            float *dst = out + (tok * p->n_heads + h0 + g) * hd;
            const float *src = O + (size_t)r * hd;
            for (int d = 0; d < hd; d++)
                dst[d] = src[d] * inv;
        }
    }
}

/* Contract (td_backend.h ops->attn_prefill): needs set_step; rows' K/V already written.
   Errors: TD_ERR_NOMEM when scratch cannot grow. */
td_status_t td_cpu_attn_prefill(td_backend_t *be, const td_attn_params_t *p)
{
    td_cpu_t *cpu = td_cpu_of(be);
    const td_step_meta_t *meta = &cpu->meta;
    TD_ASSERT(cpu->have_step);
    prefill_job_t j = {.p = p, .cpu = cpu, .meta = meta, .kv = kv_view_of(p)};
    TD_ASSERT(j.kv.n_kv > 0 && p->n_heads % j.kv.n_kv == 0);
    j.G = p->n_heads / j.kv.n_kv;
    /* ~128 stacked query rows per tile, 1..64 tokens */
    j.TQ = TD_MAX(1, TD_MIN(64, 128 / j.G));
    j.TK = TD_MAX(1, 64 / j.kv.bs) * j.kv.bs;

    size_t n_tasks = 0;
    for (int s = 0; s < meta->n_seqs; s++) {
        int q_len = meta->seq_start[s + 1] - meta->seq_start[s];
        TD_ASSERT(q_len >= 0 && q_len <= meta->seq_len[s]);
        n_tasks += (size_t)TD_DIV_CEIL(q_len, j.TQ) * j.kv.n_kv;
    }
    if (n_tasks == 0)
        return TD_OK;
    size_t rows = (size_t)j.TQ * j.G, hd = (size_t)j.kv.hd;
    size_t per_thread = (rows * hd * 2 + rows * j.TK + rows * 2 + (size_t)j.TK * hd * 2 +
                         hd * (size_t)TD_DIV_CEIL(j.TK, 16) * 16) *
                        sizeof(float);
    td_status_t st = td_cpu_reserve(cpu, per_thread, n_tasks * sizeof(prefill_task_t));
    if (st != TD_OK)
        return st;

    /* longest tiles (last in each sequence: most keys visible) first */
    prefill_task_t *tasks = (prefill_task_t *)cpu->shared;
    size_t t = 0;
    for (int s = 0; s < meta->n_seqs; s++) {
        int q_len = meta->seq_start[s + 1] - meta->seq_start[s];
        for (int tile = TD_DIV_CEIL(q_len, j.TQ) - 1; tile >= 0; tile--)
            for (int h = 0; h < j.kv.n_kv; h++)
                tasks[t++] = (prefill_task_t){.seq = s, .kvh = h, .q0 = tile * j.TQ,
                                              .q1 = TD_MIN(q_len, (tile + 1) * j.TQ)};
    }
    j.tasks = tasks;
    td_pool_run(cpu->pool, (int)n_tasks, prefill_task, &j);
    return TD_OK;
}


/* ---- decode inner kernels --------------------------------------------------------- */

/* S[g][c] = Qs[g] . K[c] for G query rows and cnt keys (row stride `stride`); S row stride ldS */
static void block_scores(const float *Qs, int G, int hd, const float *K, size_t stride, int cnt,
                         float *S, int ldS)
{
    for (int g = 0; g < G; g++)
        for (int c = 0; c < cnt; c++)
            S[(size_t)g * ldS + c] = td_cpu_dot(Qs + (size_t)g * hd, K + c * stride, hd);
}

/* acc[g][0..hd) += sum_c S[g][c] * V[c] for G rows (acc row stride ld_acc) */
static void block_pv(float *acc, size_t ld_acc, const float *S, int ldS, int G, int hd,
                     const float *V, size_t stride, int cnt)
{
    for (int g = 0; g < G; g++)
        for (int c = 0; c < cnt; c++)
            td_cpu_axpy(acc + (size_t)g * ld_acc, S[(size_t)g * ldS + c], V + c * stride, hd);
}

#if TD_CPU_X86
/* [sum(a0), sum(a1), ..., sum(a7)]: eight horizontal sums for the price of about two */
TD_CPU_AVX2_INLINE __m256 hsum8x8(const __m256 a[8])
{
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* acc[0 .. 8W) += sum_c S[c] * V[c][0 .. 8W), accumulator kept in registers */
TD_CPU_AVX2_INLINE void pv_chunk(float *acc, const float *S, const float *V, size_t stride, int cnt, int W)
{
    __m256 r[8];
    for (int u = 0; u < W; u++)
        r[u] = _mm256_loadu_ps(acc + 8 * u);
    for (int c = 0; c < cnt; c++) {
        __m256 p = _mm256_broadcast_ss(S + c);
        for (int u = 0; u < W; u++)
            r[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(V + c * stride + 8 * u), r[u]);
    }
    for (int u = 0; u < W; u++)
        _mm256_storeu_ps(acc + 8 * u, r[u]);
}

/* block_scores: 8 keys at a time, register-blocked, one 8x8 horizontal reduction */
TD_CPU_AVX2 static void block_scores_avx2(const float *Qs, int G, int hd, const float *K, size_t stride,
                                          int cnt, float *S, int ldS)
{
    for (int g = 0; g < G; g++) {
        const float *qg = Qs + (size_t)g * hd;
        float *sg = S + (size_t)g * ldS;
        int c = 0;
        if (hd % 8 == 0)
            for (; c + 8 <= cnt; c += 8) {
                __m256 a[8];
                for (int u = 0; u < 8; u++)
                    a[u] = _mm256_setzero_ps();
                for (int d = 0; d < hd; d += 8) {
                    __m256 qv = _mm256_loadu_ps(qg + d);
                    for (int u = 0; u < 8; u++)
                        a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(K + (c + u) * stride + d), a[u]);
                }
                _mm256_storeu_ps(sg + c, hsum8x8(a));
            }
        for (; c < cnt; c++)
            sg[c] = td_cpu_dot_avx2(qg, K + c * stride, hd);
    }
}

/* block_pv: the accumulator 64 floats at a time in registers */
TD_CPU_AVX2 static void block_pv_avx2(float *acc, size_t ld_acc, const float *S, int ldS, int G, int hd,
                                      const float *V, size_t stride, int cnt)
{
    for (int g = 0; g < G; g++) {
        float *ag = acc + (size_t)g * ld_acc;
        const float *sg = S + (size_t)g * ldS;
        int d0 = 0;
        for (; d0 + 64 <= hd; d0 += 64)
            pv_chunk(ag + d0, sg, V + d0, stride, cnt, 8);
        for (; d0 + 32 <= hd; d0 += 32)
            pv_chunk(ag + d0, sg, V + d0, stride, cnt, 4);
        for (; d0 + 8 <= hd; d0 += 8)
            pv_chunk(ag + d0, sg, V + d0, stride, cnt, 1);
        if (d0 < hd)
            for (int c = 0; c < cnt; c++)
                td_cpu_axpy(ag + d0, sg[c], V + c * stride + d0, hd - d0);
    }
}

/* KV elements to f32: F16C eight at a time, Q8_0 as td_quant's (float)q * d eight at a time
 * (the same one rounding); bf16 and f32 as the scalar form */
TD_CPU_AVX2 static void to_f32_avx2(float *dst, const void *src, td_dtype_t t, size_t n)
{
    if (t == TD_Q8_0) {
        const td_block_q8_0_t *b = src;
        for (size_t k = 0; k < n / TD_QK; k++) {
            __m256 d = _mm256_set1_ps(td_f16_to_f32(b[k].d));
            for (int j = 0; j < TD_QK; j += 8)
                _mm256_storeu_ps(dst + k * TD_QK + j,
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_loadl_epi64((const __m128i *)(b[k].qs + j)))),
                                               d));
        }
        return;
    }
    if (t != TD_F16) {
        td_cpu_to_f32(dst, src, t, n);
        return;
    }
    const uint16_t *s = src;
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
    for (; i < n; i++)
        dst[i] = td_f16_to_f32(s[i]);
}

static float max_avx2(const float *x, int n)
{
    return td_cpu_max_avx2(x, n);
}

static float exp_sum_avx2(float *x, float m, int n)
{
    return td_cpu_exp_sum_avx2(x, m, n);
}

static const td_cpu_attn_ops_t attn_avx2 = {
    .tile_scores = tile_scores_avx2, .tile_accumulate = tile_accumulate_avx2,
    .block_scores = block_scores_avx2, .block_pv = block_pv_avx2,
    .max = max_avx2, .exp_sum = exp_sum_avx2, .to_f32 = to_f32_avx2,
};

/* ---- AVX-512: the prefill tile's scores without horizontal sums -------------------------- */

#define TD_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

/* R query rows by C blocks of 16 keys: S[r][16 b + l] = sum over d in order of
 * Q[r][d] * KT[d][16 b + l] (KT: K transposed, ld columns), one FMA chain a score */
static inline __attribute__((always_inline)) TD_AVX512 void
scores_block(const float *Q, const float *KT, int ld, float *S, int ld_s, int hd, int R, int C, int c0,
             __mmask16 last)
{
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < C; b++)
            acc[r][b] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        __m512 k[2];
        for (int b = 0; b < C; b++)
            k[b] = _mm512_loadu_ps(KT + (size_t)d * ld + c0 + 16 * b);
        for (int r = 0; r < R; r++) {
            __m512 q = _mm512_set1_ps(Q[(size_t)r * hd + d]);
            for (int b = 0; b < C; b++)
                acc[r][b] = _mm512_fmadd_ps(q, k[b], acc[r][b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < C; b++)
            _mm512_mask_storeu_ps(S + (size_t)r * ld_s + c0 + 16 * b, b == C - 1 ? last : 0xffff, acc[r][b]);
}

/* tile_scores with K transposed once per tile into tmp (hd x the keys rounded up to 16,
 * zero-padded), so that 16 keys' scores are one zmm: 4 rows by 32 keys a pass (8 chains) */
TD_AVX512 static void tile_scores_avx512(const float *Q, const float *K, float *S, int rows, int cnt, int hd,
                                         int ld_s, float *tmp)
{
    const int ld = TD_DIV_CEIL(cnt, 16) * 16;
    for (int d = 0; d < hd; d++) {
        for (int c = 0; c < cnt; c++)
            tmp[(size_t)d * ld + c] = K[(size_t)c * hd + d];
        for (int c = cnt; c < ld; c++)
            tmp[(size_t)d * ld + c] = 0.0f;
    }
    const __mmask16 tail = cnt % 16 ? (__mmask16)((1u << (cnt % 16)) - 1) : 0xffff;
    for (int r = 0; r < rows; r += 4) {
        const int R = TD_MIN(4, rows - r);
        const float *q = Q + (size_t)r * hd;
        float *s = S + (size_t)r * ld_s;
        int c0 = 0;
        for (; c0 + 32 <= ld; c0 += 32) {
            __mmask16 last = c0 + 32 == ld ? tail : 0xffff;
            switch (R) {
            case 4: scores_block(q, tmp, ld, s, ld_s, hd, 4, 2, c0, last); break;
            case 3: scores_block(q, tmp, ld, s, ld_s, hd, 3, 2, c0, last); break;
            case 2: scores_block(q, tmp, ld, s, ld_s, hd, 2, 2, c0, last); break;
            default: scores_block(q, tmp, ld, s, ld_s, hd, 1, 2, c0, last); break;
            }
        }
        if (c0 < ld) { /* one block of 16 left */
            switch (R) {
            case 4: scores_block(q, tmp, ld, s, ld_s, hd, 4, 1, c0, tail); break;
            case 3: scores_block(q, tmp, ld, s, ld_s, hd, 3, 1, c0, tail); break;
            case 2: scores_block(q, tmp, ld, s, ld_s, hd, 2, 1, c0, tail); break;
            default: scores_block(q, tmp, ld, s, ld_s, hd, 1, 1, c0, tail); break;
            }
        }
    }
}

/* R rows by W vectors of 16 outputs from d0 (the last vector's lanes `last`): O[r][d] +=
 * S[r][c] * V[c][d], one FMA chain an output over c in order (tile_accumulate's sum),
 * each V vector loaded once for the R rows */
static inline __attribute__((always_inline)) TD_AVX512 void
accumulate_block(float *O, const float *S, const float *V, int cnt, int hd, int ld_s, int R, int W, int d0,
                 __mmask16 last)
{
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++)
            acc[r][w] = _mm512_maskz_loadu_ps(w == W - 1 ? last : 0xffff, O + (size_t)r * hd + d0 + 16 * w);
    for (int c = 0; c < cnt; c++) {
        __m512 v[4];
        for (int w = 0; w < W; w++)
            v[w] = _mm512_maskz_loadu_ps(w == W - 1 ? last : 0xffff, V + (size_t)c * hd + d0 + 16 * w);
        for (int r = 0; r < R; r++) {
            __m512 s = _mm512_set1_ps(S[(size_t)r * ld_s + c]);
            for (int w = 0; w < W; w++)
                acc[r][w] = _mm512_fmadd_ps(s, v[w], acc[r][w]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++)
            _mm512_mask_storeu_ps(O + (size_t)r * hd + d0 + 16 * w, w == W - 1 ? last : 0xffff, acc[r][w]);
}

#define ACC_W(R, W) accumulate_block(o, s, V, cnt, hd, ld_s, R, W, d0, last)
#define ACC_R(R)                          \
    switch (W) {                          \
    case 4: ACC_W(R, 4); break;           \
    case 3: ACC_W(R, 3); break;           \
    case 2: ACC_W(R, 2); break;           \
    default: ACC_W(R, 1); break;          \
    }

/* tile_accumulate by blocks of 4 rows by 64 outputs (16 zmm sums): a V vector feeds 4 FMAs
 * where the avx2 table's row at a time loaded it for one (SmolLM2, head_dim 64: the avx2
 * tile was 10% of a 1-thread prefill at avx512vnni) */
TD_AVX512 static void tile_accumulate_avx512(float *O, const float *S, const float *V, int rows, int cnt, int hd,
                                             int ld_s)
{
    for (int r = 0; r < rows; r += 4) {
        const int R = TD_MIN(4, rows - r);
        float *o = O + (size_t)r * hd;
        const float *s = S + (size_t)r * ld_s;
        for (int d0 = 0; d0 < hd; d0 += 64) {
            const int W = TD_MIN(4, TD_DIV_CEIL(hd - d0, 16));
            const int tail = TD_MIN(16, hd - d0 - 16 * (W - 1)); /* 1..16 lanes in the last vector */
            const __mmask16 last = (__mmask16)((1u << tail) - 1);
            switch (R) {
            case 4: ACC_R(4); break;
            case 3: ACC_R(3); break;
            case 2: ACC_R(2); break;
            default: ACC_R(1); break;
            }
        }
    }
}
#undef ACC_R
#undef ACC_W

static const td_cpu_attn_ops_t attn_avx512 = {
    .tile_scores = tile_scores_avx512, .tile_accumulate = tile_accumulate_avx512,
    .block_scores = block_scores_avx2, .block_pv = block_pv_avx2,
    .max = max_avx2, .exp_sum = exp_sum_avx2, .to_f32 = to_f32_avx2,
};
#endif /* TD_CPU_X86 */

static float max_scalar(const float *x, int n)
{
    return td_cpu_max(x, n);
}

static float exp_sum_scalar(float *x, float m, int n)
{
    return td_cpu_exp_sum(x, m, n);
}

static void to_f32_scalar(float *dst, const void *src, td_dtype_t t, size_t n)
{
    td_cpu_to_f32(dst, src, t, n);
}

static const td_cpu_attn_ops_t attn_scalar = {
    .tile_scores = tile_scores, .tile_accumulate = tile_accumulate,
    .block_scores = block_scores, .block_pv = block_pv,
    .max = max_scalar, .exp_sum = exp_sum_scalar, .to_f32 = to_f32_scalar,
};

const td_cpu_attn_ops_t *td_cpu_attn_ops(td_cpu_isa_t isa)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
#if TD_CPU_X86
    if (isa >= TD_CPU_ISA_AVX512)
        return &attn_avx512;
    if (isa >= TD_CPU_ISA_AVX2)
        return &attn_avx2;
#endif
    return &attn_scalar;
}

/* ---- decode ----------------------------------------------------------------------- */

typedef struct decode_part {
    int32_t seq, t0, t1; /* context tokens [t0, t1) of sequence seq */
} decode_part_t;

typedef struct decode_job {
    const td_attn_params_t *p;
    td_cpu_t *cpu;
    const td_step_meta_t *meta;
    kv_view_t kv;
    int G;
    const decode_part_t *parts; /* [n_parts] */
    const int32_t *part_start;  /* [n_seqs + 1] first part of each sequence */
    float *partials;            /* [n_parts][n_kv][G][hd + 2]: acc[hd], m, l */
    int head_chunks;            /* tasks per part, each a contiguous range of KV heads */
} decode_job_t;

static void decode_head(const decode_job_t *j, int part, int h, int thread)
{
    const td_attn_params_t *p = j->p;
    const kv_view_t *kv = &j->kv;
    const int hd = kv->hd, G = j->G, bs = kv->bs, n_kv = kv->n_kv;
    const decode_part_t *dp = &j->parts[part];
    const td_cpu_attn_ops_t *ops = j->cpu->k.attn;
    const int s = dp->seq;
    const int32_t *table = j->meta->block_tables + (size_t)s * j->meta->max_blocks;
    const size_t tok = (size_t)j->meta->seq_start[s];

    /* scratch: Qs[G][hd] S[G][bs] K[bs][hd] V[bs][hd] */
    float *Qs = td_cpu_thread_scratch(j->cpu, thread);
    float *S = Qs + (size_t)G * hd;
    float *Kc = S + (size_t)G * bs;
    float *Vc = Kc + (size_t)bs * hd;

    float *part_out = j->partials + ((size_t)part * n_kv + h) * G * (hd + 2);
    for (int g = 0; g < G; g++) {
        const float *src = (const float *)p->q + (tok * p->n_heads + (size_t)h * G + g) * hd;
        for (int d = 0; d < hd; d++)
            Qs[(size_t)g * hd + d] = src[d] * p->scale;
        float *acc = part_out + (size_t)g * (hd + 2);
        memset(acc, 0, (size_t)hd * sizeof(float));
        acc[hd] = -INFINITY;
        acc[hd + 1] = 0.0f;
    }

    for (int t0 = dp->t0; t0 < dp->t1; t0 += bs - t0 % bs) {
        const int cnt = TD_MIN(bs - t0 % bs, dp->t1 - t0);
        const int32_t b = table[t0 / bs];
        const float *K, *V;
        size_t stride;
        if (kv->dtype == TD_F32) {
            K = (const float *)kv_at(kv, b, 0, t0 % bs, h);
            V = (const float *)kv_at(kv, b, 1, t0 % bs, h);
            stride = kv->row;
        } else {
            gather_kv(ops, kv, table, 0, h, t0, t0 + cnt, Kc);
            gather_kv(ops, kv, table, 1, h, t0, t0 + cnt, Vc);
            K = Kc;
            V = Vc;
            stride = (size_t)hd;
        }
        ops->block_scores(Qs, G, hd, K, stride, cnt, S, bs);
        for (int g = 0; g < G; g++) {
            float *sr = S + (size_t)g * bs;
            float *acc = part_out + (size_t)g * (hd + 2);
            const float mx = ops->max(sr, cnt);
            const float m_old = acc[hd];
            const float m_new = mx > m_old ? mx : m_old;
            const float sum = ops->exp_sum(sr, m_new, cnt);
            if (m_new != m_old) {
                const float alpha = expf(m_old - m_new);
                acc[hd + 1] *= alpha;
                td_cpu_scale(acc, alpha, hd);
                acc[hd] = m_new;
            }
            acc[hd + 1] += sum;
        }
        ops->block_pv(part_out, (size_t)hd + 2, S, bs, G, hd, V, stride, cnt);
    }
}

/* A part of the step and a range of its KV heads (all of them unless the parts are too few
 * for the threads), one head after another: the task walks its tokens' rows, the heads side
 * by side in the pool, rather than one head's slice of each (SmolLM2 at 3000 tokens of f16
 * KV, 1 thread: decode 31 -> 39 tokens/s) */
static void decode_task(void *arg, int task, int thread)
{
    const decode_job_t *j = arg;
    const int part = task / j->head_chunks, c = task % j->head_chunks, n_kv = j->kv.n_kv;
    for (int h = n_kv * c / j->head_chunks; h < n_kv * (c + 1) / j->head_chunks; h++)
        decode_head(j, part, h, thread);
}

/* Merges the partitions of sequence `task` for all heads by log-sum-exp. */
static void decode_merge_task(void *arg, int task, int thread)
{
    const decode_job_t *j = arg;
    const td_attn_params_t *p = j->p;
    const int hd = j->kv.hd, G = j->G, n_kv = j->kv.n_kv;
    const int s = task;
    const int pa = j->part_start[s], pb = j->part_start[s + 1];
    float *out = (float *)p->out + (size_t)j->meta->seq_start[s] * p->n_heads * hd;
    for (int h = 0; h < n_kv; h++)
        for (int g = 0; g < G; g++) {
            float m = -INFINITY;
            for (int q = pa; q < pb; q++) {
                const float *pp = j->partials + (((size_t)q * n_kv + h) * G + g) * (hd + 2);
                m = pp[hd] > m ? pp[hd] : m;
            }
            float *dst = out + ((size_t)h * G + g) * hd;
            float l = 0.0f;
            memset(dst, 0, (size_t)hd * sizeof(float));
            for (int q = pa; q < pb; q++) {
                const float *pp = j->partials + (((size_t)q * n_kv + h) * G + g) * (hd + 2);
                const float w = expf(pp[hd] - m);
                l += pp[hd + 1] * w;
                td_cpu_axpy(dst, w, pp, hd);
            }
            td_cpu_scale(dst, 1.0f / l, hd);
        }
}

/*
 * Partition size in tokens when the caller leaves it to us: a constant (rounded up to whole
 * blocks), so a sequence's partitions, and so the order of its log-sum-exp merge, are the
 * same whatever else is in the batch and however many threads run it: the backend is
 * batch-invariant (docs/kernels.md). 256 tokens: a 4k context still splits into 16 tasks
 * per KV head at batch 1, and below ~64 the merge would cost more than the parallelism
 * gains. (It was derived from the batch's total context, which made a sequence's floats,
 * and now and then a greedy token, depend on its neighbours in the batch.)
 */
#define TD_CPU_DECODE_PARTITION 256

static int decode_partition(int bs)
{
    return (TD_CPU_DECODE_PARTITION + bs - 1) / bs * bs;
}

/* First key the row of a sequence of seq_len tokens attends to: the window's start. The
   partitions stay at multiples of P from position 0, the first one cut at the window's
   start, so that a sequence's partitions still depend on nothing but its own length. */
static int decode_window_start(const td_attn_params_t *p, int seq_len)
{
    return p->window > 0 ? TD_MAX(0, seq_len - p->window) : 0;
}

/* Contract (td_backend.h ops->attn_decode): needs set_step with exactly one new row per
   sequence. Errors: TD_ERR_NOMEM when scratch cannot grow. */
td_status_t td_cpu_attn_decode(td_backend_t *be, const td_attn_params_t *p)
{
    td_cpu_t *cpu = td_cpu_of(be);
    const td_step_meta_t *meta = &cpu->meta;
    TD_ASSERT(cpu->have_step);
    decode_job_t j = {.p = p, .cpu = cpu, .meta = meta, .kv = kv_view_of(p)};
    const int n_kv = j.kv.n_kv, bs = j.kv.bs, hd = j.kv.hd;
    TD_ASSERT(n_kv > 0 && p->n_heads % n_kv == 0);
    j.G = p->n_heads / n_kv;
    if (meta->n_seqs == 0)
        return TD_OK;

    int P = p->partition_tokens > 0 ? (p->partition_tokens + bs - 1) / bs * bs
                                    : decode_partition(bs);
    size_t n_parts = 0;
    for (int s = 0; s < meta->n_seqs; s++) {
        TD_ASSERT(meta->seq_start[s + 1] - meta->seq_start[s] == 1 && meta->seq_len[s] >= 1);
        n_parts += (size_t)(TD_DIV_CEIL(meta->seq_len[s], P) - decode_window_start(p, meta->seq_len[s]) / P);
    }
    size_t parts_bytes = (n_parts * sizeof(decode_part_t) + 63) & ~(size_t)63;
    size_t starts_bytes = ((size_t)(meta->n_seqs + 1) * sizeof(int32_t) + 63) & ~(size_t)63;
    size_t partial_bytes = n_parts * n_kv * j.G * (size_t)(hd + 2) * sizeof(float);
    size_t per_thread = ((size_t)j.G * hd + (size_t)j.G * bs + 2 * (size_t)bs * hd) * sizeof(float);
    td_status_t st = td_cpu_reserve(cpu, per_thread, parts_bytes + starts_bytes + partial_bytes);
    if (st != TD_OK)
        return st;

    decode_part_t *parts = (decode_part_t *)cpu->shared;
    int32_t *part_start = (int32_t *)(cpu->shared + parts_bytes);
    size_t q = 0;
    for (int s = 0; s < meta->n_seqs; s++) {
        part_start[s] = (int32_t)q;
        const int lo = decode_window_start(p, meta->seq_len[s]);
        for (int t0 = lo / P * P; t0 < meta->seq_len[s]; t0 += P)
            parts[q++] = (decode_part_t){.seq = s, .t0 = TD_MAX(t0, lo), .t1 = TD_MIN(meta->seq_len[s], t0 + P)};
    }
    part_start[meta->n_seqs] = (int32_t)q;
    j.parts = parts;
    j.part_start = part_start;
    j.partials = (float *)(cpu->shared + parts_bytes + starts_bytes);

    /* Fewer parts than two a thread (one short sequence: one part) would leave threads
       idle, so each part's heads are cut into ranges, one task each. A head's sums do not
       depend on which task or thread runs it: the same bits either way. */
    const size_t want = 2 * (size_t)cpu->n_threads;
    j.head_chunks = n_parts >= want ? 1 : (int)TD_MIN((size_t)n_kv, TD_DIV_CEIL(want, n_parts));
    td_pool_run(cpu->pool, (int)n_parts * j.head_chunks, decode_task, &j);
    td_pool_run(cpu->pool, meta->n_seqs, decode_merge_task, &j);
    return TD_OK;
}
