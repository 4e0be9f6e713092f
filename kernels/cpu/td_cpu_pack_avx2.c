/*
 * td_cpu_pack_avx2: td_cpu_pack's AVX2 table and its activation quantizer in AVX2,
 * bit-identical to the scalar reference (td_cpu_pack.h). Two-byte prefill tiles (m >= 2)
 * multiply int16 weights by the row's int16 Q with vpmaddwd (w16_tile); decode (m = 1) and the
 * one-byte rows use maddubs + madd on the hi and lo bytes (avx2_row1, avx2_row1_q6_k,
 * avx2_row1_q8_0, avx2_row1_iq4_xs, avx2_row1_q4_k; avx2_tile1_q4, avx2_tile1_q4_k, avx2_tile1_q6_k,
 * avx2_tile1_signed, avx2_tile1_iq4_xs). One-byte rows of IQ4_XS, Q4_K and Q6_K weights are super-block
 * rows (act_super: one scale a super-block), whose kernels carry a block's (Q6_K: a half's) integer scale in the
 * integer sum and take one float step a super-block.
 */
#include "td_cpu_pack_impl.h"

#ifdef TD_CPU_PACK_X86
#define TD_Y __attribute__((target("avx2,fma,f16c")))

/* act_block_scalar on AVX2, bit for bit (td_cpu_simd's pieces are the scalar C's operations) */
TD_INLINE TD_Y int32_t act_block_avx2(const float *x, int8_t *hi, int8_t *lo, float *e_p, int32_t *first_p, bool one,
                                      float amax_in)
{
    __m256 xv[4];
    bool nan;
    float amax = td_cpu_simd_amax32(x, xv, &nan);
    float d = (amax_in >= 0.0f ? amax_in : amax) / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i qh[4], ql[4], sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        __m256 v = td_cpu_simd_clamp127(_mm256_mul_ps(xv[j], _mm256_set1_ps(id)));
        __m256 h = td_cpu_simd_round_away(v);
        qh[j] = _mm256_cvtps_epi32(h);
        ql[j] = one ? _mm256_setzero_si256()
                    : _mm256_cvtps_epi32(td_cpu_simd_round_away(
                          _mm256_mul_ps(_mm256_sub_ps(v, h), _mm256_set1_ps((float)WIDE))));
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
    act_row_blocks(act_block_avx2, x, av, type, k, one_byte, true); /* w16_tile reads Q */
}
/* ---- AVX2 -------------------------------------------------------------------------------- */

/* The weight scales d_w and offsets m (0 where the type has none) of block b, rows 8h..8h+7,
 * cs the scales of b's chunk */
TD_INLINE TD_Y void avx2_scales(td_dtype_t t, const unsigned char *cs, size_t b, int h, __m256 *dw_p, __m256 *mw_p)
{
    __m256 dw, mw = _mm256_setzero_ps();
    if (t == TD_IQ4_XS) { /* d * (ls - 32): exact */
        const unsigned char *ks = cs;
        dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + 16 * h))),
                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(ks + XS_SC(b % 8) + 8 * h)))));
    } else if (k_scales(t)) { /* d * sc and -(dmin * mn): the scalar kernel's exact products */
        const unsigned char *ks = cs;
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ks + K_SC(b % 8) + 8 * h))));
        __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ks + K_MN(b % 8) + 8 * h))));
        dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + K_D + 16 * h))), sc);
        mw = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + K_DMIN + 16 * h))), mn),
                           _mm256_set1_ps(-0.0f));
    } else {
        const unsigned char *s = cs + b % PACK_CHUNK * scale_bytes(t) + 16 * h;
        dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
        if (t == TD_Q4_1)
            mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * ROWS)));
    }
    *dw_p = dw;
    *mw_p = mw;
}

/* The 8 one-byte block scales at p (8 weight rows, int8 or uint8 by is_signed) as the int16
 * pairs (s_r, s_r) of a madd operand, so madd(sums, pairs) scales each row's two int16 sums
 * and adds them: every super-block tile's and row's widening by its block scale. */
TD_INLINE TD_Y __m256i avx2_scale_pairs(const unsigned char *p, bool is_signed)
{
    const __m128i s8 = _mm_loadl_epi64((const __m128i *)p);
    const __m128i twice = _mm_unpacklo_epi8(s8, s8); /* s0 s0 s1 s1 ... s7 s7 */
    return is_signed ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
}

/* CALL(R) for the rows a tiling leaves, r in 1..7, R a constant in each call: each R is its
 * own unrolled tile */
#define AVX2_REST(r, CALL)                                                                        \
    do {                                                                                          \
        switch (r) {                                                                              \
        case 1: CALL(1); break;                                                                   \
        case 2: CALL(2); break;                                                                   \
        case 3: CALL(3); break;                                                                   \
        case 4: CALL(4); break;                                                                   \
        case 5: CALL(5); break;                                                                   \
        case 6: CALL(6); break;                                                                   \
        case 7: CALL(7); break;                                                                   \
        default: break;                                                                           \
        }                                                                                         \
    } while (0)

/* Whether avx2_row1 takes type t: unsigned quants u <= 31 (not Q8_0, IQ4_XS: signed through
 * the sign trick; not Q6_K: its own layout) */
TD_INLINE bool avx2_row1_takes(td_dtype_t t)
{
    return t == TD_Q4_0 || t == TD_Q4_1 || t == TD_Q4_K || t == TD_Q5_K;
}

/* One v of avx2_row1: the weights 4v.. and 16 + 4v.. of both halves of block q (16 rows)
 * against the row's hi (and lo) bytes at qh (ql), into the int16 sums sh (sl); held: each sum
 * kept in its register where it is added (AVX2_KEEP; the unrolled loops) */
TD_INLINE TD_Y void avx2_row1_v(td_dtype_t t, bool one, bool held, int v, const unsigned char *q, const int8_t *qh,
                                const int8_t *ql, __m256i sh[2], __m256i sl[2])
{
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const __m256i ah = _mm256_set1_epi32(load_i32(qh + 4 * v)), ah2 = _mm256_set1_epi32(load_i32(qh + 16 + 4 * v));
    const __m256i al = _mm256_set1_epi32(load_i32(ql + 4 * v)), al2 = _mm256_set1_epi32(load_i32(ql + 16 + 4 * v));
#pragma GCC unroll 2
    for (int x = 0; x < 2; x++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v + 32 * x));
        __m256i lo4 = _mm256_and_si256(raw, low4);
        __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        if (t == TD_Q5_K) { /* the fifth bits: weight 4v + j's at bit v, 16 + 4v + j's at 4 + v */
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(q + 256 + 32 * x));
            lo4 = _mm256_or_si256(lo4, _mm256_and_si256(_mm256_sll_epi16(hb, _mm_cvtsi32_si128(4 - v)), bit4));
            hi4 = _mm256_or_si256(hi4, _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(v)), bit4));
        }
        sh[x] = _mm256_add_epi16(sh[x], _mm256_add_epi16(_mm256_maddubs_epi16(lo4, ah), _mm256_maddubs_epi16(hi4, ah2)));
        if (held)
            AVX2_KEEP(sh[x]);
        if (!one) {
            sl[x] = _mm256_add_epi16(sl[x], _mm256_add_epi16(_mm256_maddubs_epi16(lo4, al), _mm256_maddubs_epi16(hi4, al2)));
            if (held)
                AVX2_KEEP(sl[x]);
        }
    }
}

/* Decode's one activation row against a whole group (both halves), for avx2_row1_takes types.
 * the header's integer sums in another order, so the same integers: the four broadcasts of a v serve
 * both halves, and maddubs' int16 pair sums build up over several v before one madd widens
 * them (u <= 15: 8 pairs of at most 2 * 15 * 127 stay under 2^15 over a block's 4 v; Q5_K's
 * u <= 31: over 2 v). The v loop carries only the int16 sums (the widening is outside it:
 * inside, under a condition, GCC kept the int32 sums on the stack), and Q4_K's and Q5_K's f16
 * d and dmin are widened once per super-block (chunk), not per block. A two-byte row's v loop
 * is unrolled with each sum held in its register where it is added (AVX2_KEEP): unrolled
 * without that, GCC hoisted the four v's loads and spilled (q4_0 -20%), and rolled it spent a
 * counter, a compare and a branch a v and could not overlap one v's loads with the last's
 * maddubs (one core, m = 1, a 2048 x 2048 matrix in L2, rolled -> unrolled, two-byte GB/s:
 * q4_k 26.5 -> 28.9, q4_0 29.1 -> 31.9, q4_1 31.4 -> 35.4, q5_k 21.7 -> 25.1). One-byte
 * rows, 10% faster unrolled in L2, stream a large matrix (what a decode does) each at its
 * own speed for reasons this VM's missing counters did not show (65536 x 2048, rolled ->
 * unrolled, GB/s: q4_0 19-21 -> 28-29, q4_1 28-29 -> 23-24, q4_k 32-33 -> 31-32, q5_k 30-31
 * both), so Q4_0's is unrolled and the others' stay rolled. */
