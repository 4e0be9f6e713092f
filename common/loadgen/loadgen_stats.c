/*
 * loadgen_stats: the pure parts of the load generator (contracts in loadgen.h):
 * PRNG and arrivals, datasets, statistics, objectives and goodput, the sweep's rates.
 */
#include "loadgen.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_rng.h"
#include "td_stats.h"

/* ---- PRNG ------------------------------------------------------------------------------ */

void loadgen_rng_seed(loadgen_rng_t *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        r->s[i] = td_splitmix64(&seed);
}

uint64_t loadgen_rng_next(loadgen_rng_t *r)
{
    return td_xoshiro256ss(r->s);
}

double loadgen_rng_uniform(loadgen_rng_t *r)
{
    return ((double)(loadgen_rng_next(r) >> 11) + 0.5) * 0x1.0p-53;
}

int64_t loadgen_rng_int(loadgen_rng_t *r, int64_t lo, int64_t hi)
{
    if (hi <= lo)
        return lo;
    uint64_t span = (uint64_t)(hi - lo) + 1;
    return lo + (int64_t)(loadgen_rng_next(r) % span); /* bias < span / 2^64: nothing a benchmark sees */
}

static double rng_normal(loadgen_rng_t *r)
{
    return sqrt(-2.0 * log(loadgen_rng_uniform(r))) * cos(2.0 * M_PI * loadgen_rng_uniform(r));
}

double loadgen_rng_gamma(loadgen_rng_t *r, double shape, double scale)
{
    if (shape < 1) { /* Gamma(a) = Gamma(a + 1) * U^(1/a) */
        double u = loadgen_rng_uniform(r);
        return loadgen_rng_gamma(r, shape + 1, scale) * pow(u, 1.0 / shape);
    }
    double d = shape - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = rng_normal(r), v = 1 + c * x;
        if (v <= 0)
            continue;
        v = v * v * v;
        double u = loadgen_rng_uniform(r);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v))
            return d * v * scale;
    }
}

void loadgen_arrivals(loadgen_rng_t *r, double rate, double burstiness, size_t n, double *t)
{
    double now = 0;
    for (size_t i = 0; i < n; i++) {
        t[i] = now;
        if (isfinite(rate))
            now += loadgen_rng_gamma(r, burstiness, 1.0 / (rate * burstiness));
    }
}

/* ---- datasets ---------------------------------------------------------------------------- */

uint32_t loadgen_prompt_id(const loadgen_item_t *it, uint32_t i, uint32_t vocab)
{
    uint64_t x = it->id_seed + (uint64_t)i * 0x9e3779b97f4a7c15ull;
    return 1 + (uint32_t)(td_splitmix64(&x) % (vocab - 1));
}

void loadgen_dataset_free(loadgen_dataset_t *d)
{
    if (!d)
        return;
    for (size_t i = 0; i < d->n; i++)
        free(d->items[i].text);
    free(d->items);
    d->items = NULL;
    d->n = 0;
}

static uint32_t len_in_range(loadgen_rng_t *r, uint32_t len, double ratio)
{
    int64_t lo = (int64_t)floor(len * (1 - ratio)), hi = (int64_t)ceil(len * (1 + ratio));
    int64_t v = loadgen_rng_int(r, lo, hi);
    return v < 1 ? 1 : (uint32_t)v;
}

td_status_t loadgen_dataset_random(loadgen_rng_t *r, size_t n, uint32_t input_len, uint32_t output_len, double range_ratio,
                              loadgen_dataset_t *d)
{
    loadgen_item_t *items = calloc(n ? n : 1, sizeof *items);
    if (!items)
        return td_errorf(TD_ERR_NOMEM, "bench serve: out of memory for %zu requests", n);
    for (size_t i = 0; i < n; i++) {
        items[i].arrival_s = -1;
        items[i].input_len = len_in_range(r, input_len, range_ratio);
        items[i].output_len = len_in_range(r, output_len, range_ratio);
        items[i].id_seed = loadgen_rng_next(r);
    }
    *d = (loadgen_dataset_t){.items = items, .n = n};
    return TD_OK;
}

/* The first number among keys[] of a JSON object, or NAN. */
static double json_num(const cJSON *o, const char *const *keys)
{
    for (; *keys; keys++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, *keys);
        if (cJSON_IsNumber(v))
            return v->valuedouble;
    }
    return NAN;
}

static bool len_ok(double v)
{
    return isfinite(v) && v >= 0 && v <= 1e7 && v == floor(v);
}

