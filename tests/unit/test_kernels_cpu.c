/*
 * Tests of the CPU backend: every op against a plain double-precision reference written
 * here, on seeded random inputs (never zero), with outputs poisoned with NaN before the op
 * so anything left unwritten fails. The KV pool is poisoned too, so an attention kernel
 * that reads a slot outside a sequence's context produces NaN and fails.
 *
 * Each case runs with 1 and 4 threads. Errors are relative: |got - ref| must be within
 * tol * (|ref| + rms(ref)) elementwise.
 *
 * The special-values cases feed NaN, +-inf and huge values (what weights with NaN or Inf
 * produce) to exp, softmax and swiglu and check the results docs/kernels.md promises; the
 * sanitizer build runs them too, so undefined behaviour on such inputs fails there.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/td_cpu.h"
#include "cpu/td_cpu_pack.h"
#include "cpu/td_cpu_quant.h"
#include "td_backend.h"
#include "td_quant.h"
#include "td_test_models.h"
#include "td_util.h"

/* ---- helpers -------------------------------------------------------------------- */

typedef struct rng {
    uint64_t s;
} rng_t;

static uint64_t rng_next(rng_t *r)
{
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}

/* uniform in +-[0.1, 1): never zero */
static float rng_val(rng_t *r)
{
    float u = (float)(rng_next(r) >> 40) / (float)(1u << 24);
    float v = 0.1f + 0.9f * u;
    return (rng_next(r) & 1) ? v : -v;
}

static int rng_int(rng_t *r, int n)
{
    return (int)(rng_next(r) % (uint64_t)n);
}

static float round_to(float f, td_dtype_t t)
{
    switch (t) {
    case TD_F16: return td_f16_to_f32(td_f32_to_f16(f));
    case TD_BF16: return td_bf16_to_f32(td_f32_to_bf16(f));
    default: return f;
    }
}

/* Fills n elements of dtype t at dst with random values; writes the exact values as floats
   to ref (if non-NULL). */
static void fill_random(rng_t *r, void *dst, td_dtype_t t, float *ref, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float v = round_to(rng_val(r), t);
        td_dtype_convert((unsigned char *)dst + i * td_dtype_size(t), t, &v, TD_F32, 1);
        if (ref)
            ref[i] = v;
    }
}

static void poison(void *p, size_t bytes)
{
    memset(p, 0xff, bytes); /* all-ones is NaN in f32, f16 and bf16 */
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    cr_assert_not_null(p);
    return p;
}

/* n floats as a KV cache of dtype t holds them: each rounded to a float type, or Q8_0's
 * blocks of 32 quantized and dequantized by td_quant's references (n a multiple of 32) */
static void round_kv(float *x, size_t n, td_dtype_t t)
{
    if (t != TD_Q8_0) {
        for (size_t i = 0; i < n; i++)
            x[i] = round_to(x[i], t);
        return;
    }
    td_block_q8_0_t *b = xmalloc(td_dtype_bytes(TD_Q8_0, n));
    td_quant_quantize_q8_0(x, b, n);
    td_quant_dequantize_q8_0(b, x, n);
    free(b);
}

static void check_close(const char *what, const float *got, const double *ref, size_t n, double tol)
{
    double ss = 0;
    for (size_t i = 0; i < n; i++)
        ss += ref[i] * ref[i];
    double rms = n ? sqrt(ss / n) : 0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - ref[i]);
        if (!(err <= tol * (fabs(ref[i]) + rms)))
            cr_assert_fail("%s: element %zu: got %.8g want %.8g (tol %.1e, rms %.3g)", what, i,
                     (double)got[i], ref[i], tol, rms);
    }
}

static td_backend_t *make_backend_int8(int threads, bool int8)
{
    const char *isa, *best;
    if (td_backend_cpu_isa_choose(NULL, &isa, &best) != TD_OK) {
        /* TANDEM_CPU_ISA above this CPU skips; a name that is no level fails */
        cr_assert(strstr(td_last_error(), "does not run"), "%s", td_last_error());
        cr_skip_test("%s", td_last_error());
    }
    td_cpu_config_t cfg = {.n_threads = threads, .exact = !int8};
    td_backend_t *be = NULL;
    cr_assert_eq(td_backend_cpu_create(&cfg, &be), TD_OK);
    cr_assert_eq(be->act_dtype, TD_F32);
    cr_assert(be->host_memory);
    return be;
}

static td_backend_t *make_backend(int threads)
{
    return make_backend_int8(threads, true); /* the default */
}

static const int thread_counts[] = {1, 4};
static const td_dtype_t dtypes[] = {TD_F32, TD_F16, TD_BF16};

/* ---- matmul ----------------------------------------------------------------------- */

static void matmul_case(td_backend_t *be, rng_t *r, int m, int n, int k, td_dtype_t wt, bool bias,
                        bool acc)
{
    size_t ws = td_dtype_size(wt);
    float *x = xmalloc((size_t)m * k * 4), *wref = xmalloc((size_t)n * k * 4);
    float *bref = xmalloc((size_t)n * 4), *y = xmalloc((size_t)m * n * 4);
    void *w = xmalloc((size_t)n * k * ws), *b = xmalloc((size_t)n * ws);
    double *ref = xmalloc((size_t)m * n * 8);
    fill_random(r, x, TD_F32, NULL, (size_t)m * k);
    fill_random(r, w, wt, wref, (size_t)n * k);
    fill_random(r, b, wt, bref, (size_t)n);
    if (acc)
        fill_random(r, y, TD_F32, NULL, (size_t)m * n);
    else
        poison(y, (size_t)m * n * 4);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double s = 0;
            for (int q = 0; q < k; q++)
                s += (double)x[(size_t)i * k + q] * wref[(size_t)j * k + q];
            if (bias)
                s += bref[j];
            if (acc)
                s += y[(size_t)i * n + j];
            ref[(size_t)i * n + j] = s;
        }
    td_matmul_params_t p = {.m = m, .n = n, .k = k, .x = x, .w = w, .w_dtype = wt,
                            .bias = bias ? b : NULL, .bias_dtype = wt, .y = y, .accumulate = acc};
    cr_assert_eq(be->ops->matmul(be, &p), TD_OK);
    char what[128];
    snprintf(what, sizeof(what), "matmul m %d n %d k %d w %s bias %d acc %d", m, n, k,
             td_dtype_name(wt), bias, acc);
    check_close(what, y, ref, (size_t)m * n, 1e-4);
    free(x), free(wref), free(bref), free(y), free(w), free(b), free(ref);
}

Test(kernels_cpu, matmul, .timeout = 300)
{
    static const int ms[] = {1, 2, 3, 4, 5, 64};
    static const int nk[][2] = {{1, 1}, {7, 9}, {67, 64}, {256, 200}, {33, 257}, {130, 8}};
    rng_t r = {0x1234567};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        for (size_t a = 0; a < TD_ARRAY_LEN(ms); a++)
            for (size_t c = 0; c < TD_ARRAY_LEN(nk); c++)
                for (size_t d = 0; d < TD_ARRAY_LEN(dtypes); d++)
                    for (int f = 0; f < 4; f++)
                        matmul_case(be, &r, ms[a], nk[c][0], nk[c][1], dtypes[d], f & 1, f & 2);
        td_backend_destroy(be);
    }
}

/* Larger shapes: N split over many tasks and multi-tile conversion of f16/bf16 W. */
Test(kernels_cpu, matmul_large, .timeout = 300)
{
    rng_t r = {0xabcdef};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        for (size_t d = 0; d < TD_ARRAY_LEN(dtypes); d++) {
            matmul_case(be, &r, 1, 1000, 1024, dtypes[d], true, false);
            matmul_case(be, &r, 3, 515, 768, dtypes[d], false, true);
            matmul_case(be, &r, 64, 300, 4100, dtypes[d], true, true);
        }
        td_backend_destroy(be);
    }
}

/*
 * The AVX2 float matmul's one summation order (td_cpu_matmul.c, docs/kernels.md "Batch
 * invariance"): weight q into lane q % 8 by FMA over k in order up to the last multiple of 8,
 * the lanes summed as td_cpu_hsum8 does (l + 4, then l + 2, then l + 1), then the k % 8 tail
 * products added one by one; then the bias, then the old y.
 */
static float avx2_order_dot(const float *x, const float *w, int k)
{
    float lane[8] = {0};
    int q = 0;
    for (; q + 8 <= k; q += 8)
        for (int l = 0; l < 8; l++)
            lane[l] = fmaf(w[q + l], x[q + l], lane[l]);
    float h[4];
    for (int l = 0; l < 4; l++)
        h[l] = lane[l] + lane[l + 4];
    float s = (h[0] + h[2]) + (h[1] + h[3]);
    for (; q < k; q++)
        s += w[q] * x[q];
    return s;
}

/* At level avx2 every output of the float matmul is avx2_order_dot bit for bit, whatever m
 * (decode tiles 1..4, the prefill tile and its tails, X chunks: 70 rows at k = 2049 cross
 * one), n (W row tails, slices split over threads) and k (the scalar tail): so a row's
 * result does not depend on its batch. Runs in test_kernels_cpu_avx2 (ctest); other levels
 * skip (AVX-512: test_cpu_fgemm; scalar: not batch-invariant). */
