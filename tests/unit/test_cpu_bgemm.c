/*
 * test_cpu_bgemm: cpu:q8's bf16 float matmul (td_cpu_bgemm, issue 32).
 *
 * 1. Rounding: the activation rounding (td_cpu_bgemm_act_row, AVX-512) is td_f32_to_bf16 bit
 *    for bit on random bit patterns and on the edges (ties both ways, NaN of either sign
 *    kept quiet, infinities, the largest float rounding to inf, denormals, -0); the
 *    packing rounds f16 and f32 weights the same way (f16 ties, NaN, inf, subnormals, the
 *    largest f16), keeps bf16 ones, and lays them out as the header says, padding rows 0;
 *    the AVX-512 packing is the plain C one's bits (every f16, f32 edges and random bits).
 * 2. The kernel against a double-precision sum of the bf16-rounded operands' products:
 *    one vdpbf16ps per pair rounds a partial sum at most twice, so an output is within
 *    (k + 2) * 2^-24 * S of it (S = sum |w x| over the rounded values), which the test
 *    allows; every decode tile (m = 1..4), the prefill tile (m >= 5) and its m % 8 tails,
 *    odd group counts (the one-group tail), groups from an offset, strided y. At level amx
 *    too (the tile unit's TDPBF16PS for k % 32 == 0, chunks of 16 rows, pairs of chunks and
 *    the rows past them), where the CPU runs it: the same bound.
 * 3. Batch invariance: every output the same bits whether its row is computed alone, in
 *    any row grouping, and whichever groups a call takes; at amx for both of its orders.
 * 4. Through the backend: cpu:q8 at avx512bf16 or amx packs float weights (the default backend,
 *    cpu:q8 at avx512vnni and an odd k do not), its matmul gives its level's kernel's bits
 *    (TANDEM_CPU_ISA's level when set; a level without the kernel skips 4, saying so)
 *    through the epilogue (bias, accumulate), the same at 1 and 4 threads and row by row;
 *    ops->matmuls of several packed float matrices (one job) gives each one's matmul bits.
 * A CPU without AVX512_BF16 skips 2-4 with a line saying so; one without AMX runs 2-3 at
 * avx512bf16 only.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/td_cpu_bgemm.h"
#include "td_backend.h"
#include "td_dtype.h"
#include "td_rng.h"
#include "td_test_models.h"
#include "td_util.h"

static float uniform(uint64_t *s)
{
    return (float)((double)(td_splitmix64(s) >> 11) * 0x1.0p-52 - 1.0);
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static void *xmalloc(size_t bytes)
{
    void *p = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    cr_assert(p);
    return p;
}

#define SKIP_WITHOUT_BF16()                                                  \
    do {                                                                     \
        if (!td_cpu_bgemm_of(td_cpu_isa_best()))                             \
            cr_skip_test("skipped: this CPU has no AVX512_BF16");            \
    } while (0)

/* Each level with a kernel that this CPU runs: avx512bf16, and amx where it runs */
#define FOR_EACH_LEVEL(isa) \
    for (td_cpu_isa_t isa = TD_CPU_ISA_AVX512_BF16; isa <= td_cpu_isa_best(); isa++)

/* ---- 1. rounding ------------------------------------------------------------------------ */

