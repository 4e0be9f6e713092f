/*
 * test_quant: the reference block (de)quantizers of td_quant against gguf-py, and against
 * the arithmetic of their formats.
 *
 * Fixtures (tests/fixtures/quant/, made by make_fixtures.py there with gguf-py): every
 * dequantizer must reproduce gguf-py's output bit for bit (compared as uint32 words, so a
 * -0.0 for +0.0 fails too). The tolerance is 0 ulp because it can be: gguf-py computes in
 * f32 with the same operations in the same order as ggml's C reference and td_quant.c, and
 * every rounding step is IEEE round-to-nearest in both. The Q8_0 and Q4_0 quantizers must
 * give gguf-py's bytes. Then, in double precision, a quantize -> dequantize round trip stays
 * within half a quantization step per weight (one step where Q4_0 clips to 15) plus what the
 * f16 rounding of the scale adds; and the corners: zero, negative-zero and largest-magnitude
 * blocks, never a NaN.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "td_dtype.h"
#include "td_quant.h"
#include "td_test_models.h"
#include "td_util.h"

/* The whole of tests/fixtures/quant/<name> (caller frees). */
static void *read_fixture(const char *name, size_t *len_p)
{
    char rel[256];
    snprintf(rel, sizeof rel, "quant/%s", name);
    return td_test_fixture_read(rel, 1u << 20, len_p);
}

static void check_dequantize(const char *name, int type)
{
    const td_ggml_type_t *t = td_ggml_type((uint32_t)type);
    cr_assert(t && t->dequantize, "type %d", type);
    cr_assert_eq(strcasecmp(t->name, name), 0, "%s is named %s", name, t->name);
    char fname[64];
    size_t n_raw, n_want;
    snprintf(fname, sizeof fname, "%s.blocks", name);
    void *raw = read_fixture(fname, &n_raw);
    snprintf(fname, sizeof fname, "%s.f32", name);
    uint32_t *want = read_fixture(fname, &n_want);
    cr_assert_eq(n_raw % t->block_bytes, 0);
    size_t n = n_raw / t->block_bytes * t->block_elems;
    cr_assert_eq(n_want, n * sizeof(float), "%s: %zu weights, %zu bytes of gguf-py output", name, n,
                 n_want);
    uint32_t *got = calloc(n, sizeof *got);
    t->dequantize(raw, (float *)got, n);
    for (size_t i = 0; i < n; i++) {
        float g, w;
        memcpy(&g, &got[i], 4);
        memcpy(&w, &want[i], 4);
        cr_assert_eq(got[i], want[i], "%s weight %zu (block %zu): %a (0x%08x), gguf-py %a (0x%08x)",
                     name, i, i / t->block_elems, g, got[i], w, want[i]);
        cr_assert(isfinite(g), "%s weight %zu is not finite", name, i);
    }
    free(got);
    free(want);
    free(raw);
}

Test(quant, q8_0_dequantize_matches_gguf_py)
{
    check_dequantize("q8_0", TD_GGML_Q8_0);
}
Test(quant, q4_0_dequantize_matches_gguf_py)
{
    check_dequantize("q4_0", TD_GGML_Q4_0);
}
Test(quant, q4_1_dequantize_matches_gguf_py)
{
    check_dequantize("q4_1", TD_GGML_Q4_1);
}
Test(quant, q5_0_dequantize_matches_gguf_py)
{
    check_dequantize("q5_0", TD_GGML_Q5_0);
}
Test(quant, q5_1_dequantize_matches_gguf_py)
{
    check_dequantize("q5_1", TD_GGML_Q5_1);
}
Test(quant, q4_k_dequantize_matches_gguf_py)
{
    check_dequantize("q4_k", TD_GGML_Q4_K);
}
Test(quant, q6_k_dequantize_matches_gguf_py)
{
    check_dequantize("q6_k", TD_GGML_Q6_K);
}
Test(quant, q5_k_dequantize_matches_gguf_py)
{
    check_dequantize("q5_k", TD_GGML_Q5_K);
}
Test(quant, iq4_xs_dequantize_matches_gguf_py)
{
    check_dequantize("iq4_xs", TD_GGML_IQ4_XS);
}

typedef void (*quantize_fn)(const float *src, void *dst, size_t n);

