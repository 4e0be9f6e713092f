/*
 * test_backend_ops: every op of the CUDA backend against the same op of the CPU backend
 * (the reference), in the manner of ggml's test-backend-ops: random inputs (never zeros),
 * outputs poisoned with NaN before the run, normalised mean squared error
 * sum((gpu - cpu)^2) / sum(cpu^2) under a per-dtype bound, any NaN/inf a failure.
 *
 * Inputs are rounded to the GPU's dtype first and the CPU gets the same values (in f32
 * where it does not take that dtype), so the error measured is the GPU's own rounding.
 * Shapes: the small shapes of the CPU kernel tests, llama-like shapes, GQA groups up to 16,
 * ragged batches, chunked prefill against a cached prefix and contexts up to 32k tokens.
 *
 * CUDA is touched only inside each test (Criterion forks them), never at load time. Without
 * a device every test skips with "skipped: no CUDA device"; built without CUDA, "skipped:
 * built without CUDA".
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_backend.h"
#include "td_dtype.h"
#include "td_util.h"

typedef struct td_pair {
    td_backend_t *cpu, *gpu;
    td_dtype_t act; /* the GPU's activation dtype (the CPU's is f32) */
} td_pair_t;

static const td_dtype_t td_all_dtypes[] = {TD_F32, TD_F16, TD_BF16};

static td_pair_t td_open(td_dtype_t act)
{
    td_pair_t p = {NULL, NULL, act};
    if (!td_backend_cuda_compiled())
        cr_skip_test("skipped: built without CUDA");
    td_cuda_config_t gc = {0, act};
    td_status_t st = td_backend_cuda_create(&gc, &p.gpu);
    if (st == TD_ERR_UNSUPPORTED) /* the reason says which: no GPU, or a driver too old for the runtime */
        cr_skip_test("skipped: no CUDA device (%s)", td_last_error());
    cr_assert_eq(st, TD_OK, "cuda backend: %s", td_last_error());
    td_cpu_config_t cc = {0};
    st = td_backend_cpu_create(&cc, &p.cpu);
    cr_assert_eq(st, TD_OK, "cpu backend: %s", td_last_error());
    cr_assert_eq(p.cpu->act_dtype, TD_F32);
    return p;
}

static void td_close(td_pair_t *p)
{
    td_backend_destroy(p->gpu);
    td_backend_destroy(p->cpu);
}

/* ---- data helpers ---------------------------------------------------------------------- */

static uint64_t td_rng_state = 0x9E3779B97F4A7C15ull;

/* uniform in [-scale, -scale/16] U [scale/16, scale]: never zero, never tiny */
static float td_rand(float scale)
{
    td_rng_state ^= td_rng_state << 13;
    td_rng_state ^= td_rng_state >> 7;
    td_rng_state ^= td_rng_state << 17;
    float u = (float)((td_rng_state >> 40) & 0xFFFFFF) / 16777216.0f; /* [0, 1) */
    float mag = scale * (0.0625f + 0.9375f * u);
    return (td_rng_state & 1) ? mag : -mag;
}

static int32_t td_rand_int(int32_t n)
{
    td_rand(1.0f);
    return (int32_t)((td_rng_state >> 16) % (uint64_t)n);
}

/* n random values already representable in dtype t */
static float *td_rand_vec(size_t n, float scale, td_dtype_t t)
{
    float *x = malloc(n * sizeof(float) + 1);
    void *tmp = malloc(n * 4 + 1);
    cr_assert(x && tmp);
    for (size_t i = 0; i < n; i++)
        x[i] = td_rand(scale);
    td_dtype_convert(tmp, t, x, TD_F32, n);
    td_dtype_convert(x, TD_F32, tmp, t, n);
    free(tmp);
    return x;
}

/* device copy of host f32 values stored as dtype t */
static void *td_up(td_backend_t *be, const float *x, size_t n, td_dtype_t t)
{
    size_t bytes = n * td_dtype_size(t);
    void *tmp = malloc(bytes + 1), *d = NULL;
    cr_assert(tmp);
    td_dtype_convert(tmp, t, x, TD_F32, n);
    cr_assert_eq(be->ops->alloc(be, bytes, &d), TD_OK, "%s alloc: %s", be->ops->name, td_last_error());
    cr_assert_eq(be->ops->copy_h2d(be, d, tmp, bytes), TD_OK, "%s", td_last_error());
    cr_assert_eq(be->ops->sync(be), TD_OK, "%s", td_last_error());
    free(tmp);
    return d;
}

/* host f32 copy of n device elements of dtype t (caller frees) */
static float *td_down(td_backend_t *be, const void *d, size_t n, td_dtype_t t)
{
    size_t bytes = n * td_dtype_size(t);
    void *tmp = malloc(bytes + 1);
    float *x = malloc(n * sizeof(float) + 1);
    cr_assert(tmp && x);
    cr_assert_eq(be->ops->sync(be), TD_OK, "%s: %s", be->ops->name, td_last_error());
    cr_assert_eq(be->ops->copy_d2h(be, tmp, d, bytes), TD_OK, "%s", td_last_error());
    td_dtype_convert(x, TD_F32, tmp, t, n);
    free(tmp);
    return x;
}

/* fills a device buffer with 0xFF bytes: NaN in f32, f16 and bf16 */
static void td_poison(td_backend_t *be, void *d, size_t bytes)
{
    void *tmp = malloc(bytes + 1);
    cr_assert(tmp);
    memset(tmp, 0xFF, bytes);
    /* copy_h2d is not ordered after queued ops: none may still use d */
    cr_assert_eq(be->ops->sync(be), TD_OK, "%s", td_last_error());
    cr_assert_eq(be->ops->copy_h2d(be, d, tmp, bytes), TD_OK, "%s", td_last_error());
    free(tmp);
}

static double td_tol(td_dtype_t t)
{
    return t == TD_F32 ? 1e-7 : t == TD_F16 ? 1e-5 : 1e-4;
}

/* normalised MSE of got against want; fails the test on NaN/inf or above tol */
static void td_check(const char *what, const float *got, const float *want, size_t n, double tol)
{
    double err = 0.0, ref = 0.0;
    for (size_t i = 0; i < n; i++) {
        cr_assert(isfinite(got[i]) && isfinite(want[i]),
                  "%s: element %zu not finite (gpu %g, cpu %g): unwritten or overflowed", what, i,
                  got[i], want[i]);
        double d = (double)got[i] - want[i];
        err += d * d;
        ref += (double)want[i] * want[i];
    }
    double nmse = ref > 0 ? err / ref : err;
    cr_assert(nmse <= tol, "%s: nmse %.3g > %.3g (n %zu)", what, nmse, tol, n);
}

