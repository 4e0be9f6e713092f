/*
 * cmd_plan: `tandem plan`, the capacity planner (issue 16; docs/goodput.md "Capacity
 * planning").
 *
 *   tandem plan profile --model PATH [--threads N] [--out FILE]
 *       runs the engine in this process as `tandem bench engine` does and measures a prefill
 *       step against its tokens, a decode step against batch size and context, and models the
 *       KV transfer (bytes per token / this machine's memcpy bandwidth); writes the points and
 *       least-squares fits as a JSON profile.
 *   tandem plan profile (--gateway HOST:PORT | --openai URL) [--prefill-metrics URL]
 *       the same profile measured through a running cluster with bench serve's client
 *       (bench_serve_client.h): prefill from lone requests' TTFT (the prefill node's engine
 *       time per request with --prefill-metrics, the rest the fixed overhead), decode from the
 *       gaps between tokens of B streams generating together, the KV transfer from a lone
 *       request's first gap minus the decode step.
 *   tandem plan --profile P (--workload W | --metrics URL) --ttft MS --tpot MS
 *               [--rate R | --nodes N] [--split P:D | --unified N] [--json]
 *       simulates the cluster (common/plan/td_plan.h) and answers: the P:D split and batch
 *       limits with the most goodput per node, the highest rate N nodes sustain, the nodes a
 *       rate needs, and a what-if table.
 *   tandem plan calibrate --profile P --prefill-metrics URL --decode-metrics URL --context C --out P2
 *       scales a profile's fits to the mean step times the running nodes report (their own
 *       step histograms: the whole scheduler step, at the CPU share they really had).
 *
 * The workload: `random:IN:OUT[:RANGE]` (bench serve's random dataset, its lengths drawn
 * with the same seed), `trace:FILE` (bench serve's trace format and parser), or a live
 * router's /metrics (arrival rate from two scrapes, lengths from its histograms).
 */
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "bench_serve.h"
#include "bench_serve_client.h"
#include "td_backend.h"
#include "td_cli.h"
#include "td_engine.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_model.h"
#include "td_plan.h"
#include "td_stats.h"
#include "td_util.h"

/* ==== profile ================================================================================== */

/* The median of v[0..n) (sorted in place). */
static double median(double *v, int n)
{
    td_stats_sort(v, (size_t)n);
    return td_stats_median(v, (size_t)n);
}

/* The median of the finite values of v[0..n) (reordered); NAN when there are none. */
static double median_finite(double *v, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++)
        if (isfinite(v[i]))
            v[k++] = v[i];
    return k ? median(v, k) : NAN;
}

#define PROFILE_REPS 7

/* Least squares on relative error: each row scaled by 1 / its time, so the short steps (the
 * ones a lightly loaded node runs) weigh as much as the long ones. */
static td_status_t fit_relative(double *x, double *y, int n, int k, double *coef)
{
    for (int i = 0; i < n; i++) {
        double w = y[i] > 0 ? 1.0 / y[i] : 1.0;
        for (int c = 0; c < k; c++)
            x[i * k + c] *= w;
        y[i] *= w;
    }
    return td_plan_fit(x, y, (size_t)n, k, coef);
}

/* Seconds of one prefill step of `tokens` tokens (one new sequence, one logit row): median. */
static td_status_t time_prefill(td_engine_t *eng, const int32_t *toks, int tokens, float *logits, double *s_p)
{
    double t[PROFILE_REPS];
    for (int rep = -1; rep < PROFILE_REPS; rep++) { /* one warm-up */
        td_kv_seq_t seq;
        td_kv_seq_init(&seq);
        td_engine_item_t it = {.seq = &seq, .tokens = toks, .n_tokens = tokens, .n_logits = 1};
        uint64_t t0 = td_now_ns();
        td_status_t st = td_engine_step(eng, &it, 1, logits);
        double dt = (double)(td_now_ns() - t0) * 1e-9;
        td_engine_seq_end(eng, &seq);
        if (st != TD_OK)
            return st;
        if (rep >= 0)
            t[rep] = dt;
    }
    *s_p = median(t, PROFILE_REPS);
    return TD_OK;
}

/* Seconds of one decode step of `batch` sequences holding `ctx` tokens each, over `reps` steps
 * after a warm-up one: their median (*median_p) and mean (*mean_p, optional). */
