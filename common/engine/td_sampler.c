/*
 * td_sampler: per-sequence token sampling and stop-string matching (contract in
 * td_sampler.h).
 *
 * The hot path touches the whole vocabulary a small constant number of times (copy with
 * penalty, one pass for top-k or for the softmax) and sorts only what it must: top-k keeps
 * a k-entry heap, and top-p without top-k sorts only the tokens above a probability
 * threshold that is lowered until they cover top_p (the nucleus is always inside that set,
 * so the result equals a full sort's).
 */
#include "td_sampler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_hash.h"
#include "td_rng.h"
#include "td_util.h"

/* ---- parameters ------------------------------------------------------------------- */

td_sampling_t td_sampling_default(void)
{
    return (td_sampling_t){
#define TD_SAMPLING_DEFAULT(ID, ctype, field, def, ...) .field = def,
        TD_SAMPLING_FIELDS(TD_SAMPLING_DEFAULT)
#undef TD_SAMPLING_DEFAULT
    };
}

#define TD_SAMPLING_TYPE_OF(ctype) _Generic((ctype)0, float: TD_SAMPLING_F32, int32_t: TD_SAMPLING_I32, \
                                           uint64_t: TD_SAMPLING_U64)

static const td_sampling_field_desc_t field_descs[TD_SAMPLING_FIELD_END] = {
#define TD_SAMPLING_DESC(ID, ctype, field, def, ...)                                                 \
    [TD_SAMPLING_FIELD_##ID] = {.id = TD_SAMPLING_FIELD_##ID, .name = #field, .type = TD_SAMPLING_TYPE_OF(ctype), \
                                .offset = offsetof(td_sampling_t, field), __VA_ARGS__},
    TD_SAMPLING_FIELDS(TD_SAMPLING_DESC)
#undef TD_SAMPLING_DESC
};

const td_sampling_field_desc_t *td_sampling_field_desc(td_sampling_field_t f)
{
    return f > TD_SAMPLING_FIELD_NONE && f < TD_SAMPLING_FIELD_END ? &field_descs[f] : NULL;
}

/* d's value in *s as a double: exact for every float and int32_t, and for a uint64_t
 * only compared against a range that holds them all */
static double field_value(const td_sampling_t *s, const td_sampling_field_desc_t *d)
{
    const void *v = (const char *)s + d->offset;
    switch (d->type) {
    case TD_SAMPLING_F32: return *(const float *)v;
    case TD_SAMPLING_I32: return *(const int32_t *)v;
    case TD_SAMPLING_U64: return (double)*(const uint64_t *)v;
    }
    return NAN;
}

/* A range's end: a float's in %g, an integer's as an integer. */
static void bound(const td_sampling_field_desc_t *d, double x, char *buf, size_t cap)
{
    if (d->type == TD_SAMPLING_F32)
        snprintf(buf, cap, "%g", x);
    else
        snprintf(buf, cap, "%.0f", x);
}

/* "top_p -0.5 is out of range (0, 1] (1 = off)" */
static void out_of_range(const td_sampling_t *s, const td_sampling_field_desc_t *d, char *msg, size_t cap)
{
    const void *v = (const char *)s + d->offset;
    char val[32], lo[32], hi[32];
    if (d->type == TD_SAMPLING_F32)
        snprintf(val, sizeof val, "%g", (double)*(const float *)v);
    else if (d->type == TD_SAMPLING_I32)
        snprintf(val, sizeof val, "%d", *(const int32_t *)v);
    else
        snprintf(val, sizeof val, "%llu", (unsigned long long)*(const uint64_t *)v);
    bound(d, d->lo, lo, sizeof lo);
    bound(d, d->hi, hi, sizeof hi);
    snprintf(msg, cap, "%s %s is out of range %c%s, %s%c%s%s%s", d->name, val, d->lo_open ? '(' : '[', lo, hi,
             d->hi_open ? ')' : ']', d->note ? " (" : "", d->note ? d->note : "", d->note ? ")" : "");
}

