/*
 * Tests of td_sampler: parameter validation, greedy argmax, seeded reproducibility, the
 * filters (top-k, top-p, min-p) against brute-force references, the empirical
 * distribution against softmax, the repetition penalty, OpenAI's presence and frequency
 * penalties against a plain reference, log-probabilities against a double-precision
 * log_softmax and a full sort, and the stop-string matcher across token boundaries with its
 * hold-back.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "td_sampler.h"

static td_sampler_t *make(td_sampling_t p)
{
    td_sampler_t *s = NULL;
    cr_assert_eq(td_sampler_create(&p, &s), TD_OK, "%s", td_last_error());
    return s;
}

static int32_t draw(td_sampler_t *s, const float *logits, int32_t vocab)
{
    int32_t t = -1;
    cr_assert_eq(td_sampler_sample(s, logits, vocab, &t), TD_OK, "%s", td_last_error());
    cr_assert(t >= 0 && t < vocab);
    return t;
}

/* Deterministic pseudo-random logits, roughly normal with the given scale. */
static void fill_logits(float *l, int32_t n, uint32_t seed, float scale)
{
    uint64_t x = seed * 2654435761u + 1;
    for (int32_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (int k = 0; k < 4; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            acc += (float)((x >> 40) & 0xffffff) / 16777216.0f - 0.5f;
        }
        l[i] = acc * scale;
    }
}

static int32_t argmax(const float *l, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (l[i] > l[b])
            b = i;
    return b;
}

static void softmax(const float *l, int32_t n, float t, double *p)
{
    double mx = l[argmax(l, n)], sum = 0.0;
    for (int32_t i = 0; i < n; i++)
        sum += p[i] = exp((l[i] - mx) / t);
    for (int32_t i = 0; i < n; i++)
        p[i] /= sum;
}

Test(sampler, defaults_and_validation)
{
    td_sampling_t d = td_sampling_default();
    cr_assert_eq(d.temperature, 0.0f);
    cr_assert(d.top_k == 0 && d.top_p == 1.0f && d.min_p == 0.0f && d.repetition_penalty == 1.0f);
    cr_assert_eq(td_sampling_validate(&d, NULL, 0), TD_OK);

    struct {
        td_sampling_t s;
        const char *field;
    } bad[] = {
        { d, "temperature" }, { d, "temperature" }, { d, "top_k" },   { d, "top_p" },
        { d, "top_p" },       { d, "min_p" },       { d, "min_p" },   { d, "repetition_penalty" },
        { d, "repetition_penalty" }, { d, "penalty_window" }, { d, "presence_penalty" },
        { d, "presence_penalty" }, { d, "frequency_penalty" }, { d, "frequency_penalty" },
    };
    bad[0].s.temperature = -0.5f;
    bad[1].s.temperature = NAN;
    bad[2].s.top_k = -1;
    bad[3].s.top_p = 0.0f;
    bad[4].s.top_p = 1.5f;
    bad[5].s.min_p = -0.1f;
    bad[6].s.min_p = 1.0f;
    bad[7].s.repetition_penalty = 0.0f;
    bad[8].s.repetition_penalty = INFINITY;
    bad[9].s.penalty_window = -3;
    bad[10].s.presence_penalty = 2.5f;
    bad[11].s.presence_penalty = NAN;
    bad[12].s.frequency_penalty = -2.01f;
    bad[13].s.frequency_penalty = -INFINITY;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char why[256] = "";
        cr_assert_eq(td_sampling_validate(&bad[i].s, why, sizeof why), TD_ERR_INVALID, "case %zu", i);
        cr_assert(strstr(why, bad[i].field), "case %zu: '%s' does not name %s", i, why, bad[i].field);
        cr_assert_str_eq(td_last_error(), why);
    }
}

/* Out-of-range parameters never reach a sampler: the process's edge refuses them
 * (td_sampling_validate, above), and td_sampler_create asserts what the edge checked. */
Test(sampler, create_asserts_valid_params, .signal = SIGABRT)
{
    td_sampling_t p = td_sampling_default();
    p.top_p = NAN;
    td_sampler_t *s = NULL;
    td_sampler_create(&p, &s);
}

Test(sampler, greedy_argmax_lowest_index_on_ties)
{
    td_sampler_t *s = make(td_sampling_default());
    float l[6] = { 0.5f, 3.0f, -1.0f, 3.0f, 2.9f, 3.0f };
    cr_assert_eq(draw(s, l, 6), 1);
    float n[4] = { NAN, -INFINITY, 0.25f, NAN };
    cr_assert_eq(draw(s, n, 4), 2); /* NaN is never chosen */
    float none[3] = { -INFINITY, NAN, -INFINITY };
    int32_t t = -1;
    cr_assert_eq(td_sampler_sample(s, none, 3, &t), TD_ERR_INVALID);
    cr_assert_eq(t, -1);
    cr_assert_eq(td_sampler_sample(s, l, 0, &t), TD_ERR_INVALID);
    static float big[50000];
    fill_logits(big, 50000, 7, 4.0f);
    cr_assert_eq(draw(s, big, 50000), argmax(big, 50000));
    td_sampler_destroy(s);
    td_sampler_destroy(NULL);
}