Test(kernels_cpu, matmul_float_avx2_order, .timeout = 300)
{
    static const int ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 64, 70};
    static const int ks[] = {1, 7, 8, 9, 100, 2049};
    const int n = 37; /* 9 tiles of 4 W rows and one left; 16-row task slices */
    rng_t r = {0x5eed32};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        const char *isa = td_backend_cpu_isa(be); /* a static string */
        if (strcmp(isa, "avx2") != 0) {
            td_backend_destroy(be);
            cr_skip_test("the backend runs %s; the avx2 order is checked at TANDEM_CPU_ISA=avx2", isa);
        }
        for (size_t d = 0; d < TD_ARRAY_LEN(dtypes); d++)
            for (size_t c = 0; c < TD_ARRAY_LEN(ks); c++)
                for (size_t a = 0; a < TD_ARRAY_LEN(ms); a++) {
                    int m = ms[a], k = ks[c];
                    td_dtype_t wt = dtypes[d];
                    bool bias = a & 1, acc = a & 2;
                    float *x = xmalloc((size_t)m * k * 4), *wref = xmalloc((size_t)n * k * 4);
                    float *bref = xmalloc((size_t)n * 4), *y = xmalloc((size_t)m * n * 4);
                    float *y0 = xmalloc((size_t)m * n * 4);
                    void *w = xmalloc((size_t)n * k * td_dtype_size(wt)), *b = xmalloc((size_t)n * td_dtype_size(wt));
                    fill_random(&r, x, TD_F32, NULL, (size_t)m * k);
                    fill_random(&r, w, wt, wref, (size_t)n * k);
                    fill_random(&r, b, wt, bref, (size_t)n);
                    if (acc)
                        fill_random(&r, y, TD_F32, NULL, (size_t)m * n);
                    else
                        poison(y, (size_t)m * n * 4);
                    memcpy(y0, y, (size_t)m * n * 4);
                    td_matmul_params_t p = {.m = m, .n = n, .k = k, .x = x, .w = w, .w_dtype = wt,
                                            .bias = bias ? b : NULL, .bias_dtype = wt, .y = y, .accumulate = acc};
                    cr_assert_eq(be->ops->matmul(be, &p), TD_OK);
                    for (int i = 0; i < m; i++)
                        for (int j = 0; j < n; j++) {
                            float want = avx2_order_dot(x + (size_t)i * k, wref + (size_t)j * k, k);
                            if (bias)
                                want += bref[j];
                            if (acc)
                                want += y0[(size_t)i * n + j];
                            float got = y[(size_t)i * n + j];
                            cr_assert(memcmp(&got, &want, 4) == 0,
                                      "matmul m %d n %d k %d w %s bias %d acc %d, %d threads: y[%d][%d] = %.9g, "
                                      "the avx2 order gives %.9g",
                                      m, n, k, td_dtype_name(wt), bias, acc, thread_counts[ti], i, j, got, want);
                        }
                    free(x), free(wref), free(bref), free(y), free(y0), free(w), free(b);
                }
        td_backend_destroy(be);
    }
}

/* ---- row-wise ops ------------------------------------------------------------------ */

static td_step_meta_t simple_meta(int n_tokens, int32_t *tokens, int32_t *positions)
{
    static int32_t seq_start[2];
    seq_start[0] = 0;
    seq_start[1] = n_tokens;
    td_step_meta_t m = {.n_tokens = n_tokens, .n_seqs = 1, .tokens = tokens,
                        .positions = positions, .seq_start = seq_start};
    return m;
}

/* ---- block-quantized W ------------------------------------------------------------- */

static const td_dtype_t block_dtypes[] = {TD_Q8_0, TD_Q4_0, TD_Q4_1, TD_Q4_K, TD_Q6_K, TD_Q5_K, TD_IQ4_XS};

/* types the CPU backend reads only packed: an exact backend lacks them, and as stored its
 * matmul refuses them */
static bool packed_only(td_dtype_t t)
{
    return t == TD_Q5_K || t == TD_IQ4_XS;
}

/* f16 bits of a scale in +-[2^-7, 2^-3) */
static uint16_t rng_scale(rng_t *r)
{
    return td_f32_to_f16((float)ldexp(1.0 + (double)(rng_next(r) % 1024) / 1024.0,
                                      -7 - rng_int(r, 4)) * ((rng_next(r) & 1) ? 1.0f : -1.0f));
}

/* n elements (a multiple of the block size) of block dtype t: random quants, random scales */
static void *make_blocks(rng_t *r, td_dtype_t t, size_t n)
{
    size_t bytes = td_dtype_bytes(t, n), bb = td_dtype_block_bytes(t);
    unsigned char *w = xmalloc(bytes);
    for (size_t i = 0; i < bytes; i++)
        w[i] = (unsigned char)rng_next(r);
    for (size_t b = 0; b < bytes / bb; b++) {
        unsigned char *blk = w + b * bb;
        uint16_t d = rng_scale(r), m = rng_scale(r);
        switch (t) {
        case TD_Q8_0: ((td_block_q8_0_t *)blk)->d = d; break;
        case TD_Q4_0: ((td_block_q4_0_t *)blk)->d = d; break;
        case TD_Q4_1: ((td_block_q4_1_t *)blk)->d = d, ((td_block_q4_1_t *)blk)->m = m; break;
        case TD_Q4_K: ((td_block_q4_k_t *)blk)->d = d, ((td_block_q4_k_t *)blk)->dmin = m; break;
        case TD_Q6_K: ((td_block_q6_k_t *)blk)->d = d; break;
        case TD_Q5_K: ((td_block_q5_k_t *)blk)->d = d, ((td_block_q5_k_t *)blk)->dmin = m; break;
        case TD_IQ4_XS: ((td_block_iq4_xs_t *)blk)->d = d; break;
        default: cr_assert_fail("make_blocks: %s is not a block type", td_dtype_name(t));
        }
    }
    return w;
}

/*
 * Quantized matmul against a double reference of what it computes: W dequantized by
 * td_quant's reference times X (an exact backend, td_cpu_qf32), or, by default, times X
 * rows quantized the way the path does (each scheme's documented first step) and
 * dequantized; then bias and accumulate. By default the weights are run both as stored
 * (td_cpu_quant: int8 blocks, td_cpu_quant_act_row) and as ops->weight_pack packs them
 * (td_cpu_pack: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, two-byte blocks, td_cpu_pack_act_row; an exact backend
 * packs nothing). Q5_K and IQ4_XS run packed only. Relative tolerance 1e-5 covers the f32 sums of k <= 4096 terms.
 */
enum { ACT_F32, ACT_INT8, ACT_PACKED };

static void qmatmul_ref(int act, const float *x, const float *wref, const float *b, const float *y, int m,
                        int n, int k, td_dtype_t wt, double *ref, double *mag)
{
    size_t nb = (size_t)k / TD_QK;
    float *xq = xmalloc((size_t)k * 4);
    td_cpu_q8a_block_t *a = xmalloc(nb * sizeof *a);
    unsigned char *ap = xmalloc(td_cpu_pack_act_stride((size_t)k));
    for (int i = 0; i < m; i++) {
        const float *xi = x + (size_t)i * k;
        if (act == ACT_INT8)
            td_cpu_quant_act_row(xi, a, (size_t)k);
        if (act == ACT_PACKED)
            td_cpu_pack_act_row(td_cpu_pack_ops(TD_CPU_ISA_SCALAR), xi, ap, wt, (size_t)k, false);
        for (int q = 0; q < k; q++) {
            float e;
            memcpy(&e, ap + 2 * k + 4 * (q / TD_QK), 4);
            xq[q] = act == ACT_INT8     ? a[q / TD_QK].d * (float)a[q / TD_QK].qs[q % TD_QK]
                    : act == ACT_PACKED ? e * (float)(254 * (int8_t)ap[q] + (int8_t)ap[k + q])
                                        : xi[q];
        }
        for (int j = 0; j < n; j++) {
            double s = 0, sa = 0;
            for (int q = 0; q < k; q++) {
                s += (double)xq[q] * wref[(size_t)j * k + q];
                sa += fabs((double)xq[q] * wref[(size_t)j * k + q]);
            }
            ref[(size_t)i * n + j] = s + (b ? b[j] : 0.0) + (y ? y[(size_t)i * n + j] : 0.0);
            if (mag)
                mag[(size_t)i * n + j] = sa;
        }
    }
    free(xq), free(a), free(ap);
}

static void qmatmul_case(td_backend_t *be, bool int8, rng_t *r, int m, int n, int k, td_dtype_t wt,
                         bool bias, bool acc)
{
    float *x = xmalloc((size_t)m * k * 4), *wref = xmalloc((size_t)n * k * 4);
    float *b = xmalloc((size_t)n * 4), *y = xmalloc((size_t)m * n * 4);
    double *ref = xmalloc((size_t)m * n * 8);
    void *w = make_blocks(r, wt, (size_t)n * k);
    td_ggml_type(td_dtype_to_ggml(wt))->dequantize(w, wref, (size_t)n * k);
    fill_random(r, x, TD_F32, NULL, (size_t)m * k);
    fill_random(r, b, TD_F32, NULL, (size_t)n);
    if (acc)
        fill_random(r, y, TD_F32, NULL, (size_t)m * n);
    else
        poison(y, (size_t)m * n * 4);
    float *y_init = xmalloc((size_t)m * n * 4);
    memcpy(y_init, y, (size_t)m * n * 4);
    qmatmul_ref(int8 ? ACT_INT8 : ACT_F32, x, wref, bias ? b : NULL, acc ? y : NULL, m, n, k, wt, ref, NULL);
    td_matmul_params_t p = {.m = m, .n = n, .k = k, .x = x, .w = w, .w_dtype = wt,
                            .bias = bias ? b : NULL, .bias_dtype = TD_F32, .y = y,
                            .accumulate = acc};
    char what[128];
    snprintf(what, sizeof(what), "matmul m %d n %d k %d w %s bias %d acc %d int8 %d", m, n, k,
             td_dtype_name(wt), bias, acc, int8);
    if (packed_only(wt)) { /* refused as stored, y untouched */
        cr_assert_eq(be->ops->matmul(be, &p), TD_ERR_UNSUPPORTED, "%s as stored", what);
        cr_assert_eq(memcmp(y, y_init, (size_t)m * n * 4), 0, "%s: a refused matmul wrote y", what);
    } else {
        cr_assert_eq(be->ops->matmul(be, &p), TD_OK);
        check_close(what, y, ref, (size_t)m * n, 1e-5);
    }
    void *wp = NULL;
    cr_assert_eq(be->ops->weight_pack(be, w, wt, n, k, &wp), TD_OK);
    cr_assert_eq(wp != NULL, int8, "%s: packed %d", what, wp != NULL);
    if (wp) {
        memcpy(y, y_init, (size_t)m * n * 4);
        p.w = wp;
        p.w_packed = true;
        cr_assert_eq(be->ops->matmul(be, &p), TD_OK);
        strcat(what, " packed");
        double *mag = xmalloc((size_t)m * n * 8);
        qmatmul_ref(ACT_PACKED, x, wref, bias ? b : NULL, acc ? y_init : NULL, m, n, k, wt, ref, mag);
        /* or within the f32 sum's own bound (test_cpu_pack's): k / 16 rounded products
         * (Q6_K: one a 16-weight half) and their sum, of terms whose magnitudes add up to
         * mag; Q6_K's random int8 scales of either sign cancel enough that 1e-5 of the
         * result alone is below what any f32 sum of those terms can promise */
        for (size_t i = 0; i < (size_t)m * n; i++) {
            double err = fabs((double)y[i] - ref[i]);
            cr_assert(err <= 1e-5 * fabs(ref[i]) || err <= (double)(k / 16 + 8) * 0x1.0p-24 * mag[i] + 1e-5 * fabs(ref[i]),
                      "%s: element %zu: got %.8g want %.8g (sum of |terms| %.3g)", what, i, (double)y[i], ref[i], mag[i]);
        }
        free(mag);
        be->ops->free(be, wp);
    }
    free(x), free(wref), free(b), free(y), free(y_init), free(ref), free(w);
}