TD_INLINE TD_Y void avx2_row1(td_dtype_t t, bool one, const unsigned char *gq, size_t nb,
                              size_t k, const unsigned char *a, float *y, const unsigned char *pf_end)
{
    const int flush = t == TD_Q5_K ? 2 : 4; /* v's summed in int16 before widening */
    const int8_t *hi = act_hi(a), *lo = act_lo(a, k);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, macc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 kd[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, kdmin[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (size_t b = 0; b < nb; b++) {
        const unsigned char *q = gq + block_at(t, b), *cs = gq + chunk_scales_at(t, nb, b);
        decode_prefetch(t, gq, b, pf_end);
        if (k_scales(t) && b % PACK_CHUNK == 0) /* the super-block's d and dmin, both halves */
            for (int x = 0; x < 2; x++) {
                kd[x] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + K_D + 16 * x)));
                kdmin[x] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + K_DMIN + 16 * x)));
            }
        const int8_t *qh = hi + b * TD_QK, *ql = lo + b * TD_QK;
        __m256i p[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* Q4_0's c is added last */
        for (int v0 = 0; v0 < 4; v0 += flush) {
            __m256i sh[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, sl[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            if (one && t != TD_Q4_0) /* (above) */
#pragma GCC unroll 1
                for (int v = v0; v < v0 + flush; v++)
                    avx2_row1_v(t, one, false, v, q, qh, ql, sh, sl);
            else
#pragma GCC unroll 4
                for (int v = v0; v < v0 + flush; v++)
                    avx2_row1_v(t, one, true, v, q, qh, ql, sh, sl);
#pragma GCC unroll 2
            for (int x = 0; x < 2; x++) { /* widen: hi by 254, lo by 1 */
                p[x] = _mm256_add_epi32(p[x], _mm256_madd_epi16(sh[x], _mm256_set1_epi16(WIDE)));
                if (!one)
                    p[x] = _mm256_add_epi32(p[x], _mm256_madd_epi16(sl[x], _mm256_set1_epi16(1)));
            }
        }
        if (t == TD_Q4_0) { /* the offset's c (the same integer sum in another order) */
            const __m256i c = _mm256_set1_epi32(load_i32(act_c(a, k) + 4 * b));
            p[0] = _mm256_add_epi32(p[0], c);
            p[1] = _mm256_add_epi32(p[1], c);
        }
        const __m256 e = _mm256_set1_ps(load_f32(act_e(a, k) + 4 * b));
#pragma GCC unroll 2
        for (int x = 0; x < 2; x++) {
            __m256 dw, mw;
            if (k_scales(t)) { /* d * sc and dmin * mn: the scalar kernel's exact products */
                const __m128i sc8 = _mm_loadl_epi64((const __m128i *)(cs + K_SC(b % 8) + 8 * x));
                const __m128i mn8 = _mm_loadl_epi64((const __m128i *)(cs + K_MN(b % 8) + 8 * x));
                dw = _mm256_mul_ps(kd[x], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc8)));
                mw = _mm256_xor_ps(_mm256_mul_ps(kdmin[x], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn8))),
                                   _mm256_set1_ps(-0.0f)); /* -(dmin * mn), NaN signs as scalar's */
            } else
                avx2_scales(t, cs, b, x, &dw, &mw);
            acc[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[x]), _mm256_mul_ps(dw, e), acc[x]);
            if (has_min(t))
                macc[x] = _mm256_fmadd_ps(mw, _mm256_set1_ps(load_f32(act_c(a, k) + 4 * b)), macc[x]);
        }
    }
    for (int x = 0; x < 2; x++)
        _mm256_storeu_ps(y + 8 * x, has_min(t) ? _mm256_add_ps(acc[x], macc[x]) : acc[x]);
}

/* Decode's one activation row against a whole group (both halves) for one-byte IQ4_XS, a
 * super-block row (act_super; a two-byte IQ4_XS row goes to w16_tile). The weights are signed
 * (the table value): the sign trick |w| * sign(a, w) keeps maddubs' pairs in int16, up to 2 *
 * 127 * 127, so every vector needs its own madd, which multiplies the pair sums by the block's
 * ls - 32 (avx2_tile1_iq4_xs's integers), and each half's int32 sum runs over the super-block
 * before its one float step. */
TD_INLINE TD_Y void avx2_row1_iq4_xs(const unsigned char *gq, size_t nb, size_t k, const unsigned char *a, float *y,
                                     const unsigned char *pf_end)
{
    const td_dtype_t t = TD_IQ4_XS;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    /* IQ4_XS: the signed values of the indices in both lanes, for vpshufb */
    const __m256i iq4s = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)td_quant_iq4nl_values));
    const int8_t *hi = act_hi(a);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256i big[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* P of each half */
    for (size_t b = 0; b < nb; b++) {
        decode_prefetch(t, gq, b, pf_end);
        const unsigned char *qblk = gq + block_at(t, b), *cs = gq + chunk_scales_at(t, nb, b);
        const int8_t *qh = hi + b * TD_QK;
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const unsigned char *q = qblk + 32 * h;
            const __m256i scv = avx2_scale_pairs(cs + XS_SC(b % 8) + 8 * h, true); /* (ls-32, ls-32) a row */
            __m256i p = big[h];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v));
                __m256i sl = _mm256_shuffle_epi8(iq4s, _mm256_and_si256(raw, low4));
                __m256i sh = _mm256_shuffle_epi8(iq4s, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
                __m256i al = _mm256_abs_epi8(sl), ah = _mm256_abs_epi8(sh);
                p = _mm256_add_epi32(p, _mm256_add_epi32(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(al, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qh + 4 * v)), sl)), scv),
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ah, _mm256_sign_epi8(_mm256_set1_epi32(load_i32(qh + 16 + 4 * v)), sh)), scv)));
            }
            big[h] = p;
            if (b % PACK_CHUNK == PACK_CHUNK - 1) { /* the super-block's float step */
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + 16 * h)));
                const __m256 e = _mm256_set1_ps(load_f32(act_e(a, k) + 4 * b));
                acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d, e), acc[h]);
                big[h] = _mm256_setzero_si256();
            }
        }
    }
    for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(y + 8 * h, acc[h]);
}

/* Decode's one activation row against a whole Q4_K group (both halves), a super-block row
 * (act_super): avx2_row1's integers (a v's broadcasts serve both halves, maddubs' pair sums in
 * int16 over the block's 4 v) widened by the block's sc instead of 254, each half's int32 sum
 * over the super-block and one float step a super-block; the offset terms a block each, as
 * avx2_row1's. The blocks are walked chunk by chunk (a block's quants and scales at constant
 * offsets of its chunk's) and the v loop is rolled, as avx2_row1's one-byte Q4_K. */
TD_INLINE TD_Y void avx2_row1_q4_k(const unsigned char *gq, size_t nb, size_t k, const unsigned char *a, float *y,
                                   const unsigned char *pf_end)
{
    const td_dtype_t t = TD_Q4_K;
    const size_t qb = quant_bytes(t), sb = scale_bytes(t);
    const int8_t *hi = act_hi(a);
    const unsigned char *ev = act_e(a, k), *cv = act_c(a, k);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, macc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (size_t c0 = 0; c0 < nb; c0 += PACK_CHUNK) { /* a super-block (k % 256 == 0) */
        const unsigned char *qc = gq + c0 * (qb + sb), *cs = qc + PACK_CHUNK * qb; /* its quants, its scales */
        __m256i big[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* P of each half */
        for (size_t j = 0; j < PACK_CHUNK; j++) {
            const size_t b = c0 + j;
            decode_prefetch(t, gq, b, pf_end);
            const unsigned char *q = qc + j * qb;
            const int8_t *qh = hi + b * TD_QK;
            __m256i sh[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, sl[2];
#pragma GCC unroll 1
            for (int v = 0; v < 4; v++)
                avx2_row1_v(t, true, false, v, q, qh, qh, sh, sl);
            const __m256 cb = _mm256_set1_ps(load_f32(cv + 4 * b));
#pragma GCC unroll 2
            for (int x = 0; x < 2; x++) {
                big[x] = _mm256_add_epi32(big[x], _mm256_madd_epi16(sh[x], avx2_scale_pairs(cs + K_SC(j) + 8 * x, false)));
                const __m128i mn8 = _mm_loadl_epi64((const __m128i *)(cs + K_MN(j) + 8 * x));
                const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + K_DMIN + 16 * x)));
                const __m256 mw = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn8))),
                                                _mm256_set1_ps(-0.0f)); /* -(dmin * mn), NaN signs as scalar's */
                macc[x] = _mm256_fmadd_ps(mw, cb, macc[x]);
            }
        }
        const __m256 e = _mm256_set1_ps(load_f32(ev + 4 * c0));
#pragma GCC unroll 2
        for (int x = 0; x < 2; x++) { /* the super-block's float step */
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + K_D + 16 * x)));
            acc[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(big[x]), _mm256_mul_ps(d, e), acc[x]);
        }
    }
    for (int x = 0; x < 2; x++)
        _mm256_storeu_ps(y + 8 * x, _mm256_add_ps(acc[x], macc[x]));
}

