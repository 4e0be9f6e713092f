/*
 * td_cpu_fgemm: the AVX-512 float-weight matmul (f32, f16, bf16 W; f32 X), summing in the
 * header's order (16 lanes over k, then a fixed tree) in every tile shape.
 *
 * A tile is R W rows by M X rows held in R * M zmm accumulators; per 16-weight chunk each
 * W row is loaded and widened to f32 once and each X row's 16 activations once, then R * M
 * FMAs. Zen 4 runs one 512-bit FMA a cycle and one or two 512-bit loads, so a tile with
 * R + M loads (and R conversions) per R * M FMAs stays FMA-bound once R * M >= 16 or so.
 *
 * Prefetch (into L2, _MM_HINT_T1: T0 measured slower, 15-18 vs 22-25 GB/s for one thread's
 * f16 GEMV from DRAM): a decode tile (R rows, read once) prefetches each of its rows' lines
 * two tiles ahead (the rows are contiguous); R interleaved row streams are more than the
 * hardware prefetcher follows at full speed on its own. The first X tile of a prefill call
 * prefetches the rows a next call will read (the n rows after its own); later X tiles find
 * the call's rows in L2.
 */
#include "td_cpu_fgemm.h"

#include <stdint.h>

#include "td_cpu_isa.h"
#include "td_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TD_CPU_FGEMM_X86 1
#endif

#ifdef TD_CPU_FGEMM_X86

#define TD_INLINE static inline __attribute__((always_inline))
#define TD_Z __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

#define LANES 16 /* the order contract's lane count */
#define MAX_R 8
#define MAX_M 6
#ifndef FG_DECODE_AHEAD
#define FG_DECODE_AHEAD 2 /* decode tiles prefetch this many tiles ahead */
#endif
#ifndef FG_PREFETCH_HINT
#define FG_PREFETCH_HINT _MM_HINT_T1
#endif