Test(sampler, same_seed_same_tokens)
{
    enum { V = 1000, N = 300 };
    static float l[V];
    fill_logits(l, V, 3, 2.0f);
    td_sampling_t p = td_sampling_default();
    p.temperature = 1.0f;
    p.seed = 1234;
    td_sampler_t *a = make(p), *b = make(p), *other = make(p);
    p.seed = 1235;
    td_sampler_t *c = make(p);
    int32_t ta[N], tb[N], tc[N];
    int differ = 0, distinct_a = 0;
    for (int i = 0; i < N; i++) {
        ta[i] = draw(a, l, V);
        /* b runs "in a batch" with another sequence drawing in between */
        draw(other, l, V);
        tb[i] = draw(b, l, V);
        tc[i] = draw(c, l, V);
        differ += ta[i] != tc[i];
        distinct_a += i > 0 && ta[i] != ta[i - 1];
    }
    cr_assert_eq(memcmp(ta, tb, sizeof ta), 0);
    cr_assert_gt(differ, N / 2);
    cr_assert_gt(distinct_a, N / 2); /* it really is random */
    /* reset reseeds */
    td_sampler_reset(a);
    cr_assert_eq(draw(a, l, V), ta[0]);
    td_sampler_destroy(a);
    td_sampler_destroy(b);
    td_sampler_destroy(c);
    td_sampler_destroy(other);
}

Test(sampler, top_k_1_and_tiny_top_p_equal_greedy)
{
    enum { V = 4096 };
    static float l[V];
    td_sampling_t p = td_sampling_default();
    p.temperature = 1.5f;
    p.top_k = 1;
    td_sampler_t *k1 = make(p);
    p.top_k = 0;
    p.top_p = 1e-6f;
    td_sampler_t *p0 = make(p);
    p.top_k = 50;
    td_sampler_t *kp = make(p);
    for (uint32_t trial = 0; trial < 50; trial++) {
        fill_logits(l, V, 100 + trial, 1.0f);
        int32_t g = argmax(l, V);
        cr_assert_eq(draw(k1, l, V), g);
        cr_assert_eq(draw(p0, l, V), g);
        cr_assert_eq(draw(kp, l, V), g);
    }
    td_sampler_destroy(k1);
    td_sampler_destroy(p0);
    td_sampler_destroy(kp);
}

