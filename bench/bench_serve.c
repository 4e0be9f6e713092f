/*
 * bench_serve: `tandem bench serve --base-url URL | --gateway HOST:PORT [options]`, the
 * serving benchmark of issue 16, in the spirit of `vllm bench serve` and AIPerf: a load
 * generator against a running cluster that reports what a user of it sees and whether it
 * met its service-level objectives. It takes vLLM's flags (issue 34: --backend, --base-url,
 * --endpoint, --dataset-name, --random-*-len, --goodput KEY:MS..., --percentile-metrics,
 * --metric-percentiles, --save-result ...), so that a vLLM command line gives the same run,
 * and shows its progress on stderr.
 *
 * Requests come from a dataset (vLLM's random lengths, a ShareGPT file, or a trace that
 * also gives arrival times) and arrive as a Poisson process of --request-rate (gamma with
 * --burstiness as vLLM), at most --max-concurrency in flight (the rest wait in arrival
 * order). Each is a streamed generation: through the OpenAI API a POST /v1/completions with
 * the prompt's token ids (or its text) and stream_options.include_usage; through the gRPC
 * gateway a tandem.v1.Generation/Generate stream. Per request the client clock gives the
 * time to first token (TTFT), every gap between token-carrying chunks (ITL), the end-to-end
 * latency (E2EL) and TPOT = (E2EL - TTFT) / (output tokens - 1); the token counts are the
 * server's usage. Goodput (DistServe): completed requests per second that met every
 * objective of --goodput; SLO attainment: the fraction of requests that did. --sweep runs
 * rate after rate and names the highest that kept attainment >= --sweep-attainment.
 *
 * The load generator is common/loadgen (loadgen_client.h: the connections, the per-request
 * clock, the deadlines; loadgen.h: datasets, arrivals, statistics, goodput), shared with
 * `tandem plan profile --gateway/--openai`; this file is the command: its flags, the dataset
 * they name, the runs they ask for, and the summary and JSON it prints (keys in docs/bench.md).
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "loadgen.h"
#include "loadgen_client.h"
#include "td_bench.h"
#include "td_log.h"
#include "td_opts.h"
#include "td_progress.h"
#include "td_util.h"

/* The latency metrics of --percentile-metrics, in the summary's order. */
enum { BS_TTFT, BS_TPOT, BS_ITL, BS_E2EL, BS_N_METRICS };
static const char *const bs_metric_names[BS_N_METRICS] = {"ttft", "tpot", "itl", "e2el"};

typedef struct bs_opts {
    const char *openai, *gateway, *model, *api_key;
    const char *backend, *base_url, *host, *endpoint; /* vLLM's target flags */
    int64_t port;
    const char *dataset, *dataset_path, *tokenizer;
    int64_t input_len, output_len, vocab_size, sharegpt_output_len;
    float range_ratio;
    float request_rate, burstiness;
    int64_t max_concurrency, max_connections, connections, num_prompts, warmup_prompts, seed;
    float request_timeout_s;
    loadgen_slo_t slo;
    const char *result_file, *result_dir, *result_filename, *sweep;
    float sweep_attainment;
    bool save_result, save_detailed, json, disable_tqdm;
    bool metrics[BS_N_METRICS];          /* --percentile-metrics */
    double pct[LOADGEN_MAX_PERCENTILES]; /* --metric-percentiles [n_pct] */
    size_t n_pct;
    bool chat;                           /* --backend openai-chat */
    char url[300];                       /* the OpenAI target that --host/--port name */
    bool ignore_eos_flag, no_ignore_eos; /* --ignore-eos, --no-ignore-eos as given */
    bool ignore_eos;                     /* sent: the flags, else on for random and trace */
} bs_opts_t;

/* The command's state: its flags, the client, the dataset. */
typedef struct bs_state {
    bs_opts_t o;
    loadgen_client_t *cl;
    loadgen_dataset_t data;
    td_progress_t prog;       /* the run's progress line */
} bs_state_t;

/* ---- output ---------------------------------------------------------------------------------- */

static void bs_line_u(const char *label, uint64_t v)
{
    printf("%-40s %-10llu\n", label, (unsigned long long)v);
}

static void bs_line_f(const char *label, double v)
{
    printf("%-40s %-10.2f\n", label, v);
}

/* A 50-column rule with `title` centred, as vLLM's "{s:{c}^{n}}" */
static void bs_rule(const char *title, char c)
{
    int len = (int)strlen(title), left = (50 - len) / 2, right = 50 - len - left;
    for (int i = 0; i < left; i++)
        putchar(c);
    fputs(title, stdout);
    for (int i = 0; i < right; i++)
        putchar(c);
    putchar('\n');
}

/* A percentile as vLLM names it: "99", "99.9". */
static void bs_pct_word(double p, char *buf, size_t size)
{
    if (p == floor(p))
        snprintf(buf, size, "%d", (int)p);
    else
        snprintf(buf, size, "%g", p);
}

static void bs_print_stat(const bs_state_t *s, const char *name, const loadgen_stat_t *st)
{
    char label[64], pw[32];
    const char *what[] = {"Mean", "Std", "Median"};
    double vals[] = {st->mean, st->std, st->median};
    for (int i = 0; i < 3; i++) {
        snprintf(label, sizeof label, "%s %s (ms):", what[i], name);
        bs_line_f(label, vals[i]);
    }
    for (size_t i = 0; i < s->o.n_pct; i++) {
        bs_pct_word(s->o.pct[i], pw, sizeof pw);
        snprintf(label, sizeof label, "P%s %s (ms):", pw, name);
        bs_line_f(label, st->pct[i]);
    }
}

