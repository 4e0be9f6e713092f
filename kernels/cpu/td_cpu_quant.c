/*
 * td_cpu_quant: activation quantization and the Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K row dots
 * against it, scalar and AVX2, bit-identical (the sum order is the header's contract).
 *
 * The AVX2 technique is llama.cpp's (ggml-cpu quants.c): the 32 weight quants of a block are
 * widened to 32 signed or unsigned bytes in weight order (4-bit: the low nibbles are weights
 * 0..15, the high ones 16..31), _mm256_maddubs_epi16 multiplies unsigned by signed bytes and
 * adds neighbours into 16 int16, _mm256_madd_epi16 by ones adds neighbours again into 8 int32
 * lanes of 4 weights each, which are converted and FMA'd with the block's scale into 8 f32
 * accumulators. Signed weights (Q8_0, Q4_0 after - 8) go through the sign trick: |w| times
 * a * sign(w). No int16 saturation: |w| <= 128, |a| <= 127, so a pair is at most 32512.
 * The scalar reference computes the same int32 lanes (exact, so any order) and then the same
 * f32 operations in the same order, fmaf where AVX2 has an FMA.
 */
#include "td_cpu_quant.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "td_cpu_isa.h"
#include "td_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "td_cpu_simd.h"
#define TD_CPU_QUANT_X86 1
#endif

void td_cpu_quant_act_row(const float *x, td_cpu_q8a_block_t *a, size_t k)
{
    TD_ASSERT(k % TD_QK == 0);
    for (size_t b = 0; b < k / TD_QK; b++, x += TD_QK) {
        float amax = 0.0f;
        bool nan = false;
        for (int i = 0; i < TD_QK; i++) {
            const float ax = fabsf(x[i]); /* not fmaxf, a libm call (act_amax) */
            amax = ax > amax ? ax : amax;
            nan |= x[i] != x[i];
        }
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < TD_QK; i++) {
            /* |x * id| <= 127 * (1 + 3 ulp) < 127.5: never rounds to 128. The clamp only
             * matters in a non-finite block (NaN, inf * 0 = NaN): NaN becomes -127, a
             * defined int8, and the block's d (NaN or inf) carries the fault on. */
            float v = x[i] * id;
            v = v >= -127.0f ? v : -127.0f;
            v = v <= 127.0f ? v : 127.0f;
            int q = (int)roundf(v);
            a[b].qs[i] = (int8_t)q;
            sum += q;
        }
        a[b].d = nan ? NAN : d;
        a[b].s = d * (float)sum;
    }
}

/* ---- scalar reference ----------------------------------------------------------------- */