static int cmp_desc(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

Test(sampler, top_k_stays_in_the_top_k_of_a_large_vocab)
{
    enum { V = 128000, K = 40 };
    float *l = malloc(V * sizeof *l), *sorted = malloc(V * sizeof *sorted);
    fill_logits(l, V, 11, 3.0f);
    memcpy(sorted, l, V * sizeof *l);
    qsort(sorted, V, sizeof *sorted, cmp_desc);
    float kth = sorted[K - 1];
    td_sampling_t p = td_sampling_default();
    p.temperature = 5.0f; /* flat: without the filter most draws would fall outside */
    p.top_k = K;
    p.seed = 9;
    td_sampler_t *s = make(p);
    int hits_outside_top10 = 0;
    for (int i = 0; i < 500; i++) {
        int32_t t = draw(s, l, V);
        cr_assert_geq(l[t], kth);
        hits_outside_top10 += l[t] < sorted[9];
    }
    cr_assert_gt(hits_outside_top10, 0); /* not just greedy */
    td_sampler_destroy(s);
    free(l);
    free(sorted);
}

Test(sampler, top_p_matches_a_full_sort)
{
    enum { V = 3000 };
    static float l[V], sorted[V];
    td_sampling_t p = td_sampling_default();
    p.temperature = 1.0f;
    p.top_p = 0.7f;
    p.seed = 5;
    td_sampler_t *s = make(p);
    static double pd[V];
    for (uint32_t trial = 0; trial < 20; trial++) {
        fill_logits(l, V, 300 + trial, 6.0f);
        /* the nucleus by brute force: the smallest top set with mass >= top_p */
        memcpy(sorted, l, sizeof l);
        qsort(sorted, V, sizeof *sorted, cmp_desc);
        for (int i = 0; i < V; i++)
            pd[i] = exp((double)sorted[i] - sorted[0]);
        double tot = 0.0;
        for (int i = 0; i < V; i++)
            tot += pd[i];
        double cum = 0.0;
        float last_in = sorted[0];
        for (int i = 0; i < V; i++) {
            cum += pd[i] / tot;
            last_in = sorted[i];
            if (cum >= p.top_p)
                break;
        }
        int outside_top1 = 0;
        for (int i = 0; i < 40; i++) {
            int32_t t = draw(s, l, V);
            cr_assert_geq(l[t], last_in, "trial %u: token %d (logit %g) outside the nucleus (min %g)",
                          trial, t, l[t], last_in);
            outside_top1 += l[t] < sorted[0];
        }
        cr_assert_gt(outside_top1, 0);
    }
    td_sampler_destroy(s);
}

Test(sampler, top_p_renormalizes_the_nucleus)
{
    /* p = .5 .3 .15 .05 among 2000 tokens (the rest ~e-30 each, so the selection runs on a
     * large unsorted set): top_p .79 keeps the first two, drawn .625/.375 */
    enum { V = 2000 };
    static float l[V];
    for (int i = 0; i < V; i++)
        l[i] = -30.0f;
    const int ids[4] = { 1500, 7, 999, 3 };
    const float pr[4] = { 0.5f, 0.3f, 0.15f, 0.05f };
    for (int i = 0; i < 4; i++)
        l[ids[i]] = logf(pr[i]);
    td_sampling_t p = td_sampling_default();
    p.temperature = 1.0f;
    p.top_p = 0.79f;
    p.seed = 77;
    td_sampler_t *s = make(p);
    int first = 0;
    for (int i = 0; i < 20000; i++) {
        int32_t t = draw(s, l, V);
        cr_assert(t == ids[0] || t == ids[1], "token %d outside the nucleus", t);
        first += t == ids[0];
    }
    cr_assert_float_eq(first / 20000.0, 0.625, 0.02);
    td_sampler_destroy(s);
}

Test(sampler, min_p)
{
    float l[5] = { logf(0.5f), logf(0.3f), logf(0.12f), logf(0.05f), logf(0.03f) };
    td_sampling_t p = td_sampling_default();
    p.temperature = 1.0f;
    p.min_p = 0.2f; /* floor 0.1: tokens 0, 1, 2 */
    p.seed = 3;
    td_sampler_t *s = make(p);
    int count[5] = { 0 };
    for (int i = 0; i < 10000; i++)
        count[draw(s, l, 5)]++;
    cr_assert_eq(count[3] + count[4], 0);
    cr_assert_gt(count[2], 0);
    cr_assert_float_eq(count[2] / 10000.0, 0.12 / 0.92, 0.02);
    td_sampler_destroy(s);
}

/* Max abs difference and chi-square of 20000 draws against the expected distribution. */
static void check_distribution(td_sampling_t p, const float *l, int32_t v, const double *expect)
{
    enum { N = 20000 };
    td_sampler_t *s = make(p);
    int count[16] = { 0 };
    for (int i = 0; i < N; i++)
        count[draw(s, l, v)]++;
    double chi2 = 0.0, max_diff = 0.0;
    int df = -1;
    for (int32_t i = 0; i < v; i++) {
        if (expect[i] == 0.0) {
            cr_assert_eq(count[i], 0, "token %d has p 0 but was drawn", i);
            continue;
        }
        double e = expect[i] * N;
        chi2 += (count[i] - e) * (count[i] - e) / e;
        max_diff = fmax(max_diff, fabs(count[i] / (double)N - expect[i]));
        df++;
    }
    /* fixed seed: deterministic; the bounds are ~4 sigma / the 0.1% chi-square quantile */
    cr_assert_lt(max_diff, 0.015, "max abs diff %g", max_diff);
    cr_assert_lt(chi2, 30.0, "chi-square %g with %d degrees of freedom", chi2, df);
    td_sampler_destroy(s);
}

Test(sampler, distribution_matches_softmax)
{
    float l[8] = { 1.0f, 0.5f, -0.3f, 2.0f, 0.0f, 1.7f, -2.0f, 0.9f };
    double e[8];
    td_sampling_t p = td_sampling_default();
    p.temperature = 1.0f;
    p.seed = 42;
    softmax(l, 8, 1.0f, e);
    check_distribution(p, l, 8, e);
    p.temperature = 2.5f;
    p.seed = 43;
    softmax(l, 8, 2.5f, e);
    check_distribution(p, l, 8, e);
    /* top-k 3 renormalizes over tokens 3, 5, 0 */
    p.temperature = 1.0f;
    p.top_k = 3;
    float top3[8];
    for (int i = 0; i < 8; i++)
        top3[i] = (i == 3 || i == 5 || i == 0) ? l[i] : -INFINITY;
    softmax(top3, 8, 1.0f, e);
    check_distribution(p, l, 8, e);
}

Test(sampler, repetition_penalty)
{
    td_sampling_t p = td_sampling_default();
    p.repetition_penalty = 1.5f;
    p.penalty_window = 3;
    td_sampler_t *s = make(p);
    float l[4] = { 2.0f, 1.9f, -1.0f, -1.2f };
    cr_assert_eq(draw(s, l, 4), 0);
    td_sampler_accept(s, 0); /* 2.0 -> 1.33 < 1.9 */
    cr_assert_eq(draw(s, l, 4), 1);
    td_sampler_accept(s, 1); /* 1.9 -> 1.27 < 1.33 */
    cr_assert_eq(draw(s, l, 4), 0);
    /* 0 and 1 leave the 3-token window */
    td_sampler_accept(s, 2);
    td_sampler_accept(s, 3);
    td_sampler_accept(s, 3);
    cr_assert_eq(draw(s, l, 4), 0);
    td_sampler_destroy(s);

    /* negative logits are multiplied, so they also drop */
    s = make(p);
    float neg[2] = { -1.0f, -1.2f };
    td_sampler_accept(s, 0); /* -1.0 -> -1.5 < -1.2 */
    cr_assert_eq(draw(s, neg, 2), 1);
    td_sampler_destroy(s);

    /* applied once per distinct token however often it repeats */
    s = make(p);
    float once[2] = { 2.0f, 1.0f };
    td_sampler_accept(s, 0);
    td_sampler_accept(s, 0);
    td_sampler_accept(s, 0); /* 2.0 / 1.5 = 1.33 > 1.0; thrice would be 0.59 */
    cr_assert_eq(draw(s, once, 2), 0);
    td_sampler_accept(s, 99999); /* ids past the vocabulary are ignored */
    cr_assert_eq(draw(s, once, 2), 0);
    td_sampler_destroy(s);
}

/* The plain reference of the penalties: repetition (CTRL) once per distinct id of the last
 * `window` tokens of hist (prompt and generated), then OpenAI's over the generated ids:
 * logit -= presence * (count > 0) + frequency * count. */
static void ref_penalize(const float *l, int32_t v, const td_sampling_t *p, const int32_t *hist, int32_t n_hist,
                         int32_t n_prompt, float *out)
{
    for (int32_t i = 0; i < v; i++)
        out[i] = l[i];
    for (int32_t t = 0; t < v; t++) {
        bool seen = false;
        int32_t count = 0;
        for (int32_t i = 0; i < n_hist; i++) {
            if (hist[i] != t)
                continue;
            seen |= i >= n_hist - p->penalty_window;
            count += i >= n_prompt;
        }
        if (seen)
            out[t] = out[t] > 0.0f ? out[t] / p->repetition_penalty : out[t] * p->repetition_penalty;
        out[t] -= p->presence_penalty * (float)(count > 0) + p->frequency_penalty * (float)count;
    }
}

Test(sampler, presence_and_frequency_penalties_match_a_plain_reference)
{
    enum { V = 24, PROMPT = 6, STEPS = 60 };
    const float pres[] = { 0.0f, 0.7f, -0.4f, 2.0f, 0.3f };
    const float freq[] = { 0.5f, 0.0f, 0.25f, -1.0f, 2.0f };
    const float rep[] = { 1.0f, 1.0f, 1.3f, 1.0f, 1.6f };
    for (int c = 0; c < 5; c++) {
        td_sampling_t p = td_sampling_default();
        p.presence_penalty = pres[c];
        p.frequency_penalty = freq[c];
        p.repetition_penalty = rep[c];
        p.penalty_window = 8;
        td_sampler_t *s = make(p);
        int32_t hist[PROMPT + STEPS];
        int32_t n = 0;
        for (int32_t i = 0; i < PROMPT; i++) {
            hist[n++] = (i * 5) % V; /* prompt ids: only the repetition penalty sees them */
            td_sampler_accept_prompt(s, hist[n - 1]);
        }
        float l[V], ref[V];
        int changed = 0;
        for (int32_t step = 0; step < STEPS; step++) {
            fill_logits(l, V, (uint32_t)(c * 1000 + step), 1.0f);
            ref_penalize(l, V, &p, hist, n, PROMPT, ref);
            int32_t t = draw(s, l, V); /* greedy: the argmax of the penalized logits */
            cr_assert_eq(t, argmax(ref, V), "case %d step %d", c, step);
            changed += t != argmax(l, V);
            /* continue with a mix of the pick and forced repeats, so counts reach several */
            int32_t next = step % 3 == 0 ? 7 : t;
            cr_assert_eq(td_sampler_accept(s, next), TD_OK);
            hist[n++] = next;
        }
        if (pres[c] > 0.5f || freq[c] > 0.4f)
            cr_assert_gt(changed, 0, "case %d: the penalties never changed a pick", c);
        /* a reset forgets the counts as it forgets the window */
        td_sampler_reset(s);
        fill_logits(l, V, 7, 1.0f);
        cr_assert_eq(draw(s, l, V), argmax(l, V));
        td_sampler_destroy(s);
    }
}

Test(sampler, frequency_penalty_counts_generated_tokens_only)
{
    td_sampling_t p = td_sampling_default();
    p.frequency_penalty = 1.0f;
    td_sampler_t *s = make(p);
    float l[2] = { 1.0f, 0.5f };
    for (int i = 0; i < 5; i++)
        td_sampler_accept_prompt(s, 0); /* prompt: not counted */
    cr_assert_eq(draw(s, l, 2), 0);
    cr_assert_eq(td_sampler_accept(s, 0), TD_OK); /* 1.0 - 1 = 0 < 0.5 */
    cr_assert_eq(draw(s, l, 2), 1);
    cr_assert_eq(td_sampler_accept(s, 1), TD_OK); /* 0.5 - 1 = -0.5 < 0 */
    cr_assert_eq(draw(s, l, 2), 0);
    cr_assert_eq(td_sampler_accept(s, 99999), TD_OK); /* ids past the vocabulary are ignored */
    cr_assert_eq(draw(s, l, 2), 0);
    td_sampler_destroy(s);
}

/* ---- sampling under a token mask (a grammar's) ---- */

static void random_mask(uint32_t *mask, int32_t n, uint64_t seed, int keep_one_in)
{
    memset(mask, 0, (size_t)(n + 31) / 32 * sizeof *mask);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int32_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        if ((x >> 33) % (uint64_t)keep_one_in == 0)
            mask[i >> 5] |= 1u << (i & 31);
    }
}