/* Decode's one activation row against a whole Q8_0 group (issue 32, h32l): the integers of
 * avx2_row1_signed, the type-generic signed row it replaced (since gone: one-byte IQ4_XS has
 * avx2_row1_iq4_xs), the sign trick, a madd every vector, the hi part's by 254, laid out for the
 * stream: the blocks walked chunk by chunk (a block's quants and scales at constant offsets
 * of its chunk's, where block_at and chunk_scales_at cost ~25 scalar instructions a block),
 * both halves in one pass (a v's hi and lo broadcasts serve the 16 rows), every v unrolled
 * with each sum held in its register where it is added (AVX2_KEEP), and the two f32 sums in
 * registers (avx2_row1_signed kept them on the stack). docs/kernels.md. */
TD_INLINE TD_Y void avx2_row1_q8_0(bool one, const unsigned char *gq, size_t nb, size_t k, const unsigned char *a,
                                   float *y, const unsigned char *pf_end)
{
    const __m256i ones = _mm256_set1_epi16(1), wide = _mm256_set1_epi16(WIDE);
    const __m256i bias8 = _mm256_set1_epi8((char)0x80); /* w = u ^ 0x80 in two-byte rows' layout */
    const size_t qb = quant_bytes(TD_Q8_0), sb = scale_bytes(TD_Q8_0);
    const int8_t *hi = act_hi(a), *lo = act_lo(a, k);
    const unsigned char *ae = act_e(a, k);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (size_t c0 = 0; c0 < nb; c0 += PACK_CHUNK) {
        const size_t n_in = nb - c0 < PACK_CHUNK ? nb - c0 : PACK_CHUNK;
        const unsigned char *qc = gq + c0 * (qb + sb), *cs = qc + n_in * qb; /* its quants, its scales */
        for (size_t j = 0; j < n_in; j++) {
            const size_t b = c0 + j;
            decode_prefetch(TD_Q8_0, gq, b, pf_end);
            const unsigned char *q = qc + j * qb;
            const int8_t *qh = hi + b * TD_QK, *ql = lo + b * TD_QK;
            __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                const __m256i ah = _mm256_set1_epi32(load_i32(qh + 4 * v));
                __m256i s0 = _mm256_loadu_si256((const __m256i *)(q + 64 * v));
                __m256i s1 = _mm256_loadu_si256((const __m256i *)(q + 64 * v + 32));
                if (!one) { /* two-byte rows' layout: u */
                    s0 = _mm256_xor_si256(s0, bias8);
                    s1 = _mm256_xor_si256(s1, bias8);
                }
                const __m256i w0 = _mm256_abs_epi8(s0), w1 = _mm256_abs_epi8(s1);
                p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_sign_epi8(ah, s0)), wide));
                AVX2_KEEP(p0);
                p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_sign_epi8(ah, s1)), wide));
                AVX2_KEEP(p1);
                if (!one) {
                    const __m256i al = _mm256_set1_epi32(load_i32(ql + 4 * v));
                    p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_sign_epi8(al, s0)), ones));
                    AVX2_KEEP(p0);
                    p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_sign_epi8(al, s1)), ones));
                    AVX2_KEEP(p1);
                }
            }
            const __m256 e = _mm256_set1_ps(load_f32(ae + 4 * b));
            const unsigned char *s = cs + j * sb; /* 16 f16 d, row order */
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0),
                                   _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s)), e), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                                   _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16))), e), acc1);
        }
    }
    _mm256_storeu_ps(y, acc0);
    _mm256_storeu_ps(y + 8, acc1);
}

#define Q6_HI_YMM(hb, v) ((v) == 3 ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 4 - 2 * (v)))

/* Decode's one activation row against a whole Q6_K group: the scalar kernel's sums in another
 * order, so the same integers. maddubs' int16 pair sums of a half (u <= 63: at most 2 * 63 *
 * 127 = 16002) build up over two v (32004 < 2^15) before one madd widens them. One half of
 * the block's weights at a time (h: the low nibbles and hb0, then the high ones and hb1), so
 * a pass holds one set of sums and GCC keeps them in registers: the two halves together
 * (each v's vector unpacked once for both) held 12 accumulators and the broadcasts, and GCC
 * spilled them, the v's products as a tree of adds (one core, m = 1, two-byte, a 2048 x 2048
 * matrix in L2: 21.2 -> 24.4 GB/s; one-byte 30.8 -> 31.5). The vector is loaded once a half
 * (an L1 hit the second time). One-byte rows are super-block rows: the half's exact p = c +
 * sum u hi (|p| <= 16 * 32 * 127) times its int8 sc (vpmulld) into the int32 P of the
 * super-block, |P| < 2^31 (td_cpu_pack.h), one FMA by d * E a super-block. It reads only what
 * every table's quantizer writes (not act_o6: avx512vnni's decode comes here). */
TD_INLINE TD_Y void avx2_row1_q6_k(bool one, const unsigned char *gq, size_t nb, size_t k, const unsigned char *a, float *y,
                                   const unsigned char *pf_end)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const int8_t *hi = act_hi(a), *lo = act_lo(a, k);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256i big[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* one: the super-block's P */
    for (size_t b = 0; b < nb; b++) {
        decode_prefetch(TD_Q6_K, gq, b, pf_end);
        const unsigned char *ks = gq + chunk_scales_at(TD_Q6_K, nb, b), *qb = gq + block_at(TD_Q6_K, b);
        const int8_t *qh = hi + b * TD_QK, *ql = lo + b * TD_QK;
        const __m256 e = _mm256_set1_ps(load_f32(act_e(a, k) + 4 * b));
#pragma GCC unroll 2
        for (int x = 0; x < 2; x++) { /* rows 8x .. 8x + 7 */
            const unsigned char *q = qb + 32 * x;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ks + 16 * x)));
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) { /* weights 16 h + 4 v + j; the halves in the reference's order */
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(q + 256 + 64 * h));
                __m256i p = _mm256_set1_epi32(load_i32((h == 0 ? act_c(a, k) : act_c2(a, k)) + 4 * b));
#pragma GCC unroll 2
                for (int v0 = 0; v0 < 4; v0 += 2) {
                    __m256i sh = _mm256_setzero_si256(), sl = _mm256_setzero_si256();
#pragma GCC unroll 2
                    for (int v = v0; v < v0 + 2; v++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v));
                        const __m256i nib = h == 0 ? raw : _mm256_srli_epi16(raw, 4);
                        const __m256i w = _mm256_or_si256(_mm256_and_si256(nib, low4), _mm256_and_si256(Q6_HI_YMM(hb, v), hi2));
                        sh = _mm256_add_epi16(sh, _mm256_maddubs_epi16(w, _mm256_set1_epi32(load_i32(qh + 16 * h + 4 * v))));
                        AVX2_KEEP(sh);
                        if (!one) {
                            sl = _mm256_add_epi16(sl, _mm256_maddubs_epi16(w, _mm256_set1_epi32(load_i32(ql + 16 * h + 4 * v))));
                            AVX2_KEEP(sl);
                        }
                    }
                    /* widen: hi by 254 and lo by 1 (one byte, a super-block row: hi by 1) */
                    p = _mm256_add_epi32(p, _mm256_madd_epi16(sh, _mm256_set1_epi16(one ? 1 : WIDE)));
                    if (!one)
                        p = _mm256_add_epi32(p, _mm256_madd_epi16(sl, _mm256_set1_epi16(1)));
                    AVX2_KEEP(p);
                }
                const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(ks + K6_SC(b % 8, h) + 8 * x)));
                if (one) {
                    big[x] = _mm256_add_epi32(big[x], _mm256_mullo_epi32(p, sc));
                } else {
                    __m256 dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                    acc[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, e), acc[x]);
                }
            }
            if (one && b % PACK_CHUNK == PACK_CHUNK - 1) { /* the super-block's float step (e = E) */
                acc[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(big[x]), _mm256_mul_ps(d, e), acc[x]);
                big[x] = _mm256_setzero_si256();
            }
        }
    }
    for (int x = 0; x < 2; x++)
        _mm256_storeu_ps(y + 8 * x, acc[x]);
}

/* Prefill's int16 tiles (two-byte rows, m >= 2). Q = 254 hi + lo is an int16 (the row's
 * act_q16 part) and each weight u (<= 255) widens to one, so vpmaddwd's int16 x int16 pairs,
 * summed in int32, give each block's p = c + sum u Q = 254 p_hi + p_lo with no hi/lo split:
 * the same integer as the maddubs tiles', hence the same bits. One vpmaddwd serves 16 weights
 * of a row (8 weight rows x 2) where the split took two maddubs and a widening madd per 32,
 * and the weights are unpacked to int16 once per block for all R activation rows.
 * w16_pick's two shuffles put bytes 0, 1 (pick[0]) or 2, 3 (pick[1]) of each 32-bit lane
 * (a row's 4 consecutive weights in the layout) into that lane's two int16, zero-extended. */
static const int8_t w16_pick[2][32] = {
    {0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1},
    {2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1, 2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1}};

/* p[x][i] += the products of weight bytes wb[x] (half h0 + x; lane r: row r's weights
 * e0..e0 + 3) with activation row i's Q at e0.. (q16 + off of each row): each broadcast of
 * a Q pair serves the H halves */