static td_status_t time_decode(td_engine_t *eng, const int32_t *toks, int batch, int ctx, int reps, float *logits,
                               double *median_p, double *mean_p)
{
    td_kv_seq_t *seqs = calloc((size_t)batch, sizeof *seqs);
    td_engine_item_t *items = calloc((size_t)batch, sizeof *items);
    int32_t *next = calloc((size_t)batch, sizeof *next);
    double *t = malloc((size_t)(reps + 1) * sizeof *t);
    if (!seqs || !items || !next || !t) {
        free(seqs), free(items), free(next), free(t);
        return td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
    }
    td_status_t st = TD_OK;
    int max_tok = td_engine_config(eng)->max_batch_tokens;
    for (int i = 0; i < batch; i++)
        td_kv_seq_init(&seqs[i]);
    for (int i = 0; i < batch && st == TD_OK; i++)
        for (int off = 0; off < ctx && st == TD_OK; off += max_tok) {
            int n = TD_MIN(max_tok, ctx - off);
            td_engine_item_t it = {.seq = &seqs[i], .tokens = toks + off, .n_tokens = n, .n_logits = 1};
            st = td_engine_step(eng, &it, 1, logits);
        }
    double sum = 0;
    for (int rep = 0; rep <= reps && st == TD_OK; rep++) { /* the first is a warm-up */
        for (int i = 0; i < batch; i++) {
            next[i] = toks[(i + rep) % ctx];
            items[i] = (td_engine_item_t){.seq = &seqs[i], .tokens = &next[i], .n_tokens = 1, .n_logits = 1};
        }
        uint64_t t0 = td_now_ns();
        st = td_engine_step(eng, items, batch, logits);
        t[rep] = (double)(td_now_ns() - t0) * 1e-9;
        sum += rep ? t[rep] : 0;
    }
    for (int i = 0; i < batch; i++)
        td_engine_seq_end(eng, &seqs[i]);
    if (st == TD_OK) {
        if (mean_p)
            *mean_p = sum / reps;
        *median_p = median(t + 1, reps);
    }
    free(seqs), free(items), free(next), free(t);
    return st;
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
static void speed_section(cJSON *j, double *means, int k, int tokens, const char *method)
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

/* memcpy bandwidth of this machine over 64 MiB, best of 5: the same-host KV copy's bound. */
static double copy_bandwidth(void)
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

/* ---- through a running cluster: --gateway HOST:PORT | --openai URL ---------------------------- */

static td_status_t http_get(const char *url, char **body_p);

typedef struct cluster_prof_opts {
    bs_client_config_t cfg;
    const char *target, *prefill_metrics, *out;
    int64_t max_tokens, max_batch, max_context, decode_tokens, reps, speed_runs;
} cluster_prof_opts_t;

/* What a prefill node's /metrics counts; NAN where it has not the series. */
typedef struct prefill_counts {
    double requests, step_s, transfers, transfer_s, cached_tokens;
} prefill_counts_t;

static td_status_t prefill_counts_get(const char *url, prefill_counts_t *c)
{
    char *m = NULL;
    td_status_t st = http_get(url, &m);
    if (st != TD_OK)
        return st;
    *c = (prefill_counts_t){td_metrics_text_value(m, "tandem_prefill_requests_total"),
                            td_metrics_text_value(m, "tandem_prefill_step_seconds_sum"),
                            td_metrics_text_value(m, "tandem_prefill_transfer_seconds_count"),
                            td_metrics_text_value(m, "tandem_prefill_transfer_seconds_sum"),
                            td_metrics_text_value(m, "tandem_prefill_cached_tokens_total")};
    free(m);
    if (isnan(c->requests) || isnan(c->step_s))
        return td_errorf(TD_ERR_INVALID, "--prefill-metrics: %s has no tandem_prefill_requests_total or "
                                         "tandem_prefill_step_seconds: is it a prefill node's /metrics?", url);
    return TD_OK;
}

/* Runs the items and fails unless every one was answered: the first error, saying what was sent. */
static td_status_t cluster_run(bs_client_t *cl, const cluster_prof_opts_t *o, const bs_dataset_t *d, int64_t conc,
                               bs_replies_t *rep, bool first)
{
    char hint[160];
    if (first)
        snprintf(hint, sizeof hint, "is the cluster up, and is that its %s?",
                 o->cfg.gateway ? "gRPC gateway (tandem local prints 'gateway: HOST:PORT')"
                                : "OpenAI API (tandem local prints 'openai: URL')");
    else
        snprintf(hint, sizeof hint, "does the model hold %u tokens (--max-tokens, --max-context, --decode-tokens), "
                 "and the decode node %lld sequences (--max-batch)?", d->items[0].input_len + d->items[0].output_len,
                 (long long)conc);
    td_status_t st = bs_client_run(cl, d->items, d->n, conc, rep);
    if (st != TD_OK)
        return st;
    for (size_t i = 0; i < rep->n; i++)
        if (!rep->r[i].ok || rep->r[i].output_tokens < d->items[i].output_len) {
            st = td_errorf(TD_ERR_UNAVAILABLE, "plan profile: %s: a request of %u prompt tokens and %u output tokens "
                           "(%lld at once) %s%s; %s", o->target, d->items[i].input_len, d->items[i].output_len,
                           (long long)conc, rep->r[i].ok ? "ended early" : "failed: ",
                           rep->r[i].ok ? "" : rep->r[i].error ? rep->r[i].error : "no reason given", hint);
            bs_replies_free(rep);
            return st;
        }
    return TD_OK;
}

/* A decode point from B replies (td_plan_decode_window); NAN step when out of memory. */
static void decode_window(const bs_replies_t *rep, uint32_t prompt, double *step_s, double *ctx, double *per_stream,
                          double *tok_per_msg)
{
    td_plan_stream_t *st = malloc((rep->n ? rep->n : 1) * sizeof *st);
    double *gaps = NULL;
    size_t n_gaps = 0;
    for (size_t i = 0; i < rep->n; i++)
        n_gaps += rep->r[i].n_itl;
    gaps = malloc((n_gaps ? n_gaps : 1) * sizeof *gaps);
    td_plan_decode_point_t pt = {.step_s = NAN, .context = NAN};
    if (st && gaps) {
        double *g = gaps;
        for (size_t i = 0; i < rep->n; i++) {
            const bs_reply_t *r = &rep->r[i];
            for (uint32_t k = 0; k < r->n_itl; k++)
                g[k] = r->itl_ms[k] * 1e-3;
            st[i] = (td_plan_stream_t){.first_s = (r->start_ms + r->ttft_ms) * 1e-3, .gaps_s = g,
                                       .n_gaps = r->n_itl, .tokens = r->output_tokens};
            g += r->n_itl;
        }
        if (td_plan_decode_window(st, rep->n, prompt, &pt) != TD_OK)
            pt = (td_plan_decode_point_t){.step_s = NAN, .context = NAN};
    }
    free(st), free(gaps);
    *step_s = pt.step_s, *ctx = pt.context, *per_stream = pt.gaps_per_stream, *tok_per_msg = pt.tokens_per_message;
}

/* Writes a profile's JSON to path (what: the command, for the message). */
static td_status_t profile_write(const cJSON *j, const char *what, const char *path)
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

/* One profile of a running cluster (plan_profile_cluster): its client, prompts, the JSON being
 * built, and what the prefill sweep measured for the fits after it. */
typedef struct prof_run {
    const cluster_prof_opts_t *o;
    bs_client_t *cl;
    bs_rng_t rng;
    bs_replies_t rep;
    bs_dataset_t d;
    cJSON *j;
    double *tt, *gap; /* [o->reps] one point's TTFTs and first gaps */
    int n_t;          /* prefill points */
    int32_t tok[32];
    double ttft[32], gap1[32], engine[32], xfer_node[32];
    double pc[3], dc[3], xc[2]; /* the prefill, decode and KV-transfer fits */
    bool usage;                 /* a failure the user's flags can fix (exit 2) */
} prof_run_t;

/* Prefill: lone requests of T prompt tokens (T doubling from 8 to --max-tokens), the JSON's
 * "prefill" and the fit r->pc. false: failed, said. */
static bool prof_prefill(prof_run_t *r)
{
    const cluster_prof_opts_t *o = r->o;
    /* 2 output tokens: TTFT, and the first gap */
    cJSON *pre = cJSON_AddObjectToObject(r->j, "prefill"), *pts = cJSON_AddArrayToObject(pre, "points");
    for (int t = 8; r->n_t < 32; t = (int)TD_MIN(2 * t, o->max_tokens)) {
        /* one request at a time, the node's counters read between them: its engine time per
         * request, a median beside TTFT's (a mean would carry the one step a neighbour delayed) */
        prefill_counts_t c0 = {0}, c1 = {0};
        double *eng = malloc((size_t)o->reps * sizeof *eng), *xn = malloc((size_t)o->reps * sizeof *xn);
        int n_xn = 0;
        if (!eng || !xn) {
            free(eng), free(xn);
            td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
            return false;
        }
        if (o->prefill_metrics && prefill_counts_get(o->prefill_metrics, &c0) != TD_OK) {
            free(eng), free(xn);
            return false;
        }
        if (bs_dataset_random(&r->rng, (size_t)o->reps, (uint32_t)t, 2, 0, &r->d) != TD_OK) {
            free(eng), free(xn);
            return false;
        }
        td_status_t st = TD_OK;
        for (int i = 0; i < o->reps && st == TD_OK; i++) {
            bs_dataset_t one = {.items = &r->d.items[i], .n = 1};
            if ((st = cluster_run(r->cl, o, &one, 1, &r->rep, false)) != TD_OK)
                break;
            r->tt[i] = r->rep.r[0].ttft_ms * 1e-3, r->gap[i] = r->rep.r[0].n_itl ? r->rep.r[0].itl_ms[0] * 1e-3 : NAN;
            bs_replies_free(&r->rep);
            if (!o->prefill_metrics || (st = prefill_counts_get(o->prefill_metrics, &c1)) != TD_OK)
                continue;
            if (c1.requests - c0.requests != 1) {
                st = td_errorf(TD_ERR_INVALID, "--prefill-metrics: %s counted %.0f Prefill calls for one request: is "
                               "it the only prefill node of the cluster at %s, and idle but for this?",
                               o->prefill_metrics, c1.requests - c0.requests, o->target);
                r->usage = true;
                break;
            }
            if (c1.cached_tokens > c0.cached_tokens) {
                st = td_errorf(TD_ERR_INVALID, "plan profile: the prefill node's prefix cache served %.0f tokens of a "
                               "%d-token prompt: its r->engine time is not a prefill of T tokens (another client sending "
                               "the same prompts?)", c1.cached_tokens - c0.cached_tokens, t);
                break;
            }
            eng[i] = c1.step_s - c0.step_s;
            if (c1.transfers > c0.transfers)
                xn[n_xn++] = (c1.transfer_s - c0.transfer_s) / (c1.transfers - c0.transfers);
            c0 = c1;
        }
        bs_dataset_free(&r->d);
        if (st != TD_OK) {
            free(eng), free(xn);
            return false;
        }
        r->tok[r->n_t] = t, r->ttft[r->n_t] = median(r->tt, (int)o->reps), r->gap1[r->n_t] = median_finite(r->gap, (int)o->reps);
        r->engine[r->n_t] = o->prefill_metrics ? median(eng, (int)o->reps) : NAN;
        r->xfer_node[r->n_t] = n_xn ? median(xn, n_xn) : NAN;
        free(eng), free(xn);
        cJSON *p = cJSON_CreateObject();
        cJSON_AddNumberToObject(p, "tokens", t);
        cJSON_AddNumberToObject(p, "ttft_s", r->ttft[r->n_t]);
        if (o->prefill_metrics) {
            cJSON_AddNumberToObject(p, "node_engine_s", r->engine[r->n_t]);
            if (!isnan(r->xfer_node[r->n_t]))
                cJSON_AddNumberToObject(p, "node_transfer_s", r->xfer_node[r->n_t]);
        }
        double y = o->prefill_metrics ? r->engine[r->n_t] : r->ttft[r->n_t];
        cJSON_AddNumberToObject(p, "seconds", y);
        cJSON_AddItemToArray(pts, p);
        fprintf(stderr, "plan profile: prefill %4d tokens  TTFT %9.3f ms%s", t, r->ttft[r->n_t] * 1e3,
                o->prefill_metrics ? "" : "\n");
        if (o->prefill_metrics)
            fprintf(stderr, "  node r->engine %9.3f ms\n", r->engine[r->n_t] * 1e3);
        r->n_t++;
        if (t == o->max_tokens)
            break;
    }
    double px[32 * 3], py[32];
    for (int i = 0; i < r->n_t; i++) {
        px[i * 3] = 1, px[i * 3 + 1] = r->tok[i], px[i * 3 + 2] = (double)r->tok[i] * r->tok[i];
        py[i] = o->prefill_metrics ? r->engine[i] : r->ttft[i];
    }
    if (r->n_t < 4)
        for (int i = 0; i < r->n_t; i++)
            px[i * 2] = 1, px[i * 2 + 1] = px[i * 3 + 1];
    if (fit_relative(px, py, r->n_t, r->n_t >= 4 ? 3 : 2, r->pc) != TD_OK)
        return false;
    cJSON_AddStringToObject(pre, "method", o->prefill_metrics
                                               ? "lone requests of T prompt tokens through the front door; seconds: "
                                                 "the prefill node's r->engine steps per request (its /metrics), median "
                                                 "TTFT in ttft_s"
                                               : "lone requests of T prompt tokens through the front door; seconds: "
                                                 "median TTFT (router, RPC hops and relay included: no "
                                                 "--prefill-metrics to tell the r->engine's part)");
    cJSON_AddNumberToObject(pre, "requests_per_point", (double)o->reps);
    cJSON_AddNumberToObject(pre, "a_s", r->pc[0]);
    cJSON_AddNumberToObject(pre, "b_s_per_token", r->pc[1]);
    cJSON_AddNumberToObject(pre, "c_s_per_token2", r->pc[2]);

    return true;
}

/* Decode: B streams of P prompt tokens at once over a grid of B and P, the JSON's "decode" and
 * the fit r->dc. false: failed, said. */
static bool prof_decode(prof_run_t *r)
{
    const cluster_prof_opts_t *o = r->o;
    /* long enough that all B generate together */
    static const int ctx_grid[] = {16, 128, 384, 1024};
    double dx[64 * 3], dy[64];
    int nd = 0;
    int64_t out_len = o->decode_tokens;
    cJSON *dec = cJSON_AddObjectToObject(r->j, "decode");
    cJSON *pts = cJSON_AddArrayToObject(dec, "points");
    for (size_t ci = 0; ci < TD_ARRAY_LEN(ctx_grid) && ctx_grid[ci] + o->decode_tokens <= o->max_context; ci++)
        for (int b = 1; nd < 64; b = (int)TD_MIN(2 * b, o->max_batch)) {
            double step = NAN, ctx = NAN, per = 0, tpm = 1;
            out_len = TD_MIN(out_len, o->max_context - ctx_grid[ci]);
            for (int tries = 0;; tries++) {
                if (bs_dataset_random(&r->rng, (size_t)b, (uint32_t)ctx_grid[ci], (uint32_t)out_len, 0, &r->d) != TD_OK ||
                    cluster_run(r->cl, o, &r->d, b, &r->rep, false) != TD_OK)
                    return false;
                decode_window(&r->rep, (uint32_t)ctx_grid[ci], &step, &ctx, &per, &tpm);
                bs_replies_free(&r->rep);
                bs_dataset_free(&r->d);
                if (per >= 8 || tries == 3 || ctx_grid[ci] + 2 * out_len > o->max_context)
                    break;
                out_len *= 2; /* the prompts' prefills outlasted the first streams: longer outputs */
            }
            /* more rounds of the same point: the median of their medians (a neighbour's burst
             * slows one round of ~30 steps, not all) */
            double steps[16] = {step}, ctxs[16] = {ctx};
            int n_rounds = 1;
            for (; n_rounds < TD_MIN(o->reps, 16) && per >= 2; n_rounds++) {
                double p2;
                if (bs_dataset_random(&r->rng, (size_t)b, (uint32_t)ctx_grid[ci], (uint32_t)out_len, 0, &r->d) != TD_OK ||
                    cluster_run(r->cl, o, &r->d, b, &r->rep, false) != TD_OK)
                    return false;
                decode_window(&r->rep, (uint32_t)ctx_grid[ci], &steps[n_rounds], &ctxs[n_rounds], &p2, &tpm);
                bs_replies_free(&r->rep);
                bs_dataset_free(&r->d);
                if (!(p2 >= 2))
                    break;
            }
            if (per >= 2)
                step = median(steps, n_rounds), ctx = median(ctxs, n_rounds);
            if (!(per >= 2)) { /* left out, said so; too few points left is the error below */
                td_warn("plan profile: %d streams of %d prompt tokens and %lld output tokens never generated "
                        "together (their prefills outlasted them): point left out (a larger --decode-tokens or "
                        "--max-context keeps it)", b, ctx_grid[ci], (long long)out_len);
                cJSON *sk = cJSON_GetObjectItemCaseSensitive(dec, "left_out");
                if (!sk)
                    sk = cJSON_AddArrayToObject(dec, "left_out");
                cJSON *p = cJSON_CreateObject();
                cJSON_AddNumberToObject(p, "batch", b);
                cJSON_AddNumberToObject(p, "prompt_tokens", ctx_grid[ci]);
                cJSON_AddNumberToObject(p, "output_tokens", (double)out_len);
                cJSON_AddItemToArray(sk, p);
                if (b == o->max_batch)
                    break;
                continue;
            }
            dx[nd * 3] = 1, dx[nd * 3 + 1] = b, dx[nd * 3 + 2] = (double)b * ctx;
            dy[nd++] = step;
            cJSON *p = cJSON_CreateObject();
            cJSON_AddNumberToObject(p, "batch", b);
            cJSON_AddNumberToObject(p, "context", ctx);
            cJSON_AddNumberToObject(p, "seconds", step);
            cJSON_AddNumberToObject(p, "prompt_tokens", ctx_grid[ci]);
            cJSON_AddNumberToObject(p, "output_tokens", (double)out_len);
            cJSON_AddNumberToObject(p, "gaps_per_stream", per);
            cJSON_AddNumberToObject(p, "rounds", n_rounds);
            cJSON_AddNumberToObject(p, "tokens_per_message", tpm);
            cJSON_AddItemToArray(pts, p);
            fprintf(stderr, "plan profile: decode batch %3d context %6.1f  %9.3f ms (%.1f gaps a stream)\n", b, ctx,
                    step * 1e3, per);
            if (b == o->max_batch)
                break;
        }
    if (nd < 3) {
        td_errorf(TD_ERR_INVALID, "plan profile: %d decode points are too few to fit three terms: raise --max-batch, "
                  "--max-context or --decode-tokens", nd);
        r->usage = true;
        return false;
    }
    if (fit_relative(dx, dy, nd, 3, r->dc) != TD_OK)
        return false;
    cJSON_AddStringToObject(dec, "method", "B concurrent streams (ignore_eos) through the front door; seconds: the "
                                           "time between tokens while all B generated (relay included; a message "
                                           "of several tokens counted as such), median over the streams and over "
                                           "--reps rounds; context: the context at the middle of that time");
    cJSON_AddNumberToObject(dec, "a_s", r->dc[0]);
    cJSON_AddNumberToObject(dec, "b_s_per_seq", r->dc[1]);
    cJSON_AddNumberToObject(dec, "c_s_per_context_token", r->dc[2]);

    return true;
}

/* Speed: --speed-runs lone requests (the JSON's "speed"). false: failed, said. */
static bool prof_speed(prof_run_t *r)
{
    const cluster_prof_opts_t *o = r->o;
    /* speed: lone requests of 16 prompt tokens and --decode-tokens, one after another; each one's
     * mean time between tokens from its second (the first gap carries the KV transfer) */
    if (o->speed_runs > 0) {
        double *means = malloc((size_t)o->speed_runs * sizeof *means);
        int k = 0;
        if (!means) {
            td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
            return false;
        }
        if (bs_dataset_random(&r->rng, (size_t)o->speed_runs, 16, (uint32_t)o->decode_tokens, 0, &r->d) != TD_OK) {
            free(means);
            return false;
        }
        td_status_t st = TD_OK;
        for (int64_t i = 0; i < o->speed_runs && st == TD_OK; i++) {
            bs_dataset_t one = {.items = &r->d.items[i], .n = 1};
            if ((st = cluster_run(r->cl, o, &one, 1, &r->rep, false)) != TD_OK)
                break;
            const bs_reply_t *rr = &r->rep.r[0];
            if (rr->n_itl >= 2) { /* tokens a message: a router that fell behind merges them */
                double sum = 0, f = (double)rr->output_tokens / (double)(rr->n_itl + 1);
                for (uint32_t g = 1; g < rr->n_itl; g++)
                    sum += rr->itl_ms[g] * 1e-3;
                if (sum > 0) /* all its messages read together: no time to read */
                    means[k++] = sum / ((double)(rr->n_itl - 1) * f);
            }
            bs_replies_free(&r->rep);
        }
        bs_dataset_free(&r->d);
        if (st == TD_OK)
            speed_section(r->j, means, k, (int)o->decode_tokens - 2,
                          "lone requests of 16 prompt tokens and tokens_per_run + 2 output tokens, one at a time "
                          "through the front door; a run factor: one request's mean time between tokens after "
                          "its second token over the median of those means; factors: a log-normal's quantiles "
                          "with the run factors' median (1) and interquartile range");
        free(means);
        if (st != TD_OK)
            return false;
    }

    return true;
}

/* KV transfer, from the prefill points' first gaps and the decode fit: the JSON's "kv_transfer"
 * and the fit r->xc. */
static void prof_kv_transfer(prof_run_t *r)
{
    /* KV transfer: a lone request's second token waits for its KV to reach the decode node and one
     * decode step there; what the first gap outlasts that step is the transfer (and adoption) */
    double xx[32 * 2], xy[32], sum = 0;
    int nx = 0;
    cJSON *kv = cJSON_AddObjectToObject(r->j, "kv_transfer");
    cJSON *pts = cJSON_AddArrayToObject(kv, "points");
    for (int i = 0; i < r->n_t; i++) {
        if (!isfinite(r->gap1[i])) /* both tokens came in one message every time: no gap to read */
            continue;
        td_plan_profile_t pf = {.decode_a_s = r->dc[0], .decode_b_s = r->dc[1], .decode_c_s = r->dc[2]};
        xx[nx * 2] = 1, xx[nx * 2 + 1] = r->tok[i];
        xy[nx] = r->gap1[i] - td_plan_decode_step_s(&pf, 1, r->tok[i] + 1);
        sum += xy[nx];
        cJSON *p = cJSON_CreateObject();
        cJSON_AddNumberToObject(p, "tokens", r->tok[i]);
        cJSON_AddNumberToObject(p, "first_gap_s", r->gap1[i]);
        cJSON_AddNumberToObject(p, "seconds", xy[nx++]);
        if (!isnan(r->xfer_node[i]))
            cJSON_AddNumberToObject(p, "node_transfer_s", r->xfer_node[i]);
        cJSON_AddItemToArray(pts, p);
    }
    if (nx < 2 || td_plan_fit(xx, xy, (size_t)nx, 2, r->xc) != TD_OK || r->xc[1] < 0)
        r->xc[0] = nx ? sum / nx : 0, r->xc[1] = 0; /* no growth with the prompt measured: a constant */
    r->xc[0] = TD_MAX(r->xc[0], 0.0);
    cJSON_AddStringToObject(kv, "method", "measured: a lone request's first r->gap between tokens minus the decode fit "
                                          "at batch 1 (the KV's arrival, adoption and relay); fitted a + b x tokens, "
                                          "clamped at 0");
    cJSON_AddNumberToObject(kv, "a_s", r->xc[0]);
    cJSON_AddNumberToObject(kv, "b_s_per_token", r->xc[1]);

}

/* The fixed overhead (the JSON's "overheads" and "overhead_s"), returned. */
static double prof_overhead(prof_run_t *r)
{
    const cluster_prof_opts_t *o = r->o;
    /* the fixed overhead: what TTFT outlasts the prefill node's engine steps */
    double over = 0;
    cJSON *ov = cJSON_AddObjectToObject(r->j, "overheads");
    if (o->prefill_metrics) {
        double diff[32];
        cJSON *arr = cJSON_AddArrayToObject(ov, "ttft_minus_engine_s");
        for (int i = 0; i < r->n_t; i++) {
            diff[i] = r->ttft[i] - r->engine[i];
            cJSON_AddItemToArray(arr, cJSON_CreateNumber(diff[i]));
        }
        over = TD_MAX(median(diff, r->n_t), 0.0);
        cJSON_AddStringToObject(ov, "method", "median over prompt lengths of TTFT minus the prefill node's r->engine "
                                              "time per request: router, RPC hops, the node's queue and the relay");
    } else {
        cJSON_AddStringToObject(ov, "method", "not separated: without --prefill-metrics the router, RPC hops and "
                                              "relay are inside the prefill fit (its a_s); overhead_s is 0");
    }
    cJSON_AddNumberToObject(ov, "ttft_intercept_s", r->pc[0] + (o->prefill_metrics ? over : 0));
    cJSON_AddNumberToObject(r->j, "overhead_s", over);

    return over;
}

static int plan_profile_cluster(const cluster_prof_opts_t *o)
{
    int rc = 1;
    prof_run_t r_ = {.o = o}, *r = &r_;
    /* prompts of their own each time: a second profile of the same cluster must not find the
     * first one's prompts in the prefill node's prefix cache */
    uint64_t seed = td_now_ns() ^ ((uint64_t)getpid() << 32);
    bs_rng_seed(&r->rng, seed);
    r->tt = malloc((size_t)o->reps * sizeof *r->tt);
    r->gap = malloc((size_t)o->reps * sizeof *r->gap);
    if (!r->tt || !r->gap) {
        td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
        goto out;
    }
    if (bs_client_create(&o->cfg, "tandem plan profile", &r->cl) != TD_OK) {
        rc = 2;
        goto out;
    }
    /* one request first: a cluster that is not there is one clear error, and a warm-up */
    if (bs_dataset_random(&r->rng, 1, 8, 2, 0, &r->d) != TD_OK || cluster_run(r->cl, o, &r->d, 1, &r->rep, true) != TD_OK)
        goto out;
    bs_replies_free(&r->rep);
    bs_dataset_free(&r->d);
    cJSON *j = r->j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "tandem_plan_profile", 1);
    cJSON_AddStringToObject(j, "source", o->cfg.gateway ? "gateway" : "openai");
    cJSON_AddStringToObject(j, "target", o->target);
    cJSON_AddStringToObject(j, "model", o->cfg.model ? o->cfg.model : "(the served one)");
    cJSON_AddNumberToObject(j, "vocab_size", o->cfg.vocab);
    cJSON_AddNumberToObject(j, "prompt_seed", (double)(seed >> 12)); /* a JSON number holds 52 bits */
    if (!prof_prefill(r) || !prof_decode(r) || !prof_speed(r)) {
        rc = r->usage ? 2 : 1;
        goto out;
    }
    prof_kv_transfer(r);
    double over = prof_overhead(r);
    const double *pc = r->pc, *dc = r->dc, *xc = r->xc;
    if (profile_write(j, "plan profile", o->out) != TD_OK)
        goto out;
    printf("Profile written:                         %s\n", o->out);
    printf("Measured through:                        %s %s\n", o->cfg.gateway ? "gateway" : "openai", o->target);
    printf("Prefill step (ms):                       %.4f + %.6f x tokens + %.3g x tokens^2%s\n", pc[0] * 1e3,
           pc[1] * 1e3, pc[2] * 1e3, o->prefill_metrics ? "" : " (TTFT)");
    printf("Decode step (ms):                        %.4f + %.6f x batch + %.3g x context tokens\n", dc[0] * 1e3,
           dc[1] * 1e3, dc[2] * 1e3);
    printf("KV transfer (ms, measured):              %.4f + %.6f x tokens\n", xc[0] * 1e3, xc[1] * 1e3);
    printf("Fixed overhead (ms):                     %.4f%s\n", over * 1e3,
           o->prefill_metrics ? "" : " (not separated: give --prefill-metrics)");
    rc = 0;
out:
    bs_replies_free(&r->rep);
    bs_dataset_free(&r->d);
    bs_client_destroy(r->cl);
    cJSON_Delete(r->j);
    free(r->tt), free(r->gap);
    return rc;
}