static bool allowed_bit(const uint32_t *mask, int32_t i)
{
    return (mask[i >> 5] >> (i & 31)) & 1;
}

static int32_t draw_masked(td_sampler_t *s, const float *logits, int32_t vocab, const uint32_t *mask)
{
    int32_t t = -1;
    cr_assert_eq(td_sampler_sample_masked(s, logits, vocab, mask, &t), TD_OK, "%s", td_last_error());
    return t;
}

Test(sampler, greedy_under_a_mask_is_the_best_allowed_token)
{
    enum { V = 5000 };
    static float l[V];
    static uint32_t mask[(V + 31) / 32];
    td_sampler_t *s = make(td_sampling_default());
    for (uint32_t seed = 1; seed <= 20; seed++) {
        fill_logits(l, V, seed, 3.0f);
        random_mask(mask, V, seed, 1 + (int)seed % 7);
        int32_t best = -1;
        for (int32_t i = 0; i < V; i++)
            if (allowed_bit(mask, i) && (best < 0 || l[i] > l[best]))
                best = i;
        cr_expect_eq(draw_masked(s, l, V, mask), best, "seed %u", seed);
    }
    td_sampler_destroy(s);
}

Test(sampler, every_filter_sees_only_allowed_tokens)
{
    enum { V = 3000 };
    static float l[V];
    static uint32_t mask[(V + 31) / 32];
    td_sampling_t p = td_sampling_default();
    p.temperature = 1.3f;
    p.repetition_penalty = 1.5f;
    p.presence_penalty = 0.5f;
    for (int variant = 0; variant < 4; variant++) {
        p.top_k = variant == 1 ? 5 : 0;
        p.top_p = variant == 2 ? 0.5f : 1.0f;
        p.min_p = variant == 3 ? 0.2f : 0.0f;
        p.seed = (uint64_t)variant;
        td_sampler_t *s = make(p);
        for (uint32_t step = 0; step < 300; step++) {
            fill_logits(l, V, step, 4.0f);
            random_mask(mask, V, step + 1000u * (uint32_t)variant, 50);
            int32_t t = draw_masked(s, l, V, mask);
            cr_assert(allowed_bit(mask, t), "variant %d step %u: token %d is masked out", variant, step, t);
            cr_assert_eq(td_sampler_accept(s, t), TD_OK);
        }
        td_sampler_destroy(s);
    }
    /* top-k 1 under a mask is greedy over the allowed tokens, penalties included */
    p = td_sampling_default();
    p.temperature = 1.0f;
    p.top_k = 1;
    td_sampler_t *k1 = make(p), *greedy = make(td_sampling_default());
    for (uint32_t seed = 0; seed < 50; seed++) {
        fill_logits(l, V, seed, 2.0f);
        random_mask(mask, V, seed, 9);
        cr_expect_eq(draw_masked(k1, l, V, mask), draw_masked(greedy, l, V, mask));
    }
    td_sampler_destroy(k1);
    td_sampler_destroy(greedy);
}