td_status_t loadgen_dataset_trace_parse(const char *text, size_t len, const char *name, size_t max_n, loadgen_rng_t *r,
                                   loadgen_dataset_t *d)
{
    static const char *const k_t[] = {"arrival_s", "timestamp", "time", NULL};
    static const char *const k_in[] = {"input_len", "input_length", "input_tokens", NULL};
    static const char *const k_out[] = {"output_len", "output_length", "output_tokens", NULL};
    size_t cap = 0, n = 0, line_no = 0;
    loadgen_item_t *items = NULL;
    td_status_t st = TD_OK;
    const char *p = text, *end = text + len;
    while (p < end && (!max_n || n < max_n)) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *e = nl ? nl : end;
        line_no++;
        char buf[1024];
        size_t l = (size_t)(e - p);
        p = nl ? nl + 1 : end;
        if (l >= sizeof buf) {
            st = td_errorf(TD_ERR_FORMAT, "%s:%zu: line longer than %zu bytes", name, line_no, sizeof buf - 1);
            goto err;
        }
        memcpy(buf, e - l, l);
        buf[l] = '\0';
        char *s = buf;
        while (isspace((unsigned char)*s))
            s++;
        if (!*s || *s == '#')
            continue;
        double t, in, out;
        if (*s == '{') {
            cJSON *j = cJSON_Parse(s);
            if (!j) {
                st = td_errorf(TD_ERR_FORMAT, "%s:%zu: not a JSON object", name, line_no);
                goto err;
            }
            t = json_num(j, k_t);
            in = json_num(j, k_in);
            out = json_num(j, k_out);
            cJSON_Delete(j);
        } else {
            char *q;
            t = strtod(s, &q);
            if (q == s) {
                if (n == 0 && line_no == 1)
                    continue; /* a CSV header */
                st = td_errorf(TD_ERR_FORMAT, "%s:%zu: want 'arrival_s,input_len,output_len'", name, line_no);
                goto err;
            }
            in = out = NAN;
            if (*q == ',') {
                char *q2;
                in = strtod(q + 1, &q2);
                if (*q2 == ',')
                    out = strtod(q2 + 1, &q);
            }
        }
        if (!isfinite(t) || t < 0 || !len_ok(in) || !len_ok(out) || out < 1) {
            st = td_errorf(TD_ERR_FORMAT, "%s:%zu: want an arrival time (s) >= 0, an input length and an output "
                           "length >= 1 (whole numbers)", name, line_no);
            goto err;
        }
        if (n && t < items[n - 1].arrival_s) {
            st = td_errorf(TD_ERR_FORMAT, "%s:%zu: arrival time %g is before the previous row's %g: sort the trace",
                           name, line_no, t, items[n - 1].arrival_s);
            goto err;
        }
        if (n == cap) {
            size_t c = cap ? 2 * cap : 256;
            loadgen_item_t *x = realloc(items, c * sizeof *x);
            if (!x) {
                st = td_errorf(TD_ERR_NOMEM, "%s: out of memory at line %zu", name, line_no);
                goto err;
            }
            items = x;
            cap = c;
        }
        items[n++] = (loadgen_item_t){.arrival_s = t, .input_len = in < 1 ? 1 : (uint32_t)in, .output_len = (uint32_t)out,
                                 .id_seed = loadgen_rng_next(r)};
    }
    if (!n) {
        st = td_errorf(TD_ERR_FORMAT, "%s: no requests in the trace", name);
        goto err;
    }
    for (size_t i = n; i-- > 0;)
        items[i].arrival_s -= items[0].arrival_s;
    *d = (loadgen_dataset_t){.items = items, .n = n, .timed = true};
    return TD_OK;
err:
    free(items);
    return st;
}

static uint32_t count_tokens(const td_tokenizer_t *tok, const char *text)
{
    size_t len = strlen(text);
    if (!tok)
        return (uint32_t)((len + 3) / 4);
    int32_t *ids = NULL;
    size_t n = 0;
    if (td_tokenizer_encode(tok, text, len, 0, &ids, &n) != TD_OK)
        n = (len + 3) / 4;
    free(ids);
    return (uint32_t)n;
}

