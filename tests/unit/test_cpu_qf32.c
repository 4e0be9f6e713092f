/*
 * test_cpu_qf32: the f32-activation quantized matmul (td_cpu_qf32, issue 14) against a
 * double-precision reference over td_quant's dequantized weights, every SIMD table against
 * the scalar one bit for bit, and batch invariance: a row's output does not depend on how
 * many X rows or which W rows a call computes.
 *
 * Tolerance: an output sums k products in 16 lane accumulators of k / 16 FMAs each (at most
 * k / 16 roundings on a partial sum of magnitude <= S, S = sum |w_e x_e| over the f32
 * weights td_quant gives), then a 4-level tree, so it is within (k / 16 + 4) * 2^-24 * S
 * (first order) of the exact sum; the test allows (k / 16 + 5) * 2^-24 * S. Nothing in the
 * data is subnormal in f32, so the relative bound holds.
 *
 * Data: random seeded blocks (every quant byte random: Q8_0's -128, Q6_K's -128 scales,
 * all 6-bit Q4_K scales and mins), f16 scales typical or extreme (f16 subnormal, 65504),
 * activations uniform in [-1, 1). A table this CPU cannot run is skipped with a line
 * saying so.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/td_cpu_qf32.h"
#include "td_dtype.h"
#include "td_quant.h"
#include "td_util.h"

static const td_dtype_t types[] = {TD_Q8_0, TD_Q4_0, TD_Q4_1, TD_Q4_K, TD_Q6_K};
#define N_TYPES (sizeof types / sizeof types[0])

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* f16 bits of a finite scale, either sign: 2^-6..2^2, or anything finite when extreme */
static uint16_t f16_scale(uint64_t *s, bool extreme)
{
    uint16_t sign = (uint16_t)((rng_next(s) & 1) << 15);
    uint16_t mant = (uint16_t)(rng_next(s) & 1023);
    if (!extreme)
        return sign | (uint16_t)((9 + rng_next(s) % 8) << 10) | mant;
    return sign | (uint16_t)((rng_next(s) % 31) << 10) | mant;
}

/* n rows of k weights of `type`, each row_bytes apart (row_bytes >= the dense row; the gap
 * is filled with garbage the kernels must not read as weights). Caller frees. */
static uint8_t *make_weights(td_dtype_t type, size_t n, size_t k, size_t row_bytes,
                             bool extreme, uint64_t *s)
{
    size_t be = td_dtype_block_elems(type), bb = td_dtype_block_bytes(type);
    uint8_t *w = malloc(n * row_bytes);
    cr_assert(w);
    for (size_t i = 0; i < n * row_bytes; i++)
        w[i] = (uint8_t)rng_next(s);
    for (size_t j = 0; j < n; j++) {
        for (size_t b = 0; b < k / be; b++) {
            void *blk = w + j * row_bytes + b * bb;
            switch (type) {
            case TD_Q8_0: ((td_block_q8_0_t *)blk)->d = f16_scale(s, extreme); break;
            case TD_Q4_0: ((td_block_q4_0_t *)blk)->d = f16_scale(s, extreme); break;
            case TD_Q4_1:
                ((td_block_q4_1_t *)blk)->d = f16_scale(s, extreme);
                ((td_block_q4_1_t *)blk)->m = f16_scale(s, extreme);
                break;
            case TD_Q4_K:
                ((td_block_q4_k_t *)blk)->d = f16_scale(s, extreme);
                ((td_block_q4_k_t *)blk)->dmin = f16_scale(s, extreme);
                break;
            default: ((td_block_q6_k_t *)blk)->d = f16_scale(s, extreme); break;
            }
        }
    }
    return w;
}