#define W16_DOT(wb, off)                                                                          \
    do {                                                                                          \
        __m256i w0_[2], w1_[2];                                                                   \
        _Pragma("GCC unroll 2") for (int x = 0; x < H; x++)                                       \
        {                                                                                         \
            w0_[x] = _mm256_shuffle_epi8(wb[x], pick0);                                           \
            w1_[x] = _mm256_shuffle_epi8(wb[x], pick1);                                           \
        }                                                                                         \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)                                       \
        {                                                                                         \
            const unsigned char *qi_ = q16 + i * stride + (off);                                  \
            const __m256i q0_ = _mm256_set1_epi32(load_i32(qi_)), q1_ = _mm256_set1_epi32(load_i32(qi_ + 4)); \
            _Pragma("GCC unroll 2") for (int x = 0; x < H; x++)                                   \
            {                                                                                     \
                p[x][i] = _mm256_add_epi32(p[x][i], _mm256_madd_epi16(w0_[x], q0_));              \
                p[x][i] = _mm256_add_epi32(p[x][i], _mm256_madd_epi16(w1_[x], q1_));              \
                AVX2_KEEP(p[x][i]);                                                                \
            }                                                                                     \
        }                                                                                         \
    } while (0)

/* Halves [h0, h0 + H) (weight rows 8h..8h+7) of one group against R two-byte activation
 * rows (R * H <= 8): the header's sum, each block's integers through vpmaddwd (above).
 * Q6_K's two halves of a block are two passes over its vectors (their sums apart, in the
 * reference's order); the offset terms M of Q4_1, Q4_K and Q5_K are a second pass over the
 * blocks (the same fmaf order, registers free for the tile). */
TD_INLINE TD_Y void w16_tile(td_dtype_t t, int R, int h0, int H, const unsigned char *gq, size_t nb, size_t k,
                             const unsigned char *a, size_t stride, float *y, size_t ldy, const unsigned char *pf_end)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), hi2 = _mm256_set1_epi8(0x30);
    const __m256i pick0 = _mm256_loadu_si256((const __m256i *)w16_pick[0]);
    const __m256i pick1 = _mm256_loadu_si256((const __m256i *)w16_pick[1]);
    /* IQ4_XS: u = value + 128 of each index, for vpshufb */
    const __m256i iq4u = _mm256_xor_si256(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)td_quant_iq4nl_values)), _mm256_set1_epi8((char)0x80));
    const unsigned char *q16 = act_q16(a, k);
    __m256 acc[2][8];
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            acc[x][i] = _mm256_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        if (pf_end) /* the group's first sweep */
            decode_prefetch(t, gq, b, pf_end);
        const unsigned char *q = gq + block_at(t, b) + 32 * h0, *cs = gq + chunk_scales_at(t, nb, b);
        const size_t qb = 2 * b * TD_QK; /* block b's Q in each row's q16 */
        if (t == TD_Q6_K) {
#pragma GCC unroll 2
            for (int s = 0; s < 2; s++) { /* weights 16 s .. 16 s + 15 */
                __m256i p[2][8];
                for (int x = 0; x < H; x++)
                    for (int i = 0; i < R; i++)
                        p[x][i] = _mm256_set1_epi32(load_i32((s ? act_c2(a + i * stride, k) : act_c(a + i * stride, k)) + 4 * b));
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) {
                    __m256i wb[2];
                    for (int x = 0; x < H; x++) {
                        __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 32 * x + 64 * v));
                        __m256i hb = _mm256_loadu_si256((const __m256i *)(q + 32 * x + 256 + 64 * s));
                        wb[x] = _mm256_or_si256(_mm256_and_si256(s ? _mm256_srli_epi16(raw, 4) : raw, low4),
                                                _mm256_and_si256(Q6_HI_YMM(hb, v), hi2));
                    }
                    W16_DOT(wb, qb + 2 * (16 * s + 4 * v));
                }
                for (int x = 0; x < H; x++) {
                    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + 16 * (h0 + x))));
                    __m256 dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                     _mm_loadl_epi64((const __m128i *)(cs + K6_SC(b % 8, s) + 8 * (h0 + x))))));
                    for (int i = 0; i < R; i++) {
                        __m256 e = _mm256_set1_ps(load_f32(act_e(a + i * stride, k) + 4 * b));
                        acc[x][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[x][i]), _mm256_mul_ps(dw, e), acc[x][i]);
                    }
                }
            }
            continue;
        }
        __m256i p[2][8];
        for (int x = 0; x < H; x++)
            for (int i = 0; i < R; i++) /* Q4_0, Q8_0, IQ4_XS: the offset's c; the others' M is apart */
                p[x][i] = has_min(t) ? _mm256_setzero_si256() : _mm256_set1_epi32(load_i32(act_c(a + i * stride, k) + 4 * b));
        if (t == TD_Q8_0) {
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                __m256i wb[2];
                for (int x = 0; x < H; x++) /* u, as two-byte rows' layout stores it */
                    wb[x] = _mm256_loadu_si256((const __m256i *)(q + 32 * x + 64 * v));
                W16_DOT(wb, qb + 2 * 4 * v);
            }
        } else {
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                __m256i lo4[2], hi4[2];
                for (int x = 0; x < H; x++) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 32 * x + 64 * v));
                    lo4[x] = _mm256_and_si256(raw, low4);
                    hi4[x] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                    if (t == TD_Q5_K) { /* the fifth bits: weight 4v + j's at bit v, 16 + 4v + j's at 4 + v */
                        const __m256i hb = _mm256_loadu_si256((const __m256i *)(q + 32 * x + 256));
                        lo4[x] = _mm256_or_si256(lo4[x], _mm256_and_si256(_mm256_slli_epi16(hb, 4 - v), bit4));
                        hi4[x] = _mm256_or_si256(hi4[x], _mm256_and_si256(_mm256_srli_epi16(hb, v), bit4));
                    }
                    if (t == TD_IQ4_XS) {
                        lo4[x] = _mm256_shuffle_epi8(iq4u, lo4[x]);
                        hi4[x] = _mm256_shuffle_epi8(iq4u, hi4[x]);
                    }
                }
                W16_DOT(lo4, qb + 2 * 4 * v);
                W16_DOT(hi4, qb + 2 * (16 + 4 * v));
            }
        }
        for (int x = 0; x < H; x++) {
            __m256 dw, mw;
            avx2_scales(t, cs, b, h0 + x, &dw, &mw);
            for (int i = 0; i < R; i++) {
                __m256 e = _mm256_set1_ps(load_f32(act_e(a + i * stride, k) + 4 * b));
                acc[x][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[x][i]), _mm256_mul_ps(dw, e), acc[x][i]);
            }
        }
    }
    for (int x = 0; x < H; x++) {
        if (has_min(t)) { /* M = sum over blocks of m * c, in block order */
            __m256 macc[8];
            for (int i = 0; i < R; i++)
                macc[i] = _mm256_setzero_ps();
            for (size_t b = 0; b < nb; b++) {
                __m256 dw, mw;
                avx2_scales(t, gq + chunk_scales_at(t, nb, b), b, h0 + x, &dw, &mw);
                for (int i = 0; i < R; i++)
                    macc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(load_f32(act_c(a + i * stride, k) + 4 * b)), macc[i]);
            }
            for (int i = 0; i < R; i++)
                acc[x][i] = _mm256_add_ps(acc[x][i], macc[i]);
        }
        for (int i = 0; i < R; i++)
            _mm256_storeu_ps(y + i * ldy + 8 * (h0 + x), acc[x][i]);
    }
}

/* The int16 tile of type t: R rows by H halves. Both halves a tile, each Q broadcast feeding
 * two vpmaddwd, paid for Q4_0, Q4_1 and Q8_0 (one core, m = 64, 2048 x 2048: q4_0 3.85 ms
 * against 4.25 for 8 rows by one half, q8_0 3.73 against 4.11, q4_1 4.12 against 4.33); the
 * K-quants and IQ4_XS, with more scale work a block, read alike or slower that way. */
#define W16_R(t) (w16_both_halves(t) ? 4 : 8)
#define W16_H(t) (w16_both_halves(t) ? 2 : 1)
TD_INLINE bool w16_both_halves(td_dtype_t t)
{
    return t == TD_Q4_0 || t == TD_Q4_1 || t == TD_Q8_0;
}

/* Q6_K's one-byte prefill tile (m >= 2, `--device cpu:q8`; super-block rows): half h of a
 * group (8 weight rows) against R one-byte rows, R <= Q6_TILE. maddubs' int16 lanes of row r
 * hold the products of two weights, those of a block's 16-weight half at positions {0, 1}
 * (even lanes) or {2, 3} (odd) mod 4; over the half's 4 vectors each lane sums 8 of them, u <=
 * 63 against |hi| <= 127, up to 64008, too much for int16. But a lane that starts at -32 times
 * the sum of its 8 hi (the row's act_o6 pair, made by the quantizer) ends at sum (u - 32) hi,
 * |.| <= 32 * 8 * 127 = 32512: in range, so vpaddw's wrapping leaves it exact whatever the
 * order. One madd by the half's int8 sc (sign-extended, as an int16 pair a row) then gives sc
 * times the half's c + sum u hi, |.| <= 128 * 2 * 32512 = 8,323,072 a lane, added into the
 * row's int32 P; 16 halves a super-block, |P| <= 133,169,152 < 2^31 (td_cpu_pack.h), and one
 * FMA by d * E a super-block (issue 32: one float step where the per-32 rows took a madd by
 * 254, a cvt, a mul and an FMA a row and half). Per row and block: 8 maddubs, 2 madd, 2 add.
 * The block's 8 weight vectors and the halves' scales are made once for the R rows, which go
 * one at a time, one pointer and a stride opaque to GCC (no pointer a row kept live); the
 * int32 and f32 sums live in memory (volatile, as avx2_tile1_q4's), so R costs no register and
 * 16 rows share each block's unpacking; the blocks are walked chunk by chunk (a chunk is a
 * super-block), a block's quants and scales at constant offsets. docs/kernels.md. */
