/*
 * test_cpu_fgemm: the AVX-512 float-weight matmul (td_cpu_fgemm, issue 14) against a
 * double-precision reference, bit for bit against a scalar model of its order contract
 * (16 lanes over k with fmaf, then the fixed tree), and batch invariance: a row's output
 * does not depend on how many X rows or which W rows a call computes.
 *
 * Tolerance: an output sums k products in 16 lane accumulators of ceil(k / 16) FMAs each (at
 * most that many roundings on a partial sum of magnitude <= S, S = sum |w_e x_e|), then a
 * 4-level tree, so it is within (k / 16 + 5) * 2^-24 * S (first order) of the exact sum,
 * which the test allows. f16/bf16 weights widen to f32 exactly, so the reference is over
 * the same f32 values.
 *
 * Shapes: every decode tile (m = 1..5) and the prefill tile (m >= 6) with its m % 6 tails,
 * n not a multiple of the tiles' 4, 6 or 8 rows, k below, at and around multiples of 16.
 * A CPU without AVX-512 skips with a line saying so.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/td_cpu_fgemm.h"
#include "td_dtype.h"
#include "td_util.h"

static const td_dtype_t types[] = {TD_F32, TD_F16, TD_BF16};
#define N_TYPES (sizeof types / sizeof types[0])

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float uniform(uint64_t *s)
{
    return (float)((double)(rng_next(s) >> 11) * 0x1.0p-52 - 1.0);
}

/* n rows of k weights of `type`, uniform in [-1, 1) rounded to the type; wf gets their f32
 * values. Caller frees both. */
static void *make_weights(td_dtype_t type, size_t n, size_t k, float **wf_p, uint64_t *s)
{
    void *w = malloc(td_dtype_bytes(type, n * k));
    float *wf = malloc(n * k * sizeof *wf);
    cr_assert(w && wf);
    for (size_t i = 0; i < n * k; i++) {
        float v = uniform(s);
        switch (type) {
        case TD_F32: ((float *)w)[i] = v; break;
        case TD_F16: ((uint16_t *)w)[i] = td_f32_to_f16(v), v = td_f16_to_f32(((uint16_t *)w)[i]); break;
        default: ((uint16_t *)w)[i] = td_f32_to_bf16(v), v = td_bf16_to_f32(((uint16_t *)w)[i]); break;
        }
        wf[i] = v;
    }
    *wf_p = wf;
    return w;
}

static float *make_x(size_t m, size_t k, uint64_t *s)
{
    float *x = malloc(m * k * sizeof *x);
    cr_assert(x);
    for (size_t i = 0; i < m * k; i++)
        x[i] = uniform(s);
    return x;
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* The header's order, one product at a time: lane e % 16 by fmaf, then the tree. */
static float dot_model(const float *w, const float *x, size_t k)
{
    float acc[16] = {0}, s8[8], s4[4], s2[2];
    for (size_t e = 0; e < k; e++)
        acc[e % 16] = fmaf(w[e], x[e], acc[e % 16]);
    for (int l = 0; l < 8; l++)
        s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++)
        s4[l] = s8[l] + s8[l + 4];
    for (int l = 0; l < 2; l++)
        s2[l] = s4[l] + s4[l + 2];
    return s2[0] + s2[1];
}

/* Every type, decode and prefill shapes: within the f32 bound of the double reference and
 * bit-identical to the order model. y strided (ldy > n) as the backend's tiles are. */
