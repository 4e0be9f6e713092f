/*
 * td_cpu_qf32: block-quantized weights times f32 activations, scalar, AVX2 and AVX-512, all
 * summing in the header's order (16 lanes over k, then a fixed tree), so bit-identical.
 *
 * Why each dequantized weight is bit-identical to td_quant's reference: the SIMD code does
 * the reference's f32 operations on the same operands. Q8_0 q * d and Q4_0 d * (q - 8) are
 * exact products. Q4_1 d * q + m, Q4_K (d * sc) * q - dmin * mn: the products are exact (at
 * most 11 + 6 + 4 significant bits), so the reference rounds once, in its add, exactly as an
 * FMA does. Q6_K (d * sc) * (q - 32): d * sc is exact, the second product rounds once, as in
 * the reference. Scales go through F16C (vcvtph2ps), exact as td_f16_to_f32 is.
 *
 * Blocking: a tile is R W rows by M X rows, R * M accumulators (zmm, or ymm pairs) held in
 * registers; per 16-weight chunk the R rows' weights are dequantized once and each X row's
 * 16 activations are loaded once. The X-row tiles are the outer loop and W rows the inner
 * one: the quantized W (0.56 to 1.06 bytes a weight) is what is re-read per tile, not the
 * f32 X (4 bytes a value), and a thread's W rows stay in L2 across tiles.
 */
#include "td_cpu_qf32.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "td_cpu_isa.h"
#include "td_quant.h"
#include "td_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TD_CPU_QF32_X86 1
#endif

#define LANES 16 /* the order contract's lane count */

/* ---- scalar reference ------------------------------------------------------------------- */

/* The header's tree over the 16 lane accumulators. */
static float hsum16_ref(const float acc[LANES])
{
    float s8[8], s4[4], s2[2];
    for (int l = 0; l < 8; l++)
        s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++)
        s4[l] = s8[l] + s8[l + 4];
    for (int l = 0; l < 2; l++)
        s2[l] = s4[l] + s4[l + 2];
    return s2[0] + s2[1];
}

#define SCALAR_ROWS 8 /* X rows per pass over a W row: each block dequantized once per pass */

/* The reference: each W block dequantized by td_quant's own dequantizer, the lanes summed
 * one product at a time with fmaf. */
static void matmul_scalar(td_dtype_t type, const void *w, size_t row_bytes, size_t n0,
                          size_t n1, const float *x, size_t m, size_t k, float *y, size_t ldy)
{
    const td_ggml_type_t *gt = td_ggml_type(td_dtype_to_ggml(type));
    const size_t be = gt->block_elems, bb = gt->block_bytes;
    float wb[TD_QK_K];
    for (size_t j = n0; j < n1; j++) {
        const uint8_t *row = (const uint8_t *)w + j * row_bytes;
        for (size_t i0 = 0; i0 < m; i0 += SCALAR_ROWS) {
            size_t mi = m - i0 < SCALAR_ROWS ? m - i0 : SCALAR_ROWS;
            float acc[SCALAR_ROWS][LANES] = {{0}};
            for (size_t b = 0; b < k / be; b++) {
                gt->dequantize(row + b * bb, wb, be);
                for (size_t i = 0; i < mi; i++) {
                    const float *xb = x + (i0 + i) * k + b * be;
                    for (size_t e = 0; e < be; e++)
                        acc[i][e % LANES] = fmaf(wb[e], xb[e], acc[i][e % LANES]);
                }
            }
            for (size_t i = 0; i < mi; i++)
                y[(i0 + i) * ldy + j] = hsum16_ref(acc[i]);
        }
    }
}

#define SCALAR_FN(name, type)                                                                \
    static void name(const void *w, size_t row_bytes, size_t n0, size_t n1, const float *x,  \
                     size_t m, size_t k, float *y, size_t ldy)                               \
    {                                                                                        \
        matmul_scalar(type, w, row_bytes, n0, n1, x, m, k, y, ldy);                          \
    }
