/*
 * test_quant_dot: the quantized dot kernels of td_cpu_quant (issue 14) against a plain
 * double-precision reference built from td_quant's dequantizers, and the AVX2 kernels
 * against the scalar ones.
 *
 * Reference: the weight row dequantized by td_quant (bit-exact to ggml), the activation
 * blocks dequantized as a_i = d * qs[i] in f32, their dot summed in double. The scalar
 * kernel must be within (nb + 8) * 2^-24 * S of it, nb = k / 32 blocks, where S is the sum
 * of the magnitudes of everything the kernel adds: sum |w_i a_i|, and for Q4_1 (whose
 * kernel adds d q_i a_i and m * s separately, and these can cancel) also sum |d q_i a_i|,
 * sum |m a_i| and sum_b |m_b s_b|. Why that bound: each of the 8 lane accumulators is a
 * recursive f32 sum of nb FMA terms (at most nb - 1 roundings each, gamma_{nb} of the sum
 * of magnitudes), the scale d_w * d_a is rounded once, the horizontal sum adds 3 levels
 * and Q4_1's offset sum 1 more, and the reference's own f32 dequantization of a_i (and of
 * d q + m) is off by half an ulp; nb + 8 units of 2^-24 cover all of them. Scales are chosen
 * so nothing is subnormal in f32 (the bound is relative; subnormals would need an absolute
 * term): f16 weight scales from subnormal to 65504, activation blocks from 1e-20 to 1e25.
 *
 * Q4_K's kernel, like Q4_1's, adds the scaled quants and the mins apart, so its S also
 * counts sum |dmin mn a_i| (twice: the weight is a difference) and sum_b |dmin mn s_b|,
 * with mn bounded by 63.
 *
 * Every SIMD table (AVX2, AVX-512 VNNI) vs scalar: bitwise, single dots and blocked GEMM
 * tiles. All compute the same exact int32 lane sums and then the same f32 operations in the
 * same order (td_cpu_quant.h), so any difference is a bug, not rounding. A table this CPU
 * cannot run is skipped with a line saying so. Rows of 32..4096 weights, several not
 * multiples of 256, random seeded data, Q8_0 quants over the full int8 range (-128 included).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/td_cpu_quant.h"
#include "td_quant.h"
#include "td_util.h"

static const size_t row_lengths[] = {32, 64, 96, 256, 288, 512, 1056, 1280, 2080, 4000, 4096};
#define N_LENGTHS (sizeof row_lengths / sizeof row_lengths[0])
static const uint32_t types[] = {TD_GGML_Q8_0, TD_GGML_Q4_0, TD_GGML_Q4_1, TD_GGML_Q4_K,
                                 TD_GGML_Q6_K};
#define N_TYPES (sizeof types / sizeof types[0])

/* whether rows of k weights exist in `type` (the K formats come in blocks of 256) */
static bool fits(uint32_t type, size_t k)
{
    return k % td_ggml_type(type)->block_elems == 0;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s) /* [0, 1) */
{
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

/* f16 bits of a weight scale: typical (2^-6 .. 2^2) or extreme (zero, subnormal, smallest
 * normal, 65504, anything finite), either sign */
static uint16_t f16_scale(uint64_t *s, bool extreme)
{
    uint16_t sign = (uint16_t)((rng_next(s) & 1) << 15);
    uint16_t mant = (uint16_t)(rng_next(s) & 1023);
    if (!extreme)
        return sign | (uint16_t)((9 + rng_next(s) % 8) << 10) | mant;
    switch (rng_next(s) % 5) {
    case 0: return sign | mant;                 /* subnormal (or zero) */
    case 1: return sign | 0x0400;               /* smallest normal */
    case 2: return sign | 0x7bff;               /* 65504 */
    default: return sign | (uint16_t)((rng_next(s) % 31) << 10) | mant;
    }
}

/* n_rows rows of k weights of `type`, raw random blocks (caller frees) */
static void *make_weights(uint32_t type, size_t n_rows, size_t k, bool extreme, uint64_t *s)
{
    const td_ggml_type_t *t = td_ggml_type(type);
    size_t nb = n_rows * k / t->block_elems;
    uint8_t *w = malloc(nb * t->block_bytes);
    for (size_t b = 0; b < nb; b++) {
        void *blk = w + b * t->block_bytes;
        if (type == TD_GGML_Q8_0) {
            td_block_q8_0_t *q = blk;
            q->d = f16_scale(s, extreme);
            for (int i = 0; i < TD_QK; i++)
                q->qs[i] = (int8_t)(rng_next(s) & 255);
        } else if (type == TD_GGML_Q4_0) {
            td_block_q4_0_t *q = blk;
            q->d = f16_scale(s, extreme);
            for (int i = 0; i < TD_QK / 2; i++)
                q->qs[i] = (uint8_t)rng_next(s);
        } else if (type == TD_GGML_Q4_1) {
            td_block_q4_1_t *q = blk;
            q->d = f16_scale(s, extreme);
            q->m = f16_scale(s, extreme);
            for (int i = 0; i < TD_QK / 2; i++)
                q->qs[i] = (uint8_t)rng_next(s);
        } else { /* K formats: every byte random (6-bit scales, mins, quants), then d, dmin */
            uint8_t *bytes = blk;
            for (size_t i = 0; i < t->block_bytes; i++)
                bytes[i] = (uint8_t)rng_next(s);
            if (type == TD_GGML_Q4_K) {
                ((td_block_q4_k_t *)blk)->d = f16_scale(s, extreme);
                ((td_block_q4_k_t *)blk)->dmin = f16_scale(s, extreme);
            } else {
                ((td_block_q6_k_t *)blk)->d = f16_scale(s, extreme);
            }
        }
    }
    return w;
}

/* k activations quantized to blocks: uniform in [-1, 1), each block times 10^[-20, 25]
 * when extreme; every 7th block zero */
static td_cpu_q8a_block_t *make_act(size_t k, bool extreme, uint64_t *s)
{
    float *x = malloc(k * sizeof *x);
    for (size_t b = 0; b < k / TD_QK; b++) {
        double scale = extreme ? pow(10.0, -20.0 + 45.0 * rng_unit(s)) : 1.0;
        for (int i = 0; i < TD_QK; i++)
            x[b * TD_QK + i] = b % 7 == 6 ? 0.0f : (float)((2.0 * rng_unit(s) - 1.0) * scale);
    }
    td_cpu_q8a_block_t *a = malloc(k / TD_QK * sizeof *a);
    td_cpu_quant_act_row(x, a, k);
    free(x);
    return a;
}

/* the double reference of one row, and the bound the scalar kernel must meet */
static double reference(uint32_t type, const void *w, const td_cpu_q8a_block_t *a, size_t k,
                        double *tol_p)
{
    const td_ggml_type_t *t = td_ggml_type(type);
    float *wf = malloc(k * sizeof *wf);
    t->dequantize(w, wf, k);
    double dot = 0.0, mag = 0.0;
    for (size_t i = 0; i < k; i++) {
        const td_cpu_q8a_block_t *ab = &a[i / TD_QK];
        double ai = (double)(ab->d * (float)ab->qs[i % TD_QK]);
        dot += (double)wf[i] * ai;
        mag += fabs((double)wf[i] * ai);
        if (type == TD_GGML_Q4_1) {
            const td_block_q4_1_t *q = (const td_block_q4_1_t *)w + i / TD_QK;
            size_t j = i % TD_QK;
            int qi = j < 16 ? q->qs[j] & 15 : q->qs[j - 16] >> 4;
            double m = td_f16_to_f32(q->m);
            mag += fabs(td_f16_to_f32(q->d) * qi * ai) + fabs(m * ai);
            if (j == 0)
                mag += fabs(m * ab->s);
        } else if (type == TD_GGML_Q4_K) {
            /* the kernel adds (d sc) q a and -(dmin mn) s apart; the weight is their
             * difference, so count both: |w a| <= |d sc q a| + |dmin mn a| */
            const td_block_q4_k_t *q = (const td_block_q4_k_t *)w + i / TD_QK_K;
            size_t j = i % TD_QK;
            double mn = fabs((double)td_f16_to_f32(q->dmin)) * 63.0;
            mag += fabs((double)wf[i] * ai) + 2.0 * mn * fabs(ai);
            if (j == 0)
                mag += mn * fabs((double)ab->s);
        }
    }
    free(wf);
    *tol_p = (double)(k / TD_QK + 8) * 0x1.0p-24 * mag;
    return dot;
}

static void check_scalar(bool extreme, uint64_t seed)
{
    const td_cpu_quant_ops_t *ops = td_cpu_quant_ops(TD_CPU_ISA_SCALAR);
    uint64_t s = seed;
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        for (size_t li = 0; li < N_LENGTHS; li++) {
            size_t k = row_lengths[li];
            if (!fits(types[ti], k))
                continue;
            for (int rep = 0; rep < 4; rep++) {
                void *w = make_weights(types[ti], 1, k, extreme, &s);
                td_cpu_q8a_block_t *a = make_act(k, extreme, &s);
                double tol, ref = reference(types[ti], w, a, k, &tol);
                float got = td_cpu_quant_dot_of(ops, types[ti])(w, a, k);
                cr_assert(isfinite(got), "type %u k %zu: %g", types[ti], k, got);
                cr_assert(fabs(got - ref) <= tol,
                          "type %u k %zu rep %d: scalar %.9g, double %.17g, |diff| %.3g > %.3g",
                          types[ti], k, rep, got, ref, fabs(got - ref), tol);
                free(w);
                free(a);
            }
        }
    }
}

