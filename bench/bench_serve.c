/*
 * bench_serve: `tandem bench serve --openai URL | --gateway HOST:PORT [options]`, the
 * serving benchmark of issue 16, in the spirit of `vllm bench serve` and AIPerf: a load
 * generator against a running cluster that reports what a user of it sees and whether it
 * met its service-level objectives.
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
 * One thread, one libuv loop, non-blocking: an arrival timer, keep-alive HTTP/1.1
 * connections (bench_http_client, shared with bench router --http: one request in flight on
 * each, at most --max-connections) or gRPC channels, and a 50 ms tick that fails requests
 * past --request-timeout-s. The waiting queue holds at most --num-prompts requests (the
 * dataset). Pure parts (datasets, arrivals, statistics, goodput) are in
 * bench_serve_stats.c. Output keys in docs/bench.md. The same client, run by run, is a library
 * for `tandem plan profile --gateway/--openai` (bench_serve_client.h, at the end of this file).
 */
#include "bench_serve.h"

#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <netdb.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <uv.h>

#include "bench_http_client.h"
#include "bench_serve_client.h"
#include "tandem.pb-c.h"
#include "td_bench.h"
#include "td_grpc.h"
#include "td_list.h"
#include "td_log.h"
#include "td_opts.h"
#include "td_util.h"

#define BS_TICK_MS 50

typedef struct bs_opts {
    const char *openai, *gateway, *model, *api_key;
    const char *dataset, *dataset_path, *tokenizer;
    int64_t input_len, output_len, vocab_size, sharegpt_output_len;
    float range_ratio;
    float request_rate, burstiness;
    int64_t max_concurrency, max_connections, connections, num_prompts, warmup_prompts, seed;
    float request_timeout_s;
    bs_slo_t slo;
    const char *result_file, *sweep;
    float sweep_attainment;
    bool save_detailed, json;
    bool ignore_eos_flag, no_ignore_eos; /* --ignore-eos, --no-ignore-eos as given */
    bool ignore_eos;                     /* sent: the flags, else on for random and trace */
} bs_opts_t;

typedef struct bs_state bs_state_t;
typedef struct bs_conn bs_conn_t;

typedef enum { BS_REQ_WAITING, BS_REQ_RUNNING, BS_REQ_DONE } bs_req_state_t;

/* One request of a run, from its arrival to its verdict. */
typedef struct bs_req {
    bs_state_t *s;
    const bs_item_t *item;
    double arrival_s;         /* planned, from the run's start */
    bs_req_state_t state;
    uint64_t t_send, t_first, t_last, t_end, deadline; /* ns (td_now_ns) */
    uint32_t chunks;          /* token-carrying chunks / messages */
    uint32_t usage_in, usage_out;
    bool have_usage, done_marker;
    double *itl;              /* [n_itl] ms between token-carrying chunks */
    uint32_t n_itl, cap_itl;
    char *error;              /* why it failed (malloc'd) */
    bs_conn_t *conn;          /* HTTP: the connection it runs on */
    td_grpc_client_call_t *call; /* gRPC */
    td_list_t link;           /* the waiting queue or the running list */
    bs_outcome_t out;
} bs_req_t;

/* A keep-alive connection to the OpenAI API and the request it carries. */
struct bs_conn {
    bench_http_conn_t *h;
    bs_state_t *s;
    bs_req_t *req;            /* in flight, or NULL (then linked in the idle list) */
    td_list_t link;           /* idle list */
    char *wbuf;               /* the request's bytes, alive until its verdict */
    size_t wlen, wcap;
};

/* What one run (one rate) gave. */
typedef struct bs_run {
    double rate;
    bs_summary_t sum;
    bs_stat_t ttft, tpot, itl, e2el;
    int64_t max_concurrency_seen;
    double cpu_s;             /* this process's CPU during the run */
    uint64_t t0;              /* its start (td_now_ns) */
    bs_req_t *reqs;           /* [n_reqs], kept for --save-detailed */
    size_t n_reqs;
} bs_run_t;

struct bs_state {
    bs_opts_t o;
    uv_loop_t loop;
    uv_timer_t arrive, tick;
    /* target */
    char host[256], path[256];
    uint16_t port;
    struct sockaddr_storage addr;
    td_grpc_channel_t **gw;
    int n_gw, next_gw;
    /* the run in progress */
    bs_req_t *reqs;
    size_t n_reqs, next_arrival, n_done;
    int64_t running, limit, max_running;
    td_list_t waiting, active, idle_conns;
    int64_t n_conns;
    uint64_t t0;
    bool in_run, dispatching;
    bs_dataset_t data;
    uint32_t vocab;
    char *model_json;         /* --model as a JSON string (escaped), or NULL */
};

/* ---- small helpers ----------------------------------------------------------------------- */

static void bs_req_fail(bs_req_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bs_req_end(bs_req_t *r, bool ok);

static double bs_cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec * 1e-6;
}

static void bs_req_token(bs_req_t *r, uint64_t now)
{
    if (!r->t_first) {
        r->t_first = now;
    } else {
        if (r->n_itl == r->cap_itl) {
            uint32_t cap = r->cap_itl ? 2 * r->cap_itl : 16;
            double *p = realloc(r->itl, cap * sizeof *p);
            if (!p)
                return; /* a gap not kept: statistics of the others still hold */
            r->itl = p;
            r->cap_itl = cap;
        }
        r->itl[r->n_itl++] = (double)(now - r->t_last) * 1e-6;
    }
    r->t_last = now;
    r->chunks++;
}

static void bs_req_fail(bs_req_t *r, const char *fmt, ...)
{
    if (!r->error) {
        char buf[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);
        r->error = strdup(buf);
    }
}

/* Appends printf output to a growable buffer; false when out of memory. */
static bool bs_buf_printf(char **buf, size_t *len, size_t *cap, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static bool bs_buf_printf(char **buf, size_t *len, size_t *cap, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(*buf ? *buf + *len : NULL, *buf ? *cap - *len : 0, fmt, ap);
        va_end(ap);
        if (n < 0)
            return false;
        if (*buf && *len + (size_t)n < *cap) {
            *len += (size_t)n;
            return true;
        }
        size_t c = TD_MAX(*cap * 2, *len + (size_t)n + 4096);
        char *p = realloc(*buf, c);
        if (!p)
            return false;
        *buf = p;
        *cap = c;
    }
}

/* ---- the OpenAI API over HTTP/1.1 (bench_http_client) ------------------------------------- */

static void bs_dispatch(bs_state_t *s);