static void check_quantize(const char *name, quantize_fn quantize)
{
    char fname[64];
    size_t n_in, n_want;
    snprintf(fname, sizeof fname, "%s.quant_in.f32", name);
    float *x = read_fixture(fname, &n_in);
    snprintf(fname, sizeof fname, "%s.quant.blocks", name);
    uint8_t *want = read_fixture(fname, &n_want);
    size_t n = n_in / sizeof(float);
    const td_ggml_type_t *t = td_ggml_type(strcmp(name, "q8_0") == 0 ? TD_GGML_Q8_0 : TD_GGML_Q4_0);
    cr_assert_eq(n_want, n / t->block_elems * t->block_bytes);
    uint8_t *got = calloc(1, n_want);
    quantize(x, got, n);
    for (size_t i = 0; i < n_want; i++)
        cr_assert_eq(got[i], want[i], "%s byte %zu (block %zu, offset %zu): 0x%02x, gguf-py 0x%02x",
                     name, i, i / t->block_bytes, i % t->block_bytes, got[i], want[i]);
    free(got);
    free(want);
    free(x);
}

Test(quant, q8_0_quantize_matches_gguf_py)
{
    check_quantize("q8_0", td_quant_quantize_q8_0);
}
Test(quant, q4_0_quantize_matches_gguf_py)
{
    check_quantize("q4_0", td_quant_quantize_q4_0);
}

Test(quant, traits_give_ggml_block_sizes)
{
    static const struct {
        int type;
        size_t elems, bytes;
    } want[] = {{2, 32, 18}, {3, 32, 20},    {6, 32, 22},   {7, 32, 24},
                {8, 32, 34}, {12, 256, 144}, {14, 256, 210}};
    for (size_t i = 0; i < TD_ARRAY_LEN(want); i++) {
        const td_ggml_type_t *t = td_ggml_type((uint32_t)want[i].type);
        cr_assert(t && t->dequantize, "type %d", want[i].type);
        cr_assert_eq(t->block_elems, want[i].elems, "%s", t->name);
        cr_assert_eq(t->block_bytes, want[i].bytes, "%s", t->name);
    }
    /* f32, f16, q8_1 (an activation format), q2_k, q8_k, bf16: not weight formats we read */
    static const int unread[] = {0, 1, 9, 10, 15, 30, -1, 1000};
    for (size_t i = 0; i < TD_ARRAY_LEN(unread); i++)
        cr_assert(!td_ggml_type((uint32_t)unread[i]) || !td_ggml_type((uint32_t)unread[i])->dequantize, "type %d",
                  unread[i]);
}

/* Seeded uniform in [-1, 1) (xorshift64*), the same sequence on every machine. */
static float rand_unit(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return (float)((double)((*s * 0x2545F4914F6CDD1DULL) >> 40) / (double)(1u << 23) - 1.0);
}

/* n seeded weights in blocks of 32 whose magnitudes span 1e-6 .. 1e4, some with one outlier. */
static float *random_weights(size_t n, uint64_t seed)
{
    float *x = malloc(n * sizeof *x);
    for (size_t b = 0; b < n / TD_QK; b++) {
        float scale = powf(10.0f, -6.0f + 10.0f * (rand_unit(&seed) * 0.5f + 0.5f));
        for (int j = 0; j < TD_QK; j++)
            x[b * TD_QK + j] = scale * rand_unit(&seed);
        if (b % 3 == 0)
            x[b * TD_QK + b % TD_QK] *= 20.0f;
    }
    return x;
}

/*
 * Q8_0: q = round(x / d) with d = amax / 127, read back as q * f16(d). Per weight, in
 * double: |x - y| <= |x - q d| + |q| |d - f16(d)| <= d (1/2 + 1e-4) + |q| |d - f16(d)|, the
 * 1e-4 step covering the f32 rounding of d, 1/d and x/d.
 */
Test(quant, q8_0_round_trip_within_half_a_step)
{
    const size_t n = 64 * TD_QK;
    float *x = random_weights(n, 42);
    td_block_q8_0_t *b = calloc(n / TD_QK, sizeof *b);
    float *y = calloc(n, sizeof *y);
    td_quant_quantize_q8_0(x, b, n);
    td_quant_dequantize_q8_0(b, y, n);
    for (size_t i = 0; i < n / TD_QK; i++) {
        double amax = 0;
        for (int j = 0; j < TD_QK; j++)
            amax = fmax(amax, fabs((double)x[i * TD_QK + j]));
        double d = amax / 127, d16 = td_f16_to_f32(b[i].d);
        for (int j = 0; j < TD_QK; j++) {
            size_t k = i * TD_QK + j;
            double bound = d * (0.5 + 1e-4) + fabs((double)b[i].qs[j]) * fabs(d - d16);
            cr_assert(isfinite(y[k]));
            cr_assert_leq(fabs((double)x[k] - (double)y[k]), bound,
                          "block %zu weight %d: %a -> %a (d %a)", i, j, x[k], y[k], d);
        }
    }
    free(y);
    free(b);
    free(x);
}

