/*
 * td_cpu_matmul: Y[m][n] = X[m][k] . W[n][k]^T (+ bias) (+ Y), W in f32, f16 or bf16, or
 * block-quantized (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; Q5_K and IQ4_XS packed only). By default block W
 * meets X quantized once per call to integers: W that ops->weight_pack repacked at load (those and Q5_K, IQ4_XS)
 * goes to td_cpu_pack's VNNI/AVX2 kernels with two-byte activations (pmatmul below), W as
 * stored (a caller's unpacked matrix) to td_cpu_quant's int8 dots, llama.cpp's
 * scheme (qmatmul). On an exact backend (--device cpu:exact) X stays f32 and the weights are
 * dequantized in registers (qf32_matmul, td_cpu_qf32: exact to f32 rounding, slower: its
 * FMA peak here is below llama.cpp's integer prefill rate). docs/kernels.md has the figures.
 *
 * The N dimension (rows of W, columns of Y) is split over the pool, so every thread
 * streams its own part of W exactly once and the whole of X (small) from cache.
 *
 * Float W (f32, f16, bf16) on a CPU with AVX-512: td_cpu_fgemm (fgemm_matmul below), 4 to 8 W
 * rows widened to f32 in registers against 1 to 6 X rows in zmm accumulators, every output
 * summed in its one order (16 lanes over k, then a fixed tree), so batch-invariant; decode
 * tiles prefetch ahead, prefill runs X in chunks that stay in L2. At level avx2 (the
 * kernel table's fmatmul, td_cpu_kernels.h):
 *
 * One hand-written AVX2/FMA kernel (gemv_block) computes every output: it reads 1-8 rows
 * of W at a time, converts f16/bf16 to f32 in registers once per 8 weights, and multiplies
 * them with 1-4 rows of X, each output summed the same way (eight FMA lanes over k in order,
 * one horizontal sum, a scalar tail). So a row's result does not depend on how many rows
 * its step has: the backend is batch-invariant, and a sequence gives the same tokens alone,
 * in a batch of 64 decodes or in a prefill batch of other prompts (docs/kernels.md).
 *  - m <= 4 (decode, a few sequences): tiles of 8, 4, 4 or 2 W rows (m = 1..4) against all
 *    m X rows, W streamed once, each tile prefetching its rows two tiles ahead. This is
 *    the memory-bandwidth path of batch-1 decode.
 *  - larger m: X in chunks of 512 KiB (kept in L2) against blocks of 4 W rows (kept in L1)
 *    in 4x3 tiles (12 accumulators, 3 X vectors, 1 W vector: AVX2's 16 registers); W is
 *    streamed once per chunk.
 * At level scalar (a CPU without AVX2/FMA/F16C, or TANDEM_CPU_ISA=scalar) cblas_sgemm on
 * converted tiles of W does it all, and batch invariance is not promised.
 *
 * The result is written with the epilogue (bias, accumulate) by the thread that owns the
 * slice, so no two threads touch the same column of Y.
 */
#include "td_cpu.h"

#include <cblas.h>

#include "td_cpu_bgemm.h"
#include "td_cpu_fgemm.h"
#include "td_cpu_pack.h"
#include "td_cpu_qf32.h"
#include "td_cpu_quant.h"

/* rows of W handed to one task: enough tasks for balance, slices big enough to stream */
static int matmul_chunk(const td_cpu_t *cpu, int m, int n)
{
    int tasks = cpu->n_threads == 1 ? 1 : cpu->n_threads * (m <= 4 ? 4 : 2);
    int align = m <= 4 ? 4 : 16;
    int chunk = (n + tasks - 1) / tasks;
    chunk = (chunk + align - 1) / align * align;
    return chunk < align ? align : chunk;
}

static float load_scalar(const void *p, td_dtype_t t, size_t i)
{
    switch (t) {
    case TD_F32: return ((const float *)p)[i];
    case TD_F16: return td_f16_to_f32(((const uint16_t *)p)[i]);
    case TD_BF16: return td_bf16_to_f32(((const uint16_t *)p)[i]);
    default: break; /* block types never reach load_scalar */
    }
    return 0.0f;
}

typedef struct matmul_job {
    const td_matmul_params_t *p;
    td_cpu_t *cpu;
    int chunk;      /* W rows per task */
    int tile_rows;  /* W rows converted at a time (f16/bf16, large m) */
} matmul_job_t;

/* Applies bias and accumulate to y[i][n0..n1) which holds the bare product in `v`. */
static inline void store_out(const td_matmul_params_t *p, int i, int j, float v)
{
    float *y = (float *)p->y + (size_t)i * p->n + j;
    if (p->bias)
        v += load_scalar(p->bias, p->bias_dtype, (size_t)j);
    if (p->accumulate)
        v += *y;
    *y = v;
}