Test(quant_dot, scalar_matches_double_reference)
{
    check_scalar(false, 1);
}

Test(quant_dot, scalar_matches_double_reference_extreme_scales)
{
    check_scalar(true, 2);
}

/* Every SIMD table the CPU runs against the scalar one, GEMVs over n_rows rows: every
 * output bit-identical, and each equal to its row's single dot. Skipped (with a line
 * saying so) for tables this CPU cannot run. */
static void check_tables(bool extreme, uint64_t seed)
{
    const td_cpu_quant_ops_t *ref = td_cpu_quant_ops(TD_CPU_ISA_SCALAR);
    int ran = 0;
    for (int isa = TD_CPU_ISA_SCALAR + 1; isa < TD_CPU_ISA_COUNT; isa++) {
        if (!td_cpu_isa_runs((td_cpu_isa_t)isa)) {
            cr_log_info("skipped: level %s (this CPU cannot run it)", td_cpu_isa_name((td_cpu_isa_t)isa));
            continue;
        }
        const td_cpu_quant_ops_t *simd = td_cpu_quant_ops((td_cpu_isa_t)isa);
        if (simd == td_cpu_quant_ops((td_cpu_isa_t)(isa - 1)))
            continue; /* the level below's table, checked already */
        ran++;
        uint64_t s = seed;
        const size_t n_rows = 5;
        for (size_t ti = 0; ti < N_TYPES; ti++) {
            const td_ggml_type_t *t = td_ggml_type(types[ti]);
            for (size_t li = 0; li < N_LENGTHS; li++) {
                size_t k = row_lengths[li];
                if (!fits(types[ti], k))
                    continue;
                size_t row_bytes = k / t->block_elems * t->block_bytes;
                void *w = make_weights(types[ti], n_rows, k, extreme, &s);
                td_cpu_q8a_block_t *a = make_act(k, extreme, &s);
                float y_ref[5], y[5];
                td_cpu_quant_gemv(ref, types[ti], w, row_bytes, 0, n_rows, a, k, y_ref);
                td_cpu_quant_gemv(simd, types[ti], w, row_bytes, 0, n_rows, a, k, y);
                for (size_t r = 0; r < n_rows; r++) {
                    cr_assert_eq(memcmp(&y[r], &y_ref[r], 4), 0,
                                 "%s type %u k %zu row %zu: %a, scalar %a", simd->name, types[ti],
                                 k, r, y[r], y_ref[r]);
                    float one = td_cpu_quant_dot_of(simd, types[ti])(
                        (const uint8_t *)w + r * row_bytes, a, k);
                    cr_assert_eq(memcmp(&one, &y[r], 4), 0, "%s: gemv row %zu is not its dot",
                                 simd->name, r);
                }
                free(w);
                free(a);
            }
        }
    }
    if (!ran)
        cr_skip_test("skipped: this CPU (or build) runs no SIMD table");
}

