/*
 * td_cpu_pack: the packed layout, activation rows for it, and its int8 kernels: scalar (the
 * reference), AVX2 (maddubs) and AVX-512 VNNI (vpdpbusd), bit-identical (the header's sum
 * order). The SIMD tables are compiled with target attributes and chosen at run time.
 *
 * Shapes of the kernels: a call walks its groups one by one; per group the activation rows
 * go in tiles (VNNI: 8 rows, AVX2: 4 rows per half group of 8 weight rows), and for each
 * block the group's weight vectors are loaded and unpacked once, then dotted with every
 * row of the tile. Tiles keep one f32 accumulator vector per activation row for the whole
 * of k, so no partial sums leave registers; at decode (m = 1..4) this is one pass over the
 * group's bytes, which is what bounds batch-1 speed.
 */
#include "td_cpu_pack.h"

#include <math.h>
#include <string.h>

#include "td_cpu_isa.h"
#include "td_quant.h"
#include "td_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "td_cpu_simd.h"
#define TD_CPU_PACK_X86 1
#endif

#define TD_INLINE static inline __attribute__((always_inline))
#define ROWS TD_CPU_PACK_ROWS
#define WIDE 254 /* an activation quant Q = WIDE * hi + lo (td_cpu_pack.h) */
_Static_assert(WIDE == 256 - 2, "vnni_tile multiplies by WIDE with two shifts");

/* bytes of one block's quants and scales in a group */
TD_INLINE size_t quant_bytes(td_dtype_t t)
{
    return t == TD_Q8_0   ? ROWS * TD_QK
           : t == TD_Q6_K ? ROWS * TD_QK * 3 / 4
           : t == TD_Q5_K ? ROWS * TD_QK * 5 / 8
                          : ROWS * TD_QK / 2;
}

TD_INLINE size_t scale_halves(td_dtype_t t) /* f16 values per block (not Q4_K) */
{
    return t == TD_Q4_1 ? 2 * ROWS : ROWS;
}

/* Q4_K's and Q5_K's scales, per super-block of a group (the header's layout): 16 f16 d, 16
 * f16 dmin, then 8 sub-blocks x 16 rows of 6-bit sc, then of mn */
#define K_SCALE_BYTES (4 * ROWS + 16 * ROWS)
#define K_D 0
#define K_DMIN (2 * ROWS)
#define K_SC(s) (4 * ROWS + (s) * ROWS)
#define K_MN(s) (12 * ROWS + (s) * ROWS)

/* Q6_K's scales, per super-block of a group: 16 f16 d, then per block the 16 rows' int8
 * scale of its first 16 weights, then of its last 16 */
#define K6_SCALE_BYTES (2 * ROWS + 8 * 2 * ROWS)
#define K6_SC(b, half) (2 * ROWS + (b) * 2 * ROWS + (half) * ROWS)

/* IQ4_XS's scales, per super-block of a group: 16 f16 d, then per block the 16 rows' int8
 * ls - 32 */
#define XS_SCALE_BYTES (2 * ROWS + 8 * ROWS)
#define XS_SC(b) (2 * ROWS + (b) * ROWS)

/* Q4_K and Q5_K: scales as stored, a block's d * sc and -(dmin * mn) */
TD_INLINE bool k_scales(td_dtype_t t)
{
    return t == TD_Q4_K || t == TD_Q5_K;
}

TD_INLINE size_t scale_bytes(td_dtype_t t) /* per 32-weight block of a group */
{
    return k_scales(t)       ? K_SCALE_BYTES / 8
           : t == TD_Q6_K   ? K6_SCALE_BYTES / 8
           : t == TD_IQ4_XS ? XS_SCALE_BYTES / 8
                            : 2 * scale_halves(t);
}

/* Q4_1, Q4_K, Q5_K: an offset term m * (e sum Q) beside the integer sum (c is f32) */
TD_INLINE bool has_min(td_dtype_t t)
{
    return t == TD_Q4_1 || k_scales(t);
}

bool td_cpu_pack_supports(td_dtype_t type)
{
    return type == TD_Q8_0 || type == TD_Q4_0 || type == TD_Q4_1 || type == TD_Q4_K || type == TD_Q5_K ||
           type == TD_Q6_K || type == TD_IQ4_XS;
}

size_t td_cpu_pack_group_bytes(td_dtype_t type, size_t k)
{
    TD_ASSERT(td_cpu_pack_supports(type) && k % td_dtype_block_elems(type) == 0);
    size_t b = k / TD_QK * (quant_bytes(type) + scale_bytes(type));
    return (b + 63) & ~(size_t)63;
}

size_t td_cpu_pack_bytes(td_dtype_t type, size_t n, size_t k)
{
    return (n + ROWS - 1) / ROWS * td_cpu_pack_group_bytes(type, k);
}

/* Row j's place in a packed matrix: the quants of its group (the block's scales follow at
 * gq + nb * quant_bytes) and its row within the group */
TD_INLINE unsigned char *group_of(void *dst, td_dtype_t t, size_t k, size_t j, size_t *r_p)
{
    *r_p = j % ROWS;
    return (unsigned char *)dst + j / ROWS * td_cpu_pack_group_bytes(t, k);
}

/* A 4-bit block's 16 stored bytes (byte e: weight e low, weight e + 16 high) into row r of
 * its 4 quant vectors (the header's Q4 layout) */
TD_INLINE void place_q4(unsigned char *q, size_t r, const uint8_t qs[TD_QK / 2])
{
    for (int e = 0; e < TD_QK / 2; e++)
        q[64 * (e / 4) + 4 * r + e % 4] = qs[e];
}

/* Q4_K and Q5_K: sub-block s of a super-block becomes a 32-weight block of the Q4 layout of
 * its low 4 bits (byte e: weight e low, weight e + 16 high), and for Q5_K a fifth vector of its
 * fifth bits: byte 4r + i holds those of weights i, 4 + i, 8 + i, 12 + i at bits 0..3 and of
 * weights 16 + i, ... at bits 4..7 (the header's layout); d, dmin and the 6-bit sc, mn kept as
 * stored */
static void pack_k4(void *dst, const void *w, td_dtype_t t, size_t n, size_t k)
{
    size_t nb = k / TD_QK, qb = quant_bytes(t), row_bytes = td_dtype_bytes(t, k);
    for (size_t j = 0; j < n; j++) {
        size_t r;
        unsigned char *gq = group_of(dst, t, k, j, &r), *gs = gq + nb * qb;
        const unsigned char *row = (const unsigned char *)w + j * row_bytes;
        for (size_t sb = 0; sb < k / TD_QK_K; sb++) {
            const td_block_q4_k_t *b4 = t == TD_Q4_K ? (const td_block_q4_k_t *)row + sb : NULL;
            const td_block_q5_k_t *b5 = t == TD_Q5_K ? (const td_block_q5_k_t *)row + sb : NULL;
            unsigned char *ks = gs + sb * K_SCALE_BYTES;
            memcpy(ks + K_D + 2 * r, b4 ? &b4->d : &b5->d, 2);
            memcpy(ks + K_DMIN + 2 * r, b4 ? &b4->dmin : &b5->dmin, 2);
            for (int sub = 0; sub < 8; sub++) {
                uint8_t u[TD_QK], qs[TD_QK / 2];
                int sc, mn;
                if (b5) {
                    td_quant_q5_k_piece(b5, sub, u);
                } else { /* chunk sub / 2: sub-block 2c in the low nibbles, 2c + 1 in the high ones */
                    for (int e = 0; e < TD_QK; e++)
                        u[e] = (uint8_t)((b4->qs[32 * (sub / 2) + e] >> (4 * (sub % 2))) & 15);
                }
                unsigned char *q = gq + (sb * 8 + (size_t)sub) * qb;
                for (int i = 0; i < 16; i++) {
                    qs[i] = (uint8_t)((u[i] & 15) | (u[16 + i] & 15) << 4);
                    if (b5)
                        q[256 + 4 * r + i % 4] |=
                            (unsigned char)((u[i] >> 4) << (i / 4) | (u[16 + i] >> 4) << (4 + i / 4));
                }
                place_q4(q, r, qs);
                td_quant_q4_k_scale_min(b4 ? b4->scales : b5->scales, sub, &sc, &mn);
                ks[K_SC(sub) + r] = (unsigned char)sc;
                ks[K_MN(sub) + r] = (unsigned char)mn;
            }
        }
    }
}