/* One SSE event of a streamed completion: a token chunk, the usage chunk, an error, [DONE]. */
static void bs_sse_event(bs_req_t *r, const char *d, uint64_t now)
{
    if (strncmp(d, "data: ", 6))
        return; /* a comment or another field */
    d += 6;
    if (!strncmp(d, "[DONE]", 6)) {
        r->done_marker = true;
        return;
    }
    if (!strncmp(d, "{\"error\"", 8)) {
        bs_req_fail(r, "error event: %.300s", d);
        return;
    }
    const char *u = strstr(d, "\"usage\":{");
    if (u) {
        const char *p = strstr(u, "\"prompt_tokens\":"), *q = strstr(u, "\"completion_tokens\":");
        if (p && q) {
            r->usage_in = (uint32_t)strtoul(p + 16, NULL, 10);
            r->usage_out = (uint32_t)strtoul(q + 20, NULL, 10);
            r->have_usage = true;
        }
    }
    if (strstr(d, "\"choices\":[]"))
        return; /* the usage chunk */
    if (strstr(d, "\"text\":\"\"") || strstr(d, "\"delta\":{}"))
        return; /* the finish chunk without text */
    bs_req_token(r, now);
}

static void bs_http_on_event(bench_http_conn_t *h, const char *ev, size_t len, uint64_t now)
{
    bs_conn_t *c = bench_http_conn_data(h);
    if (c->req)
        bs_sse_event(c->req, ev, now);
}

static void bs_http_on_done(bench_http_conn_t *h, unsigned status, const char *body, size_t len, bool keep_alive)
{
    bs_conn_t *c = bench_http_conn_data(h);
    bs_req_t *r = c->req;
    c->req = NULL;
    if (!r)
        return;
    r->conn = NULL;
    if (status == 0)
        bs_req_fail(r, "%s", body);
    else if (status != 200)
        bs_req_fail(r, "HTTP %u: %.300s", status, body);
    else if (!r->done_marker)
        bs_req_fail(r, "the stream ended without data: [DONE]");
    if (keep_alive)
        td_list_push_back(&c->s->idle_conns, &c->link);
    bs_req_end(r, status == 200 && r->done_marker && !r->error);
}

static void bs_http_on_close(bench_http_conn_t *h)
{
    bs_conn_t *c = bench_http_conn_data(h);
    td_list_remove(&c->link);
    c->s->n_conns--;
    free(c->wbuf);
    free(c);
}

static const bench_http_ops_t bs_http_ops = {.on_event = bs_http_on_event, .on_done = bs_http_on_done,
                                             .on_close = bs_http_on_close};

/* The request's bytes into c->wbuf: POST /v1/completions, streamed, with usage. */
static bool bs_http_build(bs_conn_t *c, const bs_req_t *r)
{
    bs_state_t *s = c->s;
    char *body = NULL;
    size_t len = 0, cap = 0;
    const bs_item_t *it = r->item;
    bool ok = bs_buf_printf(&body, &len, &cap, "{");
    if (ok && s->model_json)
        ok = bs_buf_printf(&body, &len, &cap, "\"model\":%s,", s->model_json);
    if (ok && it->text) {
        char *js = NULL;
        cJSON *str = cJSON_CreateString(it->text);
        if (str)
            js = cJSON_PrintUnformatted(str);
        cJSON_Delete(str);
        ok = js && bs_buf_printf(&body, &len, &cap, "\"prompt\":%s", js);
        cJSON_free(js);
    } else if (ok) {
        ok = bs_buf_printf(&body, &len, &cap, "\"prompt\":[");
        for (uint32_t i = 0; ok && i < it->input_len; i++)
            ok = bs_buf_printf(&body, &len, &cap, i ? ",%u" : "%u", bs_prompt_id(it, i, s->vocab));
        ok = ok && bs_buf_printf(&body, &len, &cap, "]");
    }
    ok = ok && bs_buf_printf(&body, &len, &cap,
                             ",\"max_tokens\":%u,\"temperature\":0,\"stream\":true,%s"
                             "\"stream_options\":{\"include_usage\":true}}", it->output_len,
                             s->o.ignore_eos ? "\"ignore_eos\":true," : "");
    c->wlen = 0;
    ok = ok && bs_buf_printf(&c->wbuf, &c->wlen, &c->wcap,
                             "POST %s/completions HTTP/1.1\r\nHost: %s:%u\r\nContent-Type: application/json\r\n"
                             "Accept: text/event-stream\r\nContent-Length: %zu\r\n%s%s%s\r\n%s",
                             s->path, s->host, s->port, len, s->o.api_key ? "Authorization: Bearer " : "",
                             s->o.api_key ? s->o.api_key : "", s->o.api_key ? "\r\n" : "", body);
    free(body);
    return ok;
}

static void bs_http_start(bs_state_t *s, bs_req_t *r)
{
    bs_conn_t *c = NULL;
    r->t_send = td_now_ns(); /* a new connection's connect time counts in TTFT, as a client sees it */
    if (!td_list_empty(&s->idle_conns)) {
        c = TD_CONTAINER_OF(s->idle_conns.next, bs_conn_t, link);
        td_list_remove(&c->link);
    } else {
        if (!(c = calloc(1, sizeof *c))) {
            bs_req_fail(r, "out of memory for a connection");
            bs_req_end(r, false);
            return;
        }
        c->s = s;
        td_list_init(&c->link);
        if (bench_http_conn_open(&s->loop, (const struct sockaddr *)&s->addr, &bs_http_ops, c, &c->h) != TD_OK) {
            free(c);
            bs_req_fail(r, "%s:%u: %s", s->host, s->port, td_last_error());
            bs_req_end(r, false);
            return;
        }
        s->n_conns++;
    }
    if (!bs_http_build(c, r)) {
        td_list_push_back(&s->idle_conns, &c->link);
        bs_req_fail(r, "out of memory building the request");
        bs_req_end(r, false);
        return;
    }
    c->req = r;
    r->conn = c;
    bench_http_conn_send(c->h, c->wbuf, c->wlen);
}

/* ---- the gRPC gateway ----------------------------------------------------------------------- */

static void bs_grpc_on_msg(td_grpc_client_call_t *call, const ProtobufCMessage *msg, void *data)
{
    bs_req_t *r = data;
    const Tandem__V1__GenerateResponse *m = (const void *)msg;
    if (m->n_token_ids)
        bs_req_token(r, td_now_ns());
    if (m->usage) {
        r->usage_in = m->usage->prompt_tokens;
        r->usage_out = m->usage->completion_tokens;
        r->have_usage = true;
    }
}

