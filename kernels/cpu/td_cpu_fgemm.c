/*
 * td_cpu_fgemm: the AVX-512 float-weight matmul (f32, f16, bf16 W; f32 X), summing in the
 * header's order (16 lanes over k, then a fixed tree) in every tile shape.
 *
 * A tile is R W rows by M X rows held in R * M zmm accumulators; per 16-weight chunk each
 * W row is loaded and widened to f32 once and each X row's 16 activations once, then R * M
 * FMAs. Zen 4 runs one 512-bit FMA a cycle and one or two 512-bit loads, so a tile with
 * R + M loads (and R conversions) per R * M FMAs stays FMA-bound once R * M >= 16 or so.
 *
 * Prefetch: a decode tile (R rows, read once) prefetches the W rows two tiles ahead (the
 * rows are contiguous), R * 16 weights' worth of bytes per chunk, so the next tiles are in
 * cache when they start; R interleaved row streams are more than the hardware prefetcher
 * follows at full speed on its own. A prefill tile prefetches the next R-row group during
 * its first X tile; later X tiles find the group in L1/L2.
 */
#include "td_cpu_fgemm.h"

#include <stdint.h>

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
        for (int r = 0; r < R; r++)
            acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
    }
}

/* y[i * ldy + r] = dot(W row r, X row i) for r < R, i < M; W row r at w + r * row_bytes.
 * pf: where to prefetch R * row_bytes bytes spread over the chunks, or NULL. */
TD_INLINE TD_Z void z_tile(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                           const float *x, size_t k, float *y, size_t ldy, const uint8_t *pf)
{
    __m512 acc[MAX_R][MAX_M];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            acc[r][i] = _mm512_setzero_ps();
    /* the bytes of R rows one chunk covers: the chunks together cover the R rows at pf */
    const size_t step = (size_t)R * LANES * (t == TD_F32 ? 4 : 2);
    size_t e = 0;
    for (; e + LANES <= k; e += LANES) {
        if (pf) {
            for (size_t o = 0; o < step; o += 64)
                _mm_prefetch((const char *)pf + o, _MM_HINT_T0);
            pf += step;
        }
        z_chunk(t, R, M, w, row_bytes, x, k, e, 0, false, acc);
    }
    if (e < k)
        z_chunk(t, R, M, w, row_bytes, x, k, e, (__mmask16)((1u << (k - e)) - 1), true, acc);
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
        z_tile(t, R, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy,
               w + (j + 2 * (size_t)R) * row_bytes);
    for (; j < n; j++)
        z_tile(t, 1, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy, NULL);
}

/* R W rows (R = 4, or 1 for the last n % 4) against all m X rows, 6 at a time and the
 * m % 6 left; the first X tile prefetches the next R-row group. */
TD_INLINE TD_Z void z_prefill_rows(td_dtype_t t, int R, const uint8_t *w, size_t row_bytes,
                                   const float *x, size_t m, size_t k, float *y, size_t ldy)
{
    const uint8_t *pf = w + (size_t)R * row_bytes;
    size_t i = 0;
    for (; i + MAX_M <= m; i += MAX_M, pf = NULL)
        z_tile(t, R, MAX_M, w, row_bytes, x + i * k, k, y + i * ldy, ldy, pf);
    const float *xi = x + i * k;
    float *yi = y + i * ldy;
    switch (m - i) {
    case 1: z_tile(t, R, 1, w, row_bytes, xi, k, yi, ldy, pf); break;
    case 2: z_tile(t, R, 2, w, row_bytes, xi, k, yi, ldy, pf); break;
    case 3: z_tile(t, R, 3, w, row_bytes, xi, k, yi, ldy, pf); break;
    case 4: z_tile(t, R, 4, w, row_bytes, xi, k, yi, ldy, pf); break;
    case 5: z_tile(t, R, 5, w, row_bytes, xi, k, yi, ldy, pf); break;
    default: break;
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
    size_t j = 0;
    for (; j + 4 <= n; j += 4)
        z_prefill_rows(t, 4, w + j * row_bytes, row_bytes, x, m, k, y + j, ldy);
    for (; j < n; j++)
        z_prefill_rows(t, 1, w + j * row_bytes, row_bytes, x, m, k, y + j, ldy);
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
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
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
    size_t rows = (384u * 1024u) / (TD_MAX(k, 1) * sizeof(float)) / 6 * 6;
    return TD_MAX(rows, 6);
}