/* IQ4_XS: each 32-weight sub-block's 4-bit indices in the Q4 layout (as stored: byte j holds
 * weights j and j + 16), f16 d and the int8 ls - 32 of each sub-block kept */
static void pack_iq4_xs(void *dst, const void *w, size_t n, size_t k)
{
    size_t nb = k / TD_QK, qb = quant_bytes(TD_IQ4_XS);
    for (size_t j = 0; j < n; j++) {
        size_t r;
        unsigned char *gq = group_of(dst, TD_IQ4_XS, k, j, &r), *gs = gq + nb * qb;
        const td_block_iq4_xs_t *row =
            (const td_block_iq4_xs_t *)((const unsigned char *)w + j * td_dtype_bytes(TD_IQ4_XS, k));
        for (size_t sb = 0; sb < k / TD_QK_K; sb++) {
            const td_block_iq4_xs_t *blk = &row[sb];
            unsigned char *ks = gs + sb * XS_SCALE_BYTES;
            memcpy(ks + 2 * r, &blk->d, 2);
            for (int sub = 0; sub < 8; sub++) {
                place_q4(gq + (sb * 8 + (size_t)sub) * qb, r, blk->qs + 16 * sub);
                ks[XS_SC(sub) + r] = (unsigned char)(int8_t)td_quant_iq4_xs_scale(blk, sub);
            }
        }
    }
}

/* Q6_K: block j of a super-block (32 weights, two 16-weight scales) becomes the Q4 layout of
 * its low 4 bits (4 vectors) and two vectors of its high 2 bits: vector 4 byte 4r + i holds
 * weights i, 4 + i, 8 + i, 12 + i at bits 0-1, 2-3, 4-5, 6-7, vector 5 the same for weights
 * 16 + ... (the header's layout); d and the scales kept as stored */
static void pack_q6_k(void *dst, const void *w, size_t n, size_t k)
{
    size_t nb = k / TD_QK, qb = quant_bytes(TD_Q6_K);
    for (size_t jr = 0; jr < n; jr++) {
        size_t r;
        unsigned char *gq = group_of(dst, TD_Q6_K, k, jr, &r), *gs = gq + nb * qb;
        const td_block_q6_k_t *row = (const td_block_q6_k_t *)((const unsigned char *)w + jr * td_dtype_bytes(TD_Q6_K, k));
        for (size_t sb = 0; sb < k / TD_QK_K; sb++) {
            const td_block_q6_k_t *blk = &row[sb];
            unsigned char *ks = gs + sb * K6_SCALE_BYTES;
            memcpy(ks + 2 * r, &blk->d, 2);
            for (int j = 0; j < 8; j++) {
                uint8_t u[TD_QK], qs[TD_QK / 2];
                td_quant_q6_k_piece(blk, j, u);
                unsigned char *q = gq + (sb * 8 + (size_t)j) * qb;
                for (int i = 0; i < 16; i++) {
                    int v = i / 4, e = i % 4; /* weights i and 16 + i: vector v, byte 4r + e */
                    qs[i] = (uint8_t)((u[i] & 15) | (u[16 + i] & 15) << 4);
                    q[256 + 4 * r + e] |= (unsigned char)((u[i] >> 4) << (2 * v));
                    q[320 + 4 * r + e] |= (unsigned char)((u[16 + i] >> 4) << (2 * v));
                }
                place_q4(q, r, qs);
                ks[K6_SC(j, 0) + r] = (unsigned char)blk->scales[2 * j];
                ks[K6_SC(j, 1) + r] = (unsigned char)blk->scales[2 * j + 1];
            }
        }
    }
}

void td_cpu_pack_weights(void *dst, const void *w, td_dtype_t type, size_t n, size_t k)
{
    size_t nb = k / TD_QK, qb = quant_bytes(type);
    size_t sh = scale_halves(type), row_bytes = td_dtype_bytes(type, k);
    /* zero padding rows: quants 0 and scales +0.0 give outputs nobody stores */
    memset(dst, 0, td_cpu_pack_bytes(type, n, k));
    if (k_scales(type)) {
        pack_k4(dst, w, type, n, k);
        return;
    }
    if (type == TD_Q6_K) {
        pack_q6_k(dst, w, n, k);
        return;
    }
    if (type == TD_IQ4_XS) {
        pack_iq4_xs(dst, w, n, k);
        return;
    }
    for (size_t j = 0; j < n; j++) {
        size_t r;
        unsigned char *gq = group_of(dst, type, k, j, &r), *gs = gq + nb * qb;
        const unsigned char *row = (const unsigned char *)w + j * row_bytes;
        for (size_t b = 0; b < nb; b++) {
            uint16_t d, m = 0;
            unsigned char *q = gq + b * qb;
            if (type == TD_Q8_0) {
                const td_block_q8_0_t *blk = (const td_block_q8_0_t *)row + b;
                d = blk->d;
                for (int e = 0; e < TD_QK; e++)
                    q[64 * (e / 4) + 4 * r + e % 4] = (unsigned char)(blk->qs[e] + 128);
            } else {
                const uint8_t *qs;
                if (type == TD_Q4_0) {
                    const td_block_q4_0_t *blk = (const td_block_q4_0_t *)row + b;
                    d = blk->d;
                    qs = blk->qs;
                } else {
                    const td_block_q4_1_t *blk = (const td_block_q4_1_t *)row + b;
                    d = blk->d;
                    m = blk->m;
                    qs = blk->qs;
                }
                place_q4(q, r, qs);
            }
            /* f16 bits, stored byte-wise (gs is not 2-aligned for every caller's dst) */
            memcpy(gs + 2 * (b * sh + r), &d, 2);
            if (type == TD_Q4_1)
                memcpy(gs + 2 * (b * sh + ROWS + r), &m, 2);
        }
    }
}

size_t td_cpu_pack_act_stride(size_t k)
{
    return (2 * k + 12 * (k / TD_QK) + 63) & ~(size_t)63;
}

/* Where the parts of an activation row of k are (the header's layout) */
TD_INLINE const int8_t *act_hi(const unsigned char *a) { return (const int8_t *)a; }
TD_INLINE const int8_t *act_lo(const unsigned char *a, size_t k) { return (const int8_t *)(a + k); }
TD_INLINE const unsigned char *act_e(const unsigned char *a, size_t k) { return a + 2 * k; }
TD_INLINE const unsigned char *act_c(const unsigned char *a, size_t k) { return a + 2 * k + 4 * (k / TD_QK); }
TD_INLINE const unsigned char *act_c2(const unsigned char *a, size_t k) { return a + 2 * k + 8 * (k / TD_QK); }

/* c (and c2) of a block from its scale e and sums of Q, of the whole block and of its first
 * 16 values (the header's definitions; c2 only Q6_K's, 0 for the others) */
TD_INLINE void act_store_c(unsigned char *c, unsigned char *c2, td_dtype_t type, float e, int32_t sum_q,
                           int32_t sum_first)
{
    float s = e * (float)sum_q;
    int32_t ci = (type == TD_Q4_0 ? -8 : -128) * sum_q, c2i = 0; /* Q8_0, IQ4_XS: -128 */
    if (type == TD_Q6_K) {
        ci = -32 * sum_first;
        c2i = -32 * (sum_q - sum_first);
    }
    memcpy(c, has_min(type) ? (const void *)&s : (const void *)&ci, 4);
    memcpy(c2, &c2i, 4);
}

/* The scalar quantizer of one block (the reference the SIMD one equals bit for bit):
 * d = amax / 127 (amax ignores NaN), v = x * (1 / d) clamped to [-127, 127] (NaN to -127),
 * hi = roundf(v), lo = roundf((v - hi) * 254) (v - hi is exact). Returns sum Q, and the sum
 * of the first 16 in *first_p. */