static void bs_grpc_on_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *msg, void *data)
{
    bs_req_t *r = data;
    r->call = NULL;
    if (code != TD_GRPC_OK)
        bs_req_fail(r, "%s: %.300s", td_grpc_code_name(code), msg);
    bs_req_end(r, code == TD_GRPC_OK);
}

static void bs_grpc_start(bs_state_t *s, bs_req_t *r)
{
    const bs_item_t *it = r->item;
    Tandem__V1__GenerateRequest q = TANDEM__V1__GENERATE_REQUEST__INIT;
    uint32_t *ids = NULL;
    if (it->text) {
        q.prompt = it->text;
    } else {
        if (!(ids = malloc((it->input_len ? it->input_len : 1) * sizeof *ids))) {
            r->t_send = td_now_ns();
            bs_req_fail(r, "out of memory for the prompt");
            bs_req_end(r, false);
            return;
        }
        for (uint32_t i = 0; i < it->input_len; i++)
            ids[i] = bs_prompt_id(it, i, s->vocab);
        q.prompt_ids = ids;
        q.n_prompt_ids = it->input_len;
    }
    q.max_tokens = it->output_len;
    q.ignore_eos = s->o.ignore_eos;
    if (s->o.model)
        q.model = (char *)s->o.model;
    char auth[300];
    td_grpc_header_t hdr = {.name = "authorization", .value = auth};
    if (s->o.api_key)
        snprintf(auth, sizeof auth, "Bearer %s", s->o.api_key);
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__generate_response__descriptor,
                             .on_message = bs_grpc_on_msg, .on_done = bs_grpc_on_done, .data = r,
                             .timeout_ms = (uint32_t)(s->o.request_timeout_s * 1e3),
                             .headers = s->o.api_key ? &hdr : NULL, .n_headers = s->o.api_key ? 1 : 0};
    td_grpc_channel_t *ch = s->gw[s->next_gw++ % s->n_gw];
    r->t_send = td_now_ns();
    td_status_t st = td_grpc_channel_call(ch, "/tandem.v1.Generation/Generate", &q.base, &o, &r->call);
    free(ids);
    if (st != TD_OK) {
        r->call = NULL;
        bs_req_fail(r, "Generate: %s", td_last_error());
        bs_req_end(r, false);
    }
}

/* ---- arrivals, dispatch, verdicts ------------------------------------------------------------ */

static void bs_req_start(bs_state_t *s, bs_req_t *r)
{
    r->state = BS_REQ_RUNNING;
    s->running++;
    s->max_running = TD_MAX(s->max_running, s->running);
    td_list_push_back(&s->active, &r->link);
    r->deadline = td_now_ns() + (uint64_t)(s->o.request_timeout_s * 1e9);
    if (s->o.openai)
        bs_http_start(s, r);
    else
        bs_grpc_start(s, r);
}

/* The verdict of a request (exactly once): its outcome, then the next waiting one. */
static void bs_req_end(bs_req_t *r, bool ok)
{
    bs_state_t *s = r->s;
    if (r->state != BS_REQ_RUNNING)
        return;
    r->state = BS_REQ_DONE;
    r->t_end = td_now_ns();
    td_list_remove(&r->link);
    s->running--;
    s->n_done++;
    uint32_t out = r->have_usage ? r->usage_out : r->chunks;
    r->out = (bs_outcome_t){.ok = ok, .input_tokens = r->have_usage ? r->usage_in : r->item->input_len,
                            .output_tokens = out};
    if (ok) { /* no token chunk at all (an EOS first, text-less tokens): the first token is the end */
        r->out.ttft_ms = (double)((r->t_first ? r->t_first : r->t_end) - r->t_send) * 1e-6;
        r->out.e2el_ms = (double)(r->t_end - r->t_send) * 1e-6;
        r->out.tpot_ms = out > 1 ? (r->out.e2el_ms - r->out.ttft_ms) / (double)(out - 1) : 0;
    }
    if (s->in_run && !s->dispatching)
        bs_dispatch(s);
}

static void bs_on_arrive(uv_timer_t *t);

/* Moves the requests that have arrived to the waiting queue, starts what the concurrency
 * limit allows, and sets the timer for the next arrival. */
static void bs_dispatch(bs_state_t *s)
{
    s->dispatching = true; /* a verdict given while starting (a failed connect) does not recurse */
    double now_s = (double)(td_now_ns() - s->t0) * 1e-9;
    while (s->next_arrival < s->n_reqs && s->reqs[s->next_arrival].arrival_s <= now_s) {
        td_list_push_back(&s->waiting, &s->reqs[s->next_arrival].link);
        s->next_arrival++;
    }
    while (!td_list_empty(&s->waiting) && s->running < s->limit) {
        bs_req_t *r = TD_CONTAINER_OF(s->waiting.next, bs_req_t, link);
        td_list_remove(&r->link);
        bs_req_start(s, r);
    }
    if (s->next_arrival < s->n_reqs) {
        double wait_ms = (s->reqs[s->next_arrival].arrival_s - now_s) * 1e3;
        uv_timer_start(&s->arrive, bs_on_arrive, wait_ms > 0 ? (uint64_t)ceil(wait_ms) : 0, 0);
    }
    s->dispatching = false;
}

static void bs_on_arrive(uv_timer_t *t)
{
    bs_dispatch(t->data);
}

/* Fails the requests past their deadline (every wait has one). The expired ones are moved
 * to a list of their own first: ending one starts others, which join the running list. */
static void bs_on_tick(uv_timer_t *t)
{
    bs_state_t *s = t->data;
    uint64_t now = td_now_ns();
    td_list_t expired;
    td_list_init(&expired);
    for (td_list_t *n = s->active.next, *next; n != &s->active; n = next) {
        next = n->next;
        if (TD_CONTAINER_OF(n, bs_req_t, link)->deadline <= now) {
            td_list_remove(n);
            td_list_push_back(&expired, n);
        }
    }
    while (!td_list_empty(&expired)) {
        bs_req_t *r = TD_CONTAINER_OF(expired.next, bs_req_t, link);
        bs_req_fail(r, "no answer within --request-timeout-s %g", s->o.request_timeout_s);
        if (r->call)
            td_grpc_client_call_cancel(r->call); /* its on_done ends it */
        else if (r->conn)
            bench_http_conn_close(r->conn->h); /* likewise */
        bs_req_end(r, false);
        td_list_remove(&r->link);
    }
}

