/*
 * test_cpu_pack: the packed int8 kernels of td_cpu_pack (issue 14) against two double-precision
 * references built from the row-major GGUF blocks (never from the packed bytes), and every
 * SIMD table against the scalar one bit for bit.
 *
 * 1. The same int8 scheme: each output is sum over blocks of d_w e * (exact integer sum of
 *    the signed weight quants times the two-byte activation quants Q = 254 hi + lo), + m * e
 *    * sum Q for Q4_1, in double.
 *    The scalar kernel's f32 sum of nb terms (one fma each, the scale rounded once, Q4_1's
 *    two sums added once) is within (nb + 4) * 2^-24 * S of it, S the sum of the terms'
 *    magnitudes. This catches a weight landing in the wrong lane or block.
 * 2. The exact product: the weights dequantized by td_quant (bit-exact with gguf-py, checked
 *    in test_quant) times the f32 activations, in double. e Q differs from x by at most
 *    e / 2 per element (and the f32 rounding of x / d, under 0.01 e), so the kernel is
 *    within sum |w| 0.51 e plus the bound of 1 on the magnitudes of w x: the scheme as a
 *    whole, not only its sum.
 * 3. AVX2 and AVX-512 VNNI tables equal scalar bitwise for m = 1..19 rows (tiles and their
 *    tails) and group ranges that start past 0, and so do their activation quantizers,
 *    NaN, infinities and halfway values included; a table this CPU lacks is skipped with a
 *    line saying so.
 * Rows of n = 1..40 (groups padded past n), k from 32 to 4096, Q8_0 quants over the full
 * int8 range, activations with blocks of zeros and scales from 1e-3 to 1e3.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/td_cpu_pack.h"
#include "td_quant.h"
#include "td_util.h"

static const td_dtype_t types[] = {TD_Q8_0, TD_Q4_0, TD_Q4_1, TD_Q4_K, TD_Q6_K, TD_Q5_K, TD_IQ4_XS};

/* Q4_1, Q4_K, Q5_K: a min term beside the integer sum */
static bool has_min(td_dtype_t t)
{
    return t == TD_Q4_1 || t == TD_Q4_K || t == TD_Q5_K;
}

/* one-byte rows of IQ4_XS, Q4_K and Q6_K are super-block rows: one step E a super-block of 256,
 * stored as every block's e, hi = round(x / E), and the kernels' sum takes one float step a
 * super-block (td_cpu_pack.h) */
