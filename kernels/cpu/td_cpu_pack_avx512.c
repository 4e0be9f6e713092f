/*
 * td_cpu_pack_avx512: td_cpu_pack's AVX-512 VNNI table (vpdpbusd) and its activation
 * quantizer in AVX-512, bit-identical to the scalar reference (td_cpu_pack.h).
 */
#include "td_cpu_pack_impl.h"

#include "td_cpu_amx.h"

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
TD_INLINE TD_Z int32_t act_block_avx512(const float *x, int8_t *hi, int8_t *lo, float *e_p, int32_t *first_p, bool one,
                                        float amax_in)
{
    __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    __m512 amax = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps());
    amax = _mm512_max_ps(_mm512_abs_ps(x1), amax);
    bool nan = (_mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q)) != 0;
    float d = (amax_in >= 0.0f ? amax_in : _mm512_reduce_max_ps(amax)) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    for (int half = 0; half < 2; half++) {
        __m512 v = _mm512_mul_ps(half ? x1 : x0, _mm512_set1_ps(id));
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        __m512 h = round_half_away(v);
        __m512i qh = _mm512_cvtps_epi32(h), ql = one ? _mm512_setzero_si512()
                                                     : _mm512_cvtps_epi32(round_half_away(
                                                           _mm512_mul_ps(_mm512_sub_ps(v, h), _mm512_set1_ps((float)WIDE))));
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
    act_row_blocks(act_block_avx512, x, av, type, k, one_byte, false); /* no VNNI kernel reads Q */
}

/* ---- AVX-512 VNNI ------------------------------------------------------------------------ */

#define TD_V __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

/* (float)(WIDE * ph + pl), the block's exact integer sum rounded once as the scalar kernel
 * rounds it. Where ph and pl are both exact in f32, one FMA of them rounds WIDE * ph + pl
 * once, to that same float, two instructions fewer a row and block than the integer multiply
 * (two shifts, a subtract) and add before a conversion. ph is (|ph| <= 32 * 255 * 127 < 2^24);
 * pl is c + sum u lo, c = -offset * sum Q (td_cpu_pack.h; 0 with a min):
 * - one byte (lo is 0): pl = c = -offset * 254 * S, S the block's (Q6_K: half's) sum of hi,
 *   offset 8, 32 or 128: a power of two times 127 S, |127 S| < 2^24, exact;
 * - two bytes: |Q| <= 254 * 127, so |pl| <= 32 * 8 * 32258 + 32 * 15 * 127 (Q4_0), 16 * 32 *
 *   32258 + 16 * 63 * 127 (a Q6_K half) or 32 * 31 * 127 (a min) < 2^24, exact; Q8_0's and
 *   IQ4_XS's (offset 128, up to 2^27) are not, and take the integer way. */
TD_INLINE TD_V __m512 wide_sum(td_dtype_t t, bool one, __m512i ph, __m512i pl)
{
    if (one || (t != TD_Q8_0 && t != TD_IQ4_XS))
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(ph), _mm512_set1_ps((float)WIDE), _mm512_cvtepi32_ps(pl));
    return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(ph, 8), _mm512_slli_epi32(ph, 1)), pl));
}

/* One group (at gq, nb blocks) against R activation rows (at a, `stride` apart): the
 * 16 outputs of row i go to y + i * ldy. */