/* Runs `n` requests (d->items[(first + i) % d->n]) at `rate`; the results stay in *run. */
static td_status_t bs_run(bs_state_t *s, const bs_dataset_t *d, size_t first, size_t n, double rate, bool timed,
                          bs_rng_t *rng, bs_run_t *run)
{
    bs_req_t *reqs = calloc(n ? n : 1, sizeof *reqs);
    double *at = malloc((n ? n : 1) * sizeof *at);
    if (!reqs || !at) {
        free(reqs);
        free(at);
        return td_errorf(TD_ERR_NOMEM, "bench serve: out of memory for %zu requests", n);
    }
    if (timed)
        for (size_t i = 0; i < n; i++)
            at[i] = d->items[(first + i) % d->n].arrival_s;
    else
        bs_arrivals(rng, rate, s->o.burstiness, n, at);
    for (size_t i = 0; i < n; i++) {
        reqs[i] = (bs_req_t){.s = s, .item = &d->items[(first + i) % d->n], .arrival_s = at[i]};
        td_list_init(&reqs[i].link);
    }
    free(at);
    s->reqs = reqs;
    s->n_reqs = n;
    s->next_arrival = s->n_done = 0;
    s->running = s->max_running = 0;
    s->in_run = true;
    double cpu0 = bs_cpu_s();
    s->t0 = td_now_ns();
    bs_dispatch(s);
    while (s->n_done < n) /* the 50 ms tick bounds each wait */
        uv_run(&s->loop, UV_RUN_ONCE);
    s->in_run = false;
    uv_timer_stop(&s->arrive);
    uint64_t t_last = s->t0;
    for (size_t i = 0; i < n; i++)
        t_last = TD_MAX(t_last, reqs[i].t_end);
    *run = (bs_run_t){.rate = rate, .reqs = reqs, .n_reqs = n, .max_concurrency_seen = s->max_running,
                      .cpu_s = bs_cpu_s() - cpu0, .t0 = s->t0};
    s->reqs = NULL;
    s->n_reqs = 0;
    /* the figures */
    bs_outcome_t *o = malloc(n * sizeof *o + 1);
    double *v = malloc(n * sizeof *v + 1);
    size_t n_itl = 0;
    for (size_t i = 0; i < n; i++)
        n_itl += reqs[i].out.ok ? reqs[i].n_itl : 0;
    double *itl = malloc(n_itl * sizeof *itl + 1);
    if (!o || !v || !itl) {
        free(o);
        free(v);
        free(itl);
        return td_errorf(TD_ERR_NOMEM, "bench serve: out of memory for the figures");
    }
    for (size_t i = 0; i < n; i++)
        o[i] = reqs[i].out;
    bs_summarize(o, n, (double)(t_last - s->t0) * 1e-9, &s->o.slo, &run->sum);
    size_t k = 0, kt = 0;
    for (size_t i = 0; i < n; i++)
        if (o[i].ok)
            v[k++] = o[i].ttft_ms;
    bs_stat_of(v, k, &run->ttft);
    k = 0;
    for (size_t i = 0; i < n; i++)
        if (o[i].ok)
            v[k++] = o[i].e2el_ms;
    bs_stat_of(v, k, &run->e2el);
    for (size_t i = 0; i < n; i++)
        if (o[i].ok && o[i].output_tokens > 1) /* one token has no TPOT (vLLM leaves it out too) */
            v[kt++] = o[i].tpot_ms;
    bs_stat_of(v, kt, &run->tpot);
    k = 0;
    for (size_t i = 0; i < n; i++)
        if (reqs[i].out.ok)
            for (uint32_t j = 0; j < reqs[i].n_itl; j++)
                itl[k++] = reqs[i].itl[j];
    bs_stat_of(itl, k, &run->itl);
    free(o);
    free(v);
    free(itl);
    return TD_OK;
}

static void bs_run_free(bs_run_t *run)
{
    for (size_t i = 0; run->reqs && i < run->n_reqs; i++) {
        free(run->reqs[i].itl);
        free(run->reqs[i].error);
    }
    free(run->reqs);
    run->reqs = NULL;
}

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

static void bs_print_stat(const char *name, const char *unit_name, const bs_stat_t *st)
{
    char label[64];
    const char *what[] = {"Mean", "Std", "Median", "P90", "P99"};
    double vals[] = {st->mean, st->std, st->median, st->p90, st->p99};
    for (int i = 0; i < 5; i++) {
        snprintf(label, sizeof label, "%s %s (%s):", what[i], name, unit_name);
        bs_line_f(label, vals[i]);
    }
}

static void bs_print_run(const bs_state_t *s, const bs_run_t *r)
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
    bs_rule("Time to First Token", '-');
    bs_print_stat("TTFT", "ms", &r->ttft);
    bs_rule("Time per Output Token (excl. 1st token)", '-');
    bs_print_stat("TPOT", "ms", &r->tpot);
    bs_rule("Inter-token Latency", '-');
    bs_print_stat("ITL", "ms", &r->itl);
    bs_rule("End-to-end Latency", '-');
    bs_print_stat("E2EL", "ms", &r->e2el);
    bs_rule("", '=');
    for (size_t i = 0; i < r->n_reqs; i++)
        if (r->reqs[i].error) {
            printf("first error: %s\n", r->reqs[i].error);
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

static void bs_json_stat(cJSON *o, const char *name, const bs_stat_t *st)
{
    char key[64];
    const char *what[] = {"mean", "std", "median", "p90", "p99"};
    double vals[] = {st->mean, st->std, st->median, st->p90, st->p99};
    for (int i = 0; i < 5; i++) {
        snprintf(key, sizeof key, "%s_%s_ms", what[i], name);
        bs_json_num(o, key, vals[i], 3);
    }
}

/* A run's keys into o (the document itself for one run, as vLLM's result file, or an
 * entry of "runs" for a sweep). */
static void bs_json_run(const bs_state_t *s, const bs_run_t *r, cJSON *o)
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
    bs_json_num(o, "bench_cpu_us_per_request", r->n_reqs ? r->cpu_s / (double)r->n_reqs * 1e6 : NAN, 2);
    bs_json_stat(o, "ttft", &r->ttft);
    bs_json_stat(o, "tpot", &r->tpot);
    bs_json_stat(o, "itl", &r->itl);
    bs_json_stat(o, "e2el", &r->e2el);
    const char *first_error = NULL;
    for (size_t i = 0; i < r->n_reqs && !first_error; i++)
        first_error = r->reqs[i].error;
    if (first_error)
        cJSON_AddStringToObject(o, "first_error", first_error);
    else
        cJSON_AddNullToObject(o, "first_error");
    if (!s->o.save_detailed)
        return;
    cJSON *arr = cJSON_AddArrayToObject(o, "requests");
    for (size_t i = 0; arr && i < r->n_reqs; i++) {
        const bs_req_t *q = &r->reqs[i];
        cJSON *e = cJSON_CreateObject();
        if (!e)
            break;
        bs_json_num(e, "arrival_s", q->arrival_s, 6);
        bs_json_num(e, "start_s", q->t_send ? (double)(q->t_send - r->t0) * 1e-9 : NAN, 6);
        cJSON_AddBoolToObject(e, "ok", q->out.ok);
        cJSON_AddNumberToObject(e, "input_tokens", q->out.input_tokens);
        cJSON_AddNumberToObject(e, "output_tokens", q->out.output_tokens);
        cJSON_AddNumberToObject(e, "requested_output_tokens", q->item ? q->item->output_len : 0);
        bs_json_num(e, "ttft_ms", q->out.ok ? q->out.ttft_ms : NAN, 3);
        bs_json_num(e, "tpot_ms", q->out.ok ? q->out.tpot_ms : NAN, 3);
        bs_json_num(e, "e2el_ms", q->out.ok ? q->out.e2el_ms : NAN, 3);
        /* sent to ended, failed ones too (how fast a refusal came) */
        bs_json_num(e, "end_ms", q->t_send && q->t_end ? (double)(q->t_end - q->t_send) * 1e-6 : NAN, 3);
        cJSON *itl = cJSON_AddArrayToObject(e, "itl_ms");
        for (uint32_t j = 0; itl && j < q->n_itl; j++)
            cJSON_AddItemToArray(itl, cJSON_CreateNumber(round(q->itl[j] * 1e3) / 1e3));
        if (q->error)
            cJSON_AddStringToObject(e, "error", q->error);
        else
            cJSON_AddNullToObject(e, "error");
        cJSON_AddItemToArray(arr, e);
    }
}