Test(sampler, masked_distribution_is_the_renormalized_softmax)
{
    enum { V = 8, N = 40000 };
    const float l[V] = {1.0f, 0.5f, 2.0f, -1.0f, 0.0f, 1.5f, 3.0f, 0.2f};
    const uint32_t mask[1] = {0x5du}; /* tokens 0, 2, 3, 4, 6 */
    td_sampling_t p = td_sampling_default();
    p.temperature = 0.8f;
    p.seed = 7;
    td_sampler_t *s = make(p);
    int count[V] = {0};
    for (int i = 0; i < N; i++)
        count[draw_masked(s, l, V, mask)]++;
    double z = 0.0, q[V];
    for (int i = 0; i < V; i++)
        z += q[i] = allowed_bit(mask, i) ? exp(l[i] / 0.8) : 0.0;
    for (int i = 0; i < V; i++) {
        double want = q[i] / z, got = (double)count[i] / N;
        cr_expect(fabs(got - want) < 4.0 * sqrt(want * (1 - want) / N) + 1e-9, "token %d: %.4f, want %.4f", i, got, want);
    }
    td_sampler_destroy(s);
}

Test(sampler, masked_sampling_is_reproducible_and_draws_once_per_token)
{
    enum { V = 1000 };
    static float l[V];
    static uint32_t mask[(V + 31) / 32];
    td_sampling_t p = td_sampling_default();
    p.temperature = 1.0f;
    p.top_p = 0.9f;
    p.seed = 12345;
    td_sampler_t *a = make(p), *b = make(p), *unmasked = make(p), *masked = make(p);
    for (uint32_t step = 0; step < 200; step++) {
        fill_logits(l, V, step, 2.0f);
        random_mask(mask, V, step, 3);
        cr_assert_eq(draw_masked(a, l, V, mask), draw_masked(b, l, V, mask), "step %u", step);
        /* a masked draw advances the PRNG as an unmasked one does: after the same number of
         * draws both samplers give the same unmasked token */
        if (step % 2)
            draw_masked(masked, l, V, mask);
        else
            (void)draw(masked, l, V);
        (void)draw(unmasked, l, V);
    }
    fill_logits(l, V, 999, 2.0f);
    cr_expect_eq(draw(masked, l, V), draw(unmasked, l, V));
    td_sampler_destroy(a);
    td_sampler_destroy(b);
    td_sampler_destroy(unmasked);
    td_sampler_destroy(masked);
}

