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
 *       the same profile measured through a running cluster with the load generator
 *       (common/loadgen/loadgen_profile.h).
 *   tandem plan --profile P (--workload W | --metrics URL) --ttft MS --tpot MS
 *               [--rate R | --nodes N] [--split P:D | --unified N] [--prefill-policy conditional|follow] [--json]
 *       simulates the cluster (common/plan/td_plan.h) and answers: the P:D split and batch
 *       limits with the most goodput per node, the highest rate N nodes sustain and the mode
 *       (disaggregated, conditional, follow, unified) that sustains the most, the nodes a rate
 *       needs, and a what-if table.
 *   tandem plan calibrate --profile P --prefill-metrics URL --decode-metrics URL --context C --out P2
 *       scales a profile's fits to the mean step times the running nodes report (their own
 *       step histograms: the whole scheduler step, at the CPU share they really had).
 *
 * The workload: `random:IN:OUT[:RANGE]`, `trace:FILE` or a live router's /metrics
 * (common/loadgen/loadgen_workload.h). The profile's method and file are
 * common/plan/td_plan_profile.h; this file is the flags, the calls and the printing.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "loadgen_profile.h"
#include "loadgen_workload.h"
#include "router_policy.h"
#include "td_backend.h"
#include "td_cli.h"
#include "td_engine.h"
#include "td_http_client.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_model.h"
#include "td_plan.h"
#include "td_plan_profile.h"
#include "td_stats.h"
#include "td_util.h"

/* ==== profile: an engine in this process ========================================================= */

/* The median of v[0..n) (sorted in place). */
static double median(double *v, int n)
{
    td_stats_sort(v, (size_t)n);
    return td_stats_median(v, (size_t)n);
}