/* The row's dot from its 8 lane accumulators (the header's fixed tree). */
static float hsum_lanes(const float acc[8])
{
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* p[l] = the sum of the 4 products of lane l, w[] the block's weight quants in order */
static void lane_sums(int32_t p[8], const int w[TD_QK], const int8_t *qa)
{
    for (int l = 0; l < 8; l++) {
        p[l] = 0;
        for (int i = 4 * l; i < 4 * l + 4; i++)
            p[l] += w[i] * qa[i];
    }
}

/* acc[l] += d * (sum of the 4 products of lane l) */
static void block_lanes(float acc[8], float d, const int w[TD_QK], const int8_t *qa)
{
    int32_t p[8];
    lane_sums(p, w, qa);
    for (int l = 0; l < 8; l++)
        acc[l] = fmaf(d, (float)p[l], acc[l]);
}

/* The 6-bit scales and mins of a Q4_K block's 8 sub-blocks, as the dots use them. */
static void q4_k_scales_mins(const uint8_t scales[12], uint8_t sc[8], uint8_t mn[8])
{
    for (int s = 0; s < 8; s++) {
        int c, m;
        td_quant_q4_k_scale_min(scales, s, &c, &m);
        sc[s] = (uint8_t)c;
        mn[s] = (uint8_t)m;
    }
}

static float dot_q8_0_scalar(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q8_0_t *w = wv;
    float acc[8] = {0};
    for (size_t b = 0; b < k / TD_QK; b++) {
        int q[TD_QK];
        for (int i = 0; i < TD_QK; i++)
            q[i] = w[b].qs[i];
        block_lanes(acc, td_f16_to_f32(w[b].d) * a[b].d, q, a[b].qs);
    }
    return hsum_lanes(acc);
}

/* the 32 nibbles of a Q4 block in weight order */
static void nibbles(const uint8_t qs[TD_QK / 2], int bias, int q[TD_QK])
{
    for (int j = 0; j < TD_QK / 2; j++) {
        q[j] = (qs[j] & 15) - bias;
        q[j + TD_QK / 2] = (qs[j] >> 4) - bias;
    }
}

static float dot_q4_0_scalar(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q4_0_t *w = wv;
    float acc[8] = {0};
    for (size_t b = 0; b < k / TD_QK; b++) {
        int q[TD_QK];
        nibbles(w[b].qs, 8, q);
        block_lanes(acc, td_f16_to_f32(w[b].d) * a[b].d, q, a[b].qs);
    }
    return hsum_lanes(acc);
}

static float dot_q4_1_scalar(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q4_1_t *w = wv;
    float acc[8] = {0};
    float m = 0.0f;
    for (size_t b = 0; b < k / TD_QK; b++) {
        int q[TD_QK];
        nibbles(w[b].qs, 0, q);
        block_lanes(acc, td_f16_to_f32(w[b].d) * a[b].d, q, a[b].qs);
        m = fmaf(td_f16_to_f32(w[b].m), a[b].s, m);
    }
    return hsum_lanes(acc) + m;
}

/* Q4_K: 32-weight sub-block s of a super-block meets activation block 8 sb + s */
static float dot_q4_k_scalar(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q4_k_t *w = wv;
    float acc[8] = {0};
    float m = 0.0f;
    for (size_t sb = 0; sb < k / TD_QK_K; sb++, a += 8) {
        float d = td_f16_to_f32(w[sb].d), dmin = td_f16_to_f32(w[sb].dmin);
        uint8_t sc[8], mn[8];
        q4_k_scales_mins(w[sb].scales, sc, mn);
        for (int s = 0; s < 8; s++) {
            const uint8_t *qs = w[sb].qs + 32 * (s / 2);
            int q[TD_QK];
            for (int l = 0; l < TD_QK; l++)
                q[l] = s & 1 ? qs[l] >> 4 : qs[l] & 15;
            block_lanes(acc, (d * (float)sc[s]) * a[s].d, q, a[s].qs);
            m = fmaf(-(dmin * (float)mn[s]), a[s].s, m);
        }
    }
    return hsum_lanes(acc) + m;
}

/* Q6_K: 32-weight block j (0..7) of a super-block is half h = j / 4, quarter c = j % 4,
 * its weights (ql nibble c / 2 of ql[64h + 32 (c % 2) + l]) | (bits 2c of qh[32h + l]) << 4,
 * minus 32; its lanes 0-3 take scale 2j, lanes 4-7 scale 2j + 1 */
static float dot_q6_k_scalar(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q6_k_t *w = wv;
    float acc[8] = {0};
    for (size_t sb = 0; sb < k / TD_QK_K; sb++) {
        float d = td_f16_to_f32(w[sb].d);
        for (int j = 0; j < 8; j++, a++) {
            uint8_t u[TD_QK];
            td_quant_q6_k_piece(&w[sb], j, u);
            int q[TD_QK];
            for (int l = 0; l < TD_QK; l++)
                q[l] = u[l] - 32;
            int32_t p[8];
            lane_sums(p, q, a->qs);
            for (int l = 0; l < 8; l++)
                acc[l] = fmaf(d * a->d, (float)(w[sb].scales[2 * j + l / 4] * p[l]), acc[l]);
        }
    }
    return hsum_lanes(acc);
}

static const td_cpu_quant_ops_t ops_scalar = {
    .name = "scalar",
    .act_row = td_cpu_quant_act_row,
    .q8_0 = dot_q8_0_scalar,
    .q4_0 = dot_q4_0_scalar,
    .q4_1 = dot_q4_1_scalar,
    .q4_k = dot_q4_k_scalar,
    .q6_k = dot_q6_k_scalar,
};

/* ---- AVX2 ----------------------------------------------------------------------------- */

#ifdef TD_CPU_QUANT_X86
#define TD_AVX2 __attribute__((target("avx2,fma,f16c")))

/* td_cpu_quant_act_row on AVX2, bit for bit: the same d, the same clamp (max_ps gives its
 * second operand for a NaN lane: NaN is ignored in amax and becomes -127), roundf as
 * truncation plus one away from zero at a remainder >= 1/2, the same integer sum */
static TD_AVX2 void act_row_avx2(const float *x, td_cpu_q8a_block_t *a, size_t k)
{
    for (size_t b = 0; b < k / TD_QK; b++, x += TD_QK) {
        __m256 xv[4];
        bool nan;
        float d = td_cpu_simd_amax32(x, xv, &nan) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256 v = td_cpu_simd_clamp127(_mm256_mul_ps(xv[j], _mm256_set1_ps(id)));
            q[j] = _mm256_cvtps_epi32(td_cpu_simd_round_away(v));
            sum = _mm256_add_epi32(sum, q[j]);
        }
        _mm256_storeu_si256((__m256i *)a[b].qs, td_cpu_simd_pack_i8(q));
        a[b].d = nan ? NAN : d;
        a[b].s = d * (float)td_cpu_simd_hsum_i32(sum);
    }
}