static bool super_rows(td_dtype_t t, bool one)
{
    return one && (t == TD_IQ4_XS || t == TD_Q4_K || t == TD_Q6_K);
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

/* n rows of k weights: random quants (Q4_K, Q5_K: random 6-bit scales and mins; IQ4_XS: random
 * 6-bit scales), f16 scales (and Q4_1's mins, Q4_K's and Q5_K's dmin) of either sign in 2^-8..2^1 */
static void *make_weights(td_dtype_t t, size_t n, size_t k, uint64_t *s)
{
    size_t bytes = td_dtype_bytes(t, n * k);
    uint8_t *w = malloc(bytes);
    for (size_t i = 0; i < bytes; i++)
        w[i] = (uint8_t)rng_next(s);
    size_t be = td_dtype_block_elems(t), bb = td_dtype_bytes(t, be);
    for (size_t b = 0; b < n * k / be; b++) {
        /* d, then Q4_1's m or Q4_K's, Q5_K's dmin; Q6_K's d ends its block */
        uint16_t *h = (uint16_t *)(w + b * bb + (t == TD_Q6_K ? offsetof(td_block_q6_k_t, d) : 0));
        for (int j = 0; j < (has_min(t) ? 2 : 1); j++)
            h[j] = (uint16_t)((rng_next(s) & 1) << 15 | (7 + rng_next(s) % 10) << 10 | (rng_next(s) & 1023));
    }
    return w;
}

static float *make_x(size_t m, size_t k, uint64_t *s)
{
    float *x = malloc(m * k * sizeof *x);
    for (size_t b = 0; b < m * k / TD_QK; b++) {
        double scale = pow(10.0, -3.0 + 6.0 * rng_unit(s));
        for (int e = 0; e < TD_QK; e++)
            x[b * TD_QK + e] = b % 5 == 4 ? 0.0f : (float)((2.0 * rng_unit(s) - 1.0) * scale);
    }
    return x;
}

/* signed quant e of a row as stored in GGUF (the offset already taken: Q4_1's and Q4_K's q
 * are 0..15, Q5_K's 0..31; IQ4_XS: the table's value), read from the GGUF layout, never from
 * the packed one */
static int row_quant(td_dtype_t t, const uint8_t *row, size_t e)
{
    if (t == TD_Q6_K) { /* td_quant.h's description of Q6_K's planes */
        const td_block_q6_k_t *blk = (const td_block_q6_k_t *)row + e / TD_QK_K;
        size_t w = e % TD_QK_K, h = w / 128, l = w % 32, quarter = w % 128 / 32;
        int lo = (blk->ql[64 * h + l + 32 * (quarter % 2)] >> (4 * (quarter / 2))) & 15;
        int hi = (blk->qh[32 * h + l] >> (2 * quarter)) & 3;
        return (lo | hi << 4) - 32;
    }
    if (t == TD_Q4_K) {
        const td_block_q4_k_t *blk = (const td_block_q4_k_t *)row + e / TD_QK_K;
        size_t sub = e % TD_QK_K / TD_QK, j = e % TD_QK;
        return (blk->qs[32 * (sub / 2) + j] >> (4 * (sub % 2))) & 15;
    }
    if (t == TD_Q5_K) { /* Q4_K's nibbles, bit `sub` of qh[j] the fifth */
        const td_block_q5_k_t *blk = (const td_block_q5_k_t *)row + e / TD_QK_K;
        size_t sub = e % TD_QK_K / TD_QK, j = e % TD_QK;
        return ((blk->qs[32 * (sub / 2) + j] >> (4 * (sub % 2))) & 15) | ((blk->qh[j] >> sub) & 1) << 4;
    }
    if (t == TD_IQ4_XS) { /* byte j % 16 of the sub-block's 16, low nibble for j < 16 */
        const td_block_iq4_xs_t *blk = (const td_block_iq4_xs_t *)row + e / TD_QK_K;
        size_t sub = e % TD_QK_K / TD_QK, j = e % TD_QK;
        static const int values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
        return values[(blk->qs[16 * sub + j % 16] >> (j < 16 ? 0 : 4)) & 15];
    }
    const uint8_t *blk = row + e / TD_QK * td_dtype_bytes(t, TD_QK);
    e %= TD_QK;
    if (t == TD_Q8_0)
        return ((const td_block_q8_0_t *)blk)->qs[e];
    const uint8_t *qs = t == TD_Q4_0 ? ((const td_block_q4_0_t *)blk)->qs : ((const td_block_q4_1_t *)blk)->qs;
    int q = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
    return t == TD_Q4_0 ? q - 8 : q;
}

/* 32-block b's weight scale of its half `half` (16 weights; only Q6_K's halves differ) and
 * offset (Q4_1: m; Q4_K: -(dmin * mn); else 0) in double, from the GGUF layout (td_quant.h's
 * description of Q4_K's 12 scale bytes) */
static void row_scales(td_dtype_t t, const uint8_t *row, size_t b, int half, double *d_p, double *m_p)
{
    if (t == TD_Q6_K) {
        const td_block_q6_k_t *blk = (const td_block_q6_k_t *)row + b / 8;
        *d_p = (double)td_f16_to_f32(blk->d) * blk->scales[2 * (b % 8) + (size_t)half];
        *m_p = 0.0;
        return;
    }
    if (t == TD_IQ4_XS) { /* 6-bit ls: 4 bits from scales_l, 2 from scales_h */
        const td_block_iq4_xs_t *blk = (const td_block_iq4_xs_t *)row + b / 8;
        size_t sub = b % 8;
        int ls = ((blk->scales_l[sub / 2] >> (4 * (sub % 2))) & 15) | ((blk->scales_h >> (2 * sub)) & 3) << 4;
        *d_p = (double)td_f16_to_f32(blk->d) * (ls - 32);
        *m_p = 0.0;
        return;
    }
    if (t == TD_Q4_K || t == TD_Q5_K) { /* the same 12 scale bytes after d and dmin */
        const td_block_q4_k_t *blk = (const td_block_q4_k_t *)(row + b / 8 * td_dtype_bytes(t, TD_QK_K));
        size_t sub = b % 8;
        const uint8_t *sc = blk->scales;
        int scale = sub < 4 ? sc[sub] & 63 : (sc[sub + 4] & 15) | (sc[sub - 4] >> 6) << 4;
        int min = sub < 4 ? sc[sub + 4] & 63 : (sc[sub + 4] >> 4) | (sc[sub] >> 6) << 4;
        *d_p = (double)td_f16_to_f32(blk->d) * scale;
        *m_p = -(double)td_f16_to_f32(blk->dmin) * min;
        return;
    }
    uint16_t h[2];
    memcpy(h, row + b * td_dtype_bytes(t, TD_QK), sizeof h);
    *d_p = td_f16_to_f32(h[0]);
    *m_p = t == TD_Q4_1 ? td_f16_to_f32(h[1]) : 0.0;
}

/* packed kernel of `ops` (its one-byte set with `one`) over the whole matrix: y[m][n_groups * 16] */
static float *run(const td_cpu_pack_ops_t *ops, td_dtype_t t, const void *wp, size_t n, size_t k,
                  const void *a, size_t m, bool one)
{
    size_t g = (n + TD_CPU_PACK_ROWS - 1) / TD_CPU_PACK_ROWS, ld = g * TD_CPU_PACK_ROWS;
    float *y = malloc(m * ld * sizeof *y);
    memset(y, 0xff, m * ld * sizeof *y); /* NaN: an output never written shows */
    td_cpu_pack_fn_of(ops, t, one)(wp, 0, g, g, k, a, m, y, ld);
    return y;
}

/* one: rows of one byte a value (lo 0), whose e Q is within d / 2 = 127 e of x, not e / 2;
 * super-block rows (super_rows): Q = hi, e = E the step, within E / 2 of x; the same double
 * reference, sum over blocks of d_w e sum w Q, holds for both */
static void check_case(td_dtype_t t, size_t n, size_t k, size_t m, uint64_t seed, bool one)
{
    uint64_t s = seed;
    size_t nb = k / TD_QK, row_bytes = td_dtype_bytes(t, k), stride = td_cpu_pack_act_stride(k);
    uint8_t *w = make_weights(t, n, k, &s);
    float *x = make_x(m, k, &s), *wf = malloc(n * k * sizeof *wf);
    td_dtype_convert(wf, TD_F32, w, t, n * k);
    void *wp = aligned_alloc(64, td_cpu_pack_bytes(t, n, k));
    td_cpu_pack_weights(wp, w, t, n, k, one);
    unsigned char *a = aligned_alloc(64, m * stride);
    const td_cpu_pack_ops_t *scalar = td_cpu_pack_ops(TD_CPU_ISA_SCALAR);
    for (size_t i = 0; i < m; i++)
        td_cpu_pack_act_row(scalar, x + i * k, a + i * stride, t, k, one);
    size_t ld = (n + TD_CPU_PACK_ROWS - 1) / TD_CPU_PACK_ROWS * TD_CPU_PACK_ROWS;
    float *y = run(scalar, t, wp, n, k, a, m, one);
    int32_t *qa = malloc(k * sizeof *qa);
    for (size_t i = 0; i < m; i++) {
        const unsigned char *ai = a + i * stride;
        for (size_t e = 0; e < k; e++)
            qa[e] = (super_rows(t, one) ? 1 : 254) * ((const int8_t *)ai)[e] + ((const int8_t *)ai)[k + e];
        const float *da = (const float *)(ai + 2 * k);
        for (size_t r = 0; r < n; r++) {
            double ref = 0, mag = 0, exact = 0, mag2 = 0, qerr = 0;
            for (size_t b = 0; b < nb; b++) {
                const uint8_t *row = w + r * row_bytes;
                double dw, mw;
                for (int half = 0; half < 2; half++) { /* Q6_K's halves have scales of their own */
                    row_scales(t, row, b, half, &dw, &mw);
                    int64_t p = 0;
                    for (int e = 16 * half; e < 16 * half + 16; e++)
                        p += (int64_t)row_quant(t, row, b * TD_QK + e) * qa[b * TD_QK + e];
                    double term = dw * da[b] * (double)p;
                    ref += term;
                    mag += fabs(term);
                }
                if (has_min(t)) {
                    int64_t sq = 0;
                    for (int e = 0; e < TD_QK; e++)
                        sq += qa[b * TD_QK + e];
                    double mt = mw * ((double)da[b] * (double)sq);
                    ref += mt;
                    mag += fabs(mt);
                }
                for (int e = 0; e < TD_QK; e++) {
                    double wv = wf[r * k + b * TD_QK + e], xv = x[i * k + b * TD_QK + e];
                    exact += wv * xv;
                    mag2 += fabs(wv * xv);
                    qerr += fabs(wv) * da[b] * (one && !super_rows(t, one) ? 127.5 : 0.51);
                }
            }
            double got = y[i * ld + r], tol = (double)(nb + 4) * 0x1.0p-24 * mag;
            cr_assert(fabs(got - ref) <= tol,
                      "%s n %zu k %zu m %zu: out (%zu, %zu) = %.9g, int8 reference %.9g (tol %.3g)",
                      td_dtype_name(t), n, k, m, i, r, got, ref, tol);
            double tol2 = tol + (double)(nb + 4) * 0x1.0p-24 * mag2 + qerr;
            cr_assert(fabs(got - exact) <= tol2,
                      "%s n %zu k %zu m %zu: out (%zu, %zu) = %.9g, dequantized weights give %.9g (tol %.3g)",
                      td_dtype_name(t), n, k, m, i, r, got, exact, tol2);
        }
    }
    free(w), free(x), free(wf), free(wp), free(a), free(y), free(qa);
}

Test(cpu_pack, scalar_matches_double_references)
{
    static const size_t nk[][2] = {{1, 32}, {16, 64}, {17, 96}, {9, 256}, {40, 768}, {40, 1056}, {33, 4096}};
    static const size_t ms[] = {1, 3, 9};
    uint64_t seed = 1;
    for (size_t ti = 0; ti < TD_ARRAY_LEN(types); ti++)
        for (size_t c = 0; c < TD_ARRAY_LEN(nk); c++)
            for (size_t mi = 0; mi < TD_ARRAY_LEN(ms); mi++)
                if (nk[c][1] % td_dtype_block_elems(types[ti]) == 0) {
                    check_case(types[ti], nk[c][0], nk[c][1], ms[mi], seed, false);
                    check_case(types[ti], nk[c][0], nk[c][1], ms[mi], seed++, true);
                }
}

/* every table the CPU runs equals scalar bitwise; a group range that starts past 0 writes
 * the same bits at its own offsets */
Test(cpu_pack, simd_tables_equal_scalar_bitwise)
{
    /* k = 32, 1056: a group's last chunk of blocks short (1 of 8); 2080 (65 blocks): a chunk of
     * one block after a power of two of them (where a tile that walks the blocks in segments
     * of 64, as one tried in h32p, has a segment of one) */
    static const size_t nk[][2] = {{16, 32}, {40, 256}, {33, 1056}, {64, 2048}, {24, 2080}, {20, 8192}};
    const td_cpu_pack_ops_t *scalar = td_cpu_pack_ops(TD_CPU_ISA_SCALAR);
    for (int isa = TD_CPU_ISA_AVX2; isa < TD_CPU_ISA_COUNT; isa++) {
        if (!td_cpu_isa_runs((td_cpu_isa_t)isa)) {
            printf("test_cpu_pack: skipped: level %s: this CPU cannot run it\n", td_cpu_isa_name((td_cpu_isa_t)isa));
            continue;
        }
        const td_cpu_pack_ops_t *ops = td_cpu_pack_ops((td_cpu_isa_t)isa);
        if (ops == td_cpu_pack_ops((td_cpu_isa_t)(isa - 1)))
            continue; /* the level below's table, checked already */
        uint64_t s = 7;
        for (size_t ti = 0; ti < TD_ARRAY_LEN(types); ti++)
            for (size_t c = 0; c < TD_ARRAY_LEN(nk); c++) {
                td_dtype_t t = types[ti];
                size_t n = nk[c][0], k = nk[c][1], m = k >= 2048 ? 11 : 19;
                if (k % td_dtype_block_elems(t) != 0)
                    continue;
                size_t stride = td_cpu_pack_act_stride(k), g = (n + 15) / 16, ld = g * 16;
                uint8_t *w = make_weights(t, n, k, &s);
                float *x = make_x(m, k, &s);
                void *wp = aligned_alloc(64, td_cpu_pack_bytes(t, n, k));
                unsigned char *a = aligned_alloc(64, m * stride);
                for (int one = 0; one < 2; one++) { /* two-byte rows, then one-byte ones */
                    const char *mode = one ? "one-byte" : "two-byte";
                    td_cpu_pack_weights(wp, w, t, n, k, one); /* the mode's layout */
                    for (size_t i = 0; i < m; i++)
                        td_cpu_pack_act_row(scalar, x + i * k, a + i * stride, t, k, one);
                    float *want = run(scalar, t, wp, n, k, a, m, one);
                    for (size_t mm = 1; mm <= m; mm++) {
                        float *got = run(ops, t, wp, n, k, a, mm, one);
                        for (size_t i = 0; i < mm; i++)
                            cr_assert_eq(memcmp(got + i * ld, want + i * ld, ld * sizeof(float)), 0,
                                         "%s %s %s n %zu k %zu: row %zu of %zu differs from scalar", ops->name, mode,
                                         td_dtype_name(t), n, k, i, mm);
                        free(got);
                    }
                    if (g > 1) {
                        float *part = malloc(m * (g - 1) * 16 * sizeof(float));
                        td_cpu_pack_fn_of(ops, t, one)(wp, 1, g, g, k, a, m, part, (g - 1) * 16);
                        for (size_t i = 0; i < m; i++)
                            cr_assert_eq(memcmp(part + i * (g - 1) * 16, want + i * ld + 16, (g - 1) * 16 * sizeof(float)),
                                         0, "%s %s %s: groups [1, %zu) differ", ops->name, mode, td_dtype_name(t), g);
                        free(part);
                    }
                    free(want);
                }
                free(w), free(x), free(wp), free(a);
            }
    }
}

/* The activation row: e Q within e / 2 of x (0.51 e with the rounding of x / d), hi and lo
 * in [-127, 127], c as the header says, and every table's quantizer writing the scalar
 * one's bytes; blocks of random values, halves (x = q + 1/2 with d = 1, so hi rounds away
 * from zero), zeros, NaN (e NaN) and infinities (e inf) */
/* every table equals scalar bitwise at the integer sums' extremes: every quant at its
 * largest (all bits set) against activation blocks of hi = +-127 and lo = -+127 (x = 126.5,
 * one 127 a block, and the negation), where AVX2's one-row path keeps maddubs' pair sums in
 * int16 over several v (8 pairs of 2 * 15 * 127 for 4-bit quants, 4 of 2 * 31 * 127 for
 * Q5_K), and its one-byte Q6_K prefill tile over two (of 2 * 63 * 127): one v too many and
 * they wrap; and where its int16 prefill tiles meet |Q| = 32385
 * (m up to 9: a full tile of 8 rows or two of 4, and one left over); then every quant byte 0x80
 * (Q8_0's -128, IQ4_XS's -127 and 1), whose |w| = 128 AVX2's one-byte Q8_0 tile reads
 * unsigned against a = +-127: pairs of 2 * 128 * 127 = 32512, int16's edge near; then every
 * byte 0 (IQ4_XS's value -127 with ls - 32 = -32 in every block: the super-block rows' integer
 * sums at their largest, 8 * 32 * 32 * 127 * 127; Q6_K's with its int8 scales -128 instead:
 * u - 32 = -32, a super-block's P = 16 halves * 128 * 16 * 32 * 127 = 133,169,152, the bound
 * td_cpu_pack.h states, past 2^24 so its conversion rounds) */
Test(cpu_pack, simd_tables_equal_scalar_at_the_extremes)
{
    const size_t n = 32, k = 256, m = 9, g = n / 16, ld = g * 16;
    const td_cpu_pack_ops_t *scalar = td_cpu_pack_ops(TD_CPU_ISA_SCALAR);
    size_t stride = td_cpu_pack_act_stride(k);
    float *x = malloc(m * k * sizeof *x);
    for (size_t i = 0; i < m * k; i++)
        x[i] = (i / k % 2 ? -1.0f : 1.0f) * (i % TD_QK == 0 ? 127.0f : 126.5f);
    unsigned char *a = aligned_alloc(64, m * stride);
    static const int fills[] = {0xff, 0x80, 0x00};
    for (size_t fi = 0; fi < TD_ARRAY_LEN(fills) * TD_ARRAY_LEN(types); fi++) {
        td_dtype_t t = types[fi % TD_ARRAY_LEN(types)];
        size_t row_bytes = td_dtype_bytes(t, k), bb = td_dtype_bytes(t, td_dtype_block_elems(t));
        uint8_t *w = malloc(n * row_bytes);
        memset(w, fills[fi / TD_ARRAY_LEN(types)], n * row_bytes);
        uint16_t one_h = 0x3C00; /* f16 1.0: d, and Q4_1's m, Q4_K's and Q5_K's dmin */
        bool two_halves = t == TD_Q4_1 || t == TD_Q4_K || t == TD_Q5_K;
        for (size_t b = 0; b < n * row_bytes / bb; b++) {
            size_t at = t == TD_Q6_K ? bb - 2 : 0; /* Q6_K's d ends its block */
            memcpy(w + b * bb + at, &one_h, 2);
            if (t == TD_Q6_K && fills[fi / TD_ARRAY_LEN(types)] == 0x00) /* every u 0 (u - 32 = -32), sc -128 */
                memset(w + b * bb + 192, 0x80, 16);
            if (two_halves)
                memcpy(w + b * bb + 2, &one_h, 2);
        }
        void *wp = aligned_alloc(64, td_cpu_pack_bytes(t, n, k));
        for (int one = 0; one < 2; one++) {
            td_cpu_pack_weights(wp, w, t, n, k, one); /* the mode's layout */
            for (size_t i = 0; i < m; i++)
                td_cpu_pack_act_row(scalar, x + i * k, a + i * stride, t, k, one);
            float *want = run(scalar, t, wp, n, k, a, m, one);
            for (int isa = TD_CPU_ISA_SCALAR + 1; isa < TD_CPU_ISA_COUNT; isa++) {
                if (!td_cpu_isa_runs((td_cpu_isa_t)isa))
                    continue;
                const td_cpu_pack_ops_t *ops = td_cpu_pack_ops((td_cpu_isa_t)isa);
                for (size_t mm = 1; mm <= m; mm++) {
                    float *got = run(ops, t, wp, n, k, a, mm, one);
                    for (size_t i = 0; i < mm; i++)
                        cr_assert_eq(memcmp(got + i * ld, want + i * ld, ld * sizeof(float)), 0,
                                     "%s %s %s: row %zu of %zu differs from scalar at the extremes", ops->name,
                                     one ? "one-byte" : "two-byte", td_dtype_name(t), i, mm);
                    free(got);
                }
            }
            free(want);
        }
        free(w), free(wp);
    }
    free(x), free(a);
}

/* A table's row `got` against the scalar one `want` (whose padding is 0, as got's was before
 * the table's act_row): the same bytes, the int16 Q part too where the table writes it
 * (act_q16: of two-byte rows, and the offsets of one-byte Q6_K ones); where it does not,
 * got's Q part as it was (0). avx2 writes it: its two-byte prefill tiles read it. */
static void check_table_row(const td_cpu_pack_ops_t *ops, const unsigned char *want, const unsigned char *got,
                            size_t k, td_dtype_t t, bool one_byte, const char *what)
{
    const size_t q16_at = (2 * k + 12 * (k / TD_QK) + 63) / 64 * 64;
    const bool writes_q = ops->act_q16 && (!one_byte || t == TD_Q6_K);
    cr_assert(ops->act_q16 || strcmp(ops->name, "avx2") != 0, "avx2's int16 tiles read Q: its rows must carry it");
    cr_assert_eq(memcmp(want, got, q16_at), 0, "%s: the %s row differs from scalar", ops->name, what);
    for (size_t e = 0; e < 2 * k; e++)
        cr_assert_eq(got[q16_at + e], writes_q ? want[q16_at + e] : 0, "%s: the %s row's Q byte %zu",
                     ops->name, what, e);
}

/* Every table's row of x (one byte or two) against the scalar one `want`, whose padding (between
 * its blocks' figures and its int16 Q part) is cleared first: check_table_row compares it. */
static void check_every_table_row(const float *x, unsigned char *want, td_dtype_t t, size_t k, bool one_byte,
                                  const char *what)
{
    const size_t nb = k / TD_QK, stride = td_cpu_pack_act_stride(k), q16_at = stride - 2 * k;
    memset(want + 2 * k + 12 * nb, 0, q16_at - (2 * k + 12 * nb));
    unsigned char *got = aligned_alloc(64, stride);
    for (int isa = TD_CPU_ISA_AVX2; isa <= (int)td_cpu_isa_best(); isa++) {
        const td_cpu_pack_ops_t *ops = td_cpu_pack_ops((td_cpu_isa_t)isa);
        memset(got, 0, stride);
        td_cpu_pack_act_row(ops, x, got, t, k, one_byte);
        check_table_row(ops, want, got, k, t, one_byte, what);
    }
    free(got);
}

Test(cpu_pack, act_row)
{
    uint64_t s = 3;
    const size_t k = 256, nb = k / TD_QK, stride = td_cpu_pack_act_stride(k);
    const size_t q16_at = (2 * k + 12 * nb + 63) / 64 * 64;
    cr_assert_eq(stride, q16_at + 2 * k);
    float *x = make_x(1, k, &s);
    for (int e = 0; e < TD_QK; e++) /* block 1: amax 127, so d = 1 and x * (1 / d) = x */
        x[TD_QK + e] = e == 0 ? 127.0f : (float)(e % 2 ? -1 : 1) * ((float)(e * 3 % 120) + 0.5f);
    x[2 * TD_QK + 5] = NAN;
    x[3 * TD_QK + 7] = INFINITY;
    x[5 * TD_QK + 1] = -INFINITY;
    unsigned char *a = aligned_alloc(64, stride), *b2 = aligned_alloc(64, stride);
    cr_assert_eq(stride % 64, 0);
    const td_cpu_pack_ops_t *scalar = td_cpu_pack_ops(TD_CPU_ISA_SCALAR);
    for (size_t ti = 0; ti < TD_ARRAY_LEN(types); ti++) {
        td_dtype_t t = types[ti];
        /* one byte: the two-byte row's hi, lo all 0, c from Q = 254 hi (super-block rows: the
         * act_row_super_blocks test); every table the same */
        td_cpu_pack_act_row(scalar, x, a, t, k, false);
        td_cpu_pack_act_row(scalar, x, b2, t, k, true);
        for (size_t e = 0; e < k; e++)
            cr_assert_eq(((const int8_t *)b2)[k + e], 0, "%s: one byte's lo %zu is not 0", td_dtype_name(t), e);
        check_every_table_row(x, b2, t, k, true, "one-byte");
        if (!super_rows(t, true)) {
            cr_assert_eq(memcmp(a, b2, k), 0, "%s: one byte's hi differs from two bytes'", td_dtype_name(t));
            cr_assert_eq(memcmp(a + 2 * k, b2 + 2 * k, 4 * nb), 0, "%s: one byte's e differs", td_dtype_name(t));
        }
        for (size_t b = 0; b < nb && !super_rows(t, true); b++) {
            int32_t sum = 0, first = 0;
            for (int j = 0; j < TD_QK; j++) {
                sum += 254 * ((const int8_t *)b2)[b * TD_QK + j];
                first = j == TD_QK / 2 - 1 ? sum : first;
            }
            float e, c;
            memcpy(&e, b2 + 2 * k + 4 * b, 4);
            int32_t ci[2];
            memcpy(&c, b2 + 2 * k + 4 * nb + 4 * b, 4);
            memcpy(&ci[0], b2 + 2 * k + 4 * nb + 4 * b, 4);
            memcpy(&ci[1], b2 + 2 * k + 8 * nb + 4 * b, 4);
            if (t == TD_Q4_1 || t == TD_Q4_K || t == TD_Q5_K)
                cr_assert(memcmp(&c, &(float){e * (float)sum}, 4) == 0, "one byte, block %zu: c %g", b, c);
            else if (t == TD_Q6_K)
                cr_assert(ci[0] == -32 * first && ci[1] == -32 * (sum - first), "one byte, block %zu", b);
            else
                cr_assert_eq(ci[0], (t == TD_Q4_0 ? -8 : -128) * sum, "one byte, block %zu", b);
        }
        cr_assert(scalar->act_q16, "the reference writes every part: its rows feed every table");
        td_cpu_pack_act_row(scalar, x, a, t, k, false);
        for (size_t b = 0; b < 2; b++) /* Q as int16 after the rest, 64-aligned: 254 hi + lo (two-byte rows) */
            for (size_t e = 0; e < k && (!b || t == TD_Q6_K); e++) {
                const unsigned char *r = b ? b2 : a;
                int16_t q;
                memcpy(&q, r + q16_at + 2 * e, 2);
                if (b && t == TD_Q6_K) { /* but Q6_K's: per block -32 sum hi over 4 classes of its weights, then 0 */
                    int32_t want = 0;
                    for (int j = 0; j < TD_QK && e < 4 * nb; j++)
                        if (j / 16 * 2 + j % 4 / 2 == (int)(e % 4))
                            want -= 32 * ((const int8_t *)r)[e / 4 * TD_QK + (size_t)j];
                    cr_assert_eq(q, want, "one-byte Q6_K row, offset %zu", e);
                    continue;
                }
                cr_assert_eq(q, 254 * ((const int8_t *)r)[e] + ((const int8_t *)r)[k + e], "two-byte row, Q %zu", e);
            }
        for (size_t b = 0; b < nb; b++) {
            float e;
            memcpy(&e, a + 2 * k + 4 * b, 4);
            if (b == 2)
                cr_assert(isnan(e), "a block with NaN: e %g", e);
            else if (b == 3 || b == 5)
                cr_assert(isinf(e), "a block with an infinity: e %g", e);
            int32_t sum = 0, first = 0;
            for (int j = 0; j < TD_QK; j++) {
                int hi = ((const int8_t *)a)[b * TD_QK + j], lo = ((const int8_t *)a)[k + b * TD_QK + j];
                cr_assert(hi >= -127 && hi <= 127 && lo >= -127 && lo <= 127);
                sum += 254 * hi + lo;
                if (j == TD_QK / 2 - 1)
                    first = sum;
                if (b == 1)
                    cr_assert_eq(hi, (int)roundf(x[TD_QK + j]), "halfway %g: hi %d", x[TD_QK + j], hi);
                if (isfinite(e))
                    cr_assert(fabs((double)e * (254 * hi + lo) - x[b * TD_QK + j]) <= 0.51 * e + 1e-30,
                              "block %zu: x %g, e Q %g", b, x[b * TD_QK + j], (double)e * (254 * hi + lo));
            }
            if (has_min(t)) {
                float c;
                memcpy(&c, a + 2 * k + 4 * nb + 4 * b, 4);
                cr_assert(memcmp(&c, &(float){e * (float)sum}, 4) == 0, "block %zu: c %g", b, c);
            } else if (t == TD_Q6_K) { /* c and c2: the offset 32 times each half's sum of Q */
                int32_t c[2];
                memcpy(&c[0], a + 2 * k + 4 * nb + 4 * b, 4);
                memcpy(&c[1], a + 2 * k + 8 * nb + 4 * b, 4);
                cr_assert(c[0] == -32 * first && c[1] == -32 * (sum - first), "block %zu: c %d %d", b, c[0], c[1]);
            } else {
                int32_t c;
                memcpy(&c, a + 2 * k + 4 * nb + 4 * b, 4);
                cr_assert_eq(c, (t == TD_Q4_0 ? -8 : -128) * sum);
            }
        }
        check_every_table_row(x, a, t, k, false, "two-byte");
    }
    free(x), free(a), free(b2);
}

/* A super-block row (one-byte IQ4_XS, Q4_K and Q6_K): per 256 values one step E = amax / 127
 * (amax over the super-block, NaN ignored; NaN if one is NaN), stored as each of its 8 blocks'
 * e; hi = round(x / E) clamped, within E / 2 of x; c of block b from S_b, the sum of its hi
 * (IQ4_XS: -128 S_b; Q4_K: E * S_b; Q6_K: c and c2 -32 times its halves' sums); lo 0; every table's row the scalar one's bytes. Two
 * super-blocks: one of random blocks whose largest |x| sits in its block 3 (so a block's own
 * step would differ), one with a NaN. */
Test(cpu_pack, act_row_super_blocks)
{
    uint64_t s = 5;
    const size_t k = 512, nb = k / TD_QK, stride = td_cpu_pack_act_stride(k);
    float *x = make_x(1, k, &s);
    x[3 * TD_QK + 9] = 1000.0f;
    x[8 * TD_QK + 2] = NAN;
    const td_cpu_pack_ops_t *scalar = td_cpu_pack_ops(TD_CPU_ISA_SCALAR);
    static const td_dtype_t sb_types[] = {TD_IQ4_XS, TD_Q4_K, TD_Q6_K};
    unsigned char *a = aligned_alloc(64, stride);
    for (size_t ti = 0; ti < TD_ARRAY_LEN(sb_types); ti++) {
        td_dtype_t t = sb_types[ti];
        memset(a, 0, stride);
        td_cpu_pack_act_row(scalar, x, a, t, k, true);
        for (size_t sb = 0; sb < nb / 8; sb++) {
            float amax = 0.0f;
            for (size_t j = 0; j < 256; j++)
                amax = fmaxf(amax, fabsf(x[256 * sb + j]));
            float E = sb == 1 ? NAN : amax / 127.0f, id = 1.0f / (amax / 127.0f);
            for (size_t b = 8 * sb; b < 8 * sb + 8; b++) {
                float e;
                memcpy(&e, a + 2 * k + 4 * b, 4);
                cr_assert(sb == 1 ? isnan(e) : e == E, "%s block %zu: e %g, the super-block's step %g",
                          td_dtype_name(t), b, e, E);
                int32_t S = 0, S0 = 0; /* the block's sum of hi, of its first half */
                for (size_t j = 0; j < TD_QK; j++) {
                    size_t at = b * TD_QK + j;
                    float v = x[at] * id;
                    v = v >= -127.0f ? v : -127.0f;
                    v = v <= 127.0f ? v : 127.0f;
                    int hi = ((const int8_t *)a)[at];
                    cr_assert_eq(hi, (int)roundf(v), "%s value %zu: hi %d for x %g", td_dtype_name(t), at, hi, x[at]);
                    cr_assert_eq(((const int8_t *)a)[k + at], 0);
                    if (sb == 0)
                        cr_assert(fabs((double)E * hi - x[at]) <= 0.51 * E, "x %g, E hi %g", x[at], (double)E * hi);
                    S += hi;
                    if (j == TD_QK / 2 - 1)
                        S0 = S;
                }
                if (t == TD_IQ4_XS) {
                    int32_t c;
                    memcpy(&c, a + 2 * k + 4 * nb + 4 * b, 4);
                    cr_assert_eq(c, -128 * S, "IQ4_XS block %zu: c %d, -128 S %d", b, c, -128 * S);
                } else if (t == TD_Q6_K) {
                    int32_t c, c2;
                    memcpy(&c, a + 2 * k + 4 * nb + 4 * b, 4);
                    memcpy(&c2, a + 2 * k + 8 * nb + 4 * b, 4);
                    cr_assert_eq(c, -32 * S0, "Q6_K block %zu: c %d, -32 times the first half's S %d", b, c, -32 * S0);
                    cr_assert_eq(c2, -32 * (S - S0), "Q6_K block %zu: c2 %d, -32 times the second half's S %d", b, c2,
                                 -32 * (S - S0));
                } else {
                    float c;
                    memcpy(&c, a + 2 * k + 4 * nb + 4 * b, 4);
                    cr_assert(memcmp(&c, &(float){e * (float)S}, 4) == 0, "Q4_K block %zu: c %g", b, c);
                }
            }
        }
        check_every_table_row(x, a, t, k, true, "super-block");
    }
    free(x), free(a);
}