static void bs_print_run(const bs_state_t *s, const loadgen_run_t *r)
{
    bs_rule(" Serving Benchmark Result ", '=');
    bs_line_u("Successful requests:", r->sum.completed);
    bs_line_u("Failed requests:", r->sum.failed);
    if (s->o.max_concurrency)
        bs_line_u("Maximum request concurrency:", (uint64_t)s->o.max_concurrency);
    if (!s->data.timed)
        bs_line_f("Request rate configured (RPS):", r->rate);
    bs_line_f("Benchmark duration (s):", r->sum.duration_s);
    bs_line_u("Total input tokens:", r->sum.total_input);
    bs_line_u("Total generated tokens:", r->sum.total_output);
    bs_line_f("Request throughput (req/s):", r->sum.request_throughput);
    bs_line_f("Request goodput (req/s):", r->sum.request_goodput);
    bs_line_f("SLO attainment (%):", r->sum.slo_attainment * 100);
    bs_line_f("Output token throughput (tok/s):", r->sum.output_throughput);
    bs_line_f("Total Token throughput (tok/s):", r->sum.total_token_throughput);
    static const char *const titles[BS_N_METRICS] = {"Time to First Token", "Time per Output Token (excl. 1st token)",
                                                     "Inter-token Latency", "End-to-end Latency"};
    static const char *const names[BS_N_METRICS] = {"TTFT", "TPOT", "ITL", "E2EL"};
    const loadgen_stat_t *stats[BS_N_METRICS] = {&r->ttft, &r->tpot, &r->itl, &r->e2el};
    for (int m = 0; m < BS_N_METRICS; m++) {
        if (!s->o.metrics[m])
            continue;
        bs_rule(titles[m], '-');
        bs_print_stat(s, names[m], stats[m]);
    }
    bs_rule("", '=');
    for (size_t i = 0; i < r->n; i++)
        if (r->r[i].error) {
            printf("first error: %s\n", r->r[i].error);
            break;
        }
}

/* A number with `dec` decimals, or null when it is not one. */
static void bs_json_num(cJSON *o, const char *key, double v, int dec)
{
    if (isfinite(v))
        bench_json_number(o, key, v, dec);
    else
        cJSON_AddNullToObject(o, key);
}

static void bs_json_stat(const bs_state_t *s, cJSON *o, const char *name, const loadgen_stat_t *st)
{
    char key[64], pw[32];
    const char *what[] = {"mean", "std", "median"};
    double vals[] = {st->mean, st->std, st->median};
    for (int i = 0; i < 3; i++) {
        snprintf(key, sizeof key, "%s_%s_ms", what[i], name);
        bs_json_num(o, key, vals[i], 3);
    }
    for (size_t i = 0; i < s->o.n_pct; i++) {
        bs_pct_word(s->o.pct[i], pw, sizeof pw);
        snprintf(key, sizeof key, "p%s_%s_ms", pw, name);
        bs_json_num(o, key, st->pct[i], 3);
    }
}

/* A run's keys into o (the document itself for one run, as vLLM's result file, or an
 * entry of "runs" for a sweep). */
static void bs_json_run(const bs_state_t *s, const loadgen_run_t *r, cJSON *o)
{
    bs_json_num(o, "request_rate", r->rate, 3);
    bs_json_num(o, "duration", r->sum.duration_s, 3);
    cJSON_AddNumberToObject(o, "completed", (double)r->sum.completed);
    cJSON_AddNumberToObject(o, "failed", (double)r->sum.failed);
    cJSON_AddNumberToObject(o, "total_input_tokens", (double)r->sum.total_input);
    cJSON_AddNumberToObject(o, "total_output_tokens", (double)r->sum.total_output);
    bs_json_num(o, "request_throughput", r->sum.request_throughput, 3);
    bs_json_num(o, "request_goodput", r->sum.request_goodput, 3);
    bs_json_num(o, "slo_attainment", r->sum.slo_attainment, 4);
    bs_json_num(o, "output_throughput", r->sum.output_throughput, 3);
    bs_json_num(o, "total_token_throughput", r->sum.total_token_throughput, 3);
    cJSON_AddNumberToObject(o, "max_concurrency_seen", (double)r->max_concurrency_seen);
    bs_json_num(o, "bench_cpu_s", r->cpu_s, 3);
    bs_json_num(o, "bench_cpu_us_per_request", r->n ? r->cpu_s / (double)r->n * 1e6 : NAN, 2);
    const loadgen_stat_t *stats[BS_N_METRICS] = {&r->ttft, &r->tpot, &r->itl, &r->e2el};
    for (int m = 0; m < BS_N_METRICS; m++)
        if (s->o.metrics[m])
            bs_json_stat(s, o, bs_metric_names[m], stats[m]);
    const char *first_error = NULL;
    for (size_t i = 0; i < r->n && !first_error; i++)
        first_error = r->r[i].error;
    if (first_error)
        cJSON_AddStringToObject(o, "first_error", first_error);
    else
        cJSON_AddNullToObject(o, "first_error");
    if (!s->o.save_detailed)
        return;
    cJSON *arr = cJSON_AddArrayToObject(o, "requests");
    for (size_t i = 0; arr && i < r->n; i++) {
        const loadgen_reply_t *q = &r->r[i];
        cJSON *e = cJSON_CreateObject();
        if (!e)
            break;
        bs_json_num(e, "arrival_s", q->arrival_s, 6);
        bs_json_num(e, "start_s", q->start_ms * 1e-3, 6);
        cJSON_AddBoolToObject(e, "ok", q->ok);
        cJSON_AddNumberToObject(e, "input_tokens", q->input_tokens);
        cJSON_AddNumberToObject(e, "output_tokens", q->output_tokens);
        cJSON_AddNumberToObject(e, "requested_output_tokens", q->requested_tokens);
        bs_json_num(e, "ttft_ms", q->ok ? q->ttft_ms : NAN, 3);
        bs_json_num(e, "tpot_ms", q->ok ? q->tpot_ms : NAN, 3);
        bs_json_num(e, "e2el_ms", q->ok ? q->e2el_ms : NAN, 3);
        /* sent to ended, failed ones too (how fast a refusal came) */
        bs_json_num(e, "end_ms", q->end_ms, 3);
        cJSON *itl = cJSON_AddArrayToObject(e, "itl_ms");
        for (uint32_t j = 0; itl && j < q->n_itl; j++)
            cJSON_AddItemToArray(itl, cJSON_CreateNumber(round(q->itl_ms[j] * 1e3) / 1e3));
        if (q->error)
            cJSON_AddStringToObject(e, "error", q->error);
        else
            cJSON_AddNullToObject(e, "error");
        cJSON_AddItemToArray(arr, e);
    }
}