Test(quant_dot, simd_tables_equal_scalar_bitwise)
{
    check_tables(false, 3);
}

Test(quant_dot, simd_tables_equal_scalar_bitwise_extreme_scales)
{
    check_tables(true, 4);
}

/* td_cpu_quant_gemm, every table, tiles of 1..9 W rows by 1..9 activation rows (every
 * register-blocking remainder): each output bit-equal to the scalar dot of its pair */
Test(quant_dot, gemm_tiles_equal_scalar_dots)
{
    const td_cpu_quant_ops_t *ref = td_cpu_quant_ops(TD_CPU_ISA_SCALAR);
    uint64_t s = 6;
    const size_t k = 512, nmax = 9, ldy = 11;
    for (int isa = TD_CPU_ISA_SCALAR; isa <= (int)td_cpu_isa_best(); isa++) {
        const td_cpu_quant_ops_t *ops = td_cpu_quant_ops((td_cpu_isa_t)isa);
        for (size_t ti = 0; ti < N_TYPES; ti++) {
            const td_ggml_type_t *t = td_ggml_type(types[ti]);
            size_t row_bytes = k / t->block_elems * t->block_bytes;
            void *w = make_weights(types[ti], nmax, k, ti % 2, &s);
            td_cpu_q8a_block_t *a = malloc(nmax * (k / TD_QK) * sizeof *a);
            for (size_t i = 0; i < nmax; i++) {
                td_cpu_q8a_block_t *ai = make_act(k, ti % 2, &s);
                memcpy(a + i * (k / TD_QK), ai, k / TD_QK * sizeof *a);
                free(ai);
            }
            for (size_t n = 1; n <= nmax; n++)
                for (size_t m = 1; m <= nmax; m++) {
                    float y[9 * 11];
                    memset(y, 0xff, sizeof y);
                    td_cpu_quant_gemm(ops, types[ti], w, row_bytes, n, a, m, k, y, ldy);
                    for (size_t i = 0; i < m; i++)
                        for (size_t r = 0; r < n; r++) {
                            float want = td_cpu_quant_dot_of(ref, types[ti])(
                                (const uint8_t *)w + r * row_bytes, a + i * (k / TD_QK), k);
                            cr_assert_eq(memcmp(&y[i * ldy + r], &want, 4), 0,
                                         "%s type %u tile %zux%zu out (%zu, %zu): %a, want %a",
                                         ops->name, types[ti], n, m, r, i, y[i * ldy + r], want);
                        }
                }
            free(w);
            free(a);
        }
    }
}