#define Q6_TILE 16 /* the widest tile's rows (its sums in memory, so R costs no register) */
TD_INLINE TD_Y void avx2_tile1_q6_k(int R, int h, const unsigned char *gq, size_t nb, size_t k, const unsigned char *a,
                                      size_t stride, float *y, size_t ldy, const unsigned char *pf_end)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    const size_t e_at = act_e(a, k) - a, o_at = act_o6(a, k) - a;
    const size_t qb = quant_bytes(TD_Q6_K), sb = scale_bytes(TD_Q6_K);
    volatile __m256 acc[Q6_TILE];
    volatile __m256i iacc[Q6_TILE];
    for (int i = 0; i < R; i++)
        acc[i] = _mm256_setzero_ps();
    for (size_t c0 = 0; c0 < nb; c0 += PACK_CHUNK) {
        const size_t n_in = nb - c0 < PACK_CHUNK ? nb - c0 : PACK_CHUNK;
        const unsigned char *qc = gq + c0 * (qb + sb), *cs = qc + n_in * qb;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + 16 * h)));
        for (int i = 0; i < R; i++)
            iacc[i] = _mm256_setzero_si256();
        for (size_t j = 0; j < n_in; j++) {
            const size_t b = c0 + j;
            if (pf_end)
                decode_prefetch(TD_Q6_K, gq, b, pf_end);
            const unsigned char *q = qc + j * qb + 32 * h;
            size_t st = stride;
            __asm__("" : "+r"(st));
            __m256i w[2][4], scv[2];
#pragma GCC unroll 2
            for (int s = 0; s < 2; s++) {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(q + 256 + 64 * s));
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v));
                    w[s][v] = _mm256_or_si256(_mm256_and_si256(s ? _mm256_srli_epi16(raw, 4) : raw, low4),
                                              _mm256_and_si256(Q6_HI_YMM(hb, v), hi2));
                }
                scv[s] = avx2_scale_pairs(cs + K6_SC(j, s) + 8 * h, true);
            }
#pragma GCC unroll 16
            for (int i = 0; i < R; i++) {
                const unsigned char *ai = a + i * st;
                __m256i t = iacc[i];
#pragma GCC unroll 2
                for (int s = 0; s < 2; s++) {
                    const unsigned char *qh = ai + b * TD_QK + 16 * s;
                    __m256i s16 = _mm256_set1_epi32(load_i32(ai + o_at + 8 * b + 4 * s));
#pragma GCC unroll 4
                    for (int v = 0; v < 4; v++)
                        s16 = _mm256_add_epi16(
                            s16, _mm256_maddubs_epi16(w[s][v], _mm256_set1_epi32(load_i32(qh + 4 * v))));
                    t = _mm256_add_epi32(t, _mm256_madd_epi16(s16, scv[s]));
                }
                iacc[i] = t;
            }
        }
        for (int i = 0; i < R; i++) {
            const __m256 e = _mm256_set1_ps(load_f32(a + i * stride + e_at + 4 * c0));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps((__m256i)iacc[i]), _mm256_mul_ps(d, e), (__m256)acc[i]);
        }
    }
    for (int i = 0; i < R; i++)
        _mm256_storeu_ps(y + i * ldy + 8 * h, acc[i]);
}

/* The one-byte prefill tile of the 4-bit types (Q4_0, Q4_1, Q4_K, Q5_K; m >= 2, `--device
 * cpu:q8`): H halves of a group from h0 (8 weight rows each) against R one-byte rows, R * H <=
 * 8. Per row, half and block, maddubs' int16 pair sums build up over the block's 4 vectors (u
 * <= 15: 8 pairs of at most 2 * 15 * 127, 30480 < 2^15; Q5_K's u <= 31 over 2 vectors, 31496)
 * before one madd by 254 widens them, where the tile before it widened every vector: 8 maddubs
 * and 1 madd a row and block instead of 8 and 4. The registers go to what every vector
 * touches: R * H int16 sums, 2 H weight vectors, a row's two broadcasts and 2 constants. With
 * both halves (H = 2, 4 rows) each broadcast of a row's activations feeds two maddubs, one a
 * half: per row and block 8 broadcasts serve 16 maddubs, where 8 rows by one half spend 16 on
 * them (one core, m = 64, 2048 x 2048: q4_k 2.64 -> 2.55 ms, q4_0 2.34 -> 2.20, q4_1 2.51 ->
 * 2.41); Q5_K, whose fifth bits take two more vectors a half, reads slower that way (2.92 ->
 * 3.21) and keeps 8 rows by one half (Q4_R, Q4_H). Q4_K's d is widened a block and half (held
 * a chunk, it took a register the 4-row loop needs: q4_k 2.57-2.67 ms). The f32 sums live in
 * memory (volatile: a load and a store a row, half and block, at fixed stack offsets, where in
 * registers they spilled anyway), the offset terms m * c of Q4_1, Q4_K and Q5_K are a pass of
 * their own before the tile (avx2_min_q4, the reference's fmaf order, so its bits), Q4_0's c
 * is added after the widening, and the rows' addresses are one pointer and `stride` (opaque
 * to GCC, so it does not keep a pointer a row live and spill them). docs/kernels.md. */
#define Q4_R(t) ((t) == TD_Q5_K ? 8 : 4)
#define Q4_H(t) ((t) == TD_Q5_K ? 1 : 2)
TD_INLINE TD_Y void avx2_tile1_q4(td_dtype_t t, int R, int h0, int H, const unsigned char *gq, size_t nb, size_t k,
                                  const unsigned char *a, size_t stride, float *y, size_t ldy, const unsigned char *pf_end)
{
    const int flush = t == TD_Q5_K ? 2 : 4; /* vectors summed in int16 before widening */
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), wide = _mm256_set1_epi16(WIDE);
    const size_t e_at = act_e(a, k) - a, c_at = act_c(a, k) - a, qb = quant_bytes(t), sb = scale_bytes(t);
    volatile __m256 acc[2][8]; /* in memory on purpose (above) */
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            acc[x][i] = _mm256_setzero_ps();
    for (size_t c0 = 0; c0 < nb; c0 += PACK_CHUNK) { /* chunk by chunk: no index arithmetic a block */
        const size_t n_in = nb - c0 < PACK_CHUNK ? nb - c0 : PACK_CHUNK;
        const unsigned char *qc = gq + c0 * (qb + sb), *cs = qc + n_in * qb; /* its quants, its scales */
        for (size_t j = 0; j < n_in; j++) {
            const size_t b = c0 + j;
            if (pf_end) /* the group's first sweep */
                decode_prefetch(t, gq, b, pf_end);
            const unsigned char *q = qc + j * qb + 32 * h0;
            const unsigned char *ab = a + b * TD_QK; /* row 0's hi of block b */
            size_t st = stride;
            __asm__("" : "+r"(st)); /* rows at ab + i * st: no pointer a row */
            __m256i p[2][8];
#pragma GCC unroll 2
            for (int v0 = 0; v0 < 4; v0 += flush) {
                __m256i s16[2][8];
#pragma GCC unroll 8
                for (int v = v0; v < v0 + flush; v++) {
                    __m256i lo4[2], hi4[2];
#pragma GCC unroll 2
                    for (int x = 0; x < H; x++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v + 32 * x));
                        lo4[x] = _mm256_and_si256(raw, low4);
                        hi4[x] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                        if (t == TD_Q5_K) { /* the fifth bits: weight 4v + j's at bit v, 16 + 4v + j's at 4 + v */
                            const __m256i hb = _mm256_loadu_si256((const __m256i *)(q + 256 + 32 * x));
                            lo4[x] = _mm256_or_si256(lo4[x], _mm256_and_si256(_mm256_slli_epi16(hb, 4 - v), bit4));
                            hi4[x] = _mm256_or_si256(hi4[x], _mm256_and_si256(_mm256_srli_epi16(hb, v), bit4));
                        }
                    }
#pragma GCC unroll 8
                    for (int i = 0; i < R; i++) {
                        const unsigned char *qh = ab + i * st;
                        const __m256i al = _mm256_set1_epi32(load_i32(qh + 4 * v));
                        const __m256i ah = _mm256_set1_epi32(load_i32(qh + 16 + 4 * v));
#pragma GCC unroll 2
                        for (int x = 0; x < H; x++) {
                            const __m256i s =
                                _mm256_add_epi16(_mm256_maddubs_epi16(lo4[x], al), _mm256_maddubs_epi16(hi4[x], ah));
                            s16[x][i] = v == v0 ? s : _mm256_add_epi16(s16[x][i], s);
                            AVX2_KEEP(s16[x][i]);
                        }
                    }
                }
#pragma GCC unroll 2
                for (int x = 0; x < H; x++)
#pragma GCC unroll 8
                    for (int i = 0; i < R; i++) {
                        const __m256i w = _mm256_madd_epi16(s16[x][i], wide);
                        p[x][i] = v0 == 0 ? w : _mm256_add_epi32(p[x][i], w);
                    }
            }