/* F16C vcvtph2ps: exact, as td_f16_to_f32, but one instruction instead of a call */
static inline TD_AVX2 float f16(uint16_t h)
{
    return _cvtsh_ss(h);
}

/* the hsum_lanes tree on a register: lanes l and l + 4 first, then (0,2)/(1,3), then 0+1 */
static inline TD_AVX2 float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int32 lanes, lane l = sum of u[i] * s[i] for i = 4l..4l+3 (u unsigned, s signed bytes) */
static inline TD_AVX2 __m256i lanes_us8(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* the same for two signed byte vectors: |x| times y * sign(x) */
static inline TD_AVX2 __m256i lanes_s8(__m256i x, __m256i y)
{
    return lanes_us8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}

/* 16 bytes of nibbles to 32 bytes 0..15 in weight order (low nibbles, then high) */
static inline TD_AVX2 __m256i nibbles32(const uint8_t *qs)
{
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

static inline TD_AVX2 __m256i act32(const td_cpu_q8a_block_t *a)
{
    return _mm256_loadu_si256((const __m256i *)a->qs);
}

static TD_AVX2 float dot_q8_0_avx2(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q8_0_t *w = wv;
    __m256 acc = _mm256_setzero_ps();
    for (size_t b = 0; b < k / TD_QK; b++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)w[b].qs);
        __m256 d = _mm256_set1_ps(f16(w[b].d) * a[b].d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes_s8(q, act32(&a[b]))), acc);
    }
    return hsum8(acc);
}

static TD_AVX2 float dot_q4_0_avx2(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q4_0_t *w = wv;
    __m256 acc = _mm256_setzero_ps();
    for (size_t b = 0; b < k / TD_QK; b++) {
        __m256i q = _mm256_sub_epi8(nibbles32(w[b].qs), _mm256_set1_epi8(8));
        __m256 d = _mm256_set1_ps(f16(w[b].d) * a[b].d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lanes_s8(q, act32(&a[b]))), acc);
    }
    return hsum8(acc);
}

static TD_AVX2 float dot_q4_1_avx2(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q4_1_t *w = wv;
    __m256 acc = _mm256_setzero_ps();
    float m = 0.0f;
    for (size_t b = 0; b < k / TD_QK; b++) {
        __m256 d = _mm256_set1_ps(f16(w[b].d) * a[b].d);
        __m256i p = lanes_us8(nibbles32(w[b].qs), act32(&a[b]));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc);
        m = fmaf(f16(w[b].m), a[b].s, m);
    }
    return hsum8(acc) + m;
}

static TD_AVX2 float dot_q4_k_avx2(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q4_k_t *w = wv;
    __m256 acc = _mm256_setzero_ps();
    float m = 0.0f;
    const __m256i lo4 = _mm256_set1_epi8(15);
    for (size_t sb = 0; sb < k / TD_QK_K; sb++, a += 8) {
        float d = f16(w[sb].d), dmin = f16(w[sb].dmin);
        uint8_t sc[8], mn[8];
        q4_k_scales_mins(w[sb].scales, sc, mn);
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(w[sb].qs + 32 * c));
            __m256i q[2] = {_mm256_and_si256(raw, lo4),
                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4)};
            for (int h = 0; h < 2; h++) {
                int s = 2 * c + h;
                __m256 ds = _mm256_set1_ps((d * (float)sc[s]) * a[s].d);
                acc = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(lanes_us8(q[h], act32(&a[s]))), acc);
                m = fmaf(-(dmin * (float)mn[s]), a[s].s, m);
            }
        }
    }
    return hsum8(acc) + m;
}