static cJSON *bs_json_doc(const bs_state_t *s, const bs_run_t *runs, size_t n_runs, double best)
{
    cJSON *j = cJSON_CreateObject();
    if (!j)
        return NULL;
    cJSON_AddStringToObject(j, "bench", "serve");
    cJSON_AddStringToObject(j, "backend", s->o.openai ? "openai" : "grpc");
    cJSON_AddStringToObject(j, "target", s->o.openai ? s->o.openai : s->o.gateway);
    cJSON_AddStringToObject(j, "dataset", s->o.dataset);
    cJSON_AddBoolToObject(j, "ignore_eos", s->o.ignore_eos);
    cJSON_AddNumberToObject(j, "num_prompts", (double)s->o.num_prompts);
    cJSON_AddNumberToObject(j, "warmup_prompts", (double)s->o.warmup_prompts);
    bs_json_num(j, "burstiness", s->o.burstiness, 3);
    cJSON_AddNumberToObject(j, "max_concurrency", (double)s->o.max_concurrency);
    cJSON_AddNumberToObject(j, "seed", (double)s->o.seed);
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
    return bs_slo_parse(value, opt->ptr);
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
        return td_errorf(TD_ERR_INVALID, "--dataset: '%s' is not random, sharegpt or trace", value);
    *(const char **)opt->ptr = value;
    return TD_OK;
}

static td_status_t bs_parse_sweep(const td_opt_t *opt, const char *value)
{
    double *rates;
    size_t n;
    td_status_t st = bs_rates_parse(value, &rates, &n);
    if (st != TD_OK)
        return st;
    free(rates);
    *(const char **)opt->ptr = value;
    return TD_OK;
}

/* "http://HOST:PORT[/PATH]" → host, port, path ("/v1" when none) and the resolved address. */
static td_status_t bs_target_openai(bs_state_t *s)
{
    const char *u = s->o.openai;
    unsigned port = 80;
    if (strncmp(u, "http://", 7))
        return td_errorf(TD_ERR_INVALID, "--openai: '%s' is not http://HOST:PORT[/v1] (https is not supported)", u);
    u += 7;
    size_t hl = strcspn(u, ":/");
    if (!hl || hl >= sizeof s->host)
        return td_errorf(TD_ERR_INVALID, "--openai: no host in '%s'", s->o.openai);
    memcpy(s->host, u, hl);
    s->host[hl] = '\0';
    u += hl;
    if (*u == ':') {
        char *e;
        port = (unsigned)strtoul(u + 1, &e, 10);
        if (e == u + 1 || port == 0 || port > 65535 || (*e && *e != '/'))
            return td_errorf(TD_ERR_INVALID, "--openai: bad port in '%s'", s->o.openai);
        u = e;
    }
    s->port = (uint16_t)port;
    size_t pl = strlen(u);
    while (pl && u[pl - 1] == '/')
        pl--;
    if (pl >= sizeof s->path - 4)
        return td_errorf(TD_ERR_INVALID, "--openai: path too long in '%s'", s->o.openai);
    snprintf(s->path, sizeof s->path, "%.*s", (int)pl, u);
    if (!pl)
        snprintf(s->path, sizeof s->path, "/v1");
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char ps[8];
    snprintf(ps, sizeof ps, "%u", port);
    int rc = getaddrinfo(s->host, ps, &hints, &ai);
    if (rc || !ai)
        return td_errorf(TD_ERR_INVALID, "--openai: cannot resolve '%s': %s", s->host, gai_strerror(rc));
    memcpy(&s->addr, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    return TD_OK;
}

static td_status_t bs_load_dataset(bs_state_t *s, size_t n, bs_rng_t *rng)
{
    const bs_opts_t *o = &s->o;
    if (!strcmp(o->dataset, "random"))
        return bs_dataset_random(rng, n, (uint32_t)o->input_len, (uint32_t)o->output_len, o->range_ratio, &s->data);
    if (!o->dataset_path)
        return td_errorf(TD_ERR_INVALID, "--dataset %s needs --dataset-path FILE", o->dataset);
    char *text = NULL;
    size_t len = 0;
    td_status_t st = td_file_read_all(o->dataset_path, (size_t)4 << 30, &text, &len);
    if (st != TD_OK)
        return st;
    if (!strcmp(o->dataset, "trace")) {
        st = bs_dataset_trace_parse(text, len, o->dataset_path, n, rng, &s->data);
    } else {
        td_tokenizer_t *tok = NULL;
        if (o->tokenizer && (st = td_tokenizer_load(o->tokenizer, &tok)) != TD_OK) {
            free(text);
            return st;
        }
        st = bs_dataset_sharegpt_parse(text, len, o->dataset_path, tok, (uint32_t)o->sharegpt_output_len, n, rng,
                                       &s->data);
        td_tokenizer_destroy(tok);
    }
    free(text);
    return st;
}

static void bs_close_all(bs_state_t *s)
{
    while (!td_list_empty(&s->idle_conns)) {
        bs_conn_t *c = TD_CONTAINER_OF(s->idle_conns.next, bs_conn_t, link);
        td_list_remove(&c->link);
        bench_http_conn_close(c->h);
    }
    for (int i = 0; i < s->n_gw; i++)
        td_grpc_channel_close(s->gw[i], NULL, NULL);
    uv_close((uv_handle_t *)&s->arrive, NULL);
    uv_close((uv_handle_t *)&s->tick, NULL);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&s->loop) != 0)
        td_warn("bench serve: loop closed with handles open");
    free(s->gw);
    s->gw = NULL;
    s->n_gw = 0;
}