td_sampling_field_t td_sampling_check(const td_sampling_t *s, char *why, size_t why_cap)
{
    for (int f = TD_SAMPLING_FIELD_NONE + 1; f < TD_SAMPLING_FIELD_END; f++) {
        const td_sampling_field_desc_t *d = &field_descs[f];
        double v = field_value(s, d);
        bool in = isfinite(v) && v >= d->lo && v <= d->hi && !(d->lo_open && v == d->lo) &&
                  !(d->hi_open && v == d->hi);
        if (in)
            continue;
        if (why && why_cap > 0)
            out_of_range(s, d, why, why_cap);
        return d->id;
    }
    return TD_SAMPLING_FIELD_NONE;
}

bool td_sampling_check_bias(const td_sampling_t *s, int32_t vocab, char *why, size_t why_cap)
{
    char msg[160];
    msg[0] = 0;
    if (s->n_logit_bias < 0) {
        snprintf(msg, sizeof msg, "logit_bias_ids and logit_bias differ in length: one bias per id");
    } else if (s->n_logit_bias > TD_SAMPLING_MAX_LOGIT_BIAS) {
        snprintf(msg, sizeof msg, "logit_bias has %d entries, at most %d allowed", s->n_logit_bias,
                 TD_SAMPLING_MAX_LOGIT_BIAS);
    } else {
        for (int32_t i = 0; i < s->n_logit_bias && !msg[0]; i++) {
            int32_t id = s->logit_bias_ids[i];
            float b = s->logit_bias[i];
            if (id < 0 || (vocab > 0 && id >= vocab))
                snprintf(msg, sizeof msg, "logit_bias token %lld is outside the vocabulary (%d ids)",
                         id < 0 ? (long long)(uint32_t)id : (long long)id, vocab);
            else if (!isfinite(b) || b < -TD_SAMPLING_MAX_BIAS || b > TD_SAMPLING_MAX_BIAS)
                snprintf(msg, sizeof msg, "logit_bias of token %d is %g, out of range [-%g, %g]", id, (double)b,
                         (double)TD_SAMPLING_MAX_BIAS, (double)TD_SAMPLING_MAX_BIAS);
            for (int32_t j = 0; j < i && !msg[0]; j++) /* 300 entries: 45k compares at most */
                if (s->logit_bias_ids[j] == id)
                    snprintf(msg, sizeof msg, "logit_bias names token %d twice", id);
        }
    }
    if (!msg[0])
        return true;
    if (why && why_cap > 0)
        snprintf(why, why_cap, "%s", msg);
    return false;
}

td_status_t td_sampling_validate(const td_sampling_t *s, char *why, size_t why_cap)
{
    char msg[256];
    if (td_sampling_check(s, msg, sizeof msg) == TD_SAMPLING_FIELD_NONE && td_sampling_check_bias(s, 0, msg, sizeof msg))
        return TD_OK;
    if (why && why_cap > 0)
        snprintf(why, why_cap, "%s", msg);
    return td_errorf_quiet(TD_ERR_INVALID, "%s", msg);
}

/* ---- PRNG: td_rng's xoshiro256** seeded by splitmix64 ------------------------------ */

/* Uniform in [0, 1) with 53 random bits. */
static double uniform01(uint64_t s[4])
{
    return (double)(td_xoshiro256ss(s) >> 11) * 0x1.0p-53;
}

/* ---- sampler ---------------------------------------------------------------------- */

typedef struct cand {
    float v;    /* penalized logit, then probability */
    int32_t id; /* token id */
} cand_t;

struct td_sampler {
    td_sampling_t p;
    uint64_t rng[4];

    int32_t *window;       /* [p.penalty_window] ring of recent tokens */
    int32_t window_len;    /* valid entries */
    int32_t window_pos;    /* next write */
    int32_t *window_sort;  /* [p.penalty_window] scratch to apply the penalty once per id */
    bool counting;         /* presence or frequency penalty set: counts is live */
    td_hash_t counts;      /* generated token id -> times generated (0 after a reset) */

    float *val;            /* [cap] penalized logits of the whole vocabulary */
    cand_t *cand;          /* [cap] candidates */
    int32_t cap;
};