/* a CPU-side dtype the CPU accepts for values stored as t on the GPU */
static td_dtype_t td_cpu_dtype(uint32_t mask, td_dtype_t t)
{
    return (mask & (1u << t)) ? t : TD_F32;
}

/* ---- step metadata ----------------------------------------------------------------------- */

typedef struct td_test_step {
    td_step_meta_t m;
    int32_t *tokens, *positions, *slots, *seq_start, *seq_len, *bt;
    int32_t n_blocks; /* pool blocks the tables use (all distinct, shuffled) */
} td_test_step_t;

/* seqs with q_len[s] new rows and ctx[s] tokens of context after the step */
static void td_step_make(td_test_step_t *s, int32_t n_seqs, const int32_t *q_len,
                         const int32_t *ctx, int32_t bs, int32_t vocab)
{
    memset(s, 0, sizeof(*s));
    int32_t n_tok = 0, max_blocks = 1, max_q = 0, max_ctx = 0, total_blocks = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        cr_assert(q_len[i] >= 1 && q_len[i] <= ctx[i]);
        n_tok += q_len[i];
        int32_t nb = TD_DIV_CEIL(ctx[i], bs);
        max_blocks = TD_MAX(max_blocks, nb);
        total_blocks += nb;
        max_q = TD_MAX(max_q, q_len[i]);
        max_ctx = TD_MAX(max_ctx, ctx[i]);
    }
    s->n_blocks = total_blocks + 3;
    int32_t *perm = malloc(sizeof(int32_t) * s->n_blocks);
    for (int32_t i = 0; i < s->n_blocks; i++)
        perm[i] = i;
    for (int32_t i = s->n_blocks - 1; i > 0; i--) {
        int32_t j = td_rand_int(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    s->tokens = malloc(sizeof(int32_t) * n_tok);
    s->positions = malloc(sizeof(int32_t) * n_tok);
    s->slots = malloc(sizeof(int32_t) * n_tok);
    s->seq_start = malloc(sizeof(int32_t) * (n_seqs + 1));
    s->seq_len = malloc(sizeof(int32_t) * n_seqs);
    s->bt = calloc((size_t)n_seqs * max_blocks, sizeof(int32_t));
    int32_t row = 0, next = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        int32_t nb = TD_DIV_CEIL(ctx[i], bs);
        for (int32_t b = 0; b < nb; b++)
            s->bt[i * max_blocks + b] = perm[next++];
        s->seq_start[i] = row;
        s->seq_len[i] = ctx[i];
        for (int32_t r = 0; r < q_len[i]; r++, row++) {
            int32_t pos = ctx[i] - q_len[i] + r;
            s->tokens[row] = td_rand_int(vocab);
            s->positions[row] = pos;
            s->slots[row] = s->bt[i * max_blocks + pos / bs] * bs + pos % bs;
        }
    }
    s->seq_start[n_seqs] = row;
    free(perm);
    s->m = (td_step_meta_t){.n_tokens = n_tok, .n_seqs = n_seqs, .tokens = s->tokens,
                            .positions = s->positions, .slots = s->slots,
                            .seq_start = s->seq_start, .seq_len = s->seq_len,
                            .block_tables = s->bt, .max_blocks = max_blocks,
                            .max_q_len = max_q, .max_seq_len = max_ctx};
}

static void td_step_free(td_test_step_t *s)
{
    free(s->tokens);
    free(s->positions);
    free(s->slots);
    free(s->seq_start);
    free(s->seq_len);
    free(s->bt);
}

static void td_step_set(td_pair_t *p, const td_test_step_t *s)
{
    cr_assert_eq(p->cpu->ops->set_step(p->cpu, &s->m), TD_OK, "%s", td_last_error());
    cr_assert_eq(p->gpu->ops->set_step(p->gpu, &s->m), TD_OK, "%s", td_last_error());
}

#define TD_OK_OR_FAIL(be, call) cr_assert_eq((call), TD_OK, "%s: %s", (be)->ops->name, td_last_error())

/* ---- embed ---------------------------------------------------------------------------------- */

/* A CUDA build loads its backend module (libtandem-cuda.so, beside this test) on first use.
 * Whatever the machine, the answer must come from inside the module (a backend, or "no
 * usable CUDA device" where there is no GPU), not from the loading: a module missing, built
 * with a symbol nothing defines, or of another interface version. */
Test(backend_ops, cuda_module_loads)
{
    if (!td_backend_cuda_compiled())
        cr_skip_test("skipped: built without CUDA");
    td_backend_t *be = NULL;
    td_status_t st = td_backend_cuda_create(&(td_cuda_config_t){0, TD_BF16}, &be);
    if (st == TD_OK) {
        td_backend_destroy(be);
        return;
    }
    cr_assert_eq(st, TD_ERR_UNSUPPORTED, "%s", td_last_error());
    cr_assert(!strstr(td_last_error(), "libtandem-cuda.so") && !strncmp(td_last_error(), "cuda: ", 6),
              "the CUDA module did not load: %s", td_last_error());
}