Test(sampler, a_mask_that_allows_nothing_finite_is_an_error)
{
    float l[64];
    uint32_t mask[2] = {0x1u, 0x0u}; /* token 0 only */
    fill_logits(l, 64, 3, 1.0f);
    l[0] = -INFINITY;
    for (int greedy = 0; greedy < 2; greedy++) {
        td_sampling_t p = td_sampling_default();
        p.temperature = greedy ? 0.0f : 1.0f;
        td_sampler_t *s = make(p);
        int32_t t = -7;
        cr_expect_eq(td_sampler_sample_masked(s, l, 64, mask, &t), TD_ERR_INVALID);
        cr_expect_eq(t, -7, "no output on error");
        cr_expect(strstr(td_last_error(), "mask"), "%s", td_last_error());
        td_sampler_destroy(s);
    }
}

/* OpenAI's logit_bias: +100 forces a token, -100 bans one, greedy or sampled; the bias
 * comes before the mask (a forbidden token stays forbidden however biased) and the penalties
 * see the biased logits; a small bias moves greedy only where it changes the argmax. */
Test(sampler, logit_bias_forces_bans_and_comes_before_the_mask)
{
    enum { V = 4000 };
    static float l[V];
    static uint32_t mask[(V + 31) / 32];
    fill_logits(l, V, 77, 3.0f);
    int32_t best = argmax(l, V), forced = (best + 1234) % V;
    for (int greedy = 0; greedy < 2; greedy++) {
        td_sampling_t p = td_sampling_default();
        p.temperature = greedy ? 0.0f : 1.0f;
        p.seed = 5;
        p.n_logit_bias = 1;
        p.logit_bias_ids[0] = forced;
        p.logit_bias[0] = 100.0f;
        td_sampler_t *s = make(p);
        for (int i = 0; i < 50; i++)
            cr_expect_eq(draw(s, l, V), forced, "+100 forces token %d (greedy %d)", forced, greedy);
        td_sampler_destroy(s);

        p.logit_bias_ids[0] = best; /* the most likely token banned */
        p.logit_bias[0] = -100.0f;
        s = make(p);
        for (int i = 0; i < 200; i++)
            cr_expect_neq(draw(s, l, V), best, "-100 bans token %d (greedy %d)", best, greedy);
        td_sampler_destroy(s);
    }
    /* greedy: the argmax of logits + bias, a second one on the runner-up flips it */
    float second = -INFINITY;
    int32_t runner = -1;
    for (int32_t i = 0; i < V; i++)
        if (i != best && l[i] > second)
            second = l[i], runner = i;
    td_sampling_t p = td_sampling_default();
    p.n_logit_bias = 1;
    p.logit_bias_ids[0] = runner;
    p.logit_bias[0] = (l[best] - second) * 0.5f;
    td_sampler_t *s = make(p);
    cr_expect_eq(draw(s, l, V), best, "half the gap does not flip greedy");
    td_sampler_destroy(s);
    p.logit_bias[0] = (l[best] - second) + 0.01f;
    s = make(p);
    cr_expect_eq(draw(s, l, V), runner, "past the gap flips greedy to the biased token");
    td_sampler_destroy(s);

    /* before the mask: +100 on a forbidden token does not revive it */
    random_mask(mask, V, 9, 3);
    int32_t banned = 0;
    while (allowed_bit(mask, banned))
        banned++;
    p = td_sampling_default();
    p.n_logit_bias = 1;
    p.logit_bias_ids[0] = banned;
    p.logit_bias[0] = 100.0f;
    s = make(p);
    cr_expect(allowed_bit(mask, draw_masked(s, l, V, mask)), "a biased forbidden token stays forbidden");
    td_sampler_destroy(s);

    /* before the penalties: the repetition penalty divides the biased logit. Token 0 (logit
     * 1, in the window, bias +3) against token 1 (logit 2.5): (1 + 3) / 2 = 2 loses; a bias
     * added after the penalty (1 / 2 + 3 = 3.5) would win */
    float two[2] = {1.0f, 2.5f};
    p = td_sampling_default();
    p.repetition_penalty = 2.0f;
    p.n_logit_bias = 1;
    p.logit_bias_ids[0] = 0;
    p.logit_bias[0] = 3.0f;
    s = make(p);
    td_sampler_accept_prompt(s, 0);
    cr_expect_eq(draw(s, two, 2), 1, "the penalty applies to the biased logit");
    td_sampler_destroy(s);
}

Test(sampler, logit_bias_checked)
{
    td_sampling_t p = td_sampling_default();
    char why[160];
    p.n_logit_bias = 2;
    p.logit_bias_ids[0] = 3, p.logit_bias[0] = 100.0f;
    p.logit_bias_ids[1] = 40000, p.logit_bias[1] = -100.0f;
    cr_expect(td_sampling_check_bias(&p, 0, why, sizeof why), "%s", why);
    cr_expect_eq(td_sampling_validate(&p, NULL, 0), TD_OK);
    cr_expect(!td_sampling_check_bias(&p, 32000, why, sizeof why), "id past a vocabulary of 32000");
    cr_expect(strstr(why, "token 40000 is outside the vocabulary (32000 ids)"), "%s", why);
    p.logit_bias[1] = 100.5f;
    cr_expect_eq(td_sampling_validate(&p, why, sizeof why), TD_ERR_INVALID);
    cr_expect(strstr(why, "out of range [-100, 100]"), "%s", why);
    p.logit_bias[1] = NAN;
    cr_expect(!td_sampling_check_bias(&p, 0, NULL, 0), "NaN");
    p.logit_bias[1] = 1.0f, p.logit_bias_ids[1] = 3;
    cr_expect(!td_sampling_check_bias(&p, 0, why, sizeof why));
    cr_expect(strstr(why, "twice"), "%s", why);
    p.n_logit_bias = -1;
    cr_expect(!td_sampling_check_bias(&p, 0, why, sizeof why));
    cr_expect(strstr(why, "differ in length"), "%s", why);
    p.n_logit_bias = TD_SAMPLING_MAX_LOGIT_BIAS + 1;
    cr_expect(!td_sampling_check_bias(&p, 0, why, sizeof why));
}