/* Q6_K with its two 16-weight scales folded into the second multiply-add: maddubs gives
 * int16 pair sums, madd_epi16 by (scale 2j x 8, scale 2j + 1 x 8) the scaled lane sums */
static TD_AVX2 float dot_q6_k_avx2(const void *wv, const td_cpu_q8a_block_t *a, size_t k)
{
    const td_block_q6_k_t *w = wv;
    __m256 acc = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    for (size_t sb = 0; sb < k / TD_QK_K; sb++) {
        float d = f16(w[sb].d);
        for (int h = 0; h < 2; h++) {
            __m256i qh = _mm256_loadu_si256((const __m256i *)(w[sb].qh + 32 * h));
            __m256i ql[2] = {_mm256_loadu_si256((const __m256i *)(w[sb].ql + 64 * h)),
                             _mm256_loadu_si256((const __m256i *)(w[sb].ql + 64 * h + 32))};
            for (int c = 0; c < 4; c++, a++) {
                int j = 4 * h + c;
                __m256i lo = c < 2 ? ql[c] : _mm256_srli_epi16(ql[c - 2], 4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), two);
                __m256i q = _mm256_sub_epi8(
                    _mm256_or_si256(_mm256_and_si256(lo, lo4), _mm256_slli_epi16(hi, 4)),
                    _mm256_set1_epi8(32));
                __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q),
                                                     _mm256_sign_epi8(act32(a), q));
                __m256i scv = _mm256_set_m128i(_mm_set1_epi16(w[sb].scales[2 * j + 1]),
                                               _mm_set1_epi16(w[sb].scales[2 * j]));
                __m256i p = _mm256_madd_epi16(pairs, scv);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(p), acc);
            }
        }
    }
    return hsum8(acc);
}

/*
 * Register-blocked tiles: R W rows (R = 4 or 1) by M activation rows (1..4), R * M outputs
 * with their own 8-lane accumulators, so a weight block is unpacked once per M activation
 * rows and an activation block loaded once per R weight rows. Each output still gets its
 * lanes' FMAs in block order and one hsum8: the same bits as its single dot. TILE_BODY is
 * the one loop both ISAs share; LANES(q, x, off) gives the block's 8 int32 lane sums from
 * the prepared weight bytes q, the activation quants x and off (per activation block:
 * minus 8 or 128 times its lane sums, for VNNI's unsigned-times-signed trick).
 */