static int plan_profile(int argc, char **argv)
{
    const char *model_path = NULL, *out = "plan-profile.json";
    int64_t threads = 0, max_tokens = 0, max_batch = 0, vocab = 256;
    td_device_spec_t dev = {0};
    float timeout_s = 60;
    cluster_prof_opts_t co = {.cfg = bs_client_config_default(), .max_context = 512, .decode_tokens = 32, .reps = 5,
                              .speed_runs = 32};
    const td_opt_t opts[] = {
        TD_OPT_STRING("model", &model_path, "model to run in this process"),
        TD_OPT_STRING("gateway", &co.cfg.gateway, "a running cluster's gRPC gateway HOST:PORT: measure through it"),
        TD_OPT_STRING("openai", &co.cfg.openai, "a running cluster's OpenAI API http://HOST:PORT[/v1]: measure "
                                                "through it"),
        TD_OPT_INT("threads", &threads, 1, 1024, "--model: compute threads, as the nodes' --threads (default 1)"),
        {.name = "device", .type = TD_OPT_FN, .ptr = &dev, .parse = cli_opt_device, .arg = "D",
         .help = "--model: cpu (default), cuda or cuda:N"},
        TD_OPT_INT("max-tokens", &max_tokens, 8, 1 << 16,
                   "largest prompt measured, as a prefill node's max-batch-tokens (default 512; cluster: 256)"),
        TD_OPT_INT("max-batch", &max_batch, 1, 4096, "largest decode batch measured (default 64; cluster: 16)"),
        TD_OPT_STRING("prefill-metrics", &co.prefill_metrics,
                      "cluster: its (only) prefill node's /metrics URL: the engine's part of TTFT, the overhead apart"),
        TD_OPT_INT("max-context", &co.max_context, 32, 1 << 20,
                   "cluster: longest prompt + output a decode stream may have, >= 128 + --decode-tokens (default 512)"),
        TD_OPT_INT("decode-tokens", &co.decode_tokens, 8, 1 << 20,
                   "output tokens of a speed run; cluster: of a decode stream too, doubled while B streams do not "
                   "overlap (default 32)"),
        TD_OPT_INT("reps", &co.reps, 1, 1000, "cluster: lone requests per prompt length, rounds per decode point (default 5)"),
        TD_OPT_INT("speed-runs", &co.speed_runs, 0, TD_PLAN_SPEED_MAX,
                   "lone decode runs of --decode-tokens whose spread the planner draws the nodes' speed from "
                   "(default 32; 0: none, every step takes its fit)"),
        TD_OPT_INT("vocab-size", &vocab, 2, 1 << 24, "cluster: prompt ids drawn from [1, V) (default 256)"),
        TD_OPT_STRING("api-key", &co.cfg.api_key, "cluster: sent as Authorization: Bearer KEY"),
        {.name = "request-timeout-s", .type = TD_OPT_F32, .ptr = &timeout_s, .fmin = 0.1f, .fmax = 86400, .arg = "S",
         .help = "cluster: a request not ended within this fails the profile (default 60)"},
        TD_OPT_STRING("out", &out, "the profile file to write (default plan-profile.json)"),
    };
    td_opts_t spec = {.prog = "tandem plan profile", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r = {0};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        printf("usage: tandem plan profile --model PATH [--threads N] [--device D] [--max-tokens N]\n"
               "                          [--max-batch N] [--speed-runs N] [--decode-tokens N] [--out FILE]\n"
               "       tandem plan profile (--gateway HOST:PORT | --openai URL) [--prefill-metrics URL]\n"
               "                          [--max-tokens N] [--max-batch N] [--max-context N] [--decode-tokens N]\n"
               "                          [--reps N] [--speed-runs N] [--vocab-size V] [--out FILE]\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return 0;
    }
    bool cluster = co.cfg.gateway || co.cfg.openai;
    const char *bad = (model_path != NULL) + (co.cfg.gateway != NULL) + (co.cfg.openai != NULL) != 1
                          ? "--model: give one of --model PATH (in this process), --gateway HOST:PORT or --openai URL"
                      : cluster && threads ? "--threads: only with --model (a cluster's nodes have their own)"
                      : cluster && dev.cuda ? "--device: only with --model (a cluster's nodes have their own)"
                      : !cluster && co.prefill_metrics ? "--prefill-metrics: only with --gateway or --openai"
                      : cluster && co.decode_tokens + 128 > co.max_context
                          ? "--max-context: must hold a 128-token prompt and --decode-tokens (two prompt lengths, "
                            "16 and 128, or the context term cannot be told from the batch term)"
                          : NULL;
    if (bad) {
        td_errorf(TD_ERR_INVALID, "tandem plan profile: %s", bad);
        return 2;
    }
    if (cluster) {
        co.target = co.cfg.gateway ? co.cfg.gateway : co.cfg.openai;
        co.out = out;
        co.cfg.vocab = (uint32_t)vocab;
        co.cfg.request_timeout_s = timeout_s;
        co.max_tokens = max_tokens ? max_tokens : 256;
        co.max_batch = max_batch ? max_batch : 16;
        return plan_profile_cluster(&co);
    }
    threads = threads ? threads : 1;
    max_tokens = max_tokens ? max_tokens : 512;
    max_batch = max_batch ? max_batch : 64;
    int rc = 1;
    td_backend_t *be = NULL;
    td_model_t *model = NULL;
    td_engine_t *eng = NULL;
    float *logits = NULL;
    int32_t *toks = NULL;
    cJSON *j = NULL;
    if (td_backend_open(&dev, (int32_t)threads, TD_F32, &be) != TD_OK || td_model_load(model_path, &model) != TD_OK)
        goto out;
    const td_model_config_t *c = &model->config;
    int max_prompt = (int)TD_MIN(max_tokens, (int64_t)c->max_seq_len - 1);
    static const int ctx_grid[] = {16, 128, 384, 1024};
    int max_ctx = 16;
    for (size_t i = 0; i < TD_ARRAY_LEN(ctx_grid); i++)
        if (ctx_grid[i] + PROFILE_REPS + 2 < c->max_seq_len)
            max_ctx = ctx_grid[i];
    td_engine_config_t ec = td_engine_config_default();
    ec.prefix_cache = false;
    ec.max_batch_tokens = TD_MAX(max_prompt, 64);
    ec.max_seqs = ec.max_logit_rows = (int32_t)TD_MAX(max_batch, 1);
    ec.n_blocks = (int32_t)(max_batch * TD_DIV_CEIL(max_ctx + PROFILE_REPS + 2, ec.block_size) +
                            TD_DIV_CEIL(TD_MAX(max_prompt + 1, 16 + co.decode_tokens + 2), ec.block_size) + 8);
    if (td_engine_create(model, be, &ec, &eng) != TD_OK)
        goto out;
    logits = malloc((size_t)TD_MAX(max_batch, 1) * c->vocab_size * sizeof(float));
    toks = malloc((size_t)TD_MAX(max_prompt, max_ctx) * sizeof(int32_t));
    if (!logits || !toks) {
        td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
        goto out;
    }
    uint64_t x = 12345;
    for (int i = 0; i < TD_MAX(max_prompt, max_ctx); i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        toks[i] = 1 + (int32_t)((x >> 33) % (uint64_t)TD_MAX(c->vocab_size - 1, 1));
    }
    j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "tandem_plan_profile", 1);
    cJSON_AddStringToObject(j, "source", "engine");
    cJSON_AddStringToObject(j, "model", model_path);
    cJSON_AddNumberToObject(j, "threads", (double)threads);
    cJSON_AddStringToObject(j, "device", dev.cuda ? "cuda" : "cpu");

    /* prefill: one step of T tokens, T doubling up to the budget */
    double px[32 * 3], py[32], pc[3];
    int np = 0;
    cJSON *pre = cJSON_AddObjectToObject(j, "prefill"), *pts = cJSON_AddArrayToObject(pre, "points");
    for (int t = 8;; t = TD_MIN(2 * t, max_prompt)) {
        double s = 0;
        if (time_prefill(eng, toks, t, logits, &s) != TD_OK)
            goto out;
        px[np * 3] = 1, px[np * 3 + 1] = t, px[np * 3 + 2] = (double)t * t;
        py[np++] = s;
        cJSON *p = cJSON_CreateObject();
        cJSON_AddNumberToObject(p, "tokens", t);
        cJSON_AddNumberToObject(p, "seconds", s);
        cJSON_AddItemToArray(pts, p);
        fprintf(stderr, "plan profile: prefill %4d tokens  %9.3f ms\n", t, s * 1e3);
        if (t == max_prompt)
            break;
    }
    pc[2] = 0;
    if (np < 4) /* too few sizes for a curvature: affine */
        for (int i = 0; i < np; i++)
            px[i * 2] = 1, px[i * 2 + 1] = px[i * 3 + 1];
    if (fit_relative(px, py, np, np >= 4 ? 3 : 2, pc) != TD_OK)
        goto out;
    cJSON_AddNumberToObject(pre, "a_s", pc[0]);
    cJSON_AddNumberToObject(pre, "b_s_per_token", pc[1]);
    cJSON_AddNumberToObject(pre, "c_s_per_token2", pc[2]);

    /* decode: a step of B sequences of C context tokens each */
    double dx[64 * 3], dy[64], dc[3];
    int nd = 0;
    cJSON *dec = cJSON_AddObjectToObject(j, "decode");
    pts = cJSON_AddArrayToObject(dec, "points");
    for (size_t ci = 0; ci < TD_ARRAY_LEN(ctx_grid) && ctx_grid[ci] <= max_ctx; ci++)
        for (int b = 1;; b = (int)TD_MIN(2 * b, max_batch)) {
            double s = 0;
            if (time_decode(eng, toks, b, ctx_grid[ci], PROFILE_REPS, logits, &s, NULL) != TD_OK)
                goto out;
            dx[nd * 3] = 1, dx[nd * 3 + 1] = b, dx[nd * 3 + 2] = (double)b * ctx_grid[ci];
            dy[nd++] = s;
            cJSON *p = cJSON_CreateObject();
            cJSON_AddNumberToObject(p, "batch", b);
            cJSON_AddNumberToObject(p, "context", ctx_grid[ci]);
            cJSON_AddNumberToObject(p, "seconds", s);
            cJSON_AddItemToArray(pts, p);
            fprintf(stderr, "plan profile: decode batch %3d context %4d  %9.3f ms\n", b, ctx_grid[ci], s * 1e3);
            if (b == max_batch)
                break;
        }
    if (fit_relative(dx, dy, nd, 3, dc) != TD_OK)
        goto out;
    cJSON_AddNumberToObject(dec, "a_s", dc[0]);
    cJSON_AddNumberToObject(dec, "b_s_per_seq", dc[1]);
    cJSON_AddNumberToObject(dec, "c_s_per_context_token", dc[2]);

    /* speed: runs of --decode-tokens batch-1 steps over 16 context tokens, one after another */
    if (co.speed_runs > 0) {
        double *means = malloc((size_t)co.speed_runs * sizeof *means);
        if (!means) {
            td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
            goto out;
        }
        td_status_t st = TD_OK;
        int steps = (int)TD_MIN(co.decode_tokens, (int64_t)c->max_seq_len - 16 - 2); /* the model's context */
        for (int64_t i = 0; i < co.speed_runs && st == TD_OK; i++) {
            double med;
            st = steps >= 2 ? time_decode(eng, toks, 1, 16, steps, logits, &med, &means[i])
                            : td_errorf(TD_ERR_INVALID, "plan profile: the model's context (%d tokens) holds no speed "
                                        "run: give --speed-runs 0", c->max_seq_len);
        }
        if (st == TD_OK)
            speed_section(j, means, (int)co.speed_runs, steps,
                          "runs of tokens_per_run decode steps of one sequence of 16 context tokens, one after "
                          "another; a run factor: one run's mean step over the median of those means; factors: a "
                          "log-normal's quantiles with the run factors' median (1) and interquartile range");
        free(means);
        if (st != TD_OK)
            goto out;
    }

    /* KV transfer: a model, not a measurement of td_xfer (bench kvxfer measures that) */
    double per_tok = (double)td_engine_kv_block_bytes(model, &ec) / ec.block_size, bw = copy_bandwidth();
    cJSON *kv = cJSON_AddObjectToObject(j, "kv_transfer");
    cJSON_AddStringToObject(kv, "method", "model: KV bytes per token / this host's memcpy bandwidth (the same-host "
                                          "shared-memory copy); a_s is not measured");
    cJSON_AddNumberToObject(kv, "bytes_per_token", per_tok);
    cJSON_AddNumberToObject(kv, "copy_bytes_per_s", bw);
    cJSON_AddNumberToObject(kv, "a_s", 0);
    cJSON_AddNumberToObject(kv, "b_s_per_token", bw > 0 ? per_tok / bw : 0);
    cJSON_AddNumberToObject(j, "overhead_s", 0);

    if (profile_write(j, "plan profile", out) != TD_OK)
        goto out;
    printf("Profile written:                         %s\n", out);
    printf("Prefill step (ms):                       %.4f + %.6f x tokens + %.3g x tokens^2\n", pc[0] * 1e3,
           pc[1] * 1e3, pc[2] * 1e3);
    printf("Decode step (ms):                        %.4f + %.6f x batch + %.3g x context tokens\n", dc[0] * 1e3,
           dc[1] * 1e3, dc[2] * 1e3);
    printf("KV transfer (ms per token, modelled):    %.6f\n", bw > 0 ? per_tok / bw * 1e3 : 0);
    rc = 0;
out:
    cJSON_Delete(j);
    free(logits), free(toks);
    td_engine_destroy(eng);
    td_model_destroy(model);
    td_backend_destroy(be);
    return rc;
}