/*
 * Q4_0: q = min(15, trunc(x / d + 8.5)) with d = -max / 8, read back as (q - 8) f16(d). In
 * double: |x - y| <= |d| s + |q - 8| |d - f16(d)| where s = 1/2 + 1e-4, except that x / d
 * near +8 (the opposite extreme of the block's largest value) clips to 15: there s = 1 + 1e-4.
 */
Test(quant, q4_0_round_trip_within_half_a_step)
{
    const size_t n = 64 * TD_QK;
    float *x = random_weights(n, 7);
    td_block_q4_0_t *b = calloc(n / TD_QK, sizeof *b);
    float *y = calloc(n, sizeof *y);
    td_quant_quantize_q4_0(x, b, n);
    td_quant_dequantize_q4_0(b, y, n);
    for (size_t i = 0; i < n / TD_QK; i++) {
        double max = 0;
        for (int j = 0; j < TD_QK; j++)
            if (fabs((double)x[i * TD_QK + j]) > fabs(max))
                max = x[i * TD_QK + j];
        double d = max / -8, d16 = td_f16_to_f32(b[i].d);
        for (int j = 0; j < TD_QK; j++) {
            size_t k = i * TD_QK + j;
            int q = j < TD_QK / 2 ? b[i].qs[j] & 0x0f : b[i].qs[j - TD_QK / 2] >> 4;
            double s = q == 15 ? 1 + 1e-4 : 0.5 + 1e-4;
            double bound = fabs(d) * s + abs(q - 8) * fabs(d - d16);
            cr_assert(isfinite(y[k]));
            cr_assert_leq(fabs((double)x[k] - (double)y[k]), bound,
                          "block %zu weight %d: %a -> %a (q %d, d %a)", i, j, x[k], y[k], q, d);
        }
    }
    free(y);
    free(b);
    free(x);
}

Test(quant, zero_and_negative_zero_blocks_read_back_as_zero)
{
    float x[2 * TD_QK], y[2 * TD_QK];
    for (int j = 0; j < TD_QK; j++) {
        x[j] = 0.0f;
        x[TD_QK + j] = -0.0f;
    }
    td_block_q8_0_t b8[2];
    td_quant_quantize_q8_0(x, b8, 2 * TD_QK);
    td_quant_dequantize_q8_0(b8, y, 2 * TD_QK);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(b8[k].d, 0x0000, "q8_0 block %d: zero scale", k);
        for (int j = 0; j < TD_QK; j++)
            cr_assert_eq(b8[k].qs[j], 0);
    }
    for (int j = 0; j < 2 * TD_QK; j++)
        cr_assert(y[j] == 0.0f, "q8_0 weight %d: %a", j, y[j]);

    td_block_q4_0_t b4[2];
    td_quant_quantize_q4_0(x, b4, 2 * TD_QK);
    td_quant_dequantize_q4_0(b4, y, 2 * TD_QK);
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(b4[k].d, 0x8000, "q4_0 block %d: ggml's 0 / -8 = -0.0", k);
        for (int j = 0; j < TD_QK / 2; j++)
            cr_assert_eq(b4[k].qs[j], 0x88, "q4_0 block %d: every q is the zero point 8", k);
    }
    for (int j = 0; j < 2 * TD_QK; j++)
        cr_assert(y[j] == 0.0f, "q4_0 weight %d: %a", j, y[j]);
}

/* The largest block each quantizer takes: its scale lands on 65504, the largest finite
 * f16, and the extreme weights come back exactly. */
Test(quant, largest_magnitude_blocks_keep_a_finite_scale)
{
    float x[TD_QK], y[TD_QK];
    for (int j = 0; j < TD_QK; j++)
        x[j] = (float)(j - 16) * 1000.0f;
    x[3] = 65504.0f * 127.0f;
    x[9] = -65504.0f * 127.0f;
    td_block_q8_0_t b8;
    td_quant_quantize_q8_0(x, &b8, TD_QK);
    cr_assert_eq(b8.d, 0x7bff, "scale 65504");
    td_quant_dequantize_q8_0(&b8, y, TD_QK);
    cr_assert_eq(y[3], x[3]);
    cr_assert_eq(y[9], x[9]);
    for (int j = 0; j < TD_QK; j++)
        cr_assert(isfinite(y[j]) && fabsf(y[j] - x[j]) <= 65504.0f / 2, "q8_0 weight %d", j);

    x[3] = 65504.0f * 7.0f;
    x[9] = -65504.0f * 8.0f; /* the largest magnitude, negative: d = 65504 */
    td_block_q4_0_t b4;
    td_quant_quantize_q4_0(x, &b4, TD_QK);
    cr_assert_eq(b4.d, 0x7bff, "scale 65504");
    td_quant_dequantize_q4_0(&b4, y, TD_QK);
    cr_assert_eq(y[3], x[3]);
    cr_assert_eq(y[9], x[9]);
    for (int j = 0; j < TD_QK; j++)
        cr_assert(isfinite(y[j]) && fabsf(y[j] - x[j]) <= 65504.0f / 2, "q4_0 weight %d", j);
}