Test(kernels_cpu, matmul_block_weights, .timeout = 300)
{
#ifdef __SANITIZE_ADDRESS__ /* the -O0 sanitizer build: the same tiles, fewer batch sizes (42 s otherwise) */
    static const int ms[] = {1, 3, 17};
#else
    static const int ms[] = {1, 2, 3, 4, 5, 17, 64};
#endif
    static const int nk[][2] = {{1, 256}, {7, 512}, {67, 256}, {40, 1024}, {130, 768}};
    rng_t r = {0x5eed};
    for (size_t ti = 0; ti < 2 * TD_ARRAY_LEN(thread_counts); ti++) {
        bool int8 = ti >= TD_ARRAY_LEN(thread_counts);
        td_backend_t *be = make_backend_int8(thread_counts[ti % TD_ARRAY_LEN(thread_counts)], int8);
        for (size_t d = 0; d < TD_ARRAY_LEN(block_dtypes); d++) {
            bool listed = int8 || !packed_only(block_dtypes[d]);
            cr_assert_eq((be->weight_dtypes >> block_dtypes[d]) & 1u, listed, "%s in weight_dtypes: %d (int8 %d)",
                         td_dtype_name(block_dtypes[d]), !listed, int8);
            if (!listed) /* an exact backend has them dequantized at load */
                continue;
            for (size_t a = 0; a < TD_ARRAY_LEN(ms); a++)
                for (size_t c = 0; c < TD_ARRAY_LEN(nk); c++)
                    for (int f = 0; f < 4; f++)
                        qmatmul_case(be, int8, &r, ms[a], nk[c][0], nk[c][1], block_dtypes[d], f & 1,
                                     f & 2);
        }
        td_backend_destroy(be);
    }
}

/*
 * Batch invariance with block W: every row of a 70-row matmul, computed alone (m = 1), in
 * its batch and with another thread count, gives the same bits (docs/kernels.md), with int8
 * activations (the default; weights as stored and packed) and f32 ones (an exact backend).
 */
static void block_batch_invariant(bool int8)
{
    const int m = 70, n = 300, k = 1024;
    rng_t r = {0xba7c4};
    td_backend_t *be1 = make_backend_int8(1, int8), *be4 = make_backend_int8(4, int8);
    float *x = xmalloc((size_t)m * k * 4), *y = xmalloc((size_t)m * n * 4);
    float *y4 = xmalloc((size_t)m * n * 4), *y1 = xmalloc((size_t)n * 4);
    fill_random(&r, x, TD_F32, NULL, (size_t)m * k);
    for (size_t v = 0; v < 2 * TD_ARRAY_LEN(block_dtypes); v++) {
        size_t d = v / 2;
        if (v % 2 == 0 && packed_only(block_dtypes[d]))
            continue; /* never as stored */
        void *w = make_blocks(&r, block_dtypes[d], (size_t)n * k), *wp = NULL;
        if (v % 2) { /* the same weights packed (by default: Q8_0, Q4_0, Q4_1) */
            cr_assert_eq(be1->ops->weight_pack(be1, w, block_dtypes[d], n, k, &wp), TD_OK);
            if (!wp) {
                free(w);
                continue;
            }
        }
        td_matmul_params_t p = {.m = m, .n = n, .k = k, .x = x, .w = wp ? wp : w,
                                .w_dtype = block_dtypes[d], .w_packed = wp != NULL, .y = y};
        cr_assert_eq(be1->ops->matmul(be1, &p), TD_OK);
        p.y = y4;
        cr_assert_eq(be4->ops->matmul(be4, &p), TD_OK);
        cr_assert_eq(memcmp(y, y4, (size_t)m * n * 4), 0, "%s: 1 vs 4 threads differ",
                     td_dtype_name(block_dtypes[d]));
        for (int i = 0; i < m; i++) {
            td_matmul_params_t one = {.m = 1, .n = n, .k = k, .x = x + (size_t)i * k, .w = p.w,
                                      .w_dtype = block_dtypes[d], .w_packed = p.w_packed, .y = y1};
            cr_assert_eq(be4->ops->matmul(be4, &one), TD_OK);
            cr_assert_eq(memcmp(y1, y + (size_t)i * n, (size_t)n * 4), 0,
                         "%s%s: row %d alone differs from row %d of %d", td_dtype_name(block_dtypes[d]),
                         wp ? " packed" : "", i, i, m);
        }
        if (wp)
            be1->ops->free(be1, wp);
        free(w);
    }
    free(x), free(y), free(y4), free(y1);
    td_backend_destroy(be1);
    td_backend_destroy(be4);
}

Test(kernels_cpu, matmul_block_weights_batch_invariant, .timeout = 120)
{
    block_batch_invariant(true);
}

Test(kernels_cpu, matmul_block_weights_exact_batch_invariant, .timeout = 120)
{
    block_batch_invariant(false);
}

/* embed from a block-typed table: each row exactly td_quant's dequantized row */
/*
 * ops->matmuls: Q, K and V (or gate and up) of one input in one call give the bits of one
 * matmul call each: packed weights of two types (one quantization of X per type, one job
 * for all), with a bias and an accumulating output among them, at decode and prefill row
 * counts and two thread counts; and a float matrix among packed ones (each its own call).
 */
Test(kernels_cpu, matmuls_equal_matmul_calls, .timeout = 120)
{
    static const int ms[] = {1, 5, 70};
    const int k = 512, ns[3] = {300, 64, 48};
    const td_dtype_t types[3] = {TD_Q4_K, TD_Q6_K, TD_Q4_K};
    rng_t r = {0x3a7};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++)
        for (int fl = 0; fl < 2; fl++) { /* fl: the third matrix in f32, not packed */
            td_backend_t *be = make_backend(thread_counts[ti]);
            float *x = xmalloc((size_t)70 * k * 4), *bias = xmalloc((size_t)ns[0] * 4);
            fill_random(&r, x, TD_F32, NULL, (size_t)70 * k);
            fill_random(&r, bias, TD_F32, NULL, (size_t)ns[0]);
            void *w[3], *wp[3] = {NULL, NULL, NULL};
            for (int i = 0; i < 3; i++) {
                if (fl && i == 2) {
                    w[i] = xmalloc((size_t)ns[i] * k * 4);
                    fill_random(&r, w[i], TD_F32, NULL, (size_t)ns[i] * k);
                    continue;
                }
                w[i] = make_blocks(&r, types[i], (size_t)ns[i] * k);
                cr_assert_eq(be->ops->weight_pack(be, w[i], types[i], ns[i], k, &wp[i]), TD_OK);
                cr_assert(wp[i]);
            }
            for (size_t a = 0; a < TD_ARRAY_LEN(ms); a++) {
                const int m = ms[a];
                td_matmul_params_t ps[3];
                float *y[3], *want[3];
                for (int i = 0; i < 3; i++) {
                    y[i] = xmalloc((size_t)m * ns[i] * 4);
                    want[i] = xmalloc((size_t)m * ns[i] * 4);
                    fill_random(&r, y[i], TD_F32, NULL, (size_t)m * ns[i]); /* accumulated into by [1] */
                    memcpy(want[i], y[i], (size_t)m * ns[i] * 4);
                    ps[i] = (td_matmul_params_t){.m = m, .n = ns[i], .k = k, .x = x,
                                                 .w = wp[i] ? wp[i] : w[i], .w_packed = wp[i] != NULL,
                                                 .w_dtype = wp[i] ? types[i] : TD_F32,
                                                 .bias = i == 0 ? bias : NULL, .bias_dtype = TD_F32,
                                                 .accumulate = i == 1};
                }
                td_test_matmuls_and_calls(be, ps, 3, y, want);
                for (int i = 0; i < 3; i++) {
                    cr_assert_eq(memcmp(y[i], want[i], (size_t)m * ns[i] * 4), 0,
                                 "matmuls: matrix %d (%s, n %d) at m %d, %d threads, f32 third %d differs from its matmul",
                                 i, td_dtype_name(ps[i].w_dtype), ns[i], m, thread_counts[ti], fl);
                    free(y[i]), free(want[i]);
                }
            }
            td_test_matmuls_free(be, w, wp, 3);
            free(x), free(bias);
            td_backend_destroy(be);
        }
}