Test(quant_dot, every_level_has_every_dot)
{
    const td_cpu_quant_ops_t *best = td_cpu_quant_ops(td_cpu_isa_best());
    cr_assert_not_null(best);
    for (size_t ti = 0; ti < N_TYPES; ti++)
        cr_assert_not_null(td_cpu_quant_dot_of(best, types[ti]), "type %u", types[ti]);
    cr_assert_null(td_cpu_quant_dot_of(best, TD_GGML_Q5_0), "no Q5_0 dot");
}

/* activation quantization: quants in [-127, 127], each within half a step of x / d (plus
 * the rounding of x * (1 / d)), s = d * sum exactly, zero blocks all zero */
Test(quant_dot, act_row)
{
    uint64_t s = 5;
    size_t k = 4096;
    float *x = malloc(k * sizeof *x);
    for (size_t i = 0; i < k; i++) {
        double scale = pow(10.0, -20.0 + 45.0 * (double)(i / TD_QK) / (double)(k / TD_QK));
        x[i] = i / TD_QK == 3 ? 0.0f : (float)((2.0 * rng_unit(&s) - 1.0) * scale);
    }
    x[7] = 1.0f; /* a block whose largest magnitude is exact and one of each sign */
    x[8] = -1.0f;
    td_cpu_q8a_block_t *a = malloc(k / TD_QK * sizeof *a);
    td_cpu_quant_act_row(x, a, k);
    for (size_t b = 0; b < k / TD_QK; b++) {
        int sum = 0;
        double amax = 0.0;
        for (int i = 0; i < TD_QK; i++)
            amax = fmax(amax, fabs(x[b * TD_QK + i]));
        for (int i = 0; i < TD_QK; i++) {
            int q = a[b].qs[i];
            cr_assert(q >= -127 && q <= 127, "block %zu quant %d", b, q);
            double err = fabs((double)x[b * TD_QK + i] - (double)a[b].d * q);
            cr_assert(err <= (double)a[b].d * (0.5 + 0x1.0p-20), "block %zu weight %d: %g", b, i,
                      err);
            sum += q;
        }
        cr_assert(fabs((double)a[b].d - amax / 127.0) <= amax / 127.0 * 0x1.0p-24, "block %zu", b);
        float want_s = a[b].d * (float)sum;
        cr_assert_eq(memcmp(&a[b].s, &want_s, 4), 0, "block %zu s %g, want %g", b, a[b].s, want_s);
        if (b == 3)
            cr_assert(a[b].d == 0.0f && sum == 0 && a[b].s == 0.0f);
    }
    cr_assert_eq(a[0].qs[7], 127);
    cr_assert_eq(a[0].qs[8], -127);
    free(x);
    free(a);
}