SCALAR_FN(q8_0_scalar, TD_Q8_0)
SCALAR_FN(q4_0_scalar, TD_Q4_0)
SCALAR_FN(q4_1_scalar, TD_Q4_1)
SCALAR_FN(q4_k_scalar, TD_Q4_K)
SCALAR_FN(q6_k_scalar, TD_Q6_K)

static const td_cpu_qf32_ops_t ops_scalar = {
    .name = "scalar",
    .q8_0 = q8_0_scalar,
    .q4_0 = q4_0_scalar,
    .q4_1 = q4_1_scalar,
    .q4_k = q4_k_scalar,
    .q6_k = q6_k_scalar,
};

#ifdef TD_CPU_QF32_X86

/* ---- shared x86 pieces: per-block scales and 16 quants of a chunk as bytes --------------- */

#define TD_INLINE static inline __attribute__((always_inline))

/* A block's scales as f32, in the reference's operations: s[c] multiplies the quants of
 * chunk c (16 weights), o[c] is added (Q4_1's m, Q4_K's -(dmin * mn)). Q8_0/Q4_0/Q4_1 use
 * index 0 for both chunks. */
typedef struct qf32_scales {
    float s[LANES];
    float o[LANES];
} qf32_scales_t;

TD_INLINE void q4_k_scale_min(const uint8_t sc[12], int s, int *scale, int *min)
{
    if (s < 4) {
        *scale = sc[s] & 63;
        *min = sc[s + 4] & 63;
    } else {
        *scale = (sc[s + 4] & 0x0f) | ((sc[s - 4] >> 6) << 4);
        *min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

TD_INLINE __attribute__((target("f16c"))) void qf32_block_scales(td_dtype_t t, const uint8_t *p,
                                                                 qf32_scales_t *z)
{
    switch (t) {
    case TD_Q8_0: z->s[0] = _cvtsh_ss(((const td_block_q8_0_t *)(const void *)p)->d); break;
    case TD_Q4_0: z->s[0] = _cvtsh_ss(((const td_block_q4_0_t *)(const void *)p)->d); break;
    case TD_Q4_1: {
        const td_block_q4_1_t *b = (const void *)p;
        z->s[0] = _cvtsh_ss(b->d);
        z->o[0] = _cvtsh_ss(b->m);
        break;
    }
    case TD_Q4_K: {
        const td_block_q4_k_t *b = (const void *)p;
        float d = _cvtsh_ss(b->d), dmin = _cvtsh_ss(b->dmin);
        for (int s = 0; s < 8; s++) { /* sub-block s of 32 = chunks 2s, 2s + 1 */
            int sc, mn;
            q4_k_scale_min(b->scales, s, &sc, &mn);
            z->s[2 * s] = z->s[2 * s + 1] = d * (float)sc;
            z->o[2 * s] = z->o[2 * s + 1] = -(dmin * (float)mn);
        }
        break;
    }
    case TD_Q6_K: {
        const td_block_q6_k_t *b = (const void *)p;
        float d = _cvtsh_ss(b->d);
        for (int c = 0; c < LANES; c++) /* chunk c = weights 16c.., scale scales[c] */
            z->s[c] = d * (float)b->scales[c];
        break;
    }
    default: TD_ASSERT(0 && "qf32: not a qf32 weight type");
    }
}

/* The 16 unsigned quants of chunk c of a 4-bit block (Q4_0, Q4_1, Q4_K), as bytes. */
TD_INLINE __m128i q4_chunk(td_dtype_t t, const uint8_t *p, int c)
{
    const uint8_t *qs;
    int high;
    if (t == TD_Q4_K) { /* 32-byte group c / 4: sub-block 2g low nibbles, 2g + 1 high */
        qs = ((const td_block_q4_k_t *)(const void *)p)->qs + 32 * (c / 4) + 16 * (c % 2);
        high = (c / 2) % 2;
    } else {
        qs = t == TD_Q4_0 ? ((const td_block_q4_0_t *)(const void *)p)->qs
                          : ((const td_block_q4_1_t *)(const void *)p)->qs;
        high = c;
    }
    __m128i v = _mm_loadu_si128((const __m128i *)(const void *)qs);
    if (high)
        v = _mm_srli_epi16(v, 4);
    return _mm_and_si128(v, _mm_set1_epi8(0x0f));
}

/* The 16 quants (0..63) of chunk c of a Q6_K block (td_quant.h's layout), as bytes. */
TD_INLINE __m128i q6_chunk(const uint8_t *p, int c)
{
    const td_block_q6_k_t *b = (const void *)p;
    int h = c / 8, kq = (c % 8) / 2, l0 = 16 * (c % 2);
    __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)(b->ql + 64 * h + l0 + 32 * (kq & 1)));
    if (kq >= 2)
        lo = _mm_srli_epi16(lo, 4);
    lo = _mm_and_si128(lo, _mm_set1_epi8(0x0f));
    __m128i hi = _mm_loadu_si128((const __m128i *)(const void *)(b->qh + 32 * h + l0));
    hi = _mm_and_si128(_mm_srl_epi16(hi, _mm_cvtsi32_si128(2 * kq)), _mm_set1_epi8(3));
    return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
}