/* Seconds of one prefill step of `tokens` tokens (one new sequence, one logit row): median. */
static td_status_t time_prefill(td_engine_t *eng, const int32_t *toks, int tokens, float *logits, double *s_p)
{
    double t[TD_PLAN_PROFILE_REPS];
    for (int rep = -1; rep < TD_PLAN_PROFILE_REPS; rep++) { /* one warm-up */
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
    *s_p = median(t, TD_PLAN_PROFILE_REPS);
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

/* The engine td_plan_profile_engine times, with its prompt ids and logits. */
typedef struct engine_probe {
    td_engine_t *eng;
    const int32_t *toks;
    float *logits;
} engine_probe_t;

static td_status_t probe_prefill(void *ctx, int tokens, double *s_p)
{
    engine_probe_t *p = ctx;
    return time_prefill(p->eng, p->toks, tokens, p->logits, s_p);
}

static td_status_t probe_decode(void *ctx, int batch, int context, int reps, double *median_p, double *mean_p)
{
    engine_probe_t *p = ctx;
    return time_decode(p->eng, p->toks, batch, context, reps, p->logits, median_p, mean_p);
}

/* The profile of an engine in this process (--model): engine, prompt ids, the sweeps. */
static int profile_engine(const char *model_path, const td_device_spec_t *dev, int64_t threads, int64_t max_tokens,
                          int64_t max_batch, const loadgen_profile_opts_t *co, const char *out)
{
    int rc = 1;
    td_backend_t *be = NULL;
    td_model_t *model = NULL;
    td_engine_t *eng = NULL;
    float *logits = NULL;
    int32_t *toks = NULL;
    cJSON *j = NULL;
    if (td_backend_open(dev, (int32_t)threads, TD_F32, &be) != TD_OK || td_model_load(model_path, &model) != TD_OK)
        goto out;
    const td_model_config_t *c = &model->config;
    int max_prompt = (int)TD_MIN(max_tokens, (int64_t)c->max_seq_len - 1);
    int max_ctx = td_plan_profile_engine_context(c->max_seq_len);
    td_engine_config_t ec = td_engine_config_default();
    ec.prefix_cache = false;
    ec.max_batch_tokens = TD_MAX(max_prompt, 64);
    ec.max_seqs = ec.max_logit_rows = (int32_t)TD_MAX(max_batch, 1);
    ec.n_blocks = (int32_t)(max_batch * TD_DIV_CEIL(max_ctx + TD_PLAN_PROFILE_REPS + 2, ec.block_size) +
                            TD_DIV_CEIL(TD_MAX(max_prompt + 1, 16 + co->decode_tokens + 2), ec.block_size) + 8);
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
    cJSON_AddStringToObject(j, "device", dev->cuda ? "cuda" : "cpu");
    engine_probe_t ep = {.eng = eng, .toks = toks, .logits = logits};
    td_plan_engine_probe_t pr = {.ctx = &ep, .prefill = probe_prefill, .decode = probe_decode};
    td_plan_engine_sweep_t sw = {
        .max_prompt = max_prompt, .max_context = max_ctx, .max_batch = max_batch, .speed_runs = co->speed_runs,
        .speed_steps = (int)TD_MIN(co->decode_tokens, (int64_t)c->max_seq_len - 16 - 2), /* the model's context */
        .max_seq_len = c->max_seq_len,
        .kv_bytes_per_token = (double)td_engine_kv_block_bytes(model, &ec) / ec.block_size};
    td_plan_engine_fits_t f;
    if (td_plan_profile_engine(&pr, &sw, j, &f) != TD_OK || td_plan_profile_write(j, "plan profile", out) != TD_OK)
        goto out;
    printf("Profile written:                         %s\n", out);
    printf("Prefill step (ms):                       %.4f + %.6f x tokens + %.3g x tokens^2\n", f.prefill[0] * 1e3,
           f.prefill[1] * 1e3, f.prefill[2] * 1e3);
    printf("Decode step (ms):                        %.4f + %.6f x batch + %.3g x context tokens\n",
           f.decode[0] * 1e3, f.decode[1] * 1e3, f.decode[2] * 1e3);
    printf("KV transfer (ms per token, modelled):    %.6f\n", f.kv_s_per_token * 1e3);
    rc = 0;
out:
    cJSON_Delete(j);
    free(logits), free(toks);
    td_engine_destroy(eng);
    td_model_destroy(model);
    td_backend_destroy(be);
    return rc;
}

/* The profile of a running cluster (--gateway / --openai), written to out. */
static int profile_cluster(const loadgen_profile_opts_t *o, const char *out)
{
    cJSON *j = NULL;
    loadgen_profile_fits_t f;
    bool usage = false;
    if (loadgen_profile_cluster(o, &j, &f, &usage) != TD_OK)
        return usage ? 2 : 1;
    int rc = td_plan_profile_write(j, "plan profile", out) == TD_OK ? 0 : 1;
    cJSON_Delete(j);
    if (rc)
        return rc;
    printf("Profile written:                         %s\n", out);
    printf("Measured through:                        %s %s\n", o->cfg.gateway ? "gateway" : "openai", o->target);
    printf("Prefill step (ms):                       %.4f + %.6f x tokens + %.3g x tokens^2%s\n", f.prefill[0] * 1e3,
           f.prefill[1] * 1e3, f.prefill[2] * 1e3, o->prefill_metrics ? "" : " (TTFT)");
    printf("Decode step (ms):                        %.4f + %.6f x batch + %.3g x context tokens\n",
           f.decode[0] * 1e3, f.decode[1] * 1e3, f.decode[2] * 1e3);
    printf("KV transfer (ms, measured):              %.4f + %.6f x tokens\n", f.kv[0] * 1e3, f.kv[1] * 1e3);
    printf("Fixed overhead (ms):                     %.4f%s\n", f.overhead_s * 1e3,
           o->prefill_metrics ? "" : " (not separated: give --prefill-metrics)");
    return 0;
}

static int plan_profile(int argc, char **argv)
{
    const char *model_path = NULL, *out = "plan-profile.json";
    int64_t threads = 0, max_tokens = 0, max_batch = 0, vocab = 256;
    td_device_spec_t dev = {0};
    float timeout_s = 60;
    loadgen_profile_opts_t co = {.cfg = loadgen_config_default(), .max_context = 512, .decode_tokens = 32, .reps = 5,
                                 .speed_runs = 32, .progress = true};
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
        co.cfg.vocab = (uint32_t)vocab;
        co.cfg.request_timeout_s = timeout_s;
        co.max_tokens = max_tokens ? max_tokens : 256;
        co.max_batch = max_batch ? max_batch : 16;
        return profile_cluster(&co, out);
    }
    return profile_engine(model_path, &dev, threads ? threads : 1, max_tokens ? max_tokens : 512,
                          max_batch ? max_batch : 64, &co, out);
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
    if (td_plan_profile_load(in, &p) != TD_OK) {
        rc = 2;
        goto out;
    }
    if (td_file_read_all(in, (size_t)64 << 20, &text, &len) != TD_OK || !(j = cJSON_ParseWithLength(text, len)))
        goto out;
    cJSON *cal = cJSON_CreateObject();
    cJSON_DeleteItemFromObjectCaseSensitive(j, "calibration"); /* a calibrated profile calibrated again */
    cJSON_AddItemToObject(j, "calibration", cal);
    if (pm) {
        if (td_http_client_get(pm, "--prefill-metrics", "/metrics", 5000, &m) != TD_OK)
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
        if (td_http_client_get(dm, "--decode-metrics", "/metrics", 5000, &m) != TD_OK)
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
    if (td_plan_profile_write(j, "plan calibrate", out) != TD_OK)
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
    const char *profile, *workload, *metrics, *split, *rates, *prefill_policy;
    double ttft_ms, tpot_ms, tpot_objective_ms, rate, attainment, overhead_ms, metrics_window_s;
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
        snprintf(b, cap, "%d:%d%s", c->n_prefill, c->n_decode, c->follow ? "f" : c->conditional ? "c" : "");
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
    cJSON_AddNumberToObject(o, "placed_local", r->n ? (double)r->placed_local / (double)r->n : 0);
    cJSON_AddNumberToObject(o, "placed_peer", r->n ? (double)r->placed_peer / (double)r->n : 0);
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
    if ((c->conditional || c->follow) && r->n)
        printf("  Prompts local / peer / remote (%%):      %.1f / %.1f / %.1f\n", 100.0 * r->placed_local / r->n,
               100.0 * r->placed_peer / r->n, 100.0 * (r->n - r->placed_local - r->placed_peer) / r->n);
}

/* The split of n nodes with the highest sustained rate (follow: 0:n too, decode nodes only). */
static td_status_t best_split(const plan_ctx_t *x, int n, td_plan_cluster_t *best_c, double *best_rate)
{
    *best_rate = -1;
    for (int p = x->base.follow ? 0 : 1; p < n; p++) {
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

/* P:D, P >= min_p (follow: 0, decode nodes only), D >= 1. */
static int parse_split(const char *s, int min_p, int *p, int *d)
{
    char *end;
    long a = strtol(s, &end, 10), b = *end == ':' ? strtol(end + 1, &end, 10) : 0;
    if (a < min_p || b < 1 || a > 1024 || b > 1024 || *end)
        return -1;
    *p = (int)a, *d = (int)b;
    return 0;
}

/* The plan's header: profile, speed, workload, objectives. */
static void plan_header(const plan_opts_t *o, const plan_ctx_t *x, const loadgen_workload_t *w, cJSON *j,
                        double mean_in, double mean_out)
{
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
}

/* --split or --unified: that one configuration, at the rate, the trace's times or its highest rate. */
static td_status_t plan_one(const plan_opts_t *o, const plan_ctx_t *x, const loadgen_workload_t *w, double rate,
                            cJSON *j)
{
    int sp = 0, sd = 0;
    td_status_t st;
    if (o->split)
        parse_split(o->split, 0, &sp, &sd);
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
        return st;
    if (!o->json)
        print_result("Simulated", &c, rate, &r);
    cJSON_AddItemToObject(j, "simulated", result_json(&c, rate, &r));
    return TD_OK;
}

/* --nodes N: the best split of N nodes, its batch limits, and N unified nodes. */
static td_status_t plan_nodes(const plan_opts_t *o, const plan_ctx_t *x, cJSON *j, double *best_rate_p)
{
    td_status_t st;
    td_plan_cluster_t best_c = x->base;
    double best_rate = 0;
    if (o->nodes < 2) {
        td_plan_cluster_t u = split_cluster(x, 0, 0, 1);
        if ((st = td_plan_max_rate(&x->prof, &u, &x->L, &x->s, &best_rate, NULL)) != TD_OK)
            return st;
        best_c = u;
    } else if ((st = best_split(x, (int)o->nodes, &best_c, &best_rate)) != TD_OK) {
        return st;
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
                return st;
            if (r > lim_rate * 1.02) /* a clear win over the defaults, not the search's noise */
                lim_rate = r, lim = c;
        }
    td_plan_cluster_t u = split_cluster(x, 0, 0, (int)o->nodes);
    double u_rate;
    if ((st = td_plan_max_rate(&x->prof, &u, &x->L, &x->s, &u_rate, NULL)) != TD_OK)
        return st;
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
    *best_rate_p = best_rate;
    return TD_OK;
}

/* --nodes N: the mode that sustains the most with N nodes: each policy's best split (follow's may be
 * 0:N, decode nodes only; disaggregated and conditional need N >= 2) and N unified nodes. Ties go to
 * the mode listed first (the simpler one). */
static td_status_t plan_modes(const plan_opts_t *o, const plan_ctx_t *x, cJSON *j)
{
    static const struct {
        const char *name;
        bool conditional, follow;
    } modes[] = {{"disaggregated", false, false}, {"conditional", true, false}, {"follow", false, true}};
    int n = (int)o->nodes;
    cJSON *tab = cJSON_AddArrayToObject(j, "modes");
    char best[32] = "", name[32];
    const char *best_mode = NULL;
    double best_rate = -1, r;
    td_status_t st;
    if (!o->json)
        printf("--------------- Modes ---------------\n%-14s %6s %12s\n", "mode", "split", "max rate");
    for (size_t i = 0; i <= TD_ARRAY_LEN(modes); i++) {
        td_plan_cluster_t c;
        const char *mode = i < TD_ARRAY_LEN(modes) ? modes[i].name : "unified";
        if (i < TD_ARRAY_LEN(modes)) {
            plan_ctx_t m = *x;
            m.base.conditional = modes[i].conditional;
            m.base.follow = modes[i].follow;
            if (n < 2 && !m.base.follow)
                continue; /* a P:D split needs two nodes */
            if ((st = best_split(&m, n, &c, &r)) != TD_OK)
                return st;
        } else {
            c = split_cluster(x, 0, 0, n);
            if ((st = td_plan_max_rate(&x->prof, &c, &x->L, &x->s, &r, NULL)) != TD_OK)
                return st;
        }
        split_name(name, sizeof name, &c);
        if (!o->json)
            printf("%-14s %6s %12.3f\n", mode, name, r);
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "mode", mode);
        cJSON_AddStringToObject(e, "split", name);
        cJSON_AddNumberToObject(e, "max_rate", r);
        cJSON_AddItemToArray(tab, e);
        if (r > best_rate)
            best_rate = r, best_mode = mode, snprintf(best, sizeof best, "%s", name);
    }
    if (!o->json)
        printf("Recommended mode:                        %s (split %s, %.3f req/s)\n", best_mode, best, best_rate);
    cJSON_AddStringToObject(j, "recommended_mode", best_mode);
    cJSON_AddStringToObject(j, "recommended_split", best);
    return TD_OK;
}

/* --rate R (or the workload's): the nodes it needs, split and unified; *need_p the split's. */
static td_status_t plan_need(const plan_opts_t *o, const plan_ctx_t *x, double rate, cJSON *j, int *need_p)
{
    td_status_t st;
    int need = 0, need_u = 0;
    td_plan_cluster_t need_c = x->base;
    for (int n = 2; n <= o->max_nodes && !need; n++) {
        double r;
        td_plan_cluster_t c;
        if ((st = best_split(x, n, &c, &r)) != TD_OK)
            return st;
        if (r >= rate)
            need = n, need_c = c;
    }
    for (int n = 1; n <= o->max_nodes && !need_u; n++) {
        td_plan_cluster_t c = split_cluster(x, 0, 0, n);
        double r;
        if ((st = td_plan_max_rate(&x->prof, &c, &x->L, &x->s, &r, NULL)) != TD_OK)
            return st;
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
    *need_p = need;
    return TD_OK;
}

/* What-if: every split of n_what nodes and n_what unified ones, at a few rates (--rates, or
 * around best_rate). The exit code: 2 for a bad --rates, 1 for a failed simulation. */
static int plan_what_if(const plan_opts_t *o, const plan_ctx_t *x, int n_what, double best_rate, cJSON *j)
{
    td_status_t st = TD_OK;
    double *rates = NULL;
    size_t n_rates = 0;
    if (o->rates) {
        if (loadgen_rates_parse(o->rates, &rates, &n_rates) != TD_OK)
            return 2;
    } else {
        static const double f[] = {0.5, 0.75, 1.0, 1.25, 1.5};
        if (!(rates = malloc(sizeof f)))
            return 1;
        for (size_t i = 0; i < TD_ARRAY_LEN(f); i++)
            rates[i] = f[i] * TD_MAX(best_rate, 0.01);
        n_rates = TD_ARRAY_LEN(f);
    }
    cJSON *tab = cJSON_AddArrayToObject(j, "what_if");
    if (!o->json)
        printf("--------------- What-if ---------------\n%-6s %10s %12s %14s %8s %12s %12s\n", "split", "rate",
               "goodput", "goodput/node", "SLO %", "TTFT p90 ms", "TPOT p90 ms");
    for (int p = x->base.follow ? 0 : 1; p <= n_what && st == TD_OK; p++) {
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
    return st == TD_OK ? 0 : 1;
}

static int plan_run(const plan_opts_t *o, plan_ctx_t *x, loadgen_workload_t *w)
{
    cJSON *j = cJSON_CreateObject();
    int rc = 1;
    td_status_t st = TD_OK;
    double mean_in = 0, mean_out = 0;
    for (size_t i = 0; i < w->n; i++)
        mean_in += (double)w->in[i] / (double)w->n, mean_out += (double)w->out[i] / (double)w->n;
    double rate = o->rate > 0 ? o->rate : w->rate;
    plan_header(o, x, w, j, mean_in, mean_out);
    if (o->split || o->unified) { /* one configuration */
        rc = plan_one(o, x, w, rate, j) == TD_OK ? 0 : 1;
        goto out;
    }
    int n_what = 0;
    double best_rate = 0;
    if (o->nodes > 0) {
        if ((st = plan_nodes(o, x, j, &best_rate)) != TD_OK || (st = plan_modes(o, x, j)) != TD_OK)
            goto out;
        n_what = (int)o->nodes;
    }
    if (rate > 0) { /* the nodes the rate needs */
        int need = 0;
        if ((st = plan_need(o, x, rate, j, &need)) != TD_OK)
            goto out;
        if (!n_what)
            n_what = need ? need : (int)o->max_nodes;
        if (!best_rate)
            best_rate = rate;
    }
    rc = plan_what_if(o, x, n_what, best_rate, j);
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
               "                   --ttft MS --tpot MS [--rate R] [--nodes N] [--split P:D | --unified N]\n"
               "                   [--prefill-policy disaggregated|conditional|follow] [--json]\n");
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
    float ttft = 0, tpot = 0, rate = 0, att = 0.9f, overhead = -1, window = 5, tpot_obj = 0, ttft_obj = 0;
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
        TD_OPT_STRING("prefill-policy", &o.prefill_policy,
                      "the router's for P:D splits: disaggregated (default) | conditional (each prompt on its decode "
                      "node when that is sooner and keeps its streams within --tpot-objective-ms; splits print as "
                      "P:Dc) | follow (conditional, or another decode node when that is sooner; P may be 0: --split "
                      "0:2; splits print as P:Df)"),
        {.name = "tpot-objective-ms", .type = TD_OPT_F32, .ptr = &tpot_obj, .fmin = 1e-3f, .fmax = 1e7f, .arg = "MS",
         .help = "conditional, follow: the router's --tpot-objective-ms (default: --tpot)"},
        {.name = "ttft-objective-ms", .type = TD_OPT_F32, .ptr = &ttft_obj, .fmin = 0, .fmax = 1e7f, .arg = "MS",
         .help = "conditional, follow: the router's --ttft-objective-ms (default 0: none)"},
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
    router_prefill_policy_t policy = ROUTER_PREFILL_DISAGGREGATED;
    if (o.prefill_policy && router_prefill_policy_parse(o.prefill_policy, &policy) != TD_OK) {
        td_errorf(TD_ERR_INVALID, "tandem plan: --%s", td_last_error());
        return 2;
    }
    if (!o.profile)
        bad = "--profile: required (a file of `tandem plan profile`)";
    else if (!o.workload == !o.metrics)
        bad = "--workload: give one of --workload random:IN:OUT[:RANGE]|trace:FILE and --metrics URL";
    else if (ttft <= 0 || tpot <= 0)
        bad = ttft <= 0 ? "--ttft: required (the TTFT objective in ms)" : "--tpot: required (the TPOT objective in ms)";
    else if (o.split && parse_split(o.split, policy == ROUTER_PREFILL_FOLLOW ? 0 : 1, &sp, &sd))
        bad = policy == ROUTER_PREFILL_FOLLOW
                  ? "--split: not P:D with P >= 0, D >= 1"
                  : "--split: not P:D with P, D >= 1 (P 0 only with --prefill-policy follow)";
    else if (o.split && o.unified)
        bad = "--unified: give --split P:D or --unified N, not both";
    else if (o.unified && policy != ROUTER_PREFILL_DISAGGREGATED)
        bad = "--prefill-policy: conditional and follow place the prompts of a P:D split's decode nodes; give "
              "--split P:D, not --unified N";
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
    x.base.conditional = policy == ROUTER_PREFILL_CONDITIONAL;
    x.base.follow = policy == ROUTER_PREFILL_FOLLOW;
    x.base.tpot_objective_s = (tpot_obj > 0 ? tpot_obj : tpot) * 1e-3;
    x.base.ttft_objective_s = ttft_obj * 1e-3;
    x.s.n_requests = (size_t)o.requests;
    x.s.seed = (uint64_t)o.seed + 1;
    x.s.min_attainment = att;
    x.s.slo = (td_plan_slo_t){.ttft_s = ttft * 1e-3, .tpot_s = tpot * 1e-3};
    loadgen_workload_t w = {0};
    int rc = 1;
    td_status_t st = td_plan_profile_load(o.profile, &x.prof);
    if (st == TD_OK && overhead >= 0)
        x.prof.overhead_s = overhead * 1e-3;
    if (st == TD_OK)
        st = o.metrics ? loadgen_workload_metrics(o.metrics, window, (size_t)o.requests, &w)
                       : loadgen_workload_parse(o.workload, (size_t)o.requests, (uint64_t)o.seed, &w);
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
    loadgen_workload_free(&w);
    return rc;
}