#define TILE_PREFETCH 512
#define TILE_BODY(LANES, PREP_X)                                                               \
    __m256 acc[4][4];                                                                          \
    float mm[4][4];                                                                            \
    for (int r = 0; r < R; r++)                                                                \
        for (int i = 0; i < M; i++) {                                                          \
            acc[r][i] = _mm256_setzero_ps();                                                   \
            mm[r][i] = 0.0f;                                                                   \
        }                                                                                      \
    const size_t bb = type == TD_GGML_Q8_0 ? sizeof(td_block_q8_0_t)                           \
                    : type == TD_GGML_Q4_0 ? sizeof(td_block_q4_0_t) : sizeof(td_block_q4_1_t);\
    for (size_t b = 0; b < nb; b++) {                                                          \
        __m256i xq[4], off[4];                                                                 \
        for (int i = 0; i < M; i++) {                                                          \
            xq[i] = act32(&a[i * nb + b]);                                                     \
            PREP_X;                                                                            \
        }                                                                                      \
        for (int r = 0; r < R; r++) {                                                          \
            const uint8_t *blk = (const uint8_t *)w + r * row_bytes + b * bb;                  \
            _mm_prefetch((const char *)blk + 2 * R * row_bytes, _MM_HINT_T0);                   \
            uint16_t dh, mh = 0;                                                               \
            memcpy(&dh, blk, 2);                                                               \
            __m256i q;                                                                         \
            if (type == TD_GGML_Q8_0) {                                                        \
                q = _mm256_loadu_si256((const __m256i *)(blk + 2));                            \
            } else if (type == TD_GGML_Q4_0) {                                                 \
                q = nibbles32(blk + 2);                                                        \
            } else {                                                                           \
                memcpy(&mh, blk + 2, 2);                                                       \
                q = nibbles32(blk + 4);                                                        \
            }                                                                                  \
            float dw = f16(dh), mw = f16(mh);                                                  \
            for (int i = 0; i < M; i++) {                                                      \
                const td_cpu_q8a_block_t *ab = &a[i * nb + b];                                 \
                __m256i p = LANES(q, xq[i], off[i]);                                           \
                acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab->d), _mm256_cvtepi32_ps(p), \
                                            acc[r][i]);                                        \
                if (type == TD_GGML_Q4_1)                                                      \
                    mm[r][i] = fmaf(mw, ab->s, mm[r][i]);                                      \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    for (int r = 0; r < R; r++)                                                                \
        for (int i = 0; i < M; i++)                                                            \
            y[i * ldy + r] = type == TD_GGML_Q4_1 ? hsum8(acc[r][i]) + mm[r][i]                \
                                                  : hsum8(acc[r][i]);

/* AVX2: as the dots above (sign trick for signed weights) */
static inline TD_AVX2 __m256i lanes_avx2(uint32_t type, __m256i q, __m256i x)
{
    if (type == TD_GGML_Q4_1)
        return lanes_us8(q, x);
    if (type == TD_GGML_Q4_0)
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
    return lanes_s8(q, x);
}

#define LANES_AVX2(q, x, off) ((void)(off), lanes_avx2(type, q, x))

static inline __attribute__((always_inline)) TD_AVX2 void
tile_avx2(uint32_t type, int R, int M, const void *w, size_t row_bytes,
          const td_cpu_q8a_block_t *a, size_t nb, float *y, size_t ldy)
{
    TILE_BODY(LANES_AVX2, off[i] = xq[i])
}

/* Every (R, M) a tile can have, R = 4 or 1, M = 1..4, as constants for TILE_BODY's loops */
#define TILE_DISPATCH(TILE, type, R, M, w, row_bytes, a, nb, y, ldy)                           \
    do {                                                                                       \
        if (R == 4) {                                                                          \
            switch (M) {                                                                       \
            case 1: TILE(type, 4, 1, w, row_bytes, a, nb, y, ldy); break;                      \
            case 2: TILE(type, 4, 2, w, row_bytes, a, nb, y, ldy); break;                      \
            case 3: TILE(type, 4, 3, w, row_bytes, a, nb, y, ldy); break;                      \
            default: TILE(type, 4, 4, w, row_bytes, a, nb, y, ldy); break;                     \
            }                                                                                  \
        } else {                                                                               \
            switch (M) {                                                                       \
            case 1: TILE(type, 1, 1, w, row_bytes, a, nb, y, ldy); break;                      \
            case 2: TILE(type, 1, 2, w, row_bytes, a, nb, y, ldy); break;                      \
            case 3: TILE(type, 1, 3, w, row_bytes, a, nb, y, ldy); break;                      \
            default: TILE(type, 1, 4, w, row_bytes, a, nb, y, ldy); break;                     \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* The blocked GEMM of one type (a constant after inlining): activation rows in groups of
 * 4, W rows in groups of 4 (then singly) */
#define GEMM_LOOPS(TILE, type)                                                                 \
    size_t nb = k / TD_QK;                                                                     \
    for (size_t i0 = 0; i0 < m; i0 += 4) {                                                     \
        int M = (int)TD_MIN(4, m - i0);                                                        \
        for (size_t r0 = 0; r0 < n_rows;) {                                                    \
            int R = n_rows - r0 >= 4 ? 4 : 1;                                                  \
            TILE_DISPATCH(TILE, type, R, M, (const uint8_t *)w + r0 * row_bytes, row_bytes,    \
                          a + i0 * nb, nb, y + i0 * ldy + r0, ldy);                            \
            r0 += (size_t)R;                                                                   \
        }                                                                                      \
    }

#define GEMM_FN(NAME, ATTR, TILE, type)                                                        \
    static ATTR void NAME(const void *w, size_t row_bytes, size_t n_rows,                      \
                          const td_cpu_q8a_block_t *a, size_t m, size_t k, float *y, size_t ldy) \
    {                                                                                          \
        GEMM_LOOPS(TILE, type)                                                                 \
    }

/*
 * The K formats' tiles: R W rows by M activation rows, each super-block's scales decoded
 * and each 32-weight piece unpacked once per W row for all M activation rows (the per-row
 * dots did both M times over in a prefill). Every output takes the operations of its
 * single dot (dot_q4_k_avx2, dot_q6_k_avx2) in the same order: the same bits.
 */
/* A Q4_K super-block's 8 sub-block scales d * sc and negated mins -(dmin * mn) as f32 (the
 * dots' exact products), unpacked with 32-bit word operations instead of byte by byte (the
 * byte loop and its scalar int-to-float conversions were a sixth of a Q4_K decode) */
static inline __attribute__((always_inline)) TD_AVX2 void q4_k_scales_f32(const td_block_q4_k_t *blk, float dsc[8],
                                                                          float mnv[8])
{
    uint32_t w[3];
    memcpy(w, blk->scales, 12);
    uint64_t sc = (uint64_t)(w[0] & 0x3f3f3f3fu) | (uint64_t)((w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u)) << 32;
    uint64_t mn = (uint64_t)(w[1] & 0x3f3f3f3fu) |
                  (uint64_t)(((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u)) << 32;
    __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
    __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn)));
    _mm256_storeu_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(f16(blk->d)), scf));
    _mm256_storeu_ps(mnv, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16(blk->dmin)), mnf), _mm256_set1_ps(-0.0f)));
}