static void seed_rng(td_sampler_t *s)
{
    uint64_t x = s->p.seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = td_splitmix64(&x);
}

td_status_t td_sampler_create(const td_sampling_t *params, td_sampler_t **sampler_p)
{
    /* checked at the process's edge (td_sampling_validate) and not again: a precondition */
    TD_ASSERT(td_sampling_check(params, NULL, 0) == TD_SAMPLING_FIELD_NONE && td_sampling_check_bias(params, 0, NULL, 0));
    td_sampler_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_errorf(TD_ERR_NOMEM, "sampler: out of memory");
    s->p = *params;
    if (s->p.penalty_window > 0) {
        s->window = malloc((size_t)s->p.penalty_window * sizeof *s->window);
        s->window_sort = malloc((size_t)s->p.penalty_window * sizeof *s->window_sort);
        if (!s->window || !s->window_sort) {
            td_sampler_destroy(s);
            return td_errorf(TD_ERR_NOMEM, "sampler: out of memory for a %d-token window",
                             params->penalty_window);
        }
    }
    s->counting = s->p.presence_penalty != 0.0f || s->p.frequency_penalty != 0.0f;
    if (s->counting && td_hash_init(&s->counts, 64) != TD_OK) {
        td_sampler_destroy(s);
        return td_errorf(TD_ERR_NOMEM, "sampler: out of memory for the generated-token counts");
    }
    seed_rng(s);
    *sampler_p = s;
    return TD_OK;
}

void td_sampler_destroy(td_sampler_t *sampler)
{
    if (!sampler)
        return;
    free(sampler->window);
    free(sampler->window_sort);
    td_hash_free(&sampler->counts);
    free(sampler->val);
    free(sampler->cand);
    free(sampler);
}

const td_sampling_t *td_sampler_params(const td_sampler_t *sampler)
{
    return &sampler->p;
}

void td_sampler_accept_prompt(td_sampler_t *sampler, int32_t token)
{
    if (sampler->p.penalty_window == 0)
        return;
    sampler->window[sampler->window_pos] = token;
    sampler->window_pos = (sampler->window_pos + 1) % sampler->p.penalty_window;
    if (sampler->window_len < sampler->p.penalty_window)
        sampler->window_len++;
}

td_status_t td_sampler_accept(td_sampler_t *sampler, int32_t token)
{
    td_sampler_accept_prompt(sampler, token);
    if (!sampler->counting || token < 0)
        return TD_OK;
    td_hash_slot_t *c = td_hash_find(&sampler->counts, (uint64_t)token);
    if (c) {
        c->value++;
        return TD_OK;
    }
    if (td_hash_put(&sampler->counts, (uint64_t)token, 1) != TD_OK)
        return td_errorf(TD_ERR_NOMEM, "sampler: out of memory for %zu generated-token counts",
                         sampler->counts.n + 1);
    return TD_OK;
}

void td_sampler_reset(td_sampler_t *sampler)
{
    sampler->window_len = 0;
    sampler->window_pos = 0;
    TD_HASH_FOREACH(c, &sampler->counts)
        c->value = 0; /* kept as zero counts: no allocation when counting starts again */
    seed_rng(sampler);
}