/* every table's activation quantizer writes the scalar one's bytes: random blocks over 45
 * decades, halfway values (x / d = n + 1/2), NaN, +-inf, zero and denormal blocks */
Test(quant_dot, act_row_tables_equal_scalar_bitwise)
{
    const size_t k = 32 * 64;
    float *x = malloc(k * sizeof *x);
    uint64_t s = 11;
    for (size_t i = 0; i < k; i++) {
        double scale = pow(10.0, -20.0 + 45.0 * (double)(i / TD_QK) / (double)(k / TD_QK));
        x[i] = (float)((2.0 * rng_unit(&s) - 1.0) * scale);
    }
    for (int i = 0; i < TD_QK; i++) {
        x[1 * TD_QK + i] = 127.0f - (float)i - 0.5f; /* d = 1: every value halfway */
        x[2 * TD_QK + i] = 0.0f;
        x[3 * TD_QK + i] = 1e-44f * (float)(i - 16);
    }
    x[1 * TD_QK] = 127.0f;
    x[4 * TD_QK + 5] = NAN;
    x[5 * TD_QK + 9] = INFINITY;
    x[6 * TD_QK + 31] = -INFINITY;
    x[7 * TD_QK + 0] = NAN, x[7 * TD_QK + 1] = INFINITY;
    td_cpu_q8a_block_t *want = malloc(k / TD_QK * sizeof *want), *got = malloc(k / TD_QK * sizeof *got);
    td_cpu_quant_act_row(x, want, k);
    for (int isa = TD_CPU_ISA_SCALAR; isa <= (int)td_cpu_isa_best(); isa++) {
        const td_cpu_quant_ops_t *ops = td_cpu_quant_ops((td_cpu_isa_t)isa);
        memset(got, 0x5a, k / TD_QK * sizeof *got);
        ops->act_row(x, got, k);
        for (size_t b = 0; b < k / TD_QK; b++)
            cr_assert_eq(memcmp(&got[b], &want[b], sizeof *got), 0, "%s: block %zu differs from scalar (d %a vs %a)",
                         ops->name, b, got[b].d, want[b].d);
    }
    free(x), free(want), free(got);
}