static int32_t act_block_scalar(const float *x, int8_t *hi, int8_t *lo, float *e_p, int32_t *first_p)
{
    float amax = 0.0f;
    bool nan = false;
    for (int i = 0; i < TD_QK; i++) {
        amax = fmaxf(amax, fabsf(x[i]));
        nan |= x[i] != x[i];
    }
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < TD_QK; i++) {
        float v = x[i] * id;
        v = v >= -127.0f ? v : -127.0f;
        v = v <= 127.0f ? v : 127.0f;
        float h = roundf(v);
        float l = roundf((v - h) * (float)WIDE);
        hi[i] = (int8_t)h;
        lo[i] = (int8_t)l;
        sum += WIDE * (int32_t)h + (int32_t)l;
        if (i == TD_QK / 2 - 1)
            *first_p = sum;
    }
    *e_p = nan ? NAN : d / (float)WIDE;
    return sum;
}

/* One block's quantizer: hi and lo of the 32 floats at x, *e_p its scale; returns sum Q and
 * the sum of the first 16 Q in *first_p. */
typedef int32_t (*act_block_fn)(const float *x, int8_t *hi, int8_t *lo, float *e_p, int32_t *first_p);

/* The activation row of the header's layout, block by block (every table's loop: `block`
 * is a constant, inlined into each table's row function) */
TD_INLINE void act_row_blocks(act_block_fn block, const float *x, void *av, td_dtype_t type, size_t k,
                              bool one_byte)
{
    unsigned char *a = av;
    for (size_t b = 0; b < k / TD_QK; b++) {
        float e;
        int8_t *hi = (int8_t *)a + b * TD_QK, *lo = (int8_t *)a + k + b * TD_QK;
        int32_t first = 0, sum = block(x + b * TD_QK, hi, lo, &e, &first);
        if (one_byte) { /* the second byte dropped: Q = 254 hi, llama.cpp's one-byte rounding */
            memset(lo, 0, TD_QK);
            sum = first = 0;
            for (int i = 0; i < TD_QK; i++) {
                sum += WIDE * hi[i];
                if (i == TD_QK / 2 - 1)
                    first = sum;
            }
        }
        memcpy(a + 2 * k + 4 * b, &e, 4);
        act_store_c((unsigned char *)act_c(a, k) + 4 * b, (unsigned char *)act_c2(a, k) + 4 * b, type, e, sum, first);
    }
}

static void act_row_scalar(const float *x, void *av, td_dtype_t type, size_t k, bool one_byte)
{
    act_row_blocks(act_block_scalar, x, av, type, k, one_byte);
}

#ifdef TD_CPU_PACK_X86
#define TD_Z __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

/* roundf on 16 lanes: trunc, then one step away from zero when the exact remainder is >= 1/2 */
TD_INLINE TD_Z __m512 round_half_away(__m512 v)
{
    __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512 one = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_set1_ps(1.0f)),
                                                     _mm512_and_si512(_mm512_castps_si512(v),
                                                                      _mm512_set1_epi32(INT32_MIN))));
    return _mm512_mask_add_ps(t, up, t, one);
}

/* act_block_scalar on AVX-512, bit for bit (max_ps returns its second operand for a NaN
 * lane, so NaN is ignored in amax and clamped to -127 as the scalar code does) */
static TD_Z int32_t act_block_avx512(const float *x, int8_t *hi, int8_t *lo, float *e_p, int32_t *first_p)
{
    __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    __m512 amax = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps());
    amax = _mm512_max_ps(_mm512_abs_ps(x1), amax);
    bool nan = (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0;
    float d = _mm512_reduce_max_ps(amax) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    for (int half = 0; half < 2; half++) {
        __m512 v = _mm512_mul_ps(half ? x1 : x0, _mm512_set1_ps(id));
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        __m512 h = round_half_away(v);
        __m512 l = round_half_away(_mm512_mul_ps(_mm512_sub_ps(v, h), _mm512_set1_ps((float)WIDE)));
        __m512i qh = _mm512_cvtps_epi32(h), ql = _mm512_cvtps_epi32(l);
        sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_mullo_epi32(qh, _mm512_set1_epi32(WIDE)), ql));
        if (half == 0)
            *first_p = _mm512_reduce_add_epi32(sum);
        _mm_storeu_si128((__m128i *)(hi + 16 * half), _mm512_cvtepi32_epi8(qh));
        _mm_storeu_si128((__m128i *)(lo + 16 * half), _mm512_cvtepi32_epi8(ql));
    }
    *e_p = nan ? NAN : d / (float)WIDE;
    return _mm512_reduce_add_epi32(sum);
}

static TD_Z void act_row_avx512(const float *x, void *av, td_dtype_t type, size_t k, bool one_byte)
{
    act_row_blocks(act_block_avx512, x, av, type, k, one_byte);
}

#define TD_Y __attribute__((target("avx2,fma,f16c")))

/* Decode tiles (m <= 4) stream the weights: each block asks for the lines this far ahead
 * into L2 (T1), never past the end of the call's groups (a thread's share: what lies beyond
 * is another thread's). L1 prefetches (T0) hold a line-fill buffer for a whole DRAM round
 * trip, and a core has few: on Zen 4 (1 thread, a 151 MB Q4_0 matrix, m = 1) T0 at 2 KiB
 * read 12 GB/s, T1 at 8 KiB 16, at 32 KiB 19.7 (2 threads: 18-24 -> 33 GB/s). */
#define DECODE_PREFETCH_BYTES 32768

TD_INLINE void decode_prefetch(const unsigned char *q, size_t bytes, const unsigned char *end)
{
    uintptr_t p = (uintptr_t)q + DECODE_PREFETCH_BYTES;
    for (size_t off = 0; off < bytes; off += 64)
        if (p + off < (uintptr_t)end)
            _mm_prefetch((const char *)(p + off), _MM_HINT_T1);
}

/* act_block_scalar on AVX2, bit for bit (td_cpu_simd's pieces are the scalar C's operations) */
static TD_Y int32_t act_block_avx2(const float *x, int8_t *hi, int8_t *lo, float *e_p, int32_t *first_p)
{
    __m256 xv[4];
    bool nan;
    float d = td_cpu_simd_amax32(x, xv, &nan) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i qh[4], ql[4], sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        __m256 v = td_cpu_simd_clamp127(_mm256_mul_ps(xv[j], _mm256_set1_ps(id)));
        __m256 h = td_cpu_simd_round_away(v);
        __m256 l = td_cpu_simd_round_away(_mm256_mul_ps(_mm256_sub_ps(v, h), _mm256_set1_ps((float)WIDE)));
        qh[j] = _mm256_cvtps_epi32(h);
        ql[j] = _mm256_cvtps_epi32(l);
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_mullo_epi32(qh[j], _mm256_set1_epi32(WIDE)), ql[j]));
        if (j == 1)
            *first_p = td_cpu_simd_hsum_i32(sum);
    }
    _mm256_storeu_si256((__m256i *)hi, td_cpu_simd_pack_i8(qh));
    _mm256_storeu_si256((__m256i *)lo, td_cpu_simd_pack_i8(ql));
    *e_p = nan ? NAN : d / (float)WIDE;
    return td_cpu_simd_hsum_i32(sum);
}

static TD_Y void act_row_avx2(const float *x, void *av, td_dtype_t type, size_t k, bool one_byte)
{
    act_row_blocks(act_block_avx2, x, av, type, k, one_byte);
}
#endif

void td_cpu_pack_act_row(const td_cpu_pack_ops_t *ops, const float *x, void *a, td_dtype_t type, size_t k,
                         bool one_byte)
{
    TD_ASSERT(k % TD_QK == 0 && td_cpu_pack_supports(type));
    ops->act_row(x, a, type, k, one_byte);
}

/* ---- scalar reference ------------------------------------------------------------------ */

