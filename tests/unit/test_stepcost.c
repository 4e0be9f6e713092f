/*
 * test_stepcost: a node's step-cost fit (td_stepcost, over td_lsq). It finds the law its steps
 * follow (decodes, their context, prompt tokens) through noise; makes no fit before it has seen
 * steps with prompt tokens, keeps those through a long run without; follows a node that
 * slows down within its window; falls back to the columns the steps determine; and sizes the
 * chunk that keeps a step within an objective.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "td_lsq.h"
#include "td_stepcost.h"

/* 2 ms a step, 0.4 ms a decoding sequence, 1 us a context token, 0.25 ms a prompt token. */
static double law(double speed, int32_t b, int64_t c, int32_t p)
{
    return speed * (0.002 + 0.0004 * b + 1e-6 * (double)c + 0.00025 * p);
}

static uint32_t next(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* A node's steps: batches of 1-16 with 100-800 context tokens each; every third step carries a
 * chunk of 8-128 prompt tokens; times off the law by up to +-noise (uniform). */
static void run(td_stepcost_t *c, uint32_t *seed, int steps, double speed, double noise)
{
    for (int i = 0; i < steps; i++) {
        int32_t b = 1 + (int32_t)(next(seed) % 16);
        int64_t ctx = b * (100 + (int64_t)(next(seed) % 700));
        int32_t p = i % 3 == 0 ? 8 + (int32_t)(next(seed) % 121) : 0;
        double u = (double)(next(seed) % 20001) / 10000.0 - 1.0;
        td_stepcost_note(c, b, ctx, p, law(speed, b, ctx, p) * (1 + noise * u));
    }
}

Test(stepcost, finds_the_law_through_noise)
{
    td_stepcost_t c;
    td_stepcost_init(&c);
    uint32_t seed = 7;
    run(&c, &seed, 400, 1.0, 0.1);
    td_stepcost_fit_t f = td_stepcost_fit(&c);
    cr_assert(f.valid);
    cr_assert_float_eq(f.per_prefill_s, 0.00025, 0.00025 * 0.1, "per prompt token %g s", f.per_prefill_s);
    for (int32_t b = 2; b <= 16; b += 7) { /* predictions within the noise's mean, a few percent */
        double want = law(1, b, b * 400, 64), got = td_stepcost_predict(&f, b, b * 400, 64);
        cr_assert_float_eq(got, want, want * 0.05, "batch %d: %g s, the law %g s", b, got, want);
    }
}

Test(stepcost, no_fit_before_steps_with_prompt_tokens_and_they_outlast_decode_runs)
{
    td_stepcost_t c;
    td_stepcost_init(&c);
    for (int i = 0; i < 1000; i++) /* decode-only: nothing says what a prompt token costs */
        td_stepcost_note(&c, 1 + i % 8, 100 * (1 + i % 8), 0, law(1, 1 + i % 8, 100 * (1 + i % 8), 0));
    cr_assert(!td_stepcost_fit(&c).valid);
    cr_assert_eq(td_stepcost_chunk(&(td_stepcost_fit_t){0}, 4, 400, 0.025), -1, "no fit: no chunk");
    for (int i = 0; i < TD_STEPCOST_MIN_PREFILL; i++) {
        cr_assert(!td_stepcost_fit(&c).valid, "a fit from %d steps with prompt tokens", i);
        td_stepcost_note(&c, 2, 300, 16 * (i + 1), law(1, 2, 300, 16 * (i + 1)));
    }
    td_stepcost_fit_t f = td_stepcost_fit(&c);
    cr_assert(f.valid);
    cr_assert_float_eq(f.per_prefill_s, 0.00025, 1e-9);
    for (int i = 0; i < 10 * TD_STEPCOST_WINDOW; i++) /* a long decode-only run keeps them */
        td_stepcost_note(&c, 3, 900, 0, law(1, 3, 900, 0));
    f = td_stepcost_fit(&c);
    cr_assert(f.valid);
    cr_assert_float_eq(f.per_prefill_s, 0.00025, 1e-9);
    /* refused samples change nothing */
    td_stepcost_note(&c, 1, 10, 10, NAN);
    td_stepcost_note(&c, 1, 10, 10, -1);
    td_stepcost_note(&c, -1, 10, 10, 1);
    td_stepcost_note(&c, 0, 0, 0, 1);
    td_stepcost_fit_t g = td_stepcost_fit(&c);
    cr_assert_float_eq(g.per_prefill_s, f.per_prefill_s, 1e-15);
}

Test(stepcost, follows_a_node_that_slows_down_within_its_window)
{
    td_stepcost_t c;
    td_stepcost_init(&c);
    uint32_t seed = 3;
    run(&c, &seed, 6 * TD_STEPCOST_WINDOW, 1.0, 0);
    cr_assert_float_eq(td_stepcost_fit(&c).per_prefill_s, 0.00025, 1e-9);
    run(&c, &seed, 3 * TD_STEPCOST_WINDOW, 2.0, 0); /* a third of them carry prompt tokens */
    td_stepcost_fit_t f = td_stepcost_fit(&c);
    cr_assert_float_eq(f.per_prefill_s, 0.0005, 1e-9, "the old steps left the window: %g s", f.per_prefill_s);
    cr_assert_float_eq(td_stepcost_predict(&f, 4, 1600, 0), law(2, 4, 1600, 0), 1e-9);
}

Test(stepcost, fits_the_columns_the_steps_determine)
{
    td_stepcost_t c;
    td_stepcost_init(&c);
    for (int i = 0; i < 40; i++) { /* one sequence, one context: only the intercept and P vary */
        int32_t p = i % 2 ? 0 : 4 * (i + 1);
        td_stepcost_note(&c, 1, 256, p, law(1, 1, 256, p));
    }
    td_stepcost_fit_t f = td_stepcost_fit(&c);
    cr_assert(f.valid);
    cr_assert_float_eq(f.per_prefill_s, 0.00025, 1e-9);
    cr_assert_float_eq(td_stepcost_predict(&f, 1, 256, 0), law(1, 1, 256, 0), 1e-9);
    /* every step the same prompt tokens: what one costs is not determined */
    td_stepcost_init(&c);
    for (int i = 0; i < 40; i++)
        td_stepcost_note(&c, 1 + i % 5, 256, 32, law(1, 1 + i % 5, 256, 32));
    cr_assert(!td_stepcost_fit(&c).valid);
}

Test(stepcost, the_chunk_keeps_the_step_within_the_objective)
{
    td_stepcost_fit_t f = {.valid = true, .fixed_s = 0.002, .per_seq_s = 0.0004, .per_context_s = 1e-6,
                           .per_prefill_s = 0.00025};
    /* 8 sequences of 2000 context: 2 + 3.2 + 2 = 7.2 ms; 25 ms leaves 17.8 ms = 71.2 tokens */
    cr_assert_eq(td_stepcost_chunk(&f, 8, 2000, 0.025), 71);
    cr_assert_leq(td_stepcost_predict(&f, 8, 2000, 71), 0.025);
    cr_assert_gt(td_stepcost_predict(&f, 8, 2000, 72), 0.025);
    cr_assert_eq(td_stepcost_chunk(&f, 8, 2000, 0.007), 0, "the decodes alone pass the objective");
    cr_assert_eq(td_stepcost_chunk(&f, 0, 0, 1e9), INT32_MAX);
    f.spread_s = 0.001; /* steps that stray 1 ms: a millisecond kept back, 4 tokens fewer */
    cr_assert_eq(td_stepcost_chunk(&f, 8, 2000, 0.025), 67);
}

/* The spread is the residuals' RMS over the steps with prompt tokens: 0 on the law itself, the
 * noise's (uniform +-10%: ~5.8% of a step, RMS) through noise. */
Test(stepcost, the_spread_is_how_far_prompt_steps_stray_from_the_fit)
{
    td_stepcost_t c;
    td_stepcost_init(&c);
    uint32_t seed = 11;
    run(&c, &seed, 400, 1.0, 0);
    cr_assert_float_eq(td_stepcost_fit(&c).spread_s, 0, 1e-12);
    run(&c, &seed, 4 * TD_STEPCOST_WINDOW, 1.0, 0.1);
    /* prompt steps take ~5-50 ms here, off by a uniform +-10%: an RMS of ~5.8% of each */
    double s = td_stepcost_fit(&c).spread_s;
    cr_assert(s > 0.0002 && s < 0.002, "spread %g s", s);
}

Test(stepcost, least_squares_refuses_dependent_columns)
{
    double x[] = {1, 2, 1, 2, 1, 2}, y[] = {1, 2, 3}, coef[2] = {42, 42};
    cr_assert(!td_lsq_fit(x, y, 3, 2, coef), "two proportional columns");
    cr_assert_eq(coef[0], 42, "untouched on failure");
    double z[] = {1, 0, 1, 0}, w[] = {1, 1};
    cr_assert(!td_lsq_fit(z, w, 2, 2, coef), "a column of zeros");
    double a[] = {1, 1, 1, 2, 1, 3}, b[] = {3, 5, 7};
    cr_assert(td_lsq_fit(a, b, 3, 2, coef));
    cr_assert_float_eq(coef[0], 1, 1e-12);
    cr_assert_float_eq(coef[1], 2, 1e-12);
    cr_assert(!td_lsq_fit(a, b, 1, 2, coef), "fewer points than coefficients");
}