TD_INLINE size_t qf32_block_elems(td_dtype_t t)
{
    return t == TD_Q4_K || t == TD_Q6_K ? TD_QK_K : TD_QK;
}

TD_INLINE size_t qf32_block_bytes(td_dtype_t t)
{
    switch (t) {
    case TD_Q8_0: return sizeof(td_block_q8_0_t);
    case TD_Q4_0: return sizeof(td_block_q4_0_t);
    case TD_Q4_1: return sizeof(td_block_q4_1_t);
    case TD_Q4_K: return sizeof(td_block_q4_k_t);
    default: return sizeof(td_block_q6_k_t);
    }
}

/* Software prefetch of the W rows two tiles ahead (contiguous after this tile's in a dense
 * matrix), row_bytes * R / nb bytes per block of this tile, so a tile is in cache when it
 * starts. Why: with short rows (k = 576: 6 to 10 cache lines) the R interleaved row
 * streams end before the hardware prefetcher has learnt them; measured GEMV from DRAM
 * (196608 x 576, one thread, noisy VM), Q8_0 went from ~6 to 21-34 GFLOP/s, Q4_0 from ~21
 * to ~37 (one tile ahead was not far enough for Q4_0). A prefetch never faults, so the
 * last tiles' look past the matrix is harmless. */
TD_INLINE size_t qf32_prefetch_step(int R, size_t row_bytes, size_t nb)
{
    return ((size_t)R * row_bytes + nb - 1) / nb;
}

TD_INLINE void qf32_prefetch_next(const uint8_t *next, size_t b, size_t step)
{
    for (size_t o = b * step; o < (b + 1) * step; o += 64)
        _mm_prefetch((const char *)next + o, _MM_HINT_T0);
}

/* ---- AVX-512 ------------------------------------------------------------------------------ */

#define TD_Z __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

/* A unit is the weights one dequantization step of a block gives: Q8_0, Q4_0, Q4_1 a whole
 * block (2 chunks of 16), Q4_K a 32-byte group of quants (4 chunks: sub-blocks 2g and
 * 2g + 1), Q6_K one chunk. */
TD_INLINE int z_unit_chunks(td_dtype_t t)
{
    return t == TD_Q4_K ? 4 : t == TD_Q6_K ? 1 : 2;
}

