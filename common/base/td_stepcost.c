/*
 * td_stepcost: a node's step-time model, fitted over its recent steps (see td_stepcost.h).
 */
#include "td_stepcost.h"

#include <math.h>
#include <string.h>

#include "td_lsq.h"

void td_stepcost_init(td_stepcost_t *c)
{
    memset(c, 0, sizeof *c);
}

void td_stepcost_note(td_stepcost_t *c, int32_t seqs, int64_t context, int32_t prefill_tokens, double s)
{
    if (!(s > 0) || !isfinite(s) || seqs < 0 || context < 0 || prefill_tokens < 0 || seqs + prefill_tokens == 0)
        return;
    int kind = prefill_tokens > 0;
    c->ring[kind][c->next[kind]] = (td_stepcost_sample_t){seqs, (double)context, prefill_tokens, s};
    c->next[kind] = (c->next[kind] + 1) % TD_STEPCOST_WINDOW;
    if (c->n[kind] < TD_STEPCOST_WINDOW)
        c->n[kind]++;
}

/* Least squares over the window with the columns of `use` (intercept, B, C, P in that order;
 * the intercept and P always) into *f. */
static bool fit_columns(const td_stepcost_t *c, const bool use[4], td_stepcost_fit_t *f)
{
    double x[2 * TD_STEPCOST_WINDOW * 4], y[2 * TD_STEPCOST_WINDOW], coef[4];
    size_t n = 0;
    int k = 0;
    for (int i = 0; i < 4; i++)
        k += use[i];
    for (int kind = 0; kind < 2; kind++)
        for (int32_t i = 0; i < c->n[kind]; i++, n++) {
            const td_stepcost_sample_t *p = &c->ring[kind][i];
            double col[4] = {1, p->seqs, p->context, p->prefill};
            for (int j = 0, m = 0; j < 4; j++)
                if (use[j])
                    x[n * (size_t)k + (size_t)m++] = col[j];
            y[n] = p->s;
        }
    if (!td_lsq_fit(x, y, n, k, coef))
        return false;
    double full[4] = {0};
    for (int j = 0, m = 0; j < 4; j++)
        if (use[j])
            full[j] = coef[m++];
    if (!(full[3] > 0))
        return false;
    *f = (td_stepcost_fit_t){.valid = true, .fixed_s = full[0], .per_seq_s = full[1], .per_context_s = full[2],
                             .per_prefill_s = full[3]};
    double sq = 0;
    for (int32_t i = 0; i < c->n[1]; i++) {
        const td_stepcost_sample_t *p = &c->ring[1][i];
        double r = p->s - (full[0] + full[1] * p->seqs + full[2] * p->context + full[3] * p->prefill);
        sq += r * r;
    }
    f->spread_s = sqrt(sq / c->n[1]);
    return true;
}

td_stepcost_fit_t td_stepcost_fit(const td_stepcost_t *c)
{
    td_stepcost_fit_t f = {.valid = false};
    if (c->n[1] < TD_STEPCOST_MIN_PREFILL)
        return f;
    static const bool models[3][4] = {{1, 1, 1, 1}, {1, 1, 0, 1}, {1, 0, 0, 1}};
    for (int m = 0; m < 3; m++)
        if (fit_columns(c, models[m], &f))
            return f;
    return (td_stepcost_fit_t){.valid = false};
}

double td_stepcost_predict(const td_stepcost_fit_t *f, int32_t seqs, int64_t context, int64_t prefill_tokens)
{
    double s = f->fixed_s + f->per_seq_s * seqs + f->per_context_s * (double)context +
               f->per_prefill_s * (double)prefill_tokens;
    return s > 0 ? s : 0;
}

int64_t td_stepcost_probe(const td_stepcost_t *c, int64_t probe)
{
    return c->n[1] >= TD_STEPCOST_MIN_PREFILL && c->next[1] % 2 == 0 ? (probe / 2 > 0 ? probe / 2 : 1) : probe;
}

int64_t td_stepcost_chunk(const td_stepcost_fit_t *f, int32_t seqs, int64_t context, double objective_s)
{
    if (!f->valid)
        return -1;
    double room = objective_s - f->spread_s - td_stepcost_predict(f, seqs, context, 0);
    if (!(room > 0))
        return 0;
    double p = floor(room / f->per_prefill_s);
    return p >= (double)INT32_MAX ? INT32_MAX : (int64_t)p;
}