Test(kernels_cpu, embed_block_table, .timeout = 60)
{
    rng_t r = {0xe4bed};
    const int vocab = 20, dim = 512, rows = 9;
    int32_t tokens[9], positions[9];
    for (int i = 0; i < rows; i++)
        tokens[i] = rng_int(&r, vocab), positions[i] = i;
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        td_step_meta_t meta = simple_meta(rows, tokens, positions);
        cr_assert_eq(be->ops->set_step(be, &meta), TD_OK);
        for (size_t d = 0; d < TD_ARRAY_LEN(block_dtypes); d++) {
            td_dtype_t t = block_dtypes[d];
            void *table = make_blocks(&r, t, (size_t)vocab * dim);
            float *tref = xmalloc((size_t)vocab * dim * 4), *x = xmalloc((size_t)rows * dim * 4);
            td_ggml_type(td_dtype_to_ggml(t))->dequantize(table, tref, (size_t)vocab * dim);
            poison(x, (size_t)rows * dim * 4);
            cr_assert_eq(be->ops->embed(be, x, table, t, dim), TD_OK);
            for (int i = 0; i < rows; i++)
                cr_assert_eq(memcmp(x + (size_t)i * dim, tref + (size_t)tokens[i] * dim,
                                    (size_t)dim * 4), 0, "%s row %d", td_dtype_name(t), i);
            free(table), free(tref), free(x);
        }
        td_backend_destroy(be);
    }
}

Test(kernels_cpu, rmsnorm, .timeout = 120)
{
    static const int rows_[] = {1, 5, 33};
    static const int dims[] = {7, 64, 257, 2048};
    rng_t r = {42};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        for (size_t a = 0; a < TD_ARRAY_LEN(rows_); a++)
            for (size_t b = 0; b < TD_ARRAY_LEN(dims); b++)
                for (size_t d = 0; d < TD_ARRAY_LEN(dtypes); d++)
                    for (int f = 0; f < 4; f++) {
                        int rows = rows_[a], dim = dims[b];
                        bool resid = f & 1, inplace = f & 2;
                        size_t n = (size_t)rows * dim;
                        float *x = xmalloc(n * 4), *res = xmalloc(n * 4), *out = xmalloc(n * 4);
                        float *wref = xmalloc((size_t)dim * 4);
                        void *w = xmalloc((size_t)dim * 2 * 2);
                        double *ref = xmalloc(n * 8), *ref_res = xmalloc(n * 8);
                        fill_random(&r, x, TD_F32, NULL, n);
                        fill_random(&r, res, TD_F32, NULL, n);
                        fill_random(&r, w, dtypes[d], wref, (size_t)dim);
                        for (int i = 0; i < rows; i++) {
                            double ss = 0;
                            for (int j = 0; j < dim; j++) {
                                size_t e = (size_t)i * dim + j;
                                ref_res[e] = resid ? (double)res[e] + x[e] : x[e];
                                ss += ref_res[e] * ref_res[e];
                            }
                            double inv = 1.0 / sqrt(ss / dim + 1e-5);
                            for (int j = 0; j < dim; j++)
                                ref[(size_t)i * dim + j] = ref_res[(size_t)i * dim + j] * inv * wref[j];
                        }
                        float *o = inplace ? x : out;
                        if (!inplace)
                            poison(out, n * 4);
                        cr_assert_eq(be->ops->rmsnorm(be, o, x, resid ? res : NULL, w, dtypes[d],
                                                      rows, dim, 1e-5f),
                                     TD_OK);
                        check_close("rmsnorm", o, ref, n, 1e-5);
                        if (resid)
                            check_close("rmsnorm residual", res, ref_res, n, 1e-6);
                        free(x), free(res), free(out), free(wref), free(w), free(ref), free(ref_res);
                    }
        td_backend_destroy(be);
    }
}

Test(kernels_cpu, embed_swiglu_gather, .timeout = 60)
{
    rng_t r = {7};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        const int vocab = 50, dim = 37, rows = 13;
        int32_t tokens[13], positions[13];
        for (int i = 0; i < rows; i++)
            tokens[i] = rng_int(&r, vocab), positions[i] = i;
        td_step_meta_t meta = simple_meta(rows, tokens, positions);
        cr_assert_eq(be->ops->set_step(be, &meta), TD_OK);
        for (size_t d = 0; d < TD_ARRAY_LEN(dtypes); d++) {
            void *table = xmalloc((size_t)vocab * dim * 4);
            float *tref = xmalloc((size_t)vocab * dim * 4), *x = xmalloc((size_t)rows * dim * 4);
            double *ref = xmalloc((size_t)rows * dim * 8);
            fill_random(&r, table, dtypes[d], tref, (size_t)vocab * dim);
            poison(x, (size_t)rows * dim * 4);
            for (int i = 0; i < rows; i++)
                for (int j = 0; j < dim; j++)
                    ref[i * dim + j] = tref[tokens[i] * dim + j];
            cr_assert_eq(be->ops->embed(be, x, table, dtypes[d], dim), TD_OK);
            check_close("embed", x, ref, (size_t)rows * dim, 0);
            free(table), free(tref), free(x), free(ref);
        }

        /* swiglu, out-of-place and out == gate; hidden large enough to split into tasks */
        const int srows = 3, hidden = 20011;
        size_t n = (size_t)srows * hidden;
        float *g = xmalloc(n * 4), *u = xmalloc(n * 4), *o = xmalloc(n * 4);
        double *ref = xmalloc(n * 8);
        fill_random(&r, g, TD_F32, NULL, n);
        fill_random(&r, u, TD_F32, NULL, n);
        for (size_t i = 0; i < n; i++)
            g[i] *= 12.0f; /* exercise the tails of silu */
        for (size_t i = 0; i < n; i++)
            ref[i] = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        poison(o, n * 4);
        cr_assert_eq(be->ops->swiglu(be, o, g, u, srows, hidden), TD_OK);
        check_close("swiglu", o, ref, n, 1e-5);
        cr_assert_eq(be->ops->swiglu(be, g, g, u, srows, hidden), TD_OK);
        check_close("swiglu in place", g, ref, n, 1e-5);

        /* gather_rows */
        int32_t idx[5] = {2, 0, 2, 1, 2};
        float *dst = xmalloc(5 * 7 * 4);
        double gref[35];
        poison(dst, 5 * 7 * 4);
        for (int i = 0; i < 5; i++)
            for (int j = 0; j < 7; j++)
                gref[i * 7 + j] = u[idx[i] * 7 + j];
        cr_assert_eq(be->ops->gather_rows(be, dst, u, idx, 5, 7), TD_OK);
        check_close("gather_rows", dst, gref, 35, 0);
        free(g), free(u), free(o), free(ref), free(dst);
        td_backend_destroy(be);
    }
}

/* moe_combine against a double sum: each row plus its k weighted slots (repeated slots,
   rows wider than a stripe of 256 and not a multiple of it), 1 and 4 threads; and a row's
   result is bit-identical whatever other rows the call holds (the engine's invariance). */
Test(kernels_cpu, moe_combine, .timeout = 60)
{
    rng_t r = {11};
    enum { N = 17, K = 4, Y = 40, DIM = 600 };
    int32_t slots[N * K];
    float w[N * K];
    float *x0 = xmalloc((size_t)N * DIM * 4), *y = xmalloc((size_t)Y * DIM * 4), *x = xmalloc((size_t)N * DIM * 4);
    double *ref = xmalloc((size_t)N * DIM * 8);
    fill_random(&r, x0, TD_F32, NULL, (size_t)N * DIM);
    fill_random(&r, y, TD_F32, NULL, (size_t)Y * DIM);
    for (int i = 0; i < N * K; i++) {
        slots[i] = rng_int(&r, Y);
        w[i] = fabsf(rng_val(&r));
    }
    slots[1] = slots[0]; /* one row takes the same output twice */
    for (int t = 0; t < N; t++)
        for (int i = 0; i < DIM; i++) {
            double acc = 0;
            for (int k = 0; k < K; k++)
                acc += (double)w[t * K + k] * y[(size_t)slots[t * K + k] * DIM + i];
            ref[(size_t)t * DIM + i] = x0[(size_t)t * DIM + i] + acc;
        }
    float *alone = xmalloc(DIM * 4);
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        memcpy(x, x0, (size_t)N * DIM * 4);
        cr_assert_eq(be->ops->moe_combine(be, x, y, slots, w, N, K, DIM), TD_OK);
        check_close("moe_combine", x, ref, (size_t)N * DIM, 1e-6);
        /* row 5 alone: the same bits as in the call of 17 rows */
        memcpy(alone, x0 + 5 * DIM, DIM * 4);
        cr_assert_eq(be->ops->moe_combine(be, alone, y, slots + 5 * K, w + 5 * K, 1, K, DIM), TD_OK);
        cr_assert(!memcmp(alone, x + 5 * DIM, DIM * 4), "moe_combine: row 5 alone differs from row 5 of 17");
        td_backend_destroy(be);
    }
    free(x0), free(y), free(x), free(ref), free(alone);
}

/* rope_kv_write against a plain double-precision rotation: q rotated in place, k rotated
   into its cache slot (layer 1 of a 2-layer f32 pool), v copied; a row with slot -1 writes
   nothing and slots no row names keep their poison. */