TD_INLINE TD_V void vnni_tile(td_dtype_t t, bool one, int R, const unsigned char *gq, size_t nb, size_t k, const unsigned char *a, size_t stride, float *y,
                              size_t ldy, const unsigned char *pf_end)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    /* IQ4_XS: u = value + 128 of each index, in every 128-bit lane for vpshufb */
    const __m512i iq4u = _mm512_broadcast_i32x4(_mm_add_epi8(
        _mm_loadu_si128((const __m128i *)td_quant_iq4nl_values), _mm_set1_epi8((char)0x80)));
    const bool super = act_super(t, one); /* a super-block row: P over 8 blocks, one float step */
    __m512 acc[8], macc[8];
    __m512i big[8]; /* super: each row's P = sum sc_b p_b of the super-block so far */
    for (int i = 0; i < R; i++) {
        acc[i] = macc[i] = _mm512_setzero_ps();
        big[i] = _mm512_setzero_si512();
    }
    for (size_t b = 0; b < nb; b++) {
        const unsigned char *q = gq + block_at(t, b);
        __m512i w[8];
        if (pf_end) /* the group's first sweep */
            decode_prefetch(t, gq, b, pf_end);
        if (t == TD_Q8_0) { /* u, vpdpbusd's unsigned operand: one-byte rows' layout holds q */
            for (int v = 0; v < 8; v++) {
                w[v] = _mm512_loadu_si512(q + 64 * v);
                if (one)
                    w[v] = _mm512_xor_si512(w[v], _mm512_set1_epi8((char)0x80));
            }
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
        __m512i isc = _mm512_setzero_si512(); /* super: the block's integer scales */
        if (super) {
            const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
            const __m128i sc8 = _mm_loadu_si128((const __m128i *)(ks + (t == TD_IQ4_XS ? XS_SC(b % 8) : K_SC(b % 8))));
            isc = t == TD_IQ4_XS ? _mm512_cvtepi8_epi32(sc8) : _mm512_cvtepu8_epi32(sc8);
            dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + (t == TD_IQ4_XS ? 0 : K_D)))); /* d */
            if (t == TD_Q4_K)
                mw = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + K_DMIN))),
                                                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                                          (const __m128i *)(ks + K_MN(b % 8))))))),
                    _mm512_set1_epi32(INT32_MIN)));
        } else if (t == TD_IQ4_XS) { /* d * (ls - 32): exact */
            const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
            dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ks)),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ks + XS_SC(b % 8))))));
        } else if (k_scales(t)) { /* d * sc and -(dmin * mn): the scalar kernel's exact products */
            const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
            __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ks + K_SC(b % 8)))));
            __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ks + K_MN(b % 8)))));
            dw = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + K_D))), sc);
            mw = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + K_DMIN))), mn)),
                _mm512_set1_epi32(INT32_MIN)));
        } else {
            const unsigned char *s = gq + block_scales_at(t, nb, b);
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
            if (super) { /* P += sc_b (c_b + sum u hi); at the super-block's end one float step */
                big[i] = _mm512_add_epi32(big[i], _mm512_mullo_epi32(has_min(t) ? ph : _mm512_add_epi32(ph, pl), isc));
                if (b % PACK_CHUNK == PACK_CHUNK - 1) {
                    __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(load_f32(act_e(ai, k) + 4 * b)));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(big[i]), sc, acc[i]);
                    big[i] = _mm512_setzero_si512();
                }
            } else {
                __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(load_f32(act_e(ai, k) + 4 * b)));
                acc[i] = _mm512_fmadd_ps(wide_sum(t, one, ph, pl), sc, acc[i]);
            }
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
 * Q: c = -32 sum Q of the half) and their two FMAs, half 0 first. One-byte rows are
 * super-block rows: each half's c + sum u hi times its int8 sc (vpmulld) into the row's int32
 * P, one FMA by d * E a super-block (td_cpu_pack.h; AVX2's row and tile alike) */
TD_INLINE TD_V void vnni_tile_q6_k(bool one, int R, const unsigned char *gq, size_t nb, size_t k,
                                   const unsigned char *a, size_t stride, float *y, size_t ldy,
                                   const unsigned char *pf_end)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F), hi2 = _mm512_set1_epi8(0x30);
    __m512 acc[8];
    __m512i big[8]; /* one byte: each row's P of the super-block so far */
    for (int i = 0; i < R; i++) {
        acc[i] = _mm512_setzero_ps();
        big[i] = _mm512_setzero_si512();
    }
    for (size_t b = 0; b < nb; b++) {
        const unsigned char *q = gq + block_at(TD_Q6_K, b);
        if (pf_end)
            decode_prefetch(TD_Q6_K, gq, b, pf_end);
        __m512i w[8];
        const __m512i hb0 = _mm512_loadu_si512(q + 256), hb1 = _mm512_loadu_si512(q + 320);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            __m512i raw = _mm512_loadu_si512(q + 64 * v);
            w[v] = _mm512_or_si512(_mm512_and_si512(raw, low4), _mm512_and_si512(Q6_HI_ZMM(hb0, v), hi2));
            w[v + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4),
                                       _mm512_and_si512(Q6_HI_ZMM(hb1, v), hi2));
        }
        const unsigned char *ks = gq + chunk_scales_at(TD_Q6_K, nb, b);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ks));
        __m512 dw[2];
        __m512i isc[2];
        for (int h = 0; h < 2; h++) {
            isc[h] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ks + K6_SC(b % 8, h))));
            dw[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(isc[h]));
        }
        const bool step = one && b % PACK_CHUNK == PACK_CHUNK - 1; /* the super-block's last block */
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
                if (one)
                    big[i] = _mm512_add_epi32(big[i], _mm512_mullo_epi32(_mm512_add_epi32(ph, pl), isc[h]));
                else
                    acc[i] = _mm512_fmadd_ps(wide_sum(TD_Q6_K, one, ph, pl), _mm512_mul_ps(dw[h], e), acc[i]);
            }
            if (step) { /* e = E */
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(big[i]), _mm512_mul_ps(d, e), acc[i]);
                big[i] = _mm512_setzero_si512();
            }
        }
    }
    for (int i = 0; i < R; i++)
        _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* Whether a decode row (m = 1) of type t goes faster through the avx2 table's row kernel
 * than through vnni_tile's one-row tile: Q8_0 (both modes) and one-byte Q6_K. 1B Llama
 * shapes, `tandem generate` decode, 1 thread, Zen 4, vnni_tile against the avx2 row kernel,
 * three alternated runs, tokens/s: Q8_0 16.1-16.2 -> 19.8-20.0, `--device cpu:q8` Q8_0
 * 15.6 -> 16.6-16.8 and Q6_K 21.6-22.3 -> 26.6-26.9. Tried and left with vnni_tile: two-byte
 * Q4_0 (22.3-22.8 -> 21.2-21.4) and one-byte Q4_1 and Q4_K (the same speed). At 2 threads
 * decode is bound by the memory's bandwidth and reads alike either way. Both tables give
 * the scalar reference's bits, so a row's result does not depend on which one runs it; these
 * avx2 row kernels read only the parts of an activation row that act_row_avx512 writes
 * (not the Q part). */