/* u of (row r, weight e) in a block's quants */
TD_INLINE int unsigned_quant(td_dtype_t t, const unsigned char *q, size_t r, int e)
{
    if (t == TD_Q8_0)
        return q[64 * (e / 4) + 4 * r + e % 4];
    if (t == TD_Q6_K) {
        int i = e % 16, lo = q[64 * (i / 4) + 4 * r + i % 4] >> (e < 16 ? 0 : 4) & 15;
        int hi = q[(e < 16 ? 256 : 320) + 4 * r + i % 4] >> (2 * (i / 4)) & 3;
        return lo | hi << 4;
    }
    unsigned char byte = q[64 * ((e % 16) / 4) + 4 * r + e % 4];
    int nibble = e < 16 ? byte & 15 : byte >> 4;
    if (t == TD_Q5_K)
        return nibble | (q[256 + 4 * r + e % 4] >> ((e % 16) / 4 + (e < 16 ? 0 : 4)) & 1) << 4;
    if (t == TD_IQ4_XS)
        return td_quant_iq4nl_values[nibble] + 128;
    return nibble;
}

TD_INLINE float half_at(const unsigned char *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return td_f16_to_f32(h);
}

/* A block's weight scale d_w and offset m of row r (Q4_K, Q5_K: d * sc and -(dmin * mn),
 * IQ4_XS: d * (ls - 32), exact in f32; Q4_0, Q8_0, IQ4_XS: m unused) */
TD_INLINE void row_scales(td_dtype_t t, const unsigned char *gs, size_t b, size_t r, float *d_p, float *m_p)
{
    if (t == TD_IQ4_XS) {
        const unsigned char *ks = gs + b / 8 * XS_SCALE_BYTES;
        *d_p = half_at(ks + 2 * r) * (float)(int8_t)ks[XS_SC(b % 8) + r];
        *m_p = 0.0f;
        return;
    }
    if (k_scales(t)) {
        const unsigned char *ks = gs + b / 8 * K_SCALE_BYTES;
        size_t sub = b % 8;
        *d_p = half_at(ks + K_D + 2 * r) * (float)ks[K_SC(sub) + r];
        *m_p = -(half_at(ks + K_DMIN + 2 * r) * (float)ks[K_MN(sub) + r]);
        return;
    }
    size_t sh = scale_halves(t);
    *d_p = half_at(gs + 2 * (b * sh + r));
    *m_p = t == TD_Q4_1 ? half_at(gs + 2 * (b * sh + ROWS + r)) : 0.0f;
}

/* Q6_K's block: two exact integer halves, each with its own scale (the header's contract) */
TD_INLINE float q6_k_block_scalar(const unsigned char *gq, const unsigned char *gs, size_t b, size_t r,
                                  const int8_t *hi, const int8_t *lo, float ea, int32_t c, int32_t c2, float acc)
{
    const unsigned char *ks = gs + b / 8 * K6_SCALE_BYTES;
    float d = half_at(ks + 2 * r);
    int32_t p[2] = {c, c2};
    for (int e = 0; e < TD_QK; e++)
        p[e / 16] += unsigned_quant(TD_Q6_K, gq + b * quant_bytes(TD_Q6_K), r, e) *
                     (WIDE * hi[b * TD_QK + e] + lo[b * TD_QK + e]);
    for (int h = 0; h < 2; h++)
        acc = fmaf((float)p[h], d * (float)(int8_t)ks[K6_SC(b % 8, h) + r] * ea, acc);
    return acc;
}

TD_INLINE void kernel_scalar(td_dtype_t t, const void *wp, size_t g0, size_t g1, size_t k,
                             const void *av, size_t m, float *y, size_t ldy)
{
    size_t nb = k / TD_QK, gb = td_cpu_pack_group_bytes(t, k), qb = quant_bytes(t);
    size_t stride = td_cpu_pack_act_stride(k);
    for (size_t g = g0; g < g1; g++) {
        const unsigned char *gq = (const unsigned char *)wp + g * gb, *gs = gq + nb * qb;
        for (size_t i = 0; i < m; i++) {
            const unsigned char *a = (const unsigned char *)av + i * stride;
            const int8_t *hi = act_hi(a), *lo = act_lo(a, k);
            const unsigned char *ev = act_e(a, k), *c = act_c(a, k);
            for (size_t r = 0; r < ROWS; r++) {
                float acc = 0.0f, macc = 0.0f;
                for (size_t b = 0; b < nb; b++) {
                    if (t == TD_Q6_K) {
                        float ea;
                        int32_t cb, c2;
                        memcpy(&ea, ev + 4 * b, 4);
                        memcpy(&cb, c + 4 * b, 4);
                        memcpy(&c2, act_c2(a, k) + 4 * b, 4);
                        acc = q6_k_block_scalar(gq, gs, b, r, hi, lo, ea, cb, c2, acc);
                        continue;
                    }
                    int32_t p = 0;
                    if (!has_min(t))
                        memcpy(&p, c + 4 * b, 4);
                    for (int e = 0; e < TD_QK; e++)
                        p += unsigned_quant(t, gq + b * qb, r, e) * (WIDE * hi[b * TD_QK + e] + lo[b * TD_QK + e]);
                    float ea, dw, mw;
                    memcpy(&ea, ev + 4 * b, 4);
                    row_scales(t, gs, b, r, &dw, &mw);
                    acc = fmaf((float)p, dw * ea, acc);
                    if (has_min(t)) {
                        float cf;
                        memcpy(&cf, c + 4 * b, 4);
                        macc = fmaf(mw, cf, macc);
                    }
                }
                y[i * ldy + (g - g0) * ROWS + r] = has_min(t) ? acc + macc : acc;
            }
        }
    }
}

/* One type's entry of an ops table: the kernel with the type and the activation bytes fixed
 * (attr: its target); a table's seven entries of one mode, and the table's fns of it. */
#define PACK_FN(name, attr, kernel, type, one)                                               \
    static attr void name(const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k,       \
                          const void *a, size_t m, float *y, size_t ldy)                     \
    {                                                                                        \
        kernel(type, one, wp, g0, g1, g_pf, k, a, m, y, ldy);                                \
    }