TD_INLINE TD_Z __m512 z_iota(void)
{
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* An f16 scale broadcast to 16 lanes (vcvtph2ps: exact). */
TD_INLINE TD_Z __m512 z_f16(uint16_t h)
{
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
}

/*
 * Unit u of the block at p, chunks in weight order into out[0..z_unit_chunks), each weight
 * as td_quant's dequantizer gives it. The 4-bit types look their weights up in a 16-entry
 * table of the block's (or sub-block's) 16 possible values, lut[q] computed with the
 * reference's own operation (d * (q - 8), fma(d, q, m), fma(d * sc, q, -(dmin * mn))), so
 * one vpermps (which reads only an index's low 4 bits: the low nibble needs no mask)
 * replaces a convert and an FMA per chunk. z: Q6_K's per-chunk scales.
 */
TD_INLINE TD_Z void z_deq_unit(td_dtype_t t, const uint8_t *p, int u, const qf32_scales_t *z,
                               __m512 out[4])
{
    switch (t) {
    case TD_Q8_0: {
        const td_block_q8_0_t *b = (const void *)p;
        __m512 d = z_f16(b->d);
        for (int c = 0; c < 2; c++) {
            __m128i q = _mm_loadu_si128((const __m128i *)(const void *)(b->qs + 16 * c));
            out[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
        }
        return;
    }
    case TD_Q4_0:
    case TD_Q4_1: {
        const uint8_t *qs;
        __m512 lut;
        if (t == TD_Q4_0) {
            const td_block_q4_0_t *b = (const void *)p;
            qs = b->qs;
            lut = _mm512_mul_ps(z_f16(b->d), _mm512_sub_ps(z_iota(), _mm512_set1_ps(8)));
        } else {
            /* d and m are adjacent: one broadcast and one convert give [d, m, d, m, ...],
             * two in-lane shuffles the splats (cheaper than two of z_f16) */
            const td_block_q4_1_t *b = (const void *)p;
            int32_t dm_bits;
            memcpy(&dm_bits, &b->d, sizeof dm_bits);
            __m512 dm = _mm512_cvtph_ps(_mm256_set1_epi32(dm_bits));
            qs = b->qs;
            lut = _mm512_fmadd_ps(_mm512_shuffle_ps(dm, dm, 0x00), z_iota(),
                                  _mm512_shuffle_ps(dm, dm, 0x55));
        }
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)qs));
        out[0] = _mm512_permutexvar_ps(v, lut);
        out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
        return;
    }
    case TD_Q4_K: {
        const td_block_q4_k_t *b = (const void *)p;
        float d = _cvtsh_ss(b->d), dmin = _cvtsh_ss(b->dmin);
        __m512 lut[2];
        for (int h = 0; h < 2; h++) {
            int sc, mn;
            q4_k_scale_min(b->scales, 2 * u + h, &sc, &mn);
            lut[h] = _mm512_fmadd_ps(_mm512_set1_ps(d * (float)sc), z_iota(),
                                     _mm512_set1_ps(-(dmin * (float)mn)));
        }
        const uint8_t *qs = b->qs + 32 * u;
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)qs));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(qs + 16)));
        out[0] = _mm512_permutexvar_ps(v0, lut[0]);
        out[1] = _mm512_permutexvar_ps(v1, lut[0]);
        out[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), lut[1]);
        out[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), lut[1]);
        return;
    }
    case TD_Q6_K: {
        __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q6_chunk(p, u)), _mm512_set1_epi32(32));
        out[0] = _mm512_mul_ps(_mm512_set1_ps(z->s[u]), _mm512_cvtepi32_ps(q));
        return;
    }
    default: TD_ASSERT(0 && "qf32: not a qf32 weight type");
    }
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

#define Z_MAX_R 4
#define Z_MAX_M 8

/* y[i * ldy + r] = dot(W row r, X row i), r < R, i < M; W row r at w + r * row_bytes. Per
 * unit, one W row at a time: its chunks are dequantized and FMA'd into its M accumulators
 * in chunk order (the lane order of the contract), so at most 4 dequantized chunks are
 * live beside the R * M accumulators. */