Test(sampler, logprobs_match_log_softmax_and_a_full_sort)
{
    enum { V = 3000 };
    float *l = malloc(V * sizeof *l);
    double *ref = malloc(V * sizeof *ref);
    int32_t *order = malloc(V * sizeof *order);
    cr_assert(l && ref && order);
    for (int c = 0; c < 4; c++) {
        fill_logits(l, V, (uint32_t)(77 + c), c == 3 ? 60.0f : 8.0f); /* 60: differences past -87 */
        l[5] = NAN;
        l[9] = -INFINITY;
        l[100] = l[101] = l[argmax(l, V)]; /* ties at the top: lower id first */
        double mx = -INFINITY, sum = 0.0;
        for (int32_t i = 0; i < V; i++)
            if (!isnan(l[i]))
                mx = fmax(mx, l[i]);
        for (int32_t i = 0; i < V; i++)
            if (!isnan(l[i]))
                sum += exp((double)l[i] - mx);
        for (int32_t i = 0; i < V; i++)
            ref[i] = isnan(l[i]) ? -INFINITY : (double)l[i] - mx - log(sum);
        /* full selection sort by (logprob desc, id asc) of the first 20 */
        for (int32_t i = 0; i < V; i++)
            order[i] = i;
        for (int32_t i = 0; i < TD_LOGPROBS_MAX_TOP; i++)
            for (int32_t j = i + 1; j < V; j++)
                if (ref[order[j]] > ref[order[i]] || (ref[order[j]] == ref[order[i]] && order[j] < order[i])) {
                    int32_t t = order[i];
                    order[i] = order[j];
                    order[j] = t;
                }
        const int32_t n_tops[] = { 0, 1, 5, TD_LOGPROBS_MAX_TOP };
        int32_t tok = (int32_t)(c * 711 + 3) % V;
        td_token_logprob_t lp;
        cr_assert_eq(td_sampler_logprobs(l, V, tok, n_tops[c], &lp), TD_OK, "%s", td_last_error());
        cr_assert_eq(lp.token, tok);
        cr_assert(fabs(lp.logprob - ref[tok]) < 1e-5 * fmax(1.0, fabs(ref[tok])), "%g vs %g", lp.logprob, ref[tok]);
        cr_assert_eq(lp.n_top, n_tops[c]);
        for (int32_t i = 0; i < lp.n_top; i++) {
            cr_assert_eq(lp.top[i].token, order[i], "case %d rank %d", c, i);
            cr_assert(fabs(lp.top[i].logprob - ref[order[i]]) < 1e-5, "rank %d", i);
        }
        cr_assert_eq(td_sampler_logprobs(l, V, 5, 0, &lp), TD_OK);
        cr_assert(isinf(lp.logprob) && lp.logprob < 0, "a NaN logit has logprob -inf");
    }
    /* probabilities sum to 1 */
    float small[4] = { 0.1f, -2.0f, 3.0f, 1.0f };
    double total = 0.0;
    for (int32_t t = 0; t < 4; t++) {
        td_token_logprob_t lp;
        cr_assert_eq(td_sampler_logprobs(small, 4, t, 4, &lp), TD_OK);
        total += exp(lp.logprob);
        cr_assert_eq(lp.top[0].token, 2);
    }
    cr_assert(fabs(total - 1.0) < 1e-6);
    /* bad arguments are errors, not crashes */
    td_token_logprob_t lp;
    float none[3] = { NAN, -INFINITY, NAN };
    cr_assert_eq(td_sampler_logprobs(none, 3, 0, 1, &lp), TD_ERR_INVALID);
    cr_assert_eq(td_sampler_logprobs(small, 4, 4, 1, &lp), TD_ERR_INVALID);
    cr_assert_eq(td_sampler_logprobs(small, 4, -1, 1, &lp), TD_ERR_INVALID);
    cr_assert_eq(td_sampler_logprobs(small, 4, 0, TD_LOGPROBS_MAX_TOP + 1, &lp), TD_ERR_INVALID);
    cr_assert_eq(td_sampler_logprobs(small, 0, 0, 1, &lp), TD_ERR_INVALID);
    free(l);
    free(ref);
    free(order);
}

/* ---- stop strings ------------------------------------------------------------------ */

typedef struct sink {
    char out[512];
    size_t len;
} sink_t;

/* Feeds one piece; appends what may be emitted; returns the match index or -1. */
static int32_t feed(td_stop_t *m, sink_t *k, const char *piece)
{
    td_stop_result_t r;
    cr_assert_eq(td_stop_feed(m, piece, strlen(piece), &r), TD_OK);
    memcpy(k->out + k->len, r.emit, r.emit_len);
    k->len += r.emit_len;
    k->out[k->len] = '\0';
    cr_assert_eq(r.matched, r.which >= 0);
    return r.which;
}