Test(backend_ops, embed, .timeout = 120)
{
    for (int a = 0; a < 3; a++) {
        td_pair_t p = td_open(td_all_dtypes[a]);
        for (int w = 0; w < 3; w++) {
            td_dtype_t wt = td_all_dtypes[w];
            int32_t vocab = 517, dim = 288, q[] = {5, 1, 33}, ctx[] = {5, 9, 40};
            td_test_step_t s;
            td_step_make(&s, 3, q, ctx, 16, vocab);
            td_step_set(&p, &s);
            float *table = td_rand_vec((size_t)vocab * dim, 1.0f, wt);
            td_dtype_t cwt = td_cpu_dtype(p.cpu->weight_dtypes, wt);
            void *tc = td_up(p.cpu, table, (size_t)vocab * dim, cwt);
            void *tg = td_up(p.gpu, table, (size_t)vocab * dim, wt);
            size_t n = (size_t)s.m.n_tokens * dim;
            void *xc = NULL, *xg = NULL;
            TD_OK_OR_FAIL(p.cpu, p.cpu->ops->alloc(p.cpu, n * 4, &xc));
            TD_OK_OR_FAIL(p.gpu, p.gpu->ops->alloc(p.gpu, n * td_dtype_size(p.act), &xg));
            td_poison(p.gpu, xg, n * td_dtype_size(p.act));
            TD_OK_OR_FAIL(p.cpu, p.cpu->ops->embed(p.cpu, xc, tc, cwt, dim));
            TD_OK_OR_FAIL(p.gpu, p.gpu->ops->embed(p.gpu, xg, tg, wt, dim));
            float *want = td_down(p.cpu, xc, n, TD_F32), *got = td_down(p.gpu, xg, n, p.act);
            td_check("embed", got, want, n, td_tol(p.act));
            free(want); free(got); free(table);
            p.cpu->ops->free(p.cpu, tc); p.cpu->ops->free(p.cpu, xc);
            p.gpu->ops->free(p.gpu, tg); p.gpu->ops->free(p.gpu, xg);
            td_step_free(&s);
        }
        td_close(&p);
    }
}

/* ---- rmsnorm (+ residual) ------------------------------------------------------------------ */

Test(backend_ops, rmsnorm, .timeout = 120)
{
    static const int32_t shapes[][2] = {{1, 64}, {7, 288}, {33, 4096}, {5, 100}};
    for (int a = 0; a < 3; a++) {
        td_pair_t p = td_open(td_all_dtypes[a]);
        size_t es = td_dtype_size(p.act);
        for (size_t si = 0; si < TD_ARRAY_LEN(shapes); si++) {
            for (int w = 0; w < 3; w++) {
                for (int with_res = 0; with_res < 2; with_res++) {
                    td_dtype_t wt = td_all_dtypes[w], cwt = td_cpu_dtype(p.cpu->weight_dtypes, wt);
                    int32_t rows = shapes[si][0], dim = shapes[si][1];
                    size_t n = (size_t)rows * dim;
                    float *x = td_rand_vec(n, 2.0f, p.act), *r = td_rand_vec(n, 2.0f, p.act);
                    float *wv = td_rand_vec(dim, 1.0f, wt);
                    void *xc = td_up(p.cpu, x, n, TD_F32), *xg = td_up(p.gpu, x, n, p.act);
                    void *rc = td_up(p.cpu, r, n, TD_F32), *rg = td_up(p.gpu, r, n, p.act);
                    void *wc = td_up(p.cpu, wv, dim, cwt), *wg = td_up(p.gpu, wv, dim, wt);
                    void *oc = NULL, *og = NULL;
                    TD_OK_OR_FAIL(p.cpu, p.cpu->ops->alloc(p.cpu, n * 4, &oc));
                    TD_OK_OR_FAIL(p.gpu, p.gpu->ops->alloc(p.gpu, n * es, &og));
                    td_poison(p.gpu, og, n * es);
                    TD_OK_OR_FAIL(p.cpu, p.cpu->ops->rmsnorm(p.cpu, oc, xc, with_res ? rc : NULL, wc,
                                                             cwt, rows, dim, 1e-5f));
                    TD_OK_OR_FAIL(p.gpu, p.gpu->ops->rmsnorm(p.gpu, og, xg, with_res ? rg : NULL, wg,
                                                             wt, rows, dim, 1e-5f));
                    float *want = td_down(p.cpu, oc, n, TD_F32), *got = td_down(p.gpu, og, n, p.act);
                    td_check("rmsnorm out", got, want, n, td_tol(p.act));
                    free(want); free(got);
                    if (with_res) {
                        want = td_down(p.cpu, rc, n, TD_F32);
                        got = td_down(p.gpu, rg, n, p.act);
                        td_check("rmsnorm residual", got, want, n, td_tol(p.act));
                        free(want); free(got);
                    }
                    free(x); free(r); free(wv);
                    p.cpu->ops->free(p.cpu, xc); p.cpu->ops->free(p.cpu, rc);
                    p.cpu->ops->free(p.cpu, wc); p.cpu->ops->free(p.cpu, oc);
                    p.gpu->ops->free(p.gpu, xg); p.gpu->ops->free(p.gpu, rg);
                    p.gpu->ops->free(p.gpu, wg); p.gpu->ops->free(p.gpu, og);
                }
            }
        }
        td_close(&p);
    }
}

/* ---- matmul --------------------------------------------------------------------------------- */

static void td_check_matmul(td_pair_t *p, int32_t m, int32_t n, int32_t k, td_dtype_t wt,
                            bool bias, bool accumulate, bool y_f32)
{
    td_dtype_t cwt = td_cpu_dtype(p->cpu->weight_dtypes, wt);
    td_dtype_t yt = y_f32 ? TD_F32 : p->act;
    float *x = td_rand_vec((size_t)m * k, 1.0f, p->act);
    float *w = td_rand_vec((size_t)n * k, 0.1f, wt);
    float *b = td_rand_vec(n, 1.0f, wt);
    float *y0 = td_rand_vec((size_t)m * n, 1.0f, yt);
    void *xc = td_up(p->cpu, x, (size_t)m * k, TD_F32), *xg = td_up(p->gpu, x, (size_t)m * k, p->act);
    void *wc = td_up(p->cpu, w, (size_t)n * k, cwt), *wg = td_up(p->gpu, w, (size_t)n * k, wt);
    void *bc = td_up(p->cpu, b, n, cwt), *bg = td_up(p->gpu, b, n, wt);
    void *yc = td_up(p->cpu, y0, (size_t)m * n, TD_F32), *yg = td_up(p->gpu, y0, (size_t)m * n, yt);
    if (!accumulate)
        td_poison(p->gpu, yg, (size_t)m * n * td_dtype_size(yt));
    td_matmul_params_t mc = {.m = m, .n = n, .k = k, .x = xc, .w = wc, .w_dtype = cwt,
                             .bias = bias ? bc : NULL, .bias_dtype = cwt, .y = yc, .y_f32 = y_f32,
                             .accumulate = accumulate};
    td_matmul_params_t mg = mc;
    mg.x = xg; mg.w = wg; mg.w_dtype = wt; mg.bias = bias ? bg : NULL; mg.bias_dtype = wt; mg.y = yg;
    TD_OK_OR_FAIL(p->cpu, p->cpu->ops->matmul(p->cpu, &mc));
    TD_OK_OR_FAIL(p->gpu, p->gpu->ops->matmul(p->gpu, &mg));
    float *want = td_down(p->cpu, yc, (size_t)m * n, TD_F32);
    float *got = td_down(p->gpu, yg, (size_t)m * n, yt);
    char what[160];
    snprintf(what, sizeof(what), "matmul m %d n %d k %d act %s w %s bias %d acc %d y_f32 %d", m, n,
             k, td_dtype_name(p->act), td_dtype_name(wt), bias, accumulate, y_f32);
    /* fp32 output of 16-bit operands is as exact as fp32 accumulation */
    td_check(what, got, want, (size_t)m * n, td_tol(yt == TD_F32 ? TD_F32 : p->act) * 10);
    free(want); free(got); free(x); free(w); free(b); free(y0);
    p->cpu->ops->free(p->cpu, xc); p->cpu->ops->free(p->cpu, wc);
    p->cpu->ops->free(p->cpu, bc); p->cpu->ops->free(p->cpu, yc);
    p->gpu->ops->free(p->gpu, xg); p->gpu->ops->free(p->gpu, wg);
    p->gpu->ops->free(p->gpu, bg); p->gpu->ops->free(p->gpu, yg);
}