TD_INLINE TD_Z void z_tile(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                           const float *x, size_t k, float *y, size_t ldy)
{
    const size_t be = qf32_block_elems(t), bb = qf32_block_bytes(t);
    const int uc = z_unit_chunks(t), units = (int)be / LANES / uc;
    __m512 acc[Z_MAX_R][Z_MAX_M];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            acc[r][i] = _mm512_setzero_ps();
    const size_t nb = k / be, ahead = qf32_prefetch_step(R, row_bytes, nb);
    for (size_t b = 0; b < nb; b++) {
        qf32_prefetch_next(w + 2 * (size_t)R * row_bytes, b, ahead);
        qf32_scales_t zs[Z_MAX_R];
        if (t == TD_Q6_K)
            for (int r = 0; r < R; r++)
                qf32_block_scales(t, w + r * row_bytes + b * bb, &zs[r]);
        for (int u = 0; u < units; u++) {
            const float *xu = x + b * be + (size_t)(LANES * uc * u);
            for (int r = 0; r < R; r++) {
                __m512 wv[4];
                z_deq_unit(t, w + r * row_bytes + b * bb, u, &zs[r], wv);
                for (int c = 0; c < uc; c++)
                    for (int i = 0; i < M; i++)
                        acc[r][i] = _mm512_fmadd_ps(wv[c], _mm512_loadu_ps(xu + LANES * c + i * k),
                                                    acc[r][i]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            y[i * ldy + r] = z_hsum(acc[r][i]);
}
/* W rows [n0, n1) against M X rows: R at a time, the rest one by one. */
TD_INLINE TD_Z void z_rows(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                           size_t n0, size_t n1, const float *x, size_t k, float *y, size_t ldy)
{
    size_t j = n0;
    for (; j + (size_t)R <= n1; j += (size_t)R)
        z_tile(t, R, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy);
    for (; j < n1; j++)
        z_tile(t, 1, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy);
}

/* Tiles of 8 X rows by 2 W rows (16 accumulators) while 8 are left, then up to 4 X rows by
 * 4 W rows: m <= 4 (decode) reads each W block once. */
TD_INLINE TD_Z void z_matmul(td_dtype_t t, const void *w, size_t row_bytes, size_t n0, size_t n1,
                             const float *x, size_t m, size_t k, float *y, size_t ldy)
{
    const uint8_t *wb = w;
    size_t i = 0;
    for (; m - i >= 8; i += 8)
        z_rows(t, 2, 8, wb, row_bytes, n0, n1, x + i * k, k, y + i * ldy, ldy);
    for (; i < m; i += 4) {
        const float *xi = x + i * k;
        float *yi = y + i * ldy;
        switch (m - i) {
        case 1: z_rows(t, 4, 1, wb, row_bytes, n0, n1, xi, k, yi, ldy); break;
        case 2: z_rows(t, 4, 2, wb, row_bytes, n0, n1, xi, k, yi, ldy); break;
        case 3: z_rows(t, 4, 3, wb, row_bytes, n0, n1, xi, k, yi, ldy); break;
        default: z_rows(t, 4, 4, wb, row_bytes, n0, n1, xi, k, yi, ldy); break;
        }
    }
}

#define Z_FN(name, type)                                                                     \
    static TD_Z void name(const void *w, size_t row_bytes, size_t n0, size_t n1,             \
                          const float *x, size_t m, size_t k, float *y, size_t ldy)          \
    {                                                                                        \
        z_matmul(type, w, row_bytes, n0, n1, x, m, k, y, ldy);                               \
    }
Z_FN(q8_0_avx512, TD_Q8_0)
Z_FN(q4_0_avx512, TD_Q4_0)
Z_FN(q4_1_avx512, TD_Q4_1)
Z_FN(q4_k_avx512, TD_Q4_K)
Z_FN(q6_k_avx512, TD_Q6_K)

static const td_cpu_qf32_ops_t ops_avx512 = {
    .name = "avx512",
    .q8_0 = q8_0_avx512,
    .q4_0 = q4_0_avx512,
    .q4_1 = q4_1_avx512,
    .q4_k = q4_k_avx512,
    .q6_k = q6_k_avx512,
};

/* ---- AVX2 --------------------------------------------------------------------------------- */

#define TD_Y __attribute__((target("avx2,fma,f16c")))

/* The 16 lanes in two registers: lanes 0-7 and 8-15. */
typedef struct y16 {
    __m256 lo, hi;
} y16_t;

/* 16 quant bytes as 16 f32 lanes, minus `bias`. */
TD_INLINE TD_Y y16_t y_cvt_u8(__m128i q, int bias)
{
    __m256i b = _mm256_set1_epi32(bias);
    y16_t v = {
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q), b)),
        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), b)),
    };
    return v;
}