Test(cpu_bgemm, act_rounding_is_nearest_even)
{
    static const struct {
        uint32_t f;
        uint16_t b;
    } edges[] = {
        {0x3f800000, 0x3f80}, /* 1 */
        {0x3f808000, 0x3f80}, /* 1 + 2^-8: a tie, to the even 1 */
        {0x3f818000, 0x3f82}, /* 1 + 3 * 2^-8: a tie, up to the even */
        {0x3f808001, 0x3f81}, /* just above the tie */
        {0x3f807fff, 0x3f80}, /* just below */
        {0x7f7fffff, 0x7f80}, /* the largest float: inf */
        {0x7f800000, 0x7f80}, {0xff800000, 0xff80}, /* infinities */
        {0x7f800001, 0x7fc0}, /* a signalling NaN, kept a NaN and quiet */
        {0xffc00000, 0xffc0}, {0x7fffffff, 0x7fff},
        {0x00000001, 0x0000}, /* the smallest denormal: to +0 */
        {0x00400000, 0x0040}, /* a denormal bf16 keeps */
        {0x80000000, 0x8000}, /* -0 */
        {0xc0490fdb, 0xc049}, /* -pi */
    };
    const size_t n = 64; /* four vectors' worth plus the scalar tail's none: edges repeat */
    float x[66];
    uint16_t a[66];
    for (size_t i = 0; i < n + 2; i++)
        x[i] = from_bits(edges[i % TD_ARRAY_LEN(edges)].f);
    td_cpu_bgemm_act_row(x, a, n + 2); /* 66: four vectors and a tail of two */
    for (size_t i = 0; i < n + 2; i++) {
        cr_assert_eq(a[i], edges[i % TD_ARRAY_LEN(edges)].b, "0x%08x: 0x%04x, want 0x%04x",
                     edges[i % TD_ARRAY_LEN(edges)].f, a[i], edges[i % TD_ARRAY_LEN(edges)].b);
        cr_assert_eq(a[i], td_f32_to_bf16(x[i]));
    }
    uint64_t s = 32;
    enum { K = 4098 };
    float *r = xmalloc(K * sizeof *r);
    uint16_t *ra = xmalloc(K * sizeof *ra);
    for (int rep = 0; rep < 16; rep++) {
        for (size_t i = 0; i < K; i++)
            r[i] = from_bits((uint32_t)td_splitmix64(&s));
        td_cpu_bgemm_act_row(r, ra, K);
        for (size_t i = 0; i < K; i++)
            cr_assert_eq(ra[i], td_f32_to_bf16(r[i]), "0x%08x: 0x%04x, td_f32_to_bf16 0x%04x", bits(r[i]), ra[i],
                         td_f32_to_bf16(r[i]));
    }
    free(r);
    free(ra);
}

/* The packed element of weight (row, e) in a matrix of k columns. */
static uint16_t packed_at(const uint16_t *wp, size_t k, size_t row, size_t e)
{
    size_t g = row / TD_CPU_BGEMM_ROWS, r = row % TD_CPU_BGEMM_ROWS;
    return wp[g * td_cpu_bgemm_group_bytes(k) / 2 + (e / 2) * 32 + 2 * r + e % 2];
}