/* ---- td_dtype's block types: sizes, names, and td_dtype_convert through them ----------- */

Test(quant, dtype_block_types_have_ggml_sizes_and_names)
{
    cr_expect_eq(td_dtype_bytes(TD_Q8_0, 64), 68);
    cr_expect_eq(td_dtype_bytes(TD_Q4_1, 32), 20);
    cr_expect_eq(td_dtype_bytes(TD_Q4_K, 512), 288);
    cr_expect_eq(td_dtype_bytes(TD_Q6_K, 256), 210);
    cr_expect_eq(td_dtype_bytes(TD_Q5_K, 512), 352);
    cr_expect_eq(td_dtype_bytes(TD_IQ4_XS, 256), 136);
    cr_expect_str_eq(td_dtype_name(TD_IQ4_XS), "iq4_xs");
    cr_expect_eq(td_dtype_bytes(TD_F16, 3), 6);
    cr_expect_eq(td_dtype_block_elems(TD_Q6_K), 256);
    cr_expect_eq(td_dtype_size(TD_Q8_0), 0, "a block type has no element size");
    for (int t = 0; t < TD_DTYPE_COUNT; t++) {
        cr_expect_eq(td_dtype_parse(td_dtype_name((td_dtype_t)t)), t, "%s", td_dtype_name((td_dtype_t)t));
        cr_expect_eq(td_dtype_from_ggml(td_dtype_to_ggml((td_dtype_t)t)), t);
        cr_expect_eq(td_dtype_is_float(t) + td_dtype_is_block(t), 1);
    }
    cr_expect_eq(td_dtype_parse("Q4_K"), TD_Q4_K);
    cr_expect_eq(td_dtype_from_ggml(TD_GGML_Q2_K), -1);
    td_dtype_t t = TD_F32;
    cr_expect_eq(td_dtype_parse_quant_flag("q4_0", &t), TD_OK);
    cr_expect_eq(t, TD_Q4_0);
    cr_expect_eq(td_dtype_parse_quant_flag("q4_k", &t), TD_ERR_INVALID, "no Q4_K quantizer");
    cr_expect_eq(td_dtype_parse_flag("q8_0", &t), TD_ERR_INVALID, "--dtype takes float types only");
    cr_expect_eq(t, TD_Q4_0, "a refused flag leaves the value alone");
    cr_expect(td_dtype_can_convert(TD_F16, TD_Q6_K));
    cr_expect(!td_dtype_can_convert(TD_Q4_0, TD_Q8_0));
    cr_expect(!td_dtype_can_convert(TD_Q4_K, TD_F32));
}

Test(quant, dtype_convert_quantizes_and_dequantizes_like_the_references)
{
    size_t n = 512;
    float *x = random_weights(n, 7);
    uint16_t *h = malloc(n * 2);
    float *xh = malloc(n * 4), *back = malloc(n * 4), *want = malloc(n * 4);
    td_block_q8_0_t q[16], qref[16];
    td_dtype_convert(h, TD_F16, x, TD_F32, n);
    td_dtype_convert(xh, TD_F32, h, TD_F16, n);
    /* f16 -> Q8_0 quantizes the f16 values, as the reference does on their f32 */
    td_dtype_convert(q, TD_Q8_0, h, TD_F16, n);
    td_quant_quantize_q8_0(xh, qref, n);
    cr_assert_eq(memcmp(q, qref, sizeof q), 0);
    /* Q8_0 -> f32 is the reference dequantizer; -> bf16 its rounding */
    td_dtype_convert(back, TD_F32, q, TD_Q8_0, n);
    td_quant_dequantize_q8_0(q, want, n);
    cr_assert_eq(memcmp(back, want, n * 4), 0);
    td_dtype_convert(h, TD_BF16, q, TD_Q8_0, n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(h[i], td_f32_to_bf16(want[i]), "weight %zu", i);
    free(x), free(h), free(xh), free(back), free(want);
}