Test(backend_ops, matmul, .timeout = 300)
{
    static const int32_t shapes[][3] = {{1, 32, 64}, {7, 288, 288}, {33, 512, 768}, {64, 1000, 256},
                                        {3, 4096, 4096}, {130, 768, 96}};
    for (int a = 0; a < 3; a++) {
        td_pair_t p = td_open(td_all_dtypes[a]);
        for (size_t si = 0; si < TD_ARRAY_LEN(shapes); si++)
            for (int w = 0; w < 3; w++)
                td_check_matmul(&p, shapes[si][0], shapes[si][1], shapes[si][2], td_all_dtypes[w],
                                false, false, false);
        /* bias, the residual accumulate and f32 logits, on one shape per weight dtype */
        for (int w = 0; w < 3; w++) {
            td_check_matmul(&p, 9, 320, 128, td_all_dtypes[w], true, false, false);
            td_check_matmul(&p, 9, 320, 128, td_all_dtypes[w], false, true, false);
            td_check_matmul(&p, 9, 320, 128, td_all_dtypes[w], true, true, false);
            td_check_matmul(&p, 9, 320, 128, td_all_dtypes[w], false, false, true);
        }
        td_close(&p);
    }
}

/* ---- swiglu, gather_rows, moe_combine --------------------------------------------------------------------- */

Test(backend_ops, swiglu, .timeout = 120)
{
    for (int a = 0; a < 3; a++) {
        td_pair_t p = td_open(td_all_dtypes[a]);
        int32_t rows = 13, hidden = 1000;
        size_t n = (size_t)rows * hidden, es = td_dtype_size(p.act);
        float *g = td_rand_vec(n, 4.0f, p.act), *u = td_rand_vec(n, 2.0f, p.act);
        void *gc = td_up(p.cpu, g, n, TD_F32), *gg = td_up(p.gpu, g, n, p.act);
        void *uc = td_up(p.cpu, u, n, TD_F32), *ug = td_up(p.gpu, u, n, p.act);
        void *oc = NULL, *og = NULL;
        TD_OK_OR_FAIL(p.cpu, p.cpu->ops->alloc(p.cpu, n * 4, &oc));
        TD_OK_OR_FAIL(p.gpu, p.gpu->ops->alloc(p.gpu, n * es, &og));
        td_poison(p.gpu, og, n * es);
        TD_OK_OR_FAIL(p.cpu, p.cpu->ops->swiglu(p.cpu, oc, gc, uc, rows, hidden));
        TD_OK_OR_FAIL(p.gpu, p.gpu->ops->swiglu(p.gpu, og, gg, ug, rows, hidden));
        float *want = td_down(p.cpu, oc, n, TD_F32), *got = td_down(p.gpu, og, n, p.act);
        td_check("swiglu", got, want, n, td_tol(p.act));
        free(want); free(got);
        /* in place: out == gate */
        TD_OK_OR_FAIL(p.cpu, p.cpu->ops->swiglu(p.cpu, gc, gc, uc, rows, hidden));
        TD_OK_OR_FAIL(p.gpu, p.gpu->ops->swiglu(p.gpu, gg, gg, ug, rows, hidden));
        want = td_down(p.cpu, gc, n, TD_F32);
        got = td_down(p.gpu, gg, n, p.act);
        td_check("swiglu in place", got, want, n, td_tol(p.act));
        free(want); free(got); free(g); free(u);
        p.cpu->ops->free(p.cpu, gc); p.cpu->ops->free(p.cpu, uc); p.cpu->ops->free(p.cpu, oc);
        p.gpu->ops->free(p.gpu, gg); p.gpu->ops->free(p.gpu, ug); p.gpu->ops->free(p.gpu, og);
        td_close(&p);
    }
}

Test(backend_ops, gather_rows, .timeout = 120)
{
    for (int a = 0; a < 3; a++) {
        td_pair_t p = td_open(td_all_dtypes[a]);
        int32_t rows = 50, dim = 333, pick[] = {49, 0, 7, 7, 23};
        int32_t n = (int32_t)TD_ARRAY_LEN(pick);
        size_t es = td_dtype_size(p.act);
        float *x = td_rand_vec((size_t)rows * dim, 1.0f, p.act);
        void *xc = td_up(p.cpu, x, (size_t)rows * dim, TD_F32), *xg = td_up(p.gpu, x, (size_t)rows * dim, p.act);
        void *oc = NULL, *og = NULL;
        TD_OK_OR_FAIL(p.cpu, p.cpu->ops->alloc(p.cpu, (size_t)n * dim * 4, &oc));
        TD_OK_OR_FAIL(p.gpu, p.gpu->ops->alloc(p.gpu, (size_t)n * dim * es, &og));
        td_poison(p.gpu, og, (size_t)n * dim * es);
        TD_OK_OR_FAIL(p.cpu, p.cpu->ops->gather_rows(p.cpu, oc, xc, pick, n, dim));
        TD_OK_OR_FAIL(p.gpu, p.gpu->ops->gather_rows(p.gpu, og, xg, pick, n, dim));
        float *want = td_down(p.cpu, oc, (size_t)n * dim, TD_F32);
        float *got = td_down(p.gpu, og, (size_t)n * dim, p.act);
        td_check("gather_rows", got, want, (size_t)n * dim, 0.0);
        free(want); free(got); free(x);
        p.cpu->ops->free(p.cpu, xc); p.cpu->ops->free(p.cpu, oc);
        p.gpu->ops->free(p.gpu, xg); p.gpu->ops->free(p.gpu, og);
        td_close(&p);
    }
}