Test(cpu_bgemm, pack_rounds_and_lays_out)
{
    /* f16 -> bf16: three mantissa bits go, ties to even */
    static const struct {
        uint16_t h, b;
    } f16s[] = {
        {0x3c00, 0x3f80}, {0x3c01, 0x3f80}, /* 1, 1 + 2^-10 */
        {0x3c04, 0x3f80}, /* 1 + 2^-8: a tie, down to the even */
        {0x3c0c, 0x3f82}, /* 1 + 3 * 2^-8: a tie, up to the even */
        {0x3c05, 0x3f81}, /* above the tie */
        {0x7bff, 0x4780}, /* 65504: up to 65536 */
        {0x7c00, 0x7f80}, {0xfc00, 0xff80}, {0x7e00, 0x7fc0}, /* inf, -inf, NaN */
        {0x0001, 0x3380}, /* 2^-24, a subnormal f16: a normal bf16 */
        {0x8000, 0x8000}, {0xc248, 0xc049}, /* -0, -3.140625 */
    };
    const size_t n = 19, k = 6; /* two groups, the second padded */
    uint16_t *h = xmalloc(n * k * 2), *b = xmalloc(n * k * 2);
    float *f = xmalloc(n * k * 4);
    uint64_t s = 16;
    for (size_t i = 0; i < n * k; i++) {
        h[i] = f16s[i % TD_ARRAY_LEN(f16s)].h;
        f[i] = from_bits((uint32_t)td_splitmix64(&s));
        b[i] = (uint16_t)td_splitmix64(&s);
    }
    f[0] = from_bits(0x3f808000), f[1] = from_bits(0x3f818000), f[2] = from_bits(0x7f7fffff);
    size_t bytes = td_cpu_bgemm_pack_bytes(n, k);
    cr_assert_eq(bytes, 2 * td_cpu_bgemm_group_bytes(k));
    cr_assert_eq(td_cpu_bgemm_group_bytes(k), 16 * k * 2);
    uint16_t *ph = xmalloc(bytes), *pf = xmalloc(bytes), *pb = xmalloc(bytes);
    memset(ph, 0xff, bytes), memset(pf, 0xff, bytes), memset(pb, 0xff, bytes);
    td_cpu_bgemm_pack(ph, h, TD_F16, n, k);
    td_cpu_bgemm_pack(pf, f, TD_F32, n, k);
    td_cpu_bgemm_pack(pb, b, TD_BF16, n, k);
    for (size_t row = 0; row < 32; row++)
        for (size_t e = 0; e < k; e++) {
            size_t i = row * k + e;
            if (row >= n) {
                cr_assert(!packed_at(ph, k, row, e) && !packed_at(pf, k, row, e) && !packed_at(pb, k, row, e),
                          "padding row %zu is 0", row);
                continue;
            }
            cr_assert_eq(packed_at(ph, k, row, e), f16s[i % TD_ARRAY_LEN(f16s)].b, "f16 0x%04x: 0x%04x, want 0x%04x",
                         h[i], packed_at(ph, k, row, e), f16s[i % TD_ARRAY_LEN(f16s)].b);
            cr_assert_eq(packed_at(pf, k, row, e), td_f32_to_bf16(f[i]), "f32 0x%08x at (%zu, %zu)", bits(f[i]), row, e);
            cr_assert_eq(packed_at(pb, k, row, e), b[i], "bf16 kept at (%zu, %zu)", row, e);
        }
    cr_assert_eq(packed_at(pf, k, 0, 0), 0x3f80);
    cr_assert_eq(packed_at(pf, k, 0, 1), 0x3f82);
    cr_assert_eq(packed_at(pf, k, 0, 2), 0x7f80);
    free(h), free(b), free(f), free(ph), free(pf), free(pb);
}

/* The AVX-512 packing against the plain C one, bit for bit: every f16 (all 65536 patterns,
 * NaNs, infinities and subnormals among them), f32 bit patterns at random and at the edges
 * (denormals, which vcvtneps2bf16 would flush, NaNs of both signs, ties, the largest float),
 * bf16 kept; k with and without a tail past the last 32 weights, n with a padded group. */
Test(cpu_bgemm, pack_avx512_is_pack_c, .timeout = 60)
{
    static const uint32_t f32_edges[] = {0x00000001, 0x807fffff, 0x00400000, 0x00008000, 0x00018000, 0x7f800001,
                                         0xff800001, 0x7fffffff, 0x7fc00000, 0x7f800000, 0xff800000, 0x7f7fffff,
                                         0x3f808000, 0x3f818000, 0x80000000, 0x00000000, 0x0001ffff};
    static const struct {
        size_t n, k;
    } shapes[] = {{37, 1774}, {16, 32}, {3, 2}, {33, 64}, {17, 30}, {1, 4098}};
    static const td_dtype_t types[] = {TD_F16, TD_F32, TD_BF16};
    uint64_t s = 77;
    for (size_t si = 0; si < TD_ARRAY_LEN(shapes); si++)
        for (size_t t = 0; t < TD_ARRAY_LEN(types); t++) {
            size_t n = shapes[si].n, k = shapes[si].k, bytes = td_cpu_bgemm_pack_bytes(n, k);
            void *w = xmalloc(td_dtype_bytes(types[t], n * k));
            for (size_t i = 0; i < n * k; i++) {
                uint64_t r = td_splitmix64(&s);
                if (types[t] == TD_F32)
                    ((uint32_t *)w)[i] = r % 4 == 0 ? f32_edges[(r >> 8) % TD_ARRAY_LEN(f32_edges)] : (uint32_t)(r >> 16);
                else /* f16: every pattern in turn (n k >= 65536 in the first shape); bf16 at random */
                    ((uint16_t *)w)[i] = types[t] == TD_F16 ? (uint16_t)i : (uint16_t)r;
            }
            uint16_t *got = xmalloc(bytes), *want = xmalloc(bytes);
            memset(got, 0xa5, bytes), memset(want, 0x5a, bytes);
            td_cpu_bgemm_pack(got, w, types[t], n, k);
            td_cpu_bgemm_pack_c(want, w, types[t], n, k);
            for (size_t i = 0; i < bytes / 2; i++)
                cr_assert_eq(got[i], want[i], "%s n %zu k %zu: packed element %zu 0x%04x, plain C 0x%04x",
                             td_dtype_name(types[t]), n, k, i, got[i], want[i]);
            free(w), free(got), free(want);
        }
}