/* ==== reading a profile =========================================================================== */

static double num(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static td_status_t profile_load(const char *path, td_plan_profile_t *p)
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

/* ==== workloads ================================================================================== */

typedef struct workload {
    int32_t *in, *out;
    size_t n;
    double rate;            /* the trace's or the live router's; 0: none */
    td_plan_request_t *timed; /* a trace's own arrivals [n], or NULL */
    char desc[256];
} workload_t;

static void workload_free(workload_t *w)
{
    free(w->in), free(w->out), free(w->timed);
}

static td_status_t workload_from_dataset(const bs_dataset_t *d, workload_t *w)
{
    w->n = d->n;
    w->in = malloc(TD_MAX(d->n, (size_t)1) * sizeof(int32_t));
    w->out = malloc(TD_MAX(d->n, (size_t)1) * sizeof(int32_t));
    if (d->timed)
        w->timed = malloc(TD_MAX(d->n, (size_t)1) * sizeof *w->timed);
    if (!w->in || !w->out || (d->timed && !w->timed))
        return td_errorf(TD_ERR_NOMEM, "plan: out of memory for the workload");
    for (size_t i = 0; i < d->n; i++) {
        w->in[i] = (int32_t)TD_MAX(d->items[i].input_len, 1u);
        w->out[i] = (int32_t)TD_MAX(d->items[i].output_len, 1u);
        if (w->timed)
            w->timed[i] = (td_plan_request_t){d->items[i].arrival_s, w->in[i], w->out[i]};
    }
    if (d->timed && d->n > 1 && d->items[d->n - 1].arrival_s > 0)
        w->rate = (double)(d->n - 1) / d->items[d->n - 1].arrival_s;
    return TD_OK;
}

/* --workload random:IN:OUT[:RANGE] | trace:FILE */
static td_status_t workload_parse(const char *spec, size_t n, uint64_t seed, workload_t *w)
{
    bs_rng_t rng;
    bs_rng_seed(&rng, seed);
    bs_dataset_t d = {0};
    td_status_t st;
    if (!strncmp(spec, "random:", 7)) {
        char *end;
        long in = strtol(spec + 7, &end, 10), out = *end == ':' ? strtol(end + 1, &end, 10) : 0;
        double rr = 0;
        if (*end == ':')
            rr = strtod(end + 1, &end);
        if (in < 1 || out < 1 || in > 1 << 20 || out > 1 << 20 || *end || rr < 0 || rr >= 1)
            return td_errorf(TD_ERR_INVALID, "--workload: '%s' is not random:IN:OUT[:RANGE] (IN, OUT >= 1, "
                                             "0 <= RANGE < 1)", spec);
        if ((st = bs_dataset_random(&rng, n, (uint32_t)in, (uint32_t)out, rr, &d)) != TD_OK)
            return st;
        snprintf(w->desc, sizeof w->desc, "random input %ld output %ld range %.2f", in, out, rr);
    } else if (!strncmp(spec, "trace:", 6)) {
        char *text = NULL;
        size_t len = 0;
        if ((st = td_file_read_all(spec + 6, (size_t)1 << 30, &text, &len)) != TD_OK)
            return st;
        st = bs_dataset_trace_parse(text, len, spec + 6, 0, &rng, &d);
        free(text);
        if (st != TD_OK)
            return st;
        if (!d.n) {
            bs_dataset_free(&d);
            return td_errorf(TD_ERR_INVALID, "--workload: %s has no requests", spec + 6);
        }
        snprintf(w->desc, sizeof w->desc, "trace %s (%zu requests)", spec + 6, d.n);
    } else {
        return td_errorf(TD_ERR_INVALID, "--workload: '%s' is neither random:IN:OUT[:RANGE] nor trace:FILE", spec);
    }
    st = workload_from_dataset(&d, w);
    bs_dataset_free(&d);
    return st;
}

/* ---- a live router's /metrics ---- */

/* GET url (http://HOST:PORT/PATH) with a 5 s bound: the body, NUL-terminated, in *body_p. */
static td_status_t http_get(const char *url, char **body_p)
{
    char host[256], port[16] = "80";
    const char *path = "/metrics";
    if (strncmp(url, "http://", 7))
        return td_errorf(TD_ERR_INVALID, "--metrics: '%s' is not http://HOST:PORT/metrics", url);
    const char *h = url + 7, *slash = strchr(h, '/'), *colon = strchr(h, ':');
    size_t hl = slash ? (size_t)(slash - h) : strlen(h);
    if (slash)
        path = slash;
    if (colon && (!slash || colon < slash)) {
        snprintf(port, sizeof port, "%.*s", (int)TD_MIN((size_t)(hl - (size_t)(colon - h) - 1), sizeof port - 1),
                 colon + 1);
        hl = (size_t)(colon - h);
    }
    if (!hl || hl >= sizeof host)
        return td_errorf(TD_ERR_INVALID, "--metrics: no host in '%s'", url);
    snprintf(host, sizeof host, "%.*s", (int)hl, h);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
    if (getaddrinfo(host, port, &hints, &ai) != 0 || !ai)
        return td_errorf(TD_ERR_UNAVAILABLE, "--metrics: cannot resolve %s", host);
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    struct timeval tv = {.tv_sec = 5};
    if (fd >= 0) {
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    if (fd < 0 || connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        freeaddrinfo(ai);
        if (fd >= 0)
            close(fd);
        return td_errorf(TD_ERR_UNAVAILABLE, "--metrics: cannot connect to %s:%s: %s", host, port, strerror(errno));
    }
    freeaddrinfo(ai);
    char req[512];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n", path, host);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    td_status_t st = TD_OK;
    if (!buf || write(fd, req, (size_t)n) != n)
        st = td_errorf(TD_ERR_IO, "--metrics: cannot send the request to %s:%s", host, port);
    while (st == TD_OK) {
        if (len + 1 == cap) {
            char *nb = cap < ((size_t)64 << 20) ? realloc(buf, cap *= 2) : NULL;
            if (!nb) {
                st = td_errorf(TD_ERR_NOMEM, "--metrics: the answer is too large");
                break;
            }
            buf = nb;
        }
        ssize_t k = read(fd, buf + len, cap - len - 1);
        if (k < 0)
            st = td_errorf(TD_ERR_IO, "--metrics: reading from %s:%s: %s", host, port, strerror(errno));
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    close(fd);
    if (st != TD_OK) {
        free(buf);
        return st;
    }
    buf[len] = '\0';
    char *body = strstr(buf, "\r\n\r\n");
    if (strncmp(buf, "HTTP/1.", 7) || !strchr(buf, ' ') || atoi(strchr(buf, ' ') + 1) != 200 || !body) {
        free(buf);
        return td_errorf(TD_ERR_UNAVAILABLE, "--metrics: %s did not answer 200 with a body", url);
    }
    memmove(buf, body + 4, len - (size_t)(body + 4 - buf) + 1);
    *body_p = buf;
    return TD_OK;
}

#define MAX_BUCKETS 64

/* n lengths spread over a histogram's buckets in proportion to their counts, each the middle
 * of its bucket (the +Inf bucket: its lower bound); deterministic order (a stride through
 * the quantiles, so any prefix spans the distribution). */
static td_status_t lengths_from_hist(const double *le, const double *cum, int nb, size_t n, int32_t *v)
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

static td_status_t workload_metrics(const char *url, double window_s, size_t n, workload_t *w)
{
    char *a = NULL, *b = NULL;
    td_status_t st = http_get(url, &a);
    if (st != TD_OK)
        return st;
    uint64_t t0 = td_now_ns();
    struct timespec ts = {.tv_sec = (time_t)window_s, .tv_nsec = (long)((window_s - floor(window_s)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    if ((st = http_get(url, &b)) != TD_OK) {
        free(a);
        return st;
    }
    double dt = (double)(td_now_ns() - t0) * 1e-9;
    double arr0 = td_metrics_text_value(a, "tandem_router_requests_arrived_total"),
           arr1 = td_metrics_text_value(b, "tandem_router_requests_arrived_total");
    double le[MAX_BUCKETS], cum[MAX_BUCKETS], le2[MAX_BUCKETS], cum2[MAX_BUCKETS];
    int ni = td_metrics_text_buckets(b, "tandem_router_prompt_tokens", le, cum, MAX_BUCKETS);
    int no = td_metrics_text_buckets(b, "tandem_router_output_tokens", le2, cum2, MAX_BUCKETS);
    free(a);
    w->in = malloc(n * sizeof(int32_t));
    w->out = malloc(n * sizeof(int32_t));
    if (!w->in || !w->out)
        st = td_errorf(TD_ERR_NOMEM, "plan: out of memory for the workload");
    else if (isnan(arr1) || !ni || !no)
        st = td_errorf(TD_ERR_INVALID, "--metrics: %s has no tandem_router_requests_arrived_total or no prompt/"
                                       "output token histograms: is it a tandem router's /metrics?", url);
    else if (lengths_from_hist(le, cum, ni, n, w->in) != TD_OK || lengths_from_hist(le2, cum2, no, n, w->out) != TD_OK)
        st = td_errorf(TD_ERR_INVALID, "--metrics: the router at %s has ended no request yet: nothing to plan from",
                       url);
    free(b);
    if (st != TD_OK)
        return st;
    w->n = n;
    w->rate = (arr1 - arr0) / dt;
    snprintf(w->desc, sizeof w->desc, "live router %s (%.2f requests/s over %.1f s; lengths from its histograms)",
             url, w->rate, dt);
    return TD_OK;
}

/* ==== calibration from the nodes' own step histograms ================================================ */

/* Scales a profile's fits so that they give the mean step the nodes measured (their step
 * histograms count the whole scheduler step, sampling and sends included, at whatever share
 * of the CPU the node had), at the mean batch they ran. One factor per node kind. */
static int plan_calibrate(int argc, char **argv)
{
    const char *in = NULL, *out = NULL, *pm = NULL, *dm = NULL;
    int64_t ctx = 0;
    const td_opt_t opts[] = {
        TD_OPT_STRING("profile", &in, "profile to calibrate (required)"),
        TD_OPT_STRING("prefill-metrics", &pm, "a prefill node's /metrics URL"),
        TD_OPT_STRING("decode-metrics", &dm, "a decode node's /metrics URL"),
        TD_OPT_INT("context", &ctx, 1, 1 << 24, "mean context tokens of a decoding sequence (required with "
                                              "--decode-metrics: prompt + half the output)"),
        TD_OPT_STRING("out", &out, "calibrated profile to write (required)"),
    };
    td_opts_t spec = {.prog = "tandem plan calibrate", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r = {0};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        printf("usage: tandem plan calibrate --profile P [--prefill-metrics URL] [--decode-metrics URL --context C]\n"
               "                            --out FILE\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return 0;
    }
    const char *bad = !in ? "--profile: required" : !out ? "--out: required"
                      : !pm && !dm ? "--prefill-metrics: give it or --decode-metrics (or both)"
                      : dm && !ctx ? "--context: required with --decode-metrics" : NULL;
    if (bad) {
        td_errorf(TD_ERR_INVALID, "tandem plan calibrate: %s", bad);
        return 2;
    }
    td_plan_profile_t p;
    char *text = NULL, *m = NULL;
    size_t len = 0;
    cJSON *j = NULL;
    int rc = 1;
    if (profile_load(in, &p) != TD_OK) {
        rc = 2;
        goto out;
    }
    if (td_file_read_all(in, (size_t)64 << 20, &text, &len) != TD_OK || !(j = cJSON_ParseWithLength(text, len)))
        goto out;
    cJSON *cal = cJSON_CreateObject();
    cJSON_DeleteItemFromObjectCaseSensitive(j, "calibration"); /* a calibrated profile calibrated again */
    cJSON_AddItemToObject(j, "calibration", cal);
    if (pm) {
        if (http_get(pm, &m) != TD_OK)
            goto out;
        double n = td_metrics_text_value(m, "tandem_prefill_step_seconds_count"), ss = td_metrics_text_value(m, "tandem_prefill_step_seconds_sum"),
               ts = td_metrics_text_value(m, "tandem_prefill_batch_tokens_sum"), ps = td_metrics_text_value(m, "tandem_prefill_batch_size_sum");
        double xn = td_metrics_text_value(m, "tandem_prefill_transfer_seconds_count"),
               xs = td_metrics_text_value(m, "tandem_prefill_transfer_seconds_sum");
        free(m);
        m = NULL;
        if (!(n > 0) || !(ss > 0) || !(ts > 0) || !(ps > 0)) {
            td_errorf(TD_ERR_INVALID, "--prefill-metrics: %s has no prefill steps counted (is it a prefill node that "
                      "has served?)", pm);
            rc = 2;
            goto out;
        }
        double step = ss / n, tok = ts / n, prompts = ps / n, chunk = tok / prompts;
        double f = step / td_plan_prefill_step_s(&p, (int64_t)round(tok), prompts * chunk * chunk);
        cJSON *pre = cJSON_GetObjectItemCaseSensitive(j, "prefill");
        cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(pre, "a_s"), p.prefill_a_s * f);
        cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(pre, "b_s_per_token"), p.prefill_b_s * f);
        cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(pre, "c_s_per_token2"), p.prefill_c_s * f);
        cJSON_AddNumberToObject(cal, "prefill_factor", f);
        cJSON_AddNumberToObject(cal, "prefill_steps", n);
        cJSON_AddNumberToObject(cal, "prefill_mean_step_s", step);
        cJSON_AddNumberToObject(cal, "prefill_mean_tokens", tok);
        printf("Prefill: %.0f steps, mean %.3f ms at %.1f tokens: fits x %.3f\n", n, step * 1e3, tok, f);
        if (xn > 0 && xs >= 0) {
            /* a transfer is timed from the first layer of the prompt's last step until the decode
             * node adopted it: what outlasts that step is the delay between the first token and
             * the sequence joining a decode batch (messages, adoption, not only bytes) */
            double extra = TD_MAX(xs / xn - step, 0.0);
            cJSON *kv = cJSON_GetObjectItemCaseSensitive(j, "kv_transfer");
            cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(kv, "a_s"), extra);
            cJSON_AddNumberToObject(cal, "kv_transfer_mean_s", xs / xn);
            printf("KV transfer: %.0f, mean %.3f ms from the first layer: %.3f ms after the step\n", xn,
                   xs / xn * 1e3, extra * 1e3);
        }
    }
    if (dm) {
        if (http_get(dm, &m) != TD_OK)
            goto out;
        double n = td_metrics_text_value(m, "tandem_decode_step_seconds_count"), ss = td_metrics_text_value(m, "tandem_decode_step_seconds_sum"),
               bs = td_metrics_text_value(m, "tandem_decode_batch_size_sum");
        free(m);
        m = NULL;
        if (!(n > 0) || !(ss > 0) || !(bs > 0)) {
            td_errorf(TD_ERR_INVALID, "--decode-metrics: %s has no decode steps counted (is it a decode node that "
                      "has served?)", dm);
            rc = 2;
            goto out;
        }
        double step = ss / n, b = bs / n;
        double f = step / td_plan_decode_step_s(&p, (int64_t)TD_MAX(round(b), 1.0), (int64_t)round(b * (double)ctx));
        cJSON *dec = cJSON_GetObjectItemCaseSensitive(j, "decode");
        cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(dec, "a_s"), p.decode_a_s * f);
        cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(dec, "b_s_per_seq"), p.decode_b_s * f);
        cJSON_SetNumberValue(cJSON_GetObjectItemCaseSensitive(dec, "c_s_per_context_token"), p.decode_c_s * f);
        cJSON_AddNumberToObject(cal, "decode_factor", f);
        cJSON_AddNumberToObject(cal, "decode_steps", n);
        cJSON_AddNumberToObject(cal, "decode_mean_step_s", step);
        cJSON_AddNumberToObject(cal, "decode_mean_batch", b);
        printf("Decode: %.0f steps, mean %.3f ms at batch %.2f: fits x %.3f\n", n, step * 1e3, b, f);
    }
    if (profile_write(j, "plan calibrate", out) != TD_OK)
        goto out;
    printf("Profile written:                         %s\n", out);
    rc = 0;
out:
    free(text), free(m);
    cJSON_Delete(j);
    return rc;
}

/* ==== the plan =================================================================================== */

typedef struct plan_opts {
    const char *profile, *workload, *metrics, *split, *rates;
    double ttft_ms, tpot_ms, rate, attainment, overhead_ms, metrics_window_s;
    int64_t nodes, unified, max_nodes, requests, seed;
    int64_t prefill_max_batch_tokens, prefill_max_batch, decode_max_batch, decode_kv_tokens;
    int64_t unified_max_batch_tokens, unified_chunk;
    bool json;
} plan_opts_t;

typedef struct plan_ctx {
    td_plan_profile_t prof;
    td_plan_cluster_t base;
    td_plan_lengths_t L;
    td_plan_search_t s;
} plan_ctx_t;

static td_plan_cluster_t split_cluster(const plan_ctx_t *x, int p, int d, int u)
{
    td_plan_cluster_t c = x->base;
    c.n_prefill = u ? 0 : p;
    c.n_decode = u ? 0 : d;
    c.n_unified = u;
    return c;
}

static void split_name(char *b, size_t cap, const td_plan_cluster_t *c)
{
    if (c->n_unified)
        snprintf(b, cap, "%dU", c->n_unified);
    else
        snprintf(b, cap, "%d:%d", c->n_prefill, c->n_decode);
}

static cJSON *result_json(const td_plan_cluster_t *c, double rate, const td_plan_result_t *r)
{
    char name[32];
    split_name(name, sizeof name, c);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "split", name);
    cJSON_AddNumberToObject(o, "rate", rate);
    cJSON_AddNumberToObject(o, "goodput", r->goodput);
    cJSON_AddNumberToObject(o, "goodput_per_node", r->goodput / (c->n_unified + c->n_prefill + c->n_decode));
    cJSON_AddNumberToObject(o, "slo_attainment", r->attainment);
    cJSON_AddNumberToObject(o, "throughput", r->throughput);
    cJSON_AddNumberToObject(o, "ttft_p50_ms", r->ttft_p50_s * 1e3);
    cJSON_AddNumberToObject(o, "ttft_p90_ms", r->ttft_p90_s * 1e3);
    cJSON_AddNumberToObject(o, "tpot_p50_ms", isnan(r->tpot_p50_s) ? 0 : r->tpot_p50_s * 1e3);
    cJSON_AddNumberToObject(o, "tpot_p90_ms", isnan(r->tpot_p90_s) ? 0 : r->tpot_p90_s * 1e3);
    cJSON_AddNumberToObject(o, "prefill_busy", r->prefill_busy);
    cJSON_AddNumberToObject(o, "decode_busy", r->decode_busy);
    return o;
}