TD_INLINE bool vnni_row_by_avx2(td_dtype_t t, bool one)
{
    return t == TD_Q8_0 || (one && t == TD_Q6_K);
}

TD_INLINE TD_V void kernel_vnni(td_dtype_t t, bool one, const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k,
                                const void *av, size_t m, float *y, size_t ldy)
{
    if (m == 1 && vnni_row_by_avx2(t, one)) {
        td_cpu_pack_fn_of(&td_cpu_pack_ops_avx2, t, one)(wp, g0, g1, g_pf, k, av, m, y, ldy);
        return;
    }
    size_t nb = k / TD_QK, gb = td_cpu_pack_group_bytes(t, k), stride = td_cpu_pack_act_stride(k);
    const unsigned char *a = av, *end = (const unsigned char *)wp + g_pf * gb;
    for (size_t g = g0; g < g1; g++) {
        const unsigned char *gq = (const unsigned char *)wp + g * gb;
        float *yg = y + (g - g0) * ROWS;
#define VNNI_TILE(R, ai, yi)                                                                    \
    (t == TD_Q6_K ? vnni_tile_q6_k(one, R, gq, nb, k, ai, stride, yi, ldy, i == 0 ? end : NULL)   \
                  : vnni_tile(t, one, R, gq, nb, k, ai, stride, yi, ldy, i == 0 ? end : NULL))
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

const td_cpu_pack_ops_t td_cpu_pack_ops_vnni = {
    .name = "avx512vnni", .act_row = act_row_avx512, .act_q16 = false, .two_byte = PACK_TABLE(vnni2),
    .one_byte = PACK_TABLE(vnni1)};

/* ---- AMX ---------------------------------------------------------------------------------- */

/*
 * Prefill rows on the tile unit (AMX-INT8), 16 activation rows at a time, both row modes and
 * every packed type. A packed block is already a tile operand: its 8 vectors of 64 bytes
 * hold, vector v, the 4 weights 4v..4v+3 of each of the group's 16 rows, which is row v of
 * the "B" tile of TDPB*D (K / 4 rows of N = 16 columns of 4 bytes; td_cpu_pack.h). One-byte
 * Q8_0's layout holds q itself and loads as stored; every other block is spread into such a
 * tile first (amx_spread), once a 32 KiB segment of its group for every 16-row chunk of the
 * call: as the signed weight less its offset (Q4_0 u - 8, IQ4_XS its value, Q6_K u - 32,
 * two-byte Q8_0 q) or, for the types with a min, as u (Q4_1, Q4_K 0..15, Q5_K 0..31). A unit
 * (a block; a Q6_K half of 16 weights, K = 16) against the chunk's hi bytes as the "A" tile
 * (16 rows of 32 bytes, the rows' stride apart; two-byte rows: the lo bytes as a second A)
 * is one TDPBSSD (TDPBSUD for u) a part, giving the 16 x 16 exact sums
 *   ph = sum (u - offset) hi, pl = sum (u - offset) lo   (|.| <= 32 * 128 * 127 < 2^24)
 * that vnni_tile makes with 8 vpdpbusd a row and part; the offset is in the signed weights,
 * so no c term. From there the header's arithmetic, in block order:
 * - block rows (all two-byte rows; one-byte Q8_0, Q4_0, Q4_1, Q5_K): acc += (float)(254 ph
 *   + pl) * (d_w * e), the integer rounded once (one byte: a product, two bytes: one FMA of
 *   the two exact conversions; vnni_tile's wide_sum rounds the same integer once);
 * - super-block rows (one-byte Q4_K, IQ4_XS, Q6_K): P += sc_b ph (Q6_K a half's sc), and once
 *   a super-block acc += (float)P * (d * E);
 * - with a min, M += m * c a block, its own chain in a second pass, and y = acc + M.
 * So every table gives the same bits and a row's result does not depend on which rows share
 * its call: decode rows (fewer than 16) and the rows past the last 16 go through vnni_tile.
 * The sums leave the tile unit only through memory (a C tile stored, its rows loaded), which
 * with the float step is what bounds it (docs/kernels.md "On the tile unit").
 *
 * Tiles: A 0 (hi) and 1 (lo); B 2 and 3, C 4 and 6 (lo: 5 and 7) by the unit's parity, and
 * unit x's products are issued before unit x - 1's float step. Each call configures the tiles
 * and releases them at its end (td_cpu_amx.h has the instructions).
 */
#define TD_AMX TD_V
#define AMX_ROWS 16 /* activation rows a tile */

/* kq weights a product: TD_QK, or a Q6_K half's 16 */
static TD_AMX void amx_configure(int kq)
{
    td_cpu_amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) {
        c.rows[i] = AMX_ROWS; /* A: 16 rows of kq hi bytes */
        c.colsb[i] = (uint16_t)kq;
        c.rows[2 + i] = (uint8_t)(kq / 4); /* B: kq / 4 rows of 16 weight rows x 4 bytes */
        c.colsb[2 + i] = 4 * ROWS;
    }
    for (int i = 4; i < 8; i++) {
        c.rows[i] = AMX_ROWS; /* C: 16 x 16 int32 */
        c.colsb[i] = 4 * ROWS;
    }
    AMX_CONFIGURE(&c);
}

/* Block b's B tile (8 rows of 64 bytes) spread at dst from the packed quants at q: nibble
 * vector v's low nibbles are tile row v, its high ones row 4 + v (vnni_tile's w[]), then the
 * type's offset taken off where the product is signed */
TD_INLINE TD_AMX void amx_spread(td_dtype_t t, const unsigned char *q, unsigned char *dst)
{
    if (t == TD_Q8_0) { /* two-byte rows' layout: u = q + 128 (one-byte rows' q loads as stored) */
        for (int v = 0; v < 8; v++)
            _mm512_store_si512(dst + 64 * v, _mm512_xor_si512(_mm512_loadu_si512(q + 64 * v), _mm512_set1_epi8((char)0x80)));
        return;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10), hi2 = _mm512_set1_epi8(0x30);
    const __m512i iq4 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)td_quant_iq4nl_values));
    __m512i w[8];
    for (int v = 0; v < 4; v++) {
        __m512i raw = _mm512_loadu_si512(q + 64 * v);
        w[v] = _mm512_and_si512(raw, low4);
        w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
    if (t == TD_Q5_K) { /* the fifth bits, as vnni_tile */
        const __m512i hb = _mm512_loadu_si512(q + 256);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            w[v] = _mm512_or_si512(w[v], _mm512_and_si512(_mm512_slli_epi16(hb, 4 - v), bit4));
            w[v + 4] = _mm512_or_si512(w[v + 4], _mm512_and_si512(_mm512_srli_epi16(hb, v), bit4));
        }
    } else if (t == TD_Q6_K) { /* the high 2 bits, as vnni_tile_q6_k, less 32 */
        const __m512i hb0 = _mm512_loadu_si512(q + 256), hb1 = _mm512_loadu_si512(q + 320);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            w[v] = _mm512_sub_epi8(_mm512_or_si512(w[v], _mm512_and_si512(Q6_HI_ZMM(hb0, v), hi2)), _mm512_set1_epi8(32));
            w[v + 4] = _mm512_sub_epi8(_mm512_or_si512(w[v + 4], _mm512_and_si512(Q6_HI_ZMM(hb1, v), hi2)),
                                       _mm512_set1_epi8(32));
        }
    } else if (t == TD_IQ4_XS) { /* the value itself (vnni_tile's u less 128) */
        for (int v = 0; v < 8; v++)
            w[v] = _mm512_shuffle_epi8(iq4, w[v]);
    } else if (t == TD_Q4_0) {
        for (int v = 0; v < 8; v++)
            w[v] = _mm512_sub_epi8(w[v], _mm512_set1_epi8(8));
    }
    for (int v = 0; v < 8; v++)
        _mm512_store_si512(dst + 64 * v, w[v]);
}