/* ---- 2, 3. the kernel ------------------------------------------------------------------- */

typedef struct mat {
    size_t n, k;
    void *wp;      /* packed */
    float *wf;     /* [n][k] the bf16-rounded weights as f32 */
} mat_t;

/* n rows of k uniform weights in [-1, 1) stored as `type`, packed. */
static mat_t make_mat(td_dtype_t type, size_t n, size_t k, uint64_t *s, void **stored_p)
{
    mat_t m = {.n = n, .k = k, .wp = xmalloc(td_cpu_bgemm_pack_bytes(n, k)), .wf = xmalloc(n * k * 4)};
    void *w = xmalloc(td_dtype_bytes(type, n * k));
    for (size_t i = 0; i < n * k; i++) {
        float v = uniform(s);
        switch (type) {
        case TD_F32: ((float *)w)[i] = v; break;
        case TD_F16: ((uint16_t *)w)[i] = td_f32_to_f16(v), v = td_f16_to_f32(((uint16_t *)w)[i]); break;
        default: ((uint16_t *)w)[i] = td_f32_to_bf16(v); break;
        }
        m.wf[i] = td_bf16_to_f32(td_f32_to_bf16(v));
    }
    td_cpu_bgemm_pack(m.wp, w, type, n, k);
    if (stored_p)
        *stored_p = w;
    else
        free(w);
    return m;
}

static void free_mat(mat_t *m)
{
    free(m->wp);
    free(m->wf);
}

/* m rows of k activations (scales 2^-4..2^4 a row), their bf16 rows (stride
 * td_cpu_bgemm_act_stride) and those as f32. */
static float *make_x(size_t m, size_t k, uint64_t *s, unsigned char **a_p, float **xr_p)
{
    size_t stride = td_cpu_bgemm_act_stride(k);
    float *x = xmalloc(m * k * 4), *xr = xmalloc(m * k * 4);
    unsigned char *a = xmalloc(m * stride);
    for (size_t i = 0; i < m; i++) {
        float scale = ldexpf(1.0f, (int)(td_splitmix64(s) % 9) - 4);
        for (size_t e = 0; e < k; e++) {
            x[i * k + e] = uniform(s) * scale;
            xr[i * k + e] = td_bf16_to_f32(td_f32_to_bf16(x[i * k + e]));
        }
        td_cpu_bgemm_act_row(x + i * k, (uint16_t *)(void *)(a + i * stride), k);
    }
    *a_p = a;
    *xr_p = xr;
    return x;
}