static void print_result(const char *what, const td_plan_cluster_t *c, double rate, const td_plan_result_t *r)
{
    char name[32];
    split_name(name, sizeof name, c);
    printf("%s split %s at %.3f req/s:\n", what, name, rate);
    printf("  Request goodput (req/s):               %.3f\n", r->goodput);
    printf("  SLO attainment (%%):                    %.2f\n", r->attainment * 100);
    printf("  Request throughput (req/s):            %.3f\n", r->throughput);
    printf("  P50 TTFT (ms):                         %.2f\n", r->ttft_p50_s * 1e3);
    printf("  P90 TTFT (ms):                         %.2f\n", r->ttft_p90_s * 1e3);
    printf("  P50 TPOT (ms):                         %.2f\n", r->tpot_p50_s * 1e3);
    printf("  P90 TPOT (ms):                         %.2f\n", r->tpot_p90_s * 1e3);
    printf("  Prefill / decode busy (%%):             %.1f / %.1f\n", r->prefill_busy * 100, r->decode_busy * 100);
}

/* The split of n nodes (and the unified n) with the highest sustained rate. */
static td_status_t best_split(const plan_ctx_t *x, int n, td_plan_cluster_t *best_c, double *best_rate)
{
    *best_rate = -1;
    for (int p = 1; p < n; p++) {
        td_plan_cluster_t c = split_cluster(x, p, n - p, 0);
        double r;
        td_status_t st = td_plan_max_rate(&x->prof, &c, &x->L, &x->s, &r, NULL);
        if (st != TD_OK)
            return st;
        if (r > *best_rate)
            *best_rate = r, *best_c = c;
    }
    return TD_OK;
}