/* The experts' weighted sum of a mixture: 9 rows, k = 3 slots each into 30 expert-output rows
   (repeats and every row of y not used), residual x added in place. */
Test(backend_ops, moe_combine, .timeout = 120)
{
    for (int a = 0; a < 3; a++) {
        td_pair_t p = td_open(td_all_dtypes[a]);
        enum { N = 9, K = 3, Y = 30 };
        int32_t dim = 333, slots[N * K];
        float w[N * K];
        for (int i = 0; i < N * K; i++) {
            slots[i] = td_rand_int(Y);
            w[i] = fabsf(td_rand(1.0f));
        }
        float *x = td_rand_vec((size_t)N * dim, 1.0f, p.act), *y = td_rand_vec((size_t)Y * dim, 1.0f, p.act);
        void *xc = td_up(p.cpu, x, (size_t)N * dim, TD_F32), *xg = td_up(p.gpu, x, (size_t)N * dim, p.act);
        void *yc = td_up(p.cpu, y, (size_t)Y * dim, TD_F32), *yg = td_up(p.gpu, y, (size_t)Y * dim, p.act);
        TD_OK_OR_FAIL(p.cpu, p.cpu->ops->moe_combine(p.cpu, xc, yc, slots, w, N, K, dim));
        TD_OK_OR_FAIL(p.gpu, p.gpu->ops->moe_combine(p.gpu, xg, yg, slots, w, N, K, dim));
        float *want = td_down(p.cpu, xc, (size_t)N * dim, TD_F32);
        float *got = td_down(p.gpu, xg, (size_t)N * dim, p.act);
        td_check("moe_combine", got, want, (size_t)N * dim, td_tol(p.act));
        free(want); free(got); free(x); free(y);
        p.cpu->ops->free(p.cpu, xc); p.cpu->ops->free(p.cpu, yc);
        p.gpu->ops->free(p.gpu, xg); p.gpu->ops->free(p.gpu, yg);
        td_close(&p);
    }
}

/* ---- KV pool helpers ----------------------------------------------------------------------- */

typedef struct td_test_pool {
    td_kv_layout_t lg, lc;   /* GPU layout, CPU layout (f32 where the CPU lacks the dtype) */
    int32_t n_blocks;
    size_t n_elems;          /* elements of the whole pool */
    float *host;
    void *pc, *pg;           /* whole pools */
    void *kc, *kg;           /* the layer under test (layer 1 of 2) */
} td_test_pool_t;

static void td_pool_make(td_pair_t *p, td_test_pool_t *tp, td_dtype_t kt, int32_t bs,
                         int32_t n_kv, int32_t hd, int32_t n_blocks)
{
    tp->lg = (td_kv_layout_t){.model_fingerprint = 1, .dtype = kt, .block_size = (uint32_t)bs,
                              .n_layers = 2, .n_kv_heads = (uint32_t)n_kv, .head_dim = (uint32_t)hd,
                              .version = TD_KV_LAYOUT_VERSION};
    tp->lc = tp->lg;
    tp->lc.dtype = td_cpu_dtype(p->cpu->kv_dtypes, kt);
    tp->n_blocks = n_blocks;
    tp->n_elems = td_kv_pool_bytes(&tp->lg, n_blocks) / td_dtype_size(kt);
    tp->host = td_rand_vec(tp->n_elems, 1.0f, kt);
    tp->pc = td_up(p->cpu, tp->host, tp->n_elems, (td_dtype_t)tp->lc.dtype);
    tp->pg = td_up(p->gpu, tp->host, tp->n_elems, kt);
    tp->kc = (char *)tp->pc + td_kv_block_offset(&tp->lc, n_blocks, 1, 0);
    tp->kg = (char *)tp->pg + td_kv_block_offset(&tp->lg, n_blocks, 1, 0);
}

static void td_pool_check(td_pair_t *p, td_test_pool_t *tp, const char *what)
{
    float *want = td_down(p->cpu, tp->pc, tp->n_elems, (td_dtype_t)tp->lc.dtype);
    float *got = td_down(p->gpu, tp->pg, tp->n_elems, (td_dtype_t)tp->lg.dtype);
    td_check(what, got, want, tp->n_elems, td_tol((td_dtype_t)tp->lg.dtype));
    free(want);
    free(got);
}

static void td_pool_free(td_pair_t *p, td_test_pool_t *tp)
{
    free(tp->host);
    p->cpu->ops->free(p->cpu, tp->pc);
    p->gpu->ops->free(p->gpu, tp->pg);
}

/* rope_kv_write: q rotated in place, k rotated into the cache with v, for every activation
   and KV dtype, GQA and MHA shapes, both rotation styles and no rotation (inv_freq NULL);
   positions up to 1200, with cached prefixes (rows land mid-block) */