static inline __attribute__((always_inline)) TD_AVX2 void
tile_q4_k(int R, int M, const void *w, size_t row_bytes, const td_cpu_q8a_block_t *a, size_t nb,
          float *y, size_t ldy)
{
    __m256 acc[4][4];
    float mm[4][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++) {
            acc[r][i] = _mm256_setzero_ps();
            mm[r][i] = 0.0f;
        }
    const __m256i lo4 = _mm256_set1_epi8(15);
    for (size_t sb = 0; sb < nb / 8; sb++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const td_block_q4_k_t *blk = (const td_block_q4_k_t *)((const uint8_t *)w + r * row_bytes) + sb;
            /* all the block's lines: 144-byte blocks of 4 short interleaved rows defeat the
               hardware prefetcher, and one line a block left most loads to miss */
            const char *ahead = (const char *)blk + 2 * R * row_bytes;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + sizeof *blk - 1, _MM_HINT_T0);
            float dsc[8], mnv[8];
            q4_k_scales_f32(blk, dsc, mnv);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * c));
                __m256i q[2] = {_mm256_and_si256(raw, lo4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), lo4)};
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    int s = 2 * c + h;
#pragma GCC unroll 4
                    for (int i = 0; i < M; i++) {
                        const td_cpu_q8a_block_t *ab = &a[i * nb + sb * 8 + s];
                        __m256 ds = _mm256_mul_ps(_mm256_broadcast_ss(&dsc[s]), _mm256_broadcast_ss(&ab->d));
                        acc[r][i] = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(lanes_us8(q[h], act32(ab))), acc[r][i]);
                        mm[r][i] = fmaf(mnv[s], ab->s, mm[r][i]);
                    }
                }
            }
        }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            y[i * ldy + r] = hsum8(acc[r][i]) + mm[r][i];
}

static inline __attribute__((always_inline)) TD_AVX2 void
tile_q6_k(int R, int M, const void *w, size_t row_bytes, const td_cpu_q8a_block_t *a, size_t nb,
          float *y, size_t ldy)
{
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            acc[r][i] = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(15), two = _mm256_set1_epi8(3);
    for (size_t sb = 0; sb < nb / 8; sb++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const td_block_q6_k_t *blk = (const td_block_q6_k_t *)((const uint8_t *)w + r * row_bytes) + sb;
            const char *ahead = (const char *)blk + 2 * R * row_bytes;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            _mm_prefetch(ahead + 128, _MM_HINT_T0);
            _mm_prefetch(ahead + sizeof *blk - 1, _MM_HINT_T0);
            float d = f16(blk->d);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * h));
                __m256i ql[2] = {_mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h)),
                                 _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h + 32))};
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                    int j = 4 * h + c;
                    __m256i lo = c < 2 ? ql[c] : _mm256_srli_epi16(ql[c - 2], 4);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), two);
                    __m256i q = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lo, lo4), _mm256_slli_epi16(hi, 4)),
                                                _mm256_set1_epi8(32));
                    __m256i qa = _mm256_sign_epi8(q, q);
                    __m256i scv = _mm256_set_m128i(_mm_set1_epi16(blk->scales[2 * j + 1]),
                                                   _mm_set1_epi16(blk->scales[2 * j]));