static int parse_split(const char *s, int *p, int *d)
{
    char *end;
    long a = strtol(s, &end, 10), b = *end == ':' ? strtol(end + 1, &end, 10) : 0;
    if (a < 1 || b < 1 || a > 1024 || b > 1024 || *end)
        return -1;
    *p = (int)a, *d = (int)b;
    return 0;
}

static int plan_run(const plan_opts_t *o, plan_ctx_t *x, workload_t *w)
{
    cJSON *j = cJSON_CreateObject();
    int rc = 1;
    td_status_t st = TD_OK;
    double mean_in = 0, mean_out = 0;
    for (size_t i = 0; i < w->n; i++)
        mean_in += (double)w->in[i] / (double)w->n, mean_out += (double)w->out[i] / (double)w->n;
    double rate = o->rate > 0 ? o->rate : w->rate;
    if (!o->json) {
        printf("============ Capacity Plan ============\n");
        printf("Profile:                                 %s\n", o->profile);
        if (x->prof.n_speed > 0)
            printf("Node speed:                              drawn from %d measured factors (p10 x %.3f, p90 x %.3f) "
                   "per %.3g s\n", x->prof.n_speed, td_stats_percentile(x->prof.speed_f, (size_t)x->prof.n_speed, 10),
                   td_stats_percentile(x->prof.speed_f, (size_t)x->prof.n_speed, 90), x->prof.speed_window_s);
        else
            printf("Node speed:                              fixed (the profile has no speed factors)\n");
        printf("Workload:                                %s\n", w->desc);
        printf("Mean input / output tokens:              %.1f / %.1f\n", mean_in, mean_out);
        printf("Objectives:                              TTFT %.1f ms, TPOT %.1f ms, attainment >= %.0f%%\n",
               o->ttft_ms, o->tpot_ms, o->attainment * 100);
        if (w->rate > 0)
            printf("Workload arrival rate (req/s):           %.3f\n", w->rate);
    }
    cJSON_AddStringToObject(j, "profile", o->profile);
    cJSON_AddNumberToObject(j, "speed_factors", x->prof.n_speed);
    cJSON_AddStringToObject(j, "workload", w->desc);
    cJSON_AddNumberToObject(j, "mean_input_tokens", mean_in);
    cJSON_AddNumberToObject(j, "mean_output_tokens", mean_out);
    cJSON_AddNumberToObject(j, "ttft_ms", o->ttft_ms);
    cJSON_AddNumberToObject(j, "tpot_ms", o->tpot_ms);
    cJSON_AddNumberToObject(j, "min_attainment", o->attainment);
    if (w->rate > 0)
        cJSON_AddNumberToObject(j, "workload_rate", w->rate);

    int sp = 0, sd = 0;
    if (o->split || o->unified) { /* one configuration */
        if (o->split)
            parse_split(o->split, &sp, &sd);
        td_plan_cluster_t c = split_cluster(x, sp, sd, (int)o->unified);
        td_plan_result_t r;
        if (rate > 0 && w->timed && o->rate <= 0) { /* the trace's own times */
            st = td_plan_simulate(&x->prof, &c, w->timed, w->n, &x->s.slo, &r);
        } else if (rate > 0) {
            st = td_plan_at_rate(&x->prof, &c, &x->L, &x->s, rate, &r);
        } else {
            st = td_plan_max_rate(&x->prof, &c, &x->L, &x->s, &rate, &r);
            if (st == TD_OK && !o->json)
                printf("Highest sustained rate (req/s):          %.3f\n", rate);
            cJSON_AddNumberToObject(j, "max_rate", rate);
        }
        if (st != TD_OK)
            goto out;
        if (!o->json)
            print_result("Simulated", &c, rate, &r);
        cJSON_AddItemToObject(j, "simulated", result_json(&c, rate, &r));
        rc = 0;
        goto out;
    }

    int n_what = 0;
    td_plan_cluster_t best_c = x->base;
    double best_rate = 0;
    if (o->nodes > 0) {
        if (o->nodes < 2) {
            td_plan_cluster_t u = split_cluster(x, 0, 0, 1);
            if ((st = td_plan_max_rate(&x->prof, &u, &x->L, &x->s, &best_rate, NULL)) != TD_OK)
                goto out;
            best_c = u;
        } else if ((st = best_split(x, (int)o->nodes, &best_c, &best_rate)) != TD_OK) {
            goto out;
        }
        /* per-node batch limits of that split: the pair with the highest rate */
        static const int32_t dmb[] = {8, 16, 32, 64, 128}, pmbt[] = {128, 256, 512, 1024, 2048};
        td_plan_cluster_t lim = best_c;
        double lim_rate = best_rate;
        for (size_t a = 0; a < TD_ARRAY_LEN(dmb); a++)
            for (size_t b = 0; b < TD_ARRAY_LEN(pmbt); b++) {
                td_plan_cluster_t c = best_c;
                c.decode_max_batch = dmb[a];
                c.prefill_max_batch_tokens = c.unified_max_batch_tokens = pmbt[b];
                if (c.n_unified && c.unified_max_batch_tokens <= c.decode_max_batch)
                    continue;
                double r;
                if ((st = td_plan_max_rate(&x->prof, &c, &x->L, &x->s, &r, NULL)) != TD_OK)
                    goto out;
                if (r > lim_rate * 1.02) /* a clear win over the defaults, not the search's noise */
                    lim_rate = r, lim = c;
            }
        td_plan_cluster_t u = split_cluster(x, 0, 0, (int)o->nodes);
        double u_rate;
        if ((st = td_plan_max_rate(&x->prof, &u, &x->L, &x->s, &u_rate, NULL)) != TD_OK)
            goto out;
        char name[32];
        split_name(name, sizeof name, &best_c);
        if (!o->json) {
            char label[64];
            snprintf(label, sizeof label, "Highest rate %lld nodes sustain (req/s):", (long long)o->nodes);
            printf("%-41s%.3f\n", label, best_rate);
            snprintf(label, sizeof label, "Best split for %lld nodes (P:D):", (long long)o->nodes);
            printf("%-41s%s\n", label, name);
            printf("Sustained rate per node (req/s):         %.3f\n", best_rate / (double)o->nodes);
            printf("Best batch limits:                       %s %d, decode-max-batch %d (%.3f req/s)\n",
                   lim.n_unified ? "unified-max-batch-tokens" : "prefill-max-batch-tokens",
                   lim.n_unified ? lim.unified_max_batch_tokens : lim.prefill_max_batch_tokens, lim.decode_max_batch,
                   lim_rate);
            snprintf(label, sizeof label, "Unified %lld nodes sustain (req/s):", (long long)o->nodes);
            printf("%-41s%.3f\n", label, u_rate);
        }
        cJSON_AddNumberToObject(j, "nodes", (double)o->nodes);
        cJSON_AddNumberToObject(j, "max_rate", best_rate);
        cJSON_AddStringToObject(j, "best_split", name);
        cJSON_AddNumberToObject(j, "max_rate_per_node", best_rate / (double)o->nodes);
        cJSON_AddNumberToObject(j, lim.n_unified ? "best_unified_max_batch_tokens" : "best_prefill_max_batch_tokens",
                                lim.n_unified ? lim.unified_max_batch_tokens : lim.prefill_max_batch_tokens);
        cJSON_AddNumberToObject(j, "best_decode_max_batch", lim.decode_max_batch);
        cJSON_AddNumberToObject(j, "best_limits_rate", lim_rate);
        cJSON_AddNumberToObject(j, "unified_max_rate", u_rate);
        n_what = (int)o->nodes;
    }
    if (rate > 0) { /* the nodes the rate needs */
        int need = 0, need_u = 0;
        td_plan_cluster_t need_c = x->base;
        for (int n = 2; n <= o->max_nodes && !need; n++) {
            double r;
            td_plan_cluster_t c;
            if ((st = best_split(x, n, &c, &r)) != TD_OK)
                goto out;
            if (r >= rate)
                need = n, need_c = c;
        }
        for (int n = 1; n <= o->max_nodes && !need_u; n++) {
            td_plan_cluster_t c = split_cluster(x, 0, 0, n);
            double r;
            if ((st = td_plan_max_rate(&x->prof, &c, &x->L, &x->s, &r, NULL)) != TD_OK)
                goto out;
            if (r >= rate)
                need_u = n;
        }
        char name[32] = "none";
        if (need)
            split_name(name, sizeof name, &need_c);
        if (!o->json) {
            printf("Target rate (req/s):                     %.3f\n", rate);
            if (need)
                printf("Nodes needed:                            %d (split %s)\n", need, name);
            else
                printf("Nodes needed:                            more than %lld\n", (long long)o->max_nodes);
            if (need_u)
                printf("Unified nodes needed:                    %d\n", need_u);
            else
                printf("Unified nodes needed:                    more than %lld\n", (long long)o->max_nodes);
        }
        cJSON_AddNumberToObject(j, "target_rate", rate);
        cJSON_AddNumberToObject(j, "nodes_needed", need);
        cJSON_AddStringToObject(j, "nodes_needed_split", name);
        cJSON_AddNumberToObject(j, "unified_nodes_needed", need_u);
        if (!n_what)
            n_what = need ? need : (int)o->max_nodes;
        if (!best_rate)
            best_rate = rate;
    }

    /* what-if: every split of n_what nodes and n_what unified ones, at a few rates */
    double *rates = NULL;
    size_t n_rates = 0;
    if (o->rates) {
        if (bs_rates_parse(o->rates, &rates, &n_rates) != TD_OK) {
            rc = 2;
            goto out;
        }
    } else {
        static const double f[] = {0.5, 0.75, 1.0, 1.25, 1.5};
        if (!(rates = malloc(sizeof f)))
            goto out;
        for (size_t i = 0; i < TD_ARRAY_LEN(f); i++)
            rates[i] = f[i] * TD_MAX(best_rate, 0.01);
        n_rates = TD_ARRAY_LEN(f);
    }
    cJSON *tab = cJSON_AddArrayToObject(j, "what_if");
    if (!o->json)
        printf("--------------- What-if ---------------\n%-6s %10s %12s %14s %8s %12s %12s\n", "split", "rate",
               "goodput", "goodput/node", "SLO %", "TTFT p90 ms", "TPOT p90 ms");
    for (int p = 1; p <= n_what && st == TD_OK; p++) {
        bool uni = p == n_what;
        if (!uni && n_what - p < 1)
            continue;
        td_plan_cluster_t c = split_cluster(x, p, n_what - p, uni ? n_what : 0);
        for (size_t i = 0; i < n_rates && st == TD_OK; i++) {
            td_plan_result_t r;
            if ((st = td_plan_at_rate(&x->prof, &c, &x->L, &x->s, rates[i], &r)) != TD_OK)
                break;
            cJSON_AddItemToArray(tab, result_json(&c, rates[i], &r));
            char name[32];
            split_name(name, sizeof name, &c);
            if (!o->json)
                printf("%-6s %10.3f %12.3f %14.3f %8.1f %12.2f %12.2f\n", name, rates[i], r.goodput,
                       r.goodput / n_what, r.attainment * 100, r.ttft_p90_s * 1e3, r.tpot_p90_s * 1e3);
        }
    }
    free(rates);
    if (st == TD_OK)
        rc = 0;
out:
    if (rc == 0 && o->json) {
        char *t = cJSON_Print(j);
        if (t)
            puts(t);
        free(t);
    }
    cJSON_Delete(j);
    return rc;
}