Test(backend_ops, rope_kv_write, .timeout = 240)
{
    static const int32_t shapes[][3] = {{8, 4, 8}, {32, 8, 128}, {6, 6, 64}};
    for (int a = 0; a < 3; a++) {
        td_pair_t p = td_open(td_all_dtypes[a]);
        for (int k = 0; k < 3; k++)
            for (size_t si = 0; si < TD_ARRAY_LEN(shapes); si++)
                for (int style = -1; style < 2; style++) {
                    int32_t nh = shapes[si][0], n_kv = shapes[si][1], hd = shapes[si][2];
                    int32_t q[] = {20, 1, 37}, ctx[] = {1200, 70, 100};
                    td_test_step_t s;
                    td_step_make(&s, 3, q, ctx, 16, 10);
                    td_step_set(&p, &s);
                    td_test_pool_t tp;
                    td_pool_make(&p, &tp, td_all_dtypes[k], 16, n_kv, hd, s.n_blocks);
                    size_t nq = (size_t)s.m.n_tokens * nh * hd, n = (size_t)s.m.n_tokens * n_kv * hd;
                    float *qv = td_rand_vec(nq, 1.0f, p.act);
                    float *kv = td_rand_vec(n, 1.0f, p.act), *vv = td_rand_vec(n, 1.0f, p.act);
                    float *freq = malloc(sizeof(float) * hd / 2);
                    for (int32_t i = 0; i < hd / 2; i++)
                        freq[i] = powf(10000.0f, -2.0f * i / hd);
                    void *qc = td_up(p.cpu, qv, nq, TD_F32), *qg = td_up(p.gpu, qv, nq, p.act);
                    void *kc = td_up(p.cpu, kv, n, TD_F32), *kg = td_up(p.gpu, kv, n, p.act);
                    void *vc = td_up(p.cpu, vv, n, TD_F32), *vg = td_up(p.gpu, vv, n, p.act);
                    void *fc = td_up(p.cpu, freq, hd / 2, TD_F32);
                    void *fg = td_up(p.gpu, freq, hd / 2, TD_F32);
                    td_rope_kv_params_t rc = {.q = qc, .k = kc, .v = vc, .n_heads = nh,
                                              .inv_freq = style < 0 ? NULL : fc,
                                              .style = (td_rope_style_t)(style < 0 ? 0 : style),
                                              .kv_layer = tp.kc, .layout = &tp.lc,
                                              .n_blocks = tp.n_blocks};
                    td_rope_kv_params_t rg = rc;
                    rg.q = qg; rg.k = kg; rg.v = vg; rg.inv_freq = style < 0 ? NULL : fg;
                    rg.kv_layer = tp.kg; rg.layout = &tp.lg;
                    TD_OK_OR_FAIL(p.cpu, p.cpu->ops->rope_kv_write(p.cpu, &rc));
                    TD_OK_OR_FAIL(p.gpu, p.gpu->ops->rope_kv_write(p.gpu, &rg));
                    float *want = td_down(p.cpu, qc, nq, TD_F32), *got = td_down(p.gpu, qg, nq, p.act);
                    td_check("rope_kv_write q", got, want, nq, TD_MAX(td_tol(p.act), 1e-6));
                    free(want); free(got);
                    td_pool_check(&p, &tp, "rope_kv_write pool");
                    free(qv); free(kv); free(vv); free(freq);
                    p.cpu->ops->free(p.cpu, qc); p.cpu->ops->free(p.cpu, kc);
                    p.cpu->ops->free(p.cpu, vc); p.cpu->ops->free(p.cpu, fc);
                    p.gpu->ops->free(p.gpu, qg); p.gpu->ops->free(p.gpu, kg);
                    p.gpu->ops->free(p.gpu, vg); p.gpu->ops->free(p.gpu, fg);
                    td_pool_free(&p, &tp);
                    td_step_free(&s);
                }
        td_close(&p);
    }
}

Test(backend_ops, copy_blocks, .timeout = 120)
{
    td_pair_t p = td_open(TD_BF16);
    for (int k = 0; k < 3; k++) {
        td_test_pool_t tp;
        td_pool_make(&p, &tp, td_all_dtypes[k], 16, 2, 64, 12);
        int32_t src[] = {3, 0, 11, 5}, dst[] = {7, 10, 1, 5};
        TD_OK_OR_FAIL(p.cpu, p.cpu->ops->copy_blocks(p.cpu, tp.pc, &tp.lc, tp.n_blocks, src, dst, 4));
        TD_OK_OR_FAIL(p.gpu, p.gpu->ops->copy_blocks(p.gpu, tp.pg, &tp.lg, tp.n_blocks, src, dst, 4));
        td_pool_check(&p, &tp, "copy_blocks pool");
        td_pool_free(&p, &tp);
    }
    td_close(&p);
}

/* ---- data-plane copies ------------------------------------------------------------------------ */

static void td_count_wake(void *arg)
{
    __atomic_add_fetch((int *)arg, 1, __ATOMIC_SEQ_CST);
}

/* copy_d2h_start / copy_poll / copy_quiesce / host_pin on each backend: 64 pieces of a
 * random device buffer into a pinned host ring, each piece overwritten on the compute
 * queue just before its copy starts (the copy must see that write: it is ordered after the
 * work queued before it), tickets done in order, every wake delivered, every byte equal. */
Test(backend_ops, copy_d2h_async, .timeout = 120)
{
    td_pair_t p = td_open(TD_BF16);
    td_backend_t *bes[] = {p.cpu, p.gpu};
    const size_t piece = (size_t)128 << 10, n_pieces = 64, bytes = piece * n_pieces;
    uint8_t *want = malloc(bytes), *later = malloc(bytes), *ring = aligned_alloc(4096, bytes);
    cr_assert(want && later && ring);
    for (size_t i = 0; i < bytes; i++) {
        want[i] = (uint8_t)(td_rand_int(255) + 1);
        later[i] = (uint8_t)(want[i] ^ 0x5A);
    }
    for (int b = 0; b < 2; b++) {
        td_backend_t *be = bes[b];
        void *d_old = NULL, *d_new = NULL;
        TD_OK_OR_FAIL(be, be->ops->alloc(be, bytes, &d_old));
        TD_OK_OR_FAIL(be, be->ops->alloc(be, bytes, &d_new));
        TD_OK_OR_FAIL(be, be->ops->copy_h2d(be, d_old, later, bytes));
        TD_OK_OR_FAIL(be, be->ops->copy_h2d(be, d_new, want, bytes));
        TD_OK_OR_FAIL(be, be->ops->sync(be));
        TD_OK_OR_FAIL(be, be->ops->host_pin(be, ring, bytes));
        memset(ring, 0, bytes);
        int wakes = 0;
        uint64_t tickets[64];
        for (size_t k = 0; k < n_pieces; k++) {
            uint8_t *dst = ring + k * piece, *src = (uint8_t *)d_old + k * piece;
            TD_OK_OR_FAIL(be, be->ops->copy_d2d(be, src, (uint8_t *)d_new + k * piece, piece)); /* compute queue */
            TD_OK_OR_FAIL(be, be->ops->copy_d2h_start(be, dst, src, piece, td_count_wake, &wakes, &tickets[k]));
            if (k && !be->host_memory) /* the CPU finishes inside start: every ticket is 0 */
                cr_assert_gt(tickets[k], tickets[k - 1], "%s: tickets in start order", be->ops->name);
        }
        for (size_t k = 0; k < n_pieces; k++) {
            uint64_t until = td_now_ns() + 10000000000ull;
            td_status_t st;
            while ((st = be->ops->copy_poll(be, tickets[k])) == TD_ERR_BUSY && td_now_ns() < until)
                ;
            cr_assert_eq(st, TD_OK, "%s: copy %zu: %s", be->ops->name, k, td_strerror(st));
            for (size_t j = 0; j < k; j++)
                cr_assert_eq(be->ops->copy_poll(be, tickets[j]), TD_OK, "%s: copies finish in order", be->ops->name);
        }
        be->ops->copy_quiesce(be);
        if (!be->host_memory) /* the CPU backend finishes inside start and owes no wake */
            cr_expect_eq(__atomic_load_n(&wakes, __ATOMIC_SEQ_CST), (int)n_pieces, "%s: %d wakes for %zu copies",
                         be->ops->name, wakes, n_pieces);
        cr_expect(memcmp(ring, want, bytes) == 0, "%s: the copies carry the bytes written just before them",
                  be->ops->name);
        be->ops->host_unpin(be, ring);
        be->ops->free(be, d_old);
        be->ops->free(be, d_new);
    }
    free(want);
    free(later);
    free(ring);
    td_close(&p);
}

