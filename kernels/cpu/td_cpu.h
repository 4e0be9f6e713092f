/*
 * td_cpu: internals of the CPU backend shared by its files (backend context, scratch
 * management, small vector kernels). Not a public header: only kernels/cpu/ includes it.
 *
 * The context owns one thread pool and grow-only scratch: per-thread slices (conversion
 * tiles, attention tiles) and one shared area (task tables, split-KV partials). Ops size
 * the scratch with td_cpu_reserve() before td_pool_run, so a steady-state step allocates
 * nothing.
 */
#ifndef TD_CPU_H
#define TD_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "td_backend.h"
#include "td_cpu_kernels.h"
#include "td_quant.h"
#include "td_threadpool.h"
#include "td_util.h"

#if TD_CPU_X86
#include <immintrin.h>
#endif

typedef struct td_cpu {
    td_backend_t base; /* first: a td_backend_t * is a td_cpu_t * */
    td_pool_t *pool;
    int n_threads;
    bool exact;          /* td_cpu_config_t.exact */
    bool act_one_byte;   /* td_cpu_config_t.act_one_byte */
    td_cpu_kernels_t k;  /* every op's kernels, of one ISA level, chosen at creation */
    td_step_meta_t meta; /* pointers owned by the engine, valid until the next set_step */
    bool have_step;
    /* the step's rotation angles, computed by the first rope_kv_write of a step and read by
       the other layers': per row its cos, then its sin, of inv_freq (head_dim / 2 each) */
    float *rope;
    size_t rope_cap;         /* floats */
    const float *rope_freq;  /* whose angles rope holds for this step (NULL: none yet) */
    int32_t rope_hd;

    unsigned char *scratch;  /* [n_threads][scratch_stride] bytes, 64-byte aligned slices */
    size_t scratch_stride;
    unsigned char *shared;   /* [shared_bytes] */
    size_t shared_bytes;
} td_cpu_t;

static inline td_cpu_t *td_cpu_of(td_backend_t *be)
{
    return (td_cpu_t *)be;
}

/* Grows the scratch to at least per_thread bytes per thread and `shared` shared bytes.
   Errors: TD_ERR_NOMEM (scratch unchanged). Caller thread only (not inside a pool job). */
td_status_t td_cpu_reserve(td_cpu_t *cpu, size_t per_thread, size_t shared);

static inline void *td_cpu_thread_scratch(td_cpu_t *cpu, int thread)
{
    return cpu->scratch + (size_t)thread * cpu->scratch_stride;
}

/* ops implemented in td_cpu_matmul.c and td_cpu_attn.c */
td_status_t td_cpu_matmul(td_backend_t *be, const td_matmul_params_t *p);
td_status_t td_cpu_matmuls(td_backend_t *be, const td_matmul_params_t *ps, int32_t count);
td_status_t td_cpu_attn_prefill(td_backend_t *be, const td_attn_params_t *p);
td_status_t td_cpu_attn_decode(td_backend_t *be, const td_attn_params_t *p);

/* ---- element conversion ---------------------------------------------------------- */

/* dst[i] = (float)src[i] for n elements of dtype t: a float type, or Q8_0 (a KV cache's; n
 * a multiple of 32) through td_quant's reference. */
static inline void td_cpu_to_f32(float *dst, const void *src, td_dtype_t t, size_t n)
{
    size_t i = 0;
    if (t == TD_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    if (t == TD_Q8_0) {
        td_quant_dequantize_q8_0(src, dst, n);
        return;
    }
    const uint16_t *s = src;
    if (t == TD_BF16) {
        /* bf16 is the top half of an f32: a shift, which the compiler vectorises */
        for (; i < n; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            float f;
            memcpy(&f, &u, sizeof(f));
            dst[i] = f;
        }
        return;
    }
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < n; i++)
        dst[i] = td_f16_to_f32(s[i]);
}

/* dst[i] = src[i] converted to dtype t (round to nearest even) for n floats; Q8_0 (a KV
 * cache's; n a multiple of 32) through td_quant's reference quantizer. */