static cJSON *bs_json_doc(const bs_state_t *s, const loadgen_run_t *runs, size_t n_runs, double best)
{
    cJSON *j = cJSON_CreateObject();
    if (!j)
        return NULL;
    cJSON_AddStringToObject(j, "bench", "serve");
    cJSON_AddStringToObject(j, "backend", s->o.gateway ? "grpc" : s->o.chat ? "openai-chat" : "openai");
    cJSON_AddStringToObject(j, "target", s->o.gateway ? s->o.gateway : s->o.openai);
    if (s->o.model)
        cJSON_AddStringToObject(j, "model_id", s->o.model);
    cJSON_AddStringToObject(j, "dataset", s->o.dataset);
    cJSON_AddBoolToObject(j, "ignore_eos", s->o.ignore_eos);
    cJSON_AddNumberToObject(j, "num_prompts", (double)s->o.num_prompts);
    cJSON_AddNumberToObject(j, "warmup_prompts", (double)s->o.warmup_prompts);
    bs_json_num(j, "burstiness", s->o.burstiness, 3);
    cJSON_AddNumberToObject(j, "max_concurrency", (double)s->o.max_concurrency);
    cJSON_AddNumberToObject(j, "seed", (double)s->o.seed);
    char date[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(date, sizeof date, "%Y%m%d-%H%M%S", localtime_r(&now, &tm));
    cJSON_AddStringToObject(j, "date", date);
    cJSON *g = cJSON_AddObjectToObject(j, "goodput_config");
    if (g && s->o.slo.ttft_ms > 0)
        bs_json_num(g, "ttft", s->o.slo.ttft_ms, 3);
    if (g && s->o.slo.tpot_ms > 0)
        bs_json_num(g, "tpot", s->o.slo.tpot_ms, 3);
    if (g && s->o.slo.e2el_ms > 0)
        bs_json_num(g, "e2el", s->o.slo.e2el_ms, 3);
    if (!s->o.sweep) {
        bs_json_run(s, &runs[0], j);
        return j;
    }
    cJSON *arr = cJSON_AddArrayToObject(j, "runs");
    for (size_t i = 0; arr && i < n_runs; i++) {
        cJSON *r = cJSON_CreateObject();
        if (r) {
            bs_json_run(s, &runs[i], r);
            cJSON_AddItemToArray(arr, r);
        }
    }
    bs_json_num(j, "sweep_attainment", s->o.sweep_attainment, 3);
    bs_json_num(j, "sweep_best_rate", best, 3);
    return j;
}

/* ---- options ------------------------------------------------------------------------------- */

static td_status_t bs_parse_goodput(const td_opt_t *opt, const char *value)
{
    return loadgen_slo_parse(value, opt->ptr);
}

static td_status_t bs_parse_rate(const td_opt_t *opt, const char *value)
{
    char *e;
    double v = !strcmp(value, "inf") ? INFINITY : strtod(value, &e);
    if (strcmp(value, "inf") && (e == value || *e || !(v > 0)))
        return td_errorf(TD_ERR_INVALID, "--%s: '%s' is not a rate > 0 (requests/s) or inf", opt->name, value);
    *(float *)opt->ptr = (float)v;
    return TD_OK;
}

static td_status_t bs_parse_dataset(const td_opt_t *opt, const char *value)
{
    if (strcmp(value, "random") && strcmp(value, "sharegpt") && strcmp(value, "trace"))
        return td_errorf(TD_ERR_INVALID, "--%s: '%s' is not random, sharegpt or trace (the datasets bench serve has)",
                         opt->name, value);
    *(const char **)opt->ptr = value;
    return TD_OK;
}

/* vLLM's --backend: openai (and vllm, its old name) are /v1/completions, openai-chat
 * /v1/chat/completions; the others are servers tandem does not speak. */
static td_status_t bs_parse_backend(const td_opt_t *opt, const char *value)
{
    if (strcmp(value, "openai") && strcmp(value, "vllm") && strcmp(value, "openai-chat"))
        return td_errorf(TD_ERR_INVALID, "--%s: '%s' is not openai, vllm or openai-chat (use --gateway for tandem's "
                         "gRPC)", opt->name, value);
    *(const char **)opt->ptr = value;
    return TD_OK;
}

/* --percentile-metrics ttft,tpot,itl,e2el: which latencies the summary and JSON carry. */
static td_status_t bs_parse_metrics(const td_opt_t *opt, const char *value)
{
    bool *on = opt->ptr, any = false;
    bool want[BS_N_METRICS] = {0};
    for (const char *p = value; *p;) {
        size_t len = strcspn(p, ",");
        int m = 0;
        while (m < BS_N_METRICS && (strlen(bs_metric_names[m]) != len || strncmp(p, bs_metric_names[m], len)))
            m++;
        if (m == BS_N_METRICS)
            return td_errorf(TD_ERR_INVALID, "--%s: '%.*s' is not ttft, tpot, itl or e2el", opt->name, (int)len, p);
        want[m] = any = true;
        p += len + (p[len] == ',');
    }
    if (!any)
        return td_errorf(TD_ERR_INVALID, "--%s: give a comma list of ttft, tpot, itl, e2el", opt->name);
    memcpy(on, want, sizeof want);
    return TD_OK;
}

/* --metric-percentiles 50,90,99: the percentiles each latency reports. */
static td_status_t bs_parse_percentiles(const td_opt_t *opt, const char *value)
{
    bs_opts_t *o = opt->ptr;
    size_t n = 0;
    double pct[LOADGEN_MAX_PERCENTILES];
    for (const char *p = value; *p;) {
        char *e;
        double v = strtod(p, &e);
        if (e == p || (*e && *e != ',') || !(v >= 0 && v <= 100))
            return td_errorf(TD_ERR_INVALID, "--%s: '%s' is not a comma list of percentiles in [0, 100]", opt->name,
                             value);
        if (n == LOADGEN_MAX_PERCENTILES)
            return td_errorf(TD_ERR_INVALID, "--%s: at most %d percentiles", opt->name, LOADGEN_MAX_PERCENTILES);
        pct[n++] = v;
        p = *e ? e + 1 : e;
    }
    if (!n)
        return td_errorf(TD_ERR_INVALID, "--%s: give a comma list of percentiles such as 50,90,99", opt->name);
    memcpy(o->pct, pct, n * sizeof *pct);
    o->n_pct = n;
    return TD_OK;
}

static td_status_t bs_parse_sweep(const td_opt_t *opt, const char *value)
{
    double *rates;
    size_t n;
    td_status_t st = loadgen_rates_parse(value, &rates, &n);
    if (st != TD_OK)
        return st;
    free(rates);
    *(const char **)opt->ptr = value;
    return TD_OK;
}

/* openai-chat: each ids prompt decoded to the text of its user message, as vLLM's random
 * dataset decodes its ids (the server's usage then counts the tokens it got). */
static td_status_t bs_chat_text(bs_state_t *s)
{
    td_tokenizer_t *tok = NULL;
    td_status_t st = td_tokenizer_load(s->o.tokenizer, &tok);
    uint32_t vocab = (uint32_t)s->o.vocab_size;
    for (size_t i = 0; st == TD_OK && i < s->data.n; i++) {
        loadgen_item_t *it = &s->data.items[i];
        if (it->text)
            continue;
        int32_t *ids = malloc((it->input_len ? it->input_len : 1) * sizeof *ids);
        if (!ids) {
            st = td_errorf(TD_ERR_NOMEM, "bench serve: out of memory for a prompt");
            break;
        }
        for (uint32_t j = 0; j < it->input_len; j++)
            ids[j] = (int32_t)loadgen_prompt_id(it, j, vocab);
        st = td_tokenizer_decode(tok, ids, it->input_len, &it->text, NULL);
        if (st == TD_ERR_RANGE)
            st = td_errorf(st, "--vocab-size %u: above %s's vocabulary", vocab, s->o.tokenizer);
        free(ids);
    }
    td_tokenizer_destroy(tok);
    return st;
}

static td_status_t bs_load_dataset(bs_state_t *s, size_t n, loadgen_rng_t *rng)
{
    const bs_opts_t *o = &s->o;
    if (!strcmp(o->dataset, "random")) {
        td_status_t st = loadgen_dataset_random(rng, n, (uint32_t)o->input_len, (uint32_t)o->output_len,
                                                o->range_ratio, &s->data);
        return st == TD_OK && o->chat ? bs_chat_text(s) : st;
    }
    if (!o->dataset_path)
        return td_errorf(TD_ERR_INVALID, "--dataset %s needs --dataset-path FILE", o->dataset);
    char *text = NULL;
    size_t len = 0;
    td_status_t st = td_file_read_all(o->dataset_path, (size_t)4 << 30, &text, &len);
    if (st != TD_OK)
        return st;
    if (!strcmp(o->dataset, "trace")) {
        st = loadgen_dataset_trace_parse(text, len, o->dataset_path, n, rng, &s->data);
        if (st == TD_OK && o->chat)
            st = bs_chat_text(s);
    } else {
        td_tokenizer_t *tok = NULL;
        if (o->tokenizer && (st = td_tokenizer_load(o->tokenizer, &tok)) != TD_OK) {
            free(text);
            return st;
        }
        st = loadgen_dataset_sharegpt_parse(text, len, o->dataset_path, tok, (uint32_t)o->sharegpt_output_len, n, rng,
                                       &s->data);
        td_tokenizer_destroy(tok);
    }
    free(text);
    return st;
}

static const char bs_usage[] =
    "usage: tandem bench serve (--base-url URL | --host H --port P | --gateway HOST:PORT) [options]\n"
    "\n"
    "A load generator against a running cluster (issue 16), speaking `vllm bench serve`'s flags: a\n"
    "vLLM command line (--backend openai|openai-chat --base-url --endpoint --dataset-name random\n"
    "--random-input-len --random-output-len --random-range-ratio --num-prompts --request-rate\n"
    "--max-concurrency --goodput ttft:MS tpot:MS --percentile-metrics --metric-percentiles\n"
    "--save-result --result-dir --result-filename) gives the same run. Streamed generations\n"
    "arrive as a Poisson (or gamma, --burstiness) process of --request-rate, at most\n"
    "--max-concurrency in flight; prints vLLM's summary (Successful requests, Benchmark\n"
    "duration, Total input/generated tokens, throughputs, Request goodput, SLO attainment, and\n"
    "per latency mean, std, median and the --metric-percentiles) and progress on stderr.\n"
    "--goodput ttft:MS tpot:MS e2el:MS: DistServe's goodput (completed requests/s meeting every\n"
    "objective). --sweep R1,R2,.. or START:STOP:STEP: one run per rate, then the highest rate\n"
    "whose SLO attainment is >= --sweep-attainment. The random and trace datasets send ignore_eos\n"
    "(unlike vLLM, whose --ignore-eos is off by default): every request generates its max_tokens\n"
    "(--no-ignore-eos: it may end at EOS; sharegpt's default). Keys in docs/bench.md.\n\n";

/* The OpenAI target of --base-url / --host / --port / --openai and --backend / --endpoint into
 * o->openai and *endpoint_p, or a message naming the flags. */
static td_status_t bs_target(bs_opts_t *o, const char **endpoint_p)
{
    int n = !!o->openai + !!o->gateway + !!o->base_url + !!(o->host || o->port);
    if (n > 1)
        return td_errorf(TD_ERR_INVALID, "bench serve: give one target: --base-url URL, --host/--port, --openai URL "
                         "or --gateway HOST:PORT");
    if (!n)
        return td_errorf(TD_ERR_INVALID, "bench serve: give a target: --base-url http://HOST:PORT (or --host and "
                         "--port; --openai URL), or --gateway HOST:PORT");
    o->chat = o->backend && !strcmp(o->backend, "openai-chat");
    *endpoint_p = NULL;
    if (o->gateway) {
        if (o->chat || o->endpoint)
            return td_errorf(TD_ERR_INVALID, "--%s: not with --gateway (tandem's gRPC front door)",
                             o->chat ? "backend openai-chat" : "endpoint");
        return TD_OK;
    }
    const char *def = o->chat ? "/v1/chat/completions" : "/v1/completions";
    if (o->endpoint) {
        size_t el = strlen(o->endpoint), cl = strlen("chat/completions");
        bool chat_ep = el >= cl && !strcmp(o->endpoint + el - cl, "chat/completions");
        bool comp_ep = el >= 11 && !strcmp(o->endpoint + el - 11, "completions");
        if (o->endpoint[0] != '/' || !comp_ep || chat_ep != o->chat)
            return td_errorf(TD_ERR_INVALID, "--endpoint: '%s' is not a path ending in %s (the %s backend's; e.g. %s)",
                             o->endpoint, o->chat ? "/chat/completions" : "/completions",
                             o->chat ? "openai-chat" : "openai", def);
        if (o->openai)
            return td_errorf(TD_ERR_INVALID, "--endpoint: goes with --base-url http://HOST:PORT (--openai URL is the "
                             "API's root, /v1)");
    }
    if (o->base_url || o->host || o->port) {
        if (!o->base_url) {
            snprintf(o->url, sizeof o->url, "http://%s:%lld", o->host ? o->host : "127.0.0.1",
                     (long long)(o->port ? o->port : 8000));
            o->base_url = o->url;
        }
        o->openai = o->base_url;
        *endpoint_p = o->endpoint ? o->endpoint : def;
    }
    return TD_OK;
}

/* Parses and checks the flags into s->o and creates the client of the target they name:
 * -1 to go on, or the exit code (2: a bad flag, said). */
static int bs_flags(bs_state_t *s, int argc, char **argv, td_opts_result_t *ro)
{
    s->o = (bs_opts_t){.dataset = "random", .input_len = 1024, .output_len = 128, .vocab_size = 256,
                       .request_rate = INFINITY, .burstiness = 1, .max_connections = 1000, .connections = 4,
                       .num_prompts = 1000, .request_timeout_s = 300, .sweep_attainment = 0.9f,
                       .metrics = {true, true, true, true}, .pct = {90, 99}, .n_pct = 2};
    bs_opts_t *o = &s->o;
    const td_opt_t opts[] = {
        {.name = "backend", .type = TD_OPT_FN, .ptr = &o->backend, .parse = bs_parse_backend, .arg = "NAME",
         .help = "openai (or vllm): /v1/completions (default); openai-chat: /v1/chat/completions"},
        {.name = "base-url", .type = TD_OPT_STR, .ptr = &o->base_url, .arg = "URL",
         .help = "the server, http://HOST:PORT: requests go to URL + --endpoint"},
        {.name = "host", .type = TD_OPT_STR, .ptr = &o->host, .arg = "HOST",
         .help = "instead of --base-url: http://HOST:--port (default 127.0.0.1)"},
        {.name = "port", .type = TD_OPT_I64, .ptr = &o->port, .min = 1, .max = 65535, .arg = "PORT",
         .help = "instead of --base-url: the server's port (default 8000)"},
        {.name = "endpoint", .type = TD_OPT_STR, .ptr = &o->endpoint, .arg = "PATH",
         .help = "the request path (default /v1/completions; openai-chat /v1/chat/completions)"},
        {.name = "openai", .type = TD_OPT_STR, .ptr = &o->openai, .arg = "URL",
         .help = "the API's root, http://HOST:PORT/v1 (the `openai:` line of tandem local; --base-url without /v1)"},
        {.name = "gateway", .type = TD_OPT_STR, .ptr = &o->gateway, .arg = "HOST:PORT",
         .help = "the router's gRPC gateway: tandem.v1.Generation/Generate streams"},
        {.name = "model", .type = TD_OPT_STR, .ptr = &o->model, .arg = "NAME", .help = "model name sent (default: none, the served one)"},
        {.name = "api-key", .type = TD_OPT_STR, .ptr = &o->api_key, .arg = "KEY", .help = "sent as Authorization: Bearer KEY"},
        {.name = "dataset-name", .type = TD_OPT_FN, .ptr = &o->dataset, .parse = bs_parse_dataset, .arg = "NAME",
         .help = "random (default), sharegpt or trace"},
        {.name = "dataset", .type = TD_OPT_FN, .ptr = &o->dataset, .parse = bs_parse_dataset, .arg = "NAME",
         .help = "the same as --dataset-name"},
        {.name = "dataset-path", .type = TD_OPT_STR, .ptr = &o->dataset_path, .arg = "FILE",
         .help = "ShareGPT JSON, or a trace (JSONL or CSV: arrival_s, input_len, output_len)"},
        {.name = "random-input-len", .type = TD_OPT_I64, .ptr = &o->input_len, .min = 1, .max = 1 << 20, .arg = "N",
         .help = "random: prompt tokens (default 1024)"},
        {.name = "random-output-len", .type = TD_OPT_I64, .ptr = &o->output_len, .min = 1, .max = 1 << 20, .arg = "N",
         .help = "random: max_tokens (default 128)"},
        {.name = "random-range-ratio", .type = TD_OPT_F32, .ptr = &o->range_ratio, .fmin = 0, .fmax = 0.999f,
         .arg = "R", .help = "random: lengths uniform in [len*(1-R), len*(1+R)] (default 0)"},
        {.name = "input-len", .type = TD_OPT_I64, .ptr = &o->input_len, .min = 1, .max = 1 << 20, .arg = "N",
         .help = "the same as --random-input-len"},
        {.name = "output-len", .type = TD_OPT_I64, .ptr = &o->output_len, .min = 1, .max = 1 << 20, .arg = "N",
         .help = "the same as --random-output-len"},
        {.name = "range-ratio", .type = TD_OPT_F32, .ptr = &o->range_ratio, .fmin = 0, .fmax = 0.999f, .arg = "R",
         .help = "the same as --random-range-ratio"},
        {.name = "vocab-size", .type = TD_OPT_I64, .ptr = &o->vocab_size, .min = 2, .max = 1 << 24, .arg = "V",
         .help = "random and trace prompts: ids drawn from [1, V) (default 256; the model's vocabulary or less)"},
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &o->tokenizer, .arg = "PATH",
         .help = "sharegpt: count the gpt turn's tokens with this tokenizer (else bytes/4);\n"
                 "openai-chat with random or trace: decode the prompt ids to the message's text"},
        {.name = "sharegpt-output-len", .type = TD_OPT_I64, .ptr = &o->sharegpt_output_len, .min = 0, .max = 1 << 20,
         .arg = "N", .help = "sharegpt: max_tokens of every request instead of the gpt turn's length"},
        {.name = "num-prompts", .type = TD_OPT_I64, .ptr = &o->num_prompts, .min = 1, .max = 10000000, .arg = "N",
         .help = "requests measured per run (default 1000; a trace: its rows, at most this)"},
        {.name = "request-rate", .type = TD_OPT_FN, .ptr = &o->request_rate, .parse = bs_parse_rate, .arg = "R",
         .help = "requests/s, or inf: all at once (default inf)"},
        {.name = "burstiness", .type = TD_OPT_F32, .ptr = &o->burstiness, .fmin = 0.01f, .fmax = 1000, .arg = "B",
         .help = "gamma shape of the gaps (1: Poisson; < 1 burstier)"},
        {.name = "max-concurrency", .type = TD_OPT_I64, .ptr = &o->max_concurrency, .min = 0, .max = 1000000,
         .arg = "N", .help = "requests in flight at most (0: no limit but --max-connections)"},
        {.name = "max-connections", .type = TD_OPT_I64, .ptr = &o->max_connections, .min = 1, .max = 100000,
         .arg = "N", .help = "OpenAI: keep-alive connections at most, one request each (default 1000)"},
        {.name = "connections", .type = TD_OPT_I64, .ptr = &o->connections, .min = 1, .max = 1024, .arg = "N",
         .help = "gRPC: channels the streams are spread over (default 4)"},
        {.name = "warmup-prompts", .type = TD_OPT_I64, .ptr = &o->warmup_prompts, .min = 0, .max = 1000000,
         .arg = "N", .help = "requests sent first, all at once within --max-concurrency, not counted (default 0)"},
        {.name = "seed", .type = TD_OPT_I64, .ptr = &o->seed, .min = 0, .max = INT64_MAX, .arg = "N",
         .help = "dataset and arrivals (default 0)"},
        {.name = "request-timeout-s", .type = TD_OPT_F32, .ptr = &o->request_timeout_s, .fmin = 0.01f, .fmax = 86400,
         .arg = "S", .help = "a request not ended within this fails (default 300)"},
        {.name = "goodput", .type = TD_OPT_FN, .ptr = &o->slo, .parse = bs_parse_goodput, .arg = "KEY:MS..",
         .multi = true, .help = "objectives ttft:MS tpot:MS e2el:MS (any of them, space-separated as vLLM's)"},
        {.name = "percentile-metrics", .type = TD_OPT_FN, .ptr = o->metrics, .parse = bs_parse_metrics,
         .arg = "LIST", .help = "latencies reported, a comma list of ttft,tpot,itl,e2el (default all four)"},
        {.name = "metric-percentiles", .type = TD_OPT_FN, .ptr = o, .parse = bs_parse_percentiles, .arg = "LIST",
         .help = "their percentiles, a comma list such as 50,90,99 (default 90,99)"},
        {.name = "sweep", .type = TD_OPT_FN, .ptr = &o->sweep, .parse = bs_parse_sweep, .arg = "RATES",
         .help = "R1,R2,... or START:STOP:STEP: one run per rate"},
        {.name = "sweep-attainment", .type = TD_OPT_F32, .ptr = &o->sweep_attainment, .fmin = 0.01f, .fmax = 1,
         .arg = "F", .help = "the attainment a swept rate must keep (default 0.9)"},
        {.name = "save-result", .type = TD_OPT_BOOL, .ptr = &o->save_result,
         .help = "write the JSON result to --result-dir/--result-filename (vLLM's default name:\n"
                 "BACKEND-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json)"},
        {.name = "result-dir", .type = TD_OPT_STR, .ptr = &o->result_dir, .arg = "DIR",
         .help = "where --save-result writes (default .; implies --save-result)"},
        {.name = "result-filename", .type = TD_OPT_STR, .ptr = &o->result_filename, .arg = "NAME",
         .help = "the file --save-result writes (implies --save-result)"},
        {.name = "result-file", .type = TD_OPT_STR, .ptr = &o->result_file, .arg = "FILE",
         .help = "write the JSON result to FILE (a path: --result-dir and --result-filename in one)"},
        {.name = "save-detailed", .type = TD_OPT_BOOL, .ptr = &o->save_detailed,
         .help = "the JSON carries every request (times, tokens, ITLs, error)"},
        {.name = "ignore-eos", .type = TD_OPT_BOOL, .ptr = &o->ignore_eos_flag,
         .help = "send ignore_eos: output lengths as asked (default with random and trace)"},
        {.name = "no-ignore-eos", .type = TD_OPT_BOOL, .ptr = &o->no_ignore_eos,
         .help = "do not send ignore_eos: a request may end at EOS (default with sharegpt)"},
        {.name = "disable-tqdm", .type = TD_OPT_BOOL, .ptr = &o->disable_tqdm,
         .help = "no progress on stderr (vLLM's name for its progress bar)"},
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &o->json, .help = "the JSON result on stdout instead of the summary"},
    };
    td_opts_t spec = {.prog = "bench serve", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    if (td_opts_parse(&spec, argc, argv, ro) != TD_OK)
        return 2;
    if (ro->help) {
        fputs(bs_usage, stdout);
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return 0;
    }
    td_status_t bad = TD_OK;
    const char *endpoint = NULL;
    if (o->ignore_eos_flag && o->no_ignore_eos)
        bad = td_errorf(TD_ERR_INVALID, "bench serve: give --ignore-eos or --no-ignore-eos, not both");
    o->ignore_eos = o->ignore_eos_flag || (!o->no_ignore_eos && strcmp(o->dataset, "sharegpt"));
    o->save_result |= o->result_dir || o->result_filename;
    if (bad == TD_OK && strcmp(o->dataset, "random") && !o->dataset_path)
        bad = td_errorf(TD_ERR_INVALID, "--dataset-name %s: needs --dataset-path FILE", o->dataset);
    if (bad == TD_OK && o->sweep && !strcmp(o->dataset, "trace"))
        bad = td_errorf(TD_ERR_INVALID, "--sweep: a trace gives its own arrival times; sweep the random or sharegpt "
                        "dataset");
    if (bad == TD_OK)
        bad = bs_target(o, &endpoint);
    if (bad == TD_OK && o->chat && strcmp(o->dataset, "sharegpt") && !o->tokenizer)
        bad = td_errorf(TD_ERR_INVALID, "--backend openai-chat: the %s dataset's prompts are token ids and a chat "
                        "message is text: give --tokenizer PATH (the model's) to decode them", o->dataset);
    if (bad != TD_OK)
        return 2;
    loadgen_config_t cfg = {.openai = o->openai, .endpoint = endpoint, .chat = o->chat, .gateway = o->gateway,
                            .model = o->model, .api_key = o->api_key, .vocab = (uint32_t)o->vocab_size,
                            .ignore_eos = o->ignore_eos, .request_timeout_s = o->request_timeout_s,
                            .connections = o->connections};
    td_status_t st = loadgen_client_create(&cfg, "bench serve", &s->cl);
    return st == TD_OK ? -1 : st == TD_ERR_INVALID ? 2 : 1;
}

