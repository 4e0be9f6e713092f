/*
 * loadgen_profile: `tandem plan profile --gateway / --openai`, a step-time profile measured
 * through a running cluster with the load generator (contract in loadgen_profile.h): prefill
 * from lone requests' TTFT (the prefill node's engine time per request with --prefill-metrics,
 * the rest the fixed overhead), decode from the gaps between tokens of B streams generating
 * together, the KV transfer from a lone request's first gap minus the decode step. The fits,
 * the speed section and the file are td_plan_profile's; the measuring is here.
 */
#include "loadgen_profile.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_http_client.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_stats.h"
#include "td_util.h"

#define LP_METRICS_TIMEOUT_MS 5000 /* a node's /metrics answers within this */

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

/* What a prefill node's /metrics counts; NAN where it has not the series. */
typedef struct prefill_counts {
    double requests, step_s, transfers, transfer_s, cached_tokens;
} prefill_counts_t;

static td_status_t prefill_counts_get(const char *url, prefill_counts_t *c)
{
    char *m = NULL;
    td_status_t st = td_http_client_get(url, "--prefill-metrics", "/metrics", LP_METRICS_TIMEOUT_MS, &m);
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

/* A phase of the profile (prefill, decode, speed) as one progress line over its many runs
 * (o->progress): its requests so far of all it will send, counted into each run's ticks. */
typedef struct prof_phase {
    bool on;                  /* o->progress */
    td_progress_t prog;
    size_t n;                 /* requests the phase sends (decode: an estimate, raised as it goes) */
    size_t done, failed;      /* of the runs that ended */
} prof_phase_t;

/* Each run's tick: the phase's requests so far, never its last line (phase_end's). */
static void phase_on_progress(void *arg, const loadgen_progress_t *p)
{
    prof_phase_t *ph = arg;
    size_t done = ph->done + p->n_done;
    loadgen_progress_t all = {.n = TD_MAX(ph->n, done), .n_done = done, .n_failed = ph->failed + p->n_failed,
                              .elapsed_s = td_progress_elapsed(&ph->prog)};
    loadgen_progress_show(&ph->prog, &all, false);
}

/* The phase `name` begins, of about n requests. prog names it: "plan profile: prefill". */
static void phase_begin(prof_phase_t *ph, bool on, const char *prog, size_t n)
{
    *ph = (prof_phase_t){.on = on, .n = n};
    /* a terminal: a line rewritten each second; elsewhere one every 10 s and the last, so a
       log holds at least one line a phase */
    td_progress_init(&ph->prog, prog, 10, 0);
}

/* A result line of the phase (a point measured) is about to go to stderr. */
static void phase_say(prof_phase_t *ph)
{
    if (ph->on)
        td_progress_clear(&ph->prog);
}

/* The phase's last line: every request it sent. */
static void phase_end(prof_phase_t *ph)
{
    if (!ph->on)
        return;
    loadgen_progress_t all = {.n = ph->done, .n_done = ph->done, .n_failed = ph->failed,
                              .elapsed_s = td_progress_elapsed(&ph->prog)};
    loadgen_progress_show(&ph->prog, &all, true);
}

/* Runs the items and fails unless every one was answered: the first error, saying what was sent.
 * With ph, the run's progress is the phase's. */
static td_status_t cluster_run(loadgen_client_t *cl, const loadgen_profile_opts_t *o, const loadgen_dataset_t *d, int64_t conc,
                               loadgen_run_t *rep, bool first, prof_phase_t *ph)
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
    loadgen_run_opts_t ro = {.rate = INFINITY, .burstiness = 1, .max_concurrency = TD_MAX(conc, 1),
                             .progress_cb = ph && ph->on ? phase_on_progress : NULL, .progress_arg = ph};
    loadgen_rng_t rng; /* arrivals at an infinite rate draw nothing */
    loadgen_rng_seed(&rng, 0);
    td_status_t st = loadgen_client_run(cl, d, 0, d->n, &ro, &rng, rep);
    if (st != TD_OK)
        return st;
    if (ph) /* the run is over: its requests count as the phase's */
        ph->done += rep->n, ph->failed += (size_t)rep->sum.failed;
    for (size_t i = 0; i < rep->n; i++)
        if (!rep->r[i].ok || rep->r[i].output_tokens < d->items[i].output_len) {
            st = td_errorf(TD_ERR_UNAVAILABLE, "plan profile: %s: a request of %u prompt tokens and %u output tokens "
                           "(%lld at once) %s%s; %s", o->target, d->items[i].input_len, d->items[i].output_len,
                           (long long)conc, rep->r[i].ok ? "ended early" : "failed: ",
                           rep->r[i].ok ? "" : rep->r[i].error ? rep->r[i].error : "no reason given", hint);
            loadgen_run_free(rep);
            return st;
        }
    return TD_OK;
}