/* One part's exact sums: the rows' bytes at src into tile A, times tile B, into C and on to
 * dst (16 rows of 16 int32); tile numbers written out (the instructions take immediates) */
#define AMX_PART(A, B, C, t, src, stride, dst)                                                   \
    do {                                                                                         \
        AMX_LOAD(A, src, stride);                                                                \
        AMX_ZERO(C);                                                                             \
        if (has_min(t))                                                                          \
            AMX_DPBSUD(C, A, B);                                                                 \
        else                                                                                     \
            AMX_DPBSSD(C, A, B);                                                                 \
        AMX_STORE(C, dst, 4 * ROWS);                                                             \
    } while (0)

/* One unit's exact sums: its B tile at bt into tile B, the rows' hi bytes at ahi on tiles A
 * and C to ch; two-byte rows also their lo bytes at alo on tiles AL and CL to cl */
#define AMX_SUMS(A, AL, B, C, CL, t, one, bt, ahi, alo, stride, ch, cl)                          \
    do {                                                                                         \
        AMX_LOAD(B, bt, 4 * ROWS);                                                               \
        AMX_PART(A, B, C, t, ahi, stride, ch);                                                   \
        if (!(one))                                                                              \
            AMX_PART(AL, B, CL, t, alo, stride, cl);                                             \
    } while (0)