/* The sweep's table and its best rate. */
static void bs_print_sweep(const bs_state_t *s, const loadgen_run_t *runs, size_t n_rates, double best)
{
    printf("%-12s %-12s %-12s %-12s %-12s %-12s\n", "rate", "req/s", "goodput", "attainment", "p99 TTFT ms",
           "p99 TPOT ms");
    for (size_t i = 0; i < n_rates; i++)
        printf("%-12.3g %-12.2f %-12.2f %-12.3f %-12.2f %-12.2f\n", runs[i].rate, runs[i].sum.request_throughput,
               runs[i].sum.request_goodput, runs[i].sum.slo_attainment, runs[i].ttft.p99, runs[i].tpot.p99);
    if (isnan(best))
        printf("%-40s %s\n", "Highest rate meeting SLO attainment:", "none");
    else
        printf("%-40s %-10.3g (attainment >= %.0f%%)\n", "Highest rate meeting SLO attainment:", best,
               s->o.sweep_attainment * 100);
}

/* The JSON result into the file at path: 0, or 1 (said). */
static int bs_write_file(const bs_state_t *s, const char *path, const loadgen_run_t *runs, size_t n_rates,
                         double best)
{
    int rc = 0;
    FILE *f = fopen(path, "w");
    if (!f || bench_json_print(f, bs_json_doc(s, runs, n_rates, best)) != 0) {
        td_errorf(TD_ERR_IO, "bench serve: cannot write %s: %s", path, strerror(errno));
        rc = 1;
    }
    if (f && fclose(f) != 0)
        rc = 1;
    return rc;
}