#pragma GCC unroll 4
                    for (int i = 0; i < M; i++) {
                        const td_cpu_q8a_block_t *ab = &a[i * nb + sb * 8 + j];
                        __m256i pairs = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(act32(ab), q));
                        __m256i p = _mm256_madd_epi16(pairs, scv);
                        acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(d * ab->d), _mm256_cvtepi32_ps(p), acc[r][i]);
                    }
                }
            }
        }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < M; i++)
            y[i * ldy + r] = hsum8(acc[r][i]);
}

/* TILE_DISPATCH's signature for the K tiles (their type is in their name) */
#define TILE_Q4_K(type, R, M, w, row_bytes, a, nb, y, ldy) tile_q4_k(R, M, w, row_bytes, a, nb, y, ldy)
#define TILE_Q6_K(type, R, M, w, row_bytes, a, nb, y, ldy) tile_q6_k(R, M, w, row_bytes, a, nb, y, ldy)

GEMM_FN(gemm_q8_0_avx2, TD_AVX2, tile_avx2, TD_GGML_Q8_0)
GEMM_FN(gemm_q4_0_avx2, TD_AVX2, tile_avx2, TD_GGML_Q4_0)
GEMM_FN(gemm_q4_1_avx2, TD_AVX2, tile_avx2, TD_GGML_Q4_1)
GEMM_FN(gemm_q4_k_avx2, TD_AVX2, TILE_Q4_K, TD_GGML_Q4_K)
GEMM_FN(gemm_q6_k_avx2, TD_AVX2, TILE_Q6_K, TD_GGML_Q6_K)

static const td_cpu_quant_ops_t ops_avx2 = {
    .name = "avx2",
    .act_row = act_row_avx2,
    .q8_0 = dot_q8_0_avx2,
    .q4_0 = dot_q4_0_avx2,
    .q4_1 = dot_q4_1_avx2,
    .q4_k = dot_q4_k_avx2,
    .q6_k = dot_q6_k_avx2,
    .gemm_q8_0 = gemm_q8_0_avx2,
    .gemm_q4_0 = gemm_q4_0_avx2,
    .gemm_q4_1 = gemm_q4_1_avx2,
    .gemm_q4_k = gemm_q4_k_avx2,
    .gemm_q6_k = gemm_q6_k_avx2,
};

/* ---- AVX-512 VNNI (256-bit vpdpbusd) ------------------------------------------------------ */

#define TD_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

/*
 * vpdpbusd multiplies unsigned by signed bytes and adds each lane's 4 products into an
 * int32 accumulator in one instruction (AVX2 needs maddubs + madd), exactly, no int16 step.
 * Signed weights are made unsigned: q + 8 - 8 for Q4_0 (the nibble as is) and q ^ 0x80 =
 * q + 128 for Q8_0, and the excess (8 or 128 times the lane's activation sum) is the
 * accumulator's start value, prepared once per activation block: the same exact int32.
 */
static inline TD_VNNI __m256i lanes_vnni(uint32_t type, __m256i q, __m256i x, __m256i off)
{
    if (type == TD_GGML_Q8_0)
        q = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
    return _mm256_dpbusd_epi32(off, q, x);
}

static inline TD_VNNI __m256i act_off_vnni(uint32_t type, __m256i x)
{
    if (type == TD_GGML_Q4_1)
        return _mm256_setzero_si256();
    __m256i s4 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), x);
    return _mm256_sub_epi32(_mm256_setzero_si256(),
                            _mm256_slli_epi32(s4, type == TD_GGML_Q8_0 ? 7 : 3));
}

#define LANES_VNNI(q, x, off) lanes_vnni(type, q, x, off)

static inline __attribute__((always_inline)) TD_VNNI void
tile_vnni(uint32_t type, int R, int M, const void *w, size_t row_bytes,
          const td_cpu_q8a_block_t *a, size_t nb, float *y, size_t ldy)
{
    TILE_BODY(LANES_VNNI, off[i] = act_off_vnni(type, xq[i]))
}

GEMM_FN(gemm_q8_0_vnni, TD_VNNI, tile_vnni, TD_GGML_Q8_0)
GEMM_FN(gemm_q4_0_vnni, TD_VNNI, tile_vnni, TD_GGML_Q4_0)
GEMM_FN(gemm_q4_1_vnni, TD_VNNI, tile_vnni, TD_GGML_Q4_1)