/* A block row's d_w of unit x (vnni_tile's dw; a Q6_K half's, vnni_tile_q6_k's dw[h]) */
TD_INLINE TD_AMX __m512 amx_dw(td_dtype_t t, const unsigned char *gq, size_t nb, size_t x)
{
    const size_t b = t == TD_Q6_K ? x / 2 : x;
    const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
    if (t == TD_Q6_K || t == TD_IQ4_XS) { /* d times the int8 scale (IQ4_XS: ls - 32): exact */
        const unsigned char *sc = ks + (t == TD_Q6_K ? K6_SC(b % 8, (int)(x % 2)) : XS_SC(b % 8));
        return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ks)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))));
    }
    if (k_scales(t))
        return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + K_D))),
                             _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ks + K_SC(b % 8))))));
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gq + block_scales_at(t, nb, b))));
}

/* A super-block row's integer scales of block b (Q6_K: of its half h) */
TD_INLINE TD_AMX __m512i amx_isc(td_dtype_t t, const unsigned char *gq, size_t nb, size_t b, int h)
{
    const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
    if (t == TD_Q6_K)
        return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ks + K6_SC(b % 8, h))));
    if (t == TD_IQ4_XS)
        return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ks + XS_SC(b % 8))));
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ks + K_SC(b % 8))));
}