#define PACK_FNS(sfx, attr, kernel, one)                   \
    PACK_FN(q8_0_##sfx, attr, kernel, TD_Q8_0, one)        \
    PACK_FN(q4_0_##sfx, attr, kernel, TD_Q4_0, one)        \
    PACK_FN(q4_1_##sfx, attr, kernel, TD_Q4_1, one)        \
    PACK_FN(q4_k_##sfx, attr, kernel, TD_Q4_K, one)        \
    PACK_FN(q5_k_##sfx, attr, kernel, TD_Q5_K, one)        \
    PACK_FN(q6_k_##sfx, attr, kernel, TD_Q6_K, one)        \
    PACK_FN(iq4_xs_##sfx, attr, kernel, TD_IQ4_XS, one)
#define PACK_TABLE(sfx)                                                                        \
    {.q8_0 = q8_0_##sfx, .q4_0 = q4_0_##sfx, .q4_1 = q4_1_##sfx, .q4_k = q4_k_##sfx,          \
     .q5_k = q5_k_##sfx, .q6_k = q6_k_##sfx, .iq4_xs = iq4_xs_##sfx}

/* the scalar kernel reads lo as it is: a one-byte row's zeros add nothing, so one set serves
 * both modes */
TD_INLINE void kernel_scalar_any(td_dtype_t t, bool one_byte, const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k,
                                 const void *av, size_t m, float *y, size_t ldy)
{
    (void)one_byte, (void)g_pf;
    kernel_scalar(t, wp, g0, g1, k, av, m, y, ldy);
}
PACK_FNS(scalar, , kernel_scalar_any, false)

static const td_cpu_pack_ops_t ops_scalar = {
    .name = "scalar", .act_row = act_row_scalar, .two_byte = PACK_TABLE(scalar), .one_byte = PACK_TABLE(scalar)};

#ifdef TD_CPU_PACK_X86

TD_INLINE int32_t load_i32(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

TD_INLINE float load_f32(const void *p)
{
    float v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- AVX-512 VNNI ------------------------------------------------------------------------ */

#define TD_V __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* One group (quants gq, scales gs) against R activation rows (at a, `stride` apart): the
 * 16 outputs of row i go to y + i * ldy. */
TD_INLINE TD_V void vnni_tile(td_dtype_t t, bool one, int R, const unsigned char *gq, const unsigned char *gs,
                              size_t nb, size_t k, const unsigned char *a, size_t stride, float *y,
                              size_t ldy, const unsigned char *pf_end)
{
    const size_t qb = quant_bytes(t);
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    /* IQ4_XS: u = value + 128 of each index, in every 128-bit lane for vpshufb */
    const __m512i iq4u = _mm512_broadcast_i32x4(_mm_add_epi8(
        _mm_loadu_si128((const __m128i *)td_quant_iq4nl_values), _mm_set1_epi8((char)0x80)));
    __m512 acc[8], macc[8];
    for (int i = 0; i < R; i++)
        acc[i] = macc[i] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        const unsigned char *q = gq + b * qb;
        __m512i w[8];
        if (R <= 4)
            decode_prefetch(q, qb, pf_end);
        if (t == TD_Q8_0) {
            for (int v = 0; v < 8; v++)
                w[v] = _mm512_loadu_si512(q + 64 * v);
        } else {
            for (int v = 0; v < 4; v++) {
                __m512i raw = _mm512_loadu_si512(q + 64 * v);
                w[v] = _mm512_and_si512(raw, low4);
                w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
            if (t == TD_Q5_K) { /* the fifth bits: weight 4v + j's at bit v, 16 + 4v + j's at 4 + v */
                const __m512i hb = _mm512_loadu_si512(q + 256);
                w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(hb, 4), bit4));
                w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(hb, 3), bit4));
                w[2] = _mm512_or_si512(w[2], _mm512_and_si512(_mm512_slli_epi16(hb, 2), bit4));
                w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_slli_epi16(hb, 1), bit4));
                w[4] = _mm512_or_si512(w[4], _mm512_and_si512(hb, bit4));
                w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_srli_epi16(hb, 1), bit4));
                w[6] = _mm512_or_si512(w[6], _mm512_and_si512(_mm512_srli_epi16(hb, 2), bit4));
                w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(hb, 3), bit4));
            }
            if (t == TD_IQ4_XS)
                for (int v = 0; v < 8; v++)
                    w[v] = _mm512_shuffle_epi8(iq4u, w[v]);
        }
        __m512 dw, mw = _mm512_setzero_ps();
        if (t == TD_IQ4_XS) { /* d * (ls - 32): exact */
            const unsigned char *ks = gs + b / 8 * XS_SCALE_BYTES;
            dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ks)),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ks + XS_SC(b % 8))))));
        } else if (k_scales(t)) { /* d * sc and -(dmin * mn): the scalar kernel's exact products */
            const unsigned char *ks = gs + b / 8 * K_SCALE_BYTES;
            __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ks + K_SC(b % 8)))));
            __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ks + K_MN(b % 8)))));
            dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + K_D))), sc);
            mw = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + K_DMIN))), mn)),
                _mm512_set1_epi32(INT32_MIN)));
        } else {
            const unsigned char *s = gs + 2 * b * scale_halves(t);
            dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
            if (t == TD_Q4_1)
                mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 2 * ROWS)));
        }
        /* unrolled, so that acc[] and macc[] stay in registers: as a loop GCC keeps them in
         * memory, a store and a reload per row and block (1B Q4_0 prefill tile 67 -> 80
         * GFLOP/s on one core) */
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const unsigned char *ai = a + i * stride, *c = act_c(ai, k) + 4 * b;
            const int8_t *hi = act_hi(ai) + b * TD_QK, *lo = act_lo(ai, k) + b * TD_QK;
            /* two chains, hi and lo, joined exactly: WIDE * p_hi + p_lo (one byte: lo is 0, skipped) */
            __m512i ph = _mm512_setzero_si512();
            __m512i pl = has_min(t) ? _mm512_setzero_si512() : _mm512_set1_epi32(load_i32(c));
            if (one && R <= 2) { /* four chains of two over hi alone, for the latency */
                __m512i ph2 = _mm512_setzero_si512(), ph3 = _mm512_setzero_si512(), ph4 = _mm512_setzero_si512();
                for (int v = 0; v < 8; v += 4) {
                    ph = _mm512_dpbusd_epi32(ph, w[v], _mm512_set1_epi32(load_i32(hi + 4 * v)));
                    ph2 = _mm512_dpbusd_epi32(ph2, w[v + 1], _mm512_set1_epi32(load_i32(hi + 4 * v + 4)));
                    ph3 = _mm512_dpbusd_epi32(ph3, w[v + 2], _mm512_set1_epi32(load_i32(hi + 4 * v + 8)));
                    ph4 = _mm512_dpbusd_epi32(ph4, w[v + 3], _mm512_set1_epi32(load_i32(hi + 4 * v + 12)));
                }
                ph = _mm512_add_epi32(_mm512_add_epi32(ph, ph2), _mm512_add_epi32(ph3, ph4));
            } else if (one) {
                for (int v = 0; v < 8; v++)
                    ph = _mm512_dpbusd_epi32(ph, w[v], _mm512_set1_epi32(load_i32(hi + 4 * v)));
            } else if (R <= 2) {
                /* few rows: four chains of four, not two of eight, so that the dot products'
                 * latency does not bound the block (integer sums: the same result) */
                __m512i ph2 = _mm512_setzero_si512(), pl2 = _mm512_setzero_si512();
                for (int v = 0; v < 8; v += 2) {
                    ph = _mm512_dpbusd_epi32(ph, w[v], _mm512_set1_epi32(load_i32(hi + 4 * v)));
                    pl = _mm512_dpbusd_epi32(pl, w[v], _mm512_set1_epi32(load_i32(lo + 4 * v)));
                    ph2 = _mm512_dpbusd_epi32(ph2, w[v + 1], _mm512_set1_epi32(load_i32(hi + 4 * v + 4)));
                    pl2 = _mm512_dpbusd_epi32(pl2, w[v + 1], _mm512_set1_epi32(load_i32(lo + 4 * v + 4)));
                }
                ph = _mm512_add_epi32(ph, ph2);
                pl = _mm512_add_epi32(pl, pl2);
            } else {
                for (int v = 0; v < 8; v++) {
                    ph = _mm512_dpbusd_epi32(ph, w[v], _mm512_set1_epi32(load_i32(hi + 4 * v)));
                    pl = _mm512_dpbusd_epi32(pl, w[v], _mm512_set1_epi32(load_i32(lo + 4 * v)));
                }
            }
            /* WIDE * ph + pl, the multiply as shifts (WIDE = 254 = 256 - 2) */
            __m512i p0 = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(ph, 8), _mm512_slli_epi32(ph, 1)), pl);
            __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(load_f32(act_e(ai, k) + 4 * b)));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), sc, acc[i]);
            if (has_min(t))
                macc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(load_f32(c)), macc[i]);
        }
    }
    for (int i = 0; i < R; i++)
        _mm512_storeu_ps(y + i * ldy, has_min(t) ? _mm512_add_ps(acc[i], macc[i]) : acc[i]);
}

/* Q6_K's 2-bit planes: the high bits of the weights of nibble vector v, at bits 4-5 */
#define Q6_HI_ZMM(hb, v) ((v) == 3 ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 4 - 2 * (v)))

/* One Q6_K group against R activation rows: the 8 weight vectors of a block made once (u =
 * low nibble | high bits << 4, 0..63), then per row the two halves' exact integers (c + sum u
 * Q: c = -32 sum Q of the half) and their two FMAs, half 0 first */