Test(cpu_bgemm, matches_double_reference, .timeout = 240)
{
    SKIP_WITHOUT_BF16();
    static const td_dtype_t types[] = {TD_F32, TD_F16, TD_BF16};
    static const size_t ks[] = {2, 4, 30, 32, 64, 576, 1002, 2048}; /* amx: k % 32 on the tile unit */
    static const size_t ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 48, 64}; /* amx: chunks of 16, pairs, tails */
    static const size_t ns[] = {1, 16, 17, 40, 70}; /* 1 to 5 groups */
    uint64_t s = 32;
    if (td_cpu_isa_best() < TD_CPU_ISA_AMX)
        cr_log_info("level amx's kernel not run: this CPU's best level is %s (no usable AMX)",
                    td_cpu_isa_name(td_cpu_isa_best()));
    FOR_EACH_LEVEL(isa)
    for (size_t t = 0; t < TD_ARRAY_LEN(types); t++)
        for (size_t ki = 0; ki < TD_ARRAY_LEN(ks); ki++)
            for (size_t ni = 0; ni < TD_ARRAY_LEN(ns); ni++) {
                size_t k = ks[ki], n = ns[ni], groups = (n + 15) / 16;
                mat_t w = make_mat(types[t], n, k, &s, NULL);
                for (size_t mi = 0; mi < TD_ARRAY_LEN(ms); mi++) {
                    size_t m = ms[mi], g0 = groups > 2 ? 1 : 0, ldy = (groups - g0) * 16 + 5;
                    unsigned char *a;
                    float *xr, *x = make_x(m, k, &s, &a, &xr), *y = xmalloc(m * ldy * 4);
                    td_cpu_bgemm_of(isa)(w.wp, g0, groups, groups, k, a, td_cpu_bgemm_act_stride(k), m, y, ldy);
                    for (size_t i = 0; i < m; i++)
                        for (size_t j = g0 * 16; j < n; j++) {
                            double ref = 0, mag = 0;
                            for (size_t e = 0; e < k; e++) {
                                double p = (double)w.wf[j * k + e] * xr[i * k + e];
                                ref += p, mag += fabs(p);
                            }
                            double tol = ((double)k + 2) * 0x1.0p-24 * mag;
                            float got = y[i * ldy + j - g0 * 16];
                            cr_assert(fabs(got - ref) <= tol, "%s %s k %zu m %zu n %zu: y[%zu][%zu] %.9g vs %.9g (tol %.3g)",
                                      td_cpu_isa_name(isa), td_dtype_name(types[t]), k, m, n, i, j, (double)got, ref, tol);
                        }
                    free(x), free(xr), free(a), free(y);
                }
                free_mat(&w);
            }
}

Test(cpu_bgemm, batch_invariant, .timeout = 60)
{
    SKIP_WITHOUT_BF16();
    static const size_t group[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 33, 70};
    static const size_t ks[] = {514, 1024}; /* amx: the vdpbf16ps order, the tile unit's */
    const size_t n = 150, m = 70, groups = 10, ld = groups * 16;
    uint64_t s = 41;
    FOR_EACH_LEVEL(isa)
    for (size_t ki = 0; ki < TD_ARRAY_LEN(ks); ki++) {
        const size_t k = ks[ki];
        td_cpu_bgemm_fn bgemm = td_cpu_bgemm_of(isa);
        mat_t w = make_mat(TD_F16, n, k, &s, NULL);
        unsigned char *a;
        float *xr, *x = make_x(m, k, &s, &a, &xr);
        size_t stride = td_cpu_bgemm_act_stride(k);
        float *whole = xmalloc(m * ld * 4), *part = xmalloc(m * ld * 4);
        bgemm(w.wp, 0, groups, groups, k, a, stride, m, whole, ld);
        for (size_t gi = 0; gi < TD_ARRAY_LEN(group); gi++) {
            memset(part, 0, m * ld * 4);
            size_t split = 1 + gi % (groups - 1); /* groups [0, split) and [split, groups) */
            for (size_t i = 0; i < m; i += group[gi]) {
                size_t mm = TD_MIN(group[gi], m - i);
                bgemm(w.wp, 0, split, split, k, a + i * stride, stride, mm, part + i * ld, ld);
                bgemm(w.wp, split, groups, groups, k, a + i * stride, stride, mm, part + i * ld + split * 16, ld);
            }
            for (size_t i = 0; i < m * ld; i++)
                cr_assert_eq(bits(part[i]), bits(whole[i]),
                             "%s k %zu: rows in groups of %zu, split at group %zu: y[%zu] %.9g vs %.9g",
                             td_cpu_isa_name(isa), k, group[gi], split, i, (double)part[i], (double)whole[i]);
        }
        free(whole), free(part), free(x), free(xr), free(a);
        free_mat(&w);
    }
}