/* A super-block's d (the f16 d of the chunk's scales: first for Q6_K and IQ4_XS, K_D for Q4_K) */
TD_INLINE TD_AMX __m512 amx_d(td_dtype_t t, const unsigned char *gq, size_t nb, size_t b)
{
    const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + (t == TD_Q4_K ? K_D : 0))));
}

/* The min's m of block b: Q4_1's stored m, Q4_K's and Q5_K's -(dmin * mn) */
TD_INLINE TD_AMX __m512 amx_mw(td_dtype_t t, const unsigned char *gq, size_t nb, size_t b)
{
    if (t == TD_Q4_1)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gq + block_scales_at(t, nb, b) + 2 * ROWS)));
    const unsigned char *ks = gq + chunk_scales_at(t, nb, b);
    __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ks + K_MN(b % 8)))));
    return _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ks + K_DMIN))), mn)),
        _mm512_set1_epi32(INT32_MIN)));
}

/* Unit x's float step of block rows, the 16 rows' sums of hi in ch (and of lo in cl for
 * two-byte rows: (float)(254 ph + pl) as one FMA rounds it, both exact in f32) */
TD_INLINE TD_AMX void amx_block_step(td_dtype_t t, bool one, const unsigned char *gq, size_t nb, size_t x, size_t k,
                                     const unsigned char *a, size_t stride, const int32_t *ch, const int32_t *cl,
                                     __m512 *acc)
{
    const size_t b = t == TD_Q6_K ? x / 2 : x;
    const __m512 dw = amx_dw(t, gq, nb, x), wide = _mm512_set1_ps((float)WIDE);
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++) {
        __m512 ph = _mm512_cvtepi32_ps(_mm512_load_si512(ch + ROWS * i));
        __m512 p = one ? _mm512_mul_ps(ph, wide) : _mm512_fmadd_ps(ph, wide, _mm512_cvtepi32_ps(_mm512_load_si512(cl + ROWS * i)));
        __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(load_f32(act_e(a + i * stride, k) + 4 * b)));
        acc[i] = _mm512_fmadd_ps(p, sc, acc[i]);
    }
}

/* A super-block row's integer step, P += sc p for the 16 rows */
TD_INLINE TD_AMX void amx_super_step(__m512i isc, const int32_t *cbuf, __m512i *big)
{
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++)
        big[i] = _mm512_add_epi32(big[i], _mm512_mullo_epi32(_mm512_load_si512(cbuf + ROWS * i), isc));
}

/* The end of super-block s (its last block b): y (the rows' acc) += (float)P * (d * E), P to 0 */
TD_INLINE TD_AMX void amx_super_end(td_dtype_t t, const unsigned char *gq, size_t nb, size_t b, size_t k,
                                    const unsigned char *a, size_t stride, __m512i *big, float *y, size_t ldy)
{
    const __m512 d = amx_d(t, gq, nb, b);
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; i++) {
        __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(load_f32(act_e(a + i * stride, k) + 4 * b)));
        __m512 acc = b < PACK_CHUNK ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * ldy);
        _mm512_storeu_ps(y + i * ldy, _mm512_fmadd_ps(_mm512_cvtepi32_ps(big[i]), sc, acc));
        big[i] = _mm512_setzero_si512();
    }
}

