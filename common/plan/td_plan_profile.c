/*
 * td_plan_profile: the profile file and the method of measuring one (contract in
 * td_plan_profile.h; the commands are cli/cmd_plan.c).
 */
#include "td_plan_profile.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_stats.h"
#include "td_util.h"

/* The decode grid's contexts (tokens a sequence holds). */
static const int ctx_grid[] = {16, 128, 384, 1024};

/* The median of v[0..n) (sorted in place). */
static double median(double *v, int n)
{
    td_stats_sort(v, (size_t)n);
    return td_stats_median(v, (size_t)n);
}

td_status_t td_plan_fit_relative(double *x, double *y, int n, int k, double *coef)
{
    for (int i = 0; i < n; i++) {
        double w = y[i] > 0 ? 1.0 / y[i] : 1.0;
        for (int c = 0; c < k; c++)
            x[i * k + c] *= w;
        y[i] *= w;
    }
    return td_plan_fit(x, y, (size_t)n, k, coef);
}

/* The standard normal's quantile: Phi^-1(q), q in (0, 1), by bisection on erfc (to 1e-12). */
static double normal_quantile(double q)
{
    double lo = -40, hi = 40;
    for (int i = 0; i < 200 && hi - lo > 1e-12; i++) {
        double mid = 0.5 * (lo + hi);
        if (0.5 * erfc(-mid / sqrt(2.0)) < q)
            lo = mid;
        else
            hi = mid;
    }
    return 0.5 * (lo + hi);
}

/*
 * The profile's "speed" section from k lone decode runs of `tokens` steps each whose mean steps
 * are means[0..k) (reordered). Each run over their median is a run factor (kept as measured,
 * `run_factors`); the simulator draws from `factors`: the quantiles at (i + 0.5) / k of a
 * log-normal of median 1 whose interquartile range is the run factors' (sigma = ln(q75 / q25) /
 * 1.349). The interquartile range, not the extremes: a run that a neighbour's burst stopped for
 * a second is one sample in 32, and as a drawn factor it would be the node stopping for 1/32 of
 * the time. The window is a run's length.
 */
void td_plan_profile_speed(cJSON *j, double *means, int k, int tokens, const char *method)
{
    double med = k > 0 ? median(means, k) : 0; /* sorts means */
    if (!(med > 0)) {
        td_warn("plan profile: no speed run could be timed: the profile has no speed section (every step "
                "will take its fit)");
        return;
    }
    cJSON *sp = cJSON_AddObjectToObject(j, "speed"), *fs = cJSON_AddArrayToObject(sp, "factors"),
          *rf = cJSON_AddArrayToObject(sp, "run_factors");
    for (int i = 0; i < k; i++)
        means[i] /= med;
    for (int i = 0; i < k; i++)
        cJSON_AddItemToArray(rf, cJSON_CreateNumber(means[i]));
    double q25 = td_stats_percentile(means, (size_t)k, 25), q75 = td_stats_percentile(means, (size_t)k, 75);
    double sigma = q25 > 0 ? log(q75 / q25) / 1.349 : 0;
    for (int i = 0; i < k; i++)
        cJSON_AddItemToArray(fs, cJSON_CreateNumber(exp(sigma * normal_quantile((i + 0.5) / k))));
    cJSON_AddNumberToObject(sp, "sigma", sigma);
    cJSON_AddNumberToObject(sp, "window_s", med * tokens);
    cJSON_AddNumberToObject(sp, "runs", k);
    cJSON_AddNumberToObject(sp, "tokens_per_run", tokens);
    cJSON_AddNumberToObject(sp, "median_step_s", med);
    cJSON_AddStringToObject(sp, "method", method);
    fprintf(stderr, "plan profile: speed over %d runs of %d steps: median step %.3f ms; runs p10 x %.3f, p90 x %.3f, "
            "max x %.3f; drawn: log-normal sigma %.4f (p10 x %.3f, p90 x %.3f)\n", k, tokens, med * 1e3,
            td_stats_percentile(means, (size_t)k, 10), td_stats_percentile(means, (size_t)k, 90), means[k - 1], sigma,
            exp(-1.2816 * sigma), exp(1.2816 * sigma));
}