TD_INLINE TD_V void vnni_tile_q6_k(bool one, int R, const unsigned char *gq, const unsigned char *gs, size_t nb, size_t k,
                                   const unsigned char *a, size_t stride, float *y, size_t ldy,
                                   const unsigned char *pf_end)
{
    const size_t qb = quant_bytes(TD_Q6_K);
    const __m512i low4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    __m512 acc[8];
    for (int i = 0; i < R; i++)
        acc[i] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        const unsigned char *q = gq + b * qb;
        if (R <= 4)
            decode_prefetch(q, qb, pf_end);
        __m512i w[8];
        const __m512i hb0 = _mm512_loadu_si512(q + 256), hb1 = _mm512_loadu_si512(q + 320);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            __m512i raw = _mm512_loadu_si512(q + 64 * v);
            w[v] = _mm512_or_si512(_mm512_and_si512(raw, low4), _mm512_and_si512(Q6_HI_ZMM(hb0, v), hi2));
            w[v + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4),
                                       _mm512_and_si512(Q6_HI_ZMM(hb1, v), hi2));
        }
        const unsigned char *ks = gs + b / 8 * K6_SCALE_BYTES;
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ks));
        __m512 dw[2];
        for (int h = 0; h < 2; h++)
            dw[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                         _mm_loadu_si128((const __m128i *)(ks + K6_SC(b % 8, h))))));
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            const unsigned char *ai = a + i * stride;
            const int8_t *hi = act_hi(ai) + b * TD_QK, *lo = act_lo(ai, k) + b * TD_QK;
            __m512 e = _mm512_set1_ps(load_f32(act_e(ai, k) + 4 * b));
            for (int h = 0; h < 2; h++) {
                __m512i ph = _mm512_setzero_si512();
                __m512i pl = _mm512_set1_epi32(load_i32((h ? act_c2(ai, k) : act_c(ai, k)) + 4 * b));
                for (int v = 0; v < 4; v++) {
                    ph = _mm512_dpbusd_epi32(ph, w[4 * h + v], _mm512_set1_epi32(load_i32(hi + 16 * h + 4 * v)));
                    if (!one)
                        pl = _mm512_dpbusd_epi32(pl, w[4 * h + v], _mm512_set1_epi32(load_i32(lo + 16 * h + 4 * v)));
                }
                __m512i p = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(ph, 8), _mm512_slli_epi32(ph, 1)), pl);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw[h], e), acc[i]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        _mm512_storeu_ps(y + i * ldy, acc[i]);
}

TD_INLINE TD_V void kernel_vnni(td_dtype_t t, bool one, const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k,
                                const void *av, size_t m, float *y, size_t ldy)
{
    size_t nb = k / TD_QK, gb = td_cpu_pack_group_bytes(t, k), stride = td_cpu_pack_act_stride(k);
    const unsigned char *a = av, *end = (const unsigned char *)wp + g_pf * gb;
    for (size_t g = g0; g < g1; g++) {
        const unsigned char *gq = (const unsigned char *)wp + g * gb, *gs = gq + nb * quant_bytes(t);
        float *yg = y + (g - g0) * ROWS;
#define VNNI_TILE(R, ai, yi)                                                                    \
    (t == TD_Q6_K ? vnni_tile_q6_k(one, R, gq, gs, nb, k, ai, stride, yi, ldy, end)             \
                  : vnni_tile(t, one, R, gq, gs, nb, k, ai, stride, yi, ldy, end))
        size_t i = 0;
        for (; i + 8 <= m; i += 8)
            VNNI_TILE(8, a + i * stride, yg + i * ldy);
        const unsigned char *ai = a + i * stride;
        float *yi = yg + i * ldy;
        switch (m - i) {
        case 1: VNNI_TILE(1, ai, yi); break;
        case 2: VNNI_TILE(2, ai, yi); break;
        case 3: VNNI_TILE(3, ai, yi); break;
        case 4: VNNI_TILE(4, ai, yi); break;
        case 5: VNNI_TILE(5, ai, yi); break;
        case 6: VNNI_TILE(6, ai, yi); break;
        case 7: VNNI_TILE(7, ai, yi); break;
        default: break;
        }
#undef VNNI_TILE
    }
}

PACK_FNS(vnni2, TD_V, kernel_vnni, false)
PACK_FNS(vnni1, TD_V, kernel_vnni, true)

static const td_cpu_pack_ops_t ops_vnni = {
    .name = "avx512vnni", .act_row = act_row_avx512, .two_byte = PACK_TABLE(vnni2), .one_byte = PACK_TABLE(vnni1)};

/* ---- AVX2 -------------------------------------------------------------------------------- */

/* The weight scales d_w and offsets m (0 where the type has none) of block b, rows 8h..8h+7 */
TD_INLINE TD_Y void avx2_scales(td_dtype_t t, const unsigned char *gs, size_t b, int h, __m256 *dw_p, __m256 *mw_p)
{
    __m256 dw, mw = _mm256_setzero_ps();
    if (t == TD_IQ4_XS) { /* d * (ls - 32): exact */
        const unsigned char *ks = gs + b / 8 * XS_SCALE_BYTES;
        dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + 16 * h))),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(ks + XS_SC(b % 8) + 8 * h)))));
    } else if (k_scales(t)) { /* d * sc and -(dmin * mn): the scalar kernel's exact products */
        const unsigned char *ks = gs + b / 8 * K_SCALE_BYTES;
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ks + K_SC(b % 8) + 8 * h))));
        __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ks + K_MN(b % 8) + 8 * h))));
        dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + K_D + 16 * h))), sc);
        mw = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + K_DMIN + 16 * h))), mn),
                           _mm256_set1_ps(-0.0f));
    } else {
        const unsigned char *s = gs + 2 * b * scale_halves(t) + 16 * h;
        dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
        if (t == TD_Q4_1)
            mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * ROWS)));
    }
    *dw_p = dw;
    *mw_p = mw;
}

/* Whether avx2_row1 takes type t: unsigned quants u <= 31 (not Q8_0, IQ4_XS: signed through
 * the sign trick; not Q6_K: its own layout) */
TD_INLINE bool avx2_row1_takes(td_dtype_t t)
{
    return t == TD_Q4_0 || t == TD_Q4_1 || t == TD_Q4_K || t == TD_Q5_K;
}

/* Decode's one activation row against a whole group (both halves), for avx2_row1_takes types.
 * avx2_tile's sums in another order, so the same integers: the four broadcasts of a v serve
 * both halves, and maddubs' int16 pair sums build up over several v before one madd widens
 * them (u <= 15: 8 pairs of at most 2 * 15 * 127 stay under 2^15 over a block's 4 v; Q5_K's
 * u <= 31: over 2 v). Fewer widening multiplies and live registers than the general tile,
 * which on 16 ymm registers spills its accumulators. */
TD_INLINE TD_Y void avx2_row1(td_dtype_t t, bool one, const unsigned char *gq, const unsigned char *gs, size_t nb,
                              size_t k, const unsigned char *a, float *y, const unsigned char *pf_end)
{
    const size_t qb = quant_bytes(t);
    const int flush = t == TD_Q5_K ? 2 : 4; /* v's summed in int16 before widening */
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const int8_t *hi = act_hi(a), *lo = act_lo(a, k);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, macc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (size_t b = 0; b < nb; b++) {
        decode_prefetch(gq + b * qb, qb, pf_end);
        const unsigned char *q = gq + b * qb;
        const int8_t *qh = hi + b * TD_QK, *ql = lo + b * TD_QK;
        __m256i p[2], sh[2], sl[2];
        p[0] = p[1] = t == TD_Q4_0 ? _mm256_set1_epi32(load_i32(act_c(a, k) + 4 * b)) : _mm256_setzero_si256();
        sh[0] = sh[1] = sl[0] = sl[1] = _mm256_setzero_si256();
#pragma GCC unroll 1 /* unrolled, GCC hoists the four v's loads and spills (1 core, in L2: q4_0 -20% time) */
        for (int v = 0; v < 4; v++) {
            const __m256i ah = _mm256_set1_epi32(load_i32(qh + 4 * v)), ah2 = _mm256_set1_epi32(load_i32(qh + 16 + 4 * v));
            const __m256i al = _mm256_set1_epi32(load_i32(ql + 4 * v)), al2 = _mm256_set1_epi32(load_i32(ql + 16 + 4 * v));
#pragma GCC unroll 2
            for (int x = 0; x < 2; x++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v + 32 * x));
                __m256i lo4 = _mm256_and_si256(raw, low4);
                __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                if (t == TD_Q5_K) { /* the fifth bits: weight 4v + j's at bit v, 16 + 4v + j's at 4 + v */
                    const __m256i hb = _mm256_loadu_si256((const __m256i *)(q + 256 + 32 * x));
                    lo4 = _mm256_or_si256(lo4, _mm256_and_si256(_mm256_slli_epi16(hb, 4 - v), bit4));
                    hi4 = _mm256_or_si256(hi4, _mm256_and_si256(_mm256_srli_epi16(hb, v), bit4));
                }
                sh[x] = _mm256_add_epi16(sh[x], _mm256_add_epi16(_mm256_maddubs_epi16(lo4, ah), _mm256_maddubs_epi16(hi4, ah2)));
                if (!one)
                    sl[x] = _mm256_add_epi16(sl[x], _mm256_add_epi16(_mm256_maddubs_epi16(lo4, al), _mm256_maddubs_epi16(hi4, al2)));
                if ((v + 1) % flush == 0) { /* widen: hi by 254, lo by 1 */
                    p[x] = _mm256_add_epi32(p[x], _mm256_madd_epi16(sh[x], _mm256_set1_epi16(WIDE)));
                    if (!one)
                        p[x] = _mm256_add_epi32(p[x], _mm256_madd_epi16(sl[x], _mm256_set1_epi16(1)));
                    sh[x] = sl[x] = _mm256_setzero_si256();
                }
            }
        }
        const __m256 e = _mm256_set1_ps(load_f32(act_e(a, k) + 4 * b));