static float *make_x(size_t m, size_t k, uint64_t *s)
{
    float *x = malloc(m * k * sizeof *x);
    cr_assert(x);
    for (size_t i = 0; i < m * k; i++)
        x[i] = (float)((double)(rng_next(s) >> 11) * 0x1.0p-52 - 1.0);
    return x;
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* the tables this CPU runs; logs the ones it skips */
static size_t tables(const td_cpu_qf32_ops_t *out[TD_CPU_ISA_COUNT])
{
    size_t n = 0;
    for (int isa = 0; isa < TD_CPU_ISA_COUNT; isa++) {
        if (!td_cpu_isa_runs((td_cpu_isa_t)isa)) {
            fprintf(stderr, "skipped: level %s (this CPU cannot run it)\n", td_cpu_isa_name((td_cpu_isa_t)isa));
            continue;
        }
        const td_cpu_qf32_ops_t *ops = td_cpu_qf32_ops((td_cpu_isa_t)isa);
        if (n == 0 || out[n - 1] != ops) /* a level without a table of its own runs the one below */
            out[n++] = ops;
    }
    return n;
}

Test(cpu_qf32, tables_and_types)
{
    const td_cpu_qf32_ops_t *best = td_cpu_qf32_ops(td_cpu_isa_best());
    cr_assert(best);
    for (size_t t = 0; t < N_TYPES; t++)
        cr_assert(td_cpu_qf32_fn_of(best, types[t]), "type %d has a kernel", types[t]);
    cr_assert_null(td_cpu_qf32_fn_of(best, TD_F32));
    cr_assert_null(td_cpu_qf32_fn_of(best, TD_Q5_0));
}

/* Every table, every type, several k: within the f32 bound of the double reference over
 * td_quant's weights, and bit-identical to the scalar table. Rows padded (row_bytes >
 * dense) and y strided (ldy > n) as a caller slicing a larger matrix does. */
Test(cpu_qf32, matches_reference_and_scalar)
{
    static const size_t ks[] = {32, 64, 96, 256, 576, 1536};
    const td_cpu_qf32_ops_t *ops[TD_CPU_ISA_COUNT];
    size_t n_ops = tables(ops);
    uint64_t seed = 14;
    const size_t n = 9, m = 11, ldy = n + 3;
    for (size_t t = 0; t < N_TYPES; t++) {
        for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
            size_t k = ks[ki];
            if (k % td_dtype_block_elems(types[t]))
                continue;
            for (int extreme = 0; extreme < 2; extreme++) {
                size_t row_bytes = td_dtype_bytes(types[t], k) + (extreme ? 6 : 0);
                uint8_t *w = make_weights(types[t], n, k, row_bytes, extreme, &seed);
                float *x = make_x(m, k, &seed);
                float *wf = malloc(k * sizeof *wf);
                float *y0 = malloc(m * ldy * sizeof *y0), *y1 = malloc(m * ldy * sizeof *y1);
                cr_assert(wf && y0 && y1);
                td_cpu_qf32_matmul(ops[0], types[t], w, row_bytes, 0, n, x, m, k, y0, ldy);
                const td_ggml_type_t *gt = td_ggml_type(td_dtype_to_ggml(types[t]));
                for (size_t j = 0; j < n; j++) {
                    gt->dequantize(w + j * row_bytes, wf, k);
                    for (size_t i = 0; i < m; i++) {
                        double ref = 0.0, mag = 0.0;
                        for (size_t e = 0; e < k; e++) {
                            ref += (double)wf[e] * (double)x[i * k + e];
                            mag += fabs((double)wf[e] * (double)x[i * k + e]);
                        }
                        double tol = ((double)k / 16 + 5) * 0x1.0p-24 * mag;
                        cr_assert(fabs((double)y0[i * ldy + j] - ref) <= tol,
                                  "type %d k %zu row %zu col %zu: %.9g vs %.9g (tol %.3g)",
                                  types[t], k, i, j, (double)y0[i * ldy + j], ref, tol);
                    }
                }
                for (size_t o = 1; o < n_ops; o++) {
                    memset(y1, 0, m * ldy * sizeof *y1);
                    td_cpu_qf32_matmul(ops[o], types[t], w, row_bytes, 0, n, x, m, k, y1, ldy);
                    for (size_t i = 0; i < m; i++)
                        for (size_t j = 0; j < n; j++)
                            cr_assert_eq(bits(y1[i * ldy + j]), bits(y0[i * ldy + j]),
                                         "%s type %d k %zu: y[%zu][%zu] %.9g, scalar %.9g",
                                         ops[o]->name, types[t], k, i, j,
                                         (double)y1[i * ldy + j], (double)y0[i * ldy + j]);
                }
                free(y1);
                free(y0);
                free(wf);
                free(x);
                free(w);
            }
        }
    }
}

/* A row's output is the same bits whether computed alone, in a decode batch or in a 64-row
 * prefill, and whichever W rows one call takes: every table, every type, X rows taken in
 * groups of m (1, 3, 4, 5, 9, 64) at every offset, W rows split at several points. */
Test(cpu_qf32, batch_invariant)
{
    static const size_t group[] = {1, 3, 4, 5, 9, 64};
    const td_cpu_qf32_ops_t *ops[TD_CPU_ISA_COUNT];
    size_t n_ops = tables(ops);
    uint64_t seed = 41;
    const size_t n = 13, m = 64;
    for (size_t t = 0; t < N_TYPES; t++) {
        size_t k = td_dtype_block_elems(types[t]) == TD_QK ? 160 : 512;
        size_t row_bytes = td_dtype_bytes(types[t], k);
        uint8_t *w = make_weights(types[t], n, k, row_bytes, false, &seed);
        float *x = make_x(m, k, &seed);
        float *whole = malloc(m * n * sizeof *whole), *part = malloc(m * n * sizeof *part);
        cr_assert(whole && part);
        td_cpu_qf32_matmul(ops[0], types[t], w, row_bytes, 0, n, x, m, k, whole, n);
        for (size_t o = 0; o < n_ops; o++) {
            for (size_t g = 0; g < sizeof group / sizeof group[0]; g++) {
                size_t split = 1 + (g * 5) % (n - 1); /* W rows [0, split) and [split, n) */
                memset(part, 0xff, m * n * sizeof *part);
                for (size_t i0 = 0; i0 < m; i0 += group[g]) {
                    size_t mi = m - i0 < group[g] ? m - i0 : group[g];
                    const float *xi = x + i0 * k;
                    float *yi = part + i0 * n;
                    td_cpu_qf32_matmul(ops[o], types[t], w, row_bytes, 0, split, xi, mi, k, yi, n);
                    td_cpu_qf32_matmul(ops[o], types[t], w, row_bytes, split, n, xi, mi, k, yi, n);
                }
                for (size_t i = 0; i < m * n; i++)
                    cr_assert_eq(bits(part[i]), bits(whole[i]),
                                 "%s type %d: rows in groups of %zu, W split at %zu: y[%zu][%zu] "
                                 "%.9g, whole %.9g",
                                 ops[o]->name, types[t], group[g], split, i / n, i % n,
                                 (double)part[i], (double)whole[i]);
            }
        }
        free(part);
        free(whole);
        free(x);
        free(w);
    }
}