Test(stop, match_across_token_boundaries)
{
    const char *stops[] = { "</s>", "STOP" };
    td_stop_t *m = NULL;
    cr_assert_eq(td_stop_create(stops, 2, &m), TD_OK);
    sink_t k = { .len = 0 };
    cr_assert_eq(feed(m, &k, "Hello <"), -1);
    cr_assert_str_eq(k.out, "Hello ");
    cr_assert_eq(td_stop_held(m), 1);
    cr_assert_eq(feed(m, &k, "/"), -1);
    cr_assert_eq(feed(m, &k, "s"), -1);
    cr_assert_str_eq(k.out, "Hello "); /* "</s" held back */
    cr_assert_eq(td_stop_held(m), 3);
    cr_assert_eq(feed(m, &k, ">tail"), 0);
    cr_assert_str_eq(k.out, "Hello "); /* neither the stop string nor what follows */
    td_stop_result_t r;
    cr_assert_eq(td_stop_feed(m, "x", 1, &r), TD_ERR_INVALID);
    td_stop_destroy(m);
}

Test(stop, hold_back_is_released_when_it_cannot_match)
{
    const char *stops[] = { "STOP" };
    td_stop_t *m = NULL;
    cr_assert_eq(td_stop_create(stops, 1, &m), TD_OK);
    sink_t k = { .len = 0 };
    cr_assert_eq(feed(m, &k, "go ST"), -1);
    cr_assert_str_eq(k.out, "go ");
    cr_assert_eq(feed(m, &k, "O"), -1);
    cr_assert_str_eq(k.out, "go ");
    cr_assert_eq(feed(m, &k, "P"), 0);
    td_stop_destroy(m);

    cr_assert_eq(td_stop_create(stops, 1, &m), TD_OK);
    k.len = 0;
    cr_assert_eq(feed(m, &k, "STO"), -1);
    cr_assert_eq(feed(m, &k, "RE S"), -1);
    cr_assert_str_eq(k.out, "STORE ");
    cr_assert_eq(feed(m, &k, "ST"), -1); /* "SST": only "ST" can still start STOP */
    cr_assert_str_eq(k.out, "STORE S");
    const char *rest;
    size_t rest_len;
    td_stop_flush(m, &rest, &rest_len);
    cr_assert_eq(rest_len, 2);
    cr_assert_eq(memcmp(rest, "ST", 2), 0);
    cr_assert_eq(td_stop_held(m), 0);
    td_stop_destroy(m);
}

Test(stop, earliest_match_and_overlaps)
{
    const char *stops[] = { "yz", "xyz", "abab" };
    td_stop_t *m = NULL;
    cr_assert_eq(td_stop_create(stops, 3, &m), TD_OK);
    sink_t k = { .len = 0 };
    cr_assert_eq(feed(m, &k, "1x"), -1);
    cr_assert_eq(feed(m, &k, "y"), -1);
    cr_assert_eq(feed(m, &k, "z2"), 1); /* xyz starts before yz */
    cr_assert_str_eq(k.out, "1");
    td_stop_destroy(m);

    cr_assert_eq(td_stop_create(stops, 3, &m), TD_OK);
    k.len = 0;
    k.out[0] = '\0';
    cr_assert_eq(feed(m, &k, "aba"), -1);
    cr_assert_eq(td_stop_held(m), 3);
    cr_assert_eq(feed(m, &k, "ba"), 2); /* "ababa": abab at 0 */
    cr_assert_str_eq(k.out, "");
    td_stop_destroy(m);
}

Test(stop, one_token_holding_text_and_the_stop)
{
    const char *stops[] = { "\n\n" };
    td_stop_t *m = NULL;
    cr_assert_eq(td_stop_create(stops, 1, &m), TD_OK);
    sink_t k = { .len = 0 };
    cr_assert_eq(feed(m, &k, "line\n"), -1);
    cr_assert_str_eq(k.out, "line");
    cr_assert_eq(feed(m, &k, "more\n\nrest"), 0);
    cr_assert_str_eq(k.out, "line\nmore");
    td_stop_destroy(m);
}

Test(stop, no_stop_strings_and_limits)
{
    td_stop_t *m = NULL;
    const char *empty[] = { "" };
    cr_assert_eq(td_stop_create(empty, 1, &m), TD_OK);
    sink_t k = { .len = 0 };
    cr_assert_eq(feed(m, &k, "anything"), -1);
    cr_assert_str_eq(k.out, "anything");
    cr_assert_eq(td_stop_held(m), 0);
    td_stop_destroy(m);

    const char *many[TD_STOP_MAX_STRINGS + 1];
    for (int i = 0; i <= TD_STOP_MAX_STRINGS; i++)
        many[i] = "x";
    cr_assert_eq(td_stop_create(many, TD_STOP_MAX_STRINGS + 1, &m), TD_ERR_INVALID);
    static char longs[TD_STOP_MAX_LEN + 2];
    memset(longs, 'a', TD_STOP_MAX_LEN + 1);
    const char *one[] = { longs };
    cr_assert_eq(td_stop_create(one, 1, &m), TD_ERR_INVALID);
    td_stop_destroy(NULL);
}