#pragma GCC unroll 2
        for (int x = 0; x < 2; x++) {
            __m256 dw, mw;
            avx2_scales(t, gs, b, x, &dw, &mw);
            acc[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[x]), _mm256_mul_ps(dw, e), acc[x]);
            if (has_min(t))
                macc[x] = _mm256_fmadd_ps(mw, _mm256_set1_ps(load_f32(act_c(a, k) + 4 * b)), macc[x]);
        }
    }
    for (int x = 0; x < 2; x++)
        _mm256_storeu_ps(y + 8 * x, has_min(t) ? _mm256_add_ps(acc[x], macc[x]) : acc[x]);
}

/* Halves [h0, h0 + H) (weight rows 8h..8h+7) of one group against R activation rows,
 * R * H <= 4: up to four rows by one half (prefill), or one row by both halves in one pass
 * (decode: every byte of a quant line used as it arrives). The int32 lanes of maddubs +
 * madd are the same four-product sums vpdpbusd makes; the hi part's int16 pair sums are
 * widened by a madd with 254 instead of 1, so each block's exact integer p = 254 p_hi + p_lo
 * builds up in one accumulator a row. Q8_0's quants are u = q + 128: the sign trick on
 * q = u ^ 0x80 keeps maddubs' pairs in int16, and the sum starts at 0 instead of c (the
 * same integer as VNNI's c + sum u Q). */
TD_INLINE TD_Y void avx2_tile(td_dtype_t t, bool one, int R, int h0, int H, const unsigned char *gq,
                              const unsigned char *gs, size_t nb, size_t k, const unsigned char *a,
                              size_t stride, float *y, size_t ldy, const unsigned char *pf_end)
{
    const size_t qb = quant_bytes(t);
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), wide = _mm256_set1_epi16(WIDE);
    const __m256i bias8 = _mm256_set1_epi8((char)0x80), bit4 = _mm256_set1_epi8(0x10);
    /* IQ4_XS: the signed values of the indices in both lanes, for vpshufb */
    const __m256i iq4s = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)td_quant_iq4nl_values));
    __m256 acc[2][4], macc[2][4];
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            acc[x][i] = macc[x][i] = _mm256_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        if (H == 2) /* decode */
            decode_prefetch(gq + b * qb, qb, pf_end);
#pragma GCC unroll 2
        for (int x = 0; x < H; x++) {
            const int h = h0 + x;
            const unsigned char *q = gq + b * qb + 32 * h;
            __m256i p[4];
#pragma GCC unroll 4
            for (int i = 0; i < R; i++)
                p[i] = t == TD_Q4_0 ? _mm256_set1_epi32(load_i32(act_c(a + i * stride, k) + 4 * b))
                                    : _mm256_setzero_si256();
            if (t == TD_Q8_0) {
                for (int v = 0; v < 8; v++) {
                    __m256i sw = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 64 * v)), bias8);
                    __m256i aw = _mm256_abs_epi8(sw);
#pragma GCC unroll 4
                    for (int i = 0; i < R; i++) {
                        const unsigned char *ai = a + i * stride;
                        __m256i qh = _mm256_set1_epi32(load_i32(act_hi(ai) + b * TD_QK + 4 * v));
                        __m256i ql = _mm256_set1_epi32(load_i32(act_lo(ai, k) + b * TD_QK + 4 * v));
                        p[i] = _mm256_add_epi32(p[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(qh, sw)), wide));
                        if (!one)
                            p[i] = _mm256_add_epi32(p[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(ql, sw)), ones));
                    }
                }
            } else {
                const __m256i hb = t == TD_Q5_K ? _mm256_loadu_si256((const __m256i *)(q + 256)) : _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v));
                    __m256i lo4 = _mm256_and_si256(raw, low4);
                    __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    if (t == TD_Q5_K) { /* the fifth bits: weight 4v + j's at bit v, 16 + 4v + j's at 4 + v */
                        lo4 = _mm256_or_si256(lo4, _mm256_and_si256(_mm256_slli_epi16(hb, 4 - v), bit4));
                        hi4 = _mm256_or_si256(hi4, _mm256_and_si256(_mm256_srli_epi16(hb, v), bit4));
                    }
                    if (t == TD_IQ4_XS) { /* signed values, Q8_0's sign trick; pairs up to 2 * 127 * 127: one madd each */
                        __m256i sl = _mm256_shuffle_epi8(iq4s, lo4), sh = _mm256_shuffle_epi8(iq4s, hi4);
                        __m256i al = _mm256_abs_epi8(sl), ah = _mm256_abs_epi8(sh);
#pragma GCC unroll 4
                        for (int i = 0; i < R; i++) {
                            const unsigned char *ai = a + i * stride;
                            const int8_t *qh = act_hi(ai) + b * TD_QK, *ql = act_lo(ai, k) + b * TD_QK;
                            __m256i ph = _mm256_add_epi32(
                                _mm256_madd_epi16(_mm256_maddubs_epi16(al, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qh + 4 * v)), sl)), wide),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(ah, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qh + 16 + 4 * v)), sh)), wide));
                            p[i] = _mm256_add_epi32(p[i], ph);
                            if (one)
                                continue;
                            __m256i pl = _mm256_add_epi32(
                                _mm256_madd_epi16(_mm256_maddubs_epi16(al, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(ql + 4 * v)), sl)), ones),
                                _mm256_madd_epi16(_mm256_maddubs_epi16(ah, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(ql + 16 + 4 * v)), sh)), ones));
                            p[i] = _mm256_add_epi32(p[i], pl);
                        }
                        continue;
                    }
#pragma GCC unroll 4
                    for (int i = 0; i < R; i++) {
                        const unsigned char *ai = a + i * stride;
                        const int8_t *qh = act_hi(ai) + b * TD_QK, *ql = act_lo(ai, k) + b * TD_QK;
                        /* pairs of u <= 31: at most 2 * 31 * 127 each, two summed: no int16 overflow */
                        __m256i sh16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo4, _mm256_set1_epi32(load_i32(qh + 4 * v))),
                                                        _mm256_maddubs_epi16(hi4, _mm256_set1_epi32(load_i32(qh + 16 + 4 * v))));
                        if (one) {
                            p[i] = _mm256_add_epi32(p[i], _mm256_madd_epi16(sh16, wide));
                            continue;
                        }
                        __m256i sl16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo4, _mm256_set1_epi32(load_i32(ql + 4 * v))),
                                                        _mm256_maddubs_epi16(hi4, _mm256_set1_epi32(load_i32(ql + 16 + 4 * v))));
                        p[i] = _mm256_add_epi32(p[i], _mm256_add_epi32(_mm256_madd_epi16(sh16, wide),
                                                                       _mm256_madd_epi16(sl16, ones)));
                    }
                }
            }
            __m256 dw, mw;
            avx2_scales(t, gs, b, h, &dw, &mw);
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const unsigned char *ai = a + i * stride;
                __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(load_f32(act_e(ai, k) + 4 * b)));
                acc[x][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[i]), sc, acc[x][i]);
                if (has_min(t))
                    macc[x][i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(load_f32(act_c(ai, k) + 4 * b)), macc[x][i]);
            }
        }
    }
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            _mm256_storeu_ps(y + i * ldy + 8 * (h0 + x),
                             has_min(t) ? _mm256_add_ps(acc[x][i], macc[x][i]) : acc[x][i]);
}