Test(kernels_cpu, rope_kv_write, .timeout = 60)
{
    static const int hds[] = {32, 64, 128};
    rng_t r = {99};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        for (size_t hi = 0; hi < TD_ARRAY_LEN(hds); hi++)
            for (int style = 0; style < 2; style++) {
                const int hd = hds[hi], nh = 6, nkv = 2, rows = 9, n_blocks = 3, layer = 1;
                int32_t positions[9] = {0, 1, 7, 100, 2047, 4095, 16383, 32767, 32000};
                int32_t slots[9] = {3, 0, 9, 5, 1, -1, 10, 2, 7};
                int32_t tokens[9] = {0};
                td_step_meta_t meta = simple_meta(rows, tokens, positions);
                meta.slots = slots;
                cr_assert_eq(be->ops->set_step(be, &meta), TD_OK);
                td_kv_layout_t l = {.dtype = TD_F32, .block_size = 4, .n_layers = 2,
                                    .n_kv_heads = (uint32_t)nkv, .head_dim = (uint32_t)hd,
                                    .version = TD_KV_LAYOUT_VERSION};
                size_t pool_bytes = td_kv_pool_bytes(&l, n_blocks);
                unsigned char *pool = xmalloc(pool_bytes);
                poison(pool, pool_bytes);
                float inv_freq[64];
                for (int i = 0; i < hd / 2; i++)
                    inv_freq[i] = (float)pow(500000.0, -2.0 * i / hd);
                size_t nq = (size_t)rows * nh * hd, nk = (size_t)rows * nkv * hd, row = nk / rows;
                float *q = xmalloc(nq * 4), *k = xmalloc(nk * 4), *v = xmalloc(nk * 4);
                double *qref = xmalloc(nq * 8), *kref = xmalloc(nk * 8);
                fill_random(&r, q, TD_F32, NULL, nq);
                fill_random(&r, k, TD_F32, NULL, nk);
                fill_random(&r, v, TD_F32, NULL, nk);
                for (int pass = 0; pass < 2; pass++) {
                    float *x = pass ? k : q;
                    double *ref = pass ? kref : qref;
                    int heads = pass ? nkv : nh;
                    for (int t = 0; t < rows; t++)
                        for (int h = 0; h < heads; h++) {
                            const float *xv = x + ((size_t)t * heads + h) * hd;
                            double *o = ref + ((size_t)t * heads + h) * hd;
                            for (int i = 0; i < hd / 2; i++) {
                                double ang = (double)positions[t] * (double)inv_freq[i];
                                int a = style == TD_ROPE_PAIRS ? 2 * i : i;
                                int b = style == TD_ROPE_PAIRS ? 2 * i + 1 : i + hd / 2;
                                o[a] = xv[a] * cos(ang) - xv[b] * sin(ang);
                                o[b] = xv[a] * sin(ang) + xv[b] * cos(ang);
                            }
                        }
                }
                unsigned char *lbase = pool + td_kv_block_offset(&l, n_blocks, layer, 0);
                td_rope_kv_params_t p = {.q = q, .k = k, .v = v, .n_heads = nh,
                                         .inv_freq = inv_freq, .style = (td_rope_style_t)style,
                                         .kv_layer = lbase, .layout = &l, .n_blocks = n_blocks};
                cr_assert_eq(be->ops->rope_kv_write(be, &p), TD_OK);
                check_close("rope q", q, qref, nq, 1e-5);
                bool used[12] = {false};
                for (int t = 0; t < rows; t++) {
                    if (slots[t] < 0)
                        continue;
                    used[slots[t]] = true;
                    const float *kc = (const float *)lbase + ((size_t)(slots[t] / 4) * 2 * 4 +
                                                              (size_t)(slots[t] % 4)) * row;
                    check_close("rope k (cache)", kc, kref + (size_t)t * row, row, 1e-5);
                    cr_assert_eq(memcmp(kc + 4 * row, v + (size_t)t * row, row * 4), 0,
                                 "v of row %d in its slot", t);
                }
                unsigned char ff[4];
                memset(ff, 0xff, sizeof(ff));
                for (int sl = 0; sl < 12; sl++)
                    if (!used[sl])
                        cr_assert_eq(memcmp((const float *)lbase +
                                            ((size_t)(sl / 4) * 2 * 4 + (size_t)(sl % 4)) * row,
                                            ff, 4), 0, "slot %d written", sl);
                cr_assert_eq(memcmp(pool, ff, 4), 0, "layer 0 written");
                free(q), free(k), free(v), free(qref), free(kref), free(pool);
            }
        td_backend_destroy(be);
    }
}

/* ---- paged attention -------------------------------------------------------------- */

#define MAX_SEQS 8

typedef struct attn_case {
    int n_seqs;
    int q_len[MAX_SEQS]; /* new rows */
    int ctx[MAX_SEQS];   /* seq_len after the step (cached prefix + new rows) */
    int n_kv, G, hd, bs;
    td_dtype_t kv_dtype;
    int partition_tokens;
    bool decode;
    int window;          /* sliding window (0: none); blocks below every row's window are
                            "released": their table entries point at a NaN-poisoned block */
} attn_case_t;

static void attn_run(td_backend_t *be, rng_t *r, const attn_case_t *c)
{
    const int n_kv = c->n_kv, hd = c->hd, bs = c->bs, nh = n_kv * c->G;
    const size_t row = (size_t)n_kv * hd;
    td_kv_layout_t layout = {.dtype = c->kv_dtype, .block_size = (uint32_t)bs, .n_layers = 1,
                             .n_kv_heads = (uint32_t)n_kv, .head_dim = (uint32_t)hd,
                             .version = TD_KV_LAYOUT_VERSION};
    int32_t seq_start[MAX_SEQS + 1], seq_len[MAX_SEQS];
    int n_tokens = 0, max_blocks = 1, total_blocks = 0, max_q = 0, max_len = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        seq_start[s] = n_tokens;
        n_tokens += c->q_len[s];
        seq_len[s] = c->ctx[s];
        int nb = TD_DIV_CEIL(c->ctx[s], bs);
        max_blocks = TD_MAX(max_blocks, nb);
        total_blocks += nb;
        max_q = TD_MAX(max_q, c->q_len[s]);
        max_len = TD_MAX(max_len, c->ctx[s]);
    }
    seq_start[c->n_seqs] = n_tokens;

    /* scattered block ids: a random permutation of a pool with spare blocks */
    const int n_blocks = total_blocks + 7;
    int32_t *perm = xmalloc((size_t)n_blocks * 4);
    for (int i = 0; i < n_blocks; i++)
        perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int j = rng_int(r, i + 1);
        int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int32_t *tables = xmalloc((size_t)c->n_seqs * max_blocks * 4);
    for (int s = 0, used = 0; s < c->n_seqs; s++)
        for (int b = 0; b < max_blocks; b++)
            tables[s * max_blocks + b] = b < TD_DIV_CEIL(c->ctx[s], bs) ? perm[used++] : -1;
    /* released blocks: wholly below the first new row's window; perm[n_blocks - 1] is a spare
       block nobody writes, poisoned with NaNs, so a kernel that reads one fails the check */
    int released[MAX_SEQS] = {0};
    for (int s = 0; c->window > 0 && s < c->n_seqs; s++) {
        released[s] = TD_MAX(0, c->ctx[s] - c->q_len[s] - c->window + 1) / bs;
        for (int b = 0; b < released[s]; b++)
            tables[s * max_blocks + b] = perm[n_blocks - 1];
    }

    /* ground truth K/V per sequence [ctx][n_kv][hd], rounded to the KV dtype */
    float *kref[MAX_SEQS], *vref[MAX_SEQS];
    size_t pool_bytes = td_kv_pool_bytes(&layout, (uint32_t)n_blocks);
    unsigned char *pool = NULL;
    cr_assert_eq(be->ops->alloc(be, pool_bytes, (void **)&pool), TD_OK);
    poison(pool, pool_bytes);
    size_t block_elems = td_kv_block_elems(&layout);
    float *knew = xmalloc((size_t)n_tokens * row * 4), *vnew = xmalloc((size_t)n_tokens * row * 4);
    int32_t *slots = xmalloc((size_t)n_tokens * 4), *positions = xmalloc((size_t)n_tokens * 4);
    int32_t *tokens = xmalloc((size_t)n_tokens * 4);
    for (int s = 0; s < c->n_seqs; s++) {
        kref[s] = xmalloc((size_t)c->ctx[s] * row * 4);
        vref[s] = xmalloc((size_t)c->ctx[s] * row * 4);
        int prefix = c->ctx[s] - c->q_len[s];
        for (int t = 0; t < c->ctx[s]; t++) {
            float *kt = kref[s] + (size_t)t * row, *vt = vref[s] + (size_t)t * row;
            for (size_t e = 0; e < row; e++) {
                kt[e] = rng_val(r);
                vt[e] = rng_val(r);
            }
            round_kv(kt, row, c->kv_dtype);
            round_kv(vt, row, c->kv_dtype);
            int32_t b = tables[s * max_blocks + t / bs];
            if (t < released[s] * bs) { /* released: nothing to write */
            } else if (t < prefix) { /* cached prefix: written straight into the pool */
                size_t ko = ((size_t)b * 2 + 0) * block_elems + (size_t)(t % bs) * row;
                size_t vo = ((size_t)b * 2 + 1) * block_elems + (size_t)(t % bs) * row;
                td_dtype_convert(pool + td_kv_bytes(c->kv_dtype, ko), c->kv_dtype, kt, TD_F32, row);
                td_dtype_convert(pool + td_kv_bytes(c->kv_dtype, vo), c->kv_dtype, vt, TD_F32, row);
            } else { /* new rows: through rope_kv_write (no rotation) */
                int i = seq_start[s] + t - prefix;
                memcpy(knew + (size_t)i * row, kt, row * 4);
                memcpy(vnew + (size_t)i * row, vt, row * 4);
                slots[i] = b * bs + t % bs;
                positions[i] = t;
                tokens[i] = 1;
            }
        }
    }
    td_step_meta_t meta = {.n_tokens = n_tokens, .n_seqs = c->n_seqs, .tokens = tokens,
                           .positions = positions, .slots = slots, .seq_start = seq_start,
                           .seq_len = seq_len, .block_tables = tables, .max_blocks = max_blocks,
                           .max_q_len = max_q, .max_seq_len = max_len};
    cr_assert_eq(be->ops->set_step(be, &meta), TD_OK);
    td_rope_kv_params_t wp = {.k = knew, .v = vnew, .n_heads = nh, .kv_layer = pool,
                              .layout = &layout, .n_blocks = n_blocks};
    cr_assert_eq(be->ops->rope_kv_write(be, &wp), TD_OK);

    size_t nq = (size_t)n_tokens * nh * hd;
    float *q = xmalloc(nq * 4), *out = xmalloc(nq * 4);
    double *ref = xmalloc(nq * 8), *sc = xmalloc((size_t)max_len * 8);
    fill_random(r, q, TD_F32, NULL, nq);
    for (size_t i = 0; i < nq; i++)
        q[i] *= 3.0f; /* peakier softmax */
    poison(out, nq * 4);
    const double scale = 1.0 / sqrt((double)hd);
    for (int s = 0; s < c->n_seqs; s++)
        for (int i = 0; i < c->q_len[s]; i++) {
            int pos = c->ctx[s] - c->q_len[s] + i;
            for (int h = 0; h < nh; h++) {
                const float *qv = q + ((size_t)(seq_start[s] + i) * nh + h) * hd;
                int kvh = h / c->G;
                int t_lo = c->window > 0 ? TD_MAX(0, pos - c->window + 1) : 0;
                double mx = -INFINITY, sum = 0;
                for (int t = t_lo; t <= pos; t++) {
                    const float *kv = kref[s] + (size_t)t * row + (size_t)kvh * hd;
                    double d = 0;
                    for (int e = 0; e < hd; e++)
                        d += (double)qv[e] * kv[e];
                    sc[t] = d * (float)scale;
                    mx = fmax(mx, sc[t]);
                }
                for (int t = t_lo; t <= pos; t++)
                    sum += (sc[t] = exp(sc[t] - mx));
                double *o = ref + ((size_t)(seq_start[s] + i) * nh + h) * hd;
                for (int e = 0; e < hd; e++)
                    o[e] = 0;
                for (int t = t_lo; t <= pos; t++) {
                    const float *vv = vref[s] + (size_t)t * row + (size_t)kvh * hd;
                    for (int e = 0; e < hd; e++)
                        o[e] += sc[t] / sum * vv[e];
                }
            }
        }
    td_attn_params_t p = {.q = q, .out = out, .kv_layer = pool, .layout = &layout,
                          .n_blocks = n_blocks, .n_heads = nh, .scale = (float)scale,
                          .partition_tokens = c->partition_tokens, .window = c->window};
    td_status_t st = c->decode ? be->ops->attn_decode(be, &p) : be->ops->attn_prefill(be, &p);
    cr_assert_eq(st, TD_OK);
    char what[256];
    snprintf(what, sizeof(what), "%s seqs %d (q %d ctx %d ...) kv %d G %d hd %d bs %d %s part %d window %d",
             c->decode ? "attn_decode" : "attn_prefill", c->n_seqs, c->q_len[0], c->ctx[0], n_kv,
             c->G, hd, bs, td_dtype_name(c->kv_dtype), c->partition_tokens, c->window);
    check_close(what, out, ref, nq, 2e-4);

    for (int s = 0; s < c->n_seqs; s++)
        free(kref[s]), free(vref[s]);
    be->ops->free(be, pool);
    free(perm), free(tables), free(knew), free(vnew), free(slots), free(positions), free(tokens);
    free(q), free(out), free(ref), free(sc);
}