static void plan_usage(FILE *f)
{
    fprintf(f, "usage: tandem plan profile (--model PATH | --gateway HOST:PORT | --openai URL) [--out FILE]   (--help for "
               "its flags)\n"
               "       tandem plan calibrate --profile P --prefill-metrics URL --decode-metrics URL --context C --out FILE\n"
               "       tandem plan --profile P (--workload random:IN:OUT[:RANGE]|trace:FILE | --metrics URL)\n"
               "                   --ttft MS --tpot MS [--rate R] [--nodes N] [--split P:D | --unified N] [--json]\n");
}

int cmd_plan(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "profile"))
        return plan_profile(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "calibrate"))
        return plan_calibrate(argc - 1, argv + 1);
    /* the batch limits default to the nodes' own (td_sched_defaults.h) */
    const td_plan_cluster_t dc = td_plan_cluster_default();
    plan_opts_t o = {.attainment = 0.9, .overhead_ms = -1, .metrics_window_s = 5, .max_nodes = 8, .requests = 1000,
                     .prefill_max_batch_tokens = dc.prefill_max_batch_tokens, .prefill_max_batch = dc.prefill_max_batch,
                     .decode_max_batch = dc.decode_max_batch, .unified_max_batch_tokens = dc.unified_max_batch_tokens,
                     .unified_chunk = dc.unified_chunk};
    float ttft = 0, tpot = 0, rate = 0, att = 0.9f, overhead = -1, window = 5;
    const td_opt_t opts[] = {
        TD_OPT_STRING("profile", &o.profile, "profile file of `tandem plan profile` (required)"),
        TD_OPT_STRING("workload", &o.workload, "random:IN:OUT[:RANGE] or trace:FILE (bench serve's trace format)"),
        TD_OPT_STRING("metrics", &o.metrics, "a live router's /metrics URL: its arrival rate and length histograms"),
        {.name = "metrics-window-s", .type = TD_OPT_F32, .ptr = &window, .fmin = 0.1f, .fmax = 3600, .arg = "S",
         .help = "seconds between the two scrapes of --metrics (default 5)"},
        {.name = "ttft", .type = TD_OPT_F32, .ptr = &ttft, .fmin = 1e-3f, .fmax = 1e7f, .arg = "MS",
         .help = "TTFT objective in ms (required)"},
        {.name = "tpot", .type = TD_OPT_F32, .ptr = &tpot, .fmin = 1e-3f, .fmax = 1e7f, .arg = "MS",
         .help = "TPOT objective in ms (required)"},
        {.name = "rate", .type = TD_OPT_F32, .ptr = &rate, .fmin = 1e-3f, .fmax = 1e7f, .arg = "R",
         .help = "target requests/s: the nodes it needs (default: the trace's or the router's rate)"},
        TD_OPT_INT("nodes", &o.nodes, 1, 1024, "nodes to split: the highest rate, best split and batch limits"),
        TD_OPT_STRING("split", &o.split, "P:D: simulate only this split (at --rate, the trace's times, or its highest rate)"),
        TD_OPT_INT("unified", &o.unified, 1, 1024, "N: simulate only N colocated nodes (chunked prefill)"),
        TD_OPT_INT("max-nodes", &o.max_nodes, 2, 256, "largest cluster --rate searches (default 8)"),
        TD_OPT_STRING("rates", &o.rates, "what-if rates: R1,R2,... or START:STOP:STEP (default: 0.5x..1.5x the best)"),
        TD_OPT_INT("requests", &o.requests, 10, 10000000, "requests per simulated run (default 1000)"),
        TD_OPT_INT("seed", &o.seed, 0, INT64_MAX, "workload lengths (as bench serve's --seed) and arrivals (default 0)"),
        {.name = "attainment", .type = TD_OPT_F32, .ptr = &att, .fmin = 0.01f, .fmax = 1, .arg = "F",
         .help = "SLO attainment a sustained rate keeps (default 0.9)"},
        {.name = "overhead-ms", .type = TD_OPT_F32, .ptr = &overhead, .fmin = 0, .fmax = 1e6f, .arg = "MS",
         .help = "router and RPC hops per request (default: the profile's)"},
        TD_OPT_INT("prefill-max-batch-tokens", &o.prefill_max_batch_tokens, 1, 1 << 20,
                   "prompt tokens per prefill step (a prefill node's --max-batch-tokens, 2048)"),
        TD_OPT_INT("prefill-max-batch", &o.prefill_max_batch, 1, 4096,
                   "prompts per prefill step (a prefill node's --max-batch, 64)"),
        TD_OPT_INT("decode-max-batch", &o.decode_max_batch, 1, 4096,
                   "sequences per decode or unified step (the node's --max-batch, 64)"),
        TD_OPT_INT("unified-max-batch-tokens", &o.unified_max_batch_tokens, 2, 1 << 20,
                   "tokens per unified step (a unified node's --max-batch-tokens, 512)"),
        TD_OPT_INT("unified-chunk", &o.unified_chunk, 1, 1 << 20,
                   "prompt tokens a sequence feeds per unified step (a unified node's --prefill-chunk, 256)"),
        TD_OPT_INT("decode-kv-tokens", &o.decode_kv_tokens, 0, INT64_MAX, "KV tokens per decode node (0: unbounded)"),
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &o.json, .help = "one JSON document on stdout"},
    };
    td_opts_t spec = {.prog = "tandem plan", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r = {0};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        plan_usage(stdout);
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return 0;
    }
    o.ttft_ms = ttft, o.tpot_ms = tpot, o.rate = rate, o.attainment = att, o.overhead_ms = overhead;
    o.metrics_window_s = window;
    int sp, sd;
    const char *bad = NULL;
    if (!o.profile)
        bad = "--profile: required (a file of `tandem plan profile`)";
    else if (!o.workload == !o.metrics)
        bad = "--workload: give one of --workload random:IN:OUT[:RANGE]|trace:FILE and --metrics URL";
    else if (ttft <= 0 || tpot <= 0)
        bad = ttft <= 0 ? "--ttft: required (the TTFT objective in ms)" : "--tpot: required (the TPOT objective in ms)";
    else if (o.split && parse_split(o.split, &sp, &sd))
        bad = "--split: not P:D with P, D >= 1";
    else if (o.split && o.unified)
        bad = "--unified: give --split P:D or --unified N, not both";
    else if (!o.split && !o.unified && !o.nodes && rate <= 0 && o.workload && strncmp(o.workload, "trace:", 6))
        bad = "--rate: give --rate R or --nodes N (or a trace, whose rate is its own)";
    if (bad) {
        td_errorf(TD_ERR_INVALID, "tandem plan: %s", bad);
        return 2;
    }
    plan_ctx_t x = {.base = td_plan_cluster_default(), .s = td_plan_search_default()};
    x.base.prefill_max_batch_tokens = (int32_t)o.prefill_max_batch_tokens;
    x.base.unified_max_batch_tokens = (int32_t)o.unified_max_batch_tokens;
    x.base.unified_chunk = (int32_t)o.unified_chunk;
    x.base.prefill_max_batch = (int32_t)o.prefill_max_batch;
    x.base.decode_max_batch = (int32_t)o.decode_max_batch;
    x.base.decode_kv_tokens = o.decode_kv_tokens;
    x.s.n_requests = (size_t)o.requests;
    x.s.seed = (uint64_t)o.seed + 1;
    x.s.min_attainment = att;
    x.s.slo = (td_plan_slo_t){.ttft_s = ttft * 1e-3, .tpot_s = tpot * 1e-3};
    workload_t w = {0};
    int rc = 1;
    td_status_t st = profile_load(o.profile, &x.prof);
    if (st == TD_OK && overhead >= 0)
        x.prof.overhead_s = overhead * 1e-3;
    if (st == TD_OK)
        st = o.metrics ? workload_metrics(o.metrics, window, (size_t)o.requests, &w)
                       : workload_parse(o.workload, (size_t)o.requests, (uint64_t)o.seed, &w);
    if (st != TD_OK) {
        rc = st == TD_ERR_INVALID ? 2 : 1;
        goto out;
    }
    if (o.metrics && rate <= 0 && !o.nodes && !o.split && !o.unified && !(w.rate > 0)) {
        td_errorf(TD_ERR_INVALID, "tandem plan: --rate: the router at %s saw no arrivals in %.1f s; give --rate R "
                  "or --nodes N", o.metrics, window);
        rc = 2;
        goto out;
    }
    x.L = (td_plan_lengths_t){w.in, w.out, w.n};
    rc = plan_run(&o, &x, &w);
out:
    workload_free(&w);
    return rc;
}