#pragma GCC unroll 2
            for (int x = 0; x < H; x++) {
                __m256 dw, mw;
                if (k_scales(t)) /* d * sc: the scalar kernel's exact product */
                    dw = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + K_D + 16 * (h0 + x)))),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                                  _mm_loadl_epi64((const __m128i *)(cs + K_SC(j) + 8 * (h0 + x))))));
                else
                    avx2_scales(t, cs, j, h0 + x, &dw, &mw);
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    __m256i pi = p[x][i];
                    if (t == TD_Q4_0) /* the offset's c, last (the same integer sum in another order) */
                        pi = _mm256_add_epi32(pi, _mm256_set1_epi32(load_i32(a + i * st + c_at + 4 * b)));
                    const __m256 e = _mm256_set1_ps(load_f32(a + i * st + e_at + 4 * b));
                    acc[x][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pi), _mm256_mul_ps(dw, e), (__m256)acc[x][i]);
                }
            }
        }
    }
    for (int x = 0; x < H; x++) /* Q4_1, Q4_K, Q5_K: y holds M (avx2_min_q4), y = acc + M */
        for (int i = 0; i < R; i++) {
            float *yi = y + i * ldy + 8 * (h0 + x);
            _mm256_storeu_ps(yi, has_min(t) ? _mm256_add_ps(acc[x][i], _mm256_loadu_ps(yi)) : acc[x][i]);
        }
}


/* The super-block tile of Q4_K (one-byte rows, act_super; every m, decode too; issue 32,
 * h32q): R rows by H halves from h0, R * H <= 8, as avx2_tile1_q4 (a row's maddubs pair sums
 * in int16 over the block's 4 vectors, 8 pairs of at most 2 * 15 * 127 = 30480 < 2^15), but the
 * madd that widens them multiplies by the block's 6-bit sc (an int16 pair a weight row) where
 * avx2_tile1_q4 took 254, so each row's int32 sum runs over the super-block, P = sum sc_b sum
 * q hi (|P| <= 8 * 63 * 30480 * 2 < 2^25), kept in memory as the f32 sums are (the loop's
 * registers go to the int16 sums), and the float step is one a super-block: acc = fmaf((float)P,
 * d * E, acc). The offset terms m_b * c_b stay a block each, avx2_min_q4's pass into y, added
 * last as in avx2_tile1_q4. One core, m = 64, 2048 x 2048: 1.90 -> 1.76 ms (docs/kernels.md). */
TD_INLINE TD_Y void avx2_tile1_q4_k(int R, int h0, int H, const unsigned char *gq, size_t nb, size_t k,
                                      const unsigned char *a, size_t stride, float *y, size_t ldy,
                                      const unsigned char *pf_end)
{
    const td_dtype_t t = TD_Q4_K;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const size_t e_at = act_e(a, k) - a, qb = quant_bytes(t), sb = scale_bytes(t);
    volatile __m256 acc[2][8];   /* in memory on purpose (avx2_tile1_q4) */
    volatile __m256i iacc[2][8]; /* P of each row and half, likewise */
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            acc[x][i] = _mm256_setzero_ps();
    for (size_t c0 = 0; c0 < nb; c0 += PACK_CHUNK) {
        const size_t n_in = nb - c0 < PACK_CHUNK ? nb - c0 : PACK_CHUNK;
        const unsigned char *qc = gq + c0 * (qb + sb), *cs = qc + n_in * qb;
        for (int x = 0; x < H; x++)
            for (int i = 0; i < R; i++)
                iacc[x][i] = _mm256_setzero_si256();
        for (size_t j = 0; j < n_in; j++) {
            const size_t b = c0 + j;
            if (pf_end)
                decode_prefetch(t, gq, b, pf_end);
            const unsigned char *q = qc + j * qb + 32 * h0;
            const unsigned char *ab = a + b * TD_QK;
            size_t st = stride;
            __asm__("" : "+r"(st));
            __m256i s16[2][8];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                __m256i lo4[2], hi4[2];
#pragma GCC unroll 2
                for (int x = 0; x < H; x++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v + 32 * x));
                    lo4[x] = _mm256_and_si256(raw, low4);
                    hi4[x] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                }
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    const unsigned char *qh = ab + i * st;
                    const __m256i al = _mm256_set1_epi32(load_i32(qh + 4 * v));
                    const __m256i ah = _mm256_set1_epi32(load_i32(qh + 16 + 4 * v));
#pragma GCC unroll 2
                    for (int x = 0; x < H; x++) {
                        const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo4[x], al), _mm256_maddubs_epi16(hi4[x], ah));
                        s16[x][i] = v == 0 ? s : _mm256_add_epi16(s16[x][i], s);
                        AVX2_KEEP(s16[x][i]);
                    }
                }
            }
#pragma GCC unroll 2
            for (int x = 0; x < H; x++) {
                const __m256i scv = avx2_scale_pairs(cs + K_SC(j) + 8 * (h0 + x), false);
#pragma GCC unroll 8
                for (int i = 0; i < R; i++)
                    iacc[x][i] = _mm256_add_epi32((__m256i)iacc[x][i], _mm256_madd_epi16(s16[x][i], scv));
            }
        }
#pragma GCC unroll 2
        for (int x = 0; x < H; x++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + K_D + 16 * (h0 + x))));
#pragma GCC unroll 8
            for (int i = 0; i < R; i++) {
                const __m256 e = _mm256_set1_ps(load_f32(a + i * stride + e_at + 4 * c0));
                acc[x][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps((__m256i)iacc[x][i]), _mm256_mul_ps(d, e), (__m256)acc[x][i]);
            }
        }
    }
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++) {
            float *yi = y + i * ldy + 8 * (h0 + x);
            _mm256_storeu_ps(yi, _mm256_add_ps(acc[x][i], _mm256_loadu_ps(yi)));
        }
}

/* The offset terms M = sum over blocks of m * c (Q4_1, Q4_K, Q5_K), in block order, of half h
 * of a group against R <= 8 activation rows, into y for avx2_tile1_q4 to add its sums to. Apart
 * from the integer tile, whose registers they would take, and for 8 rows at a time: a block's
 * m is made once for 8 rows, and 8 independent fmaf chains hide the instruction's latency
 * (in the 4-row tile, after its integer pass, this pass took ~15% of its time). */
TD_INLINE TD_Y void avx2_min_q4(td_dtype_t t, int R, int h, const unsigned char *gq, size_t nb, size_t k,
                                const unsigned char *a, size_t stride, float *y, size_t ldy)
{
    const size_t c_at = act_c(a, k) - a;
    __m256 macc[8];
    for (int i = 0; i < R; i++)
        macc[i] = _mm256_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        __m256 dw, mw;
        avx2_scales(t, gq + chunk_scales_at(t, nb, b), b, h, &dw, &mw);
#pragma GCC unroll 8
        for (int i = 0; i < R; i++)
            macc[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(load_f32(a + i * stride + c_at + 4 * b)), macc[i]);
    }
    for (int i = 0; i < R; i++)
        _mm256_storeu_ps(y + i * ldy + 8 * h, macc[i]);
}

/* kernel_avx2's one-byte prefill of the 4-bit types: tiles of Q4_R(t) rows by Q4_H(t) halves,
 * then one of the rest; the offset terms first. super: Q4_K's super-block rows (any m), whose
 * tile is avx2_tile1_q4_k */
TD_INLINE TD_Y void kernel_avx2_q4_one(td_dtype_t t, bool super, const unsigned char *gq, size_t nb, size_t k, const unsigned char *a,
                                       size_t m, size_t stride, float *yg, size_t ldy, const unsigned char *end)
{
    for (int h = 0; h < 2 && has_min(t); h++) {
        size_t i = 0;
        for (; i + 8 <= m; i += 8)
            avx2_min_q4(t, 8, h, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy);
        const unsigned char *ai = a + i * stride;
        float *yi = yg + i * ldy;
#define MIN_Q4(R) avx2_min_q4(t, R, h, gq, nb, k, ai, stride, yi, ldy)
        AVX2_REST(m - i, MIN_Q4);
#undef MIN_Q4
    }
    const int R = Q4_R(t), H = Q4_H(t);
    if (super) { /* Q4_K's super-block rows: 4 rows by both halves, then one tile of the rest */
        size_t i = 0;
        for (; i + 4 <= m; i += 4)
            avx2_tile1_q4_k(4, 0, 2, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy, i == 0 ? end : NULL);
        const unsigned char *ai = a + i * stride, *pf = i == 0 ? end : NULL;
        float *yi = yg + i * ldy;
#define TILE1_Q4_K(R) avx2_tile1_q4_k(R, 0, 2, gq, nb, k, ai, stride, yi, ldy, pf)
        AVX2_REST(m - i, TILE1_Q4_K);
#undef TILE1_Q4_K
        return;
    }
    for (int h = 0; h < 2; h += H) {
        size_t i = 0;
        for (; i + (size_t)R <= m; i += (size_t)R)
            avx2_tile1_q4(t, R, h, H, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy,
                          h == 0 && i == 0 ? end : NULL);
        const unsigned char *ai = a + i * stride, *pf = h == 0 && i == 0 ? end : NULL;
        float *yi = yg + i * ldy;
#define TILE1_Q4(R) avx2_tile1_q4(t, R, h, (R) * H <= 8 ? H : 1, gq, nb, k, ai, stride, yi, ldy, pf) /* R * H <= 8 */
        AVX2_REST(m - i, TILE1_Q4);
#undef TILE1_Q4
    }
}