td_status_t loadgen_dataset_sharegpt_parse(const char *text, size_t len, const char *name, const td_tokenizer_t *tok,
                                      uint32_t fixed_output_len, size_t max_n, loadgen_rng_t *r, loadgen_dataset_t *d)
{
    cJSON *j = cJSON_ParseWithLength(text, len);
    if (!cJSON_IsArray(j)) {
        cJSON_Delete(j);
        return td_errorf(TD_ERR_FORMAT, "%s: not a JSON array (want ShareGPT's [{\"conversations\": [...]}, ...])",
                         name);
    }
    size_t total = (size_t)cJSON_GetArraySize(j);
    cJSON **entries = calloc(total ? total : 1, sizeof *entries);
    loadgen_item_t *items = calloc(total ? total : 1, sizeof *items);
    td_status_t st = TD_OK;
    if (!entries || !items) {
        st = td_errorf(TD_ERR_NOMEM, "%s: out of memory", name);
        goto out;
    }
    size_t k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, j) entries[k++] = (cJSON *)e;
    for (size_t i = total; i > 1; i--) { /* Fisher-Yates with the run's seed */
        size_t m = (size_t)loadgen_rng_int(r, 0, (int64_t)i - 1);
        cJSON *x = entries[i - 1];
        entries[i - 1] = entries[m];
        entries[m] = x;
    }
    size_t n = 0;
    for (size_t i = 0; i < total && (!max_n || n < max_n); i++) {
        const cJSON *conv = cJSON_GetObjectItemCaseSensitive(entries[i], "conversations");
        const char *prompt = NULL, *reply = NULL;
        const cJSON *turn;
        cJSON_ArrayForEach(turn, conv) {
            const cJSON *from = cJSON_GetObjectItemCaseSensitive(turn, "from");
            const cJSON *value = cJSON_GetObjectItemCaseSensitive(turn, "value");
            if (!cJSON_IsString(from) || !cJSON_IsString(value))
                break;
            if (!prompt) {
                if (strcmp(from->valuestring, "human"))
                    break;
                prompt = value->valuestring;
            } else {
                if (!strcmp(from->valuestring, "gpt"))
                    reply = value->valuestring;
                break;
            }
        }
        if (!prompt || !reply)
            continue;
        uint32_t out = fixed_output_len ? fixed_output_len : count_tokens(tok, reply);
        uint32_t in = tok ? count_tokens(tok, prompt) : 0;
        uint32_t in_check = tok ? in : count_tokens(NULL, prompt);
        if (in_check < 4 || (!fixed_output_len && out < 4) || in_check > 1024 || in_check + out > 2048)
            continue;
        char *t = strdup(prompt);
        if (!t) {
            st = td_errorf(TD_ERR_NOMEM, "%s: out of memory", name);
            goto out;
        }
        items[n++] = (loadgen_item_t){.arrival_s = -1, .input_len = in, .output_len = out, .text = t};
    }
    if (!n) {
        st = td_errorf(TD_ERR_FORMAT, "%s: no usable conversation (a human turn then a gpt turn, prompt 4..1024 "
                       "tokens)", name);
        goto out;
    }
    *d = (loadgen_dataset_t){.items = items, .n = n};
    items = NULL;
out:
    if (items) {
        for (size_t i = 0; i < total; i++)
            free(items[i].text);
        free(items);
    }
    free(entries);
    cJSON_Delete(j);
    return st;
}

/* ---- statistics ---------------------------------------------------------------------------- */

void loadgen_stat_of(double *v, size_t n, loadgen_stat_t *out)
{
    if (!n) {
        *out = (loadgen_stat_t){.mean = NAN, .std = NAN, .median = NAN, .p90 = NAN, .p99 = NAN};
        return;
    }
    td_stats_sort(v, n);
    double sum = 0, sq = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    double mean = sum / (double)n;
    for (size_t i = 0; i < n; i++)
        sq += (v[i] - mean) * (v[i] - mean);
    *out = (loadgen_stat_t){.mean = mean, .std = sqrt(sq / (double)n), .median = td_stats_percentile(v, n, 50),
                       .p90 = td_stats_percentile(v, n, 90), .p99 = td_stats_percentile(v, n, 99)};
}

/* ---- objectives and goodput ------------------------------------------------------------------ */