Test(kernels_cpu, kv_write_layout_and_copy_blocks, .timeout = 60)
{
    rng_t r = {5};
    td_backend_t *be = make_backend(4);
    static const td_dtype_t kv_types[] = {TD_F32, TD_F16, TD_BF16, TD_Q8_0};
    for (size_t d = 0; d < TD_ARRAY_LEN(kv_types); d++) {
        td_dtype_t t = kv_types[d];
        uint32_t hd = t == TD_Q8_0 ? 32 : 8; /* Q8_0: whole blocks along head_dim */
        td_kv_layout_t l = {.dtype = t, .block_size = 4, .n_layers = 3, .n_kv_heads = 2,
                            .head_dim = hd, .version = TD_KV_LAYOUT_VERSION};
        cr_assert_eq(td_kv_layout_validate(&l), TD_OK);
        const int n_blocks = 5, rows = 6, layer = 1;
        size_t bytes = td_kv_pool_bytes(&l, n_blocks), row = 2 * hd, row_bytes = td_kv_bytes(t, row);
        unsigned char *pool = xmalloc(bytes);
        poison(pool, bytes);
        int32_t slots[6] = {0, 5, 19, 18, 7, -1}, tokens[6] = {0}, pos[6] = {0};
        td_step_meta_t meta = simple_meta(rows, tokens, pos);
        meta.slots = slots;
        cr_assert_eq(be->ops->set_step(be, &meta), TD_OK);
        float k[6 * 64], v[6 * 64], got[64];
        fill_random(&r, k, TD_F32, NULL, rows * row);
        fill_random(&r, v, TD_F32, NULL, rows * row);
        round_kv(k, rows * row, t); /* values exact in the KV dtype */
        round_kv(v, rows * row, t);
        unsigned char *lbase = pool + td_kv_block_offset(&l, n_blocks, layer, 0);
        td_rope_kv_params_t wp = {.k = k, .v = v, .n_heads = 2, .kv_layer = lbase, .layout = &l,
                                  .n_blocks = n_blocks};
        cr_assert_eq(be->ops->rope_kv_write(be, &wp), TD_OK);
        for (int i = 0; i < 5; i++) {
            int b = slots[i] / 4, off = slots[i] % 4;
            td_dtype_convert(got, TD_F32, pool + td_kv_block_offset(&l, n_blocks, layer, b) +
                             off * row_bytes, t, row);
            cr_assert_eq(memcmp(got, k + i * row, row * 4), 0, "%s K row %d", td_dtype_name(t), i);
            td_dtype_convert(got, TD_F32, pool + td_kv_block_offset(&l, n_blocks, layer, b) +
                             (4 + off) * row_bytes, t, row);
            cr_assert_eq(memcmp(got, v + i * row, row * 4), 0, "%s V row %d", td_dtype_name(t), i);
        }
        /* block 2 of layer 1 has no write: still poison; other layers untouched */
        unsigned char ff[8];
        memset(ff, 0xff, sizeof(ff));
        cr_assert_eq(memcmp(pool + td_kv_block_offset(&l, n_blocks, layer, 2), ff, 8), 0);
        cr_assert_eq(memcmp(pool, ff, 8), 0);

        /* copy_blocks: every layer of block 4 -> block 2 */
        fill_random(&r, pool, TD_F32, NULL, bytes / 4);
        int32_t src[1] = {4}, dst[1] = {2};
        cr_assert_eq(be->ops->copy_blocks(be, pool, &l, n_blocks, src, dst, 1), TD_OK);
        for (uint32_t ly = 0; ly < l.n_layers; ly++)
            cr_assert_eq(memcmp(pool + td_kv_block_offset(&l, n_blocks, ly, 2),
                                pool + td_kv_block_offset(&l, n_blocks, ly, 4), td_kv_block_bytes(&l)),
                         0);
        free(pool);
    }
    td_backend_destroy(be);
}

/* Single-sequence prefill over head dims, GQA ratios, block sizes and odd lengths, with and
   without a cached prefix (chunked prefill). */
Test(kernels_cpu, attn_prefill_shapes, .timeout = 600)
{
    static const int hds[] = {32, 64, 72, 128}; /* 72: a 64-output block and one of 8 lanes */
    static const int Gs[] = {1, 2, 4, 8};
    static const int bss[] = {8, 16, 32};
    static const int lens[][2] = {{1, 1}, {7, 7}, {33, 33}, {100, 100}, {1, 37}, {7, 100},
                                  {64, 257}, {33, 130}};
    rng_t r = {11};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        int n = 0;
        for (size_t a = 0; a < TD_ARRAY_LEN(hds); a++)
            for (size_t g = 0; g < TD_ARRAY_LEN(Gs); g++)
                for (size_t b = 0; b < TD_ARRAY_LEN(bss); b++, n++) {
                    /* each (hd, G, bs) gets two of the lengths to keep the run short */
                    for (int li = 0; li < 2; li++) {
                        int L = (n * 2 + li) % (int)TD_ARRAY_LEN(lens);
                        attn_case_t c = {.n_seqs = 1, .q_len = {lens[L][0]}, .ctx = {lens[L][1]},
                                         .n_kv = (n % 3 == 0) ? 1 : 2, .G = Gs[g], .hd = hds[a],
                                         .bs = bss[b], .kv_dtype = dtypes[n % 3]};
                        attn_run(be, &r, &c);
                    }
                }
        td_backend_destroy(be);
    }
}

/* Ragged batches: several sequences with different prefixes and chunk lengths, scattered
   blocks, every KV dtype; also a full 257-token prompt. */
Test(kernels_cpu, attn_prefill_ragged, .timeout = 600)
{
    rng_t r = {12};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        for (size_t d = 0; d < TD_ARRAY_LEN(dtypes); d++) {
            attn_case_t c = {.n_seqs = 5, .q_len = {7, 1, 33, 100, 16}, .ctx = {7, 60, 90, 100, 257},
                             .n_kv = 2, .G = 4, .hd = 64, .bs = 16, .kv_dtype = dtypes[d]};
            attn_run(be, &r, &c);
            attn_case_t c2 = {.n_seqs = 3, .q_len = {257, 3, 1}, .ctx = {257, 1000, 5},
                              .n_kv = 1, .G = 8, .hd = 32, .bs = 8, .kv_dtype = dtypes[d]};
            attn_run(be, &r, &c2);
        }
        td_backend_destroy(be);
    }
}

/* Decode: one row per sequence, partition sizes from one block to more than the context,
   and the heuristic (0); contexts up to a few thousand tokens. */