/* --save-result's path: --result-dir joined to --result-filename or vLLM's name
 * BACKEND-RATEqps[-concurrencyN]-MODEL-YYYYmmdd-HHMMSS.json. */
static void bs_result_path(const bs_state_t *s, char *buf, size_t size)
{
    const bs_opts_t *o = &s->o;
    char name[512], rate[32], conc[48] = "", date[32];
    if (o->result_filename) {
        snprintf(name, sizeof name, "%s", o->result_filename);
    } else {
        if (isinf(o->request_rate))
            snprintf(rate, sizeof rate, "inf");
        else if (o->request_rate == floorf(o->request_rate))
            snprintf(rate, sizeof rate, "%.1f", (double)o->request_rate); /* Python's str(10.0) */
        else
            snprintf(rate, sizeof rate, "%g", (double)o->request_rate);
        if (o->max_concurrency)
            snprintf(conc, sizeof conc, "-concurrency%lld", (long long)o->max_concurrency);
        const char *model = o->model ? o->model : "default", *slash = strrchr(model, '/');
        time_t now = time(NULL);
        struct tm tm;
        strftime(date, sizeof date, "%Y%m%d-%H%M%S", localtime_r(&now, &tm));
        snprintf(name, sizeof name, "%s-%sqps%s-%s-%s.json",
                 o->gateway ? "grpc" : o->backend ? o->backend : "openai", rate, conc, slash ? slash + 1 : model,
                 date);
    }
    if (o->result_dir)
        snprintf(buf, size, "%s/%s", o->result_dir, name);
    else
        snprintf(buf, size, "%s", name);
}