#define DOT_VNNI(NAME, type)                                                                   \
    static TD_VNNI float NAME(const void *w, const td_cpu_q8a_block_t *a, size_t k)            \
    {                                                                                          \
        float y;                                                                               \
        tile_vnni(type, 1, 1, w, 0, a, k / TD_QK, &y, 1);                                      \
        return y;                                                                              \
    }

DOT_VNNI(dot_q8_0_vnni, TD_GGML_Q8_0)
DOT_VNNI(dot_q4_0_vnni, TD_GGML_Q4_0)
DOT_VNNI(dot_q4_1_vnni, TD_GGML_Q4_1)

static const td_cpu_quant_ops_t ops_vnni = {
    .name = "avx512vnni",
    .act_row = act_row_avx2,
    .q8_0 = dot_q8_0_vnni,
    .q4_0 = dot_q4_0_vnni,
    .q4_1 = dot_q4_1_vnni,
    .q4_k = dot_q4_k_avx2,
    .q6_k = dot_q6_k_avx2,
    .gemm_q8_0 = gemm_q8_0_vnni,
    .gemm_q4_0 = gemm_q4_0_vnni,
    .gemm_q4_1 = gemm_q4_1_vnni,
    .gemm_q4_k = gemm_q4_k_avx2,
    .gemm_q6_k = gemm_q6_k_avx2,
};
#endif /* TD_CPU_QUANT_X86 */

/* ---- choice and GEMV ------------------------------------------------------------------ */

const td_cpu_quant_ops_t *td_cpu_quant_ops(td_cpu_isa_t isa)
{
    TD_ASSERT(td_cpu_isa_runs(isa));
#ifdef TD_CPU_QUANT_X86
    if (isa >= TD_CPU_ISA_AVX512_VNNI)
        return &ops_vnni;
    if (isa >= TD_CPU_ISA_AVX2)
        return &ops_avx2;
#endif
    return &ops_scalar;
}

td_cpu_quant_dot_fn td_cpu_quant_dot_of(const td_cpu_quant_ops_t *ops, uint32_t type)
{
    switch (type) {
    case TD_GGML_Q8_0: return ops->q8_0;
    case TD_GGML_Q4_0: return ops->q4_0;
    case TD_GGML_Q4_1: return ops->q4_1;
    case TD_GGML_Q4_K: return ops->q4_k;
    case TD_GGML_Q6_K: return ops->q6_k;
    }
    return NULL;
}

void td_cpu_quant_gemv(const td_cpu_quant_ops_t *ops, uint32_t type, const void *w,
                       size_t row_bytes, size_t r0, size_t r1, const td_cpu_q8a_block_t *a,
                       size_t k, float *y)
{
    td_cpu_quant_dot_fn dot = td_cpu_quant_dot_of(ops, type);
    TD_ASSERT(dot && k % TD_QK == 0);
    for (size_t r = r0; r < r1; r++)
        y[r] = dot((const uint8_t *)w + r * row_bytes, a, k);
}

void td_cpu_quant_gemm(const td_cpu_quant_ops_t *ops, uint32_t type, const void *w,
                       size_t row_bytes, size_t n_rows, const td_cpu_q8a_block_t *a, size_t m,
                       size_t k, float *y, size_t ldy)
{
    td_cpu_quant_dot_fn dot = td_cpu_quant_dot_of(ops, type);
    TD_ASSERT(dot && k % TD_QK == 0);
    td_cpu_quant_gemm_fn gemm = type == TD_GGML_Q8_0   ? ops->gemm_q8_0
                              : type == TD_GGML_Q4_0 ? ops->gemm_q4_0
                              : type == TD_GGML_Q4_1 ? ops->gemm_q4_1
                              : type == TD_GGML_Q4_K ? ops->gemm_q4_k
                              : type == TD_GGML_Q6_K ? ops->gemm_q6_k : NULL;
    if (gemm) {
        gemm(w, row_bytes, n_rows, a, m, k, y, ldy);
        return;
    }
    size_t nb = k / TD_QK;
    for (size_t r = 0; r < n_rows; r++)
        for (size_t i = 0; i < m; i++)
            y[i * ldy + r] = dot((const uint8_t *)w + r * row_bytes, a + i * nb, k);
}