/* A decode point from B replies (td_plan_decode_window); NAN step when out of memory. */
static void decode_window(const loadgen_run_t *rep, uint32_t prompt, double *step_s, double *ctx, double *per_stream,
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
            const loadgen_reply_t *r = &rep->r[i];
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

/* One profile of a running cluster (plan_profile_cluster): its client, prompts, the JSON being
 * built, and what the prefill sweep measured for the fits after it. */
typedef struct prof_run {
    const loadgen_profile_opts_t *o;
    loadgen_client_t *cl;
    loadgen_rng_t rng;
    loadgen_run_t rep;
    loadgen_dataset_t d;
    cJSON *j;
    double *tt, *gap; /* [o->reps] one point's TTFTs and first gaps */
    int n_t;          /* prefill points */
    int32_t tok[32];
    double ttft[32], gap1[32], engine[32], xfer_node[32];
    double pc[3], dc[3], xc[2]; /* the prefill, decode and KV-transfer fits */
    bool usage;                 /* a failure the user's flags can fix (exit 2) */
    prof_phase_t ph;            /* the phase running, its progress line */
} prof_run_t;

/* Prefill: lone requests of T prompt tokens (T doubling from 8 to --max-tokens), the JSON's
 * "prefill" and the fit r->pc. false: failed, said. */
static bool prof_prefill(prof_run_t *r)
{
    const loadgen_profile_opts_t *o = r->o;
    /* 2 output tokens: TTFT, and the first gap */
    cJSON *pre = cJSON_AddObjectToObject(r->j, "prefill"), *pts = cJSON_AddArrayToObject(pre, "points");
    int n_points = 0; /* the loop below's */
    for (int t = 8; n_points < 32; t = (int)TD_MIN(2 * t, o->max_tokens)) {
        n_points++;
        if (t == o->max_tokens)
            break;
    }
    phase_begin(&r->ph, o->progress, "plan profile: prefill", (size_t)n_points * (size_t)o->reps);
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
        if (loadgen_dataset_random(&r->rng, (size_t)o->reps, (uint32_t)t, 2, 0, &r->d) != TD_OK) {
            free(eng), free(xn);
            return false;
        }
        td_status_t st = TD_OK;
        for (int i = 0; i < o->reps && st == TD_OK; i++) {
            loadgen_dataset_t one = {.items = &r->d.items[i], .n = 1};
            if ((st = cluster_run(r->cl, o, &one, 1, &r->rep, false, &r->ph)) != TD_OK)
                break;
            r->tt[i] = r->rep.r[0].ttft_ms * 1e-3, r->gap[i] = r->rep.r[0].n_itl ? r->rep.r[0].itl_ms[0] * 1e-3 : NAN;
            loadgen_run_free(&r->rep);
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
        loadgen_dataset_free(&r->d);
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
        phase_say(&r->ph);
        fprintf(stderr, "plan profile: prefill %4d tokens  TTFT %9.3f ms%s", t, r->ttft[r->n_t] * 1e3,
                o->prefill_metrics ? "" : "\n");
        if (o->prefill_metrics)
            fprintf(stderr, "  node r->engine %9.3f ms\n", r->engine[r->n_t] * 1e3);
        r->n_t++;
        if (t == o->max_tokens)
            break;
    }
    phase_end(&r->ph);
    double px[32 * 3], py[32];
    for (int i = 0; i < r->n_t; i++) {
        px[i * 3] = 1, px[i * 3 + 1] = r->tok[i], px[i * 3 + 2] = (double)r->tok[i] * r->tok[i];
        py[i] = o->prefill_metrics ? r->engine[i] : r->ttft[i];
    }
    if (r->n_t < 4)
        for (int i = 0; i < r->n_t; i++)
            px[i * 2] = 1, px[i * 2 + 1] = px[i * 3 + 1];
    if (td_plan_fit_relative(px, py, r->n_t, r->n_t >= 4 ? 3 : 2, r->pc) != TD_OK)
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
    const loadgen_profile_opts_t *o = r->o;
    /* long enough that all B generate together */
    static const int ctx_grid[] = {16, 128, 384, 1024};
    double dx[64 * 3], dy[64];
    int nd = 0;
    int64_t out_len = o->decode_tokens;
    cJSON *dec = cJSON_AddObjectToObject(r->j, "decode");
    cJSON *pts = cJSON_AddArrayToObject(dec, "points");
    size_t n_req = 0; /* the requests of the grid below, each point's rounds all run (an estimate:
                         a point's retries add some, its early end saves some) */
    for (size_t ci = 0; ci < TD_ARRAY_LEN(ctx_grid) && ctx_grid[ci] + o->decode_tokens <= o->max_context; ci++)
        for (int b = 1, k = 0; k < 64; b = (int)TD_MIN(2 * b, o->max_batch), k++) {
            n_req += (size_t)b * (size_t)TD_MAX(TD_MIN(o->reps, 16), 1);
            if (b == o->max_batch)
                break;
        }
    phase_begin(&r->ph, o->progress, "plan profile: decode", n_req);
    for (size_t ci = 0; ci < TD_ARRAY_LEN(ctx_grid) && ctx_grid[ci] + o->decode_tokens <= o->max_context; ci++)
        for (int b = 1; nd < 64; b = (int)TD_MIN(2 * b, o->max_batch)) {
            double step = NAN, ctx = NAN, per = 0, tpm = 1;
            out_len = TD_MIN(out_len, o->max_context - ctx_grid[ci]);
            for (int tries = 0;; tries++) {
                if (loadgen_dataset_random(&r->rng, (size_t)b, (uint32_t)ctx_grid[ci], (uint32_t)out_len, 0, &r->d) != TD_OK ||
                    cluster_run(r->cl, o, &r->d, b, &r->rep, false, &r->ph) != TD_OK)
                    return false;
                decode_window(&r->rep, (uint32_t)ctx_grid[ci], &step, &ctx, &per, &tpm);
                loadgen_run_free(&r->rep);
                loadgen_dataset_free(&r->d);
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
                if (loadgen_dataset_random(&r->rng, (size_t)b, (uint32_t)ctx_grid[ci], (uint32_t)out_len, 0, &r->d) != TD_OK ||
                    cluster_run(r->cl, o, &r->d, b, &r->rep, false, &r->ph) != TD_OK)
                    return false;
                decode_window(&r->rep, (uint32_t)ctx_grid[ci], &steps[n_rounds], &ctxs[n_rounds], &p2, &tpm);
                loadgen_run_free(&r->rep);
                loadgen_dataset_free(&r->d);
                if (!(p2 >= 2))
                    break;
            }
            if (per >= 2)
                step = median(steps, n_rounds), ctx = median(ctxs, n_rounds);
            if (!(per >= 2)) { /* left out, said so; too few points left is the error below */
                phase_say(&r->ph);
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
            phase_say(&r->ph);
            fprintf(stderr, "plan profile: decode batch %3d context %6.1f  %9.3f ms (%.1f gaps a stream)\n", b, ctx,
                    step * 1e3, per);
            if (b == o->max_batch)
                break;
        }
    phase_end(&r->ph);
    if (nd < 3) {
        td_errorf(TD_ERR_INVALID, "plan profile: %d decode points are too few to fit three terms: raise --max-batch, "
                  "--max-context or --decode-tokens", nd);
        r->usage = true;
        return false;
    }
    if (td_plan_fit_relative(dx, dy, nd, 3, r->dc) != TD_OK)
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
    const loadgen_profile_opts_t *o = r->o;
    /* speed: lone requests of 16 prompt tokens and --decode-tokens, one after another; each one's
     * mean time between tokens from its second (the first gap carries the KV transfer) */
    if (o->speed_runs > 0) {
        double *means = malloc((size_t)o->speed_runs * sizeof *means);
        int k = 0;
        if (!means) {
            td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
            return false;
        }
        if (loadgen_dataset_random(&r->rng, (size_t)o->speed_runs, 16, (uint32_t)o->decode_tokens, 0, &r->d) != TD_OK) {
            free(means);
            return false;
        }
        td_status_t st = TD_OK;
        phase_begin(&r->ph, o->progress, "plan profile: speed", (size_t)o->speed_runs);
        for (int64_t i = 0; i < o->speed_runs && st == TD_OK; i++) {
            loadgen_dataset_t one = {.items = &r->d.items[i], .n = 1};
            if ((st = cluster_run(r->cl, o, &one, 1, &r->rep, false, &r->ph)) != TD_OK)
                break;
            const loadgen_reply_t *rr = &r->rep.r[0];
            if (rr->n_itl >= 2) { /* tokens a message: a router that fell behind merges them */
                double sum = 0, f = (double)rr->output_tokens / (double)(rr->n_itl + 1);
                for (uint32_t g = 1; g < rr->n_itl; g++)
                    sum += rr->itl_ms[g] * 1e-3;
                if (sum > 0) /* all its messages read together: no time to read */
                    means[k++] = sum / ((double)(rr->n_itl - 1) * f);
            }
            loadgen_run_free(&r->rep);
        }
        loadgen_dataset_free(&r->d);
        if (st == TD_OK)
            phase_end(&r->ph);
        if (st == TD_OK)
            td_plan_profile_speed(r->j, means, k, (int)o->decode_tokens - 2,
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
    const loadgen_profile_opts_t *o = r->o;
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

td_status_t loadgen_profile_cluster(const loadgen_profile_opts_t *o, cJSON **j_p, loadgen_profile_fits_t *fits_p,
                                   bool *usage_p)
{
    td_status_t st = TD_ERR_NOMEM;
    prof_run_t r_ = {.o = o}, *r = &r_;
    *usage_p = false;
    /* prompts of their own each time: a second profile of the same cluster must not find the
     * first one's prompts in the prefill node's prefix cache */
    uint64_t seed = td_now_ns() ^ ((uint64_t)getpid() << 32);
    loadgen_rng_seed(&r->rng, seed);
    r->tt = malloc((size_t)o->reps * sizeof *r->tt);
    r->gap = malloc((size_t)o->reps * sizeof *r->gap);
    if (!r->tt || !r->gap) {
        td_errorf(TD_ERR_NOMEM, "plan profile: out of memory");
        goto out;
    }
    if ((st = loadgen_client_create(&o->cfg, "tandem plan profile", &r->cl)) != TD_OK) {
        *usage_p = true;
        goto out;
    }
    /* one request first: a cluster that is not there is one clear error, and a warm-up */
    if ((st = loadgen_dataset_random(&r->rng, 1, 8, 2, 0, &r->d)) != TD_OK ||
        (st = cluster_run(r->cl, o, &r->d, 1, &r->rep, true, NULL)) != TD_OK)
        goto out;
    loadgen_run_free(&r->rep);
    loadgen_dataset_free(&r->d);
    cJSON *j = r->j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "tandem_plan_profile", 1);
    cJSON_AddStringToObject(j, "source", o->cfg.gateway ? "gateway" : "openai");
    cJSON_AddStringToObject(j, "target", o->target);
    cJSON_AddStringToObject(j, "model", o->cfg.model ? o->cfg.model : "(the served one)");
    cJSON_AddNumberToObject(j, "vocab_size", o->cfg.vocab);
    cJSON_AddNumberToObject(j, "prompt_seed", (double)(seed >> 12)); /* a JSON number holds 52 bits */
    if (!prof_prefill(r) || !prof_decode(r) || !prof_speed(r)) {
        st = TD_ERR_UNAVAILABLE;
        *usage_p = r->usage;
        goto out;
    }
    prof_kv_transfer(r);
    double over = prof_overhead(r);
    loadgen_profile_fits_t f = {.overhead_s = over};
    memcpy(f.prefill, r->pc, sizeof f.prefill);
    memcpy(f.decode, r->dc, sizeof f.decode);
    memcpy(f.kv, r->xc, sizeof f.kv);
    *fits_p = f;
    *j_p = r->j;
    r->j = NULL;
    st = TD_OK;
out:
    if (r->ph.on) /* a phase that failed: its terminal line ends before the error is said */
        td_progress_end(&r->ph.prog);
    loadgen_run_free(&r->rep);
    loadgen_dataset_free(&r->d);
    loadgen_client_destroy(r->cl);
    cJSON_Delete(r->j);
    free(r->tt), free(r->gap);
    return st;
}