/* As z_deq, in two halves. */
TD_INLINE TD_Y y16_t y_deq(td_dtype_t t, const uint8_t *p, int c, const qf32_scales_t *z)
{
    y16_t v;
    switch (t) {
    case TD_Q8_0: {
        const int8_t *qs = ((const td_block_q8_0_t *)(const void *)p)->qs + 16 * c;
        __m256 d = _mm256_set1_ps(z->s[0]);
        v.lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)qs)));
        v.hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(qs + 8))));
        v.lo = _mm256_mul_ps(v.lo, d);
        v.hi = _mm256_mul_ps(v.hi, d);
        return v;
    }
    case TD_Q4_0: {
        __m256 d = _mm256_set1_ps(z->s[0]);
        v = y_cvt_u8(q4_chunk(t, p, c), 8);
        v.lo = _mm256_mul_ps(d, v.lo);
        v.hi = _mm256_mul_ps(d, v.hi);
        return v;
    }
    case TD_Q4_1:
    case TD_Q4_K: {
        int s = t == TD_Q4_K ? c : 0;
        __m256 d = _mm256_set1_ps(z->s[s]), o = _mm256_set1_ps(z->o[s]);
        v = y_cvt_u8(q4_chunk(t, p, c), 0);
        v.lo = _mm256_fmadd_ps(d, v.lo, o);
        v.hi = _mm256_fmadd_ps(d, v.hi, o);
        return v;
    }
    case TD_Q6_K: {
        __m256 d = _mm256_set1_ps(z->s[c]);
        v = y_cvt_u8(q6_chunk(p, c), 32);
        v.lo = _mm256_mul_ps(d, v.lo);
        v.hi = _mm256_mul_ps(d, v.hi);
        return v;
    }
    default: TD_ASSERT(0 && "qf32: not a qf32 weight type");
    }
    v.lo = v.hi = _mm256_setzero_ps();
    return v;
}