/* The one-byte prefill tile of Q8_0 (m >= 2, `--device cpu:q8`; issue 32, h32n; it took IQ4_XS
 * too until avx2_tile1_iq4_xs, the same integers a vector and row with the block's scale in the
 * madd, h32q): H halves of a group from h0 (8 weight rows each) against R one-byte rows, R * H <=
 * 8. Each weight vector w (8 rows x 4 weights; Q8_0 u ^ 0x80, IQ4_XS the table value by
 * vpshufb) and |w| are made once a block for the R rows; a row's broadcast of 4 activation bytes
 * a then meets it as maddubs(|w|, sign(a, w)): the products w a in pairs of at most 2 * 128 *
 * 127 = 32512 < 2^15 (|w| <= 128 read unsigned, Q8_0's -128 included; |a| <= 127), so no
 * saturation, and one madd by 254 widens each pair sum (the hi part's weight in Q = 254 hi):
 * a block's p = 254 sum w hi = c + sum u Q, the reference's integer, in one int32 sum a row and
 * half. With full-range 8-bit weights no two pair sums fit int16, so a madd every 32 products
 * is the floor here as in w16_tile (a madd every 16 with a vpaddd each), but one 4-byte
 * broadcast serves 32 products where w16_tile's serves 16 and needs its weights widened by two
 * vpshufb a vector. The f32 sums live in memory and the rows are one pointer and an opaque
 * stride, as in avx2_tile1_q4. 8 rows by half a group beat 4 by both halves for both types
 * (the loop then holds 8 int32 sums, the weights and a row's broadcasts). One core, m = 64,
 * 2048 x 2048 (docs/kernels.md), w16_tile -> this: iq4_xs 3.52 -> 2.91-2.97 ms, q8_0 2.96 ->
 * 2.69-2.75. */
#define SIGNED_R 8
#define SIGNED_H 1
TD_INLINE TD_Y void avx2_tile1_signed(td_dtype_t t, int R, int h0, int H, const unsigned char *gq, size_t nb, size_t k,
                                      const unsigned char *a, size_t stride, float *y, size_t ldy,
                                      const unsigned char *pf_end)
{
    TD_ASSERT(t == TD_Q8_0);
    const __m256i wide = _mm256_set1_epi16(WIDE);
    const size_t e_at = act_e(a, k) - a, qb = quant_bytes(t), sb = scale_bytes(t);
    volatile __m256 acc[2][8]; /* in memory on purpose (avx2_tile1_q4) */
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            acc[x][i] = _mm256_setzero_ps();
    for (size_t c0 = 0; c0 < nb; c0 += PACK_CHUNK) { /* chunk by chunk: no index arithmetic a block */
        const size_t n_in = nb - c0 < PACK_CHUNK ? nb - c0 : PACK_CHUNK;
        const unsigned char *qc = gq + c0 * (qb + sb), *cs = qc + n_in * qb; /* its quants, its scales */
        for (size_t j = 0; j < n_in; j++) {
            const size_t b = c0 + j;
            if (pf_end) /* the group's first sweep */
                decode_prefetch(t, gq, b, pf_end);
            const unsigned char *q = qc + j * qb + 32 * h0;
            const unsigned char *ab = a + b * TD_QK; /* row 0's hi of block b */
            size_t st = stride;
            __asm__("" : "+r"(st)); /* rows at ab + i * st: no pointer a row */
            __m256i p[2][8];
#pragma GCC unroll 8
            for (int v = 0; v < 8; v++) {
                __m256i w[2], aw[2]; /* [half] */
#pragma GCC unroll 2
                for (int x = 0; x < H; x++) {
                    w[x] = _mm256_loadu_si256((const __m256i *)(q + 64 * v + 32 * x)); /* q: one-byte layout */
                    aw[x] = _mm256_abs_epi8(w[x]);
                }
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    const unsigned char *qh = ab + i * st;
                    const __m256i a0 = _mm256_set1_epi32(load_i32(qh + 4 * v));
#pragma GCC unroll 2
                    for (int x = 0; x < H; x++) {
                        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[x], _mm256_sign_epi8(a0, w[x])), wide);
                        p[x][i] = v == 0 ? s : _mm256_add_epi32(p[x][i], s);
                        AVX2_KEEP(p[x][i]);
                    }
                }
            }
#pragma GCC unroll 2
            for (int x = 0; x < H; x++) {
                __m256 dw, mw;
                avx2_scales(t, cs, j, h0 + x, &dw, &mw);
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    const __m256 e = _mm256_set1_ps(load_f32(a + i * st + e_at + 4 * b));
                    acc[x][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[x][i]), _mm256_mul_ps(dw, e), (__m256)acc[x][i]);
                }
            }
        }
    }
    for (int x = 0; x < H; x++)
        for (int i = 0; i < R; i++)
            _mm256_storeu_ps(y + i * ldy + 8 * (h0 + x), acc[x][i]);
}


/* The super-block tile of IQ4_XS (one-byte rows, act_super: one scale a super-block of 256
 * values; every m, decode too; issue 32, h32q): 8 weight rows (half a group, h0) against R <= 8
 * rows. As avx2_tile1_signed did per vector and row (w the table value by vpshufb, |w| made
 * once for the R rows, maddubs(|w|, sign(a, w)): pairs of at most 2 * 127 * 127 = 32258, no
 * saturation), but the madd that widens the pair sums multiplies them by the block's ls - 32
 * (an int16 pair a weight row, -32..31) where it took 254, so each row's int32 sum runs over a
 * whole super-block, P = sum sc_b sum w hi, the reference's integer (|P| <= 8 * 32 * 32 * 127
 * * 127 < 2^28: a madd lane at most 2 * 32 * 32258, a block 8 of those, a super-block 8 blocks),
 * and the float step, a cvt, a mul and an FMA a row, is one a super-block instead of one a
 * block: acc = fmaf((float)P, d * E, acc). One core, m = 64, 2048 x 2048: 2.92 -> 2.73 ms
 * (docs/kernels.md). The R rows meet one weight vector at a time (the low nibbles' vector for
 * every row, then the high ones'): the loop then holds the 8 sums, one vector and its |w|, the
 * scales and the table, where both vectors a row spilled half the sums to the stack (2.75-2.78
 * -> 2.65-2.66 ms; 10 rows spill again: 2.62 -> 2.73-2.76). */
TD_INLINE TD_Y void avx2_tile1_iq4_xs(int R, int h0, const unsigned char *gq, size_t nb, size_t k,
                                      const unsigned char *a, size_t stride, float *y, size_t ldy,
                                      const unsigned char *pf_end)
{
    const td_dtype_t t = TD_IQ4_XS;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i iq4s = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)td_quant_iq4nl_values));
    const size_t e_at = act_e(a, k) - a, qb = quant_bytes(t), sb = scale_bytes(t);
    volatile __m256 acc[8]; /* in memory on purpose (avx2_tile1_q4) */
    for (int i = 0; i < R; i++)
        acc[i] = _mm256_setzero_ps();
    for (size_t c0 = 0; c0 < nb; c0 += PACK_CHUNK) { /* a super-block (n_in = 8: k % 256 == 0) */
        const size_t n_in = nb - c0 < PACK_CHUNK ? nb - c0 : PACK_CHUNK;
        const unsigned char *qc = gq + c0 * (qb + sb), *cs = qc + n_in * qb; /* its quants, its scales */
        __m256i p[8]; /* P of each row */
        for (int i = 0; i < 8; i++)
            p[i] = _mm256_setzero_si256();
        size_t st = stride;
        __asm__("" : "+r"(st)); /* rows at ab + i * st: no pointer a row */
        for (size_t j = 0; j < n_in; j++) {
            const size_t b = c0 + j;
            if (pf_end) /* the group's first sweep */
                decode_prefetch(t, gq, b, pf_end);
            const unsigned char *q = qc + j * qb + 32 * h0;
            const unsigned char *ab = a + b * TD_QK; /* row 0's hi of block b */
            const __m256i scv = avx2_scale_pairs(cs + XS_SC(j) + 8 * h0, true); /* (ls-32, ls-32) a row */
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + 64 * v));
                const __m256i w0 = _mm256_shuffle_epi8(iq4s, _mm256_and_si256(raw, low4));
                const __m256i w1 = _mm256_shuffle_epi8(iq4s, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
                const __m256i aw0 = _mm256_abs_epi8(w0), aw1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    const __m256i a0 = _mm256_set1_epi32(load_i32(ab + i * st + 4 * v));
                    p[i] = _mm256_add_epi32(p[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(a0, w0)), scv));
                    AVX2_KEEP(p[i]);
                }