Test(kernels_cpu, attn_decode, .timeout = 600)
{
    static const int parts[] = {0, 1, 2, 3, 16, 100000};
    rng_t r = {13};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        int n = 0;
        for (size_t pi = 0; pi < TD_ARRAY_LEN(parts); pi++)
            for (int G = 1; G <= 8; G *= 2, n++) {
                int bs = 8 << (n % 3), hd = 32 << ((n / 3) % 3);
                attn_case_t c = {.n_seqs = 4, .q_len = {1, 1, 1, 1}, .ctx = {1, 33, 257, 1000},
                                 .n_kv = 2, .G = G, .hd = hd, .bs = bs,
                                 .kv_dtype = dtypes[n % 3], .decode = true,
                                 .partition_tokens = parts[pi] * bs};
                attn_run(be, &r, &c);
            }
        /* batch 1, long context */
        attn_case_t c = {.n_seqs = 1, .q_len = {1}, .ctx = {3001}, .n_kv = 2, .G = 4, .hd = 128,
                         .bs = 16, .kv_dtype = TD_F32, .decode = true};
        attn_run(be, &r, &c);
        c.partition_tokens = 48;
        attn_run(be, &r, &c);
        /* batch 1, one part: its KV heads are cut into ranges across the threads (3 heads
           into 2 or 3 uneven ranges) */
        attn_case_t c3 = {.n_seqs = 1, .q_len = {1}, .ctx = {40}, .n_kv = 3, .G = 3, .hd = 64,
                          .bs = 16, .kv_dtype = TD_F16, .decode = true};
        attn_run(be, &r, &c3);
        td_backend_destroy(be);
    }
}

/* Sliding window: contexts far beyond the window, windows smaller and larger than a block
   and than a tile, prefill pieces that start inside, at and past the window, and decode
   at every partition size; the blocks below the window are released (poisoned) and must
   never be read. */
Test(kernels_cpu, attn_sliding_window, .timeout = 600)
{
    static const int windows[] = {1, 5, 16, 40, 100, 300};
    static const int parts[] = {0, 1, 3, 100000};
    rng_t r = {15};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        int n = 0;
        for (size_t wi = 0; wi < TD_ARRAY_LEN(windows); wi++, n++) {
            int bs = 8 << (n % 2), G = 1 << (n % 3), W = windows[wi];
            attn_case_t c = {.n_seqs = 5, .q_len = {7, 1, 33, 100, 130}, .ctx = {7, 60, 90, 400, 700},
                             .n_kv = 2, .G = G, .hd = 32 << (n % 2), .bs = bs,
                             .kv_dtype = dtypes[n % 3], .window = W};
            attn_run(be, &r, &c);
            for (size_t pi = 0; pi < TD_ARRAY_LEN(parts); pi++) {
                attn_case_t d = {.n_seqs = 4, .q_len = {1, 1, 1, 1}, .ctx = {1, W, W + 1, 1000},
                                 .n_kv = 2, .G = G, .hd = 64, .bs = bs, .kv_dtype = dtypes[(n + pi) % 3],
                                 .decode = true, .partition_tokens = parts[pi] * bs, .window = W};
                attn_run(be, &r, &d);
            }
        }
        td_backend_destroy(be);
    }
}

/* A Q8_0 KV cache (blocks of 32 along head_dim, written by rope_kv_write's quantizer): prefill
   shapes, a ragged batch, decode over partitions and a sliding window, against the double
   reference on the values the cache holds (td_quant's quantize then dequantize). */
Test(kernels_cpu, attn_q8_0_kv, .timeout = 300)
{
    static const int parts[] = {0, 1, 100000};
    rng_t r = {16};
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        for (int hd = 32; hd <= 128; hd *= 2) {
            attn_case_t c = {.n_seqs = 1, .q_len = {33}, .ctx = {130}, .n_kv = 2, .G = 4, .hd = hd, .bs = 16,
                             .kv_dtype = TD_Q8_0};
            attn_run(be, &r, &c);
        }
        attn_case_t c = {.n_seqs = 5, .q_len = {7, 1, 33, 100, 16}, .ctx = {7, 60, 90, 100, 257},
                         .n_kv = 2, .G = 4, .hd = 64, .bs = 16, .kv_dtype = TD_Q8_0};
        attn_run(be, &r, &c);
        for (size_t pi = 0; pi < TD_ARRAY_LEN(parts); pi++) {
            attn_case_t d = {.n_seqs = 4, .q_len = {1, 1, 1, 1}, .ctx = {1, 33, 257, 1000}, .n_kv = 2, .G = 8,
                             .hd = 64, .bs = 8, .kv_dtype = TD_Q8_0, .decode = true,
                             .partition_tokens = parts[pi] * 8};
            attn_run(be, &r, &d);
            d.window = 40;
            attn_run(be, &r, &d);
        }
        td_backend_destroy(be);
    }
}

/* A decode step computed by the prefill kernel gives the same result. */
Test(kernels_cpu, attn_prefill_single_rows, .timeout = 120)
{
    rng_t r = {14};
    td_backend_t *be = make_backend(4);
    attn_case_t c = {.n_seqs = 3, .q_len = {1, 1, 1}, .ctx = {1, 100, 2000}, .n_kv = 2, .G = 2,
                     .hd = 64, .bs = 16, .kv_dtype = TD_BF16};
    attn_run(be, &r, &c);
    td_backend_destroy(be);
}

/* ---- special values: NaN, +-inf, huge --------------------------------------------- */

#define N_SPECIAL 28
static const float special_in[N_SPECIAL] = {
    NAN, -NAN, INFINITY, -INFINITY, 3.4e38f, -3.4e38f, 1e30f, -1e30f, 1000.0f, -1000.0f,
    88.5f, 88.0f, 87.9f, -86.9f, -87.0f, -87.5f, -88.5f, -100.0f, 20.0f, -20.0f,
    1.0f, -1.0f, 0.0f, -0.0f, 1e-40f, -1e-40f, 1e-30f, 0.5f};

/* got matches ref: both NaN, the same infinity, or finite and within rel * |ref| + abs */
static void check_special(const char *what, const float *in, const float *got, const double *ref, int n,
                          double rel, double abs)
{
    for (int i = 0; i < n; i++) {
        double g = got[i], w = ref[i];
        bool ok = isnan(w) ? isnan(g) : isinf(w) ? g == w : isfinite(g) && fabs(g - w) <= rel * fabs(w) + abs;
        if (!ok)
            cr_assert_fail("%s: element %d (input %.8g): got %.8g want %.8g", what, i, in ? (double)in[i] : 0.0,
                           g, w);
    }
}

/* td_cpu_exp's documented function: exp on [-87, 88], clamped outside it, NaN for NaN */
static double exp_ref(float x)
{
    return isnan(x) ? NAN : exp(fmin(fmax((double)x, -87.0), 88.0));
}

/* exp on every special value, scalar and (where built) the 8-lane version */
Test(kernels_cpu, exp_special_values)
{
    float got[32], in[32] = {0};
    double ref[N_SPECIAL];
    memcpy(in, special_in, sizeof special_in);
    for (int i = 0; i < N_SPECIAL; i++)
        got[i] = td_cpu_exp(in[i]), ref[i] = exp_ref(in[i]);
    check_special("td_cpu_exp", in, got, ref, N_SPECIAL, 2e-6, 0);
#if defined(__AVX2__) && defined(__FMA__)
    for (int i = 0; i < 32; i += 8)
        _mm256_storeu_ps(got + i, td_cpu_exp8(_mm256_loadu_ps(in + i)));
    check_special("td_cpu_exp8", in, got, ref, N_SPECIAL, 2e-6, 0);
#endif
}

/* The scalar exp is the 8-lane one lane by lane: the same bits for every input (a row's tail
 * goes through td_cpu_exp, its body through td_cpu_exp8; if they differed, a SwiGLU or softmax
 * result would depend on where a task's range started). Every float on a fine grid over
 * [-100, 100] and the special values. */
Test(kernels_cpu, exp_scalar_equals_lanes)
{
#if defined(__AVX2__) && defined(__FMA__)
    float in[8], lane[8];
    int bad = 0;
    for (int i = 0; i < 200000 + N_SPECIAL; i += 8) {
        for (int l = 0; l < 8; l++) {
            int t = i + l;
            in[l] = t < 200000 ? -100.0f + (float)t * 1e-3f + (float)(t % 7) * 1.3e-7f
                    : t < 200000 + N_SPECIAL ? special_in[t - 200000] : 0.0f;
        }
        _mm256_storeu_ps(lane, td_cpu_exp8(_mm256_loadu_ps(in)));
        for (int l = 0; l < 8; l++) {
            float s = td_cpu_exp(in[l]);
            if (memcmp(&s, &lane[l], sizeof s) != 0 && !(isnan(s) && isnan(lane[l])) && bad++ < 5)
                cr_log_error("exp(%.9g): scalar %.9g, lane %.9g", (double)in[l], (double)s, (double)lane[l]);
        }
    }
    cr_assert_eq(bad, 0, "%d inputs where td_cpu_exp and td_cpu_exp8 differ", bad);
#else
    cr_skip_test("no AVX2/FMA build: there is no 8-lane exp");
#endif
}

/* Softmax as attention computes it (max, then exp(x - max) and the sum, on rows long enough
 * for the 8-lane path and its scalar tail): a NaN anywhere, or +inf (inf - inf), makes the
 * row NaN; -inf entries (masked) weigh ~0; huge finite values are exact after the shift. */