/* Weights a product ("unit"): a block, or a Q6_K half; a B tile of a unit is 16 x unit bytes */
TD_INLINE int amx_unit(td_dtype_t t)
{
    return t == TD_Q6_K ? TD_QK / 2 : TD_QK;
}

/* Units a segment: the spread B tiles of one group's segment, 32 KiB, are made once and read
 * by every 16-row chunk of the call. A multiple of a super-block's units (8 blocks, 16 Q6_K
 * halves), so that P never spans two segments. */
#define AMX_SEG_BYTES 32768

/* Units [u0, u1) of one group (at gq, nb blocks) against the 16 activation rows at a, on the
 * B tiles at sb (unit u0's first; not read for one-byte Q8_0, whose packed blocks are the tiles): acc
 * continues from y (the rows' 16 outputs each at y + i * ldy) unless u0 is 0, and is left
 * there. Unit x's products are issued before unit x - 1's float step, on the other parity's
 * tiles (A 0 and 1, hi and lo; B 2 + x % 2; C 4 + 2 (x % 2) and the next for lo). */
TD_INLINE TD_AMX void amx_chunk(td_dtype_t t, bool one, const unsigned char *gq, size_t nb, size_t u0, size_t u1,
                                size_t k, const unsigned char *sb, const unsigned char *a, size_t stride, float *y,
                                size_t ldy, const unsigned char *pf_end)
{
    _Alignas(64) int32_t cbuf[2][2][AMX_ROWS * ROWS]; /* [parity][hi, lo] */
    const size_t U = (size_t)amx_unit(t);
    const bool super = act_super(t, one);
    __m512 acc[AMX_ROWS];
    __m512i big[AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; i++) {
        acc[i] = super || u0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * ldy);
        big[i] = _mm512_setzero_si512();
    }
#define AMX_ISSUE(B, C, CL, x)                                                                   \
    do {                                                                                         \
        if ((x) < u1) {                                                                          \
            if (pf_end)                                                                          \
                decode_prefetch(t, gq, x, pf_end);                                               \
            const unsigned char *bt_ = t == TD_Q8_0 && one ? gq + block_at(t, x) : sb + ((x) - u0) * U * ROWS; \
            int32_t(*c_)[AMX_ROWS * ROWS] = cbuf[((x) - u0) % 2];                                \
            AMX_SUMS(0, 1, B, C, CL, t, one, bt_, act_hi(a) + (x) * U, act_lo(a, k) + (x) * U, stride, c_[0], \
                     c_[1]);                                                                     \
        }                                                                                        \
    } while (0)
#define AMX_STEP(x)                                                                              \
    do {                                                                                         \
        if ((x) < u1) {                                                                          \
            int32_t(*c_)[AMX_ROWS * ROWS] = cbuf[((x) - u0) % 2];                                \
            if (super && t == TD_Q6_K) {                                                         \
                amx_super_step(amx_isc(t, gq, nb, (x) / 2, (int)((x) % 2)), c_[0], big);         \
                if ((x) % (2 * PACK_CHUNK) == 2 * PACK_CHUNK - 1)                                \
                    amx_super_end(t, gq, nb, (x) / 2, k, a, stride, big, y, ldy);                \
            } else if (super) {                                                                  \
                amx_super_step(amx_isc(t, gq, nb, x, 0), c_[0], big);                            \
                if ((x) % PACK_CHUNK == PACK_CHUNK - 1)                                          \
                    amx_super_end(t, gq, nb, x, k, a, stride, big, y, ldy);                      \
            } else {                                                                             \
                amx_block_step(t, one, gq, nb, x, k, a, stride, c_[0], c_[1], acc);              \
            }                                                                                    \
        }                                                                                        \
    } while (0)
    AMX_ISSUE(2, 4, 5, u0);
    for (size_t x = u0; x < u1; x += 2) {
        AMX_ISSUE(3, 6, 7, x + 1);
        AMX_STEP(x);
        AMX_ISSUE(2, 4, 5, x + 2);
        AMX_STEP(x + 1);
    }