#define Q6_HI_YMM(hb, v) ((v) == 3 ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 4 - 2 * (v)))

/* vnni_tile_q6_k's sums on AVX2 for halves [h0, h0 + H) of a group (8 rows each) by R rows,
 * R * H <= 4: maddubs (u <= 63: pairs within int16) + madd, hi widened by 254 */
TD_INLINE TD_Y void avx2_tile_q6_k(bool one, int R, int h0, int H, const unsigned char *gq, const unsigned char *gs,
                                   size_t nb, size_t k, const unsigned char *a, size_t stride, float *y, size_t ldy,
                                   const unsigned char *pf_end)
{
    const size_t qb = quant_bytes(TD_Q6_K);
    const __m256i low4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const __m256i ones = _mm256_set1_epi16(1), wide = _mm256_set1_epi16(WIDE);
    __m256 acc[2][4];
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            acc[x][i] = _mm256_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        if (H == 2)
            decode_prefetch(gq + b * qb, qb, pf_end);
        const unsigned char *ks = gs + b / 8 * K6_SCALE_BYTES;
#pragma GCC unroll 2
        for (int x = 0; x < H; x++) {
            const int hr = h0 + x; /* rows 8 hr .. 8 hr + 7 */
            const unsigned char *q = gq + b * qb + 32 * hr;
            const __m256i hb0 = _mm256_loadu_si256((const __m256i *)(q + 256));
            const __m256i hb1 = _mm256_loadu_si256((const __m256i *)(q + 320));
            __m256i p[2][4];
#pragma GCC unroll 4
            for (int i = 0; i < R; i++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
                    p[h][i] = _mm256_set1_epi32(load_i32((h ? act_c2(a + i * stride, k) : act_c(a + i * stride, k)) + 4 * b));
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v));
                __m256i wv[2] = {_mm256_or_si256(_mm256_and_si256(raw, low4), _mm256_and_si256(Q6_HI_YMM(hb0, v), hi2)),
                                 _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                                 _mm256_and_si256(Q6_HI_YMM(hb1, v), hi2))};
#pragma GCC unroll 4
                for (int i = 0; i < R; i++) {
                    const unsigned char *ai = a + i * stride;
                    const int8_t *hi = act_hi(ai) + b * TD_QK, *lo = act_lo(ai, k) + b * TD_QK;
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        __m256i sh = _mm256_maddubs_epi16(wv[h], _mm256_set1_epi32(load_i32(hi + 16 * h + 4 * v)));
                        if (one) {
                            p[h][i] = _mm256_add_epi32(p[h][i], _mm256_madd_epi16(sh, wide));
                            continue;
                        }
                        __m256i sl = _mm256_maddubs_epi16(wv[h], _mm256_set1_epi32(load_i32(lo + 16 * h + 4 * v)));
                        p[h][i] = _mm256_add_epi32(p[h][i], _mm256_add_epi32(_mm256_madd_epi16(sh, wide),
                                                                             _mm256_madd_epi16(sl, ones)));
                    }
                }
            }
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + 16 * hr)));
            __m256 dw[2];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++)
                dw[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                             _mm_loadl_epi64((const __m128i *)(ks + K6_SC(b % 8, h) + 8 * hr)))));
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                __m256 e = _mm256_set1_ps(load_f32(act_e(a + i * stride, k) + 4 * b));
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
                    acc[x][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[h][i]), _mm256_mul_ps(dw[h], e), acc[x][i]);
            }
        }
    }
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            _mm256_storeu_ps(y + i * ldy + 8 * (h0 + x), acc[x][i]);
}

TD_INLINE TD_Y void kernel_avx2(td_dtype_t t, bool one, const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k,
                                const void *av, size_t m, float *y, size_t ldy)
{
    size_t nb = k / TD_QK, gb = td_cpu_pack_group_bytes(t, k), stride = td_cpu_pack_act_stride(k);
    const unsigned char *a = av, *end = (const unsigned char *)wp + g_pf * gb;
    for (size_t g = g0; g < g1; g++) {
        const unsigned char *gq = (const unsigned char *)wp + g * gb, *gs = gq + nb * quant_bytes(t);
        float *yg = y + (g - g0) * ROWS;
        size_t i = 0;
        if (t == TD_Q6_K) { /* twice the accumulators a row: tiles of 2 rows, the odd one alone */
            for (int h = 0; h < 2; h++)
                for (i = 0; i + 2 <= m; i += 2)
                    avx2_tile_q6_k(one, 2, h, 1, gq, gs, nb, k, a + i * stride, stride, yg + i * ldy, ldy, end);
            if (i < m)
                avx2_tile_q6_k(one, 1, 0, 2, gq, gs, nb, k, a + i * stride, stride, yg + i * ldy, ldy, end);
            continue;
        }
        for (int h = 0; h < 2; h++)
            for (i = 0; i + 4 <= m; i += 4)
                avx2_tile(t, one, 4, h, 1, gq, gs, nb, k, a + i * stride, stride, yg + i * ldy, ldy, end);
        const unsigned char *ai = a + i * stride;
        float *yi = yg + i * ldy;
        switch (m - i) { /* the last rows (decode: all of them), both halves in one pass */
        case 1:
            if (avx2_row1_takes(t))
                avx2_row1(t, one, gq, gs, nb, k, ai, yi, end);
            else
                avx2_tile(t, one, 1, 0, 2, gq, gs, nb, k, ai, stride, yi, ldy, end);
            break;
        case 2: avx2_tile(t, one, 2, 0, 2, gq, gs, nb, k, ai, stride, yi, ldy, end); break;
        case 3:
            avx2_tile(t, one, 3, 0, 1, gq, gs, nb, k, ai, stride, yi, ldy, end);
            avx2_tile(t, one, 3, 1, 1, gq, gs, nb, k, ai, stride, yi, ldy, end);
            break;
        default: break;
        }
    }
}

PACK_FNS(avx2_2, TD_Y, kernel_avx2, false)
PACK_FNS(avx2_1, TD_Y, kernel_avx2, true)

static const td_cpu_pack_ops_t ops_avx2 = {
    .name = "avx2", .act_row = act_row_avx2, .two_byte = PACK_TABLE(avx2_2), .one_byte = PACK_TABLE(avx2_1)};

#endif /* TD_CPU_PACK_X86 */

/* ---- tables ------------------------------------------------------------------------------- */

const td_cpu_pack_ops_t *td_cpu_pack_ops(td_cpu_isa_t isa)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
#ifdef TD_CPU_PACK_X86
    if (isa >= TD_CPU_ISA_AVX512_VNNI)
        return &ops_vnni;
    if (isa >= TD_CPU_ISA_AVX2)
        return &ops_avx2;
#endif
    return &ops_scalar;
}

td_cpu_pack_fn td_cpu_pack_fn_of(const td_cpu_pack_ops_t *ops, td_dtype_t type, bool one_byte)
{
    const td_cpu_pack_fns_t *f = one_byte ? &ops->one_byte : &ops->two_byte;
    switch (type) {
    case TD_Q8_0: return f->q8_0;
    case TD_Q4_0: return f->q4_0;
    case TD_Q4_1: return f->q4_1;
    case TD_Q4_K: return f->q4_k;
    case TD_Q6_K: return f->q6_k;
    case TD_Q5_K: return f->q5_k;
    case TD_IQ4_XS: return f->iq4_xs;
    default: break;
    }
    TD_ASSERT(!"td_cpu_pack_fn_of: a type without a packed layout");
    return NULL;
}