/* ---- attention ------------------------------------------------------------------------------ */

typedef struct td_attn_case {
    const char *name;
    int32_t n_seqs;
    const int32_t *q_len, *ctx;
    int32_t n_heads, n_kv, hd, bs;
    bool decode;
    int32_t partition_tokens;
} td_attn_case_t;

static void td_check_attn(td_pair_t *p, const td_attn_case_t *c, td_dtype_t kt, int32_t window)
{
    td_test_step_t s;
    td_step_make(&s, c->n_seqs, c->q_len, c->ctx, c->bs, 10);
    td_step_set(p, &s);
    td_test_pool_t tp;
    td_pool_make(p, &tp, kt, c->bs, c->n_kv, c->hd, s.n_blocks);
    size_t n = (size_t)s.m.n_tokens * c->n_heads * c->hd, es = td_dtype_size(p->act);
    float *q = td_rand_vec(n, 1.0f, p->act);
    void *qc = td_up(p->cpu, q, n, TD_F32), *qg = td_up(p->gpu, q, n, p->act);
    void *oc = NULL, *og = NULL;
    TD_OK_OR_FAIL(p->cpu, p->cpu->ops->alloc(p->cpu, n * 4, &oc));
    TD_OK_OR_FAIL(p->gpu, p->gpu->ops->alloc(p->gpu, n * es, &og));
    td_poison(p->gpu, og, n * es);
    td_attn_params_t ac = {.q = qc, .out = oc, .kv_layer = tp.kc, .layout = &tp.lc,
                           .n_blocks = tp.n_blocks, .n_heads = c->n_heads,
                           .scale = 1.0f / sqrtf((float)c->hd),
                           .partition_tokens = c->partition_tokens, .window = window};
    td_attn_params_t ag = ac;
    ag.q = qg; ag.out = og; ag.kv_layer = tp.kg; ag.layout = &tp.lg;
    if (c->decode) {
        TD_OK_OR_FAIL(p->cpu, p->cpu->ops->attn_decode(p->cpu, &ac));
        TD_OK_OR_FAIL(p->gpu, p->gpu->ops->attn_decode(p->gpu, &ag));
    } else {
        TD_OK_OR_FAIL(p->cpu, p->cpu->ops->attn_prefill(p->cpu, &ac));
        TD_OK_OR_FAIL(p->gpu, p->gpu->ops->attn_prefill(p->gpu, &ag));
    }
    float *want = td_down(p->cpu, oc, n, TD_F32), *got = td_down(p->gpu, og, n, p->act);
    char what[200];
    snprintf(what, sizeof(what), "%s %s (act %s, kv %s, heads %d/%d, hd %d, bs %d, window %d)",
             c->decode ? "attn_decode" : "attn_prefill", c->name, td_dtype_name(p->act),
             td_dtype_name(kt), c->n_heads, c->n_kv, c->hd, c->bs, window);
    /* the weaker of the two dtypes sets the bound; P is rounded to 16 bits in the mma path */
    td_dtype_t weak = (p->act == TD_BF16 || kt == TD_BF16) ? TD_BF16
                      : (p->act == TD_F16 || kt == TD_F16) ? TD_F16 : TD_F32;
    td_check(what, got, want, n, td_tol(weak) * 4);
    free(want); free(got); free(q);
    p->cpu->ops->free(p->cpu, qc); p->cpu->ops->free(p->cpu, oc);
    p->gpu->ops->free(p->gpu, qg); p->gpu->ops->free(p->gpu, og);
    td_pool_free(p, &tp);
    td_step_free(&s);
}

/* every act dtype with the same KV dtype, plus mixed act/KV pairs on the first act; a
   sliding window of `window` tokens (0: none) */
static void td_attn_all_dtypes_window(const td_attn_case_t *c, int32_t window)
{
    for (int a = 0; a < 3; a++) {
        td_pair_t p = td_open(td_all_dtypes[a]);
        td_check_attn(&p, c, td_all_dtypes[a], window);
        if (a == 2)
            td_check_attn(&p, c, TD_F32, window); /* bf16 activations over an f32 cache */
        if (a == 0)
            td_check_attn(&p, c, TD_BF16, window); /* f32 activations over a bf16 cache */
        td_close(&p);
    }
}

static void td_attn_all_dtypes(const td_attn_case_t *c)
{
    td_attn_all_dtypes_window(c, 0);
}

static const int32_t q1[] = {1}, q77[] = {77}, q300[] = {300}, q64[] = {64};
static const int32_t c1[] = {1}, c77[] = {77}, c300[] = {300}, c1077[] = {1077};
static const int32_t c32k[] = {32768}, c32k64[] = {32704};
static const int32_t rq[] = {5, 64, 1, 130, 17}, rc[] = {5, 100, 1000, 130, 2049};
/* sequences of 1..16 new rows (one warp of a 64-row tile has rows, three are padding), with
   and without a prefix, beside longer ones */
static const int32_t fq[] = {16, 3, 200, 9, 1, 70}, fc[] = {16, 1003, 260, 75, 1, 1070};

