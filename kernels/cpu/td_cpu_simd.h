/*
 * td_cpu_simd: the AVX2 pieces both activation quantizers are built from (td_cpu_pack's
 * two-byte one, td_cpu_quant's one-byte one): a block's largest magnitude, round half away
 * from zero, the int32-to-int8 pack, an int32 horizontal sum. Each gives exactly what the
 * scalar quantizers' C does (fmaxf ignoring NaN, roundf, a plain integer sum), so the SIMD
 * quantizers stay bit-identical to them. Compiled for AVX2 whatever the build's -march
 * (TD_CPU_AVX2); only x86 includes it.
 */
#ifndef TD_CPU_SIMD_H
#define TD_CPU_SIMD_H

#include <immintrin.h>
#include <stdbool.h>

#include "td_cpu_isa.h"

/* Loads the 32 floats at x into xv; returns max |x| over the non-NaN ones (0 if none) and
 * sets *nan when one is NaN. max_ps returns its second operand for a NaN lane, so a NaN
 * never becomes the maximum, as with fmaxf. */
TD_CPU_AVX2_INLINE float td_cpu_simd_amax32(const float *x, __m256 xv[4], bool *nan)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps(), n = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        xv[j] = _mm256_loadu_ps(x + 8 * j);
        amax = _mm256_max_ps(_mm256_andnot_ps(sign, xv[j]), amax);
        n = _mm256_or_ps(n, _mm256_cmp_ps(xv[j], xv[j], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    *nan = _mm256_movemask_ps(n) != 0;
    return _mm_cvtss_f32(m4);
}

/* v clamped to [-127, 127] (NaN to -127: max_ps gives its second operand), as the scalar
 * `v >= -127 ? v : -127`, then `v <= 127 ? v : 127` */
TD_CPU_AVX2_INLINE __m256 td_cpu_simd_clamp127(__m256 v)
{
    return _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
}

/* roundf on 8 lanes: truncate, then one away from zero where the exact remainder is >= 1/2 */
TD_CPU_AVX2_INLINE __m256 td_cpu_simd_round_away(__m256 v)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, sign));
    return _mm256_add_ps(t, _mm256_and_ps(up, one));
}

/* 4 x 8 int32 (each in [-127, 127]) to 32 int8 in order */
TD_CPU_AVX2_INLINE __m256i td_cpu_simd_pack_i8(const __m256i q[4])
{
    __m256i ab = _mm256_packs_epi32(q[0], q[1]), cd = _mm256_packs_epi32(q[2], q[3]);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* the sum of 8 int32 lanes (integers: any order gives the same) */
TD_CPU_AVX2_INLINE int32_t td_cpu_simd_hsum_i32(__m256i v)
{
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
}

#endif /* TD_CPU_SIMD_H */