#pragma GCC unroll 8
                for (int i = 0; i < R; i++) {
                    const __m256i a1 = _mm256_set1_epi32(load_i32(ab + i * st + 16 + 4 * v));
                    p[i] = _mm256_add_epi32(p[i], _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(a1, w1)), scv));
                    AVX2_KEEP(p[i]);
                }
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cs + 16 * h0)));
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) { /* E: the super-block's step, every block's e */
            const __m256 e = _mm256_set1_ps(load_f32(a + i * st + e_at + 4 * c0));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[i]), _mm256_mul_ps(d, e), (__m256)acc[i]);
        }
    }
    for (int i = 0; i < R; i++)
        _mm256_storeu_ps(y + i * ldy + 8 * h0, acc[i]);
}

/* kernel_avx2's IQ4_XS super-block rows (any m): tiles of 8 rows by half a group, then one of
 * the rest */
TD_INLINE TD_Y void kernel_avx2_iq4_xs_one(const unsigned char *gq, size_t nb, size_t k, const unsigned char *a, size_t m,
                                           size_t stride, float *yg, size_t ldy, const unsigned char *end)
{
    for (int h = 0; h < 2; h++) {
        size_t i = 0;
        for (; i + 8 <= m; i += 8)
            avx2_tile1_iq4_xs(8, h, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy, h == 0 && i == 0 ? end : NULL);
        const unsigned char *ai = a + i * stride, *pf = h == 0 && i == 0 ? end : NULL;
        float *yi = yg + i * ldy;
#define TILE1_XS(R) avx2_tile1_iq4_xs(R, h, gq, nb, k, ai, stride, yi, ldy, pf)
        AVX2_REST(m - i, TILE1_XS);
#undef TILE1_XS
    }
}

/* kernel_avx2's one-byte prefill of Q8_0: tiles of SIGNED_R rows by SIGNED_H halves, then one
 * of the rest */
TD_INLINE TD_Y void kernel_avx2_signed_one(td_dtype_t t, const unsigned char *gq, size_t nb, size_t k,
                                           const unsigned char *a, size_t m, size_t stride, float *yg, size_t ldy,
                                           const unsigned char *end)
{
    const int R = SIGNED_R, H = SIGNED_H;
    for (int h = 0; h < 2; h += H) {
        size_t i = 0;
        for (; i + (size_t)R <= m; i += (size_t)R)
            avx2_tile1_signed(t, R, h, H, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy,
                              h == 0 && i == 0 ? end : NULL);
        const unsigned char *ai = a + i * stride, *pf = h == 0 && i == 0 ? end : NULL;
        float *yi = yg + i * ldy;
#define TILE1_SIGNED(R) avx2_tile1_signed(t, R, h, (R) * H <= 8 ? H : 1, gq, nb, k, ai, stride, yi, ldy, pf) /* R * H <= 8 */
        AVX2_REST(m - i, TILE1_SIGNED);
#undef TILE1_SIGNED
    }
}

/* kernel_avx2's one-byte Q6_K prefill: tiles of 16 rows, then one of 8, then one of the rest */
TD_INLINE TD_Y void kernel_avx2_q6_k_one(const unsigned char *gq, size_t nb, size_t k, const unsigned char *a, size_t m,
                                         size_t stride, float *yg, size_t ldy, const unsigned char *end)
{
    for (int h = 0; h < 2; h++) {
        size_t i = 0;
        for (; i + Q6_TILE <= m; i += Q6_TILE)
            avx2_tile1_q6_k(Q6_TILE, h, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy,
                            h == 0 && i == 0 ? end : NULL);
        for (; i + 8 <= m; i += 8)
            avx2_tile1_q6_k(8, h, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy, h == 0 && i == 0 ? end : NULL);
        const unsigned char *ai = a + i * stride, *pf = h == 0 && i == 0 ? end : NULL;
        float *yi = yg + i * ldy;
#define TILE1_Q6_K(R) avx2_tile1_q6_k(R, h, gq, nb, k, ai, stride, yi, ldy, pf)
        AVX2_REST(m - i, TILE1_Q6_K);
#undef TILE1_Q6_K
    }
}

/* kernel_avx2's two-byte prefill: every row in int16 tiles of W16_R(t) rows, then one of the rest */
TD_INLINE TD_Y void kernel_avx2_w16(td_dtype_t t, const unsigned char *gq, size_t nb, size_t k, const unsigned char *a,
                                    size_t m, size_t stride, float *yg, size_t ldy, const unsigned char *end)
{
    const int R = W16_R(t), H = W16_H(t);
    for (int h = 0; h < 2; h += H) {
        size_t i = 0;
        for (; i + (size_t)R <= m; i += (size_t)R)
            w16_tile(t, R, h, H, gq, nb, k, a + i * stride, stride, yg + i * ldy, ldy, h == 0 && i == 0 ? end : NULL);
        const unsigned char *ai = a + i * stride, *pf = h == 0 && i == 0 ? end : NULL;
        float *yi = yg + i * ldy;
#define W16(R) w16_tile(t, R, h, (R) * H <= 8 ? H : 1, gq, nb, k, ai, stride, yi, ldy, pf) /* R * H <= 8 */
        AVX2_REST(m - i, W16);
#undef W16
    }
}

TD_INLINE TD_Y void kernel_avx2(td_dtype_t t, bool one, const void *wp, size_t g0, size_t g1, size_t g_pf, size_t k,
                                const void *av, size_t m, float *y, size_t ldy)
{
    size_t nb = k / TD_QK, gb = td_cpu_pack_group_bytes(t, k), stride = td_cpu_pack_act_stride(k);
    const unsigned char *a = av, *end = (const unsigned char *)wp + g_pf * gb;
    for (size_t g = g0; g < g1; g++) {
        const unsigned char *gq = (const unsigned char *)wp + g * gb;
        float *yg = y + (g - g0) * ROWS;
        if (act_super(t, one)) { /* super-block rows: one float step a super-block */
            if (t == TD_Q6_K && m == 1)
                avx2_row1_q6_k(true, gq, nb, k, a, yg, end);
            else if (t == TD_Q6_K)
                kernel_avx2_q6_k_one(gq, nb, k, a, m, stride, yg, ldy, end);
            else if (m == 1)
                (t == TD_IQ4_XS ? avx2_row1_iq4_xs : avx2_row1_q4_k)(gq, nb, k, a, yg, end);
            else if (t == TD_IQ4_XS)
                kernel_avx2_iq4_xs_one(gq, nb, k, a, m, stride, yg, ldy, end);
            else
                kernel_avx2_q4_one(t, true, gq, nb, k, a, m, stride, yg, ldy, end);
            continue;
        }
        if (m >= 2 && one && t == TD_Q8_0) { /* the sign-trick tile (its comment) */
            kernel_avx2_signed_one(t, gq, nb, k, a, m, stride, yg, ldy, end);
            continue;
        }
        if (m >= 2 ? !one : !one && t == TD_IQ4_XS) {
            /* Every two-byte prefill, and an IQ4_XS two-byte decode row: its maddubs tile spends a
             * sign, a maddubs and a madd on each byte of each vector, the int16 tile ~20% fewer
             * instructions a block (1B IQ4_XS decode, 2 threads, alternated: 33.5/36.6,
             * 33.6/37.1, 33.8/38.0 tokens/s). Q8_0's decode read no faster that way (it
             * streams twice the bytes). One-byte rows of Q8_0 and IQ4_XS went to the int16
             * tile too until avx2_tile1_signed (above) beat it. */
            kernel_avx2_w16(t, gq, nb, k, a, m, stride, yg, ldy, end);
            continue;
        }
        if (m >= 2 && avx2_row1_takes(t)) { /* one-byte rows (two-byte ones went to the int16 tiles) */
            kernel_avx2_q4_one(t, false, gq, nb, k, a, m, stride, yg, ldy, end);
            continue;
        }
        if (t == TD_Q6_K) { /* a two-byte decode row (one-byte rows are super-block rows) */
            avx2_row1_q6_k(false, gq, nb, k, a, yg, end);
            continue;
        }
        /* decode (m = 1) */
        if (avx2_row1_takes(t))
            avx2_row1(t, one, gq, nb, k, a, yg, end);
        else if (t == TD_Q8_0)
            avx2_row1_q8_0(one, gq, nb, k, a, yg, end);
        else
            TD_ASSERT(!"kernel_avx2: no row kernel for this type and mode");
    }
}

PACK_FNS(avx2_2, TD_Y, kernel_avx2, false)
PACK_FNS(avx2_1, TD_Y, kernel_avx2, true)

const td_cpu_pack_ops_t td_cpu_pack_ops_avx2 = {
    .name = "avx2", .act_row = act_row_avx2, .act_q16 = true, .two_byte = PACK_TABLE(avx2_2),
    .one_byte = PACK_TABLE(avx2_1)};

#endif /* TD_CPU_PACK_X86 */