Test(cpu_fgemm, matches_reference_and_order_model, .timeout = 120)
{
    if (!td_cpu_fgemm_available())
        cr_skip_test("skipped: this CPU has no AVX-512 F/BW/VL");
    static const size_t ks[] = {1, 7, 15, 16, 17, 33, 100, 257, 576, 2049};
    static const size_t ms[] = {1, 2, 3, 4, 5, 6, 7, 11, 13, 64};
    static const size_t ns[] = {1, 3, 7, 9, 17, 33};
    uint64_t seed = 14;
    for (size_t t = 0; t < N_TYPES; t++)
        for (size_t ki = 0; ki < TD_ARRAY_LEN(ks); ki++)
            for (size_t mi = 0; mi < TD_ARRAY_LEN(ms); mi++)
                for (size_t ni = 0; ni < TD_ARRAY_LEN(ns); ni++) {
                    size_t k = ks[ki], m = ms[mi], n = ns[ni], ldy = n + 3;
                    float *wf;
                    void *w = make_weights(types[t], n, k, &wf, &seed);
                    float *x = make_x(m, k, &seed);
                    float *y = malloc(m * ldy * sizeof *y);
                    cr_assert(y);
                    td_cpu_fgemm(types[t], w, n, x, m, k, y, ldy);
                    for (size_t i = 0; i < m; i++)
                        for (size_t j = 0; j < n; j++) {
                            const float *wr = wf + j * k, *xr = x + i * k;
                            double ref = 0.0, mag = 0.0;
                            for (size_t e = 0; e < k; e++) {
                                ref += (double)wr[e] * (double)xr[e];
                                mag += fabs((double)wr[e] * (double)xr[e]);
                            }
                            double tol = ((double)k / 16 + 5) * 0x1.0p-24 * mag;
                            float got = y[i * ldy + j], want = dot_model(wr, xr, k);
                            cr_assert(fabs((double)got - ref) <= tol,
                                      "%s k %zu m %zu n %zu: y[%zu][%zu] %.9g vs %.9g (tol %.3g)",
                                      td_dtype_name(types[t]), k, m, n, i, j, (double)got, ref, tol);
                            cr_assert_eq(bits(got), bits(want),
                                         "%s k %zu m %zu n %zu: y[%zu][%zu] %.9g, order model %.9g",
                                         td_dtype_name(types[t]), k, m, n, i, j, (double)got,
                                         (double)want);
                        }
                    free(y);
                    free(x);
                    free(wf);
                    free(w);
                }
}

/* A row's output is the same bits whether computed alone, in a decode batch or in a 70-row
 * prefill, and whichever W rows one call takes: X rows in groups of 1..7 and 70 at every
 * offset, W rows split at several points. */
Test(cpu_fgemm, batch_invariant, .timeout = 60)
{
    if (!td_cpu_fgemm_available())
        cr_skip_test("skipped: this CPU has no AVX-512 F/BW/VL");
    static const size_t group[] = {1, 2, 3, 4, 5, 6, 7, 70};
    uint64_t seed = 41;
    const size_t n = 21, m = 70, k = 300;
    for (size_t t = 0; t < N_TYPES; t++) {
        float *wf;
        void *w = make_weights(types[t], n, k, &wf, &seed);
        float *x = make_x(m, k, &seed);
        float *whole = malloc(m * n * sizeof *whole), *part = malloc(m * n * sizeof *part);
        cr_assert(whole && part);
        td_cpu_fgemm(types[t], w, n, x, m, k, whole, n);
        size_t row_bytes = td_dtype_bytes(types[t], k);
        for (size_t g = 0; g < TD_ARRAY_LEN(group); g++) {
            memset(part, 0, m * n * sizeof *part);
            size_t split = 1 + g * 3 % (n - 1); /* W rows [0, split) and [split, n) */
            for (size_t i = 0; i < m; i += group[g]) {
                size_t mm = TD_MIN(group[g], m - i);
                td_cpu_fgemm(types[t], w, split, x + i * k, mm, k, part + i * n, n);
                td_cpu_fgemm(types[t], (const char *)w + split * row_bytes, n - split, x + i * k, mm, k,
                             part + i * n + split, n);
            }
            for (size_t i = 0; i < m * n; i++)
                cr_assert_eq(bits(part[i]), bits(whole[i]), "%s groups of %zu split %zu: y[%zu] %.9g vs %.9g",
                             td_dtype_name(types[t]), group[g], split, i, (double)part[i], (double)whole[i]);
        }
        free(part);
        free(whole);
        free(x);
        free(wf);
        free(w);
    }
}

/* Non-finite inputs propagate as IEEE says: an inf weight against a nonzero activation
 * gives inf, inf against 0 or a NaN anywhere gives NaN, and a masked tail lane never turns
 * into one (k = 17: lanes 1..15 of the last chunk are absent, not 0 * garbage). */
Test(cpu_fgemm, special_values)
{
    if (!td_cpu_fgemm_available())
        cr_skip_test("skipped: this CPU has no AVX-512 F/BW/VL");
    const size_t k = 17;
    float w[3][17], x[17], y[3];
    for (size_t e = 0; e < k; e++) {
        w[0][e] = w[1][e] = w[2][e] = 1.0f;
        x[e] = 1.0f;
    }
    w[0][3] = INFINITY;
    w[1][16] = INFINITY;
    x[16] = 0.0f; /* row 1: inf * 0 in the masked tail chunk */
    w[2][5] = NAN;
    td_cpu_fgemm(TD_F32, w, 3, x, 1, k, y, 3);
    cr_assert(isinf(y[0]) && y[0] > 0, "inf weight: %g", (double)y[0]);
    cr_assert(isnan(y[1]), "inf * 0: %g", (double)y[1]);
    cr_assert(isnan(y[2]), "NaN weight: %g", (double)y[2]);
}