Test(kernels_cpu, softmax_special_values)
{
    enum { N = 21 };
    static const struct {
        const char *what;
        int at;      /* where `v` goes in a row of small values */
        float v;
        bool nan;    /* the whole row is NaN */
    } rows[] = {
        {"nan first", 0, NAN, true},    {"nan in the vector part", 5, NAN, true},
        {"nan in the tail", 19, NAN, true}, {"+inf", 9, INFINITY, true},
        {"-inf", 3, -INFINITY, false},  {"-inf in the tail", 20, -INFINITY, false},
        {"huge", 7, 3.0e38f, false},    {"huge negative", 17, -3.0e38f, false},
    };
    for (size_t t = 0; t < TD_ARRAY_LEN(rows); t++) {
        float x[N];
        double ref[N];
        for (int i = 0; i < N; i++)
            x[i] = 0.25f * (float)(i % 7) - 1.0f;
        x[rows[t].at] = rows[t].v;
        float m = td_cpu_max(x, N);
        float sum = td_cpu_exp_sum(x, m, N);
        for (int i = 0; i < N; i++)
            x[i] /= sum;
        if (rows[t].nan) {
            for (int i = 0; i < N; i++)
                ref[i] = NAN;
        } else {
            double mx = -INFINITY, s = 0;
            for (int i = 0; i < N; i++)
                mx = fmax(mx, i == rows[t].at ? (double)rows[t].v : 0.25 * (i % 7) - 1.0);
            for (int i = 0; i < N; i++)
                s += ref[i] = exp((i == rows[t].at ? (double)rows[t].v : 0.25 * (i % 7) - 1.0) - mx);
            for (int i = 0; i < N; i++)
                ref[i] /= s;
        }
        check_special(rows[t].what, NULL, x, ref, N, 1e-5, 1e-30);
    }
}

/* swiglu on every pair of a special gate and a plain or zero up: silu(+inf) = +inf,
 * silu(-inf) = 0 (its limit), NaN gives NaN, and inf * 0 is NaN as IEEE says. */
Test(kernels_cpu, swiglu_special_values)
{
    static const float ups[] = {1.0f, 0.0f, -0.5f};
    enum { NU = 3, N = N_SPECIAL * NU };
    float g[N], u[N], o[N];
    double ref[N];
    for (int i = 0; i < N_SPECIAL; i++)
        for (int k = 0; k < NU; k++) {
            int at = i * NU + k;
            double gd = special_in[i];
            double silu = isinf(gd) ? (gd > 0 ? gd : 0.0) : gd / (1.0 + exp(-gd));
            g[at] = special_in[i], u[at] = ups[k];
            ref[at] = silu * ups[k];
        }
    for (size_t ti = 0; ti < TD_ARRAY_LEN(thread_counts); ti++) {
        td_backend_t *be = make_backend(thread_counts[ti]);
        poison(o, sizeof o);
        cr_assert_eq(be->ops->swiglu(be, o, g, u, 1, N), TD_OK);
        check_special("swiglu", g, o, ref, N, 1e-5, 1e-30);
        td_backend_destroy(be);
    }
}

/* ---- opening a backend by --device -------------------------------------------------- */

Test(backend_open, device_values_parse_or_are_refused)
{
    td_device_spec_t d;
    cr_assert_eq(td_device_parse("cpu", &d), TD_OK);
    cr_assert(!d.cuda && !d.staged);
    cr_assert_eq(td_device_parse("cpu:staged", &d), TD_OK);
    cr_assert(!d.cuda && d.staged);
    cr_assert_eq(td_device_parse("cuda", &d), TD_OK);
    cr_assert(d.cuda && d.index == 0);
    cr_assert_eq(td_device_parse("cuda:3", &d), TD_OK);
    cr_assert(d.cuda && d.index == 3);
    const char *bad[] = {"", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:+1", "cuda:1x", "cuda:99999", "cpu:", "cpu:x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        d = (td_device_spec_t){.cuda = true, .staged = true, .index = 7};
        cr_assert_eq(td_device_parse(bad[i], &d), TD_ERR_INVALID, "'%s' accepted", bad[i]);
        cr_assert(strstr(td_last_error(), bad[i]), "the message does not name '%s': %s", bad[i], td_last_error());
        cr_assert(d.cuda && d.staged && d.index == 7, "'%s' changed the output", bad[i]);
    }
    cr_assert_eq(td_device_parse(NULL, &d), TD_ERR_INVALID);
    /* no --dtype: the model's on CUDA, weights as stored on the CPU */
    cr_assert_eq(td_device_default_dtype(&(td_device_spec_t){.cuda = true}, TD_BF16), TD_BF16);
    cr_assert_eq(td_device_default_dtype(&(td_device_spec_t){.cuda = false}, TD_BF16), -1);
}

/* cpu:q8: the packed matmul on one-byte activation rows, bit for bit what td_cpu_pack's scalar
 * one-byte kernel gives on the rows td_cpu_pack_act_row makes with one_byte (for Q4_K, IQ4_XS
 * and Q6_K super-block rows, one scale a 256 values) and on the weights the cpu:q8 backend packed
 * (Q8_0 in the one-byte layout); the default backend's two-byte result is another */
Test(backend_open, cpu_q8_runs_one_byte_activations)
{
    td_device_spec_t d;
    cr_assert_eq(td_device_parse("cpu:q8", &d), TD_OK);
    cr_assert(!d.cuda && d.q8 && !d.exact && !d.staged);
    cr_assert_eq(td_device_parse("cpu:exact", &d), TD_OK);
    cr_assert(!d.cuda && d.exact && !d.q8);
    cr_assert_eq(td_device_parse("cpu:q8", &d), TD_OK);
    const int m = 3, n = 40, k = 512, ld = 48;
    static const td_dtype_t types[] = {TD_Q8_0, TD_Q4_0, TD_Q4_K, TD_IQ4_XS, TD_Q6_K};
    rng_t r = {0x98};
    td_backend_t *q8 = NULL, *two = make_backend(2);
    cr_assert_eq(td_backend_open(&d, 2, TD_F32, &q8), TD_OK);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const td_dtype_t t = types[ti];
        void *w = make_blocks(&r, t, (size_t)n * k), *wp = NULL, *wp2 = NULL;
        float *x = xmalloc((size_t)m * k * 4), *y = xmalloc((size_t)m * n * 4), *y2 = xmalloc((size_t)m * n * 4);
        fill_random(&r, x, TD_F32, NULL, (size_t)m * k);
        cr_assert_eq(q8->ops->weight_pack(q8, w, t, n, k, &wp), TD_OK);
        cr_assert_eq(two->ops->weight_pack(two, w, t, n, k, &wp2), TD_OK);
        td_matmul_params_t p = {.m = m, .n = n, .k = k, .x = x, .w = wp, .w_dtype = t, .w_packed = true, .y = y};
        cr_assert_eq(q8->ops->matmul(q8, &p), TD_OK);
        p.w = wp2;
        p.y = y2;
        cr_assert_eq(two->ops->matmul(two, &p), TD_OK);
        const td_cpu_pack_ops_t *scalar = td_cpu_pack_ops(TD_CPU_ISA_SCALAR);
        size_t stride = td_cpu_pack_act_stride(k);
        unsigned char *a = aligned_alloc(64, (size_t)m * stride);
        for (int i = 0; i < m; i++)
            td_cpu_pack_act_row(scalar, x + (size_t)i * k, a + (size_t)i * stride, t, k, true);
        float *ref = xmalloc((size_t)m * ld * 4);
        td_cpu_pack_fn_of(scalar, t, true)(wp, 0, 3, 3, k, a, m, ref, ld);
        int differ = 0;
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                cr_assert_eq(memcmp(&y[i * n + j], &ref[i * ld + j], 4), 0, "%s (%d, %d): %g, one-byte scalar %g",
                             td_dtype_name(t), i, j, y[i * n + j], ref[i * ld + j]);
                differ += memcmp(&y2[i * n + j], &ref[i * ld + j], 4) != 0;
            }
        cr_assert(differ > 0, "%s: the default backend's outputs all equal the one-byte ones", td_dtype_name(t));
        q8->ops->free(q8, wp);
        two->ops->free(two, wp2);
        free(w), free(x), free(y), free(y2), free(a), free(ref);
    }
    td_backend_destroy(q8);
    td_backend_destroy(two);
}

/* cpu:staged: the CPU backend whose memory callers must treat as a device's */
Test(backend_open, cpu_staged_is_device_memory)
{
    td_backend_t *be;
    cr_assert_eq(td_backend_open(&(td_device_spec_t){.staged = true}, 1, TD_F32, &be), TD_OK);
    cr_assert(!be->host_memory);
    cr_assert_str_eq(be->ops->name, "cpu");
    td_backend_destroy(be);
    cr_assert_eq(td_backend_open(&(td_device_spec_t){0}, 1, TD_F32, &be), TD_OK);
    cr_assert(be->host_memory);
    td_backend_destroy(be);
}

/* The kernel level a CPU backend runs: each level this CPU has, by name, is what the
 * backend reports; a name that is no level, and a level above this CPU's, are refused
 * with a message that lists what it runs. */
Test(backend_open, cpu_isa_levels)
{
    static const char *const levels[] = {"scalar", "avx2", "avx512", "avx512vnni", "avx512bf16", "amx"};
    const char *isa, *best;
    cr_assert_eq(td_backend_cpu_isa_choose("scalar", &isa, &best), TD_OK);
    size_t n_best = 0;
    while (n_best < TD_ARRAY_LEN(levels) && strcmp(levels[n_best], best))
        n_best++;
    cr_assert_lt(n_best, TD_ARRAY_LEN(levels), "best level %s is one of the six", best);
    for (size_t i = 0; i < TD_ARRAY_LEN(levels); i++) {
        td_backend_t *be = NULL;
        td_status_t st = td_backend_cpu_create(&(td_cpu_config_t){.n_threads = 1, .isa = levels[i]}, &be);
        if (i > n_best) {
            cr_assert_eq(st, TD_ERR_INVALID, "%s above this CPU's %s", levels[i], best);
            cr_assert_null(be);
            cr_assert(strstr(td_last_error(), best), "the message names what the CPU runs: %s", td_last_error());
            continue;
        }
        cr_assert_eq(st, TD_OK, "%s: %s", levels[i], td_last_error());
        cr_assert_str_eq(td_backend_cpu_isa(be), levels[i]);
        td_backend_destroy(be);
    }
    cr_assert_eq(td_backend_cpu_isa_choose("avx3", &isa, &best), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "avx3") && strstr(td_last_error(), "scalar, avx2, avx512, avx512vnni, avx512bf16, amx"),
              "%s", td_last_error());
    cr_assert_null(td_backend_cpu_isa(NULL));
}