Test(backend_ops, attn_prefill_single, .timeout = 300)
{
    static const int32_t shapes[][4] = {{8, 4, 8, 16}, {4, 4, 64, 16}, {8, 2, 128, 16},
                                        {8, 8, 128, 32}, {6, 2, 64, 8}, {4, 1, 96, 16}};
    for (size_t i = 0; i < TD_ARRAY_LEN(shapes); i++) {
        td_attn_case_t k1 = {"one row", 1, q1, c1, shapes[i][0], shapes[i][1], shapes[i][2],
                              shapes[i][3], false, 0};
        td_attn_case_t k77 = {"77 rows, no prefix", 1, q77, c77, shapes[i][0], shapes[i][1],
                              shapes[i][2], shapes[i][3], false, 0};
        td_attn_case_t k300 = {"300 rows, no prefix", 1, q300, c300, shapes[i][0], shapes[i][1],
                               shapes[i][2], shapes[i][3], false, 0};
        td_attn_all_dtypes(&k1);
        td_attn_all_dtypes(&k77);
        td_attn_all_dtypes(&k300);
    }
}

Test(backend_ops, attn_prefill_chunked_ragged, .timeout = 600)
{
    /* {n_heads, n_kv_heads, head_dim, block_size}; block size 48 does not divide the
       kernel's 64-token KV tiles */
    static const int32_t shapes[][4] = {{8, 4, 8, 16}, {8, 2, 64, 16}, {16, 4, 128, 16},
                                        {32, 2, 128, 64}, {8, 2, 128, 48}};
    for (size_t i = 0; i < TD_ARRAY_LEN(shapes); i++) {
        td_attn_case_t chunk = {"77 rows after a 1000-token prefix", 1, q77, c1077, shapes[i][0],
                                shapes[i][1], shapes[i][2], shapes[i][3], false, 0};
        td_attn_case_t ragged = {"ragged batch of 5", 5, rq, rc, shapes[i][0], shapes[i][1],
                                 shapes[i][2], shapes[i][3], false, 0};
        td_attn_case_t few = {"ragged batch of 6 with 1..16-row sequences", 6, fq, fc,
                              shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3], false, 0};
        td_attn_all_dtypes(&chunk);
        td_attn_all_dtypes(&ragged);
        td_attn_all_dtypes(&few);
    }
}

Test(backend_ops, attn_prefill_long, .timeout = 600)
{
    /* 64 new rows after a 32704-token prefix: a 32k context */
    td_attn_case_t c = {"64 rows at 32k context", 1, q64, c32k64, 8, 2, 128, 16, false, 0};
    (void)c32k;
    td_attn_all_dtypes(&c);
}

Test(backend_ops, attn_decode, .timeout = 600)
{
    static const int32_t shapes[][4] = {{8, 4, 8, 16}, {32, 8, 128, 16}, {8, 8, 64, 16},
                                        {16, 1, 128, 32}, {4, 2, 64, 8}};
    static const int32_t dq[] = {1, 1, 1, 1, 1, 1, 1}, dc[] = {1, 17, 300, 4096, 1000, 16, 33};
    static const int32_t partitions[] = {0, 16, 64};
    for (size_t i = 0; i < TD_ARRAY_LEN(shapes); i++) {
        for (size_t k = 0; k < TD_ARRAY_LEN(partitions); k++) {
            td_attn_case_t ragged = {"ragged batch of 7", 7, dq, dc, shapes[i][0], shapes[i][1],
                                     shapes[i][2], shapes[i][3], true, partitions[k]};
            td_attn_all_dtypes(&ragged);
        }
        td_attn_case_t one = {"one token", 1, q1, c1, shapes[i][0], shapes[i][1], shapes[i][2],
                              shapes[i][3], true, 0};
        td_attn_all_dtypes(&one);
    }
}

/* Sliding windows smaller than a block, than the 64-token KV tile, and crossing partitions,
   on the tensor-core and generic prefill paths and the split-KV decode */
Test(backend_ops, attn_sliding_window, .timeout = 600)
{
    static const int32_t shapes[][4] = {{8, 2, 128, 16}, {8, 4, 64, 16}, {8, 4, 8, 16}, {8, 2, 128, 48}};
    static const int32_t windows[] = {1, 7, 40, 100, 300};
    static const int32_t dq[] = {1, 1, 1, 1, 1}, dc[] = {1, 40, 41, 300, 1000};
    for (size_t i = 0; i < TD_ARRAY_LEN(shapes); i++)
        for (size_t w = 0; w < TD_ARRAY_LEN(windows); w++) {
            td_attn_case_t ragged = {"ragged batch of 6", 6, fq, fc, shapes[i][0], shapes[i][1],
                                     shapes[i][2], shapes[i][3], false, 0};
            td_attn_all_dtypes_window(&ragged, windows[w]);
            td_attn_case_t dec = {"ragged decode of 5", 5, dq, dc, shapes[i][0], shapes[i][1], shapes[i][2],
                                  shapes[i][3], true, 64};
            td_attn_all_dtypes_window(&dec, windows[w]);
            dec.partition_tokens = 0;
            td_attn_all_dtypes_window(&dec, windows[w]);
        }
}

Test(backend_ops, attn_decode_long, .timeout = 600)
{
    td_attn_case_t c = {"batch 1 at 32k", 1, q1, c32k, 32, 8, 128, 16, true, 0};
    td_attn_all_dtypes(&c);
    static const int32_t dq[] = {1, 1, 1}, dc[] = {32768, 5, 20000};
    td_attn_case_t r = {"ragged up to 32k", 3, dq, dc, 32, 8, 128, 16, true, 0};
    td_attn_all_dtypes(&r);
}

/* ---- backend-level behaviour ---------------------------------------------------------------- */

Test(backend_ops, cuda_reports_oom, .timeout = 60)
{
    td_pair_t p = td_open(TD_BF16);
    void *d = NULL;
    td_status_t st = p.gpu->ops->alloc(p.gpu, (size_t)1 << 50, &d); /* 1 PiB */
    cr_assert_eq(st, TD_ERR_NOMEM, "alloc of 1 PiB: %s", td_status_name(st));
    cr_assert_null(d);
    cr_assert(strstr(td_last_error(), "out of device memory") != NULL, "message: %s", td_last_error());
    /* the backend still works afterwards */
    TD_OK_OR_FAIL(p.gpu, p.gpu->ops->alloc(p.gpu, 4096, &d));
    p.gpu->ops->free(p.gpu, d);
    td_close(&p);
}