#if TD_CPU_X86
TD_CPU_AVX2_INLINE __m256 load8(td_dtype_t t, const void *w, size_t i)
{
    if (t == TD_F32)
        return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (t == TD_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#define AV_MAX_R 8 /* W rows of a tile (m = 1's decode tile) */
#define AV_MAX_M 4 /* X rows of a tile */

/*
 * R rows of W (starting at row j) times M rows of X (starting at row i0), each output summed
 * in the contract's order (eight FMA lanes over k in order, td_cpu_hsum8, the scalar tail).
 * R, M and t are compile-time constants at every call site, so the loops unroll into R * M
 * independent FMA chains. Per 8 weights each W row is loaded and widened once and each X row
 * loaded once (held in a register: GCC otherwise folds the load into each of the R FMAs as
 * a memory operand, R loads from L2 where one does). pf: when not 0, each W row's cache line
 * pf bytes ahead of the one a step starts is prefetched into L2, once a line (the rows'
 * interleaved streams are more than the hardware prefetcher follows on its own).
 */
TD_CPU_AVX2_INLINE void gemv_block(const td_matmul_params_t *p, int R, int M, td_dtype_t t, int j, int i0,
                                   size_t pf)
{
    const int k = p->k;
    const float *x = (const float *)p->x + (size_t)i0 * k;
    const size_t wsz = td_dtype_size(t), row_bytes = (size_t)k * wsz;
    const unsigned char *w = (const unsigned char *)p->w + (size_t)j * row_bytes;
    const size_t line_steps = 64 / (8 * wsz); /* k-steps of 8 weights a cache line */
    __m256 acc[AV_MAX_R][AV_MAX_M];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            acc[r][i] = _mm256_setzero_ps();
    int kk = 0;
    for (; kk + 8 <= k; kk += 8) {
        if (pf && ((size_t)kk / 8) % line_steps == 0)
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)w + (size_t)r * row_bytes + (size_t)kk * wsz + pf, _MM_HINT_T1);
        __m256 xv[AV_MAX_M];
        for (int i = 0; i < M; i++) {
            xv[i] = _mm256_loadu_ps(x + (size_t)i * k + kk);
            AVX2_KEEP(xv[i]);
        }
        for (int r = 0; r < R; r++) {
            __m256 wv = load8(t, w + (size_t)r * row_bytes, (size_t)kk);
            for (int i = 0; i < M; i++)
                acc[r][i] = _mm256_fmadd_ps(wv, xv[i], acc[r][i]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) {
            float s = td_cpu_hsum8(acc[r][i]);
            for (int q = kk; q < k; q++)
                s += load_scalar(w + (size_t)r * row_bytes, t, (size_t)q) * x[(size_t)i * k + q];
            store_out(p, i0 + i, j + r, s);
        }
}

/* Decode tiles prefetch this many tiles of W rows ahead (their rows are contiguous). */
#ifndef AV_DECODE_AHEAD
#define AV_DECODE_AHEAD 2
#endif
#ifndef AV_D1
#define AV_D1 8 /* W rows of m = 1's tile (4 measured the same within this VM's noise) */
#endif

/* m <= 4 (decode): W rows [j, n1) R at a time against all M = m X rows (in L1), each tile
 * prefetching AV_DECODE_AHEAD tiles ahead, then 4 rows at a time where R > 4, the last
 * rows one by one. */
TD_CPU_AVX2_INLINE void gemv_decode(const td_matmul_params_t *p, int R, int M, td_dtype_t t, int n0, int n1)
{
    size_t pf = (size_t)AV_DECODE_AHEAD * R * (size_t)p->k * td_dtype_size(t);
    int j = n0;
    for (; j + R <= n1; j += R)
        gemv_block(p, R, M, t, j, 0, pf);
    for (; R > 4 && j + 4 <= n1; j += 4)
        gemv_block(p, 4, M, t, j, 0, 0);
    for (; j < n1; j++)
        gemv_block(p, 1, M, t, j, 0, 0);
}

/* One slice [n0, n1) for m <= 4 with W dtype t (a constant after inlining): W read once. */
TD_CPU_AVX2_INLINE void gemv_slice_t(const td_matmul_params_t *p, td_dtype_t t, int n0, int n1)
{
    switch (p->m) {
    case 1: gemv_decode(p, AV_D1, 1, t, n0, n1); break;
    case 2: gemv_decode(p, 4, 2, t, n0, n1); break;
    case 3: gemv_decode(p, 4, 3, t, n0, n1); break;
    default: gemv_decode(p, 2, 4, t, n0, n1); break;
    }
}

/* The prefill tile: AV_R W rows by AV_M X rows, AV_R * AV_M accumulators, AV_M X vectors
 * and one W vector live: 16 ymm registers. */
#define AV_R 4
#define AV_M 3 /* tile_tail takes the chunk's last 1 or 2 rows */

/* X rows [i, i + n) (n < AV_M) against W rows [j, j + R): the tail of a chunk. */
TD_CPU_AVX2_INLINE void tile_tail(const td_matmul_params_t *p, int R, td_dtype_t t, int j, int i, int n, size_t pf)
{
    switch (n) {
    case 1: gemv_block(p, R, 1, t, j, i, pf); break;
    case 2: gemv_block(p, R, 2, t, j, i, pf); break;
    default: break;
    }
}

/* X rows [i0, i1) against W rows [j, j + R): AV_M at a time, then the rest. The first X tile
 * reads the block's W rows from memory; it prefetches the next block's (the R rows after). */
TD_CPU_AVX2_INLINE void tile_block(const td_matmul_params_t *p, int R, td_dtype_t t, int j, int i0, int i1)
{
    size_t pf = (size_t)R * (size_t)p->k * td_dtype_size(t);
    int i = i0;
    for (; i + AV_M <= i1; i += AV_M, pf = 0)
        gemv_block(p, R, AV_M, t, j, i, pf);
    tile_tail(p, R, t, j, i, i1 - i, pf);
}

/* X rows of a prefill chunk: AV_X_BYTES of f32 activations, a multiple of AV_M rows. */
#ifndef AV_X_BYTES
#define AV_X_BYTES (512u * 1024u)
#endif
static int av_x_rows(int k)
{
    int rows = (int)(AV_X_BYTES / ((size_t)TD_MAX(k, 1) * sizeof(float))) / AV_M * AV_M;
    return TD_MAX(rows, AV_M);
}

/* One slice [n0, n1) for m > 4: X in chunks of av_x_rows(k) rows (kept in L2), each chunk
 * against blocks of AV_R W rows (kept in L1), W streamed once per chunk. */
TD_CPU_AVX2_INLINE void tile_slice_t(const td_matmul_params_t *p, td_dtype_t t, int n0, int n1)
{
    const int x_rows = av_x_rows(p->k);
    for (int i0 = 0; i0 < p->m; i0 += x_rows) {
        int i1 = TD_MIN(p->m, i0 + x_rows);
        int j = n0;
        for (; j + AV_R <= n1; j += AV_R)
            tile_block(p, AV_R, t, j, i0, i1);
        for (; j < n1; j++)
            tile_block(p, 1, t, j, i0, i1);
    }
}

/* One task: W rows [n0, n1) for every row of X, by the m <= 4 or the tiled shape. */
TD_CPU_AVX2 static void kernel_task(void *arg, int task, int thread)
{
    matmul_job_t *jb = arg;
    const td_matmul_params_t *p = jb->p;
    int n0 = task * jb->chunk;
    int n1 = TD_MIN(p->n, n0 + jb->chunk);
    bool small = p->m <= 4;
    switch (p->w_dtype) {
    case TD_F32: small ? gemv_slice_t(p, TD_F32, n0, n1) : tile_slice_t(p, TD_F32, n0, n1); break;
    case TD_F16: small ? gemv_slice_t(p, TD_F16, n0, n1) : tile_slice_t(p, TD_F16, n0, n1); break;
    case TD_BF16: small ? gemv_slice_t(p, TD_BF16, n0, n1) : tile_slice_t(p, TD_BF16, n0, n1); break;
    default: TD_ASSERT(!"kernel_task: block types go to the quantized path"); break;
    }
}

/* The float matmul of level AVX2 (and of AVX-512 CPUs forced to it). */
static td_status_t gemv_matmul(td_cpu_t *cpu, const td_matmul_params_t *p)
{
    matmul_job_t jb = {.p = p, .cpu = cpu, .chunk = matmul_chunk(cpu, p->m, p->n)};
    td_pool_run(cpu->pool, (p->n + jb.chunk - 1) / jb.chunk, kernel_task, &jb);
    return TD_OK;
}
#endif /* TD_CPU_X86 */

/* ---- float W, scalar level: OpenBLAS sgemm on converted tiles of W ---------------------- */

/* sgemm of X against W rows [n0, n0 + nn) given as f32 `w` (row stride k), then epilogue. */
static void sgemm_slice(const td_matmul_params_t *p, const float *w, int n0, int nn)
{
    float *y = (float *)p->y + n0;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, p->m, nn, p->k, 1.0f, p->x, p->k, w,
                p->k, p->accumulate ? 1.0f : 0.0f, y, p->n);
    if (p->bias) {
        float b[64];
        for (int j0 = 0; j0 < nn; j0 += 64) {
            int nb = TD_MIN(64, nn - j0);
            for (int j = 0; j < nb; j++)
                b[j] = load_scalar(p->bias, p->bias_dtype, (size_t)(n0 + j0 + j));
            for (int i = 0; i < p->m; i++) {
                float *yr = y + (size_t)i * p->n + j0;
                for (int j = 0; j < nb; j++)
                    yr[j] += b[j];
            }
        }
    }
}

static void gemm_task(void *arg, int task, int thread)
{
    matmul_job_t *jb = arg;
    const td_matmul_params_t *p = jb->p;
    int n0 = task * jb->chunk;
    int n1 = TD_MIN(p->n, n0 + jb->chunk);
    if (p->w_dtype == TD_F32) {
        sgemm_slice(p, (const float *)p->w + (size_t)n0 * p->k, n0, n1 - n0);
        return;
    }
    float *tile = td_cpu_thread_scratch(jb->cpu, thread);
    size_t row_bytes = (size_t)p->k * td_dtype_size(p->w_dtype);
    for (int j = n0; j < n1; j += jb->tile_rows) {
        int nn = TD_MIN(jb->tile_rows, n1 - j);
        td_cpu_to_f32(tile, (const unsigned char *)p->w + (size_t)j * row_bytes, p->w_dtype,
                      (size_t)nn * p->k);
        sgemm_slice(p, tile, j, nn);
    }
}

/* The float matmul of the scalar level: not batch-invariant (sgemm's sums depend on m). */
static td_status_t blas_matmul(td_cpu_t *cpu, const td_matmul_params_t *p)
{
    matmul_job_t jb = {.p = p, .cpu = cpu, .chunk = matmul_chunk(cpu, p->m, p->n)};
    if (p->w_dtype != TD_F32) {
        /* ~512 KiB of converted rows per tile: stays in L2 while sgemm sweeps X over it */
        int rows = (int)TD_MAX(8, (131072 / TD_MAX(p->k, 1)) / 8 * 8);
        jb.tile_rows = TD_MIN(rows, jb.chunk);
        td_status_t st = td_cpu_reserve(cpu, (size_t)jb.tile_rows * p->k * sizeof(float), 0);
        if (st != TD_OK)
            return st;
    }
    td_pool_run(cpu->pool, (p->n + jb.chunk - 1) / jb.chunk, gemm_task, &jb);
    return TD_OK;
}

/* ---- float W, AVX-512 (td_cpu_fgemm) ---------------------------------------------------- */

static void store_tile(const td_matmul_params_t *p, int i0, int mm, int j, int nn, const float *tile, int ld);

/* W rows per td_cpu_fgemm call: a decode call streams 256 rows (its 8-row tiles prefetch
 * ahead within the call's rows and into the next); a prefill call takes 16 (64 KiB of f16
 * at k = 2048, in L1/L2 while the call's X chunk streams past them). */
#define FG_DECODE_COLS 256
#define FG_PREFILL_COLS 16
#define FG_DECODE_ROWS 5 /* td_cpu_fgemm's decode tiles take m <= 5 */

static int fgemm_cols(int m)
{
    return m <= FG_DECODE_ROWS ? FG_DECODE_COLS : FG_PREFILL_COLS;
}

static int fgemm_rows(const td_matmul_params_t *p)
{
    return p->m <= FG_DECODE_ROWS ? p->m : TD_MIN(p->m, (int)td_cpu_fgemm_x_rows((size_t)p->k));
}

/* One task: W rows [n0, n1) against X in chunks that stay in L2, each call's [rows][cols]
 * products put through the epilogue (store_tile) by this thread. */
static void fgemm_task(void *arg, int task, int thread)
{
    matmul_job_t *jb = arg;
    const td_matmul_params_t *p = jb->p;
    int n0 = task * jb->chunk;
    int n1 = TD_MIN(p->n, n0 + jb->chunk);
    int rows = fgemm_rows(p), cols = fgemm_cols(p->m);
    size_t row_bytes = td_dtype_bytes(p->w_dtype, (size_t)p->k);
    float *tile = td_cpu_thread_scratch(jb->cpu, thread); /* [rows][cols] */
    for (int i0 = 0; i0 < p->m; i0 += rows) {
        int mm = TD_MIN(rows, p->m - i0);
        for (int j = n0; j < n1; j += cols) {
            int nn = TD_MIN(cols, n1 - j);
            td_cpu_fgemm(p->w_dtype, (const unsigned char *)p->w + (size_t)j * row_bytes, (size_t)nn,
                         (const float *)p->x + (size_t)i0 * p->k, (size_t)mm, (size_t)p->k, tile,
                         (size_t)cols);
            store_tile(p, i0, mm, j, nn, tile, cols);
        }
    }
}

static td_status_t fgemm_matmul(td_cpu_t *cpu, const td_matmul_params_t *p)
{
    td_status_t st = td_cpu_reserve(cpu, (size_t)fgemm_rows(p) * fgemm_cols(p->m) * sizeof(float), 0);
    if (st != TD_OK)
        return st;
    matmul_job_t jb = {.p = p, .cpu = cpu, .chunk = matmul_chunk(cpu, p->m, p->n)};
    td_pool_run(cpu->pool, (p->n + jb.chunk - 1) / jb.chunk, fgemm_task, &jb);
    return TD_OK;
}

/* ---- block-quantized W (td_cpu_quant) ------------------------------------------------- */

/* Puts a tile's products (mm rows of X by nn rows of W from row j, at tile[i * ld + r])
 * through the epilogue: the quantized paths' one way of writing Y. */
static void store_tile(const td_matmul_params_t *p, int i0, int mm, int j, int nn, const float *tile, int ld)
{
    for (int i = 0; i < mm; i++) {
        float *y = (float *)p->y + (size_t)(i0 + i) * p->n + j;
        const float *t = tile + (size_t)i * ld;
        /* store_out's sums without its per-element tests, in loops that vectorise (a
         * prefill's matmuls write ~400K outputs a token) */
        if (p->bias) {
            for (int r = 0; r < nn; r++)
                store_out(p, i0 + i, j + r, t[r]);
        } else if (p->accumulate) {
            for (int r = 0; r < nn; r++)
                y[r] = t[r] + y[r];
        } else {
            memcpy(y, t, (size_t)nn * sizeof(float));
        }
    }
}

/* The quantized path's tile: QTILE rows of W by QROWS rows of X. The activation rows
 * (QROWS * k / 32 blocks of 40 bytes: 40 KiB at k = 2048) and the W rows (18 KiB of Q4_0)
 * stay in L1/L2 while the blocked kernel sweeps them; with all of a 64-row X instead, L2
 * misses halved the speed (VNNI Q4_0, k = 2048: 50 -> 28 GMAC/s). */
#define QTILE 16
#define QROWS 16

typedef struct qmatmul_job {
    const td_matmul_params_t *p;
    td_cpu_t *cpu;
    const td_cpu_quant_ops_t *ops;
    uint32_t type;            /* ggml type id of W */
    size_t row_bytes;         /* bytes of one W row */
    td_cpu_q8a_block_t *a;    /* [m][k / 32] the quantized activations */
    int chunk;                /* W rows per task */
    int act_tasks;            /* tasks quantizing X */
} qmatmul_job_t;

static void qact_task(void *arg, int task, int thread)
{
    qmatmul_job_t *jb = arg;
    const td_matmul_params_t *p = jb->p;
    int i0 = (int)((int64_t)p->m * task / jb->act_tasks);
    int i1 = (int)((int64_t)p->m * (task + 1) / jb->act_tasks);
    size_t nb = (size_t)p->k / TD_QK;
    for (int i = i0; i < i1; i++)
        jb->ops->act_row((const float *)p->x + (size_t)i * p->k, jb->a + (size_t)i * nb, (size_t)p->k);
}

/* One task: W rows [n0, n1) against X in chunks of QROWS rows, tiles of QTILE W rows, each
 * tile's products put through the epilogue (store_out) by this thread. */
static void qmatmul_task(void *arg, int task, int thread)
{
    qmatmul_job_t *jb = arg;
    const td_matmul_params_t *p = jb->p;
    int n0 = task * jb->chunk;
    int n1 = TD_MIN(p->n, n0 + jb->chunk);
    size_t nb = (size_t)p->k / TD_QK;
    float *tile = td_cpu_thread_scratch(jb->cpu, thread); /* [QROWS][QTILE] */
    for (int i0 = 0; i0 < p->m; i0 += QROWS) {
        int mm = TD_MIN(QROWS, p->m - i0);
        for (int j = n0; j < n1; j += QTILE) {
            int nn = TD_MIN(QTILE, n1 - j);
            td_cpu_quant_gemm(jb->ops, jb->type,
                              (const unsigned char *)p->w + (size_t)j * jb->row_bytes,
                              jb->row_bytes, (size_t)nn, jb->a + (size_t)i0 * nb, (size_t)mm,
                              (size_t)p->k, tile, QTILE);
            store_tile(p, i0, mm, j, nn, tile, QTILE);
        }
    }
}

/* Quantizes the m rows of X once (in parallel when m is large), then splits W's rows over
 * the pool. Every output is one td_cpu_quant dot in the contract's order: batch-invariant. */
static td_status_t qmatmul(td_cpu_t *cpu, const td_matmul_params_t *p)
{
    size_t nb = (size_t)p->k / TD_QK;
    size_t act_bytes = (size_t)p->m * nb * sizeof(td_cpu_q8a_block_t);
    td_status_t st = td_cpu_reserve(cpu, QROWS * QTILE * sizeof(float), act_bytes);
    if (st != TD_OK)
        return st;
    qmatmul_job_t jb = {.p = p, .cpu = cpu, .ops = cpu->k.quant,
                        .type = td_dtype_to_ggml(p->w_dtype),
                        .row_bytes = td_dtype_bytes(p->w_dtype, (size_t)p->k),
                        .a = (td_cpu_q8a_block_t *)cpu->shared,
                        .chunk = matmul_chunk(cpu, p->m, p->n)};
    /* quantizing a row costs about what 1/8 of a W row's dot does: split it only when
     * there are rows enough for every thread */
    jb.act_tasks = p->m >= 4 * cpu->n_threads ? cpu->n_threads : 1;
    td_pool_run(cpu->pool, jb.act_tasks, qact_task, &jb);
    td_pool_run(cpu->pool, (p->n + jb.chunk - 1) / jb.chunk, qmatmul_task, &jb);
    return TD_OK;
}

/* ---- block-quantized W, f32 activations (td_cpu_qf32) ----------------------------------- */

/* Rows of X per td_cpu_qf32 call: its prefill tile holds 8 X rows against a dequantized W
 * block; 64 rows (256 KiB of f32 at k = 1024) stay in L2 while a task's W rows stream. */
#define QF_ROWS 64
#define QF_TILE 16

typedef struct qf32_job {
    const td_matmul_params_t *p;
    td_cpu_t *cpu;
    const td_cpu_qf32_ops_t *ops;
    size_t row_bytes;
    int chunk;
} qf32_job_t;

/* One task: W rows [n0, n1) against X in chunks of QF_ROWS rows, QF_TILE W rows a call, each
 * call's products put through the epilogue (store_out) by this thread. */
static void qf32_task(void *arg, int task, int thread)
{
    qf32_job_t *jb = arg;
    const td_matmul_params_t *p = jb->p;
    int n0 = task * jb->chunk;
    int n1 = TD_MIN(p->n, n0 + jb->chunk);
    float *tile = td_cpu_thread_scratch(jb->cpu, thread); /* [QF_ROWS][QF_TILE] */
    for (int i0 = 0; i0 < p->m; i0 += QF_ROWS) {
        int mm = TD_MIN(QF_ROWS, p->m - i0);
        for (int j = n0; j < n1; j += QF_TILE) {
            int nn = TD_MIN(QF_TILE, n1 - j);
            /* the tile's W rows as rows 0..nn of a matrix starting at row j */
            td_cpu_qf32_matmul(jb->ops, p->w_dtype, (const unsigned char *)p->w + (size_t)j * jb->row_bytes,
                               jb->row_bytes, 0, (size_t)nn, (const float *)p->x + (size_t)i0 * p->k, (size_t)mm,
                               (size_t)p->k, tile, QF_TILE);
            store_tile(p, i0, mm, j, nn, tile, QF_TILE);
        }
    }
}

static td_status_t qf32_matmul(td_cpu_t *cpu, const td_matmul_params_t *p)
{
    td_status_t st = td_cpu_reserve(cpu, QF_ROWS * QF_TILE * sizeof(float), 0);
    if (st != TD_OK)
        return st;
    qf32_job_t jb = {.p = p, .cpu = cpu, .ops = cpu->k.qf32,
                     .row_bytes = td_dtype_bytes(p->w_dtype, (size_t)p->k),
                     .chunk = matmul_chunk(cpu, p->m, p->n)};
    td_pool_run(cpu->pool, (p->n + jb.chunk - 1) / jb.chunk, qf32_task, &jb);
    return TD_OK;
}

/* ---- packed block-quantized W, int8 activations (td_cpu_pack) ------------------------- */

/* Rows of X per kernel call and W groups per call: 64 activation rows (280 KiB at k = 1024,
 * of which a kernel reads the hi and lo bytes or the int16 Q: 128 KiB) stay in L2 while the
 * call sweeps its groups, each group's block serving tiles of 4 to 8 rows;
 * the [PK_ROWS][PK_GROUPS * 16] f32 tile goes through the epilogue after each call. */
#define PK_ROWS 64
#define PK_GROUPS 8
#define PK_COLS (PK_GROUPS * TD_CPU_PACK_ROWS)

/* One matrix of a pmatmul job: its tasks start at task0 (the next matrix's task0 ends them),
 * `groups` W groups each. */
typedef struct pmat {
    const td_matmul_params_t *p;
    td_cpu_pack_fn fn;
    const unsigned char *a; /* [m][stride] X quantized for this W's type */
    int groups;
    int task0;
} pmat_t;

typedef struct pmatmul_job {
    td_cpu_t *cpu;
    const td_cpu_pack_ops_t *ops;
    const float *x;       /* [m][k] the shared input */
    int m, k;
    size_t stride;        /* bytes of one activation row */
    int n_mats;
    pmat_t mats[TD_BACKEND_MATMULS_MAX];
    int n_types;          /* the distinct W types: X is quantized once for each */
    td_dtype_t types[TD_BACKEND_MATMULS_MAX];
    unsigned char *act[TD_BACKEND_MATMULS_MAX];
    int act_tasks;        /* tasks quantizing X */
} pmatmul_job_t;

static void pact_task(void *arg, int task, int thread)
{
    pmatmul_job_t *jb = arg;
    int i0 = (int)((int64_t)jb->m * task / jb->act_tasks);
    int i1 = (int)((int64_t)jb->m * (task + 1) / jb->act_tasks);
    for (int t = 0; t < jb->n_types; t++)
        for (int i = i0; i < i1; i++)
            td_cpu_pack_act_row(jb->ops, jb->x + (size_t)i * jb->k, jb->act[t] + (size_t)i * jb->stride,
                                jb->types[t], (size_t)jb->k, jb->cpu->act_one_byte);
}

/* One task: W groups [g0, g1) of one matrix against X in chunks of PK_ROWS rows, PK_GROUPS
 * groups a call. */
static void pmatmul_task(void *arg, int task, int thread)
{
    pmatmul_job_t *jb = arg;
    const pmat_t *mt = &jb->mats[0];
    while (mt + 1 < jb->mats + jb->n_mats && task >= mt[1].task0)
        mt++;
    const td_matmul_params_t *p = mt->p;
    int n_groups = (p->n + TD_CPU_PACK_ROWS - 1) / TD_CPU_PACK_ROWS;
    int g0 = (task - mt->task0) * mt->groups, g1 = TD_MIN(n_groups, g0 + mt->groups);
    float *tile = td_cpu_thread_scratch(jb->cpu, thread); /* [PK_ROWS][PK_COLS] */
    for (int i0 = 0; i0 < p->m; i0 += PK_ROWS) {
        int mm = TD_MIN(PK_ROWS, p->m - i0);
        for (int g = g0; g < g1; g += PK_GROUPS) {
            int ge = TD_MIN(g1, g + PK_GROUPS);
            mt->fn(p->w, (size_t)g, (size_t)ge, (size_t)g1, (size_t)p->k, mt->a + (size_t)i0 * jb->stride, (size_t)mm,
                   tile, PK_COLS);
            int j = g * TD_CPU_PACK_ROWS;
            store_tile(p, i0, mm, j, TD_MIN(p->n, ge * TD_CPU_PACK_ROWS) - j, tile, PK_COLS);
        }
    }
}

/* Quantizes X's rows once for each W type (in parallel when there are many), then splits
 * the matrices' groups over the pool in one job: about two tasks a thread in all, a
 * matrix's share of them by its bytes, so that the small K and V projections beside Q add
 * tasks, not fork-joins. Every output is summed in td_cpu_pack's one order whatever the
 * split: batch-invariant. */
static td_status_t pmatmuls(td_cpu_t *cpu, const td_matmul_params_t *ps, int count)
{
    TD_ASSERT(count >= 1 && count <= TD_BACKEND_MATMULS_MAX);
    const td_matmul_params_t *p0 = &ps[0];
    size_t stride = td_cpu_pack_act_stride((size_t)p0->k);
    pmatmul_job_t jb = {.cpu = cpu, .ops = cpu->k.pack, .x = p0->x, .m = p0->m, .k = p0->k, .stride = stride,
                        .n_mats = count};
    int type_of[TD_BACKEND_MATMULS_MAX]; /* each matrix's index in jb.types */
    double bytes[TD_BACKEND_MATMULS_MAX], total = 0;
    for (int i = 0; i < count; i++) {
        int t = 0;
        while (t < jb.n_types && jb.types[t] != ps[i].w_dtype)
            t++;
        if (t == jb.n_types)
            jb.types[jb.n_types++] = ps[i].w_dtype;
        type_of[i] = t;
        bytes[i] = (double)td_dtype_bytes(ps[i].w_dtype, (size_t)ps[i].n * (size_t)ps[i].k);
        total += bytes[i];
    }
    td_status_t st = td_cpu_reserve(cpu, PK_ROWS * PK_COLS * sizeof(float), (size_t)jb.n_types * (size_t)p0->m * stride);
    if (st != TD_OK)
        return st;
    for (int t = 0; t < jb.n_types; t++)
        jb.act[t] = cpu->shared + (size_t)t * (size_t)p0->m * stride;
    /* two tasks a thread: enough to even out a slow thread, and a decode task's share is one
       stream its prefetch runs ahead in (four: 1B Q4_0 at avx2, 2 threads, 36.1 tokens/s
       against 37.5 at two) */
    int tasks = cpu->n_threads == 1 ? 1 : cpu->n_threads * 2;
    int n_tasks = 0;
    for (int i = 0; i < count; i++) {
        pmat_t *mt = &jb.mats[i];
        int n_groups = (ps[i].n + TD_CPU_PACK_ROWS - 1) / TD_CPU_PACK_ROWS;
        int mine = TD_MAX(1, (int)(tasks * (bytes[i] / total) + 0.5));
        *mt = (pmat_t){.p = &ps[i], .fn = td_cpu_pack_fn_of(cpu->k.pack, ps[i].w_dtype, cpu->act_one_byte),
                       .a = jb.act[type_of[i]], .groups = (n_groups + mine - 1) / mine, .task0 = n_tasks};
        n_tasks += (n_groups + mt->groups - 1) / mt->groups;
    }
    jb.act_tasks = p0->m >= 4 * cpu->n_threads ? cpu->n_threads : 1;
    td_pool_run(cpu->pool, jb.act_tasks, pact_task, &jb);
    td_pool_run(cpu->pool, n_tasks, pmatmul_task, &jb);
    return TD_OK;
}

/* ---- float W packed to bf16, bf16 activations (td_cpu_bgemm: cpu:q8 at avx512bf16, amx) -- */

/* Activation rows per td_cpu_bgemm call in a prefill (its [rows][block * 16] f32 tile: 64 KiB
 * at 16 groups), and the packed W bytes one call's block of groups holds: a block stays in
 * L2 while every row tile of the call, and the next calls' rows, sweep it; the first row
 * tile reads it from memory. A decode call takes BG_DECODE_GROUPS groups (its tiles prefetch
 * ahead within the task's share). */
#define BG_ROWS 64
#define BG_BLOCK_BYTES (512u * 1024u)
#define BG_DECODE_GROUPS 16
#define BG_DECODE_ROWS 4 /* td_cpu_bgemm's decode tiles take m <= 4 */

/* One matrix of a bmatmuls job: its groups are [g0, g0 + groups) of the job's concatenation. */
typedef struct bmat {
    const td_matmul_params_t *p;
    int g0, groups;
} bmat_t;

typedef struct bmatmul_job {
    td_cpu_t *cpu;
    const float *x;   /* [m][k] the shared input */
    int m, k;
    unsigned char *a; /* [m][stride] X rounded to bf16, once for all the matrices */
    size_t stride;
    int rows;         /* activation rows per call */
    int block;        /* groups per call */
    int span;         /* groups per task, of the matrices' groups end to end */
    int n_groups;     /* of all the matrices */
    int n_mats;
    bmat_t mats[TD_BACKEND_MATMULS_MAX];
    int act_tasks;
} bmatmul_job_t;

static void bact_task(void *arg, int task, int thread)
{
    bmatmul_job_t *jb = arg;
    int i0 = (int)((int64_t)jb->m * task / jb->act_tasks);
    int i1 = (int)((int64_t)jb->m * (task + 1) / jb->act_tasks);
    for (int i = i0; i < i1; i++)
        td_cpu_bgemm_act_row(jb->x + (size_t)i * jb->k, (uint16_t *)(void *)(jb->a + (size_t)i * jb->stride),
                             (size_t)jb->k);
}

/* Groups [g0, g1) of one matrix in blocks of jb->block, each block against every activation
 * row (jb->rows a call) before the next, each call's products put through the epilogue. */
static void bmatmul_range(const bmatmul_job_t *jb, const td_matmul_params_t *p, int g0, int g1, float *tile)
{
    int cols = jb->block * TD_CPU_BGEMM_ROWS;
    for (int g = g0; g < g1; g += jb->block) {
        int ge = TD_MIN(g1, g + jb->block);
        int j = g * TD_CPU_BGEMM_ROWS, nn = TD_MIN(p->n, ge * TD_CPU_BGEMM_ROWS) - j;
        for (int i0 = 0; i0 < p->m; i0 += jb->rows) {
            int mm = TD_MIN(jb->rows, p->m - i0);
            jb->cpu->k.bgemm(p->w, (size_t)g, (size_t)ge, (size_t)g1, (size_t)p->k, jb->a + (size_t)i0 * jb->stride,
                         jb->stride, (size_t)mm, tile, (size_t)cols);
            store_tile(p, i0, mm, j, nn, tile, cols);
        }
    }
}

/* One task: jb->span groups of the matrices' groups end to end (a task may end one matrix
 * and start the next), so every task has the same work whatever the matrices' sizes. */
static void bmatmul_task(void *arg, int task, int thread)
{
    bmatmul_job_t *jb = arg;
    int a = task * jb->span, b = TD_MIN(jb->n_groups, a + jb->span);
    float *tile = td_cpu_thread_scratch(jb->cpu, thread); /* [rows][block * 16] */
    for (int i = 0; i < jb->n_mats; i++) {
        const bmat_t *mt = &jb->mats[i];
        int lo = TD_MAX(a, mt->g0), hi = TD_MIN(b, mt->g0 + mt->groups);
        if (lo < hi)
            bmatmul_range(jb, mt->p, lo - mt->g0, hi - mt->g0, tile);
    }
}

/* Rounds X's rows to bf16 once for all the matrices (in parallel when there are many), then
 * splits their groups, end to end, over the pool in one job, so that K and V beside Q (or up
 * beside gate) add work to tasks, not fork-joins, as pmatmuls, and every task has the same
 * share: a decode two tasks a thread (each one stream its tiles prefetch ahead in), a
 * prefill one block of groups a task. (Shares per matrix, as pmatmuls, left 5 tasks of
 * 43, 43, 42, 32 and 32 groups for Q, K, V at 2 threads.) Every output is one lane summed
 * in td_cpu_bgemm's one order whatever the split: batch-invariant, and the bits of one
 * call per matrix. */
static td_status_t bmatmuls(td_cpu_t *cpu, const td_matmul_params_t *ps, int count)
{
    TD_ASSERT(cpu->k.bgemm && count >= 1 && count <= TD_BACKEND_MATMULS_MAX);
    const td_matmul_params_t *p0 = &ps[0];
    TD_ASSERT(p0->k % 2 == 0);
    bmatmul_job_t jb = {.cpu = cpu, .x = p0->x, .m = p0->m, .k = p0->k,
                        .stride = td_cpu_bgemm_act_stride((size_t)p0->k), .n_mats = count};
    bool decode = p0->m <= BG_DECODE_ROWS;
    jb.rows = decode ? p0->m : BG_ROWS;
    jb.block = decode ? BG_DECODE_GROUPS
                      : TD_MAX(2, (int)(BG_BLOCK_BYTES / td_cpu_bgemm_group_bytes((size_t)p0->k)) / 2 * 2);
    td_status_t st = td_cpu_reserve(cpu, (size_t)jb.rows * (size_t)jb.block * TD_CPU_BGEMM_ROWS * sizeof(float),
                                    (size_t)p0->m * jb.stride);
    if (st != TD_OK)
        return st;
    jb.a = cpu->shared;
    for (int i = 0; i < count; i++) {
        TD_ASSERT(td_dtype_is_float(ps[i].w_dtype) && ps[i].w_packed);
        int groups = (ps[i].n + TD_CPU_BGEMM_ROWS - 1) / TD_CPU_BGEMM_ROWS;
        jb.mats[i] = (bmat_t){.p = &ps[i], .g0 = jb.n_groups, .groups = groups};
        jb.n_groups += groups;
    }
    if (cpu->n_threads == 1) {
        jb.span = jb.n_groups;
    } else if (decode) { /* an even share: the kernel's tiles are 2 groups */
        int tasks = cpu->n_threads * 2;
        jb.span = (jb.n_groups + tasks - 1) / tasks;
        jb.span += jb.span % 2;
    } else {
        jb.span = jb.block;
    }
    jb.act_tasks = p0->m >= 4 * cpu->n_threads ? cpu->n_threads : 1;
    td_pool_run(cpu->pool, jb.act_tasks, bact_task, &jb);
    td_pool_run(cpu->pool, (jb.n_groups + jb.span - 1) / jb.span, bmatmul_task, &jb);
    return TD_OK;
}

/* Contract (td_backend.h ops->matmul): y may not alias x or w. Errors: TD_ERR_NOMEM when
   the conversion scratch cannot grow. */
td_status_t td_cpu_matmul(td_backend_t *be, const td_matmul_params_t *p)
{
    td_cpu_t *cpu = td_cpu_of(be);
    TD_ASSERT(p->m >= 0 && p->n >= 0 && p->k >= 0);
    if (p->m == 0 || p->n == 0)
        return TD_OK;
    if (p->w_packed)
        return td_dtype_is_float(p->w_dtype) ? bmatmuls(cpu, p, 1) : pmatmuls(cpu, p, 1);
    if (p->w_dtype == TD_Q5_K || p->w_dtype == TD_IQ4_XS)
        return td_errorf(TD_ERR_UNSUPPORTED, "cpu matmul: %s weights are read only in the packed form "
                         "ops->weight_pack makes; pack the matrix first", td_dtype_name(p->w_dtype));
    if (td_dtype_is_block(p->w_dtype))
        return cpu->exact ? qf32_matmul(cpu, p) : qmatmul(cpu, p);
    return cpu->k.fmatmul(cpu, p);
}

/* Contract (td_backend.h ops->matmuls): ps[i] share m, k and x. Packed block-typed matrices
   go through one pmatmuls job, packed float ones (cpu:q8's bf16) through one bmatmuls job;
   otherwise each is td_cpu_matmul's, in order. */
td_status_t td_cpu_matmuls(td_backend_t *be, const td_matmul_params_t *ps, int32_t count)
{
    td_cpu_t *cpu = td_cpu_of(be);
    TD_ASSERT(count >= 1 && count <= TD_BACKEND_MATMULS_MAX);
    bool packed = ps[0].m > 0, fpacked = packed; /* all packed block-typed; all packed float */
    for (int i = 0; i < count; i++) {
        TD_ASSERT(ps[i].m == ps[0].m && ps[i].k == ps[0].k && ps[i].x == ps[0].x && ps[i].n >= 0);
        bool in = ps[i].w_packed && ps[i].n > 0;
        packed = packed && in && !td_dtype_is_float(ps[i].w_dtype);
        fpacked = fpacked && in && td_dtype_is_float(ps[i].w_dtype);
    }
    if (packed)
        return pmatmuls(cpu, ps, count);
    if (fpacked)
        return bmatmuls(cpu, ps, count);
    for (int i = 0; i < count; i++) {
        td_status_t st = td_cpu_matmul(be, &ps[i]);
        if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

td_cpu_fmatmul_fn td_cpu_fmatmul_of(td_cpu_isa_t isa)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
#if TD_CPU_X86
    if (isa >= TD_CPU_ISA_AVX512)
        return fgemm_matmul;
    if (isa >= TD_CPU_ISA_AVX2)
        return gemv_matmul;
#endif
    return blas_matmul;
}