/* --result-file, --save-result and --json: 0, or 1 when one could not be written. */
static int bs_write_results(const bs_state_t *s, const loadgen_run_t *runs, size_t n_rates, double best)
{
    const bs_opts_t *o = &s->o;
    int rc = 0;
    if (o->result_file)
        rc |= bs_write_file(s, o->result_file, runs, n_rates, best);
    if (o->save_result) {
        char path[1024];
        bs_result_path(s, path, sizeof path);
        rc |= bs_write_file(s, path, runs, n_rates, best);
        if (!o->json)
            fprintf(stderr, "bench serve: result in %s\n", path);
    }
    if (o->json && bench_json_print(stdout, bs_json_doc(s, runs, n_rates, best)) != 0)
        rc = 1;
    return rc;
}

/* The run's progress (loadgen's 50 ms tick) on stderr, td_progress's way (a terminal: a line
 * rewritten each second; a log: one every 10 s, none for a run under 10 s): requests done of
 * all, their rate, the errors, the time left at that rate (loadgen_progress_show). */
static void bs_on_progress(void *arg, const loadgen_progress_t *p)
{
    bs_state_t *s = arg;
    loadgen_progress_show(&s->prog, p, p->n_done == p->n);
}

/* The run options of bench serve's flags at `rate`. */
static loadgen_run_opts_t bs_run_opts(bs_state_t *s, double rate, bool timed, const char *prog)
{
    const bs_opts_t *o = &s->o;
    int64_t limit = o->max_concurrency ? o->max_concurrency : INT64_MAX;
    if (o->openai)
        limit = TD_MIN(limit, o->max_connections);
    td_progress_init(&s->prog, prog, 10, 0);
    if (!s->prog.tty)
        s->prog.quiet_s = 10;
    return (loadgen_run_opts_t){.rate = rate, .burstiness = o->burstiness, .timed = timed,
                                .max_concurrency = limit, .slo = o->slo, .percentiles = o->pct,
                                .n_percentiles = o->n_pct,
                                .progress_cb = o->disable_tqdm ? NULL : bs_on_progress, .progress_arg = s};
}

