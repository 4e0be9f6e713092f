/*
 * td_cpu_pack_impl.h: what the packed kernels' files share (td_cpu_pack.c: the layout, the
 * packing, the scalar reference and the tables; td_cpu_pack_avx512.c and td_cpu_pack_avx2.c:
 * one SIMD table each): the layout's sizes, the activation row's parts, the decode prefetch
 * and the macros that make a table's entries. Private to kernels/cpu.
 */
#ifndef TD_CPU_PACK_IMPL_H
#define TD_CPU_PACK_IMPL_H

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

/* Where block b of a group is (the header's layout): blocks go in chunks of PACK_CHUNK, a
 * chunk's quants and then its blocks' scales (the last chunk may be short), so a decode
 * reads each group front to back as one stream. With all scales after all quants, the
 * hardware prefetcher followed the second stream badly: one Zen 4 core read that layout at
 * 19 GB/s with no arithmetic at all, chunks of 8 at 30-34 (a plain read's speed). */
#define PACK_CHUNK 8 /* blocks: one K super-block, whose scales are one piece */

/* offset of block b's quants from its group's start */
TD_INLINE size_t block_at(td_dtype_t t, size_t b)
{
    return b / PACK_CHUNK * PACK_CHUNK * (quant_bytes(t) + scale_bytes(t)) + b % PACK_CHUNK * quant_bytes(t);
}

/* offset of the scales of block b's chunk (of nb blocks in the group): for Q4_K, Q5_K, Q6_K
 * and IQ4_XS the super-block's, for the others block b's are scale_bytes(t) * (b % PACK_CHUNK)
 * further on */
TD_INLINE size_t chunk_scales_at(td_dtype_t t, size_t nb, size_t b)
{
    size_t c0 = b / PACK_CHUNK * PACK_CHUNK, in_chunk = nb - c0 < PACK_CHUNK ? nb - c0 : PACK_CHUNK;
    return c0 * (quant_bytes(t) + scale_bytes(t)) + in_chunk * quant_bytes(t);
}

/* offset of block b's own scales (Q8_0, Q4_0, Q4_1: 16 f16 d, then Q4_1's 16 f16 m) */
TD_INLINE size_t block_scales_at(td_dtype_t t, size_t nb, size_t b)
{
    return chunk_scales_at(t, nb, b) + b % PACK_CHUNK * scale_bytes(t);
}

/* Q4_1, Q4_K, Q5_K: an offset term m * (e sum Q) beside the integer sum (c is f32) */
TD_INLINE bool has_min(td_dtype_t t)
{
    return t == TD_Q4_1 || k_scales(t);
}


/* Whether a row for weights of type t is a super-block row (the header): one-byte rows for
 * IQ4_XS, Q4_K and Q6_K weights, one scale a super-block of 256 values, so that a kernel
 * carries a block's (Q6_K: a half's) integer scale in its integer sum and takes one float
 * step a super-block (issue 32, h32q; Q6_K h32r). PACK_CHUNK blocks make a super-block. */
TD_INLINE bool act_super(td_dtype_t t, bool one_byte)
{
    return one_byte && (t == TD_IQ4_XS || t == TD_Q4_K || t == TD_Q6_K);
}

/* Where the parts of an activation row of k are (the header's layout) */
TD_INLINE const int8_t *act_hi(const unsigned char *a) { return (const int8_t *)a; }
TD_INLINE const int8_t *act_lo(const unsigned char *a, size_t k) { return (const int8_t *)(a + k); }
TD_INLINE const unsigned char *act_e(const unsigned char *a, size_t k) { return a + 2 * k; }
TD_INLINE const unsigned char *act_c(const unsigned char *a, size_t k) { return a + 2 * k + 4 * (k / TD_QK); }
TD_INLINE const unsigned char *act_c2(const unsigned char *a, size_t k) { return a + 2 * k + 8 * (k / TD_QK); }
TD_INLINE size_t act_q16_at(size_t k) { return (2 * k + 12 * (k / TD_QK) + 63) & ~(size_t)63; }
TD_INLINE const unsigned char *act_q16(const unsigned char *a, size_t k) { return a + act_q16_at(k); }
/* A one-byte Q6_K row's offsets (the header: its Q part, which no kernel reads on such a row,
 * holds them, packed): of block b, four int16 at act_o6 + 8 b, -32 times the sums of hi over
 * the weights {0, 1, 4, 5, 8, 9, 12, 13} and {2, 3, 6, 7, 10, 11, 14, 15} of the first half,
 * then of the second (16 + those); the rest of the part 0 */