/* --openai or --gateway (exactly one) into the target's host, port, path and address; `prog`
 * names the command in the message. */
static td_status_t bs_target_parse(bs_state_t *s, const char *prog)
{
    const bs_opts_t *o = &s->o;
    if (!o->openai == !o->gateway)
        return td_errorf(TD_ERR_INVALID, "%s: give one of --openai URL or --gateway HOST:PORT", prog);
    if (o->openai)
        return bs_target_openai(s);
    if (sscanf(o->gateway, "%255[^:]:%hu", s->host, &s->port) != 2 || !s->port)
        return td_errorf(TD_ERR_INVALID, "--gateway: '%s' is not HOST:PORT", o->gateway);
    return TD_OK;
}

/* The loop, its arrival timer and deadline tick, and the gRPC channels of --gateway. On an
 * error what was made is still closed by bs_close_all. */
static td_status_t bs_open(bs_state_t *s)
{
    uv_loop_init(&s->loop);
    td_list_init(&s->waiting);
    td_list_init(&s->active);
    td_list_init(&s->idle_conns);
    uv_timer_init(&s->loop, &s->arrive);
    uv_timer_init(&s->loop, &s->tick);
    s->arrive.data = s->tick.data = s;
    uv_timer_start(&s->tick, bs_on_tick, BS_TICK_MS, BS_TICK_MS);
    if (!s->o.gateway)
        return TD_OK;
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    if (!(s->gw = calloc((size_t)s->o.connections, sizeof *s->gw)))
        return td_errorf(TD_ERR_NOMEM, "bench serve: out of memory for %lld channels", (long long)s->o.connections);
    for (; s->n_gw < s->o.connections; s->n_gw++) {
        td_status_t st = td_grpc_channel_create(&s->loop, s->host, s->port, &cc, &s->gw[s->n_gw]);
        if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

static const char bs_usage[] =
    "usage: tandem bench serve (--openai URL | --gateway HOST:PORT) [options]\n"
    "\n"
    "A load generator against a running cluster (issue 16; vLLM's `bench serve`): streamed\n"
    "generations arriving as a Poisson (or gamma, --burstiness) process of --request-rate,\n"
    "at most --max-concurrency in flight; prints vLLM's summary (Successful requests,\n"
    "Benchmark duration, Total input/generated tokens, throughputs, Request goodput, SLO\n"
    "attainment, TTFT / TPOT / ITL / E2EL mean, std, median, p90, p99). --goodput \"ttft:MS\n"
    "tpot:MS e2el:MS\": DistServe's goodput (completed requests/s meeting every objective).\n"
    "--sweep R1,R2,.. or START:STOP:STEP: one run per rate, then the highest rate whose SLO\n"
    "attainment is >= --sweep-attainment. The random and trace datasets send ignore_eos\n"
    "(vLLM's): every request generates its max_tokens (--no-ignore-eos: it may end at EOS;\n"
    "sharegpt's default). Keys in docs/bench.md.\n\n";

int bench_serve(int argc, char **argv)
{
    bs_state_t *s = calloc(1, sizeof *s);
    if (!s) {
        fprintf(stderr, "tandem bench serve: out of memory\n");
        return 1;
    }
    s->o = (bs_opts_t){.dataset = "random", .input_len = 1024, .output_len = 128, .vocab_size = 256,
                       .request_rate = INFINITY, .burstiness = 1, .max_connections = 1000, .connections = 4,
                       .num_prompts = 1000, .request_timeout_s = 300, .sweep_attainment = 0.9f};
    bs_opts_t *o = &s->o;
    const td_opt_t opts[] = {
        {.name = "openai", .type = TD_OPT_STR, .ptr = &o->openai, .arg = "URL",
         .help = "the router's OpenAI API (http://HOST:PORT/v1): streamed POST /v1/completions"},
        {.name = "gateway", .type = TD_OPT_STR, .ptr = &o->gateway, .arg = "HOST:PORT",
         .help = "the router's gRPC gateway: tandem.v1.Generation/Generate streams"},
        {.name = "model", .type = TD_OPT_STR, .ptr = &o->model, .arg = "NAME", .help = "model name sent (default: none, the served one)"},
        {.name = "api-key", .type = TD_OPT_STR, .ptr = &o->api_key, .arg = "KEY", .help = "sent as Authorization: Bearer KEY"},
        {.name = "dataset", .type = TD_OPT_FN, .ptr = &o->dataset, .parse = bs_parse_dataset, .arg = "NAME",
         .help = "random (default), sharegpt or trace"},
        {.name = "dataset-path", .type = TD_OPT_STR, .ptr = &o->dataset_path, .arg = "FILE",
         .help = "ShareGPT JSON, or a trace (JSONL or CSV: arrival_s, input_len, output_len)"},
        {.name = "input-len", .type = TD_OPT_I64, .ptr = &o->input_len, .min = 1, .max = 1 << 20, .arg = "N",
         .help = "random: prompt tokens (default 1024)"},
        {.name = "output-len", .type = TD_OPT_I64, .ptr = &o->output_len, .min = 1, .max = 1 << 20, .arg = "N",
         .help = "random: max_tokens (default 128)"},
        {.name = "range-ratio", .type = TD_OPT_F32, .ptr = &o->range_ratio, .fmin = 0, .fmax = 0.999f, .arg = "R",
         .help = "random: lengths uniform in [len*(1-R), len*(1+R)] (default 0)"},
        {.name = "vocab-size", .type = TD_OPT_I64, .ptr = &o->vocab_size, .min = 2, .max = 1 << 24, .arg = "V",
         .help = "random and trace prompts: ids drawn from [1, V) (default 256; the model's vocabulary or less)"},
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &o->tokenizer, .arg = "PATH",
         .help = "sharegpt: count the gpt turn's tokens with this tokenizer (else bytes/4)"},
        {.name = "sharegpt-output-len", .type = TD_OPT_I64, .ptr = &o->sharegpt_output_len, .min = 0, .max = 1 << 20,
         .arg = "N", .help = "sharegpt: max_tokens of every request instead of the gpt turn's length"},
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
        {.name = "num-prompts", .type = TD_OPT_I64, .ptr = &o->num_prompts, .min = 1, .max = 10000000, .arg = "N",
         .help = "requests measured per run (default 1000; a trace: its rows, at most this)"},
        {.name = "warmup-prompts", .type = TD_OPT_I64, .ptr = &o->warmup_prompts, .min = 0, .max = 1000000,
         .arg = "N", .help = "requests sent first, all at once within --max-concurrency, not counted (default 0)"},
        {.name = "seed", .type = TD_OPT_I64, .ptr = &o->seed, .min = 0, .max = INT64_MAX, .arg = "N",
         .help = "dataset and arrivals (default 0)"},
        {.name = "request-timeout-s", .type = TD_OPT_F32, .ptr = &o->request_timeout_s, .fmin = 0.01f, .fmax = 86400,
         .arg = "S", .help = "a request not ended within this fails (default 300)"},
        {.name = "goodput", .type = TD_OPT_FN, .ptr = &o->slo, .parse = bs_parse_goodput, .arg = "KEY:MS",
         .help = "objectives \"ttft:MS tpot:MS e2el:MS\" (any of them; repeatable)"},
        {.name = "sweep", .type = TD_OPT_FN, .ptr = &o->sweep, .parse = bs_parse_sweep, .arg = "RATES",
         .help = "R1,R2,... or START:STOP:STEP: one run per rate"},
        {.name = "sweep-attainment", .type = TD_OPT_F32, .ptr = &o->sweep_attainment, .fmin = 0.01f, .fmax = 1,
         .arg = "F", .help = "the attainment a swept rate must keep (default 0.9)"},
        {.name = "result-file", .type = TD_OPT_STR, .ptr = &o->result_file, .arg = "FILE",
         .help = "write the JSON result there"},
        {.name = "save-detailed", .type = TD_OPT_BOOL, .ptr = &o->save_detailed,
         .help = "the JSON carries every request (times, tokens, ITLs, error)"},
        {.name = "ignore-eos", .type = TD_OPT_BOOL, .ptr = &o->ignore_eos_flag,
         .help = "send ignore_eos: output lengths as asked (default with random and trace)"},
        {.name = "no-ignore-eos", .type = TD_OPT_BOOL, .ptr = &o->no_ignore_eos,
         .help = "do not send ignore_eos: a request may end at EOS (default with sharegpt)"},
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &o->json, .help = "the JSON result on stdout instead of the summary"},
    };
    td_opts_t spec = {.prog = "bench serve", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t ro = {0};
    if (td_opts_parse(&spec, argc, argv, &ro) != TD_OK) {
        td_opts_result_free(&ro);
        free(s);
        return 2;
    }
    if (ro.help) {
        fputs(bs_usage, stdout);
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        td_opts_result_free(&ro);
        free(s);
        return 0;
    }
    td_status_t bad = bs_target_parse(s, "bench serve");
    if (bad == TD_OK && o->ignore_eos_flag && o->no_ignore_eos)
        bad = td_errorf(TD_ERR_INVALID, "bench serve: give --ignore-eos or --no-ignore-eos, not both");
    o->ignore_eos = o->ignore_eos_flag || (!o->no_ignore_eos && strcmp(o->dataset, "sharegpt"));
    if (bad == TD_OK && strcmp(o->dataset, "random") && !o->dataset_path)
        bad = td_errorf(TD_ERR_INVALID, "--dataset %s: needs --dataset-path FILE", o->dataset);
    if (bad == TD_OK && o->sweep && !strcmp(o->dataset, "trace"))
        bad = td_errorf(TD_ERR_INVALID, "--sweep: a trace gives its own arrival times; sweep the random or sharegpt "
                        "dataset");
    if (bad != TD_OK) {
        td_opts_result_free(&ro);
        free(s);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    int rc = 1;
    double *rates = NULL;
    size_t n_rates = 1;
    bs_run_t *runs = NULL;
    bs_rng_t rng;
    bs_rng_seed(&rng, (uint64_t)o->seed);
    if (o->sweep) {
        if (bs_rates_parse(o->sweep, &rates, &n_rates) != TD_OK)
            goto err_opts;
    } else if (!(rates = malloc(sizeof *rates))) {
        goto err_opts;
    } else {
        rates[0] = o->request_rate;
    }
    size_t n_measured = (size_t)o->num_prompts;
    /* random: a sweep gives every rate prompts of its own (slice i of the dataset), so that a
       server's prefix cache never serves a rate the prompts an earlier rate sent */
    bool fresh = !strcmp(o->dataset, "random");
    if (bs_load_dataset(s, fresh ? n_measured * n_rates + (size_t)o->warmup_prompts : n_measured, &rng) != TD_OK)
        goto err_opts;
    if (s->data.timed)
        n_measured = s->data.n;
    s->vocab = (uint32_t)o->vocab_size;
    if (o->model) {
        cJSON *m = cJSON_CreateString(o->model);
        s->model_json = m ? cJSON_PrintUnformatted(m) : NULL;
        cJSON_Delete(m);
        if (!s->model_json)
            goto err_data;
    }
    s->limit = o->max_concurrency ? o->max_concurrency : INT64_MAX;
    if (o->openai)
        s->limit = TD_MIN(s->limit, o->max_connections);
    if (!(runs = calloc(n_rates, sizeof *runs)))
        goto err_data;
    if (bs_open(s) != TD_OK)
        goto err_loop;
    /* warm-up: the dataset's last requests (random: extra ones), all at once, not counted */
    if (o->warmup_prompts) {
        bs_run_t w;
        size_t first = s->data.n > (size_t)o->warmup_prompts ? s->data.n - (size_t)o->warmup_prompts : 0;
        if (!o->json)
            fprintf(stderr, "bench serve: warm-up, %lld requests\n", (long long)o->warmup_prompts);
        if (bs_run(s, &s->data, first, (size_t)o->warmup_prompts, INFINITY, false, &rng, &w) != TD_OK)
            goto err_loop;
        if (w.sum.failed)
            fprintf(stderr, "bench serve: %llu of the warm-up requests failed (first: %s)\n",
                    (unsigned long long)w.sum.failed, w.reqs[0].error ? w.reqs[0].error : "see the summary");
        bs_run_free(&w);
    }
    double *attain = calloc(n_rates, sizeof *attain);
    if (!attain)
        goto err_loop;
    bool any_ok = false;
    for (size_t i = 0; i < n_rates; i++) {
        if (!o->json && !s->data.timed)
            fprintf(stderr, "bench serve: %zu requests at %.3g requests/s%s\n", n_measured, rates[i],
                    o->max_concurrency ? ", concurrency-limited" : "");
        if (bs_run(s, &s->data, fresh ? i * n_measured : 0, n_measured, rates[i], s->data.timed, &rng, &runs[i]) != TD_OK) {
            free(attain);
            goto err_loop;
        }
        attain[i] = runs[i].sum.slo_attainment;
        any_ok |= runs[i].sum.completed > 0;
        if (!o->json)
            bs_print_run(s, &runs[i]);
    }
    double best = bs_sweep_best(rates, attain, n_rates, o->sweep_attainment);
    free(attain);
    if (o->sweep && !o->json) {
        printf("%-12s %-12s %-12s %-12s %-12s %-12s\n", "rate", "req/s", "goodput", "attainment", "p99 TTFT ms",
               "p99 TPOT ms");
        for (size_t i = 0; i < n_rates; i++)
            printf("%-12.3g %-12.2f %-12.2f %-12.3f %-12.2f %-12.2f\n", runs[i].rate, runs[i].sum.request_throughput,
                   runs[i].sum.request_goodput, runs[i].sum.slo_attainment, runs[i].ttft.p99, runs[i].tpot.p99);
        if (isnan(best))
            printf("%-40s %s\n", "Highest rate meeting SLO attainment:", "none");
        else
            printf("%-40s %-10.3g (attainment >= %.0f%%)\n", "Highest rate meeting SLO attainment:", best,
                   o->sweep_attainment * 100);
    }
    rc = any_ok ? 0 : 1;
    if (!any_ok)
        fprintf(stderr, "tandem bench serve: no request completed (first error in the summary)\n");
    if (o->result_file || o->json) {
        if (o->result_file) {
            FILE *f = fopen(o->result_file, "w");
            if (!f || bench_json_print(f, bs_json_doc(s, runs, n_rates, best)) != 0) {
                td_errorf(TD_ERR_IO, "bench serve: cannot write %s: %s", o->result_file, strerror(errno));
                rc = 1;
            }
            if (f && fclose(f) != 0)
                rc = 1;
        }
        if (o->json && bench_json_print(stdout, bs_json_doc(s, runs, n_rates, best)) != 0)
            rc = 1;
    }
err_loop:
    bs_close_all(s);
    for (size_t i = 0; runs && i < n_rates; i++)
        bs_run_free(&runs[i]);
    free(runs);
err_data:
    cJSON_free(s->model_json);
    bs_dataset_free(&s->data);
err_opts:
    free(rates);
    td_opts_result_free(&ro);
    free(s);
    return rc;
}

/* ---- the load generator as a library (bench_serve_client.h) ----------------------------------- */

struct bs_client {
    bs_state_t s;
};

bs_client_config_t bs_client_config_default(void)
{
    return (bs_client_config_t){.vocab = 256, .ignore_eos = true, .request_timeout_s = 300, .connections = 4};
}

td_status_t bs_client_create(const bs_client_config_t *cfg, const char *prog, bs_client_t **c_p)
{
    bs_client_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_errorf(TD_ERR_NOMEM, "%s: out of memory", prog);
    bs_state_t *s = &c->s;
    s->o = (bs_opts_t){.openai = cfg->openai, .gateway = cfg->gateway, .model = cfg->model,
                       .api_key = cfg->api_key, .burstiness = 1, .request_timeout_s = (float)cfg->request_timeout_s,
                       .connections = TD_MAX(cfg->connections, 1), .max_connections = 1000,
                       .ignore_eos = cfg->ignore_eos};
    s->vocab = TD_MAX(cfg->vocab, 2u);
    td_status_t st = bs_target_parse(s, prog);
    if (st == TD_OK && cfg->model) {
        cJSON *m = cJSON_CreateString(cfg->model);
        s->model_json = m ? cJSON_PrintUnformatted(m) : NULL;
        cJSON_Delete(m);
        if (!s->model_json)
            st = td_errorf(TD_ERR_NOMEM, "%s: out of memory", prog);
    }
    if (st != TD_OK) {
        cJSON_free(s->model_json);
        free(c);
        return st;
    }
    if ((st = bs_open(s)) != TD_OK) {
        bs_client_destroy(c);
        return st;
    }
    *c_p = c;
    return TD_OK;
}

td_status_t bs_client_run(bs_client_t *c, const bs_item_t *items, size_t n, int64_t max_concurrency,
                          bs_replies_t *out_p)
{
    bs_state_t *s = &c->s;
    bs_dataset_t d = {.items = (bs_item_t *)items, .n = n};
    bs_run_t *run = calloc(1, sizeof *run);
    bs_reply_t *r = calloc(n ? n : 1, sizeof *r);
    if (!run || !r) {
        free(run), free(r);
        return td_errorf(TD_ERR_NOMEM, "bench serve: out of memory for %zu replies", n);
    }
    bs_rng_t rng; /* arrivals at an infinite rate draw nothing */
    bs_rng_seed(&rng, 0);
    s->limit = TD_MAX(max_concurrency, 1);
    td_status_t st = bs_run(s, &d, 0, n, INFINITY, false, &rng, run);
    if (st != TD_OK) {
        bs_run_free(run);
        free(run), free(r);
        return st;
    }
    for (size_t i = 0; i < n; i++) {
        const bs_req_t *q = &run->reqs[i];
        r[i] = (bs_reply_t){.ok = q->out.ok, .error = q->error, .output_tokens = q->out.output_tokens,
                            .start_ms = q->t_send ? (double)(q->t_send - run->t0) * 1e-6 : 0,
                            .ttft_ms = q->out.ttft_ms, .e2el_ms = q->out.e2el_ms, .itl_ms = q->itl,
                            .n_itl = q->n_itl};
    }
    *out_p = (bs_replies_t){.r = r, .n = n, .run = run};
    return TD_OK;
}

void bs_replies_free(bs_replies_t *r)
{
    if (!r)
        return;
    if (r->run)
        bs_run_free(r->run);
    free(r->run);
    free(r->r);
    *r = (bs_replies_t){0};
}

void bs_client_destroy(bs_client_t *c)
{
    if (!c)
        return;
    bs_close_all(&c->s);
    cJSON_free(c->s.model_json);
    free(c);
}