/* The warm-up (the dataset's last requests, random: extra ones, all at once, not counted),
 * then one run per rate into runs[0..n_rates). */
static td_status_t bs_measure(bs_state_t *s, const double *rates, size_t n_rates, size_t n_measured, bool fresh,
                              loadgen_rng_t *rng, loadgen_run_t *runs)
{
    const bs_opts_t *o = &s->o;
    td_status_t st;
    if (o->warmup_prompts) {
        loadgen_run_t w;
        size_t first = s->data.n > (size_t)o->warmup_prompts ? s->data.n - (size_t)o->warmup_prompts : 0;
        loadgen_run_opts_t ro = bs_run_opts(s, INFINITY, false, "bench serve: warm-up");
        if (!o->json)
            fprintf(stderr, "bench serve: warm-up, %lld requests\n", (long long)o->warmup_prompts);
        if ((st = loadgen_client_run(s->cl, &s->data, first, (size_t)o->warmup_prompts, &ro, rng, &w)) != TD_OK)
            return st;
        if (w.sum.failed)
            fprintf(stderr, "bench serve: %llu of the warm-up requests failed (first: %s)\n",
                    (unsigned long long)w.sum.failed, w.r[0].error ? w.r[0].error : "see the summary");
        loadgen_run_free(&w);
    }
    for (size_t i = 0; i < n_rates; i++) {
        if (!o->json && !s->data.timed)
            fprintf(stderr, "bench serve: %zu requests at %.3g requests/s%s\n", n_measured, rates[i],
                    o->max_concurrency ? ", concurrency-limited" : "");
        loadgen_run_opts_t ro = bs_run_opts(s, rates[i], s->data.timed, "bench serve");
        if ((st = loadgen_client_run(s->cl, &s->data, fresh ? i * n_measured : 0, n_measured, &ro, rng, &runs[i])) !=
            TD_OK)
            return st;
        if (!o->json)
            bs_print_run(s, &runs[i]);
    }
    return TD_OK;
}