/* ---- 4. through the backend ------------------------------------------------------------- */

/* The kernel of the level a backend made with no isa named runs (TANDEM_CPU_ISA, else the
 * CPU's best): the bits its matmul must give. Skips when that level has none. */
static td_cpu_bgemm_fn backend_bgemm(void)
{
    td_cpu_isa_t isa;
    cr_assert_eq(td_cpu_isa_choose(NULL, &isa), TD_OK, "%s", td_last_error());
    td_cpu_bgemm_fn fn = td_cpu_bgemm_of(isa);
    if (!fn)
        cr_skip_test("skipped: the CPU backend's level %s has no bf16 matmul (avx512bf16 and above)",
                     td_cpu_isa_name(isa));
    return fn;
}

static td_backend_t *q8_backend(int threads, const char *isa)
{
    td_backend_t *be = NULL;
    td_cpu_config_t cc = {.n_threads = threads, .act_one_byte = true, .isa = isa};
    cr_assert_eq(td_backend_cpu_create(&cc, &be), TD_OK, "%s", td_last_error());
    return be;
}

Test(cpu_bgemm, backend_packs_in_q8_only, .timeout = 120)
{
    td_cpu_bgemm_fn bgemm = backend_bgemm();
    const int n = 70, k = 256, m = 70; /* k % 32 == 0: at amx the tile unit's kernel */
    uint64_t s = 4;
    void *stored;
    mat_t w = make_mat(TD_F16, (size_t)n, (size_t)k, &s, &stored);
    td_backend_t *q8 = q8_backend(1, NULL), *q8_4 = q8_backend(4, NULL), *vnni = q8_backend(1, "avx512vnni"), *def = NULL;
    const char *q8_isa = td_backend_cpu_isa(q8); /* avx512bf16, or amx above it */
    cr_assert(!strcmp(q8_isa, "avx512bf16") || !strcmp(q8_isa, "amx"), "%s", q8_isa);
    cr_assert_eq(td_backend_cpu_create(&(td_cpu_config_t){.n_threads = 1}, &def), TD_OK);
    void *wp = NULL, *none = (void *)1;
    cr_assert_eq(def->ops->weight_pack(def, stored, TD_F16, n, k, &none), TD_OK);
    cr_assert_null(none, "the default backend keeps float weights as stored");
    none = (void *)1;
    cr_assert_eq(vnni->ops->weight_pack(vnni, stored, TD_F16, n, k, &none), TD_OK);
    cr_assert_null(none, "cpu:q8 below avx512bf16 keeps float weights as stored");
    none = (void *)1;
    cr_assert_eq(q8->ops->weight_pack(q8, stored, TD_F16, n, k - 1, &none), TD_OK);
    cr_assert_null(none, "an odd k stays as stored");
    cr_assert_eq(q8->ops->weight_pack(q8, stored, TD_F16, n, k, &wp), TD_OK);
    cr_assert_not_null(wp);
    cr_assert_eq(memcmp(wp, w.wp, td_cpu_bgemm_pack_bytes((size_t)n, (size_t)k)), 0, "the backend's packing is td_cpu_bgemm_pack's");

    unsigned char *a;
    float *xr, *x = make_x((size_t)m, (size_t)k, &s, &a, &xr);
    float *bias = xmalloc((size_t)n * 4), *y0 = xmalloc((size_t)m * n * 4);
    for (int j = 0; j < n; j++)
        bias[j] = uniform(&s);
    for (int i = 0; i < m * n; i++)
        y0[i] = uniform(&s);
    const int ld = 80;
    float *ref = xmalloc((size_t)m * ld * 4), *y = xmalloc((size_t)m * n * 4), *y4 = xmalloc((size_t)m * n * 4);
    bgemm(w.wp, 0, 5, 5, (size_t)k, a, td_cpu_bgemm_act_stride((size_t)k), (size_t)m, ref, ld);
    for (int f = 0; f < 3; f++) { /* plain, bias, accumulate */
        memcpy(y, y0, (size_t)m * n * 4);
        memcpy(y4, y0, (size_t)m * n * 4);
        td_matmul_params_t p = {.m = m, .n = n, .k = k, .x = x, .w = wp, .w_dtype = TD_F16, .w_packed = true,
                                .bias = f == 1 ? bias : NULL, .bias_dtype = TD_F32, .accumulate = f == 2, .y = y};
        cr_assert_eq(q8->ops->matmul(q8, &p), TD_OK);
        p.y = y4;
        cr_assert_eq(q8_4->ops->matmul(q8_4, &p), TD_OK);
        cr_assert_eq(memcmp(y, y4, (size_t)m * n * 4), 0, "1 and 4 threads differ (epilogue %d)", f);
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                float want = ref[i * ld + j];
                if (f == 1)
                    want += bias[j];
                if (f == 2)
                    want += y0[i * n + j];
                cr_assert_eq(bits(y[i * n + j]), bits(want), "epilogue %d (%d, %d): %.9g, kernel %.9g", f, i, j,
                             (double)y[i * n + j], (double)want);
            }
        for (int i = 0; i < m; i++) { /* row by row, as decode steps */
            float row[70];
            memcpy(row, y0 + (size_t)i * n, sizeof row);
            td_matmul_params_t one = p;
            one.m = 1, one.x = x + (size_t)i * k, one.y = row;
            cr_assert_eq(q8_4->ops->matmul(q8_4, &one), TD_OK);
            cr_assert_eq(memcmp(row, y + (size_t)i * n, sizeof row), 0, "epilogue %d: row %d alone differs", f, i);
        }
    }
    q8->ops->free(q8, wp);
    td_backend_destroy(q8), td_backend_destroy(q8_4), td_backend_destroy(vnni), td_backend_destroy(def);
    free(stored), free(x), free(xr), free(a), free(bias), free(y0), free(ref), free(y), free(y4);
    free_mat(&w);
}