td_status_t loadgen_slo_parse(const char *text, loadgen_slo_t *slo)
{
    const char *p = text;
    bool any = false;
    while (*p) {
        while (*p == ' ' || *p == ',')
            p++;
        if (!*p)
            break;
        size_t n = strcspn(p, " ,");
        char pair[64];
        if (n >= sizeof pair)
            return td_errorf(TD_ERR_INVALID, "--goodput: '%.*s' is too long (want ttft:MS, tpot:MS or e2el:MS)",
                             (int)(n < 40 ? n : 40), p);
        memcpy(pair, p, n);
        pair[n] = '\0';
        p += n;
        char *colon = strchr(pair, ':'), *e = NULL;
        double v = colon ? strtod(colon + 1, &e) : NAN;
        if (!colon || e == colon + 1 || *e || !isfinite(v) || v <= 0)
            return td_errorf(TD_ERR_INVALID, "--goodput: '%s' is not KEY:MS with MS > 0 (keys ttft, tpot, e2el)",
                             pair);
        *colon = '\0';
        if (!strcmp(pair, "ttft"))
            slo->ttft_ms = v;
        else if (!strcmp(pair, "tpot"))
            slo->tpot_ms = v;
        else if (!strcmp(pair, "e2el"))
            slo->e2el_ms = v;
        else
            return td_errorf(TD_ERR_INVALID, "--goodput: unknown objective '%s' (keys ttft, tpot, e2el)", pair);
        any = true;
    }
    if (!any)
        return td_errorf(TD_ERR_INVALID, "--goodput: no objective given (want e.g. \"ttft:500 tpot:50\")");
    return TD_OK;
}

bool loadgen_slo_any(const loadgen_slo_t *slo)
{
    return slo->ttft_ms > 0 || slo->tpot_ms > 0 || slo->e2el_ms > 0;
}

bool loadgen_slo_met(const loadgen_slo_t *slo, const loadgen_outcome_t *o)
{
    return o->ok && !(slo->ttft_ms > 0 && o->ttft_ms > slo->ttft_ms) && !(slo->tpot_ms > 0 && o->tpot_ms > slo->tpot_ms) &&
           !(slo->e2el_ms > 0 && o->e2el_ms > slo->e2el_ms);
}

void loadgen_summarize(const loadgen_outcome_t *o, size_t n, double duration_s, const loadgen_slo_t *slo, loadgen_summary_t *s)
{
    *s = (loadgen_summary_t){.duration_s = duration_s};
    for (size_t i = 0; i < n; i++) {
        if (!o[i].ok) {
            s->failed++;
            continue;
        }
        s->completed++;
        s->total_input += o[i].input_tokens;
        s->total_output += o[i].output_tokens;
        if (loadgen_slo_met(slo, &o[i]))
            s->good++;
    }
    double d = duration_s > 0 ? duration_s : NAN;
    s->request_throughput = (double)s->completed / d;
    s->output_throughput = (double)s->total_output / d;
    s->total_token_throughput = (double)(s->total_input + s->total_output) / d;
    s->request_goodput = (double)s->good / d;
    s->slo_attainment = n ? (double)s->good / (double)n : NAN;
}

/* ---- --sweep ---------------------------------------------------------------------------------- */

td_status_t loadgen_rates_parse(const char *text, double **rates_p, size_t *n_p)
{
    enum { MAX_RATES = 1000 };
    double *rates = malloc(MAX_RATES * sizeof *rates);
    if (!rates)
        return td_errorf(TD_ERR_NOMEM, "--sweep: out of memory");
    size_t n = 0;
    double a, b, step;
    char tail;
    if (strchr(text, ':')) {
        if (sscanf(text, "%lf:%lf:%lf%c", &a, &b, &step, &tail) != 3 || !(a > 0) || !(b >= a) || !(step > 0) ||
            !isfinite(b) || (b - a) / step >= MAX_RATES) {
            free(rates);
            return td_errorf(TD_ERR_INVALID, "--sweep: '%s' is not START:STOP:STEP with 0 < START <= STOP, STEP > 0 "
                             "and at most %d rates", text, MAX_RATES);
        }
        for (size_t i = 0; a + (double)i * step <= b * (1 + 1e-9); i++)
            rates[n++] = a + (double)i * step;
    } else {
        const char *p = text;
        while (*p) {
            char *e;
            double v = strtod(p, &e);
            if (e == p || (*e && *e != ',') || !(v > 0) || n == MAX_RATES) {
                free(rates);
                return td_errorf(TD_ERR_INVALID, "--sweep: '%s' is not a list of rates > 0 (R1,R2,... or "
                                 "START:STOP:STEP)", text);
            }
            rates[n++] = v;
            p = *e ? e + 1 : e;
        }
        if (!n) {
            free(rates);
            return td_errorf(TD_ERR_INVALID, "--sweep: no rate given");
        }
    }
    *rates_p = rates;
    *n_p = n;
    return TD_OK;
}

double loadgen_sweep_best(const double *rates, const double *attainment, size_t n, double min_attainment)
{
    double best = NAN;
    for (size_t i = 0; i < n; i++)
        if (attainment[i] >= min_attainment && (isnan(best) || rates[i] > best))
            best = rates[i];
    return best;
}