TD_INLINE TD_Y float y_hsum(y16_t v)
{
    __m256 s8 = _mm256_add_ps(v.lo, v.hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

#define Y_MAX_R 2
#define Y_MAX_M 4

/* As z_tile, with 16 ymm: R * M <= 4 outputs of two accumulators each. */
TD_INLINE TD_Y void y_tile(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                           const float *x, size_t k, float *y, size_t ldy)
{
    const size_t be = qf32_block_elems(t), bb = qf32_block_bytes(t);
    y16_t acc[Y_MAX_R][Y_MAX_M];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            acc[r][i].lo = acc[r][i].hi = _mm256_setzero_ps();
    const size_t nb = k / be, ahead = qf32_prefetch_step(R, row_bytes, nb);
    for (size_t b = 0; b < nb; b++) {
        qf32_prefetch_next(w + 2 * (size_t)R * row_bytes, b, ahead);
        qf32_scales_t zs[Y_MAX_R];
        for (int r = 0; r < R; r++)
            qf32_block_scales(t, w + r * row_bytes + b * bb, &zs[r]);
        for (int c = 0; c < (int)(be / LANES); c++) {
            y16_t wv[Y_MAX_R];
            for (int r = 0; r < R; r++)
                wv[r] = y_deq(t, w + r * row_bytes + b * bb, c, &zs[r]);
            const float *xc = x + b * be + LANES * (size_t)c;
            for (int i = 0; i < M; i++) {
                __m256 xlo = _mm256_loadu_ps(xc + i * k), xhi = _mm256_loadu_ps(xc + i * k + 8);
                for (int r = 0; r < R; r++) {
                    acc[r][i].lo = _mm256_fmadd_ps(wv[r].lo, xlo, acc[r][i].lo);
                    acc[r][i].hi = _mm256_fmadd_ps(wv[r].hi, xhi, acc[r][i].hi);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            y[i * ldy + r] = y_hsum(acc[r][i]);
}

TD_INLINE TD_Y void y_rows(td_dtype_t t, int R, int M, const uint8_t *w, size_t row_bytes,
                           size_t n0, size_t n1, const float *x, size_t k, float *y, size_t ldy)
{
    size_t j = n0;
    for (; j + (size_t)R <= n1; j += (size_t)R)
        y_tile(t, R, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy);
    for (; j < n1; j++)
        y_tile(t, 1, M, w + j * row_bytes, row_bytes, x, k, y + j, ldy);
}

/* Tiles of 4 X rows by 1 W row; a single X row takes 2 W rows (4 accumulator chains). */
TD_INLINE TD_Y void y_matmul(td_dtype_t t, const void *w, size_t row_bytes, size_t n0, size_t n1,
                             const float *x, size_t m, size_t k, float *y, size_t ldy)
{
    const uint8_t *wb = w;
    for (size_t i = 0; i < m; i += 4) {
        const float *xi = x + i * k;
        float *yi = y + i * ldy;
        switch (m - i) {
        case 1: y_rows(t, 2, 1, wb, row_bytes, n0, n1, xi, k, yi, ldy); break;
        case 2: y_rows(t, 1, 2, wb, row_bytes, n0, n1, xi, k, yi, ldy); break;
        case 3: y_rows(t, 1, 3, wb, row_bytes, n0, n1, xi, k, yi, ldy); break;
        default: y_rows(t, 1, 4, wb, row_bytes, n0, n1, xi, k, yi, ldy); break;
        }
    }
}

#define Y_FN(name, type)                                                                     \
    static TD_Y void name(const void *w, size_t row_bytes, size_t n0, size_t n1,             \
                          const float *x, size_t m, size_t k, float *y, size_t ldy)          \
    {                                                                                        \
        y_matmul(type, w, row_bytes, n0, n1, x, m, k, y, ldy);                               \
    }
Y_FN(q8_0_avx2, TD_Q8_0)
Y_FN(q4_0_avx2, TD_Q4_0)
Y_FN(q4_1_avx2, TD_Q4_1)
Y_FN(q4_k_avx2, TD_Q4_K)
Y_FN(q6_k_avx2, TD_Q6_K)

static const td_cpu_qf32_ops_t ops_avx2 = {
    .name = "avx2",
    .q8_0 = q8_0_avx2,
    .q4_0 = q4_0_avx2,
    .q4_1 = q4_1_avx2,
    .q4_k = q4_k_avx2,
    .q6_k = q6_k_avx2,
};

#endif /* TD_CPU_QF32_X86 */

/* ---- tables ------------------------------------------------------------------------------- */

const td_cpu_qf32_ops_t *td_cpu_qf32_ops(td_cpu_isa_t isa)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
#ifdef TD_CPU_QF32_X86
    if (isa >= TD_CPU_ISA_AVX512)
        return &ops_avx512;
    if (isa >= TD_CPU_ISA_AVX2)
        return &ops_avx2;
#endif
    return &ops_scalar;
}

td_cpu_qf32_fn td_cpu_qf32_fn_of(const td_cpu_qf32_ops_t *ops, td_dtype_t type)
{
    switch (type) {
    case TD_Q8_0: return ops->q8_0;
    case TD_Q4_0: return ops->q4_0;
    case TD_Q4_1: return ops->q4_1;
    case TD_Q4_K: return ops->q4_k;
    case TD_Q6_K: return ops->q6_k;
    default: return NULL;
    }
}

void td_cpu_qf32_matmul(const td_cpu_qf32_ops_t *ops, td_dtype_t type, const void *w,
                        size_t row_bytes, size_t n0, size_t n1, const float *x, size_t m,
                        size_t k, float *y, size_t ldy)
{
    td_cpu_qf32_fn fn = td_cpu_qf32_fn_of(ops, type);
    TD_ASSERT(fn != NULL);
    TD_ASSERT(k % td_dtype_block_elems(type) == 0);
    TD_ASSERT(n0 <= n1 && row_bytes >= td_dtype_bytes(type, k) && row_bytes % 2 == 0);
    TD_ASSERT((uintptr_t)w % 2 == 0);
    fn(w, row_bytes, n0, n1, x, m, k, y, ldy);
}