TD_INLINE const unsigned char *act_o6(const unsigned char *a, size_t k) { return a + act_q16_at(k); }

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

/* One block's quantizer: hi and lo of the 32 floats at x, *e_p its scale; returns sum Q and
 * the sum of the first 16 Q in *first_p. With `one` (a one-byte row: llama.cpp's rounding)
 * lo is 0 and Q = 254 hi, the second byte never computed. amax >= 0: the step is amax / 127
 * (a super-block's, act_super) where the block's own largest |x| would set it (amax < 0). */
typedef int32_t (*act_block_fn)(const float *x, int8_t *hi, int8_t *lo, float *e_p, int32_t *first_p, bool one,
                                float amax);

/* The largest |x| of the n floats at x (n % 8 == 0), NaN ignored (as fmaxf), and whether one
 * is NaN: a super-block's, every table's the same value (the maximum is exact in any order).
 * Eight lanes in GCC's vector type, so each table's target makes it one vector compare and
 * blend a lane group (the scalar loop, a vmaxss and a vucomiss a float, was half of act_row's
 * time: 2% of a one-byte IQ4_XS prefill). A NaN lane never replaces the running maximum. */
TD_INLINE float act_amax(const float *x, size_t n, bool *nan_p)
{
    typedef float v8f __attribute__((vector_size(32)));
    typedef int32_t v8i __attribute__((vector_size(32)));
    const v8i abs_mask = {INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX, INT32_MAX};
    v8f m = {0};
    v8i nan = {0};
    for (size_t i = 0; i < n; i += 8) {
        v8f v;
        memcpy(&v, x + i, sizeof v);
        const v8f ax = (v8f)((v8i)v & abs_mask);
        const v8i gt = ax > m; /* false for a NaN lane */
        m = (v8f)(((v8i)ax & gt) | ((v8i)m & ~gt));
        nan |= v != v;
    }
    float amax = 0.0f;
    bool any_nan = false;
    for (int l = 0; l < 8; l++) {
        amax = m[l] > amax ? m[l] : amax;
        any_nan |= nan[l] != 0;
    }
    *nan_p = any_nan;
    return amax;
}

/* The activation row of the header's layout, block by block (every table's loop: `block`
 * and `q16` are constants, inlined into each table's row function, once for each one_byte).
 * q16: the table's act_q16, whether a two-byte row's int16 Q part is written (the header). */