/*
 * ops->matmuls with packed float matrices (Q, K, V or gate, up in cpu:q8): one job, X rounded
 * once, gives each matrix the bits of its own matmul call and of the kernel over all its
 * groups through the epilogue: three types (f16, bf16, f32),
 * a bias and an accumulating output among them, decode and prefill row counts, 1, 2 and 4
 * threads; and with a matrix left as stored among them (each then its own call).
 */
Test(cpu_bgemm, matmuls_equal_matmul_calls, .timeout = 120)
{
    td_cpu_bgemm_fn bgemm = backend_bgemm();
    static const int threads[] = {1, 2, 4}, ms[] = {1, 3, 5, 70};
    static const td_dtype_t types[3] = {TD_F16, TD_BF16, TD_F32};
    const int ns[3] = {300, 64, 48}; /* a prefill task is a block of 6 or 8 groups: tasks span two matrices */
    uint64_t s = 91;
    for (size_t ti = 0; ti < TD_ARRAY_LEN(threads); ti++)
        for (int stored = 0; stored < 2; stored++) { /* stored: the third matrix not packed */
            const int k = stored ? 2050 : 2048;      /* amx: the vdpbf16ps kernel, the tile unit's */
            td_backend_t *be = q8_backend(threads[ti], NULL);
            float *x = xmalloc((size_t)70 * k * 4), *bias = xmalloc((size_t)ns[0] * 4);
            for (int i = 0; i < 70 * k; i++)
                x[i] = uniform(&s);
            for (int j = 0; j < ns[0]; j++)
                bias[j] = uniform(&s);
            void *w[3], *wp[3] = {NULL, NULL, NULL};
            for (int i = 0; i < 3; i++) {
                mat_t mm = make_mat(types[i], (size_t)ns[i], (size_t)k, &s, &w[i]);
                free_mat(&mm);
                if (!(stored && i == 2)) {
                    cr_assert_eq(be->ops->weight_pack(be, w[i], types[i], ns[i], k, &wp[i]), TD_OK);
                    cr_assert_not_null(wp[i]);
                }
            }
            for (size_t a = 0; a < TD_ARRAY_LEN(ms); a++) {
                const int m = ms[a];
                td_matmul_params_t ps[3];
                float *y[3], *want[3], *y0[3];
                for (int i = 0; i < 3; i++) {
                    y[i] = xmalloc((size_t)m * ns[i] * 4);
                    want[i] = xmalloc((size_t)m * ns[i] * 4);
                    y0[i] = xmalloc((size_t)m * ns[i] * 4);
                    for (int e = 0; e < m * ns[i]; e++)
                        y[i][e] = uniform(&s); /* accumulated into by [1] */
                    memcpy(want[i], y[i], (size_t)m * ns[i] * 4);
                    memcpy(y0[i], y[i], (size_t)m * ns[i] * 4);
                    ps[i] = (td_matmul_params_t){.m = m, .n = ns[i], .k = k, .x = x, .w = wp[i] ? wp[i] : w[i],
                                                 .w_packed = wp[i] != NULL, .w_dtype = types[i],
                                                 .bias = i == 0 ? bias : NULL, .bias_dtype = TD_F32,
                                                 .accumulate = i == 1};
                }
                td_test_matmuls_and_calls(be, ps, 3, y, want);
                /* and the kernel's bits over all the groups through the epilogue, so that a
                   group both calls skip, or take from the wrong matrix, fails too */
                size_t stride = td_cpu_bgemm_act_stride((size_t)k);
                unsigned char *act = xmalloc((size_t)m * stride);
                for (int r = 0; r < m; r++)
                    td_cpu_bgemm_act_row(x + (size_t)r * k, (uint16_t *)(void *)(act + (size_t)r * stride), (size_t)k);
                for (int i = 0; i < 2 + !stored; i++) {
                    size_t groups = ((size_t)ns[i] + 15) / 16, ld = groups * 16;
                    float *kern = xmalloc((size_t)m * ld * 4);
                    bgemm(wp[i], 0, groups, groups, (size_t)k, act, stride, (size_t)m, kern, ld);
                    for (int r = 0; r < m; r++)
                        for (int j = 0; j < ns[i]; j++) {
                            float kv = kern[(size_t)r * ld + (size_t)j];
                            kv = i == 0 ? kv + bias[j] : i == 1 ? kv + y0[i][r * ns[i] + j] : kv;
                            cr_assert_eq(bits(y[i][r * ns[i] + j]), bits(kv),
                                         "matmuls: matrix %d at m %d, %d threads: y[%d][%d] %.9g, the kernel's %.9g", i,
                                         m, threads[ti], r, j, (double)y[i][r * ns[i] + j], (double)kv);
                        }
                    free(kern);
                }
                free(act);
                for (int i = 0; i < 3; i++) {
                    for (int e = 0; e < m * ns[i]; e++)
                        cr_assert_eq(bits(y[i][e]), bits(want[i][e]),
                                     "matmuls: matrix %d (%s, n %d) at m %d, %d threads, third stored %d: y[%d] %.9g, "
                                     "its matmul %.9g", i, td_dtype_name(types[i]), ns[i], m, threads[ti], stored, e,
                                     (double)y[i][e], (double)want[i][e]);
                    free(y[i]), free(want[i]), free(y0[i]);
                }
            }
            td_test_matmuls_free(be, w, wp, 3);
            free(x), free(bias);
            td_backend_destroy(be);
        }
}