#undef AMX_ISSUE
#undef AMX_STEP
    if (!super)
        for (int i = 0; i < AMX_ROWS; i++)
            _mm512_storeu_ps(y + i * ldy, acc[i]);
}

/* The min's chain M of the 16 rows at a, in block order (vnni_tile's macc), then y = acc + M */
TD_INLINE TD_AMX void amx_min(td_dtype_t t, const unsigned char *gq, size_t nb, size_t k, const unsigned char *a,
                              size_t stride, float *y, size_t ldy)
{
    __m512 macc[AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; i++)
        macc[i] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        const __m512 mw = amx_mw(t, gq, nb, b);
#pragma GCC unroll 16
        for (int i = 0; i < AMX_ROWS; i++)
            macc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(load_f32(act_c(a + i * stride, k) + 4 * b)), macc[i]);
    }
    for (int i = 0; i < AMX_ROWS; i++)
        _mm512_storeu_ps(y + i * ldy, _mm512_add_ps(_mm512_loadu_ps(y + i * ldy), macc[i]));
}

/* The kernel of both row modes: the first m - m % 16 rows 16 at a time on tiles, group by group and
 * segment by segment (the segment's B tiles spread once for all of them), the rest as the
 * VNNI table runs them */
TD_INLINE TD_AMX void kernel_amx(td_dtype_t t, bool one, const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k,
                                 const void *av, size_t m, float *y, size_t ldy)
{
    if (m < AMX_ROWS) {
        td_cpu_pack_fn_of(&td_cpu_pack_ops_vnni, t, one)(wp, g0, g1, g_pf, k, av, m, y, ldy);
        return;
    }
    _Alignas(64) unsigned char sb[AMX_SEG_BYTES];
    const size_t U = (size_t)amx_unit(t), nu = k / U, seg = AMX_SEG_BYTES / (U * ROWS);
    size_t nb = k / TD_QK, gb = td_cpu_pack_group_bytes(t, k), stride = td_cpu_pack_act_stride(k);
    size_t m16 = m / AMX_ROWS * AMX_ROWS;
    const unsigned char *a = av, *end = (const unsigned char *)wp + g_pf * gb;
    amx_configure((int)U);
    for (size_t g = g0; g < g1; g++) {
        const unsigned char *gq = (const unsigned char *)wp + g * gb;
        float *yg = y + (g - g0) * ROWS;
        for (size_t u0 = 0; u0 < nu; u0 += seg) {
            size_t u1 = u0 + seg < nu ? u0 + seg : nu;
            if (t != TD_Q8_0 || !one)
                for (size_t b = u0 * U / TD_QK; b < u1 * U / TD_QK; b++) {
                    decode_prefetch(t, gq, b, end);
                    amx_spread(t, gq + block_at(t, b), sb + (b * TD_QK - u0 * U) * ROWS);
                }
            for (size_t i = 0; i < m16; i += AMX_ROWS)
                amx_chunk(t, one, gq, nb, u0, u1, k, sb, a + i * stride, stride, yg + i * ldy, ldy,
                          t == TD_Q8_0 && one && i == 0 ? end : NULL);
        }
        if (has_min(t))
            for (size_t i = 0; i < m16; i += AMX_ROWS)
                amx_min(t, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy);
    }
    AMX_RELEASE();
    if (m16 < m) /* the last m % 16 rows */
        td_cpu_pack_fn_of(&td_cpu_pack_ops_vnni, t, one)(wp, g0, g1, g_pf, k, a + m16 * stride, m - m16,
                                                         y + m16 * ldy, ldy);
}

PACK_FNS(amx2, TD_AMX, kernel_amx, false)
PACK_FNS(amx1, TD_AMX, kernel_amx, true)

const td_cpu_pack_ops_t td_cpu_pack_ops_amx = {
    .name = "amx", .act_row = act_row_avx512, .act_q16 = false, .two_byte = PACK_TABLE(amx2),
    .one_byte = PACK_TABLE(amx1)};

#endif /* TD_CPU_PACK_X86 */