static td_status_t ensure_scratch(td_sampler_t *s, int32_t vocab)
{
    if (vocab <= s->cap)
        return TD_OK;
    float *val = malloc((size_t)vocab * sizeof *val);
    cand_t *cand = malloc((size_t)vocab * sizeof *cand);
    if (!val || !cand) {
        free(val);
        free(cand);
        return td_errorf(TD_ERR_NOMEM, "sampler: out of memory for a vocabulary of %d", vocab);
    }
    free(s->val);
    free(s->cand);
    s->val = val;
    s->cand = cand;
    s->cap = vocab;
    return TD_OK;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Higher value first, lower id on ties: a total order, so results never depend on qsort's
 * handling of equal keys. */
static int cmp_cand_desc(const void *a, const void *b)
{
    const cand_t *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* True when a ranks below b in cmp_cand_desc's order. */
static inline bool cand_worse(const cand_t *a, const cand_t *b)
{
    return a->v < b->v || (a->v == b->v && a->id > b->id);
}

/* OpenAI's presence and frequency penalties over the generated counts: one subtraction
 * per distinct generated id, O(distinct ids). */
static void openai_penalties(td_sampler_t *s, int32_t vocab)
{
    const float pres = s->p.presence_penalty, freq = s->p.frequency_penalty;
    TD_HASH_FOREACH(c, &s->counts) {
        if (c->value == 0 || c->hash >= (uint64_t)vocab)
            continue;
        s->val[c->hash] -= pres + freq * (float)c->value;
    }
}

/* Copies the logits with NaN as -inf and the mask applied, adds the logit bias (ids past this
 * vocabulary, which the node refused at admission, are skipped), and the repetition penalty once to every
 * distinct token of the window: positive logits are divided, negative ones multiplied
 * (CTRL, Keskar et al. 2019), so a penalty > 1 always makes the token less likely; then
 * the presence and frequency penalties. */
static void penalized_logits(td_sampler_t *s, const float *logits, int32_t vocab, const uint32_t *allowed)
{
    float *val = s->val;
    if (!allowed) {
        for (int32_t i = 0; i < vocab; i++)
            val[i] = isnan(logits[i]) ? -INFINITY : logits[i];
    } else { /* the mask first, nothing after it sees a forbidden token; a word at a time, as a
                grammar's mask is mostly zero words, whose logits are not even read */
        for (int32_t w = 0; w * 32 < vocab; w++) {
            uint32_t bits = allowed[w];
            int32_t i0 = w * 32, n = vocab - i0 < 32 ? vocab - i0 : 32;
            if (bits == 0) {
                for (int32_t i = 0; i < n; i++)
                    val[i0 + i] = -INFINITY;
            } else {
                for (int32_t i = 0; i < n; i++)
                    val[i0 + i] = ((bits >> i) & 1) && !isnan(logits[i0 + i]) ? logits[i0 + i] : -INFINITY;
            }
        }
    }
    /* the client's bias, on the model's logits, before the penalties (a forbidden token's
     * -inf stays -inf: the grammar wins over any bias) */
    for (int32_t i = 0; i < s->p.n_logit_bias; i++)
        if (s->p.logit_bias_ids[i] < vocab)
            val[s->p.logit_bias_ids[i]] += s->p.logit_bias[i];
    const float pen = s->p.repetition_penalty;
    if (pen != 1.0f && s->window_len > 0) {
        memcpy(s->window_sort, s->window, (size_t)s->window_len * sizeof *s->window);
        qsort(s->window_sort, (size_t)s->window_len, sizeof *s->window_sort, cmp_i32);
        for (int32_t i = 0; i < s->window_len; i++) {
            int32_t t = s->window_sort[i];
            if ((i > 0 && t == s->window_sort[i - 1]) || t < 0 || t >= vocab)
                continue;
            val[t] = val[t] > 0.0f ? val[t] / pen : val[t] * pen;
        }
    }
    if (s->counting)
        openai_penalties(s, vocab);
}

/* Offers c to a k-entry min-heap h[0..*n) (root = worst kept): kept while fewer than k
 * are held or when it beats the root. O(log k). */
static void heap_offer(cand_t *h, int32_t *n, int32_t k, cand_t c)
{
    int32_t j;
    if (*n < k) {
        j = (*n)++; /* sift up */
        while (j > 0 && cand_worse(&c, &h[(j - 1) / 2])) {
            h[j] = h[(j - 1) / 2];
            j = (j - 1) / 2;
        }
        h[j] = c;
    } else if (cand_worse(&h[0], &c)) {
        j = 0; /* replace the root, sift down */
        for (;;) {
            int32_t l = 2 * j + 1, m = j;
            const cand_t *mv = &c;
            if (l < *n && cand_worse(&h[l], mv)) {
                m = l;
                mv = &h[l];
            }
            if (l + 1 < *n && cand_worse(&h[l + 1], mv))
                m = l + 1;
            if (m == j)
                break;
            h[j] = h[m];
            j = m;
        }
        h[j] = c;
    }
}

/* The k best of val[0..vocab) into cand[0..k), sorted best first: O(vocab log k). */
static int32_t select_top_k(td_sampler_t *s, int32_t vocab, int32_t k)
{
    cand_t *h = s->cand;
    int32_t n = 0;
    for (int32_t i = 0; i < vocab; i++)
        if (s->val[i] != -INFINITY)
            heap_offer(h, &n, k, (cand_t){ s->val[i], i });
    qsort(h, (size_t)n, sizeof *h, cmp_cand_desc);
    return n;
}

/* Moves the entries of cand[lo..hi) that rank before cand[piv] (cmp_cand_desc order) to
 * the front, then the pivot; returns the pivot's new index and their mass in *mass_p. */
static int32_t partition_desc(cand_t *cand, int32_t lo, int32_t hi, int32_t piv, double *mass_p)
{
    cand_t pv = cand[piv];
    cand[piv] = cand[hi - 1];
    cand[hi - 1] = pv;
    int32_t m = lo;
    double mass = 0.0;
    for (int32_t i = lo; i < hi - 1; i++) {
        if (cand_worse(&pv, &cand[i])) {
            cand_t c = cand[i];
            cand[i] = cand[m];
            cand[m++] = c;
            mass += c.v;
        }
    }
    cand[hi - 1] = cand[m];
    cand[m] = pv;
    *mass_p = mass;
    return m;
}

/*
 * Nucleus filter: keeps the smallest set of most likely tokens whose mass reaches
 * top_p * total (weights need not be normalized) and returns its size (>= 1). If cand is
 * sorted best first, a walk. Otherwise a quickselect on mass, O(n) expected: the kept
 * tokens end up in cand[0..k) in no particular (but deterministic) order, which is all a
 * draw needs; no full sort of a large vocabulary.
 */
static int32_t apply_top_p(cand_t *cand, int32_t n, bool sorted, double total, float top_p)
{
    const double target = (double)top_p * total;
    int32_t lo = 0, hi = n;
    double above = 0.0; /* mass of cand[0..lo), all in the nucleus */
    if (!sorted) {
        while (hi - lo > 32) {
            int32_t a = lo, b = lo + (hi - lo) / 2, c = hi - 1, piv; /* median of three */
            if (cand_worse(&cand[a], &cand[b]))
                piv = cand_worse(&cand[b], &cand[c]) ? b : (cand_worse(&cand[a], &cand[c]) ? c : a);
            else
                piv = cand_worse(&cand[a], &cand[c]) ? a : (cand_worse(&cand[b], &cand[c]) ? c : b);
            double front;
            int32_t m = partition_desc(cand, lo, hi, piv, &front);
            if (above + front >= target) {
                hi = m; /* the nucleus ends before the pivot */
            } else if (above + front + cand[m].v >= target) {
                return m + 1; /* ... exactly at the pivot */
            } else {
                above += front + cand[m].v;
                lo = m + 1;
            }
        }
        qsort(cand + lo, (size_t)(hi - lo), sizeof *cand, cmp_cand_desc);
    }
    double cum = above;
    for (int32_t i = lo; i < hi; i++) {
        cum += cand[i].v;
        if (cum >= target)
            return i + 1;
    }
    return TD_MAX(hi, 1);
}

td_status_t td_sampler_sample(td_sampler_t *sampler, const float *logits, int32_t vocab,
                              int32_t *token_p)
{
    return td_sampler_sample_masked(sampler, logits, vocab, NULL, token_p);
}

/* "none of the 49152 logits is finite", or under a mask, that nothing allowed is */
static td_status_t no_candidate(int32_t vocab, const uint32_t *allowed)
{
    if (allowed)
        return td_errorf(TD_ERR_INVALID, "sampler: the mask allows no token with a finite logit (of %d): "
                         "the grammar allows no token here, or the model's logits are NaN or Inf", vocab);
    return td_errorf(TD_ERR_INVALID, "sampler: none of the %d logits is finite (are the model's weights NaN or Inf?)", vocab);
}

td_status_t td_sampler_sample_masked(td_sampler_t *sampler, const float *logits, int32_t vocab,
                                     const uint32_t *allowed, int32_t *token_p)
{
    td_sampler_t *s = sampler;
    if (vocab <= 0)
        return td_errorf(TD_ERR_INVALID, "sampler: vocabulary size %d", vocab);
    td_status_t st = ensure_scratch(s, vocab);
    if (st != TD_OK)
        return st;
    penalized_logits(s, logits, vocab, allowed);
    const float *val = s->val;

    if (s->p.temperature == 0.0f) {
        int32_t best = 0;
        for (int32_t i = 1; i < vocab; i++)
            if (val[i] > val[best])
                best = i;
        if (val[best] == -INFINITY)
            return no_candidate(vocab, allowed);
        *token_p = best;
        return TD_OK;
    }

    /* candidates: the top k, or every token with a finite logit */
    cand_t *cand = s->cand;
    int32_t n;
    bool sorted = false;
    if (s->p.top_k > 0 && s->p.top_k < vocab) {
        n = select_top_k(s, vocab, s->p.top_k);
        sorted = true;
    } else {
        n = 0;
        for (int32_t i = 0; i < vocab; i++)
            if (val[i] != -INFINITY)
                cand[n++] = (cand_t){ val[i], i };
    }
    if (n == 0)
        return no_candidate(vocab, allowed);

    /* temperature + softmax, left unnormalized: v becomes exp((logit - max) / T), so the
     * most likely token has weight 1 and probabilities are v / total */
    float v_max = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        v_max = TD_MAX(v_max, cand[i].v);
    const float inv_t = 1.0f / s->p.temperature;
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) {
        cand[i].v = expf((cand[i].v - v_max) * inv_t);
        total += cand[i].v;
    }

    if (s->p.top_p < 1.0f)
        n = apply_top_p(cand, n, sorted, total, s->p.top_p);
    if (s->p.min_p > 0.0f) {
        const float floor_w = s->p.min_p; /* min_p * p_max, in weights where p_max is 1 */
        int32_t m = 0;
        for (int32_t i = 0; i < n; i++)
            if (cand[i].v >= floor_w)
                cand[m++] = cand[i];
        n = m; /* the most likely token (weight 1) always survives: min_p < 1 */
    }

    /* draw: one uniform per token, whatever the filters */
    if (s->p.top_p < 1.0f || s->p.min_p > 0.0f) {
        total = 0.0;
        for (int32_t i = 0; i < n; i++)
            total += cand[i].v;
    }
    double r = uniform01(s->rng) * total, acc = 0.0;
    int32_t pick = cand[n - 1].id;
    for (int32_t i = 0; i < n; i++) {
        acc += cand[i].v;
        if (r < acc) {
            pick = cand[i].id;
            break;
        }
    }
    *token_p = pick;
    return TD_OK;
}

/* ---- log-probabilities ------------------------------------------------------------ */

/* exp(x) for x in [-87, 0] (smaller x is taken as -87: exp(-87) = 1.6e-38, nothing beside a
 * sum >= 1; NaN too), without calls or branches so that a loop of it vectorizes: Cephes'
 * expf (range reduction by ln 2 in two parts, a degree-6 polynomial; relative error about
 * 2e-7), 2^n put together from its bits. With libm's exp in double a row of SmolLM2's
 * 49152 logits took 290 us of td_sampler_logprobs, with this 60 us (a 4096-token prompt's
 * logprobs: 0.25 s instead of 1.2 s). */
static inline float exp_le0(float x)
{
    x = x >= -87.0f ? x : -87.0f;
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float t = x * 1.44269504088896341f + magic;
    float n = t - magic;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t ti, mi;
    memcpy(&ti, &t, sizeof ti);
    memcpy(&mi, &magic, sizeof mi);
    int32_t bits = (ti - mi + 127) << 23; /* 2^n, n in [-126, 0] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* sum_i exp(l[i] - mx) over l[0..n) (NaN and -inf count as 0), 16 float lanes of 16 terms
 * each flushed into a double: the loop vectorizes, the sum keeps double's precision. */
static double sum_exp(const float *l, int32_t n, float mx)
{
    enum { LANES = 16, BLOCK = 16 * LANES };
    double sum = 0.0;
    int32_t i = 0;
    for (; i + BLOCK <= n; i += BLOCK) {
        float acc[LANES] = {0};
        for (int32_t k = 0; k < BLOCK; k += LANES)
            for (int32_t j = 0; j < LANES; j++)
                acc[j] += exp_le0(l[i + k + j] - mx);
        for (int32_t j = 0; j < LANES; j++)
            sum += acc[j];
    }
    for (; i < n; i++)
        sum += exp_le0(l[i] - mx);
    return sum;
}

td_status_t td_sampler_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t n_top,
                                td_token_logprob_t *out_p)
{
    if (vocab <= 0 || token < 0 || token >= vocab || n_top < 0 || n_top > TD_LOGPROBS_MAX_TOP)
        return td_errorf(TD_ERR_INVALID, "logprobs: token %d of a vocabulary of %d, %d alternatives "
                         "(at most %d)", token, vocab, n_top, TD_LOGPROBS_MAX_TOP);
    /* pass 1: the maximum, and the n_top best in a min-heap (root = worst kept; most logits
     * lose to it at the first compare) */
    cand_t h[TD_LOGPROBS_MAX_TOP];
    int32_t n = 0;
    float mx = -INFINITY;
    for (int32_t i = 0; i < vocab; i++) {
        float v = logits[i];
        if (isnan(v) || v == -INFINITY)
            continue;
        mx = TD_MAX(mx, v);
        if (n < n_top || (n_top > 0 && v >= h[0].v))
            heap_offer(h, &n, n_top, (cand_t){ v, i });
    }
    if (mx == -INFINITY || mx == INFINITY)
        return td_errorf(TD_ERR_INVALID, "logprobs: the %d logits have no finite maximum (are the "
                         "model's weights NaN or Inf?)", vocab);
    /* pass 2: the normalizer, log(sum exp(l - max)) + max */
    const double lse = (double)mx + log(sum_exp(logits, vocab, mx));
    qsort(h, (size_t)n, sizeof *h, cmp_cand_desc);
    td_token_logprob_t lp = { .token = token, .n_top = n };
    float lt = logits[token];
    lp.logprob = isnan(lt) ? -INFINITY : (float)((double)lt - lse);
    for (int32_t i = 0; i < n; i++)
        lp.top[i] = (td_top_logprob_t){ .token = h[i].id, .logprob = (float)((double)h[i].v - lse) };
    *out_p = lp;
    return TD_OK;
}

/* ---- stop strings ----------------------------------------------------------------- */

struct td_stop {
    int32_t n;
    char *str[TD_STOP_MAX_STRINGS];
    size_t len[TD_STOP_MAX_STRINGS];
    size_t max_len;

    char *buf;      /* held text, then the newest feed; [0, emitted) already handed out */
    size_t buf_len;
    size_t buf_cap;
    size_t emitted; /* bytes at the front handed out by the last call */
    bool done;      /* a stop string matched */
};

td_status_t td_stop_create(const char *const *stops, int32_t n, td_stop_t **stop_p)
{
    if (n < 0 || n > TD_STOP_MAX_STRINGS)
        return td_errorf(TD_ERR_INVALID, "stop strings: %d given, at most %d allowed", n,
                         TD_STOP_MAX_STRINGS);
    for (int32_t i = 0; i < n; i++)
        if (strlen(stops[i]) > TD_STOP_MAX_LEN)
            return td_errorf(TD_ERR_INVALID, "stop string %d is %zu bytes long, at most %d allowed",
                             i, strlen(stops[i]), TD_STOP_MAX_LEN);
    td_stop_t *m = calloc(1, sizeof *m);
    if (!m)
        return td_errorf(TD_ERR_NOMEM, "stop strings: out of memory");
    for (int32_t i = 0; i < n; i++) {
        size_t len = strlen(stops[i]);
        if (len == 0)
            continue;
        m->str[m->n] = malloc(len);
        if (!m->str[m->n]) {
            td_stop_destroy(m);
            return td_errorf(TD_ERR_NOMEM, "stop strings: out of memory");
        }
        memcpy(m->str[m->n], stops[i], len);
        m->len[m->n] = len;
        m->max_len = TD_MAX(m->max_len, len);
        m->n++;
    }
    *stop_p = m;
    return TD_OK;
}

void td_stop_destroy(td_stop_t *stop)
{
    if (!stop)
        return;
    for (int32_t i = 0; i < stop->n; i++)
        free(stop->str[i]);
    free(stop->buf);
    free(stop);
}

/* Drops what the previous call handed out (its pointer is no longer promised). */
static void stop_compact(td_stop_t *m)
{
    if (m->emitted > 0) {
        memmove(m->buf, m->buf + m->emitted, m->buf_len - m->emitted);
        m->buf_len -= m->emitted;
        m->emitted = 0;
    }
}

/* Length of the longest proper suffix of buf[0..len) that starts some stop string. */
static size_t stop_partial(const td_stop_t *m, const char *buf, size_t len)
{
    size_t k = m->max_len > 0 ? TD_MIN(len, m->max_len - 1) : 0;
    for (; k > 0; k--)
        for (int32_t j = 0; j < m->n; j++)
            if (m->len[j] > k && memcmp(buf + len - k, m->str[j], k) == 0)
                return k;
    return 0;
}

td_status_t td_stop_feed(td_stop_t *stop, const char *text, size_t len, td_stop_result_t *res)
{
    td_stop_t *m = stop;
    if (m->done)
        return td_errorf(TD_ERR_INVALID, "stop strings: text fed after a stop string matched");
    stop_compact(m);
    if (m->buf_len + len > m->buf_cap) {
        size_t cap = m->buf_cap ? m->buf_cap : 256;
        while (cap < m->buf_len + len)
            cap *= 2;
        char *nb = realloc(m->buf, cap);
        if (!nb)
            return td_errorf(TD_ERR_NOMEM, "stop strings: out of memory for %zu bytes", cap);
        m->buf = nb;
        m->buf_cap = cap;
    }
    if (len > 0)
        memcpy(m->buf + m->buf_len, text, len);
    m->buf_len += len;

    /* Earliest complete match. Held text never contains one, so only starts that reach
     * into the new text can complete, but scanning the held part too is cheap and simple. */
    for (size_t i = 0; i < m->buf_len; i++) {
        for (int32_t j = 0; j < m->n; j++) {
            if (m->len[j] <= m->buf_len - i && memcmp(m->buf + i, m->str[j], m->len[j]) == 0) {
                m->done = true;
                m->emitted = m->buf_len; /* nothing more is handed out */
                *res = (td_stop_result_t){ .emit = m->buf, .emit_len = i, .matched = true, .which = j };
                return TD_OK;
            }
        }
    }
    size_t hold = stop_partial(m, m->buf, m->buf_len);
    m->emitted = m->buf_len - hold;
    /* buf is still NULL when only empty text was fed: emit is never NULL, so callers may
     * hand it to fwrite/memcpy whatever its length */
    *res = (td_stop_result_t){ .emit = m->buf ? m->buf : "", .emit_len = m->emitted, .matched = false, .which = -1 };
    return TD_OK;
}

void td_stop_flush(td_stop_t *stop, const char **text_p, size_t *len_p)
{
    if (stop->done) {
        *text_p = "";
        *len_p = 0;
        return;
    }
    stop_compact(stop);
    *text_p = stop->buf ? stop->buf : "";
    *len_p = stop->buf_len;
    stop->emitted = stop->buf_len;
}

size_t td_stop_held(const td_stop_t *stop)
{
    return stop->done ? 0 : stop->buf_len - stop->emitted;
}

void td_sampler_skip(td_sampler_t *sampler, int32_t n_tokens)
{
    if (sampler->p.temperature == 0.0f)
        return; /* greedy draws nothing */
    for (int32_t i = 0; i < n_tokens; i++)
        (void)td_xoshiro256ss(sampler->rng); /* td_sampler_sample draws exactly one per token */
}