TD_INLINE void act_row_blocks_of(act_block_fn block, const float *x, void *av, td_dtype_t type, size_t k,
                                 bool one_byte, bool q16)
{
    unsigned char *a = av;
    if (q16 && one_byte && type == TD_Q6_K) /* act_o6's 8 bytes a block (the loop's), then 0 */
        memset(a + act_q16_at(k) + 8 * (k / TD_QK), 0, 2 * k - 8 * (k / TD_QK));
    const bool super = act_super(type, one_byte);
    TD_ASSERT(!super || k % (PACK_CHUNK * TD_QK) == 0);
    float amax = -1.0f, e_super = 0.0f; /* a super-block row's largest |x| and step (act_super) */
    for (size_t b = 0; b < k / TD_QK; b++) {
        float e;
        int8_t *hi = (int8_t *)a + b * TD_QK, *lo = (int8_t *)a + k + b * TD_QK;
        if (super && b % PACK_CHUNK == 0) {
            bool nan;
            amax = act_amax(x + b * TD_QK, PACK_CHUNK * TD_QK, &nan);
            e_super = nan ? NAN : amax / 127.0f;
        }
        int32_t first = 0, sum = block(x + b * TD_QK, hi, lo, &e, &first, one_byte, amax);
        if (super) { /* e the step of hi itself, c from the sums of hi (lo is 0: sum = 254 S) */
            e = e_super;
            sum /= WIDE;
            first /= WIDE;
        }
        if (q16 && one_byte && type == TD_Q6_K) { /* the Q part holds the offsets instead (act_o6) */
            int32_t o[4] = {0};
            int16_t o16[4];
            for (int i = 0; i < TD_QK; i++)
                o[i / 16 * 2 + i % 4 / 2] -= 32 * hi[i];
            for (int j = 0; j < 4; j++)
                o16[j] = (int16_t)o[j]; /* |o| <= 32 * 8 * 127 */
            memcpy(a + act_q16_at(k) + 8 * b, o16, sizeof o16);
        } else if (q16 && !one_byte) { /* Q = 254 hi + lo, |Q| <= 32385: AVX2's int16 prefill tiles
                                           read these (no one-byte kernel does) */
            int16_t q[TD_QK];
            for (int i = 0; i < TD_QK; i++)
                q[i] = (int16_t)(WIDE * hi[i] + lo[i]);
            memcpy(a + act_q16_at(k) + 2 * b * TD_QK, q, sizeof q);
        }
        memcpy(a + 2 * k + 4 * b, &e, 4);
        act_store_c((unsigned char *)act_c(a, k) + 4 * b, (unsigned char *)act_c2(a, k) + 4 * b, type, e, sum, first);
    }
}

TD_INLINE void act_row_blocks(act_block_fn block, const float *x, void *av, td_dtype_t type, size_t k,
                              bool one_byte, bool q16)
{
    if (one_byte)
        act_row_blocks_of(block, x, av, type, k, true, q16);
    else
        act_row_blocks_of(block, x, av, type, k, false, q16);
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

/* A group's first sweep (every decode tile; a prefill's first tile of the group) streams
 * the weights: each block asks for the lines this far ahead into L2 (T1), never past `end`:
 * group g_pf's start, the end of the caller's share (what lies beyond is another thread's).
 * A block asks for its share of the group's bytes, b (qb + sb) on and qb + sb long, so the
 * chunks' scales are fetched as well as their quants (the shares tile the group). L1
 * prefetches (T0) hold a line-fill buffer for a whole DRAM round trip, and a core has few: on
 * Zen 4 (1 thread, a 151 MB Q4_0 matrix, m = 1) T0 at 2 KiB read 12 GB/s, T1 at 8 KiB 16, at
 * 32 KiB 19.7 (2 threads: 18-24 -> 33 GB/s). With the chunked layout 8 to 64 KiB read alike
 * (2 threads, 1B Q4_0 shapes, AVX2: 32-40 GB/s; T0 27); none at all 21-24. */
#define DECODE_PREFETCH_BYTES 32768

TD_INLINE void decode_prefetch(td_dtype_t t, const unsigned char *gq, size_t b, const unsigned char *end)
{
    size_t bytes = quant_bytes(t) + scale_bytes(t);
    uintptr_t p = (uintptr_t)gq + b * bytes + DECODE_PREFETCH_BYTES;
    for (size_t off = 0; off < bytes; off += 64)
        if (p + off < (uintptr_t)end)
            _mm_prefetch((const char *)(p + off), _MM_HINT_T1);
}

/* the SIMD tables (td_cpu_pack_avx512.c, td_cpu_pack_avx2.c) */
extern const td_cpu_pack_ops_t td_cpu_pack_ops_vnni;
extern const td_cpu_pack_ops_t td_cpu_pack_ops_amx;
extern const td_cpu_pack_ops_t td_cpu_pack_ops_avx2;
#endif

#endif /* TD_CPU_PACK_IMPL_H */