double td_plan_copy_bandwidth(void)
{
    size_t bytes = (size_t)64 << 20;
    char *a = malloc(bytes), *b = malloc(bytes);
    double best = 0;
    if (a && b) {
        memset(a, 1, bytes);
        memset(b, 2, bytes);
        for (int rep = 0; rep < 5; rep++) {
            uint64_t t0 = td_now_ns();
            memcpy(b, a, bytes);
            best = TD_MAX(best, (double)bytes / ((double)(td_now_ns() - t0) * 1e-9));
        }
    }
    free(a), free(b);
    return best;
}

td_status_t td_plan_profile_write(const cJSON *j, const char *what, const char *path)
{
    char *text = cJSON_Print(j);
    FILE *f = text ? fopen(path, "w") : NULL;
    if (!f || fputs(text, f) < 0 || fputc('\n', f) < 0) {
        td_status_t st = td_errorf(TD_ERR_IO, "%s: cannot write %s: %s", what, path, strerror(errno));
        if (f)
            fclose(f);
        free(text);
        return st;
    }
    fclose(f);
    free(text);
    return TD_OK;
}

static double num(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

td_status_t td_plan_profile_load(const char *path, td_plan_profile_t *p)
{
    char *text = NULL;
    size_t len = 0;
    td_status_t st = td_file_read_all(path, (size_t)64 << 20, &text, &len);
    if (st != TD_OK)
        return st;
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(j, "prefill"),
                *dec = cJSON_GetObjectItemCaseSensitive(j, "decode"),
                *kv = cJSON_GetObjectItemCaseSensitive(j, "kv_transfer");
    *p = (td_plan_profile_t){
        .prefill_a_s = num(pre, "a_s"), .prefill_b_s = num(pre, "b_s_per_token"),
        .prefill_c_s = num(pre, "c_s_per_token2"), .decode_a_s = num(dec, "a_s"),
        .decode_b_s = num(dec, "b_s_per_seq"), .decode_c_s = num(dec, "c_s_per_context_token"),
        .xfer_a_s = num(kv, "a_s"), .xfer_b_s = num(kv, "b_s_per_token"), .overhead_s = num(j, "overhead_s")};
    const double coef[] = {p->prefill_a_s, p->prefill_b_s, p->prefill_c_s, p->decode_a_s, p->decode_b_s,
                           p->decode_c_s, p->xfer_a_s, p->xfer_b_s, p->overhead_s};
    for (size_t i = 0; i < TD_ARRAY_LEN(coef); i++)
        if (!isfinite(coef[i])) {
            cJSON_Delete(j);
            return td_errorf(TD_ERR_INVALID, "--profile: %s is not a profile `tandem plan profile` wrote (a "
                                             "coefficient is missing)", path);
        }
    /* the speed spread: optional (profiles before it, and calibrated ones of them, have none) */
    const cJSON *sp = cJSON_GetObjectItemCaseSensitive(j, "speed"),
                *fs = cJSON_GetObjectItemCaseSensitive(sp, "factors");
    const char *bad = NULL;
    char why[96];
    if (sp) {
        int n = cJSON_GetArraySize(fs);
        p->speed_window_s = num(sp, "window_s");
        snprintf(why, sizeof why, "speed.factors is not an array of 1 to %d numbers", TD_PLAN_SPEED_MAX);
        if (!cJSON_IsArray(fs) || n < 1 || n > TD_PLAN_SPEED_MAX)
            bad = why;
        else if (!(p->speed_window_s > 0) || !isfinite(p->speed_window_s))
            bad = "speed.window_s is not a number > 0";
        const cJSON *f;
        cJSON_ArrayForEach(f, fs) {
            if (bad)
                break;
            if (!cJSON_IsNumber(f) || !(f->valuedouble > 0) || !isfinite(f->valuedouble))
                bad = "a speed factor is not a number > 0";
            else
                p->speed_f[p->n_speed++] = f->valuedouble;
        }
    }
    cJSON_Delete(j);
    /* sorted: td_stats_percentile reads the p10 and p90 printed */
    td_stats_sort(p->speed_f, (size_t)p->n_speed);
    if (bad) {
        p->n_speed = 0;
        return td_errorf(TD_ERR_INVALID, "--profile: %s: %s (write it again with `tandem plan profile`)", path, bad);
    }
    return TD_OK;
}

/* ==== an engine in this process ==== */

/* Prefill: one step of T tokens, T doubling up to the budget; the JSON's "prefill", fit f. */
static td_status_t engine_prefill(const td_plan_engine_probe_t *pr, const td_plan_engine_sweep_t *sw, cJSON *j,
                                  double *pc)
{
    double px[32 * 3], py[32];
    int np = 0;
    td_status_t st;
    cJSON *pre = cJSON_AddObjectToObject(j, "prefill"), *pts = cJSON_AddArrayToObject(pre, "points");
    for (int t = 8;; t = TD_MIN(2 * t, sw->max_prompt)) {
        double s = 0;
        if ((st = pr->prefill(pr->ctx, t, &s)) != TD_OK)
            return st;
        px[np * 3] = 1, px[np * 3 + 1] = t, px[np * 3 + 2] = (double)t * t;
        py[np++] = s;
        cJSON *p = cJSON_CreateObject();
        cJSON_AddNumberToObject(p, "tokens", t);
        cJSON_AddNumberToObject(p, "seconds", s);
        cJSON_AddItemToArray(pts, p);
        fprintf(stderr, "plan profile: prefill %4d tokens  %9.3f ms\n", t, s * 1e3);
        if (t == sw->max_prompt)
            break;
    }
    pc[2] = 0;
    if (np < 4) /* too few sizes for a curvature: affine */
        for (int i = 0; i < np; i++)
            px[i * 2] = 1, px[i * 2 + 1] = px[i * 3 + 1];
    if ((st = td_plan_fit_relative(px, py, np, np >= 4 ? 3 : 2, pc)) != TD_OK)
        return st;
    cJSON_AddNumberToObject(pre, "a_s", pc[0]);
    cJSON_AddNumberToObject(pre, "b_s_per_token", pc[1]);
    cJSON_AddNumberToObject(pre, "c_s_per_token2", pc[2]);
    return TD_OK;
}

/* Decode: a step of B sequences of C context tokens each; the JSON's "decode", fit dc. */
static td_status_t engine_decode(const td_plan_engine_probe_t *pr, const td_plan_engine_sweep_t *sw, cJSON *j,
                                 double *dc)
{
    double dx[64 * 3], dy[64];
    int nd = 0;
    td_status_t st;
    cJSON *dec = cJSON_AddObjectToObject(j, "decode");
    cJSON *pts = cJSON_AddArrayToObject(dec, "points");
    for (size_t ci = 0; ci < TD_ARRAY_LEN(ctx_grid) && ctx_grid[ci] <= sw->max_context; ci++)
        for (int b = 1;; b = (int)TD_MIN(2 * b, sw->max_batch)) {
            double s = 0;
            if ((st = pr->decode(pr->ctx, b, ctx_grid[ci], TD_PLAN_PROFILE_REPS, &s, NULL)) != TD_OK)
                return st;
            dx[nd * 3] = 1, dx[nd * 3 + 1] = b, dx[nd * 3 + 2] = (double)b * ctx_grid[ci];
            dy[nd++] = s;
            cJSON *p = cJSON_CreateObject();
            cJSON_AddNumberToObject(p, "batch", b);
            cJSON_AddNumberToObject(p, "context", ctx_grid[ci]);
            cJSON_AddNumberToObject(p, "seconds", s);
            cJSON_AddItemToArray(pts, p);
            fprintf(stderr, "plan profile: decode batch %3d context %4d  %9.3f ms\n", b, ctx_grid[ci], s * 1e3);
            if (b == sw->max_batch)
                break;
        }
    if ((st = td_plan_fit_relative(dx, dy, nd, 3, dc)) != TD_OK)
        return st;
    cJSON_AddNumberToObject(dec, "a_s", dc[0]);
    cJSON_AddNumberToObject(dec, "b_s_per_seq", dc[1]);
    cJSON_AddNumberToObject(dec, "c_s_per_context_token", dc[2]);
    return TD_OK;
}

/* Speed: runs of speed_steps batch-1 steps over 16 context tokens, one after another. */
static td_status_t engine_speed(const td_plan_engine_probe_t *pr, const td_plan_engine_sweep_t *sw, cJSON *j)
{
    if (sw->speed_runs <= 0)
        return TD_OK;
    double *means = malloc((size_t)sw->speed_runs * sizeof *means);
    if (!means)
        return td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
    td_status_t st = TD_OK;
    int steps = sw->speed_steps;
    for (int64_t i = 0; i < sw->speed_runs && st == TD_OK; i++) {
        double med;
        st = steps >= 2 ? pr->decode(pr->ctx, 1, 16, steps, &med, &means[i])
                        : td_errorf(TD_ERR_INVALID, "plan profile: the model's context (%d tokens) holds no speed "
                                    "run: give --speed-runs 0", sw->max_seq_len);
    }
    if (st == TD_OK)
        td_plan_profile_speed(j, means, (int)sw->speed_runs, steps,
                              "runs of tokens_per_run decode steps of one sequence of 16 context tokens, one after "
                              "another; a run factor: one run's mean step over the median of those means; factors: "
                              "a log-normal's quantiles with the run factors' median (1) and interquartile range");
    free(means);
    return st;
}

int td_plan_profile_engine_context(int max_seq_len)
{
    int max_ctx = 16;
    for (size_t i = 0; i < TD_ARRAY_LEN(ctx_grid); i++)
        if (ctx_grid[i] + TD_PLAN_PROFILE_REPS + 2 < max_seq_len)
            max_ctx = ctx_grid[i];
    return max_ctx;
}

td_status_t td_plan_profile_engine(const td_plan_engine_probe_t *pr, const td_plan_engine_sweep_t *sw, cJSON *j,
                                   td_plan_engine_fits_t *fits_p)
{
    td_plan_engine_fits_t f = {0};
    td_status_t st;
    if ((st = engine_prefill(pr, sw, j, f.prefill)) != TD_OK || (st = engine_decode(pr, sw, j, f.decode)) != TD_OK ||
        (st = engine_speed(pr, sw, j)) != TD_OK)
        return st;
    /* KV transfer: a model, not a measurement of td_xfer (bench kvxfer measures that) */
    double per_tok = sw->kv_bytes_per_token, bw = td_plan_copy_bandwidth();
    cJSON *kv = cJSON_AddObjectToObject(j, "kv_transfer");
    cJSON_AddStringToObject(kv, "method", "model: KV bytes per token / this host's memcpy bandwidth (the same-host "
                                          "shared-memory copy); a_s is not measured");
    cJSON_AddNumberToObject(kv, "bytes_per_token", per_tok);
    cJSON_AddNumberToObject(kv, "copy_bytes_per_s", bw);
    cJSON_AddNumberToObject(kv, "a_s", 0);
    cJSON_AddNumberToObject(kv, "b_s_per_token", bw > 0 ? per_tok / bw : 0);
    cJSON_AddNumberToObject(j, "overhead_s", 0);
    f.kv_s_per_token = bw > 0 ? per_tok / bw : 0;
    *fits_p = f;
    return TD_OK;
}

td_status_t td_plan_lengths_from_hist(const double *le, const double *cum, int nb, size_t n, int32_t *v)
{
    double total = nb ? cum[nb - 1] : 0;
    if (!(total > 0))
        return TD_ERR_NOT_FOUND;
    for (size_t i = 0; i < n; i++) {
        double q = fmod((double)i * 0.6180339887498949, 1.0) * total; /* golden-ratio stride */
        int b = 0;
        while (b < nb - 1 && cum[b] <= q)
            b++;
        double lo = b ? le[b - 1] : 0, hi = isinf(le[b]) ? lo : le[b];
        v[i] = (int32_t)TD_MAX(1.0, round(0.5 * (lo + hi)));
    }
    return TD_OK;
}