int bench_serve(int argc, char **argv)
{
    bs_state_t *s = calloc(1, sizeof *s);
    if (!s) {
        fprintf(stderr, "tandem bench serve: out of memory\n");
        return 1;
    }
    td_opts_result_t ro = {0};
    int rc = bs_flags(s, argc, argv, &ro);
    if (rc >= 0)
        goto err_opts;
    signal(SIGPIPE, SIG_IGN);
    rc = 1;
    const bs_opts_t *o = &s->o;
    double *rates = NULL, *attain = NULL;
    size_t n_rates = 1;
    loadgen_run_t *runs = NULL;
    loadgen_rng_t rng;
    loadgen_rng_seed(&rng, (uint64_t)o->seed);
    if (o->sweep) {
        if (loadgen_rates_parse(o->sweep, &rates, &n_rates) != TD_OK)
            goto err_rates;
    } else if (!(rates = malloc(sizeof *rates))) {
        goto err_rates;
    } else {
        rates[0] = o->request_rate;
    }
    size_t n_measured = (size_t)o->num_prompts;
    /* random: a sweep gives every rate prompts of its own (slice i of the dataset), so that a
       server's prefix cache never serves a rate the prompts an earlier rate sent */
    bool fresh = !strcmp(o->dataset, "random");
    if (bs_load_dataset(s, fresh ? n_measured * n_rates + (size_t)o->warmup_prompts : n_measured, &rng) != TD_OK)
        goto err_rates;
    if (s->data.timed)
        n_measured = s->data.n;
    if (!(runs = calloc(n_rates, sizeof *runs)) || !(attain = calloc(n_rates, sizeof *attain)))
        goto err_runs;
    if (bs_measure(s, rates, n_rates, n_measured, fresh, &rng, runs) != TD_OK)
        goto err_runs;
    bool any_ok = false;
    for (size_t i = 0; i < n_rates; i++) {
        attain[i] = runs[i].sum.slo_attainment;
        any_ok |= runs[i].sum.completed > 0;
    }
    double best = loadgen_sweep_best(rates, attain, n_rates, o->sweep_attainment);
    if (o->sweep && !o->json)
        bs_print_sweep(s, runs, n_rates, best);
    rc = any_ok ? 0 : 1;
    if (!any_ok)
        fprintf(stderr, "tandem bench serve: no request completed (first error in the summary)\n");
    if (bs_write_results(s, runs, n_rates, best) != 0)
        rc = 1;
err_runs:
    for (size_t i = 0; runs && i < n_rates; i++)
        loadgen_run_free(&runs[i]);
    free(runs), free(attain);
    loadgen_dataset_free(&s->data);
err_rates:
    free(rates);
err_opts:
    loadgen_client_destroy(s->cl);
    td_opts_result_free(&ro);
    free(s);
    return rc;
}