static inline void td_cpu_from_f32(void *dst, td_dtype_t t, const float *src, size_t n)
{
    size_t i = 0;
    if (t == TD_F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    if (t == TD_Q8_0) {
        td_quant_quantize_q8_0(src, dst, n);
        return;
    }
    uint16_t *d = dst;
    if (t == TD_BF16) {
        for (; i < n; i++)
            d[i] = td_f32_to_bf16(src[i]);
        return;
    }
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        d[i] = td_f32_to_f16(src[i]);
}

/* ---- small vector kernels (plain loops the compiler vectorises at -O3) ------------ */

static inline float td_cpu_dot(const float *a, const float *b, int n)
{
    float s = 0.0f;
    for (int i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

#if TD_CPU_X86
/* td_cpu_dot in two 8-lane FMA chains, one horizontal sum, a scalar tail */
TD_CPU_AVX2 static inline float td_cpu_dot_avx2(const float *a, const float *b, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s0 = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s0), _mm256_extractf128_ps(s0, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    float s = _mm_cvtss_f32(h);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}
#endif

/* y += a * x */
static inline void td_cpu_axpy(float *restrict y, float a, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += a * x[i];
}

static inline void td_cpu_scale(float *y, float a, int n)
{
    for (int i = 0; i < n; i++)
        y[i] *= a;
}

/*
 * exp(x) as softmax (x <= 0) and silu use it, ~2 ulp on [-87, 88]: range reduction by ln 2
 * and a degree-6 polynomial, written without calls or branches so loops over it vectorise,
 * and bit-identical to td_cpu_exp8's lanes (the same fused multiply-adds, fmaf, and floor as
 * a conversion: |x * log2 e + 0.5| < 128 after the clamp), so a row's tail computed here
 * equals what a vector lane would give: no result depends on where a task's range starts.
 * (With __builtin_floorf GCC called floorf, whose SSE4.1 form may raise inexact, in every
 * iteration: SwiGLU took 12% of a SmolLM2 prefill, scalar.)
 * Defined for every input (docs/kernels.md): below -87, -inf included, it gives exp(-87)
 * ~1.6e-38 (never denormal garbage; nothing beside a 1 in a sum); above 88, +inf included,
 * exp(88) ~1.65e38 (finite); NaN gives NaN. The clamp is written so that NaN fails both
 * tests and is clamped too, so the float-to-int conversion always sees [-125, 127] and the
 * exponent is shifted as an unsigned value: no input reaches a conversion out of range or a
 * shift of a negative value (before, NaN did both).
 */
static inline float td_cpu_exp(float x)
{
    float c = x > -87.0f ? x : -87.0f;
    c = c < 88.0f ? c : 88.0f;
    float v = fmaf(c, 1.44269504088896341f, 0.5f);
    float t = (float)(int32_t)v; /* truncation; floor is one less below zero */
    float n = t > v ? t - 1.0f : t;
    float r = fmaf(-n, 0.693359375f, c);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r + 1.0f);
    uint32_t e = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof(scale));
    return x == x ? p * scale : x; /* NaN in, NaN out */
}

#if TD_CPU_X86
/* td_cpu_exp on 8 lanes (same constants, same clamping, same special values: max/min_ps
 * return their second operand for a NaN lane, the final blend puts the NaN back) */
TD_CPU_AVX2 static inline __m256 td_cpu_exp8(__m256 x)
{
    __m256 c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(c, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), c);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

#if TD_CPU_X86
/* The sum of v's eight lanes, always in the same order (the kernels' results depend on it
 * being one order: batch invariance, docs/kernels.md). */
TD_CPU_AVX2 static inline float td_cpu_hsum8(__m256 v)
{
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* max of x[0..n), n >= 1 */
static inline float td_cpu_max(const float *x, int n)
{
    float m = x[0];
    for (int i = 1; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

/* x[i] = exp(x[i] - m) in place; returns the sum of the results */
static inline float td_cpu_exp_sum(float *x, float m, int n)
{
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = td_cpu_exp(x[i] - m);
        s += x[i];
    }
    return s;
}

#if TD_CPU_X86
TD_CPU_AVX2 static inline float td_cpu_max_avx2(const float *x, int n)
{
    float m = x[0];
    int i = 0;
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8)
            v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm_cvtss_f32(h);
    }
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

/* td_cpu_exp_sum with td_cpu_exp8: the same exps, the sum in 8 lanes then one hsum */
TD_CPU_AVX2 static inline float td_cpu_exp_sum_avx2(float *x, float m, int n)
{
    int i = 0;
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) {
        __m256 e = td_cpu_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float s = td_cpu_hsum8(acc);
    for (; i < n; i++) {
        x[i] = td_cpu_exp(x[i] - m);
        s += x[i];
    }
    return s;
}
#endif

#endif /* TD_CPU_H */