/* W weights [e, e + 16) of a row as f32; mask-loaded (missing lanes 0) when k - e < 16. */
TD_INLINE TD_Z __m512 z_load_w(td_dtype_t t, const uint8_t *row, size_t e, __mmask16 mk, bool tail)
{
    if (t == TD_F32) {
        const float *p = (const float *)(const void *)row + e;
        return tail ? _mm512_maskz_loadu_ps(mk, p) : _mm512_loadu_ps(p);
    }
    const uint16_t *p = (const uint16_t *)(const void *)row + e;
    __m256i h = tail ? _mm256_maskz_loadu_epi16(mk, p) : _mm256_loadu_si256((const __m256i *)(const void *)p);
    if (t == TD_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The header's tree: lanes l + 8, then l + 4, l + 2, l + 1. */
TD_INLINE TD_Z float z_hsum(__m512 v)
{
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

/* One chunk of 16 weights at e into the R x M accumulators. */
TD_INLINE TD_Z void z_chunk(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                            const float *x, size_t k, size_t e, __mmask16 mk, bool tail,
                            __m512 acc[MAX_R][MAX_M])
{
    __m512 wv[MAX_R];
    for (int r = 0; r < R; r++)
        wv[r] = z_load_w(t, w + (size_t)r * row_bytes, e, mk, tail);
    for (int i = 0; i < M; i++) {
        const float *xi = x + (size_t)i * k + e;
        __m512 xv = tail ? _mm512_maskz_loadu_ps(mk, xi) : _mm512_loadu_ps(xi);
        /* one load per X vector: without this GCC folds it into each of the R FMAs as a
         * memory operand, R loads where one does, and the tile turns load-bound */
        __asm__("" : "+v"(xv));
        for (int r = 0; r < R; r++)
            acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
    }
}

/* The k weights into the R x M accumulators, chunk by chunk (the last masked when
 * k % 16 != 0). pf: when not 0, each row's cache line pf bytes ahead of the one a chunk
 * starts is prefetched (once a line). */
TD_INLINE TD_Z void z_run(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                          const float *x, size_t k, __m512 acc[MAX_R][MAX_M], size_t pf)
{
    const size_t sz = t == TD_F32 ? 4 : 2;
    size_t e = 0;
    for (; e + LANES <= k; e += LANES) {
        if (pf && (e * sz) % 64 == 0)
            for (int r = 0; r < R; r++)
                _mm_prefetch((const char *)w + (size_t)r * row_bytes + e * sz + pf, FG_PREFETCH_HINT);
        z_chunk(t, R, M, w, row_bytes, x, k, e, 0, false, acc);
    }
    if (e < k)
        z_chunk(t, R, M, w, row_bytes, x, k, e, (__mmask16)((1u << (k - e)) - 1), true, acc);
}

/* y[i * ldy + r] = dot(W row r, X row i) for r < R, i < M; W row r at w + r * row_bytes.
 * pf: z_run's prefetch distance in bytes, or 0. */
TD_INLINE TD_Z void z_tile(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                           const float *x, size_t k, float *y, size_t ldy, size_t pf)
{
    __m512 acc[MAX_R][MAX_M];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            acc[r][i] = _mm512_setzero_ps();
    z_run(t, R, M, w, row_bytes, x, k, acc, pf);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            y[(size_t)i * ldy + r] = z_hsum(acc[r][i]);
}

/* Decode: W rows [0, n) against M <= 5 X rows, R at a time (each prefetching two tiles
 * ahead), the last n % R one by one. */
TD_INLINE TD_Z void z_decode(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                             size_t n, const float *x, size_t k, float *y, size_t ldy)
{
    size_t j = 0;
    for (; j + (size_t)R <= n; j += (size_t)R)
        z_tile(t, R, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy, FG_DECODE_AHEAD * R * row_bytes);
    for (; j < n; j++)
        z_tile(t, 1, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy, 0);
}

/* Prefill: M X rows against the call's W rows [0, n), 4 at a time, then the n % 4 single
 * rows: the M rows' activations stay in L1/L2 across the call's rows, which come from L2
 * after the first X tile. (Blocking k as well, parking the accumulators between blocks in
 * the lane order, measured slower: 92 vs 105 GFLOP/s at k = 2048 with 512-weight blocks.) */
TD_INLINE TD_Z void z_prefill_tile(td_dtype_t t, int M, const uint8_t *w, size_t row_bytes, size_t n,
                                   const float *x, size_t k, float *y, size_t ldy, size_t pf)
{
    size_t j = 0;
    for (; j + 4 <= n; j += 4)
        z_tile(t, 4, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy, pf);
    for (; j < n; j++)
        z_tile(t, 1, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy, pf);
}

/* Prefill: all m X rows, 6 at a time and the m % 6 left. */
TD_INLINE TD_Z void z_prefill(td_dtype_t t, const uint8_t *w, size_t row_bytes, size_t n,
                              const float *x, size_t m, size_t k, float *y, size_t ldy)
{
    for (size_t i = 0; i < m; i += MAX_M) {
        const float *xi = x + i * k;
        float *yi = y + i * ldy;
        /* the first X tile reads the call's W rows from memory: it prefetches the rows a
         * next call on the following n rows will read */
        size_t pf = i == 0 ? n * row_bytes : 0;
        switch (TD_MIN(m - i, (size_t)MAX_M)) {
        case 1: z_prefill_tile(t, 1, w, row_bytes, n, xi, k, yi, ldy, pf); break;
        case 2: z_prefill_tile(t, 2, w, row_bytes, n, xi, k, yi, ldy, pf); break;
        case 3: z_prefill_tile(t, 3, w, row_bytes, n, xi, k, yi, ldy, pf); break;
        case 4: z_prefill_tile(t, 4, w, row_bytes, n, xi, k, yi, ldy, pf); break;
        case 5: z_prefill_tile(t, 5, w, row_bytes, n, xi, k, yi, ldy, pf); break;
        default: z_prefill_tile(t, MAX_M, w, row_bytes, n, xi, k, yi, ldy, pf); break;
        }
    }
}

TD_INLINE TD_Z void z_fgemm(td_dtype_t t, const void *wv, size_t n, const float *x, size_t m,
                            size_t k, float *y, size_t ldy)
{
    const uint8_t *w = wv;
    const size_t row_bytes = k * (t == TD_F32 ? 4 : 2);
    switch (m) {
    case 1: z_decode(t, 8, 1, w, row_bytes, n, x, k, y, ldy); return;
    case 2: z_decode(t, 8, 2, w, row_bytes, n, x, k, y, ldy); return;
    case 3: z_decode(t, 6, 3, w, row_bytes, n, x, k, y, ldy); return;
    case 4: z_decode(t, 4, 4, w, row_bytes, n, x, k, y, ldy); return;
    case 5: z_decode(t, 4, 5, w, row_bytes, n, x, k, y, ldy); return;
    default: break;
    }
    z_prefill(t, w, row_bytes, n, x, m, k, y, ldy);
}

static TD_Z void fgemm_f32(const void *w, size_t n, const float *x, size_t m, size_t k, float *y, size_t ldy)
{
    z_fgemm(TD_F32, w, n, x, m, k, y, ldy);
}

static TD_Z void fgemm_f16(const void *w, size_t n, const float *x, size_t m, size_t k, float *y, size_t ldy)
{
    z_fgemm(TD_F16, w, n, x, m, k, y, ldy);
}

static TD_Z void fgemm_bf16(const void *w, size_t n, const float *x, size_t m, size_t k, float *y, size_t ldy)
{
    z_fgemm(TD_BF16, w, n, x, m, k, y, ldy);
}

#endif /* TD_CPU_FGEMM_X86 */

bool td_cpu_fgemm_available(void)
{
#ifdef TD_CPU_FGEMM_X86
    return td_cpu_isa_runs(TD_CPU_ISA_AVX512);
#else
    return false;
#endif
}

void td_cpu_fgemm(td_dtype_t type, const void *w, size_t n, const float *x, size_t m, size_t k,
                  float *y, size_t ldy)
{
    TD_ASSERT(td_cpu_fgemm_available());
#ifdef TD_CPU_FGEMM_X86
    switch (type) {
    case TD_F32: fgemm_f32(w, n, x, m, k, y, ldy); return;
    case TD_F16: fgemm_f16(w, n, x, m, k, y, ldy); return;
    case TD_BF16: fgemm_bf16(w, n, x, m, k, y, ldy); return;
    default: break;
    }
#endif
    TD_ASSERT(!"td_cpu_fgemm: W must be f32, f16 or bf16");
}

size_t td_cpu_fgemm_x_rows(size_t k)
{
    /* measured (one thread, 4x6 tiles): 384 KiB of X 95-105 GFLOP/s at k = 8192, 1.5 MiB
     * 105-108, unchunked (W read once, X from L3) 85-98 */
    size_t rows = (1536u * 1024u) / (TD_MAX(k, 1) * sizeof(float)) / 6 * 6;
    return TD_MAX(rows, 6);
}
